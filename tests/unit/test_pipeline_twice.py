"""ci/promote_pipeline.sh run twice on one checkpoint (field case r11), and the
deployment settings reaching every step (r12), without vLLM engines.

The two engine steps (``gate``, ``canary record``) are replaced by a stub
``preload-gate`` that logs its argv and answers as they would; ``promote``,
``preload`` (at the ``raw`` stage: no vLLM) and ``status`` are the real CLI.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from daemon_support import short_dir

from fixtures.tiny import write_tiny
from pgbase.procs import stop_pid

pytestmark = [pytest.mark.unit, pytest.mark.xdist_group(name="pipeline_twice")]

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "ci" / "promote_pipeline.sh"

STUB = '''#!{python}
import json, os, sys, time
sys.path.insert(0, {repo!r})
with open(os.environ["STUB_LOG"], "a") as f:
    f.write(json.dumps({{"pid": os.getpid(), "argv": sys.argv[1:]}}) + "\\n")
args = sys.argv[1:]
if args[:1] == ["gate"]:
    flag = os.environ.get("STUB_GATE_FLAG")
    if flag:  # hold the gate until the test says go
        open(flag + ".started", "w").close()
        while not os.path.exists(flag):
            time.sleep(0.1)
    rep = args[args.index("--report") + 1]
    os.makedirs(rep, exist_ok=True)
    open(os.path.join(rep, "report.md"), "w").write("stub gate: PASS\\n")
    sys.exit(0)
if args[:2] == ["canary", "record"]:
    from preload.identity.digest import content_digest
    model, out = args[args.index("--model") + 1], args[args.index("--out") + 1]
    d = content_digest(model)
    open(out, "w").write(json.dumps({{"format": "stub", "digest": d}}))
    print(json.dumps({{"golden": out, "digest": d}}))
    sys.exit(0)
from preload_gate.cli import main
sys.exit(main(args))
'''


@pytest.fixture
def env(tmp_path: Path):
    stub = tmp_path / "pg-stub"
    stub.write_text(STUB.format(python=sys.executable, repo=str(REPO)))
    stub.chmod(0o755)
    root = short_dir("pg-pt-")
    e = dict(os.environ, PRELOAD_GATE=str(stub), STUB_LOG=str(tmp_path / "calls.jsonl"),
             PRELOAD_GATE_CACHE=str(tmp_path / "cache"), PRELOAD_GATE_SOCKET_ROOT=str(root), READY_TIMEOUT="300",
             PATH=str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""),
             PYTHONPATH=str(REPO))
    e.pop("STUB_GATE_FLAG", None)
    kept: list[int] = []
    yield {"env": e, "tmp": tmp_path, "root": root, "kept": kept}
    for pid in kept:
        stop_pid(pid, term_s=30.0, kill_s=10.0)
    import shutil

    shutil.rmtree(root, ignore_errors=True)


def start(env: dict, *args: str, cwd: Path, **extra: str) -> subprocess.Popen:
    return subprocess.Popen(["bash", str(SCRIPT), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=dict(env, **extra), cwd=cwd, start_new_session=True)


def finish(p: subprocess.Popen, timeout: float = 400) -> tuple[int, str, str]:
    out, err = p.communicate(timeout=timeout)
    return p.returncode, out, err


def ckpt(tmp: Path, name: str, seed: int) -> Path:
    return write_tiny(tmp / name, seed=seed)


def wait_for(path: Path, proc: subprocess.Popen, what: str) -> None:
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"{what}: the run exited {proc.returncode}: {proc.stderr.read() if proc.stderr else ''}")
        time.sleep(0.1)


def test_two_runs_of_one_digest_one_waits_with_a_clear_line_others_proceed(env) -> None:
    tmp, e = env["tmp"], env["env"]
    c1, c2 = ckpt(tmp, "c1", 1), ckpt(tmp, "c2", 2)
    cwd = tmp / "cwd"
    cwd.mkdir()
    flag = tmp / "go"
    a = start(e, str(c1), "--", "--stage", "raw", cwd=cwd, STUB_GATE_FLAG=str(flag))
    wait_for(Path(str(flag) + ".started"), a, "run A")  # A holds the promotion of c1, in its gate
    b = start(e, str(c1), "--", "--stage", "raw", cwd=cwd)
    rb, out_b, err_b = finish(b)
    assert rb == 2 and out_b == "", err_b
    digest = json.loads(next(cwd.glob("*/promote.json")).read_text())["digest"]
    (line,) = [ln for ln in err_b.splitlines() if "error" in ln]
    assert f"another promotion of {digest} is running (pid {a.pid}" in line and "wait for it" in line
    # control: another digest is not held by that lock, and both default output folders are unique
    c = start(e, str(c2), "--", "--stage", "raw", cwd=cwd)
    rc_c, _, err_c = finish(c)
    assert rc_c == 0, err_c
    flag.touch()
    ra, out_a, err_a = finish(a)
    assert ra == 0, err_a
    dirs = sorted(d.name for d in cwd.iterdir())
    # B stopped before its gate, so the folder it made is gone (nothing half-written);
    # A's and C's are distinct and complete.
    assert len(dirs) == 2 and len(set(dirs)) == 2, dirs
    assert sum((cwd / d / "deploy.sh").exists() for d in dirs) == 2
    # an output folder used by a run is refused, not shared
    used = next(d for d in dirs if (cwd / d / "deploy.sh").exists())
    rc2, _, err2 = finish(start(e, str(c1), "--out", str(cwd / used), "--", "--stage", "raw", cwd=cwd))
    assert rc2 == 2 and "was used by another run of this pipeline" in err2


def test_rerun_reuses_a_daemon_that_serves_the_digest_with_the_same_settings(env) -> None:
    tmp, e = env["tmp"], env["env"]
    c1 = ckpt(tmp, "c1", 3)
    r1, _, err1 = finish(start(e, str(c1), "--out", str(tmp / "o1"), "--keep-daemon", "--", "--stage", "raw",
                               cwd=tmp))
    assert r1 == 0, err1
    kept = json.loads((tmp / "o1" / "daemon.json").read_text())
    env["kept"].append(int(kept["pid"]))
    r2, out2, err2 = finish(start(e, str(c1), "--out", str(tmp / "o2"), "--", "--stage", "raw", cwd=tmp))
    assert r2 == 0, err2
    assert "reusing the daemon already serving" in err2 and "--load-format verified_cache" in out2
    reused = json.loads((tmp / "o2" / "daemon.json").read_text())
    assert reused["reused"] is True and reused["rank_pids"] == [r["pid"] for r in kept["ranks"]]
    status = subprocess.run([sys.executable, "-m", "preload_gate.cli", "status", "--json"], capture_output=True,
                            text=True, env=e, timeout=120)
    assert [r["pid"] for r in json.loads(status.stdout)["ranks"] if r["serving"]] == reused["rank_pids"]
    # control: the same digest held under other settings is named, not reused and not fought over
    r3, _, err3 = finish(start(e, str(c1), "--out", str(tmp / "o3"), "--", "--stage", "raw", "--dtype", "float16",
                               cwd=tmp))
    assert r3 == 2 and "serves" in err3 and "dtype=" in err3 and "float16" in err3, err3


def test_deployment_settings_reach_gate_golden_daemon_and_printed_commands(env) -> None:
    tmp, e = env["tmp"], env["env"]
    c1 = ckpt(tmp, "c1", 4)
    rc, out, err = finish(start(e, str(c1), "--out", str(tmp / "o"), "--", "--stage", "raw", "--dtype", "float16",
                                "-tp", "1", cwd=tmp))
    assert rc == 0, err
    calls = [json.loads(ln)["argv"] for ln in (tmp / "calls.jsonl").read_text().splitlines()]
    by_verb = {(a[0] if a[0] != "canary" else "canary " + a[1]): a for a in calls}
    for verb in ("gate", "canary record", "preload"):
        argv = by_verb[verb]
        assert argv[argv.index("--dtype") + 1] == "float16" and argv[argv.index("-tp") + 1] == "1", (verb, argv)
    assert "--stage" not in by_verb["gate"] and "--stage" not in by_verb["canary record"]  # daemon-only flags
    daemon_cmd, serve_cmd, check_cmd = [ln for ln in out.splitlines() if ln and not ln.startswith("#")]
    assert "--dtype float16 -tp 1" in daemon_cmd and "--dtype float16 -tp 1" in serve_cmd
    assert check_cmd.endswith(f"--checkpoint {c1.resolve()} --dtype float16 -tp 1")
