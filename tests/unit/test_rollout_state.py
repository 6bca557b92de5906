"""The rollout's state file, host lock, plan checks and the command driver (no vLLM)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from rollout_support import FakeReplica, golden

from harness.rollout.command import CommandDriver, TemplateError, check_template
from harness.rollout.plan import (
    Plan,
    PlanError,
    check_engine_args,
    per_target,
    replica_urls,
    resolve_state,
)
from harness.rollout.replicas import StartFailedError, Target, wait_serving
from harness.rollout.state import (
    Checkpoint,
    HostLock,
    ReplicaRecord,
    RolloutLockedError,
    RolloutState,
    StateError,
    load_state,
    save_state,
)
from preload.deployment import DeploymentSettings

pytestmark = pytest.mark.unit

A, B = "a" * 64, "b" * 64


def state(tmp: Path, n: int = 2) -> RolloutState:
    recs = [ReplicaRecord(i, f"http://127.0.0.1:{9000 + i}", str(tmp / f"r{i}.jsonl")) for i in range(n)]
    return RolloutState.new([Checkpoint("/m/A", A), Checkpoint("/m/B", B)], recs, {}, [], {"kind": "fake"})


# ---------------------------------------------------------------- state file

def test_state_round_trips_and_is_private(tmp_path: Path) -> None:
    s = state(tmp_path)
    s.mark(s.replicas[0], "switching", A, B)
    save_state(tmp_path / "state.json", s)
    assert os.stat(tmp_path / "state.json").st_mode & 0o777 == 0o600
    back = load_state(tmp_path / "state.json")
    assert back is not None and back.to_json() == s.to_json()
    assert [r.index for r in back.unknown()] == [0]


@pytest.mark.parametrize(("edit", "why"), [
    (lambda o: o.update(format="other/1"), "not a rollout state file"),
    (lambda o: o.update(surprise=1), "unknown fields ['surprise']"),
    (lambda o: o["replicas"][0].update(phase="flying"), "unknown phase 'flying'"),
    (lambda o: o.update(step=5), "outside the sequence"),
    (lambda o: [r.update(phase="switching") for r in o["replicas"]], "all mid-switch"),
    (lambda o: o["replicas"][0].update(pid="12"), "Expected `int | null`, got `str`"),
])
def test_a_state_file_no_rollout_wrote_is_refused_by_name(tmp_path: Path, edit, why) -> None:
    save_state(tmp_path / "state.json", state(tmp_path))
    assert load_state(tmp_path / "state.json") is not None  # the neighbour: untouched, it reads
    obj = json.loads((tmp_path / "state.json").read_text())
    edit(obj)
    (tmp_path / "state.json").write_text(json.dumps(obj))
    with pytest.raises(StateError, match=why.replace("[", r"\[").replace("]", r"\]").replace("|", r"\|")):
        load_state(tmp_path / "state.json")


def test_no_state_file_is_none_and_garbage_is_refused(tmp_path: Path) -> None:
    assert load_state(tmp_path / "absent.json") is None
    (tmp_path / "state.json").write_text("{half")
    with pytest.raises(StateError, match="not JSON"):
        load_state(tmp_path / "state.json")


def test_one_rollout_per_host_the_second_is_told_who_holds_it(tmp_path: Path) -> None:
    lock = tmp_path / "rollout.lock"
    code = ("import sys,time; from pathlib import Path; from harness.rollout.state import HostLock; "
            "HostLock(Path(sys.argv[1])).acquire(); print('held', flush=True); time.sleep(30)")
    holder = subprocess.Popen([sys.executable, "-c", code, str(lock)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(RolloutLockedError, match=f"another rollout runs on this host \\(pid {holder.pid}, since"):
            HostLock(lock).acquire()
    finally:
        holder.kill()
        holder.wait()
    with HostLock(lock):  # the kernel freed it with the process (kill -9 included)
        pass


# ---------------------------------------------------------------- plan

@pytest.mark.parametrize("arg", ["--port", "--host=0.0.0.0", "--load-format", "--model-loader-extra-config"])
def test_engine_args_the_rollout_sets_are_refused(arg: str) -> None:
    check_engine_args(["--dtype", "float16"])  # the neighbour
    with pytest.raises(PlanError, match="set by the rollout"):
        check_engine_args([arg, "x"] if "=" not in arg else [arg])


def test_replicas_are_named_one_way() -> None:
    assert replica_urls(2, 8100, "127.0.0.1", None) == ["http://127.0.0.1:8100", "http://127.0.0.1:8101"]
    assert replica_urls(None, None, "x", ["http://h:1/", "http://h:2"]) == ["http://h:1", "http://h:2"]
    for bad, why in [((2, None, "h", None), "needs --port"), ((None, None, "h", None), "name the replicas"),
                     ((2, 1, "h", ["http://h:1"]), "not both"), ((None, None, "h", ["http://h:1"] * 2), "twice"),
                     ((3, 65534, "h", None), "past port 65535")]:
        with pytest.raises(PlanError, match=why):
            replica_urls(*bad)
    assert per_target(None, 2, "--golden") == [None, None]
    with pytest.raises(PlanError, match="one --golden per --to \\(2\\)"):
        per_target(["x"], 2, "--golden")


def _plan(tmp: Path, urls: list[str]) -> Plan:
    return Plan("/m/A", ["/m/B"], urls, [], DeploymentSettings(), tmp)


def test_resolve_state_continues_refuses_or_inherits(tmp_path: Path) -> None:
    seq = [Checkpoint("/m/A", A), Checkpoint("/m/B", B)]
    s = state(tmp_path)
    urls = [r.url for r in s.replicas]
    # unfinished, same plan: continued
    assert resolve_state(_plan(tmp_path, urls), seq, {}, s) is s
    # unfinished, another plan: refused, naming it
    with pytest.raises(PlanError, match="unfinished rollout .*--abort"):
        resolve_state(_plan(tmp_path, urls), [seq[0], Checkpoint("/m/C", "c" * 64)], {}, s)
    # finished: a new rollout of B -> C inherits the replicas and their processes
    for r in s.replicas:
        s.mark(r, "serving", B)
        r.pid = 4242
    s.status = "done"
    save_state(tmp_path / "state.json", s)
    nxt = [Checkpoint("/m/B", B), Checkpoint("/m/C", "c" * 64)]
    fresh = resolve_state(_plan(tmp_path, urls), nxt, {}, s)
    assert fresh.id != s.id and fresh.fleet_id == s.fleet_id and [r.pid for r in fresh.replicas] == [4242, 4242]
    assert (tmp_path / f"rollout-{s.id}.json").exists()
    # finished, but --from is not what the replicas serve: refused
    with pytest.raises(PlanError, match="roll from what it serves"):
        resolve_state(_plan(tmp_path, urls), seq, {}, s)
    with pytest.raises(PlanError, match="another --state-dir"):
        resolve_state(_plan(tmp_path, urls[:1]), nxt, {}, s)


# ---------------------------------------------------------------- command driver

@pytest.mark.parametrize(("template", "why"), [
    ("systemctl restart vllm@{replica}", "unknown placeholder {replica}"),
    ("echo 'unclosed", "No closing quotation"),
    ("", "is empty"),
    ("echo {", "literal brace"),
])
def test_bad_templates_are_refused_before_anything_runs(template: str, why: str) -> None:
    check_template("systemctl restart vllm@{i}")  # the neighbour
    with pytest.raises(TemplateError, match=why):
        check_template(template)


def test_the_template_is_filled_word_by_word_and_never_through_a_shell(tmp_path: Path) -> None:
    out = tmp_path / "argv.json"
    script = "import json,sys; json.dump(sys.argv[1:], open(sys.argv[1], 'w'))"
    d = CommandDriver(f"{sys.executable} -c \"{script}\" {out} {{i}} {{checkpoint}} {{loader_config}} {{serve_args}}",
                      ["--dtype", "float16"])
    rec = ReplicaRecord(1, "http://127.0.0.1:9001", str(tmp_path / "e.jsonl"))
    t = Target("/models/with space; rm -rf x", B, "B", "/run/pg")
    saved = []
    d.restart(rec, t, lambda: saved.append(1))
    argv = json.loads(out.read_text())
    assert argv[1:3] == ["1", "/models/with space; rm -rf x"] and saved == [1]
    cfg = json.loads(argv[3])
    assert cfg == {"socket_root": "/run/pg", "fallback": False, "identity": "pinned", "expected_digest": B,
                   "events_file": str(tmp_path / "e.jsonl")}
    assert argv[4].startswith("--dtype float16 --load-format verified_cache --model-loader-extra-config ")


def test_a_failing_restart_command_is_named(tmp_path: Path) -> None:
    d = CommandDriver(f"{sys.executable} -c \"import sys; print('unit not found'); sys.exit(5)\"", [])
    rec = ReplicaRecord(0, "http://127.0.0.1:9", str(tmp_path / "e.jsonl"))
    with pytest.raises(StartFailedError) as e:
        d.restart(rec, Target("/m", B, "B", "/r"), lambda: None)
    assert e.value.reason == "restart_command_failed" and "exited 5: unit not found" in e.value.detail


def test_a_replica_that_did_not_restart_is_no_load_event(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A restart command that restarts nothing: the old process still answers, no new event."""
    import harness.rollout.replicas as replicas

    monkeypatch.setattr(replicas, "EVENTLESS_GRACE_S", 0.3)
    fake = FakeReplica()
    try:
        fake.serving = golden(1, A)
        rec = ReplicaRecord(0, fake.url, str(tmp_path / "e.jsonl"))
        (tmp_path / "e.jsonl").write_text(json.dumps({"outcome": "hit", "daemon_digest": A, "rank": 0}) + "\n")
        d = CommandDriver("true", [])
        with pytest.raises(StartFailedError) as e:
            wait_serving(d, rec, Target("/m/B", B, "B", "/r"), seen=1, timeout_s=5)
        assert e.value.reason == "no_load_event"
        # control: the same replica with a new hit on B is serving B
        with open(tmp_path / "e.jsonl", "a") as f:
            f.write(json.dumps({"outcome": "hit", "daemon_digest": B, "rank": 0}) + "\n")
        assert wait_serving(d, rec, Target("/m/B", B, "B", "/r"), seen=1, timeout_s=5)[0]["daemon_digest"] == B
    finally:
        fake.close()


