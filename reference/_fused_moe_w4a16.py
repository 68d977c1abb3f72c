"""The fused W4A16 MoE path SGLang takes on an H200, written for this repository (issue 12): the
baseline of muse_moe_w4a16 and the layers' experts on a GPU (on a CPU they keep moe_torch, which the
interpreter would not slow down). Tuned and measured on the H200: docs/BENCHMARKS.md.

1. `align_block_size`: the M*topk (token, expert) pairs sorted by expert, each expert's run padded to a
   multiple of the block size BM with a sentinel, and the expert of each block of BM rows, all on the
   device with fixed-size tensors (no host synchronisation: CUDA-graph capturable). The grid covers the
   worst case (every expert's run padded), and blocks past the real end exit at once.
2. `_gate_up`: per block of BM pairs (one expert) and BN columns of the intermediate, the gate and the
   up GEMMs over K = H in steps of one quantisation group, the int4 nibbles unpacked in the kernel
   (`_group_step`: two schemes and two ways to unpack, chosen per token count by the tuning), bf16
   tensor-core dots accumulated in fp32; silu(gate) * up fused, stored in bf16.
3. `_down`: the w2 GEMM of each block over K = I the same way, each pair's top-k weight applied, one
   bf16 row per pair (as SGLang's intermediate cache); `_sum_topk` then sums the top-k rows of each token
   in fp32 (deterministic, as SGLang's moe_sum_reduce), with the layer's residual added when given.
4. Split-K, for the few-expert decode sizes (M1 uses 8 experts: 384 gate/up programs for 132 SMs, each
   walking 40 dependent steps): SPLIT_UP / SPLIT_DOWN programs share each block's K, write fp32 parts,
   and `_silu_mul` / `_sum_topk` add them in a fixed order (deterministic, no atomics).
Block configurations per token count live in `configs/fused_moe_w4a16.json` (as SGLang keeps per-shape
JSON configs); `benchmarks/tune_fused_moe.py` writes them on the H200.

On a CPU (Triton's interpreter) the dots run in float32 (the interpreter's bf16 dot is wrong) and the
bf16 rounding of the intermediate is done by hand (its float32 -> bf16 cast truncates).
"""

from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the evaluator's machines have Triton; this module needs it
    triton = None

# The tuned block configurations are part of the baseline: its identity hashes them with the code.
BASELINE_DATA = ("configs/fused_moe_w4a16.json",)
CONFIGS = Path(__file__).resolve().parent / BASELINE_DATA[0]
DEFAULT_CONFIG = {"BM": 16, "BN": 32, "num_warps": 4, "num_stages": 3, "SCHEME": 0, "DEQ": 1}
# The one-program alignment kernel compares every pair with every other (NP^2 work in registers).
ALIGN_KERNEL_MAX_PAIRS = 256


