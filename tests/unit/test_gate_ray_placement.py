"""The Ray executor's placement rules, without Ray: a stand-in cluster.

``harness.gate.ray_executor.RayExecutor`` asks Ray for nodes, sends each
engine to one with ``NodeAffinitySchedulingStrategy(soft=False)`` and reads
what comes back. The stand-in below is that surface (``nodes``, ``remote``,
``get``, ``cancel``, ``kill``), with a script saying what each node does
with a run: answer, die under it, or never answer. The real thing, a
two-node ``ray.cluster_utils.Cluster`` with real engines, is
tests/cpu/test_gate_ray.py; this file holds the rules in the unit tier,
where ray is not installed.

- a node lost under a cached engine: re-run on the other node whose daemon
  holds the digest; with one attempt allowed (control), NOT_RUN naming it;
- a run that never answers: NOT_RUN after its deadline, never a result;
- a cached engine its daemon's node cannot hold: NOT_RUN naming why, and no
  run sent to a node with room but no daemon (control: a reference with the
  same request runs there);
- two cached engines at once spread over both daemons' nodes;
- bad input: ``--ray-resource``, ``--ray`` without the package, ``--ray auto``
  without ``RAY_ADDRESS``: one line, exit 2, before anything starts.
"""

from __future__ import annotations

import sys
import threading
import types
from pathlib import Path
from typing import Any

import pytest

from harness.engine import EngineResult, EngineSpec
from harness.gate.options import GateSetupError
from harness.gate.schedule import EngineJob, Placement

pytestmark = pytest.mark.unit


class _Affinity:
    def __init__(self, node_id: str, soft: bool) -> None:
        self.node_id, self.soft = node_id, soft


class _Ref:
    def __init__(self, cluster: FakeRay, node: str, args: tuple[Any, ...]) -> None:
        self.cluster, self.node, self.args = cluster, node, args


class _Remote:
    def __init__(self, cluster: FakeRay, opts: dict[str, Any] | None = None) -> None:
        self.cluster, self.opts = cluster, opts or {}

    def options(self, **opts: Any) -> _Remote:
        return _Remote(self.cluster, opts)

    def remote(self, *args: Any) -> _Ref:
        strategy = self.opts["scheduling_strategy"]
        assert strategy.soft is False  # every run is pinned to the node it was admitted on
        self.cluster.sent.append((strategy.node_id, dict(self.opts)))
        return _Ref(self.cluster, strategy.node_id, args)


class FakeRay(types.ModuleType):
    """The part of ``ray`` the executor uses; ``script[node]`` says what a run there does:
    ``"ok"``, ``"die"`` (the node is lost under it) or ``"hang"`` (never answers)."""

    def __init__(self, nodes: dict[str, dict[str, float]], script: dict[str, str]) -> None:
        super().__init__("ray")
        self.resources, self.script = nodes, script
        self.alive = set(nodes)
        self.sent: list[tuple[str, dict[str, Any]]] = []
        self.gate = threading.Barrier(1)
        self.exceptions = types.SimpleNamespace(GetTimeoutError=type("GetTimeoutError", (Exception,), {}))

    def is_initialized(self) -> bool:
        return True

    def nodes(self) -> list[dict[str, Any]]:
        return [{"NodeID": n, "Alive": n in self.alive, "Resources": r} for n, r in self.resources.items()]

    def remote(self, fn: Any = None, **_kw: Any) -> Any:
        return _Remote(self) if fn is not None else (lambda _f: _Remote(self))

    def get(self, ref: _Ref, timeout: float | None = None) -> dict[str, Any]:
        self.gate.wait(timeout=10)
        what = self.script.get(ref.node, "ok")
        if what == "die":
            self.alive.discard(ref.node)
            raise RuntimeError(f"NodeDiedError: node {ref.node} died")
        if what == "hang":
            raise self.exceptions.GetTimeoutError("timed out")
        return {"result": EngineResult(ok=True, token_ids=[[1, 2]]).to_json(), "node": ref.node, "log": "ran\n"}

    def cancel(self, ref: _Ref, force: bool = False) -> None:
        pass

    def kill(self, handle: Any) -> None:
        pass


