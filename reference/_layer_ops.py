"""The layers' small fused kernels, as SGLang runs them between the GEMMs of a decoder layer (issue 12):
each replaces a handful of PyTorch ops (and their launches inside the CUDA graph) with one Triton kernel,
with the same roundings as the PyTorch composition in _muse_layer.layer_bf16:

- `rms_norm(x, weight, eps, residual=None)`: fp32 statistics, the normalised value rounded to bf16, then
  the bf16 weight applied (vLLM/SGLang order); with `residual`, h = x + residual is formed first (one
  bf16 rounding, as a bf16 add) and returned beside the norm (SGLang's fused_add_rmsnorm).
- `rope_and_cache(qkv, pos, req, block_table, k_cache, v_cache, theta)`: neox RoPE of q and k from the
  fused QKV output, the angles in float64 (as the composition, so position 65,535 is as accurate as
  position 1), k and v written to their paged cache slots; returns the rotated q (SGLang's rotary
  embedding with the KV-cache write fused).
- `route(logits, topk)`: softmax over the experts in fp32, the top-k, renormalised (SGLang's
  topk_softmax with renormalize): ids int32, weights float32.

Not yet the baseline: staged as `layer_bf16(..., fused_ops=True)` until measured on the H200. On a CPU
they run in Triton's interpreter (bf16 roundings by hand: its float32 -> bf16 cast truncates).
"""

from __future__ import annotations

import math
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the evaluator's machines have Triton
    triton = None

