"""What runs just before each call of the target on a GPU: the decision that no call borrows time from the
work before it, and that a call which would read its inputs before they exist is caught.

On Hopper a kernel launched with programmatic dependent launch (Triton's `launch_pdl`, CUDA's programmatic
stream serialisation attribute) may start while the kernel ahead of it in the stream still runs. Inside a
call, with the dependent kernel waiting (`gdc_wait`, `griddepcontrol.wait`) before it reads what its
predecessor writes, that only hides a launch's gap, as production kernels do. A call whose *first* kernel
starts early and never waits reads its inputs before the kernel that makes them (in a decode step, the
previous layer's) has written them: in the timed graph its calls are independent (each on an input set of
its own), so it would overlap the call before it, and nothing would check it (SECURITY.md, R25).

- `fence`: in every captured graph, after each call, a node that is not a kernel (an event record). Only
  kernel nodes have a programmatic port (cudaGraphEdgeData), so the next call's first kernel depends on the
  whole of the call before it, whatever attribute it was launched with: no call overlaps another, and a
  kernel launched that way gains at most what a plain launch has (benchmarks/pdl_fence.py measures both).
- `LateWrite`: before a checked call, the inputs a kernel before it would make in production (the problem's
  `produced` inputs: the activations, never the weights, which a production kernel may read before it
  waits) hold other content, and a harness kernel, launched last before the call, releases its dependents
  at once (`griddepcontrol.launch_dependents`), spins for `DELAY_NS`, and only then writes the real content.
  A kernel that waits, or a plain launch, sees the real inputs; one that reads before it waits reads the
  other content and its output is wrong.

On a CPU, and on a GPU older than Hopper, neither has anything to do: no launch there can overlap another.
"""

from __future__ import annotations

from typing import Any

import torch

from pipeline.problems import MAX_PRODUCED as SLOTS  # the produced inputs a problem may name, one slot each

DELAY_NS = 1_000_000  # 1 ms: longer than any workload's first kernel takes to read its activations
_GRID = 32
_BLOCK = 4096


def overlaps_possible(device: torch.device) -> bool:
    """Whether a launch on this device may start before the one ahead of it ends (compute capability 9.0+)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def fence(keep: list) -> None:
    """Inside a capture on a CUDA stream: an event record node after the call just captured, so that the
    next call's first kernel waits for the whole of this one. The event is kept (in `keep`) as long as the
    graph that records it."""
    event = torch.cuda.Event(external=True)
    event.record()
    keep.append(event)


_KERNEL: list = []


def _kernel():
    if not _KERNEL:
        import triton
        import triton.language as tl

        @triton.jit
        def _copy(src, dst, n, pid, programs, BLOCK: tl.constexpr):
            for start in range(pid * BLOCK, n, programs * BLOCK):
                offs = start + tl.arange(0, BLOCK)
                mask = offs < n
                tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)

        @triton.jit
        def late_write(s0, d0, n0, s1, d1, n1, s2, d2, n2, s3, d3, n3, delay_ns, BLOCK: tl.constexpr):
            # Dependents may start now; the real inputs are written only once delay_ns have passed.
            tl.extra.cuda.gdc_launch_dependents()
            start = tl.extra.cuda.globaltimer()
            waited = start - start
            while waited < delay_ns:
                waited = tl.extra.cuda.globaltimer() - start
            pid, programs = tl.program_id(0), tl.num_programs(0)
            _copy(s0, d0, n0, pid, programs, BLOCK)
            _copy(s1, d1, n1, pid, programs, BLOCK)
            _copy(s2, d2, n2, pid, programs, BLOCK)
            _copy(s3, d3, n3, pid, programs, BLOCK)

        _KERNEL.append(late_write)
    return _KERNEL[0]


def _same_words(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two contiguous tensors of one size as 32-bit words where their size and addresses allow (a copy of
    words is 4x fewer steps), else both as bytes."""
    a8, b8 = a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)
    if a8.numel() % 4 == 0 and a.data_ptr() % 4 == 0 and b.data_ptr() % 4 == 0:
        return a8.view(torch.int32), b8.view(torch.int32)
    return a8, b8


class LateWrite:
    """The produced inputs of one checked call, staged: `launch` (just before the call, on the current
    stream) is the late-writing kernel; until it has run, those inputs hold their content rolled by one
    element (other values of the same kind: valid indices stay valid, and nothing marks them as stale)."""

    def __init__(self, inputs: dict[str, Any], produced: tuple[str, ...] | list[str]):
        if len(produced) > SLOTS:  # before any input is touched
            raise ValueError(f"at most {SLOTS} produced inputs, got {len(produced)}")
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        for name in produced:
            t = inputs.get(name)
            if not isinstance(t, torch.Tensor) or t.numel() < 2 or not t.is_contiguous():
                continue
            real = t.clone()
            t.copy_(torch.roll(real, 1))
            self.pairs.append(_same_words(real, t))

    def launch(self, delay_ns: int = DELAY_NS) -> None:
        if not self.pairs:
            return
        args: list[Any] = []
        for src, dst in self.pairs:
            args += [src, dst, src.numel()]
        spare = self.pairs[0][0][:1]
        for _ in range(SLOTS - len(self.pairs)):
            args += [spare, spare, 0]
        _kernel()[(_GRID,)](*args, delay_ns, BLOCK=_BLOCK)
