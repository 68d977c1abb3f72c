"""Every problem, generically: its data loads, its template passes the real evaluator, and its
calibration variants get the verdicts they should (correct ones pass, wrong ones fail)."""

from __future__ import annotations

import pytest
import torch

from pipeline.kernel.calibrate import run_variant, variants
from pipeline.kernel.evaluate import Options, evaluate
from pipeline.problems import DEFAULT_RUN_TO_RUN, ProblemError, list_problems, load_problem

PROBLEMS = list_problems()
MODEL = "full" if torch.cuda.is_available() else "smoke"


def test_the_five_problems_exist():
    assert {"muse_bf16_proj", "muse_attention_decode", "muse_moe_w4a16", "muse_decode_layer",
            "muse_prefill_layer"} <= set(PROBLEMS)


@pytest.mark.parametrize("name", PROBLEMS)
def test_problem_data_is_complete(name):
    problem = load_problem(name)
    for f in ("problem.toml", "README.md", "template.py"):
        assert (problem.directory / f).is_file(), f
    ref = problem.reference
    for size in ("full", "smoke"):
        for shape in problem.shapes(size):
            floor = ref.floor(shape)
            assert floor["bytes"] > 0 and floor["flops"] > 0, shape.name
    if problem.inplace:
        assert callable(getattr(ref, "written", None)), "in-place problems must say which slots they write"


@pytest.mark.parametrize("name", PROBLEMS)
def test_template_passes_the_evaluator(name):
    problem = load_problem(name)
    doc = evaluate(problem.directory / "template.py", problem, Options(seeds=1 if MODEL == "full" else 2, timing=False))
    failures = [(e["shape"], e["reason"]) for e in doc["correctness"] if not e["passed"]]
    assert doc["status"] == "passed", (doc["error"], failures)
    assert len(doc["correctness"]) == len(problem.shapes(MODEL))


def _copy_problem(root, name, line, key="run_to_run"):
    """A repository root holding one problem whose problem.toml says `line` (or nothing) in place of its own
    `key` line."""
    import shutil

    src = load_problem(name)
    (root / "problems" / name).mkdir(parents=True)
    shutil.copy(src.directory.parent / "model.toml", root / "problems" / "model.toml")
    (root / "reference").mkdir()
    shutil.copy(src.reference_path, root / "reference" / src.reference_path.name)
    text = "\n".join(kept for kept in (src.directory / "problem.toml").read_text().splitlines()
                      if not kept.startswith(key))
    text = text.replace("official_seeds = 8", f"official_seeds = 8\n{line}")
    (root / "problems" / name / "problem.toml").write_text(text)
    return root


def test_run_to_run_is_read_with_a_default_and_a_bad_value_is_refused(tmp_path):
    assert load_problem("muse_bf16_proj").run_to_run == 0.001
    assert load_problem("muse_attention_decode").run_to_run == DEFAULT_RUN_TO_RUN  # not measured yet
    root = _copy_problem(tmp_path / "a", "muse_bf16_proj", "run_to_run = 0.0025")
    assert load_problem("muse_bf16_proj", root).run_to_run == 0.0025
    root = _copy_problem(tmp_path / "b", "muse_bf16_proj", "")
    assert load_problem("muse_bf16_proj", root).run_to_run == DEFAULT_RUN_TO_RUN
    for i, bad in enumerate(["0.5", "-0.001", "true", '"0.3%"']):
        root = _copy_problem(tmp_path / f"bad{i}", "muse_bf16_proj", f"run_to_run = {bad}")
        with pytest.raises(ProblemError, match=r"problem.toml: run_to_run = .* is not a fraction .*repeatability"):
            load_problem("muse_bf16_proj", root)


