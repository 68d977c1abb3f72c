"""The serving score S and gate G: properties (hypothesis), hand-computed values, and recorded fixtures."""

from __future__ import annotations

import json
import math
from decimal import Decimal
from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from pipeline.serving import score

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "serving"

ratio = st.floats(min_value=0.01, max_value=100.0, allow_nan=False, allow_infinity=False)
eps_values = st.floats(min_value=0.0, max_value=0.5, allow_nan=False)
figure = st.floats(min_value=1e-3, max_value=1e6, allow_nan=False, allow_infinity=False)
levels_strategy = st.fixed_dictionaries({c: st.fixed_dictionaries({"T": figure, "I": figure}) for c in score.LEVELS})


def scaled(levels, factor=1.0, only=None):
    out = {}
    for c, v in levels.items():
        out[c] = {m: (x * factor if only in (None, (m, c)) else x) for m, x in v.items()}
    return out


@given(levels_strategy)
def test_baseline_against_itself_scores_exactly_one(base):
    result = score.serving_score([base] * 3, [base] * 3, [base] * 3, gate_value=1)
    assert result["S"] == 1.0
    assert all(r == 1.0 for r in result["ratios"].values())
    assert result["eps"] == 0.0


@given(st.lists(ratio, min_size=8, max_size=8), st.integers(0, 7), ratio, eps_values)
def test_monotone_in_each_ratio(rs, i, other, eps):
    clipped = [score.clip(r) for r in rs]
    lower = list(clipped)
    higher = list(clipped)
    a, b = sorted((score.clip(rs[i]), score.clip(other)))
    lower[i], higher[i] = a, b
    assert score.score_from_ratios(lower, eps) <= score.score_from_ratios(higher, eps)
    if a < b:
        assert score.score_from_ratios(lower, eps) < score.score_from_ratios(higher, eps)


@given(levels_strategy, st.sampled_from([(m, c) for m in score.METRICS for c in score.LEVELS]),
       st.floats(min_value=4.0, max_value=1e4), st.floats(min_value=1e-4, max_value=0.25))
def test_ratios_are_clipped_to_a_quarter_and_four(base, which, up, down):
    hi = score.ratios(scaled(base, up, which), base)
    lo = score.ratios(scaled(base, down, which), base)
    key = f"{which[0]}_{which[1]}"
    assert hi[key] == pytest.approx(4.0) and lo[key] == pytest.approx(0.25)
    # beyond the clip, more of the same changes nothing
    assert score.ratios(scaled(base, up * 10, which), base)[key] == pytest.approx(4.0)
    assert score.ratios(scaled(base, down / 10, which), base)[key] == pytest.approx(0.25)


def test_clip_bounds_the_whole_score():
    assert score.score_from_ratios([score.clip(1e9)] * 8, 0.1) == pytest.approx(4.0)
    # all at the floor: every ratio pays the double cost below 1 - eps
    floor = score.score_from_ratios([score.clip(0.0001)] * 8, 0.1)
    assert floor == pytest.approx(math.exp(2 * math.log(0.25) - math.log(0.9)))


@given(st.lists(ratio, min_size=1, max_size=8), eps_values)
def test_gate_zero_gives_zero(rs, eps):
    base = {c: {"T": 1.0, "I": 1.0} for c in score.LEVELS}
    cand = {c: {"T": score.clip(rs[i % len(rs)]), "I": 1.0} for i, c in enumerate(score.LEVELS)}
    assert score.serving_score([base], [base], [cand], gate_value=0)["S"] == 0.0


@given(st.floats(min_value=0.26, max_value=0.99), eps_values)
def test_regressions_beyond_the_noise_band_cost_double(r, eps):
    assume(r < 1 - eps - 1e-9)
    # one regressed ratio among seven at 1: its log counts once down to 1 - eps, twice beyond
    got = math.log(score.score_from_ratios([r] + [1.0] * 7, eps)) * 8
    assert got == pytest.approx(math.log(1 - eps) + 2 * (math.log(r) - math.log(1 - eps)))
    # inside the band (or a gain) a ratio counts once
    inside = 1 - eps / 2
    assert math.log(score.score_from_ratios([inside] + [1.0] * 7, eps)) * 8 == pytest.approx(math.log(inside))
    assert math.log(score.score_from_ratios([2.0] + [1.0] * 7, eps)) * 8 == pytest.approx(math.log(2.0))