@pytest.fixture
def cluster(monkeypatch):
    def make(nodes: dict[str, dict[str, float]], script: dict[str, str] | None = None, **kw: Any):
        fake = FakeRay(nodes, script or {})
        util = types.ModuleType("ray.util")
        strategies = types.ModuleType("ray.util.scheduling_strategies")
        strategies.NodeAffinitySchedulingStrategy = _Affinity  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, "ray", fake)
        monkeypatch.setitem(sys.modules, "ray.util", util)
        monkeypatch.setitem(sys.modules, "ray.util.scheduling_strategies", strategies)
        from harness.gate import ray_executor
        from harness.gate.ray_executor import RayExecutor

        # The address is read by Ray's own helpers (test_cli_bad_input.py's RAY_BAD rows); the stand-in has none.
        monkeypatch.setattr(ray_executor, "ray_endpoint", lambda address, flag="--ray": ("head", 10001))
        ex = RayExecutor("ray://head:10001", **kw)
        ex.poll_s = 0.01
        return fake, ex

    return make


def _job(tmp: Path, nodes: list[str | None], kind: str = "cached", tp: int = 1, label: str = "c") -> EngineJob:
    spec = EngineSpec(checkpoint="/models/m", tensor_parallel_size=tp)
    return EngineJob(kind, f"{kind}:{label}", label, [Placement(n, spec) for n in nodes], "harness.engine_worker",
                     tmp / label, 5.0)


def test_a_node_lost_under_a_cached_engine_reruns_it_next_to_the_other_daemon(cluster, tmp_path):
    fake, ex = cluster({"A": {"CPU": 1}, "B": {"CPU": 1}}, {"A": "die"})
    out = ex.run(_job(tmp_path, ["A", "B"]))
    assert out.result.ok and out.node == "B" and not out.not_run
    assert [a["node"] for a in out.attempts] == ["A", "B"] and "NodeDiedError" in out.attempts[0]["why"]
    assert (tmp_path / "c" / "engine.log").read_text() == "ran\n"  # the node's log, where the judge reads it


def test_control_one_attempt_allowed_the_lost_node_makes_it_not_run(cluster, tmp_path):
    fake, ex = cluster({"A": {"CPU": 1}, "B": {"CPU": 1}}, {"A": "die"}, max_attempts=1)
    out = ex.run(_job(tmp_path, ["A", "B"]))
    assert not out.result.ok and out.node is None
    assert "after 1 run(s)" in out.not_run and "node A: RuntimeError: NodeDiedError" in out.not_run
    assert [n for n, _ in fake.sent] == ["A"]


def test_a_run_that_never_answers_is_not_run_after_its_deadline(cluster, tmp_path):
    fake, ex = cluster({"A": {"CPU": 1}}, {"A": "hang"}, place_timeout_s=1.0)
    out = ex.run(_job(tmp_path, ["A"]))
    assert not out.result.ok and "did not finish in 6 s" in out.not_run, out.not_run


def test_a_cached_engine_its_daemons_node_cannot_hold_is_not_run_and_never_sent_elsewhere(cluster, tmp_path):
    # A holds the daemon but one core; C has room and no daemon. TP=2 needs two.
    fake, ex = cluster({"A": {"CPU": 1}, "C": {"CPU": 4}})
    out = ex.run(_job(tmp_path, ["A"], tp=2))
    assert not out.result.ok and fake.sent == []
    assert "cannot be placed next to its daemon: node A has {'CPU': 1}, the engine needs {'CPU': 2.0}" in out.not_run
    # Control: a reference (anywhere) with the same request runs on C.
    ref = ex.run(_job(tmp_path, [None], kind="reference", tp=2, label="r"))
    assert ref.result.ok and ref.node == "C" and fake.sent[0][1]["num_cpus"] == 2.0


