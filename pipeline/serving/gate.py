"""A serving patch.diff -> accepted (with what a maintainer should look at) or every reason to refuse it.

Static: nothing of the patch runs. Three readers look at it and must agree:
- `unidiff` (the hunks: which lines are added and removed, where each sits in the patch);
- pipeline/validate.py's reader of git diffs (every name a file's header carries, as git spells and
  quotes it, modes, renames and copies, and headers whose names disagree);
- git itself: `git apply --check --numstat` and `--summary`, run at the root of the pinned tree in git
  layout with repository discovery fenced off. From a subdirectory of a repository, git apply silently
  skips the paths outside it and reports success, so the tree's root is never inside a work tree
  git can see.
A file one reader sees and another does not, or line counts that differ, is a header that lies or a
patch that is malformed: refused.

The rules are sglang_pin/pin.toml's [rules] and [flags] (the spec's list is the minimum). A reason
names the file, the line of patch.diff where the problem is (where that file's diff starts for the
rules about the file itself), and the rule; so does a flag (pipeline/serving/flags.py finds them by
reading the patched Python files' syntax trees, before and after: see its docstring).

Refuse or flag: the rule for the request and stream path. A patch is measured as speed, so whatever
sits between the client and the model's tokens decides what is measured, not how fast it is produced:
a reply cache, filler replies, a rewritten or re-counted stream all live there, and all passed while
the HTTP server was open. A performance patch changes the scheduler, the KV cache and its memory, the
model, its layers and kernels, speculative decoding and parallelism, none of which is on that path. So
a file is refused when it only parses, routes, renders, templates, tokenizes or detokenizes requests
and replies (no speed is there to gain), and flagged when it is on the path but also holds what a
performance patch may need. Refused (pin.toml [[rules.deny]]): entrypoints/http_server.py (routes,
middleware, the streaming responses, the /flush_cache handler), entrypoints/openai/** and the other
front ends (anthropic/**, ollama/**, grpc_server.py, v1_loads.py) with the OpenAI layer's helpers
(harmony_utils.py, context.py, tool.py), utils/{http_middleware_patch,json_response,auth,
request_logger}.py, observability/request_metrics_exporter.py (each is handed every request or reply),
parser/** and function_call/** (chat templates, and the parsers that turn the model's text into the
stream's fields), managers/{tokenizer_manager,detokenizer_manager,template_manager,io_struct,...}.py
(text in and out, and the structures every request is normalized in). Flagged: entrypoints/engine.py
(it wires the tokenizer manager and the detokenizer to the schedulers, and sets the processes'
environment, which a performance patch may tune), environ.py, and in any file a changed statement that
names a knob (`flush_cache`: a Scheduler.flush_cache that returns early is flagged, whatever its added
lines say), a denied module, the HTTP framework, a library the stream runs through, or a name the gate
cannot compute. The scheduler's output path (managers/scheduler_output_processor_mixin.py) stays open:
it hands token ids, not text, to the detokenizer, and batching them is performance work; its knob
(`stream_interval`) is flagged.
"""

from __future__ import annotations

import argparse
import fnmatch
import functools
import json
import os
import re
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.serving.flags import MAX_FLAGS_PER_PATTERN, Flag, denied_modules, patch_flags  # noqa: F401

if TYPE_CHECKING:  # pragma: no cover
    from pipeline.serving.pin import Pin

REGULAR = "100644"
GIT_TIMEOUT_S = 60
MAX_REASONS_PER_RULE = 50  # a 5,000-line patch of non-UTF-8 text is one problem, not 5,000
MAKE_IT = ("make the patch in a clone of SGLang at the pinned tag with `git diff` (see sglang_pin/README.md)")


@dataclass(frozen=True)
class Reason:
    file: str  # the file of the tree the problem is about; "" for the patch as a whole
    line: int  # the line of patch.diff (1-based); 0 for the patch as a whole
    rule: str
    message: str


