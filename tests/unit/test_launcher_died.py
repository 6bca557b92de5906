"""The launcher names the rank that died, with its pid and how (issue 39).

A real raw daemon; its rank is SIGKILLed; the launcher's line names it
(``rank 0 (pid P, killed by SIGKILL) died; stopping the others``). The
control puts the old line back inside the launcher (a ``sitecustomize`` on
its ``PYTHONPATH``): it names neither the rank nor its pid, and the test's
check fails on it.
"""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import pytest
from daemon_support import Daemon, repo_pythonpath, short_dir, wait_for
from reliability_support import fresh_checkpoint

pytestmark = [pytest.mark.unit, pytest.mark.timeout(180)]

OLD_RULE = ("from preload.daemon import launcher\n"
            "launcher.Launcher.died = lambda self: 'a rank process'\n")


@pytest.mark.parametrize("fixed", [True, False], ids=["fixed", "control_old_rule"])
def test_the_dying_rank_is_named_with_its_pid(tmp_path: Path, fixed: bool) -> None:
    root = short_dir("pg-died-")
    env = {"PRELOAD_GATE_KEEPER_IDLE_S": "1"}
    if not fixed:
        (tmp_path / "site").mkdir()
        (tmp_path / "site" / "sitecustomize.py").write_text(OLD_RULE)
        env["PYTHONPATH"] = os.pathsep.join([repo_pythonpath(), str(tmp_path / "site")])
    ckpt = fresh_checkpoint(tmp_path / "m", seed=2, shards=1)
    cache = tmp_path / "cache"
    cache.mkdir()
    d = Daemon(ckpt, root, cache, args=("--stage", "raw", "--no-fd-store"), env=env).start()
    try:
        pid = d.rank_pid
        os.kill(pid, signal.SIGKILL)
        assert d.proc is not None and wait_for(lambda: d.proc.poll() is not None, 30.0)
        out = d._stderr()
        named = f"rank 0 (pid {pid}, killed by SIGKILL) died; stopping the others" in out
        assert named is fixed, out[-2000:]
        assert d.proc.returncode == 1
    finally:
        if d.proc is not None and d.proc.poll() is None:
            d.stop()
        shutil.rmtree(root, ignore_errors=True)
