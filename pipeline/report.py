"""A result document -> the text a competitor reads (the terminal table; the PR comment builds on it)."""

from __future__ import annotations

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


def terminal(doc: dict[str, Any]) -> str:
    mode = doc["mode"]
    lines = [
        f"{doc['problem']}  {doc['submission']['path']}",
        f"device {mode['device']}, {mode['model']} model, {mode['seeds']} seeds, timing: {mode['timing']}",
        "",
    ]
    if doc["correctness"]:
        lines.append(tabulate(
            correctness_rows(doc),
            headers=["shape", "kind", "check", "seeds", "max abs", "max rel", "rel-L2", "matched", "why"],
            tablefmt="simple",
        ))
        lines.append("")
    if doc["performance"]:
        rows = [[p["workload"], _g(p["median_us"], ",.1f"), _g(p.get("p10_us"), ",.1f"), _g(p.get("p90_us"), ",.1f"),
                 p["n"], _g(p["baseline_median_us"], ",.1f"), f"{p['speedup']:.3f}x"] for p in doc["performance"]]
        lines.append(tabulate(rows, headers=["workload", "median us", "p10 us", "p90 us", "n", "baseline us", "speedup"],
                              tablefmt="simple"))
        if doc["score"]:
            lines.append(f"score: {doc['score']['time_us']:,.1f} us, {doc['score']['speedup']:.3f}x (geometric means)")
        if not doc["official"]:
            lines.append("These timings are UNOFFICIAL: " + (
                "wall-clock on a CPU with the smoke model; only the H200 runner's numbers count."
                if mode["device"] == "cpu" else
                "a wall-clock loop, not the official CUDA-graph method; only the runner's numbers count."))
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
        lines.append(f"flag {flag['code']}: {flag['message']}")
    lines.append(f"verdict: {VERDICT[doc['status']]}")
    return "\n".join(lines)
