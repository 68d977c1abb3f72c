"""Rounds the weights to fp8 e4m3 (per-tensor scale) before the GEMM."""
import torch
import torch.nn.functional as F


def custom_kernel(inputs):
    x, w = inputs["x"], inputs["w"]
    scale = w.float().abs().amax() / 448.0
    w8 = (w.float() / scale).to(torch.float8_e4m3fn).float() * scale
    return F.linear(x.float(), w8).to(torch.bfloat16)
