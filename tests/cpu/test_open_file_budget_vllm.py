"""The loaded and processed stages' loads hold what preload.budget counts, measured by the kernel.

Each stage runs ``fill_model`` (vLLM builds the model, our iterator feeds its
``load_weights``: vLLM's own ``safetensors_weights_iterator`` never runs in
the daemon) on the tiny fixture split into one shard per tensor, in a
subprocess whose open-file limit, set at the moment the rank reserves its
files (vLLM's world and imports are up by then), leaves exactly
``load_open_files(stage)`` descriptors free: it loads. With one fewer it
fails, naming the open-file limit (and not "No such file or directory").
Both attempts run in one process (vLLM's world is set up once), the short
one first, so a count that is too large fails the test as surely as one
that is too small.
"""

from __future__ import annotations

import pytest
from fd_limit_support import PRELUDE, run_child

pytestmark = [pytest.mark.cpu, pytest.mark.slow, pytest.mark.xdist_group(name="open_file_budget_vllm")]

FILL = PRELUDE + r"""
import socket
from preload import budget
from preload.daemon import loaded
from preload.daemon.stage import RankConfig
from preload.transports import get_transport
ckpt, stage = sys.argv[1], sys.argv[2]
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
cfg = RankConfig(checkpoint=ckpt, stage=stage, engine={"dtype": "float32"},
                 distributed_init_method=f"tcp://127.0.0.1:{port}")
transport = get_transport("shm")
attempts = {}
def at_reservation(need, what, want=None):  # the rank's reservation point: the limit becomes the stage's count
    give = budget.load_open_files(stage) + extra
    limit_to(give, hard_extra=None)  # the hard limit kept: the next attempt raises the soft one again
    return give
loaded.reserve_open_files = at_reservation
for extra in (-1, 0):
    opened.clear()
    try:
        filled = loaded.fill_model(cfg, transport, None, None)
        attempts[str(extra)] = {"ok": True, "digest": filled.digest, "shard_opens": len(opened)}
        filled.arena.close()
    except Exception as exc:
        attempts[str(extra)] = {"ok": False, "error": str(exc), "type": type(exc).__name__}
print(json.dumps(attempts), flush=True)
"""


@pytest.fixture(scope="module")
def per_tensor(tiny_checkpoint):
    from fixtures.tiny import write_tiny
    from pgbase.shards import read_header, shard_paths

    one = tiny_checkpoint()
    n = sum(len(read_header(p).tensors) for p in shard_paths(one))
    ckpt = one.parent.parent / "per-tensor" / "ckpt"
    if not ckpt.exists():
        write_tiny(ckpt, arch="qwen3", shards=n)
    return ckpt, n


@pytest.mark.parametrize("stage", ["loaded", "processed"])
def test_stage_load_holds_exactly_what_is_counted(per_tensor, stage):
    from preload.identity.digest import content_digest

    ckpt, shards = per_tensor
    got, stderr = run_child(FILL, ckpt, stage, timeout=600)
    short, exact = got["-1"], got["0"]
    assert not short["ok"], (short, stderr[-3000:])
    assert "open-file limit" in short["error"] and "ulimit -n" in short["error"], short
    assert "No such file" not in short["error"], short
    assert exact["ok"], (exact, stderr[-3000:])
    assert exact["digest"] == content_digest(ckpt)
    assert exact["shard_opens"] >= shards  # every shard was read under the limit
