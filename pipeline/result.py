"""The one result schema (versioned) that every stage after evaluation reads.

`pipeline/schema/result.schema.json` is the published contract; `validate` is called wherever a result
crosses a trust boundary (written by an evaluator, read from an artifact, appended to the ledger).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
from functools import lru_cache
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1
SCHEMA_PATH = Path(__file__).resolve().parent / "schema" / "result.schema.json"
STATUSES = ("passed", "incorrect", "compile_error", "runtime_error", "timeout", "rejected", "needs_review")


class ResultError(ValueError):
    pass


@lru_cache(maxsize=1)
def _validator():
    try:
        import jsonschema
    except ImportError:
        raise ResultError("validating a result needs the jsonschema package: pip install jsonschema") from None
    schema = json.loads(SCHEMA_PATH.read_text())
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def validate(doc: Any) -> None:
    """Raise ResultError naming every place where `doc` breaks the schema."""
    errors = sorted(_validator().iter_errors(doc), key=lambda e: list(e.absolute_path))
    if errors:
        lines = [f"  at /{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in errors[:20]]
        raise ResultError("the result does not match result.schema.json:\n" + "\n".join(lines))


def now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def git_blob_sha(data: bytes) -> str:
    """The SHA git gives this content as a blob: what the PR's tree names, so the two can be matched."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def write(doc: dict[str, Any], path: Path) -> None:
    validate(doc)
    path.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")


def read(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ResultError(f"{path}: cannot read a result: {exc}") from None
    validate(doc)
    return doc


MAX_BYTES = 16 * 1024 * 1024


def read_data(path: Path, limit: int = MAX_BYTES) -> tuple[bytes, dict[str, Any]]:
    """A result file that crossed a trust boundary (an artifact, a download), read as data: a regular
    file opened without following a link, bounded in size, strict JSON (pipeline.signing.loads), valid
    by the schema. Returns its exact bytes (what the ledger's evidence keeps) and the document."""
    from pipeline.files import UnreadableFile, read_regular_file
    from pipeline.signing import loads

    try:
        raw, _ = read_regular_file(path, limit)
    except UnreadableFile as exc:
        raise ResultError(f"{path}: cannot read it as a result ({exc}); pass the result.json itself") from None
    try:
        doc = loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ResultError(f"{path}: not JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise ResultError(f"{path}: a result is a JSON object, not a {type(doc).__name__}")
    validate(doc)
    return raw, doc
