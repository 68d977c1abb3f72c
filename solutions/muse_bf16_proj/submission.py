"""The organizers' muse_bf16_proj (issue 18): a skinny GEMM in Triton for decode batch sizes.

out [M, N] = x [M, K] @ w [N, K]^T with M <= 64, N = 7,168, K = 5,120: the 73 MB weight is the whole cost
(x is 10-320 KB), so the kernel's one job is to stream w at the memory's rate. cuBLAS picks tiles made
for larger M (22.7 / 20.4 / 20.7 us at M1 / M16 / M32 on the H200 against a 15.3 us floor). Here each
program owns BN rows of w (the output's columns) and walks K in BK steps with num_stages loads in flight,
all M rows of x in one BM = 16/32/64 tile (x is re-read by every program but lives in L2); SPLIT > 1
shares K between programs for more of them in flight (fp32 parts added in a fixed order by a second
kernel: deterministic, no atomics). The configurations per M are data (CONFIGS) and are tuned on the
H200 under the evaluator's own timing (benchmarks/tune_solutions.py).

On a CPU (Triton's interpreter, where a bf16 tl.dot is wrong) the dot runs in float32."""

import torch
import triton
import triton.language as tl

# M (the nearest tuned) -> tile sizes; BM covers M (the dot needs 16 rows at least).
CONFIGS = {
    1: {"BN": 16, "BK": 256, "SPLIT": 1, "num_warps": 4, "num_stages": 4},
    16: {"BN": 32, "BK": 128, "SPLIT": 1, "num_warps": 4, "num_stages": 4},
    32: {"BN": 32, "BK": 128, "SPLIT": 1, "num_warps": 4, "num_stages": 4},
}


@triton.jit
def _skinny(x_ptr, w_ptr, out_ptr, M, N, K, k_per_split,
            BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr, F32: tl.constexpr):
    pid_n = tl.program_id(0)
    sp = tl.program_id(1)
    rm = tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    m_ok = rm < M
    n_ok = rn < N
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    start = sp * k_per_split
    for k0 in range(start, start + k_per_split, BK):
        a = tl.load(x_ptr + rm[:, None] * K + (k0 + rk)[None, :], mask=m_ok[:, None], other=0.0)
        b = tl.load(w_ptr + rn[:, None].to(tl.int64) * K + (k0 + rk)[None, :], mask=n_ok[:, None], other=0.0)
        if F32:
            acc = tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), acc)
        else:
            acc = tl.dot(a, tl.trans(b), acc)
    keep = m_ok[:, None] & n_ok[None, :]
    if SPLIT == 1:
        tl.store(out_ptr + rm[:, None] * N + rn[None, :], acc.to(tl.bfloat16), mask=keep)
    else:
        tl.store(out_ptr + sp.to(tl.int64) * M * N + rm[:, None] * N + rn[None, :], acc, mask=keep)


@triton.jit
def _sum_splits(part_ptr, out_ptr, MN, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    at = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = at < MN
    acc = tl.zeros([BLOCK], tl.float32)
    for sp in tl.static_range(SPLIT):
        acc += tl.load(part_ptr + sp * MN + at, mask=ok, other=0.0)
    tl.store(out_ptr + at, acc.to(tl.bfloat16), mask=ok)


def config_for(m: int) -> dict:
    return dict(CONFIGS[min(CONFIGS, key=lambda k: (abs(k - m), k))])


def skinny_gemm(x: torch.Tensor, w: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    M, K = x.shape
    N = w.shape[0]
    cfg = config or config_for(M)
    bm = max(16, triton.next_power_of_2(M))
    bk = min(int(cfg["BK"]), triton.next_power_of_2(K))
    split = int(cfg["SPLIT"])
    if K % (split * bk):  # the kernel walks whole BK steps: fall back to what divides
        split, bk = 1, bk if K % bk == 0 else 16
        if K % bk:
            raise ValueError(f"K = {K} is not a multiple of 16")
    interpreting = x.device.type != "cuda"  # a CPU tensor runs only under Triton's interpreter
    launch = {} if interpreting else {"num_warps": int(cfg["num_warps"]), "num_stages": int(cfg["num_stages"])}
    out = torch.empty(M, N, dtype=torch.bfloat16, device=x.device)
    target = out if split == 1 else torch.empty(split, M, N, dtype=torch.float32, device=x.device)
    bn = int(cfg["BN"])
    _skinny[(triton.cdiv(N, bn), split)](x, w, target, M, N, K, K // split, BM=bm, BN=bn, BK=bk, SPLIT=split,
                                         F32=interpreting, **launch)
    if split > 1:
        block = 1024
        _sum_splits[(triton.cdiv(M * N, block),)](target, out, M * N, SPLIT=split, BLOCK=block)
    return out


def custom_kernel(inputs: dict) -> torch.Tensor:
    x, w = inputs["x"], inputs["w"]
    if x.shape[0] > 64:  # past the decode sizes this kernel is made for (no such workload): cuBLAS
        return x @ w.T
    return skinny_gemm(x.contiguous(), w.contiguous())
