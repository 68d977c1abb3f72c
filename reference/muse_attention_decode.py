"""muse_attention_decode: GQA decode attention over a paged KV cache.

Inputs (see problems/muse_attention_decode/README.md):
  q            [B, Hq, D]              bf16   one query token per request
  k_cache      [pages, page, Hkv, D]   bf16   the shared pool of KV pages
  v_cache      [pages, page, Hkv, D]   bf16
  block_table  [B, max_pages]          int32  physical page of each logical page of a request
  seq_lens     [B]                     int32  tokens in each request's context (>= 1)
  scale        Python float            1/sqrt(D)
Output o [B, Hq, D] bf16: o[b, h] = softmax(scale * q[b, h] . K_b^T) @ V_b over the first seq_lens[b]
tokens of request b, with query head h reading KV head h // (Hq // Hkv).

Cache layout facts (decided here, documented in the README, relied on by the layer problems):
- The pool holds the pages every request needs plus `spare_pages` unused pages; the pages of all
  requests are one random permutation of the pool, so a request's pages are scattered.
- Token t of request b lives at k_cache[block_table[b, t // page], t % page].
- block_table has ceil(max(seq_lens) / page) + 1 columns, so every row has at least one entry past
  its request's pages; those entries hold valid indices of spare pages (never -1), whose contents
  are garbage.
- Valid tokens are N(0, 1); every other slot of the pool (spare pages, the unused tail of a request's
  last page) holds garbage N(0, GARBAGE_STD^2), so a kernel that reads one token too many shows it.

Also the building blocks other problems import: `attention_decode_ref`, `make_paged_cache`,
`decode_lengths`.
"""

from __future__ import annotations

import math
import random

import torch

GARBAGE_STD = 4.0  # scale of the values in slots no request owns
Q_STD = 2.0  # q ~ N(0, Q_STD^2): scores scale*q.k then have std 2, a peaked softmax like a trained model's
TABLE_PAD = 1  # block_table columns beyond the longest request's pages


def decode_lengths(B: int) -> list[int]:
    """The context lengths of the B16/B32 workloads: drawn once, log-uniform in [2048, 32768]."""
    rng = random.Random(f"muse_attention_decode/B{B}")
    return [int(round(math.exp(rng.uniform(math.log(2048), math.log(32768))))) for _ in range(B)]


