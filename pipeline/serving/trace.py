"""The serving dataset's file (`muse-agentic-trace`): its format, how it is read and written, what it measures
(token counts with the pinned tokenizer) and its check against the shape it was drawn with. Nothing here
generates: pipeline/serving/dataset.py does, and its `dataset check` command runs `check` here. The format
itself is described there, beside the generator that writes it.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FORMAT = "muse-agentic-trace"
FORMAT_VERSION = 1
# Bump when the same (seed, corpus, shape) would give different conversations.
GENERATOR_VERSION = "1"

# Chat-template tokens a message costs beyond its content (ChatML: <|im_start|>, the role, a newline,
# <|im_end|>, a newline, and room for a tool wrapper), counted when the peak context is checked.
MESSAGE_OVERHEAD_TOKENS = 8

# Markers a message must never contain: they would forge the chat template's structure.
FORBIDDEN_MARKERS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")


@dataclass(frozen=True)
class Source:
    """One pinned sdist of the corpus."""

    name: str
    version: str
    sha256: str
    license: str

    @property
    def requirement(self) -> str:
        return f"{self.name}=={self.version}"

    @property
    def archive(self) -> str:
        return f"{self.name}-{self.version}.tar.gz"


# The corpora: disjoint projects, so that the public sample says nothing about the hidden set's text.
CORPORA: dict[str, tuple[Source, ...]] = {
    "public": (
        Source("click", "8.1.7", "ca9853ad459e787e2192211578cc907e7594e294c7ccc834310722b41b9ca6de",
               "BSD-3-Clause"),
        Source("packaging", "24.1", "026ed72c8ed3fcce5bf8950572258698927fd1dbda10a5e981cdf0ac37f4f002",
               "Apache-2.0 OR BSD-2-Clause"),
        Source("requests", "2.32.3", "55365417734eb18255590a9ff9eb97e9e1da868d4ccd6402399eaf68af20a760",
               "Apache-2.0"),
    ),
    "hidden": (
        Source("flask", "3.0.3", "ceb27b0af3823ea2737928a4d99d125a06175b8512c445cbd9a9ce200ef76842",
               "BSD-3-Clause"),
        Source("jinja2", "3.1.4", "4a3aee7acbbe7303aede8e9648d13b8bf88a429282aa6122a993f0ac800cb369",
               "BSD-3-Clause"),
        Source("werkzeug", "3.0.4", "34f2371506b250df4d4f84bfe7b0921e4762525762bbd936614909fe25cd7306",
               "BSD-3-Clause"),
    ),
}


@dataclass(frozen=True)
class Shape:
    """The sizes a set is drawn with, in tokens of the pinned tokenizer, and the bounds its check holds."""

    prefix_tokens: int
    first_turn: tuple[int, int]
    turns: tuple[int, int]
    tool_median: int
    tool_p95: int
    tool_max: int
    reply_median: int
    reply_p95: int
    reply_bounds: tuple[int, int]
    followup_tokens: tuple[int, int]
    canary_rate: float
    # quantiles are checked only with at least this many samples (fewer say too little)
    min_samples: int = 200

    def sigma(self, median: int, p95: int) -> float:
        return math.log(p95 / median) / 1.6448536269514722  # the standard normal's 95th percentile


SHAPES: dict[str, Shape] = {
    # The serving track's shape (serving-track.md, "The replay").
    "agentic": Shape(prefix_tokens=6000, first_turn=(4000, 24000), turns=(10, 40), tool_median=600,
                     tool_p95=6000, tool_max=16000, reply_median=150, reply_p95=2000, reply_bounds=(8, 8192),
                     followup_tokens=(20, 200), canary_rate=0.05),
    # The same flow scaled down for engines with a small window (SmolLM2-135M's 8k on a CPU in tests).
    "smoke": Shape(prefix_tokens=500, first_turn=(300, 1200), turns=(3, 6), tool_median=60, tool_p95=400,
                   tool_max=800, reply_median=16, reply_p95=64, reply_bounds=(4, 128),
                   followup_tokens=(10, 40), canary_rate=0.05),
}
DEFAULT_WINDOW = 131072


class DatasetError(Exception):
    """A dataset cannot be generated or read; the message says what to do."""


def _count(text: str) -> int:
    from pipeline.serving import tokenizer

    return tokenizer.count(text)


def _counts(texts: list[str]) -> list[int]:
    from pipeline.serving import tokenizer

    if not texts:
        return []
    return [len(e.ids) for e in tokenizer.load().encode_batch(texts, add_special_tokens=False)]


def content_sha256(document: dict[str, Any]) -> str:
    """The sha256 of the content (the shared prefix and the conversations), as the module docstring defines it."""
    content = {"system": document.get("system"), "conversations": document.get("conversations")}
    return hashlib.sha256(json.dumps(content, sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode()).hexdigest()


def canary_count(conversations: int, shape: Shape) -> int:
    """How many conversations of a set are canaries: the shape's rate, at least one from ten conversations."""
    n = round(shape.canary_rate * conversations)
    return max(n, 1) if conversations >= 10 else n


