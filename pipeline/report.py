"""A result document -> the text a competitor reads: the terminal table and the PR comment.

Both renderers take their rows from the same builders, so the bot's comment and the local command
show the same numbers. Everything that came from a submission or a result file (its output, its
traceback, flags, names, the login) is untrusted and goes through pipeline/escape.py's rule for where it
lands: `md_inline` / `md_heading` / `md_code_block` in the comment, `terminal` / `terminal_lines` in the
terminal table, so it cannot add markdown, links, images, mentions, math, HTML or move a cursor. The
comment fits GitHub's limit by cutting the flags and the logs, never the verdict, the workload table, the
score or the rank (`comment_markdown`).

A serving result (track serving) shows, instead of the per-workload table, its per-concurrency table
(T_c and I_c of baseline and candidate, their ratios, turns, failures, validity), the correctness gate's
parts and S, the unscored figures, and a PNG of throughput per GPU against interactivity
(`serving_plot`). Every number of it is checked finite and in range as it is written (`_num`), and every
string (a server's error, a level's reason, the engine's name) goes through `md_inline`.

Rendering only: this module knows no transport and no ledger. pipeline/post.py decides what is posted
on a pull request (`post-result`) and pipeline/github.py posts it. The verbs here write what a reader
runs locally or a workflow keeps: `plot-result` (bench.yml) writes a serving result's PNG, `show-result`
prints a result as the terminal table. A PR's validation verdict (pipeline/validate.py) is rendered here
too (`verdict_markdown`).
"""

from __future__ import annotations

import argparse
import math
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tabulate import tabulate

from pipeline.escape import md_code_block, md_heading, md_inline, printable, terminal as terminal_text, terminal_lines
from pipeline.exits import OK, REFUSED, USAGE, error, guarded

if TYPE_CHECKING:  # pragma: no cover
    from pipeline.validate import Verdict

VERDICT = {
    "passed": "PASSED",
    "incorrect": "INCORRECT",
    "compile_error": "COMPILE ERROR",
    "runtime_error": "RUNTIME ERROR",
    "timeout": "TIMEOUT",
    "rejected": "REJECTED",
    "needs_review": "NEEDS REVIEW",
}


def _g(v: Any, fmt: str = ".3g") -> str:
    return "-" if v is None else format(v, fmt)


def correctness_rows(doc: dict[str, Any]) -> list[list[str]]:
    rows = []
    for entry in doc["correctness"]:
        out = entry["outputs"].get("output", {})
        worst_name, worst = "output", out
        for name, v in entry["outputs"].items():
            if not v.get("passed", True):
                worst_name, worst = name, v
                break
        rows.append([
            entry["shape"],
            entry["kind"],
            "ok" if entry["passed"] else "FAIL",
            f"{entry['seeds']}",
            _g(worst.get("max_abs")),
            _g(worst.get("max_rel")),
            _g(worst.get("rel_l2")),
            _g(worst.get("matched_ratio"), ".4%") if "matched_ratio" in worst else "-",
            "" if entry["passed"] else f"[{worst_name}] seed #{entry.get('failed_seed_index')}: {entry.get('reason')}",
        ])
    return rows


def first_failure(doc: dict[str, Any]) -> str | None:
    """The first failing shape's worst element, where the check recorded one: which output, where, what the
    submission wrote and what the reference holds (an index a competitor can look up in their own run)."""
    for entry in doc.get("correctness") or []:
        if entry.get("passed", True):
            continue
        for name, v in (entry.get("outputs") or {}).items():
            w = v.get("worst")
            if v.get("passed", True) or not isinstance(w, dict):
                continue
            try:
                got, want = float(w["got"]), float(w["expected"])
                index = ", ".join(str(int(i)) for i in w["index"])
            except (KeyError, TypeError, ValueError):
                return None
            return (f"First failing shape {entry['shape']} (seed index {entry.get('failed_seed_index')}), output {name}: "
                    f"its worst element, at [{index}], is {got:.6g} where the reference has {want:.6g} "
                    f"(off by {abs(got - want):.3g})")
        return None
    return None


CORRECTNESS_HEADERS = ["shape", "kind", "check", "seeds", "max abs", "max rel", "rel-L2", "matched", "why"]
PERFORMANCE_HEADERS = ["workload", "median us", "95% interval us", "baseline us", "speedup", "floor us", "n"]
MARKER = "<!-- muse-pipeline:sticky-result -->"
GITHUB_LIMIT = 65_536


def performance_rows(doc: dict[str, Any]) -> list[list[str]]:
    rows = []
    for p in doc["performance"]:
        interval = p.get("interval_us")
        rows.append([
            p["workload"],
            _g(p["median_us"], ",.2f"),
            f"{interval[0]:,.2f} - {interval[1]:,.2f}" if interval else "-",
            _g(p["baseline_median_us"], ",.2f"),
            f"{p['speedup']:.3f}x",
            _g(p.get("floor_us"), ",.2f"),
            str(p["n"]),
        ])
    return rows


