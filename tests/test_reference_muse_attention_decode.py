"""muse_attention_decode: the reference against a naive per-token computation, the layout of the paged
cache (pages really scattered, padding entries valid, garbage where no request owns a slot), the
literal workload lengths, and the baseline kernels."""

from __future__ import annotations

import math

import pytest
import torch

from pipeline.kernel.check import compare
from pipeline.problems import Shape, load_problem

NAME = "muse_attention_decode"


@pytest.fixture
def problem():
    return load_problem(NAME)


@pytest.fixture
def ref(problem):
    # Loaded inside a test (after conftest set TRITON_INTERPRET on a CPU), never at collection.
    return problem.reference


def _shape(seq_lens, Hq=6, Hkv=2, D=8, page=4):
    return Shape("tiny", "test", "smoke", {"Hq": Hq, "Hkv": Hkv, "D": D, "page": page, "seq_lens": list(seq_lens),
                                           "B": len(seq_lens)})


def _args(inputs):
    return tuple(inputs[k] for k in ("q", "k_cache", "v_cache", "block_table", "seq_lens", "scale"))


def test_workload_lengths_are_the_published_draw(problem, ref):
    for B in (16, 32):
        lens = ref.decode_lengths(B)
        assert len(lens) == B and all(2048 <= n <= 32768 for n in lens)
        assert problem.shape(f"B{B}", "full")["seq_lens"] == lens
        # The smoke model divides the long lengths by 32.
        assert problem.shape(f"B{B}", "smoke")["seq_lens"] == [n // 32 for n in lens]
    assert ref.decode_lengths(16)[:3] == [5367, 12626, 16215]
    for size in ("full", "smoke"):
        for s in problem.shapes(size):
            assert s["B"] == len(s["seq_lens"]) and min(s["seq_lens"]) >= 1, s.name
    assert [problem.shape(n, "smoke")["seq_lens"] for n in ("L1", "L15", "L16", "L17")] == [[1], [15], [16], [17]]


def test_reference_matches_a_naive_per_token_computation(ref):
    shape = _shape([1, 5, 8, 13])
    inputs = ref.make_inputs(shape, 7, "cpu")
    q, kc, vc, bt, lens, scale = _args(inputs)
    B, Hq, D = q.shape
    page, Hkv = kc.shape[1], kc.shape[2]
    G = Hq // Hkv
    want = torch.zeros(B, Hq, D, dtype=torch.float64)
    for b in range(B):
        for h in range(Hq):
            rows = []
            for t in range(int(lens[b])):
                p, slot = int(bt[b, t // page]), t % page
                k = kc[p, slot, h // G].double()
                rows.append((float(q[b, h].double() @ k) * scale, vc[p, slot, h // G].double()))
            top = max(s for s, _ in rows)
            w = [math.exp(s - top) for s, _ in rows]
            want[b, h] = sum(wi * v for wi, (_, v) in zip(w, rows)) / sum(w)
    got = ref.reference(inputs)
    assert got.dtype == torch.float32 and got.shape == (B, Hq, D)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
    # Length 1: the output is exactly that token's V row of its KV head.
    torch.testing.assert_close(got[0], vc[int(bt[0, 0]), 0].float().repeat_interleave(G, dim=0))


def test_paged_cache_is_scattered_with_valid_padding_and_garbage(ref):
    lens = [1, 15, 16, 17, 100, 0]
    shape = _shape(lens, Hkv=2, D=16, page=16)
    g = torch.Generator().manual_seed(3)
    kc, vc, bt = ref.make_paged_cache(lens, shape, g, "cpu", spare_pages=8)
    need = [-(-n // 16) for n in lens]
    assert kc.dtype == vc.dtype == torch.bfloat16 and kc.shape == vc.shape == (sum(need) + 8, 16, 2, 16)
    assert bt.dtype == torch.int32 and bt.shape == (len(lens), max(need) + 1)
    used = [int(p) for b, n in enumerate(need) for p in bt[b, :n]]
    assert len(set(used)) == len(used), "two requests share a page"
    spare = set(range(kc.shape[0])) - set(used)
    assert len(spare) == 8
    for b, n in enumerate(need):
        assert {int(p) for p in bt[b, n:]} <= spare, "padding entries must be valid spare pages"
    long_pages = [int(p) for p in bt[4, :need[4]]]
    assert any(b != a + 1 for a, b in zip(long_pages, long_pages[1:])), "pages of a request are contiguous"
    # Values: N(0, 1) in owned slots, larger garbage elsewhere; never all zero.
    owned = torch.zeros(kc.shape[0], 16, dtype=torch.bool)
    for b, n in enumerate(lens):
        for t in range(n):
            owned[int(bt[b, t // 16]), t % 16] = True
    for cache in (kc, vc):
        good, junk = cache[owned].float(), cache[~owned].float()
        assert 0.9 < good.std() < 1.1 and junk.std() > 3 * good.std()
    # Same generator state, same cache: make_inputs is reproducible from its seed.
    again = ref.make_paged_cache(lens, shape, torch.Generator().manual_seed(3), "cpu", spare_pages=8)
    assert all(torch.equal(x, y) for x, y in zip((kc, vc, bt), again))


def test_make_inputs_contract(problem, ref):
    shape = problem.shape("B3", "smoke")
    a = ref.make_inputs(shape, 11, "cpu")
    assert list(a) == ["q", "k_cache", "v_cache", "block_table", "seq_lens", "scale"]
    Hq, Hkv, D, page = shape["Hq"], shape["Hkv"], shape["D"], shape["page"]
    assert a["q"].shape == (3, Hq, D) and a["q"].dtype == torch.bfloat16
    assert a["k_cache"].shape[1:] == (page, Hkv, D) and a["v_cache"].shape == a["k_cache"].shape
    assert a["seq_lens"].dtype == torch.int32 and a["seq_lens"].tolist() == shape["seq_lens"]
    assert isinstance(a["scale"], float) and a["scale"] == D ** -0.5
    b = ref.make_inputs(shape, 11, "cpu")
    c = ref.make_inputs(shape, 12, "cpu")
    assert all(torch.equal(a[k], b[k]) for k in ("q", "k_cache", "block_table"))
    assert not torch.equal(a["q"], c["q"]) and not torch.equal(a["block_table"], c["block_table"])
    copies = {k: v.clone() for k, v in a.items() if isinstance(v, torch.Tensor)}
    ref.reference(a)
    assert all(torch.equal(a[k], v) for k, v in copies.items()), "the reference modified its inputs"


def test_floor(ref):
    shape = _shape([1, 17], Hq=4, Hkv=2, D=8, page=16)
    f = ref.floor(shape)
    q = out = 2 * 4 * 8 * 2
    kv = 18 * 2 * 8 * 2 * 2
    assert f == {"bytes": q + kv + 3 * 4 + 2 * 4 + out, "flops": 4 * 18 * 4 * 8}


@pytest.mark.parametrize("splits", [1, 3, 7])
def test_triton_split_kv_matches_the_reference(problem, ref, splits, device):
    # Interpreted on a CPU. splits=7 over 1 and 40 tokens leaves empty splits, which must be skipped.
    shape = _shape([1, 40, 300, 16], Hq=4, Hkv=2, D=16, page=16)
    inputs = ref.make_inputs(shape, 5, device)
    expected = ref.reference(inputs)
    out = ref.split_kv_decode(*_args(inputs), splits=splits, block_n=16)
    v = compare(out, expected, problem.tolerances["output"], expected_dtype=torch.bfloat16)
    assert v["passed"], v
    assert v["rel_l2"] < 3e-3  # bf16 rounding of the output (~1.7e-3), plus bf16 P on a GPU


def test_baseline_matches_the_reference(problem, ref, device):
    for name in ("B3", "L17"):
        inputs = ref.make_inputs(problem.shape(name, "smoke"), 1, device)
        v = compare(ref.baseline(inputs), ref.reference(inputs), problem.tolerances["output"],
                    expected_dtype=torch.bfloat16)
        assert v["passed"], (name, v)


@pytest.mark.gpu
def test_template_passes_on_the_full_model():
    from pipeline.kernel.evaluate import Options, evaluate

    problem = load_problem(NAME)
    doc = evaluate(problem.directory / "template.py", problem, Options(seeds=1, timing=False))
    failures = [(e["shape"], e["reason"]) for e in doc["correctness"] if not e["passed"]]
    assert doc["status"] == "passed", (doc["error"], failures)
    assert doc["mode"]["model"] == "full" and len(doc["correctness"]) == len(problem.shapes("full"))


@pytest.mark.gpu
def test_triton_baseline_on_the_full_model():
    problem = load_problem(NAME)
    ref = problem.reference
    for shape in problem.shapes("full"):
        inputs = ref.make_inputs(shape, 2, "cuda")
        v = compare(ref.baseline(inputs), ref.reference(inputs), problem.tolerances["output"],
                    expected_dtype=torch.bfloat16)
        assert v["passed"], (shape.name, v)
        del inputs
        torch.cuda.empty_cache()
