"""The pin: sglang_pin/pin.toml says what the real tree holds (every rule matches real files, so a typo
cannot switch one off), and `serving fetch` verifies, extracts safely and atomically, and caches."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import re
import tarfile
import time
import tomllib
from pathlib import Path

import pytest

from pipeline.__main__ import main
from pipeline.serving import gate as g
from pipeline.serving import pin as pin_stage

ROOT = Path(__file__).resolve().parents[2]


# ---- pin.toml against the real tree ----

def test_the_pin_names_the_sdist_and_its_kernel_package(sglang_pin, sglang_tree):
    assert sglang_pin.version == "0.5.10.post1"
    assert sglang_pin.sha256 == "01f7adfe7cde85b238fb0e1bae4b31d494e19d1471cf35ff3c5489a02f9d2263"
    assert sglang_pin.sdist["size"] == 4_701_855 and sglang_pin.sdist["requirement"] == "sglang==0.5.10.post1"
    pyproject = tomllib.loads((sglang_tree / "python" / "pyproject.toml").read_text())
    assert pyproject["project"]["version"] if "version" in pyproject["project"] else True
    kernel = sglang_pin.kernel
    assert f"{kernel['package']}=={kernel['version']}" in pyproject["project"]["dependencies"]
    version = (sglang_tree / "python" / "sglang" / "_version.py").read_text()
    assert f"__version__ = version = '{sglang_pin.version}'" in version


def test_the_tree_is_in_git_layout_and_holds_no_links(sglang_tree):
    assert (sglang_tree / "python" / "sglang" / "srt" / "server_args.py").is_file()
    assert (sglang_tree / pin_stage.MARKER).read_text().strip() == pin_stage.load_pin().sha256
    assert not [p for p in sglang_tree.rglob("*") if p.is_symlink()]


def _files(tree: Path) -> list[str]:
    return sorted(g._index(str(tree.resolve())).files)


def test_every_allowed_and_denied_pattern_matches_a_real_file(sglang_pin, sglang_tree):
    files = _files(sglang_tree)
    for pattern in sglang_pin.rules["allowed"]:
        assert any(g.glob_match(pattern, f) for f in files), pattern
    for deny in sglang_pin.rules["deny"]:
        # exactly as spelled, not only case-folded: the tree's own spelling is the one the rule names
        assert any(g.glob_match(deny["pattern"], f) for f in files), f"{deny['pattern']} matches no file of the tree"
        assert deny["why"]


def test_the_spec_minimum_is_denied(sglang_pin):
    patterns = {d["pattern"] for d in sglang_pin.rules["deny"]}
    srt = "python/sglang/srt/"
    spec = {srt + "sampling/**", srt + "layers/sampler.py", srt + "layers/logits_processor.py",
            srt + "entrypoints/openai/**", "**/bench_*.py", "**/benchmark/**", "**/test/**",
            "python/sglang/jit_kernel/tests/**", "python/sglang/jit_kernel/benchmark/**", "**/test_*.py",
            "**/pyproject*.toml", "**/setup.py", "**/setup.cfg"}
    spec |= {f"{srt}managers/{m}.py" for m in ("tokenizer_manager", "detokenizer_manager", "multi_tokenizer_mixin",
                                               "tokenizer_communicator_mixin", "async_dynamic_batch_tokenizer")}
    spec |= {f"{srt}parser/{m}.py" for m in ("conversation", "jinja_template_utils")}
    spec |= {f"{srt}utils/{m}.py" for m in ("hf_transformers_utils", "patch_tokenizer")}
    assert spec <= patterns, sorted(spec - patterns)
    assert sglang_pin.rules["max_bytes"] == 1024 * 1024 and sglang_pin.rules["max_changed_lines"] == 5000


def test_every_flag_names_something_real(sglang_pin, sglang_tree):
    flags = sglang_pin.flags
    assert {f["pattern"] for f in flags["knob"]} >= {"ignore_eos", "flush_cache", "completion_tokens",
                                                          "cached_tokens", "stream_interval", "SIMULATE_ACC"}
    text = "\n".join((sglang_tree / f).read_text(errors="replace") for f in _files(sglang_tree)
                     if f.startswith("python/sglang/srt/") and f.endswith(".py"))
    for rule in flags["knob"]:
        assert re.search(re.escape(rule["pattern"]), text, re.IGNORECASE), f"{rule['pattern']} occurs nowhere in srt/"
    assert {f["path"] for f in flags["file"]} == {"python/sglang/srt/environ.py", "python/sglang/srt/mem_cache/flush_cache.py",
                                                  "python/sglang/srt/entrypoints/engine.py"}
    for rule in flags["file"]:
        assert (sglang_tree / rule["path"]).is_file(), rule["path"]
    for module in g.denied_modules(sglang_pin.rules):
        path = sglang_tree / "python" / module.replace(".", "/")
        assert path.is_dir() or path.with_suffix(".py").is_file(), module


# ---- fetch: verify, extract, cache ----

def _archive(members: list[tuple[str, bytes | str | None]], top: str = "sglang-0.5.10.post1") -> bytes:
    """A .tar.gz: (name, bytes) is a file, (name, None) a folder, (name, "->target") a symbolic link."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            if data is None:
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
            elif isinstance(data, str):
                info.type, info.linkname = tarfile.SYMTYPE, data[2:]
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


