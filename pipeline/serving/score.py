"""The serving score S and its correctness gate G, from the levels' figures of baseline and candidate runs.

Pure functions; the caller runs the levels (baseline and candidate alternating B C C B on one node, each
level three times) and hands over plain data: per run, {c: {"T": T_c, "I": I_c}} from metrics.level.

Score (serving-track.md, "Score and correctness gate"):
- Medians: each side's figure at each level is the median over its repeats (all of its runs).
- Ratios r = T_c / T_c(baseline) and I_c / I_c(baseline) for c in {1, 4, 16, 32}, each clipped to
  [0.25, 4]: eight ratios.
- S = G * exp(mean over r of (log r - max(0, log(1 - eps) - log r))). Above 1 - eps a ratio counts as its
  log; below, the shortfall beyond the noise band counts twice. The baseline's own figures give
  r = 1 everywhere and S = 1 exactly.
- eps = 2 x the baseline-vs-baseline spread: the largest relative difference |b2 / b1 - 1| between the
  medians of the first and the second baseline block (B . . B) over the eight figures, so noise the
  baseline shows against itself never costs double. It is capped at EPS_CAP (0.5): a baseline that
  disagrees with itself more than that is a broken measurement, flagged, not a licence to regress.

Gate G = 1 only if all hold, else 0:
- (a) canary agreement: the candidate's canary tokens agree with the baseline's reference at least as
  well as the baseline's second block agrees with its first, minus 2 points. Agreement of one canary
  turn = the length of the common prefix of its greedy token ids with the reference's / the
  reference's length (greedy decoding that goes wrong diverges early; numerical noise in batching
  diverges late, if at all); of a run, the mean over the canary turns both have. The mean
  common-prefix fraction, not exact match, so one late flip of a near-tie does not count as a wholly
  wrong reply.
- (b) GSM8K 5-shot accuracy through the chat endpoint after the perf runs >= the baseline's - 1.7 points.
- (c) no candidate level invalid (metrics.validity).
- (d) the audit (serving-track.md, "Only the model's own replies count"): the live (non-canary) turns are
  the model's own replies. Each replay run keeps a random sample of its completed live turns (the request's
  exact body and the reply's token ids; replay.py picks them with the OS's randomness, which the server
  cannot see), and the last baseline block re-sends a sample of the candidate blocks' kept turns, and, as
  the calibration, of the first baseline block's, to the unpatched server (evaluate.py). A turn's audit
  agreement is common_prefix_fraction(the baseline's new reply, the recorded reply). The candidate's mean
  must be at least the baseline's self-agreement (its first block against its last, on the same requests)
  minus AUDIT_MARGIN, and the candidate's mean length ratio (recorded tokens / the baseline's new reply's)
  must lie in AUDIT_LENGTH_BAND. A server that caches earlier replies or answers live turns with filler
  agrees near 0; an honest one agrees as the baseline agrees with itself (1 for a deterministic greedy
  engine; below 1 only where batching noise flips a late near-tie). AUDIT_MARGIN is 5 points, wider than
  the canaries' 2: an audit sample is a few dozen turns, not every canary turn, so one reply that diverges
  early from numerical noise moves its mean by a few points; filler or a cache moves it by tens.
  No audit turn on one side is no evidence: a failure where evidence was due (an official run, or a
  candidate that completed live turns: then its runs kept some, and the baseline's did too), otherwise
  (a dataset of canaries only, a test) nothing to audit and no reason.

GSM8K's answers end with `#### <number>`; a model's reply is read for its answer:
- First the reply is cut where the model starts a question of its own (a line beginning `Question:`, the
  shots' user format): a model that imitates the transcript instead of ending its turn (or whose end of
  turn is suppressed, pipeline/serving/engine.py) writes a next question and its numbers, and those are
  not its answer.
- In what is left, the number after the first `####` (the shots' answer format, the one the model
  committed to); without one, the last number.
- A number: digits with an optional decimal part, or a leading-dot decimal (`.5` is 0.5, never 5); a comma
  only as a thousands separator between groups of three digits ("1,234" is 1234, "1,2,3" ends with 3,
  not 123); a dollar sign stripped (`$1,234.50` -> 1234.50); compared as decimals (18 == 18.00). A minus
  sign (ASCII or U+2212) counts only where it is not a hyphen between word characters ("pages 3-4" ends
  with 4, not -4), and a number glued to a word ("v2") is none.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import re
from decimal import Decimal, InvalidOperation
from statistics import median
from typing import Any, Iterable

LEVELS = (1, 4, 16, 32)
METRICS = ("T", "I")
CLIP = (0.25, 4.0)
EPS_CAP = 0.5
RESAMPLES = 2000  # the interval's bootstrap resamples
CANARY_MARGIN = 0.02  # 2 points of agreement
GSM8K_MARGIN = 0.017  # 1.7 points of accuracy
AUDIT_MARGIN = 0.05  # 5 points of audit agreement (the module's docstring, (d), says why)
AUDIT_LENGTH_BAND = (0.9, 1.1)  # the candidate's recorded reply length / the baseline's new reply's, mean

Levels = dict[int, dict[str, float]]


class ScoreError(Exception):
    """The runs cannot be scored (a level or figure missing, a non-positive baseline); the message says which."""


def clip(r: float) -> float:
    return min(max(r, CLIP[0]), CLIP[1])


def median_levels(runs: list[Levels], levels: Iterable[int] = LEVELS) -> Levels:
    """Per level and figure, the median over the runs (each run {c: {"T": ..., "I": ...}})."""
    if not runs:
        raise ScoreError("no runs to take a median of")
    out: Levels = {}
    for c in levels:
        out[c] = {}
        for m in METRICS:
            values = []
            for i, run in enumerate(runs):
                try:
                    value = run[c][m]
                except (KeyError, TypeError):
                    raise ScoreError(f"run {i} has no {m} at concurrency {c}") from None
                if value is None or not math.isfinite(value):
                    raise ScoreError(f"run {i} has {m} = {value!r} at concurrency {c}; a scored figure is a finite number")
                values.append(float(value))
            out[c][m] = median(values)
    return out


def ratios(candidate: Levels, baseline: Levels, levels: Iterable[int] = LEVELS) -> dict[str, float]:
    """The eight clipped ratios, keyed "T_1", "I_1", ..., "I_32"."""
    out = {}
    for c in levels:
        for m in METRICS:
            b = baseline[c][m]
            if not b > 0:
                raise ScoreError(f"the baseline's {m} at concurrency {c} is {b}; ratios need a positive baseline")
            out[f"{m}_{c}"] = clip(candidate[c][m] / b)
    return out


def spread(first: Levels, second: Levels, levels: Iterable[int] = LEVELS) -> float:
    """The largest |second / first - 1| over the figures of two baseline blocks."""
    worst = 0.0
    for c in levels:
        for m in METRICS:
            a, b = first[c][m], second[c][m]
            if not a > 0:
                raise ScoreError(f"the first baseline block's {m} at concurrency {c} is {a}; it must be positive")
            worst = max(worst, abs(b / a - 1))
    return worst


def eps_from_spread(measured_spread: float) -> float:
    """eps = 2 x spread, capped at EPS_CAP."""
    if measured_spread < 0 or not math.isfinite(measured_spread):
        raise ScoreError(f"a spread of {measured_spread} is not a measurement")
    return min(2 * measured_spread, EPS_CAP)


def term(r: float, eps: float) -> float:
    """One ratio's contribution: log r, and the shortfall below 1 - eps counted twice."""
    log_r = math.log(r)
    return log_r - max(0.0, math.log(1 - eps) - log_r)


