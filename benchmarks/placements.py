"""Would re-placing the rotated inputs during a run average away the per-process offset of a median?
GPU only. One process's worth; run it several times (gpu_session.sh step `placements` runs it 5 times
and compares).

    python benchmarks/placements.py [--m 32] [--placements 1 3] [--seconds 2] [--json OUT]

For each placement count P, the projection's rotated sets (20x L2, as the evaluator uses) are placed
P times in fresh memory behind a spacer of random size, each placement captured in its own graph and
sampled for seconds/P after a short settle; the median of all P*n samples is that P's figure, the
same total sampling time as the evaluator's minimum window. A lower spread across processes for P=3
than for P=1 would justify re-placing inside the evaluator.

    python benchmarks/placements.py --compare r1.json r2.json ...   # the spread per P over runs
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


def compare(paths: list[Path]) -> None:
    runs = [json.loads(p.read_text()) for p in paths]
    for key in runs[0]["medians_us"]:
        meds = [r["medians_us"][key] for r in runs]
        print(f"P={key}: medians {', '.join(f'{m:.3f}' for m in meds)} us; spread {max(meds) / min(meds) - 1:.3%}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, default=32)
    ap.add_argument("--placements", type=int, nargs="+", default=[1, 3])
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--multiple", type=float, default=20.0)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--compare", type=Path, nargs="+")
    args = ap.parse_args()
    if args.compare:
        compare(args.compare)
        return

    import torch
    import torch.nn.functional as F

    from pipeline.kernel import timing
    from pipeline.problems import load_problem

    problem = load_problem("muse_bf16_proj")
    shape = problem.shape(f"M{args.m}", "full")
    stream = torch.cuda.Stream()
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    fn = lambda s: F.linear(s["x"], s["w"])  # noqa: E731
    one = problem.reference.make_inputs(shape, 0, "cuda")
    R = timing.rotation_sets(one, l2, args.multiple)
    del one
    rng = random.Random()

    def place() -> tuple[list[dict], torch.Tensor]:
        spacer = torch.empty(rng.randrange(1, 2048) << 20, dtype=torch.uint8, device="cuda")
        return [problem.reference.make_inputs(shape, r, "cuda") for r in range(R)], spacer

    def sample(graph, seconds: float) -> list[float]:
        xs: list[float] = []
        t_end = time.monotonic() + seconds
        while time.monotonic() < t_end:
            xs.extend(timing.replays_us([graph] * timing.BLOCK))
        return xs

    sets, spacer = place()
    for s in sets:
        fn(s)
    torch.cuda.synchronize()
    k = timing.choose_calls(timing.replays_us([timing.capture(fn, sets, 2 * R, stream)])[0], R)
    sample(timing.capture(fn, sets, k, stream), 1.5)  # the evaluator's settle
    del sets, spacer
    medians, per_placement = {}, {}
    order = list(args.placements)
    rng.shuffle(order)  # neither count always goes first
    for P in order:
        pooled, levels = [], []
        for _ in range(P):
            sets, spacer = place()
            graph = timing.capture(fn, sets, k, stream)
            sample(graph, 0.2)
            xs = sample(graph, args.seconds / P)
            pooled += xs
            levels.append(statistics.median(xs))
            del graph, sets, spacer
            torch.cuda.empty_cache()
        medians[str(P)] = statistics.median(pooled)
        per_placement[str(P)] = levels
        print(f"M={args.m} R={R} k={k} P={P}: median {medians[str(P)]:.3f} us over {len(pooled)} samples; "
              f"per placement {', '.join(f'{x:.3f}' for x in levels)}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"m": args.m, "sets": R, "calls": k, "medians_us": medians,
                                         "per_placement_us": per_placement}, indent=2))


if __name__ == "__main__":
    main()
