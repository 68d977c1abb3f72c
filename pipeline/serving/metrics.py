"""A replayed level's figures: T_c and I_c (scored), the InferenceX-style figures (reported), its validity.

Pure functions of a replay document (pipeline/serving/replay.py: facts and per-turn records); nothing
here reads a clock or a server.

Scored (serving-track.md, "Metrics"):
- T_c = output tokens whose chunk arrived inside the window / (window seconds * GPUs). GPUs come from the
  launch template (8 on the SGLang node; 1 for the engines of the tests). Every turn's tokens count,
  whatever became of the turn (a cancelled turn's tokens before the window closed are output the server
  did produce).
- u = output tokens of a turn / its end-to-end latency, send to last counted token, so the time to the
  first token is inside it and a server that buffers its stream gains nothing.
- I_c = the slow-tail user's u, as InferenceX defines interactivity: 1 / P90(E2EL / OSL), the 90th
  percentile of each turn's seconds per output token, inverted after the percentile is taken (interpolating
  between rates instead would not give the same figure: the other order inverts the percentile's order and
  interpolates on another scale). Over the window's turns: those whose end falls inside the window (completed
  there, sent before it or not). A failed turn ending inside the window is an infinitely slow user (u = 0),
  so a server cannot lift its slow tail by failing its slowest turns; where the percentile reaches one, I_c is
  0. Cancelled turns (open when the window closed) do not count.

Reported, not scored (the server's own `usage` is trusted for none of them):
- 1000 / median TPOT, in tokens/s (InferenceX's interactivity): TPOT of a turn = (last token - first
  token) / (tokens - 1), over the window's completed turns with two tokens or more.
- TTFT p50 and p90 (first token's chunk - send), ms, over the window's completed turns.
- ITL p90, ms: the gaps between consecutive token-carrying chunks of the window's completed turns, a gap
  before a chunk of m tokens counted as m gaps of a m-th of it (the convention of SGLang's bench_serving).
- cache-hit rate: the sum of `usage.prompt_tokens_details.cached_tokens` over the sum of
  `usage.prompt_tokens` of the window's completed turns that report both; as the server claims it, so
  logged as untrusted; null when no turn reports it.
- usage disagreement: the share of those turns whose `usage.completion_tokens` differs from the client's
  count (untrusted; a check of the count itself, since a forced reply's text can re-tokenise otherwise).

Validity, over the whole run (warm-up included; cancelled turns left out): a level is invalid when no
turn completed, when more than 0.5% of turns failed (HTTP errors, broken streams, stream errors,
timeouts), or when any turn finished with fewer than max_tokens - 1 tokens. Each reason says what, with
the first such turn (its conversation, turn and error) as the example.

Percentiles interpolate linearly between order statistics (numpy's default, "linear").
"""

from __future__ import annotations

import math
from statistics import median
from typing import Any, Iterable

FAILED = ("http_error", "broken", "stream_error", "timeout")
MAX_FAILED_FRACTION = 0.005
MAX_EXAMPLE = 400  # characters of a failed turn's error quoted in a reason (the result keeps 2,000 a reason)


def _cut(text: str, cap: int) -> str:
    return text if len(text) <= cap else text[:cap - 3] + "..."


def percentile(values: Iterable[float], p: float) -> float | None:
    """The p-th percentile (0..100) by linear interpolation; None for no values."""
    xs = sorted(values)
    if not xs:
        return None
    if not 0 <= p <= 100:
        raise ValueError(f"percentile {p} is outside 0..100")
    pos = (len(xs) - 1) * p / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def window(facts: dict[str, Any]) -> tuple[int, int]:
    """The measurement window's bounds, ns on the run's own clock: [start, end)."""
    start, end = int(facts["window_start_ns"]), int(facts["window_end_ns"])
    if end <= start:
        raise ValueError(f"the window [{start}, {end}) ns is empty")
    return start, end


def in_window(t: int | None, bounds: tuple[int, int]) -> bool:
    return t is not None and bounds[0] <= t < bounds[1]


def tokens_in_window(turns: list[dict[str, Any]], bounds: tuple[int, int]) -> int:
    """Output tokens whose chunk's client timestamp lies inside the window, over every turn."""
    start, end = bounds
    total = 0
    for turn in turns:
        for t, n in zip(turn["chunk_ns"], turn["chunk_tokens"]):
            if start <= t < end:
                total += n
    return total


