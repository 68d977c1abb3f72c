"""Tune the organizers' solutions (solutions/<problem>/submission.py, issue 18) on the H200, as
tune_fused_moe.py tunes the fused MoE baseline: each configuration timed as the evaluator times a
submission (CUDA graphs over rotated input sets, cold weights, the median over --seconds), the problem's
baseline timed in the same run beside them, and with --write the best per M written into the
submission's CONFIGS (between its `CONFIGS = {` line and the closing `}`), so no search is repeated.

    python benchmarks/tune_solutions.py muse_bf16_proj [--write] [--seconds 0.3] [--json OUT]
Each solution's custom_kernel takes the configuration as an optional second argument.
GPU only.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import math
import re
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from pipeline.kernel.evaluate import device_ceilings, floor_us  # noqa: E402
from pipeline.problems import load_problem  # noqa: E402
from tune_fused_moe import time_us  # noqa: E402

MAX_SIZE, MIN_SIZE = "max_size", "min_size"  # a stage's optional bounds: it runs only for the sizes between
# Each problem's search, in stages: a stage searches its grid with every other key at the best found so
# far (the kept configuration first), so the MoE's two GEMMs are searched one after the other, not as a
# product.
GRIDS = {
    "muse_bf16_proj": [{"BN": [32, 64, 128], "BK": [128, 256], "SPLIT": [1, 2, 4], "num_warps": [4],
                        "num_stages": [4, 6]},
                       # the orientation: the weight's rows as the dot's first operand compile to wgmma (BN >= 64)
                       # where the tokens' 16-32 rows make mma.sync, with fewer registers (56 against 72 and 8 bytes
                       # of stack at BM 32, BN 64) and a shorter loop (122 against 139 instructions), for 20% more
                       # shared memory (benchmarks/static_kernels.py, 2026-12-06): 0.6-1.1 us faster at every
                       # M on an H100 (2026-12-06). (Stream-K, 132 equal runs of (tile, K step)s, lost by 4 us there:
                       # docs/BENCHMARKS.md, "Appendix: how the figures came to be", 2026-12-06.)
                       {"SWAP": [0, 1], "BN": [64, 128], "num_stages": [3, 4, 5, 6]}],
    # the tensor-core path's orientation (ROWS: the tokens as the dot's first operand; with 4 warps its kernels
    # hold 88-127 registers, as the baseline's, against 128-194 for ROWS 0: benchmarks/static_kernels.py), then
    # the CUDA-core path (PATH cc); each later stage tunes whichever is best so far. The CUDA-core GEMV's
    # arithmetic grows with the pairs (no tensor cores), so its stages run at the few-token sizes alone
    # (MAX_SIZE: M16's 128 pairs took 1.0 ms on it against the tensor cores' 0.45, twelfth session).
    # At M1 the words' unpacking (UNPACK words: 3.8-5 instructions a weight in its loop against the bytes' 6.8-8,
    # benchmarks/static_kernels.py) first, then the bytes' with PREFETCH.
    # The tensor-core kernels' loop fell from 5.0-5.4 to 2.4-2.8 instructions a weight in the fourteenth session
    # (no mask on the weights' loads, no interleave, the scale on the sums), so their tiles are searched again,
    # and at M1 too (last: it sets every key of the path).
    "muse_moe_w4a16": [{"ROWS": [0, 1], "SPLIT_UP": [1, 2], "warps_up": [2, 4], "warps_down": [2, 4], MIN_SIZE: 16},
                       {"BN_UP": [64, 128], "BN_DOWN": [64, 128], "SPLIT_DOWN": [1, 2], MIN_SIZE: 16},
                       # ncu at M16 (fifteenth session): DRAM at 52-55% of peak, occupancy capped by registers: the
                       # kernels wait on memory. The weights reach the dequant through Triton's cp.async pipeline
                       # (LDGSTS into shared memory, SASS), so more stages are more bytes in flight for no register;
                       # only stages 2 (M16) and 3 (M32) had ever been timed.
                       {"stages_up": [2, 3, 4, 5], "stages_down": [2, 3, 4, 5], MIN_SIZE: 16},
                       # the stages settled, the registers: ~245 a thread hold gate/up to 4 programs an SM. A cap
                       # trades spills (72-272 bytes of stack) for 5-8; half the tile (BN 32 on 2 warps: 165
                       # registers, no spill) for 2.96 instructions a weight against 2.43 (static_kernels, sixteenth
                       # session). Each kernel on its own.
                       {"BN_UP": [32, 64], "maxnreg_up": [0, 128, 168, 192], MIN_SIZE: 16},
                       {"BN_DOWN": [32, 64, 128], "maxnreg_down": [0, 128, 168], MIN_SIZE: 16},
                       # M1's 8 pairs x 3,072 rows are few for 132 SMs: 1-2 warps a program, K split in 2-4
                       # (the last split of a tile adds the parts); the down GEMV's 8 experts split likewise
                       {"PATH": ["cc"], "BT": [1], "UNPACK": ["words"], "BN_UP": [32, 64], "warps_up": [1, 2, 4],
                        "SPLIT_UP": [1, 2, 4], "GPS_UP": [1], "BN_DOWN": [32], "warps_down": [1], "GPS_DOWN": [1],
                        "SPLIT_DOWN": [2], MAX_SIZE: 8},
                       {"BN_DOWN": [32, 64], "warps_down": [1, 2], "SPLIT_DOWN": [1, 2, 4], MAX_SIZE: 8},
                       {"GPS_UP": [1, 2], "GPS_DOWN": [1, 2], MAX_SIZE: 8},
                       {"UNPACK": ["bytes"], "BN_UP": [8, 16, 32], "GPS_UP": [4, 8], "PREFETCH": [0, 1],
                        "warps_up": [4], "BN_DOWN": [8], "GPS_DOWN": [4], "warps_down": [4], MAX_SIZE: 8},
                       {"warps_up": [1, 2, 4, 8], MAX_SIZE: 8},
                       {"PATH": ["tc"], "BT": [16], "ROWS": [1], "BN_UP": [32, 64], "SPLIT_UP": [2, 4], "warps_up": [2],
                        "stages_up": [2], "BN_DOWN": [64], "SPLIT_DOWN": [1, 2], "warps_down": [2], "stages_down": [2],
                        MAX_SIZE: 8},
                       {"stages_up": [2, 3, 4], "stages_down": [2, 3, 4], MAX_SIZE: 8},
                       # M1's grids are ~1.2-1.5 waves at ~4-5 programs an SM (gate/up: 8 pairs x 48 tiles x
                       # split 2; down: 8 x 80): the register cap fits more programs an SM, one wave
                       {"BN_UP": [32, 64], "maxnreg_up": [0, 128, 168], "maxnreg_down": [0, 128, 168], MAX_SIZE: 8},
                       # M1's experts have one pair each: sorting groups nothing, so no _route (one launch fewer)
                       {"SORT": [0, 1], MAX_SIZE: 8},
                       # the tensor-core path's three launches chained by Hopper's programmatic dependent launch
                       # (_gate_up and _down launched while the kernel before runs, waiting on the device)
                       {"PDL": [0, 1]}],
    "muse_attention_decode": [{"CHUNK": [128, 256, 512, 1024, 2048], "BLOCK_N": [32, 64]},
                              {"num_warps": [4, 8], "num_stages": [2, 3, 4]},
                              # the merge: one program a head reads all its splits' [S, D] tile (B1: 40 programs on
                              # 132 SMs, ~4 us under the profiler; the decode layer's B32 16 us, sixteenth session);
                              # its columns split over 2-8 programs, and its warps
                              {"MERGE_BD": [16, 32, 64, 128], "merge_warps": [2, 4, 8]},
                              # the merge launched while the splits run (Hopper's programmatic dependent launch), its
                              # programs waiting on the device for the splits' end: the launch's gap hidden
                              {"PDL": [0, 1]}],
    # the prefill layer: its attention's tiles, then the MoE's blocks at prefill sizes
    "muse_prefill_layer": [{"BLOCK_M": [64, 128], "BLOCK_N": [32, 64], "attn_warps": [4, 8]},
                           {"BT": [32, 64, 128], "BN_UP": [64, 128], "warps_up": [4, 8]},
                           # the orientation (ROWS: the tokens as the dot's first operand, as the production kernel);
                           # compiled for sm_90 both are wgmma, ROWS 1's K loop 16-25% shorter (static_kernels), and
                           # the H100 breakdown had this _down at 1.27x the baseline's at 2k (sixteenth session)
                           {"ROWS": [0, 1], "BT": [64, 128], "warps_up": [4, 8], "warps_down": [4, 8]},
                           {"BN_DOWN": [64, 128], "warps_down": [4, 8], "stages_down": [2, 3]},
                           # the pipeline's depth, as for the MoE's decode sizes (bytes in flight for shared memory)
                           {"stages_up": [2, 3, 4], "attn_stages": [2, 3]},
                           # the MoE's register cap, as at decode sizes (its BT 128 tiles hold 255 registers)
                           {"maxnreg_up": [0, 168], "maxnreg_down": [0, 168]}],
}
# What a solution's CONFIGS are keyed by (its custom_kernel reads it off the inputs): a workload's parameter
# (M when not named), or for the prefill layer the batch's new tokens.
SIZE = {"muse_attention_decode": lambda shape: shape["B"],
        "muse_prefill_layer": lambda shape: sum(int(n) for n in shape["new"])}


def _runs(stage: dict, size: int) -> bool:
    return stage.get(MIN_SIZE, -math.inf) <= size <= stage.get(MAX_SIZE, math.inf)


def size_of(problem: str, shape) -> int:
    """The key of `shape` in the solution's CONFIGS."""
    return SIZE[problem](shape) if problem in SIZE else shape["M"]


