"""Every toolchain the rules allow, as a competitor meets it: what the runner has (the result says),
builds inside the sandbox (load_inline in the scratch, within the compile limit, the compiler's first
error at the submission's line), a toolchain the runner lacks (a compile_error naming it), and, on a
GPU, one example submission per toolchain through `python -m pipeline evaluate` (examples/toolchains/).

The builds are real: g++ through torch.utils.cpp_extension and ninja, in the real sandbox where this
host can isolate (root, namespaces). The successful build parses torch/extension.h (about 35 s on two
cores), so it is `slow`; the failing one has no torch headers and fails in a second.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pipeline import result, sandbox
from pipeline.kernel import toolchains
from pipeline.kernel.evaluate import Limits, Options, evaluate
from pipeline.problems import load_problem

ROOT = Path(__file__).resolve().parent.parent
FIX = ROOT / "tests" / "fixtures" / "toolchains"
EXAMPLES = ROOT / "examples" / "toolchains"
PROJ = load_problem("muse_bf16_proj")


def cli(*args, env=None, timeout=600):
    return subprocess.run([sys.executable, "-m", "pipeline", "evaluate", *map(str, args)], capture_output=True,
                          text=True, cwd=ROOT, timeout=timeout, env=env)


def evaluate_cli(path: Path, tmp_path: Path, *extra: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "result.json"
    done = cli(path, "--problem", "muse_bf16_proj", "--no-timing", "--seeds", "1", "--json", out, *extra)
    assert out.exists(), done.stderr[-3000:]
    return done, result.read(out)


def assert_isolated_where_possible(doc: dict) -> None:
    if sandbox.availability()[0]:
        assert doc["environment"]["sandbox"]["submission"]["isolation"] == "namespaces"


# ---- what the runner has ----

def test_the_probe_names_every_toolchain_with_what_this_machine_has():
    found = toolchains.probe()
    assert list(found) == list(toolchains.TOOLCHAINS)
    assert found["torch"]["version"] == torch.__version__
    import triton

    assert found["triton"]["version"] == triton.__version__
    for key in ("ninja", "cxx"):  # a build needs both; the test extra installs ninja
        assert found[key] and found[key]["path"], key
    # The same answer twice without probing again: the evaluator asks once per result.
    assert toolchains.probe() is found


def test_the_probe_sees_packages_as_a_worker_does(tmp_path, monkeypatch):
    """A package only the evaluator's PYTHONPATH reaches is not one a submission can import (workers run
    `python -I`): the probe must not list it."""
    fake = tmp_path / "site" / "flashinfer_python-9.9.9.dist-info"
    fake.mkdir(parents=True)
    (fake / "METADATA").write_text("Metadata-Version: 2.1\nName: flashinfer-python\nVersion: 9.9.9\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site"))
    visible = subprocess.run([sys.executable, "-c", "import importlib.metadata as m; print(m.version('flashinfer-python'))"],
                             capture_output=True, text=True)
    assert visible.stdout.strip() == "9.9.9"  # the evaluator's own interpreter sees it
    assert toolchains._packages()["versions"].get("flashinfer-python") != "9.9.9"


def test_the_worker_path_puts_the_interpreters_own_bin_first():
    path = toolchains.worker_path("/usr/bin:/bin")
    assert path.split(":")[0] == os.path.dirname(sys.executable)
    assert path.endswith("/usr/bin:/bin")


def test_builds_and_caches_go_to_the_scratch_never_home():
    env = toolchains.build_env("/scratch-x", {"PATH": "/usr/bin"})
    for key in ("TORCH_EXTENSIONS_DIR", "TRITON_CACHE_DIR", "CCACHE_DIR", "XDG_CACHE_HOME", "CUDA_CACHE_PATH"):
        assert env[key].startswith("/scratch-x/"), key
    assert env["FLASHINFER_WORKSPACE_BASE"] == "/scratch-x"


def test_cuda_home_resolves_a_wrapper_script_to_its_toolkit(tmp_path):
    kit = tmp_path / "cuda-13.0"
    (kit / "bin").mkdir(parents=True)
    (kit / "include").mkdir()
    (kit / "bin" / "nvcc").write_text("#!/bin/sh\n")
    wrappers = tmp_path / "wrappers"
    wrappers.mkdir()
    (wrappers / "nvcc").write_text(f'#!/bin/sh\nexec {kit}/bin/nvcc "$@"\n')
    (wrappers / "nvcc").chmod(0o755)
    assert toolchains.cuda_home({"CUDA_HOME": str(kit)}) == str(kit)
    if not os.path.isfile("/usr/local/cuda/bin/nvcc"):  # that one wins where it exists
        assert toolchains.cuda_home({"PATH": str(wrappers)}) == str(kit)


@pytest.mark.parametrize("value, ok", [
    (None, True), ("", True), ("sha256:" + "a" * 64, True), ("ghcr.io/org/muse-runner@sha256:" + "0" * 64, True),
    ("latest", False), ("sha256:abc", False), ("muse-runner:1.0", False)])
def test_the_image_digest_is_the_runners_statement_checked(value, ok):
    env = {} if value is None else {"PIPELINE_IMAGE_DIGEST": value}
    if ok:
        assert toolchains.image_digest(env) == (value or None)
    else:
        with pytest.raises(toolchains.RunnerConfigError, match="PIPELINE_IMAGE_DIGEST"):
            toolchains.image_digest(env)


def test_a_misconfigured_image_digest_stops_the_evaluation_before_it_runs(tmp_path):
    env = {**os.environ, "PIPELINE_IMAGE_DIGEST": "muse-runner:latest"}
    done = cli(ROOT / "problems/muse_bf16_proj/template.py", "--problem", "muse_bf16_proj", "--no-timing",
               "--json", tmp_path / "r.json", env=env)
    assert done.returncode == 3, done.stderr
    assert "PIPELINE_IMAGE_DIGEST" in done.stderr and "no result was written" in done.stderr
    assert not (tmp_path / "r.json").exists()


def test_the_result_records_the_toolchains_and_the_image_digest(monkeypatch):
    digest = "ghcr.io/org/muse-runner@sha256:" + "5" * 64
    monkeypatch.setenv("PIPELINE_IMAGE_DIGEST", digest)
    doc = evaluate(ROOT / "problems/muse_bf16_proj/template.py", PROJ, Options(seeds=1, timing=False, shapes=["M1"]))
    env = doc["environment"]
    assert env["image_digest"] == digest
    assert env["toolchains"] == toolchains.probe()
    result.validate(doc)
    # The schema holds the shape of both: a toolchain entry without its version, or a digest that is none.
    bad = json.loads(json.dumps(doc))
    bad["environment"]["toolchains"]["ninja"] = {"path": "/usr/bin/ninja"}
    with pytest.raises(result.ResultError):
        result.validate(bad)
    bad = json.loads(json.dumps(doc))
    del bad["environment"]["toolchains"]["flashinfer"]
    with pytest.raises(result.ResultError):
        result.validate(bad)
    bad = json.loads(json.dumps(doc))
    bad["environment"]["image_digest"] = "latest"
    with pytest.raises(result.ResultError):
        result.validate(bad)


# ---- a missing toolchain ----

def test_an_import_of_a_toolchain_the_runner_lacks_is_a_compile_error_naming_it():
    if toolchains.probe()["flashinfer"]:
        pytest.skip("FlashInfer is installed here")
    doc = evaluate(FIX / "imports_flashinfer.py", PROJ, Options(seeds=1, timing=False))
    assert doc["status"] == "compile_error"
    message = doc["error"]["message"]
    assert message.startswith("flashinfer is not on this runner (FlashInfer: pip package flashinfer-python)")
    assert f"the runner has: torch {torch.__version__}" in message and "COMPETING.md" in message
    assert doc["error"]["where"]["line"] == 3
    assert_isolated_where_possible(doc)


@pytest.mark.parametrize("error, needle", [
    ("ModuleNotFoundError: No module named 'cutlass'", "cutlass is not on this runner (the CuTe DSL: pip package nvidia-cutlass-dsl)"),
    ("ModuleNotFoundError: No module named 'deep_gemm.jit'", "deep_gemm.jit is not on this runner (DeepGEMM"),
    ("ModuleNotFoundError: No module named 'tilelang'", "tilelang is not on this runner; the runner has: "),
    ("RuntimeError: Ninja is required to load C++ extensions (pip install ninja to get it)", "ninja is not on this runner"),
    ("OSError: CUDA_HOME environment variable is not set. Please set it to your CUDA install root.",
     "nvcc (a CUDA toolkit) is not on this runner"),
])
def test_each_missing_toolchain_is_told_with_what_the_runner_has(error, needle):
    found = {k: None for k in toolchains.TOOLCHAINS}
    found["torch"] = {"version": "2.11.0+cu130", "cuda": "13.0"}
    told = toolchains.explain({"ok": False, "status": "runtime_error", "error": error}, found)
    assert told["status"] == "compile_error"
    assert needle in told["error"]
    assert "the runner has: torch 2.11.0+cu130 (CUDA 13.0)" in told["error"]


def test_a_present_toolchain_keeps_its_own_import_error():
    found = {k: None for k in toolchains.TOOLCHAINS}
    found["flashinfer"] = {"version": "0.7.4"}
    reply = {"ok": False, "status": "compile_error", "error": "ModuleNotFoundError: No module named 'flashinfer.nope'"}
    assert toolchains.explain(reply, found) == reply


@pytest.mark.parametrize("line, file, number, message", [
    ("/tmp/torch-extensions/x/main.cpp:4:5: error: expected ',' or ';' before 'return'", "/tmp/torch-extensions/x/main.cpp", 4,
     "expected ',' or ';' before 'return'"),
    ("/tmp/x/cuda.cu(12): error: identifier \"foo\" is undefined", "/tmp/x/cuda.cu", 12, 'identifier "foo" is undefined'),
    ("/tmp/x/cuda.cu(7): error #20: identifier \"bar\" is undefined", "/tmp/x/cuda.cu", 7, 'identifier "bar" is undefined'),
    ("main.cpp:3:10: fatal error: cutlass/cutlass.h: No such file or directory", "main.cpp", 3,
     "cutlass/cutlass.h: No such file or directory"),
    ("ptxas error   : Entry function '_Z1kv' uses too much shared data", None, None,
     "ptxas error   : Entry function '_Z1kv' uses too much shared data"),
])
def test_the_first_compiler_error_is_read_from_gcc_nvcc_and_ptxas(line, file, number, message):
    text = f"[1/2] c++ -MMD -c main.cpp\nFAILED: main.o\n{line}\nsomething: error: a later one\nninja: build stopped"
    err = toolchains.first_compiler_error(text)
    assert (err["file"], err["line"], err["message"]) == (file, number, message)


def test_a_generated_line_maps_to_the_submission_only_where_it_is_unambiguous():
    source = "a = 1\nSRC = '''\nint y = 2 * x\nreturn y;\n'''\nreturn y;\n"
    assert toolchains.submission_line(source, "  int y = 2 * x") == 3
    assert toolchains.submission_line(source, "return y;") is None  # two lines hold it
    assert toolchains.submission_line(source, "}") is None  # too short to tell


# ---- builds in the sandbox (real compilers) ----

def test_a_cpp_syntax_error_is_a_compile_error_with_the_compilers_first_error_at_the_submissions_line(tmp_path):
    done, doc = evaluate_cli(FIX / "cpp_syntax_error.py", tmp_path)
    assert done.returncode == 1
    assert doc["status"] == "compile_error"
    err = doc["error"]
    assert err["message"].startswith("the extension 'muse_fixture_syntax_error' did not build: main.cpp:4:5: error: "), err
    lines = (FIX / "cpp_syntax_error.py").read_text().splitlines()
    assert err["where"]["file"] == "cpp_syntax_error.py"
    assert lines[err["where"]["line"] - 1].strip() == "return y;"  # where g++ noticed the missing ';'
    assert re.search(r"FAILED: (\[code=\d+\] )?main\.o", err["log_tail"]) and "error: expected" in err["log_tail"]
    assert "-isystem" not in err["log_tail"]  # the compiler's command lines are left out of the tail
    assert_isolated_where_possible(doc)


@pytest.mark.heavy
def test_load_inline_builds_a_cpp_extension_in_the_sandboxs_scratch(tmp_path):
    t0 = time.monotonic()
    done, doc = evaluate_cli(FIX / "cpp_extension.py", tmp_path)
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    assert doc["status"] == "passed"
    assert all(e["passed"] for e in doc["correctness"])
    assert_isolated_where_possible(doc)
    # The build went to the scratch (the fixture refuses to load from anywhere else), never to a home
    # directory: the evaluator's own has no trace of it.
    assert not list(Path.home().glob(".cache/torch_extensions/*/muse_fixture_proj_cpp"))
    print(f"load_inline C++ build and evaluation: {time.monotonic() - t0:.1f} s")


def test_a_build_past_the_compile_limit_is_a_timeout_and_leaves_no_compiler_running():
    opts = Options(seeds=1, timing=False, limits=Limits(compile=3.0))
    t0 = time.monotonic()
    doc = evaluate(FIX / "cpp_extension.py", PROJ, opts)
    assert time.monotonic() - t0 < 30
    assert doc["status"] == "timeout"
    assert "3 s, the limit for importing the submission" in doc["error"]["message"]
    left = subprocess.run(["pgrep", "-f", "muse_fixture_proj_cpp"], capture_output=True, text=True)
    assert left.stdout.strip() == "", "a compiler of the killed build is still running"


# ---- on the GPU: one example per toolchain through the evaluator (examples/toolchains/) ----

def _example_needs(name: str) -> str | None:
    """Why the example `name` cannot run on this machine, or None."""
    found = toolchains.probe()
    needs = {"cuda_cpp": ["nvcc", "ninja", "cxx"], "cutlass_cpp": ["nvcc", "ninja", "cxx", "cutlass"],
             "cute_dsl": ["cutlass_dsl"], "flashinfer_mm": ["flashinfer"], "deep_gemm_mm": ["deep_gemm"]}[name]
    missing = [k for k in needs if not found[k]]
    return f"this runner lacks {', '.join(missing)}" if missing else None


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["cuda_cpp", "cutlass_cpp", "cute_dsl", "flashinfer_mm", "deep_gemm_mm"])
def test_each_toolchains_example_passes_through_the_evaluator_on_the_gpu(name, tmp_path):
    why = _example_needs(name)
    if why:
        pytest.skip(why)
    path = EXAMPLES / name / "submission.py"
    out = tmp_path / "result.json"
    t0 = time.monotonic()
    done = cli(path, "--problem", "muse_bf16_proj", "--seeds", "2", "--json", out)
    wall = time.monotonic() - t0
    loaded = [ln for ln in done.stderr.splitlines() if "loaded muse_bf16_proj submission in" in ln]
    doc = result.read(out) if out.exists() else None
    record = {"example": name, "returncode": done.returncode, "wall_s": round(wall, 1),
              "load_s": float(loaded[0].rsplit(" in ", 1)[1].split()[0]) if loaded else None,
              "status": doc and doc["status"], "error": doc and doc["error"] and doc["error"]["message"][:500],
              "speedups": doc and [round(p["speedup"], 3) for p in doc["performance"]],
              "median_us": doc and [round(p["median_us"], 2) for p in doc["performance"]],
              "toolchains": doc and {k: v and v.get("version") for k, v in doc["environment"]["toolchains"].items()}}
    report = os.environ.get("PIPELINE_TOOLCHAINS_REPORT")
    if report:
        with open(report, "a") as f:
            f.write(json.dumps(record) + "\n")
    print(json.dumps(record))
    assert doc is not None, done.stderr[-3000:]
    assert doc["status"] in ("passed", "needs_review"), (doc["error"], done.stderr[-3000:])
    assert_isolated_where_possible(doc)
