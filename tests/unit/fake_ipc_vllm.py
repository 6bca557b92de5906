"""Stand-ins for vLLM 0.33 at the public boundary of its ``ipc_cache``: the
``vllm preload`` command and an engine process, for the unit test of the
ipc_cache target on a machine without CUDA.

- ``python -m fake_ipc_vllm preload --model BASE --weight-cache-socket-dir D ...``
  records vLLM's header-only key of BASE in D (the upstream rule,
  ``hash_checkpoint``, through our labelled reimplementation), logs the
  daemon's READY line and waits.
- ``python -m fake_ipc_vllm SPEC OUT`` is an engine: for ``ipc_cache`` it
  logs ``Mapped N tensors ...`` when the checkpoint's key equals the
  daemon's, and serves the daemon's content; otherwise it logs vLLM's
  fallback line and serves its own. Its "tokens" are a function of the
  content digest it served, so equal content gives equal tokens.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def _key(ckpt: str) -> str:
    from preload.identity.anchors import fingerprint

    return fingerprint("header_only", ckpt, implementation="reimpl").hex


def _tokens(digest: str) -> list[list[int]]:
    return [[int(digest[i : i + 4], 16) % 1000 for i in range(0, 16, 4)] for _ in range(2)]


def preload(argv: list[str]) -> None:
    model = argv[argv.index("--model") + 1]
    sockets = Path(argv[argv.index("--weight-cache-socket-dir") + 1])
    from pgbase.shards import shard_paths
    from preload.identity.digest import checkpoint_digest, hash_shards

    digest = checkpoint_digest(hash_shards(shard_paths(model), progress=False))
    (sockets / "daemon.json").write_text(json.dumps({"key": _key(model), "digest": digest}))
    print("INFO ===== Weight cache daemon READY: node 0/1 serving 1 local rank(s) x 1 role(s) =====", flush=True)
    time.sleep(600)


def engine(spec_path: str, out_path: str) -> None:
    from pgbase.shards import shard_paths
    from preload.identity.digest import checkpoint_digest, hash_shards

    spec = json.loads(Path(spec_path).read_text())
    own = checkpoint_digest(hash_shards(shard_paths(spec["checkpoint"]), progress=False))
    served = own
    if spec["load_format"] == "ipc_cache":
        daemon = json.loads((Path(spec["extra_config"]["socket_dir"]) / "daemon.json").read_text())
        if daemon["key"] == _key(spec["checkpoint"]):
            print("INFO Mapped 25 tensors from the weight cache daemon (zero_copy mode)", flush=True)
            served = daemon["digest"]
        else:
            print("WARNING Weight cache unusable (checkpoint fingerprint differs); falling back to disk loading",
                  flush=True)
    tokens = _tokens(served)
    Path(out_path).write_text(json.dumps({
        "ok": True, "token_ids": tokens, "texts": [f"served {served[:8]}"] * len(tokens),
        "logprobs": [[{str(t): -0.5} for t in row] for row in tokens],
        "marks": {"imported": 0.1, "ready": 0.2, "first_token": 0.3, "done": 0.4}, "vllm_version": "0.33.0",
    }))


if __name__ == "__main__":
    if sys.argv[1] == "preload":
        preload(sys.argv[2:])
    else:
        engine(sys.argv[1], sys.argv[2])
