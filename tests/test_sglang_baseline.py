"""The organizer switch `--baseline sglang` (issue 12): SGLang's own MoE kernels, taken unchanged from the
pinned source, run as the baseline (reference/_sglang_baselines.py). On a CPU they run in Triton's
interpreter on the smoke model; on the H200 (marked gpu) on the full model.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipeline.kernel.check import compare
from pipeline.kernel.evaluate import Options, evaluate
from pipeline.problems import load_problem
from pipeline.serving import pin

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "reference"))

import _sglang_baselines as sglang  # noqa: E402

MOE = load_problem("muse_moe_w4a16")


@pytest.fixture(scope="module")
def tree() -> Path:
    try:
        return pin.tree_path()
    except pin.PinError as exc:
        pytest.fail(f"the pinned SGLang could not be fetched (from the package index): {exc}")


@pytest.fixture(scope="module")
def interpreted():
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    yield
    if old is None:
        os.environ.pop("TRITON_INTERPRET")
    else:
        os.environ["TRITON_INTERPRET"] = old


def test_the_generated_module_is_the_pinned_functions_unchanged(tree, tmp_path):
    """Every function the adapters call is the pinned file's own text (only @torch.compile dropped), and
    nothing but the prelude's stated module globals is added: what runs is SGLang's code, not ours."""
    text = (sglang.build_kernels(tree, tmp_path) / f"{sglang.MODULE}.py").read_text()
    assert text == sglang.kernels_source(tree)
    body = text[text.index(sglang.PRELUDE) + len(sglang.PRELUDE):]
    generated = {n.name: n for n in ast.parse(body).body if isinstance(n, ast.FunctionDef)}
    wanted = [name for names in sglang.PINNED.values() for name in names]
    assert sorted(generated) == sorted(wanted) and len(wanted) == len(set(wanted))
    body_lines = body.splitlines(keepends=True)
    for rel, names in sglang.PINNED.items():
        source = (tree / rel).read_text()
        pinned = {n.name: n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef)}
        lines = source.splitlines(keepends=True)
        for name in names:
            node, mine = pinned[name], generated[name]
            # the def line to the end: byte for byte
            assert "".join(lines[node.lineno - 1:node.end_lineno]) == "".join(body_lines[mine.lineno - 1:mine.end_lineno])
            kept = [ast.unparse(d) for d in node.decorator_list if ast.unparse(d) != "torch.compile"]
            assert [ast.unparse(d) for d in mine.decorator_list] == kept, name
    assert "@torch.compile" not in text


def test_a_tampered_module_is_rewritten_before_it_is_used(tree, tmp_path):
    folder = sglang.build_kernels(tree, tmp_path)
    module = folder / f"{sglang.MODULE}.py"
    module.write_text(module.read_text() + "\nimport os; os.environ['PWNED'] = '1'\n")
    assert sglang.build_kernels(tree, tmp_path) == folder
    assert module.read_text() == sglang.kernels_source(tree)
    assert module.stat().st_mode & 0o444 == 0o444 and folder.stat().st_mode & 0o055 == 0o055


def test_a_pin_without_a_taken_function_is_refused_by_name(tree, tmp_path):
    fake = tmp_path / "tree"
    for rel in sglang.PINNED:
        (fake / rel).parent.mkdir(parents=True, exist_ok=True)
        (fake / rel).write_text((tree / rel).read_text().replace("def fused_moe_kernel_gptq_awq(", "def renamed("))
    with pytest.raises(sglang.PinnedSourceMissing, match="no top-level function fused_moe_kernel_gptq_awq"):
        sglang.kernels_source(fake)


@pytest.mark.heavy  # SGLang's Triton kernels in the interpreter, every smoke shape
def test_sglangs_moe_kernels_pass_every_smoke_shape(tree, interpreted):
    """SGLang's W4A16 path (its GPTQ/AWQ Triton kernel, act_and_mul, the top-k sum) on our layouts, with
    SGLang's configuration rule, within the problem's tolerances on every shape: the adapter reads our
    int4 format as SGLang's kernel does (low nibble = even k, zero point 8, one scale per group)."""
    ref = MOE.reference
    for shape in MOE.shapes("smoke"):
        inputs = ref.make_inputs(shape, 3, "cpu")
        got = sglang.muse_moe_w4a16(inputs)
        verdict = compare(got, ref.reference(inputs), MOE.tolerances["output"], expected_dtype=torch.bfloat16)
        assert verdict["passed"], (shape.name, verdict)


