"""A pull request's files -> which submission it is and whose, or every reason to refuse it.

Static only: nothing here executes, imports or evaluates a submission. The rules are the spec's
(github-flow.md, "PR validation rules"); each violation names the file and the rule, and all of them
are listed at once so that a competitor fixes their PR in one round.

The changes come from one of two places, both turned into the same `Change` records:
- a unified diff (`git diff --full-index main...HEAD`, parsed with unidiff), optionally with a
  checkout of the PR's head to measure whole files (`changes_from_diff`);
- the GitHub API (the PR's file list, the head commit's tree for modes, the blobs for content), which
  is what the privileged gate trusts (`changes_from_pull`; every call is in `pipeline.github`).
"""

from __future__ import annotations

import datetime as dt
import os
import re
import stat
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
}
REGULAR = "100644"
MODES = {"100755": "an executable file", "120000": "a symbolic link", "160000": "a submodule", "040000": "a directory"}
# GitHub's rule for logins: alphanumerics and single inner hyphens, at most 39 characters
LOGIN_RE = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9]|-(?=[A-Za-z0-9])){0,38}$")
_SEGMENT_BAD = re.compile(r"[\x00-\x1f\x7f\\]")
MAX_LISTED = 100  # violations shown in the PR comment; the JSON verdict keeps every one


@dataclass(frozen=True)
class Change:
    """One file a pull request touches. `path` is the new path (the old one for a deletion)."""

    path: str
    status: str  # added | modified | removed | renamed (| unlisted: files the API would not list)
    previous_path: str | None = None
    old_mode: str | None = None
    new_mode: str | None = None
    binary: bool = False  # binary, not UTF-8, or holding a NUL byte
    size: int | None = None  # bytes of the new content, when known
    size_at_least: int = 0  # a lower bound when only a diff's hunks are known
    blob_sha: str | None = None  # git's SHA of the new content, when known
    missing: bool = False  # listed by the PR but absent from its head commit's tree


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
    return None


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
          rate_limit: int | None = None) -> Verdict:
    """Apply every rule to a PR's changes; `recent_evaluations` are the author's evaluations in the last
    hour (the gate reads them from the API), checked against `rate_limit` (default: the competition's)."""
    changes = list(changes)
    problems = set(problems)
    verdict = Verdict(author=author, files=[c.path for c in changes])
    add = verdict.violations.append
    me = author.lower()
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
        gone = [c.previous_path] if c.status == "renamed" and c.previous_path else []
        for old in gone:  # a rename moves a file away from where it was: a deletion there
            _check_path(Change(old, "removed"), author, me, problems, targets, add)
        _check_path(c, author, me, problems, targets, add)

    if len(targets) > 1:
        names = ", ".join(f"kernel/{p}" if t == "kernel" else "serving" for t, p in sorted(targets))
        add(Violation("", "one-submission-per-pr",
                      f"a pull request holds one submission; this one touches {names}: open one pull request each"))
    elif len(targets) == 1:
        (track, problem), facts = next(iter(targets.items()))
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


def _check_path(c: Change, author: str, me: str, problems: set[str], targets: dict, add) -> None:
    path = c.path
    why = _segments_problem(path)
    if why:
        add(Violation(path, "unsafe-path", f"{why}: every file must lie inside your submission folder"))
        return
    kind, info = _classify(path)
    owner = _owner_of(path)
    if owner is not None and owner.lower() != me:
        if c.status == "removed":
            add(Violation(path, "deletes-others-file",
                          f"deletes a file of @{owner}: a pull request may delete only its author's files"))
        elif c.status == "added":
            track = path.split("/")[1]
            problem = path.split("/")[2] if track == "kernel" else ""
            add(Violation(path, "login-mismatch",
                          f"the folder's login {owner!r} is not the pull request author's (@{author}); "
                          f"put your files under {_folder_hint(track, problem, author)}"))
        else:
            add(Violation(path, "others-folder",
                          f"changes a file in @{owner}'s folder: a pull request may change only its author's "
                          "folder"))
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
    facts = targets.setdefault((track, problem), {"folder": info["folder"], "login": info["login"]})
    if c.status == "removed":
        if name == SUBMISSION_FILE[track]:
            facts["main"] = c
        return  # deleting one's own README is fine
    allowed = ALLOWED_FILES[track]
    if name not in allowed:
        add(Violation(path, "file-name", f"{name!r} is not allowed here; your folder may hold only "
                      f"{' and '.join(sorted(allowed))}"))
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

_QUOTED_ESCAPES = {"a": "\a", "b": "\b", "t": "\t", "n": "\n", "v": "\v", "f": "\f", "r": "\r", '"': '"', "\\": "\\"}


