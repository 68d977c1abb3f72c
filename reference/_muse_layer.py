"""Shared code of the two whole-layer problems, muse_decode_layer and muse_prefill_layer.

One decoder layer of the model, for T new tokens of B requests (decode: one token per request; prefill /
extend: a ragged run of tokens per request):

    h   = x + wo @ attention(RoPE(q), cache + RoPE(k), cache + v)      q, k, v = wqkv @ RMSNorm(x, attn_norm)
    out = h + MoE_W4A16(RMSNorm(h, ffn_norm), top-k of softmax(router @ RMSNorm(h, ffn_norm)), renormalised)

with the new tokens' K and V written into the paged cache (in place) before attention reads it. Both
problems describe their tokens the same way: token t belongs to request `req[t]` and sits at position
`pos[t]` of that request; its K/V slot is page `block_table[req, pos // page]`, row `pos % page`.

Contents:
- the model's weights and the planted routing (`make_layer_inputs`),
- the float64/float32 reference of the layer (`layer_reference`),
- the bf16 production-style composition used as the baseline (`layer_bf16`),
- the analytic floor (`layer_floor`) and the written-slot mask (`written_mask`),
- attention over the paged cache: float32 reference (`extend_attention_ref`), per-request SDPA
  (`extend_attention_bf16`, the CPU baseline) and a Triton kernel (`extend_attention_triton`, the GPU
  prefill baseline; CUDA-graph capturable).

Routing robustness. A correct bf16 engine and the float64 reference compute slightly different router
logits; with random weights, two logits near the k-th place would swap often enough to fail the
hidden-state check (one swapped expert changes a token's MoE output by ~1/topk of its norm). So the
inputs are built with a planted routing: every token's hidden state carries a component b*c along
`topk` orthonormal directions u_e of the router (the experts it should pick, drawn with Zipf-skewed
popularity), the router is a*u_e plus noise, the rest of x is orthogonal to every u_e, and `wo` writes
nothing along them. The chosen experts' logits then sit near A (see `_logit_target`; divided by the
token's RMS, and spread by c in [0.75, 1.25]), the others near 0: a margin between the k-th and
(k+1)-th logit of 1 to 2 typically and above 0.3 at worst (tests/test_reference_layers.py), against bf16
errors of ~0.02, while the experts left out still hold 10-40% of the softmax mass (so top-k weights that
are not renormalised are visibly wrong). The reference itself computes the routing from its own logits.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:  # the evaluator's child loads this file by path, without reference/ on sys.path
    sys.path.insert(0, _HERE)

import muse_moe_w4a16 as moe_w4a16  # noqa: E402
from muse_moe_w4a16 import (  # noqa: E402
    DEFAULT_ALPHA,
    expected_active_experts,
    make_moe_weights,
    moe_ref,
    zipf_topk,
)

WEIGHT_KEYS = ("attn_norm", "wqkv", "wo", "ffn_norm", "router", "w13", "w13_scale", "w2", "w2_scale")
MOE_KEYS = ("w13", "w13_scale", "w2", "w2_scale")

# Input construction (see the module docstring).
Q_GAIN = 2.0  # query rows of wqkv ~ N(0, Q_GAIN^2/H): attention logits ~ N(0, Q_GAIN^2), a peaked softmax
WO_GAIN = 1.0  # wo ~ N(0, WO_GAIN^2/(Hq*D)): the attention branch is a visible part of h
PLANT = 4.0  # b: x's component along each of its experts' directions (x's other components ~ N(0, 1))
# The experts' w2 rows ~ N(0, MOE_W2_GAIN^2/I) (muse_moe_w4a16's scales rescaled): the MoE branch is about
# 0.3-0.4 of the hidden state's norm, like the attention branch.
MOE_W2_GAIN = 0.75
ROUTER_NOISE = 0.2  # standard deviation of the router logits' random part
_OUT_MASS = 0.2  # target softmax mass of the experts left out of the top-k


def _logit_target(E: int, topk: int) -> float:
    """A: the chosen experts' mean logit, so that the other E - topk hold about _OUT_MASS of the softmax."""
    return math.log((1.0 - _OUT_MASS) / _OUT_MASS * (E - topk) / topk)


# ---------------------------------------------------------------------------------------------------
# Small pieces (float64 reference versions and bf16 production versions)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xd = x.double()
    return xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


