"""The gate on a Ray cluster of two nodes on this machine, real daemons and engines.

One module-scoped ``ray.cluster_utils.Cluster`` (:class:`harness.bench.ray_cluster.LocalCluster`):
two nodes of one CPU each, each with its own daemon socket root. Expensive
(a daemon per node, each engine start 20-45 s on two cores), so two tests:

- the tiny self-test on both nodes gives the local run's verdicts (the local
  run reuses the cluster run's references: only its cached engines start),
  every cached engine ran on the node of the daemon its spec pointed at
  (from the report), the cases' cached engines used both nodes, and
  ``dp_shift`` (two engine cores: more than a node holds next to its daemon)
  is a named NOT_RUN, never started elsewhere;
- a node removed while its case's cached engine runs: the case is NOT_RUN
  with the reason, never PASS (the only daemon holding the digest was there).
  Its case is ``zeroed_norm``, whose reference the first test left in the
  module's ``refcache``: the one engine that starts is the cached one killed.

The placement rules without Ray (re-run elsewhere, deadlines, spread) are
tests/unit/test_gate_ray_placement.py.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from harness.gate import GateOptions, run_gate
from harness.verdict import NOT_RUN, PASS

pytest.importorskip("ray", reason="the Ray executor needs its extra: pip install 'preload-gate[ray]'")

pytestmark = [pytest.mark.cpu, pytest.mark.slow, pytest.mark.xdist_group(name="ray")]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    from harness.bench.ray_cluster import LocalCluster

    with LocalCluster([{"CPU": 1}, {"CPU": 1}], tmp_path_factory.mktemp("ray")) as c:
        yield c


@pytest.fixture(scope="module")
def refcache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("refcache")


def _executor(cluster, **kw):
    from harness.gate.ray_executor import RayExecutor

    return RayExecutor(cluster.address, **kw)


def test_self_test_on_two_nodes_gives_the_local_verdicts(cluster, tiny_ckpt, tmp_path, refcache):
    mutations = "identical_copy,zeroed_norm,dp_shift"
    report = run_gate(GateOptions(candidate=str(tiny_ckpt), mutations=mutations, workdir=str(tmp_path / "ray"),
                                  reference_cache=str(refcache)), executor=_executor(cluster))
    cases = {c.name: c for c in report.cases}
    assert report.executor["kind"] == "ray" and len(report.executor["nodes"]) == 2
    assert sorted(report.daemon["nodes"]) == sorted(cluster.node_ids)  # a daemon on each node
    dp = cases.pop("dp_shift")
    assert dp.status == NOT_RUN and dp.verdict is None
    assert "cannot be placed next to its daemon" in dp.not_run_reason and "'CPU': 2.0" in dp.not_run_reason
    assert all(a["started"] is False for a in dp.placement["cached"]["attempts"])  # never sent anywhere
    ran = set()
    for name, case in cases.items():
        cached = case.placement["cached"]
        (attempt,) = cached["attempts"]
        assert attempt["node"] == attempt["placed_on"] == cached["node"], (name, cached)
        ran.add(cached["node"])
    assert ran == set(cluster.node_ids), "the cached engines used both nodes"

    local = run_gate(GateOptions(candidate=str(tiny_ckpt), mutations="identical_copy,zeroed_norm",
                                 workdir=str(tmp_path / "local"), reference_cache=str(refcache)))
    assert local.executor["kind"] == "local"
    for c in local.cases:
        r = cases[c.name]
        assert c.status == r.status == PASS, (c.name, c.verdict and c.verdict.details, r.not_run_reason)
        assert (c.verdict.outcome, c.verdict.reasons) == (r.verdict.outcome, r.verdict.reasons)
        assert c.cached.token_ids == r.cached.token_ids
    assert {c.name: c.verdict.outcome for c in local.cases} == {"identical_copy": "hit", "zeroed_norm": "miss"}


def test_a_node_removed_while_its_case_runs_is_not_run_never_pass(cluster, tiny_ckpt, tmp_path, refcache):
    # A third node is the only one with the resource every engine asks for:
    # the only daemon, and every engine, are there.
    node = cluster.add({"CPU": 1, "only_here": 1})
    work = tmp_path / "work"
    started = threading.Event()

    def note(stage: str, msg: str) -> None:
        if stage == "engine-start" and msg.startswith("cached"):
            started.set()

    box: list = []
    t = threading.Thread(target=lambda: box.append(run_gate(
        GateOptions(candidate=str(tiny_ckpt), mutations="zeroed_norm", workdir=str(work),
                    reference_cache=str(refcache), progress=note),
        executor=_executor(cluster, resources={"only_here": 1.0}))))
    t.start()
    assert started.wait(600), "the cached engine never started"
    log = work / "engines" / "cached-zeroed_norm" / "engine.log"
    deadline = time.monotonic() + 300
    while not (log.exists() and log.stat().st_size > 0) and time.monotonic() < deadline:
        time.sleep(0.5)  # the engine is running on the node
    cluster.remove(node)
    t.join(600)
    (report,) = box
    (case,) = report.cases
    assert case.reference_reused, "the first test's reference is reused: only the cached engine starts"
    assert case.status == NOT_RUN and case.verdict is None and report.exit_code == 2
    assert "the cached engine was not run" in case.not_run_reason and node[:12] in case.not_run_reason
    attempts = case.placement["cached"]["attempts"]
    assert attempts[0]["node"] == node and attempts[0]["started"] and not attempts[0]["ok"]

