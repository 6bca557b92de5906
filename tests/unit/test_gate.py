"""Gate logic without engines: case catalogue, key checks, exit codes, ipc_cache, bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from fixtures.mutations import MUTATIONS, by_name
from harness.engine import EngineResult, EngineSpec
from harness.gate import (
    CaseResult,
    GateOptions,
    GateReport,
    GateSetupError,
    ReferenceCache,
    run_gate,
)
from harness.mutations import (
    CASES,
    TARGET_CASES,
    CaseSelectionError,
    EngineSettings,
    GateCase,
    dense_key,
    select_cases,
)
from harness.verdict import BLOCK, NOT_RUN, PASS, Verdict
from pgbase.errors import CheckpointError

pytestmark = pytest.mark.unit
DIGEST = "d" * 64


# The gate's cases as ``--mutations all`` runs them, in order, then the rows
# only some targets run: name -> (required outcome for a dense model, key
# fields the cache and engine keys must differ in, runs end to end on CPU,
# served through the OpenAI server). Written out so that a change to the
# catalogue or to its derivation rules that moves any of these fails here.
GATE_CASES = {
    "identical_copy": ("hit", (), True, False),
    # Every value edit: a loud miss on the content digest.
    **dict.fromkeys(("zeroed_norm", "tail_edit", "mid_row_zeroed", "single_element", "finetune_noise",
                     "constant_shift", "first_row_zeroed", "stale_derivation", "inplace_overwrite",
                     "inplace_mtime_restored"), ("miss", ("content_digest",), True, False)),
    "dtype_change": ("miss", ("dtype",), True, False),
    "tp_shift": ("miss", ("tp_size",), False, False),
    "dp_shift": ("hit", (), True, True),
}
TARGET_ONLY = {"tp_2_to_1": ("miss", ("tp_size",), True, False)}


def _gate_reading(cases) -> list[tuple[str, tuple]]:
    return [(c.name, (c.expect, c.expected_fields, not c.cpu_skip, c.server)) for c in cases]


def test_the_gates_cases_and_what_each_requires():
    assert _gate_reading(CASES) == list(GATE_CASES.items())
    assert _gate_reading(TARGET_CASES) == list(TARGET_ONLY.items())
    assert [c.name for c in select_cases("all")] == list(GATE_CASES)
    # A file case makes its candidate with the catalogue's own row, not a copy of it.
    for case in CASES:
        assert (case.recipe is by_name(case.name)) == (case.name in {m.name for m in MUTATIONS})


@pytest.mark.parametrize("case", [c for c in CASES + TARGET_CASES if c.recipe is None], ids=lambda c: c.name)
def test_a_setting_rows_key_fields_are_what_the_product_key_changes(case: GateCase):
    """The catalogue derives a setting row's key fields from the settings it
    changes; the product's own key (rank_key) must differ in exactly those."""
    check = case.key_check(DIGEST)
    assert check.ok and set(check.mismatched_fields) == set(case.expected_fields)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_required_outcome_follows_weights_and_the_product_key(case: GateCase):
    # dense model: DP replicas hold the full weights, so dp_shift must hit
    unchanged_key = not case.key_check(DIGEST).mismatched_fields
    assert case.expect == ("hit" if case.weights_equal and unchanged_key else "miss")
    if case.name == "dp_shift":
        assert case.expect == "hit"


@pytest.mark.parametrize("name,field", [("dtype_change", "dtype"), ("tp_shift", "tp_size")])
def test_setting_cases_key_check_names_the_field(name, field):
    (case,) = select_cases(name)
    check = case.key_check(DIGEST)
    assert field in check.mismatched_fields and check.ok


def test_dp_shift_key_follows_the_products_moe_rule():
    """Same function as the loader and daemon (rank_key): dense keys DP as
    (1, 0); MoE keys it by size, so a MoE dp_shift would require a miss."""
    (case,) = select_cases("dp_shift")
    assert case.key_check(DIGEST, is_moe=False).mismatched_fields == ()
    assert "dp_size" in case.key_check(DIGEST, is_moe=True).mismatched_fields


