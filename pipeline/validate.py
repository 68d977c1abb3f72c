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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

from pipeline.diff import Change, DiffError, is_utf8, read_diff  # noqa: F401 - DiffError: changes_from_diff raises it
from pipeline.escape import easy_to_miss, printable

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
                          f"deletes a file of @{owner}{easy_to_miss(owner)}: a pull request may delete only its "
                          "author's files"))
        elif c.status == "added":
            track = path.split("/")[1]
            problem = path.split("/")[2] if track == "kernel" else ""
            add(Violation(path, "login-mismatch",
                          f"the folder's login {owner!r}{easy_to_miss(owner)} is not the pull request author's "
                          f"(@{author}); put your files under {_folder_hint(track, problem, author)}"))
        else:
            add(Violation(path, "others-folder",
                          f"changes a file in @{owner}'s folder{easy_to_miss(owner)}: a pull request may change only "
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
        add(Violation(path, "file-name", f"{name!r} is not allowed here{easy_to_miss(name)}; your folder may "
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
        binary = binary or b"\0" in data or not is_utf8(data)
        from pipeline.files import git_blob_sha

        return replace(c, size=size, binary=binary, blob_sha=git_blob_sha(data), content=data)
    return replace(c, size=size, binary=binary)


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
    return replace(change, size=len(data), binary=b"\0" in data or not is_utf8(data), content=data)
