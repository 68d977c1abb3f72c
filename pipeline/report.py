"""A result document -> the text a competitor reads: the terminal table and the PR comment.

Both renderers take their rows from the same builders, so the bot's comment and the local command
show the same numbers. Everything that came from a submission (its output, its traceback, the names
of its types) is untrusted: in the comment it goes into fenced code blocks or through `md_escape`, so
it cannot inject markdown, links, images or @-mentions.

A serving result (track serving) shows, instead of the per-workload table, its per-concurrency table
(T_c and I_c of baseline and candidate, their ratios, turns, failures, validity), the correctness gate's
parts and S, the unscored figures, and a PNG of throughput per GPU against interactivity
(`serving_plot`). Every number of it is checked finite and in range as it is written (`_num`), and every
string (a server's error, a level's reason, the engine's name) goes through `md_escape`.
"""

from __future__ import annotations

import math
import re
from typing import Any

from tabulate import tabulate

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
            "" if entry["passed"] else f"[{worst_name}] seed #{entry['failed_seed_index']}: {entry['reason']}",
        ])
    return rows


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
    if mode["device"] == "cpu":
        return "These timings are UNOFFICIAL: wall-clock on a CPU with the smoke model; only the H200 runner's numbers count."
    if mode["timing"] != "cuda-graph":
        return "These timings are UNOFFICIAL: a wall-clock loop, not the official CUDA-graph method."
    return "These timings are UNOFFICIAL: public seeds, not the runner's official evaluation."


def terminal(doc: dict[str, Any]) -> str:
    mode = doc["mode"]
    lines = [
        f"{doc['problem']}  {doc['submission']['path']}",
        f"device {mode['device']}, {mode['model']} model, {mode['seeds']} seeds, timing: {mode['timing']}",
        "",
    ]
    if doc["correctness"]:
        lines.append(tabulate(correctness_rows(doc), headers=CORRECTNESS_HEADERS, tablefmt="simple", disable_numparse=True))
        lines.append("")
    if doc.get("serving"):
        lines += serving_terminal(doc)
    elif doc["performance"]:
        lines.append(tabulate(performance_rows(doc), headers=PERFORMANCE_HEADERS, tablefmt="simple", disable_numparse=True))
        lines.extend(x for x in (score_line(doc), timing_note(doc)) if x)
        lines.append("")
    if doc["error"]:
        err = doc["error"]
        lines.append(f"error{' in shape ' + err['shape'] if err.get('shape') else ''}: {err['message']}")
        where = err.get("where")
        if where and where.get("line"):
            lines.append(f"  at {where['file']}:{where['line']} in {where.get('function')}: {where.get('code', '')}")
        if err.get("traceback"):
            lines.append("traceback (tail):")
            lines.extend("  " + line for line in err["traceback"].splitlines()[-15:])
        if err.get("log_tail"):
            lines.append("output of the submission (tail):")
            lines.extend("  " + line for line in err["log_tail"].splitlines()[-15:])
        lines.append("")
    for flag in doc["flags"]:
        line = f" (line {flag['line']})" if flag.get("line") else ""
        lines.append(f"flag {flag['code']}{line}: {flag['message']}")
    lines.append(f"verdict: {VERDICT[doc['status']]}")
    return "\n".join(lines)


# ---- the PR comment ----

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f\u200b-\u200f\u202a-\u202e\u2066-\u2069]")
_MD_SPECIAL = re.compile(r"([\\`*_{}\[\]()#+\-.!|~>])")
_ZWSP = "\u200b"
_PLAIN_NUMBER = re.compile(r"^[0-9][0-9,.]*( - [0-9][0-9,.]*)?(x|%)?\Z")


def md_escape(text: Any, limit: int = 500) -> str:
    """Untrusted text as inert inline markdown: no formatting, links, images, HTML or mentions."""
    s = _CONTROL.sub("", str(text)).replace("\r", " ").replace("\n", " ")
    if _PLAIN_NUMBER.match(s):
        return s
    if len(s) > limit:
        s = s[: limit - 1] + "..."
    s = s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    s = _MD_SPECIAL.sub(r"\\\1", s)
    for token in ("@", ":", "#"):  # mentions, autolinked URLs and emoji, issue references
        s = s.replace(token, token + _ZWSP)
    s = s.replace("www", "w" + _ZWSP + "ww")
    return s


