"""Does the host's launch latency sit inside a sample, and does it drift? GPU only. One process's
worth; run it several times (`bash benchmarks/gpu.sh method` runs it 3 times and compares).

    python benchmarks/launch_guard.py [--ms 1 32] [--trials 8] [--json OUT]
    python benchmarks/launch_guard.py --compare r1.json r2.json ...

For the projection (cuBLAS F.linear) with the evaluator's rotation (20x L2) and calls per replay,
one graph is sampled two ways in interleaved trials (0.25 s each, after the evaluator's 1.5 s settle):
- synced: one replay between two events, then wait for it (how the harness sampled until
  2026-11-30): the GPU is idle when the start event runs, so a sample also holds the time the host
  takes to launch the graph;
- guarded: timing.replays_us, a GPU sleep that holds the stream while the host queues a block of
  replays back to back, one event between each two.
Printed per mode: the median, the spread of the trial medians within the process; with --compare,
the spread of each mode's median across processes (the figure the repeatability target is about).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def spread(xs: list[float]) -> float:
    return max(xs) / min(xs) - 1


def compare(paths: list[Path]) -> None:
    runs = [json.loads(p.read_text()) for p in paths]
    for key in runs[0]["rows"]:
        for mode in ("synced", "guarded"):
            meds = [r["rows"][key][mode]["median_us"] for r in runs]
            print(f"M={key} {mode:7s}: medians {', '.join(f'{m:.3f}' for m in meds)} us; "
                  f"spread over {len(meds)} processes {spread(meds):.3%}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--trials", type=int, default=8)
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
    stream = torch.cuda.Stream()
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    fn = lambda s: F.linear(s["x"], s["w"])  # noqa: E731
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def synced(graph) -> float:
        start.record()
        graph.graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3 / graph.calls

    rows = {}
    for M in args.ms:
        shape = problem.shape(f"M{M}", "full")
        one = problem.reference.make_inputs(shape, 0, "cuda")
        R = timing.rotation_sets(one, l2, 20)
        sets = [one] + [problem.reference.make_inputs(shape, r, "cuda") for r in range(1, R)]
        for s in sets:
            fn(s)
        torch.cuda.synchronize()
        k = timing.choose_calls(timing.replays_us([timing.capture(fn, sets, 2 * R, stream)])[0], R)
        graph = timing.capture(fn, sets, k, stream)
        t_end = time.monotonic() + 1.5
        while time.monotonic() < t_end:
            timing.replays_us([graph] * timing.BLOCK)
        trials: dict[str, list[float]] = {"synced": [], "guarded": []}
        for t in range(args.trials):
            for mode in (("synced", "guarded") if t % 2 == 0 else ("guarded", "synced")):
                xs: list[float] = []
                t_end = time.monotonic() + 0.25
                while time.monotonic() < t_end:
                    if mode == "synced":
                        xs.extend(synced(graph) for _ in range(timing.BLOCK))
                    else:
                        xs.extend(timing.replays_us([graph] * timing.BLOCK))
                trials[mode].append(statistics.median(xs))
        row = {mode: {"median_us": statistics.median(v), "trial_medians_us": v, "within_spread": spread(v)}
               for mode, v in trials.items()}
        row.update(sets=R, calls=k)
        rows[str(M)] = row
        s, g = row["synced"], row["guarded"]
        print(f"M={M:2d} R={R} k={k}: synced {s['median_us']:.3f} us (trials spread {s['within_spread']:.3%}); "
              f"guarded {g['median_us']:.3f} us (trials spread {g['within_spread']:.3%}); synced - guarded "
              f"{(s['median_us'] - g['median_us']) * k:.2f} us per replay", flush=True)
        del graph, sets
        torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps({"rows": rows}, indent=2))


if __name__ == "__main__":
    main()