def test_no_node_with_room_anywhere_is_a_named_not_run(cluster, tmp_path):
    fake, ex = cluster({"A": {"CPU": 1}}, resources={"accel": 1.0})
    out = ex.run(_job(tmp_path, [None], kind="reference"))
    assert "cannot be placed: no alive node has {'CPU': 1.0, 'accel': 1.0}" in out.not_run and fake.sent == []


def test_two_cached_engines_at_once_spread_over_both_daemons_nodes(cluster, tmp_path):
    fake, ex = cluster({"A": {"CPU": 2}, "B": {"CPU": 2}})
    fake.gate = threading.Barrier(2)  # neither answers before both were sent
    outs: list[Any] = [None, None]
    threads = [threading.Thread(target=lambda i=i: outs.__setitem__(i, ex.run(_job(tmp_path, ["A", "B"],
                                                                                     label=f"c{i}"))))
               for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert sorted(o.node for o in outs) == ["A", "B"]
    assert ex.used_nodes == {"A", "B"}


@pytest.mark.parametrize("items, error", [
    (["accel=1", "pool=0.5"], None),
    (["accel"], "give NAME=N"),
    (["accel=0"], "give NAME=N"),
    (["accel=x"], "give NAME=N"),
    (["CPU=2"], "CPU and GPU follow from the engine's parallelism"),
])
def test_ray_resource_values(items, error):
    from harness.gate.ray_executor import parse_resources

    if error is None:
        assert parse_resources(items) == {"accel": 1.0, "pool": 0.5}
    else:
        with pytest.raises(GateSetupError, match=error):
            parse_resources(items)


@pytest.mark.parametrize("argv, env, message", [
    (["--ray", "ray://head:10001"], {}, "--ray needs the ray package"),
    (["--ray-resource", "accel=1"], {}, "--ray-resource applies with --ray ADDRESS"),
    (["--ray", "auto", "--ray-resource", "bad"], {}, "--ray-resource 'bad': give NAME=N"),
])
def test_cli_ray_bad_input_is_one_line_exit_2(tiny_ckpt, tmp_path, monkeypatch, capsys, argv, env, message):
    from preload_gate.cli import main

    monkeypatch.setitem(sys.modules, "ray", None)  # not installed
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    out = tmp_path / "report"
    rc = main(["gate", str(tiny_ckpt), "--mutations", "identical_copy", "--report", str(out), *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and message in err[0], err
    assert not out.exists()


def test_cli_ray_auto_without_ray_address_is_refused(tiny_ckpt, tmp_path, monkeypatch, capsys, cluster):
    cluster({"A": {"CPU": 1}})  # ray "installed"
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    from preload_gate.cli import main

    rc = main(["gate", str(tiny_ckpt), "--mutations", "identical_copy", "--ray", "auto"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "--ray auto reads RAY_ADDRESS, which is not set" in err[0], err


@pytest.mark.parametrize("address, endpoint", [
    ("ray://head:10001", ("head", 10001)),
    ("head:6379", ("head", 6379)),
    ("10.1.2.3:6379", ("10.1.2.3", 6379)),
    ("local", None),  # Ray starts a cluster here: nothing to reach
])
def test_good_ray_addresses_are_read_as_ray_reads_them(address, endpoint):
    """Control for the RAY_BAD rows of test_cli_bad_input.py: the forms Ray takes pass the shape check."""
    pytest.importorskip("ray")
    from harness.gate.ray_executor import ray_endpoint

    assert ray_endpoint(address) == endpoint


def test_an_unreachable_head_is_refused_in_seconds_and_a_listening_one_passes():
    """The probe before ray.init: a closed port is one GateSetupError naming it,
    well inside the probe's timeout; control: a port something listens on passes."""
    import socket
    import time

    from harness.gate.ray_executor import check_reachable

    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen(1)
        check_reachable("--ray x", listening.getsockname())  # no error
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            closed = s.getsockname()
    t0 = time.monotonic()
    with pytest.raises(GateSetupError, match=rf"--ray x: cannot reach a Ray cluster at 127.0.0.1:{closed[1]} "
                                             r"\(Connection refused\); on the head node run `ray status`"):
        check_reachable("--ray x", closed)
    assert time.monotonic() - t0 < 5
