"""Leaves the last 16 output columns (one N tile) unwritten: zeros where the tail tile was skipped."""
import torch
import torch.nn.functional as F


def custom_kernel(inputs):
    out = F.linear(inputs["x"], inputs["w"])
    out[:, -16:] = 0
    return out
