"""How a verb ends, shared by every stage's verbs: its exit codes, the one way it says no, and the input
whose failure is such an ending (a JSON file read as data). A leaf: it imports no stage; a stage's own
failures that end a verb with exit 2 (GitHub failing a call, a time that is no instant) derive from
`UsageError` here.

Exit codes: 0 done, 1 refused (the input is not one that may pass), 2 usage or configuration error.
A message goes to stderr, control characters shown as escapes (it may quote a file name or a title a
competitor chose), after "refused: " or "error: ".
"""

from __future__ import annotations

import argparse
import json
import os
import stat
import sys
from functools import wraps
from pathlib import Path
from typing import Any, Callable

from pipeline.escape import printable

OK, REFUSED, USAGE = 0, 1, 2
MAX_EVENT_BYTES = 32 * 1024 * 1024  # a workflow's event payload, read by `read_json`


def error(code: int, message: str) -> int:
    text = "\n".join(printable(line) for line in message.splitlines())
    print(("refused: " if code == REFUSED else "error: ") + text, file=sys.stderr)
    return code


class Stop(Exception):
    """Ends a verb (through `guarded`) with this exit code and message."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class UsageError(Exception):
    """The configuration or the environment cannot serve the verb (GitHub failed a call for good, a time
    is no UTC instant): `guarded` ends the verb with exit 2 and `prefix` + the message."""

    prefix = ""


def guarded(body: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Map the expected failures of a verb to its exit code and one message, never a stack trace."""

    @wraps(body)
    def wrapper(args: argparse.Namespace) -> int:
        try:
            return body(args)
        except Stop as stop:
            return error(stop.code, str(stop))
        except UsageError as exc:
            return error(USAGE, f"{exc.prefix}{exc}")

    return wrapper


def read_json(path: Path, what: str, limit: int) -> Any:
    """A JSON file read as data: a regular file (never through a link), bounded in size."""
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise Stop(USAGE, f"{path}: cannot read the {what}: {exc.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise Stop(REFUSED, f"{path}: the {what} is not a regular file")
    if st.st_size > limit:
        raise Stop(REFUSED, f"{path}: the {what} is {st.st_size:,} bytes, more than {limit:,}")
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    with os.fdopen(fd, "rb") as fh:
        raw = fh.read(limit + 1)
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise Stop(REFUSED, f"{path}: the {what} is not JSON: {exc}") from None
