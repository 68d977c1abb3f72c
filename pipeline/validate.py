"""A pull request's files -> which submission it is and whose, or every reason to refuse it.

Static only: nothing here executes, imports or evaluates a submission. The rules are the spec's
(github-flow.md, "PR validation rules"); each violation names the file and the rule, and all of them
are listed at once so that a competitor fixes their PR in one round.

A path is compared exactly as git spells it: nothing is stripped or folded, so `submission.py ` (a
trailing space or NBSP) is not `submission.py`, and a folder's login matches its author's only in ASCII
(case-insensitively, as GitHub compares logins), spelled one way throughout the PR.

The changes come from one of two places, both turned into the same `Change` records:
- a unified diff (`git diff --full-index main...HEAD`, read as git writes it: `read_diff`), optionally
  with a checkout of the PR's head to measure whole files (`changes_from_diff`);
- the GitHub API (the PR's file list, the head commit's tree for modes, the blobs for content), which
  is what the privileged gate trusts (`changes_from_pull`; every call is in `pipeline.github`).
"""

from __future__ import annotations

import datetime as dt
import os
import re
import stat
import unicodedata
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

if TYPE_CHECKING:  # pragma: no cover
    from pipeline.competition import Competition
    from pipeline.github import GitHub

KIB = 1024
# the file each track evaluates, and what else a competitor's folder may hold, with size caps
SUBMISSION_FILE = {"kernel": "submission.py", "serving": "patch.diff"}
ALLOWED_FILES = {
    "kernel": {"submission.py": 256 * KIB, "README.md": 64 * KIB},
    "serving": {"patch.diff": 1024 * KIB, "README.md": 64 * KIB},
}
# top-level paths that only organizers change, with what they are (for the message)
PROTECTED = {
    "leaderboard.md": "the generated leaderboard",
    "leaderboard": "the generated leaderboard plots",
    "results": "the results ledger and snapshots",
    "pipeline": "the harness",
    "problems": "the problem definitions",
    "reference": "the reference implementations",
    ".github": "the workflows and repository settings",
    "sglang_pin": "the SGLang pin",
    "competition.toml": "the competition's calendar and rules",
    "tests": "the harness's tests",
    "docs": "the documentation",
    # a result evaluated from solutions/ is the only kind `ledger append --organizers` records
    "solutions": "the organizers' own solutions",
}
REGULAR = "100644"
MODES = {"100755": "an executable file", "120000": "a symbolic link", "160000": "a submodule", "040000": "a directory"}
# GitHub's rule for logins: alphanumerics and single inner hyphens, at most 39 characters
LOGIN_RE = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9]|-(?=[A-Za-z0-9])){0,38}\Z")
_SEGMENT_BAD = re.compile(r"[\x00-\x1f\x7f-\x9f\\]")
_NOT_UTF8 = re.compile(r"[\ud800-\udfff]")  # a byte that is not UTF-8, kept as a lone surrogate
MAX_LISTED = 100  # violations shown in the PR comment; the JSON verdict keeps every one


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


@dataclass(frozen=True)
class Violation:
    path: str
    rule: str
    message: str


@dataclass(frozen=True)
class Submission:
    track: str
    problem: str | None  # None for the serving track
    login: str  # as the folder spells it
    folder: str
    path: str  # the file that is evaluated
    blob_sha: str | None = None


@dataclass
class Verdict:
    author: str
    violations: list[Violation] = field(default_factory=list)
    notices: list[str] = field(default_factory=list)
    submission: Submission | None = None
    files: list[str] = field(default_factory=list)
    patch_gate: dict[str, Any] | None = None  # a serving patch's gate verdict (pipeline/serving/gate.py)

    @property
    def ok(self) -> bool:
        return not self.violations

    def as_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "author": self.author,
            "submission": asdict(self.submission) if self.submission else None,
            "violations": [asdict(v) for v in self.violations],
            "notices": list(self.notices),
            "files": list(self.files),
            "patch_gate": self.patch_gate,
        }

    def text(self) -> str:
        """The verdict for a terminal or a workflow log. A file name is the PR's own text: anything
        unprintable is escaped, so that no name can start a line of its own (an Actions log reads lines
        that start with `::` as workflow commands)."""
        lines = []
        if self.ok and self.submission:
            s = self.submission
            what = f"kernel/{s.problem}" if s.track == "kernel" else "serving"
            lines.append(f"valid: {s.path} ({what} submission of @{s.login})")
        else:
            n = len(self.violations)
            lines.append(f"refused: {n} problem{'s' if n != 1 else ''} with this pull request")
            lines += [f"  {v.path or '(the pull request)'}: [{v.rule}] {v.message}" for v in self.violations]
        lines += [f"note: {n}" for n in self.notices]
        return "\n".join(printable(line) for line in lines)