@dataclass
class GateVerdict:
    """The gate's answer as plain data (`as_dict`), for the PR comment and the result document."""

    accepted: bool
    reasons: list[Reason] = field(default_factory=list)
    flags: list[Flag] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    added: int = 0
    removed: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {"accepted": self.accepted, "reasons": [asdict(r) for r in self.reasons],
                "flags": [asdict(f) for f in self.flags], "files": list(self.files),
                "added": self.added, "removed": self.removed}

    def text(self) -> str:
        from pipeline.escape import printable

        if self.accepted:
            lines = [f"accepted: {len(self.files)} file(s), +{self.added} -{self.removed} lines"]
        else:
            n = len(self.reasons)
            lines = [f"refused: {n} problem{'s' if n != 1 else ''} with this patch"]
            for r in self.reasons:
                where = f"{r.file or '(the patch)'}" + (f" (patch line {r.line})" if r.line else "")
                lines.append(f"  {where}: [{r.rule}] {r.message}")
        for f in self.flags:
            where = f"{f.file} (patch line {f.line}): " if f.file else ""
            lines.append(f"  flag: {where}[{f.pattern}] {f.why}" + (f": {f.text}" if f.text else ""))
        return "\n".join(printable(line) for line in lines)


class GateUnavailable(RuntimeError):
    """The gate could not run (no pinned tree, no git): not the patch's fault."""


# ---- paths ----

def glob_match(pattern: str, path: str) -> bool:
    """`**` is any number of whole segments (none included), `*` and `?` stay within one segment.
    fnmatch runs per segment, with its special characters escaped in the path's own segments never
    mattering (only the pattern's are special)."""
    return _match(tuple(pattern.split("/")), tuple(path.split("/")))


@functools.lru_cache(maxsize=4096)
def _match(pat: tuple[str, ...], parts: tuple[str, ...]) -> bool:
    if not pat:
        return not parts
    if pat[0] == "**":
        return any(_match(pat[1:], parts[i:]) for i in range(len(parts) + 1))
    return bool(parts) and fnmatch.fnmatchcase(parts[0], pat[0]) and _match(pat[1:], parts[1:])


@dataclass(frozen=True)
class _Tree:
    root: Path
    files: frozenset[str]
    dirs: frozenset[str]
    folded: dict[str, str]  # lowercased path -> the path (files and folders)


@functools.lru_cache(maxsize=4)
def _index(root: str) -> _Tree:
    files, dirs = set(), set()
    for here, ds, fs in os.walk(root):
        rel = os.path.relpath(here, root)
        prefix = "" if rel == "." else rel.replace(os.sep, "/") + "/"
        dirs.update(prefix + d for d in ds)
        files.update(prefix + f for f in fs)
    folded = {p.lower(): p for p in sorted(files | dirs)}
    return _Tree(Path(root), frozenset(files), frozenset(dirs), folded)


def _case_variant(name: str, tree: _Tree) -> str | None:
    """The tree's own spelling of `name` or of a folder on its way, where it differs only in case."""
    parts = name.split("/")
    for i in range(1, len(parts) + 1):
        prefix = "/".join(parts[:i])
        if prefix in tree.files or prefix in tree.dirs:
            continue
        real = tree.folded.get(prefix.lower())
        return real if real is not None else None
    return None


def _shadowed(name: str, tree: _Tree) -> str | None:
    """What of the tree a new file would shadow at import: a new `x.py` beside a folder `x/` (a module
    wins over a namespace package, and may set __path__), or a new folder `x/` beside a module `x.py`
    (a package wins over a module)."""
    parts = name.split("/")
    for i in range(1, len(parts)):
        folder = "/".join(parts[:i])
        if folder in tree.dirs:
            continue
        if folder + ".py" in tree.files:
            return folder + ".py"
        break
    if name.endswith(".py") and name[:-3] in tree.dirs:
        return name[:-3] + "/"
    return None


