"""Wall time of a full official evaluation of each problem's template (8 seeds, every shape, the
official timing), and the baseline's median against the analytic floor for every workload. GPU only.

    python benchmarks/official_eval.py [--problem NAME ...] [--seeds 8] [--as-baseline | --solutions] [--json OUT]

--as-baseline evaluates a submission that is the problem's own baseline: what the evaluation of a
competitive submission costs (the templates are plain-PyTorch starting points, up to 60x slower than
the baseline, and their evaluation time is mostly their own).

Prints a markdown table ready for docs/BENCHMARKS.md. Each evaluation runs in its own process; the
first compile of a Triton kernel is in the figure unless the cache is warm (run twice to see both).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pipeline.problems import list_problems  # noqa: E402


HEADER = ("| problem | workload | baseline us | submission us | floor us | baseline / floor | fresh-content / rotation, "
          "submission; baseline | evaluation wall s |\n| --- | --- | --- | --- | --- | --- | --- | --- |")


def row_line(r: dict) -> str:
    ratio = f"{r['baseline_over_floor']:.2f}x" if r["baseline_over_floor"] else "-"
    return (f"| {r['problem']} | {r['workload']} | {r['baseline_us']:,.1f} | {r['template_us']:,.1f} | {r['floor_us'] or 0:,.1f} | "
            f"{ratio} | {r['fresh_over_rotation']:.3f}; {r['baseline_fresh_over_rotation']:.3f} | {r['wall_s']:.0f} |")


# The submission's process reads only its own file: evaluate these with --grant-read reference/.
AS_BASELINE = '''"""{name}'s own baseline, submitted: benchmarks/official_eval.py --as-baseline."""
import sys

sys.path.insert(0, "{folder}")
from {name} import {function} as custom_kernel  # noqa: E402,F401
'''


def phases(entries: list[dict]) -> dict[str, float]:
    """Wall seconds per phase, summed over the shapes (the result's `wall_s`)."""
    out: dict[str, float] = {}
    for e in entries:
        for k, v in (e.get("wall_s") or {}).items():
            out[k] = round(out.get(k, 0.0) + v, 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--problem", action="append")
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--as-baseline", action="store_true", help="submit each problem's baseline instead of its template")
    ap.add_argument("--solutions", action="store_true",
                    help="submit the organizers' solution (solutions/<problem>/submission.py) instead of the template; "
                         "problems without one are skipped")
    ap.add_argument("--function", default="baseline",
                    help="with --as-baseline: which function of reference/<problem>.py to submit (a variant staged "
                         "beside the baseline)")
    ap.add_argument("--timeout", type=float, help="seconds per evaluation; one that runs longer is reported and skipped")
    ap.add_argument("--baseline", choices=["ours", "sglang"], default="ours",
                    help="what the evaluator times the submission against (sglang: SGLang's kernels from the pinned "
                         "source; with --as-baseline the score is our baseline's speedup over SGLang's)")
    args = ap.parse_args()
    rows, walls, scores = [], {}, {}  # scores: each problem's score (interval included), status and flags
    print(HEADER, flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp).chmod(0o755)  # the sandbox user reads the submission
        for name in args.problem or list_problems():
            out = Path(tmp) / f"{name}.json"
            submission = f"problems/{name}/template.py"
            if args.solutions:
                submission = f"solutions/{name}/submission.py"
                if not (ROOT / submission).is_file():
                    print(f"{name}: no organizers' solution ({submission}); skipped", flush=True)
                    continue
            if args.as_baseline:
                submission = str(Path(tmp) / f"{name}_baseline.py")
                Path(submission).write_text(AS_BASELINE.format(folder=ROOT / "reference", name=name, function=args.function))
                Path(submission).chmod(0o644)
            t0 = time.monotonic()
            grant = ["--grant-read", str(ROOT / "reference")] if args.as_baseline else []
            proc = subprocess.Popen([sys.executable, "-m", "pipeline", "evaluate", submission, "--problem", name,
                                     "--seeds", str(args.seeds), "--json", str(out), "--baseline", args.baseline,
                                     *grant], cwd=ROOT, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            try:
                stdout, stderr = proc.communicate(timeout=args.timeout)
            except subprocess.TimeoutExpired:
                proc.terminate()  # SIGTERM: the evaluation kills its worker and frees the GPU
                stdout, stderr = proc.communicate()
                print(f"{name}: did not finish within {args.timeout:.0f} s; its progress:\n{stderr[-3000:]}", flush=True)
                continue
            walls[name] = time.monotonic() - t0
            if not out.exists():
                print(f"{name}: no result\n{stdout[-2000:]}\n{stderr[-2000:]}", flush=True)
                continue
            doc = json.loads(out.read_text())
            if doc["status"] != "passed":  # say why, so a failure on the GPU is never only a word
                failed = [(e["shape"], e.get("reason")) for e in doc["correctness"] if not e["passed"]]
                print(f"{name}: {doc['status']}: {(doc.get('error') or {}).get('message')}; failed shapes {failed}",
                      flush=True)
            mine = []
            for p in doc["performance"]:
                mine.append({"problem": name, "workload": p["workload"], "baseline_us": p["baseline_median_us"],
                             "template_us": p["median_us"], "floor_us": p["floor_us"],
                             "baseline_over_floor": p["baseline_median_us"] / p["floor_us"] if p["floor_us"] else None,
                             "fresh_over_rotation": (p.get("read_flush_us") or 0) / p["median_us"],
                             "baseline_fresh_over_rotation": (p.get("baseline_read_flush_us") or 0) / p["baseline_median_us"],
                             "status": doc["status"], "wall_s": walls[name],
                             "block_overhead_us": p.get("block_overhead_us"), "wall_unexplained": p.get("wall_unexplained")})
                print(row_line(mine[-1]), flush=True)
            rows += mine
            scores[name] = {"score": doc["score"], "status": doc["status"], "flags": [f["code"] for f in doc["flags"]]}
            print(f"{name}: {doc['status']} in {walls[name]:.1f} s; flags {[f['code'] for f in doc['flags']] or 'none'}; "
                  f"score {doc['score']}", flush=True)
            print(f"{name}: where the time went: checks {phases(doc['correctness'])}; timing {phases(doc['performance'])}",
                  flush=True)
            for p in doc["performance"]:  # the request's cost around each timed block on this host (evaluate.py)
                o = p.get("block_overhead_us") or {}
                if o:
                    print(f"{name} {p['workload']}: overhead a block (ms): baseline {o['baseline'] / 1e3:.2f} beside, "
                          f"{o['baseline_alone'] / 1e3:.2f} alone; submission {o['submission'] / 1e3:.2f}, allowed "
                          f"{o['allowed'] / 1e3:.2f}; unexplained {p['wall_unexplained']:.2%}", flush=True)
            if args.json:
                args.json.write_text(json.dumps({"rows": rows, "wall_s": walls, "scores": scores}, indent=2))
    print("\n" + HEADER)
    for r in rows:
        print(row_line(r))


if __name__ == "__main__":
    main()
