"""B C C B's figures -> the serving part of the one result: each level's two sides over their runs, the
correctness gate G, S and its interval, and the status they give (pipeline/serving/score.py decides G and
S; this module writes what it decided as the result schema keeps it, and validates the document).

`serving_document` builds a scored result from the blocks' runs; `serving_failure_document` a result for
a serving evaluation that ended before it could be scored (a refused patch, a server that never came up,
the deadline). Every figure is cleaned to what result.schema.json keeps, so a candidate's server cannot
turn its own failure into a document the schema refuses.
"""

from __future__ import annotations

import math
from typing import Any

from pipeline.result import SCHEMA_VERSION, ResultError, cut, validate
from pipeline.serving import score as sc
from pipeline.serving.metrics import FAILED

SERVING_PROBLEM = "serving"
SERVING_ORDER = ("baseline", "candidate", "candidate", "baseline")
Run = dict[int, dict[str, Any]]  # one sweep of the levels: {c: pipeline.serving.metrics.level(...)}


def _finite_or_none(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def _median(values: list[float]) -> float | None:
    from statistics import median

    return median(values) if values else None


# What the schema keeps of a level's figures (result.schema.json's `rate`, `ms`, `fraction`): a figure beyond
# them was not measured from a server that serves (10 million tokens a second to one user).
RATE_MAX, MS_MAX = 1e7, 1e8
UNSCORED_MAX = {"tpot_rate": RATE_MAX, "ttft_p50_ms": MS_MAX, "ttft_p90_ms": MS_MAX, "itl_p90_ms": MS_MAX,
                "cache_hit_rate_untrusted": 1.0, "usage_disagreement_untrusted": 1.0}
RATIO_MAX = 1e6


def _clean_run(lv: dict[str, Any], c: int, where: str) -> dict[str, Any]:
    """A level's figures as the schema keeps them. An unscored figure that is not finite (metrics gives
    1000/median TPOT = inf when the median TPOT is 0) or outside the schema's range (a server's claim of
    more cached tokens than prompt tokens, a TPOT of a nanosecond from a burst) becomes null. A scored one
    that is not finite refuses the run (metrics never gives one); one above RATE_MAX (a garbage reply
    streamed at once) is kept at RATE_MAX and makes the level invalid, saying so: never a result the
    schema refuses, so a candidate's server cannot turn its own failure into the harness's."""
    if lv.get("concurrency") != c:
        raise ResultError(f"{where}: the level filed under c = {c} says concurrency {lv.get('concurrency')!r}")
    run = dict(lv)
    for key in ("T", "I"):
        v = run.get(key)
        if v is not None and _finite_or_none(v) is None:
            raise ResultError(f"{where}: {key} = {v!r} at c = {c}; a scored figure is a finite number (or null for "
                              "an I_c with no turn in the window)")
        if v is not None and v > RATE_MAX:
            run[key] = RATE_MAX
            run["valid"] = False
            run["invalid_reasons"] = [*run.get("invalid_reasons", []),
                                      f"{key}_c = {v:.4g} tokens/s, beyond the {RATE_MAX:g} a result keeps: not a "
                                      "measurement of a server that serves"][:50]
    if run.get("T") is None:
        raise ResultError(f"{where}: no T at c = {c}; metrics.level always gives one")
    unscored = {}
    for k, v in dict(lv.get("unscored") or {}).items():
        v = _finite_or_none(v)
        unscored[k] = v if v is not None and 0 <= v <= UNSCORED_MAX.get(k, math.inf) else None
    run["unscored"] = unscored
    return run


def serving_side(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One side (baseline or candidate) of one level over its runs: T and I the medians over the runs, as
    pipeline/serving/score.py takes them; the unscored figures the medians of the runs that have them; turns
    (in the window) and failed turns summed; valid only if every run is valid, every run has an I_c and
    the median T_c is above zero (a level with no output or no turn in its window measured nothing)."""
    if not runs:
        raise ResultError("a level side needs at least one run")
    by_status: dict[str, int] = {}
    for r in runs:
        for s, n in r["turns_by_status"].items():
            by_status[s] = by_status.get(s, 0) + n
    reasons = []
    for i, r in enumerate(runs):
        reasons += [f"run {i + 1}: {x}" if len(runs) > 1 else x for x in r["invalid_reasons"]]
    T = _median([r["T"] for r in runs])
    Is = [r["I"] for r in runs]
    I = None if any(v is None for v in Is) else _median(Is)
    if I is None:
        reasons.append("no turn ended inside the measurement window" + (" in some run" if len(runs) > 1 else ""))
    if not T:
        reasons.append("no output token was timestamped inside the measurement window")
    keys = sorted({k for r in runs for k in r["unscored"]})
    return {
        "T": T, "I": I,
        "unscored": {k: _median([r["unscored"][k] for r in runs if r["unscored"].get(k) is not None]) for k in keys},
        "turns": sum(r["window_turns"] for r in runs),
        "failed": sum(by_status.get(s, 0) for s in FAILED),
        "turns_by_status": dict(sorted(by_status.items())),
        "valid": all(r["valid"] for r in runs) and I is not None and bool(T),
        "invalid_reasons": reasons[:50],
        "runs": runs,
    }


def _gm(xs: list[float]) -> float:
    return math.exp(sum(map(math.log, xs)) / len(xs))


def serving_document(
    *,
    submission: dict[str, Any],
    patch_gate: dict[str, Any],
    engine: dict[str, Any],
    dataset: dict[str, Any],
    baseline_first: list[Run],
    baseline_second: list[Run],
    candidate: list[Run],
    canary: dict[str, Any],
    gsm8k: dict[str, Any],
    audit: dict[str, Any],
    official: bool,
    mode: dict[str, Any],
    environment: dict[str, Any],
    started_at: str,
    finished_at: str,
    order: tuple[str, ...] = SERVING_ORDER,
    flags: list[dict[str, Any]] | tuple = (),
    needs_review: bool = False,
    baseline: str | None = None,
) -> dict[str, Any]:
    """A serving evaluation -> its result document (validated), the one the report, ledger and board read.

    The runs are sweeps of the levels ({c: metrics.level(...)}): the two baseline blocks and the
    candidate's runs (B C C B). The score and the gate are computed here, with pipeline/serving/score.py,
    from exactly the figures the document keeps, so the two can never disagree. `canary`: {"candidate",
    "baseline", "turns"} (score.canary_agreement of the candidate and of the second baseline block against
    the first); `gsm8k`: {"candidate", "baseline", "questions"} (accuracies); `audit`: {"candidate",
    "baseline", "required"}, the first two score.audit_summary()s of the live turns re-sent to the last
    baseline block (the candidate blocks' and the first baseline block's), `required` whether evidence
    was due (score.py's gate, condition (d)). `patch_gate`: the patch gate's
    GateVerdict.as_dict(); its flags become advisory flags of the result. `needs_review` holds a result that
    passed the gate for an organizer (its status is then needs_review).

    G = 1 gives status passed and `score` = {speedup: S, time_us, interval}; G = 0 gives status incorrect,
    `score` null, the gate's reasons as the first error, and S = 0 in serving.score (the ledger records
    only passing results, as for a wrong kernel).
    """
    if not patch_gate.get("accepted"):
        raise ResultError("the patch gate refused this patch: a refused patch is never launched, so it has no "
                          "serving figures; write a rejected result instead")
    blocks = {"baseline block 1": baseline_first, "baseline block 2": baseline_second, "candidate": candidate}
    levels: tuple[int, ...] | None = None
    cleaned: dict[str, list[Run]] = {}
    for name, runs in blocks.items():
        if not runs:
            raise ResultError(f"{name}: no runs; B C C B needs at least one run in each block")
        cleaned[name] = []
        for i, run in enumerate(runs):
            cs = tuple(sorted(run))
            if levels is None:
                levels = cs
            if cs != levels:
                raise ResultError(f"{name} run {i + 1} has levels {list(cs)}, the first run {list(levels)}: every "
                                  "run sweeps the same concurrencies")
            cleaned[name].append({c: _clean_run(run[c], c, f"{name} run {i + 1}") for c in cs})
    assert levels is not None
    if official and levels != sc.LEVELS:
        raise ResultError(f"an official serving result measures c = {list(sc.LEVELS)}, not {list(levels)}")
    base_runs = cleaned["baseline block 1"] + cleaned["baseline block 2"]
    level_entries = []
    for c in levels:
        b = serving_side([r[c] for r in base_runs])
        k = serving_side([r[c] for r in cleaned["candidate"]])
        if not b["valid"]:
            raise ResultError(f"the baseline's level c = {c} is invalid ({'; '.join(b['invalid_reasons'])}): the "
                              "node or the harness is at fault, not the patch; the run cannot be scored")
        level_entries.append({"concurrency": c, "baseline": b, "candidate": k, "ratios": {
            m: (min(k[m] / b[m], RATIO_MAX) if k[m] is not None and b[m] else None) for m in ("T", "I")}})
    invalid = [e["concurrency"] for e in level_entries if not e["candidate"]["valid"]]
    G, reasons = sc.gate(candidate_agreement=canary["candidate"], baseline_agreement=canary["baseline"],
                         candidate_gsm8k=gsm8k["candidate"], baseline_gsm8k=gsm8k["baseline"], invalid_levels=invalid,
                         audit=audit)

    def figures(runs: list[Run]) -> list[sc.Levels]:
        return [{c: {"T": r[c]["T"], "I": r[c]["I"]} for c in levels} for r in runs]

    try:
        first = sc.median_levels(figures(cleaned["baseline block 1"]), levels)
        second = sc.median_levels(figures(cleaned["baseline block 2"]), levels)
        spread = sc.spread(first, second, levels)
        eps = sc.eps_from_spread(spread)
    except sc.ScoreError as exc:
        raise ResultError(f"the baseline cannot be scored: {exc}") from None
    if all(e["candidate"]["I"] is not None for e in level_entries):
        s = sc.serving_score(figures(cleaned["baseline block 1"]), figures(cleaned["baseline block 2"]),
                             figures(cleaned["candidate"]), G, levels)
        S, ungated, ratios = s["S"], s["S_ungated"], s["ratios"]
    else:  # a level without an I_c is invalid, so G = 0: the ratios that exist are kept for the record
        S, ungated = 0.0, None
        ratios = {f"{m}_{e['concurrency']}": sc.clip(e["ratios"][m]) for e in level_entries for m in sc.METRICS
                  if e["ratios"][m] is not None}
    # The runs' own spread, the candidate's included (score.score_interval, a bootstrap over each block's runs)
    interval = (sc.score_interval(figures(cleaned["baseline block 1"]), figures(cleaned["baseline block 2"]),
                                  figures(cleaned["candidate"]), G, levels) if ungated is not None else [S, S])
    performance = []
    for e in level_entries:
        for m in sc.METRICS:
            k, b = e["candidate"][m], e["baseline"][m]
            if k and b:
                performance.append({"workload": f"{m}_{e['concurrency']}", "median_us": 1e6 / k,
                                    "baseline_median_us": 1e6 / b, "speedup": k / b,
                                    "n": len(e["candidate"]["runs"])})
    doc_flags = [dict(f) for f in flags]
    for f in patch_gate.get("flags", []):
        doc_flags.append({"code": "patch_flag", "line": f.get("line") or None,
                          "message": f"{f.get('file') or 'the patch'}: [{f.get('pattern')}] {f.get('why')}"
                          + (f": {f['text']}" if f.get("text") else "")})
    if 2 * spread > sc.EPS_CAP:
        doc_flags.append({"code": "baseline_spread", "line": None,
                          "message": f"the baseline's two blocks differ by {spread:.1%} on some figure; eps is capped "
                                     f"at {sc.EPS_CAP:g}: the node was noisy, re-run before trusting this score"})
    passed = G == 1
    doc = {
        "schema_version": SCHEMA_VERSION,
        "track": "serving",
        "problem": SERVING_PROBLEM,
        "submission": submission,
        "status": ("needs_review" if needs_review else "passed") if passed else "incorrect",
        "official": official,
        "mode": mode,
        "error": None if passed else {"message": _gate_message(reasons, level_entries), "shape": None,
                                      "where": None, "log_tail": ""},
        "correctness": [],
        "performance": performance,
        "score": {"speedup": S, "time_us": _gm([1e6 / e["candidate"]["T"] for e in level_entries]),
                  "interval": interval} if passed else None,
        "flags": doc_flags,
        "environment": environment,
        "baseline": baseline or f"unpatched {engine['name']} {engine['version']}, same node, same run ({' '.join(x[0].upper() for x in order)})",
        "serving": {
            "patch_gate": patch_gate,
            "engine": engine,
            "dataset": dataset,
            "order": list(order),
            "levels": level_entries,
            "score": {"S": S, "G": G, "S_ungated": ungated, "ratios": ratios, "eps": eps, "baseline_spread": spread,
                      "spread_capped": 2 * spread > sc.EPS_CAP, "interval": interval},
            "gate": {"G": G, "reasons": reasons,
                     "canary": {"candidate": canary["candidate"], "baseline": canary["baseline"],
                                "turns": canary["turns"], "margin": sc.CANARY_MARGIN},
                     "gsm8k": {"candidate": gsm8k["candidate"], "baseline": gsm8k["baseline"],
                               "questions": gsm8k["questions"], "margin": sc.GSM8K_MARGIN},
                     "audit": {"candidate": audit["candidate"]["agreement"], "baseline": audit["baseline"]["agreement"],
                               "turns": audit["candidate"]["turns"], "baseline_turns": audit["baseline"]["turns"],
                               "failed": audit["candidate"]["failed"],
                               "length_ratio": audit["candidate"]["length_ratio"], "margin": sc.AUDIT_MARGIN,
                               "length_band": list(sc.AUDIT_LENGTH_BAND), "required": bool(audit["required"])},
                     "invalid_levels": invalid},
        },
        "started_at": started_at,
        "finished_at": finished_at,
        "signature": None,
    }
    validate(doc)
    return doc


LEVEL_ADVICE = ("Every turn must be streamed as the unpatched server streams it: one choice (index 0) whose "
                "delta carries the reply's text in one field (`content`), max_tokens tokens, then a finish_reason, "
                "within the turn timeout; more than 0.5% of turns failing, or one short of max_tokens - 1, "
                "invalidates a level (serving-track.md, \"The replay\"). Run the evaluation with --records DIR to "
                "read every turn's record (its status and error)")


def _gate_message(reasons: list[str], level_entries: list[dict[str, Any]]) -> str:
    """A gated result's error: what failed (the gate's reasons), where (each invalid level of the candidate,
    with its runs' reasons, runs numbered in the order they ran: what its turns did), and what to do."""
    message = "the correctness gate failed (G = 0, so S = 0): " + "; ".join(reasons)
    invalid = [e for e in level_entries if not e["candidate"]["valid"]]
    if invalid:
        parts = []
        for e in invalid:
            why = "; ".join(e["candidate"]["invalid_reasons"][:3]) or "invalid"
            parts.append(f"c = {e['concurrency']}: {cut(why, 1500)}")
        message += ". What the candidate's server did: " + " | ".join(parts)[:6000] + ". " + LEVEL_ADVICE
    return message


SERVING_FAILURES = ("rejected", "runtime_error", "timeout")


def serving_failure_document(
    *,
    status: str,
    message: str,
    submission: dict[str, Any],
    patch_gate: dict[str, Any],
    engine: dict[str, Any],
    dataset: dict[str, Any],
    official: bool,
    mode: dict[str, Any],
    environment: dict[str, Any],
    started_at: str,
    finished_at: str,
    log_tail: str = "",
    where: dict[str, Any] | None = None,
    order: tuple[str, ...] = SERVING_ORDER,
    flags: list[dict[str, Any]] | tuple = (),
    baseline: str | None = None,
) -> dict[str, Any]:
    """A serving evaluation that has no score (validated): the patch refused by the gate (`rejected`, never
    launched), or the candidate's server failing to launch or dying (`runtime_error`) or a phase past its
    wall clock (`timeout`). `message` says what happened, where (block, level, run) and what to do;
    `log_tail` is the end of the candidate server's output. No levels, no score, no gate: a partial
    measurement is never scored."""
    if status not in SERVING_FAILURES:
        raise ResultError(f"a serving failure is one of {', '.join(SERVING_FAILURES)}, not {status!r}")
    if status == "rejected" and patch_gate.get("accepted"):
        raise ResultError("a rejected serving result needs the gate's refusal; this patch was accepted")
    if status != "rejected" and not patch_gate.get("accepted"):
        raise ResultError("a refused patch is never launched: its result is rejected, not a launch failure")
    doc_flags = [dict(f) for f in flags]
    for f in patch_gate.get("flags", []):
        doc_flags.append({"code": "patch_flag", "line": f.get("line") or None,
                          "message": f"{f.get('file') or 'the patch'}: [{f.get('pattern')}] {f.get('why')}"
                          + (f": {f['text']}" if f.get("text") else "")})
    doc = {
        "schema_version": SCHEMA_VERSION,
        "track": "serving",
        "problem": SERVING_PROBLEM,
        "submission": submission,
        "status": status,
        "official": official,
        "mode": mode,
        "error": {"message": message, "shape": None, "where": where, "log_tail": log_tail[-8000:]},
        "correctness": [],
        "performance": [],
        "score": None,
        "flags": doc_flags,
        "environment": environment,
        "baseline": baseline or f"unpatched {engine['name']} {engine['version']}, same node, same run ({' '.join(x[0].upper() for x in order)})",
        "serving": {"patch_gate": patch_gate, "engine": engine, "dataset": dataset, "order": list(order),
                    "levels": [], "score": None, "gate": None},
        "started_at": started_at,
        "finished_at": finished_at,
        "signature": None,
    }
    validate(doc)
    return doc
