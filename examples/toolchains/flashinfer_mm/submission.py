"""muse_bf16_proj through FlashInfer: x @ w.T with flashinfer.mm_bf16.

mm_bf16 takes the weight as a [K, N] column-major matrix, which is exactly w.T (a view, no copy). Its
TinyGEMM backend is FlashInfer's kernel for small-M bf16 GEMMs on Hopper and later, the decode sizes of
this problem; FlashInfer JIT-builds it with the runner's nvcc at the first call (the evaluator's
warm-up), into the sandbox's scratch ($FLASHINFER_WORKSPACE_BASE), and later calls reuse it. It runs
on torch's current stream, so the evaluator can capture it in a CUDA graph.
"""

import flashinfer
import torch


def custom_kernel(inputs: dict) -> torch.Tensor:
    x, w = inputs["x"], inputs["w"]  # [M, K] bf16, [N, K] bf16
    out = torch.empty((x.shape[0], w.shape[0]), dtype=torch.bfloat16, device=x.device)
    return flashinfer.mm_bf16(x, w.T, out=out, backend="tinygemm")