def test_key_check_fails_when_settings_do_not_change_the_key():
    # Control: a "shift" that changes nothing must not pass the key check.
    fake = GateCase("no_shift", "", recipe=None, weights_equal=True, expected_fields=("dtype",))
    assert not fake.key_check(DIGEST).ok
    # and a dense model keys DP as (1, 0): DP alone does not change its key.
    assert dense_key(DIGEST, EngineSettings(data_parallel_size=2)) == dense_key(DIGEST, EngineSettings())


def test_select_cases_rejects_unknown_names():
    assert [c.name for c in select_cases("zeroed_norm, tail_edit")] == ["zeroed_norm", "tail_edit"]
    with pytest.raises(CaseSelectionError, match="unknown mutation nope"):
        select_cases("zeroed_norm,nope")


def _case(status: str) -> CaseResult:
    v = None if status == NOT_RUN else Verdict(status, ["output_mismatch"] if status == BLOCK else [])
    return CaseResult("c", "", "hit", True, {}, status, verdict=v, not_run_reason="x" if status == NOT_RUN else "")


@pytest.mark.parametrize(
    "statuses,verdict,code",
    [
        ([PASS, PASS], PASS, 0),
        ([PASS, NOT_RUN], PASS, 0),  # not run is listed, the cases that ran decide
        ([PASS, BLOCK, NOT_RUN], BLOCK, 1),
        ([NOT_RUN, NOT_RUN], NOT_RUN, 2),  # nothing ran: never a pass
        ([], NOT_RUN, 2),
    ],
)
def test_exit_codes(statuses, verdict, code):
    r = GateReport("self-test", "verified_cache", "c", "b", [_case(s) for s in statuses], {}, 1e-3, None)
    assert (r.verdict, r.exit_code) == (verdict, code)
    assert r.counts[PASS] == statuses.count(PASS)


def test_error_with_passes_is_not_a_pass():
    r = GateReport("self-test", "verified_cache", "c", "b", [_case(PASS)], {}, 1e-3, None, error="daemon died")
    assert r.exit_code == 2


def test_ipc_cache_on_cpu_runs_nothing_and_exits_2(tiny_ckpt):
    report = run_gate(GateOptions(candidate=str(tiny_ckpt), mutations="all", target="ipc_cache"))
    assert report.exit_code == 2 and report.verdict == NOT_RUN
    assert len(report.cases) == len(CASES)
    assert all(c.status == NOT_RUN and "CUDA" in c.not_run_reason for c in report.cases)


def test_cli_ipc_cache_exit_2_and_json(tiny_ckpt, tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "preload_gate", "gate", str(tiny_ckpt), "--mutations", "zeroed_norm",
         "--target", "ipc_cache", "--json", "--report", str(tmp_path / "r")],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["counts"] == {"PASS": 0, "BLOCK": 0, "NOT_RUN": 1}
    assert {p.name for p in (tmp_path / "r").iterdir()} >= {"report.json", "report.md", "report.xml", "report.html"}