def test_hand_computed_score():
    base = {c: {"T": 100.0 * c, "I": 50.0} for c in score.LEVELS}
    second = scaled(base, 1.05, ("T", 32))  # the baseline's second block: 5% off at T_32 -> eps = 0.10
    cand = {c: {"T": 100.0 * c * (1.2 if c == 1 else 1.0), "I": 50.0 * (0.5 if c == 32 else 1.0)} for c in score.LEVELS}
    result = score.serving_score([base, base, base], [second, second, second], [cand, cand, cand], gate_value=1)
    assert result["baseline_spread"] == pytest.approx(0.05)
    assert result["eps"] == pytest.approx(0.10)
    # the baseline's T_32 is the median over both blocks' six runs: 3200 (three) and 3360 (three) -> 3280
    assert result["baseline"][32]["T"] == pytest.approx(3280.0)
    r_t32 = 3200 / 3280
    terms = [math.log(1.2), math.log(r_t32), 2 * math.log(0.5) - math.log(0.9)]  # others log 1 = 0
    assert result["ratios"]["T_1"] == pytest.approx(1.2) and result["ratios"]["I_32"] == pytest.approx(0.5)
    assert result["S"] == pytest.approx(math.exp(sum(terms) / 8))


def test_eps_is_capped_and_flagged():
    base = {c: {"T": 1.0, "I": 1.0} for c in score.LEVELS}
    noisy = scaled(base, 1.6, ("I", 4))
    result = score.serving_score([base], [noisy], [base], gate_value=1)
    assert result["eps"] == score.EPS_CAP and result["spread_capped"]


def test_unscorable_input_is_refused_with_the_place():
    base = {c: {"T": 1.0, "I": 1.0} for c in score.LEVELS}
    missing = {c: v for c, v in base.items() if c != 16}
    with pytest.raises(score.ScoreError, match="concurrency 16"):
        score.serving_score([base], [base], [missing], gate_value=1)
    zero = scaled(base, 0.0, ("T", 4))
    with pytest.raises(score.ScoreError, match="T at concurrency 4"):
        score.serving_score([zero], [zero], [base], gate_value=1)
    with pytest.raises(score.ScoreError, match="eps"):
        score.score_from_ratios([1.0], 1.0)


AUDITED = {"candidate": {"agreement": 1.0, "length_ratio": 1.0, "turns": 32, "failed": 0},
           "baseline": {"agreement": 1.0, "length_ratio": 1.0, "turns": 32, "failed": 0}, "required": True}


def test_gate_conditions():
    ok = dict(candidate_agreement=0.95, baseline_agreement=0.96, candidate_gsm8k=0.40, baseline_gsm8k=0.41,
              audit=AUDITED)
    assert score.gate(**ok) == (1, [])
    assert score.gate(**{**ok, "candidate_agreement": 0.94})[0] == 1  # exactly 2 points below: allowed
    g, reasons = score.gate(**{**ok, "candidate_agreement": 0.9399})
    assert g == 0 and "canary agreement" in reasons[0]
    assert score.gate(**{**ok, "candidate_gsm8k": 0.41 - 0.017})[0] == 1
    g, reasons = score.gate(**{**ok, "candidate_gsm8k": 0.392})
    assert g == 0 and "GSM8K" in reasons[0]
    g, reasons = score.gate(**ok, invalid_levels=[16, 4])
    assert g == 0 and "c = 4, 16" in reasons[0]
    g, reasons = score.gate(**{**ok, "candidate_agreement": None})
    assert g == 0 and "no canary turn" in reasons[0]
    g, reasons = score.gate(candidate_agreement=0.1, baseline_agreement=0.9, candidate_gsm8k=0.0,
                            baseline_gsm8k=0.5, invalid_levels=[1], audit=AUDITED)
    assert g == 0 and len(reasons) == 3


def _audit(candidate_pairs, baseline_pairs, required=True):
    return {"candidate": score.audit_summary(candidate_pairs), "baseline": score.audit_summary(baseline_pairs),
            "required": required}