def _path_reasons(name: str, line: int, rules: dict, tree: _Tree | None) -> list[Reason]:
    from pipeline.escape import easy_to_miss

    out = []

    def add(rule: str, message: str) -> None:
        out.append(Reason(name, line, rule, message))

    if not name:
        add("unsafe-path", f"an empty file name; {MAKE_IT}")
        return out
    parts = name.split("/")
    if name.startswith("/") or re.match(r"^[A-Za-z]:", name):
        add("absolute-path", "an absolute path: every file must be inside the tree, named from its root "
            "(python/sglang/...)")
    if ".." in parts:
        add("dotdot-path", "a path that climbs out with `..`: name files from the tree's root (python/sglang/...)")
    if any(p in ("", ".") for p in parts[1 if name.startswith("/") else 0:]):
        add("unsafe-path", "an empty or `.` segment (`./`, `//`): git and this gate would read it as another "
            f"path; {MAKE_IT}")
    if re.search(r"[\x00-\x1f\x7f\\]", name) or re.search(r"[\ud800-\udfff]", name):
        add("unsafe-path", "a backslash, a control character or bytes that are not UTF-8 in the name")
    segment = re.compile(rules["segment"])
    odd = [p for p in parts if p not in ("", ".", "..") and not segment.match(p)]
    if odd and not out:
        add("unusual-name", f"the segment `{odd[0]}`{easy_to_miss(odd[0])} uses characters SGLang's own "
            "file names never do: ASCII letters, digits, `._=,[]-` and single inner spaces only")
    # the rules below judge the path git would write: `.` and empty segments dropped
    plain = "/".join(p for p in parts if p not in ("", "."))
    if ".." in parts or name.startswith("/"):
        return out
    if not any(glob_match(a, plain) for a in rules["allowed"]):
        add("outside-allowed", f"only files under {' and '.join(a.removesuffix('**') for a in rules['allowed'])} "
            "may be patched (spelled exactly so); this file is outside them")
    folded = plain.lower()
    for deny in rules.get("deny", []):
        if glob_match(deny["pattern"].lower(), folded):
            add("denied-path", f"matches {deny['pattern']} ({deny['why']}), which no patch may change"
                + ("" if glob_match(deny["pattern"], plain) else " (in any spelling of its case)"))
            break
    if tree is not None:
        real = _case_variant(plain, tree)
        if real is not None:
            add("case-variant", f"the tree has {real}, which differs from this name only in case: a "
                "case-insensitive file system reads them as one; use the tree's own spelling")
    return out


# ---- the readers ----

def _strip(name: str | None, prefix: str) -> str | None:
    if name is None or name == "/dev/null":
        return name
    return name[len(prefix):] if name.startswith(prefix) else name


@dataclass
class _File:
    """One file of the patch, as the readers agree (or do not) on it."""

    path: str
    line: int  # where its section starts in the patch
    end: int  # the line after its section
    change: Any  # pipeline.validate.Change
    section_is_git: bool
    added: int | None = None  # from unidiff
    removed: int | None = None
    added_lines: list[tuple[int, str]] = field(default_factory=list)  # (patch line, text)
    # (line of the patched file, patch line) for each added line, and for each removed line the line
    # of the patched file where it was; (first, last line of the patched file, patch line) of each hunk
    positions: list[tuple[int, int]] = field(default_factory=list)
    hunks: list[tuple[int, int, int]] = field(default_factory=list)
    binary: bool | None = None


def _unidiff_view(lines: list[str]):
    """unidiff's PatchSet over exactly git's lines (split at \\n only, never at \\r or U+2028)."""
    from unidiff import PatchSet
    from unidiff.errors import UnidiffParseError

    try:
        return PatchSet([line + "\n" for line in lines]), None
    except UnidiffParseError as exc:
        return None, str(exc)
    except (ValueError, IndexError, TypeError) as exc:  # unidiff has raised others on hostile input
        return None, f"{type(exc).__name__}: {exc}"


def _after_hunk(hunk, lines: list[str]) -> int | None:
    """The line (1-based) right after a hunk's counted lines when it looks like a hunk line (` `, `+`,
    `-`): a header that says fewer lines than the hunk holds. git ignores such a line; a reader of the
    patch would not. A format-patch signature (`-- `) is not one."""
    numbers = [ln.diff_line_no for ln in hunk if ln.diff_line_no]
    if not numbers:
        return None
    j = max(numbers)  # the 0-based index of the next line
    while j < len(lines) and lines[j].startswith("\\"):
        j += 1
    if j < len(lines) and lines[j][:1] in ("+", "-", " ") and lines[j] != "-- ":
        return j + 1
    return None


