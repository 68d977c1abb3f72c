"""Off-by-one context length: attends to seq_len + 1 tokens (reads one stale slot past the end)."""
import torch


def custom_kernel(inputs):
    q, kc, vc = inputs["q"], inputs["k_cache"], inputs["v_cache"]
    bt, scale = inputs["block_table"], inputs["scale"]
    B, Hq, D = q.shape
    _, page, Hkv, _ = kc.shape
    G = Hq // Hkv
    T = bt.shape[1] * page
    k = kc[bt.long()].reshape(B, T, Hkv, D).float()
    v = vc[bt.long()].reshape(B, T, Hkv, D).float()
    s = torch.einsum("bhgd,bthd->bhgt", q.float().view(B, Hkv, G, D), k) * scale
    past = torch.arange(T, device=q.device)[None, :] > inputs["seq_lens"][:, None]
    s = s.masked_fill(past[:, None, None, :], float("-inf"))
    o = torch.einsum("bhgt,bthd->bhgd", torch.softmax(s, dim=-1), v)
    return o.reshape(B, Hq, D).to(torch.bfloat16)
