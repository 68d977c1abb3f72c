"""Evaluate the same submission N times, each in its own process, and report the spread
(max/min - 1) of every workload's median and of the score. GPU only.

    python benchmarks/repeatability.py SUBMISSION [--problem NAME] [--runs 5] [--json OUT]
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("submission")
    ap.add_argument("--problem")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--docs", type=Path, help="keep every run's full result (raw samples included) in this folder")
    args = ap.parse_args()
    docs, walls = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            out = Path(tmp) / f"r{i}.json"
            cmd = [sys.executable, "-m", "pipeline", "evaluate", args.submission, "--json", str(out), "--seeds", str(args.seeds)]
            if args.problem:
                cmd += ["--problem", args.problem]
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
                                      ("clocks", "converged", "n", "calls_per_replay", "input_sets", "wall_s")}}
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