def code_block(text: str, lang: str = "text") -> str:
    """Untrusted text verbatim in a fence longer than any backtick run inside it."""
    text = _CONTROL.sub("", text).replace("\r", "")
    longest = max((len(m) for m in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}{lang}\n{text}\n{fence}"


def _table(headers: list[str], rows: list[list[str]]) -> str:
    return tabulate([[md_escape(c) for c in r] for r in rows], headers=headers, tablefmt="github", disable_numparse=True)


def comment_markdown(doc: dict[str, Any], *, rank: str | None = None, log_url: str | None = None,
                     limit: int = GITHUB_LIMIT, plot_url: str | None = None,
                     plot_artifact_url: str | None = None) -> str:
    """The sticky PR comment for a result, always within `limit` characters. A serving result's plot is
    drawn in the comment as text (`text_plot`); `plot_url`: where its PNG (serving_plot) is hosted, an https
    URL, shown as an image; else `plot_artifact_url`: the bench run's artifact page holding the PNG,
    linked; without either the comment names the file."""
    sub = doc["submission"]
    head = [
        MARKER,
        f"### {md_escape(doc['problem'])}: {VERDICT[doc['status']]}",
        "",
        f"Submission {md_escape(sub['path'], 200)}"
        + (f" by {md_escape(sub['login'], 60)}" if sub.get("login") else "")
        + (f" at {sub['head_sha'][:12]}" if sub.get("head_sha") else "")
        + f" (blob {sub['blob_sha'][:12]}).",
        f"Mode: {doc['mode']['device']}, {doc['mode']['model']} model, {doc['mode']['seeds']} seeds, "
        f"timing: {md_escape(doc['mode']['timing'])}; baseline: {md_escape(doc['baseline'])}.",
        "",
    ]
    perf: list[str] = []
    if doc.get("serving"):
        perf = serving_markdown(doc, rank=rank, plot_url=plot_url, log_url=log_url, plot_artifact_url=plot_artifact_url)
    elif doc["performance"]:
        perf += [_table(PERFORMANCE_HEADERS, performance_rows(doc)), ""]
        perf += [x + "  " for x in (score_line(doc), timing_note(doc)) if x]
        if rank:
            perf.append(f"Would-be rank on the current board: {md_escape(rank)}")
        perf.append("")
    flags = [f"- **{md_escape(f['code'])}**" + (f" (line {f['line']})" if f.get("line") else "")
             + f": {md_escape(f['message'])}" for f in doc["flags"]]
    if flags:
        flags = ["Flags (advisory; leaders are reviewed before prizes):", *flags, ""]
    err_head: list[str] = []
    traceback, log_tail = "", ""
    if doc["error"]:
        err = doc["error"]
        where = err.get("where") or {}
        err_head = [f"**First error**{' in shape ' + md_escape(err['shape']) if err.get('shape') else ''}:", "",
                    code_block(err["message"])]
        if where.get("line"):
            err_head.append(f"at {md_escape(where.get('file'), 100)} line {int(where['line'])}")
        err_head.append("")
        traceback = err.get("traceback") or ""
        log_tail = err.get("log_tail") or ""
    env = doc["environment"]
    if doc.get("serving"):
        engine = doc["serving"]["engine"]
        software = f"{md_escape(engine['name'])} {md_escape(engine['version'])} on {_int(engine['gpus'])} GPU"
    else:
        software = f"torch {md_escape(env.get('torch'))}, triton {md_escape(env.get('triton'))}"
    foot = [
        f"<sub>{md_escape(env.get('gpu') or env.get('cpu') or 'cpu')}, {software}, "
        f"harness {md_escape((env.get('harness_commit') or 'unknown')[:12])}, "
        f"{doc['started_at']} - {doc['finished_at']}"
        + (f" · [run log]({log_url})" if log_url and re.match(r"^https://[\w./-]+\Z", log_url) else "")
        + "</sub>",
    ]
    rows = correctness_rows(doc)

    def render(rows: list[list[str]], tb: str, log: str, note: str | None, flags: list[str] = flags) -> str:
        parts = head + perf
        if rows:
            parts += ["<details" + (" open" if doc["status"] == "incorrect" else "") + "><summary>Correctness, per shape"
                      "</summary>", "", _table(CORRECTNESS_HEADERS, rows), "", "</details>", ""]
        parts += flags + err_head
        if tb:
            parts += ["Traceback (tail):", "", code_block(tb, "python"), ""]
        if log:
            parts += ["Output of the submission (tail):", "", code_block(log), ""]
        if note:
            parts += [f"_{note}_", ""]
        return "\n".join(parts + foot) + "\n"

    text = render(rows, traceback, log_tail, None)
    if len(text) <= limit:
        return text
    note = "Truncated to fit GitHub's comment limit" + ("; the run log has everything." if log_url else ".")
    for keep in (8000, 2000, 500, 0):
        tb, log = traceback[-keep:] if keep else "", log_tail[-keep:] if keep else ""
        text = render(rows, tb, log, note)
        if len(text) <= limit:
            return text
    failing = [r for r in rows if r[2] != "ok"]
    for n in (200, 50, 10, 0) if rows else ():
        text = render(failing[:n], "", "", note + f" {len(rows) - min(n, len(failing))} shape rows left out.")
        if len(text) <= limit:
            return text
    # a patch can carry hundreds of flags (the serving gate caps them per pattern, not in all)
    listed = flags[1:-1]
    for n in (50, 10, 0):
        kept = flags[:1] + listed[:n] + [f"- and {len(listed) - n} more flags (in the result)", ""] if flags else []
        text = render([], "", "", note + (f" {len(rows)} shape rows left out." if rows else ""), kept)
        if len(text) <= limit:
            return text
    return (MARKER + "\n" + f"### {md_escape(doc['problem'])}: {VERDICT[doc['status']]}\n\n_{note}_\n")[:limit]


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
    """The correctness gate's three parts, each with what it needed, and G."""
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
    ]


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
    s = doc["serving"]
    lines = [f"engine {s['engine']['name']} {s['engine']['version']} on {s['engine']['gpus']} GPU; "
             f"dataset {s['dataset']['sha256'][:12]} ({s['dataset']['conversations']} conversations); "
             f"patch: {len(s['patch_gate']['files'])} file(s), +{s['patch_gate']['added']} -{s['patch_gate']['removed']}"]
    if s["levels"]:
        lines += ["", tabulate(serving_rows(doc), headers=SERVING_HEADERS, tablefmt="simple", disable_numparse=True),
                  "T_c: output tokens/s per GPU in the window; I_c: P10 of the per-turn user rate, tokens/s.", ""]
        lines += [x for x in (serving_score_line(doc),) if x]
        lines += gate_lines(doc)
        lines += [f"  {where}: {why}" for where, why in _level_reasons(doc)]
        lines += ["", "unscored:", tabulate(unscored_rows(doc), headers=UNSCORED_HEADERS, tablefmt="simple",
                                            disable_numparse=True)]
        lines.extend(x for x in (timing_note(doc),) if x)
    lines.append("")
    return lines


