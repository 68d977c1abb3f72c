"""What the compiler makes of the MoE kernels, without a GPU (issue 18): each kernel compiled for sm_90
(Hopper) by the Triton installed here, its cubin read with the bundled cuobjdump: registers a thread,
stack (spills), shared memory, how its global loads are vectorised (ld.global.v4 = 16 bytes a thread) and
whether they are pipelined (cp.async: Triton pipelines the loads that feed a tl.dot).
Registers bound the programs an SM holds, so the loads a program keeps in flight; narrow loads multiply the
load instructions. A first look between GPU sessions, not a timing: the runner's Triton (3.6) may
allocate differently from this one, and every claim still needs the GPU's numbers.

    python benchmarks/static_kernels.py [--json OUT]

The integer arguments are given Triton's divisibility-by-16 specialisation where the full model's values
have it (H 5,120, I 1,536, the rows' bytes 2,560 and 768, the pair counts), as the JIT gives them at run time.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "reference"))
BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
DIVISIBLE = {"H", "I", "ROW", "n_pairs"}  # the full model's values are multiples of 16
POINTERS = {"x_ptr": "*bf16", "w_ptr": "*u8", "s_ptr": "*bf16", "act_ptr": "*fp32", "tw_ptr": "*fp32",
            "res_ptr": "*bf16", "out_ptr": "*bf16", "part_ptr": "*fp32"}


def _module(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compile_report(fn, constexprs: dict, num_warps: int, num_stages: int, pointers: dict | None = None,
                   scalars: dict | None = None, maxnreg: int | None = None, divisible: set | None = None) -> dict:
    """Compile `fn` for sm_90 with these constexprs; its resources and load widths. `pointers` and `scalars`
    name the types of the arguments that are not the MoE's usual pointers or i32; `maxnreg` caps a thread's
    registers (the launch option the MoE solution's "maxnreg_up" / "maxnreg_down" set)."""
    names = fn.arg_names
    # a constexpr left out takes its default, as a launch does (not a runtime i32: a branch on it would stay)
    constexprs = {**{q.name: q.default for q in fn.params if q.is_constexpr and q.has_default}, **constexprs}
    types = {**POINTERS, **(pointers or {})}
    scalars = scalars or {}
    signature, attrs = {}, {}
    for i, n in enumerate(names):
        if n in constexprs:
            signature[n] = "constexpr"
        elif n.endswith("_ptr"):
            signature[n] = types.get(n, "*i32")
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[n] = scalars.get(n, "i32")
            if n in DIVISIBLE | (divisible or set()):  # what Triton's launch specialises for multiples of 16
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=signature, constexprs={(names.index(k),): v for k, v in constexprs.items()},
                    attrs=attrs)
    options = {"num_warps": num_warps, "num_stages": num_stages, **({"maxnreg": maxnreg} if maxnreg else {})}
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    try:
        dump = subprocess.run([str(BIN / "cuobjdump"), "--dump-resource-usage", f.name], capture_output=True,
                              text=True, check=True).stdout
        sass = subprocess.run([str(BIN / "cuobjdump"), "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
    finally:
        os.unlink(f.name)
    use = re.search(r"REG:(\d+).*?STACK:(\d+).*?SHARED:(\d+)", dump, re.S)
    ptx = kernel.asm["ptx"]
    # cuobjdump's SHARED is the static part only; Triton's pipeline buffers (num_stages) are dynamic
    return {"registers": int(use[1]), "stack": int(use[2]), "shared": max(int(use[3]), int(kernel.metadata.shared)),
            "ld_v4": ptx.count("ld.global.v4"), "ld_v2": ptx.count("ld.global.v2"),
            "ld": len(re.findall(r"ld\.global", ptx)), "cp_async": ptx.count("cp.async"),
            "wgmma": ptx.count("wgmma.mma_async"), "mma_sync": ptx.count("mma.sync"),
            "griddep": ptx.count("griddepcontrol"),
            "loop_instructions": inner_loop(sass)}


def inner_loop(sass: str) -> int | None:
    """The instructions of the kernel's longest loop (a backward branch and what it jumps over), in SASS:
    what a thread issues per K step, where a GEMV bound by the SMs spends its time. None: no loop."""
    at = {}
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            at[int(m[1], 16)] = m[2]
    spans = [(a - int(m[1], 16)) // 16 + 1 for a, ins in at.items()
             if (m := re.search(r"BRA\s+(?:`\()?0x([0-9a-f]+)", ins)) and int(m[1], 16) < a]
    return max(spans, default=None)


def rows() -> list[dict]:
    solution = _module(ROOT / "solutions" / "muse_moe_w4a16" / "submission.py", "solution_moe")
    import _fused_moe_w4a16 as base  # noqa: E402 - the baseline's kernels

    out = []

    def add(what, fn, const, warps, stages, weights=None, **kw):
        """`weights`: the weights one thread unpacks per trip of the K loop (the CUDA-core GEMVs)."""
        try:
            r = compile_report(fn, const, warps, stages, **kw)
            if weights and r["loop_instructions"]:
                r["per_weight"] = round(r["loop_instructions"] / weights, 2)
        except Exception as exc:  # noqa: BLE001 - a configuration that does not compile is reported
            r = {"error": f"{type(exc).__name__}: {str(exc)[:160]}"}
        cap = {"maxnreg": kw["maxnreg"]} if kw.get("maxnreg") else {}
        out.append({"kernel": what, "config": {**const, "num_warps": warps, "num_stages": stages, **cap}, **r})
        print(json.dumps(out[-1]), flush=True)

    moe = dict(TOPK=8, GROUP=128)
    for bn, gps, pf, w, s in [(32, 4, 0, 4, 3), (16, 2, 0, 4, 3), (16, 2, 1, 4, 3), (8, 2, 1, 2, 2)]:
        add("solution _gate_up_cc", solution._gate_up_cc,
            {**moe, "BT": 1, "BN": bn, "GPS": gps, "SORTED": False, "PREFETCH": pf}, w, s,
            weights=2 * bn * gps * 128 / (32 * w))
    for bn, gps, w in [(32, 1, 4), (64, 1, 2), (64, 1, 4), (128, 1, 4), (64, 2, 4)]:
        add("solution _gate_up_words", solution._gate_up_words, {**moe, "BN": bn, "GPS": gps, "SPLIT": 2}, w, 1,
            weights=2 * bn * gps * 128 / (32 * w))
    for bn, gps, pf, w, s in [(8, 4, 0, 4, 3), (16, 2, 1, 4, 3), (32, 2, 1, 4, 3)]:
        add("solution _down_cc", solution._down_cc,
            {**moe, "BN": bn, "GPS": gps, "HAS_RES": False, "PREFETCH": pf}, w, s, weights=bn * gps * 128 / (32 * w))
    for bn, gps, w in [(32, 1, 4), (64, 1, 4), (128, 1, 4)]:
        add("solution _down_words", solution._down_words, {**moe, "BN": bn, "GPS": gps, "HAS_RES": False, "SPLIT": 2},
            w, 1,
            weights=bn * gps * 128 / (32 * w))
    # POST 0: each weight scaled in bf16 as the production kernel does; POST 1 (BT <= 32): the group's sums
    # (0, 64, 2, 4, 1): the pipeline's depth costs shared memory, not registers (fifteenth session); (0, 32, 2, 4, 1):
    # half the tile on as many threads, ~2/3 of the registers (sixteenth session)
    for rows_, bn, w, s, post in [(0, 64, 2, 2, 1), (1, 64, 2, 2, 1), (0, 128, 4, 3, 1), (1, 128, 4, 3, 1),
                                  (1, 64, 2, 2, 0), (0, 64, 2, 4, 1), (0, 32, 2, 4, 1)]:
        # a trip of the tensor-core kernels' K loop is one quantisation group (128 k) of BN rows (gate and up)
        add("solution _gate_up (tensor cores)", solution._gate_up,
            {**moe, "BT": 16, "BN": bn, "SPLIT": 2, "F32": False, "ROWS": rows_, "POST": post}, w, s,
            weights=2 * bn * 128 / (32 * w))
        add("solution _down (tensor cores)", solution._down,
            {**moe, "BT": 16, "BN": bn, "SPLIT": 1, "F32": False, "ROWS": rows_, "POST": post}, w, s,
            pointers={"act_ptr": "*bf16", "out_ptr": "*bf16"}, weights=bn * 128 / (32 * w))
    # the register cap the search tries (sixteenth session): registers against the stack it spills to
    for cap in (192, 168, 128):
        add("solution _gate_up (tensor cores)", solution._gate_up,
            {**moe, "BT": 16, "BN": 64, "SPLIT": 1, "F32": False, "ROWS": 0, "POST": 1}, 2, 4, maxnreg=cap,
            weights=2 * 64 * 128 / (32 * 2))
        add("solution _down (tensor cores)", solution._down,
            {**moe, "BT": 16, "BN": 64, "SPLIT": 1, "F32": False, "ROWS": 0, "POST": 1}, 2, 5, maxnreg=cap,
            pointers={"act_ptr": "*bf16", "out_ptr": "*bf16"}, weights=64 * 128 / (32 * 2))
    # the launches chained by programmatic dependent launch (griddepcontrol in the PTX), and unsorted (SORT 0: no
    # route, block b is pair b), eighteenth session
    add("solution _gate_up (tensor cores, PDL, unsorted)", solution._gate_up,
        {**moe, "BT": 16, "BN": 32, "SPLIT": 2, "F32": False, "ROWS": 1, "POST": 1, "PDL": True, "SORTED": False}, 2, 3,
        weights=2 * 32 * 128 / (32 * 2))
    add("solution _down (tensor cores, PDL, unsorted)", solution._down,
        {**moe, "BT": 16, "BN": 64, "SPLIT": 1, "F32": False, "ROWS": 1, "POST": 1, "PDL": True, "SORTED": False}, 2, 3,
        pointers={"act_ptr": "*bf16", "out_ptr": "*bf16"}, weights=64 * 128 / (32 * 2))
    # the layers' own kernels, as their generated submissions define them
    decode = _module(ROOT / "solutions" / "muse_decode_layer" / "submission.py", "solution_decode_layer")
    prefill = _module(ROOT / "solutions" / "muse_prefill_layer" / "submission.py", "solution_prefill_layer")
    bf16 = {n: "*bf16" for n in ("x_ptr", "res_ptr", "w_ptr", "out_ptr", "h_ptr", "qkv_ptr", "q_ptr", "k_ptr",
                                 "v_ptr", "o_ptr", "logits_ptr")}
    add("layers _norm", decode._norm, {"HAS_RES": True, "BLOCK": 8192, "F32": False}, 8, 1, pointers=bf16,
        scalars={"eps": "fp32"})
    for extend in (False, True):
        add(f"layers _rope_write (extend {extend})", decode._rope_write,
            {"Hq": 40, "Hkv": 8, "D": 128, "PAGE": 16, "BB": 4, "EXTEND": extend, "F32": False}, 1, 1,
            pointers={**bf16, "freq_ptr": "*fp64"})
    add("layers _topk", decode._topk, {"TOPK": 8, "EB": 128}, 1, 1, pointers={**bf16, "w_ptr": "*fp32"})
    add("prefill _extend", prefill._extend, {"Hq": 40, "G": 5, "D": 128, "PAGE": 16, "BLOCK_M": 64, "BLOCK_N": 64,
                                              "F32": False}, 4, 2, pointers=bf16, scalars={"qk_scale": "fp32"})
    attention = decode.attn_config_for(32)
    add("attention _decode (B32)", decode._decode,
        {"G": 5, "G_PAD": 16, "D": 128, "PAGE": 16, "CHUNK": attention["CHUNK"], "BLOCK_N": attention["BLOCK_N"],
         "F32": False}, attention["num_warps"], attention["num_stages"],
        pointers={**bf16, "acc_ptr": "*fp32", "m_ptr": "*fp32", "l_ptr": "*fp32"}, scalars={"qk_scale": "fp32"})
    # the projection's skinny GEMM in both orientations (seventeenth session): SWAP 1 puts the weight's rows on
    # the dot's M side, so BN >= 64 makes Hopper's wgmma where the tokens' 16-32 rows make mma.sync
    proj = _module(ROOT / "solutions" / "muse_bf16_proj" / "submission.py", "solution_proj")
    for swap, bm in [(0, 16), (1, 16), (0, 32), (1, 32)]:
        add(f"proj _skinny (SWAP {swap}, BM {bm})", proj._skinny,
            {"BM": bm, "BN": 64, "BK": 128, "SPLIT": 1, "SWAP": swap, "F32": False}, 4, 6,
            pointers={"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16"}, divisible={"K", "N", "k_per_split"})
    attention_part = _module(ROOT / "solutions" / "muse_attention_decode" / "submission.py", "solution_attention")
    add("attention _merge (PDL)", attention_part._merge,
        {"G": 5, "D": 128, "CHUNK": 256, "S": 64, "BD": 32, "F32": False, "PDL": True}, 4, 1,
        pointers={"out_ptr": "*bf16", "acc_ptr": "*fp32", "m_ptr": "*fp32", "l_ptr": "*fp32", "lens_ptr": "*i32"})
    if getattr(base, "triton", None) is not None:
        for m in (1, 16):
            cfg = base.config_for(m)
            kinds = {"SCHEME": cfg["SCHEME"], "DEQ": cfg["DEQ"]}
            add(f"baseline _gate_up (M{m})", base._gate_up,
                {"TOPK": 8, "E": 128, "BM": cfg["BM"], "BN": cfg["BN"], "GROUP": 128, **kinds,
                 "SPLIT": cfg.get("SPLIT_UP", 1), "F32": False}, cfg["num_warps"], cfg["num_stages"],
                pointers={"act_ptr": "*bf16"}, weights=2 * cfg["BN"] * 128 / (32 * cfg["num_warps"]))
            add(f"baseline _down (M{m})", base._down,
                {"E": 128, "BM": cfg["BM"], "BN": cfg["BN"], "GROUP": 128, **kinds,
                 "SPLIT": cfg.get("SPLIT_DOWN", 1), "F32": False}, cfg["num_warps"], cfg["num_stages"],
                pointers={"act_ptr": "*bf16", "out_ptr": "*fp32"}, weights=cfg["BN"] * 128 / (32 * cfg["num_warps"]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    out = rows()
    print(f"\nTriton {triton.__version__}, sm_90\n\n| kernel | configuration | registers | stack | ld.global v4 / v2 / all "
          "| cp.async | shared bytes | wgmma / mma.sync | loop instructions (a weight) |\n"
          "| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in out:
        cfg = ", ".join(f"{k} {v}" for k, v in r["config"].items() if k not in ("TOPK", "GROUP", "E", "F32"))
        if "error" in r:
            print(f"| {r['kernel']} | {cfg} | {r['error']} | | | | | | |")
        else:
            loop = r["loop_instructions"] or "-"
            loop = f"{loop} ({r['per_weight']})" if "per_weight" in r else loop
            print(f"| {r['kernel']} | {cfg} | {r['registers']} | {r['stack']} | {r['ld_v4']} / {r['ld_v2']} / {r['ld']} "
                  f"| {r['cp_async']} | {r['shared']:,} | {r['wgmma']} / {r['mma_sync']} | {loop} |")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