def test_the_default_configuration_is_sglangs_rule_for_this_model(tree):
    """At <= E tokens SGLang's default for a W4A16 MoE without a tuned file is BLOCK_SIZE_M 16, N 32, K 64;
    above, 64/64/32 with GROUP_SIZE_M 8 (get_default_config of the pin), and the pin ships no tuned file
    for this model's (E=128, N=768, int4_w4a16) on an H200, so the default is what SGLang runs."""
    w13 = torch.empty(128, 3072, 2560, dtype=torch.uint8, device="meta")
    w2 = torch.empty(128, 5120, 768, dtype=torch.uint8, device="meta")
    small = sglang.moe_config(32, 128, w13, w2, 8, 128)
    assert {k: small[k] for k in ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K")} == {
        "BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 64}
    assert sglang.moe_config(129, 128, w13, w2, 8, 128)["BLOCK_SIZE_M"] == 64
    configs = tree / "python/sglang/srt/layers/moe/fused_moe_triton/configs"
    assert not [p for p in configs.rglob("*.json") if p.name.startswith("E=128,N=768,") and "int4_w4a16" in p.name]


@pytest.mark.heavy  # a whole timed evaluation with SGLang's kernels interpreted: 90 s
def test_an_evaluation_against_sglangs_kernels_runs_them_in_the_baseline_sandbox_and_records_them(tree):
    """Through the evaluator: the baseline worker (its own sandbox) imports the generated module from the
    folder it is granted and times SGLang's kernels; the result names that baseline and hashes its code."""
    doc = evaluate(MOE.directory / "template.py", MOE, Options(seeds=1, shapes=["M1"], baseline="sglang"))
    assert doc["status"] == "passed", doc["error"]
    assert doc["baseline"].startswith(f"sglang {pin.load_pin().version}") and doc["baseline"].endswith(":muse_moe_w4a16")
    assert doc["baseline_source"]["files"] == ["reference/_sglang_baselines.py", *sglang.PINNED]
    ours = evaluate(MOE.directory / "template.py", MOE, Options(seeds=1, timing=False))["baseline_source"]
    assert doc["baseline_source"]["sha256"] != ours["sha256"]
    [perf] = doc["performance"]
    assert perf["baseline_median_us"] > 0
    readable = doc["environment"]["sandbox"]["baseline"].get("readable")
    if readable is not None:  # isolated: it reads the generated module's folder and nothing else of the pin
        assert any(p.endswith(str(sglang.build_kernels(tree).name)) for p in readable)
        assert not any(p == str(tree) or p.startswith(str(tree) + "/") for p in readable)


def test_without_the_pinned_source_the_switch_is_refused_clearly(tmp_path):
    env = {**os.environ, pin.CACHE_ENV: str(tmp_path / "empty-cache")}
    cmd = [sys.executable, "-m", "pipeline", "evaluate"]
    refused = subprocess.run([*cmd, MOE.directory / "template.py", "--baseline", "sglang", "--no-timing"],
                             capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert refused.returncode == 2 and "serving fetch" in refused.stderr, refused.stderr
    attention = ROOT / "problems/muse_attention_decode/template.py"
    unadapted = subprocess.run([*cmd, attention, "--baseline", "sglang"], capture_output=True, text=True, cwd=ROOT,
                               env=env, timeout=120)
    assert unadapted.returncode == 2 and "no adapter for muse_attention_decode" in unadapted.stderr


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 16, 32])
def test_sglangs_moe_kernels_on_the_full_model_in_a_graph(tree, M):
    from test_reference_muse_moe_w4a16 import _graph_outputs

    ref = MOE.reference
    shape = MOE.shape("M1")
    shape.params["M"] = M
    a, b = ref.make_inputs(shape, 1, "cuda"), ref.make_inputs(shape, 2, "cuda")
    want_a, want_b = ref.reference(a), ref.reference(b)
    got_a, got_b = _graph_outputs(sglang.muse_moe_w4a16, a, b)
    for got, want in ((got_a, want_a), (got_b, want_b)):
        verdict = compare(got, want, MOE.tolerances["output"], expected_dtype=torch.bfloat16)
        assert verdict["passed"], verdict
