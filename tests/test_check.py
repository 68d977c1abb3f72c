"""The comparison rules themselves, element by element."""

import torch

from pipeline.kernel.check import compare
from pipeline.problems import Tolerance

TOL = Tolerance(atol=1e-2, rtol=1e-2, rel_l2=5e-3)


def ref_and_out(n=10_000, seed=0):
    g = torch.Generator().manual_seed(seed)
    ref = torch.randn(n, generator=g)
    return ref, ref.to(torch.bfloat16)


def test_bf16_rounding_of_the_reference_passes():
    ref, out = ref_and_out()
    v = compare(out, ref, TOL, expected_dtype=torch.bfloat16)
    assert v["passed"] and v["matched_ratio"] == 1.0 and v["rel_l2"] < 3e-3


def test_matched_ratio_is_counted_exactly():
    ref, out = ref_and_out(n=50_176)
    out[123] += 1.0
    assert not compare(out, ref, TOL, expected_dtype=torch.bfloat16)["passed"]
    loose = Tolerance(atol=1e-2, rtol=1e-2, rel_l2=1.0, min_match=1 - 1 / 50_176)
    v = compare(out, ref, loose, expected_dtype=torch.bfloat16)
    assert v["passed"], v["reason"]
    out[124] += 1.0
    assert not compare(out, ref, loose, expected_dtype=torch.bfloat16)["passed"]


def test_worst_element_is_located():
    ref, out = ref_and_out(n=64)
    ref2, out2 = ref.reshape(8, 8), out.reshape(8, 8).clone()
    out2[5, 3] += 0.5
    v = compare(out2, ref2, TOL, expected_dtype=torch.bfloat16)
    assert not v["passed"] and v["worst"]["index"] == [5, 3]


def test_nan_inf_zero_shape_dtype_layout():
    ref, out = ref_and_out(n=64)
    bad = out.clone()
    bad[7] = float("inf")
    assert "NaN/Inf" in compare(bad, ref, TOL, expected_dtype=torch.bfloat16)["reason"]
    assert "all zeros" in compare(torch.zeros_like(out), ref, TOL, expected_dtype=torch.bfloat16)["reason"]
    assert "shape" in compare(out[:63], ref, TOL, expected_dtype=torch.bfloat16)["reason"]
    assert "dtype" in compare(out.float(), ref, TOL, expected_dtype=torch.bfloat16)["reason"]
    m = out.reshape(8, 8).T
    assert "contiguous" in compare(m, ref.reshape(8, 8).T.contiguous(), TOL, expected_dtype=torch.bfloat16)["reason"]


class Sub(torch.Tensor):
    pass


def test_tensor_subclass_is_refused():
    ref, out = ref_and_out(n=64)
    assert "plain torch.Tensor" in compare(out.as_subclass(Sub), ref, TOL, expected_dtype=torch.bfloat16)["reason"]


def test_masked_compare_checks_written_slots_and_untouched_bits():
    pristine = torch.randn(4, 16, dtype=torch.float32).to(torch.bfloat16)
    mask = torch.zeros(4, 16, dtype=torch.bool)
    mask[2, 5] = True
    expected = pristine.float().clone()
    expected[2, 5] = 3.0
    got = pristine.clone()
    got[2, 5] = 3.0
    tol = Tolerance(atol=1e-2, rtol=1e-2, rel_l2=1e-2)
    assert compare(got, expected, tol, expected_dtype=torch.bfloat16, mask=mask, pristine=pristine)["passed"]
    got_wrong_slot = pristine.clone()
    got_wrong_slot[2, 6] = 3.0
    v = compare(got_wrong_slot, expected, tol, expected_dtype=torch.bfloat16, mask=mask, pristine=pristine)
    assert not v["passed"] and "outside the written slots" in v["reason"]


def test_untouched_nan_bits_count_as_untouched():
    pristine = torch.randn(4, 16).to(torch.bfloat16)
    pristine[0, 0] = float("nan")
    mask = torch.zeros(4, 16, dtype=torch.bool)
    mask[3, 3] = True
    expected = pristine.float().clone()
    expected[3, 3] = 1.0
    got = pristine.clone()
    got[3, 3] = 1.0
    tol = Tolerance(atol=1e-2, rtol=1e-2, rel_l2=1e-2)
    assert compare(got, expected, tol, expected_dtype=torch.bfloat16, mask=mask, pristine=pristine)["passed"]


def test_an_error_against_an_all_zero_reference_fails_with_a_finite_rel_l2():
    """A result must hold finite numbers (pipeline/result.py refuses inf before anything is written), and
    an error against a zero reference is still the worst there is."""
    import math

    from pipeline.kernel.check import RELATIVE_TO_ZERO

    ref = torch.zeros(64)
    out = torch.zeros(64, dtype=torch.bfloat16)
    out[3] = 0.5
    v = compare(out, ref, TOL, expected_dtype=torch.bfloat16)
    assert not v["passed"] and math.isfinite(v["rel_l2"]) and v["rel_l2"] == RELATIVE_TO_ZERO
    assert compare(torch.zeros(64, dtype=torch.bfloat16), ref, TOL, expected_dtype=torch.bfloat16)["rel_l2"] == 0.0
