"""Is one output close enough to the reference? The rules of kernel-track.md, in one place.

Per element `|out - ref| <= atol + rtol*|ref|` on at least `min_match` of the elements, every element
within `max_abs` where the problem sets one, and a relative-L2 bound on the whole tensor. NaN or Inf
anywhere fails, an all-zero output fails, and shape, dtype and layout must match.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from pipeline.problems import Tolerance

RELATIVE_TO_ZERO = 1e300  # the rel-L2 of a nonzero error against an all-zero reference


def _index(flat_index: int, shape: torch.Size) -> list[int]:
    idx = []
    for d in reversed(shape):
        idx.append(flat_index % d if d else 0)
        flat_index //= max(d, 1)
    return list(reversed(idx))


def _bits(t: torch.Tensor) -> torch.Tensor:
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.view(torch.uint8 if t.dtype == torch.bool else ints[t.element_size()])


def compare(
    out: Any,
    ref: torch.Tensor,
    tol: Tolerance,
    *,
    expected_dtype: torch.dtype | None = None,
    mask: torch.Tensor | None = None,
    pristine: torch.Tensor | None = None,
) -> dict[str, Any]:
    """Compare `out` with `ref` (float32/float64). Returns the measured errors and a verdict.

    With `mask` (a boolean tensor broadcastable to `ref`) the tolerance applies to the masked
    elements only and every other element must equal `pristine` bit for bit: the rule for a cache
    that a layer writes in place.
    """
    m: dict[str, Any] = {"passed": False, "reason": None}
    if not isinstance(out, torch.Tensor) or type(out) is not torch.Tensor:
        m["reason"] = f"returned a {type(out).__name__}, expected a plain torch.Tensor"
        return m
    if tuple(out.shape) != tuple(ref.shape):
        m["reason"] = f"shape {list(out.shape)} != expected {list(ref.shape)}"
        return m
    want = expected_dtype or ref.dtype
    if out.dtype != want:
        m["reason"] = f"dtype {out.dtype} != expected {want}"
        return m
    if not out.is_contiguous():
        m["reason"] = f"output is not contiguous (strides {list(out.stride())}); return a contiguous tensor"
        return m
    out = out.to(ref.device)
    refd = ref.to(torch.float64)
    outd = out.to(torch.float64)
    if mask is not None:
        full_mask = mask.to(ref.device).expand(ref.shape)
        if pristine is not None:
            untouched = ~full_mask
            changed = (_bits(out) != _bits(pristine.to(ref.device))) & untouched  # bitwise: NaN == NaN here
            n_changed = int(changed.sum())
            m["untouched_changed"] = n_changed
            if n_changed:
                where = _index(int(changed.reshape(-1).nonzero()[0]), ref.shape)
                m["reason"] = f"{n_changed} elements outside the written slots changed (first at {where})"
                return m
        refd = refd[full_mask]
        outd = outd[full_mask]
        checked_shape = refd.shape
    else:
        checked_shape = ref.shape
    n = outd.numel()
    m["numel"] = n
    finite = torch.isfinite(outd)
    if not bool(finite.all()):
        bad = int((~finite).sum())
        where = _index(int((~finite).reshape(-1).nonzero()[0]), checked_shape)
        m["reason"] = f"{bad} NaN/Inf elements (first at {where})"
        m["nonfinite"] = bad
        return m
    if n and not bool(outd.any()) and bool(refd.any()):
        m["reason"] = "output is all zeros"
        return m
    diff = (outd - refd).abs()
    bound = tol.atol + tol.rtol * refd.abs()
    ok = diff <= bound
    ref_norm = float(torch.linalg.vector_norm(refd)) if n else 0.0
    err_norm = float(torch.linalg.vector_norm(outd - refd)) if n else 0.0
    m["max_abs"] = float(diff.max()) if n else 0.0
    m["max_rel"] = float((diff / refd.abs().clamp_min(tol.atol or 1e-12)).max()) if n else 0.0
    # Against an all-zero reference any error is infinitely relative: recorded as RELATIVE_TO_ZERO, above
    # every tolerance and still a finite JSON number (a result holding inf is refused before it is written).
    m["rel_l2"] = err_norm / ref_norm if ref_norm > 0 else (0.0 if err_norm == 0 else RELATIVE_TO_ZERO)
    # Counted, not averaged: a float mean of n ones can come back as 0.9999999999999999 on a GPU.
    n_ok = int(ok.sum())
    m["matched_ratio"] = n_ok / n if n else 1.0
    if n:
        worst = int((diff - bound).reshape(-1).argmax())
        m["worst"] = {
            "index": _index(worst, checked_shape),
            "got": float(outd.reshape(-1)[worst]),
            "expected": float(refd.reshape(-1)[worst]),
        }
    reasons = []
    allowed_misses = math.floor((1.0 - tol.min_match) * n + 1e-9)
    if n - n_ok > allowed_misses:
        reasons.append(
            f"{m['matched_ratio']:.4%} of elements within atol={tol.atol:g}+rtol={tol.rtol:g}*|ref| "
            f"(need {tol.min_match:.2%})"
        )
    if tol.max_abs is not None and m["max_abs"] > tol.max_abs:
        reasons.append(f"max abs error {m['max_abs']:.3g} > {tol.max_abs:g}")
    if m["rel_l2"] > tol.rel_l2:
        reasons.append(f"rel-L2 {m['rel_l2']:.3g} > {tol.rel_l2:g}")
    m["passed"] = not reasons
    m["reason"] = "; ".join(reasons) or None
    return m