def printable(text: str) -> str:
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


class DiffError(ValueError):
    """The diff could not be read at all."""


# ---- the rules ----

def _segments_problem(path: str) -> str | None:
    if not path:
        return "an empty path"
    if path.startswith("/") or re.match(r"^[A-Za-z]:", path):
        return "an absolute path"
    parts = path.split("/")
    if ".." in parts:
        return "a path that climbs out with `..`"
    if any(p in ("", ".") for p in parts):
        return "a path with an empty or `.` segment"
    if _SEGMENT_BAD.search(path):
        return "a path with a backslash or a control character"
    if _NOT_UTF8.search(path):
        return "a path that is not UTF-8"
    return None


def _same_login(folder: str, author: str) -> bool:
    """GitHub logins are ASCII and compared without case; no other folding (a KELVIN SIGN lowercases
    to `k`, but `\u212aate/` is not kate's folder)."""
    return folder.isascii() and folder.lower() == author.lower()


def _easy_to_miss(text: str) -> str:
    """The characters of a name a reader would not see or would take for others, named; "" if none."""
    odd = dict.fromkeys(c for c in text if c.isspace() or not c.isprintable() or not c.isascii())
    if not odd:
        return ""
    names = ", ".join(f"U+{ord(c):04X} {unicodedata.name(c, 'an unnamed character')}" for c in odd)
    where = " at its end" if len(odd) == 1 and text.endswith(tuple(odd)) else ""
    return f" (it holds {names}{where}, easy to miss)"


def _classify(path: str) -> tuple[str, dict[str, str]]:
    """What a (safe) path is: ("submission", {track, problem, login, name, folder}) for a path with the
    shape of a submission file, else ("protected"|"other"|"track"|"shape", details)."""
    parts = path.split("/")
    if parts[0] != "submissions":
        return ("protected", {"what": PROTECTED[parts[0]]}) if parts[0] in PROTECTED else ("other", {})
    if len(parts) < 2 or parts[1] not in ALLOWED_FILES:
        return "track", {"track": parts[1] if len(parts) > 1 else ""}
    track = parts[1]
    depth = 5 if track == "kernel" else 4  # submissions/kernel/<problem>/<login>/<file>
    if len(parts) != depth:
        return "shape", {"track": track}
    if track == "kernel":
        problem, login, name = parts[2], parts[3], parts[4]
    else:
        problem, login, name = "", parts[2], parts[3]
    return "submission", {"track": track, "problem": problem, "login": login, "name": name,
                          "folder": "/".join(parts[:-1])}


def _owner_of(path: str) -> str | None:
    """The login of the competitor folder a path lies in, whatever else is wrong with the path."""
    parts = path.split("/")
    if len(parts) >= 4 and parts[0] == "submissions" and parts[1] == "kernel":
        return parts[3]
    if len(parts) >= 3 and parts[0] == "submissions" and parts[1] == "serving":
        return parts[2]
    return None


def _folder_hint(track: str, problem: str, author: str) -> str:
    if track == "kernel":
        return f"submissions/kernel/{problem or '<problem>'}/{author}/"
    return f"submissions/serving/{author}/"


