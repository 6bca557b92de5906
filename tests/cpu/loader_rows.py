"""Drive the real ``verified_cache`` loader through failure rows, in one process.

``python loader_rows.py SPEC.json OUT.json``. For each row: a fresh vLLM
``VllmConfig`` (EngineArgs -> create_engine_config, as an engine builds it,
load format ``verified_cache``), the loader vLLM's own ``get_model_loader``
returns for it, and ``load_model`` called exactly as vLLM's CPU worker calls
it, inside a real (world size 1, gloo) vLLM distributed group. The row's
failure is injected first; what comes back is recorded: the model (and
whether its weights equal the checkpoint's) or the exception, the events
file, the ``preload-gate load:`` log lines, and the process's descriptors
and arena mappings before and after.

Rows run in one process because every row fails (or loads) before vLLM
builds anything beyond the model: KV cache, warm-up and the scheduler, which
a full engine start would add, play no part in any of these paths.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from pgbase.ports import free_port


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if msg.startswith("preload-gate load:"):
            self.lines.append(msg)


def _arena_maps() -> int:
    with open("/proc/self/maps", encoding="utf-8") as f:
        return sum(1 for line in f if "memfd:preload-gate" in line)


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))




def _weights_equal(model: Any, ckpt: str) -> bool:
    """Every checkpoint tensor the model has under the same name equals it."""
    import torch
    from safetensors.torch import load_file

    params = dict(model.named_parameters())
    same = 0
    for shard in sorted(Path(ckpt).glob("*.safetensors")):
        for name, t in load_file(str(shard)).items():
            if name in params and params[name].shape == t.shape:
                if not torch.equal(params[name].detach().to(t.dtype), t):
                    return False
                same += 1
    return same > 0


def run_row(row: dict[str, Any], handler: _Lines) -> dict[str, Any]:
    import dataclasses

    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model_loader

    import preload.client
    import preload.loader.resident

    for k, v in row.get("env", {}).items():
        os.environ[k] = v
    for k in row.get("unset_env", []):
        os.environ.pop(k, None)
    args = EngineArgs(model=row["model"], load_format="verified_cache", dtype="bfloat16", max_model_len=128,
                      enforce_eager=True, model_loader_extra_config=row["extra"])
    vllm_config = args.create_engine_config()
    inject = row.get("inject")
    restore: list[tuple[Any, str, Any]] = []

    def patch(obj: Any, name: str, value: Any) -> None:
        restore.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    if inject == "release_fails":
        def release(self: Any) -> None:
            from pgbase.errors import WeightCacheUnavailableError

            raise WeightCacheUnavailableError(f"daemon at {self.path} dropped the connection")
        patch(preload.client.DaemonClient, "release", release)
    elif inject == "attach_fails":
        def verify(tensors: Any, state: Any) -> None:
            from pgbase.errors import WeightCacheUnavailableError

            raise WeightCacheUnavailableError(f"resident checksum mismatch on {sorted(tensors)[0]}")
        patch(preload.loader.resident, "verify_attached", verify)
        patch(preload.loader.resident, "should_verify", lambda opts, state: True)
    elif inject == "config_unreadable":
        # vLLM read config.json when it built its config; the file is then
        # broken before the load (an edit mid-start, a bad sync).
        Path(row["model"], "config.json").write_text("{ not json")
    elif inject == "disk_fails":
        for shard in Path(row["model"]).glob("*.safetensors"):
            shard.write_bytes(shard.read_bytes()[:64])
    handler.lines.clear()
    events = row["extra"].get("events_file")
    before = {"fds": _fds(), "maps": _arena_maps()}
    out: dict[str, Any] = {"name": row["name"]}
    model = None
    try:
        with set_current_vllm_config(vllm_config):
            loader = get_model_loader(vllm_config.load_config)
            model = loader.load_model(vllm_config=vllm_config, model_config=vllm_config.model_config)
        out["result"] = "model"
        out["weights_equal"] = _weights_equal(model, row["model"]) if row.get("check_weights") else None
    except BaseException as exc:  # noqa: BLE001 - the row records whatever the loader raised
        out["result"] = "raised"
        out["error_type"] = type(exc).__name__
        out["error"] = str(exc)
    finally:
        for obj, name, value in reversed(restore):
            setattr(obj, name, value)
    if model is not None:
        del model
    loader = None  # noqa: F841 - a zero-copy loader keeps its attachment
    import gc

    gc.collect()
    out["before"], out["after"] = before, {"fds": _fds(), "maps": _arena_maps()}
    out["log_events"] = [json.loads(line.split(":", 1)[1]) for line in handler.lines]
    out["file_events"] = []
    if events and os.path.exists(events):
        with open(events, encoding="utf-8") as f:
            out["file_events"] = [json.loads(line) for line in f if line.strip()]
    _ = dataclasses
    return out


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    handler = _Lines()
    logging.getLogger("preload.load").addHandler(handler)
    logging.getLogger("preload.load").setLevel(logging.INFO)
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment

    import preload.loader

    preload.loader.register()
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs

    # What vLLM's CPU model runner does at start (its own function).
    from vllm.v1.worker.cpu_model_runner import _set_torch_accelerator_to_noop

    _set_torch_accelerator_to_noop()
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method=f"tcp://127.0.0.1:{free_port()}")
    group_config = EngineArgs(model=spec["rows"][0]["model"], max_model_len=128,
                              enforce_eager=True).create_engine_config()
    with set_current_vllm_config(group_config):
        ensure_model_parallel_initialized(1, 1)
    results = [run_row(row, handler) for row in spec["rows"]]
    Path(sys.argv[2]).write_text(json.dumps(results, indent=1))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