GOOD = [("sglang-0.5.10.post1", None), ("sglang-0.5.10.post1/sglang", None),
        ("sglang-0.5.10.post1/sglang/srt", None), ("sglang-0.5.10.post1/sglang/srt/x.py", b"X = 1\n"),
        ("sglang-0.5.10.post1/pyproject.toml", b"[project]\n")]


def _pin_for(tmp_path: Path, data: bytes, sglang_pin) -> tuple[pin_stage.Pin, Path]:
    """The real pin, re-pointed at `data` (its sha256 and size), and the archive on disk."""
    archive = tmp_path / "sglang-0.5.10.post1.tar.gz"
    archive.write_bytes(data)
    sdist = dict(sglang_pin.sdist, sha256=hashlib.sha256(data).hexdigest(), size=len(data))
    return dataclasses.replace(sglang_pin, sdist=sdist), archive


def _pin_file(tmp_path: Path, pin: pin_stage.Pin) -> Path:
    text = pin_stage.PIN_FILE.read_text()
    text = re.sub(r'(?m)^sha256 = "01f7[0-9a-f]+"$', f'sha256 = "{pin.sha256}"', text, count=1)
    text = re.sub(r"(?m)^size = 4701855$", f"size = {pin.sdist['size']}", text, count=1)
    path = tmp_path / "pin.toml"
    path.write_text(text)
    assert pin_stage.load_pin(path).sha256 == pin.sha256
    return path


def _left_in(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir()) if cache.exists() else []


def test_an_archive_is_extracted_once_in_git_layout(tmp_path, sglang_pin):
    pin, archive = _pin_for(tmp_path, _archive(GOOD), sglang_pin)
    cache = tmp_path / "cache"
    root = pin_stage.fetch(pin, cache, sdist=archive)
    assert root == cache / pin.sha256
    assert (root / "python" / "sglang" / "srt" / "x.py").read_text() == "X = 1\n"
    assert (root / pin_stage.MARKER).read_text().strip() == pin.sha256
    assert _left_in(cache) == [pin.sha256]  # no temp folder left beside it
    archive.unlink()  # a second fetch never reads the archive again
    assert pin_stage.fetch(pin, cache, sdist=archive) == root == pin_stage.tree_path(pin, cache)