def test_gate_audit_condition():
    # (d): live replies checked against the baseline's replies to the same requests. Issue 40's two servers:
    # one that caches earlier replies and one that pads live turns with filler of the same length; both
    # pass the canaries, GSM8K and every level, so only the audit can gate them.
    ok = dict(candidate_agreement=1.0, baseline_agreement=1.0, candidate_gsm8k=0.5, baseline_gsm8k=0.5)
    reply = list(range(100, 120))
    honest = [(reply, list(reply))] * 16
    filler = [(reply, [7] * 20)] * 12 + [(reply, list(reply))] * 4  # the first turns of conversations honest
    assert score.gate(**ok, audit=_audit(honest, honest)) == (1, [])
    g, reasons = score.gate(**ok, audit=_audit(filler, honest))
    assert g == 0 and len(reasons) == 1 and reasons[0].startswith("audit: the candidate's live replies agree 25.00%")
    assert "self-agreement 100.00% minus 5 points" in reasons[0]
    # a late divergence on one turn in sixteen (batching noise) is within the margin; the baseline's own noise
    # lowers the bar for the candidate too
    late = [(reply, reply[:15] + [0] * 5)] + honest[1:]
    assert score.gate(**ok, audit=_audit(late, honest))[0] == 1
    noisy_base = [(reply, reply[:10] + [0] * 10)] * 4 + honest[4:]
    assert score.gate(**ok, audit=_audit([(reply, reply[:10] + [0] * 10)] * 5 + honest[5:], noisy_base))[0] == 1
    # replies the baseline could not answer (a history it refuses) count as 0
    assert score.audit_summary([(None, reply)]) == {"agreement": 0.0, "length_ratio": 0.0, "turns": 1, "failed": 1}
    # lengths: the same words, a third longer, are not the model's reply to this request
    long = [(reply, reply + reply[:8])] * 16
    g, reasons = score.gate(**ok, audit=_audit(long, honest))
    assert g == 0 and "1.400 x the length" in reasons[0]
    # no evidence: a failure only where it was due
    g, reasons = score.gate(**ok, audit=_audit([], honest))
    assert g == 0 and "no live turn of the candidate was kept" in reasons[0] and "no evidence" in reasons[0]
    g, reasons = score.gate(**ok, audit=_audit(honest, []))
    assert g == 0 and "of the baseline" in reasons[0]
    assert score.gate(**ok, audit=_audit([], [], required=False)) == (1, [])


def test_canary_agreement_on_recorded_runs():
    runs = json.loads((FIXTURES / "canary_runs.json").read_text())
    reference = score.canary_outputs([runs["baseline_first"]])
    assert reference[("a", 1)] == list(range(100, 110))  # the earliest pass wins
    assert ("x", 0) not in reference  # not a canary
    found = {}
    for name in ("baseline_second", "candidate_bad", "candidate_good"):
        agreement, n = score.canary_agreement(reference, score.canary_outputs([runs[name]]))
        expected, expected_n = runs["expected"][name]
        assert agreement == pytest.approx(expected, abs=1e-6) and n == expected_n, name
        found[name] = agreement
    gsm = dict(candidate_gsm8k=0.5, baseline_gsm8k=0.5, audit=AUDITED)
    assert score.gate(candidate_agreement=found["candidate_bad"], baseline_agreement=found["baseline_second"], **gsm)[0] == 0
    assert score.gate(candidate_agreement=found["candidate_good"], baseline_agreement=found["baseline_second"], **gsm)[0] == 1
    assert score.canary_agreement(reference, {}) == (None, 0)


def test_common_prefix_fraction():
    assert score.common_prefix_fraction([1, 2, 3, 4], [1, 2, 9, 4]) == 0.5
    assert score.common_prefix_fraction([1, 2], [1, 2, 3]) == 1.0
    assert score.common_prefix_fraction([1, 2, 3, 4], [1]) == 0.25
    assert score.common_prefix_fraction([], []) == 1.0


