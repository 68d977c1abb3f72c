"""The one result schema (versioned) that every stage after evaluation reads.

`pipeline/schema/result.schema.json` is the published contract; `validate` is called wherever a result
crosses a trust boundary (written by an evaluator, read from an artifact, appended to the ledger).
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import re
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterator

from pipeline.files import UnreadableFile, git_blob_sha, read_regular_file

SCHEMA_VERSION = 1
SCHEMA_PATH = Path(__file__).resolve().parent / "schema" / "result.schema.json"
STATUSES = ("passed", "incorrect", "compile_error", "runtime_error", "timeout", "rejected", "needs_review")


class ResultError(ValueError):
    pass


@lru_cache(maxsize=1)
def _validator():
    try:
        import jsonschema  # noqa: F401
    except ImportError:
        raise ResultError("validating a result needs the jsonschema package: pip install jsonschema") from None
    return strict_validator(json.loads(SCHEMA_PATH.read_text()))


@lru_cache(maxsize=None)
def _ecma_pattern(pattern: str) -> re.Pattern[str]:
    """A JSON Schema `pattern` (ECMA-262) compiled with its own meaning of `$`, the end of the text: in
    Python `$` also matches before a final newline, so "<40 hex digits>\\n" would pass ^[0-9a-f]{40}$."""
    out, i, in_class = [], 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            out.append(pattern[i:i + 2])
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
        elif c == "$":
            c = r"\Z"
        out.append(c)
        i += 1
    return re.compile("".join(out))


def strict_validator(schema: dict[str, Any]) -> Any:
    """A jsonschema validator of `schema` whose `pattern` means what the schema's readers (ECMA-262) take
    it to mean; the ledger's schema is checked with it too."""
    import jsonschema

    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)

    def pattern(validator: Any, patrn: str, instance: Any, _schema: Any) -> Iterator[Any]:
        if validator.is_type(instance, "string") and not _ecma_pattern(patrn).search(instance):
            yield jsonschema.ValidationError(f"{instance!r} does not match {patrn!r}")

    return jsonschema.validators.extend(cls, {"pattern": pattern})(schema)