def check(changes: Iterable[Change], author: str, *, problems: Iterable[str], competition: "Competition | None" = None,
          now: dt.datetime | None = None, recent_evaluations: list[dt.datetime] | None = None,
          rate_limit: int | None = None, serving_tree: Path | None = None) -> Verdict:
    """Apply every rule to a PR's changes; `recent_evaluations` are the author's evaluations in the last
    hour (the gate reads them from the API), checked against `rate_limit` (default: the competition's).
    A serving patch.diff whose content is known also goes through the patch gate, against
    `serving_tree` (default: the pinned SGLang, fetched into its cache if need be)."""
    changes = list(changes)
    problems = set(problems)
    verdict = Verdict(author=author, files=[c.path for c in changes])
    add = verdict.violations.append
    if not changes:
        add(Violation("", "empty", "the pull request changes no files; add "
                      f"{_folder_hint('kernel', '', author)}submission.py (or submissions/serving/{author}/patch.diff)"))
        return verdict
    if not LOGIN_RE.match(author):
        add(Violation("", "author", f"the author's login {author!r} cannot own a submission folder"))

    targets: dict[tuple[str, str], dict[str, Any]] = {}  # (track, problem) -> facts
    for c in changes:
        if c.status == "unlisted":
            add(Violation("", "too-many-files", f"the pull request changes {c.size:,} files and GitHub lists only "
                          f"the first 3,000; the rest cannot be checked: a submission is one or two files"))
            continue
        if c.header_problem:
            add(Violation(c.path, "diff-header", c.header_problem))
        gone = [c.previous_path] if c.status == "renamed" and c.previous_path else []
        for old in gone:  # a rename moves a file away from where it was: a deletion there
            _check_path(Change(old, "removed"), author, problems, targets, add)
        if c.copied_from is not None and _segments_problem(c.copied_from):
            add(Violation(c.copied_from, "unsafe-path", f"{_segments_problem(c.copied_from)} (the source of a copy to "
                          f"{c.path}): git writes no such name"))
        for other in c.header_names:  # a lying header: every name it carries is a file the PR may touch
            _check_path(Change(other, "modified"), author, problems, targets, add)
        _check_path(c, author, problems, targets, add)

    if len(targets) > 1:
        names = ", ".join(f"kernel/{p}" if t == "kernel" else "serving" for t, p in sorted(targets))
        add(Violation("", "one-submission-per-pr",
                      f"a pull request holds one submission; this one touches {names}: open one pull request each"))
    elif len(targets) == 1:
        (track, problem), facts = next(iter(targets.items()))
        spellings = facts["spellings"]
        if len(spellings) > 1:
            add(Violation(list(spellings)[1], "folder-spelling",
                          f"your folder is spelled {len(spellings)} ways in this pull request "
                          f"({', '.join(f + '/' for f in spellings)}); git and GitHub keep them as different "
                          f"folders, and a competitor has one: put every file under "
                          f"{_folder_hint(track, problem, author)}"))
        main = facts.get("main")
        expected = f"{facts['folder']}/{SUBMISSION_FILE[track]}"
        if main is None:
            add(Violation(expected, "no-submission-file",
                          f"nothing to evaluate: the pull request must add or change {expected}"))
        elif main.status == "removed":
            add(Violation(expected, "no-submission-file",
                          f"the pull request deletes {expected}; a pull request must add or change the "
                          "submission it asks to evaluate"))
        else:
            verdict.submission = Submission(track, problem or None, facts["login"], facts["folder"], main.path,
                                            main.blob_sha)
            if track == "serving":
                _gate_patch(verdict, main, add, serving_tree)
    if competition is not None and targets:
        _calendar_notes(verdict, competition, {t for t, _ in targets}, now)
        limit = rate_limit or competition.rate_limit_per_hour
    else:
        limit = rate_limit
    if recent_evaluations is not None and limit is not None and len(recent_evaluations) >= limit:
        first = min(recent_evaluations)
        opens = (first + dt.timedelta(hours=1)).astimezone(dt.timezone.utc).strftime("%H:%M UTC")
        add(Violation("", "rate-limit",
                      f"@{author} has had {len(recent_evaluations)} evaluations in the last hour; the limit is "
                      f"{limit} per competitor per hour. The next slot opens at {opens}: push again or ask "
                      "for the run-eval label then"))
    return verdict


