"""What a rollout calls one checkpoint (issue 37, item 3): the weights digest,
the config digest and the answer files, the golden's rule.

- the rule on real folders: a byte-identical copy is the same checkpoint; a
  config-only change (rope_theta x4), an answer-file change or a weight
  change is another;
- a rollout to a config-only change switches every replica, each judged by
  the canary against the new checkpoint's golden, its daemon beside the old
  one (the socket directory is keyed by the digest: its own root), and the
  new one stays resident; control: keyed by the weights digest alone (the
  old rule) the same rollout switches nothing and releases the only daemon;
- a rollout to identical content is refused in one line, exit 2, before any
  daemon is found, started or stopped and before any state is written;
  control: the same run onto a config-only change goes on to the replicas;
- "A is resident" is a daemon of A's digest whose key fits (its config): one
  of the same weights under another config is not A.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from rollout_support import FakeDaemons, FakeDriver, FakeReplica, golden

from harness.rollout.identity import identity, key_mismatch, what_differs
from harness.rollout.runner import Rollout, RolloutOptions
from harness.rollout.state import Checkpoint, ReplicaRecord, RolloutState
from harness.rollout.switch import SwitchOptions
from preload.deployment import DeploymentSettings
from preload.identity.digest import content_digest

pytestmark = pytest.mark.unit
D = "d" * 64


def _config_only(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["rope_theta"] = float(cfg.get("rope_theta") or 10000.0) * 4
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_the_identity_is_weights_config_and_answer_files(tiny_ckpt, tmp_path):
    digest = content_digest(tiny_ckpt)
    copy = tmp_path / "copy"
    shutil.copytree(tiny_ckpt, copy)
    assert identity(digest, copy) == identity(digest, tiny_ckpt) and what_differs(tiny_ckpt, copy) == []
    cfg = _config_only(tiny_ckpt, tmp_path / "cfg")
    assert identity(digest, cfg) != identity(digest, tiny_ckpt) and what_differs(tiny_ckpt, cfg) == ["config.json"]
    tok = tmp_path / "tok"
    shutil.copytree(tiny_ckpt, tok)
    (tok / "chat_template.jinja").write_text("{{ messages }}")
    assert identity(digest, tok) != identity(digest, tiny_ckpt) and "chat_template.jinja" in what_differs(tiny_ckpt, tok)
    assert identity("e" * 64, copy) != identity(digest, copy)  # other weights


def test_a_daemon_of_another_stage_is_not_resident(monkeypatch):
    """A raw daemon of A's digest serves no vLLM replica on this host (its
    engines attach the loaded stage on CPU): not "A resident" (review finding).
    Control: the stage and transport this host's engines attach fit."""
    import harness.rollout.identity as identity

    monkeypatch.setattr(identity, "engine_surface", lambda: ("loaded", "shm"))
    s = DeploymentSettings(dtype="bfloat16")
    key = {"config_digest": "c1", "dtype": "bfloat16", "tp_size": 1}
    assert key_mismatch({**key, "export_stage": "raw", "transport": "shm"}, "c1", s) == ["export_stage"]
    assert key_mismatch({**key, "export_stage": "processed", "transport": "cuda"}, "c1", s) == \
        ["export_stage", "transport"]
    assert key_mismatch({**key, "export_stage": "loaded", "transport": "shm"}, "c1", s) == []


def test_a_daemon_of_the_same_weights_under_another_config_is_not_resident():
    s = DeploymentSettings(dtype="bfloat16")
    assert key_mismatch({"config_digest": "c1", "dtype": "torch.bfloat16", "tp_size": 1}, "c1", s) == []
    assert key_mismatch({"config_digest": "c1", "dtype": "bfloat16", "tp_size": 1}, "c2", s) == ["config_digest"]
    assert key_mismatch({"config_digest": "c1", "dtype": "float16", "tp_size": 2}, "c1", s) == ["dtype", "tp_size"]


