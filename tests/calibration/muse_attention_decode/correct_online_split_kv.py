"""Split-KV online softmax in fp32 over 64-token blocks, P rounded to bf16 before P@V (as flash kernels do), LSE merge."""
import torch

BLOCK = 64
SPLITS = 3


def _partial(qg, k, v, scale):
    """qg [Hkv, G, D] fp32; k, v [n, Hkv, D] bf16 -> (m, l, acc) of an online softmax over the n tokens."""
    Hkv, G, D = qg.shape
    m = torch.full((Hkv, G), float("-inf"), device=qg.device)
    l = torch.zeros(Hkv, G, device=qg.device)
    acc = torch.zeros(Hkv, G, D, device=qg.device)
    for s0 in range(0, k.shape[0], BLOCK):
        kb, vb = k[s0:s0 + BLOCK].float(), v[s0:s0 + BLOCK].float()
        s = torch.einsum("hgd,nhd->hgn", qg, kb) * scale
        m_new = torch.maximum(m, s.amax(-1))
        alpha = torch.exp(m - m_new)
        p = torch.exp(s - m_new[..., None])
        l = l * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + torch.einsum("hgn,nhd->hgd", p.to(torch.bfloat16).float(), vb)
        m = m_new
    return m, l, acc


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
        k = kc[pages].reshape(-1, Hkv, D)[:n]
        v = vc[pages].reshape(-1, Hkv, D)[:n]
        qg = q[b].float().view(Hkv, G, D)
        per = -(-n // SPLITS)
        parts = [_partial(qg, k[i:i + per], v[i:i + per], scale) for i in range(0, n, per)]
        m_all = torch.stack([p[0] for p in parts]).amax(0)
        l_all = sum(p[1] * torch.exp(p[0] - m_all) for p in parts)
        acc = sum(p[2] * torch.exp(p[0] - m_all)[..., None] for p in parts)
        out[b] = (acc / l_all[..., None]).reshape(Hq, D).to(torch.bfloat16)
    return out
