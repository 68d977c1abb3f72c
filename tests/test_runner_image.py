"""The runner image as data (runner/): a lock pip can install with --require-hashes, that holds every pin
of requirements.in and every dependency the harness declares, and a recipe pinned by digest."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RUNNER = ROOT / "runner"
LINE = re.compile(r"^(?P<name>[a-z0-9][a-z0-9._-]*)==(?P<version>[^\s\\]+) \\$")
HASH = re.compile(r"^    --hash=sha256:[0-9a-f]{64}$")


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def locked() -> dict[str, str]:
    """requirements.txt as {name: version}, failing on any line that --require-hashes would refuse."""
    lines = (RUNNER / "requirements.txt").read_text().splitlines()
    out: dict[str, str] = {}
    i = 0
    while i < len(lines):
        line = lines[i]
        if not line.strip() or line.lstrip().startswith("#"):
            i += 1
            continue
        m = LINE.match(line)
        assert m, f"requirements.txt line {i + 1} is not `name==version \\`: {line!r}"
        assert i + 1 < len(lines) and HASH.match(lines[i + 1]), f"{m['name']} has no sha256 on the next line"
        assert _norm(m["name"]) not in out, f"{m['name']} is pinned twice"
        out[_norm(m["name"])] = m["version"]
        i += 2
    return out


def top_level() -> dict[str, str | None]:
    """requirements.in: {name: the exact version where it pins one, else None}."""
    out: dict[str, str | None] = {}
    for line in (RUNNER / "requirements.in").read_text().splitlines():
        s = line.strip()
        if not s or s.startswith("#"):
            continue
        m = re.match(r"^([A-Za-z0-9._-]+)(\[[^\]]*\])?\s*(==\s*([^\s;]+))?", s)
        assert m, s
        out[_norm(m[1])] = m[4]
    return out


def test_every_line_of_the_lock_is_pinned_with_its_hash():
    pins = locked()
    assert len(pins) > 50  # torch alone brings its CUDA libraries


def test_the_lock_holds_every_pin_of_requirements_in_at_its_version():
    pins = locked()
    for name, version in top_level().items():
        assert name in pins, f"{name} is in requirements.in but not locked: run python runner/lock.py"
        if version:
            assert pins[name] == version, f"{name}: requirements.in pins {version}, the lock {pins[name]}"


def test_the_toolchains_are_the_ones_the_docs_name():
    pins = locked()
    assert pins["torch"] == "2.11.0" and pins["triton"] == "3.6.0"
    for name in ("ninja", "nvidia-cutlass", "nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-cu13", "flashinfer-python"):
        assert name in pins, name
        assert pins[name] in (ROOT / "docs" / "COMPETING.md").read_text(), f"docs/COMPETING.md does not say {name} {pins[name]}"
    assert "deep-gemm" not in pins  # no usable build on PyPI (runner/README.md)


def test_every_dependency_the_harness_declares_is_in_the_image():
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    top = top_level()
    for req in declared:
        name = _norm(re.split(r"[\[<>=!~; ]", req, maxsplit=1)[0])
        assert name in top, f"pyproject.toml depends on {name}, which runner/requirements.in does not list"


def test_the_recipe_is_pinned_by_digest_and_installs_only_the_lock():
    text = (RUNNER / "Containerfile").read_text()
    froms = re.findall(r"^FROM\s+(\S+)", text, flags=re.M)
    assert froms, "no FROM"
    for image in froms:
        assert re.match(r"^nvidia/cuda:[\w.-]+-devel-ubuntu[\d.]+@sha256:[0-9a-f]{64}$", image), image
    installs = re.findall(r"pip install[^\n]*(?:\\\n[^\n]*)*", text)
    assert installs and all("--require-hashes" in i and "--no-deps" in i for i in installs), installs


@pytest.mark.parametrize("broken, why", [
    ("torch==2.11.0 \\\n", "no hash"),
    ("torch>=2.11 \\\n    --hash=sha256:" + "0" * 64 + "\n", "not pinned"),
])
def test_the_lock_check_refuses_what_require_hashes_would(tmp_path, monkeypatch, broken, why):
    bad = tmp_path / "runner"
    bad.mkdir()
    (bad / "requirements.txt").write_text(broken)
    monkeypatch.setattr(__import__(__name__), "RUNNER", bad)
    with pytest.raises(AssertionError):
        locked()
