"""The organizers' solutions' kernels, every variant their searches may choose, against the float64 reference:
in Triton's interpreter on a CPU (the heavy tier: Python emulates each program of the grid, up to a minute a
variant) and compiled on a GPU (the gpu tier: seconds). tests/test_solutions.py evaluates each solution whole."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pipeline.problems import load_problem
from test_solutions import _load

# On the CPU the MoE's widest shape is a smaller one of the same kind (uniform routing over 8 tokens: most of
# the 8 experts used), since uniform_M64 alone took 150 s a variant there.
DEVICES = [pytest.param("cpu", marks=pytest.mark.heavy),
           pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                           reason="needs a CUDA device")])]


def _on(device: str, monkeypatch) -> str:
    if device == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    return device


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("split, bn, bk, swap", [(2, 16, 64, 0), (4, 32, 32, 1), (1, 64, 128, 0), (1, 64, 128, 1)])
def test_the_projection_s_every_tiling_is_right(split, bn, bk, swap, device, monkeypatch):
    """Every tiling the search may choose for the projection (split-K with its fixed-order sum included), in
    either orientation (SWAP: the weight's rows as the dot's first operand, the tile stored transposed), in the
    interpreter against the float64 product; the tickets left at zero for the next call."""
    device = _on(device, monkeypatch)
    mod = _load("muse_bf16_proj")
    g = torch.Generator().manual_seed(split)
    for m in (1, 7, 33):
        x = torch.randn(m, 256, generator=g).bfloat16().to(device)
        w = (torch.randn(512, 256, generator=g) / 16).bfloat16().to(device)
        got = mod.skinny_gemm(x, w, {"BN": bn, "BK": bk, "SPLIT": split, "SWAP": swap, "num_warps": 4,
                                     "num_stages": 3})
        want = x.cpu().double() @ w.cpu().double().T
        assert got.dtype == torch.bfloat16 and got.shape == (m, 512)
        assert torch.allclose(got.cpu().double(), want, atol=1e-2, rtol=1e-2), (m, (got.cpu().double() - want).abs().max())
        assert not mod._tickets(512 // bn, x.device).any()


MOE_VARIANTS = [  # the two searched stages' extremes: split-K on either GEMM (ticket-finished), wide tiles, BT 32
    # (ROWS named: the defaults are M1's, ROWS 1; M16's and M32's tiles are ROWS 0)
    {"PATH": "tc", "BT": 16, "BN_UP": 32, "SPLIT_UP": 4, "BN_DOWN": 128, "SPLIT_DOWN": 2, "ROWS": 0},
    {"PATH": "tc", "BT": 32, "BN_UP": 128, "SPLIT_UP": 1, "BN_DOWN": 32, "SPLIT_DOWN": 1, "ROWS": 0},
    {"PATH": "tc", "BT": 16, "BN_UP": 64, "SPLIT_UP": 2, "BN_DOWN": 64, "SPLIT_DOWN": 2, "ROWS": 1},  # tokens as the first operand
    # unsorted (no _route: block b is pair b), meant for M1 and right at every size
    {"PATH": "tc", "BT": 16, "BN_UP": 32, "SPLIT_UP": 2, "BN_DOWN": 64, "SPLIT_DOWN": 2, "ROWS": 1, "SORT": 0},
    # BT > 32: weights scaled (POST 0), in both orientations (M1's ROWS 1 is the default, so ROWS 0 named)
    {"PATH": "tc", "BT": 64, "BN_UP": 64, "SPLIT_UP": 1, "BN_DOWN": 64, "SPLIT_DOWN": 1, "ROWS": 0},
    {"PATH": "tc", "BT": 64, "BN_UP": 64, "SPLIT_UP": 1, "BN_DOWN": 64, "SPLIT_DOWN": 1, "ROWS": 1},
    # the CUDA-core path: unsorted (a block per pair), sorted blocks smaller than an expert's run, several
    # groups a step
    {"PATH": "cc", "BT": 1, "BN_UP": 16, "GPS_UP": 1, "BN_DOWN": 32, "GPS_DOWN": 2},
    {"PATH": "cc", "BT": 4, "BN_UP": 32, "GPS_UP": 2, "BN_DOWN": 16, "GPS_DOWN": 1, "PREFETCH": 1},
    # the CUDA-core path unpacking 32-bit words (one fma a weight), one and several groups a step
    {"PATH": "cc", "UNPACK": "words", "BT": 1, "BN_UP": 16, "GPS_UP": 1, "BN_DOWN": 32, "GPS_DOWN": 2, "SPLIT_UP": 1,
     "SPLIT_DOWN": 1},
    {"PATH": "cc", "UNPACK": "words", "BT": 1, "BN_UP": 64, "GPS_UP": 2, "BN_DOWN": 16, "GPS_DOWN": 1, "SPLIT_UP": 1,
     "SPLIT_DOWN": 1},
    # and with K and the experts split (the last split of a tile adds the parts)
    {"PATH": "cc", "UNPACK": "words", "BT": 1, "BN_UP": 32, "GPS_UP": 1, "SPLIT_UP": 2, "BN_DOWN": 32, "GPS_DOWN": 1,
     "SPLIT_DOWN": 2},
]


def _moe_shapes(problem, device: str) -> dict:
    """The smoke shapes by name; on a CPU uniform_M64 is uniform routing over 8 tokens (see DEVICES)."""
    shapes = {s.name: s for s in problem.shapes("smoke")}
    if device == "cpu":
        wide = shapes["uniform_M64"]
        shapes["uniform_M64"] = dataclasses.replace(wide, params={**wide.params, "M": 8})
    return shapes


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("variant", MOE_VARIANTS, ids=lambda v: "-".join(f"{k}{v[k]}" for k in v))
def test_the_moe_s_every_blocking_is_right(variant, device, monkeypatch):
    """Every blocking the search may choose for the MoE, in the interpreter against the float64 reference,
    twice on each shape (the second call finds the tickets the first left, which must be zero again):
    shapes whose experts hold more pairs than a block (the same experts for every token), one pair each
    (M1) and most experts used (uniform)."""
    device = _on(device, monkeypatch)
    mod = _load("muse_moe_w4a16")
    problem = load_problem("muse_moe_w4a16")
    ref = problem.reference
    cfg = {**mod.config_for(1), **variant}
    shapes = _moe_shapes(problem, device)
    # the words' unpacking routes nothing (a program row a pair), and the interpreter runs it slowly: the
    # shapes with several pairs an expert and with one; the CUDA-core path keeps no tickets: one call a shape
    words = variant.get("UNPACK") == "words"
    names = ("same_experts_M16", "M1") + (() if words else ("uniform_M64",))
    if device == "cpu":  # the interpreter: M1, and the shape whose experts hold several pairs that the path routes
        names = ("M1", "same_experts_M16" if cfg["PATH"] == "tc" else "uniform_M64")
    for name in names:
        inputs = ref.make_inputs(shapes[name], 3, device)
        want = ref.reference(inputs).double().cpu()
        tickets = cfg["PATH"] == "tc" or cfg.get("SPLIT_UP", 1) > 1 or cfg.get("SPLIT_DOWN", 1) > 1
        for _ in range(2 if tickets else 1):
            got = mod.custom_kernel(inputs, cfg).double().cpu()
            err = (got - want).abs()
            assert err.max() < 0.1 and (got - want).norm() / want.norm() < 1e-2, (name, float(err.max()))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("chunk, block_n, merge_bd", [(16, 16, 128), (48, 16, 32), (128, 32, 16)])
def test_the_attention_s_every_chunking_is_right(chunk, block_n, merge_bd, device, monkeypatch):
    """Chunkings the search may choose for the attention, in the interpreter against the float64 reference:
    the most splits the merge holds (chunk 16 on L65536's 2,048 tokens is raised to keep 65 <= MAX_SPLITS),
    a chunk that is no power of two (48), one split (L1), and ragged batches whose requests end mid-chunk,
    with the merge's columns split over 1, 4 and 8 programs a head;
    twice a shape (the buffers of the first call are the allocator's to reuse)."""
    device = _on(device, monkeypatch)
    mod = _load("muse_attention_decode")
    problem = load_problem("muse_attention_decode")
    ref = problem.reference
    cfg = {**mod.config_for(1), "CHUNK": chunk, "BLOCK_N": block_n, "MERGE_BD": merge_bd}
    shapes = {s.name: s for s in problem.shapes("smoke")}
    for name in ("L65536", "L1", "B3", "B16"):
        inputs = ref.make_inputs(shapes[name], 5, device)
        want = ref.reference(inputs).double().cpu()
        for _ in range(2):
            got = mod.custom_kernel(inputs, cfg)
            assert got.dtype == torch.bfloat16 and got.shape == want.shape
            err = (got.cpu().double() - want).abs()
            assert err.max() < 0.02 and (got.cpu().double() - want).norm() / want.norm() < 5e-3, (name, float(err.max()))


@pytest.mark.parametrize("device", DEVICES)
def test_the_moe_s_counted_route_is_right(device, monkeypatch):
    """Past MAX_PAIRS pairs (prefill sizes) the MoE solution routes by an atomic count per expert, a scan that
    cuts each expert's run into blocks, and a scatter: forced here on the smoke model's shapes (MAX_PAIRS 8),
    blocks smaller than the runs, against the float64 reference."""
    device = _on(device, monkeypatch)
    mod = _load("muse_moe_w4a16")
    monkeypatch.setattr(mod, "MAX_PAIRS", 8)
    problem = load_problem("muse_moe_w4a16")
    ref = problem.reference
    shapes = _moe_shapes(problem, device)
    cfg = {**mod.config_for(16), "PATH": "tc", "BT": 4, "SPLIT_UP": 1, "SPLIT_DOWN": 1}
    for name in ("same_experts_M16", "uniform_M64"):
        inputs = ref.make_inputs(shapes[name], 5, device)
        want = ref.reference(inputs).double().cpu()
        got = mod.custom_kernel(inputs, cfg).double().cpu()
        assert (got - want).abs().max() < 0.1 and (got - want).norm() / want.norm() < 1e-2, name
