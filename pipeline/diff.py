"""A unified diff -> the files it touches, read exactly as git writes it (`git diff --full-index`).

Both gates read diffs through here: pipeline/validate.py for a pull request's files (every name a header
carries is a file the PR touches) and pipeline/serving/gate.py for a serving patch.diff (what it changes
in the pinned tree). Nothing here decides whether a change may pass: that is the gates' rule.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from pipeline.escape import printable

@dataclass(frozen=True)
class Change:
    """One file a pull request touches. `path` is the new path (the old one for a deletion)."""

    path: str
    status: str  # added | modified | removed | renamed (| unlisted: files the API would not list)
    previous_path: str | None = None  # a rename's old path: the rename deletes it
    old_mode: str | None = None
    new_mode: str | None = None
    binary: bool = False  # binary, not UTF-8, or holding a NUL byte
    size: int | None = None  # bytes of the new content, when known
    size_at_least: int = 0  # a lower bound when only a diff's hunks are known
    blob_sha: str | None = None  # git's SHA of the new content, when known
    missing: bool = False  # listed by the PR but absent from its head commit's tree
    copied_from: str | None = None  # a copy's source (status "added"): read, never changed
    header_problem: str | None = None  # how a diff's header names for this file disagree
    header_names: tuple[str, ...] = ()  # the other names that header carries: each is checked as touched
    # the whole new content where it was read (a checkout, a blob, a new file's hunks): a serving
    # patch.diff is gated on it (pipeline/serving/gate.py)
    content: bytes | None = field(default=None, compare=False, repr=False)


class DiffError(ValueError):
    """The diff could not be read at all."""


# Read as git writes it (diff.c, `git diff --full-index`): a `diff --git a/<old> b/<new>` line, the
# extended header (modes, `index`, `similarity index`, `rename from/to`, `copy from/to`), then `---`/
# `+++` and hunks, or `Binary files ... differ`, or a `GIT binary patch`. A name is exactly its bytes:
# C-quoted (`"b/sub\302\240mission.py"`) where git must quote it, else the raw text of the line, which
# ends a `---`/`+++` name at a TAB (git appends one after a name holding a space). Nothing is stripped,
# so `submission.py ` stays the name git gave it. Every name a header carries is read, and a header
# whose names disagree is refused (`diff-header`) with each of its names checked as a file the PR
# touches: a hand-written diff cannot show the rules one name while naming another.

_QUOTED_ESCAPES = {"a": "\a", "b": "\b", "t": "\t", "n": "\n", "v": "\v", "f": "\f", "r": "\r", '"': '"', "\\": "\\"}
_HEADER_KEYWORDS = ("old mode", "new mode", "deleted file mode", "new file mode", "copy from", "copy to",
                    "rename from", "rename to", "similarity index", "dissimilarity index", "index")
_HEADER_LIKE = re.compile(r"^(old|new|deleted|copy|rename|similarity|dissimilarity|index)\b")
_HUNK_HEADER = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")
REGENERATE = "regenerate it with `git diff --full-index main...HEAD`"


class _BadQuote(ValueError):
    """A C-quoted name that git would not write."""


def _unquote_prefix(s: str) -> tuple[str, str]:
    """The C-quoted name that `s` starts with, and the text after its closing quote."""
    out: list[str] = []
    raw = bytearray()

    def flush() -> None:
        if raw:
            out.append(raw.decode("utf-8", "surrogateescape"))  # the exact bytes, even when not UTF-8
            raw.clear()

    i = 1
    while i < len(s):
        ch = s[i]
        if ch == '"':
            flush()
            return "".join(out), s[i + 1:]
        if ch == "\\":
            octal = s[i + 1:i + 4]
            if re.fullmatch(r"[0-3][0-7]{2}", octal):
                raw.append(int(octal, 8))
                i += 4
                continue
            nxt = s[i + 1:i + 2]
            if nxt not in _QUOTED_ESCAPES:
                raise _BadQuote(f"an escape git never writes (\\{nxt})")
            flush()
            out.append(_QUOTED_ESCAPES[nxt])
            i += 2
            continue
        flush()
        out.append(ch)
        i += 1
    raise _BadQuote("a quoted name without its closing quote")


def unquote(name: str) -> str:
    """git's C-style quoting of unusual file names ("b/we\\tird\\303\\274.py") -> the name."""
    if len(name) >= 2 and name.startswith('"'):
        try:
            unquoted, rest = _unquote_prefix(name)
        except _BadQuote:
            return name
        if not rest:
            return unquoted
    return name