def load_solution(problem: str, path: Path | None = None):
    """(its path, the module) of solutions/<problem>/submission.py, or of `path` (an older version)."""
    path = path or ROOT / "solutions" / problem / "submission.py"
    spec = importlib.util.spec_from_file_location(f"solution_{problem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return path, module


def write_configs(path: Path, best: dict[int, dict], card: str, day: str, searched: list[int] | None = None) -> None:
    """The searched configurations written over the file's `CONFIGS = {...}` block, with the card and day they were
    searched on in a comment line right above it (replacing the last search's): tiles tuned on one GPU are not
    the best on another, and the runner's card is the one that counts. `searched`: the sizes this search timed
    when not all of `best` (tune_solutions --shape); the line then names them and keeps the last search's
    provenance for the rest."""
    text = path.read_text()
    last = re.search(r"^# searched on (.*?)(?: \(benchmarks/tune_solutions\.py --write\))?\n(?=CONFIGS = \{)", text, re.M)
    if last:  # the last search's line goes: the new one is written in its place
        text = text[:last.start()] + text[last.end():]
    where = f"{card}, {day}"
    if searched is not None and set(searched) != set(best):
        where += f": {', '.join(str(s) for s in sorted(searched))}; the rest on {last.group(1) if last else 'unknown cards'}"
    def entry(m: int, c: dict) -> str:  # one line, or one key per line past 110 characters
        line = f"    {m}: {json.dumps(c)},\n"
        if len(line) <= 110:
            return line
        return f"    {m}: {{\n" + "".join(f"        {json.dumps(k)}: {json.dumps(v)},\n" for k, v in c.items()) + "    },\n"
    body = "".join(entry(m, c) for m, c in sorted(best.items()))
    block = f"# searched on {where} (benchmarks/tune_solutions.py --write)\nCONFIGS = {{\n{body}}}\n"
    new, n = re.subn(r"^CONFIGS = \{\n.*?^\}\n", lambda _: block, text, count=1, flags=re.S | re.M)
    if n != 1:
        raise SystemExit(f"{path}: no `CONFIGS = {{ ... }}` block to write into")
    path.write_text(new)
    print(f"wrote CONFIGS into {path}", flush=True)


def chosen_shapes(shapes: list, names: list[str]) -> list:
    """The workloads named (every one when none is), in the problem's order; an unknown name is an error
    that lists the problem's."""
    known = [s.name for s in shapes]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"tune_solutions: no workload {', '.join(unknown)}; this problem's are {', '.join(known)}")
    return [s for s in shapes if not names or s.name in names]