def _jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_gsm8k_extraction_on_recorded_replies():
    questions = _jsonl(FIXTURES / "gsm8k" / "test_sample.jsonl")
    recorded = json.loads((FIXTURES / "gsm8k_replies.json").read_text())["replies"]
    pairs = []
    for entry in recorded:
        answer = questions[entry["line"]]["answer"]
        got = score.extract_answer(entry["reply"])
        assert got == (None if entry["extracted"] is None else Decimal(entry["extracted"])), entry["reply"]
        assert score.gsm8k_correct(entry["reply"], answer) is entry["correct"], entry["reply"]
        pairs.append((entry["reply"], answer))
    assert score.gsm8k_accuracy(pairs) == pytest.approx(6 / 8)
    assert [score.reference_answer(q["answer"]) for q in questions] == [Decimal(x) for x in
                                                                       ("18", "3", "70000", "540", "20", "64", "260", "160")]


@pytest.mark.parametrize("reply, expected", [
    ("so x = -5.", "-5"), ("a loss of $-12", "-12"), ("pages 3-4", "4"), ("$1,234.50 in all", "1234.50"),
    ("18 apples, then 19.", "19"), ("#### 1,000", "1000"), ("no digits", None), ("v2 of the plan", None),
])
def test_gsm8k_number_shapes(reply, expected):
    assert score.extract_answer(reply) == (None if expected is None else Decimal(expected))


def test_gsm8k_messages_are_five_shots_then_the_question():
    shots = _jsonl(FIXTURES / "gsm8k" / "train_shots.jsonl")
    question = _jsonl(FIXTURES / "gsm8k" / "test_sample.jsonl")[0]["question"]
    messages = score.gsm8k_messages(shots, question)
    assert [m["role"] for m in messages] == ["user", "assistant"] * 5 + ["user"]
    assert messages[1]["content"].endswith("#### 72") and question in messages[-1]["content"]
    with pytest.raises(score.ScoreError, match="####"):
        score.reference_answer("no marker here 12")


@settings(max_examples=50)
@given(st.lists(st.tuples(st.integers(0, 10**9), st.booleans()), min_size=1, max_size=20))
def test_gsm8k_accuracy_counts_matches(items):
    pairs = [(f"so the answer is {n if right else n + 1}.", f"work\n#### {n:,}") for n, right in items]
    assert score.gsm8k_accuracy(pairs) == pytest.approx(sum(r for _, r in items) / len(items))


def _runs(*scales: float) -> list[dict[int, dict[str, float]]]:
    return [{c: {"T": 100.0 * k, "I": 10.0 * k} for c in score.LEVELS} for k in scales]


def test_the_interval_is_the_runs_own_spread_the_candidates_included():
    """A candidate whose runs came out at 1x and 4x against a baseline that agrees with itself: S = 2.5, and the
    interval built from the baseline's spread alone was [2.5, 2.5]. The bootstrap over each block's runs sees the
    candidate's own disagreement; a steady candidate gets a narrow one; the same runs give the same interval."""
    base1, base2 = _runs(1, 1, 1), _runs(1, 1, 1)
    wild = _runs(1, 1, 1, 4, 4, 4)
    s = score.serving_score(base1, base2, wild, 1)["S"]
    assert s == pytest.approx(2.5)
    lo, hi = score.score_interval(base1, base2, wild, 1)
    assert lo <= s <= hi and lo < 1.5 and hi > 3.5, (lo, hi)
    steady = _runs(1.2, 1.21, 1.19, 1.2, 1.2, 1.21)
    lo2, hi2 = score.score_interval(base1, base2, steady, 1)
    assert 1.18 <= lo2 <= score.serving_score(base1, base2, steady, 1)["S"] <= hi2 <= 1.22
    assert score.score_interval(base1, base2, wild, 1) == [lo, hi]
    assert score.score_interval(base1, base2, wild, 0) == [0.0, 0.0]


def test_the_interval_widens_with_the_baselines_own_noise():
    base1, base2 = _runs(0.9, 1.1, 1.0), _runs(1.05, 0.95, 1.0)
    cand = _runs(1.2, 1.2, 1.2, 1.2, 1.2, 1.2)
    lo, hi = score.score_interval(base1, base2, cand, 1)
    assert hi - lo > 0.1 and lo <= score.serving_score(base1, base2, cand, 1)["S"] <= hi
