"""How many device bytes an engine's weights will be mapped from a daemon
(vLLM's ``get_external_weight_memory``), asked before the engine's start-up
memory check."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from pgbase.errors import PreloadGateError
from preload.client import DaemonClient
from preload.events import LoadEvent
from preload.loader.misses import Miss, resolve
from preload.loader.options import LoaderOptions
from preload.loader.ranks import global_rank_of, rank_info
from preload.sockets import socket_dir

log = logging.getLogger("preload.loader")


def daemon_device_bytes(opts: LoaderOptions, vllm_config: Any) -> int:
    """The arena bytes a zero_copy engine on a GPU will map from the daemon
    serving its content digest; 0 in copy mode, on CPU (shared file memory,
    not device memory), or where no daemon answers for that digest (a disk
    load follows, whose event says why). One hello and one ``get_memory``;
    no key is checked here (a key mismatch would count as a miss twice)."""
    if opts.mode != "zero_copy" or str(vllm_config.device_config.device_type or "cpu") == "cpu":
        return 0
    if opts.unsafe_uncounted_memory:
        log.warning("UNSAFE: unsafe_uncounted_memory: the daemon's weights are not counted in this engine's budget")
        return 0
    scratch = LoadEvent(outcome="error", reason="memory query")
    try:
        digest = resolve(opts, vllm_config.model_config.model, scratch)
        global_rank, _dp = global_rank_of(vllm_config, rank_info())
        sdir = Path(opts.socket_dir) if opts.socket_dir else socket_dir(digest, opts.socket_root)
        client = DaemonClient.connect(sdir, global_rank, opts.connect_timeout_s,
                                      opts.state_timeout_s, client=f"vllm-rank{global_rank}-memory")
    except (Miss, PreloadGateError, OSError) as exc:
        log.info("preload-gate: no daemon weights to count in this engine's memory budget (%s)", exc)
        return 0
    try:
        if client.hello.get("digest") != digest:
            return 0  # other content: this engine will load from disk
        held = client.get_memory()
    except (PreloadGateError, OSError) as exc:
        log.info("preload-gate: the daemon in %s did not say its memory (%s); counting none", sdir, exc)
        return 0
    finally:
        client.close()
    log.info("preload-gate: %d bytes of this engine's weights are held by the daemon in %s (counted once)",
             held, sdir)
    return held
