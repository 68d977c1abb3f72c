import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip)


@pytest.fixture
def device():
    return "cuda" if HAS_CUDA else "cpu"


@pytest.fixture(autouse=True)
def _triton_interpreter_on_cpu(monkeypatch):
    if not HAS_CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield


# Ledger appends verify signatures with the runner's key; tests sign with a known test key. Set at
# import, because some test modules build records while they are collected.
import tempfile  # noqa: E402

from ledger_factory import TEST_KEY  # noqa: E402

_KEY_FILE = Path(tempfile.mkdtemp(prefix="muse-test-key-")) / "result-signing.key"
_KEY_FILE.write_bytes(TEST_KEY)
os.environ["PIPELINE_RESULT_KEY_FILE"] = str(_KEY_FILE)
