"""Grows its host memory a quarter GiB at a time until none is left, holding all of it (a memory leak
at its worst). torch.empty reserves the memory without touching it: the limit counts what is mapped,
so the case crosses it without loading the machine that runs the test."""
import torch

_held = []


def custom_kernel(inputs):
    while True:
        _held.append(torch.empty(1 << 28, dtype=torch.uint8))
