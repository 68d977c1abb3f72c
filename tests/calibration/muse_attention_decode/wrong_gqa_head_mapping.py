"""Wrong GQA mapping: query head h reads KV head h % Hkv instead of h // (Hq // Hkv)."""
import torch


def custom_kernel(inputs):
    q, kc, vc = inputs["q"], inputs["k_cache"], inputs["v_cache"]
    bt, scale = inputs["block_table"], inputs["scale"]
    B, Hq, D = q.shape
    _, page, Hkv, _ = kc.shape
    T = bt.shape[1] * page
    kv_head = torch.arange(Hq, device=q.device) % Hkv
    k = kc[bt.long()].reshape(B, T, Hkv, D)[:, :, kv_head].float()  # [B, T, Hq, D]
    v = vc[bt.long()].reshape(B, T, Hkv, D)[:, :, kv_head].float()
    s = torch.einsum("bhd,bthd->bht", q.float(), k) * scale
    past = torch.arange(T, device=q.device)[None, :] >= inputs["seq_lens"][:, None]
    s = s.masked_fill(past[:, None, :], float("-inf"))
    o = torch.einsum("bht,bthd->bhd", torch.softmax(s, dim=-1), v)
    return o.to(torch.bfloat16)