def _git(args: list[str], root: Path, data: bytes) -> subprocess.CompletedProcess:
    """git at `root`, which is never taken for part of an enclosing repository, with no user or system
    configuration (an `apply.whitespace = error` in someone's ~/.gitconfig must not refuse a patch)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update(GIT_CEILING_DIRECTORIES=str(Path(root).resolve().parent), GIT_CONFIG_NOSYSTEM="1",
               GIT_CONFIG_GLOBAL=os.devnull, LC_ALL="C", LANG="C")
    try:
        return subprocess.run(["git", *args], cwd=root, input=data, capture_output=True, env=env,
                              timeout=GIT_TIMEOUT_S)
    except FileNotFoundError:
        raise GateUnavailable("git is not installed; the gate needs it to check that the patch applies") from None
    except subprocess.TimeoutExpired:
        raise GateUnavailable(f"git apply took more than {GIT_TIMEOUT_S} s") from None


def git_apply(root: Path, patch: bytes, *extra: str) -> subprocess.CompletedProcess:
    """`git apply` of `patch` at `root` (a tree in git layout), fenced like the gate's check: the apply
    stage uses this to patch its copy of the tree exactly as the gate checked it."""
    return _git(["apply", "-p1", "--whitespace=nowarn", *extra, "-"], Path(root), patch)


def _numstat(out: bytes) -> dict[str, list[tuple[int | None, int | None]]] | str:
    """git apply --numstat -z: `added TAB removed TAB path NUL` (`-` for binary; a rename's path alone is
    its new name), in the patch's order; a path the patch names twice has two entries. A string when
    the output is not that."""
    stats: dict[str, list[tuple[int | None, int | None]]] = {}
    for record in out.split(b"\0"):
        if not record:
            continue
        fields = record.split(b"\t", 2)
        if len(fields) != 3:
            return f"an entry git apply --numstat wrote that is not `added, removed, path`: {record[:80]!r}"
        a, r, p = fields
        name = p.decode("utf-8", "surrogateescape")
        try:
            stats.setdefault(name, []).append((None if a == b"-" else int(a), None if r == b"-" else int(r)))
        except ValueError:
            return f"an entry git apply --numstat wrote that is not `added, removed, path`: {record[:80]!r}"
    return stats


_SUMMARY = re.compile(r"^ (create|delete) mode (\d+) (.+)$|^ mode change (\d+) => (\d+) (.+)$|^ (rename|copy) (.+)$")


def _summary(out: bytes) -> list[tuple[str, str, str]]:
    """git apply --summary -> (what, mode, path) for creations, deletions, mode changes, renames, copies."""
    found = []
    for raw in out.decode("utf-8", "surrogateescape").splitlines():
        m = _SUMMARY.match(raw)
        if not m:
            continue
        if m[1]:
            found.append((m[1], m[2], m[3]))
        elif m[4]:
            found.append(("mode change", f"{m[4]} => {m[5]}", m[6]))
        else:
            found.append((m[7], "", m[8]))
    return found


def _positions(patched_file) -> tuple[list[tuple[int, int]], list[tuple[int, int, int]]]:
    """Where each changed line of one file's diff lands in the patched file (see _File.positions)."""
    positions, hunks = [], []
    for h in patched_file:
        numbers = [ln.diff_line_no for ln in h if ln.diff_line_no]
        if numbers:
            hunks.append((h.target_start, h.target_start + max(h.target_length - 1, 0), min(numbers) - 1))
        at = h.target_start
        for ln in h:
            if ln.is_added:
                positions.append((ln.target_line_no, ln.diff_line_no))
                at = ln.target_line_no + 1
            elif ln.is_removed:
                positions.append((at, ln.diff_line_no))
            elif ln.target_line_no:
                at = ln.target_line_no + 1
    return positions, hunks


# ---- the gate ----

