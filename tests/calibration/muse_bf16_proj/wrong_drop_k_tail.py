"""Drops the last 1% of K (a tail-handling bug when K is not a multiple of the tile)."""
import torch.nn.functional as F


def custom_kernel(inputs):
    x, w = inputs["x"], inputs["w"]
    k = x.shape[1] - max(1, x.shape[1] // 100)
    return F.linear(x[:, :k], w[:, :k])
