"""Canary comparison rules, without engines: tokens exact, logprobs within a tolerance."""

from __future__ import annotations

import json

import pytest

from canaries.compare import Answer, compare_answer, compare_answers
from canaries.errors import GoldenError
from canaries.golden import FORMAT, Golden, GoldenPrompt, Sampling, load_golden
from preload.deployment import DeploymentSettings

pytestmark = pytest.mark.unit


def gp(token_ids=(5, 6, 7), lps=(-0.1, -0.2, -0.3), top=None) -> GoldenPrompt:
    if top is None:
        top = [{str(t): lp, "99": lp - 1.0} for t, lp in zip(token_ids, lps, strict=True)]
    return GoldenPrompt("p", [1, 2], list(token_ids), "text", list(lps), top)


def answer_of(g: GoldenPrompt, shift: float = 0.0) -> Answer:
    return Answer(
        list(g.token_ids),
        [lp + shift for lp in g.token_logprobs],
        [{int(k): v + shift for k, v in step.items()} for step in g.top_logprobs],
    )


def test_identical_answer_matches_with_zero_delta() -> None:
    g = gp()
    c = compare_answer(g, 0, answer_of(g), tolerance=0.0)
    assert c.ok and c.max_delta == 0.0


@pytest.mark.parametrize(
    ("got", "position", "got_id"),
    [
        ([9, 6, 7], 0, 9),  # first token differs
        ([5, 6, 9], 2, 9),  # last token differs
        ([5, 6], 2, None),  # answer ended early
        ([5, 6, 7, 8], 3, 8),  # answer ran long
    ],
)
def test_first_token_difference_is_named(got: list[int], position: int, got_id: int | None) -> None:
    g = gp()
    a = Answer(got, [-0.1] * len(got), [{t: -0.1} for t in got])
    c = compare_answer(g, 3, a, tolerance=10.0)  # a loose tolerance must not hide a token change
    assert not c.ok
    d = c.difference
    assert d is not None and d.kind == "token"
    assert (d.prompt_index, d.position, d.got_id) == (3, position, got_id)
    assert d.expected_id == (g.token_ids[position] if position < 3 else None)


def test_logprob_within_tolerance_passes_and_reports_delta() -> None:
    g = gp()
    c = compare_answer(g, 0, answer_of(g, shift=0.04), tolerance=0.05)
    assert c.ok
    assert c.max_delta == pytest.approx(0.04)


def test_logprob_beyond_tolerance_is_drift() -> None:
    g = gp()
    # Control for the test above: the same answer with a larger shift fails.
    c = compare_answer(g, 0, answer_of(g, shift=0.06), tolerance=0.05)
    assert not c.ok
    assert c.difference.kind == "logprob" and c.difference.position == 0
    assert c.difference.token_id == 5


def test_drift_in_a_top_alternative_is_caught() -> None:
    g = gp()
    a = answer_of(g)
    a.top_logprobs[1][99] += 0.5  # only the runner-up moved
    c = compare_answer(g, 0, a, tolerance=0.05)
    assert not c.ok and c.difference.position == 1 and c.difference.token_id == 99


def test_boundary_tie_in_top_k_is_accepted_but_a_new_strong_token_is_not() -> None:
    g = gp(top=[{"5": -0.1, "99": -2.0}, {"6": -0.2, "98": -2.0}, {"7": -0.3, "97": -2.0}])
    a = answer_of(g)
    # Token 42 replaces 99 at the k-th place with a near-equal logprob: a tie.
    a.top_logprobs[0].pop(99)
    a.top_logprobs[0][42] = -2.01
    assert compare_answer(g, 0, a, tolerance=0.05).ok
    # Control: the newcomer is far above the golden's k-th place: drift.
    a.top_logprobs[0][42] = -1.0
    c = compare_answer(g, 0, a, tolerance=0.05)
    assert not c.ok and c.difference.token_id == 42


def test_missing_logprobs_are_a_difference_not_a_pass() -> None:
    g = gp()
    a = Answer(list(g.token_ids), [None, None, None], [{}, {}, {}])
    c = compare_answer(g, 0, a, tolerance=1.0)
    assert not c.ok and c.difference.kind == "logprob"


