import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

HAS_CUDA = torch.cuda.is_available()


WORKERS_ENV = "PIPELINE_TEST_WORKERS"


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """Both cores by default on a CPU machine: `python -m pytest -q` runs in 2 worker processes (pytest-xdist, a test extra), each
    test file whole on one of them (module fixtures are built once). Most tests wait on processes they start
    (evaluations, servers, git), so a second worker nearly halves the wall time on 2 cores (test_evaluate.py:
    203 s alone, 121 s with two). $PIPELINE_TEST_WORKERS=1 (or -n 0, or -p no:xdist) runs in this process."""
    if (config.pluginmanager.has_plugin("xdist") and getattr(config.option, "numprocesses", None) is None
            and not os.environ.get("PYTEST_XDIST_WORKER") and not config.option.collectonly
            and config.option.usepdb is False and not HAS_CUDA):  # one process where a GPU is timed
        workers = int(os.environ.get(WORKERS_ENV) or min(2, os.cpu_count() or 1))
        if workers > 1:
            config.option.numprocesses = workers
            if getattr(config.option, "dist", "no") == "no":
                config.option.dist = "loadfile"


def pytest_addoption(parser):
    parser.addoption("--shard", metavar="K/N", default=None,
                     help="run only the K-th of N consecutive shares of the selected tests, of about equal time by "
                          "tests/gpu_durations.json where it knows a test (one share a device call: "
                          "benchmarks/gpu.sh tests K/N)")


DURATIONS = ROOT / "tests" / "gpu_durations.json"
from shards import shard  # noqa: E402

# The test extras (pyproject.toml's [test]) a test module may import: where one is not installed, its modules
# are skipped with what to install, never a collection error (a competitor may run the suite with less).
OPTIONAL = {"hypothesis": "hypothesis", "yaml": "pyyaml", "markdown_it": "markdown-it-py",
            "linkify_it": "linkify-it-py", "transformers": "transformers[serving]", "gguf": "gguf",
            "pytest_httpserver": "pytest-httpserver", "werkzeug": "pytest-httpserver"}


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    report = outcome.get_result()
    if report.failed and isinstance(collector, pytest.Module):
        import re

        missing = re.search(r"No module named '([\w.]+)'", str(report.longrepr))
        top = missing.group(1).split(".")[0] if missing else None
        if top in OPTIONAL:
            report.outcome = "skipped"
            report.longrepr = (str(collector.path), 0, f"Skipped: needs {OPTIONAL[top]}, a test extra: "
                                                       "pip install -e '.[test]'")


try:
    import pytest_httpserver  # noqa: F401
except ImportError:  # its fixture is missing too: the tests that ask for it skip
    @pytest.fixture
    def httpserver():
        pytest.skip("needs pytest-httpserver, a test extra: pip install -e '.[test]'")


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected: the shares are of what runs
def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip)
    spec = config.getoption("--shard")
    if spec:
        import json
        import re

        m = re.fullmatch(r"(\d+)/(\d+)", spec)
        if not m or not 1 <= int(m.group(1)) <= int(m.group(2)):
            raise pytest.UsageError(f"--shard {spec}: give K/N with 1 <= K <= N, e.g. --shard 2/3")
        seconds = json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {}
        kept = shard(items, int(m.group(1)), int(m.group(2)), seconds)
        config.hook.pytest_deselected(items=[it for it in items if it not in kept])
        items[:] = kept


@pytest.fixture
def device():
    return "cuda" if HAS_CUDA else "cpu"


@pytest.fixture(autouse=True)
def _triton_interpreter_on_cpu(monkeypatch):
    if not HAS_CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield


# Ledger appends and post-result verify signatures against the runners' public keys; tests sign with a
# known test key. Set at import, because some test modules build records while they are collected.
import tempfile  # noqa: E402

from ledger_factory import write_keyring, write_private_key  # noqa: E402

_KEYS = Path(tempfile.mkdtemp(prefix="muse-test-keys-"))
os.environ["PIPELINE_SIGNING_KEY_FILE"] = str(write_private_key(_KEYS / "signing.key"))
os.environ["PIPELINE_KEYRING"] = str(write_keyring(_KEYS / "runners"))
os.environ.pop("PIPELINE_RESULT_KEY_FILE", None)
