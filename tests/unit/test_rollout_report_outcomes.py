"""The rollout report renders for every outcome (issue 37, item 4): a rollback
with no canary (no ``--from-golden``), no golden at all, a failed start, a
done rollout, each run on fake replicas and daemons and written as JSON,
Markdown and HTML with its summary line. Control: the old template's
``x.seconds.canary`` (a switch record without a canary phase has no such
key) raises under the report's strict environment for the no-canary rollback.
"""

from __future__ import annotations

from pathlib import Path

import jinja2
import pytest
from rollout_support import FakeDaemons, FakeDriver, FakeReplica, golden

from harness.report.html import _env
from harness.rollout.report import build, headline, write_report
from harness.rollout.runner import Rollout, RolloutOptions
from harness.rollout.state import Checkpoint, ReplicaRecord, RolloutState
from harness.rollout.switch import SwitchOptions
from preload.deployment import DeploymentSettings

pytestmark = pytest.mark.unit
A, B = "a" * 64, "b" * 64

# outcome -> (goldens of A and B, driver script, exit code, headline start)
OUTCOMES = {
    "rollback_without_canary": ((False, True), {(1, "B"): "wrong"}, 1, "FAILED: replica 1"),
    "no_golden_at_all": ((False, False), {}, 0, "DONE: every replica serves B"),
    "failed_start": ((False, True), {(0, "A"): "exit"}, 1, "FAILED: replica 0"),
    "done_with_canaries": ((True, True), {}, 0, "DONE: every replica serves B"),
}


def _run(tmp: Path, monkeypatch: pytest.MonkeyPatch, outcome: str) -> tuple[int, dict]:
    import harness.rollout.replicas as replicas

    monkeypatch.setattr(replicas, "EVENTLESS_GRACE_S", 0.5)
    monkeypatch.setattr(replicas, "POLL_S", 0.05)
    (ga, gb), script, _, _ = OUTCOMES[outcome]
    all_goldens = {A: golden(1, A), B: golden(2, B)}
    goldens = {A: all_goldens[A] if ga else None, B: all_goldens[B] if gb else None}
    fakes = [FakeReplica() for _ in range(2)]
    try:
        records = [ReplicaRecord(i, f.url, events_file=str(tmp / f"r{i}.events.jsonl")) for i, f in enumerate(fakes)]
        state = RolloutState.new([Checkpoint("/ckpt/A", A), Checkpoint("/ckpt/B", B)], records,
                                 DeploymentSettings().to_json(), [], {"kind": "fake"})
        FakeDaemons().install(monkeypatch)
        opts = RolloutOptions(socket_root=str(tmp), state_path=tmp / "state.json", settings=DeploymentSettings(),
                              switch=SwitchOptions(ready_timeout_s=1.5, canary_timeout_s=5, canary_retries=0))
        driver = FakeDriver({f.url: f for f in fakes}, all_goldens, dict(script))
        code = Rollout(state, driver, goldens, opts).run()
    finally:
        for f in fakes:
            f.close()
    return code, build(state)


@pytest.mark.parametrize("outcome", list(OUTCOMES))
def test_the_report_renders_for_every_outcome(tmp_path, monkeypatch, outcome):
    code, doc = _run(tmp_path, monkeypatch, outcome)
    assert code == OUTCOMES[outcome][2], headline(doc)
    assert headline(doc).startswith(OUTCOMES[outcome][3]), headline(doc)
    paths = write_report(doc, tmp_path / "report")
    assert sorted(paths) == ["html", "json", "md"] and all(p.stat().st_size > 0 for p in paths.values())
    assert headline(doc).split(":")[0] in paths["html"].read_text()


def test_control_the_old_template_fails_on_a_rollback_without_a_canary(tmp_path, monkeypatch):
    _, doc = _run(tmp_path, monkeypatch, "rollback_without_canary")
    assert any("canary" not in (x.get("seconds") or {}) for x in doc["switches"])
    old = _env.from_string("{% for x in doc.switches %}{{ x.seconds.canary or '' }}{% endfor %}")
    with pytest.raises(jinja2.UndefinedError, match="canary"):
        old.render(doc=doc)
