"""Online softmax over 64-token blocks that forgets to rescale the running sum and accumulator when the max grows."""
import torch

BLOCK = 64


def custom_kernel(inputs):
    q, kc, vc = inputs["q"], inputs["k_cache"], inputs["v_cache"]
    bt, lens, scale = inputs["block_table"], inputs["seq_lens"].tolist(), inputs["scale"]
    B, Hq, D = q.shape
    _, page, Hkv, _ = kc.shape
    G = Hq // Hkv
    out = torch.empty(B, Hq, D, dtype=torch.bfloat16, device=q.device)
    for b in range(B):
        n = lens[b]
        pages = bt[b, : -(-n // page)].long()
        k = kc[pages].reshape(-1, Hkv, D)[:n].float()
        v = vc[pages].reshape(-1, Hkv, D)[:n].float()
        qg = q[b].float().view(Hkv, G, D)
        m = torch.full((Hkv, G), float("-inf"), device=q.device)
        l = torch.zeros(Hkv, G, device=q.device)
        acc = torch.zeros(Hkv, G, D, device=q.device)
        for s0 in range(0, n, BLOCK):
            s = torch.einsum("hgd,nhd->hgn", qg, k[s0:s0 + BLOCK]) * scale
            m = torch.maximum(m, s.amax(-1))
            p = torch.exp(s - m[..., None])
            l = l + p.sum(-1)  # bug: l and acc still hold terms relative to the old max
            acc = acc + torch.einsum("hgn,nhd->hgd", p, v[s0:s0 + BLOCK])
        out[b] = (acc / l[..., None]).reshape(Hq, D).to(torch.bfloat16)
    return out
