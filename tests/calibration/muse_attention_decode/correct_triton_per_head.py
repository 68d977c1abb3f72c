"""A Triton kernel, one program per (request, query head), one pass over the tokens with an fp32 online softmax."""
import torch
import triton
import triton.language as tl


@triton.jit
def _decode(q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, out_ptr, scale, Hq, max_pages,
            G: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // G
    n = tl.load(lens_ptr + b)
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BLOCK_N)
    q = tl.load(q_ptr + (b * Hq + h) * D + offs_d).to(tl.float32)
    m = float("-inf")
    l = 0.0
    acc = tl.zeros([D], tl.float32)
    for s in range(0, n, BLOCK_N):
        tok = s + offs_n
        ok = tok < n
        pg = tl.load(bt_ptr + b * max_pages + tok // PAGE, mask=ok, other=0).to(tl.int64)
        row = (pg * PAGE + tok % PAGE) * HKV + kvh
        k = tl.load(k_ptr + row[:, None] * D + offs_d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        v = tl.load(v_ptr + row[:, None] * D + offs_d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        sc = tl.sum(k * q[None, :], axis=1) * scale
        sc = tl.where(ok, sc, float("-inf"))
        m_new = tl.maximum(m, tl.max(sc, axis=0))
        alpha = tl.exp(m - m_new)
        p = tl.exp(sc - m_new)
        l = l * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m = m_new
    # float32 out: the CPU interpreter truncates float32 -> bf16 casts; torch rounds to nearest.
    tl.store(out_ptr + (b * Hq + h) * D + offs_d, acc / l)


def custom_kernel(inputs):
    q, kc, vc = inputs["q"], inputs["k_cache"], inputs["v_cache"]
    bt, lens = inputs["block_table"].contiguous(), inputs["seq_lens"]
    B, Hq, D = q.shape
    _, page, Hkv, _ = kc.shape
    out = torch.empty(B, Hq, D, dtype=torch.float32, device=q.device)
    _decode[(B, Hq)](q, kc, vc, bt, lens, out, float(inputs["scale"]), Hq, bt.shape[1],
                     G=Hq // Hkv, HKV=Hkv, D=D, PAGE=page, BLOCK_N=128)
    return out.to(torch.bfloat16)