@pytest.mark.parametrize("argv,needle", [
    (["gate", "/nonexistent/ckpt", "--mutations", "all"], "does not exist"),
    (["gate", "{tiny}", "--mutations", "bogus"], "unknown mutation bogus"),
])
def test_cli_bad_input_is_one_line_exit_2(tiny_ckpt, argv, needle):
    argv = [a.replace("{tiny}", str(tiny_ckpt)) for a in argv]
    proc = subprocess.run([sys.executable, "-m", "preload_gate", *argv], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    err = [ln for ln in proc.stderr.splitlines() if ln.startswith("preload-gate gate: error:")]
    assert len(err) == 1 and needle in err[0], proc.stderr


def test_missing_checkpoint_raises_before_any_work(tmp_path):
    with pytest.raises(CheckpointError):
        run_gate(GateOptions(candidate=str(tmp_path / "nope"), mutations="all"))
    with pytest.raises(GateSetupError):
        run_gate(GateOptions(candidate=str(tmp_path), target="tensorrt"))


def test_reference_cache_keys_on_digest_settings_version_and_skips_failures(tmp_path):
    cache = ReferenceCache(tmp_path)
    spec = EngineSpec(checkpoint="/a")
    k = cache.key(DIGEST, spec, "0.32.0")
    # Where the checkpoint lives does not matter; its bytes, settings and vLLM do.
    assert k == cache.key(DIGEST, EngineSpec(checkpoint="/elsewhere"), "0.32.0")
    assert k != cache.key("e" * 64, spec, "0.32.0")
    assert k != cache.key(DIGEST, EngineSpec(checkpoint="/a", dtype="float32"), "0.32.0")
    assert k != cache.key(DIGEST, spec, "0.33.0")
    cache.put(k, EngineResult(ok=False, error="boom"))
    assert cache.get(k) is None
    cache.put(k, EngineResult(ok=True, token_ids=[[1, 2]]))
    assert cache.get(k).token_ids == [[1, 2]]


def test_case_is_not_run_until_judged(tiny_ckpt, tmp_path, monkeypatch):
    """A prepared case is NOT_RUN and a report of it cannot pass; judging the
    same case (control) is what turns it into PASS."""
    from gate_cases import prepare

    from harness.gate import content_digest
    from harness.gate.runner import judge_case

    monkeypatch.setattr("harness.gate.fingerprints.HEADER_IMPL", "reimpl")
    (case,) = select_cases("identical_copy")
    digest = content_digest(tiny_ckpt)
    sock = tmp_path / "s"
    sock.mkdir(mode=0o700)
    plan, p = prepare(GateOptions(candidate=str(tiny_ckpt), mutations="identical_copy"), case, digest,
                      tmp_path / "w", str(sock))
    assert p.result.status == NOT_RUN and p.result.not_run_reason
    report = GateReport("self-test", "verified_cache", "c", "b", [p.result], {}, 1e-3, None)
    assert report.verdict == NOT_RUN and report.exit_code == 2
    answers = {"token_ids": [[1, 2]], "logprobs": [[{"1": -0.1}, {"2": -0.2}]]}
    p.result.reference = EngineResult(ok=True, **answers)
    p.result.cached = EngineResult(ok=True, **answers,
                                   events=[{"outcome": "hit", "rank": 0, "digest": digest, "daemon_digest": digest}])
    judge_case(plan, p)
    assert p.result.status == PASS and report.verdict == PASS


def test_switch_to_identical_base_requires_a_hit(tiny_ckpt, tmp_path, monkeypatch):
    """`gate A --base A`: equal content, equal key: a hit is required. Control:
    a base with other content requires a miss. Neither follows from the name."""
    from gate_cases import prepare

    from harness.gate import content_digest
    from harness.gate.cases import switch_case

    monkeypatch.setattr("harness.gate.fingerprints.HEADER_IMPL", "reimpl")
    sock = tmp_path / "s"
    sock.mkdir(mode=0o700)
    digest = content_digest(tiny_ckpt)
    o1 = GateOptions(candidate=str(tiny_ckpt), base=str(tiny_ckpt))
    same = prepare(o1, switch_case(o1), digest, tmp_path / "w1", str(sock))[1]
    assert same.result.expect == "hit" and same.cached_spec.extra_config["fallback"] is False
    other = tmp_path / "other"
    from fixtures.tiny import write_tiny

    write_tiny(other, seed=99)
    o2 = GateOptions(candidate=str(tiny_ckpt), base=str(other))
    diff = prepare(o2, switch_case(o2), content_digest(other), tmp_path / "w2", str(sock))[1]
    assert diff.result.expect == "miss" and diff.cached_spec.extra_config["fallback"] is True



def test_a_promotion_cases_engines_run_in_the_deployments_settings():
    """The engine keywords the gate and a target's runner both take from a
    case: a catalogue row's are its settings; a promotion case adds the
    deployment's, its context bounded where the deployment sets none."""
    from harness.gate.cases import MAX_MODEL_LEN, promotion_case
    from preload.deployment import DeploymentSettings

    (row,) = select_cases("dtype_change")
    assert row.engine_kwargs() == {"dtype": "float32", "tensor_parallel_size": 1, "data_parallel_size": 1}
    d = DeploymentSettings(dtype="float16", tensor_parallel_size=2, pipeline_parallel_size=2, quantization="fp8",
                           kv_cache_dtype="fp8")
    assert promotion_case(GateOptions(candidate="/c", settings=d)).engine_kwargs() == {
        "dtype": "float16", "tensor_parallel_size": 2, "data_parallel_size": 1, "pipeline_parallel_size": 2,
        "quantization": "fp8", "kv_cache_dtype": "fp8", "max_model_len": MAX_MODEL_LEN}
    d512 = DeploymentSettings(max_model_len=512)
    assert promotion_case(GateOptions(candidate="/c", settings=d512)).engine_kwargs()["max_model_len"] == 512

def test_reference_cache_refuses_a_loose_or_foreign_file(tmp_path):
    cache = ReferenceCache(tmp_path / "refs")
    cache.put("k", EngineResult(ok=True, token_ids=[[1]]))
    assert cache.get("k").token_ids == [[1]]  # control: our own 0600 file is used
    (tmp_path / "refs" / "k.json").chmod(0o644)
    with pytest.raises(GateSetupError, match="group/world accessible"):
        cache.get("k")


def _race_for_one_reference(cache: ReferenceCache) -> tuple[int, list[tuple[EngineResult, bool]]]:
    """Two runs ask ``cache`` for one reference while the first is still
    computing it; returns (engines run, each run's (result, reused))."""
    import threading

    started, release = threading.Event(), threading.Event()
    calls: list[int] = []
    out: list[tuple[EngineResult, bool]] = []

    def compute() -> EngineResult:
        calls.append(1)
        if len(calls) == 1:  # the first run's engine is slow; another one would not be
            started.set()
            release.wait(30)
        return EngineResult(ok=True, token_ids=[[len(calls)]])

    first = threading.Thread(target=lambda: out.append(cache.reference(["k"], compute)))
    first.start()
    assert started.wait(30)
    second = threading.Thread(target=lambda: out.append(cache.reference(["k", "values:k"], compute)))
    second.start()
    second.join(0.5)
    waited = second.is_alive()
    release.set()
    first.join(30)
    second.join(30)
    return (len(calls) if waited else -len(calls)), out


def test_a_reference_being_computed_is_waited_for_not_computed_twice(tmp_path):
    """The demo's two lanes ask for the same `auto` reference at once: the
    second waits and reuses (and stores it under its own extra key too).
    Control: without the lock both run the engine."""
    cache = ReferenceCache(tmp_path / "refs")
    runs, out = _race_for_one_reference(cache)
    assert runs == 1, "the second run did not wait, or ran the engine again"
    assert sorted(reused for _, reused in out) == [False, True]
    assert cache.get("values:k").token_ids == [[1]]

    import contextlib

    unlocked = ReferenceCache(tmp_path / "refs2")
    unlocked._locked = lambda key, what: contextlib.nullcontext()  # type: ignore[method-assign]
    runs, out = _race_for_one_reference(unlocked)
    assert runs == -2 and [reused for _, reused in out] == [False, False]


def _judged_switch(candidate, base, tmp_path, name: str, event_digest: str | None = None):
    """``gate CANDIDATE --base BASE``'s switch case judged on stand-in answers: equal
    tokens, and one load event, a hit on ``event_digest`` (default: the candidate's)."""
    from gate_cases import prepare

    from harness.gate import content_digest
    from harness.gate.cases import switch_case
    from harness.gate.runner import judge_case

    sock = tmp_path / f"s-{name}"
    sock.mkdir(mode=0o700)
    opts = GateOptions(candidate=str(candidate), base=str(base))
    plan, p = prepare(opts, switch_case(opts), content_digest(base), tmp_path / f"w-{name}", str(sock))
    answers = {"token_ids": [[1, 2]], "logprobs": [[{"1": -0.1}, {"2": -0.2}]]}
    digest = event_digest or p.result.candidate_digest
    p.result.reference = EngineResult(ok=True, **answers)
    p.result.cached = EngineResult(ok=True, **answers, events=[
        {"outcome": "hit", "rank": 0, "digest": digest, "daemon_digest": p.result.daemon_digest}])
    judge_case(plan, p)
    return p.result


def _copy_of(src, dst, flip_last_byte: bool = False):
    import shutil

    shutil.copytree(src, dst)
    if flip_last_byte:  # one byte of the last tensor's data; the header is untouched
        shard = sorted(dst.glob("*.safetensors"))[0]
        data = bytearray(shard.read_bytes())
        data[-1] ^= 0x01
        shard.write_bytes(bytes(data))
    return dst


def test_an_identical_re_promotion_passes_and_a_one_byte_change_blocks(tiny_ckpt, tmp_path, monkeypatch):
    """`gate COPY --base A`, COPY a byte-identical copy of A at another path:
    equal digests, equal keys, a hit, equal tokens: PASS, and the report says
    the weights are equal (observed, whatever the catalogue row says). The
    same with one byte changed, served as a hit on A: BLOCK wrong_hit."""
    monkeypatch.setattr("harness.gate.fingerprints.HEADER_IMPL", "reimpl")
    same = _judged_switch(_copy_of(tiny_ckpt, tmp_path / "copy"), tiny_ckpt, tmp_path, "same")
    assert same.status == PASS, same.verdict
    assert same.expect == "hit" and same.weights_equal is True
    edited = _copy_of(tiny_ckpt, tmp_path / "edited", flip_last_byte=True)
    from harness.gate import content_digest

    base_digest = content_digest(tiny_ckpt)
    changed = _judged_switch(edited, tiny_ckpt, tmp_path, "edited", event_digest=base_digest)
    assert changed.status == BLOCK and changed.verdict.reasons == ["wrong_hit"], changed.verdict
    assert changed.expect == "miss" and changed.weights_equal is False


def test_control_the_catalogue_default_blocks_the_identical_re_promotion(tiny_ckpt, tmp_path, monkeypatch):
    """Control: with the old rule (the case's catalogue fields when the key rule
    finds none: ``content_digest`` for every switch case), the identical
    re-promotion BLOCKs wrong_hit, as issue 37 found it."""
    from harness.targets import judge as judge_mod

    monkeypatch.setattr("harness.gate.fingerprints.HEADER_IMPL", "reimpl")
    monkeypatch.setattr(judge_mod, "observed_fields", lambda c, d, fields: tuple(fields) or ("content_digest",))
    same = _judged_switch(_copy_of(tiny_ckpt, tmp_path / "copy"), tiny_ckpt, tmp_path, "same")
    assert same.status == BLOCK and same.verdict.reasons == ["wrong_hit"], same.verdict
    assert "settings differ on content_digest" in " ".join(same.verdict.details)


def test_a_config_only_switch_requires_a_miss_observed_from_config_json(tiny_ckpt, tmp_path, monkeypatch):
    """`gate B --base A`, B = A's weights with another config.json: the engine's key
    holds B's config, the daemon's A's: a miss is required (observed, not named).
    Control: the byte-identical copy requires a hit."""
    import json as _json

    monkeypatch.setattr("harness.gate.fingerprints.HEADER_IMPL", "reimpl")
    cfg = _copy_of(tiny_ckpt, tmp_path / "cfg")
    body = _json.loads((cfg / "config.json").read_text())
    body["rope_theta"] = float(body.get("rope_theta") or 10000.0) * 4
    (cfg / "config.json").write_text(_json.dumps(body))
    changed = _judged_switch(cfg, tiny_ckpt, tmp_path, "cfg")
    assert changed.expect == "miss" and changed.weights_equal is True
    assert changed.status == BLOCK and changed.verdict.reasons == ["wrong_hit"]  # its stand-in engine hit
    same = _judged_switch(_copy_of(tiny_ckpt, tmp_path / "copy"), tiny_ckpt, tmp_path, "same")
    assert same.expect == "hit" and same.status == PASS
