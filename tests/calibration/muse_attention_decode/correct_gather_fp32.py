"""Per-request gather of exactly seq_len tokens through block_table, float32 softmax (host loop over requests)."""
import torch


def custom_kernel(inputs):
    q, kc, vc = inputs["q"], inputs["k_cache"], inputs["v_cache"]
    bt, lens, scale = inputs["block_table"], inputs["seq_lens"].tolist(), inputs["scale"]
    B, Hq, D = q.shape
    _, page, Hkv, _ = kc.shape
    G = Hq // Hkv
    out = torch.empty(B, Hq, D, dtype=torch.bfloat16, device=q.device)
    for b in reversed(range(B)):
        n = lens[b]
        tok = torch.arange(n, device=q.device)
        pages = bt[b].long()[tok // page]
        k = kc[pages, tok % page].float()  # [n, Hkv, D]
        v = vc[pages, tok % page].float()
        kh = k.repeat_interleave(G, dim=1).transpose(0, 1)  # [Hq, n, D]
        vh = v.repeat_interleave(G, dim=1).transpose(0, 1)
        s = torch.bmm(kh, q[b].float().unsqueeze(-1)).squeeze(-1) * scale  # [Hq, n]
        p = torch.softmax(s, dim=-1)
        out[b] = torch.bmm(p.unsqueeze(1), vh).squeeze(1).to(torch.bfloat16)
    return out
