"""A node that sees other files at the candidate's path never passes (issue 37, item 2).

The driver hashes the candidate; a Ray worker node may see other content at
the same path (another mount, a stale local copy). The stand-in executor
below is the Ray executor's shape with a per-node path rewrite: node
``node-b`` reads every path through its own view, so its daemon and its
engines load the other checkpoint and agree with each other. Each engine
reports the digest of what it was given where it ran
(:func:`harness.gate.schedule.run_seen`); the runner compares it with the
promoted candidate's: NOT_RUN naming the node, the path and both digests.
Control: with that comparison switched off, the case is judged as if the
node had run the candidate. A second test holds the field's exact shape
(expected miss, load miss, equal tokens) at the judge: PASS under the old
rule, NOT_RUN now. Errors raised on a node reach the report as plain text.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

import pytest
from fake_engines import FakeDaemon

from fixtures.tiny import write_tiny
from harness.engine import EngineResult
from harness.gate import GateOptions, run_gate
from harness.gate.schedule import EngineJob, LocalExecutor, Outcome, plain_error, run_seen
from harness.targets.digests import Digests
from harness.targets.verified_cache import VerifiedCacheTarget
from harness.verdict import NOT_RUN, PASS
from preload.identity.digest import content_digest

pytestmark = pytest.mark.unit
HERE = Path(__file__).resolve().parent
NODE = "node-b"


@pytest.fixture
def stand_ins(monkeypatch, tmp_path):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("PRELOAD_GATE_CACHE", str(tmp_path / "manifests"))
    monkeypatch.setattr(VerifiedCacheTarget, "engine_worker", "fake_engines")
    monkeypatch.setattr(VerifiedCacheTarget, "reference_worker", "fake_engines")
    monkeypatch.setattr("harness.targets.verified_cache.DaemonProcess", FakeDaemon)


class NodeViewExecutor(LocalExecutor):
    """Every cache and engine on ``node-b``, which reads ``view[path]`` where it is given ``path``."""

    def __init__(self, view: dict[str, Path], socket_root: Path) -> None:
        super().__init__(1)
        self.view, self.socket_root = view, socket_root

    def _seen(self, path: str | Path) -> Path:
        return self.view.get(str(path), Path(path))

    def prepare(self, target, base, settings, ctx):
        node = Digests(str(self.socket_root))  # the node's own digests, as _DaemonHost makes them
        nctx = dataclasses.replace(ctx, digest_of=node.of, promote=node.promoted, socket_root=str(self.socket_root))
        cache = target.prepare(self._seen(base), settings, nctx)
        cache.node = NODE
        return [cache]

    def run(self, job: EngineJob) -> Outcome:
        spec = dataclasses.replace(job.spec, checkpoint=str(self._seen(job.spec.checkpoint)))
        result = run_seen(spec, job.workdir, job.timeout_s, job.worker)
        return Outcome(result, node=NODE, attempts=[{"node": NODE, "ok": result.ok}])


def _gate_on_node_b(tiny_ckpt, tmp_path):
    cand = tmp_path / "cand"
    shutil.copytree(tiny_ckpt, cand)
    other = tmp_path / "node-b-copy"
    write_tiny(other, seed=7)  # what node-b finds at the candidate's path
    sock = tmp_path / "sock"
    sock.mkdir(mode=0o700)
    ex = NodeViewExecutor({str(cand): other, os.path.realpath(cand): other}, sock)
    report = run_gate(GateOptions(candidate=str(cand), workdir=str(tmp_path / "w"), socket_root=str(sock),
                                  reference_cache=str(tmp_path / "refs"), report_dir=str(tmp_path / "r"),
                                  record_golden=False),
                      executor=ex)
    return report, content_digest(cand), content_digest(other), cand


def test_a_node_that_sees_other_content_is_not_run_with_both_digests(tiny_ckpt, tmp_path, stand_ins):
    report, want, seen, cand = _gate_on_node_b(tiny_ckpt, tmp_path)
    (case,) = report.cases
    assert case.status == NOT_RUN and report.exit_code == 2, (case.status, case.not_run_reason)
    why = case.not_run_reason
    assert "contradicting observations" in why and f"node {NODE}" in why and str(cand) in why
    assert want in why and seen in why, why


def test_control_without_the_comparison_the_node_is_judged_as_the_candidate(tiny_ckpt, tmp_path, stand_ins,
                                                                           monkeypatch):
    monkeypatch.setattr("harness.gate.runner._contradiction", lambda plan, it: "")
    report, *_ = _gate_on_node_b(tiny_ckpt, tmp_path)
    (case,) = report.cases
    assert case.status != NOT_RUN and case.verdict is not None, case.not_run_reason


def _field_case(tiny_ckpt, tmp_path):
    """The field's shape: expected miss (the node's daemon digest differs),
    a load miss, equal tokens, on node-b, whose engines saw other content."""
    from gate_cases import prepare

    from harness.gate.cases import promotion_case
    from harness.gate.runner import judge_case
    from harness.targets.base import PreparedCache

    other = tmp_path / "other"
    write_tiny(other, seed=7)
    seen = content_digest(other)
    sock = tmp_path / "s"
    sock.mkdir(mode=0o700)
    opts = GateOptions(candidate=str(tiny_ckpt))
    plan, p = prepare(opts, promotion_case(opts), seen, tmp_path / "w", str(sock))
    p.caches = [dataclasses.replace(p.caches[0], node=NODE)]
    answers = {"token_ids": [[1, 2]], "logprobs": [[{"1": -0.1}, {"2": -0.2}]], "weights_digest": seen}
    p.result.placement = {"cached": {"node": NODE}, "reference": {"node": NODE}}
    p.result.reference = EngineResult(ok=True, **answers)
    p.result.cached = EngineResult(ok=True, **answers, events=[
        {"outcome": "miss", "rank": 0, "reason": "stale manifest", "fields": ["content_digest"], "digest": seen,
         "daemon_digest": seen}])
    assert isinstance(p.caches[0], PreparedCache) and p.result.expect == "miss"
    judge_case(plan, p)
    return p.result, seen


def test_the_fields_expected_miss_load_miss_on_other_content_is_not_run(tiny_ckpt, tmp_path, monkeypatch):
    monkeypatch.setattr("harness.gate.fingerprints.HEADER_IMPL", "reimpl")
    res, seen = _field_case(tiny_ckpt, tmp_path)
    assert res.status == NOT_RUN and seen in res.not_run_reason and NODE in res.not_run_reason
    assert res.candidate_digest in res.not_run_reason


def test_control_the_fields_case_passes_under_the_old_rule(tiny_ckpt, tmp_path, monkeypatch):
    monkeypatch.setattr("harness.gate.fingerprints.HEADER_IMPL", "reimpl")
    monkeypatch.setattr("harness.gate.runner._contradiction", lambda plan, it: "")
    res, _ = _field_case(tiny_ckpt, tmp_path)
    assert res.status == PASS, res.verdict


class _RayTaskError(Exception):
    """Ray's wrapper of an error raised on a node: a coloured header, the node's exception as ``cause``."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__("\x1b[36mray::_DaemonHost.prepare()\x1b[39m (pid=4242, ip=10.0.0.2, "
                         "actor_id=ab12)\n  File ...\nFileNotFoundError: ...")
        self.cause = cause


def test_an_error_raised_on_a_node_reaches_the_report_as_plain_text():
    err = _RayTaskError(FileNotFoundError("checkpoint /models/cand does not exist on this node"))
    assert plain_error(err) == "FileNotFoundError: checkpoint /models/cand does not exist on this node"
    header_only = plain_error(RuntimeError("\x1b[31mray::f()\x1b[0m (pid=1)\nmore"))
    assert header_only == "RuntimeError: ray::f() (pid=1)" and "\x1b" not in header_only