def _gate_patch(verdict: Verdict, c: Change, add, tree: Path | None) -> None:
    """The serving patch gate on the patch.diff's content; its reasons become violations of that file
    (rule `patch-<rule>`, the message naming the patched file and the line of the patch), its flags notes."""
    if c.content is None:
        if not any(v.path == c.path for v in verdict.violations):
            verdict.notices.append(f"{c.path} was not read whole here (a diff shows only its hunks), so the patch rules "
                                   "were not applied; they are where the file is read (validate --tree, and the gate)")
        return
    from pipeline.serving import gate
    from pipeline.serving.pin import PinError, load_pin, tree_path

    try:
        pin = load_pin()
        result = gate.gate(c.content, tree or tree_path(pin), pin)
    except (PinError, gate.GateUnavailable) as exc:
        add(Violation(c.path, "patch-gate-unavailable", f"the patch could not be checked against the pinned SGLang "
                      f"({exc}); nothing was evaluated: push again later, or ask a maintainer"))
        return
    verdict.patch_gate = result.as_dict()
    for r in result.reasons:
        where = ", ".join(x for x in (r.file, f"line {r.line} of the patch" if r.line else "") if x)
        add(Violation(c.path, f"patch-{r.rule}", f"{where}: {r.message}" if where else r.message))
    for f in result.flags:
        where = f"{f.file}, line {f.line} of the patch " if f.file else ""
        verdict.notices.append(f"flagged for a maintainer's review: {where}({f.pattern}): {f.why}")


def _check_path(c: Change, author: str, problems: set[str], targets: dict, add) -> None:
    path = c.path
    why = _segments_problem(path)
    if why:
        add(Violation(path, "unsafe-path", f"{why}: every file must lie inside your submission folder"))
        return
    kind, info = _classify(path)
    owner = _owner_of(path)
    if owner is not None and not _same_login(owner, author):
        if c.status == "removed":
            add(Violation(path, "deletes-others-file",
                          f"deletes a file of @{owner}{_easy_to_miss(owner)}: a pull request may delete only its "
                          "author's files"))
        elif c.status == "added":
            track = path.split("/")[1]
            problem = path.split("/")[2] if track == "kernel" else ""
            add(Violation(path, "login-mismatch",
                          f"the folder's login {owner!r}{_easy_to_miss(owner)} is not the pull request author's "
                          f"(@{author}); put your files under {_folder_hint(track, problem, author)}"))
        else:
            add(Violation(path, "others-folder",
                          f"changes a file in @{owner}'s folder{_easy_to_miss(owner)}: a pull request may change only "
                          "its author's folder"))
        return
    if kind == "protected":
        add(Violation(path, "protected-path", f"only organizers change {info['what']} ({path.split('/')[0]}); "
                      "a pull request may change only files under your submission folder"))
        return
    if kind == "other":
        add(Violation(path, "outside-submissions",
                      f"only files under {_folder_hint('kernel', '', author)} or submissions/serving/{author}/ "
                      "may change"))
        return
    if kind == "track":
        add(Violation(path, "unknown-track", f"{info['track']!r} is not a track; use submissions/kernel/<problem>/"
                      f"{author}/ or submissions/serving/{author}/"))
        return
    if kind == "shape":
        track = info["track"]
        add(Violation(path, "file-name", f"files go directly in {_folder_hint(track, '', author)}, no deeper "
                      f"and no shallower: {', '.join(sorted(ALLOWED_FILES[track]))}"))
        return
    track, problem, name = info["track"], info["problem"], info["name"]
    if track == "kernel" and problem not in problems:
        known = ", ".join(sorted(problems)) or "none"
        add(Violation(path, "unknown-problem", f"{problem!r} is not a problem of this competition; the problems "
                      f"are: {known}"))
        return
    facts = targets.setdefault((track, problem), {"folder": info["folder"], "login": info["login"], "spellings": {}})
    facts["spellings"].setdefault(info["folder"], path)
    if c.status == "removed":
        if name == SUBMISSION_FILE[track]:
            facts["main"] = c
        return  # deleting one's own README is fine
    allowed = ALLOWED_FILES[track]
    if name not in allowed:
        add(Violation(path, "file-name", f"{name!r} is not allowed here{_easy_to_miss(name)}; your folder may "
                      f"hold only {' and '.join(sorted(allowed))}, spelled exactly so"))
        return
    if name == SUBMISSION_FILE[track]:
        facts["main"] = c
    _check_content(c, allowed[name], add)


