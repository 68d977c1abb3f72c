"""Evaluate the same submission N times, each in its own process, and report the spread
(max/min - 1) of every workload's median and of the score. GPU only.

    python benchmarks/repeatability.py SUBMISSION [--problem NAME] [--runs 5] [--shape NAME ...] [--json OUT]
    python benchmarks/repeatability.py --as-baseline --problem NAME [--shape NAME ...] [--runs 3]

With --as-baseline the submission is the problem's own baseline (as official_eval.py --as-baseline):
both sides run the same code, so every per-workload speedup should be 1 up to noise, and their mean
over runs shows whether the harness favours either side.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from official_eval import AS_BASELINE  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("submission", nargs="?")
    ap.add_argument("--as-baseline", action="store_true", help="submit the problem's own baseline (needs --problem)")
    ap.add_argument("--shape", action="append", help="evaluate only these shapes (repeatable)")
    ap.add_argument("--problem")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--docs", type=Path, help="keep every run's full result (raw samples included) in this folder")
    args = ap.parse_args()
    if args.as_baseline == bool(args.submission) or (args.as_baseline and not args.problem):
        ap.error("give a SUBMISSION, or --as-baseline with --problem")
    docs, walls = [], []
    with tempfile.TemporaryDirectory() as tmp:
        if args.as_baseline:
            Path(tmp).chmod(0o755)  # the sandbox user reads the submission
            args.submission = str(Path(tmp) / f"{args.problem}_baseline.py")
            Path(args.submission).write_text(AS_BASELINE.format(folder=ROOT / "reference", name=args.problem, function="baseline"))
            Path(args.submission).chmod(0o644)
        for i in range(args.runs):
            out = Path(tmp) / f"r{i}.json"
            cmd = [sys.executable, "-m", "pipeline", "evaluate", args.submission, "--json", str(out), "--seeds", str(args.seeds)]
            if args.problem:
                cmd += ["--problem", args.problem]
            if args.as_baseline:
                cmd += ["--grant-read", str(ROOT / "reference")]
            for name in args.shape or []:
                cmd += ["--shape", name]
            t0 = time.monotonic()
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
            walls.append(time.monotonic() - t0)
            if not out.exists():
                print(proc.stdout[-3000:], proc.stderr[-3000:])
                sys.exit(1)
            docs.append(json.loads(out.read_text()))
            if args.docs:
                args.docs.mkdir(parents=True, exist_ok=True)
                (args.docs / f"run{i}.json").write_text(out.read_text())
            print(f"run {i}: {docs[-1]['status']} score {docs[-1]['score']} wall {walls[-1]:.1f} s", flush=True)
    summary = {"problem": docs[0]["problem"], "runs": args.runs, "wall_s": walls, "workloads": {}}
    for w in [p["workload"] for p in docs[0]["performance"]]:
        meds = [next(p for p in d["performance"] if p["workload"] == w)["median_us"] for d in docs]
        base = [next(p for p in d["performance"] if p["workload"] == w)["baseline_median_us"] for d in docs]
        entries = [next(p for p in d["performance"] if p["workload"] == w) for d in docs]
        summary["workloads"][w] = {"medians_us": meds, "spread": max(meds) / min(meds) - 1,
                                   "baseline_medians_us": base, "baseline_spread": max(base) / min(base) - 1,
                                   **{key: [e.get(key) for e in entries] for key in
                                      ("clocks", "converged", "n", "calls_per_replay", "input_sets", "wall_s",
                                       "baseline_alone_us", "baseline_alone_idle_us", "wall_accounted")}}
        alone = [e.get("baseline_alone_us") for e in entries]
        if all(alone):
            idle = [e.get("baseline_alone_idle_us") or a for e, a in zip(entries, alone)]
            print(f"{w}: baseline interleaved / alone {', '.join(f'{b / a:.4f}' for b, a in zip(base, alone))}; "
                  f"/ alone with idle gaps {', '.join(f'{b / a:.4f}' for b, a in zip(base, idle))}; "
                  f"wall accounted {[e.get('wall_accounted') for e in entries]}")
        ratios = [b / m for b, m in zip(base, meds)]
        summary["workloads"][w]["speedups"] = ratios
        print(f"{w}: speedups {', '.join(f'{r:.4f}' for r in ratios)} (mean {statistics.fmean(ratios):.4f})")
        print(f"{w}: medians {', '.join(f'{m:.2f}' for m in meds)} us; spread {max(meds) / min(meds) - 1:.3%}; "
              f"baseline spread {max(base) / min(base) - 1:.3%}; samples {[e.get('n') for e in entries]}, "
              f"converged {[e.get('converged') for e in entries]}")
    scores = [d["score"]["speedup"] for d in docs]
    summary["score_spread"] = max(scores) / min(scores) - 1
    summary["scores"] = scores
    print(f"score: {', '.join(f'{s:.4f}' for s in scores)}; spread {summary['score_spread']:.3%}")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
