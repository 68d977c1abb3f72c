"""A Triton kernel that reads 2 TB past its input: an illegal memory access, the sticky CUDA error
that poisons the process's context (every later CUDA call in it fails)."""
import torch
import triton
import triton.language as tl


@triton.jit
def _wild_read(x_ptr, out_ptr, offset):
    value = tl.load(x_ptr + offset)
    tl.store(out_ptr, value)


def custom_kernel(inputs):
    x = inputs["x"]
    out = torch.empty(1, dtype=x.dtype, device=x.device)
    _wild_read[(1,)](x, out, 1 << 40)
    torch.cuda.synchronize()
    return inputs["x"] @ inputs["w"].T