def score_from_ratios(rs: Iterable[float], eps: float) -> float:
    """exp(mean of term(r, eps)) over the (already clipped) ratios: S before the gate."""
    rs = list(rs)
    if not rs:
        raise ScoreError("no ratios to score")
    if not 0 <= eps < 1:
        raise ScoreError(f"eps is {eps}; it lies in [0, 1)")
    for r in rs:
        if not (r > 0 and math.isfinite(r)):
            raise ScoreError(f"a ratio of {r} cannot be scored")
    return math.exp(sum(term(r, eps) for r in rs) / len(rs))


# ----- the gate -----

def common_prefix_fraction(reference: list[int], other: list[int]) -> float:
    """Length of the common prefix / the reference's length (1.0 for two empty replies)."""
    if not reference:
        return 1.0 if not other else 0.0
    n = 0
    for a, b in zip(reference, other):
        if a != b:
            break
        n += 1
    return n / len(reference)


def canary_outputs(documents: Iterable[dict[str, Any]]) -> dict[tuple[str, int], list[int]]:
    """{(conversation, turn): token ids} of every completed canary turn of these replay documents.

    The first occurrence wins (runs in the order given, a conversation's earliest pass): the same fixed
    history gives the same prompt, whichever lane and pass replayed it.
    """
    out: dict[tuple[str, int], list[int]] = {}
    for doc in documents:
        for t in sorted(doc["turns"], key=lambda t: (t["pass"], t["send_ns"] or 0)):
            if t.get("canary") and t["status"] == "ok" and "token_ids" in t:
                out.setdefault((t["conversation"], t["turn"]), list(t["token_ids"]))
    return out


