"""Where a problem's time goes, kernel by kernel, for its baseline and the organizers' solution side by side
(issue 18): each target called eagerly over two rotated input sets under torch.profiler, each kernel's mean
GPU time per call, the sums beside the workload's floor. For the layers, where the solution's score is the
sum of many kernels' differences (the decode layer's gain was the MoE's alone, fifteenth session), this says
which part wins and which loses. GPU only; eager, so the launch gaps a CUDA graph removes are not in it.

    python benchmarks/kernel_breakdown.py --problem muse_decode_layer [--shape B1 ...] [--calls 20] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from pipeline.kernel.evaluate import device_ceilings, floor_us  # noqa: E402
from pipeline.problems import load_problem  # noqa: E402
from tune_solutions import load_solution  # noqa: E402


def profile(fn, sets: list[dict], calls: int) -> dict[str, dict[str, float]]:
    """Each CUDA kernel by name: its mean GPU time per call ("us") and launches per call ("per_call"), over
    `calls` calls of `fn` rotating over `sets` (each warmed first)."""
    for s in sets:  # compile, autotune and warm
        fn(s)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for i in range(calls):
            fn(sets[i % len(sets)])
        torch.cuda.synchronize()
    per: dict[str, list[float]] = defaultdict(list)
    for e in prof.events():
        t = getattr(e, "device_time", None)
        if t is None:
            t = getattr(e, "cuda_time", 0.0)
        if e.device_type == torch.autograd.DeviceType.CUDA and t:
            per[e.name].append(t)
    return {name: {"us": sum(v) / calls, "per_call": len(v) / calls} for name, v in per.items()}


def print_kernels(kernels: dict[str, dict[str, float]], indent: str = "  ") -> None:
    """`profile`'s kernels, the longest first: time per call, launches per call, name."""
    for name, k in sorted(kernels.items(), key=lambda kv: -kv[1]["us"]):
        print(f"{indent}{k['us']:9.2f} us  {k['per_call']:.0f}/call  {name[:110]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--problem", required=True)
    ap.add_argument("--shape", action="append", help="a workload's name (default: every workload)")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("kernel_breakdown needs a CUDA device")
    problem = load_problem(args.problem)
    ref = problem.reference
    solution = load_solution(args.problem)[1]
    ceilings = device_ceilings()
    rows = []
    for shape in problem.shapes("full", kinds=("workload",)):
        if args.shape and shape.name not in args.shape:
            continue
        sets = [ref.make_inputs(shape, 100 + r, "cuda") for r in range(2)]
        floor = floor_us(ref.floor(shape), ceilings)
        times = {"baseline": profile(ref.baseline, sets, args.calls),
                 "solution": profile(solution.custom_kernel, sets, args.calls)}
        print(f"\n{args.problem} {shape.name}: floor {floor:.1f} us ({torch.cuda.get_device_name()})")
        for target, kernels in times.items():
            total = sum(k["us"] for k in kernels.values())
            print(f"  {target}: {total:.1f} us of kernels a call, {len(kernels)} kinds, {total / floor:.2f}x the floor")
            print_kernels(kernels, "    ")
        rows.append({"problem": args.problem, "workload": shape.name, "floor_us": floor, "kernels_us": times,
                     "device": torch.cuda.get_device_name()})
        del sets
        torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
