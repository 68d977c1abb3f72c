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


# Ledger appends and post-result verify signatures against the runners' public keys; tests sign with a
# known test key. Set at import, because some test modules build records while they are collected.
import tempfile  # noqa: E402

from ledger_factory import write_keyring, write_private_key  # noqa: E402

_KEYS = Path(tempfile.mkdtemp(prefix="muse-test-keys-"))
os.environ["PIPELINE_SIGNING_KEY_FILE"] = str(write_private_key(_KEYS / "signing.key"))
os.environ["PIPELINE_KEYRING"] = str(write_keyring(_KEYS / "runners"))
os.environ.pop("PIPELINE_RESULT_KEY_FILE", None)
