"""What runs before each call (pipeline/kernel/predecessor.py): no call of a timed graph overlaps the one ahead
of it, and a checked call's activations are written late by a kernel that lets it start early."""

from __future__ import annotations

import statistics

import pytest
import torch

from pipeline.kernel import predecessor, timing

ON_GPU = torch.cuda.is_available()


def test_a_late_write_stages_other_content_of_the_same_kind_and_keeps_the_real():
    g = torch.Generator().manual_seed(3)
    inputs = {"x": torch.randn(6, 5, generator=g).to(torch.bfloat16), "ids": torch.randint(0, 9, (7, 3), generator=g,
              dtype=torch.int32), "w": torch.randn(4, 5, generator=g), "one": torch.ones(1)}
    real = {k: v.clone() for k, v in inputs.items()}
    late = predecessor.LateWrite(inputs, ["x", "ids", "one", "absent"])
    for name in ("x", "ids"):  # other values, drawn from the real ones: indices stay in range
        assert not torch.equal(inputs[name], real[name]), name
        assert torch.equal(inputs[name], torch.roll(real[name], 1)), name
    assert torch.equal(inputs["w"], real["w"]) and torch.equal(inputs["one"], real["one"])  # not produced; too small
    assert [src.numel() * src.element_size() for src, _ in late.pairs] == [60, 84]
    assert torch.equal(late.pairs[0][0].view(torch.uint8), real["x"].reshape(-1).view(torch.uint8))
    with pytest.raises(ValueError, match="at most 4"):
        predecessor.LateWrite({f"t{i}": torch.zeros(4) for i in range(5)}, [f"t{i}" for i in range(5)])


def test_on_a_cpu_no_call_can_overlap_another_and_nothing_is_staged():
    assert not predecessor.overlaps_possible(torch.device("cpu"))
    graph = timing.capture(lambda s: s["x"] + 1, [{"x": torch.zeros(3)}], 4)
    assert graph.fences == []


def _per_call_us(mode: str, calls: int = 32, blocks: int = 16) -> float:
    import pdl_kernels

    src = torch.randn(blocks * 1024, device="cuda")
    dst = torch.empty_like(src)
    stream = torch.cuda.Stream()
    graph = timing.capture(lambda s: pdl_kernels.launch(s["src"], s["dst"], mode, spin_ns=50_000),
                           [{"src": src, "dst": dst}], calls, stream)
    with torch.cuda.stream(stream):
        timing.replays_us([graph] * 3)
        return statistics.median(timing.replays_us([graph] * 15))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU or torch.cuda.get_device_capability()[0] < 9, reason="needs a Hopper GPU")
def test_a_call_that_starts_before_the_one_ahead_of_it_ends_gains_nothing_in_a_timed_graph(monkeypatch):
    """16 blocks spinning 50 us a call: launched plainly, a call takes its 50 us; launched to start early and
    never wait, the calls of an unfenced graph overlap (the H100 gave 59 -> 2.8 us); with the fence they
    take what a plain launch takes."""
    times = {mode: _per_call_us(mode) for mode in ("plain", "never_waits", "waits")}
    assert times["plain"] > 45, times
    assert times["never_waits"] >= 0.99 * times["plain"], times
    assert times["waits"] >= 0.99 * times["plain"], times
    monkeypatch.setattr(predecessor, "fence", lambda keep: None)
    unfenced = _per_call_us("never_waits")
    assert unfenced < 0.5 * times["plain"], (unfenced, times)  # what the fence holds back on this card


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU or torch.cuda.get_device_capability()[0] < 9, reason="needs a Hopper GPU")
def test_a_first_kernel_that_reads_before_it_waits_reads_other_content():
    import pdl_kernels

    for mode in pdl_kernels.MODES:
        wrong = pdl_kernels.wrong_reads(mode, 10)
        assert wrong == (10 if mode == "never_waits" else 0), (mode, wrong)


COMPILE = """
import sys
from triton import compile
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from pipeline.kernel import predecessor

kernel = predecessor._kernel()
names = kernel.arg_names
signature = {n: "constexpr" if n == "BLOCK" else "i32" if n == "delay_ns" or n.startswith("n") else "*i32" for n in names}
source = ASTSource(fn=kernel, signature=signature, constexprs={(names.index("BLOCK"),): predecessor._BLOCK})
sys.stdout.write(compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"])
"""


def test_the_late_writing_kernel_compiles_for_hopper_without_a_gpu():
    """Every evaluation on a Hopper GPU builds this kernel when its workers start (a build failure there would
    fail every evaluation): compiled here for sm_90 with the ptxas Triton bundles, it releases its dependents
    (griddepcontrol.launch_dependents) and reads the global timer. In a process of its own: the suite's
    interpreter (TRITON_INTERPRET) makes no compilable kernels."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", COMPILE], cwd=Path(__file__).resolve().parent.parent, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("griddepcontrol.launch_dependents") == 1
    assert "%globaltimer" in done.stdout