def gate(patch: bytes, tree: Path, pin: "Pin | None" = None) -> GateVerdict:
    """Every rule of sglang_pin/pin.toml applied to `patch` (the bytes of a patch.diff) against `tree`, the
    pinned tree's root in git layout. Raises GateUnavailable when git cannot run."""
    from pipeline import diff as v
    from pipeline.serving.pin import load_pin

    pin = pin or load_pin()
    rules = pin.rules
    tree = Path(tree)
    reasons: list[Reason] = []
    counts: dict[str, int] = {}

    def refuse(file: str, line: int, rule: str, message: str) -> None:
        counts[rule] = counts.get(rule, 0) + 1
        if counts[rule] <= MAX_REASONS_PER_RULE:
            reasons.append(Reason(file, line, rule, message))

    def verdict(files: list[_File] | None = None, flags: list[Flag] | None = None) -> GateVerdict:
        for rule, n in counts.items():
            if n > MAX_REASONS_PER_RULE:
                reasons.append(Reason("", 0, rule, f"and {n - MAX_REASONS_PER_RULE} more of [{rule}] not listed"))
        files = files or []
        return GateVerdict(accepted=not reasons, reasons=reasons, flags=flags or [], files=[f.path for f in files],
                           added=sum(f.added or 0 for f in files), removed=sum(f.removed or 0 for f in files))

    if len(patch) > rules["max_bytes"]:
        refuse("", 0, "too-large", f"the patch is {len(patch):,} bytes; the limit is {rules['max_bytes']:,} bytes")
        return verdict()
    if not patch.strip():
        refuse("", 0, "empty", f"the patch changes nothing; {MAKE_IT}")
        return verdict()
    text = patch.decode("utf-8", "surrogateescape")
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    crlf = next((n for n, line in enumerate(lines, 1) if line.startswith("diff --git ") and line.endswith("\r")), None)
    if crlf:
        refuse("", crlf, "line-endings", "the patch has Windows line endings (CRLF), which git reads as part of every "
               "name and line; write it with LF endings (git diff does; check core.autocrlf)")
        return verdict()  # every other reason would be this one again

    # reader 1: validate's (names, modes, statuses, headers that disagree)
    try:
        diff_files = v.read_diff(text)
    except v.DiffError as exc:
        refuse("", 0, "malformed", str(exc).replace(v.REGENERATE, MAKE_IT))
        diff_files = []
    files: list[_File] = []
    starts = [d.line for d in diff_files] + [len(lines) + 1]
    for i, d in enumerate(diff_files):
        c = d.change
        files.append(_File(path=c.path, line=d.line, end=starts[i + 1], change=c,
                           section_is_git=lines[d.line - 1].startswith("diff --git ")))

    # bytes that are not UTF-8, by line, attributed to the file whose section holds them
    for n, line in enumerate(lines, 1):
        if re.search(r"[\ud800-\udfff]", line):
            owner = next((f for f in files if f.line <= n < f.end), None)
            refuse(owner.path if owner else "", n, "non-utf8",
                   "bytes that are not UTF-8: patches are UTF-8 text (re-save the file as UTF-8)")
    non_utf8 = {r.file for r in reasons if r.rule == "non-utf8"}

    # reader 2: unidiff (the hunks)
    patchset, error = _unidiff_view(lines)
    if error:
        refuse("", 0, "malformed", f"unidiff cannot read the patch ({error}); {MAKE_IT}")
    elif diff_files:
        ud = list(patchset)
        if len(ud) != len(files):
            refuse("", 0, "header-mismatch", f"the patch reads as {len(files)} file(s) to one reader and {len(ud)} to "
                   f"another: a header that lies or a malformed patch; {MAKE_IT}")
        else:
            for f, p in zip(files, ud):
                names = {_strip(v.unquote(n) if n else n, pre) for n, pre in ((p.source_file, "a/"), (p.target_file, "b/"))}
                names -= {None, "/dev/null"}
                if names and f.path not in names and not (f.change.previous_path in names or f.change.copied_from in names):
                    refuse(f.path, f.line, "header-mismatch", f"unidiff reads this file's diff as {sorted(names)[0]}: a "
                           f"header that lies or a malformed patch; {MAKE_IT}")
                f.added, f.removed, f.binary = p.added, p.removed, p.is_binary_file
                for h in p:
                    n = _after_hunk(h, lines)
                    if n is not None:
                        refuse(f.path, n, "hunk-header", f"this line reads as part of the hunk `@@ -{h.source_start},"
                               f"{h.source_length} +{h.target_start},{h.target_length} @@`, but the header's counts end "
                               "the hunk before it: git ignores it, so the patch shows a change that is never applied "
                               "(a header that lies about its line counts); " + MAKE_IT)
                f.added_lines = [(ln.diff_line_no, ln.value.rstrip("\n")) for h in p for ln in h if ln.is_added]
                f.positions, f.hunks = _positions(p)

    # the rules about each file
    tree_index = _index(str(tree.resolve())) if tree.is_dir() else None
    for f in files:
        c = f.change
        if not f.section_is_git:
            refuse(f.path, f.line, "diff-header", f"not a git diff (no `diff --git` line): {MAKE_IT}")
        elif c.header_problem:
            refuse(f.path, f.line, "diff-header", c.header_problem.replace(v.REGENERATE, MAKE_IT))
        names = [c.path, c.previous_path, c.copied_from, *c.header_names]
        for name in dict.fromkeys(n for n in names if n is not None and n != "/dev/null"):
            for r in _path_reasons(name, f.line, rules, tree_index):
                refuse(r.file, r.line, r.rule, r.message)
        if c.status == "removed":
            refuse(f.path, f.line, "deletion", "deletes a file of the pinned tree; a patch may change or add files, "
                   "never delete them (empty it, or stop importing it)")
        if c.status == "renamed":
            refuse(f.path, f.line, "rename", f"renames {c.previous_path}; a patch may not rename or delete a file "
                   "of the pinned tree: add the new file and leave the old one")
        if c.copied_from is not None:
            refuse(f.path, f.line, "copy", f"a copy of {c.copied_from}; write the new file as an added file "
                   "(`git diff --no-renames`)")
        modes = {c.old_mode, c.new_mode} - {None}
        if "120000" in modes:
            refuse(f.path, f.line, "symlink", "a symbolic link; a patch may hold only regular text files")
        elif "160000" in modes:
            refuse(f.path, f.line, "submodule", "a submodule; a patch may hold only regular text files")
        elif c.old_mode and c.new_mode and c.old_mode != c.new_mode:
            refuse(f.path, f.line, "mode-change", f"changes the file's mode from {c.old_mode} to {c.new_mode}; "
                   f"keep every file {REGULAR}")
        elif c.new_mode and c.new_mode != REGULAR and c.status != "modified":
            # a new file's mode; a modified file's `index` line only repeats the mode it has (two of the tree's
            # files are 100755), which git apply leaves as it is
            refuse(f.path, f.line, "mode-change", f"mode {c.new_mode}; every new file must be a plain {REGULAR} file")
        if c.status == "added" and tree_index is not None:
            shadow = _shadowed(c.path, tree_index)
            if shadow:
                refuse(f.path, f.line, "shadows-module", f"would take the place of {shadow} when Python imports it (a "
                       "module and a package of one name): a patch may add modules, never shadow the tree's own")
        if f.path not in non_utf8 and (c.binary or f.binary):
            refuse(f.path, f.line, "binary", "binary content (or a NUL byte); a patch may change only text files")

    changed = sum((f.added or 0) + (f.removed or 0) for f in files)
    if changed > rules["max_changed_lines"]:
        refuse("", 0, "too-many-lines", f"the patch changes {changed:,} lines; the limit is "
               f"{rules['max_changed_lines']:,} added and removed lines in all")
    if not files and not reasons:
        refuse("", 0, "empty", f"the patch names no file; {MAKE_IT}")

    # reader 3: git, at the root of the pinned tree
    if not (tree / pin.layout["sdist_is"]).is_dir():
        raise GateUnavailable(f"{tree} is not the pinned tree in git layout (no {pin.layout['sdist_is']}/ in it); "
                              "run `python -m pipeline serving fetch`")
    _git_view(patch, tree, files, reasons, refuse)

    flags = patch_flags(pin, patch, tree, files, git_apply, {r.file for r in reasons}) if files else []
    return verdict(files, flags)


