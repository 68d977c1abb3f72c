"""A Triton kernel that never returns: it spins on a flag nobody ever sets. The call hangs in the
GPU, where no signal reaches it; only the end of the process (its CUDA context) stops the kernel."""
import torch
import triton
import triton.language as tl


@triton.jit
def _spin(flag_ptr, out_ptr):
    seen = tl.load(flag_ptr, volatile=True)
    while seen == 0:
        seen = tl.load(flag_ptr, volatile=True)
    tl.store(out_ptr, seen)


def custom_kernel(inputs):
    flag = torch.zeros(1, dtype=torch.int32, device=inputs["x"].device)
    out = torch.empty_like(flag)
    _spin[(1,)](flag, out)
    torch.cuda.synchronize()
    return inputs["x"] @ inputs["w"].T
