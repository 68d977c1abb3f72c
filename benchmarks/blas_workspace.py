"""Does the place of cuBLAS's workspace set the level of a split-K GEMV? GPU only. One process's worth;
run it several times (`bash benchmarks/gpu.sh method` runs it once beside the other method experiments).

    python benchmarks/blas_workspace.py [--ms 1 32] [--trials 12] [--json OUT]

The projection at M = 1 is the one workload where cuBLAS runs a split-K kernel and a reduction kernel,
whose partial sums live in cuBLAS's workspace. torch keeps one workspace per (cuBLAS handle, stream),
so every graph captured on the evaluator's timing stream shares one, placed wherever the allocator put
it when the stream first met cuBLAS. Across evaluations, M = 1 medians fell on two levels 4.6% apart,
the baseline's and the submission's always together (docs/BENCHMARKS.md): what two graphs of one
process share is that workspace.

With one kept set of rotated inputs (20x L2, as the evaluator), each trial puts a spacer of random
size in memory, then captures the call in one of two ways and samples it guarded (timing.replays_us)
for --seconds after a short settle:
- same stream: a new graph on the stream of the first trial (its pool is new, its workspace is not);
- new stream: a new graph on a new stream (a new workspace too).
Everything stays alive until the end, so each trial's memory is its own. If the new-stream trials
spread over levels and the same-stream trials do not, the workspace's place is what sets the level.
Each trial also profiles two replays (torch.profiler): the mean time of each kernel in the graph, and
where the graph's first output lies, so a level can be pinned on a kernel and an address.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def profile(torch, timing, graph) -> dict[str, tuple[int, float]]:
    """Per kernel in two replays of the graph: (launches, mean microseconds)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        timing.replays_us([graph] * 2)
    out = {}
    for e in prof.key_averages():
        total = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if total and e.count and not e.key.startswith(("cudaGraph", "Memcpy", "Memset")):
            out[e.key[:48]] = (e.count, total / e.count)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--trials", type=int, default=12)
    ap.add_argument("--seconds", type=float, default=0.5)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    import torch
    import torch.nn.functional as F

    from pipeline.kernel import timing
    from pipeline.problems import load_problem

    problem = load_problem("muse_bf16_proj")
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    fn = lambda s: F.linear(s["x"], s["w"])  # noqa: E731
    rng = random.Random()
    rows = {}
    for M in args.ms:
        shape = problem.shape(f"M{M}", "full")
        one = problem.reference.make_inputs(shape, 0, "cuda")
        R = timing.rotation_sets(one, l2, 20)
        sets = [one] + [problem.reference.make_inputs(shape, r, "cuda") for r in range(1, R)]
        first_stream = torch.cuda.Stream()
        k = None
        kept: list = []
        trials: dict[str, list[float]] = {"same stream": [], "new stream": []}
        profiles: dict[str, list[dict]] = {}
        for t in range(args.trials):
            mode = "same stream" if t % 2 == 0 else "new stream"
            kept.append(torch.empty(rng.randrange(1, 64 << 20), dtype=torch.uint8, device="cuda"))
            stream = first_stream if mode == "same stream" else torch.cuda.Stream()
            with torch.cuda.stream(stream):
                fn(sets[0])  # the stream meets cuBLAS outside a capture
            torch.cuda.synchronize()
            if k is None:
                k = timing.choose_calls(timing.replays_us([timing.capture(fn, sets, 2 * R, stream)])[0], R)
            graph = timing.capture(fn, sets, k, stream)
            kept.append(graph)
            t_end = time.monotonic() + 0.3
            while time.monotonic() < t_end:
                timing.replays_us([graph] * timing.BLOCK)
            xs: list[float] = []
            t_end = time.monotonic() + args.seconds
            while time.monotonic() < t_end:
                xs.extend(timing.replays_us([graph] * timing.BLOCK))
            trials[mode].append(statistics.median(xs))
            kernels = profile(torch, timing, graph)
            out = graph.outputs[0]
            print(f"M={M:2d} trial {t:2d} {mode}: {trials[mode][-1]:.2f} us; output at {out.data_ptr():#x} "
                  f"(+{out.data_ptr() % (2 << 20):#x} in its 2 MiB page); kernels "
                  + "; ".join(f"{name} x{n} {us:.2f} us" for name, (n, us) in kernels.items()), flush=True)
            profiles.setdefault(mode, []).append({"median_us": trials[mode][-1], "output_ptr": out.data_ptr(),
                                                  "kernels": kernels})
        row = {mode: {"trial_medians_us": v, "spread": max(v) / min(v) - 1} for mode, v in trials.items()}
        row.update(sets=R, calls=k, profiles=profiles)
        rows[str(M)] = row
        for mode in trials:
            r = row[mode]
            print(f"M={M:2d} {mode}: trial medians {', '.join(f'{x:.2f}' for x in r['trial_medians_us'])} us; "
                  f"spread {r['spread']:.2%}", flush=True)
        del kept, sets
        torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps({"rows": rows}, indent=2))


if __name__ == "__main__":
    main()