def canary_agreement(reference: dict[tuple[str, int], list[int]],
                     other: dict[tuple[str, int], list[int]]) -> tuple[float | None, int]:
    """(mean common-prefix fraction over the canary turns both have, how many); (None, 0) when none."""
    keys = sorted(set(reference) & set(other))
    if not keys:
        return None, 0
    return sum(common_prefix_fraction(reference[k], other[k]) for k in keys) / len(keys), len(keys)


# No number starts inside a word or right after a decimal point ("v2", "v1.5" hold none); thousands groups
# of exactly three digits, so "1,2,3" is three numbers, not 123.
_NUMBER = re.compile(r"(?<![\w.])([-\u2212])?\$?([-\u2212])?"
                     r"((?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+)")
_OWN_QUESTION = re.compile(r"\n[ \t]*Question:")
_MARKER = "####"


def normalize_number(text: str) -> Decimal | None:
    """A number as GSM8K writes it (commas, a $, a sign), as a Decimal; None when it is not one."""
    cleaned = text.replace(",", "").replace("$", "").replace("\u2212", "-").strip()
    try:
        value = Decimal(cleaned)
    except InvalidOperation:
        return None
    return value if value.is_finite() else None


def reference_answer(answer: str) -> Decimal:
    """The number after `####` in a GSM8K answer."""
    head, sep, tail = answer.rpartition("####")
    value = normalize_number(tail) if sep else None
    if value is None:
        raise ScoreError(f"a GSM8K answer without `#### <number>` at its end: {answer[-80:]!r}")
    return value


def answer_text(reply: str) -> str:
    """The reply up to where the model starts a `Question:` of its own (the whole reply when it does not)."""
    m = _OWN_QUESTION.search(reply)
    return reply[:m.start()] if m else reply


def _value(m: re.Match) -> Decimal | None:
    sign = "-" if (m.group(1) or m.group(2)) else ""
    return normalize_number(sign + m.group(3))


def extract_answer(reply: str) -> Decimal | None:
    """The model's answer: the first number after its first `####`, else its last number, in
    answer_text(reply); None when it has none."""
    text = answer_text(reply)
    _, marker, after = text.partition(_MARKER)
    if marker:
        m = _NUMBER.search(after)
        if m is not None:
            return _value(m)
    found = None
    for found in _NUMBER.finditer(text):
        pass
    return None if found is None else _value(found)