def _header_name(value: str, *, tab_ends: bool) -> str:
    """One name as a header line spells it: C-quoted, or the raw text (up to a TAB on `---`/`+++`)."""
    if value.startswith('"'):
        name, rest = _unquote_prefix(value)
        if rest and not (tab_ends and rest.startswith("\t")):
            raise _BadQuote(f"text after the quoted name ({rest[:20]!r})")
        return name
    return value.split("\t", 1)[0] if tab_ends else value


def _git_line_pairs(rest: str) -> list[tuple[str, str]]:
    """Every way to read `a/<old> b/<new>` off a `diff --git` line (a name may hold spaces)."""
    splits: list[tuple[str, str]] = []
    if rest.startswith('"'):
        try:
            a, tail = _unquote_prefix(rest)
        except _BadQuote:
            return []
        if tail.startswith(" "):
            splits.append((a, tail[1:]))
    else:
        splits = [(rest[:m.start()], rest[m.start() + 1:]) for m in re.finditer(" ", rest)]
    pairs = []
    for a, b in splits:
        if b.startswith('"'):
            try:
                b = _header_name(b, tab_ends=False)
            except _BadQuote:
                continue
        if a.startswith("a/") and b.startswith("b/"):
            pairs.append((a[2:], b[2:]))
    return pairs


@dataclass
class _Section:
    """One file's part of a diff, as read, before its names are judged."""

    line: int  # where it starts, 1-based
    git: str | None  # the `diff --git ` line's names; None for a plain unified diff (`---`/`+++` only)
    headers: list[tuple[str, str]] = field(default_factory=list)
    minus: str | None = None
    plus: str | None = None
    binary_line: str | None = None
    binary: bool = False
    literal_size: int | None = None
    added: bytearray = field(default_factory=bytearray)
    problems: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class DiffFile:
    """A file of a diff: its change, the bytes its hunks add (the whole content of a new file), and the
    line of the diff its section starts at (1-based)."""

    change: Change
    added: bytes
    line: int = 0


