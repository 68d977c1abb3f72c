"""How fast can these bytes be read at all (issue 18): for each workload of the memory-bound problems, the
baseline, the organizers' solution and a kernel that does nothing but read the workload's floor bytes, all
timed by the evaluator's method (CUDA graphs of calls over rotating input sets, medians) in one process.

The analytic floor divides the bytes by the memory's theoretical peak (NVML) and a steady 1 GiB stream;
a 20-100 MB workload also pays for its ramp (the first bytes' latency, the launch, the last wave). The
read-only kernel has no arithmetic, no dependent loads and the best of a few grids, so its time is what
the bytes alone cost on this card at this size: `baseline / read-only` is the most any kernel of this
byte count can score against the baseline, whatever it computes. Where that is below issue 18's target,
the target is out of reach on this card; docs/BENCHMARKS.md records the numbers.

    python benchmarks/read_ceiling.py [--problem P ...] [--seconds 0.1] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

PROBLEMS = ("muse_bf16_proj", "muse_attention_decode", "muse_moe_w4a16")
# (programs an SM, int32 words a program loads a step, warps): a persistent grid walks the buffer in strides
GRIDS = [(1, 4096, 4), (2, 4096, 4), (4, 2048, 4), (4, 4096, 8), (8, 1024, 4), (8, 2048, 8), (16, 1024, 4)]


@triton.jit
def _read(buf_ptr, out_ptr, n_words, BLOCK: tl.constexpr):
    """Every int32 word of the buffer read once; each program's wrapping sum stored, so nothing is dead."""
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.int32)
    for start in range(pid * BLOCK, n_words, step):
        idx = start + offs
        acc += tl.load(buf_ptr + idx, mask=idx < n_words, other=0)
    tl.store(out_ptr + pid, tl.sum(acc, 0))


def read_words(buf: torch.Tensor, out: torch.Tensor, block: int, warps: int | None = None) -> torch.Tensor:
    """`buf` (int32) read by out.numel() programs; their sums in `out`."""
    launch = {} if warps is None else {"num_warps": warps}
    _read[(out.numel(),)](buf, out, buf.numel(), BLOCK=block, **launch)
    return out


def buffers(nbytes: int, l2_bytes: int, device: str) -> list[dict]:
    """Distinct buffers of `nbytes` (rounded up to 64) rotated so that together they pass the L2 twice."""
    words = -(-nbytes // 64) * 16
    count = max(2, -(-2 * l2_bytes // (words * 4)))
    return [{"buf": torch.randint(0, 1 << 20, (words,), dtype=torch.int32, device=device)} for _ in range(count)]


def main() -> None:
    from pipeline.kernel.evaluate import device_ceilings, floor_us
    from pipeline.problems import load_problem
    from tune_fused_moe import time_us
    from tune_solutions import load_solution

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--problem", action="append", choices=PROBLEMS)
    ap.add_argument("--seconds", type=float, default=0.1)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    props = torch.cuda.get_device_properties(0)
    sms, l2 = props.multi_processor_count, props.L2_cache_size
    ceilings = device_ceilings()
    rows = []
    for name in args.problem or PROBLEMS:
        problem = load_problem(name)
        ref = problem.reference
        _, solution = load_solution(name)
        for shape in problem.shapes("full", kinds=("workload",)):
            floor = ref.floor(shape)
            sets = [ref.make_inputs(shape, 100 + r, "cuda") for r in range(2)]
            base_us = time_us(ref.baseline, sets, args.seconds)
            sol_us = time_us(lambda s: solution.custom_kernel(s), sets, args.seconds)
            del sets
            torch.cuda.empty_cache()
            bufs = buffers(int(floor["bytes"]), l2, "cuda")
            reads = {}
            for per_sm, block, warps in GRIDS:
                out = torch.empty(per_sm * sms, dtype=torch.int32, device="cuda")
                reads[f"{per_sm}/SM, {block} words, {warps} warps"] = time_us(
                    lambda s, out=out, block=block, warps=warps: read_words(s["buf"], out, block, warps), bufs,
                    args.seconds)
            del bufs
            torch.cuda.empty_cache()
            grid, read_us = min(reads.items(), key=lambda kv: kv[1])
            row = {"problem": name, "workload": shape.name, "bytes": floor["bytes"], "floor_us": floor_us(floor, ceilings),
                   "baseline_us": base_us, "solution_us": sol_us, "read_us": read_us, "read_grid": grid,
                   "reads": reads}
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n{props.name}, {sms} SMs, L2 {l2 >> 20} MiB\n\n| problem | workload | MB | floor us | read-only us "
          "| baseline us | solution us | baseline / read-only (the most any kernel can score) | solution / read-only |\n"
          "| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['problem']} | {r['workload']} | {r['bytes'] / 1e6:,.1f} | {r['floor_us']:,.1f} | {r['read_us']:,.1f} "
              f"| {r['baseline_us']:,.1f} | {r['solution_us']:,.1f} | {r['baseline_us'] / r['read_us']:.3f}x "
              f"| {r['solution_us'] / r['read_us']:.3f}x |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