def align_block_size(topk_ids: torch.Tensor, num_experts: int, bm: int, capacity: int | None = None):
    """(sorted_pairs [max_padded] int32, block_expert [max_blocks] int32, padded_total [1] int32): the
    pairs (indices into topk_ids.flatten()) grouped by expert in expert order, each group padded to a
    multiple of `bm` with the sentinel M*topk; block b's expert, or `num_experts` past the end.

    Up to ALIGN_KERNEL_MAX_PAIRS pairs (decode batches) one Triton program does it all (one launch, as
    SGLang's moe_align_block_size kernel); more pairs (prefill), a few PyTorch ops whose cost is small
    beside the GEMMs. `capacity` sizes the sorted pairs otherwise than padded_capacity (the SGLang adapter
    sizes them as SGLang does)."""
    n_pairs = topk_ids.numel()
    max_padded = capacity or padded_capacity(n_pairs, num_experts, bm)
    if triton is not None and n_pairs <= ALIGN_KERNEL_MAX_PAIRS and topk_ids.is_contiguous():
        device = topk_ids.device
        sorted_pairs = torch.empty(max_padded, dtype=torch.int32, device=device)
        block_expert = torch.empty(max_padded // bm, dtype=torch.int32, device=device)
        total = torch.empty(1, dtype=torch.int32, device=device)
        _align[(1,)](topk_ids, sorted_pairs, block_expert, total, n_pairs, max_padded, max_padded // bm,
                     E=num_experts, BM=bm, NP=max(16, triton.next_power_of_2(n_pairs)),
                     EB=max(16, triton.next_power_of_2(num_experts)), CHUNK=64, RC=16, num_warps=8)
        return sorted_pairs, block_expert, total
    return _align_torch(topk_ids, num_experts, bm, max_padded)


def padded_capacity(n_pairs: int, num_experts: int, bm: int) -> int:
    """The most rows the aligned layout can need: every used expert's run padded by up to bm - 1, and at
    most min(E, pairs) experts used (M1 routes 8 pairs: 8 experts, not 128). SGLang sizes it by all E
    (`numel + E * (block - 1)`), which at M1 launches 121 M-blocks of which 8 have work (ncu: 93-97% of
    the GEMMs' programs exited at once; docs/BENCHMARKS.md)."""
    used = min(num_experts, n_pairs)
    return (n_pairs + used * (bm - 1) + bm - 1) // bm * bm


def _align_torch(topk_ids: torch.Tensor, num_experts: int, bm: int, max_padded: int):
    flat = topk_ids.reshape(-1).to(torch.int64)
    n_pairs = flat.numel()
    device = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + bm - 1) // bm * bm
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    start = torch.cumsum(counts, 0) - counts
    order = torch.sort(flat, stable=True).indices
    expert_of_sorted = flat[order]
    rank = torch.arange(n_pairs, device=device) - start[expert_of_sorted]
    dest = padded_start[expert_of_sorted] + rank
    sorted_pairs = torch.full((max_padded,), n_pairs, dtype=torch.int32, device=device)
    sorted_pairs.scatter_(0, dest, order.to(torch.int32))
    block_starts = torch.arange(0, max_padded, bm, device=device)
    block_expert = torch.searchsorted(padded_end, block_starts, right=True).to(torch.int32)
    return sorted_pairs, block_expert, padded_end[-1:].to(torch.int32)


@lru_cache(maxsize=None)
def _configs() -> dict[int, dict]:
    if not CONFIGS.is_file():
        return {}
    data = json.loads(CONFIGS.read_text())
    return {int(m): c for m, c in data.get("configs", {}).items()}


def config_for(m: int) -> dict:
    """The tuned block configuration for M tokens: the nearest token count tuned (SGLang's rule)."""
    table = _configs()
    if not table:
        return dict(DEFAULT_CONFIG)
    nearest = min(table, key=lambda k: (abs(k - m), k))
    return {**DEFAULT_CONFIG, **table[nearest]}


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