def throughput_per_gpu(turns: list[dict[str, Any]], bounds: tuple[int, int], gpus: int) -> float:
    """T_c: tokens timestamped in the window / (window seconds * GPUs)."""
    if gpus < 1:
        raise ValueError(f"gpus is {gpus}; the engine runs on at least one")
    seconds = (bounds[1] - bounds[0]) / 1e9
    return tokens_in_window(turns, bounds) / (seconds * gpus)


def user_rate(turn: dict[str, Any]) -> float:
    """u: a turn's tokens / (its last counted token - its send), tokens/s; 0 for a failed turn."""
    if turn["status"] in FAILED:
        return 0.0
    elapsed = turn["end_ns"] - turn["send_ns"]
    if turn["tokens"] == 0 or elapsed <= 0:
        return 0.0
    return turn["tokens"] / (elapsed / 1e9)


def window_turns(turns: list[dict[str, Any]], bounds: tuple[int, int]) -> list[dict[str, Any]]:
    """The turns I_c is taken over: ended inside the window, completed (ok or short) or failed."""
    return [t for t in turns if t["status"] != "cancelled" and t["send_ns"] is not None and in_window(t["end_ns"], bounds)]


def seconds_per_token(turn: dict[str, Any]) -> float:
    """E2EL / OSL of a turn: 1 / u, infinite for a failed turn or one without tokens."""
    u = user_rate(turn)
    return 1 / u if u > 0 else math.inf


def interactivity(turns: list[dict[str, Any]], bounds: tuple[int, int]) -> float | None:
    """I_c = 1 / P90(E2EL / OSL) over the window's turns (InferenceX's order: the percentile of seconds per
    token, then the inverse); 0 where the percentile reaches a failed turn; None when no turn ended
    there."""
    xs = sorted(seconds_per_token(t) for t in window_turns(turns, bounds))
    if not xs:
        return None
    pos = (len(xs) - 1) * 0.9
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    if math.isinf(xs[lo]) or (math.isinf(xs[hi]) and pos > lo):
        return 0.0
    p90 = xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)
    return 1 / p90 if p90 > 0 else math.inf


def _completed(turns: list[dict[str, Any]], bounds: tuple[int, int]) -> list[dict[str, Any]]:
    return [t for t in window_turns(turns, bounds) if t["status"] in ("ok", "short") and t["first_ns"] is not None]


def tpot_rate(turns: list[dict[str, Any]], bounds: tuple[int, int]) -> float | None:
    """1000 / median TPOT (ms), i.e. tokens/s of the median turn's decode; None without such turns."""
    tpots = [(t["end_ns"] - t["first_ns"]) / (t["tokens"] - 1) / 1e6
             for t in _completed(turns, bounds) if t["tokens"] >= 2]
    if not tpots:
        return None
    m = median(tpots)
    return 1000 / m if m > 0 else math.inf


def ttfts_ms(turns: list[dict[str, Any]], bounds: tuple[int, int]) -> list[float]:
    return [(t["first_ns"] - t["send_ns"]) / 1e6 for t in _completed(turns, bounds)]


def itls_ms(turns: list[dict[str, Any]], bounds: tuple[int, int]) -> list[float]:
    gaps: list[float] = []
    for t in _completed(turns, bounds):
        previous = None
        for when, n in zip(t["chunk_ns"], t["chunk_tokens"]):
            if n == 0:
                continue
            if previous is not None:
                gaps.extend([(when - previous) / n / 1e6] * n)
            previous = when
    return gaps


def cache_hit_rate(turns: list[dict[str, Any]], bounds: tuple[int, int]) -> float | None:
    """The servers' claimed cached share of prompt tokens (untrusted); None when no turn reports it."""
    cached = prompt = 0
    for t in _completed(turns, bounds):
        usage = t.get("usage")
        if not isinstance(usage, dict):
            continue
        details = usage.get("prompt_tokens_details")
        hit = details.get("cached_tokens") if isinstance(details, dict) else None
        total = usage.get("prompt_tokens")
        if isinstance(hit, (int, float)) and isinstance(total, (int, float)) and total > 0:
            cached += hit
            prompt += total
    return cached / prompt if prompt else None


def usage_disagreement(turns: list[dict[str, Any]], bounds: tuple[int, int]) -> float | None:
    """The share of the window's completed turns whose reported completion_tokens differ from the client's count.

    Untrusted and unscored: a diagnostic of the count itself (a model forced past its end writes tokens
    whose text re-tokenises differently); None when no turn reports usage.
    """
    reported = [t for t in _completed(turns, bounds)
                if isinstance(t.get("usage"), dict) and isinstance(t["usage"].get("completion_tokens"), int)]
    if not reported:
        return None
    return sum(t["usage"]["completion_tokens"] != t["tokens_streamed"] for t in reported) / len(reported)


