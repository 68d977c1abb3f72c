"""The organizers' muse_attention_decode (issue 18): paged GQA decode in one launch, split by fixed-size
chunks of the context, the splits merged by the last one to finish.

The baseline (SGLang's design) gives every request the same number of splits, so a request of 31k tokens
has splits 14x as long as one of 2.2k in the same batch, and merges the splits in a second kernel. Here:
- Every split is CHUNK tokens of one request and one KV head (all G query heads of the group in one
  tile), so every program of a ragged batch does the same work; the grid covers the longest context the
  block table can hold (shapes only: capturable in a CUDA graph) and programs past a request's end return
  at once.
- Each split writes its unnormalised partial (running max m, sum l and acc, fp32), then takes a ticket
  from its (request, KV head)'s counter; the last of the request's ceil(len / CHUNK) splits merges them in
  split order (deterministic whoever arrives last), writes the output and resets the counter for the next
  call. No second launch.
- The merge is two passes over the parts in tiles of SB splits: the maximum of m, then the weighted sums,
  so its loads are independent and in flight together (a one-split-at-a-time merge would walk dependent
  loads on the critical path of B1).
CHUNK, BLOCK_N (tokens per step), warps and stages per batch size are data (CONFIGS), searched on the H200
under the evaluator's timing (`python benchmarks/tune_solutions.py muse_attention_decode --write`).

On a CPU (Triton's interpreter, where a bf16 tl.dot is wrong and a float32 -> bf16 cast truncates) the dots
run in float32 and the output is written in float32 and rounded by torch.
"""

import math

import torch
import triton
import triton.language as tl

# batch size (the nearest tuned) -> tiling; CHUNK is a multiple of BLOCK_N.
CONFIGS = {
    1: {"CHUNK": 256, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3},
    16: {"CHUNK": 1024, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3},
    32: {"CHUNK": 1024, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3},
}
SB = 4  # splits per tile of the merge ([SB, G_PAD, D] fp32: its registers count for the whole kernel)


