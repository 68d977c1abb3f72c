"""The one result schema (versioned) that every stage after evaluation reads.

`pipeline/schema/result.schema.json` is the published contract; `validate` is called wherever a result
crosses a trust boundary (written by an evaluator, read from an artifact, appended to the ledger).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import math
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterator

SCHEMA_VERSION = 1
SCHEMA_PATH = Path(__file__).resolve().parent / "schema" / "result.schema.json"
STATUSES = ("passed", "incorrect", "compile_error", "runtime_error", "timeout", "rejected", "needs_review")


class ResultError(ValueError):
    pass


@lru_cache(maxsize=1)
def _validator():
    try:
        import jsonschema
    except ImportError:
        raise ResultError("validating a result needs the jsonschema package: pip install jsonschema") from None
    schema = json.loads(SCHEMA_PATH.read_text())
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def _non_finite(obj: Any, path: str = "") -> Iterator[str]:
    """The paths of NaN and infinite numbers in `obj` (JSON Schema cannot say "finite": NaN passes every
    bound, since every comparison with it is false)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        yield path or "/"
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _non_finite(v, f"{path}/{k}")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _non_finite(v, f"{path}/{i}")


def _deepest(error: Any) -> Any:
    """For a value that matched no branch of a oneOf (an object or null), the error inside the branch it
    came closest to ("4.5 is greater than the maximum of 4" at its own path), not the whole value restated."""
    while error.context:
        # the branch that is not a plain type mismatch ("... is not of type 'null'"), deepest first
        tried = [e for e in error.context if e.validator != "type"] or list(error.context)
        error = max(tried, key=lambda e: len(e.absolute_path))
    return error


def validate(doc: Any) -> None:
    """Raise ResultError naming every place where `doc` breaks the schema."""
    errors = sorted((_deepest(e) for e in _validator().iter_errors(doc)), key=lambda e: list(e.absolute_path))
    lines = [f"  at /{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in errors[:20]]
    if isinstance(doc, dict) and doc.get("track") == "serving":
        # every figure of a serving result is a measurement or a ratio of two; none may be NaN or infinite
        # (a kernel result may hold an infinite rel-L2 of a wrong output, so this is the serving track's rule)
        lines += [f"  at {p}: not a finite number" for p in list(_non_finite(doc))[:20]]
    if lines:
        raise ResultError("the result does not match result.schema.json:\n" + "\n".join(lines[:20]))


def now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def git_blob_sha(data: bytes) -> str:
    """The SHA git gives this content as a blob: what the PR's tree names, so the two can be matched."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def write(doc: dict[str, Any], path: Path) -> None:
    validate(doc)
    path.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")


def read(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ResultError(f"{path}: cannot read a result: {exc}") from None
    validate(doc)
    return doc


MAX_BYTES = 16 * 1024 * 1024


def read_data(path: Path, limit: int = MAX_BYTES) -> tuple[bytes, dict[str, Any]]:
    """A result file that crossed a trust boundary (an artifact, a download), read as data: a regular
    file opened without following a link, bounded in size, strict JSON (pipeline.signing.loads), valid
    by the schema. Returns its exact bytes (what the ledger's evidence keeps) and the document."""
    from pipeline.files import UnreadableFile, read_regular_file
    from pipeline.signing import loads

    try:
        raw, _ = read_regular_file(path, limit)
    except UnreadableFile as exc:
        raise ResultError(f"{path}: cannot read it as a result ({exc}); pass the result.json itself") from None
    try:
        doc = loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ResultError(f"{path}: not JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise ResultError(f"{path}: a result is a JSON object, not a {type(doc).__name__}")
    validate(doc)
    return raw, doc


# ---- the serving track's result ----

SERVING_PROBLEM = "serving"
SERVING_ORDER = ("baseline", "candidate", "candidate", "baseline")
Run = dict[int, dict[str, Any]]  # one sweep of the levels: {c: pipeline.serving.metrics.level(...)}


def _finite_or_none(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def _median(values: list[float]) -> float | None:
    from statistics import median

    return median(values) if values else None


def _clean_run(lv: dict[str, Any], c: int, where: str) -> dict[str, Any]:
    """A level's figures as the schema keeps them: an unscored figure that is not finite (metrics gives
    1000/median TPOT = inf when the median TPOT is 0) becomes null; a scored one refuses the run."""
    if lv.get("concurrency") != c:
        raise ResultError(f"{where}: the level filed under c = {c} says concurrency {lv.get('concurrency')!r}")
    run = dict(lv)
    for key in ("T", "I"):
        v = run.get(key)
        if v is not None and _finite_or_none(v) is None:
            raise ResultError(f"{where}: {key} = {v!r} at c = {c}; a scored figure is a finite number (or null for "
                              "an I_c with no turn in the window)")
    if run.get("T") is None:
        raise ResultError(f"{where}: no T at c = {c}; metrics.level always gives one")
    run["unscored"] = {k: _finite_or_none(v) for k, v in dict(lv.get("unscored") or {}).items()}
    return run


def serving_side(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One side (baseline or candidate) of one level over its runs: T and I the medians over the runs, as
    pipeline/serving/score.py takes them; the unscored figures the medians of the runs that have them; turns
    (in the window) and failed turns summed; valid only if every run is valid, every run has an I_c and
    the median T_c is above zero (a level with no output or no turn in its window measured nothing)."""
    from pipeline.serving.metrics import FAILED

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
    the first); `gsm8k`: {"candidate", "baseline", "questions"} (accuracies). `patch_gate`: the patch gate's
    GateVerdict.as_dict(); its flags become advisory flags of the result. `needs_review` holds a result that
    passed the gate for an organizer (its status is then needs_review).

    G = 1 gives status passed and `score` = {speedup: S, time_us, interval}; G = 0 gives status incorrect,
    `score` null, the gate's reasons as the first error, and S = 0 in serving.score (the ledger records
    only passing results, as for a wrong kernel).
    """
    from pipeline.serving import score as sc

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
            m: (k[m] / b[m] if k[m] is not None and b[m] else None) for m in ("T", "I")}})
    invalid = [e["concurrency"] for e in level_entries if not e["candidate"]["valid"]]
    G, reasons = sc.gate(candidate_agreement=canary["candidate"], baseline_agreement=canary["baseline"],
                         candidate_gsm8k=gsm8k["candidate"], baseline_gsm8k=gsm8k["baseline"], invalid_levels=invalid)

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
    interval = [S / (1 + spread), min(S * (1 + spread), sc.CLIP[1])]
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
        "error": None if passed else {"message": "the correctness gate failed (G = 0, so S = 0): " + "; ".join(reasons),
                                      "shape": None, "where": None, "log_tail": ""},
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
                     "invalid_levels": invalid},
        },
        "started_at": started_at,
        "finished_at": finished_at,
        "signature": None,
    }
    validate(doc)
    return doc


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
