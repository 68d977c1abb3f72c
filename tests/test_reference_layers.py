"""The two whole-layer references (muse_decode_layer, muse_prefill_layer) against an independent,
token-by-token float64 computation, plus the facts their inputs promise: the pages are scattered, the
written slots are exactly the new tokens', the routing margins are wide, and the references agree
with each other (a decode step is an extend of one token)."""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pytest
import torch

from pipeline.kernel.evaluate import Options, evaluate
from pipeline.problems import Shape, load_problem

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "reference"))
if not torch.cuda.is_available():
    # Triton picks the interpreter when a kernel is decorated, i.e. when _muse_layer is first imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import _muse_layer as layer  # noqa: E402

DECODE = load_problem("muse_decode_layer")
PREFILL = load_problem("muse_prefill_layer")
MODEL = "full" if torch.cuda.is_available() else "smoke"
# The Triton kernels run on the GPU where there is one (the interpreter is off there), else interpreted on the CPU.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _shape(problem, **params) -> Shape:
    p = dict(problem.model["smoke"])
    p.update(params)
    return Shape("tiny", "test", "smoke", p)


# ---------------------------------------------------------------------------------------------------
# An independent float64 layer: one token at a time, written from the problem statement


def _unpack_int4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    rows, half = packed.shape
    w = torch.zeros(rows, 2 * half, dtype=torch.float64)
    group = 2 * half // scale.shape[1]
    for k in range(2 * half):
        byte = packed[:, k // 2].long()
        nib = (byte & 15) if k % 2 == 0 else (byte >> 4)
        w[:, k] = (nib - 8).double() * scale[:, k // group].double()
    return w


def _rope_complex(v: torch.Tensor, pos: int, theta: float) -> torch.Tensor:
    """neox RoPE as a complex rotation of the pairs (i, i + D/2)."""
    D = v.shape[-1]
    z = torch.complex(v[..., : D // 2], v[..., D // 2:])
    ang = torch.tensor([pos * theta ** (-2.0 * i / D) for i in range(D // 2)], dtype=torch.float64)
    z = z * torch.polar(torch.ones_like(ang), ang)
    return torch.cat((z.real, z.imag), dim=-1)


def naive_layer(inputs: dict, req: list[int], pos: list[int]):
    x = inputs["x"].double()
    T, H = x.shape
    _, page, Hkv, D = inputs["k_cache"].shape
    Hq = inputs["wo"].shape[1] // D
    eps, theta, topk = inputs["eps"], inputs["theta"], inputs["topk"]
    bt = inputs["block_table"]

    def norm(v, w):
        return v / math.sqrt(float((v * v).mean()) + eps) * w.double()

    kc = inputs["k_cache"].clone()
    vc = inputs["v_cache"].clone()
    new_k, new_v, qs = {}, {}, []
    for t in range(T):
        qkv = inputs["wqkv"].double() @ norm(x[t], inputs["attn_norm"])
        q = qkv[: Hq * D].view(Hq, D)
        k = qkv[Hq * D:(Hq + Hkv) * D].view(Hkv, D)
        v = qkv[(Hq + Hkv) * D:].view(Hkv, D)
        qs.append(_rope_complex(q, pos[t], theta))
        k = _rope_complex(k, pos[t], theta)
        pg, row = int(bt[req[t], pos[t] // page]), pos[t] % page
        new_k[(pg, row)], new_v[(pg, row)] = k, v
        kc[pg, row], vc[pg, row] = k.to(kc.dtype), v.to(vc.dtype)
    out = torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        keys = [(int(bt[req[t], j // page]), j % page) for j in range(pos[t] + 1)]
        K = torch.stack([kc[p, r].double() for p, r in keys])  # [n, Hkv, D]
        V = torch.stack([vc[p, r].double() for p, r in keys])
        o = torch.zeros(Hq, D, dtype=torch.float64)
        for hh in range(Hq):
            kv = hh // (Hq // Hkv)
            s = (K[:, kv] @ qs[t][hh]) / math.sqrt(D)
            o[hh] = torch.softmax(s, 0) @ V[:, kv]
        h = x[t] + inputs["wo"].double() @ o.reshape(-1)
        hn = norm(h, inputs["ffn_norm"])
        probs = torch.softmax(inputs["router"].double() @ hn, 0)
        top = torch.argsort(probs, descending=True)[:topk]
        wts = probs[top] / probs[top].sum()
        moe = torch.zeros(H, dtype=torch.float64)
        I = inputs["w2"].shape[-1] * 2
        for e, wt in zip(top.tolist(), wts):
            gu = _unpack_int4(inputs["w13"][e], inputs["w13_scale"][e]) @ hn
            act = gu[:I] / (1 + torch.exp(-gu[:I])) * gu[I:]
            moe += wt * (_unpack_int4(inputs["w2"][e], inputs["w2_scale"][e]) @ act)
        out[t] = h + moe
    return out, new_k, new_v


def _check_against_naive(ref_mod, inputs, req, pos):
    pristine = {k: v.clone() for k, v in inputs.items() if isinstance(v, torch.Tensor)}
    got = ref_mod.reference(inputs)
    for k, v in pristine.items():
        assert torch.equal(v, inputs[k]), f"the reference modified {k}"
    out, new_k, new_v = naive_layer(inputs, req, pos)
    assert got["output"].dtype == torch.float32
    err = (got["output"].double() - out).norm() / out.norm()
    assert err < 1e-5, err
    mask = ref_mod.written(inputs)["k_cache"]
    assert int(mask.sum()) == len(req)
    for name, new in (("k_cache", new_k), ("v_cache", new_v)):
        exp = got[name]
        assert torch.equal(exp[~mask.expand_as(exp)], inputs[name].float()[~mask.expand_as(exp)])
        for (pg, row), val in new.items():
            assert bool(mask[pg, row, 0, 0])
            assert torch.allclose(exp[pg, row].double(), val, atol=1e-5, rtol=1e-5)


def test_decode_reference_matches_a_token_by_token_computation():
    shape = _shape(DECODE, B=4, seq_lens=[1, 16, 17, 40])
    ref = DECODE.reference
    inputs = ref.make_inputs(shape, 7, "cpu")
    assert inputs["positions"].tolist() == [0, 15, 16, 39]
    assert inputs["seq_lens"].tolist() == [1, 16, 17, 40]
    _check_against_naive(ref, inputs, list(range(4)), [0, 15, 16, 39])


def test_prefill_reference_matches_a_token_by_token_computation():
    shape = _shape(PREFILL, new=[3, 1, 6], prefix=[0, 21, 13])
    ref = PREFILL.reference
    inputs = ref.make_inputs(shape, 11, "cpu")
    assert inputs["cu_seqlens"].tolist() == [0, 3, 4, 10]
    req = [0, 0, 0, 1, 2, 2, 2, 2, 2, 2]
    pos = [0, 1, 2, 21, 13, 14, 15, 16, 17, 18]
    _check_against_naive(ref, inputs, req, pos)


def test_decode_is_an_extend_of_one_token():
    """The two references agree: a decode batch run through the prefill reference gives the same layer."""
    shape = _shape(DECODE, B=3, seq_lens=[5, 33, 100])
    inputs = DECODE.reference.make_inputs(shape, 3, "cpu")
    as_prefill = {k: v for k, v in inputs.items() if k not in ("positions", "seq_lens")}
    as_prefill["cu_seqlens"] = torch.arange(4, dtype=torch.int32)
    as_prefill["prefix_lens"] = inputs["positions"].clone()
    a = DECODE.reference.reference(inputs)
    b = PREFILL.reference.reference(as_prefill)
    for key in ("output", "k_cache", "v_cache"):
        assert torch.allclose(a[key], b[key], atol=1e-5, rtol=1e-5), key
    assert torch.equal(DECODE.reference.written(inputs)["k_cache"], PREFILL.reference.written(as_prefill)["k_cache"])


@pytest.mark.parametrize("problem", [DECODE, PREFILL], ids=lambda p: p.name)
def test_layout_and_routing_facts(problem):
    """Scattered pages, new slots inside the request's pages and full of garbage, wide routing margins."""
    ref = problem.reference
    for shape in problem.shapes("smoke"):
        inputs = ref.make_inputs(shape, 1, "cpu")
        bt = inputs["block_table"]
        mask = ref.written(inputs)["k_cache"]
        assert mask.shape == (inputs["k_cache"].shape[0], inputs["k_cache"].shape[1], 1, 1)
        T = inputs["x"].shape[0]
        assert int(mask.sum()) == T, shape.name
        # The new tokens' slots hold large garbage until the layer writes them.
        for name in ("k_cache", "v_cache"):
            assert float(inputs[name][mask.expand_as(inputs[name])].float().abs().min()) >= 7.9
        # Pages scattered: some request's consecutive pages are not consecutive in the pool.
        page = inputs["k_cache"].shape[1]
        if problem is DECODE:
            lens = inputs["seq_lens"].tolist()
        else:
            cu = inputs["cu_seqlens"].tolist()
            lens = [p + cu[i + 1] - cu[i] for i, p in enumerate(inputs["prefix_lens"].tolist())]
        runs = [bt[b, : (n + page - 1) // page].long() for b, n in enumerate(lens)]
        if sum(r.numel() for r in runs) > 4:
            assert any(bool((r.diff() != 1).any()) for r in runs if r.numel() > 1), shape.name
        # Routing: the reference's top-k has a wide margin to the next expert.
        x = inputs["x"]
        logits = layer.rms_norm_ref(x, inputs["ffn_norm"], inputs["eps"]) @ inputs["router"].double().T
        srt = logits.sort(-1, descending=True).values
        k = inputs["topk"]
        assert float((srt[:, k - 1] - srt[:, k]).min()) > 0.3, shape.name


def test_routing_of_the_reference_has_margin_after_attention():
    """With attention added, the reference's chosen experts still beat the rest by far more than bf16 error."""
    shape = DECODE.shape("B32", "smoke")
    inputs = DECODE.reference.make_inputs(shape, 5, "cpu")
    captured = {}
    real_route = layer.route

    def spy(logits, topk):
        captured["logits"] = logits
        return real_route(logits, topk)

    layer.route = spy
    try:
        DECODE.reference.reference(inputs)
    finally:
        layer.route = real_route
    srt = captured["logits"].sort(-1, descending=True).values
    k = inputs["topk"]
    gap = srt[:, k - 1] - srt[:, k]
    assert float(gap.min()) > 0.3
    probs = torch.softmax(captured["logits"], -1)
    left_out = 1 - probs.sort(-1, descending=True).values[:, :k].sum(-1)
    assert float(left_out.mean()) > 0.1  # not renormalising the top-k weights is visible


@pytest.mark.parametrize("problem", [DECODE, PREFILL], ids=lambda p: p.name)
def test_baseline_is_repeatable_in_place(problem):
    """The timing loop calls the baseline again and again on the same inputs: the cache writes are idempotent."""
    ref = problem.reference
    shape = problem.shapes("smoke")[0]
    inputs = ref.make_inputs(shape, 2, "cpu")
    a = ref.baseline(inputs)
    caches = (inputs["k_cache"].clone(), inputs["v_cache"].clone())
    b = ref.baseline(inputs)
    assert torch.equal(a, b)
    assert torch.equal(caches[0], inputs["k_cache"]) and torch.equal(caches[1], inputs["v_cache"])


def test_prefill_baseline_attention_kernel_matches_the_reference_attention():
    """The Triton extend-attention kernel of the prefill baseline (run by the interpreter on a CPU), and the
    device-side token index it relies on."""
    if layer.triton is None:
        pytest.skip("triton is not installed")
    ref = PREFILL.reference
    inputs = ref.make_inputs(PREFILL.shape("ragged", "smoke"), 4, "cpu")
    starts, prefix, new, req, pos = ref._requests(inputs)
    r2, p2 = layer.token_index(inputs["cu_seqlens"], inputs["prefix_lens"], inputs["x"].shape[0])
    assert torch.equal(r2, req) and torch.equal(p2, pos)
    T = inputs["x"].shape[0]
    _, _, Hkv, D = inputs["k_cache"].shape
    Hq = inputs["wo"].shape[1] // D
    q = (torch.randn(T, Hq, D, generator=torch.Generator().manual_seed(0)) * 2).to(torch.bfloat16)
    want = layer.extend_attention_ref(q, inputs["k_cache"], inputs["v_cache"], inputs["block_table"], starts, prefix,
                                      new, D**-0.5)
    got = layer.extend_attention_triton(q, inputs["k_cache"], inputs["v_cache"], inputs["block_table"],
                                        inputs["cu_seqlens"], inputs["prefix_lens"], D**-0.5, block_m=16, block_n=32)
    assert float((got.float() - want).norm() / want.norm()) < 4e-3


def test_decode_workloads_use_the_context_lengths_of_the_attention_problem():
    from muse_attention_decode import decode_lengths

    attention = load_problem("muse_attention_decode")
    for name in ("B1", "B16", "B32"):
        for size in ("full", "smoke"):
            assert DECODE.shape(name, size)["seq_lens"] == attention.shape(name, size)["seq_lens"], (name, size)
    for B in (16, 32):
        assert DECODE.shape(f"B{B}", "full")["seq_lens"] == decode_lengths(B)


def test_floors():
    full = DECODE.shape("B1", "full")
    f = DECODE.reference.floor(full)
    H, E, I = full["H"], full["E"], full["I"]
    expert_bytes = 3 * H * I // 2  # int4 weights of one expert, scales aside
    # B1 touches exactly topk experts: the floor must not count all E of them.
    assert f["bytes"] < 2 * 5120 * 7168 * 2 + full["topk"] * expert_bytes * 1.1 + 16384 * 8 * 128 * 4 + (1 << 26)
    p8k = PREFILL.reference.floor(PREFILL.shape("prefill_8k", "full"))
    assert p8k["bytes"] > 0.95 * E * expert_bytes  # 8,192 tokens use every expert
    # Causal attention pairs: n (n + 1) / 2 for a plain prefill.
    n = 8192
    gemm = 2 * n * H * (7168 + 5120 + E) + 2 * n * full["topk"] * 3 * H * I
    assert p8k["flops"] == gemm + 4 * 40 * 128 * n * (n + 1) // 2


@pytest.mark.gpu
@pytest.mark.parametrize("problem", [DECODE, PREFILL], ids=lambda p: p.name)
def test_template_passes_on_the_full_model(problem):
    doc = evaluate(problem.directory / "template.py", problem, Options(seeds=1, timing=False))
    failures = [(e["shape"], e["reason"]) for e in doc["correctness"] if not e["passed"]]
    assert doc["status"] == "passed", (doc["error"], failures)
    assert doc["mode"]["model"] == "full"


@pytest.mark.heavy  # the layers' Triton kernels in the interpreter
@pytest.mark.parametrize("name", ["muse_decode_layer", "muse_prefill_layer"])
def test_the_layers_with_the_fused_experts_are_right_on_the_smoke_model(name):
    """The layers' GPU baseline (the fused MoE for the experts) against the reference on one workload,
    on the CPU through Triton's interpreter: the hidden output and every written cache slot pass."""
    from pipeline.kernel.evaluate import _expected, check_outputs
    from pipeline.problems import load_problem

    problem = load_problem(name)
    ref_mod = problem.reference
    shape = problem.shapes("smoke", kinds=("workload",))[0]
    inputs = ref_mod.make_inputs(shape, 3, DEVICE)
    expected = _expected(problem, inputs)
    pristine = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    sys.path.insert(0, str(problem.reference_path.parent))
    from _fused_moe_w4a16 import fused_moe

    out = ref_mod.baseline(inputs, experts=fused_moe)
    got = {"output": out, **{k: inputs[k] for k in problem.inplace}}
    verdicts = check_outputs(problem, got, expected, pristine)
    assert all(v["passed"] for v in verdicts.values()), verdicts


def _ops():
    sys.path.insert(0, str(load_problem("muse_decode_layer").reference_path.parent))
    import _layer_ops

    return _layer_ops


@pytest.mark.parametrize("residual", [False, True])
def test_the_fused_rms_norm_rounds_as_the_composition(residual):
    """RMSNorm (and the residual add before it) in one kernel: the composition's bf16 values, up to one
    bf16 step where a sum's order flips a rounding."""
    ops = _ops()
    g = torch.Generator().manual_seed(11)
    x = torch.randn(5, 256, generator=g).to(DEVICE, torch.bfloat16)
    r = torch.randn(5, 256, generator=g).to(DEVICE, torch.bfloat16)
    w = (1 + 0.1 * torch.randn(256, generator=g)).to(DEVICE, torch.bfloat16)
    if residual:
        got, h = ops.rms_norm(x, w, 1e-5, residual=r)
        assert torch.equal(h, x + r)
        want = layer.rms_norm_bf16(x + r, w, 1e-5)
    else:
        got, want = ops.rms_norm(x, w, 1e-5), layer.rms_norm_bf16(x, w, 1e-5)
    step = (want.float().abs() * 2**-7).clamp_min(1e-30)
    assert ((got.float() - want.float()).abs() <= step).all()
    assert (got == want).float().mean() > 0.95


def test_rope_with_the_cache_write_is_the_composition():
    """q and k rotated as rope_neox in fp32 (angles in float64, position 65,535 included), k and v landing
    in each token's slot of the paged cache and nowhere else."""
    ops = _ops()
    g = torch.Generator().manual_seed(12)
    Hq, Hkv, D, page = 4, 2, 64, 16
    pos = torch.tensor([0, 15, 16, 65535, 300], dtype=torch.int32, device=DEVICE)
    req = torch.tensor([0, 1, 1, 2, 3], device=DEVICE)
    T = pos.numel()
    qkv = torch.randn(T, (Hq + 2 * Hkv) * D, generator=g).to(DEVICE, torch.bfloat16)
    block_table = torch.randperm(4 * 4096, generator=g)[: 4 * 4096].view(4, 4096).to(DEVICE, torch.int32)
    pages = int(block_table.max()) + 1
    kc = torch.zeros(pages, page, Hkv, D, dtype=torch.bfloat16, device=DEVICE)
    vc = torch.zeros_like(kc)
    got_q = ops.rope_and_cache(qkv, pos, req, block_table, kc, vc, 1e6, Hq)
    q, k, v = layer._split_qkv(qkv, Hq, Hkv, D)
    cos, sin = layer.rope_cos_sin(pos, D, 1e6, torch.float32)
    _same_rounding(got_q, layer.rope_neox(q.float(), cos, sin).to(torch.bfloat16))
    slots = layer.cache_slots(block_table, req, pos, page)
    want_k = torch.zeros_like(kc)
    want_k.view(-1, Hkv, D)[slots] = layer.rope_neox(k.float(), cos, sin).to(torch.bfloat16)
    want_v = torch.zeros_like(vc)
    want_v.view(-1, Hkv, D)[slots] = v
    _same_rounding(kc, want_k)
    assert torch.equal(vc, want_v)


def _same_rounding(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit for bit in the interpreter; on a GPU the compiler contracts t1*c - t2*s into one fused multiply-
    add (one fp32 rounding instead of two), which flips a bf16 rounding now and then: one bf16 step there,
    at a few elements. Where t1*c and t2*s nearly cancel, the two fp32 roundings differ by ~2^-24 of the
    terms (inputs ~1), many steps of a tiny result: an absolute 1e-6 there."""
    if not got.is_cuda:
        assert torch.equal(got, want)
        return
    step = (want.float().abs() * 2**-7).clamp_min(1e-6)
    diff = (got.float() - want.float()).abs()
    worst = int((diff / step).argmax())
    assert (diff <= step).all(), (f"{int((diff > step).sum())} of {diff.numel()} elements beyond one bf16 step; the "
                                  f"worst at flat index {worst} of shape {tuple(got.shape)}: {got.flatten()[worst].item()!r} "
                                  f"against {want.flatten()[worst].item()!r}")
    assert (got != want).float().mean() < 0.01


def test_the_fused_routing_picks_the_compositions_experts():
    ops = _ops()
    g = torch.Generator().manual_seed(13)
    logits = torch.randn(7, 8, generator=g).to(DEVICE, torch.bfloat16)
    ids, w = ops.route(logits, 2)
    want_ids, want_w = layer.route(logits.float(), 2)
    assert torch.equal(ids, want_ids)
    assert torch.allclose(w, want_w, rtol=1e-6, atol=1e-7) and ids.dtype == torch.int32


@pytest.mark.heavy  # the layers' Triton kernels in the interpreter
@pytest.mark.parametrize("name", ["muse_decode_layer", "muse_prefill_layer"])
def test_the_layers_with_the_fused_ops_are_right_on_the_smoke_model(name):
    """The staged baseline (SGLang's small fused kernels between the GEMMs, the fused MoE with the residual
    in its last kernel) against the reference: the output and every written cache slot pass."""
    from pipeline.kernel.evaluate import _expected, check_outputs

    problem = load_problem(name)
    shape = problem.shapes("smoke", kinds=("workload",))[0]
    inputs = problem.reference.make_inputs(shape, 3, DEVICE)
    expected = _expected(problem, inputs)
    pristine = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    out = problem.reference.baseline(inputs, fused_ops=True)
    got = {"output": out, **{k: inputs[k] for k in problem.inplace}}
    verdicts = check_outputs(problem, got, expected, pristine)
    assert all(v["passed"] for v in verdicts.values()), verdicts
