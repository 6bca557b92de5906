"""Moved: the shard set and headers live in :mod:`pgbase.shards` (every layer
shares them). This name stays for code written against it (operators' scripts
import ``preload.identity.shards.shard_paths``); it warns and re-exports.
"""

from __future__ import annotations

import warnings

from pgbase.shards import (
    INDEX_NAME,
    MAX_HEADER_BYTES,
    ShardHeader,
    TensorInfo,
    check_unique_tensors,
    read_header,
    shard_paths,
)

warnings.warn("preload.identity.shards moved to pgbase.shards; import it from there",
              DeprecationWarning, stacklevel=2)

__all__ = ["INDEX_NAME", "MAX_HEADER_BYTES", "ShardHeader", "TensorInfo", "check_unique_tensors", "read_header",
           "shard_paths"]
