"""Demo submission for muse_bf16_proj that is wrong: the K and V blocks of the fused weight are swapped
(a layout mistake), so the K and V columns of the output are each other's."""

import torch
import torch.nn.functional as F

Q_HEADS, KV_HEADS = 4, 2  # the smoke model's (problems/model.toml)


def custom_kernel(inputs):
    x, w = inputs["x"], inputs["w"]
    d = w.shape[0] // (Q_HEADS + 2 * KV_HEADS)
    q, k, v = w.split([Q_HEADS * d, KV_HEADS * d, KV_HEADS * d])
    return F.linear(x, torch.cat([q, v, k]))