def _git_view(patch: bytes, tree: Path, files: list[_File], reasons: list[Reason], refuse) -> None:
    def owner(path: str) -> _File | None:
        return next((f for f in files if path in (f.path, f.change.previous_path)), None)

    check = git_apply(tree, patch, "--check", "--numstat", "-z")
    if check.returncode != 0:
        said = check.stderr.decode("utf-8", "replace").strip().splitlines()
        reported = False
        for raw in said:
            m = re.match(r"^error: (?:patch failed: (.+):(\d+)|(.+?): (.+))$", raw)
            at = re.search(r"at line (\d+)", raw)
            invalid = re.match(r"^error: invalid path '(.*)'$", raw)
            if invalid:
                f = owner(invalid[1])
                refuse(invalid[1], f.line if f else 0, "does-not-apply", f"git apply refuses the name {invalid[1]!r}")
                reported = True
            elif m and m[1]:
                f = owner(m[1])
                refuse(m[1], f.line if f else 0, "does-not-apply",
                       f"the hunk for line {m[2]} of {m[1]} does not match the pinned tree: the patch must be made "
                       f"against SGLang {_pinned_version()} ({raw[len('error: '):]})")
                reported = True
            elif m and m[3] and owner(m[3]) is not None:
                f = owner(m[3])
                if m[4] == "patch does not apply" and any(r.file == m[3] and r.rule == "does-not-apply" for r in reasons):
                    continue  # git's second line about the hunk it already named
                refuse(m[3], f.line, "does-not-apply", f"git apply: {m[4]}")
                reported = True
            elif at:
                n = int(at[1])
                f = next((x for x in files if x.line <= n < x.end), None)
                refuse(f.path if f else "", n, "does-not-apply", f"git apply: {raw.removeprefix('error: ')}")
                reported = True
        if not reported:
            refuse("", 0, "does-not-apply", "git apply --check refused the patch: "
                   + ("; ".join(said[-5:]) if said else f"exit {check.returncode}"))
        return
    stats = _numstat(check.stdout)
    if isinstance(stats, str):
        refuse("", 0, "header-mismatch", stats)
        return
    ours: dict[str, list[tuple[int | None, int | None]]] = {}
    for f in files:
        ours.setdefault(f.path, []).append((None, None) if f.binary else (f.added, f.removed))
    for path in sorted(set(stats) | set(ours)):
        f = owner(path)
        line = f.line if f else 0
        if path not in ours:
            refuse(path, line, "header-mismatch", f"git applies this patch to {path}, which the patch's headers do not "
                   f"name as they should: a header that lies or a malformed patch; {MAKE_IT}")
        elif path not in stats:
            refuse(path, line, "header-mismatch", f"git apply does not touch {path}, which the patch names: a header "
                   f"that lies or a malformed patch; {MAKE_IT}")
        elif len(stats[path]) != len(ours[path]):
            refuse(path, line, "header-mismatch", f"git reads {len(stats[path])} diff(s) of this file, the patch's "
                   f"headers {len(ours[path])}: a header that lies or a malformed patch; {MAKE_IT}")
        else:
            for (ga, gr), (ua, ur) in zip(stats[path], ours[path]):
                if (ua, ur) != (None, None) and (ga, gr) != (ua, ur):
                    refuse(path, line, "header-mismatch", f"git reads +{ga} -{gr} lines for this file, unidiff "
                           f"+{ua} -{ur}: a hunk header that lies about its line counts, or a malformed patch; {MAKE_IT}")
    # git's own reading of modes, creations, deletions, renames and copies: what the readers above missed
    family = {"symlink": "mode", "submodule": "mode", "mode-change": "mode"}
    already = {(r.file, family.get(r.rule, r.rule)) for r in reasons}
    summary = git_apply(tree, patch, "--summary")
    for what, mode, path in _summary(summary.stdout):
        f = owner(path)
        line = f.line if f else 0
        if what == "create" and mode != REGULAR and (path, "mode") not in already:
            refuse(path, line, "mode-change", f"git creates it with mode {mode}; every file must be {REGULAR}")
        elif what == "delete" and (path, "deletion") not in already:
            refuse(path, line, "deletion", "git deletes this file of the pinned tree; a patch may not")
        elif what == "mode change" and (path, "mode") not in already:
            refuse(path, line, "mode-change", f"git changes its mode ({mode}); keep every file {REGULAR}")
        elif what in ("rename", "copy") and not any(r.rule == what for r in reasons):
            refuse(path, line, what, f"git reads a {what} ({path}); a patch may not {what} files of the pinned tree")