def rms_norm_bf16(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """fp32 math, normalised value rounded to bf16 and then scaled by the bf16 weight (vLLM/SGLang order)."""
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return y * weight


def rope_cos_sin(pos: torch.Tensor, D: int, theta: float, dtype=torch.float64):
    """cos, sin [T, D/2] of the neox-style rotary embedding at integer positions `pos` [T]."""
    inv_freq = theta ** (-torch.arange(0, D, 2, device=pos.device, dtype=torch.float64) / D)
    ang = pos.to(torch.float64)[:, None] * inv_freq[None, :]
    return ang.cos().to(dtype), ang.sin().to(dtype)


def rope_neox(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [T, heads, D] by (cos, sin) [T, D/2]: pairs (i, i + D/2), the neox / Llama layout."""
    half = t.shape[-1] // 2
    t1, t2 = t[..., :half], t[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((t1 * c - t2 * s, t2 * c + t1 * s), dim=-1)


def route(logits: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax over all experts, top-k, renormalised: (ids int32 [T, k], weights float32 [T, k])."""
    probs = torch.softmax(logits, dim=-1)
    w, ids = probs.topk(topk, dim=-1)
    w = w / w.sum(-1, keepdim=True)
    return ids.to(torch.int32), w.float()


def cache_slots(block_table: torch.Tensor, req: torch.Tensor, pos: torch.Tensor, page: int) -> torch.Tensor:
    """Flat row index (into cache.view(-1, Hkv, D)) of each token's K/V slot."""
    req, pos = req.long(), pos.long()
    return block_table.long()[req, pos // page] * page + pos % page


def dims(inputs: dict) -> dict:
    x, kc = inputs["x"], inputs["k_cache"]
    _, page, Hkv, D = kc.shape
    return {"T": x.shape[0], "H": x.shape[1], "page": page, "Hkv": Hkv, "D": D, "Hq": inputs["wo"].shape[1] // D}


# ---------------------------------------------------------------------------------------------------
# Attention over the paged cache, per request (tokens of a request are contiguous in x)


def extend_attention_ref(q, k_cache, v_cache, block_table, starts, prefix, new, scale,
                         budget: int = 1 << 27) -> torch.Tensor:
    """Causal attention of each request's new tokens over its prefix plus its new tokens (float32).

    q [T, Hq, D] (any float dtype); the cache must already hold the new tokens' K/V. starts/prefix/new:
    python lists per request. Chunked over queries so no score block exceeds `budget` elements.
    """
    T, Hq, D = q.shape
    _, page, Hkv, _ = k_cache.shape
    g = Hq // Hkv
    out = torch.empty(T, Hq, D, dtype=torch.float32, device=q.device)
    for b, (s0, P, n) in enumerate(zip(starts, prefix, new)):
        if n == 0:
            continue
        L = P + n
        pages = block_table[b, : (L + page - 1) // page].long()
        K = k_cache[pages].reshape(-1, Hkv, D)[:L].float().permute(1, 0, 2)  # [Hkv, L, D]
        V = v_cache[pages].reshape(-1, Hkv, D)[:L].float().permute(1, 0, 2)
        qb = q[s0:s0 + n].float().reshape(n, Hkv, g, D)
        chunk = max(1, min(n, budget // max(1, Hq * L)))
        for c0 in range(0, n, chunk):
            c1 = min(n, c0 + chunk)
            Lc = P + c1  # keys visible to the chunk's last query
            qc = qb[c0:c1].permute(1, 2, 0, 3).reshape(Hkv, g * (c1 - c0), D)
            s = torch.bmm(qc, K[:, :Lc].transpose(1, 2)) * scale  # [Hkv, g*c, Lc]
            qpos = P + torch.arange(c0, c1, device=q.device)
            allowed = torch.arange(Lc, device=q.device)[None, :] <= qpos[:, None]  # [c, Lc]
            s = s.view(Hkv, g, c1 - c0, Lc).masked_fill_(~allowed, float("-inf"))
            p = torch.softmax(s, dim=-1).view(Hkv, g * (c1 - c0), Lc)
            o = torch.bmm(p, V[:, :Lc]).view(Hkv, g, c1 - c0, D)
            out[s0 + c0:s0 + c1] = o.permute(2, 0, 1, 3).reshape(c1 - c0, Hq, D)
    return out


def extend_attention_bf16(q, k_cache, v_cache, block_table, starts, prefix, new, scale) -> torch.Tensor:
    """Production-style: per request, gather the pages and run SDPA (bf16) with a bottom-right causal mask.

    GQA without repeating K/V: the g query heads of a KV head are stacked along the query axis.
    """
    T, Hq, D = q.shape
    _, page, Hkv, _ = k_cache.shape
    g = Hq // Hkv
    out = torch.empty(T, Hq, D, dtype=q.dtype, device=q.device)
    for b, (s0, P, n) in enumerate(zip(starts, prefix, new)):
        if n == 0:
            continue
        L = P + n
        pages = block_table[b, : (L + page - 1) // page].long()
        K = k_cache[pages].reshape(-1, Hkv, D)[:L].permute(1, 0, 2)  # [Hkv, L, D]
        V = v_cache[pages].reshape(-1, Hkv, D)[:L].permute(1, 0, 2)
        qb = q[s0:s0 + n].reshape(n, Hkv, g, D).permute(1, 2, 0, 3).reshape(Hkv, g * n, D)
        mask = None
        if n > 1:
            qpos = P + torch.arange(n, device=q.device)
            allowed = torch.arange(L, device=q.device)[None, :] <= qpos[:, None]  # [n, L]
            mask = allowed.repeat(g, 1)  # rows ordered (head-in-group, query)
        o = F.scaled_dot_product_attention(qb[None], K[None], V[None], attn_mask=mask, scale=scale)[0]
        out[s0:s0 + n] = o.view(Hkv, g, n, D).permute(2, 0, 1, 3).reshape(n, Hq, D)
    return out


def token_index(cu_seqlens: torch.Tensor, prefix_lens: torch.Tensor, T: int):
    """(req, pos) of each of the T new tokens, computed on the device (no host synchronisation)."""
    t = torch.arange(T, device=cu_seqlens.device)
    req = torch.searchsorted(cu_seqlens[1:].long(), t, right=True)
    return req, t - cu_seqlens.long()[req] + prefix_lens.long()[req]


# The prefill baseline's attention: a Triton kernel in the design of SGLang's Triton extend attention.
# One program per (query block of a request, request, query head): it walks the request's keys
# 0 .. prefix + last query of the block through the block table, with an online softmax in fp32 and the
# causal mask aligned bottom-right. The grid is sized from shapes only (T, B, Hq): programs past their
# request's tokens do nothing, so the launch is CUDA-graph capturable.
try:  # triton is optional where only the CPU path is used
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

if triton is not None:

    @triton.jit
    def _extend_attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, bt_ptr, cu_ptr, prefix_ptr, qk_scale,
                                 stride_qt, stride_qh, stride_kp, stride_ks, stride_kh,
                                 stride_vp, stride_vs, stride_vh, stride_ot, stride_oh, stride_bt,
                                 G: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
                                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr,
                                 DOT_PRECISION: tl.constexpr):
        mb = tl.program_id(0)
        b = tl.program_id(1)
        h = tl.program_id(2)
        s0 = tl.load(cu_ptr + b)
        n = tl.load(cu_ptr + b + 1) - s0
        P = tl.load(prefix_ptr + b)
        m0 = mb * BLOCK_M
        offs_m = m0 + tl.arange(0, BLOCK_M)
        m_ok = offs_m < n
        offs_d = tl.arange(0, D)
        q = tl.load(q_ptr + (s0 + offs_m).to(tl.int64)[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                    mask=m_ok[:, None], other=0.0)
        if UPCAST:  # the CPU interpreter's bf16 tl.dot is wrong (Triton 3.9)
            q = q.to(tl.float32)
        kvh = h // G
        qpos = P + offs_m
        end = tl.where(m0 < n, P + tl.minimum(m0 + BLOCK_M, n), 0)  # keys 0 .. end-1
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        for start in range(0, end, BLOCK_N):
            toks = start + tl.arange(0, BLOCK_N)
            t_ok = toks < end
            pg = tl.load(bt_ptr + b * stride_bt + toks // PAGE, mask=t_ok, other=0).to(tl.int64)
            slot = toks % PAGE
            k = tl.load(k_ptr + pg[:, None] * stride_kp + slot[:, None] * stride_ks + kvh * stride_kh + offs_d[None, :],
                        mask=t_ok[:, None], other=0.0)
            v = tl.load(v_ptr + pg[:, None] * stride_vp + slot[:, None] * stride_vs + kvh * stride_vh + offs_d[None, :],
                        mask=t_ok[:, None], other=0.0)
            if UPCAST:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # log2 domain
            s = tl.where((toks[None, :] <= qpos[:, None]) & t_ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(o_ptr + (s0 + offs_m).to(tl.int64)[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=m_ok[:, None])


def extend_attention_triton(q, k_cache, v_cache, block_table, cu_seqlens, prefix_lens, scale,
                            block_m: int = 64, block_n: int = 64) -> torch.Tensor:
    """Causal paged attention of every request's new tokens (bf16 out). q [T, Hq, D] contiguous; the
    cache must already hold the new tokens' K/V. On a CPU it runs in the Triton interpreter."""
    T, Hq, D = q.shape
    _, page, Hkv, _ = k_cache.shape
    B = prefix_lens.shape[0]
    # The Triton 3.9 interpreter truncates float32 -> bf16 casts, so on a CPU the kernel stores float32.
    out = torch.empty(T, Hq, D, dtype=q.dtype if q.is_cuda else torch.float32, device=q.device)
    grid = (triton.cdiv(T, block_m), B, Hq)
    _extend_attention_kernel[grid](
        q, k_cache, v_cache, out, block_table, cu_seqlens, prefix_lens, float(scale) * math.log2(math.e),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1),
        block_table.stride(0),
        G=Hq // Hkv, D=D, PAGE=page, BLOCK_M=block_m, BLOCK_N=block_n, UPCAST=not q.is_cuda,
        DOT_PRECISION="tf32" if q.is_cuda else "ieee", num_warps=4, num_stages=2,
    )
    return out.to(q.dtype)


# ---------------------------------------------------------------------------------------------------
# The layer


def _split_qkv(qkv: torch.Tensor, Hq: int, Hkv: int, D: int):
    T = qkv.shape[0]
    q = qkv[:, : Hq * D].reshape(T, Hq, D)
    k = qkv[:, Hq * D:(Hq + Hkv) * D].reshape(T, Hkv, D)
    v = qkv[:, (Hq + Hkv) * D:].reshape(T, Hkv, D)
    return q, k, v


def layer_reference(inputs: dict, req: torch.Tensor, pos: torch.Tensor, attend) -> dict:
    """The reference: float64 everywhere except attention (float32), from the bf16/int4 inputs.

    attend(q float32 [T, Hq, D], k_cache, v_cache) -> float32 [T, Hq, D], over bf16 caches that hold the
    new tokens' K/V as stored (rounded to bf16). Returns {"output": float32 [T, H], "k_cache", "v_cache"}:
    the expected caches in float32, equal to the inputs except at the written slots, which hold the exact
    (unrounded) K and V. The inputs are not modified.
    """
    d = dims(inputs)
    T, Hq, Hkv, D, page = d["T"], d["Hq"], d["Hkv"], d["D"], d["page"]
    eps, theta, topk = float(inputs["eps"]), float(inputs["theta"]), int(inputs["topk"])
    x = inputs["x"].double()
    qkv = rms_norm_ref(x, inputs["attn_norm"], eps) @ inputs["wqkv"].double().T
    q, k, v = _split_qkv(qkv, Hq, Hkv, D)
    cos, sin = rope_cos_sin(pos, D, theta)
    q, k = rope_neox(q, cos, sin), rope_neox(k, cos, sin)
    slots = cache_slots(inputs["block_table"], req, pos, page)
    expected, stored = {}, {}
    for name, new in (("k_cache", k), ("v_cache", v)):
        cache = inputs[name]
        exp = cache.float()  # a copy
        exp.view(-1, Hkv, D)[slots] = new.float()
        expected[name] = exp
        st = cache.clone()
        st.view(-1, Hkv, D)[slots] = new.to(cache.dtype)
        stored[name] = st
    o = attend(q.float(), stored["k_cache"], stored["v_cache"])
    del stored
    h = x + o.double().reshape(T, Hq * D) @ inputs["wo"].double().T
    hn = rms_norm_ref(h, inputs["ffn_norm"], eps)
    ids, w = route(hn @ inputs["router"].double().T, topk)
    moe = moe_ref(hn, ids, w, *(inputs[key] for key in MOE_KEYS))
    return {"output": (h + moe.double()).float(), **expected}


def layer_bf16(inputs: dict, req: torch.Tensor, pos: torch.Tensor, attend, experts=None,
               fused_ops: bool = False) -> torch.Tensor:
    """The production-style composition (the baseline): bf16 tensors between every stage, fp32 inside
    the norms, RoPE and softmaxes, cuBLAS GEMMs, muse_moe_w4a16's baseline experts (the fused path of
    reference/_fused_moe_w4a16.py on a GPU, moe_torch on a CPU) or `experts`, with their signature.
    Writes the caches in place. No host
    synchronisation of its own (CUDA-graph capturable when `attend` and the experts are).

    attend(q bf16 [T, Hq, D], k_cache, v_cache) -> bf16 [T, Hq, D].

    fused_ops: the small ops between the GEMMs as SGLang fuses them (reference/_layer_ops.py: RMSNorm,
    RoPE with the cache write, the residual add with the second norm, the routing) and the fused MoE with
    the residual added in its last kernel: the layers' GPU baseline.
    """
    d = dims(inputs)
    T, Hq, Hkv, D, page = d["T"], d["Hq"], d["Hkv"], d["D"], d["page"]
    eps, theta, topk = float(inputs["eps"]), float(inputs["theta"]), int(inputs["topk"])
    x = inputs["x"]
    if fused_ops:
        import _layer_ops as ops
        from _fused_moe_w4a16 import fused_moe

        qkv = F.linear(ops.rms_norm(x, inputs["attn_norm"], eps), inputs["wqkv"])
        q = ops.rope_and_cache(qkv, pos, req, inputs["block_table"], inputs["k_cache"], inputs["v_cache"], theta, Hq)
        o = attend(q, inputs["k_cache"], inputs["v_cache"])
        hn, h = ops.rms_norm(F.linear(o.reshape(T, Hq * D), inputs["wo"]), inputs["ffn_norm"], eps, residual=x)
        ids, w = ops.route(F.linear(hn, inputs["router"]), topk)
        return fused_moe(hn, ids, w, *(inputs[key] for key in MOE_KEYS), residual=h)
    qkv = F.linear(rms_norm_bf16(x, inputs["attn_norm"], eps), inputs["wqkv"])
    q, k, v = _split_qkv(qkv, Hq, Hkv, D)
    cos, sin = rope_cos_sin(pos, D, theta, torch.float32)
    q = rope_neox(q.float(), cos, sin).to(x.dtype)
    k = rope_neox(k.float(), cos, sin).to(x.dtype)
    slots = cache_slots(inputs["block_table"], req, pos, page)
    inputs["k_cache"].view(-1, Hkv, D).index_copy_(0, slots, k)
    inputs["v_cache"].view(-1, Hkv, D).index_copy_(0, slots, v)
    o = attend(q, inputs["k_cache"], inputs["v_cache"])
    h = F.linear(o.reshape(T, Hq * D), inputs["wo"]) + x
    hn = rms_norm_bf16(h, inputs["ffn_norm"], eps)
    logits = F.linear(hn, inputs["router"]).float()
    ids, w = route(logits, topk)
    return h + (experts or moe_w4a16.experts)(hn, ids, w, *(inputs[key] for key in MOE_KEYS))


def written_mask(inputs: dict, req: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """bool [pages, page, 1, 1]: True exactly at the new tokens' slots."""
    kc = inputs["k_cache"]
    pages, page = kc.shape[0], kc.shape[1]
    mask = torch.zeros(pages * page, dtype=torch.bool, device=kc.device)
    mask[cache_slots(inputs["block_table"], req, pos, page)] = True
    return mask.view(pages, page, 1, 1)


# ---------------------------------------------------------------------------------------------------
# Inputs


def make_layer_inputs(shape, T: int, g: torch.Generator, device) -> tuple[dict, torch.Tensor]:
    """The weights, the scalars and x [T, H] with a planted routing; returns (inputs, planted ids [T, k]).

    Weight distributions: attn_norm, ffn_norm ~ 1 + 0.1 N(0, 1); wqkv rows ~ N(0, 1/H) (query rows
    Q_GAIN times larger); wo ~ N(0, WO_GAIN^2/(Hq*D)) with its component along the routing directions
    removed; router = a*u_e + N(0, ROUTER_NOISE^2/H); the experts as in muse_moe_w4a16 with w2 rescaled
    to MOE_W2_GAIN.
    """
    H, Hq, Hkv, D, E, topk = (shape[k] for k in ("H", "Hq", "Hkv", "D", "E", "topk"))
    f32 = dict(device=device, dtype=torch.float32)

    def randn(*size):
        return torch.randn(*size, generator=g, **f32)

    U, _ = torch.linalg.qr(randn(H, E))  # [H, E], orthonormal columns: one routing direction per expert
    attn_norm = (1.0 + 0.1 * randn(H)).to(torch.bfloat16)
    ffn_norm = (1.0 + 0.1 * randn(H)).to(torch.bfloat16)
    wqkv = randn((Hq + 2 * Hkv) * D, H) * H**-0.5
    wqkv[: Hq * D] *= Q_GAIN
    wo = randn(H, Hq * D) * (WO_GAIN * (Hq * D) ** -0.5)
    wo -= U @ (U.T @ wo)
    a = _logit_target(E, topk) / PLANT
    router = a * U.T + randn(E, H) * (ROUTER_NOISE * H**-0.5)
    moe = make_moe_weights(shape, g, device)
    gain = MOE_W2_GAIN / moe_w4a16.W2_GAIN
    if gain != 1.0:
        moe["w2_scale"] = (moe["w2_scale"].float() * gain).to(torch.bfloat16)

    planted, _ = zipf_topk(T, E, topk, g, device, float(shape.get("alpha", DEFAULT_ALPHA)))
    c = 0.75 + 0.5 * torch.rand(T, topk, generator=g, **f32)  # spread of the chosen experts' logits
    coef = torch.zeros(T, E, **f32).scatter_(1, planted.long(), PLANT * c)
    z = randn(T, H)
    z -= (z @ U) @ U.T
    x = z + coef @ U.T
    inputs = {
        "x": x.to(torch.bfloat16),
        "attn_norm": attn_norm,
        "wqkv": wqkv.to(torch.bfloat16),
        "wo": wo.to(torch.bfloat16),
        "ffn_norm": ffn_norm,
        "router": router.to(torch.bfloat16),
        **moe,
        "eps": float(shape["eps"]),
        "theta": float(shape["theta"]),
        "topk": int(topk),
    }
    return inputs, planted


def scribble(cache: torch.Tensor, slots: torch.Tensor, g: torch.Generator) -> None:
    """Fill the new tokens' slots with large garbage, so that attention which reads a slot before the
    layer writes it (or never writes it) is visibly wrong."""
    Hkv, D = cache.shape[-2:]
    junk = 8.0 + 4.0 * torch.rand(slots.numel(), Hkv, D, generator=g, device=cache.device)
    junk *= torch.randint(0, 2, junk.shape, generator=g, device=cache.device) * 2 - 1
    cache.view(-1, Hkv, D)[slots] = junk.to(cache.dtype)


# ---------------------------------------------------------------------------------------------------
# Floor


def layer_floor(shape, new: list[int], prefix: list[int], attn_pairs: int) -> dict:
    """Bytes: every dense weight once, the expert weights of the expected number of experts the tokens
    use (as muse_moe_w4a16 counts them), the cached prefix K/V read once, the new K/V written once, x,
    the output and the index tensors. FLOPs: all GEMMs plus attention (4*D per query-key pair and head).

    attn_pairs: the number of (query, key) pairs attention visits over all requests (causal).
    """
    H, Hq, Hkv, D, E, topk, I, group = (shape[k] for k in ("H", "Hq", "Hkv", "D", "E", "topk", "I", "group"))
    T, B = sum(new), len(new)
    N = (Hq + 2 * Hkv) * D
    dense = 2 * (H + N * H + H * Hq * D + H + E * H)
    per_expert = (2 * I * H // 2 + 2 * (2 * I * H // group)) + (H * I // 2 + 2 * (H * I // group))
    used = expected_active_experts({"M": T, "E": E, "topk": topk, "alpha": shape.get("alpha", DEFAULT_ALPHA)})
    kv_token = 2 * Hkv * D * 2  # K and V, bf16
    cache = kv_token * (sum(prefix) + T)
    page = shape["page"]
    max_pages = max((p + n + page - 1) // page for p, n in zip(prefix, new))
    io = 2 * T * H * 2 + 4 * (B * max_pages + 3 * B + 1)
    flops = 2 * T * H * N + 2 * T * Hq * D * H + 2 * T * H * E + 2 * T * topk * 3 * H * I
    flops += 4 * Hq * D * attn_pairs
    return {"bytes": int(dense + round(used * per_expert) + cache + io), "flops": int(flops)}
