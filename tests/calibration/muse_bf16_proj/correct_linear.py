"""cuBLAS/ATen F.linear in bf16 (fp32 accumulation inside the GEMM)."""
import torch.nn.functional as F


def custom_kernel(inputs):
    return F.linear(inputs["x"], inputs["w"])