def _tokenizer_sha256() -> str:
    from pipeline.serving import tokenizer

    return tokenizer.pin()["sha256"]


# --------------------------------------------------------------------------------------------------
# Reading, summarising and checking.

def _quantiles(values: list[int], qs=(0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99)) -> dict[str, Any]:
    if not values:
        return {"n": 0}
    s = sorted(values)

    def q(p: float) -> float:
        # linear interpolation between closest ranks (numpy's default), rounded for a stable file
        x = p * (len(s) - 1)
        lo = math.floor(x)
        hi = min(lo + 1, len(s) - 1)
        return round(s[lo] + (s[hi] - s[lo]) * (x - lo), 1)

    out: dict[str, Any] = {"n": len(s), "min": s[0]}
    out.update({f"p{round(p * 100):02d}": q(p) for p in qs})
    out.update({"max": s[-1], "mean": round(sum(s) / len(s), 1)})
    return out


def measure(document: dict[str, Any]) -> dict[str, Any]:
    """Per-item token counts of a structurally valid document (what the summary and the check are made of)."""
    system = document["system"]
    prefix = _count(system)
    per_conversation = []
    for conv in document["conversations"]:
        first = _count(conv["turns"][0]["messages"][0]["content"])
        context = prefix + MESSAGE_OVERHEAD_TOKENS
        peak = 0
        previous_reply = None
        tools, followups, kinds = [], [], []
        contents = [m["content"] for t in conv["turns"] for m in t["messages"]]
        counts = iter(_counts(contents))
        for k, turn in enumerate(conv["turns"]):
            if previous_reply is not None:  # the reply before this turn, at its full max_tokens
                context += previous_reply + MESSAGE_OVERHEAD_TOKENS
            for m in turn["messages"]:
                n = next(counts)
                context += n + MESSAGE_OVERHEAD_TOKENS
                if m["role"] == "tool":
                    tools.append(n)
                    kinds.append(_kind(m["content"]))
                elif k:
                    followups.append(n)
            peak = max(peak, context + turn["max_tokens"])
            previous_reply = turn["max_tokens"]
        per_conversation.append({"first": first, "turns": len(conv["turns"]), "peak": peak, "tools": tools,
                                 "followups": followups, "kinds": kinds,
                                 "max_tokens": [t["max_tokens"] for t in conv["turns"]],
                                 "canary": conv["canary"]})
    return {"prefix": prefix, "conversations": per_conversation}


def _kind(content: str) -> str:
    first = content.split("\n", 1)[0]
    words = first[2:].split() if first.startswith("$ ") else []
    if not words:
        return "other"
    if words[0] == "git" and len(words) > 1:
        return f"git {words[1]}"
    if words[0] == "python":
        return "py_compile" if "py_compile" in words else "traceback"
    return words[0]