def serving_markdown(doc: dict[str, Any], *, rank: str | None = None, plot_url: str | None = None,
                     log_url: str | None = None, plot_artifact_url: str | None = None) -> list[str]:
    """The serving part of the PR comment (lines)."""
    s = doc["serving"]
    pg = s["patch_gate"]
    out = [f"Engine {md_escape(s['engine']['name'])} {md_escape(s['engine']['version'])} on "
           f"{_int(s['engine']['gpus'])} GPU; dataset `{md_escape(s['dataset']['sha256'][:12])}` "
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
            "T_c: output tokens per second per GPU inside the measurement window; I_c: the 10th percentile of the "
            "per-turn user rate (tokens / end-to-end latency), tokens/s; both the medians over the runs. Ratios are "
            "candidate / baseline before clipping to [0.25, 4]; below 1 - eps a shortfall counts double.", ""]
    gate = gate_lines(doc)
    if gate:
        # gate_lines is made of our own words and of numbers through _num alone; the reasons are the server's
        out += [f"**{gate[0][0].upper()}{gate[0][1:]}**", ""] + [f"- {x}" for x in gate[1:]]
        out += [f"  - {md_escape(where)}: {md_escape(why, 300)}" for where, why in _level_reasons(doc)] + [""]
    drawn = text_plot(doc)
    if drawn:
        out += ["Throughput per GPU against interactivity (B: baseline, C: candidate; the number is c):", "",
                code_block(drawn), ""]
    if plot_url and _SAFE_URL.match(plot_url):
        out += [f"![{PLOT_ALT}]({plot_url})", ""]
    elif plot_artifact_url and _SAFE_URL.match(plot_artifact_url):
        out += [f"The plot as a PNG: [`{PLOT_NAME}`]({plot_artifact_url}) (the bench run's artifact "
                "`serving-plot`, a zip).", ""]
    else:
        out += [f"The plot of throughput per GPU against interactivity is `{PLOT_NAME}` in the run's artifacts"
                + (f" ([run log]({log_url}))." if log_url and _SAFE_URL.match(log_url) else "."), ""]
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
    lines.append(" " * (left + 1) + "I_c: P10 of the per-turn user rate (tokens/s)")
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
        ax.set_xlabel("interactivity I_c: P10 of the per-turn user rate (tokens/s)")
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
    from pathlib import Path

    data = serving_plot(doc)
    if data is None:
        return None
    path = Path(folder) / PLOT_NAME
    path.write_bytes(data)
    return path
