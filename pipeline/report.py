"""A result document -> the text a competitor reads: the terminal table and the PR comment.

Both renderers take their rows from the same builders, so the bot's comment and the local command
show the same numbers. Everything that came from a submission (its output, its traceback, the names
of its types) is untrusted: in the comment it goes into fenced code blocks or through `md_escape`, so
it cannot inject markdown, links, images or @-mentions.
"""

from __future__ import annotations

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
    if doc["performance"]:
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
_PLAIN_NUMBER = re.compile(r"^[0-9][0-9,.]*( - [0-9][0-9,.]*)?(x|%)?$")


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
                     limit: int = GITHUB_LIMIT) -> str:
    """The sticky PR comment for a result, always within `limit` characters."""
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
    if doc["performance"]:
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
    foot = [
        f"<sub>{md_escape(env.get('gpu') or env.get('cpu') or 'cpu')}, torch {md_escape(env.get('torch'))}, "
        f"triton {md_escape(env.get('triton'))}, harness {md_escape((env.get('harness_commit') or 'unknown')[:12])}, "
        f"{doc['started_at']} - {doc['finished_at']}"
        + (f" · [run log]({log_url})" if log_url and re.match(r"^https://[\w./-]+$", log_url) else "")
        + "</sub>",
    ]
    rows = correctness_rows(doc)

    def render(rows: list[list[str]], tb: str, log: str, note: str | None) -> str:
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
    for n in (200, 50, 10, 0):
        text = render(failing[:n], "", "", note + f" {len(rows) - min(n, len(failing))} shape rows left out.")
        if len(text) <= limit:
            return text
    return (MARKER + "\n" + f"### {md_escape(doc['problem'])}: {VERDICT[doc['status']]}\n\n_{note}_\n")[:limit]