def _check_content(c: Change, limit: int, add) -> None:
    path = c.path
    if c.missing:
        add(Violation(path, "missing", "listed by the pull request but not a file in its head commit"))
        return
    mode = c.new_mode
    if mode == "120000":
        add(Violation(path, "symlink", "is a symbolic link; submit the file itself"))
        return
    if mode == "160000":
        add(Violation(path, "submodule", "is a submodule; submit the file itself"))
        return
    if c.old_mode and c.new_mode and c.old_mode != c.new_mode:
        add(Violation(path, "mode-change", f"changes the file's mode from {c.old_mode} to {c.new_mode}; "
                      f"keep it a plain {REGULAR} file (git update-index --chmod=-x {path})"))
    elif mode and mode != REGULAR:
        add(Violation(path, "mode-change", f"is {MODES.get(mode, 'mode ' + mode)}; it must be a plain "
                      f"{REGULAR} file (git update-index --chmod=-x {path})"))
    if c.binary:
        add(Violation(path, "binary", "is binary or not UTF-8 text; submissions are source text"))
    size = c.size if c.size is not None else c.size_at_least
    if size > limit:
        add(Violation(path, "too-large", f"is {size:,} bytes; the limit for this file is {limit:,} bytes"))


def _calendar_notes(verdict: Verdict, competition: "Competition", tracks: set[str], now: dt.datetime | None) -> None:
    from pipeline.competition import format_instant

    now = now or dt.datetime.now(dt.timezone.utc)
    for name in sorted(tracks):
        track = competition.tracks[name]
        if now < track.start:
            verdict.notices.append(f"the {track.title} opens at {format_instant(track.start)}: this submission "
                                   "is evaluated and commented on, but not ranked")
        elif now >= track.end:
            verdict.notices.append(f"the {track.title} closed at {format_instant(track.end)}: this submission is "
                                   "evaluated and commented on, but not ranked")


def rate_window_start(now: dt.datetime | None = None) -> dt.datetime:
    return (now or dt.datetime.now(dt.timezone.utc)) - dt.timedelta(hours=1)


# ---- changes from a unified diff ----
#
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


def _unquote(name: str) -> str:
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
        disagree |= not any((_unquote(x), _unquote(y)) == want for x, y in spans)
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
    binary = sec.binary or b"\0" in added or not _is_utf8(added)
    whole = status == "added" and copied_from is None  # a new file's hunks are all of it
    size = (sec.literal_size if sec.binary_line is None and sec.binary else len(added)) if whole else None
    change = Change(path=path, status=status, previous_path=previous, old_mode=old_mode, new_mode=new_mode,
                    binary=binary, size=size, size_at_least=max(len(added), sec.literal_size or 0),
                    copied_from=copied_from, header_names=extra if problems else (),
                    content=added if whole and not binary else None,
                    header_problem=("; ".join(problems) + f" (the file's diff starts at line {sec.line}); "
                                    f"{REGENERATE}") if problems else None)
    return DiffFile(change, added, sec.line)


def changes_from_diff(text: str, tree: Path | None = None) -> list[Change]:
    """Parse a unified diff (git's, ideally with --full-index) into changes. With `tree`, a checkout of
    the PR's head, new content is measured from the files themselves (never following a link)."""
    out = []
    for f in read_diff(text):
        change = f.change
        if tree is not None and change.status != "removed" and change.path and not _segments_problem(change.path):
            change = _measure(change, Path(tree))
        out.append(change)
    return out


