"""Reading a file that crossed a trust boundary (an artifact, a key someone else placed): the file
itself, never what a link at its path points to, a regular file only, bounded in size."""

from __future__ import annotations

import errno
import hashlib
import os
import stat
from pathlib import Path


class UnreadableFile(ValueError):
    """Why the file was not read, in words for the caller's message."""


def read_regular_file(path: Path, limit: int) -> tuple[bytes, os.stat_result]:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise UnreadableFile("a link, which is never followed" if exc.errno == errno.ELOOP else exc.strerror) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnreadableFile("not a regular file")
        if st.st_size > limit:
            raise UnreadableFile(f"{st.st_size:,} bytes, more than {limit:,}")
        with os.fdopen(os.dup(fd), "rb") as fh:
            data = fh.read(limit + 1)
    finally:
        os.close(fd)
    if len(data) > limit:
        raise UnreadableFile(f"more than {limit:,} bytes")
    return data, st


def git_blob_sha(data: bytes) -> str:
    """The SHA git gives this content as a blob: what the PR's tree names, so the two can be matched."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