@functools.lru_cache(maxsize=1)
def _pinned_version() -> str:
    from pipeline.serving.pin import load_pin

    try:
        return load_pin().version
    except Exception:  # a message, never a crash
        return "at the pinned version"


# ---- reading a patch.diff ----

def read_patch(path: Path, limit: int) -> bytes:
    """The patch file itself (never what a link points to), bounded: UnreadableFile says why not."""
    from pipeline.files import read_regular_file

    data, _ = read_regular_file(Path(path), limit)
    return data


def gate_file(path: Path, tree: Path | None = None, pin: "Pin | None" = None) -> GateVerdict:
    """The gate on a patch.diff on disk; the tree defaults to the pinned one (fetched if need be)."""
    from pipeline.files import UnreadableFile
    from pipeline.serving.pin import PinError, load_pin, tree_path

    pin = pin or load_pin()
    try:
        data = read_patch(path, pin.rules["max_bytes"])
    except UnreadableFile as exc:
        if "bytes" in str(exc):  # "N bytes, more than L" or "more than L bytes"
            size = str(exc).split(" bytes")[0]
            return GateVerdict(accepted=False, reasons=[Reason("", 0, "too-large", f"the patch is {size} bytes; the "
                                                               f"limit is {pin.rules['max_bytes']:,} bytes")])
        return GateVerdict(accepted=False, reasons=[Reason("", 0, "unreadable", f"the patch file is {exc}")])
    if tree is None:
        try:
            tree = tree_path(pin, log=lambda m: print(m, file=sys.stderr))
        except PinError as exc:
            raise GateUnavailable(str(exc)) from None
    return gate(data, tree, pin)


