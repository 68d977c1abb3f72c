"""A correct, simple starting point for muse_attention_decode: gather the pages, mask, fp32 softmax.

Every request gathers all max_pages entries of its block_table row (entries past its own pages are
valid page indices of garbage pages), positions at or past seq_lens[b] are masked out, and the
softmax runs in float32. No host synchronisation, so it can be captured in a CUDA graph. It moves
far more memory than it needs to (every row is padded to the longest request, in float32): beating
it is the point.
"""

import torch


def custom_kernel(inputs: dict) -> torch.Tensor:
    q = inputs["q"]  # [B, Hq, D] bf16
    k_cache, v_cache = inputs["k_cache"], inputs["v_cache"]  # [pages, page, Hkv, D] bf16
    block_table = inputs["block_table"]  # [B, max_pages] int32
    seq_lens = inputs["seq_lens"]  # [B] int32
    scale = inputs["scale"]  # float, 1/sqrt(D)

    B, Hq, D = q.shape
    _, page, Hkv, _ = k_cache.shape
    G = Hq // Hkv  # query heads per KV head: head h reads KV head h // G
    T = block_table.shape[1] * page

    idx = block_table.long()
    k = k_cache[idx].reshape(B, T, Hkv, D).float()  # token t of row b = page block_table[b, t // page], slot t % page
    v = v_cache[idx].reshape(B, T, Hkv, D).float()
    scores = torch.einsum("bhgd,bthd->bhgt", q.float().view(B, Hkv, G, D), k) * scale
    past = torch.arange(T, device=q.device)[None, :] >= seq_lens[:, None]  # [B, T]
    scores = scores.masked_fill(past[:, None, None, :], float("-inf"))
    p = torch.softmax(scores, dim=-1)
    o = torch.einsum("bhgt,bthd->bhgd", p, v)  # [B, Hkv, G, D]
    return o.reshape(B, Hq, D).to(torch.bfloat16)