def score_line(doc: dict[str, Any]) -> str | None:
    score = doc["score"]
    if not score:
        return None
    line = f"score: {score['time_us']:,.1f} us, {score['speedup']:.3f}x (geometric means)"
    if score.get("interval"):
        line += f"; 95% interval of the speedup {score['interval'][0]:.3f}x - {score['interval'][1]:.3f}x"
        if score.get("run_to_run"):
            line += f" (with the problem's run-to-run band of +-{score['run_to_run']:.1%})"
    return line


def timing_note(doc: dict[str, Any]) -> str | None:
    if not doc["performance"] or doc["official"]:
        return None
    mode = doc["mode"]
    if doc.get("track") == "serving":
        return ("These numbers are UNOFFICIAL: not the official plan on the serving node (its dataset, levels, "
                "windows and runs); only that run's numbers count.")
    if mode["device"] == "cpu" and "Triton interpreter" in mode["timing"]:
        return ("These timings are the Triton interpreter's, on a CPU: Python emulating the kernel, which says nothing "
                "of its speed on a GPU, so no score and no rank are given. Only the H200 runner's numbers count.")
    if mode["device"] == "cpu":
        return "These timings are UNOFFICIAL: wall-clock on a CPU with the smoke model; only the H200 runner's numbers count."
    if mode["timing"] != "cuda-graph":
        return "These timings are UNOFFICIAL: a wall-clock loop, not the official CUDA-graph method."
    return "These timings are UNOFFICIAL: public seeds, not the runner's official evaluation."


def _term_table(rows: list[list[str]], headers: list[str]) -> str:
    """A terminal table whose every cell went through escape.terminal (a cell cannot move the cursor)."""
    return tabulate([[terminal_text(c) for c in r] for r in rows], headers=headers, tablefmt="simple",
                    disable_numparse=True)


def _quoted(text: str, last: int = 15) -> list[str]:
    """The last lines of a submission's output, each behind `  | ` so that none can pass for a line of
    ours (a printed `verdict: PASSED`), its control characters shown as escapes."""
    return ["  | " + line for line in terminal_lines(text)[-last:]]


def terminal(doc: dict[str, Any]) -> str:
    """The result as the evaluator prints it in a terminal or job log; every string that came from a
    submission or a result file goes through pipeline/escape.py's terminal rule."""
    t = terminal_text
    mode = doc["mode"]
    lines = [
        f"{t(doc['problem'])}  {t(doc['submission']['path'])}",
        f"device {t(mode['device'])}, {t(mode['model'])} model, {t(mode['seeds'])} seeds, timing: {t(mode['timing'])}",
        "",
    ]
    if doc["correctness"]:
        lines.append(_term_table(correctness_rows(doc), CORRECTNESS_HEADERS))
        failure = first_failure(doc)
        if failure:
            lines.append(t(failure))
        lines.append("")
    if doc.get("serving"):
        lines += serving_terminal(doc)
    elif doc["performance"]:
        lines.append(_term_table(performance_rows(doc), PERFORMANCE_HEADERS))
        lines.extend(x for x in (score_line(doc), timing_note(doc)) if x)
        lines.append("")
    if doc["error"]:
        err = doc["error"]
        lines.append(f"error{' in shape ' + t(err['shape']) if err.get('shape') else ''}: {t(err['message'])}")
        where = err.get("where")
        if where and where.get("line"):
            lines.append(f"  at {t(where.get('file'))}:{t(where['line'])} in {t(where.get('function'))}: "
                         f"{t(where.get('code', ''))}")
        if err.get("traceback"):
            lines.append("traceback (tail):")
            lines.extend(_quoted(err["traceback"]))
        if err.get("log_tail"):
            lines.append("output of the submission (tail):")
            lines.extend(_quoted(err["log_tail"]))
        lines.append("")
    for flag in doc["flags"]:
        line = f" (line {t(flag['line'])})" if flag.get("line") else ""
        lines.append(f"flag {t(flag['code'])}{line}: {t(flag['message'])}")
    lines.append(f"verdict: {VERDICT[doc['status']]}")
    return "\n".join(lines)


# ---- the PR comment ----

# the first error's message as the comment shows it (the result keeps it whole)
MAX_ERROR_MESSAGE = 4000
# failing shape rows kept before the flags are; the rest of the rows come after the logs
FAILING_ROWS_FIRST = 200
_NOTE_RESERVE = 600

# The names other stages know; the rules themselves live in pipeline/escape.py.
md_escape = md_inline
code_block = md_code_block


def size(text: str) -> int:
    """What a text costs against GitHub's limit: its UTF-8 bytes, never fewer than the characters (or the
    UTF-16 units) that GitHub could be counting."""
    return len(text.encode("utf-8", "surrogatepass"))


def _lines_size(lines: list[str]) -> int:
    return sum(size(x) + 1 for x in lines)


def _table(headers: list[str], rows: list[list[str]]) -> str:
    """A GFM table, every cell through md_inline (the headers are ours)."""
    return tabulate([[md_inline(c) for c in r] for r in rows], headers=headers, tablefmt="github",
                    disable_numparse=True)


def _table_lines(headers: list[str], rows: list[list[str]]) -> list[str]:
    return _table(headers, rows).split("\n") if rows else _table(headers, [[""] * len(headers)]).split("\n")[:2]


