"""Programmatic dependent launch against the timed graph's fence (pipeline/kernel/predecessor.py). GPU only
(Hopper or later); docs/BENCHMARKS.md keeps the figures.

    python benchmarks/pdl_fence.py [--json OUT] [--problems NAME ...]

1. Per-call time of one kernel launched three ways (plain; early and never waiting; early and waiting) in
   graphs of independent calls, with and without the fence (an event record node after each call): a
   16-block kernel spinning 50 us, and the projection of tests/exploits/pdl_never_waits.py at M = 1 on the
   full model with the evaluator's rotation of input sets.
2. What the fence costs: each problem's baseline on its first workload, in graphs with and without it,
   interleaved (the median of the paired differences, a call).
3. The late write: in how many of 20 checked calls each launch reads its input before it is written.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def per_call(graphs, rounds: int = 15) -> list[float]:
    """Median per-call time of each graph, the graphs' replays interleaved round by round."""
    from pipeline.kernel import timing

    samples: list[list[float]] = [[] for _ in graphs]
    timing.replays_us(graphs)
    for _ in range(rounds):
        for i, t in enumerate(timing.replays_us(graphs)):
            samples[i].append(t)
    return [statistics.median(s) for s in samples]


def capture(fn, sets, calls, fenced: bool):
    from pipeline.kernel import predecessor, timing

    real = predecessor.fence
    if not fenced:
        predecessor.fence = lambda keep: None
    try:
        import torch

        return timing.capture(fn, sets, calls, torch.cuda.Stream())
    finally:
        predecessor.fence = real


def spin_rows() -> dict:
    import torch

    import pdl_kernels

    src = torch.randn(16 * 1024, device="cuda")
    dst = torch.empty_like(src)
    rows = {}
    for mode in pdl_kernels.MODES:
        graphs = [capture(lambda s, m=mode: pdl_kernels.launch(s["src"], s["dst"], m, spin_ns=50_000),
                          [{"src": src, "dst": dst}], 64, fenced) for fenced in (False, True)]
        unfenced, fenced = per_call(graphs)
        rows[mode] = {"unfenced_us": unfenced, "fenced_us": fenced}
    return rows


def projection_rows() -> dict:
    import torch

    from pipeline.kernel import timing
    from pipeline.problems import load_problem

    problem = load_problem("muse_bf16_proj")
    shape = problem.shape("M1")
    sets = [problem.reference.make_inputs(shape, 100 + i, "cuda") for i in range(2)]
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    r = timing.rotation_sets(sets[0], l2, 20)
    sets = [problem.reference.make_inputs(shape, 100 + i, "cuda") for i in range(r)]
    spec = importlib.util.spec_from_file_location("pdl_never_waits", ROOT / "tests/exploits/pdl_never_waits.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rows = {}
    for mode, (pdl, wait) in {"plain": (False, False), "never_waits": (True, False), "waits": (True, True)}.items():
        module.PDL, module.WAIT = pdl, wait
        for s in sets:
            module.custom_kernel(s)
        graphs = [capture(module.custom_kernel, sets, r, fenced) for fenced in (False, True)]
        unfenced, fenced = per_call(graphs)
        rows[mode] = {"unfenced_us": unfenced, "fenced_us": fenced, "sets": r}
    return rows


def fence_cost_rows(names: list[str]) -> dict:
    import torch

    from pipeline.kernel import timing
    from pipeline.problems import load_problem

    rows = {}
    for name in names:
        problem = load_problem(name)
        shape = problem.shapes("full", ("workload",))[0]
        sets = [problem.reference.make_inputs(shape, 200 + i, "cuda") for i in range(4)]
        fn = problem.reference.baseline
        for s in sets:
            fn(s)
        torch.cuda.synchronize()
        per = timing.choose_calls(1.0, len(sets))
        graphs = [capture(fn, sets, per, fenced) for fenced in (False, True)]
        pairs = []
        for _ in range(10):
            unfenced, fenced = per_call(graphs, rounds=5)
            pairs.append((unfenced, fenced))
        diffs = [f - u for u, f in pairs]
        unf = statistics.median(u for u, _ in pairs)
        rows[name] = {"workload": shape.name, "calls": per, "unfenced_us": unf,
                      "fenced_us": statistics.median(f for _, f in pairs),
                      "cost_us": statistics.median(diffs), "cost_fraction": statistics.median(diffs) / unf}
        del sets, graphs
        torch.cuda.empty_cache()
    return rows


def late_write_rows(trials: int = 20) -> dict:
    import pdl_kernels

    return {mode: {"wrong": pdl_kernels.wrong_reads(mode, trials), "trials": trials} for mode in pdl_kernels.MODES}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path)
    ap.add_argument("--problems", nargs="*", default=["muse_bf16_proj", "muse_attention_decode", "muse_moe_w4a16",
                                                      "muse_decode_layer", "muse_prefill_layer"])
    args = ap.parse_args()
    import torch

    out = {"device": torch.cuda.get_device_name(0)}
    for key, fn in (("spin", spin_rows), ("projection", projection_rows), ("late_write", late_write_rows),
                    ("fence_cost", lambda: fence_cost_rows(args.problems))):
        try:
            out[key] = fn()
        except Exception as exc:  # noqa: BLE001 - a probe: report and go on to the next part
            out[key] = {"error": f"{type(exc).__name__}: {exc}"}
        print(key, json.dumps(out[key], indent=1), flush=True)
        if args.json:
            args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
