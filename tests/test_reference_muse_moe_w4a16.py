"""muse_moe_w4a16: the reference against an independent computation, the int4 layout, the routing."""

from __future__ import annotations

import numpy as np
import sys

import pytest
import torch

from pipeline.kernel.check import compare
from pipeline.kernel.evaluate import Options, evaluate
from pipeline.problems import Shape, load_problem

PROBLEM = load_problem("muse_moe_w4a16")
# The smoke-model checks of the fused path run its kernels on the GPU where there is one (the interpreter is
# off there), else interpreted on the CPU.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ref = PROBLEM.reference


def _rel_l2(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_packing_layout_low_nibble_is_even_k():
    # absmax 7.5 -> scale 1.0; -7.5 rounds (half to even) to -8, +7.5 to 8 and clamps to 7.
    w = torch.tensor([[-7.5, 7.5, 0.0, 1.0, -3.0, 2.0, 0.4, -0.6]])
    packed, scale = ref.quantize_w4a16(w, group=8)
    assert packed.dtype == torch.uint8 and scale.dtype == torch.bfloat16
    assert packed.shape == (1, 4) and scale.shape == (1, 1)
    assert float(scale) == 1.0
    # stored = q + 8; byte j = stored[2j] | stored[2j+1] << 4
    assert packed[0].tolist() == [0x0 | 0xF << 4, 0x8 | 0x9 << 4, 0x5 | 0xA << 4, 0x8 | 0x7 << 4]
    assert ref.dequantize_w4a16(packed, scale)[0].tolist() == [-8.0, 7.0, 0.0, 1.0, -3.0, 2.0, 0.0, -1.0]


def test_scale_groups_run_along_k():
    w = torch.cat([torch.full((2, 4), 7.5), torch.full((2, 4), 15.0)], dim=1)  # two groups of 4
    packed, scale = ref.quantize_w4a16(w, group=4)
    assert scale.tolist() == [[1.0, 2.0], [1.0, 2.0]]
    assert torch.equal(ref.dequantize_w4a16(packed, scale), torch.cat([torch.full((2, 4), 7.0), torch.full((2, 4), 14.0)], 1))


def test_quantize_round_trip_uses_the_whole_grid():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 64, 256, generator=g)
    packed, scale = ref.quantize_w4a16(w, group=64)
    assert packed.shape == (3, 64, 128) and scale.shape == (3, 64, 4)
    back = ref.dequantize_w4a16(packed, scale)
    # half a step, plus up to 7.5 * 2^-8 steps where a bf16-rounded-down scale makes +absmax clamp at 7
    step = scale.float().repeat_interleave(64, dim=-1)
    assert bool(((back - w).abs() <= 0.53 * step).all())
    codes = torch.cat([packed & 0xF, packed >> 4]).unique()
    assert codes.tolist() == list(range(16))


def _tiny_shape(M=5, routing="zipf"):
    params = dict(PROBLEM.model["smoke"])
    params.update(H=64, I=32, group=16, E=6, topk=3, M=M, routing=routing)
    return Shape("tiny", "test", "smoke", params)


def _independent(inputs):
    """Per token and per choice, numpy float64, nibbles decoded with % and //."""
    x = inputs["x"].float().numpy().astype(np.float64)
    ids, tw = inputs["topk_ids"].numpy(), inputs["topk_weights"].numpy().astype(np.float64)

    def deq(p, s):
        p = p.numpy().astype(np.int64)
        q = np.empty((p.shape[0], 2 * p.shape[1]))
        q[:, 0::2] = p % 16 - 8
        q[:, 1::2] = p // 16 - 8
        group = q.shape[1] // s.shape[1]
        return q * np.repeat(s.float().numpy().astype(np.float64), group, axis=1)

    I = inputs["w2"].shape[-1] * 2
    out = np.zeros_like(x)
    for m in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[m, k])
            h = deq(inputs["w13"][e], inputs["w13_scale"][e]) @ x[m]
            act = h[:I] / (1.0 + np.exp(-h[:I])) * h[I:]
            out[m] += tw[m, k] * (deq(inputs["w2"][e], inputs["w2_scale"][e]) @ act)
    return torch.from_numpy(out)