def _tail_section(title: str, text: str, lang: str, budget: int) -> tuple[list[str], int]:
    """`title` and the longest tail of `text` (from a line's start) whose code block fits `budget`;
    ([], 0) when not even a line fits. Returns the lines and how many characters were left out."""
    if not text:
        return [], 0
    lines = [title, "", md_code_block(text, lang), ""]
    if _lines_size(lines) <= budget:
        return lines, 0
    keep = budget
    for _ in range(64):
        if keep <= 0:
            break
        tail = text[-keep:]
        newline = tail.find("\n")
        if 0 <= newline < len(tail) - 1:
            tail = tail[newline + 1:]
        lines = [f"{title} (its last {len(tail):,} of {len(text):,} characters)", "", md_code_block(tail, lang), ""]
        over = _lines_size(lines) - budget
        if over <= 0:
            return lines, len(text) - len(tail)
        keep = min(keep, len(tail)) - max(over, 1)
    return [], len(text)


def comment_markdown(doc: dict[str, Any], *, rank: str | None = None, log_url: str | None = None,
                     limit: int = GITHUB_LIMIT, plot_url: str | None = None,
                     plot_artifact_url: str | None = None) -> str:
    """The sticky PR comment (and the check run's summary) for a result, always within `limit` (by
    `size`). A serving result's plot is drawn in the comment as text (`text_plot`); `plot_url`: where its
    PNG (serving_plot) is hosted, an https URL, shown as an image; else `plot_artifact_url`: the bench
    run's artifact page holding the PNG, linked; without either the comment names the file.

    Whatever has to go, the comment keeps, in this order: the verdict, the workload (or per-concurrency)
    table, the score, the would-be rank and the first error. Then, as far as they fit: the failing shape
    rows, the flags, the traceback's and the log's tails, the passing shape rows; each part that was cut
    says so and how much, and a note at the end lists what was left out."""
    sub = doc["submission"]
    head = [
        MARKER,
        f"### {md_heading(doc['problem'])}: {VERDICT[doc['status']]}",
        "",
        f"Submission {md_inline(sub['path'], 200)}"
        + (f" by {md_inline(sub['login'], 60)}" if sub.get("login") else "")
        + (f" at {md_inline(sub['head_sha'][:12])}" if sub.get("head_sha") else "")
        + f" (blob {md_inline(sub['blob_sha'][:12])}).",
        f"Mode: {md_inline(doc['mode']['device'])}, {md_inline(doc['mode']['model'])} model, "
        f"{md_inline(doc['mode']['seeds'])} seeds, timing: {md_inline(doc['mode']['timing'])}; "
        f"baseline: {md_inline(doc['baseline'])}.",
        "",
    ]
    failure = first_failure(doc)
    if failure:
        head += [md_inline(failure, 600), ""]
    perf: list[str] = []
    if doc.get("serving"):
        perf = serving_markdown(doc, rank=rank, plot_url=plot_url, log_url=log_url, plot_artifact_url=plot_artifact_url)
    elif doc["performance"]:
        perf += [_table(PERFORMANCE_HEADERS, performance_rows(doc)), ""]
        perf += [x + "  " for x in (score_line(doc), timing_note(doc)) if x]
        if rank:
            perf.append(f"Would-be rank on the current board: {md_inline(rank)}")
        perf.append("")
    flag_lines = [f"- **{md_inline(f['code'], 80)}**" + (f" (line {_int(f['line'])})" if f.get("line") else "")
                  + f": {md_inline(f['message'])}" for f in doc["flags"]]
    err_head: list[str] = []
    traceback, log_tail = "", ""
    if doc["error"]:
        err = doc["error"]
        where = err.get("where") or {}
        message = str(err["message"])
        if len(message) > MAX_ERROR_MESSAGE:
            message = message[:MAX_ERROR_MESSAGE] + f"\n... ({len(message) - MAX_ERROR_MESSAGE:,} more characters in the result)"
        in_shape = f" in shape {md_inline(err['shape'], before_colon=True)}" if err.get("shape") else ""
        err_head = [f"**First error**{in_shape}:", "",
                    md_code_block(message)]
        if where.get("line"):
            err_head.append(f"at {md_inline(where.get('file'), 100)} line {_int(where['line'])}")
        err_head.append("")
        traceback = str(err.get("traceback") or "")
        log_tail = str(err.get("log_tail") or "")
    env = doc["environment"]
    if doc.get("serving"):
        engine = doc["serving"]["engine"]
        software = f"{md_inline(engine['name'])} {md_inline(engine['version'])} on {_int(engine['gpus'])} GPU"
    else:
        software = f"torch {md_inline(env.get('torch'))}, triton {md_inline(env.get('triton'))}"
    foot = [
        f"<sub>{md_inline(env.get('gpu') or env.get('cpu') or 'cpu')}, {software}, "
        f"harness {md_inline((env.get('harness_commit') or 'unknown')[:12])}, "
        f"{md_inline(doc['started_at'])} - {md_inline(doc['finished_at'])}"
        + (f" · [run log]({log_url})" if log_url and _SAFE_URL.fullmatch(log_url) else "")
        + "</sub>",
    ]
    rows = correctness_rows(doc)
    open_ = " open" if doc["status"] == "incorrect" else ""

    def correctness(kept: list[int], left_out: int) -> list[str]:
        if not kept and not left_out:
            return []
        return ([f"<details{open_}><summary>Correctness, per shape</summary>", ""]
                + _table_lines(CORRECTNESS_HEADERS, [rows[i] for i in kept])
                + ([f"{left_out:,} of {len(rows):,} shape rows were cut to fit (the failing ones are kept first; "
                    "the result has them all)."] if left_out else [])
                + ["", "</details>", ""])

    def flags(lines: list[str], cut: int) -> list[str]:
        if not lines and not cut:
            return []
        return (["Flags (advisory; leaders are reviewed before prizes):", *lines]
                + ([f"- and {cut:,} more flags, cut to fit (the result has them all)"] if cut else []) + [""])

    def render(corr: list[str], fl: list[str], tb: list[str], log: list[str], note: str | None) -> str:
        parts = head + perf + corr + fl + err_head + tb + log + ([f"_{note}_", ""] if note else [])
        return "\n".join(parts + foot) + "\n"

    def tail(title: str, text: str, lang: str) -> list[str]:
        return [title, "", md_code_block(text, lang), ""] if text else []

    everything = render(correctness(list(range(len(rows))), 0), flags(flag_lines, 0),
                        tail("Traceback (tail):", traceback, "python"), tail("Output of the submission (tail):",
                                                                                log_tail, "text"), None)
    if size(everything) <= limit:
        return everything
    budget = limit - size(render([], [], [], [], None)) - _NOTE_RESERVE
    if budget < 0:  # not even the verdict's parts fit (a tiny limit): the verdict alone
        note = "Truncated to fit GitHub's comment limit" + ("; the run log has everything." if log_url else ".")
        return (MARKER + "\n" + f"### {md_heading(doc['problem'])}: {VERDICT[doc['status']]}\n\n_{note}_\n")[:limit]
    # the failing shape rows first, then the flags, then the tails of the logs, then the passing rows
    failing = [i for i, r in enumerate(rows) if r[2] != "ok"]
    # a row's line in the whole table (padded to the widest cell of all rows) bounds its cost in any subset,
    # and the whole table's header and separator lines bound theirs
    whole = _table_lines(CORRECTNESS_HEADERS, rows) if rows else []
    row_cost = [size(x) + 1 for x in whole[2:]]
    kept: list[int] = []
    used = _lines_size(correctness([], len(rows))) + _lines_size(whole[:2]) if rows else 0
    for i in failing[:FAILING_ROWS_FIRST]:
        cost = row_cost[i]
        if used + cost > budget:
            break
        kept.append(i)
        used += cost
    # the tails of the logs keep up to a third of what is left, however many flags there are
    tails = _lines_size(tail("Traceback (tail):", traceback, "python") + tail("Output of the submission (tail):",
                                                                              log_tail, "text"))
    reserve = min(tails, (budget - used) // 3)
    kept_flags: list[str] = []
    flags_used = _lines_size(flags([], len(flag_lines))) if flag_lines else 0
    for line in flag_lines:
        if used + flags_used + size(line) + 1 > budget - reserve:
            break
        kept_flags.append(line)
        flags_used += size(line) + 1
    used += flags_used
    room = budget - used
    tb, tb_cut = _tail_section("Traceback (tail)", traceback, "python", room // 2 if log_tail else room)
    room -= _lines_size(tb)
    log, log_cut = _tail_section("Output of the submission (tail)", log_tail, "text", room)
    room -= _lines_size(log)
    chosen = set(kept)
    for i in range(len(rows)):
        if i in chosen:
            continue
        cost = row_cost[i]
        if cost > room:
            break
        kept.append(i)
        room -= cost
    kept.sort()
    cut_rows, cut_flags = len(rows) - len(kept), len(flag_lines) - len(kept_flags)
    what = [f"{cut_flags:,} of {len(flag_lines):,} flags" if cut_flags else "",
            f"{tb_cut:,} characters of the traceback" if tb_cut else "",
            f"{log_cut:,} characters of the log" if log_cut else "",
            f"{cut_rows:,} of {len(rows):,} shape rows" if cut_rows else ""]
    note = ("Truncated to fit GitHub's comment limit: left out " + ", ".join(w for w in what if w)
            + ("; the run log has everything." if log_url else "; the result has everything."))
    return render(correctness(kept, cut_rows) if rows else [], flags(kept_flags, cut_flags), tb, log, note)


# ---- the serving track ----

SERVING_HEADERS = ["c", "T_c baseline", "T_c candidate", "T ratio", "I_c baseline", "I_c candidate", "I ratio",
                   "turns", "failed", "level"]
UNSCORED_HEADERS = ["c", "side", "1000/median TPOT", "TTFT p50 ms", "TTFT p90 ms", "ITL p90 ms",
                    "cache hits (server's claim)", "turns", "failed"]
PLOT_NAME = "serving-plot.png"
PLOT_ALT = "throughput per GPU against interactivity, baseline and candidate, one point per concurrency"
_SAFE_URL = re.compile(r"^https://[\w./-]+\Z")
_MAX_REASONS = 5  # per level side, in the comment (the result keeps them all)
_MAX_REASON_LINES = 20  # in all


def _num(v: Any, fmt: str, lo: float = 0.0, hi: float = 1e12, suffix: str = "") -> str:
    """A number as text, only once it is a finite number in [lo, hi]: "-" for a missing one and "invalid"
    for anything else, so that no value the schema let through by mistake reaches the comment as text."""
    if v is None:
        return "-"
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not lo <= v <= hi:
        return "invalid"
    return format(v, fmt) + suffix


def _int(v: Any) -> str:
    return _num(v, "d", 0, 1e9) if isinstance(v, int) and not isinstance(v, bool) else "invalid"


def _pct(v: Any) -> str:
    return _num(None if v is None else v * 100 if isinstance(v, (int, float)) else v, ".2f", 0, 100, "%")


def serving_rows(doc: dict[str, Any]) -> list[list[str]]:
    """Per concurrency: T_c and I_c of baseline and candidate (medians over their runs), the ratios
    before clipping, the candidate's turns in the window and failed turns, and whether the level counts."""
    rows = []
    for lv in doc["serving"]["levels"]:
        b, k, r = lv["baseline"], lv["candidate"], lv["ratios"]
        rows.append([
            _int(lv["concurrency"]),
            _num(b["T"], ",.1f", 0, 1e7), _num(k["T"], ",.1f", 0, 1e7), _num(r["T"], ".3f", 0, 1e6, "x"),
            _num(b["I"], ",.1f", 0, 1e7), _num(k["I"], ",.1f", 0, 1e7), _num(r["I"], ".3f", 0, 1e6, "x"),
            _int(k["turns"]), _int(k["failed"]), "valid" if k["valid"] is True else "INVALID",
        ])
    return rows


def unscored_rows(doc: dict[str, Any]) -> list[list[str]]:
    rows = []
    for lv in doc["serving"]["levels"]:
        for side in ("baseline", "candidate"):
            s = lv[side]
            u = s["unscored"]
            rows.append([_int(lv["concurrency"]), side, _num(u.get("tpot_rate"), ",.1f", 0, 1e7),
                         _num(u.get("ttft_p50_ms"), ",.1f", 0, 1e8), _num(u.get("ttft_p90_ms"), ",.1f", 0, 1e8),
                         _num(u.get("itl_p90_ms"), ",.2f", 0, 1e8), _pct(u.get("cache_hit_rate_untrusted")),
                         _int(s["turns"]), _int(s["failed"])])
    return rows


def serving_score_line(doc: dict[str, Any]) -> str | None:
    score = doc["serving"]["score"]
    if not score:
        return None
    line = f"S = {_num(score['S'], '.3f', 0, 4)} (G = {_int(score['G'])}"
    if score["G"] == 1:
        lo, hi = score["interval"]
        line += f"; 95% interval {_num(lo, '.3f', 0, 4)} - {_num(hi, '.3f', 0, 4)}"
    else:
        line += f"; {_num(score['S_ungated'], '.3f', 0, 4)} before the gate" if score["S_ungated"] is not None else ""
    return line + (f"; eps {_pct(score['eps'])}, twice the baseline's spread against itself"
                   + (", capped" if score["spread_capped"] is True else "") + ")")


def gate_lines(doc: dict[str, Any]) -> list[str]:
    """The correctness gate's four parts, each with what it needed, and G."""
    gate = doc["serving"]["gate"]
    if not gate:
        return []
    canary, gsm = gate["canary"], gate["gsm8k"]

    def need(base: Any, margin: Any) -> str:
        ok = all(isinstance(x, (int, float)) and math.isfinite(x) for x in (base, margin))
        return _pct(max(0.0, base - margin)) if ok else "-"

    def holds(value: Any, base: Any, margin: Any) -> bool:
        """value >= base - margin, as score.gate decides it; False for anything that is not three numbers."""
        nums = (value, base, margin)
        return all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in nums) \
            and value >= base - margin - 1e-12

    c_ok = holds(canary["candidate"], canary["baseline"], canary["margin"])
    g_ok = holds(gsm["candidate"], gsm["baseline"], gsm["margin"])
    invalid = gate["invalid_levels"]
    return [
        f"correctness gate: G = {_int(gate['G'])}",
        f"canary agreement {_pct(canary['candidate'])} over {_int(canary['turns'])} turns (the baseline's "
        f"self-agreement {_pct(canary['baseline'])}; needs {need(canary['baseline'], canary['margin'])}): "
        + ("ok" if c_ok else "FAILED"),
        f"GSM8K 5-shot {_pct(gsm['candidate'])} of {_int(gsm['questions'])} questions (the baseline "
        f"{_pct(gsm['baseline'])}; needs {need(gsm['baseline'], gsm['margin'])}): " + ("ok" if g_ok else "FAILED"),
        "invalid levels: " + (", ".join(f"c = {_int(c)}" for c in invalid) + ": FAILED" if invalid else "none"),
    ] + _audit_lines(gate)


def _audit_lines(gate: dict[str, Any]) -> list[str]:
    """The audit (score.py's condition (d)): failed exactly when the gate gave an audit reason."""
    audit = gate.get("audit")
    if not isinstance(audit, dict):
        return []
    failed = any(isinstance(r, str) and r.startswith("audit:") for r in gate.get("reasons") or [])
    base, margin = audit.get("baseline"), audit.get("margin")
    need = (_pct(max(0.0, base - margin)) if all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                  and math.isfinite(x) for x in (base, margin)) else "-")
    band = audit.get("length_band") or [None, None]
    return [f"audit of live turns {_pct(audit.get('candidate'))} agreement over {_int(audit.get('turns'))} turns re-sent "
            f"to the baseline (its self-agreement {_pct(base)} over {_int(audit.get('baseline_turns'))}; needs {need}), "
            f"length x{_num(audit.get('length_ratio'), '.3f', 0, 1e6)} (band {_num(band[0], 'g', 0, 1e6)} - "
            f"{_num(band[-1], 'g', 0, 1e6)}): " + ("FAILED" if failed else "ok")]