def chosen_stages(grid: list[dict], indices: list[int]) -> list[dict]:
    """The grid's stages at `indices` (all of them for none), in the grid's order."""
    for i in indices:
        if not -len(grid) <= i < len(grid):
            raise SystemExit(f"--stage {i}: the grid has {len(grid)} stages (0 to {len(grid) - 1}, or -1 to "
                             f"-{len(grid)} from the end)")
    keep = {i % len(grid) for i in indices}
    return [stage for i, stage in enumerate(grid) if not keep or i in keep]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("problem", choices=sorted(GRIDS))
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--seconds", type=float, default=0.3)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--budget", type=float, help="seconds for the whole search (device time is scarce): each "
                    "workload gets its share, what one leaves passes on, and a search out of time keeps the best "
                    "found so far and still writes it")
    ap.add_argument("--shape", action="append", default=[],
                    help="search this workload only (repeatable); the others keep their CONFIGS entries")
    ap.add_argument("--stage", action="append", type=int, default=[],
                    help="run this stage of the problem's grid only (repeatable; its index, negative from the end), "
                         "from the kept configuration: the stages a short budget would never reach")
    args = ap.parse_args()
    problem = load_problem(args.problem)
    ref = problem.reference
    path, solution = load_solution(args.problem)
    ceilings = device_ceilings()
    grid = chosen_stages(GRIDS[args.problem], args.stage)
    shapes = chosen_shapes(problem.shapes("full", kinds=("workload",)), args.shape)
    rows, best = [], {size: dict(cfg) for size, cfg in solution.CONFIGS.items()}
    # each workload's share of --budget in proportion to the configurations its stages search
    counts = [sum(math.prod(len(v) for k, v in stage.items() if k not in (MAX_SIZE, MIN_SIZE)) for stage in grid
                  if _runs(stage, size_of(args.problem, shape))) for shape in shapes]
    start = time.monotonic()
    for index, shape in enumerate(shapes):
        share = sum(counts[:index + 1]) / sum(counts)
        deadline = start + args.budget * share if args.budget else math.inf
        sets = [ref.make_inputs(shape, 100 + r, "cuda") for r in range(2)]
        floor = floor_us(ref.floor(shape), ceilings)
        base_us = time_us(ref.baseline, sets, args.seconds)
        size = size_of(args.problem, shape)
        kept = solution.config_for(size)
        kept_us = time_us(lambda s: solution.custom_kernel(s), sets, args.seconds)
        print(f"{shape.name}: baseline {base_us:,.2f} us, kept {kept} {kept_us:,.2f} us, floor {floor:,.2f} us",
              flush=True)
        results = [(kept_us, kept)]
        current = dict(kept)
        for stage in grid:
            if not _runs(stage, size):
                continue
            stage = {k: v for k, v in stage.items() if k not in (MAX_SIZE, MIN_SIZE)}
            for values in itertools.product(*stage.values()):
                cfg = {**current, **dict(zip(stage, values))}
                if cfg == current and len(results) > 1:
                    continue
                if time.monotonic() > deadline:
                    print(f"  out of --budget: {cfg} and the rest of {shape.name}'s search not timed", flush=True)
                    break
                try:
                    us = time_us(lambda s, cfg=cfg: solution.custom_kernel(s, cfg), sets, args.seconds)
                except Exception as exc:  # noqa: BLE001 - a configuration that does not compile is skipped
                    print(f"  {cfg}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
                    continue
                results.append((us, cfg))
                print(f"  {cfg}: {us:,.2f} us", flush=True)
            current = min(results, key=lambda r: r[0])[1]
        results.sort(key=lambda r: r[0])
        us, cfg = results[0]
        best[size] = cfg
        rows.append({"workload": shape.name, "size": size, "baseline_us": base_us, "kept_us": kept_us, "best_us": us,
                     "floor_us": floor, "config": cfg})
        print(f"{shape.name}: best {cfg} {us:,.2f} us: {base_us / us:.3f}x the baseline, {us / floor:.2f}x the floor",
              flush=True)
        del sets
        torch.cuda.empty_cache()
    if args.write:
        own = path.parent / "layer.py"  # a layer's solution is generated: its CONFIGS live in layer.py
        write_configs(own if own.is_file() else path, best, torch.cuda.get_device_name(0),
                      time.strftime("%Y-%m-%d", time.gmtime()), [r["size"] for r in rows])
        if own.is_file():
            import subprocess
            subprocess.run([sys.executable, str(ROOT / "solutions" / "build_layers.py")], check=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    print("\n| workload | baseline us | kept us | best us | floor us | best / baseline speedup | config |\n"
          "| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['workload']} | {r['baseline_us']:,.2f} | {r['kept_us']:,.2f} | {r['best_us']:,.2f} | "
              f"{r['floor_us']:,.2f} | {r['baseline_us'] / r['best_us']:.3f}x | {r['config']} |")


if __name__ == "__main__":
    main()
