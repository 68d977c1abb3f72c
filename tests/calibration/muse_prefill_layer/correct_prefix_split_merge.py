"""Cascade attention: the cached prefix (no mask) and the new tokens (causal) attended separately, the two partial softmaxes merged by log-sum-exp.

What engines do for extend: one kernel over the prefix pages, one over the new tokens' K/V kept in
registers, then a merge of the two states. The new tokens' K/V come straight from the projection
(bf16) rather than being read back from the cache. Other orders too: RMSNorm rounds before the
weight multiplies, float32 RoPE angles, the experts' routing weight is applied to the activation
before the down GEMM, and the top-k contributions are summed last expert first.
"""
import torch
import torch.nn.functional as F

CHUNK = 1024


def _norm(x, w, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)).to(torch.bfloat16) * w


def _rope(t, pos, theta):
    D = t.shape[-1]
    ang = pos.float()[:, None] / theta ** (torch.arange(D // 2, device=t.device).float() * 2 / D)
    c, s = ang.cos()[:, None], ang.sin()[:, None]
    x1, x2 = t[..., :D // 2].float(), t[..., D // 2:].float()
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1).to(t.dtype)


def _partial(q, K, V, mask):
    """q [H, n, D] fp32 (pre-scaled), K/V [H, L, D]; returns (o [H, n, D], lse [H, n])."""
    s = q @ K.transpose(1, 2)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, -1)
    return torch.exp(s - lse[..., None]) @ V, lse


def _dq(packed, scale):
    n, half = packed.shape
    q = torch.empty(n, 2 * half, dtype=torch.float32, device=packed.device)
    q[:, 0::2] = (packed & 15).float()
    q[:, 1::2] = (packed >> 4).float()
    return ((q - 8).view(n, scale.shape[1], -1) * scale.float()[:, :, None]).view(n, -1).to(torch.bfloat16)


def custom_kernel(inputs):
    x = inputs["x"]
    kc, vc, bt = inputs["k_cache"], inputs["v_cache"], inputs["block_table"]
    cu, prefix = inputs["cu_seqlens"].tolist(), inputs["prefix_lens"].tolist()
    eps, theta, topk = inputs["eps"], inputs["theta"], inputs["topk"]
    T = x.shape[0]
    page, Hkv, D = kc.shape[1:]
    Hq = inputs["wo"].shape[1] // D
    g = Hq // Hkv

    o = torch.empty(T, Hq, D, dtype=torch.bfloat16, device=x.device)
    q, k, v = F.linear(_norm(x, inputs["attn_norm"], eps), inputs["wqkv"]).split([Hq * D, Hkv * D, Hkv * D], -1)
    q, k, v = q.reshape(T, Hq, D), k.reshape(T, Hkv, D), v.reshape(T, Hkv, D)
    for b, P in enumerate(prefix):
        s0, s1 = cu[b], cu[b + 1]
        n = s1 - s0
        pos = torch.arange(P, P + n, device=x.device)
        qb, kb = _rope(q[s0:s1], pos, theta), _rope(k[s0:s1], pos, theta)
        pg = bt[b].long()[pos // page]
        kc[pg, pos % page] = kb
        vc[pg, pos % page] = v[s0:s1]
        qh = qb.float().permute(1, 0, 2) * D**-0.5  # [Hq, n, D]
        Kn = kb.float().repeat_interleave(g, 1).permute(1, 0, 2)
        Vn = v[s0:s1].float().repeat_interleave(g, 1).permute(1, 0, 2)
        if P:
            pages = bt[b, : (P + page - 1) // page].long()
            Kp = kc[pages].reshape(-1, Hkv, D)[:P].float().repeat_interleave(g, 1).permute(1, 0, 2)
            Vp = vc[pages].reshape(-1, Hkv, D)[:P].float().repeat_interleave(g, 1).permute(1, 0, 2)
        for c0 in range(0, n, CHUNK):  # query chunks bound the score blocks
            c1 = min(n, c0 + CHUNK)
            causal = torch.arange(c1, device=x.device)[None, :] <= torch.arange(c0, c1, device=x.device)[:, None]
            o_new, lse_new = _partial(qh[:, c0:c1], Kn[:, :c1], Vn[:, :c1], causal)
            if P:
                o_pre, lse_pre = _partial(qh[:, c0:c1], Kp, Vp, None)
                lse = torch.logaddexp(lse_pre, lse_new)
                o_new = o_pre * torch.exp(lse_pre - lse)[..., None] + o_new * torch.exp(lse_new - lse)[..., None]
            o[s0 + c0:s0 + c1] = o_new.permute(1, 0, 2).to(torch.bfloat16)

    h = x + F.linear(o.reshape(T, -1), inputs["wo"])
    hn = _norm(h, inputs["ffn_norm"], eps)
    w, ids = torch.softmax(F.linear(hn.float(), inputs["router"].float()), -1).topk(topk, -1)
    w = w / w.sum(-1, keepdim=True)
    I = inputs["w2"].shape[-1] * 2
    acc = torch.zeros(T, x.shape[1], device=x.device)
    for j in reversed(range(topk)):
        for e in ids[:, j].unique().tolist():
            t = (ids[:, j] == e).nonzero().squeeze(1)
            gu = (hn[t] @ _dq(inputs["w13"][e], inputs["w13_scale"][e]).T).float()
            act = ((F.silu(gu[:, :I]) * gu[:, I:]) * w[t, j, None]).to(torch.bfloat16)
            acc[t] += (act @ _dq(inputs["w2"][e], inputs["w2_scale"][e]).T).float()
    return (h.float() + acc).to(torch.bfloat16)
