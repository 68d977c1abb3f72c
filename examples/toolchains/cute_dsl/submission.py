"""muse_bf16_proj in the CuTe DSL (nvidia-cutlass-dsl): x @ w.T as a kernel written in Python and compiled
by CUTLASS's MLIR stack, one warp per output column.

Each warp reads one row of w (K bf16 values, lane-strided so that a warp's loads are contiguous) once
from memory; the loop over the M rows of x re-reads that row from L1, where the 8 rows of a block fit.
Products accumulate in float32 and the warp's lanes are summed with shuffles; lane 0 writes out[m, n] in
bf16. The kernel is compiled once per M (the shapes are static to the compiler), at the first call of
each shape: the evaluator's warm-up, before anything is timed.

It launches on torch's current stream (cutlass.torch.current_stream), which is what lets the evaluator
capture it in a CUDA graph.
"""

import torch

import cutlass
import cutlass.cute as cute
import cutlass.torch as cutlass_torch
from cutlass.cute.runtime import from_dlpack

THREADS = 256
WARPS = THREADS // 32


@cute.kernel
def _proj_kernel(mX: cute.Tensor, mW: cute.Tensor, mO: cute.Tensor):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    lane = tidx % 32
    n = bidx * WARPS + tidx // 32
    M, K = mX.shape
    N = mW.shape[0]
    if n < N:
        for m in cutlass.range(M):
            acc = cutlass.Float32(0.0)
            for k in cutlass.range(lane, K, 32):
                acc += mX[m, k].to(cutlass.Float32) * mW[n, k].to(cutlass.Float32)
            acc = cute.arch.warp_reduction_sum(acc)
            if lane == 0:
                mO[m, n] = acc.to(cutlass.BFloat16)


@cute.jit
def _proj(mX: cute.Tensor, mW: cute.Tensor, mO: cute.Tensor, stream):
    N = mW.shape[0]
    _proj_kernel(mX, mW, mO).launch(grid=[(N + WARPS - 1) // WARPS, 1, 1], block=[THREADS, 1, 1], stream=stream)


_compiled = {}


def custom_kernel(inputs: dict) -> torch.Tensor:
    x, w = inputs["x"], inputs["w"]  # [M, K] bf16, [N, K] bf16, both contiguous
    out = torch.empty((x.shape[0], w.shape[0]), dtype=torch.bfloat16, device=x.device)
    args = (from_dlpack(x, assumed_align=16), from_dlpack(w, assumed_align=16), from_dlpack(out, assumed_align=16))
    stream = cutlass_torch.current_stream()
    key = (tuple(x.shape), tuple(w.shape))
    if key not in _compiled:
        _compiled[key] = cute.compile(_proj, *args, stream)
    _compiled[key](*args, stream)
    return out