@triton.jit
def _decode(q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, out_ptr, acc_ptr, ml_ptr, ticket_ptr, qk_scale,
            stride_kp, stride_ks, stride_kh, stride_bt, Hkv, max_splits,
            G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, CHUNK: tl.constexpr,
            BLOCK_N: tl.constexpr, SB: tl.constexpr, F32: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(lens_ptr + b)
    start = split * CHUNK
    if start >= seq_len:
        return
    end = tl.minimum(start + CHUNK, seq_len)
    n_splits = tl.cdiv(seq_len, CHUNK)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D)
    n = tl.arange(0, BLOCK_N)
    g_ok = g < G
    Hq = Hkv * G
    q = tl.load(q_ptr + (b * Hq + kvh * G + g)[:, None] * D + d[None, :], mask=g_ok[:, None], other=0.0)
    if F32:
        q = q.to(tl.float32)
    m = tl.full([G_PAD], float("-inf"), tl.float32)
    l = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    row = bt_ptr + b.to(tl.int64) * stride_bt
    for s in range(start, end, BLOCK_N):
        t = s + n
        ok = t < end
        page = tl.load(row + t // PAGE, mask=ok, other=0).to(tl.int64)
        at = page[:, None] * stride_kp + (t % PAGE)[:, None] * stride_ks + kvh * stride_kh + d[None, :]
        k = tl.load(k_ptr + at, mask=ok[:, None], other=0.0)
        v = tl.load(v_ptr + at, mask=ok[:, None], other=0.0)
        if F32:
            qk = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k))
        qk = tl.where(ok[None, :], qk * qk_scale, float("-inf"))  # log2 domain
        m_new = tl.maximum(m, tl.max(qk, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        if F32:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(tl.bfloat16), v)
        m = m_new
    # this split's partial, then the ticket
    part = (b * Hkv + kvh).to(tl.int64) * max_splits
    tl.store(acc_ptr + ((part + split) * G + g)[:, None] * D + d[None, :], acc, mask=g_ok[:, None])
    tl.store(ml_ptr + ((part + split) * G + g) * 2, m, mask=g_ok)
    tl.store(ml_ptr + ((part + split) * G + g) * 2 + 1, l, mask=g_ok)
    tl.debug_barrier()  # every thread's stores are issued before the ticket is taken (release)
    if tl.atomic_add(ticket_ptr + b * Hkv + kvh, 1, sem="acq_rel") == n_splits - 1:
        sb = tl.arange(0, SB)
        top = tl.full([G_PAD], float("-inf"), tl.float32)
        for s0 in range(0, n_splits, SB):
            at = ((part + s0 + sb)[:, None] * G + g[None, :]) * 2
            keep = ((s0 + sb) < n_splits)[:, None] & g_ok[None, :]
            top = tl.maximum(top, tl.max(tl.load(ml_ptr + at, mask=keep, other=float("-inf"), cache_modifier=".cg"), 0))
        top = tl.where(g_ok, top, 0.0)
        total_l = tl.zeros([G_PAD], tl.float32)
        total = tl.zeros([G_PAD, D], tl.float32)
        for s0 in range(0, n_splits, SB):
            at = ((part + s0 + sb)[:, None] * G + g[None, :]) * 2
            keep = ((s0 + sb) < n_splits)[:, None] & g_ok[None, :]
            ms = tl.load(ml_ptr + at, mask=keep, other=float("-inf"), cache_modifier=".cg")
            ls = tl.load(ml_ptr + at + 1, mask=keep, other=0.0, cache_modifier=".cg")
            w = tl.where(keep, tl.exp2(ms - top[None, :]), 0.0)  # [SB, G_PAD]
            total_l += tl.sum(ls * w, 0)
            rows = (part + s0 + sb)[:, None] * G + g[None, :]  # [SB, G_PAD]
            parts = tl.load(acc_ptr + rows[:, :, None] * D + d[None, None, :], mask=keep[:, :, None], other=0.0,
                            cache_modifier=".cg")
            total += tl.sum(w[:, :, None] * parts, 0)
        o = total / tl.where(g_ok, total_l, 1.0)[:, None]
        dst = out_ptr + (b * Hq + kvh * G + g)[:, None] * D + d[None, :]
        if F32:
            tl.store(dst, o, mask=g_ok[:, None])
        else:
            tl.store(dst, o.to(tl.bfloat16), mask=g_ok[:, None])
        tl.atomic_xchg(ticket_ptr + b * Hkv + kvh, 0)  # ready for the next call (and the next graph replay)


_TICKETS: dict = {}


def _tickets(n: int, device: torch.device) -> torch.Tensor:
    """One zeroed int32 counter per (request, KV head), kept between calls (each call leaves them at zero)."""
    key = (device, n)
    if key not in _TICKETS:
        _TICKETS[key] = torch.zeros(n, dtype=torch.int32, device=device)
    return _TICKETS[key]


def config_for(batch: int) -> dict:
    return dict(CONFIGS[min(CONFIGS, key=lambda k: (abs(k - batch), k))])


def custom_kernel(inputs: dict, config: dict | None = None) -> torch.Tensor:
    # K and V are read at the same offsets: both contiguous (a no-op for the problem's inputs)
    q, k_cache, v_cache = inputs["q"].contiguous(), inputs["k_cache"].contiguous(), inputs["v_cache"].contiguous()
    block_table, seq_lens = inputs["block_table"], inputs["seq_lens"]
    B, Hq, D = q.shape
    _, page, Hkv, _ = k_cache.shape
    G = Hq // Hkv
    cfg = config or config_for(B)
    chunk, block_n = int(cfg["CHUNK"]), int(cfg["BLOCK_N"])
    if chunk % block_n:
        raise ValueError(f"CHUNK {chunk} must be a multiple of BLOCK_N {block_n}")
    interpreting = q.device.type != "cuda"
    launch = {} if interpreting else {"num_warps": int(cfg["num_warps"]), "num_stages": int(cfg["num_stages"])}
    max_splits = triton.cdiv(block_table.shape[1] * page, chunk)  # shapes only: no host synchronisation
    acc = torch.empty(B * Hkv * max_splits * G * D, dtype=torch.float32, device=q.device)
    ml = torch.empty(B * Hkv * max_splits * G * 2, dtype=torch.float32, device=q.device)
    out = torch.empty(B, Hq, D, dtype=torch.float32 if interpreting else q.dtype, device=q.device)
    _decode[(B, Hkv, max_splits)](
        q, k_cache, v_cache, block_table, seq_lens, out, acc, ml, _tickets(B * Hkv, q.device),
        float(inputs["scale"]) * math.log2(math.e), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_table.stride(0), Hkv, max_splits, G=G, G_PAD=max(16, triton.next_power_of_2(G)), D=D, PAGE=page,
        CHUNK=chunk, BLOCK_N=block_n, SB=SB, F32=interpreting, **launch)
    return out.to(q.dtype)
