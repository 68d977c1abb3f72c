"""Tune the fused W4A16 MoE (reference/_fused_moe_w4a16.py) on the H200 and keep the result as data.

For each token count M (the workloads of muse_moe_w4a16 and of the decode layer: 1, 16, 32; the prefill
layer's: 2048, 4096, 8192) and each block configuration of a grid for its regime (decode: BM 16, the
memory-bound case; prefill: BM 64-128, the compute-bound case), the fused path is timed as the evaluator
times a submission: warm-up calls, one CUDA graph of k calls over rotated input sets (each set is
1.5 GB, so every call reads cold weights), replays back to back, the median over --seconds. The best
configuration per M is merged into reference/configs/fused_moe_w4a16.json after each M (a run cut short
keeps what it finished), with the machine it was measured on and this command, so no search is ever
repeated; moe_torch (the old baseline) and the floor are printed beside it. GPU only.

    python benchmarks/tune_fused_moe.py [--write] [--m 1 --m 16 ...] [--seconds 0.4] [--json OUT]
        [--only DEQ=2 --only BN=64,128 ...]   (restrict the grid's values of a key)

The configuration kept for each M is timed first in the same run (its row says "kept"), so a new
search is compared with what it would replace on the same machine at the same time; --no-moe-torch
skips timing the old PyTorch loop (34 ms a call).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "reference"))

from pipeline.kernel import timing  # noqa: E402
from pipeline.kernel.evaluate import device_ceilings, floor_us  # noqa: E402
from pipeline.problems import load_problem  # noqa: E402

import _fused_moe_w4a16 as fused  # noqa: E402

GRIDS = {  # by regime: M <= 64 reads weights (memory-bound), larger M is compute-bound
    # A handful of tokens uses a handful of experts: too few programs to fill the GPU, so split K.
    "few": {"SCHEME": [0, 1], "DEQ": [1, 2], "BM": [16], "BN": [64, 128], "num_warps": [4], "num_stages": [3],
            "SPLIT_UP": [1, 2, 4], "SPLIT_DOWN": [1, 2]},
    "decode": {"SCHEME": [0, 1], "DEQ": [1, 2], "BM": [16], "BN": [32, 64, 128], "num_warps": [4, 8],
               "num_stages": [2, 3]},
    "prefill": {"SCHEME": [1], "DEQ": [1, 2], "BM": [64, 128], "BN": [64, 128], "num_warps": [4, 8],
                "num_stages": [3]},
}


def regime(m: int) -> str:
    return "few" if m <= 4 else "decode" if m <= 64 else "prefill"


DEFAULT_M = (1, 16, 32, 2048, 4096, 8192)
KEYS = ("x", "topk_ids", "topk_weights", "w13", "w13_scale", "w2", "w2_scale")


def time_us(fn, sets: list[dict], seconds: float) -> float:
    for s in sets:
        fn(s)
    torch.cuda.synchronize()
    trial = timing.capture(fn, sets, len(sets), torch.cuda.Stream())
    per_call = min(timing.replays_us([trial] * 3))
    calls = timing.choose_calls(per_call, len(sets))
    graph = timing.capture(fn, sets, calls, torch.cuda.Stream())
    xs: list[float] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end or len(xs) < 20:
        xs.extend(timing.replays_us([graph] * timing.replays_per_round(per_call * calls)))
    return statistics.median(xs)


def write(best: dict[int, dict]) -> None:
    """Merge the best configurations into the kept file (other M's entries stay)."""
    old = json.loads(fused.CONFIGS.read_text()) if fused.CONFIGS.is_file() else {}
    configs = {int(m): c for m, c in old.get("configs", {}).items()}
    configs.update(best)
    fused.CONFIGS.parent.mkdir(parents=True, exist_ok=True)
    fused.CONFIGS.write_text(json.dumps({
        "measured": {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
                     "triton": __import__("triton").__version__,
                     "at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                     "command": "python " + " ".join(["benchmarks/tune_fused_moe.py", *sys.argv[1:]])},
        "configs": {str(m): c for m, c in sorted(configs.items())}}, indent=2) + "\n")
    print(f"wrote {fused.CONFIGS}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--write", action="store_true", help="write the best configurations to " + str(fused.CONFIGS))
    ap.add_argument("--m", type=int, action="append", help=f"token counts to tune (default {DEFAULT_M})")
    ap.add_argument("--seconds", type=float, default=0.4, help="sampling per configuration and workload")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--only", action="append", default=[], metavar="KEY=V1,V2",
                    help="restrict a key of the grid to these values (integers)")
    ap.add_argument("--no-moe-torch", action="store_true", help="do not time the old PyTorch loop")
    ap.add_argument("--sglang-capacity", action="store_true",
                    help="size the alignment's grid as SGLang does (every expert's run padded, not only the used "
                         "ones'): what the bound on the used experts saves, measured; never with --write")
    args = ap.parse_args()
    if args.sglang_capacity:
        if args.write:
            ap.error("--sglang-capacity measures the old grid; it never writes configurations")
        fused.padded_capacity = lambda n, e, bm: (n + e * (bm - 1) + bm - 1) // bm * bm
    only = {}
    for item in args.only:
        key, _, values = item.partition("=")
        try:
            only[key] = [int(v) for v in values.split(",")]
        except ValueError:
            ap.error(f"--only {item!r}: expected KEY=V1,V2 with integer values")
        if not any(key in g for g in GRIDS.values()):
            ap.error(f"--only {item!r}: {key} is no key of the grids ({', '.join(GRIDS['decode'])})")
    problem = load_problem("muse_moe_w4a16")
    ref = problem.reference
    ceilings = device_ceilings()
    rows, best = [], {}
    for m in args.m or DEFAULT_M:
        base = problem.shape("M1")
        shape = dataclasses.replace(base, name=f"M{m}", params={**base.params, "M": m})
        sets = [ref.make_inputs(shape, 100 + r, "cuda") for r in range(2)]
        floor = floor_us(ref.floor(shape), ceilings)
        base_us = time_us(ref.baseline, sets, args.seconds) if m <= 64 and not args.no_moe_torch else float("nan")
        print(f"{shape.name}: baseline (moe_torch) {base_us:,.1f} us, floor {floor:,.1f} us", flush=True)
        grid = {k: only.get(k, v) for k, v in GRIDS[regime(m)].items()}
        results = []
        kept = fused._configs().get(m)
        candidates = [dict(zip(grid, values)) for values in itertools.product(*grid.values())]
        if kept is not None:
            kept = {**fused.DEFAULT_CONFIG, **kept}
            candidates = [kept] + [c for c in candidates if {**fused.DEFAULT_CONFIG, **c} != kept]
        for cfg in candidates:
            try:
                us = time_us(lambda s, cfg=cfg: fused.fused_moe(*(s[k] for k in KEYS), config=cfg), sets, args.seconds)
            except Exception as exc:  # noqa: BLE001 - a configuration that does not compile is skipped
                print(f"  {cfg}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
                continue
            results.append((us, cfg))
            print(f"  {cfg}: {us:,.2f} us" + (" (kept)" if cfg is kept else ""), flush=True)
        results.sort(key=lambda r: r[0])
        us, cfg = results[0]
        best[shape["M"]] = cfg
        kept_us = next((u for u, c in results if c is kept), float("nan"))
        rows.append({"workload": shape.name, "M": shape["M"], "baseline_us": base_us, "fused_us": us, "floor_us": floor,
                     "kept_us": kept_us, "kept": kept,
                     "fused_over_floor": us / floor, "config": cfg, "top5": results[:5]})
        print(f"{shape.name}: best {cfg}: {us:,.2f} us = {us / floor:.2f}x the floor, "
              f"{kept_us / us:.3f}x the kept configuration's {kept_us:,.2f} us, "
              f"{base_us / us:.1f}x faster than moe_torch", flush=True)
        if args.write:
            write({m: cfg})
        if args.json:
            args.json.write_text(json.dumps(rows, indent=2))
        del sets
        torch.cuda.empty_cache()
    print("\n| workload | moe_torch us | kept us | best us | floor us | best / floor | config |\n"
          "| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['workload']} | {r['baseline_us']:,.1f} | {r['kept_us']:,.2f} | {r['fused_us']:,.2f} | "
              f"{r['floor_us']:,.1f} | {r['fused_over_floor']:.2f}x | {r['config']} |")


if __name__ == "__main__":
    main()
