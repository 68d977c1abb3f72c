"""Are the organizers' solutions deterministic and right call after call? (issue 18) GPU only.

The projection's and the MoE's solutions finish split-K inside the launch: the last program to take a
ticket from a counter sums the others' partials. A first attention solution built the same way came out
`incorrect` in one of two official evaluations on an H100 (docs/BENCHMARKS.md), so a race in that pattern
is suspected. This calls each solution many times on the same inputs, eagerly and as CUDA-graph replays
(as the evaluator's timing does), and counts the outputs that differ from the first bit for bit and those
the problem's own check fails: a racy merge shows as a count above zero.

    python benchmarks/stress_solutions.py [--problem NAME ...] [--calls 300] [--json OUT]
    python benchmarks/stress_solutions.py --problem muse_attention_decode --file OLD.py   (a version from git)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from pipeline.kernel.check import compare  # noqa: E402
from pipeline.problems import load_problem  # noqa: E402
from tune_solutions import load_solution, size_of  # noqa: E402

# Configurations that take the ticket path where the tuned one may not (SPLIT > 1), the projection's also turned
# around (SWAP: its parts written from the transposed tile), the attention's merge split over columns, and the
# launches chained by programmatic dependent launch (PDL) or the MoE's route skipped (SORT 0).
FORCED = {"muse_bf16_proj": [{"SPLIT": 2}, {"SPLIT": 4}, {"SPLIT": 4, "SWAP": 1}],
          "muse_moe_w4a16": [{"SPLIT_UP": 4, "SPLIT_DOWN": 2}, {"PDL": 1}, {"PDL": 1, "SPLIT_UP": 2, "SPLIT_DOWN": 2},
                             {"SORT": 0, "PDL": 1}],
          "muse_attention_decode": [{"MERGE_BD": 32, "merge_warps": 4}, {"PDL": 1}, {"PDL": 0}]}


def stress(fn, inputs: dict, want: torch.Tensor, tol: dict, calls: int) -> dict:
    first = fn(inputs).clone()
    differ = failed = 0
    for _ in range(calls):
        out = fn(inputs)
        differ += int(not torch.equal(out, first))
        failed += int(not compare(out, want, tol, expected_dtype=torch.bfloat16)["passed"])
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(inputs)
    torch.cuda.current_stream().wait_stream(side)
    outs = []
    with torch.cuda.graph(graph):
        for _ in range(10):
            outs.append(fn(inputs))
    replays = max(1, calls // 10)
    for _ in range(replays):
        graph.replay()
        torch.cuda.synchronize()
        for out in outs:
            differ += int(not torch.equal(out, first))
            failed += int(not compare(out, want, tol, expected_dtype=torch.bfloat16)["passed"])
    return {"calls": calls + 10 * replays, "differ_from_first": differ, "failed_check": failed}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--problem", action="append")
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--all-shapes", action="store_true", help="the test shapes too, not only the workloads")
    ap.add_argument("--file", type=Path, help="stress this file as the (one) --problem's solution (an old version)")
    args = ap.parse_args()
    if args.file and len(args.problem or []) != 1:
        ap.error("--file needs exactly one --problem")
    rows = []
    for name in args.problem or sorted(p.parent.name for p in (ROOT / "solutions").glob("*/submission.py")):
        problem = load_problem(name)
        ref = problem.reference
        _, solution = load_solution(name, args.file)
        tol = problem.tolerances["output"]
        for shape in problem.shapes("full", kinds=("workload", "test") if args.all_shapes else ("workload",)):
            inputs = ref.make_inputs(shape, 7, "cuda")
            want = ref.reference(inputs)
            base = solution.config_for(size_of(name, shape))
            for extra in [{}] + FORCED.get(name, []):
                cfg = {**base, **extra}
                r = stress(lambda s, cfg=cfg: solution.custom_kernel(s, cfg), inputs, want, tol, args.calls)
                rows.append({"problem": name, "workload": shape.name, "config": cfg, **r})
                print(f"{name} {shape.name} {extra or 'tuned'}: {r['calls']} calls, {r['differ_from_first']} differ "
                      f"from the first bit for bit, {r['failed_check']} fail the check", flush=True)
                if args.json:
                    args.json.write_text(json.dumps(rows, indent=2))
            del inputs, want
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