def _measure(c: Change, tree: Path) -> Change:
    """Size, kind and content of a changed file in a checkout, without following any link on the way."""
    from dataclasses import replace

    target = tree / c.path
    probe = tree
    for part in c.path.split("/"):
        probe = probe / part
        try:
            st = os.lstat(probe)
        except FileNotFoundError:
            return replace(c, missing=True)
        if stat.S_ISLNK(st.st_mode):
            return replace(c, new_mode="120000")
    if stat.S_ISDIR(st.st_mode):
        return replace(c, new_mode="040000")
    if not stat.S_ISREG(st.st_mode):
        return replace(c, missing=True)
    if c.new_mode is None:  # no mode line (a copy or rename at 100%): the checkout's is the file's
        c = replace(c, new_mode="100755" if st.st_mode & 0o111 else REGULAR)
    size = st.st_size
    binary = c.binary
    limit = max(max(v.values()) for v in ALLOWED_FILES.values())
    if size <= limit:
        fd = os.open(target, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        with os.fdopen(fd, "rb") as fh:
            data = fh.read(limit + 1)
        binary = binary or b"\0" in data or not _is_utf8(data)
        from pipeline.result import git_blob_sha

        return replace(c, size=size, binary=binary, blob_sha=git_blob_sha(data), content=data)
    return replace(c, size=size, binary=binary)


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


# ---- changes from the GitHub API ----

def changes_from_pull(gh: "GitHub", pull: Any, author: str) -> list[Change]:
    """The PR's changes as the API reports them. Modes come from the head commit's tree and content from
    the blobs, but only for files that could be valid (in the author's folder, with an allowed name):
    everything else is refused by its path alone, and a hostile PR of thousands of files costs no more."""
    out = []
    for f in gh.pull_files(pull.number):
        status = {"copied": "added", "changed": "modified", "unchanged": "modified"}.get(f.status, f.status)
        change = Change(path=f.path, status=status, previous_path=f.previous_path if status == "renamed" else None,
                        copied_from=f.previous_path if f.status == "copied" else None)
        if status != "removed" and not _segments_problem(f.path):
            kind, info = _classify(f.path)
            if (kind == "submission" and _same_login(info["login"], author)
                    and info["name"] in ALLOWED_FILES[info["track"]]):
                change = _from_tree(gh, pull.head_sha, change, ALLOWED_FILES[info["track"]][info["name"]])
        out.append(change)
    if pull.changed_files is not None and pull.changed_files > len(out):
        # the API lists at most 3,000 files; what it leaves out cannot be checked, so it is refused
        out.append(Change(path="", status="unlisted", size=pull.changed_files))
    return out


def _from_tree(gh: "GitHub", head_sha: str, change: Change, limit: int) -> Change:
    from dataclasses import replace

    entry = gh.tree_entry(head_sha, change.path)
    if entry is None:
        return replace(change, missing=True)
    if entry.mode in ("120000", "160000") or entry.type != "blob":
        return replace(change, new_mode=entry.mode)
    change = replace(change, new_mode=entry.mode, size=entry.size, blob_sha=entry.sha)
    if entry.size is not None and entry.size > limit:
        return change
    data = gh.blob(entry.sha)
    return replace(change, size=len(data), binary=b"\0" in data or not _is_utf8(data), content=data)


# ---- the verdict as the PR comment shows it ----

def verdict_markdown(verdict: Verdict, status: str | None = None) -> str:
    """The sticky comment while a PR waits: the verdict (every violation, file by file) and its status.
    Paths and logins are the PR's own text, so they are escaped."""
    from pipeline.report import MARKER, md_escape

    lines = [MARKER]
    if verdict.ok and verdict.submission:
        s = verdict.submission
        what = f"kernel problem {md_escape(s.problem)}" if s.track == "kernel" else "the serving track"
        lines += ["### Submission check: valid", "",
                  f"{md_escape(printable(s.path), 200)} is a submission to {what} by {md_escape(s.login, 60)}."]
    else:
        n = len(verdict.violations)
        lines += [f"### Submission check: REFUSED ({n} problem{'s' if n != 1 else ''})", "",
                  "| file | rule | what is wrong |", "| --- | --- | --- |"]
        for v in verdict.violations[:MAX_LISTED]:
            lines.append(f"| {md_escape(printable(v.path), 200) if v.path else '(the pull request)'} "
                         f"| {md_escape(v.rule)} | {md_escape(printable(v.message), 400)} |")
        if n > MAX_LISTED:
            lines.append(f"| ... | | and {n - MAX_LISTED} more |")
        lines += ["", "Fix these and push again: this comment is updated on every push."]
    if verdict.notices:
        lines += [""] + [f"Note: {md_escape(n, 400)}" for n in verdict.notices]
    if status:
        lines += ["", status]
    return "\n".join(lines) + "\n"