class _Fleet:
    """Two fake replicas serving A; A and B share the weights digest ``D``."""

    def __init__(self, tmp: Path, monkeypatch: pytest.MonkeyPatch, by_identity: bool = True,
                 script: dict[tuple[int, str], str] | None = None) -> None:
        import harness.rollout.replicas as replicas

        monkeypatch.setattr(replicas, "EVENTLESS_GRACE_S", 0.5)
        monkeypatch.setattr(replicas, "POLL_S", 0.05)
        ka, kb = ("1" * 64, "2" * 64) if by_identity else (D, D)
        self.a = Checkpoint("/ckpt/A", D, None, ka, ask=D, config_digest="ca" * 32)
        self.b = Checkpoint("/ckpt/B", D, None, kb, ask=D, config_digest="cb" * 32,
                            socket_root=str(tmp / f"id-{kb[:12]}") if by_identity else "")
        self.goldens = {ka: golden(1, D), kb: golden(2, D)} if by_identity else {D: golden(1, D)}
        self.fakes = [FakeReplica() for _ in range(2)]
        records = [ReplicaRecord(i, f.url, events_file=str(tmp / f"r{i}.events.jsonl")) for i, f in enumerate(self.fakes)]
        self.state = RolloutState.new([self.a, self.b], records, DeploymentSettings().to_json(), [], {})
        self.driver = FakeDriver({f.url: f for f in self.fakes}, self.goldens, dict(script or {}))
        self.daemons = FakeDaemons(base_root=str(tmp))
        self.daemons.install(monkeypatch)
        self.opts = RolloutOptions(socket_root=str(tmp), state_path=tmp / "state.json", settings=DeploymentSettings(),
                                   switch=SwitchOptions(ready_timeout_s=1.5, canary_timeout_s=5, canary_retries=0))
        self.lines: list[str] = []

    def run(self) -> int:
        rollout = Rollout(self.state, self.driver, self.goldens, self.opts, lambda p, m: self.lines.append(f"{p} {m}"))
        try:
            return rollout.run()
        finally:
            for f in self.fakes:
                f.close()


def test_a_config_only_rollout_switches_every_replica_against_the_new_golden(tmp_path, monkeypatch):
    fleet = _Fleet(tmp_path, monkeypatch)
    assert fleet.run() == 0, fleet.lines
    assert [r for r in fleet.driver.restarts if r[1] == "B"] == [(0, "B"), (1, "B")]
    assert all(r.serving == fleet.b.key for r in fleet.state.replicas)
    switches = [s for s in fleet.state.switches if s["onto"] == "B"]
    assert len(switches) == 2 and all(s["ok"] and s["canary"]["verdict"] == "PASS" for s in switches)
    assert all(f"{D}@{fleet.b.socket_root}" == name for name in [fleet.daemons.started[-1]])
    assert list(fleet.daemons.live) == [f"{D}@{fleet.b.socket_root}"]  # B resident, A released
    assert fleet.daemons.released == [D]


def test_a_config_only_replica_serving_the_old_answers_fails_the_new_golden(tmp_path, monkeypatch):
    """The canaries judge against B's golden: a replica that hit but answers as A fails and goes back."""
    fleet = _Fleet(tmp_path, monkeypatch, script={(0, "B"): "wrong"})
    assert fleet.run() == 1
    assert fleet.state.failure["reason"] == "canary_failed" and fleet.state.failure["fleet_back_on_from"]


def test_control_keyed_by_the_weights_digest_the_config_change_switches_nothing(tmp_path, monkeypatch):
    """The old rule: A and B are one key. Zero switches, 'done', and the only daemon released."""
    fleet = _Fleet(tmp_path, monkeypatch, by_identity=False)
    assert fleet.run() == 0
    assert [r for r in fleet.driver.restarts if r[1] == "B"] == []
    assert fleet.daemons.live == {}


