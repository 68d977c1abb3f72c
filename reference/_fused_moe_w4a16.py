"""The fused W4A16 MoE path SGLang takes on an H200, written for this repository (issue 12): the
baseline-to-be of muse_moe_w4a16 and of the layers' experts. Not the default baseline until it has been
tuned and measured on the H200 (docs/BENCHMARKS.md): `baseline_fused` in muse_moe_w4a16.py.

1. `align_block_size`: the M*topk (token, expert) pairs sorted by expert, each expert's run padded to a
   multiple of the block size BM with a sentinel, and the expert of each block of BM rows, all on the
   device with fixed-size tensors (no host synchronisation: CUDA-graph capturable). The grid covers the
   worst case (every expert's run padded), and blocks past the real end exit at once.
2. `_gate_up`: per block of BM pairs (one expert) and BN columns of the intermediate, the gate and the
   up GEMMs over K = H in steps of one quantisation group: the int4 nibbles unpacked and centred in the
   kernel (exact in bf16), one bf16 tensor-core dot per group, the group's scale applied to the fp32
   partial product; silu(gate) * up fused, stored in bf16.
3. `_down`: the w2 GEMM of each block over K = I the same way, each pair's top-k weight applied, one
   row per pair; the sum over top-k is one reduction afterwards (deterministic, as SGLang's moe_sum).
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

CONFIGS = Path(__file__).resolve().parent / "configs" / "fused_moe_w4a16.json"
DEFAULT_CONFIG = {"BM": 16, "BN": 64, "num_warps": 4, "num_stages": 3}


def align_block_size(topk_ids: torch.Tensor, num_experts: int, bm: int):
    """(sorted_pairs [max_padded] int32, block_expert [max_blocks] int32, padded_total [1] int32): the
    pairs (indices into topk_ids.flatten()) grouped by expert in expert order, each group padded to a
    multiple of `bm` with the sentinel M*topk; block b's expert, or `num_experts` past the end."""
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
    max_padded = n_pairs + num_experts * (bm - 1)
    max_padded = (max_padded + bm - 1) // bm * bm
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
    def _group_dot(a, packed, F32: tl.constexpr):
        """a [BM, GROUP] bf16 times the int4 tile `packed` [BN, GROUP // 2] (two nibbles a byte, the low
        one first along K), centred: [BM, BN] float32, not yet scaled."""
        lo = (packed & 0xF).to(tl.int32) - 8
        hi = ((packed >> 4) & 0xF).to(tl.int32) - 8
        q = tl.interleave(lo, hi)  # [BN, GROUP]: even k from the low nibbles, odd k from the high ones
        if F32:
            return tl.dot(a.to(tl.float32), tl.trans(q.to(tl.float32)))
        return tl.dot(a, tl.trans(q.to(tl.bfloat16)))

    @triton.jit
    def _gate_up(x_ptr, w_ptr, s_ptr, pairs_ptr, block_expert_ptr, total_ptr, act_ptr,
                 n_pairs, H, I, G, TOPK: tl.constexpr, E: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, GROUP: tl.constexpr, F32: tl.constexpr):
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
        for g in range(0, G):
            a = tl.load(x_ptr + tok[:, None] * H + (g * GROUP + rk)[None, :], mask=valid[:, None], other=0.0)
            bytes_at = (g * (GROUP // 2) + half)[None, :]
            pg = tl.load(w_e + rn[:, None] * (H // 2) + bytes_at, mask=nmask[:, None], other=0x88)
            pu = tl.load(w_e + (rn + I)[:, None] * (H // 2) + bytes_at, mask=nmask[:, None], other=0x88)
            sg = tl.load(s_e + rn * G + g, mask=nmask, other=0.0).to(tl.float32)
            su = tl.load(s_e + (rn + I) * G + g, mask=nmask, other=0.0).to(tl.float32)
            acc_g += _group_dot(a, pg, F32) * sg[None, :]
            acc_u += _group_dot(a, pu, F32) * su[None, :]
        act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
        tl.store(act_ptr + rows[:, None].to(tl.int64) * I + rn[None, :], _to_bf16(act, F32), mask=nmask[None, :])

    @triton.jit
    def _down(act_ptr, w_ptr, s_ptr, pairs_ptr, block_expert_ptr, total_ptr, tw_ptr, out_ptr,
              n_pairs, H, I, G, E: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, GROUP: tl.constexpr,
              F32: tl.constexpr):
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
        for g in range(0, G):
            a = tl.load(act_ptr + rows[:, None].to(tl.int64) * I + (g * GROUP + rk)[None, :])
            p = tl.load(w_e + rn[:, None] * (I // 2) + (g * (GROUP // 2) + half)[None, :], mask=nmask[:, None],
                        other=0x88)
            s = tl.load(s_e + rn * G + g, mask=nmask, other=0.0).to(tl.float32)
            acc += _group_dot(a, p, F32) * s[None, :]
        wt = tl.load(tw_ptr + pair, mask=valid, other=0.0)
        tl.store(out_ptr + pair[:, None].to(tl.int64) * H + rn[None, :], acc * wt[:, None],
                 mask=valid[:, None] & nmask[None, :])


def fused_moe(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, config: dict | None = None) -> torch.Tensor:
    """bf16 [M, H]: the routed experts of muse_moe_w4a16 (layouts in its README), CUDA-graph capturable."""
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
    f32 = _interpreting()
    launch = {} if f32 else {"num_warps": int(cfg["num_warps"]), "num_stages": int(cfg["num_stages"])}
    pairs, block_expert, total = align_block_size(topk_ids, E, bm)
    n_blocks = block_expert.numel()
    act = torch.empty(pairs.numel(), I, dtype=torch.bfloat16, device=x.device)
    _gate_up[(n_blocks, triton.cdiv(I, bn))](
        x, w13, w13_scale, pairs, block_expert, total, act, M * topk, H, I, H // group,
        TOPK=topk, E=E, BM=bm, BN=bn, GROUP=group, F32=f32, **launch)
    pair_out = torch.empty(M * topk, H, dtype=torch.float32, device=x.device)
    _down[(n_blocks, triton.cdiv(H, bn))](
        act, w2, w2_scale, pairs, block_expert, total, topk_weights.reshape(-1), pair_out, M * topk, H, I,
        I // group, E=E, BM=bm, BN=bn, GROUP=group, F32=f32, **launch)
    return pair_out.view(M, topk, H).sum(1).to(torch.bfloat16)
