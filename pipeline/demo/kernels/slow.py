"""Demo submission for muse_bf16_proj: correct, but it computes the projection 9 times (honest extra
work, so that the demo's board has kernels of different speeds)."""

import torch.nn.functional as F


def custom_kernel(inputs):
    x, w = inputs["x"], inputs["w"]
    out = F.linear(x, w)
    for _ in range(8):
        out = F.linear(x, w)
    return out
