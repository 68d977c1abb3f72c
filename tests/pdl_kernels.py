"""Kernels for the tests and the probe of programmatic dependent launch (pipeline/kernel/predecessor.py): one
kernel, launched three ways. `plain`: an ordinary launch; `never_waits`: launched with programmatic
dependent launch, releasing its dependents at entry and never waiting for the kernel ahead of it; `waits`:
launched that way, waiting (`gdc_wait`) before it reads anything, as production kernels do."""
import torch
import triton
import triton.language as tl

MODES = ("plain", "never_waits", "waits")


@triton.jit
def _spin_then_copy(src, dst, n, spin_ns, PDL: tl.constexpr, WAIT: tl.constexpr, BLOCK: tl.constexpr):
    if PDL:
        if WAIT:
            tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    v = tl.load(src + offs, mask=mask)  # the call's input, read first
    start = tl.extra.cuda.globaltimer()
    spun = start - start
    while spun < spin_ns:
        spun = tl.extra.cuda.globaltimer() - start
    tl.store(dst + offs, v, mask=mask)


def launch(src: torch.Tensor, dst: torch.Tensor, mode: str, spin_ns: int = 0, block: int = 1024) -> None:
    """dst = src, read at the kernel's start, written after spin_ns; one program per `block` elements."""
    pdl = mode != "plain"
    _spin_then_copy[(triton.cdiv(src.numel(), block),)](src, dst, src.numel(), spin_ns, PDL=pdl,
                                                        WAIT=mode == "waits", BLOCK=block, launch_pdl=pdl)


def wrong_reads(mode: str, trials: int) -> int:
    """In how many of `trials` checked calls a launch `mode` copy of x read x before the harness's late write
    (pipeline/kernel/predecessor.py) had written it."""
    from pipeline.kernel import predecessor

    wrong = 0
    for _ in range(trials):
        x = torch.randn(1 << 16, device="cuda")
        real, out = x.clone(), torch.empty_like(x)
        late = predecessor.LateWrite({"x": x}, ["x"])
        torch.cuda.synchronize()
        late.launch()
        launch(x, out, mode)
        torch.cuda.synchronize()
        assert torch.equal(x, real), mode  # the real content is there once the call has ended
        wrong += not torch.equal(out, real)
    return wrong
