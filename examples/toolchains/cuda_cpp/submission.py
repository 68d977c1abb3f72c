"""muse_bf16_proj in CUDA C++ through torch.utils.cpp_extension.load_inline: x @ w.T, one warp per output
column, built with nvcc when the submission is imported (inside the evaluator's compile limit).

The projection is memory bound at decode sizes: every call streams the whole weight (73 MB) once. Each
warp reads one row of w in 16-byte vectors (8 bf16 per lane, a warp's loads contiguous) and keeps up to
16 rows of x's partial dot products in registers; rows of x beyond 16 take another pass over the same
row of w, which L1 then holds. Float32 accumulation, a shuffle reduction across the warp, bf16 out.
The kernel launches on torch's current stream, so the evaluator can capture it in a CUDA graph.

The build is split to keep it short: nvcc compiles only the kernel and a plain C++ launcher (no torch
headers: `no_implicit_headers=True`), and the host compiler builds the torch binding, which is where
torch/extension.h costs its half minute.
"""

import torch
from torch.utils.cpp_extension import load_inline

CUDA_SOURCE = r"""
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <stdint.h>

template <int ROWS>
__global__ void proj_kernel(const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ w,
                            __nv_bfloat16* __restrict__ out, int M, int N, int K) {
    const int n = (blockIdx.x * blockDim.x + threadIdx.x) / 32;  // this warp's output column
    const int lane = threadIdx.x % 32;
    if (n >= N) return;
    const __nv_bfloat16* wrow = w + (size_t)n * K;
    for (int m0 = 0; m0 < M; m0 += ROWS) {
        float acc[ROWS];
#pragma unroll
        for (int r = 0; r < ROWS; ++r) acc[r] = 0.f;
        for (int k = lane * 8; k < K; k += 32 * 8) {
            const uint4 wv = __ldg(reinterpret_cast<const uint4*>(wrow + k));
            const __nv_bfloat162* w2 = reinterpret_cast<const __nv_bfloat162*>(&wv);
            float2 wf[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) wf[i] = __bfloat1622float2(w2[i]);
#pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                if (m0 + r < M) {
                    const uint4 xv = __ldg(reinterpret_cast<const uint4*>(x + (size_t)(m0 + r) * K + k));
                    const __nv_bfloat162* x2 = reinterpret_cast<const __nv_bfloat162*>(&xv);
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const float2 xf = __bfloat1622float2(x2[i]);
                        acc[r] += xf.x * wf[i].x + xf.y * wf[i].y;
                    }
                }
            }
        }
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            float v = acc[r];
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
            if (lane == 0 && m0 + r < M) out[(size_t)(m0 + r) * N + n] = __float2bfloat16(v);
        }
    }
}

// Returns the launch's error code (0: launched).
int muse_proj_launch(const void* x, const void* w, void* out, int M, int N, int K, cudaStream_t stream) {
    const int threads = 256;
    const int blocks = (N * 32 + threads - 1) / threads;
    const auto* xp = static_cast<const __nv_bfloat16*>(x);
    const auto* wp = static_cast<const __nv_bfloat16*>(w);
    auto* op = static_cast<__nv_bfloat16*>(out);
    if (M == 1) proj_kernel<1><<<blocks, threads, 0, stream>>>(xp, wp, op, M, N, K);
    else if (M <= 8) proj_kernel<8><<<blocks, threads, 0, stream>>>(xp, wp, op, M, N, K);
    else proj_kernel<16><<<blocks, threads, 0, stream>>>(xp, wp, op, M, N, K);
    return (int)cudaGetLastError();
}
"""

CPP_SOURCE = r"""
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>

int muse_proj_launch(const void* x, const void* w, void* out, int M, int N, int K, cudaStream_t stream);

torch::Tensor proj(torch::Tensor x, torch::Tensor w) {
    TORCH_CHECK(x.is_cuda() && w.is_cuda(), "x and w must be CUDA tensors");
    TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "x and w must be bf16");
    TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "x and w must be contiguous");
    const int M = x.size(0), K = x.size(1), N = w.size(0);
    TORCH_CHECK(w.size(1) == K, "x and w disagree on K");
    TORCH_CHECK(K % 256 == 0, "this kernel needs K to be a multiple of 256");
    TORCH_CHECK(reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0 && reinterpret_cast<uintptr_t>(w.data_ptr()) % 16 == 0,
                "x and w must be 16-byte aligned");
    auto out = torch::empty({M, N}, x.options());
    const int err = muse_proj_launch(x.data_ptr(), w.data_ptr(), out.data_ptr(), M, N, K,
                                     c10::cuda::getCurrentCUDAStream().stream());
    TORCH_CHECK(err == 0, "the projection kernel did not launch: CUDA error ", err);
    return out;
}
"""

_ext = load_inline(name="muse_proj_cuda", cpp_sources=CPP_SOURCE, cuda_sources=CUDA_SOURCE, functions=["proj"],
                   no_implicit_headers=True, extra_cuda_cflags=["-O3"])


def custom_kernel(inputs: dict) -> torch.Tensor:
    return _ext.proj(inputs["x"], inputs["w"])