def _rollout_cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, frm: Path, to: Path) -> tuple[int, Any]:
    from preload_gate.cli import main

    monkeypatch.setenv("PRELOAD_GATE_CACHE", str(tmp_path / "cache"))
    daemons = FakeDaemons()
    daemons.install(monkeypatch)
    daemons.live[D] = "the fleet's daemon"  # type: ignore[assignment]
    monkeypatch.setattr("harness.rollout.flow.Flow._record", lambda self, *a: str(tmp_path / "golden.json"))
    monkeypatch.setattr("harness.rollout.flow.Flow.rotate", lambda self, state, abort=False: (0, None))
    argv = ["rollout", "--state-dir", str(tmp_path / "state"), "--socket-root", str(tmp_path / "sock"),
            "--from", str(frm), "--to", str(to), "--replica-url", "http://127.0.0.1:9", "--no-gate"]
    return main(argv), daemons


def test_a_rollout_to_identical_content_is_refused_and_changes_nothing(tiny_ckpt, tmp_path, monkeypatch, capsys):
    copy = tmp_path / "copy"
    shutil.copytree(tiny_ckpt, copy)
    code, daemons = _rollout_cli(tmp_path, monkeypatch, tiny_ckpt, copy)
    lines = capsys.readouterr().err.strip().splitlines()
    err = [ln for ln in lines if ln.startswith("preload-gate rollout: error: ")]  # besides the progress lines
    assert code == 2 and len(err) == 1 and err[0] == lines[-1] and "is the same checkpoint as A" in err[0], lines
    assert "nothing was changed" in err[0]
    assert daemons.started == [] and daemons.released == [] and daemons.live == {D: "the fleet's daemon"}
    assert not (tmp_path / "state").exists()  # not even an empty state dir (review finding)


def test_control_a_config_only_change_is_not_refused(tiny_ckpt, tmp_path, monkeypatch, capsys):
    code, _ = _rollout_cli(tmp_path, monkeypatch, tiny_ckpt, _config_only(tiny_ckpt, tmp_path / "cfg"))
    assert code == 0, capsys.readouterr().err
    assert "differs from A in config.json" in capsys.readouterr().err


@pytest.mark.parametrize("identical", [True, False], ids=["identical_second_step", "control_changed_second_step"])
def test_a_later_step_onto_identical_content_is_refused_before_any_golden(tiny_ckpt, tmp_path, monkeypatch, capsys,
                                                                          identical: bool):
    """``--to B --to B2`` where B2 is B byte for byte: refused before the first
    step's golden or gate (review finding: B's gate ran first). Control: a
    second step that differs (its config) is not refused."""
    from preload_gate.cli import main

    b = _config_only(tiny_ckpt, tmp_path / "B")
    b2 = tmp_path / "B2"
    if identical:
        shutil.copytree(b, b2)
    else:
        _config_only(b, b2)
    monkeypatch.setenv("PRELOAD_GATE_CACHE", str(tmp_path / "cache"))
    daemons = FakeDaemons()
    daemons.install(monkeypatch)
    daemons.live[D] = "the fleet's daemon"  # type: ignore[assignment]
    recorded: list[str] = []
    monkeypatch.setattr("harness.rollout.flow.Flow._record",
                        lambda self, path, *a: recorded.append(str(path)) or str(tmp_path / "golden.json"))
    monkeypatch.setattr("harness.rollout.flow.Flow.rotate", lambda self, state, abort=False: (0, None))
    code = main(["rollout", "--state-dir", str(tmp_path / "state"), "--socket-root", str(tmp_path / "sock"),
                 "--from", str(tiny_ckpt), "--to", str(b), "--to", str(b2), "--replica-url", "http://127.0.0.1:9",
                 "--no-gate"])
    err = capsys.readouterr().err
    if identical:
        assert code == 2 and f"--to {b2} is the same checkpoint as" in err, err
        assert recorded == []
    else:
        assert code == 0, err
        assert recorded