def summarize(document: dict[str, Any], window: int, measured: dict[str, Any] | None = None) -> dict[str, Any]:
    """The summary statistics (token counts of the pinned tokenizer) a set's metadata records."""
    m = measured or measure(document)
    convs = m["conversations"]
    kinds: dict[str, int] = {}
    for c in convs:
        for k in c["kinds"]:
            kinds[k] = kinds.get(k, 0) + 1
    canaries = sum(c["canary"] for c in convs)
    return {
        "conversations": len(convs),
        "turns_total": sum(c["turns"] for c in convs),
        "prefix_tokens": m["prefix"],
        "turns_per_conversation": _quantiles([c["turns"] for c in convs], (0.1, 0.5, 0.9)),
        "first_turn_tokens": _quantiles([c["first"] for c in convs], (0.1, 0.5, 0.9)),
        "tool_output_tokens": _quantiles([n for c in convs for n in c["tools"]]),
        "reply_max_tokens": _quantiles([n for c in convs for n in c["max_tokens"]]),
        "followup_tokens": _quantiles([n for c in convs for n in c["followups"]], (0.5,)),
        "peak_context_tokens": _quantiles([c["peak"] for c in convs], (0.1, 0.5, 0.9)),
        "window": window,
        "canaries": canaries,
        "canary_rate": round(canaries / len(convs), 4) if convs else 0.0,
        "tool_kinds": dict(sorted(kinds.items())),
        "total_input_tokens": m["prefix"] + sum(c["first"] + sum(c["tools"]) + sum(c["followups"]) for c in convs),
    }


