"""The rotation on fake replicas and daemons (no vLLM): one row per failure
reason with the rollback it must end in, the passing neighbour, resume after
a kill at each point, the soak, the sequence's residency rule, the budget.

Every scene also checks the state file's promise at every write: at most one
replica on weights the file cannot name (``test_*`` via ``Scene.saves``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from rollout_support import FakeDaemons, FakeDriver, FakeReplica, golden

from harness.rollout.residency import BudgetError
from harness.rollout.runner import Rollout, RolloutOptions
from harness.rollout.state import Checkpoint, ReplicaRecord, RolloutState, load_state
from harness.rollout.switch import REASONS, SwitchOptions
from preload.deployment import DeploymentSettings

pytestmark = pytest.mark.unit

KEYS = {"A": "a" * 64, "B": "b" * 64, "C": "c" * 64}


class Scene:
    def __init__(self, tmp: Path, monkeypatch: pytest.MonkeyPatch, n: int = 2, to: str = "B",
                 script: dict[tuple[int, str], str] | None = None, ties: bool = False, **opts: Any) -> None:
        self.tmp = tmp
        labels = ["A", *to]
        self.goldens = {KEYS[L]: golden(i + 1, KEYS[L], ties=ties and L != "A") for i, L in enumerate(labels)}
        self.seq = [Checkpoint(f"/ckpt/{L}", KEYS[L], None) for L in labels]
        self.fakes = [FakeReplica() for _ in range(n)]
        self.records = [ReplicaRecord(i, f.url, events_file=str(tmp / f"r{i}.events.jsonl")) for i, f in enumerate(self.fakes)]
        self.state = RolloutState.new(self.seq, self.records, DeploymentSettings().to_json(), [], {})
        self.driver = FakeDriver({f.url: f for f in self.fakes}, self.goldens, dict(script or {}))
        self.daemons = FakeDaemons()
        self.daemons.install(monkeypatch)
        self.opts = RolloutOptions(socket_root=str(tmp), state_path=tmp / "state.json", settings=DeploymentSettings(),
                                   switch=SwitchOptions(ready_timeout_s=1.5, canary_timeout_s=5, canary_retries=0),
                                   **opts)
        self.saves: list[int] = []
        self.lines: list[str] = []
        self.hooks: list[Any] = []

    def on_save(self, state: RolloutState) -> None:
        unknown = state.unknown()
        assert len(unknown) <= 1, [(r.index, r.phase) for r in unknown]  # never two on unknown weights
        self.saves.append(len(unknown))
        for h in self.hooks:
            h(state)

    def progress(self, phase: str, msg: str) -> None:
        self.lines.append(f"{phase} {msg}")

    def rollout(self, state: RolloutState | None = None, driver: FakeDriver | None = None) -> Rollout:
        return Rollout(state or self.state, driver or self.driver, self.goldens, self.opts, self.progress,
                       on_save=self.on_save)

    def serving(self) -> list[str | None]:
        by_golden = {id(g): L for L, g in ((L, self.goldens[KEYS[L]]) for L in KEYS if KEYS[L] in self.goldens)}
        return [by_golden.get(id(f.serving)) if f.serving else None for f in self.fakes]

    def close(self) -> None:
        for f in self.fakes:
            f.close()


@pytest.fixture
def scene(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    import harness.rollout.replicas as replicas

    monkeypatch.setattr(replicas, "EVENTLESS_GRACE_S", 0.5)
    monkeypatch.setattr(replicas, "POLL_S", 0.05)
    made: list[Scene] = []

    def make(**kw: Any) -> Scene:
        made.append(Scene(tmp_path, monkeypatch, **kw))
        return made[-1]
    yield make
    for s in made:
        s.close()


def test_good_rollout_moves_every_replica_and_releases_the_old_daemon(scene) -> None:
    s = scene()
    assert s.rollout().run() == 0
    assert s.serving() == ["B", "B"]
    st = load_state(s.opts.state_path)
    assert st is not None and st.status == "done" and [r.serving for r in st.replicas] == [KEYS["B"]] * 2
    assert s.daemons.started == [KEYS["A"], KEYS["B"]] and s.daemons.released == [KEYS["A"]]
    assert [(x["replica"], x["onto"], x["ok"]) for x in st.switches] == [(0, "B", True), (1, "B", True)]
    assert s.driver.restarts == [(0, "A"), (1, "A"), (0, "B"), (1, "B")]  # bring-up on A, then one at a time


def test_keep_from_keeps_the_old_daemon(scene) -> None:
    s = scene(keep_from=True)
    assert s.rollout().run() == 0
    assert s.daemons.released == [] and set(s.daemons.live) == {KEYS["A"], KEYS["B"]}


# One row per failure reason of a switch: how the fake replica misbehaves on
# B and the reason the rollout must name. The passing neighbour of every row
# is the good rollout above (the same replicas with the script "ok").
FAILURES = [
    ("wrong", "canary_failed", "token_mismatch"),
    ("miss", "miss", "no daemon for this digest"),
    ("exit", "start_failed", "exited before it served"),
    ("no_event", "no_load_event", "recorded no load event"),
    ("wrong_event", "wrong_load_event", f"hit on {'c' * 16}"),
    ("hang", "not_ready", "within 1.5 s"),
    ("ties", "near_tie_flood", "near-ties in one answer set"),
    ("restart_fails", "restart_command_failed", "exited 1"),
]


@pytest.mark.parametrize(("how", "reason", "detail"), FAILURES, ids=[f[0] for f in FAILURES])
def test_a_failing_first_replica_is_rolled_back_as_a_hit_and_the_second_never_moves(scene, how, reason, detail) -> None:
    s = scene(script={(0, "B"): how}, ties=how == "ties")
    if how == "hang":
        s.driver.script[(0, "B")] = "no_event_never"  # unknown to the fake: serves nothing, stays alive
    assert s.rollout().run() == 1
    st = load_state(s.opts.state_path)
    assert st is not None and st.status == "failed"
    f = st.failure
    assert f["replica"] == 0 and f["reason"] == reason and detail in f["detail"], f
    assert f["rollback"]["ok"] and f["rollback"]["hit"] and f["fleet_back_on_from"], f
    assert s.serving() == ["A", "A"]
    assert (1, "B") not in s.driver.restarts  # the second replica never left A
    assert KEYS["B"] in s.daemons.released and KEYS["A"] not in s.daemons.released


def test_every_switch_reason_has_a_row() -> None:
    assert {r for _, r, _ in FAILURES} == set(REASONS)


def test_near_ties_within_the_threshold_pass(scene) -> None:
    """The control of the near_tie_flood row: the same ties under a higher threshold pass."""
    s = scene(script={(0, "B"): "ties", (1, "B"): "ties"}, ties=True)
    s.opts.switch = SwitchOptions(ready_timeout_s=1.5, canary_timeout_s=5, canary_retries=0, max_near_ties=3)
    assert s.rollout().run() == 0


def test_a_failure_on_the_second_replica_takes_the_first_back_too(scene) -> None:
    s = scene(script={(1, "B"): "wrong"})
    assert s.rollout().run() == 1
    assert s.serving() == ["A", "A"]
    st = load_state(s.opts.state_path)
    assert st is not None and st.failure["replica"] == 1 and st.failure["fleet_back_on_from"]
    assert [(x["replica"], x["rollback"]) for x in st.switches] == [(0, False), (1, False), (1, True), (0, True)]


def test_a_failed_rollback_says_the_fleet_is_not_back(scene) -> None:
    s = scene(script={(0, "B"): "wrong", (0, "A"): "exit"})
    # already on A (a bring-up would meet the "exit" scripted for A)
    for r, f in zip(s.records, s.fakes, strict=True):
        s.state.mark(r, "serving", KEYS["A"])
        f.serving = s.goldens[KEYS["A"]]
    assert s.rollout().run() == 1
    st = load_state(s.opts.state_path)
    assert st is not None and not st.failure["fleet_back_on_from"] and "NOT all replicas" in st.failure["fleet"]
    assert st.replicas[0].phase == "down"


def test_soak_failure_rolls_the_whole_fleet_back(scene) -> None:
    s = scene(soak_s=0.2)

    def corrupt(state: RolloutState) -> None:  # replica 1 starts answering as C after its switch
        if state.replicas[1].serving == KEYS["B"] and s.fakes[1].serving is s.goldens[KEYS["B"]]:
            s.fakes[1].serving = golden(9, KEYS["B"])
    s.hooks.append(corrupt)
    assert s.rollout().run() == 1
    assert s.serving() == ["A", "A"]
    st = load_state(s.opts.state_path)
    assert st is not None and st.failure["replica"] == 1 and "after the soak" in st.failure["detail"]
    assert KEYS["A"] not in s.daemons.released


class Killed(BaseException):
    """Stands for kill -9: nothing after the raise runs, the state file stays as written."""


@pytest.mark.parametrize("when", ["before_start", "after_start"])
def test_killed_mid_switch_then_run_again_finishes(scene, when) -> None:
    s = scene()

    def kill(state: RolloutState) -> None:
        r = state.replicas[1]
        if r.phase == "switching" and r.target == KEYS["B"]:
            if (when == "before_start" and r.started_onto is None) or (when == "after_start" and r.started_onto == KEYS["B"]):
                s.hooks.clear()
                raise Killed()
    s.hooks.append(kill)
    with pytest.raises(Killed):
        s.rollout().run()
    st = load_state(s.opts.state_path)
    assert st is not None and [r.phase for r in st.replicas] == ["serving", "switching"]
    assert st.replicas[1].target == KEYS["B"] and st.replicas[0].serving == KEYS["B"]
    restarts_before = list(s.driver.restarts)
    again = FakeDriver(s.driver.replicas, s.goldens, {}, restarts=[])
    assert s.rollout(st, again).run() == 0
    assert s.serving() == ["B", "B"]
    # after the start, the process it began is waited for, not started again
    assert again.restarts == ([] if when == "after_start" else [(1, "B")]), (restarts_before, again.restarts)
    assert load_state(s.opts.state_path).status == "done"


def test_killed_mid_rollback_then_run_again_completes_it_and_fails(scene) -> None:
    s = scene(script={(0, "B"): "wrong"})

    def kill(state: RolloutState) -> None:
        if state.replicas[0].phase == "rolling_back" and state.replicas[0].started_onto == KEYS["A"]:
            s.hooks.clear()
            raise Killed()
    s.hooks.append(kill)
    with pytest.raises(Killed):
        s.rollout().run()
    st = load_state(s.opts.state_path)
    assert st is not None and st.replicas[0].phase == "rolling_back"
    assert s.rollout(st, FakeDriver(s.driver.replicas, s.goldens, {})).run() == 1
    st = load_state(s.opts.state_path)
    assert st.status == "failed" and s.serving() == ["A", "A"] and st.failure["fleet_back_on_from"]


def test_sequence_keeps_at_most_two_resident_and_evicts_the_oldest_after_every_replica_left(scene) -> None:
    s = scene(to="BC", keep_from=True)
    seen: list[set[str]] = []
    s.hooks.append(lambda st: seen.append(set(s.daemons.live)))
    assert s.rollout().run() == 0
    assert s.serving() == ["C", "C"]
    assert max(len(x) for x in seen) == 2
    assert s.daemons.released == [KEYS["A"]]  # A went before C was preloaded; B kept (--keep-from)
    assert s.daemons.started.index(KEYS["C"]) > 0 and set(s.daemons.live) == {KEYS["B"], KEYS["C"]}


def test_sequence_without_keep_from_releases_each_old_checkpoint(scene) -> None:
    s = scene(to="BC")
    assert s.rollout().run() == 0
    assert s.daemons.released == [KEYS["A"], KEYS["B"]]


def test_budget_that_fits_passes(scene) -> None:
    """The control of the refusal below: the same sizes under a budget that holds both."""
    s = scene(memory_budget=200 << 20)
    s.daemons.sizes = {"/ckpt/A": 100 << 20, "/ckpt/B": 100 << 20}
    assert s.rollout().run() == 0


def test_budget_refusal_names_the_sizes_before_any_replica_moves(scene) -> None:
    s = scene(memory_budget=150 << 20)
    s.daemons.sizes = {"/ckpt/A": 100 << 20, "/ckpt/B": 100 << 20}
    with pytest.raises(BudgetError) as e:
        s.rollout().run()
    msg = str(e.value)
    assert "B (/ckpt/B) needs 100.0 MiB beside A 100.0 MiB resident: 200.0 MiB of a 150.0 MiB --memory-budget" in msg
    assert "--evict-first" in msg
    assert all(label == "A" for _, label in s.driver.restarts)


def test_evict_first_stops_the_old_daemon_first_and_says_so(scene) -> None:
    s = scene(memory_budget=150 << 20, evict_first=True)
    s.daemons.sizes = {"/ckpt/A": 100 << 20, "/ckpt/B": 100 << 20}
    assert s.rollout().run() == 0
    assert s.daemons.released[0] == KEYS["A"] and s.daemons.started[-1] == KEYS["B"]
    assert any("--evict-first" in n and "reloads it from disk" in n for n in s.state.notes)


def test_abort_rolls_an_unfinished_rollout_back(scene) -> None:
    s = scene()
    s.opts.abort = True
    s.state.mark(s.records[0], "serving", KEYS["B"])
    s.state.mark(s.records[1], "serving", KEYS["A"])
    s.fakes[0].serving, s.fakes[1].serving = s.goldens[KEYS["B"]], s.goldens[KEYS["A"]]
    s.daemons.live = {k: s.daemons.start(type("R", (), {"key": k, "checkpoint": f"/ckpt/{L}", "socket_root": "/"})())
                      for L, k in (("A", KEYS["A"]), ("B", KEYS["B"]))}
    assert s.rollout().run() == 1
    assert s.serving() == ["A", "A"] and "aborted" in load_state(s.opts.state_path).failure["reason"]


def test_killed_during_bring_up_then_run_again_waits_for_the_started_replicas(scene) -> None:
    s = scene()

    def kill(state: RolloutState) -> None:
        if all(r.phase == "starting" and r.started_onto == KEYS["A"] for r in state.replicas):
            s.hooks.clear()
            raise Killed()
    s.hooks.append(kill)
    with pytest.raises(Killed):
        s.rollout().run()
    st = load_state(s.opts.state_path)
    assert st is not None and [r.phase for r in st.replicas] == ["starting", "starting"]  # A or nothing: not unknown
    again = FakeDriver(s.driver.replicas, s.goldens, {}, restarts=[])
    assert s.rollout(st, again).run() == 0
    assert again.restarts == [(0, "B"), (1, "B")] and s.serving() == ["B", "B"]
