"""A correct, simple starting point for muse_moe_w4a16: one expert at a time in plain PyTorch.

For every expert (all E of them, used or not): dequantise its int4 weights to bf16, run the two bf16
GEMMs on all M tokens with silu(gate) * up in between, and add the result into an fp32 output, weighted
per token by the routing weight the token gives this expert (zero for the tokens not routed to it).

The timed path is captured in a CUDA graph, so nothing here waits for the GPU: no .item(), .tolist(),
nonzero() or torch.unique, no Python branch on a tensor's values, every shape known from the input
shapes alone. The price is that the experts nobody uses are dequantised and multiplied too (zero-weighted):
reading only the used experts' weights, once, is the first thing a real kernel does better.
"""

import torch
import torch.nn.functional as F


def dequantize(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] + bf16 scales [N, K/group] -> bf16 [N, K]. Low nibble = even k; q = nibble - 8."""
    n, half = packed.shape
    k = 2 * half
    q = torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(n, k).to(torch.int16) - 8
    group = k // scale.shape[-1]
    w = q.reshape(n, k // group, group).float() * scale.float().unsqueeze(-1)
    return w.reshape(n, k).to(torch.bfloat16)


def custom_kernel(inputs: dict) -> torch.Tensor:
    x = inputs["x"]                        # [M, H] bf16
    topk_ids = inputs["topk_ids"]          # [M, topk] int32
    topk_weights = inputs["topk_weights"]  # [M, topk] float32
    w13, w13_scale = inputs["w13"], inputs["w13_scale"]  # [E, 2I, H/2] uint8, [E, 2I, H/group] bf16
    w2, w2_scale = inputs["w2"], inputs["w2_scale"]      # [E, H, I/2] uint8, [E, H, I/group] bf16
    M, H = x.shape
    E = w13.shape[0]
    I = w2.shape[-1] * 2
    # coef[e, m] = sum_k topk_weights[m, k] * (topk_ids[m, k] == e): [E, M] float32
    experts = torch.arange(E, device=x.device).view(E, 1, 1)
    coef = ((topk_ids.unsqueeze(0) == experts) * topk_weights.unsqueeze(0)).sum(-1)
    out = torch.zeros(M, H, dtype=torch.float32, device=x.device)
    for e in range(E):
        h = x @ dequantize(w13[e], w13_scale[e]).T            # [M, 2I]
        act = F.silu(h[:, :I]) * h[:, I:]                     # [M, I]
        y = act @ dequantize(w2[e], w2_scale[e]).T            # [M, H]
        out += y.float() * coef[e].unsqueeze(1)
    return out.to(torch.bfloat16)