def gsm8k_correct(reply: str, answer: str) -> bool:
    got = extract_answer(reply)
    return got is not None and got == reference_answer(answer)


def gsm8k_accuracy(pairs: Iterable[tuple[str, str]]) -> float:
    """The fraction of (reply, GSM8K answer) pairs whose extracted number equals the answer's."""
    pairs = list(pairs)
    if not pairs:
        raise ScoreError("no GSM8K replies to score")
    return sum(gsm8k_correct(reply, answer) for reply, answer in pairs) / len(pairs)


def gsm8k_messages(shots: list[dict[str, str]], question: str) -> list[dict[str, str]]:
    """The 5-shot chat: each shot a user question and the assistant's worked answer, then the question."""
    messages: list[dict[str, str]] = []
    for shot in shots:
        messages.append({"role": "user", "content": f"Question: {shot['question']}\nAnswer:"})
        messages.append({"role": "assistant", "content": shot["answer"]})
    messages.append({"role": "user", "content": f"Question: {question}\nAnswer:"})
    return messages


def audit_summary(pairs: Iterable[tuple[list[int] | None, list[int]]]) -> dict[str, Any]:
    """{agreement, length_ratio, turns, failed} of audited turns, each (the baseline's new reply's token ids, or
    None where the baseline gave none, the recorded reply's token ids): the mean common-prefix fraction
    (reference: the baseline's new reply) and the mean of recorded length / new length. A turn the baseline
    could not answer counts as agreement 0 and length ratio 0. None for the means when there is no turn."""
    agreements, lengths, failed = [], [], 0
    for new, recorded in pairs:
        if new is None:
            failed += 1
            agreements.append(0.0)
            lengths.append(0.0)
            continue
        agreements.append(common_prefix_fraction(new, recorded))
        lengths.append(len(recorded) / len(new) if new else (1.0 if not recorded else 0.0))
    n = len(agreements)
    return {"agreement": sum(agreements) / n if n else None, "length_ratio": sum(lengths) / n if n else None,
            "turns": n, "failed": failed}


def audit_reasons(candidate: dict[str, Any], baseline: dict[str, Any], required: bool) -> list[str]:
    """Condition (d)'s reasons (none when it holds): `candidate` and `baseline` are audit_summary()s (the
    candidate blocks' turns and the first baseline block's, re-sent to the last baseline block), `required`
    whether evidence was due (the module's docstring)."""
    reasons = []
    c, b = candidate.get("agreement"), baseline.get("agreement")
    if c is None or b is None:
        if required:
            side = " and ".join(s for s, v in (("the candidate", c), ("the baseline", b)) if v is None)
            reasons.append(f"audit: no live turn of {side} was kept and re-sent to the baseline, so nothing shows "
                           "the candidate's live replies are the model's own (no evidence)")
        return reasons
    if c < b - AUDIT_MARGIN - 1e-12:
        reasons.append(f"audit: the candidate's live replies agree {100 * c:.2f}% with the baseline's replies to the "
                       f"same requests ({candidate.get('turns')} turns re-sent), below the baseline's self-agreement "
                       f"{100 * b:.2f}% minus {100 * AUDIT_MARGIN:g} points: its replies are not the model's own "
                       "(cached, or filler)")
    ratio = candidate.get("length_ratio")
    if ratio is not None and not AUDIT_LENGTH_BAND[0] <= ratio <= AUDIT_LENGTH_BAND[1]:
        reasons.append(f"audit: the candidate's live replies are {ratio:.3f} x the length of the baseline's replies to "
                       f"the same requests, outside [{AUDIT_LENGTH_BAND[0]:g}, {AUDIT_LENGTH_BAND[1]:g}]")
    return reasons


