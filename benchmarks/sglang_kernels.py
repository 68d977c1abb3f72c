"""Our MoE baseline against SGLang's own kernels, on the same inputs in the same run (issue 12: is the
board's 1.000x what production really runs?). GPU only.

For each token count M, three things are timed as tune_fused_moe.py times a configuration (CUDA graphs over
two rotated 1.5 GB input sets, so every call reads cold weights; the median over --seconds):
- ours: reference/muse_moe_w4a16.py:baseline (the fused path with its kept configuration);
- sglang default: SGLang's kernels taken from the pinned source (reference/_sglang_baselines.py) with the
  configuration SGLang picks for this model (the pin ships no tuned file for it: get_default_config);
- sglang tuned: the same kernels over a grid of SGLang's own tuning space (its tuning script's keys:
  BLOCK_SIZE_M/N/K, GROUP_SIZE_M, num_warps, num_stages), the best per M: what a deployment that ran
  SGLang's tuner for this model on an H200 would get.
Each output is checked against the problem's reference first (rel-L2 printed), so a configuration that
computes something else is never timed as a contender.

    python benchmarks/sglang_kernels.py [--m 1 --m 16 --m 32] [--seconds 0.2] [--quick] [--json OUT]

Needs the pinned source fetched (`python -m pipeline serving fetch`; on the device: `--sdist` of a carried
copy).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
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
from tune_fused_moe import time_us  # noqa: E402

import _sglang_baselines as sglang  # noqa: E402

# SGLang's tuning space (benchmark/kernels/fused_moe_triton of the pin: BLOCK_SIZE_M 16-256, N 32-256,
# K 64-256, GROUP_SIZE_M 1-64, 4/8 warps, 2-5 stages), cut to what can win at <= 32 tokens: BLOCK_SIZE_M 16
# (at most a few tokens per expert; every larger M block only adds padding) and GROUP_SIZE_M 1 (one M block
# per expert leaves nothing to group).
GRID = {"BLOCK_SIZE_M": [16], "BLOCK_SIZE_N": [32, 64, 128, 256], "BLOCK_SIZE_K": [64, 128, 256],
        "GROUP_SIZE_M": [1], "launch": [(4, 2), (4, 3), (4, 4), (8, 3), (8, 4)]}
QUICK = {"BLOCK_SIZE_M": [16], "BLOCK_SIZE_N": [32, 64, 128], "BLOCK_SIZE_K": [64, 128], "GROUP_SIZE_M": [1],
         "launch": [(4, 3), (8, 3)]}


def configs(grid: dict) -> list[dict]:
    out = []
    for values in itertools.product(*grid.values()):
        cfg = dict(zip(grid, values))
        cfg["num_warps"], cfg["num_stages"] = cfg.pop("launch")
        out.append(cfg)
    return out


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, action="append", help="token counts (default 1, 16, 32)")
    ap.add_argument("--seconds", type=float, default=0.2)
    ap.add_argument("--quick", action="store_true", help="a smaller grid (12 configurations)")
    ap.add_argument("--sdist", type=Path, help="the pinned sdist, when the tree is not fetched yet (no network)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.sdist:
        from pipeline.serving import pin

        if pin.cached_tree() is None:
            pin.fetch(sdist=args.sdist)
    ok, why = sglang.available()
    if not ok:
        sys.exit(f"sglang_kernels: {why}")
    problem = load_problem("muse_moe_w4a16")
    ref = problem.reference
    ceilings = device_ceilings()
    rows = []
    for m in args.m or (1, 16, 32):
        base = problem.shape("M1")
        shape = dataclasses.replace(base, name=f"M{m}", params={**base.params, "M": m})
        sets = [ref.make_inputs(shape, 100 + r, "cuda") for r in range(2)]
        expected = ref.reference(sets[0]).to("cuda")
        floor = floor_us(ref.floor(shape), ceilings)
        group = shape["H"] // sets[0]["w13_scale"].shape[-1]
        default = sglang.moe_config(m, shape["E"], sets[0]["w13"], sets[0]["w2"], shape["topk"], group)
        err_ours = rel_l2(ref.baseline(sets[0]), expected)
        ours_us = time_us(ref.baseline, sets, args.seconds)
        err_default = rel_l2(sglang.muse_moe_w4a16(sets[0]), expected)
        default_us = time_us(sglang.muse_moe_w4a16, sets, args.seconds)
        print(f"M{m}: floor {floor:,.1f} us; ours {ours_us:,.2f} us (rel-L2 {err_ours:.2e}); SGLang default "
              f"{default} {default_us:,.2f} us (rel-L2 {err_default:.2e})", flush=True)
        tuned = []
        for cfg in configs(QUICK if args.quick else GRID):
            launch = {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}
            fn = (lambda s, cfg=cfg: sglang.muse_moe_w4a16(s, config=cfg))
            try:
                err = rel_l2(fn(sets[0]), expected)
                if not err < 1.5e-2:
                    print(f"  {cfg}: WRONG (rel-L2 {err:.2e}), not timed", flush=True)
                    continue
                us = time_us(fn, sets, args.seconds)
            except Exception as exc:  # noqa: BLE001 - a configuration that does not compile or fit is skipped
                print(f"  {cfg}: {type(exc).__name__}: {str(exc)[:100]}", flush=True)
                continue
            tuned.append((us, cfg))
            print(f"  {cfg}: {us:,.2f} us ({launch})", flush=True)
        tuned.sort(key=lambda t: t[0])
        best_us, best = tuned[0] if tuned else (float("nan"), None)
        rows.append({"M": m, "floor_us": floor, "ours_us": ours_us, "sglang_default_us": default_us,
                     "sglang_default": default, "sglang_tuned_us": best_us, "sglang_tuned": best,
                     "rel_l2": {"ours": err_ours, "sglang_default": err_default}, "top5": tuned[:5]})
        print(f"M{m}: ours {ours_us:,.2f} us = {ours_us / floor:.2f}x the floor; SGLang default {default_us:,.2f} us "
              f"({default_us / ours_us:.2f}x ours), SGLang tuned {best_us:,.2f} us ({best_us / ours_us:.2f}x ours) "
              f"with {best}", flush=True)
        if args.json:
            args.json.write_text(json.dumps({"gpu": torch.cuda.get_device_name(0), "rows": rows}, indent=2))
        del sets, expected
        torch.cuda.empty_cache()
    print("\n| M | floor us | ours us | SGLang default us | SGLang tuned us | ours / floor | SGLang default / ours "
          "| SGLang tuned / ours | SGLang tuned config |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['M']} | {r['floor_us']:,.1f} | {r['ours_us']:,.1f} | {r['sglang_default_us']:,.1f} | "
              f"{r['sglang_tuned_us']:,.1f} | {r['ours_us'] / r['floor_us']:.2f}x | "
              f"{r['sglang_default_us'] / r['ours_us']:.2f}x | {r['sglang_tuned_us'] / r['ours_us']:.2f}x | "
              f"{r['sglang_tuned']} |")


if __name__ == "__main__":
    main()
