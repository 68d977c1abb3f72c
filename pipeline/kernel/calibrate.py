"""Tolerance calibration: run known-correct and known-wrong implementations against the reference.

Variants live in `tests/calibration/<problem>/` as ordinary submissions: `correct_*.py` are
independent correct implementations, `wrong_*.py` are plausible bugs (bf16 accumulation, part of K or
of the tokens dropped, fp8 rounding, a skipped expert, an off-by-one context length, contiguous-page
assumptions). The first line of a variant's docstring says what it is. This runs them in-process (it
measures; it is not a security boundary), records the worst errors per shape against the bounds of
problem.toml, and renders docs/TOLERANCES.md. A bound is well placed when it is at least 3x the worst
correct error and at most 1/3 of the errors that wrong implementations make.
"""

from __future__ import annotations

import importlib.util
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pipeline.kernel.check import compare
from pipeline.kernel.evaluate import _expected
from pipeline.kernel.seeds import public_seed
from pipeline.problems import REPO_ROOT, Problem

VARIANTS_DIR = REPO_ROOT / "tests" / "calibration"
METRICS = ("max_abs", "rel_l2", "mismatch")


@dataclass
class VariantReport:
    name: str
    expect: str  # "correct" or "wrong"
    description: str
    passed_all: bool = True
    failed_shapes: list[str] = field(default_factory=list)
    # output name -> metric -> worst value seen over every shape and seed
    worst: dict[str, dict[str, float]] = field(default_factory=dict)
    error: str | None = None

    @property
    def ok(self) -> bool:
        """Does the verdict agree with what the variant is?"""
        if self.error:
            return False
        return self.passed_all if self.expect == "correct" else not self.passed_all


def variants(problem: str) -> list[Path]:
    folder = VARIANTS_DIR / problem
    return sorted(folder.glob("correct_*.py")) + sorted(folder.glob("wrong_*.py"))


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(f"_calibration_{path.parent.name}_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _clone(inputs: dict[str, Any]) -> dict[str, Any]:
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def run_variant(problem: Problem, path: Path, model: str, device: str, seeds: int) -> VariantReport:
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # read when a kernel is decorated, so before loading
    module = _load(path)
    doc = (module.__doc__ or path.stem).strip().splitlines()[0]
    report = VariantReport(path.stem, "correct" if path.stem.startswith("correct_") else "wrong", doc)
    ref_mod = problem.reference
    for shape in problem.shapes(model):
        for i in range(seeds):
            inputs = ref_mod.make_inputs(shape, public_seed(problem.name, shape.name, i), device)
            expected = _expected(problem, inputs)
            masks = ref_mod.written(inputs) if problem.inplace else {}
            mine = _clone(inputs)
            try:
                out = module.custom_kernel(mine)
            except Exception as exc:  # noqa: BLE001 - a variant that crashes is reported, not raised
                report.error = f"{shape.name}: {type(exc).__name__}: {exc}"
                report.passed_all = False
                return report
            got = {"output": out, **{k: mine[k] for k in problem.inplace}}
            shape_ok = True
            for name, tensor in got.items():
                dtype = getattr(ref_mod, "OUTPUT_DTYPE", torch.bfloat16) if name == "output" else inputs[name].dtype
                v = compare(tensor, expected[name], problem.tolerances[name], expected_dtype=dtype,
                            mask=masks.get(name), pristine=inputs.get(name) if name != "output" else None)
                shape_ok &= v["passed"]
                w = report.worst.setdefault(name, {m: 0.0 for m in METRICS})
                w["max_abs"] = max(w["max_abs"], v.get("max_abs", math.inf))
                w["rel_l2"] = max(w["rel_l2"], v.get("rel_l2", math.inf))
                w["mismatch"] = max(w["mismatch"], 1.0 - v.get("matched_ratio", 0.0))
            untouched = {k: v for k, v in inputs.items() if k not in problem.inplace}
            for k, v in untouched.items():
                if isinstance(v, torch.Tensor) and not torch.equal(v, mine[k]):
                    shape_ok = False
            if not shape_ok:
                report.passed_all = False
                if shape.name not in report.failed_shapes:
                    report.failed_shapes.append(shape.name)
    return report


def calibrate(problem: Problem, model: str = "smoke", device: str = "cpu", seeds: int = 2) -> list[VariantReport]:
    return [run_variant(problem, p, model, device, seeds) for p in variants(problem.name)]


def render(results: dict[str, list[VariantReport]], problems: dict[str, Problem], model: str, device: str,
           command: str) -> str:
    lines = [
        "# Tolerances and their calibration",
        "",
        "Generated by `" + command + "`; do not edit by hand.",
        f"Model: **{model}**, device: **{device}**. Each variant runs on every workload and test shape of its problem",
        "over public seeds; the table shows its worst error over all of them. A bound is well placed when it is",
        "at least 3x the worst error of the correct variants and at most 1/3 of the wrong variants' errors.",
        "`mismatch` is the fraction of elements outside `atol + rtol*|ref|`.",
        "",
    ]
    for name, reports in results.items():
        problem = problems[name]
        lines.append(f"## {name}")
        lines.append("")
        for out_name, tol in problem.tolerances.items():
            extra = f", max abs <= {tol.max_abs:g}" if tol.max_abs is not None else ""
            lines.append(f"- `{out_name}`: atol = {tol.atol:g}, rtol = {tol.rtol:g}, matched >= {tol.min_match:.3%}, "
                         f"rel-L2 <= {tol.rel_l2:g}{extra}")
        lines.append("")
        lines.append("| variant | expected | verdict | output | worst max abs | worst rel-L2 | worst mismatch | rel-L2 vs bound | failed on |")
        lines.append("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for r in reports:
            verdict = ("passes" if r.passed_all else "fails") + ("" if r.ok else " (WRONG VERDICT)")
            if r.error:
                lines.append(f"| `{r.name}`: {r.description} | {r.expect} | crashed: {r.error} | | | | | | |")
                continue
            for out_name, w in r.worst.items():
                bound = problem.tolerances[out_name].rel_l2
                ratio = w["rel_l2"] / bound if bound else math.inf
                lines.append(
                    f"| `{r.name}`: {r.description} | {r.expect} | {verdict} | `{out_name}` | {w['max_abs']:.3g} | "
                    f"{w['rel_l2']:.3g} | {w['mismatch']:.3g} | {ratio:.3g}x | {', '.join(r.failed_shapes) or '-'} |"
                )
        correct = [w["rel_l2"] for r in reports if r.expect == "correct" and not r.error for w in r.worst.values()]
        lines.append("")
        if correct:
            bound = min(t.rel_l2 for t in problem.tolerances.values())
            lines.append(f"Headroom: the tightest rel-L2 bound is {bound / max(max(correct), 1e-30):.1f}x the worst correct variant.")
            lines.append("")
    return "\n".join(lines) + "\n"