def test_the_produced_inputs_are_inputs_each_problem_makes_and_a_bad_list_is_refused(tmp_path):
    for name in PROBLEMS:
        problem = load_problem(name)
        inputs = problem.reference.make_inputs(problem.shapes("smoke")[0], 1, "cpu")
        assert problem.produced, name  # every problem reads activations some kernel before it writes
        for key in problem.produced:
            assert isinstance(inputs.get(key), torch.Tensor), (name, key)
    root = _copy_problem(tmp_path / "none", "muse_bf16_proj", "", key="produced")
    assert load_problem("muse_bf16_proj", root).produced == ()
    bad = {'produced = "x"': "must be a list", 'produced = ["x", "x"]': "distinct",
           'produced = ["a", "b", "c", "d", "e"]': "at most 4"}
    for i, (line, message) in enumerate(bad.items()):
        root = _copy_problem(tmp_path / f"bad{i}", "muse_bf16_proj", line, key="produced")
        with pytest.raises(ProblemError, match=message):
            load_problem("muse_bf16_proj", root)
    root = _copy_problem(tmp_path / "both", "muse_decode_layer", 'produced = ["x", "k_cache"]', key="produced")
    with pytest.raises(ProblemError, match="k_cache cannot be both produced and written in place"):
        load_problem("muse_decode_layer", root)


CASES = [(name, path) for name in PROBLEMS for path in variants(name)]


@pytest.mark.heavy  # the calibration's Triton variants in the interpreter
@pytest.mark.parametrize("name,path", CASES, ids=[f"{n}/{p.stem}" for n, p in CASES])
def test_calibration_variant_gets_its_verdict(name, path):
    problem = load_problem(name)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    report = run_variant(problem, path, MODEL, device, seeds=1)
    assert report.error is None, report.error
    if report.expect == "correct":
        assert report.passed_all, f"a correct implementation failed on {report.failed_shapes}: {report.worst}"
    else:
        assert not report.passed_all, f"a wrong implementation passed every shape: {report.worst}"


@pytest.mark.parametrize("name", PROBLEMS)
def test_each_problem_has_three_correct_and_three_wrong_variants(name):
    found = variants(name)
    assert sum(p.stem.startswith("correct_") for p in found) >= 3
    assert sum(p.stem.startswith("wrong_") for p in found) >= 3


@pytest.mark.gpu
@pytest.mark.parametrize("name", PROBLEMS)
def test_template_and_baseline_survive_the_official_timing(name):
    """Both are captured in CUDA graphs, timed against each other, and re-checked after timing."""
    problem = load_problem(name)
    doc = evaluate(problem.directory / "template.py", problem, Options(seeds=1, timing=True))
    assert doc["status"] == "passed", (doc["error"], doc["flags"])
    assert [p["workload"] for p in doc["performance"]] == [w["name"] for w in problem.workloads]
    for p in doc["performance"]:
        assert p["baseline_median_us"] >= 0.95 * p["floor_us"], p
    assert doc["score"]["run_to_run"] == problem.run_to_run


def test_the_baseline_identity_covers_exactly_the_files_it_is_made_of(tmp_path):
    """A result names its baseline by a hash over the reference module, the sibling modules it imports
    and the data they name (the tuned block configurations): changing one of those changes it, changing
    another problem's reference does not."""
    import dataclasses
    import shutil

    from pipeline.problems import REPO_ROOT, baseline_identity

    shutil.copytree(REPO_ROOT / "reference", tmp_path / "reference")
    layer = dataclasses.replace(load_problem("muse_decode_layer"),
                                reference_path=tmp_path / "reference" / "muse_decode_layer.py")
    before = baseline_identity(layer)
    assert before["files"] == ["reference/_fused_moe_w4a16.py", "reference/_layer_ops.py", "reference/_muse_layer.py",
                               "reference/configs/fused_moe_w4a16.json",
                               "reference/muse_attention_decode.py", "reference/muse_decode_layer.py",
                               "reference/muse_moe_w4a16.py"]
    (tmp_path / "reference" / "muse_bf16_proj.py").write_text("# not part of the layer's baseline\n")
    assert baseline_identity(layer) == before
    moe = tmp_path / "reference" / "muse_moe_w4a16.py"
    moe.write_text(moe.read_text() + "\n# a change to a building block\n")
    changed = baseline_identity(layer)["sha256"]
    assert changed != before["sha256"]
    configs = tmp_path / "reference" / "configs" / "fused_moe_w4a16.json"
    configs.write_text(configs.read_text().replace('"num_warps": 8', '"num_warps": 4', 1))
    assert baseline_identity(layer)["sha256"] != changed