def _level_reasons(doc: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, why) of every invalid level side, at most _MAX_REASONS reasons each."""
    out = []
    for lv in doc["serving"]["levels"]:
        for side in ("candidate", "baseline"):
            s = lv[side]
            if s["valid"] is not True:
                reasons = s["invalid_reasons"] or ["(no reason given)"]
                for why in reasons[:_MAX_REASONS]:
                    out.append((f"c = {_int(lv['concurrency'])}, {side}", why))
                if len(reasons) > _MAX_REASONS:
                    out.append((f"c = {_int(lv['concurrency'])}, {side}", f"and {len(reasons) - _MAX_REASONS} more"))
    if len(out) > _MAX_REASON_LINES:
        out = out[:_MAX_REASON_LINES - 1] + [("more", f"{len(out) - _MAX_REASON_LINES + 1} more reasons are in the result")]
    return out


def serving_terminal(doc: dict[str, Any]) -> list[str]:
    t = terminal_text
    s = doc["serving"]
    lines = [f"engine {t(s['engine']['name'])} {t(s['engine']['version'])} on {_int(s['engine']['gpus'])} GPU; "
             f"dataset {t(s['dataset']['sha256'][:12])} ({_int(s['dataset']['conversations'])} conversations); "
             f"patch: {_int(len(s['patch_gate']['files']))} file(s), +{_int(s['patch_gate']['added'])} "
             f"-{_int(s['patch_gate']['removed'])}"]
    if s["levels"]:
        lines += ["", _term_table(serving_rows(doc), SERVING_HEADERS),
                  "T_c: output tokens/s per GPU in the window; I_c: 1 / P90 of seconds per output token "
                  "(the slow-tail user), tokens/s.", ""]
        lines += [x for x in (serving_score_line(doc),) if x]
        lines += gate_lines(doc)
        lines += [f"  {t(where)}: {t(why)}" for where, why in _level_reasons(doc)]
        lines += ["", "unscored:", _term_table(unscored_rows(doc), UNSCORED_HEADERS)]
        lines.extend(x for x in (timing_note(doc),) if x)
    lines.append("")
    return lines


def serving_markdown(doc: dict[str, Any], *, rank: str | None = None, plot_url: str | None = None,
                     log_url: str | None = None, plot_artifact_url: str | None = None) -> list[str]:
    """The serving part of the PR comment (lines)."""
    s = doc["serving"]
    pg = s["patch_gate"]
    out = [f"Engine {md_escape(s['engine']['name'])} {md_escape(s['engine']['version'])} on "
           f"{_int(s['engine']['gpus'])} GPU; dataset {md_escape(s['dataset']['sha256'][:12])} "
           f"({_int(s['dataset']['conversations'])} conversations); patch: {_int(len(pg['files']))} file(s), "
           f"+{_int(pg['added'])} -{_int(pg['removed'])} lines.", ""]
    if not s["levels"]:
        return out
    line = serving_score_line(doc)
    if line:
        out += [f"**Score {line}**  " if s["score"]["G"] == 1 else f"**Score {line}**: not ranked  "]
        if s["score"]["G"] != 1:
            # as a kernel that fails its check: merging the PR records nothing (pipeline/ledger.py)
            out.append("The correctness gate failed, so S = 0: this result is never recorded in the ledger nor ranked "
                       "on the serving board, even if the pull request is merged. What failed is below; fix it and "
                       "push again for a new evaluation.  ")
    if rank:
        out.append(f"Would-be rank on the current board: {md_escape(rank)}  ")
    note = timing_note(doc)
    out += ([f"{note}  "] if note else []) + [""]
    out += [_table(SERVING_HEADERS, serving_rows(doc)), "",
            "T_c: output tokens per second per GPU inside the measurement window; I_c: 1 / the 90th percentile "
            "of each turn's end-to-end latency per output token, tokens/s; both the medians over the runs. Ratios are "
            "candidate / baseline before clipping to [0.25, 4]; below 1 - eps a shortfall counts double.", ""]
    gate = gate_lines(doc)
    if gate:
        # gate_lines is made of our own words and of numbers through _num alone; the reasons are the server's
        out += [f"**{gate[0][0].upper()}{gate[0][1:]}**", ""] + [f"- {x}" for x in gate[1:]]
        out += [f"  - {md_escape(where, before_colon=True)}: {md_escape(why, 300)}"
                for where, why in _level_reasons(doc)] + [""]
    drawn = text_plot(doc)
    if drawn:
        out += ["Throughput per GPU against interactivity (B: baseline, C: candidate; the number is c):", "",
                code_block(drawn), ""]
    if plot_url and _SAFE_URL.fullmatch(plot_url):
        out += [f"![{PLOT_ALT}]({plot_url})", ""]  # our URL, checked; never the result's
    elif plot_artifact_url and _SAFE_URL.fullmatch(plot_artifact_url):
        out += [f"The plot as a PNG: [`{PLOT_NAME}`]({plot_artifact_url}) (the bench run's artifact "
                "`serving-plot`, a zip).", ""]
    else:
        out += [f"The plot of throughput per GPU against interactivity is `{PLOT_NAME}` in the run's artifacts"
                + (f" ([run log]({log_url}))." if log_url and _SAFE_URL.fullmatch(log_url) else "."), ""]
    out += ["<details><summary>Unscored figures per level (reported, not scored)</summary>", "",
            _table(UNSCORED_HEADERS, unscored_rows(doc)), "", "</details>", ""]
    return out


# ---- the serving plot ----

def plot_series(doc: dict[str, Any]) -> dict[str, list[tuple[int, float, float]]]:
    """{side: [(c, I_c, T_c)]} in order of concurrency, the points both figures of which are finite."""
    out: dict[str, list[tuple[int, float, float]]] = {"baseline": [], "candidate": []}
    for lv in sorted(doc["serving"]["levels"], key=lambda lv: lv["concurrency"]):
        for side in out:
            T, I = lv[side]["T"], lv[side]["I"]
            if all(isinstance(x, (int, float)) and math.isfinite(x) and 0 <= x <= 1e7 for x in (T, I)):
                out[side].append((int(lv["concurrency"]), float(I), float(T)))
    return out


def text_plot(doc: dict[str, Any], width: int = 56, height: int = 14) -> str | None:
    """The plot as text, for the comment itself (GitHub shows no image it cannot fetch): T_c up, I_c
    across, each point its side's letter and c ("B16", "C16"), on axes from 0. Made of our own letters
    and of numbers alone; None when no point has both figures."""
    series = plot_series(doc)
    points = [(side[0].upper(), c, x, y) for side, pts in series.items() for c, x, y in pts]
    if not points:
        return None
    xmax = max(p[2] for p in points) * 1.08 or 1.0
    ymax = max(p[3] for p in points) * 1.08 or 1.0
    grid = [[" "] * width for _ in range(height)]
    for mark, c, x, y in sorted(points, key=lambda p: (p[0] != "B", p[1])):  # the candidate drawn last, on top
        label = f"{mark}{c}"
        col = min(width - len(label), int(round(x / xmax * (width - 1))))
        row = height - 1 - min(height - 1, int(round(y / ymax * (height - 1))))
        grid[row][col:col + len(label)] = list(label)
    top, left = f"{ymax:,.0f}", 7
    lines = ["T_c (tokens/s/GPU)"]
    for r, cells in enumerate(grid):
        tick = top if r == 0 else "0" if r == height - 1 else ""
        lines.append(f"{tick:>{left}} |" + "".join(cells).rstrip())
    lines.append(" " * left + " +" + "-" * width)
    right = f"{xmax:,.0f}"
    lines.append(" " * (left + 1) + "0" + " " * (width - len(right)) + right)
    lines.append(" " * (left + 1) + "I_c: 1 / P90 of seconds per output token (tokens/s)")
    return "\n".join(lines)


def png_bytes(fig: Any, digest: str) -> bytes:
    """The figure as a deterministic PNG: laid out, no software name or timestamp in the file, and the
    sha256 of the plotted series in its Description (the boards' plots and the PR comment's)."""
    import io

    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata={"Software": None, "Description": f"series sha256 {digest}"})
    return buf.getvalue()


def serving_plot(doc: dict[str, Any]) -> bytes | None:
    """A PNG: throughput per GPU (T_c) against interactivity (I_c), baseline and candidate, one point per
    concurrency joined in order; None for a result with no levels. Deterministic for one document (no
    timestamp or software name in the file), with the series' sha256 in its Description. Needs matplotlib."""
    if not doc.get("serving") or not doc["serving"]["levels"]:
        return None
    import hashlib
    import json

    series = plot_series(doc)
    if not any(series.values()):
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    digest = hashlib.sha256(json.dumps(series, sort_keys=True).encode()).hexdigest()
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=100)
    try:
        styles = {"baseline": dict(color="0.45", marker="o", linestyle="--", label="baseline (unpatched)"),
                  "candidate": dict(color="C0", marker="s", linestyle="-", label="candidate (this patch)")}
        for side, points in series.items():
            if not points:
                continue
            xs, ys = [p[1] for p in points], [p[2] for p in points]
            ax.plot(xs, ys, linewidth=1.6, markersize=5, **styles[side])
            for c, x, y in points:
                ax.annotate(f"c={c}", (x, y), textcoords="offset points", xytext=(5, 4), fontsize=7,
                            color=styles[side]["color"])
        ax.set_xlabel("interactivity I_c: 1 / P90 of seconds per output token (tokens/s)")
        ax.set_ylabel("throughput per GPU T_c (tokens/s/GPU)")
        ax.set_title("throughput per GPU against interactivity", fontsize=10)
        ax.margins(0.1)
        ax.set_xlim(left=0)
        ax.set_ylim(bottom=0)
        ax.grid(True, linewidth=0.3)
        ax.legend(loc="best", fontsize=8)
        return png_bytes(fig, digest)
    finally:
        plt.close(fig)


