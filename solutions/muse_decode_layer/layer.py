"""The organizers' muse_decode_layer (issue 18): the layer composed of the organizers' own kernels.

GENERATED as submission.py by `python solutions/build_layers.py` (a submission is one file): the attention's
and the MoE's solutions (solutions/muse_attention_decode, solutions/muse_moe_w4a16) are placed above this
part, their CONFIGS, config_for and custom_kernel renamed with a prefix (attn_, moe_). Edit the parts and
this file, then rebuild; tests/test_solutions.py fails while submission.py differs from the build.

The layer: RMSNorm (one Triton program per token) -> the QKV GEMM (cuBLAS) -> RoPE with the new K and V
written into their cache slots (one program per token and head) -> the attention solution (fixed-size
chunks, one-shot merge) -> the output GEMM (cuBLAS) -> the residual add and the second RMSNorm in one
kernel -> the router GEMM (cuBLAS) -> softmax-top-k renormalised (one program per token) -> the MoE
solution, the residual added in its last kernel. fp32 inside every kernel, bf16 between them.

On a CPU (Triton's interpreter: a float32 -> bf16 cast truncates) the kernels round to bf16 by hand.
"""

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
def _rope_write(qkv_ptr, q_ptr, k_ptr, v_ptr, pos_ptr, bt_ptr, freq_ptr, bt_stride, Hq: tl.constexpr,
                Hkv: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, F32: tl.constexpr):
    """Program (token t, head h): a query head rotated into q; a key head rotated into its cache slot, and
    the value head of the same index copied beside it. Angles in float64 from float64 frequencies (at
    position 65,535 float32 moves an angle by ~1e-2 rad)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    i = tl.arange(0, D // 2)
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
        slot = tl.load(bt_ptr + t * bt_stride + p // PAGE).to(tl.int64) * PAGE + p % PAGE
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


def custom_kernel(inputs: dict) -> torch.Tensor:
    x, k_cache, v_cache = inputs["x"], inputs["k_cache"], inputs["v_cache"]
    block_table, seq_lens = inputs["block_table"], inputs["seq_lens"]
    T, H = x.shape
    _, page, Hkv, D = k_cache.shape
    Hq = inputs["wqkv"].shape[0] // D - 2 * Hkv
    eps, topk = float(inputs["eps"]), int(inputs["topk"])
    f32 = x.device.type != "cuda"
    one = {} if f32 else {"num_warps": 1}
    xn, _ = _rms(x, inputs["attn_norm"], eps, f32)
    qkv = F.linear(xn, inputs["wqkv"])
    q = torch.empty(T, Hq, D, dtype=x.dtype, device=x.device)
    _rope_write[(T, Hq + Hkv)](qkv, q, k_cache, v_cache, inputs["positions"], block_table,
                               _frequencies(D, float(inputs["theta"]), x.device), block_table.stride(0), Hq=Hq,
                               Hkv=Hkv, D=D, PAGE=page, F32=f32, **one)
    o = attn_kernel({"q": q, "k_cache": k_cache, "v_cache": v_cache, "block_table": block_table,  # noqa: F821
                     "seq_lens": seq_lens, "scale": 1.0 / math.sqrt(D)})
    hn, h = _rms(F.linear(o.reshape(T, Hq * D), inputs["wo"]), inputs["ffn_norm"], eps, f32, residual=x)
    logits = F.linear(hn, inputs["router"])
    E = logits.shape[1]
    ids = torch.empty(T, topk, dtype=torch.int32, device=x.device)
    weights = torch.empty(T, topk, dtype=torch.float32, device=x.device)
    _topk[(T,)](logits, ids, weights, E, TOPK=topk, EB=triton.next_power_of_2(E), **one)
    return fused_moe(hn, ids, weights, inputs["w13"], inputs["w13_scale"], inputs["w2"],  # noqa: F821
                     inputs["w2_scale"], residual=h)
