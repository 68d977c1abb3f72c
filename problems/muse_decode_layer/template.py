"""A correct, simple starting point for muse_decode_layer: the whole layer in plain PyTorch.

Every stage is a separate PyTorch call with bf16 tensors in between (fp32 inside the norms, RoPE and
softmaxes): RMSNorm -> QKV GEMM -> RoPE -> write K/V into the paged cache -> attention, one request at a
time -> output GEMM + residual -> RMSNorm -> router -> the experts, one at a time (int4 weights
dequantised to bf16 just before its GEMMs) -> + residual. Replace any stage with your own kernels.

The timed path is captured in a CUDA graph, so nothing here reads a tensor on the host (.item(),
.tolist(), a shape that depends on values): loop bounds come from shapes, and the work that depends on
values (which pages, which experts) is selected on the device. That is why attention reads every
page of a block-table row (masked past seq_lens) and the experts run in a fixed number of slots.
"""

import torch
import torch.nn.functional as F


def rms_norm(x, weight, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def rope(t, pos, theta):
    """Neox-style rotary embedding of t [T, heads, D] at integer positions pos [T]: pairs (i, i + D/2)."""
    D = t.shape[-1]
    inv_freq = theta ** (-torch.arange(0, D, 2, device=t.device, dtype=torch.float64) / D)
    ang = pos.double()[:, None] * inv_freq[None, :]
    cos, sin = ang.cos().float()[:, None, :], ang.sin().float()[:, None, :]
    t1, t2 = t[..., : D // 2].float(), t[..., D // 2:].float()
    return torch.cat((t1 * cos - t2 * sin, t2 * cos + t1 * sin), dim=-1).to(t.dtype)


def attention(q, k_cache, v_cache, block_table, seq_lens, scale):
    """q [B, Hq, D]; request b attends to its first seq_lens[b] cached tokens. fp32 math, bf16 out.

    One request at a time over all max_pages pages of its block-table row (valid page indices), with the
    tokens past seq_lens[b] masked out."""
    B, Hq, D = q.shape
    page, Hkv = k_cache.shape[1], k_cache.shape[2]
    g = Hq // Hkv
    n_max = block_table.shape[1] * page
    tok = torch.arange(n_max, device=q.device)
    out = torch.empty_like(q)
    for b in range(B):
        k = k_cache[block_table[b].long()].reshape(n_max, Hkv, D).float()
        v = v_cache[block_table[b].long()].reshape(n_max, Hkv, D).float()
        s = torch.einsum("hgd,nhd->hgn", q[b].float().view(Hkv, g, D), k) * scale
        s = s.masked_fill(tok >= seq_lens[b], float("-inf"))
        out[b] = torch.einsum("hgn,nhd->hgd", torch.softmax(s, dim=-1), v).reshape(Hq, D).to(q.dtype)
    return out


def route(hn, router, topk):
    """softmax over the experts (fp32 logits), top-k, renormalised."""
    probs = torch.softmax(F.linear(hn, router).float(), dim=-1)
    w, ids = probs.topk(topk, dim=-1)
    return ids, w / w.sum(-1, keepdim=True)


def dequant(packed, scale):
    """int4 (low nibble = even k, stored as q + 8) times one bf16 scale per group -> bf16 [N, K]."""
    N, half = packed.shape
    q = torch.stack(((packed & 0xF), (packed >> 4)), dim=-1).reshape(N, 2 * half).float() - 8.0
    return (q.view(N, scale.shape[1], -1) * scale.float()[:, :, None]).reshape(N, 2 * half).to(torch.bfloat16)


def moe(x, ids, w, w13, w13_scale, w2, w2_scale):
    """The routed experts in S = min(E, T*topk) slots, the used experts first (every used expert gets a
    slot); each slot's expert runs on all T tokens, weighted by a coefficient that is 0 for the tokens
    not routed to it. At decode sizes the time is reading the weights, so the extra rows cost ~nothing."""
    T = x.shape[0]
    E = w13.shape[0]
    I = w2.shape[2] * 2
    S = min(E, ids.numel())
    counts = torch.zeros(E, dtype=torch.int32, device=x.device).scatter_add_(
        0, ids.reshape(-1), torch.ones(ids.numel(), dtype=torch.int32, device=x.device))
    slots = torch.argsort(counts, descending=True, stable=True)[:S]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for i in range(S):
        e = slots[i:i + 1]  # a device index: index_select, never w13[tensor] (that reads it on the host)
        coef = (w * (ids == e)).sum(-1, keepdim=True)  # [T, 1]
        gu = x @ dequant(w13.index_select(0, e)[0], w13_scale.index_select(0, e)[0]).T  # [T, 2I]
        act = F.silu(gu[:, :I].float()) * gu[:, I:].float()
        y = act.to(torch.bfloat16) @ dequant(w2.index_select(0, e)[0], w2_scale.index_select(0, e)[0]).T
        out += coef * y.float()
    return out.to(x.dtype)


def custom_kernel(inputs: dict) -> torch.Tensor:
    x, pos, seq_lens = inputs["x"], inputs["positions"], inputs["seq_lens"]
    k_cache, v_cache, block_table = inputs["k_cache"], inputs["v_cache"], inputs["block_table"]
    eps, theta, topk = inputs["eps"], inputs["theta"], inputs["topk"]
    B = x.shape[0]
    page, Hkv, D = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    Hq = inputs["wo"].shape[1] // D

    qkv = F.linear(rms_norm(x, inputs["attn_norm"], eps), inputs["wqkv"])
    q = rope(qkv[:, : Hq * D].reshape(B, Hq, D), pos, theta)
    k = rope(qkv[:, Hq * D:(Hq + Hkv) * D].reshape(B, Hkv, D), pos, theta)
    v = qkv[:, (Hq + Hkv) * D:].reshape(B, Hkv, D)

    # Append the new token's K and V at its position (the caches are updated in place).
    p = pos.long()
    slot = block_table.long()[torch.arange(B, device=x.device), p // page] * page + p % page
    k_cache.view(-1, Hkv, D).index_copy_(0, slot, k)
    v_cache.view(-1, Hkv, D).index_copy_(0, slot, v)

    o = attention(q, k_cache, v_cache, block_table, seq_lens, D**-0.5)
    h = x + F.linear(o.reshape(B, Hq * D), inputs["wo"])

    hn = rms_norm(h, inputs["ffn_norm"], eps)
    ids, w = route(hn, inputs["router"], topk)
    return h + moe(hn, ids, w, inputs["w13"], inputs["w13_scale"], inputs["w2"], inputs["w2_scale"])
