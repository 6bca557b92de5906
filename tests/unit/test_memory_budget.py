"""A load that cannot fit the memory budget is refused before its first tensor, naming the sizes.

The budget is a real limit, lowered in a subprocess: ``RLIMIT_AS`` set to
the address space in use plus a headroom (``preload.budget.memory_budget``
counts it beside MemAvailable and the memory cgroup). The checkpoint is
sparse (8 shards of 16 MiB that take no disk): its headers are real, its
data zeros. With 64 MiB of headroom the raw stage's 128 MiB arena is refused
once the headers are read, before any shard's data is opened (an audit hook
counts the opens: one per shard, for its header), and the launcher's
preflight refuses it from the shards' sizes alone; with 512 MiB it loads.
"""

from __future__ import annotations

import json
import os
import struct

import pytest
from fd_limit_support import PRELUDE, run_child

pytestmark = pytest.mark.unit

SHARDS, SHARD_BYTES = 8, 16 << 20

CHILD = PRELUDE + r"""
import psutil
from preload.daemon import raw
from preload.preflight import check_raw_memory
from preload.transports import get_transport
ckpt, where, headroom = sys.argv[1], sys.argv[2], int(sys.argv[3])
transport = get_transport("shm")
vms = psutil.Process().memory_info().vms
resource.setrlimit(resource.RLIMIT_AS, (vms + headroom, resource.RLIM_INFINITY))
try:
    if where == "preflight":
        check_raw_memory(ckpt, local_ranks=1)
        report(ok=True)
    else:
        filled = raw.fill_raw(ckpt, transport, None)
        report(ok=True, bytes=filled.layout.total_bytes)
except Exception as exc:
    report(ok=False, error=str(exc), type=type(exc).__name__)
"""


@pytest.fixture(scope="module")
def sparse(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("sparse") / "ckpt"
    ckpt.mkdir()
    weight_map = {}
    for k in range(SHARDS):
        name = f"model-{k + 1:05d}-of-{SHARDS:05d}.safetensors"
        tensor = f"model.layers.{k}.weight"
        header = json.dumps({tensor: {"dtype": "U8", "shape": [SHARD_BYTES], "data_offsets": [0, SHARD_BYTES]}})
        header += " " * (-len(header) % 8)
        with open(ckpt / name, "wb") as f:
            f.write(struct.pack("<Q", len(header)) + header.encode())
            f.truncate(8 + len(header) + SHARD_BYTES)  # a hole: zeros, no disk
        weight_map[tensor] = name
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (ckpt / "config.json").write_text(json.dumps({"architectures": ["SyntheticForBench"]}))
    return ckpt


@pytest.mark.parametrize("where", ["fill", "preflight"])
def test_refused_before_the_first_tensor_naming_the_sizes(sparse, where):
    got, _ = run_child(CHILD, sparse, where, 64 << 20)
    assert not got["ok"] and got["type"] == "PreflightError", got
    for word in ("not enough memory", "128.0 MiB" if where == "fill" else "8 shards", "RLIMIT_AS", "ulimit -v"):
        assert word in got["error"], (word, got)
    # Headers only (the raw stage reads each header once), never a shard's data.
    assert got["shard_opens"] == (SHARDS if where == "fill" else 0), got


@pytest.mark.parametrize("where", ["fill", "preflight"])
def test_control_loads_with_room(sparse, where):
    got, _ = run_child(CHILD, sparse, where, 512 << 20)
    assert got["ok"], got
    if where == "fill":
        assert got["bytes"] >= SHARDS * SHARD_BYTES and got["shard_opens"] == 2 * SHARDS


def test_the_sparse_shards_take_no_disk(sparse):
    assert sum(os.stat(p).st_blocks for p in sparse.glob("*.safetensors")) * 512 < SHARD_BYTES