# ---------------------------------------------------------------- the verb's refusals

@pytest.mark.parametrize(("args", "why"), [
    (["--to", "{B}", "--replicas", "2", "--port", "9000"], "name the checkpoints: --from CURRENT --to NEW"),
    (["--from", "{A}", "--to", "{A}", "--replicas", "2", "--port", "9000"], "follows itself in the sequence"),
    (["--from", "{A}", "--to", "{B}", "--replicas", "2", "--port", "9000", "--", "--port", "1"],
     "engine argument --port is set by the rollout"),
    (["--from", "{A}", "--to", "{B}", "--replica-url", "http://h:1", "--restart-command", "restart {n}"],
     "unknown placeholder {n}"),
    (["--from", "{A}", "--to", "/no/such", "--replicas", "2", "--port", "9000"], "--to /no/such is not a directory"),
    (["--from", "{A}", "--to", "{B}", "--replicas", "2", "--port", "9000", "--no-gate", "--gate-report", "x"],
     "contradict each other"),
    (["--from", "{A}", "--to", "{B}", "--replicas", "2", "--port", "9000", "--unsafe-identity", "header_only"],
     "negative control for tests only"),
    (["--abort"], "--abort: no rollout state at"),
    (["--stop"], "--stop: no rollout state at"),
])
def test_the_verb_refuses_in_one_line_and_makes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str], args, why) -> None:
    from preload_gate.cli import main

    for name in ("A", "B"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_bytes(b"")
    cache, state_dir = tmp_path / "cache", tmp_path / "state"
    monkeypatch.setenv("PRELOAD_GATE_CACHE", str(cache))
    monkeypatch.delenv("PRELOAD_GATE_ALLOW_UNSAFE_CONTROLS", raising=False)
    argv = ["rollout", "--state-dir", str(state_dir),
            *(a.format(A=tmp_path / "A", B=tmp_path / "B") if "{" in a and "{n}" not in a else a for a in args)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("preload-gate rollout: error: ") and why in err[0], err
    assert not state_dir.exists() and not cache.exists()
