"""muse_bf16_proj through DeepGEMM: x @ w.T with deep_gemm.bf16_gemm_nt.

Only for a runner that has DeepGEMM: there is no usable build on PyPI (runner/README.md), so the
runner image does not carry it, and on a runner without it this submission is a compile_error that
says so. bf16_gemm_nt(a, b, d) computes d = a @ b.T for a [M, K] and b [N, K], both K-major: x and w as
they come. DeepGEMM JIT-compiles its kernel for the shape at the first call (the evaluator's warm-up).
"""

import deep_gemm
import torch


def custom_kernel(inputs: dict) -> torch.Tensor:
    x, w = inputs["x"], inputs["w"]  # [M, K] bf16, [N, K] bf16
    out = torch.empty((x.shape[0], w.shape[0]), dtype=torch.bfloat16, device=x.device)
    deep_gemm.bf16_gemm_nt(x, w, out)
    return out
