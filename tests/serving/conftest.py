"""Shared fixtures for the serving tests: the real pinned SGLang tree, and scratch git repositories that
hold copies of some of its files, to make patches with real git (tests/fixtures/serving/patches.py).

The tree is fetched once (pip download of the pinned sdist, about 10 s) into the pipeline's own cache
(PIPELINE_SGLANG_CACHE, else ~/.cache/muse-pipeline/sglang), which later runs reuse.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from pipeline.serving import pin as pin_stage

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
