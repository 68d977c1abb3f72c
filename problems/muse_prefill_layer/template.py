"""A correct, simple starting point for muse_prefill_layer: the whole layer in plain PyTorch.

Every stage is a separate PyTorch call with bf16 tensors in between (fp32 inside the norms, RoPE and
softmaxes): RMSNorm -> QKV GEMM -> RoPE -> write the new tokens' K/V into the paged cache -> causal
attention, one request at a time (its pages gathered, PyTorch's scaled_dot_product_attention with a
mask) -> output GEMM + residual -> RMSNorm -> router -> the experts (int4 weights dequantised to bf16,
two grouped GEMMs over the tokens sorted by expert) -> + residual. Replace any stage with your own kernels.

The timed path is captured in a CUDA graph, so nothing here reads a tensor on the host (.item(),
.tolist(), a shape that depends on values): loop bounds come from shapes (T, B, max_pages, E), and
what depends on values is selected on the device with masks and offsets. That is why attention runs
every request over all T query rows and all pages of its block-table row, masked (wasteful: a good
first thing to replace).
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


def attention(q, k_cache, v_cache, block_table, req, pos, scale):
    """q [T, Hq, D]; token t of request req[t] at position pos[t] attends to positions 0 .. pos[t] of its
    request. One request at a time: all T query rows against every page of its block-table row, masked
    (the rows of other requests are discarded). bf16 in and out."""
    T, Hq, D = q.shape
    page, Hkv = k_cache.shape[1], k_cache.shape[2]
    B = block_table.shape[0]
    n_max = block_table.shape[1] * page
    key_pos = torch.arange(n_max, device=q.device)
    qh = q.transpose(0, 1)[None]  # [1, Hq, T, D]: 4-D, so that SDPA can pick a fused kernel
    out = torch.zeros_like(q)
    for b in range(B):
        k = k_cache[block_table[b].long()].reshape(n_max, Hkv, D).repeat_interleave(Hq // Hkv, dim=1)
        v = v_cache[block_table[b].long()].reshape(n_max, Hkv, D).repeat_interleave(Hq // Hkv, dim=1)
        mine = req == b
        mask = (key_pos[None, :] <= pos[:, None]) & mine[:, None]  # [T, n_max], True = may attend
        mask[:, 0] |= ~mine  # other requests' rows see one key, so no row is empty (they are discarded)
        o = F.scaled_dot_product_attention(qh, k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=mask,
                                           scale=scale)[0]  # [Hq, T, D]
        out = torch.where(mine[:, None, None], o.transpose(0, 1), out)
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
    """The routed experts: the T*topk (token, expert) pairs sorted by expert, every expert dequantised to
    bf16 once (one expert at a time into a bf16 buffer), two grouped GEMMs (F.grouped_mm) with each
    expert's end offset computed on the device, then the fp32 weighted sum over each token's top-k."""
    T, H = x.shape
    E, k = w13.shape[0], ids.shape[1]
    I = w2.shape[2] * 2
    flat = ids.reshape(-1).long()
    sorted_ids, order = torch.sort(flat, stable=True)
    ends = torch.searchsorted(sorted_ids, torch.arange(1, E + 1, device=x.device), out_int32=True)
    tok = order // k
    # grouped_mm wants the last offset strictly below the number of rows: one zero row at the end
    xs = torch.cat((x.index_select(0, tok), x.new_zeros(1, H)))
    w13b = torch.empty(E, 2 * I, H, dtype=torch.bfloat16, device=x.device)
    w2b = torch.empty(E, H, I, dtype=torch.bfloat16, device=x.device)
    for e in range(E):
        w13b[e] = dequant(w13[e], w13_scale[e])
        w2b[e] = dequant(w2[e], w2_scale[e])
    gu = F.grouped_mm(xs, w13b.transpose(1, 2), offs=ends)  # [T*k + 1, 2I]
    act = (F.silu(gu[:, :I].float()) * gu[:, I:].float()).to(torch.bfloat16)
    y = F.grouped_mm(act, w2b.transpose(1, 2), offs=ends)[:-1]  # [T*k, H], sorted by expert
    out = torch.zeros(T, H, dtype=torch.float32, device=x.device)
    out.index_add_(0, tok, y.float() * w.reshape(-1)[order, None])
    return out.to(x.dtype)


def custom_kernel(inputs: dict) -> torch.Tensor:
    x, cu_seqlens, prefix_lens = inputs["x"], inputs["cu_seqlens"], inputs["prefix_lens"]
    k_cache, v_cache, block_table = inputs["k_cache"], inputs["v_cache"], inputs["block_table"]
    eps, theta, topk = inputs["eps"], inputs["theta"], inputs["topk"]
    T = x.shape[0]
    page, Hkv, D = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    Hq = inputs["wo"].shape[1] // D

    # Each new token's request and position, on the device.
    t = torch.arange(T, device=x.device)
    req = torch.searchsorted(cu_seqlens[1:].long(), t, right=True)
    pos = t - cu_seqlens.long()[req] + prefix_lens.long()[req]

    qkv = F.linear(rms_norm(x, inputs["attn_norm"], eps), inputs["wqkv"])
    q = rope(qkv[:, : Hq * D].reshape(T, Hq, D), pos, theta)
    k = rope(qkv[:, Hq * D:(Hq + Hkv) * D].reshape(T, Hkv, D), pos, theta)
    v = qkv[:, (Hq + Hkv) * D:].reshape(T, Hkv, D)

    # Append the new tokens' K and V after each request's prefix (the caches are updated in place).
    slot = block_table.long()[req, pos // page] * page + pos % page
    k_cache.view(-1, Hkv, D).index_copy_(0, slot, k)
    v_cache.view(-1, Hkv, D).index_copy_(0, slot, v)

    o = attention(q, k_cache, v_cache, block_table, req, pos, D**-0.5)
    h = x + F.linear(o.reshape(T, Hq * D), inputs["wo"])

    hn = rms_norm(h, inputs["ffn_norm"], eps)
    ids, w = route(hn, inputs["router"], topk)
    return h + moe(hn, ids, w, inputs["w13"], inputs["w13_scale"], inputs["w2"], inputs["w2_scale"])
