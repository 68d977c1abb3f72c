"""muse_moe_w4a16: the routed experts of one MoE layer, W4A16 weights.

out[m] = sum_k topk_weights[m, k] * (w2_e @ (silu(gate_e @ x[m]) * (up_e @ x[m]))),  e = topk_ids[m, k]

Weight format (shared with the layer problems, which import the helpers below): symmetric int4 along K,
q in -8..7 stored as the unsigned nibble q + 8, two nibbles per uint8 (low nibble = even k, high
nibble = odd k), one bf16 scale per group of `group` consecutive k; w = q * scale, exact in float32.
`w13[e]` holds the gate rows (0..I-1) then the up rows (I..2I-1), both [*, H]; `w2[e]` is [H, I].

The reference computes everything in float64 from the dequantised weights, including the intermediate
activation silu(gate) * up. Production kernels round the dequantised weight and the intermediate to
bf16 before the GEMMs; those roundings are well inside the tolerance (see the calibration variants).
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:  # the evaluator's child loads this file by path, without reference/ on sys.path
    sys.path.insert(0, _HERE)

OUTPUT_DTYPE = torch.bfloat16

# Weight magnitudes: gate and up rows ~ N(0, 1/H), so gate(x), up(x) ~ N(0, 1) for x ~ N(0, 1); w2 rows
# ~ N(0, W2_GAIN^2 / I): the output's standard deviation is about 0.45 on the full model (top-8) and 0.7 on
# the smoke model (top-2), small enough that atol = 0.02 and max_abs = 0.1 sit well above bf16 rounding.
W2_GAIN = 1.5
# Scale = absmax / 7.5: the group's extreme values land on -8 and +7 (+7.5 rounds to 8 and clamps to 7,
# an error of half a step like any other rounding), so all 16 codes are in use.
QMAX = 7.5
DEFAULT_ALPHA = 1.1  # Zipf exponent of expert popularity
# Experts generated per chunk are bounded to about this many float32 elements (peak memory of the
# generator on the full model: a few hundred MB).
_CHUNK_ELEMENTS = 1 << 26


# ---------------------------------------------------------------------------------------------------
# int4 packing


def quantize_w4a16(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Float weight [..., N, K] -> (packed uint8 [..., N, K//2], scale bf16 [..., N, K//group])."""
    *lead, N, K = w.shape
    if K % group or group % 2:
        raise ValueError(f"K = {K} must be a multiple of the group size {group}, which must be even")
    wg = w.float().reshape(*lead, N, K // group, group)
    scale = (wg.abs().amax(-1, keepdim=True) / QMAX).clamp_min(1e-20).to(torch.bfloat16)
    q = torch.round(wg / scale.float()).clamp_(-8, 7)
    u = (q + 8).to(torch.uint8).reshape(*lead, N, K)
    packed = u[..., 0::2] | (u[..., 1::2] << 4)
    return packed.contiguous(), scale.squeeze(-1).contiguous()


def dequantize_w4a16(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(packed uint8 [..., N, K//2], scale bf16 [..., N, K//group]) -> float32 [..., N, K]."""
    *lead, N, half = packed.shape
    K = 2 * half
    groups = scale.shape[-1]
    if K % groups:
        raise ValueError(f"K = {K} is not a multiple of the {groups} scale groups")
    lo = (packed & 0xF).to(torch.int16)
    hi = (packed >> 4).to(torch.int16)
    q = torch.stack((lo, hi), dim=-1).reshape(*lead, N, K).float() - 8.0
    w = q.reshape(*lead, N, groups, K // groups) * scale.float().unsqueeze(-1)
    return w.reshape(*lead, N, K)


# ---------------------------------------------------------------------------------------------------
# Inputs


def make_moe_weights(shape, gen: torch.Generator, device) -> dict:
    """Random W4A16 expert weights: {w13, w13_scale, w2, w2_scale} (about 1.5 GB on the full model).

    Generated a few experts at a time on `device`, so the float32 temporaries stay small.
    """
    E, H, I, group = shape["E"], shape["H"], shape["I"], shape["group"]
    w13 = torch.empty(E, 2 * I, H // 2, dtype=torch.uint8, device=device)
    w13_scale = torch.empty(E, 2 * I, H // group, dtype=torch.bfloat16, device=device)
    w2 = torch.empty(E, H, I // 2, dtype=torch.uint8, device=device)
    w2_scale = torch.empty(E, H, I // group, dtype=torch.bfloat16, device=device)
    chunk = max(1, _CHUNK_ELEMENTS // (2 * I * H))
    for e0 in range(0, E, chunk):
        e1 = min(E, e0 + chunk)
        w = torch.randn(e1 - e0, 2 * I, H, generator=gen, device=device, dtype=torch.float32)
        w.mul_(H**-0.5)
        w13[e0:e1], w13_scale[e0:e1] = quantize_w4a16(w, group)
        del w
        w = torch.randn(e1 - e0, H, I, generator=gen, device=device, dtype=torch.float32)
        w.mul_(W2_GAIN * I**-0.5)
        w2[e0:e1], w2_scale[e0:e1] = quantize_w4a16(w, group)
        del w
    return {"w13": w13, "w13_scale": w13_scale, "w2": w2, "w2_scale": w2_scale}


def _zipf_probs(E: int, alpha: float, device) -> torch.Tensor:
    return torch.arange(1, E + 1, device=device, dtype=torch.float64).pow(-alpha).float()


def _route_weights(ids: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax of random logits over each token's chosen experts, sorted descending like torch.topk."""
    logits = torch.randn(ids.shape, generator=gen, device=ids.device, dtype=torch.float32)
    weights, order = torch.softmax(logits, dim=-1).sort(dim=-1, descending=True)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids.gather(1, order).to(torch.int32).contiguous(), weights.float().contiguous()


def zipf_topk(M: int, E: int, topk: int, gen: torch.Generator, device,
              alpha: float = DEFAULT_ALPHA) -> tuple[torch.Tensor, torch.Tensor]:
    """Skewed routing: topk distinct experts per token, expert popularity ~ 1/rank^alpha.

    The rank -> expert map is a random permutation, so the hot experts differ between seeds. Returns
    (topk_ids int32 [M, topk], topk_weights float32 [M, topk]); weights are a softmax of random logits
    over the chosen experts (sum to 1), sorted descending. alpha = 0 gives uniform routing.
    """
    if topk > E:
        raise ValueError(f"topk = {topk} > E = {E}")
    perm = torch.randperm(E, generator=gen, device=device)
    probs = torch.empty(E, device=device, dtype=torch.float32)
    probs[perm] = _zipf_probs(E, alpha, device)
    ids = torch.multinomial(probs.expand(M, E), topk, replacement=False, generator=gen)
    return _route_weights(ids, gen)


def make_inputs(shape, seed: int, device) -> dict:
    g = torch.Generator(device=device).manual_seed(seed)
    M, H, E, topk = shape["M"], shape["H"], shape["E"], shape["topk"]
    x = torch.randn(M, H, generator=g, device=device, dtype=torch.float32).to(torch.bfloat16)
    routing = shape.get("routing", "zipf")
    alpha = float(shape.get("alpha", DEFAULT_ALPHA))
    if routing == "zipf":
        topk_ids, topk_weights = zipf_topk(M, E, topk, g, device, alpha)
    elif routing == "same":  # every token on the same top-k experts (with its own weights)
        one, _ = zipf_topk(1, E, topk, g, device, alpha)
        topk_ids, topk_weights = _route_weights(one.long().expand(M, topk).contiguous(), g)
    else:
        raise ValueError(f"unknown routing {routing!r}")
    return {"x": x, "topk_ids": topk_ids, "topk_weights": topk_weights, **make_moe_weights(shape, g, device)}


# ---------------------------------------------------------------------------------------------------
# Reference and baseline


def moe_ref(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale) -> torch.Tensor:
    """float32 [M, H]; computed in float64 from the dequantised weights, one expert at a time."""
    M, H = x.shape
    I = w2.shape[-1] * 2
    out = torch.zeros(M, H, dtype=torch.float64, device=x.device)
    xd = x.double()
    ids = topk_ids.long()
    for e in torch.unique(ids).tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        h = xd[tok] @ dequantize_w4a16(w13[e], w13_scale[e]).double().T
        act = F.silu(h[:, :I]) * h[:, I:]
        y = act @ dequantize_w4a16(w2[e], w2_scale[e]).double().T
        out.index_add_(0, tok, y * topk_weights[tok, slot].double().unsqueeze(1))
    return out.float()


# The baseline is captured in a CUDA graph (pipeline/kernel/timing.py), like every submission: no host
# synchronisation and no data-dependent shapes. Which experts the tokens use is only known on the device,
# so the work is sized by static bounds: S = min(E, M * topk) expert slots (every used expert is among
# them), each slot computed on all M tokens and weighted by a per-token coefficient that is zero for the
# tokens not routed to it.
_DENSE_MAX_TOKENS = 128  # above this many tokens (prefill), one grouped GEMM over the sorted pairs instead


def _dequantize_bf16(packed: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """As production kernels do: q * scale rounded to bf16 (computed in bf16 arithmetic, which rounds the
    exact product once, like rounding the float32 product). packed [N, K/2], scale [N, K/group] ->
    bf16 [N, K], written into `out` when given."""
    N, half = packed.shape
    groups = scale.shape[-1]
    q = torch.stack((packed & 0xF, packed >> 4), dim=-1).view(N, groups, 2 * half // groups)
    q = q.to(torch.bfloat16).sub_(8.0)
    if out is None:
        return torch.mul(q, scale.unsqueeze(-1)).view(N, 2 * half)
    torch.mul(q, scale.unsqueeze(-1), out=out.view(N, groups, -1))
    return out


def _grouped_mm_usable(x: torch.Tensor) -> bool:
    """F.grouped_mm (absent from older torch) reads its offsets on the device only on sm90+ GPUs (older
    GPUs take a fallback that synchronises) and on the CPU; elsewhere moe_torch keeps the slot loop."""
    if not hasattr(F, "grouped_mm"):
        return False
    return not x.is_cuda or torch.cuda.get_device_capability(x.device) >= (9, 0)


def _moe_dense_slots(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale) -> torch.Tensor:
    """Decode-sized M: S = min(E, M*topk) slots, the used experts first; per slot dequantise the expert to
    bf16 and run both GEMMs on all M tokens (weight-bound at this M, so the extra rows cost ~nothing)."""
    M, H = x.shape
    E, topk = w13.shape[0], topk_ids.shape[1]
    I = w2.shape[-1] * 2
    ids = topk_ids.long()
    counts = torch.zeros(E, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, ids.reshape(-1), torch.ones(M * topk, dtype=torch.int32, device=x.device))
    S = min(E, M * topk)
    slots = torch.sort(counts, descending=True, stable=True).indices[:S]  # used experts (count > 0) first
    # coef[s, m] = the routing weight of token m for the expert in slot s (0 when m does not use it)
    coef = ((ids.unsqueeze(0) == slots.view(S, 1, 1)) * topk_weights.unsqueeze(0)).sum(-1)
    out = torch.zeros(M, H, dtype=torch.float32, device=x.device)
    for s in range(S):
        e = slots[s:s + 1]  # a device index: index_select, never w13[tensor] (that would call .item())
        h = x @ _dequantize_bf16(w13.index_select(0, e)[0], w13_scale.index_select(0, e)[0]).T  # [M, 2I]
        act = F.silu(h[:, :I]) * h[:, I:]
        y = act @ _dequantize_bf16(w2.index_select(0, e)[0], w2_scale.index_select(0, e)[0]).T  # [M, H]
        out.addcmul_(y.float(), coef[s].unsqueeze(1))
    return out.to(torch.bfloat16)


def _moe_grouped(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale) -> torch.Tensor:
    """Prefill-sized M (every expert in use): dequantise all experts to bf16 once, sort the M*topk pairs by
    expert, two grouped GEMMs with the expert boundaries as device offsets, unsort, fp32 sum over top-k."""
    M, H = x.shape
    E, topk = w13.shape[0], topk_ids.shape[1]
    I = w2.shape[-1] * 2
    P = M * topk
    flat = topk_ids.reshape(-1).long()
    sorted_ids, order = torch.sort(flat, stable=True)
    ends = torch.searchsorted(sorted_ids, torch.arange(1, E + 1, device=x.device), out_int32=True)
    # one zero row past the last pair, so that the last offset (P) is below the operand's length
    tok = torch.cat((order // topk, torch.full((1,), M, dtype=order.dtype, device=x.device)))
    xs = torch.cat((x, x.new_zeros(1, H))).index_select(0, tok)  # [P + 1, H]
    w13b = torch.empty(E, 2 * I, H, dtype=torch.bfloat16, device=x.device)
    w2b = torch.empty(E, H, I, dtype=torch.bfloat16, device=x.device)
    for e in range(E):
        _dequantize_bf16(w13[e], w13_scale[e], out=w13b[e])
        _dequantize_bf16(w2[e], w2_scale[e], out=w2b[e])
    h = F.grouped_mm(xs, w13b.transpose(-2, -1), offs=ends)  # [P + 1, 2I] bf16, fp32 accumulation
    act = F.silu(h[:, :I]) * h[:, I:]
    del h, w13b
    y = F.grouped_mm(act, w2b.transpose(-2, -1), offs=ends)[:P]  # [P, H], sorted by expert
    del act, w2b
    pairs = torch.empty_like(y).index_copy_(0, order, y).view(M, topk, H)  # back to (token, k) order
    out = torch.zeros(M, H, dtype=torch.float32, device=x.device)
    for k in range(topk):
        out.addcmul_(pairs[:, k].float(), topk_weights[:, k:k + 1])
    return out.to(torch.bfloat16)


def moe_torch(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale) -> torch.Tensor:
    """bf16 [M, H], CUDA-graph capturable: each expert's weights dequantised to bf16 (q * scale rounded),
    bf16 GEMMs (fp32 accumulation inside), the intermediate silu(gate) * up in bf16, the weighted sum
    over top-k in fp32. Up to _DENSE_MAX_TOKENS tokens: a loop over min(E, M*topk) expert slots, each on
    all tokens (_moe_dense_slots); more tokens: grouped GEMMs over the sorted pairs (_moe_grouped)."""
    args = (x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale)
    if x.shape[0] > _DENSE_MAX_TOKENS and _grouped_mm_usable(x):
        return _moe_grouped(*args)
    return _moe_dense_slots(*args)


_KEYS = ("x", "topk_ids", "topk_weights", "w13", "w13_scale", "w2", "w2_scale")


def reference(inputs: dict) -> torch.Tensor:
    return moe_ref(*(inputs[k] for k in _KEYS))


def experts(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale) -> torch.Tensor:
    """The baseline's experts: on a GPU the fused path SGLang takes (reference/_fused_moe_w4a16.py:
    aligned by expert on the device, grouped GEMMs with the int4 unpacking in the kernel, SiLU-and-mul
    fused, block configurations tuned per token count on the H200); on a CPU moe_torch (the fused path
    runs there only in Triton's interpreter, far slower; CPU results are never official)."""
    if x.is_cuda:
        from _fused_moe_w4a16 import fused_moe

        return fused_moe(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale)
    return moe_torch(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale)


def baseline(inputs: dict) -> torch.Tensor:
    return experts(*(inputs[k] for k in _KEYS))


# ---------------------------------------------------------------------------------------------------
# Floor


@functools.lru_cache(maxsize=None)
def _inclusion_probs(E: int, topk: int, alpha: float, draws: int = 1 << 14) -> tuple[float, ...]:
    """P(the expert of popularity rank r is among one token's top-k), estimated once (CPU, fixed seed)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.multinomial(_zipf_probs(E, alpha, "cpu").expand(draws, E), topk, replacement=False, generator=g)
    return tuple((torch.bincount(ids.reshape(-1), minlength=E).double() / draws).tolist())


def expected_active_experts(shape) -> float:
    """The expected number of distinct experts M tokens route to (what the weights' bytes scale with)."""
    M, E, topk = shape["M"], shape["E"], shape["topk"]
    if shape.get("routing", "zipf") == "same":
        return float(topk)
    p = _inclusion_probs(E, topk, float(shape.get("alpha", DEFAULT_ALPHA)))
    return sum(1.0 - (1.0 - pe) ** M for pe in p)


def floor(shape) -> dict:
    """Bytes: the packed weights and scales of the experts the routing uses (their expected number over
    seeds, see expected_active_experts), x, topk_ids, topk_weights and the output. FLOPs: the GEMMs of
    the M*topk token-expert pairs."""
    M, H, I, topk, group = shape["M"], shape["H"], shape["I"], shape["topk"], shape["group"]
    per_expert = (2 * I * H // 2 + 2 * (2 * I * H // group)) + (H * I // 2 + 2 * (H * I // group))
    used = expected_active_experts(shape)
    io = 2 * M * H + 4 * M * topk + 4 * M * topk + 2 * M * H
    return {"bytes": int(round(used * per_expert)) + io, "flops": 2 * M * topk * (2 * I * H + H * I)}