if triton is not None:

    @triton.jit
    def _to_bf16(v, BY_HAND: tl.constexpr):
        if BY_HAND:  # round to nearest even: the interpreter's cast truncates
            bits = v.to(tl.int32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
            return bits.to(tl.float32, bitcast=True).to(tl.bfloat16)
        return v.to(tl.bfloat16)

    @triton.jit
    def _align(ids_ptr, pairs_ptr, block_expert_ptr, total_ptr, n_pairs, max_padded, max_blocks,
               E: tl.constexpr, BM: tl.constexpr, NP: tl.constexpr, EB: tl.constexpr, CHUNK: tl.constexpr,
               RC: tl.constexpr):
        """One program: counts per expert, padded offsets, each pair's rank among the earlier pairs of its
        expert (stable, so the order is align_torch's), the sentinel fill, then the scatter. The pairs are
        taken RC at a time ([RC, NP] and [RC, EB] tiles): the whole [NP, NP] comparison at once spilled
        its registers (51 us at 256 pairs on the H200; docs/BENCHMARKS.md)."""
        i = tl.arange(0, NP)
        ids = tl.load(ids_ptr + i, mask=i < n_pairs, other=-1).to(tl.int32)  # lanes past the end: no expert
        e = tl.arange(0, EB)
        counts = tl.zeros([EB], tl.int32)
        for c in tl.static_range(0, NP, RC):
            rows = c + tl.arange(0, RC)
            ids_r = tl.load(ids_ptr + rows, mask=rows < n_pairs, other=-1).to(tl.int32)
            counts += tl.sum((ids_r[:, None] == e[None, :]).to(tl.int32), 0)
        padded = (counts + BM - 1) // BM * BM
        padded_end = tl.cumsum(padded, 0)
        padded_start = padded_end - padded
        total = tl.sum(padded, 0)
        for c in range(0, max_padded, CHUNK):
            at = c + tl.arange(0, CHUNK)
            tl.store(pairs_ptr + at, tl.full([CHUNK], 0, tl.int32) + n_pairs, mask=at < max_padded)
        tl.debug_barrier()  # the fill lands before the scatter overwrites it
        for c in tl.static_range(0, NP, RC):
            rows = c + tl.arange(0, RC)
            ids_r = tl.load(ids_ptr + rows, mask=rows < n_pairs, other=-1).to(tl.int32)
            same_before = (ids[None, :] == ids_r[:, None]) & (i[None, :] < rows[:, None])  # [RC(i), NP(j)]
            rank = tl.sum(same_before.to(tl.int32), 1)
            start_of = tl.sum(tl.where(ids_r[:, None] == e[None, :], padded_start[None, :], 0), 1)  # [RC]
            tl.store(pairs_ptr + start_of + rank, rows, mask=rows < n_pairs)
        for c in range(0, max_blocks, CHUNK):
            blk = c + tl.arange(0, CHUNK)
            ended = (padded_end[None, :] <= (blk * BM)[:, None]) & (e[None, :] < E)  # [CHUNK, EB]
            tl.store(block_expert_ptr + blk, tl.sum(ended.to(tl.int32), 1), mask=blk < max_blocks)
        tl.store(total_ptr, total)

    @triton.jit
    def _sum_topk(pair_ptr, res_ptr, out_ptr, H, split_stride, TOPK: tl.constexpr, SPLIT: tl.constexpr,
                  HAS_RES: tl.constexpr, BLOCK: tl.constexpr, BY_HAND: tl.constexpr):
        """out[m] = (residual[m] +) the sum over k (and over the down GEMM's K splits) of pair_out[s, m, k]:
        fp32 sum, one bf16 rounding."""
        m = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < H
        acc = tl.zeros([BLOCK], tl.float32)
        for sp in tl.static_range(SPLIT):
            for k in tl.static_range(TOPK):
                acc += tl.load(pair_ptr + sp * split_stride + (m * TOPK + k) * H + cols, mask=ok,
                               other=0.0).to(tl.float32)
        if HAS_RES:
            acc += tl.load(res_ptr + m * H + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + m * H + cols, _to_bf16(acc, BY_HAND), mask=ok)

    @triton.jit
    def _silu_mul(part_ptr, act_ptr, I, split_stride, SPLIT: tl.constexpr, BLOCK: tl.constexpr,
                  BY_HAND: tl.constexpr):
        """With the gate/up GEMM split along K: act[pair] = silu(sum of the gate parts) * sum of the up parts."""
        pair = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < I
        g = tl.zeros([BLOCK], tl.float32)
        u = tl.zeros([BLOCK], tl.float32)
        for sp in tl.static_range(SPLIT):
            row = part_ptr + sp * split_stride + pair * (2 * I)
            g += tl.load(row + cols, mask=ok, other=0.0)
            u += tl.load(row + I + cols, mask=ok, other=0.0)
        tl.store(act_ptr + pair * I + cols, _to_bf16(g / (1.0 + tl.exp(-g)) * u, BY_HAND), mask=ok)

    # Four bytes of nibbles in one 32-bit word -> eight bf16 128 + n, two per 32-bit register: two byte
    # permutes place bytes (0, 1) and (2, 3) in the two halves of a word, one lop3 each keeps a nibble and
    # ors in the bf16 pattern of 128 (0x4300), a shift brings the high nibbles down: 8 instructions for 8
    # weights (the trick of Marlin and FasterTransformer, written here) against ~3 per weight element by
    # element. Element j of the pack is byte j of $4 and half j % 2 of output register j // 2, so the
    # functions are elementwise (lo[j], hi[j] of byte j) whatever elements Triton packs together.

    @triton.jit
    def _nibbles_packed(packed):
        """(lo, hi) bf16 128 + the low / high nibble of each byte of the uint8 tile `packed` (GPU only)."""
        return tl.inline_asm_elementwise(
            """{
            .reg .b32 t0, t1;
            prmt.b32 t0, $4, 0, 0x4140;
            prmt.b32 t1, $4, 0, 0x4342;
            lop3.b32 $0, t0, 0x000F000F, 0x43004300, 0xEA;
            lop3.b32 $1, t1, 0x000F000F, 0x43004300, 0xEA;
            shr.u32 t0, t0, 4;
            shr.u32 t1, t1, 4;
            lop3.b32 $2, t0, 0x000F000F, 0x43004300, 0xEA;
            lop3.b32 $3, t1, 0x000F000F, 0x43004300, 0xEA;
            }""",
            "=r,=r,=r,=r,r", [packed], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)

    @triton.jit
    def _nibbles_scaled(packed, scale):
        """(lo, hi) bf16 (n - 8) * scale rounded once, of each byte's low / high nibble, `scale` bf16 of
        packed's shape: the packed unpacking, then two bf16x2 fma per two weights (128 + n - 136 is exact;
        (n - 8) * s + -0 is the product rounded once, as the scale-before scheme's f32 path gives)."""
        return tl.inline_asm_elementwise(
            """{
            .reg .b32 t0, t1, l0, l1, h0, h1, one, off, nz;
            mov.b32 one, 0x3F803F80;
            mov.b32 off, 0xC308C308;
            mov.b32 nz, 0x80008000;
            prmt.b32 t0, $4, 0, 0x4140;
            prmt.b32 t1, $4, 0, 0x4342;
            lop3.b32 l0, t0, 0x000F000F, 0x43004300, 0xEA;
            lop3.b32 l1, t1, 0x000F000F, 0x43004300, 0xEA;
            shr.u32 t0, t0, 4;
            shr.u32 t1, t1, 4;
            lop3.b32 h0, t0, 0x000F000F, 0x43004300, 0xEA;
            lop3.b32 h1, t1, 0x000F000F, 0x43004300, 0xEA;
            fma.rn.bf16x2 l0, l0, one, off;
            fma.rn.bf16x2 l1, l1, one, off;
            fma.rn.bf16x2 h0, h0, one, off;
            fma.rn.bf16x2 h1, h1, one, off;
            fma.rn.bf16x2 $0, l0, $5, nz;
            fma.rn.bf16x2 $1, l1, $6, nz;
            fma.rn.bf16x2 $2, h0, $5, nz;
            fma.rn.bf16x2 $3, h1, $6, nz;
            }""",
            "=r,=r,=r,=r,r,r,r", [packed, scale], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)

    @triton.jit
    def _group_step(acc, a, packed, scale, SCHEME: tl.constexpr, DEQ: tl.constexpr, F32: tl.constexpr):
        """acc [BM, BN] fp32 plus a [BM, GROUP] (bf16) times the int4 tile `packed` [BN, GROUP // 2] (two
        nibbles a byte, the low one first along K) of one quantisation group, `scale` [BN] its scales.

        SCHEME 0: the centred codes q are exact in bf16, so one dot per group gives the exact partial
        product, scaled in fp32 afterwards (exact weights). SCHEME 1: q * scale rounded to bf16 first, as
        SGLang's kernel does, so every group's dot accumulates in place (one accumulator chain).
        DEQ 0: the nibbles converted int -> float. DEQ 1: no conversion instruction (they are a quarter-
        rate pipe on the GPU): a nibble n or'ed into the bf16 pattern 0x4300 is the number 128 + n, so the
        codes are offset by 136 and (SCHEME 0) 136 * sum(a) is taken off the group's dot. DEQ 2: the same
        numbers, four bytes per 32-bit word in inline PTX (_nibbles_packed), and with SCHEME 1 the offset
        and the scale applied two weights per bf16x2 fma (_nibbles_scaled): what ncu found binding M16,
        the unpacking's instructions per weight, cut ~3x. Not in the interpreter (no PTX there)."""
        lo = packed & 0xF
        hi = packed >> 4
        if F32:  # the interpreter: float32 dots, the bf16 roundings by hand
            q = tl.interleave(lo.to(tl.int32) - 8, hi.to(tl.int32) - 8).to(tl.float32)
            if SCHEME == 0:
                return acc + tl.dot(a.to(tl.float32), tl.trans(q)) * scale[None, :]
            w = _to_bf16(q * scale[:, None], True).to(tl.float32)
            return tl.dot(a.to(tl.float32), tl.trans(w), acc)
        if DEQ == 2:
            if SCHEME == 0:
                lo, hi = _nibbles_packed(packed)
                q = tl.interleave(lo, hi)
                raw = tl.dot(a, tl.trans(q)) - 136.0 * tl.sum(a.to(tl.float32), 1)[:, None]
                return acc + raw * scale[None, :]
            lo, hi = _nibbles_scaled(packed, tl.broadcast_to(scale.to(tl.bfloat16)[:, None], packed.shape))
            return tl.dot(a, tl.trans(tl.interleave(lo, hi)), acc)
        if DEQ == 1:
            q = tl.interleave((lo.to(tl.int16) | 0x4300).to(tl.bfloat16, bitcast=True),
                              (hi.to(tl.int16) | 0x4300).to(tl.bfloat16, bitcast=True))
            if SCHEME == 0:
                raw = tl.dot(a, tl.trans(q)) - 136.0 * tl.sum(a.to(tl.float32), 1)[:, None]
                return acc + raw * scale[None, :]
            w = ((q.to(tl.float32) - 136.0) * scale[:, None]).to(tl.bfloat16)
            return tl.dot(a, tl.trans(w), acc)
        q = tl.interleave(lo.to(tl.int32) - 8, hi.to(tl.int32) - 8)
        if SCHEME == 0:
            return acc + tl.dot(a, tl.trans(q.to(tl.bfloat16))) * scale[None, :]
        w = (q.to(tl.float32) * scale[:, None]).to(tl.bfloat16)
        return tl.dot(a, tl.trans(w), acc)

    @triton.jit
    def _gate_up(x_ptr, w_ptr, s_ptr, pairs_ptr, block_expert_ptr, total_ptr, act_ptr,
                 n_pairs, H, I, G, TOPK: tl.constexpr, E: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                 GROUP: tl.constexpr, SCHEME: tl.constexpr, DEQ: tl.constexpr, SPLIT: tl.constexpr,
                 F32: tl.constexpr):
        """One block of BM pairs (one expert) by BN intermediate columns, over the K split program_id(2)
        of SPLIT: with SPLIT 1 silu(gate) * up in bf16 into act [pair, I]; else the fp32 gate and up
        parts into act [split, pair, 2I] for _silu_mul."""
        b = tl.program_id(0)
        if b * BM >= tl.load(total_ptr):
            return
        e = tl.load(block_expert_ptr + b).to(tl.int64)
        rows = b * BM + tl.arange(0, BM)
        pair = tl.load(pairs_ptr + rows)
        valid = pair < n_pairs
        tok = tl.where(valid, pair // TOPK, 0).to(tl.int64)
        rn = tl.program_id(1) * BN + tl.arange(0, BN)
        nmask = rn < I
        half = tl.arange(0, GROUP // 2)
        rk = tl.arange(0, GROUP)
        w_e = w_ptr + e * (2 * I) * (H // 2)
        s_e = s_ptr + e * (2 * I) * G
        acc_g = tl.zeros((BM, BN), dtype=tl.float32)
        acc_u = tl.zeros((BM, BN), dtype=tl.float32)
        sp = tl.program_id(2)
        for g in range(sp * (G // SPLIT), (sp + 1) * (G // SPLIT)):
            a = tl.load(x_ptr + tok[:, None] * H + (g * GROUP + rk)[None, :], mask=valid[:, None], other=0.0)
            bytes_at = (g * (GROUP // 2) + half)[None, :]
            pg = tl.load(w_e + rn[:, None] * (H // 2) + bytes_at, mask=nmask[:, None], other=0x88)
            pu = tl.load(w_e + (rn + I)[:, None] * (H // 2) + bytes_at, mask=nmask[:, None], other=0x88)
            sg = tl.load(s_e + rn * G + g, mask=nmask, other=0.0).to(tl.float32)
            su = tl.load(s_e + (rn + I) * G + g, mask=nmask, other=0.0).to(tl.float32)
            acc_g = _group_step(acc_g, a, pg, sg, SCHEME, DEQ, F32)
            acc_u = _group_step(acc_u, a, pu, su, SCHEME, DEQ, F32)
        at = pair[:, None].to(tl.int64)
        keep = valid[:, None] & nmask[None, :]
        if SPLIT == 1:
            act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
            tl.store(act_ptr + at * I + rn[None, :], _to_bf16(act, F32), mask=keep)
        else:
            part = act_ptr + sp.to(tl.int64) * n_pairs * (2 * I) + at * (2 * I) + rn[None, :]
            tl.store(part, acc_g, mask=keep)
            tl.store(part + I, acc_u, mask=keep)

    @triton.jit
    def _down(act_ptr, w_ptr, s_ptr, pairs_ptr, block_expert_ptr, total_ptr, tw_ptr, out_ptr,
              n_pairs, H, I, G, E: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, GROUP: tl.constexpr,
              SCHEME: tl.constexpr, DEQ: tl.constexpr, SPLIT: tl.constexpr, F32: tl.constexpr):
        """One block of BM pairs by BN output columns over the K split program_id(2) of SPLIT: each pair's
        weighted row (part) into out [split, pair, H], summed by _sum_topk."""
        b = tl.program_id(0)
        if b * BM >= tl.load(total_ptr):
            return
        e = tl.load(block_expert_ptr + b).to(tl.int64)
        rows = b * BM + tl.arange(0, BM)
        pair = tl.load(pairs_ptr + rows)
        valid = pair < n_pairs
        rn = tl.program_id(1) * BN + tl.arange(0, BN)
        nmask = rn < H
        half = tl.arange(0, GROUP // 2)
        rk = tl.arange(0, GROUP)
        w_e = w_ptr + e * H * (I // 2)
        s_e = s_ptr + e * H * G
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        at = pair[:, None].to(tl.int64)
        sp = tl.program_id(2)
        for g in range(sp * (G // SPLIT), (sp + 1) * (G // SPLIT)):
            a = tl.load(act_ptr + at * I + (g * GROUP + rk)[None, :], mask=valid[:, None], other=0.0)
            p = tl.load(w_e + rn[:, None] * (I // 2) + (g * (GROUP // 2) + half)[None, :], mask=nmask[:, None],
                        other=0x88)
            s = tl.load(s_e + rn * G + g, mask=nmask, other=0.0).to(tl.float32)
            acc = _group_step(acc, a, p, s, SCHEME, DEQ, F32)
        wt = tl.load(tw_ptr + pair, mask=valid, other=0.0)
        row = out_ptr + sp.to(tl.int64) * n_pairs * H + at * H + rn[None, :]
        if SPLIT == 1:
            tl.store(row, _to_bf16(acc * wt[:, None], F32), mask=valid[:, None] & nmask[None, :])
        else:
            tl.store(row, acc * wt[:, None], mask=valid[:, None] & nmask[None, :])


def fused_moe(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, config: dict | None = None,
              residual: torch.Tensor | None = None) -> torch.Tensor:
    """bf16 [M, H]: the routed experts of muse_moe_w4a16 (layouts in its README), CUDA-graph capturable.
    With `residual` [M, H], residual + experts, added in fp32 before the one rounding (the layers' h + MoE,
    as SGLang folds the residual add into its last kernel)."""
    if triton is None:
        raise RuntimeError("the fused MoE needs Triton")
    M, H = x.shape
    E, topk = w13.shape[0], topk_ids.shape[1]
    I = w2.shape[-1] * 2
    group = H // w13_scale.shape[-1]
    if I // w2_scale.shape[-1] != group:
        raise ValueError("w13 and w2 must share one quantisation group size")
    cfg = config or config_for(M)
    bm, bn = int(cfg["BM"]), int(cfg["BN"])
    kinds = {"SCHEME": int(cfg["SCHEME"]), "DEQ": int(cfg["DEQ"])}
    f32 = _interpreting()
    launch = {} if f32 else {"num_warps": int(cfg["num_warps"]), "num_stages": int(cfg["num_stages"])}
    split_up, split_down = int(cfg.get("SPLIT_UP", 1)), int(cfg.get("SPLIT_DOWN", 1))
    for name, split, groups in (("SPLIT_UP", split_up, H // group), ("SPLIT_DOWN", split_down, I // group)):
        if split < 1 or groups % split:
            raise ValueError(f"{name} = {split} must divide the {groups} quantisation groups along K")
    n_pairs = M * topk
    pairs, block_expert, total = align_block_size(topk_ids, E, bm)
    n_blocks = block_expert.numel()
    block = 1024
    act = torch.empty(n_pairs, I, dtype=torch.bfloat16, device=x.device)
    parts = act if split_up == 1 else torch.empty(split_up, n_pairs, 2 * I, dtype=torch.float32, device=x.device)
    _gate_up[(n_blocks, triton.cdiv(I, bn), split_up)](
        x, w13, w13_scale, pairs, block_expert, total, parts, n_pairs, H, I, H // group,
        TOPK=topk, E=E, BM=bm, BN=bn, GROUP=group, SPLIT=split_up, F32=f32, **kinds, **launch)
    if split_up > 1:
        _silu_mul[(n_pairs, triton.cdiv(I, block))](parts, act, I, n_pairs * 2 * I, SPLIT=split_up, BLOCK=block,
                                                     BY_HAND=f32)
    pair_out = torch.empty(split_down, n_pairs, H, device=x.device,
                           dtype=torch.bfloat16 if split_down == 1 else torch.float32)
    _down[(n_blocks, triton.cdiv(H, bn), split_down)](
        act, w2, w2_scale, pairs, block_expert, total, topk_weights.reshape(-1), pair_out, n_pairs, H, I,
        I // group, E=E, BM=bm, BN=bn, GROUP=group, SPLIT=split_down, F32=f32, **kinds, **launch)
    out = torch.empty(M, H, dtype=torch.bfloat16, device=x.device)
    _sum_topk[(M, triton.cdiv(H, block))](
        pair_out, residual if residual is not None else out, out, H, n_pairs * H, TOPK=topk, SPLIT=split_down,
        HAS_RES=residual is not None, BLOCK=block, BY_HAND=f32)
    return out