def _non_finite(obj: Any, path: str = "") -> Iterator[str]:
    """The paths of NaN and infinite numbers in `obj` (JSON Schema cannot say "finite": NaN passes every
    bound, since every comparison with it is false)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        yield path or "/"
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _non_finite(v, f"{path}/{k}")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _non_finite(v, f"{path}/{i}")


def _deepest(error: Any) -> Any:
    """For a value that matched no branch of a oneOf (an object or null), the error inside the branch it
    came closest to ("4.5 is greater than the maximum of 4" at its own path), not the whole value restated."""
    while error.context:
        # the branch that is not a plain type mismatch ("... is not of type 'null'"), deepest first
        tried = [e for e in error.context if e.validator != "type"] or list(error.context)
        error = max(tried, key=lambda e: len(e.absolute_path))
    return error


# Bounds a result must keep beyond its schema (JSON Schema cannot say "finite" and the schema sets no
# sizes): what every later stage (the ledger's JSON, the comment, the board) can then hold without surprise.
MAX_SAFE_INT = 2**53 - 1  # the integers a JSON number holds exactly in every reader
MAX_PR = 2**31 - 1  # GitHub's pull request numbers are GraphQL Ints (32 bits)
MAX_DEPTH = 32
MAX_ITEMS = 100_000  # in any one array
MAX_FLAGS = 10_000
MAX_STRING = 16_384
MAX_LOG = 65_536  # a log tail or a traceback
EARLIEST, LATEST = 2000, 2100  # the years a result's times may name
LOGIN_RE = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,38})")
SHA1_RE = re.compile(r"^[0-9a-f]{40}\Z")  # a git commit or blob id, lowercase hex (\Z: no final newline)
FLAG_CODE_RE = re.compile(r"[a-z][a-z0-9_]{0,63}")
_SURROGATE = re.compile(r"[\ud800-\udfff]")


def _walk_bounds(doc: Any) -> Iterator[tuple[str, str]]:
    """(path, what is wrong) for every value out of the general bounds: numbers finite and integers within
    2^53, strings of valid Unicode within their cap, arrays and nesting bounded, the whole within MAX_BYTES."""
    stack: list[tuple[str, Any, int]] = [("", doc, 0)]
    approx = 0
    while stack:
        path, v, depth = stack.pop()
        if isinstance(v, bool) or v is None:
            approx += 5
        elif isinstance(v, int):
            approx += 8
            if abs(v) > MAX_SAFE_INT:
                yield path, f"an integer of {len(str(abs(v)))} digits, beyond 2^53 (no JSON reader holds it exactly)"
        elif isinstance(v, float):
            approx += 8
            if not math.isfinite(v):
                yield path, f"not a finite number ({v})"
        elif isinstance(v, str):
            approx += len(v) + 2
            cap = MAX_LOG if path.endswith(("/log_tail", "/traceback")) else MAX_STRING
            if len(v) > cap:
                yield path, f"a string of {len(v):,} characters, more than {cap:,}"
            if _SURROGATE.search(v):
                yield path, "a string with a lone surrogate (not Unicode text)"
        elif isinstance(v, (dict, list)):
            if depth >= MAX_DEPTH:
                yield path, f"nested more than {MAX_DEPTH} deep"
                continue
            if isinstance(v, list):
                if len(v) > MAX_ITEMS:
                    yield path, f"an array of {len(v):,} items, more than {MAX_ITEMS:,}"
                    continue
                stack.extend((f"{path}/{i}", x, depth + 1) for i, x in enumerate(v))
            else:
                for k, x in v.items():
                    if not isinstance(k, str) or len(k) > 256:
                        yield path, "a key that is not a string of at most 256 characters"
                        continue
                    approx += len(k) + 4
                    stack.append((f"{path}/{k}", x, depth + 1))
        else:
            yield path, f"a {type(v).__name__}, which JSON does not hold"
        if approx > MAX_BYTES:
            yield "/", f"more than {MAX_BYTES:,} bytes of JSON"
            return


def parse_instant(value: Any) -> dt.datetime | None:
    """An ISO 8601 time with a zone in the years EARLIEST-LATEST (a result's started_at, finished_at), else None."""
    if not isinstance(value, str) or len(value) > 64:
        return None
    try:
        t = dt.datetime.fromisoformat(value)
    except ValueError:
        return None
    return t if t.tzinfo is not None and EARLIEST <= t.year <= LATEST else None


def _in(v: Any, lo: float, hi: float) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and lo < v <= hi


def _pair_ordered(v: Any) -> bool:
    return not isinstance(v, list) or len(v) != 2 or not all(isinstance(x, (int, float)) for x in v) or v[0] <= v[1]


def cut(text: str, cap: int) -> str:
    """`text` within `cap` characters: its head and tail kept, how much was cut said between them."""
    text = _SURROGATE.sub("\ufffd", text)
    if len(text) <= cap:
        return text
    note = f" [... {len(text) - cap + 64:,} characters cut ...] "
    keep = cap - len(note) - 8
    return text[:keep // 2] + note + text[len(text) - keep // 2:]


def bounded(doc: dict[str, Any]) -> dict[str, Any]:
    """`doc` made to fit the bounds that text from a submission can break (what it raises, prints, names or
    writes on a line of source ends up in messages, tracebacks, log tails and flags): every string cut to its
    cap with the cut said, lone surrogates replaced, flags beyond MAX_FLAGS folded into one that counts them.
    In place; numbers and structure are the evaluator's own and left to `validate`."""
    flags = doc.get("flags")
    if isinstance(flags, list) and len(flags) > MAX_FLAGS:
        rest = flags[MAX_FLAGS - 1:]
        codes = sorted({f.get("code", "?") for f in rest if isinstance(f, dict)})
        doc["flags"] = flags[:MAX_FLAGS - 1] + [{"code": "more_flags", "line": None, "message": (
            f"{len(rest):,} more flags, not listed (codes: {', '.join(map(str, codes[:20]))})")}]
    stack: list[tuple[str, Any]] = [("", doc)]
    while stack:
        path, v = stack.pop()
        items = v.items() if isinstance(v, dict) else enumerate(v) if isinstance(v, list) else ()
        for k, x in items:
            where = f"{path}/{k}"
            if isinstance(x, str):
                v[k] = cut(x, MAX_LOG if where.endswith(("/log_tail", "/traceback")) else MAX_STRING)
            elif isinstance(x, (dict, list)):
                stack.append((where, x))
    return doc


def bound_problems(doc: dict[str, Any]) -> list[str]:
    """What is out of bounds in a document that matches the schema (see the constants above): the
    general bounds of every value, then the fields' own ranges and exact patterns."""
    out = [f"at {p or '/'}: {why}" for p, why in _walk_bounds(doc)][:20]
    return out or _field_problems(doc)  # the fields' own checks assume finite numbers and sane sizes


def _field_problems(doc: dict[str, Any]) -> list[str]:
    out: list[str] = []
    sub = doc["submission"]
    if sub["pr"] is not None and not 1 <= sub["pr"] <= MAX_PR:
        out.append(f"at /submission/pr: {sub['pr']} is not a pull request number (1 to {MAX_PR})")
    if sub["login"] is not None and not LOGIN_RE.fullmatch(sub["login"]):
        out.append(f"at /submission/login: {sub['login']!r} is not a GitHub login")
    if len(sub["path"]) > 1024 or not sub["path"].isprintable():
        out.append("at /submission/path: not a path of at most 1,024 printable characters")
    for key in ("problem", "baseline"):
        if len(doc[key]) > (64 if key == "problem" else 1024):
            out.append(f"at /{key}: too long")
    if len(doc["mode"]["timing"]) > 200:
        out.append("at /mode/timing: too long")
    times = {k: parse_instant(doc[k]) for k in ("started_at", "finished_at")}
    for k, t in times.items():
        if t is None:
            out.append(f"at /{k}: {str(doc[k])[:64]!r} is not an ISO 8601 time with a time zone in the years "
                       f"{EARLIEST}-{LATEST}")
    if all(times.values()) and times["finished_at"] < times["started_at"]:
        out.append("at /finished_at: before started_at")
    score = doc["score"]
    if score is not None:
        if not _in(score["speedup"], 0, 1e6):
            out.append(f"at /score/speedup: {score['speedup']!r} is not in (0, 1e6]")
        if not _in(score["time_us"], 0, 1e12):
            out.append(f"at /score/time_us: {score['time_us']!r} is not in (0, 1e12] microseconds")
        lo_hi = score.get("interval")
        if lo_hi is not None and not (0 <= lo_hi[0] <= score["speedup"] <= lo_hi[1]):
            out.append(f"at /score/interval: {lo_hi} does not contain the score {score['speedup']!r} "
                       "(0 <= lo <= speedup <= hi)")
        if not _pair_ordered(score.get("within_run_interval")):
            out.append("at /score/within_run_interval: lo > hi")
    for i, p in enumerate(doc["performance"]):
        where = f"at /performance/{i}"
        if len(p["workload"]) > 128 or not p["workload"].isprintable():
            out.append(f"{where}/workload: not a name of at most 128 printable characters")
        for key, hi in (("median_us", 1e12), ("baseline_median_us", 1e12), ("speedup", 1e6)):
            if not _in(p[key], 0, hi):
                out.append(f"{where}/{key}: {p[key]!r} is not in (0, {hi:g}]")
        if not 1 <= p["n"] <= 10**9:
            out.append(f"{where}/n: {p['n']} samples")
        for key in ("interval_us", "baseline_interval_us"):
            if not _pair_ordered(p.get(key)):
                out.append(f"{where}/{key}: lo > hi")
    if len(doc["flags"]) > MAX_FLAGS:
        out.append(f"at /flags: {len(doc['flags']):,} flags, more than {MAX_FLAGS:,}")
    for i, f in enumerate(doc["flags"][:MAX_FLAGS]):
        if not FLAG_CODE_RE.fullmatch(f["code"]):
            out.append(f"at /flags/{i}/code: {f['code'][:80]!r} is not a flag code ({FLAG_CODE_RE.pattern})")
        if f.get("line") is not None and not 0 <= f["line"] <= 10**9:
            out.append(f"at /flags/{i}/line: {f['line']}")
    for i, c in enumerate(doc["correctness"]):
        if len(c["shape"]) > 128 or not c["shape"].isprintable():
            out.append(f"at /correctness/{i}/shape: not a name of at most 128 printable characters")
        if c["seeds"] > 10**6:
            out.append(f"at /correctness/{i}/seeds: {c['seeds']} seeds")
    return out[:20]


def _short(message: str, keep: int = 400) -> str:
    """A validator's message, which restates the value, without restating all of a large one."""
    return message if len(message) <= keep else f"{message[:keep // 2]} ... {message[-keep // 2:]}"


OUT_OF_BOUNDS = "the result is out of the bounds of result.schema.json and pipeline/result.py:\n"


def validate(doc: Any) -> None:
    """Raise ResultError naming every place where `doc` breaks the schema or the bounds above: the one
    check of a result, run whole before anything reads or writes it."""
    if not isinstance(doc, dict):
        raise ResultError(f"a result is a JSON object, not a {type(doc).__name__}")
    general = [f"  at {p or '/'}: {why}" for p, why in _walk_bounds(doc)][:20]
    if general:  # an integer of 400 digits or a 50 MB string is refused before the schema spends time on it
        raise ResultError(OUT_OF_BOUNDS + "\n".join(general))
    errors = sorted((_deepest(e) for e in _validator().iter_errors(doc)), key=lambda e: list(e.absolute_path))
    lines = [f"  at /{'/'.join(map(str, e.absolute_path))}: {_short(e.message)}" for e in errors[:20]]
    if lines:
        raise ResultError("the result does not match result.schema.json:\n" + "\n".join(lines[:20]))
    bad = _field_problems(doc)
    if bad:
        raise ResultError(OUT_OF_BOUNDS + "\n".join("  " + x for x in bad))


def now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def read_meta(path: Path, submitted: Path) -> dict[str, Any]:
    """The facts fetch-submission wrote for a fetched file (an evaluation's --meta), once the file's own blob
    SHA is the one they name; ResultError says what is wrong and what to pass instead."""
    try:
        meta = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ResultError(f"--meta {path}: cannot read it ({exc}); pass the file fetch-submission wrote") from None
    if not isinstance(meta, dict):
        raise ResultError(f"--meta {path}: expected a JSON object")
    try:
        actual = git_blob_sha(submitted.read_bytes())
    except OSError as exc:
        raise ResultError(f"{submitted}: cannot read it ({exc.strerror})") from None
    if meta.get("blob_sha") != actual:
        raise ResultError(f"{submitted} has blob {actual}, but --meta names {meta.get('blob_sha')}: the file is not "
                          "the one that was fetched and verified")
    return meta


def write(doc: dict[str, Any], path: Path) -> None:
    """Validate the whole document, then write it beside `path` and rename it into place: a refused or
    interrupted write leaves no half a result."""
    validate(doc)
    path = Path(path)
    text = json.dumps(doc, indent=2, sort_keys=True, allow_nan=False) + "\n"
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def read(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError, RecursionError) as exc:
        raise ResultError(f"{path}: cannot read a result: {exc}") from None
    validate(doc)
    return doc


# ---- reading a result as data: JSON as strict as the canonical form the signature covers ----

def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"the key {k!r} appears twice in one object")
        out[k] = v
    return out


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def loads(raw: bytes) -> Any:
    """JSON as strict as the canonical form: UTF-8, no duplicate keys (two parsers must never read two
    different documents from one signed file), no NaN or Infinity."""
    return json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates, parse_constant=_no_constant)


MAX_BYTES = 16 * 1024 * 1024


def read_data(path: Path, limit: int = MAX_BYTES) -> tuple[bytes, dict[str, Any]]:
    """A result file that crossed a trust boundary (an artifact, a download), read as data: a regular
    file opened without following a link, bounded in size, strict JSON (`loads`), valid
    by the schema. Returns its exact bytes (what the ledger's evidence keeps) and the document."""
    try:
        raw, _ = read_regular_file(path, limit)
    except UnreadableFile as exc:
        raise ResultError(f"{path}: cannot read it as a result ({exc}); pass the result.json itself") from None
    try:
        doc = loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ResultError(f"{path}: not JSON ({exc})") from None
    except RecursionError:
        raise ResultError(f"{path}: JSON nested too deep to be a result") from None
    if not isinstance(doc, dict):
        raise ResultError(f"{path}: a result is a JSON object, not a {type(doc).__name__}")
    validate(doc)
    return raw, doc