def write_serving_plot(doc: dict[str, Any], folder: Any) -> Any:
    """Write serving_plot's PNG as PLOT_NAME in `folder` (beside the comment); its path, or None."""
    data = serving_plot(doc)
    if data is None:
        return None
    path = Path(folder) / PLOT_NAME
    path.write_bytes(data)
    return path


# ---- the verbs: post-result (report.yml), plot-result (bench.yml), show-result (by hand) ----
# Exit codes (pipeline/exits.py): 0 done (posted, written), 1 refused, 2 usage or configuration error.

# ---- a PR's validation verdict as its sticky comment shows it (pipeline/validate.py decides it) ----

MAX_LISTED_VIOLATIONS = 100  # in the comment; the JSON verdict keeps every one


def verdict_markdown(verdict: "Verdict", status: str | None = None) -> str:
    """The sticky comment while a PR waits: the verdict (every violation, file by file) and its status.
    Paths and logins are the PR's own text, so they are escaped."""
    lines = [MARKER]
    if verdict.ok and verdict.submission:
        s = verdict.submission
        what = f"kernel problem {md_escape(s.problem)}" if s.track == "kernel" else "the serving track"
        lines += ["### Submission check: valid", "",
                  f"{md_escape(printable(s.path), 200)} is a submission to {what} by {md_escape(s.login, 60)}."]
    else:
        n = len(verdict.violations)
        lines += [f"### Submission check: REFUSED ({n} problem{'s' if n != 1 else ''})", "",
                  "| file | rule | what is wrong |", "| --- | --- | --- |"]
        for v in verdict.violations[:MAX_LISTED_VIOLATIONS]:
            lines.append(f"| {md_escape(printable(v.path), 200) if v.path else '(the pull request)'} "
                         f"| {md_escape(v.rule)} | {md_escape(printable(v.message), 400)} |")
        if n > MAX_LISTED_VIOLATIONS:
            lines.append(f"| ... | | and {n - MAX_LISTED_VIOLATIONS} more |")
        lines += ["", "Fix these and push again: this comment is updated on every push."]
    if verdict.notices:
        lines += [""] + [f"Note: {md_escape(n, 400)}" for n in verdict.notices]
    if status:
        lines += ["", status]
    return "\n".join(lines) + "\n"