def gate(*, candidate_agreement: float | None, baseline_agreement: float | None,
         candidate_gsm8k: float, baseline_gsm8k: float,
         invalid_levels: Iterable[int] = (), audit: dict[str, Any]) -> tuple[int, list[str]]:
    """(G, reasons): 1 when all four conditions hold; otherwise 0 and every reason it failed.

    `audit`: {"candidate": audit_summary, "baseline": audit_summary, "required": bool} (condition (d))."""
    reasons = []
    if candidate_agreement is None or baseline_agreement is None:
        reasons.append("no canary turn was replayed by both the candidate and the baseline")
    elif candidate_agreement < baseline_agreement - CANARY_MARGIN - 1e-12:
        reasons.append(f"canary agreement {100 * candidate_agreement:.2f}% is below the baseline's self-agreement "
                       f"{100 * baseline_agreement:.2f}% minus {100 * CANARY_MARGIN:g} points")
    if candidate_gsm8k < baseline_gsm8k - GSM8K_MARGIN - 1e-12:
        reasons.append(f"GSM8K accuracy {100 * candidate_gsm8k:.2f}% is below the baseline's "
                       f"{100 * baseline_gsm8k:.2f}% minus {100 * GSM8K_MARGIN:g} points")
    invalid = sorted(set(invalid_levels))
    if invalid:
        reasons.append("invalid levels (failed or short turns): c = " + ", ".join(map(str, invalid)))
    reasons += audit_reasons(audit["candidate"], audit["baseline"], bool(audit["required"]))
    return (0 if reasons else 1), reasons


def serving_score(baseline_first: list[Levels], baseline_second: list[Levels], candidate: list[Levels],
                  gate_value: int, levels: Iterable[int] = LEVELS) -> dict[str, Any]:
    """S with everything it came from: the medians, the eight ratios, the spread and eps, G.

    baseline_first and baseline_second are the runs of the two baseline blocks (B C C B); the
    baseline's figures for the ratios are the medians over both.
    """
    levels = tuple(levels)
    first, second = median_levels(baseline_first, levels), median_levels(baseline_second, levels)
    base = median_levels(list(baseline_first) + list(baseline_second), levels)
    cand = median_levels(candidate, levels)
    measured = spread(first, second, levels)
    eps = eps_from_spread(measured)
    rs = ratios(cand, base, levels)
    ungated = score_from_ratios(rs.values(), eps)
    return {"S": gate_value * ungated, "S_ungated": ungated, "G": gate_value, "ratios": rs, "eps": eps,
            "baseline_spread": measured, "spread_capped": 2 * measured > EPS_CAP,
            "baseline": base, "candidate": cand}


def score_interval(baseline_first: list[Levels], baseline_second: list[Levels], candidate: list[Levels],
                   gate_value: int, levels: Iterable[int] = LEVELS, resamples: int = RESAMPLES) -> list[float]:
    """S's 95% interval by the bootstrap: each block's runs (the two baseline blocks and the candidate's runs)
    resampled with replacement, S recomputed from the resample (its medians, its spread and so its eps), and the
    2.5th and 97.5th percentiles taken. So the interval is the runs' own spread, the candidate's included: a
    candidate whose runs disagree gets a wide one even when the baseline agrees with itself. Seeded by the
    figures themselves, so the same runs give the same interval. It always contains S (where the resamples are
    lopsided, its edge is S); [0, 0] for G = 0."""
    levels = tuple(levels)
    point = serving_score(baseline_first, baseline_second, candidate, gate_value, levels)["S"]
    if not gate_value:
        return [0.0, 0.0]
    seed = hashlib.sha256(json.dumps([baseline_first, baseline_second, candidate], sort_keys=True,
                                     default=str).encode()).digest()
    rng = random.Random(seed)
    values = []
    for _ in range(resamples):
        draw = [[rng.choice(block) for _ in block] for block in (baseline_first, baseline_second, candidate)]
        values.append(serving_score(*draw, gate_value, levels)["S"])
    values.sort()
    lo = values[int(0.025 * (len(values) - 1))]
    hi = values[math.ceil(0.975 * (len(values) - 1))]
    return [min(lo, point), max(hi, point)]