def read_diff(text: str) -> list[DiffFile]:
    """Every file a unified diff touches (git's, or a plain `---`/`+++` one). Raises DiffError when the
    diff cannot be read at all (a hunk outside any file, a hunk shorter than its header says)."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    sections: list[_Section] = []
    i, n = 0, len(lines)
    while i < n:
        line = lines[i]
        if line.startswith("diff --git "):
            sec = _Section(line=i + 1, git=line[len("diff --git "):])
            sections.append(sec)
            i += 1
            while i < n:
                kw = next((k for k in _HEADER_KEYWORDS if lines[i].startswith(k + " ")), None)
                if kw is None and _HEADER_LIKE.match(lines[i]):
                    sec.problems.append(f"line {i + 1} ({printable(lines[i][:60])}) is no header line git writes")
                elif kw is None:
                    break
                else:
                    sec.headers.append((kw, lines[i][len(kw) + 1:]))
                i += 1
            if i < n and lines[i].startswith("Binary files "):
                sec.binary, sec.binary_line = True, lines[i]
                i += 1
            elif i < n and lines[i] == "GIT binary patch":
                sec.binary = True
                i += 1
                while i < n and not lines[i].startswith("diff --git "):
                    literal = re.fullmatch(r"literal (\d+)", lines[i])
                    if literal and sec.literal_size is None:
                        sec.literal_size = int(literal[1])  # the first block is the new content
                    i += 1
            elif i < n and lines[i].startswith("--- "):
                if i + 1 >= n or not lines[i + 1].startswith("+++ "):
                    raise DiffError(f"line {i + 1}: a `---` line without its `+++` line; {REGENERATE}")
                sec.minus, sec.plus = lines[i][4:], lines[i + 1][4:]
                i = _read_hunks(lines, i + 2, sec)
            continue
        if line.startswith("--- ") and i + 1 < n and lines[i + 1].startswith("+++ "):
            sec = _Section(line=i + 1, git=None, minus=line[4:], plus=lines[i + 1][4:])
            sections.append(sec)
            i = _read_hunks(lines, i + 2, sec)
            continue
        if line.startswith("@@ "):
            raise DiffError(f"line {i + 1}: a hunk outside any file (no `diff --git` or `---`/`+++` before it); "
                            f"{REGENERATE}")
        if line.startswith(("diff --cc ", "diff --combined ")):
            raise DiffError(f"line {i + 1}: a combined diff of a merge; {REGENERATE}")
        i += 1  # text between files: a patch's message and diffstat, its signature
    if not sections and text.strip():
        raise DiffError(f"no file in it (no `diff --git` or `---`/`+++` line); {REGENERATE}")
    return [_resolve(sec) for sec in sections]


def _read_hunks(lines: list[str], i: int, sec: _Section) -> int:
    n = len(lines)
    while i < n and lines[i].startswith("@@"):
        m = _HUNK_HEADER.match(lines[i])
        if not m:
            raise DiffError(f"line {i + 1}: a hunk header git never writes ({printable(lines[i][:60])}); {REGENERATE}")
        start = i + 1
        old = int(m[2]) if m[2] is not None else 1
        new = int(m[4]) if m[4] is not None else 1
        last = None
        i += 1
        while old > 0 or new > 0 or (i < n and lines[i].startswith("\\")):
            if i >= n:
                raise DiffError(f"the hunk at line {start} ends before its header says; {REGENERATE}")
            line, kind = lines[i], lines[i][:1]
            if kind == "\\":  # "\ No newline at end of file": the line before it has no newline
                if last == "+" and sec.added.endswith(b"\n"):
                    del sec.added[-1:]
            elif kind in (" ", ""):
                old, new = old - 1, new - 1
            elif kind == "-":
                old -= 1
            elif kind == "+":
                new -= 1
                sec.added += line[1:].encode("utf-8", "surrogateescape") + b"\n"
            else:
                raise DiffError(f"line {i + 1}: the hunk at line {start} ends before its header says; {REGENERATE}")
            if old < 0 or new < 0:
                raise DiffError(f"line {i + 1}: the hunk at line {start} is longer than its header says; {REGENERATE}")
            last = kind
            i += 1
    return i


def _resolve(sec: _Section) -> DiffFile:
    """The change a section makes, from names that must all agree; where they do not, `header_problem`
    says how, and every other name lands in `header_names`."""
    problems = list(sec.problems)
    values: dict[str, list[str]] = {}
    for kw, value in sec.headers:
        values.setdefault(kw, []).append(value)
    for kw, vs in values.items():
        if len(vs) > 1:
            problems.append(f"`{kw}` appears {len(vs)} times")

    def named(kw: str) -> str | None:
        if kw not in values:
            return None
        try:
            return _header_name(values[kw][0], tab_ends=False)
        except _BadQuote as exc:
            problems.append(f"`{kw}` holds {exc}")
            return values[kw][0]

    def side(raw: str | None, prefix: str, what: str) -> str | None:
        if raw is None:
            return None
        try:
            name = _header_name(raw, tab_ends=True)
        except _BadQuote as exc:
            problems.append(f"`{what}` holds {exc}")
            name = raw
        if name == "/dev/null":
            return name
        if name.startswith(prefix):
            return name[len(prefix):]
        if sec.git is not None:
            problems.append(f"`{what}` names {printable(name)}, not {prefix}<path>")
        return name

    rename_from, rename_to = named("rename from"), named("rename to")
    copy_from, copy_to = named("copy from"), named("copy to")
    new_file, deleted = "new file mode" in values, "deleted file mode" in values
    minus, plus = side(sec.minus, "a/", "---"), side(sec.plus, "b/", "+++")
    renamed = rename_from is not None or rename_to is not None
    copied = copy_from is not None or copy_to is not None
    if renamed and copied:
        problems.append("it declares both a copy and a rename of one file")
    for (a, b), what in (((rename_from, rename_to), "rename"), ((copy_from, copy_to), "copy")):
        if (a is None) != (b is None):
            problems.append(f"`{what} {'from' if a is None else 'to'}` is missing")
    if (renamed or copied) and (new_file or deleted):
        problems.append(f"it declares a {'new' if new_file else 'deleted'} file that is also a "
                        f"{'rename' if renamed else 'copy'}")
    if new_file and deleted:
        problems.append("it declares the file both new and deleted")
    pairs = _git_line_pairs(sec.git) if sec.git is not None else []
    if sec.git is not None and not pairs:
        problems.append("its `diff --git` line has no `a/<path> b/<path>` git would write")

    # the names: from the most specific lines, then checked against every other line
    if renamed or copied:
        before = rename_from or copy_from or rename_to or copy_to or ""
        after = rename_to or copy_to or before
    elif minus is not None or plus is not None:
        before = minus if minus not in (None, "/dev/null") else (plus if plus not in (None, "/dev/null") else "")
        after = plus if plus not in (None, "/dev/null") else before
    else:
        same = [(a, b) for a, b in pairs if a == b]
        before, after = same[0] if len(same) == 1 else (pairs[0] if pairs else ("", ""))
        if len(same) > 1:
            problems.append("its `diff --git` line can be read as more than one file")
    if sec.git is not None:
        new_file = new_file or (minus == "/dev/null" and not (renamed or copied))
        if minus == "/dev/null" and "new file mode" not in values:
            problems.append("`--- /dev/null` says the file is new, but there is no `new file mode` line")
        if plus == "/dev/null" and "deleted file mode" not in values:
            problems.append("`+++ /dev/null` says the file is deleted, but there is no `deleted file mode` line")
        deleted = deleted or plus == "/dev/null"
    else:
        new_file, deleted = minus == "/dev/null", plus == "/dev/null"

    disagree = bool(pairs) and (before, after) not in pairs
    disagree |= minus not in (None, "/dev/null") and minus != before
    disagree |= plus not in (None, "/dev/null") and plus != after
    disagree |= before != after and not (renamed or copied)
    if sec.binary_line is not None:
        want = ("/dev/null" if new_file else f"a/{before}", "/dev/null" if deleted else f"b/{after}")
        body = sec.binary_line[len("Binary files "):]
        body = body[:-len(" differ")] if body.endswith(" differ") else body
        spans = [(body[:m.start()], body[m.end():]) for m in re.finditer(" and ", body)]
        disagree |= not any((unquote(x), unquote(y)) == want for x, y in spans)
    if disagree:
        said = []
        if sec.git is not None:
            said.append(f"`diff --git` names {printable(sec.git)}")
        for kw in ("rename from", "rename to", "copy from", "copy to"):
            if kw in values:
                said.append(f"`{kw}` names {printable(values[kw][0])}")
        for what, raw in (("---", sec.minus), ("+++", sec.plus), ("Binary files", sec.binary_line)):
            if raw is not None:
                said.append(f"`{what}` names {printable(raw.split(chr(9))[0] if what != 'Binary files' else raw)}")
        if sec.git is None and before != after:
            problems.insert(0, f"`---` and `+++` name different files ({printable(before)}, {printable(after)}), "
                            "and a diff without `rename from`/`rename to` cannot move a file")
        else:
            problems.insert(0, "the names in this file's diff header disagree: " + "; ".join(said))

    if renamed:
        status, path, previous, copied_from = "renamed", after, before, None
        if before == after:
            problems.append("it renames the file to itself")
    elif copied:
        status, path, previous, copied_from = "added", after, None, before
    elif new_file:
        status, path, previous, copied_from = "added", after, None, None
    elif deleted:
        status, path, previous, copied_from = "removed", before, None, None
    else:
        status, path, previous, copied_from = "modified", after, None, None
    seen = {n for pair in pairs[:1] for n in pair} | {rename_from, rename_to, copy_from, copy_to, minus, plus}
    extra = tuple(sorted(n for n in seen if n and n != "/dev/null" and n not in (path, previous, copied_from)))

    old_mode = new_mode = index_mode = None
    for kw, value in sec.headers:
        mode = value.split()[-1] if value.split() else None
        if kw == "old mode" or kw == "deleted file mode":
            old_mode = mode
        elif kw in ("new mode", "new file mode"):
            new_mode = mode
        elif kw == "index" and len(value.split()) == 2:
            index_mode = mode
    if status != "removed" and new_mode is None:
        new_mode = index_mode
    added = bytes(sec.added)
    binary = sec.binary or b"\0" in added or not is_utf8(added)
    whole = status == "added" and copied_from is None  # a new file's hunks are all of it
    size = (sec.literal_size if sec.binary_line is None and sec.binary else len(added)) if whole else None
    change = Change(path=path, status=status, previous_path=previous, old_mode=old_mode, new_mode=new_mode,
                    binary=binary, size=size, size_at_least=max(len(added), sec.literal_size or 0),
                    copied_from=copied_from, header_names=extra if problems else (),
                    content=added if whole and not binary else None,
                    header_problem=("; ".join(problems) + f" (the file's diff starts at line {sec.line}); "
                                    f"{REGENERATE}") if problems else None)
    return DiffFile(change, added, sec.line)


def is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False