def validity(turns: list[dict[str, Any]]) -> tuple[bool, list[str], dict[str, int]]:
    """(valid, reasons, counts) over the whole run; counts by status."""
    counts: dict[str, int] = {}
    for t in turns:
        counts[t["status"]] = counts.get(t["status"], 0) + 1
    failed = sum(counts.get(s, 0) for s in FAILED)
    short = counts.get("short", 0)
    ended = failed + short + counts.get("ok", 0)
    reasons = []
    if ended == 0:
        open_ = counts.get("cancelled", 0)
        reasons.append("no turn completed or failed in the whole run" +
                       (f" ({open_} still open when the window closed: a turn must finish inside the window)"
                        if open_ else ""))
    elif failed / ended > MAX_FAILED_FRACTION:
        kinds = ", ".join(f"{counts[s]} {s}" for s in FAILED if counts.get(s))
        first = min((t for t in turns if t["status"] in FAILED), key=lambda t: t["send_ns"] or 0)
        reasons.append(f"{failed} of {ended} turns failed ({100 * failed / ended:.2f}% > "
                       f"{100 * MAX_FAILED_FRACTION:g}%: {kinds}); the first, {first['conversation']} turn "
                       f"{first['turn']}: {first['status']}: {_cut(first['error'] or '', MAX_EXAMPLE)}")
    if short:
        worst = min((t for t in turns if t["status"] == "short"), key=lambda t: t["tokens_streamed"] - t["max_tokens"])
        reasons.append(f"{short} turns finished short of max_tokens - 1 (e.g. {worst['conversation']} turn "
                       f"{worst['turn']}: {worst['tokens_streamed']} tokens of {worst['max_tokens']})")
    return not reasons, reasons, counts


def level(document: dict[str, Any], gpus: int) -> dict[str, Any]:
    """Every figure of one replayed level, as plain data (the result schema's per-level entry)."""
    facts, turns = document["facts"], document["turns"]
    bounds = window(facts)
    valid, reasons, counts = validity(turns)
    ttft = ttfts_ms(turns, bounds)
    measured = window_turns(turns, bounds)

    def r(x: float | None, digits: int = 3) -> float | None:
        return None if x is None else round(x, digits)

    return {
        "concurrency": facts["concurrency"], "gpus": gpus, "window_s": (bounds[1] - bounds[0]) / 1e9,
        "T": throughput_per_gpu(turns, bounds, gpus), "I": interactivity(turns, bounds),
        "valid": valid, "invalid_reasons": reasons,
        "tokens_in_window": tokens_in_window(turns, bounds), "window_turns": len(measured),
        "turns_by_status": counts,
        "unscored": {
            "tpot_rate": r(tpot_rate(turns, bounds)),
            "ttft_p50_ms": r(percentile(ttft, 50)), "ttft_p90_ms": r(percentile(ttft, 90)),
            "itl_p90_ms": r(percentile(itls_ms(turns, bounds), 90), 4),
            "cache_hit_rate_untrusted": r(cache_hit_rate(turns, bounds), 4),
            "usage_disagreement_untrusted": r(usage_disagreement(turns, bounds), 4),
        },
    }


def summary_text(lv: dict[str, Any]) -> str:
    """The terminal lines of a level."""
    def f(x: Any, fmt: str = ".1f") -> str:
        return "-" if x is None else format(x, fmt)

    u = lv["unscored"]
    lines = [
        f"c={lv['concurrency']}  T_c {f(lv['T'])} tok/s/GPU ({lv['gpus']} GPU)  I_c {f(lv['I'])} tok/s  "
        f"{lv['window_turns']} turns in the window  {'valid' if lv['valid'] else 'INVALID'}",
        f"  unscored: 1000/median TPOT {f(u['tpot_rate'])} tok/s  TTFT p50 {f(u['ttft_p50_ms'])} ms "
        f"p90 {f(u['ttft_p90_ms'])} ms  ITL p90 {f(u['itl_p90_ms'], '.2f')} ms  "
        f"cache hits (server's claim) {f(u['cache_hit_rate_untrusted'], '.3f')}",
        "  turns: " + ", ".join(f"{n} {s}" for s, n in sorted(lv["turns_by_status"].items())),
    ]
    lines += [f"  invalid: {reason}" for reason in lv["invalid_reasons"]]
    return "\n".join(lines)