def safe_url(url: str | None) -> bool:
    """Whether a URL from GitHub's API (a run's page) may be linked in a comment as it is."""
    return bool(url) and re.match(r"^https?://[\w./:-]+\Z", url) is not None


# ---- plot-result ----

def _plot_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("result", type=Path, help="a serving result.json (read as data)")
    p.add_argument("--out", type=Path, required=True, metavar="PNG", help="where to write the plot")


@guarded
def plot_result(args: argparse.Namespace) -> int:
    """bench.yml: a serving result's throughput per GPU against interactivity, as a PNG beside it.

    The result is read as data and validated first. A serving result without levels (a patch the gate
    refused, a server that never came up) has no plot: nothing is written, exit 0. Exit 1 for a file that
    is not a serving result, 2 for a folder that does not exist.
    """
    from pipeline import result

    try:
        _, doc = result.read_data(args.result)
    except result.ResultError as exc:
        return error(REFUSED, str(exc))
    if doc["track"] != "serving":
        return error(REFUSED, f"{args.result} is a {doc['track']} result; only a serving result has this plot")
    if not args.out.parent.is_dir():
        return error(USAGE, f"--out {args.out}: the folder {args.out.parent} does not exist")
    data = serving_plot(doc)
    if data is None:
        print(f"no plot: {args.result} has no measured level ({doc['status']})")
        return OK
    tmp = args.out.with_name(f".{args.out.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    os.replace(tmp, args.out)
    print(f"wrote {args.out} ({len(data):,} bytes)")
    return OK


# ---- show-result ----

def _show_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("result", type=Path, help="a result.json (read as data)")
    p.add_argument("--markdown", type=Path, metavar="OUT", help="also write the PR comment post-result would post")


@guarded
def show_result(args: argparse.Namespace) -> int:
    """Print a result as the evaluator's terminal table (a serving result: its per-concurrency table, gate and S).

    The result is read as data and validated; it need not be signed (an organizer reads a hand-run
    evaluation with it). --markdown writes the sticky comment the PR would get. Exit 1 for a file that is
    not a valid result.
    """
    from pipeline import result

    try:
        _, doc = result.read_data(args.result)
    except result.ResultError as exc:
        return error(REFUSED, str(exc))
    print(terminal(doc))
    if args.markdown:
        args.markdown.write_text(comment_markdown(doc))
    return OK


VERBS = {
    "plot-result": (_plot_args, plot_result),
    "show-result": (_show_args, show_result),
}