def read(path: Path) -> dict[str, Any]:
    """A dataset file (JSON, or gzip of it), parsed; DatasetError when it is not one."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise DatasetError(f"{path}: cannot read it ({exc.strerror})") from None
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as exc:
            raise DatasetError(f"{path}: a gzip file that does not decompress ({exc})") from None
    try:
        document = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise DatasetError(f"{path}: not UTF-8 ({exc})") from None
    except json.JSONDecodeError as exc:
        raise DatasetError(f"{path}: not JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}") from None
    return document


def write(document: dict[str, Any], path: Path) -> None:
    """Write a document as JSON (one conversation a line, so a diff of two sets reads), gzip when F ends in .gz."""
    head = {k: document[k] for k in ("format", "version", "metadata", "system")}
    text = "{" + ",\n".join(f"{json.dumps(k)}: {json.dumps(v, ensure_ascii=False, sort_keys=True)}" for k, v in head.items())
    text += ',\n"conversations": [\n'
    text += ",\n".join(json.dumps(c, ensure_ascii=False, sort_keys=True) for c in document["conversations"])
    text += "\n]}\n"
    data = text.encode("utf-8")
    path = Path(path)
    if path.name.endswith(".gz"):
        buffer = io.BytesIO()
        # no name and no time in the header, so that the same content gives the same bytes
        with gzip.GzipFile(filename="", mode="wb", fileobj=buffer, compresslevel=9, mtime=0) as gz:
            gz.write(data)
        data = buffer.getvalue()
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    partial.write_bytes(data)
    os.replace(partial, path)


def _where(ci: int, conv: Any, ti: int | None = None, mi: int | None = None) -> str:
    name = conv.get("id") if isinstance(conv, dict) else None
    where = f"conversation {ci}" + (f" ({name})" if isinstance(name, str) else "")
    if ti is not None:
        where += f", turn {ti}"
    if mi is not None:
        where += f", message {mi}"
    return where


def check_structure(document: Any) -> list[str]:
    """Every structural problem of a document, each naming its conversation, turn and message."""
    if not isinstance(document, dict):
        return ["the file is not a JSON object"]
    errors = []
    if document.get("format") != FORMAT:
        errors.append(f"format is {document.get('format')!r}, not {FORMAT!r}: not a dataset of this generator")
    if document.get("version") != FORMAT_VERSION:
        errors.append(f"version is {document.get('version')!r}; this pipeline reads version {FORMAT_VERSION}")
    meta = document.get("metadata")
    if not isinstance(meta, dict):
        errors.append("metadata is missing or not an object")
    else:
        for key, kind in (("generator_version", str), ("seed", int), ("corpus", str), ("shape", str), ("window", int),
                          ("content_sha256", str), ("summary", dict)):
            if not isinstance(meta.get(key), kind):
                errors.append(f"metadata.{key} is missing or not a {kind.__name__}")
        if isinstance(meta.get("shape"), str) and meta["shape"] not in SHAPES:
            errors.append(f"metadata.shape {meta['shape']!r} is not one of {', '.join(SHAPES)}")
    if not isinstance(document.get("system"), str) or not document.get("system"):
        errors.append("system (the shared prefix) is missing or empty")
    convs = document.get("conversations")
    if not isinstance(convs, list) or not convs:
        errors.append("conversations is missing, empty or not a list")
        return errors
    seen: set[str] = set()
    for ci, conv in enumerate(convs):
        if not isinstance(conv, dict):
            errors.append(f"{_where(ci, conv)}: not an object")
            continue
        if not isinstance(conv.get("id"), str):
            errors.append(f"{_where(ci, conv)}: id is missing or not a string")
        elif conv["id"] in seen:
            errors.append(f"{_where(ci, conv)}: id {conv['id']!r} is used twice")
        else:
            seen.add(conv["id"])
        if not isinstance(conv.get("canary"), bool):
            errors.append(f"{_where(ci, conv)}: canary is missing or not true/false")
        turns = conv.get("turns")
        if not isinstance(turns, list) or not turns:
            errors.append(f"{_where(ci, conv)}: turns is missing, empty or not a list")
            continue
        for ti, turn in enumerate(turns):
            where = _where(ci, conv, ti)
            if not isinstance(turn, dict):
                errors.append(f"{where}: not an object")
                continue
            mt = turn.get("max_tokens")
            if not isinstance(mt, int) or isinstance(mt, bool) or mt < 1:
                errors.append(f"{where}: max_tokens is {mt!r}; it must be a positive integer")
            if not isinstance(turn.get("canary"), bool):
                errors.append(f"{where}: canary is missing or not true/false")
            elif isinstance(conv.get("canary"), bool) and turn["canary"] != conv["canary"]:
                errors.append(f"{where}: canary is {turn['canary']} but the conversation's is {conv['canary']}")
            if not isinstance(turn.get("reply"), str):
                errors.append(f"{where}: reply (the fixed history of a canary) is missing or not a string")
            messages = turn.get("messages")
            if not isinstance(messages, list) or not messages:
                errors.append(f"{where}: messages is missing, empty or not a list")
                continue
            for mi, msg in enumerate(messages):
                mwhere = _where(ci, conv, ti, mi)
                if not isinstance(msg, dict):
                    errors.append(f"{mwhere}: not an object")
                    continue
                role = msg.get("role")
                if role not in ("user", "tool"):
                    errors.append(f"{mwhere}: role is {role!r}; a turn holds only user and tool messages "
                                  "(the assistant's come from the server)")
                if ti == 0 and (mi > 0 or role != "user"):
                    errors.append(f"{mwhere}: the first turn is one user message (the task and its context)")
                if role == "tool" and not (isinstance(msg.get("tool_call_id"), str) and isinstance(msg.get("name"), str)):
                    errors.append(f"{mwhere}: a tool message needs tool_call_id and name")
                content = msg.get("content")
                if not isinstance(content, str) or not content:
                    errors.append(f"{mwhere}: content is missing, empty or not a string")
                    continue
                for marker in FORBIDDEN_MARKERS:
                    if marker in content:
                        errors.append(f"{mwhere}: content contains the chat marker {marker}, which would forge "
                                      "the template's structure")
        if len(errors) > 200:
            errors.append("... (more problems; fix these first)")
            break
    return errors


def check_shape(document: dict[str, Any], measured: dict[str, Any],
                window: int | None = None) -> tuple[list[str], list[str]]:
    """(errors, notes): the shape bounds of the document's metadata.shape, checked on its token counts."""
    meta = document["metadata"]
    shape = SHAPES[meta["shape"]]
    window = window or meta["window"]
    errors, notes = [], []
    lo_prefix, hi_prefix = 0.9 * shape.prefix_tokens, shape.prefix_tokens
    if not lo_prefix <= measured["prefix"] <= hi_prefix:
        errors.append(f"system: {measured['prefix']} tokens; the {meta['shape']} shape's prefix is "
                      f"{int(lo_prefix)}-{hi_prefix}")
    convs = document["conversations"]
    for ci, (conv, m) in enumerate(zip(convs, measured["conversations"])):
        where = _where(ci, conv)
        if not shape.turns[0] <= m["turns"] <= shape.turns[1]:
            errors.append(f"{where}: {m['turns']} turns; the shape allows {shape.turns[0]}-{shape.turns[1]}")
        if not shape.first_turn[0] <= m["first"] <= shape.first_turn[1]:
            errors.append(f"{where}, turn 0: {m['first']} tokens; a first turn has {shape.first_turn[0]}-{shape.first_turn[1]}")
        if m["peak"] > window:
            errors.append(f"{where}: peak context {m['peak']} tokens (replies at max_tokens) exceeds the window {window}")
        for ti, mt in enumerate(m["max_tokens"]):
            if not shape.reply_bounds[0] <= mt <= shape.reply_bounds[1]:
                errors.append(f"{where}, turn {ti}: max_tokens {mt} is outside {shape.reply_bounds[0]}-{shape.reply_bounds[1]}")
        for n in m["tools"]:
            if n > shape.tool_max:
                errors.append(f"{where}: a tool output of {n} tokens exceeds the shape's {shape.tool_max}")
    want = canary_count(len(convs), shape)
    have = sum(m["canary"] for m in measured["conversations"])
    if abs(have - want) > max(1, 0.02 * len(convs)):
        errors.append(f"{have} canary conversations of {len(convs)}; the shape's rate {shape.canary_rate} means about {want}")
    for label, values, median, p95 in (
            ("tool outputs", [n for m in measured["conversations"] for n in m["tools"]], shape.tool_median, shape.tool_p95),
            ("replies (max_tokens)", [n for m in measured["conversations"] for n in m["max_tokens"]], shape.reply_median, shape.reply_p95)):
        if len(values) < shape.min_samples:
            notes.append(f"{label}: {len(values)} samples, fewer than {shape.min_samples}: quantiles not checked")
            continue
        q = _quantiles(values)
        # Bounds wide enough for a few hundred samples of the drawn lognormal, narrow enough to catch a wrong shape.
        if not 0.7 * median <= q["p50"] <= 1.35 * median:
            errors.append(f"{label}: median {q['p50']} tokens; the shape's is {median} (allowed {0.7 * median:.0f}-{1.35 * median:.0f})")
        if not 0.55 * p95 <= q["p95"] <= 1.6 * p95:
            errors.append(f"{label}: p95 {q['p95']} tokens; the shape's is {p95} (allowed {0.55 * p95:.0f}-{1.6 * p95:.0f})")
    return errors, notes


def check(document: Any, window: int | None = None) -> tuple[list[str], list[str], dict[str, Any] | None]:
    """(errors, notes, summary) for a parsed document: structure, then the sha256, then the shape (the peak
    context against `window`, default the one the file was generated for)."""
    errors = check_structure(document)
    if errors:
        return errors, [], None
    meta = document["metadata"]
    found = content_sha256(document)
    if found != meta["content_sha256"]:
        errors.append(f"content sha256 is {found}, the metadata says {meta['content_sha256']}: the conversations or "
                      "the prefix were changed after generation; generate the set again")
    measured = measure(document)
    shape_errors, notes = check_shape(document, measured, window)
    errors += shape_errors
    summary = summarize(document, meta["window"], measured)
    if summary != meta["summary"]:
        differing = sorted(k for k in summary if summary.get(k) != meta["summary"].get(k))
        errors.append(f"metadata.summary does not match the content (differs in: {', '.join(differing) or 'its keys'})")
    return errors, notes, summary
