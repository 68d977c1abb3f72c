"""Where does the process-to-process spread of a workload's median come from? GPU only.

    python benchmarks/noise_sources.py [--trials 8] [--multiples 5 20] [--json OUT]

For the projection (cuBLAS F.linear) at M = 1 and 32 and each rotation footprint (a multiple of
the L2), one set of rotated inputs A is allocated once and kept, and in every trial a fresh set B
is allocated after a spacer of a different size (so its pages land elsewhere in the GPU's memory).
A and B are timed in interleaved blocks exactly as the official method does. Then:
- the spread of A's medians across trials is drift in time (clocks, temperature) alone;
- the spread of B's medians is drift plus where the inputs landed in memory;
- run the script in several processes to see what a new process adds to both.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.kernel import timing  # noqa: E402
from pipeline.problems import load_problem  # noqa: E402


def sets_for(problem, shape, n: int) -> list[dict]:
    return [problem.reference.make_inputs(shape, r, "cuda") for r in range(n)]


def spread(xs: list[float]) -> float:
    return max(xs) / min(xs) - 1


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=8)
    ap.add_argument("--multiples", type=float, nargs="+", default=[5.0, 20.0])
    ap.add_argument("--ms", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    problem = load_problem("muse_bf16_proj")
    stream = torch.cuda.Stream()
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    fn = lambda s: F.linear(s["x"], s["w"])  # noqa: E731
    clocks = timing.Clocks(0)
    rows = []
    for M in args.ms:
        shape = problem.shape(f"M{M}", "full")
        one = problem.reference.make_inputs(shape, 0, "cuda")
        nbytes = sum(v.numel() * v.element_size() for v in one.values())
        del one
        for mult in args.multiples:
            R = max(2, math.ceil(mult * l2 / nbytes))
            a_sets = sets_for(problem, shape, R)
            for s in a_sets:
                fn(s)
            torch.cuda.synchronize()
            est = timing.replays_us([timing.capture(fn, a_sets, 2 * R, stream)])[0]
            k = timing.choose_calls(est, R)
            ga = timing.capture(fn, a_sets, k, stream)
            trials = []
            for t in range(args.trials):
                spacer = torch.empty((37 * t + 11) << 20, dtype=torch.uint8, device="cuda")
                b_sets = sets_for(problem, shape, R)
                gb = timing.capture(fn, b_sets, k, stream)
                t_end = time.monotonic() + 0.25
                while time.monotonic() < t_end:
                    timing.replays_us([ga, gb])
                a, b = [], []
                clocks.rows.clear()
                for blk in range(10):
                    clocks.sample()
                    first, second = (ga, a), (gb, b)
                    for g, xs in ((first, second) if blk % 2 == 0 else (second, first)):
                        xs.extend(timing.replays_us([g] * timing.BLOCK))
                c = clocks.summary() or {}
                trials.append({"a_us": statistics.median(a), "b_us": statistics.median(b),
                               "a_half_width": (lambda lo_hi: (lo_hi[1] - lo_hi[0]) / 2 / statistics.median(a))(timing.median_interval(a)),
                               "b_address": b_sets[0]["w"].data_ptr(),
                               "sm_mhz": c.get("sm_mhz"), "mem_mhz": c.get("mem_mhz"), "temp_c": c.get("temp_c"),
                               "power_w": c.get("power_w")})
                del gb, b_sets, spacer
                torch.cuda.empty_cache()
            A = [x["a_us"] for x in trials]
            B = [x["b_us"] for x in trials]
            row = {"M": M, "multiple": mult, "sets": R, "calls": k, "a_spread": spread(A), "b_spread": spread(B),
                   "a_median_us": statistics.median(A), "b_median_us": statistics.median(B),
                   "mean_half_width": statistics.fmean(x["a_half_width"] for x in trials), "trials": trials}
            rows.append(row)
            print(f"M={M:2d} x{mult:g} L2 (R={R}, k={k}): kept A {statistics.median(A):.3f} us, spread over "
                  f"{args.trials} trials {spread(A):.3%}; fresh B {statistics.median(B):.3f} us, spread {spread(B):.3%}; "
                  f"B/A per trial {', '.join(f'{b / a:.4f}' for a, b in zip(A, B))}; "
                  f"SM MHz {[x['sm_mhz']['median'] if x['sm_mhz'] else None for x in trials]}", flush=True)
            del ga, a_sets
            torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "gpu": torch.cuda.get_device_name()}, indent=2))


if __name__ == "__main__":
    main()
