"""The layers' small fused ops (issue 18), a part of the organizers' layer solutions: RMSNorm (with the
residual add), RoPE with the new K/V written into their cache slots (decode and extend), softmax-top-k, and
`layer`, the decoder layer around a layer's own attention.
Placed into solutions/<layer>/submission.py by `python solutions/build_layers.py`; `_bf16_rne` is the MoE
part's. fp32 inside every kernel; on a CPU (Triton's interpreter, whose float32 -> bf16 cast truncates) the
kernels round to bf16 by hand."""

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


@triton.jit
def _to_bf16(v, F32: tl.constexpr):
    return _bf16_rne(v) if F32 else v.to(tl.bfloat16)  # noqa: F821 - _bf16_rne: the MoE part's


@triton.jit
def _norm(x_ptr, res_ptr, w_ptr, out_ptr, h_ptr, H, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr,
          F32: tl.constexpr):
    """out = rms(h) * w for the row h = x (+ res, stored as bf16 in h_ptr: the layer's residual stream)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < H
    v = tl.load(x_ptr + row * H + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_RES:
        h = _to_bf16(v + tl.load(res_ptr + row * H + cols, mask=ok, other=0.0).to(tl.float32), F32)
        tl.store(h_ptr + row * H + cols, h, mask=ok)
        v = h.to(tl.float32)
    scale = tl.rsqrt(tl.sum(v * v, 0) / H + eps)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * H + cols, _to_bf16(v * scale * w, F32), mask=ok)


@triton.jit
def _rope_write(qkv_ptr, q_ptr, k_ptr, v_ptr, pos_ptr, cu_ptr, bt_ptr, freq_ptr, bt_stride, B,
                Hq: tl.constexpr, Hkv: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, BB: tl.constexpr,
                EXTEND: tl.constexpr, F32: tl.constexpr):
    """Program (token t, head h): a query head rotated into q; a key head rotated into its cache slot, and
    the value head of the same index copied beside it. Decode: token t is request t at pos_ptr[t]. EXTEND:
    token t belongs to the request whose new tokens cu_ptr brackets it in, at that request's prefix
    (pos_ptr[request]) plus its index among them. Angles in float64 from float64 frequencies (at position
    65,535 float32 moves an angle by ~1e-2 rad)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    i = tl.arange(0, D // 2)
    if EXTEND:
        r = tl.arange(0, BB)
        req = tl.sum((tl.load(cu_ptr + 1 + r, mask=r < B, other=1 << 30) <= t).to(tl.int32), 0)
        p = t - tl.load(cu_ptr + req).to(tl.int64) + tl.load(pos_ptr + req).to(tl.int64)
    else:
        req = t
        p = tl.load(pos_ptr + t).to(tl.int64)
    angle = p.to(tl.float64) * tl.load(freq_ptr + i)
    c = tl.cos(angle).to(tl.float32)
    s = tl.sin(angle).to(tl.float32)
    src = qkv_ptr + t * ((Hq + 2 * Hkv) * D) + h * D
    a = tl.load(src + i).to(tl.float32)
    b = tl.load(src + D // 2 + i).to(tl.float32)
    first = _to_bf16(a * c - b * s, F32)
    second = _to_bf16(b * c + a * s, F32)
    if h < Hq:
        dst = q_ptr + (t * Hq + h) * D
    else:
        slot = tl.load(bt_ptr + req * bt_stride + p // PAGE).to(tl.int64) * PAGE + p % PAGE
        dst = k_ptr + (slot * Hkv + h - Hq) * D
        d = tl.arange(0, D)
        tl.store(v_ptr + (slot * Hkv + h - Hq) * D + d, tl.load(src + Hkv * D + d))
    tl.store(dst + i, first)
    tl.store(dst + D // 2 + i, second)


@triton.jit
def _topk(logits_ptr, ids_ptr, w_ptr, E, TOPK: tl.constexpr, EB: tl.constexpr):
    """Softmax over the E logits of a token, its TOPK largest (the lowest id among equals), renormalised."""
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, EB)
    z = tl.load(logits_ptr + t * E + e, mask=e < E, other=float("-inf")).to(tl.float32)
    prob = tl.exp(z - tl.max(z, 0))
    prob = tl.where(e < E, prob / tl.sum(prob, 0), -1.0)
    k = tl.arange(0, TOPK)
    ids = tl.zeros([TOPK], tl.int32)
    ws = tl.zeros([TOPK], tl.float32)
    for j in tl.static_range(TOPK):
        top = tl.max(prob, 0)
        at = tl.min(tl.where(prob == top, e, EB), 0)
        ids = tl.where(k == j, at, ids)
        ws = tl.where(k == j, top, ws)
        prob = tl.where(e == at, -1.0, prob)
    tl.store(ids_ptr + t * TOPK + k, ids)
    tl.store(w_ptr + t * TOPK + k, ws / tl.sum(ws, 0))


_FREQ: dict = {}


def _frequencies(D: int, theta: float, device: torch.device) -> torch.Tensor:
    """theta^(-2i/D), float64; kept from an eager call, never from inside a graph capture (whose memory is
    the graph's)."""
    got = _FREQ.get((D, theta, device))
    if got is None:
        got = theta ** (-torch.arange(0, D, 2, dtype=torch.float64, device=device) / D)
        if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            _FREQ[(D, theta, device)] = got
    return got


def _rms(x, weight, eps, f32, residual=None):
    T, H = x.shape
    out = torch.empty_like(x)
    h = torch.empty_like(x) if residual is not None else out
    _norm[(T,)](x, x if residual is None else residual, weight, out, h, H, float(eps), HAS_RES=residual is not None,
                BLOCK=triton.next_power_of_2(H), F32=f32, **({} if f32 else {"num_warps": 8 if H >= 2048 else 4}))
    return out, h


def rope_write(qkv, k_cache, v_cache, block_table, pos, theta: float, Hq: int, cu_seqlens=None) -> torch.Tensor:
    """q [T, Hq, D] bf16 rotated; the rotated K and the V of every token written into its cache slot. `pos`:
    each token's position (decode), or with `cu_seqlens` each request's prefix length (extend)."""
    T = qkv.shape[0]
    _, page, Hkv, D = k_cache.shape
    f32 = qkv.device.type != "cuda"
    q = torch.empty(T, Hq, D, dtype=qkv.dtype, device=qkv.device)
    B = block_table.shape[0]
    _rope_write[(T, Hq + Hkv)](qkv, q, k_cache, v_cache, pos, pos if cu_seqlens is None else cu_seqlens, block_table,
                               _frequencies(D, theta, qkv.device), block_table.stride(0), B, Hq=Hq, Hkv=Hkv, D=D,
                               PAGE=page, BB=max(2, triton.next_power_of_2(B)), EXTEND=cu_seqlens is not None,
                               F32=f32, **({} if f32 else {"num_warps": 1}))
    return q


def route(logits: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids int32 [T, topk], weights float32 [T, topk]): softmax over the experts, top-k, renormalised."""
    T, E = logits.shape
    ids = torch.empty(T, topk, dtype=torch.int32, device=logits.device)
    weights = torch.empty(T, topk, dtype=torch.float32, device=logits.device)
    _topk[(T,)](logits, ids, weights, E, TOPK=topk, EB=triton.next_power_of_2(E),
                **({} if logits.device.type != "cuda" else {"num_warps": 1}))
    return ids, weights


def layer(inputs: dict, attend, pos, cu_seqlens=None, moe_config: dict | None = None) -> torch.Tensor:
    """The layer's output [T, H] bf16: RMSNorm -> the QKV GEMM (cuBLAS) -> RoPE with the new K and V written
    into their cache slots -> attend(q [T, Hq, D] bf16, scale) -> [T, Hq, D] bf16 (reading the caches after
    the write) -> the output GEMM -> the residual add with the second RMSNorm -> the router GEMM -> softmax-
    top-k -> the MoE solution (`moe_config`, or its own for the token count), the residual added in its last
    kernel. `pos` and `cu_seqlens` as rope_write takes them."""
    x, k_cache = inputs["x"], inputs["k_cache"]
    T = x.shape[0]
    D = k_cache.shape[3]
    Hq = inputs["wqkv"].shape[0] // D - 2 * k_cache.shape[2]
    eps = float(inputs["eps"])
    f32 = x.device.type != "cuda"
    xn, _ = _rms(x, inputs["attn_norm"], eps, f32)
    q = rope_write(F.linear(xn, inputs["wqkv"]), k_cache, inputs["v_cache"], inputs["block_table"], pos,
                   float(inputs["theta"]), Hq, cu_seqlens=cu_seqlens)
    o = attend(q, 1.0 / math.sqrt(D))
    hn, h = _rms(F.linear(o.reshape(T, Hq * D), inputs["wo"]), inputs["ffn_norm"], eps, f32, residual=x)
    ids, weights = route(F.linear(hn, inputs["router"]), int(inputs["topk"]))
    return fused_moe(hn, ids, weights, inputs["w13"], inputs["w13_scale"], inputs["w2"],  # noqa: F821 - the MoE part's
                     inputs["w2_scale"], config=moe_config, residual=h)
