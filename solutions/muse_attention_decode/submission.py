"""The organizers' muse_attention_decode (issue 18): paged GQA decode split by fixed-size chunks of the
context, so every program of a ragged batch does the same work, and a one-shot merge of the splits.

The baseline (SGLang's design) gives every request of a batch the same number of splits, so a request of 31k
tokens has splits 14x as long as one of 2.2k in the same batch, and its merge walks the splits one after the
other. Here:
- Every split is CHUNK tokens of one request and one KV head (all G query heads of the group in one tile, so
  K and V are read once for the five), so every program does the same work; the grid covers the longest
  context the block table can hold (shapes only: capturable in a CUDA graph) and programs past a request's
  end return at once. Each writes its unnormalised partial (running max m, sum l, accumulator; fp32).
- The merge, one program per (request, query head), loads all of that head's splits in one [S, D] tile
  (independent loads, in flight together), takes the maximum, weights, sums: one round trip to memory
  rather than one per split.
(A first version merged in the same launch, the last split to finish taking a ticket from a counter; on an
H100 it was slower at every CHUNK, its merge walking the splits in dependent steps, and one of its two
official evaluations came out incorrect, so the merge is a kernel of its own: no cross-program protocol.)
CHUNK, the tokens per step (BLOCK_N), warps and stages per batch size are data (CONFIGS), and so are the merge's
columns a program (MERGE_BD, default D: one program a head) and warps (merge_warps, default 8), and PDL: the merge
launched with Hopper's programmatic dependent launch while the splits run (it waits on the device for their end
before it reads; the splits' kernel, the call's first, is always a plain launch), searched on the GPU under the
evaluator's timing (`python benchmarks/tune_solutions.py muse_attention_decode --write`).

On a CPU (Triton's interpreter, where a bf16 tl.dot is wrong and a float32 -> bf16 cast truncates) the dots
run in float32 and the output is written in float32 and rounded by torch.
"""

import math

import torch
import triton
import triton.language as tl

# batch size (the nearest tuned) -> tiling; CHUNK is a multiple of BLOCK_N.
# searched on NVIDIA H100 80GB HBM3, 2026-12-06 (benchmarks/tune_solutions.py --write)
CONFIGS = {
    1: {
        "CHUNK": 256,
        "BLOCK_N": 32,
        "num_warps": 4,
        "num_stages": 3,
        "MERGE_BD": 32,
        "merge_warps": 2,
        "PDL": 1,
    },
    16: {
        "CHUNK": 2048,
        "BLOCK_N": 32,
        "num_warps": 4,
        "num_stages": 2,
        "MERGE_BD": 64,
        "merge_warps": 2,
        "PDL": 0,
    },
    32: {
        "CHUNK": 1024,
        "BLOCK_N": 64,
        "num_warps": 4,
        "num_stages": 2,
        "MERGE_BD": 128,
        "merge_warps": 2,
        "PDL": 1,
    },
}
MAX_SPLITS = 128  # the merge holds a request's splits in one tile: CHUNK grows to keep them within this


@triton.jit
def _decode(q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, acc_ptr, m_ptr, l_ptr, qk_scale,
            stride_kp, stride_ks, stride_kh, stride_bt, Hkv, max_splits,
            G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, CHUNK: tl.constexpr,
            BLOCK_N: tl.constexpr, F32: tl.constexpr, PDL: tl.constexpr = False):
    if PDL:  # the merge may be launched now: it waits (gdc_wait) for this grid's end and its writes
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(lens_ptr + b)
    start = split * CHUNK
    if start >= seq_len:
        return
    end = tl.minimum(start + CHUNK, seq_len)
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
    part = ((b * Hkv + kvh).to(tl.int64) * max_splits + split) * G + g  # [G_PAD] rows of the partials
    tl.store(acc_ptr + part[:, None] * D + d[None, :], acc, mask=g_ok[:, None])
    tl.store(m_ptr + part, m, mask=g_ok)
    tl.store(l_ptr + part, l, mask=g_ok)


@triton.jit
def _merge(lens_ptr, out_ptr, acc_ptr, m_ptr, l_ptr, Hkv, max_splits, G: tl.constexpr, D: tl.constexpr,
           CHUNK: tl.constexpr, S: tl.constexpr, BD: tl.constexpr, F32: tl.constexpr, PDL: tl.constexpr = False):
    """out[b, h, BD columns] from the n = ceil(len / CHUNK) partials of request b's head h, all loaded at once
    (D // BD programs a head share its splits' columns: more SMs reading a batch of few heads). PDL: launched
    while _decode runs (programmatic dependent launch), it waits for _decode's end before reading anything."""
    if PDL:
        tl.extra.cuda.gdc_wait()
    b = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // G
    n = tl.cdiv(tl.load(lens_ptr + b), CHUNK)
    s = tl.arange(0, S)
    d = tl.program_id(2) * BD + tl.arange(0, BD)
    ok = s < n
    rows = ((b * Hkv + kvh).to(tl.int64) * max_splits + s) * G + (h - kvh * G)
    m = tl.load(m_ptr + rows, mask=ok, other=float("-inf"))
    l = tl.load(l_ptr + rows, mask=ok, other=0.0)
    parts = tl.load(acc_ptr + rows[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
    w = tl.where(ok, tl.exp2(m - tl.max(m, 0)), 0.0)
    o = tl.sum(w[:, None] * parts, 0) / tl.sum(w * l, 0)
    dst = out_ptr + (b * Hkv * G + h).to(tl.int64) * D + d
    if F32:
        tl.store(dst, o)
    else:
        tl.store(dst, o.to(tl.bfloat16))


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
    max_tokens = block_table.shape[1] * page  # shapes only: no host synchronisation
    chunk = max(chunk, triton.cdiv(triton.cdiv(max_tokens, MAX_SPLITS), block_n) * block_n)
    max_splits = triton.cdiv(max_tokens, chunk)
    interpreting = q.device.type != "cuda"
    launch = {} if interpreting else {"num_warps": int(cfg["num_warps"]), "num_stages": int(cfg["num_stages"])}
    pdl = bool(cfg.get("PDL", 0)) and not interpreting  # Hopper's programmatic dependent launch of the merge
    acc = torch.empty(B * Hkv * max_splits * G * D, dtype=torch.float32, device=q.device)
    m = torch.empty(B * Hkv * max_splits * G, dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    out = torch.empty(B, Hq, D, dtype=torch.float32 if interpreting else q.dtype, device=q.device)
    _decode[(B, Hkv, max_splits)](
        q, k_cache, v_cache, block_table, seq_lens, acc, m, l, float(inputs["scale"]) * math.log2(math.e),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_table.stride(0), Hkv, max_splits, G=G,
        G_PAD=max(16, triton.next_power_of_2(G)), D=D, PAGE=page, CHUNK=chunk, BLOCK_N=block_n, F32=interpreting,
        PDL=pdl, **launch)
    bd = min(int(cfg.get("MERGE_BD", D)), D)  # the smoke model's heads are narrower
    if D % bd:
        raise ValueError(f"MERGE_BD {bd} must divide the head dimension {D}")
    _merge[(B, Hq, D // bd)](seq_lens, out, acc, m, l, Hkv, max_splits, G=G, D=D, CHUNK=chunk,
                             S=max(2, triton.next_power_of_2(max_splits)), BD=bd, F32=interpreting, PDL=pdl,
                             **({} if interpreting else {"num_warps": int(cfg.get("merge_warps", 8))}),
                             **({"launch_pdl": True} if pdl else {}))
    return out.to(q.dtype)