@pytest.mark.parametrize("routing", ["zipf", "same"])
def test_reference_matches_an_independent_computation(routing):
    inputs = ref.make_inputs(_tiny_shape(routing=routing), seed=3, device="cpu")
    got = ref.reference(inputs)
    assert got.dtype == torch.float32 and got.shape == (5, 64)
    assert _rel_l2(got, _independent(inputs)) < 1e-6


def test_inputs_keys_dtypes_shapes_and_determinism():
    shape = PROBLEM.shape("M7", "smoke")
    a = ref.make_inputs(shape, 11, "cpu")
    b = ref.make_inputs(shape, 11, "cpu")
    M, H, E, topk, I, group = 7, shape["H"], shape["E"], shape["topk"], shape["I"], shape["group"]
    want = {
        "x": ((M, H), torch.bfloat16),
        "topk_ids": ((M, topk), torch.int32),
        "topk_weights": ((M, topk), torch.float32),
        "w13": ((E, 2 * I, H // 2), torch.uint8),
        "w13_scale": ((E, 2 * I, H // group), torch.bfloat16),
        "w2": ((E, H, I // 2), torch.uint8),
        "w2_scale": ((E, H, I // group), torch.bfloat16),
    }
    assert {k: (tuple(v.shape), v.dtype) for k, v in a.items()} == want
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["x"], ref.make_inputs(shape, 12, "cpu")["x"])
    assert bool((a["w13_scale"].float() > 0).all()) and bool((a["w2_scale"].float() > 0).all())
    # the output is O(1), not dominated by a few elements
    out = ref.reference(a)
    assert 0.2 < float(out.std()) < 3.0


def test_routing_is_distinct_sorted_normalised_and_skewed():
    g = torch.Generator().manual_seed(5)
    ids, w = ref.zipf_topk(4096, 128, 8, g, "cpu")
    assert ids.dtype == torch.int32 and w.dtype == torch.float32
    assert all(len(set(row)) == 8 for row in ids.tolist())
    assert torch.allclose(w.sum(1), torch.ones(4096), atol=1e-6)
    assert bool((w[:, :-1] >= w[:, 1:]).all())
    counts = torch.bincount(ids.reshape(-1).long(), minlength=128).sort(descending=True).values
    assert counts[0] > 10 * counts[64]  # Zipf-like: the hottest expert is far above the median
    ids1, _ = ref.zipf_topk(1, 128, 8, g, "cpu")
    assert len(set(ids1.reshape(-1).tolist())) == 8  # 120 experts have no token


def test_same_experts_shape():
    shape = PROBLEM.shape("same_experts_M16", "smoke")
    inputs = ref.make_inputs(shape, 0, "cpu")
    sets = {frozenset(r) for r in inputs["topk_ids"].tolist()}
    assert len(sets) == 1 and len(next(iter(sets))) == shape["topk"]
    assert len({tuple(r) for r in inputs["topk_weights"].tolist()}) > 1  # each token its own weights


def _template():
    import importlib.util

    spec = importlib.util.spec_from_file_location("_moe_template", PROBLEM.directory / "template.py")
    template = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(template)
    return template


def test_baseline_and_template_agree_with_the_reference():
    template = _template()
    for shape in PROBLEM.shapes("smoke"):
        inputs = ref.make_inputs(shape, 1, "cpu")
        expected = ref.reference(inputs)
        for fn in (ref.baseline, template.custom_kernel):
            got = fn(inputs)
            assert got.dtype == torch.bfloat16 and got.is_contiguous()
            assert _rel_l2(got, expected) < 8e-3, (shape.name, fn)


@pytest.mark.parametrize("M", [1, 2, 3, 7, 300])
def test_baseline_paths_every_slot_count(M):
    """min(E, M*topk) expert slots (fewer than E, exactly E) and, above _DENSE_MAX_TOKENS, the grouped
    path; both paths agree with each other and with the reference."""
    shape = _tiny_shape(M=M)
    inputs = ref.make_inputs(shape, 7, "cpu")
    args = [inputs[k] for k in ref._KEYS]
    expected = ref.reference(inputs)
    dense = ref._moe_dense_slots(*args)
    assert _rel_l2(dense, expected) < 1e-2
    assert torch.equal(ref.baseline(inputs), dense) or M > ref._DENSE_MAX_TOKENS
    if hasattr(torch.nn.functional, "grouped_mm"):
        grouped = ref._moe_grouped(*args)
        assert grouped.dtype == torch.bfloat16 and grouped.shape == dense.shape and grouped.is_contiguous()
        assert _rel_l2(grouped, dense) < 1e-3
        if M > ref._DENSE_MAX_TOKENS:
            assert torch.equal(ref.baseline(inputs), grouped)


@pytest.mark.parametrize("M", [1, 7, 64, 300])
def test_baseline_and_template_run_on_meta_tensors(M):
    """A CPU proxy for CUDA-graph capturability: on the meta device every value is unknown, so .item(),
    .tolist(), nonzero, unique, bincount and branches on values all raise; static-shape code runs."""
    shape = _tiny_shape(M=M)
    inputs = {k: v.to("meta") for k, v in ref.make_inputs(shape, 0, "cpu").items()}
    for fn in (ref.baseline, _template().custom_kernel):
        out = fn(inputs)
        assert out.device.type == "meta" and out.shape == (M, shape["H"]) and out.dtype == torch.bfloat16


def test_floor():
    full = {s.name: s for s in PROBLEM.shapes("full")}
    H, I, topk, group = (full["M1"][k] for k in ("H", "I", "topk", "group"))
    per_expert = 3 * I * H // 2 + 2 * (3 * I * H // group)
    M = full["same_experts_M16"]["M"]
    assert ref.floor(full["same_experts_M16"])["bytes"] == topk * per_expert + 4 * M * H + 8 * M * topk
    assert ref.floor(full["M1"])["flops"] == 2 * topk * 3 * I * H
    used = [ref.expected_active_experts(full[n]) for n in ("M1", "M7", "M16", "M32", "M64", "uniform_M64")]
    assert used[0] == pytest.approx(topk, abs=1e-9)
    assert all(a < b for a, b in zip(used, used[1:])) and used[-1] <= full["M1"]["E"]


@pytest.mark.gpu
def test_template_on_the_full_model():
    doc = evaluate(PROBLEM.directory / "template.py", PROBLEM, Options(seeds=1, timing=False))
    failures = [(e["shape"], e["reason"]) for e in doc["correctness"] if not e["passed"]]
    assert doc["status"] == "passed", (doc["error"], failures)
    assert doc["mode"]["model"] == "full"


def _graph_outputs(fn, inputs: dict, fresh: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """As the timing harness does: 3 eager warm-up calls (here on a side stream), capture one call in a
    CUDA graph, replay it; then write `fresh` into the graph's input buffers and replay again."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn(inputs)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(inputs)
    graph.replay()
    torch.cuda.synchronize()
    first = out.clone()
    for key, value in fresh.items():
        inputs[key].copy_(value)
    graph.replay()
    torch.cuda.synchronize()
    return first, out


@pytest.mark.gpu
@pytest.mark.parametrize("target, M", [("baseline", 1), ("baseline", 32), ("template", 1), ("template", 32),
                                       ("baseline", 256), ("torch", 1), ("torch", 256)])
def test_cuda_graph_capture_on_the_full_model(target, M):
    """Baseline (the fused path), template and moe_torch are captured and replayed (the official timing
    method); the replay follows new routing written into the input buffers. M = 256: the fused path's
    PyTorch alignment and moe_torch's grouped path."""
    fn = {"baseline": ref.baseline, "torch": _torch_baseline}.get(target) or _template().custom_kernel
    shape = PROBLEM.shape("M1")
    shape.params["M"] = M
    a = ref.make_inputs(shape, 1, "cuda")
    b = ref.make_inputs(shape, 2, "cuda")
    if target == "torch" and M > ref._DENSE_MAX_TOKENS:
        assert ref._grouped_mm_usable(a["x"]) == hasattr(torch.nn.functional, "grouped_mm")
    want_a, want_b = ref.reference(a), ref.reference(b)
    tol = PROBLEM.tolerances["output"]
    got_a, got_b = _graph_outputs(fn, a, b)
    for got, want in ((got_a, want_a), (got_b, want_b)):
        verdict = compare(got, want, tol, expected_dtype=torch.bfloat16)
        assert verdict["passed"], verdict


def _torch_baseline(inputs):
    return ref.moe_torch(*(inputs[k] for k in ref._KEYS))


def _fused():
    sys.path.insert(0, str(PROBLEM.reference_path.parent))
    import _fused_moe_w4a16

    return _fused_moe_w4a16


@pytest.mark.parametrize("path", ["kernel", "torch"])
@pytest.mark.parametrize("routing", ["zipf", "same", "empty_expert"])
def test_the_alignment_places_every_pair_once_in_blocks_of_one_expert(routing, path, device, monkeypatch):
    """align_block_size: each (token, expert) pair exactly once, grouped by expert in expert order, each
    expert's run padded to the block size with the sentinel, every block of one expert, the blocks past
    the real end marked; all with fixed sizes (what lets a CUDA graph capture it). Both paths: the one-
    program Triton kernel (decode sizes) and the PyTorch ops (prefill sizes)."""
    fm = _fused()
    if path == "torch":
        monkeypatch.setattr(fm, "ALIGN_KERNEL_MAX_PAIRS", 0)
    E, M, topk, bm = 8, 13, 2, 4
    g = torch.Generator().manual_seed(3)
    if routing == "same":
        ids = torch.tensor([[1, 5]] * M)
    else:
        ids = torch.stack([torch.randperm(E - (routing == "empty_expert"), generator=g)[:topk] for _ in range(M)])
    ids = ids.to(torch.int32).to(device)
    pairs, block_expert, total = fm.align_block_size(ids, E, bm)
    flat = ids.reshape(-1).cpu().long()
    pairs, block_expert, total = pairs.cpu().long(), block_expert.cpu().long(), int(total.cpu())
    n = flat.numel()
    real = pairs[pairs < n]
    assert sorted(real.tolist()) == list(range(n))
    # room for every used expert's run padded, and no more experts used than there are pairs
    assert pairs.numel() == -(-(n + min(E, n) * (bm - 1)) // bm) * bm and block_expert.numel() == pairs.numel() // bm
    counts = torch.bincount(flat, minlength=E)
    assert total == int(((counts + bm - 1) // bm * bm).sum())
    assert (pairs[total:] == n).all() and (block_expert[total // bm:] == E).all()
    for b in range(total // bm):
        block = pairs[b * bm:(b + 1) * bm]
        members = block[block < n]
        assert members.numel() > 0 and (flat[members] == block_expert[b]).all()
        assert (block[members.numel():] == n).all()  # the padding comes after the pairs
    assert block_expert[: total // bm].tolist() == sorted(block_expert[: total // bm].tolist())


@pytest.mark.parametrize("M, E, topk, bm", [(1, 128, 8, 16), (32, 128, 8, 16), (32, 128, 8, 64), (7, 8, 2, 16)])
def test_the_alignment_kernel_gives_the_torch_path_bit_for_bit(M, E, topk, bm, device):
    """The Triton kernel's stable order within an expert is the PyTorch path's, so both give one layout."""
    fm = _fused()
    g = torch.Generator().manual_seed(M + E)
    ids = torch.stack([torch.randperm(E, generator=g)[:topk] for _ in range(M)]).to(torch.int32).to(device)
    max_padded = fm.padded_capacity(ids.numel(), E, bm)
    for got, want in zip(fm.align_block_size(ids, E, bm), fm._align_torch(ids, E, bm, max_padded)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("scheme", [0, 1])
@pytest.mark.parametrize("name", ["M1", "M16", "same_experts_M16", "M64"])
def test_the_fused_baseline_is_right_with_margin_on_the_smoke_model(name, scheme):
    """The fused path against the reference, on the CPU through Triton's interpreter: within a third of
    every tolerance (a baseline must pass every shape with margin: kernel-track.md), in both of its
    schemes (exact weights scaled after each group's dot; weights rounded to bf16 before it)."""
    fm = _fused()
    inputs = ref.make_inputs(PROBLEM.shape(name, "smoke"), 5, DEVICE)
    config = {**fm.config_for(inputs["x"].shape[0]), "SCHEME": scheme}
    got = fm.fused_moe(*(inputs[k] for k in ref._KEYS), config=config)
    tol = PROBLEM.tolerances["output"]
    verdict = compare(got, ref.reference(inputs), tol, expected_dtype=torch.bfloat16)
    assert verdict["passed"], verdict
    assert verdict["rel_l2"] <= tol.rel_l2 / 3 and verdict["max_abs"] <= (tol.max_abs or 1) / 3, verdict


@pytest.mark.parametrize("split_up, split_down", [(2, 1), (4, 2), (1, 2)])
@pytest.mark.parametrize("name", ["M1", "M16"])
def test_the_split_k_paths_are_right_on_the_smoke_model(name, split_up, split_down):
    """Split-K (the gate/up or the down GEMM's K shared by several programs, fp32 parts added in a fixed
    order afterwards): within a third of every tolerance, as the unsplit path."""
    fm = _fused()
    inputs = ref.make_inputs(PROBLEM.shape(name, "smoke"), 6, DEVICE)
    config = {**fm.config_for(inputs["x"].shape[0]), "SPLIT_UP": split_up, "SPLIT_DOWN": split_down}
    got = fm.fused_moe(*(inputs[k] for k in ref._KEYS), config=config)
    tol = PROBLEM.tolerances["output"]
    verdict = compare(got, ref.reference(inputs), tol, expected_dtype=torch.bfloat16)
    assert verdict["passed"], verdict
    assert verdict["rel_l2"] <= tol.rel_l2 / 3 and verdict["max_abs"] <= (tol.max_abs or 1) / 3, verdict


def test_a_split_that_does_not_divide_the_groups_is_refused():
    fm = _fused()
    inputs = ref.make_inputs(PROBLEM.shape("M1", "smoke"), 6, DEVICE)
    with pytest.raises(ValueError, match="SPLIT_UP = 3 must divide the 4 quantisation groups"):
        fm.fused_moe(*(inputs[k] for k in ref._KEYS), config={**fm.config_for(1), "SPLIT_UP": 3})


@pytest.mark.gpu
@pytest.mark.parametrize("scheme, deq", [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)])
@pytest.mark.parametrize("M", [1, 32, 256])
@pytest.mark.parametrize("split", [1, 4])
def test_every_variant_of_the_fused_path_is_right_on_the_full_model(M, scheme, deq, split):
    """Every (scheme, unpacking, split-K) the tuning may choose, on the GPU, where the conversion-free
    unpacking (DEQ 1) and the packed one in PTX (DEQ 2) run (the interpreter takes the plain path): within a
    third of every tolerance."""
    fm = _fused()
    shape = PROBLEM.shape("M1")
    shape.params["M"] = M
    inputs = ref.make_inputs(shape, 4, "cuda")
    config = {**fm.config_for(M), "SCHEME": scheme, "DEQ": deq, "SPLIT_UP": split, "SPLIT_DOWN": min(split, 2)}
    got = fm.fused_moe(*(inputs[k] for k in ref._KEYS), config=config)
    tol = PROBLEM.tolerances["output"]
    verdict = compare(got, ref.reference(inputs), tol, expected_dtype=torch.bfloat16)
    assert verdict["passed"], verdict
    assert verdict["rel_l2"] <= tol.rel_l2 / 3 and verdict["max_abs"] <= (tol.max_abs or 1) / 3, verdict