def _pages_needed(n: int, page: int) -> int:
    return -(-n // page)


def make_paged_cache(seq_lens: list[int], shape, gen: torch.Generator, device, spare_pages: int = 8):
    """A scattered paged KV cache: (k_cache, v_cache, block_table).

    k_cache, v_cache: [pages, page, Hkv, D] bf16 with pages = sum(ceil(len/page)) + spare_pages; the
    first seq_lens[b] tokens of request b are N(0, 1), every other slot is garbage N(0, GARBAGE_STD^2).
    block_table: [B, ceil(max(seq_lens)/page) + 1] int32; entries past a request's pages point at
    random spare pages (or, with spare_pages = 0, at random pages of the pool), never -1.
    """
    page, Hkv, D = int(shape["page"]), int(shape["Hkv"]), int(shape["D"])
    lens = [int(n) for n in seq_lens]
    if not lens or min(lens) < 0:
        raise ValueError(f"seq_lens must be a non-empty list of lengths >= 0, got {seq_lens}")
    B = len(lens)
    needed = [_pages_needed(n, page) for n in lens]
    used = sum(needed)
    num_pages = used + int(spare_pages)
    if num_pages == 0:
        num_pages = 1
    width = max(needed) + TABLE_PAD
    perm = torch.randperm(num_pages, generator=gen, device=device).to(torch.int32)
    spare = perm[used:] if num_pages > used else perm
    pad_idx = torch.randint(0, spare.numel(), (B, width), generator=gen, device=device)
    block_table = spare[pad_idx].contiguous()
    valid = torch.zeros(num_pages * page, dtype=torch.bool, device=device)
    offset = 0
    for b, (n, n_pages) in enumerate(zip(lens, needed)):
        mine = perm[offset:offset + n_pages]
        block_table[b, :n_pages] = mine
        offset += n_pages
        if n:
            tok = torch.arange(n, device=device)
            slots = mine.long().repeat_interleave(page)[:n] * page + tok % page
            valid[slots] = True
    std = torch.where(valid, 1.0, GARBAGE_STD).view(num_pages, page, 1, 1)
    caches = []
    for _ in range(2):
        x = torch.randn(num_pages, page, Hkv, D, generator=gen, device=device, dtype=torch.float32)
        caches.append((x * std).to(torch.bfloat16))
    return caches[0], caches[1], block_table


def make_inputs(shape, seed: int, device) -> dict:
    g = torch.Generator(device=device).manual_seed(seed)
    lens = [int(n) for n in shape["seq_lens"]]
    if "B" in shape.params and int(shape["B"]) != len(lens):
        raise ValueError(f"{shape.name}: B = {shape['B']} but {len(lens)} seq_lens")
    Hq, D = int(shape["Hq"]), int(shape["D"])
    k_cache, v_cache, block_table = make_paged_cache(lens, shape, g, device)
    q = (torch.randn(len(lens), Hq, D, generator=g, device=device, dtype=torch.float32) * Q_STD).to(torch.bfloat16)
    return {
        "q": q,
        "k_cache": k_cache,
        "v_cache": v_cache,
        "block_table": block_table,
        "seq_lens": torch.tensor(lens, dtype=torch.int32, device=device),
        "scale": float(D) ** -0.5,
    }


def attention_decode_ref(q, k_cache, v_cache, block_table, seq_lens, scale) -> torch.Tensor:
    """float32 [B, Hq, D]: exact softmax attention computed in float64, one request at a time."""
    B, Hq, D = q.shape
    _, page, Hkv, _ = k_cache.shape
    G = Hq // Hkv
    out = torch.empty(B, Hq, D, dtype=torch.float32, device=q.device)
    lens = [int(n) for n in seq_lens.tolist()]
    for b, n in enumerate(lens):
        pages = block_table[b, :_pages_needed(n, page)].long()
        k = k_cache[pages].reshape(-1, Hkv, D)[:n].double()  # [n, Hkv, D]
        v = v_cache[pages].reshape(-1, Hkv, D)[:n].double()
        qb = q[b].double().view(Hkv, G, D)
        scores = torch.einsum("hgd,nhd->hgn", qb, k) * float(scale)
        p = torch.softmax(scores, dim=-1)
        out[b] = torch.einsum("hgn,nhd->hgd", p, v).reshape(Hq, D).float()
    return out


def reference(inputs: dict) -> torch.Tensor:
    return attention_decode_ref(inputs["q"], inputs["k_cache"], inputs["v_cache"], inputs["block_table"],
                                inputs["seq_lens"], inputs["scale"])


# ---------------------------------------------------------------------------------------------
# The baseline: a split-KV paged decode kernel in Triton (the design SGLang's Triton backend uses:
# one program per (request, KV head, KV split) computing all the query heads of the group, then a
# log-sum-exp merge of the splits). Graph-capturable: no host synchronisation, the split count comes
# from shapes only. Without CUDA it falls back to a batched PyTorch path (the interpreter is slow).

try:  # triton is optional where only the CPU fallback is used
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

if triton is not None:

    @triton.jit
    def _split_kv_stage1(q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, o_part_ptr, lse_part_ptr, qk_scale,
                         stride_qb, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
                         stride_bt, Hq,
                         G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
                         BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, UPCAST: tl.constexpr,
                         DOT_PRECISION: tl.constexpr):
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        seq_len = tl.load(lens_ptr + b)
        per_split = tl.cdiv(tl.cdiv(seq_len, SPLITS), BLOCK_N) * BLOCK_N
        start = split * per_split
        end = tl.minimum(start + per_split, seq_len)
        offs_g = tl.arange(0, G_PAD)
        offs_d = tl.arange(0, D)
        offs_n = tl.arange(0, BLOCK_N)
        heads = kvh * G + offs_g
        g_ok = offs_g < G
        q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=g_ok[:, None], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        m = tl.full([G_PAD], float("-inf"), tl.float32)
        l = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, D], tl.float32)
        for s in range(start, end, BLOCK_N):
            toks = s + offs_n
            ok = toks < end
            pg = tl.load(bt_ptr + b * stride_bt + toks // PAGE, mask=ok, other=0).to(tl.int64)
            slot = toks % PAGE
            k = tl.load(k_ptr + pg[:, None] * stride_kp + slot[:, None] * stride_ks + kvh * stride_kh + offs_d[None, :],
                        mask=ok[:, None], other=0.0)
            v = tl.load(v_ptr + pg[:, None] * stride_vp + slot[:, None] * stride_vs + kvh * stride_vh + offs_d[None, :],
                        mask=ok[:, None], other=0.0)
            if UPCAST:  # the CPU interpreter's bf16 tl.dot is wrong (Triton 3.9)
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [G_PAD, BLOCK_N], log2 domain
            qk = tl.where(ok[None, :], qk, float("-inf"))
            m_new = tl.maximum(m, tl.max(qk, 1))
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(qk - m_new[:, None])
            l = l * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m = m_new
        keep = g_ok & (offs_g * 0 + start < seq_len)  # [G_PAD]: real heads of a non-empty split
        safe_l = tl.where(l > 0, l, 1.0)
        row = (b * Hq + heads) * SPLITS + split
        tl.store(o_part_ptr + row[:, None] * D + offs_d[None, :], acc / safe_l[:, None],
                 mask=keep[:, None] & (offs_d[None, :] < D))
        tl.store(lse_part_ptr + row, m + tl.log2(safe_l), mask=keep)

    @triton.jit
    def _split_kv_stage2(o_part_ptr, lse_part_ptr, lens_ptr, out_ptr, Hq,
                         D: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        seq_len = tl.load(lens_ptr + b)
        per_split = tl.cdiv(tl.cdiv(seq_len, SPLITS), BLOCK_N) * BLOCK_N
        offs_d = tl.arange(0, D)
        m = float("-inf")
        l = 0.0
        acc = tl.zeros([D], tl.float32)
        for s in range(SPLITS):
            if s * per_split < seq_len:
                row = (b * Hq + h) * SPLITS + s
                lse = tl.load(lse_part_ptr + row)
                o = tl.load(o_part_ptr + row * D + offs_d)
                m_new = tl.maximum(m, lse)
                alpha = tl.exp2(m - m_new)
                beta = tl.exp2(lse - m_new)
                acc = acc * alpha + o * beta
                l = l * alpha + beta
                m = m_new
        tl.store(out_ptr + (b * Hq + h) * D + offs_d, (acc / l).to(out_ptr.dtype.element_ty))


def split_kv_decode(q, k_cache, v_cache, block_table, seq_lens, scale, splits: int | None = None,
                    block_n: int = 128, num_warps: int = 4, num_stages: int = 2) -> torch.Tensor:
    """The Triton split-KV decode (bf16 out). On a CPU it runs in the interpreter (set TRITON_INTERPRET=1).

    Default split count (shapes only, so no host sync): about 16 programs per SM, at most 32 splits,
    and at least 512 tokens of block_table capacity per split. On an H200 this runs B1 in about
    27 us, B16 in 180 us and B32 in 345 us (floors 16, 152 and 312 us at 4.26 TB/s).
    """
    B, Hq, D = q.shape
    _, page, Hkv, _ = k_cache.shape
    G = Hq // Hkv
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or block_table.stride(-1) != 1:
        raise ValueError("the innermost dimensions must be contiguous")
    if splits is None:
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 4
        max_tokens = block_table.shape[1] * page
        splits = max(1, min(32, -(-16 * sms // (B * Hkv)), -(-max_tokens // 512)))
    o_part = torch.empty(B, Hq, splits, D, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(B, Hq, splits, dtype=torch.float32, device=q.device)
    # The Triton 3.9 interpreter casts float32 -> bf16 by truncation (not round-to-nearest-even as
    # a GPU does), so on a CPU the kernel writes float32 and torch rounds.
    out = torch.empty(B, Hq, D, dtype=q.dtype if q.is_cuda else torch.float32, device=q.device)
    g_pad = max(16, triton.next_power_of_2(G))
    _split_kv_stage1[(B, Hkv, splits)](
        q, k_cache, v_cache, block_table, seq_lens, o_part, lse_part, float(scale) * math.log2(math.e),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_table.stride(0), Hq,
        G=G, G_PAD=g_pad, D=D, PAGE=page, BLOCK_N=block_n, SPLITS=splits, UPCAST=not q.is_cuda,
        DOT_PRECISION="tf32" if q.is_cuda else "ieee",
        num_warps=num_warps, num_stages=num_stages,
    )
    _split_kv_stage2[(B, Hq)](o_part, lse_part, seq_lens, out, Hq, D=D, BLOCK_N=block_n, SPLITS=splits)
    return out.to(q.dtype)


def torch_decode(q, k_cache, v_cache, block_table, seq_lens, scale) -> torch.Tensor:
    """Batched PyTorch decode: gather every row's pages, mask past seq_len, fp32 softmax (bf16 out)."""
    B, Hq, D = q.shape
    _, page, Hkv, _ = k_cache.shape
    G = Hq // Hkv
    P = block_table.shape[1]
    idx = block_table.long()
    k = k_cache[idx].reshape(B, P * page, Hkv, D).float()
    v = v_cache[idx].reshape(B, P * page, Hkv, D).float()
    scores = torch.einsum("bhgd,bthd->bhgt", q.float().view(B, Hkv, G, D), k) * float(scale)
    past = torch.arange(P * page, device=q.device)[None, :] >= seq_lens[:, None]
    scores = scores.masked_fill(past[:, None, None, :], float("-inf"))
    o = torch.einsum("bhgt,bthd->bhgd", torch.softmax(scores, dim=-1), v)
    return o.reshape(B, Hq, D).to(q.dtype)


def baseline(inputs: dict) -> torch.Tensor:
    """The production path: a Triton split-KV paged decode kernel on a GPU; batched PyTorch on a CPU."""
    args = (inputs["q"], inputs["k_cache"], inputs["v_cache"], inputs["block_table"], inputs["seq_lens"],
            inputs["scale"])
    if inputs["q"].is_cuda and triton is not None:
        return split_kv_decode(*args)
    return torch_decode(*args)


def floor(shape) -> dict:
    lens = [int(n) for n in shape["seq_lens"]]
    B, Hq, Hkv, D, page = len(lens), int(shape["Hq"]), int(shape["Hkv"]), int(shape["D"]), int(shape["page"])
    tokens = sum(lens)
    pages = sum(_pages_needed(n, page) for n in lens)
    q_bytes = out_bytes = B * Hq * D * 2
    kv_bytes = tokens * Hkv * D * 2 * 2
    index_bytes = pages * 4 + B * 4  # the block_table entries in use, seq_lens
    return {"bytes": q_bytes + kv_bytes + index_bytes + out_bytes, "flops": 4 * tokens * Hq * D}
