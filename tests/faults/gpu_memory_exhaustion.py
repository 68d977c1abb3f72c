"""Takes the GPU's memory until none is left and keeps it (in 1 GiB pieces, then smaller ones), then
fails with the out-of-memory error it ran into."""
import torch

_held = []


def custom_kernel(inputs):
    for size in (1 << 30, 1 << 26, 1 << 20):
        while True:
            try:
                _held.append(torch.empty(size, dtype=torch.uint8, device=inputs["x"].device))
            except torch.OutOfMemoryError:
                break
    raise torch.OutOfMemoryError(f"took {sum(t.numel() for t in _held) >> 20} MiB of the GPU's memory and kept it")