def test_a_tampered_archive_is_refused_and_leaves_nothing(tmp_path, sglang_pin, capsys):
    pin, archive = _pin_for(tmp_path, _archive(GOOD), sglang_pin)
    data = bytearray(archive.read_bytes())
    data[len(data) // 2] ^= 1
    archive.write_bytes(bytes(data))
    cache = tmp_path / "cache"
    code = main(["serving", "fetch", "--pin", str(_pin_file(tmp_path, pin)), "--cache", str(cache),
                 "--sdist", str(archive)])
    err = capsys.readouterr().err
    assert code == 1 and "refused:" in err and "sha256" in err and pin.sha256 in err and "nothing was extracted" in err
    assert _left_in(cache) == [] and pin_stage.cached_tree(pin, cache) is None


@pytest.mark.parametrize("hostile", [
    [("sglang-0.5.10.post1/../evil.txt", b"x")],
    [("/tmp/evil-abs.txt", b"x")],
    [("sglang-0.5.10.post1/sglang", None), ("sglang-0.5.10.post1/sglang/link", "->/etc"),
     ("sglang-0.5.10.post1/sglang/link/evil.txt", b"x")],
    [("sglang-0.5.10.post1/sglang/up", "->../../../../outside")],
    [("elsewhere/file.txt", b"x")],
], ids=["dotdot", "absolute", "link-then-write-through", "link-outside", "outside-top"])
def test_hostile_members_are_refused_and_nothing_is_written_anywhere(tmp_path, sglang_pin, hostile):
    pin, archive = _pin_for(tmp_path, _archive(GOOD + hostile), sglang_pin)
    cache = tmp_path / "deep" / "cache"
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    with pytest.raises(pin_stage.PinError, match="unsafe member|outside sglang-0.5.10.post1/"):
        pin_stage.fetch(pin, cache, sdist=archive)
    after = sorted(str(p) for p in tmp_path.rglob("*"))
    assert [p for p in after if p not in before] == [str(cache.parent), str(cache)]  # only the cache, empty
    assert _left_in(cache) == []
    assert not Path("/tmp/evil-abs.txt").exists()


def test_a_folder_without_the_marker_is_never_used(tmp_path, sglang_pin):
    pin, archive = _pin_for(tmp_path, _archive(GOOD), sglang_pin)
    cache = tmp_path / "cache"
    (cache / pin.sha256 / "python").mkdir(parents=True)  # a tree someone left half made
    assert pin_stage.cached_tree(pin, cache) is None
    with pytest.raises(pin_stage.PinError, match="no verified tree"):
        pin_stage.fetch(pin, cache, sdist=archive)
    assert _left_in(cache) == [pin.sha256]


def test_the_cache_location(monkeypatch, tmp_path):
    monkeypatch.delenv(pin_stage.CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert pin_stage.cache_root() == tmp_path / "xdg" / "muse-pipeline" / "sglang"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert pin_stage.cache_root() == tmp_path / "home" / ".cache" / "muse-pipeline" / "sglang"
    monkeypatch.setenv(pin_stage.CACHE_ENV, str(tmp_path / "mine"))
    assert pin_stage.cache_root() == tmp_path / "mine"


def test_a_second_fetch_is_instant_and_prints_the_same_tree(sglang_tree, capsys):
    start = time.perf_counter()
    assert main(["serving", "fetch"]) == 0
    took = time.perf_counter() - start
    assert capsys.readouterr().out.strip() == str(sglang_tree)
    assert took < 0.5, f"a cached fetch took {took:.2f} s"


def test_pip_refuses_an_archive_whose_hash_is_not_the_pinned_one(tmp_path, sglang_pin, capsys):
    """The real package index, with a pin whose sha256 is one digit off: pip's --require-hashes refuses
    the download before any of the package's build code runs, and nothing is extracted."""
    wrong = ("0" if sglang_pin.sha256[0] != "0" else "1") + sglang_pin.sha256[1:]
    pin = dataclasses.replace(sglang_pin, sdist=dict(sglang_pin.sdist, sha256=wrong))
    cache = tmp_path / "cache"
    code = main(["serving", "fetch", "--pin", str(_pin_file(tmp_path, pin)), "--cache", str(cache)])
    err = capsys.readouterr().err
    assert code == 1 and "refused:" in err and wrong in err and "nothing was extracted" in err
    assert _left_in(cache) == []


def test_a_broken_pin_is_a_usage_error(tmp_path, capsys):
    bad = tmp_path / "pin.toml"
    bad.write_text("[sdist]\nname = 'x'\n")
    assert main(["serving", "fetch", "--pin", str(bad)]) == 2
    assert "the pin lacks" in capsys.readouterr().err