def test_compare_answers_reports_first_prompt_in_order() -> None:
    g0, g1, g2 = gp(), gp(token_ids=(1, 2, 3)), gp(token_ids=(4, 4, 4))
    a1 = answer_of(g1)
    a1.token_ids[1] = 77
    a2 = answer_of(g2)
    a2.token_ids[0] = 66
    c = compare_answers([g0, g1, g2], [answer_of(g0), a1, a2], tolerance=0.05)
    assert c.difference.prompt_index == 1 and c.difference.position == 1


def _golden_json() -> dict:
    g = Golden(
        digest="ab" * 32, vllm_version="0.32.0", sampling=Sampling(max_tokens=3, top_logprobs=2),
        prompts=[gp()], token_texts={"5": "five"}, settings=DeploymentSettings(dtype="float16"),
        config_digest="cd" * 32, answer_files={"chat_template.jinja": "ef" * 32, "tokenizer.json": "12" * 32},
    )
    return g.to_json()


def test_golden_round_trips_and_keys_on_everything_that_decides_answers(tmp_path) -> None:
    p = tmp_path / "g.json"
    p.write_text(json.dumps(_golden_json()))
    g = load_golden(p)
    assert g.key() == {
        "digest": "ab" * 32, "config_digest": "cd" * 32, "tokenizer_digest": None,
        "answer_files": {"chat_template.jinja": "ef" * 32, "tokenizer.json": "12" * 32},
        "settings": DeploymentSettings(dtype="float16").to_json(), "vllm_version": "0.32.0", "sampling": {
            "max_tokens": 3, "top_logprobs": 2, "temperature": 0.0, "ignore_eos": True,
            "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}}
    assert g.token_text(5) == "five" and g.token_text(6) is None
    assert g.to_json()["format"] == FORMAT
    assert g.to_json() == _golden_json()  # every field back as written


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda o: o.update(format="other/1"), "format"),
        (lambda o: o.update(digest="xyz"), "64 hex"),
        (lambda o: o.pop("vllm_version"), "malformed golden record .*missing required field `vllm_version`"),
        # Shapes are msgspec's: the message names the path to the field.
        (lambda o: o["prompts"][0].update(token_ids=["5", 6, 7]), r"got `str` - at `\$.prompts\[0\].token_ids\[0\]`"),
        (lambda o: o["sampling"].update(ignore_eos=1), r"got `int` - at `\$.sampling.ignore_eos`"),
        (lambda o: o.update(settings={"dtype": "float16", "tp": 2}), r"unknown fields \['tp'\]"),
        (lambda o: o.update(config_digest="CD" * 31), "config_digest 'CDCD.* is 62 characters, not 64"),
        (lambda o: o["answer_files"].update({"../tokenizer.json": "12" * 32}), "'../tokenizer.json', not a path inside"),
        (lambda o: o["answer_files"].update({"/etc/passwd": "12" * 32}), "'/etc/passwd', not a path inside"),
        (lambda o: o["answer_files"].update({"vocab.json": "12"}), r"answer_files\['vocab.json'\] '12' is not a SHA-256 digest"),
        (lambda o: o.update(answer_files=["tokenizer.json"]), r"malformed golden record .*\$.answer_files"),
        (lambda o: o.update(prompts=[]), "no prompt"),
        (lambda o: o["prompts"][0].update(token_ids=[1]), "max_tokens=3"),
        (lambda o: o["sampling"].update(temperature=0.7), "temperature must be 0"),
        (lambda o: o["prompts"][0].update(token_logprobs=[0.0]), "logprobs do not cover"),
    ],
)
def test_malformed_golden_is_one_clear_error(tmp_path, edit, message) -> None:
    obj = _golden_json()
    edit(obj)
    p = tmp_path / "g.json"
    p.write_text(json.dumps(obj))
    with pytest.raises(GoldenError, match=message):
        load_golden(p)


def test_golden_not_json_or_missing(tmp_path) -> None:
    p = tmp_path / "g.json"
    p.write_text("{not json")
    with pytest.raises(GoldenError, match="not JSON"):
        load_golden(p)
    with pytest.raises(GoldenError, match="cannot read"):
        load_golden(tmp_path / "absent.json")
