"""Where the fused W4A16 MoE's time goes on the H200: each kernel's duration per call (issue 12).

The fused path (reference/_fused_moe_w4a16.py) runs as the kept configuration for each M, eagerly, over
rotated input sets (every call reads cold weights, as in the evaluator's graph), under torch.profiler;
each kernel's mean duration per call is printed beside the sum, the floor and the bandwidth it reached
on the bytes it must read (the experts the batch uses). GPU only.

    python benchmarks/moe_breakdown.py [--m 1 --m 16 --m 32] [--calls 40] [--json OUT]
    python benchmarks/moe_breakdown.py --solution [--config '{"BN_UP": 16}'] ...   (the organizers' solution)
    ncu -k regex:gate_up|_down ... python benchmarks/moe_breakdown.py --m 1 --plain   (ncu on a device call)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "reference"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from pipeline.kernel.evaluate import device_ceilings, floor_us  # noqa: E402
from pipeline.problems import load_problem  # noqa: E402

import _fused_moe_w4a16 as fused  # noqa: E402
from kernel_breakdown import print_kernels, profile  # noqa: E402

KEYS = ("x", "topk_ids", "topk_weights", "w13", "w13_scale", "w2", "w2_scale")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, action="append")
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--solution", action="store_true", help="the organizers' solution (solutions/muse_moe_w4a16)")
    ap.add_argument("--config", type=json.loads, default={}, help="with --solution: keys over its configuration")
    ap.add_argument("--plain", action="store_true",
                    help="only run the calls, no profiler (under Nsight Compute, which needs CUPTI to itself)")
    args = ap.parse_args()
    problem = load_problem("muse_moe_w4a16")
    ref = problem.reference
    ceilings = device_ceilings()
    rows = []
    for m in args.m or (1, 16, 32):
        base = problem.shape("M1")
        shape = dataclasses.replace(base, name=f"M{m}", params={**base.params, "M": m})
        sets = [ref.make_inputs(shape, 100 + r, "cuda") for r in range(2)]
        floor = floor_us(ref.floor(shape), ceilings)
        if args.solution:
            from tune_solutions import load_solution
            solution = load_solution("muse_moe_w4a16")[1]
            cfg = {**solution.config_for(m), **args.config}
            def run(*a, cfg=cfg):
                return solution.fused_moe(*a, config=cfg)
        else:
            cfg, run = fused.config_for(m), fused.fused_moe
        if args.plain:
            for s in sets:  # compile and warm
                run(*(s[k] for k in KEYS))
            torch.cuda.synchronize()
            print(f"M{m}: config {cfg}; warmed on {len(sets)} input sets (no profiler)")
            del sets
            continue
        per = profile(lambda s, run=run: run(*(s[k] for k in KEYS)), sets, args.calls)
        kernels = {name: k["us"] for name, k in per.items()}
        total = sum(kernels.values())
        used = {int(e) for s in sets for e in s["topk_ids"].flatten().tolist()}
        per_expert = sum(sets[0][k][0].numel() * sets[0][k].element_size() for k in ("w13", "w13_scale", "w2", "w2_scale"))
        experts = sum(len(set(s["topk_ids"].flatten().tolist())) for s in sets) / len(sets)
        gb_s = experts * per_expert / (total * 1e-6) / 1e9
        print(f"M{m}: config {cfg}; {experts:.0f} experts used per call ({len(used)} over the sets); floor {floor:.1f} us")
        print_kernels(per)
        print(f"  {total:9.2f} us  kernels in all = {total / floor:.2f}x the floor; {gb_s:,.0f} GB/s on the used experts' bytes")
        rows.append({"M": m, "config": cfg, "floor_us": floor, "kernels_us": kernels, "total_us": total,
                     "experts": experts, "gb_s": gb_s})
        del sets
        torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