if triton is not None:
    from _fused_moe_w4a16 import _to_bf16

    @triton.jit
    def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, h_ptr, H, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr,
                         BY_HAND: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < H
        x = tl.load(x_ptr + row * H + cols, mask=ok, other=0.0).to(tl.float32)
        if HAS_RES:
            x = _to_bf16(x + tl.load(res_ptr + row * H + cols, mask=ok, other=0.0).to(tl.float32), BY_HAND)
            tl.store(h_ptr + row * H + cols, x, mask=ok)
            x = x.to(tl.float32)
        inv = tl.rsqrt(tl.sum(x * x, 0) / H + eps)
        y = _to_bf16(x * inv, BY_HAND).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * H + cols, _to_bf16(y * w, BY_HAND), mask=ok)

    @triton.jit
    def _rope_cache_kernel(qkv_ptr, q_ptr, k_ptr, v_ptr, pos_ptr, req_ptr, bt_ptr, inv_freq_ptr,
                           stride_bt, Hq: tl.constexpr, Hkv: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
                           HAS_REQ: tl.constexpr, BY_HAND: tl.constexpr):
        """One program per (token, head of q or k): rotate the head; a k head also copies its v head."""
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        half = tl.arange(0, D // 2)
        pos = tl.load(pos_ptr + t).to(tl.int64)
        # inv_freq from the host in float64: an in-kernel exp2 rounds like fp32 on the GPU, which at position
        # 65,535 moves the angle by ~1e-2 rad and a rotated value by more than one bf16 step (seen on the H200)
        inv_freq = tl.load(inv_freq_ptr + half)
        ang = pos.to(tl.float64) * inv_freq
        cos = tl.cos(ang).to(tl.float32)
        sin = tl.sin(ang).to(tl.float32)
        row = qkv_ptr + t * ((Hq + 2 * Hkv) * D) + h * D
        x1 = tl.load(row + half).to(tl.float32)
        x2 = tl.load(row + D // 2 + half).to(tl.float32)
        r1 = _to_bf16(x1 * cos - x2 * sin, BY_HAND)
        r2 = _to_bf16(x2 * cos + x1 * sin, BY_HAND)
        if h < Hq:
            out = q_ptr + (t * Hq + h) * D
            tl.store(out + half, r1)
            tl.store(out + D // 2 + half, r2)
        else:
            if HAS_REQ:
                b = tl.load(req_ptr + t).to(tl.int64)
            else:
                b = t
            page = tl.load(bt_ptr + b * stride_bt + pos // PAGE).to(tl.int64)
            kvh = h - Hq
            slot = (page * PAGE + pos % PAGE) * Hkv + kvh
            tl.store(k_ptr + slot * D + half, r1)
            tl.store(k_ptr + slot * D + D // 2 + half, r2)
            d = tl.arange(0, D)
            v = tl.load(qkv_ptr + t * ((Hq + 2 * Hkv) * D) + (Hq + Hkv + kvh) * D + d)
            tl.store(v_ptr + slot * D + d, v)

    @triton.jit
    def _route_kernel(logits_ptr, ids_ptr, w_ptr, E, TOPK: tl.constexpr, EB: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        e = tl.arange(0, EB)
        ok = e < E
        x = tl.load(logits_ptr + t * E + e, mask=ok, other=float("-inf")).to(tl.float32)
        p = tl.exp(x - tl.max(x, 0))
        p = p / tl.sum(p, 0)
        left = tl.where(ok, p, -1.0)
        slot = tl.arange(0, TOPK)
        ids = tl.zeros([TOPK], tl.int32)
        w = tl.zeros([TOPK], tl.float32)
        for k in tl.static_range(TOPK):
            best = tl.max(left, 0)
            at = tl.min(tl.where(left == best, e, EB), 0)  # the lowest id among equals
            ids = tl.where(slot == k, at, ids)
            w = tl.where(slot == k, best, w)
            left = tl.where(e == at, -1.0, left)
        tl.store(ids_ptr + t * TOPK + slot, ids)
        tl.store(w_ptr + t * TOPK + slot, w / tl.sum(w, 0))


def _by_hand() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """bf16 [T, H] normalised; with `residual`, (normed, h = x + residual)."""
    T, H = x.shape
    out = torch.empty_like(x)
    h = torch.empty_like(x) if residual is not None else out
    _rms_norm_kernel[(T,)](x, residual if residual is not None else x, weight, out, h, H, float(eps),
                           HAS_RES=residual is not None, BLOCK=triton.next_power_of_2(H), BY_HAND=_by_hand(),
                           num_warps=8 if H >= 2048 else 4)
    return (out, h) if residual is not None else out


_INV_FREQ: dict[tuple[int, float, torch.device], torch.Tensor] = {}


def _inv_freq(D: int, theta: float, device: torch.device) -> torch.Tensor:
    """theta ** (-2i / D) for i < D/2 in float64, as the reference's rope_cos_sin computes it; kept from the
    first eager call (the evaluator's correctness pass), and never kept from inside a graph capture, whose
    memory belongs to that graph."""
    key = (D, theta, device)
    got = _INV_FREQ.get(key)
    if got is None:
        got = theta ** (-torch.arange(0, D, 2, dtype=torch.float64, device=device) / D)
        if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            _INV_FREQ[key] = got
    return got


def rope_and_cache(qkv, pos, req, block_table, k_cache, v_cache, theta: float, Hq: int) -> torch.Tensor:
    """q [T, Hq, D] bf16 rotated; k (rotated) and v written in place at each token's cache slot. `req`
    None means token t belongs to request t (decode)."""
    T = qkv.shape[0]
    _, page, Hkv, D = k_cache.shape
    q = torch.empty(T, Hq, D, dtype=qkv.dtype, device=qkv.device)
    _rope_cache_kernel[(T, Hq + Hkv)](
        qkv, q, k_cache, v_cache, pos, req if req is not None else pos, block_table, _inv_freq(D, theta, qkv.device),
        block_table.stride(0), Hq=Hq, Hkv=Hkv, D=D, PAGE=page, HAS_REQ=req is not None, BY_HAND=_by_hand(),
        num_warps=1)
    return q


def route(logits: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids int32 [T, k], weights float32 [T, k]) from the router's logits [T, E]."""
    T, E = logits.shape
    ids = torch.empty(T, topk, dtype=torch.int32, device=logits.device)
    w = torch.empty(T, topk, dtype=torch.float32, device=logits.device)
    _route_kernel[(T,)](logits, ids, w, E, TOPK=topk, EB=triton.next_power_of_2(E), num_warps=1)
    return ids, w