def _unquote(name: str) -> str:
    """git's C-style quoting of unusual file names ("b/we\\tird\\303\\274.py") -> the name."""
    if not (len(name) >= 2 and name[0] == '"' and name[-1] == '"'):
        return name
    out, raw, i, body = [], bytearray(), 0, name[1:-1]
    while i < len(body):
        ch = body[i]
        if ch == "\\" and i + 1 < len(body):
            nxt = body[i + 1]
            if re.match(r"[0-7]{3}", body[i + 1:i + 4]):
                raw.append(int(body[i + 1:i + 4], 8))
                i += 4
                continue
            if raw:
                out.append(raw.decode("utf-8", "replace"))
                raw = bytearray()
            out.append(_QUOTED_ESCAPES.get(nxt, nxt))
            i += 2
            continue
        if raw:
            out.append(raw.decode("utf-8", "replace"))
            raw = bytearray()
        out.append(ch)
        i += 1
    if raw:
        out.append(raw.decode("utf-8", "replace"))
    return "".join(out)


def _diff_path(name: str | None, prefix: str) -> str | None:
    if name is None:
        return None
    name = _unquote(name.strip())
    if name == "/dev/null":
        return None
    return name[len(prefix):] if name.startswith(prefix) else name


def changes_from_diff(text: str, tree: Path | None = None) -> list[Change]:
    """Parse a unified diff (git's, ideally with --full-index) into changes. With `tree`, a checkout of
    the PR's head, new content is measured from the files themselves (never following a link)."""
    from unidiff import PatchSet
    from unidiff.errors import UnidiffParseError

    try:
        patch = PatchSet(text)
    except (UnidiffParseError, ValueError) as exc:
        raise DiffError(f"cannot read the diff: {exc}") from None
    out = []
    for f in patch:
        info = [line.rstrip("\n") for line in (f.patch_info or [])]
        old_mode = new_mode = index_mode = None
        binary = bool(f.is_binary_file) or any(line.startswith(("Binary files ", "GIT binary patch")) for line in info)
        previous = None
        for line in info:
            if line.startswith("old mode "):
                old_mode = line.split()[-1]
            elif line.startswith("new mode ") or line.startswith("new file mode "):
                new_mode = line.split()[-1]
            elif line.startswith("deleted file mode "):
                old_mode = line.split()[-1]
            elif line.startswith("index ") and len(line.split()) == 3:
                index_mode = line.split()[-1]
        source = _diff_path(f.source_file, "a/")
        target = _diff_path(f.target_file, "b/")
        if f.is_added_file or (source is None and target is not None):
            status, path = "added", target
        elif f.is_removed_file or target is None:
            status, path = "removed", source
        elif source != target:
            status, path, previous = "renamed", target, source
        else:
            status, path = "modified", target
        if status != "removed" and new_mode is None:
            new_mode = index_mode
        added = b""
        lines = [line for hunk in f for line in hunk]
        for i, line in enumerate(lines):
            if line.is_added:
                value = line.value
                if i + 1 < len(lines) and lines[i + 1].line_type == "\\" and value.endswith("\n"):
                    value = value[:-1]  # "\ No newline at end of file"
                added += value.encode("utf-8", "surrogateescape")
        if b"\0" in added:
            binary = True
        try:
            added.decode("utf-8")
        except UnicodeDecodeError:
            binary = True
        size = len(added) if status == "added" else None
        change = Change(path=path or "", status=status, previous_path=previous, old_mode=old_mode, new_mode=new_mode,
                        binary=binary, size=size, size_at_least=len(added))
        if tree is not None and status != "removed" and path and not _segments_problem(path):
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
    size = st.st_size
    binary = c.binary
    limit = max(max(v.values()) for v in ALLOWED_FILES.values())
    if size <= limit:
        fd = os.open(target, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        with os.fdopen(fd, "rb") as fh:
            data = fh.read(limit + 1)
        binary = binary or b"\0" in data or not _is_utf8(data)
        from pipeline.result import git_blob_sha

        return replace(c, size=size, binary=binary, blob_sha=git_blob_sha(data))
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
    me = author.lower()
    out = []
    for f in gh.pull_files(pull.number):
        status = {"copied": "added", "changed": "modified", "unchanged": "modified"}.get(f.status, f.status)
        change = Change(path=f.path, status=status, previous_path=f.previous_path if status == "renamed" else None)
        if status != "removed" and not _segments_problem(f.path):
            kind, info = _classify(f.path)
            if (kind == "submission" and info["login"].lower() == me
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
    return replace(change, size=len(data), binary=b"\0" in data or not _is_utf8(data))


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
                  f"{md_escape(s.path, 200)} is a submission to {what} by {md_escape(s.login, 60)}."]
    else:
        n = len(verdict.violations)
        lines += [f"### Submission check: REFUSED ({n} problem{'s' if n != 1 else ''})", "",
                  "| file | rule | what is wrong |", "| --- | --- | --- |"]
        for v in verdict.violations[:MAX_LISTED]:
            lines.append(f"| {md_escape(v.path, 200) if v.path else '(the pull request)'} | {md_escape(v.rule)} "
                         f"| {md_escape(v.message, 400)} |")
        if n > MAX_LISTED:
            lines.append(f"| ... | | and {n - MAX_LISTED} more |")
        lines += ["", "Fix these and push again: this comment is updated on every push."]
    if verdict.notices:
        lines += [""] + [f"Note: {md_escape(n, 400)}" for n in verdict.notices]
    if status:
        lines += ["", status]
    return "\n".join(lines) + "\n"