# ---- the command ----

def _gate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("patch", type=Path, help="the patch.diff (a git diff against the pinned SGLang, git layout)")
    p.add_argument("--tree", type=Path, metavar="DIR",
                   help="the pinned tree's root in git layout (default: the cached one; fetched if need be)")
    p.add_argument("--json", type=Path, metavar="OUT", help="write the verdict here")
    p.add_argument("--pin", type=Path, metavar="TOML", help="default: sglang_pin/pin.toml")


def gate_command(args: argparse.Namespace) -> int:
    """Check a serving patch.diff against the pinned SGLang and the patch rules of sglang_pin/pin.toml.

    Every reason to refuse it is printed with its file, the line of the patch and the rule; flags (things
    a maintainer should look at, not refusals) are printed either way. Exit 0 accepted, 1 refused, 2 on a
    usage error (no such patch, no tree, no git).
    """
    from pipeline.serving.pin import PinError, load_pin

    try:
        pin = load_pin(args.pin)
    except PinError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not os.path.lexists(args.patch):
        print(f"error: {args.patch}: no such file; pass the path of a patch.diff", file=sys.stderr)
        return 2
    if args.tree is not None and not (args.tree / pin.layout["sdist_is"]).is_dir():
        print(f"error: {args.tree}: not the pinned tree in git layout (no {pin.layout['sdist_is']}/ in it); pass the "
              "path `python -m pipeline serving fetch` prints", file=sys.stderr)
        return 2
    try:
        result = gate_file(args.patch, args.tree, pin)
    except GateUnavailable as exc:
        print(f"error: the gate cannot run: {exc}", file=sys.stderr)
        return 2
    print(result.text())
    if args.json:
        args.json.write_text(json.dumps(result.as_dict(), indent=2) + "\n")
    return 0 if result.accepted else 1


COMMANDS = {"gate": (_gate_args, gate_command)}
