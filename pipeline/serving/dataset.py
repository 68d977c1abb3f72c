"""The agentic dataset: multi-turn coding conversations to replay, generated from real code, and their check.

`python -m pipeline serving dataset generate --conversations N --seed S --out F [--corpus public|hidden]`
writes a set; `python -m pipeline serving dataset check F` validates one (structure, sha256, shape) and
prints its summary. The hidden set (about 200 conversations, on the runner only) and the public sample in
datasets/serving/ come from this generator with different corpora and seeds.

The file (JSON, or gzip of that JSON when F ends in .gz), close to SGLang's agentic-trace idea:

    {"format": "muse-agentic-trace", "version": 1,
     "metadata": {generator, generator_version, seed, corpus, sources (name, version, sha256), shape,
                  window, tools (the versions of git/grep/sed/ls/python that made the text),
                  content_sha256, summary},
     "system": the shared system-and-tools prefix (the first message of every conversation),
     "conversations": [{"id", "canary", "turns": [{"messages": [...], "max_tokens", "canary", "reply"}]}]}

A turn's `messages` are the new non-assistant messages: the first turn one user message (the task and
the repository context), later turns the outputs of the tools the assistant called ({"role": "tool",
"tool_call_id", "name": "bash", "content"}) and now and then a user's follow-up. `max_tokens` is the
length of the assistant's reply (the replay forces it). `reply` is a fixed assistant reply of about
`max_tokens` tokens (it names the commands whose output the next turn shows): canary conversations are
replayed with it as history instead of the live reply, so that their prompts are the same for every
server; every conversation carries one so that canaries look like the rest.

content_sha256 is the sha256 of the UTF-8 bytes of `json.dumps({"system": ..., "conversations": ...},
sort_keys=True, ensure_ascii=False, separators=(",", ":"))`: the content, not the metadata or the
file's layout, so gzip or indentation do not change it and any edit of a message does.

The text is real: the corpus is pinned sdists (name, version, sha256 below) fetched with `pip download
--no-deps --no-binary :all:` and cached; tool outputs come from really running grep -n, sed -n, cat,
ls, git diff of synthetic edits, python -m py_compile of broken edits and small scripts that raise, in a
git copy of the extracted tree. Sizes are drawn from the shape (lognormal tool outputs and replies) and
each output is cut at a line to its drawn size. Everything follows from (seed, corpus, shape, window):
the same inputs and the same tools give the same file byte for byte.
"""

from __future__ import annotations

import ast
import hashlib
import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import textwrap
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# the file's format, reading and check (pipeline/serving/trace.py), named here for the generator and its command
from pipeline.serving.trace import (  # noqa: F401
    FORMAT, FORMAT_VERSION, GENERATOR_VERSION, MESSAGE_OVERHEAD_TOKENS, FORBIDDEN_MARKERS, Source, CORPORA, Shape,
    SHAPES, DEFAULT_WINDOW, DatasetError, _count, content_sha256, canary_count, _tokenizer_sha256, read, write,
    summarize, check_structure, check, _kind)

# The corpus' own documents in the shared prefix, after the instructions and the tools, in this order
# (the projects' READMEs, their contribution guidelines, their latest changes), cut to the shape's size.
PREFIX_FILES: dict[str, tuple[tuple[str, str], ...]] = {
    "public": (("click", "README.rst"), ("packaging", "README.rst"), ("requests", "README.md"),
               ("packaging", "docs/development/getting-started.rst"),
               ("packaging", "docs/development/submitting-patches.rst"),
               ("packaging", "docs/development/reviewing-patches.rst"),
               ("click", "CHANGES.rst"), ("requests", "HISTORY.md"), ("packaging", "CHANGELOG.rst")),
    "hidden": (("flask", "README.md"), ("jinja2", "README.md"), ("werkzeug", "README.md"),
               ("flask", "CONTRIBUTING.rst"), ("flask", "docs/design.rst"),
               ("flask", "CHANGES.rst"), ("werkzeug", "CHANGES.rst"), ("jinja2", "docs/faq.rst")),
}


# --------------------------------------------------------------------------------------------------
# The corpus: pinned sdists, downloaded through pip, verified, extracted once into a cache.

def corpus_cache() -> Path:
    """$PIPELINE_CORPUS_CACHE, else ~/.cache/muse-pipeline/corpus."""
    env = os.environ.get("PIPELINE_CORPUS_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "muse-pipeline" / "corpus"


def file_sha256(path: Path) -> str:
    """The sha256 of a file's bytes, read a MiB at a time."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch_corpus(corpus: str, cache: Path | None = None) -> dict[str, Path]:
    """The extracted tree of each source of `corpus` (name -> its top folder), downloading what is missing."""
    if corpus not in CORPORA:
        raise DatasetError(f"unknown corpus {corpus!r}: choose one of {', '.join(CORPORA)}")
    cache = Path(cache) if cache else corpus_cache()
    sources = CORPORA[corpus]
    missing = [s for s in sources if not (cache / s.sha256 / "tree").is_dir()]
    if missing:
        _download(missing, cache)
    return {s.name: _tree_top(cache / s.sha256 / "tree", s) for s in sources}


def _tree_top(tree: Path, source: Source) -> Path:
    tops = [p for p in tree.iterdir() if p.is_dir()]
    if len(tops) != 1:
        raise DatasetError(f"{tree} should hold one folder (the sdist's top); delete {tree.parent} to fetch it again")
    return tops[0]


def _download(sources: list[Source], cache: Path) -> None:
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix=".download-") as tmp:
        tmp = Path(tmp)
        # --require-hashes: pip refuses an archive with another sha256 before building anything from it.
        requirements = tmp / "requirements.txt"
        requirements.write_text("".join(f"{s.requirement} --hash=sha256:{s.sha256}\n" for s in sources))
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--require-hashes",
                   "--disable-pip-version-check", "-q", "-d", str(tmp / "dl"), "-r", str(requirements)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
            raise DatasetError(f"pip could not download the corpus ({', '.join(s.requirement for s in sources)}):\n{tail}")
        for s in sources:
            archive = tmp / "dl" / s.archive
            if not archive.is_file():
                found = sorted(p.name for p in (tmp / "dl").iterdir())
                raise DatasetError(f"pip downloaded {found}, not {s.archive}")
            if file_sha256(archive) != s.sha256:
                raise DatasetError(f"{s.archive} has sha256 {file_sha256(archive)}, not the pinned {s.sha256}")
            staging = tmp / f"tree-{s.name}"
            staging.mkdir()
            with tarfile.open(archive) as tar:
                members = [m for m in tar.getmembers() if m.isfile() or m.isdir()]
                tar.extractall(staging, members=members, filter="data")
            target = cache / s.sha256
            target.mkdir(exist_ok=True)
            shutil.copy2(archive, target / s.archive)
            # Renamed into place last, so a tree in the cache is always whole.
            try:
                os.replace(staging, target / "tree")
            except OSError:
                if not (target / "tree").is_dir():  # else another process put the same tree there first
                    raise


# --------------------------------------------------------------------------------------------------
# A source tree: its text files, their lines and token counts, its functions; a git copy to edit.

TEXT_SUFFIXES = (".py", ".rst", ".md", ".txt", ".toml", ".cfg", ".ini", ".yaml", ".yml")


def line_counts(text: str) -> tuple[list[str], list[int]]:
    """The lines of `text` and the tokens of each, counted in one encoding of the whole text (a token
    belongs to the line it starts in), so that the counts add up to the text's count; counting lines one
    by one would not (a newline and the next line's indentation are often one token)."""
    import bisect

    from pipeline.serving import tokenizer

    lines = text.splitlines(keepends=True)
    if not lines:
        return [], []
    starts, at = [], 0
    for line in lines:
        starts.append(at)
        at += len(line)
    counts = [0] * len(lines)
    for begin, _end in tokenizer.load().encode(text, add_special_tokens=False).offsets:
        counts[bisect.bisect_right(starts, begin) - 1] += 1
    return lines, counts


@dataclass
class Function:
    path: str
    name: str
    start: int  # first line of the def (after decorators), 1-based
    end: int
    nargs: int
    source: str


class Tree:
    """One extracted sdist, read once: which files are text, their lines, tokens per line, functions."""

    def __init__(self, source: Source, top: Path):
        self.source = source
        self.top = top
        self.name = top.name
        self.files: list[str] = []
        self.text: dict[str, str] = {}
        for path in sorted(p for p in top.rglob("*") if p.is_file()):
            rel = path.relative_to(top).as_posix()
            if any(part.startswith(".") for part in rel.split("/")) or not rel.endswith(TEXT_SUFFIXES):
                continue
            if path.stat().st_size > 400_000:
                continue
            try:
                text = path.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                continue
            # A marker in the corpus would forge the chat template; such a file is left out.
            if "\x00" in text or any(m in text for m in FORBIDDEN_MARKERS):
                continue
            self.files.append(rel)
            self.text[rel] = text
        self.py_files = [f for f in self.files if f.endswith(".py")]
        self.package_dirs = sorted({f.rsplit("/", 1)[0] for f in self.py_files if "/" in f and
                                    not f.startswith(("tests/", "docs/", "examples/"))})
        self._line_tokens: dict[str, list[int]] = {}
        self.functions: list[Function] = []
        for rel in self.py_files:
            self.functions.extend(_functions(rel, self.text[rel]))
        self.identifiers = sorted({f.name for f in self.functions if len(f.name) > 3})

    def lines(self, rel: str) -> list[str]:
        return self.text[rel].splitlines(keepends=True)

    def line_tokens(self, rel: str) -> list[int]:
        if rel not in self._line_tokens:
            self._line_tokens[rel] = line_counts(self.text[rel])[1]
        return self._line_tokens[rel]

    def tokens(self, rel: str) -> int:
        return sum(self.line_tokens(rel))


_trees: dict[tuple[Source, Path], Tree] = {}


def _tree(source: Source, top: Path) -> Tree:
    # Read once per process: a tree in the cache never changes (it is named by its archive's sha256).
    if (source, top) not in _trees:
        _trees[(source, top)] = Tree(source, top)
    return _trees[(source, top)]


def _functions(rel: str, text: str) -> list[Function]:
    try:
        module = ast.parse(text)
    except SyntaxError:
        return []
    lines = text.splitlines(keepends=True)
    found = []
    for node in ast.walk(module):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno:
            source = textwrap.dedent("".join(lines[node.lineno - 1:node.end_lineno]))
            nargs = len(node.args.posonlyargs) + len(node.args.args)
            found.append(Function(rel, node.name, node.lineno, node.end_lineno, nargs, source))
    found.sort(key=lambda f: (f.path, f.start))
    return found


def _tool_env(home: Path) -> dict[str, str]:
    # The tools' output must not depend on who runs them: C locale, UTC, no user or system git config.
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C", "LANG": "C", "TZ": "UTC",
            "HOME": str(home), "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull,
            "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1", "COLUMNS": "100", "TERM": "dumb"}


class Workspace:
    """A git copy of a tree where the generator's commands really run (edits are undone after each)."""

    def __init__(self, tree: Tree, root: Path):
        self.tree = tree
        self.dir = root / tree.name
        self.home = root / ".home"
        self.home.mkdir(exist_ok=True)
        self.env = _tool_env(self.home)
        # the script of the last traceback made here, for the reply that shows it before it runs
        self.last_repro: str | None = None
        for rel in tree.files:
            target = self.dir / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(tree.text[rel], encoding="utf-8")
            target.chmod(0o644)  # not the umask's: git diff and ls -l print the mode
            # the archive's own times, so that ls -l prints the same on every machine
            st = (tree.top / rel).stat()
            os.utime(target, (st.st_mtime, st.st_mtime))
        dates = {"GIT_AUTHOR_DATE": "2024-01-01T00:00:00Z", "GIT_COMMITTER_DATE": "2024-01-01T00:00:00Z"}
        for command in (["git", "init", "-q", "-b", "main"], ["git", "add", "-A"],
                        ["git", "-c", "user.name=generator", "-c", "user.email=generator@invalid", "commit", "-q",
                         "-m", f"{tree.source.requirement} from its sdist"]):
            subprocess.run(command, cwd=self.dir, env={**self.env, **dates}, check=True, capture_output=True)

    def run(self, argv: list[str], timeout: float = 20) -> str:
        done = subprocess.run(argv, cwd=self.dir, env=self.env, capture_output=True, timeout=timeout)
        out = (done.stdout + done.stderr).decode("utf-8", errors="replace")
        # Python prints the script's absolute path, which holds this run's temporary folder: written
        # relative to the repository, as every other path of the outputs is, so the text is the same each run.
        return out.replace(f"{self.dir}/", "")

    @contextmanager
    def edited(self, rel: str, text: str):
        """`rel` holds `text` inside the block and its committed content again after it."""
        path = self.dir / rel
        mtime = path.stat().st_mtime
        path.write_text(text, encoding="utf-8")
        try:
            yield
        finally:
            path.write_text(self.tree.text[rel], encoding="utf-8")
            os.utime(path, (mtime, mtime))  # ls -l shows it


# --------------------------------------------------------------------------------------------------
# Fitting real text to a drawn size.

def _trim_lines(lines: list[str], tokens: list[int], budget: int) -> tuple[list[str], int]:
    """The longest head of `lines` within `budget` tokens, and how many lines were left out."""
    used = 0
    for i, n in enumerate(tokens):
        if used + n > budget:
            return lines[:i], len(lines) - i
        used += n
    return lines, 0


def _fit_output(command: str, output: str, budget: int, counted=None) -> str:
    """`$ command` and its output, cut at a line so that the whole is at most `budget` tokens
    (`counted`: line_counts of that text when the caller has them)."""
    whole = f"$ {command}\n{output}"
    lines, counts = counted or line_counts(whole)
    if sum(counts) <= budget:
        return whole
    note_room = 16  # "[output truncated: N more lines]"
    kept, left = _trim_lines(lines, counts, max(counts[0], budget - note_room))
    while True:
        text = "".join(kept)
        if not text.endswith("\n"):
            text += "\n"
        text += f"[output truncated: {left} more lines]\n"
        # the counts are those of the whole output; a cut can change the last token or two
        if _count(text) <= budget or len(kept) <= 1:
            return text if _count(text) <= budget else _trim_to_tokens(text, budget)
        kept = kept[:-1]
        left += 1


def _trim_to_tokens(text: str, budget: int, offsets: list[tuple[int, int]] | None = None) -> str:
    """The head of `text` that is at most `budget` tokens, cut where a token starts (`offsets`: the
    text's token offsets when the caller has them, so a text cut several times is encoded once)."""
    from pipeline.serving import tokenizer

    if offsets is None:
        offsets = tokenizer.load().encode(text, add_special_tokens=False).offsets
    if len(offsets) <= budget:
        return text
    n = budget
    while n > 0:
        cut = text[:offsets[n][0]]
        # a cut can change the last token or two; step back until the head fits
        if _count(cut) <= budget:
            return cut
        n -= 1
    return ""


# --------------------------------------------------------------------------------------------------
# The tools. Each takes the workspace, a random generator and a token budget and returns (command,
# output) with the output really produced, or None when it cannot produce something near the budget.

def _pick_file(tree: Tree, rng: random.Random, budget: int, code_only: bool = False) -> str:
    pool = tree.py_files if code_only else tree.files
    big = [f for f in pool if tree.tokens(f) >= budget]
    if big:
        return rng.choice(big)
    return max(pool, key=lambda f: (tree.tokens(f), f))


def tool_sed(ws: Workspace, rng: random.Random, budget: int):
    tree = ws.tree
    rel = _pick_file(tree, rng, budget, code_only=rng.random() < 0.8)
    counts = tree.line_tokens(rel)
    total = sum(counts)
    budget = max(1, budget - 24)  # room for the command line above the output
    if total <= budget:
        return f"cat {rel}", ws.run(["cat", rel])
    # a window of lines holding about `budget` tokens, starting anywhere it fits
    prefix = [0]
    for n in counts:
        prefix.append(prefix[-1] + n)
    latest = next(i for i in range(len(counts), 0, -1) if prefix[len(counts)] - prefix[i - 1] >= budget)
    start = rng.randint(1, latest)
    end = start
    while end < len(counts) and prefix[end + 1] - prefix[start - 1] <= budget:
        end += 1
    return f"sed -n '{start},{end}p' {rel}", ws.run(["sed", "-n", f"{start},{end}p", rel])


def tool_cat_many(ws: Workspace, rng: random.Random, budget: int):
    # Outputs larger than any one file: several files in one command, as an agent reading a package does.
    tree = ws.tree
    pool = sorted(tree.py_files, key=lambda f: (-tree.tokens(f), f))
    chosen, total = [], 0
    for rel in rng.sample(pool, len(pool)):
        chosen.append(rel)
        total += tree.tokens(rel)
        if total >= budget:
            break
    return "cat " + " ".join(chosen), ws.run(["cat", *chosen])


def tool_grep(ws: Workspace, rng: random.Random, budget: int):
    tree = ws.tree
    if not tree.identifiers:
        return None
    if budget > 1500 and rng.random() < 0.5:
        pattern = rng.choice(["self\\.", "def ", "return ", "import ", "raise ", "if not "])
    else:
        pattern = rng.choice(tree.identifiers)
    where = rng.choice(tree.package_dirs or ["."])
    files = [f for f in tree.py_files if f.startswith(where + "/") or where == "."]
    if rng.random() < 0.3:
        files = tree.py_files
        where = "."
    if not files:
        return None
    # Explicit sorted paths, not -r: a recursive grep lists files in the order of the directory on disk.
    output = ws.run(["grep", "-n", "-H", "-e", pattern, "--", *files])
    return f"grep -rn --include='*.py' '{pattern}' {where}", output


def tool_ls(ws: Workspace, rng: random.Random, budget: int):
    tree = ws.tree
    where = rng.choice(tree.package_dirs or ["."])
    if rng.random() < 0.5:
        # files named one by one: a folder's "total" and its own size depend on the file system
        files = [f for f in tree.files if f.rsplit("/", 1)[0] == where]
        if files:
            return f"ls -l {where}/*", ws.run(["ls", "-l", "--time-style=long-iso", "-gG", "--", *files])
    return f"ls -R {where}", ws.run(["ls", "-R", "--", where])


def _synthetic_edit(rng: random.Random, lines: list[str], fn: Function) -> list[str]:
    """One plausible change inside `fn`: a guard, a renamed local, a log line, a changed literal or a comment."""
    body = list(range(fn.start, min(fn.end, len(lines))))  # 0-based indexes of the lines after the def line
    if not body:
        return lines
    at = rng.choice(body)
    line = lines[at]
    indent = re.match(r"[ \t]*", line).group(0) if line.strip() else "    " + re.match(r"[ \t]*", lines[fn.start - 1]).group(0)
    kind = rng.randrange(5)
    new = list(lines)
    if kind == 0:
        new[at:at] = [f"{indent}if {fn.name}_disabled():\n", f"{indent}    return None\n"]
    elif kind == 1:
        names = re.findall(r"\b([a-z_][a-z0-9_]{2,})\s*=(?!=)", "".join(lines[fn.start - 1:fn.end]))
        if names:
            old = rng.choice(names)
            new[fn.start - 1:fn.end] = [re.sub(rf"\b{re.escape(old)}\b", f"{old}_value", ln) for ln in lines[fn.start - 1:fn.end]]
        else:
            new[at:at] = [f"{indent}# TODO: {fn.name} should validate its arguments first\n"]
    elif kind == 2:
        new[at:at] = [f"{indent}logger.debug(\"{fn.name}: %r\", locals())\n"]
    elif kind == 3:
        changed = re.sub(r"\b(\d+)\b", lambda m: str(int(m.group(1)) + 1), line, count=1)
        changed = changed if changed != line else line.replace("True", "False", 1)
        new[at] = changed if changed != line else line.rstrip("\n") + "  # checked\n"
    else:
        new[at:at] = [f"{indent}# {fn.name}: keep this in step with the caller's expectations\n"]
    return new


def tool_git_diff(ws: Workspace, rng: random.Random, budget: int):
    tree = ws.tree
    candidates = [f for f in tree.functions if f.end - f.start >= 3 and "/" in f.path]
    if not candidates:
        return None
    rel = rng.choice(sorted({f.path for f in candidates}))
    lines = tree.lines(rel)
    functions = [f for f in candidates if f.path == rel]
    # enough edits for a diff larger than the budget (it is cut to it), as an agent's diff of a session is
    edits = max(1, min(len(functions), budget // 80))
    for fn in sorted(rng.sample(functions, edits), key=lambda f: -f.start):
        lines = _synthetic_edit(rng, lines, fn)
    with ws.edited(rel, "".join(lines)):
        output = ws.run(["git", "-c", "core.abbrev=12", "diff", "--no-color", "--", rel])
    return "git diff", output


def tool_py_compile(ws: Workspace, rng: random.Random, budget: int):
    tree = ws.tree
    rel = rng.choice(tree.py_files)
    lines = tree.lines(rel)
    code = [i for i, ln in enumerate(lines) if ln.strip() and not ln.lstrip().startswith("#")]
    if not code:
        return None
    at = rng.choice(code)
    broken = list(lines)
    # a stray character or a half-deleted line: the kinds of slip an edit tool makes
    broken[at] = rng.choice([broken[at].rstrip("\n") + " )\n", broken[at].rstrip("\n") + ":\n", "  " + broken[at]])
    with ws.edited(rel, "".join(broken)):
        output = ws.run([sys.executable, "-I", "-S", "-m", "py_compile", rel])
    if not output.strip():
        return None
    return f"python -m py_compile {rel}", output


def tool_compile_clean(ws: Workspace, rng: random.Random, budget: int):
    # A check that passes prints nothing: the shortest real output there is.
    rel = rng.choice(ws.tree.py_files)
    return f"python -m py_compile {rel}", ws.run([sys.executable, "-I", "-S", "-m", "py_compile", rel])


REPRO = "repro.py"


def _repro_source(fn: Function) -> str:
    lines = fn.source.splitlines(keepends=True)
    while lines and lines[0].lstrip().startswith("@"):
        lines = lines[1:]
    args = ", ".join(["None"] * fn.nargs)
    return f"# {fn.path}:{fn.start}\n" + "".join(lines) + f"\n\n{fn.name}({args})\n"


def tool_traceback(ws: Workspace, rng: random.Random, budget: int):
    tree = ws.tree
    candidates = [f for f in tree.functions if 1 <= f.nargs <= 4 and f.end - f.start <= 60]
    for _attempt in range(6):
        if not candidates:
            return None
        fn = rng.choice(candidates)
        script = ws.dir / REPRO
        script.write_text(_repro_source(fn))
        try:
            output = ws.run([sys.executable, "-I", "-S", REPRO], timeout=10)
        except subprocess.TimeoutExpired:
            output = ""
        finally:
            script.unlink()
        # an address printed in a message differs between runs; such an output is not used
        if "Traceback" in output and not re.search(r"0x[0-9a-f]{6,}", output):
            ws.last_repro = _repro_source(fn)
            return f"python {REPRO}", output
    return None


# (name, function, whether its output can be cut to any size, the budget range it suits)
TOOLS = (
    # below ~50 tokens a cut output would hold the command and hardly a line
    ("sed", tool_sed, True, (50, 10**9)),
    ("grep", tool_grep, True, (50, 10**9)),
    ("git diff", tool_git_diff, True, (150, 10**9)),  # its header alone is ~60 tokens
    ("ls", tool_ls, False, (30, 1200)),
    ("py_compile", tool_py_compile, False, (40, 400)),
    ("traceback", tool_traceback, False, (60, 800)),
)
TOOL_WEIGHTS = {"sed": 4, "grep": 4, "git diff": 3, "ls": 1, "py_compile": 1, "traceback": 2}


def tool_output(ws: Workspace, rng: random.Random, budget: int) -> tuple[str, str]:
    """A real tool output of at most `budget` tokens and close to it: (the command, the message text)."""
    names = [name for name, _, _, (lo, hi) in TOOLS if lo <= budget <= hi]
    order = []
    pool = list(names)
    while pool:  # a weighted shuffle: the order in which the tools are tried
        pick = rng.choices(pool, weights=[TOOL_WEIGHTS[n] for n in pool])[0]
        order.append(pick)
        pool.remove(pick)
    by_name = {name: (fn, elastic) for name, fn, elastic, _ in TOOLS}
    for name in order:
        fn, elastic = by_name[name]
        made = fn(ws, rng, budget)
        if made is None:
            continue
        command, output = made
        counted = line_counts(f"$ {command}\n{output}")
        tokens = sum(counted[1])
        # A cut output must still fill most of its budget; a natural one may be a little short.
        if tokens >= (0.85 if elastic else 0.6) * budget:
            return command, _fit_output(command, output, budget, counted)
    if budget < 50 and _count(f"$ {(made := tool_compile_clean(ws, rng, budget))[0]}\n") <= budget:
        command, output = made
    elif budget <= max(ws.tree.tokens(f) for f in ws.tree.files):
        command, output = tool_sed(ws, rng, budget)
    else:
        command, output = tool_cat_many(ws, rng, budget)
    return command, _fit_output(command, output, budget)


# --------------------------------------------------------------------------------------------------
# The words around the tool outputs: the shared prefix, tasks, follow-ups, the fixed replies.

SYSTEM_INSTRUCTIONS = """\
You are a coding agent working in a checked-out Python repository on behalf of a developer. You read
code, run commands and change files until the task you were given is done, and then you say what you
changed and why.

How you work:
- Start by understanding the task and the code it touches. Read the files you need; do not guess at
  the contents of a file you have not read. Prefer narrow reads (a range of lines, a grep for a name)
  over printing whole files.
- Reproduce a reported bug before fixing it. A failing test or a small script that shows the failure is
  worth more than an argument about the cause.
- Make the smallest change that fixes the cause, not the symptom. Keep the public API unchanged unless
  the task asks for it. Follow the style of the surrounding code: naming, docstrings, error messages.
- Every behaviour you change or add gets a test, next to the existing tests of the same module.
- Run the tests that cover your change, then the whole suite if it is fast enough. Never claim a test
  passes without having run it.
- When a command fails, read its whole output before trying something else. Do not retry the same
  command unchanged.
- Do not install packages, change dependency pins or touch CI configuration unless asked.
- Do not reformat code you are not changing; a reviewer must be able to read your diff.
- If the task is ambiguous, state the assumption you make and go on; ask only when no reasonable
  assumption exists.

How you talk:
- Be brief. Say what you are about to do in one sentence, then do it with a tool call.
- When you are done, summarise the change in a few lines: the cause, the fix, the tests.
- Quote code with its path and line numbers.

You call tools by writing one or more calls in the format the tools' schema below describes. Each call
runs in the repository's root, in a shell without a terminal, with a time limit of 120 seconds; its
standard output and standard error come back to you, cut to a length limit with a note when longer.
"""

TOOL_SCHEMAS = [
    {"name": "bash", "description": "Run a shell command in the repository's root and return its output (stdout "
     "and stderr together, cut at a length limit). Use it for git, grep, sed, ls, python and the test runner. "
     "Commands run without a terminal and without network access; interactive programs will hang and be killed.",
     "parameters": {"type": "object", "properties": {
         "command": {"type": "string", "description": "the command line, run with bash -lc"},
         "timeout": {"type": "integer", "description": "seconds before the command is killed (default 120, at most 600)"}},
         "required": ["command"]}},
    {"name": "read_file", "description": "Read a text file of the repository, optionally a range of lines. Lines "
     "come back numbered. Prefer a range when you know where to look; a whole large file wastes your context.",
     "parameters": {"type": "object", "properties": {
         "path": {"type": "string", "description": "path relative to the repository's root"},
         "start": {"type": "integer", "description": "first line, 1-based (default 1)"},
         "end": {"type": "integer", "description": "last line, inclusive (default: the end of the file)"}},
         "required": ["path"]}},
    {"name": "edit_file", "description": "Replace one exact occurrence of a string in a file by another. The old "
     "string must occur exactly once; include enough surrounding lines to make it unique. Whitespace matters.",
     "parameters": {"type": "object", "properties": {
         "path": {"type": "string"}, "old": {"type": "string", "description": "the exact text to replace"},
         "new": {"type": "string", "description": "the text to put in its place"}},
         "required": ["path", "old", "new"]}},
    {"name": "write_file", "description": "Create a file or replace all of its contents. Use edit_file for changes "
     "to an existing file; write_file is for new files such as a new test module.",
     "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                    "required": ["path", "content"]}},
    {"name": "search", "description": "Search the repository for a regular expression (ripgrep syntax) and return "
     "matching lines with their paths and line numbers, at most 200 matches.",
     "parameters": {"type": "object", "properties": {
         "pattern": {"type": "string"}, "path": {"type": "string", "description": "a folder or file to search (default: the root)"},
         "glob": {"type": "string", "description": "only files whose path matches, e.g. *.py"}},
         "required": ["pattern"]}},
    {"name": "list_dir", "description": "List a folder of the repository: names, kinds and sizes, folders first.",
     "parameters": {"type": "object", "properties": {"path": {"type": "string"},
                    "depth": {"type": "integer", "description": "how many levels to descend (default 1)"}},
                    "required": ["path"]}},
    {"name": "run_tests", "description": "Run the repository's test suite or a part of it with pytest and return "
     "the summary and the failures. Pass node ids or -k expressions to narrow it.",
     "parameters": {"type": "object", "properties": {
         "args": {"type": "array", "items": {"type": "string"}, "description": "arguments for pytest, e.g. tests/test_x.py -x"}},
         "required": []}},
    {"name": "finish", "description": "Say that the task is done, with a summary of the change for the developer.",
     "parameters": {"type": "object", "properties": {"summary": {"type": "string"}}, "required": ["summary"]}},
]

TASKS = [
    "`{name}` in `{path}` fails when it is given `None` for one of its arguments (see the traceback below); "
    "it should either handle it or raise a clear error. Find the cause, fix it and add a test.",
    "Calling `{name}` (`{path}`, line {line}) with an empty value behaves differently from the documentation. "
    "Make it match the documented behaviour and cover the edge case with a test.",
    "Refactor `{name}` in `{path}` so that its error messages say which argument was wrong and why. Keep its "
    "signature and return values unchanged; update or add tests for the new messages.",
    "There is a regression in `{path}` since the last release: `{name}` no longer accepts the values it used "
    "to. Find what changed, restore the old behaviour and add a regression test.",
    "Add type annotations to `{name}` and the helpers it calls in `{path}`, fixing any real bugs the "
    "annotations reveal. Do not change behaviour otherwise.",
    "Users report that `{name}` is slow on large inputs. Profile it, find the hot spot in `{path}` and make it "
    "faster without changing its results; include a test that pins the results.",
    "Write tests for `{name}` in `{path}`: it has none. Cover the normal cases, the error cases and the "
    "boundaries, and fix whatever bugs the tests find.",
]

FOLLOWUPS = [
    "That is not quite it: the failure also happens when `{name}` is called from `{path}`. Look there too.",
    "Keep the public API unchanged; `{name}` is imported by other projects.",
    "Please run the whole test suite before you finish, not only the new test.",
    "The change to `{path}` looks right. Can you also update the changelog entry?",
    "Before going further, explain in two sentences why `{name}` behaves like this.",
    "Stop changing `{path}` for now and show me the diff so far.",
    "Also check whether `{name}` has the same problem on Windows paths.",
]

# What the assistant says before its next call, by the kind of that call.
LEADS = {
    "sed": ["Let me read that part of `{path}` before changing anything.",
            "The relevant code should be in `{path}`; I'll read the lines around it."],
    "cat": ["I need the whole picture here, so I'll read these files in full."],
    "grep": ["I'll search for where this name is defined and used.",
             "Next, the callers: a search over the package shows them."],
    "git diff": ["That should be the change. Let me look at the diff before running anything.",
                 "I've made the edits; here is the diff to check them."],
    "ls": ["Let me see how the package is laid out first."],
    "traceback": ["I'll reproduce the failure with a small script that calls the function directly."],
    "py_compile": ["Before going on, I'll make sure the edited file still compiles."],
    "": ["That is what I found so far. I'll wait for your answer before going on.",
         "Here is where things stand; tell me which way you prefer."],
}


def _fill(template: str, rng: random.Random, tree: Tree, fn: Function | None = None) -> str:
    fn = fn or rng.choice(tree.functions)
    return template.format(name=fn.name, path=fn.path, line=fn.start)


def shared_prefix(corpus: str, trees: list[Tree], shape: Shape) -> str:
    """The system-and-tools prefix of every conversation of a set: instructions, tool schemas, then the
    corpus' READMEs, contribution guidelines and changelogs, cut at a line to the shape's size."""
    text = SYSTEM_INSTRUCTIONS + "\n# Tools\n\n" + json.dumps(TOOL_SCHEMAS, indent=2, ensure_ascii=False) + "\n"
    text += ("\n# The projects in this workspace\n\nTheir own documentation: what they are, how their "
             "maintainers want contributions made, and their latest changes.\n")
    by_name = {t.source.name: t for t in trees}
    for name, rel in PREFIX_FILES[corpus]:
        tree = by_name[name]
        if rel not in tree.text:
            raise DatasetError(f"{tree.name} has no text file {rel} for the shared prefix (PREFIX_FILES)")
        text += f"\n## {tree.name}/{rel}\n\n{tree.text[rel]}"
    lines, counts = line_counts(text)
    kept, _ = _trim_lines(lines, counts, shape.prefix_tokens)
    return _trim_to_tokens("".join(kept), shape.prefix_tokens)


# A first turn ends within this many tokens below its drawn size (the draw stays this far above the minimum).
FIRST_TURN_SLACK = 80


def first_turn(tree: Tree, rng: random.Random, budget: int, fn: Function) -> str:
    """The task and the repository context: the task, a listing of the package, then whole relevant files
    (the task's own first) until about `budget` tokens."""
    task = _fill(rng.choice(TASKS), rng, tree, fn)
    package = fn.path.rsplit("/", 1)[0]
    listing = "\n".join(f for f in tree.files if f.startswith(package + "/") or "/" not in f)
    text = f"{task}\n\nRepository: {tree.name} (git checkout, Python).\n\nFiles:\n{listing}\n\n"
    others = [f for f in tree.py_files if f != fn.path]
    rng.shuffle(others)
    files = iter([fn.path, *others])
    used = _count(text)
    while budget - used > FIRST_TURN_SLACK:
        rel = next(files, None)
        if rel is None:
            break
        block = f"{rel}:\n```\n"
        room = budget - used - _count(block) - 12
        if room < 20:
            break
        kept, left = _trim_lines(tree.lines(rel), tree.line_tokens(rel), room)
        if not kept:
            continue
        body = "".join(kept)
        if not body.endswith("\n"):
            body += "\n"
        text += block + body + ("```\n\n" if not left else f"[... {left} more lines]\n```\n\n")
        # counted again whole: the sum of a file's counts and the fences is only near the joined text's
        used = _count(text)
    return _trim_to_tokens(text, budget)


def followup(ws: Workspace, rng: random.Random, budget: int) -> str:
    """A user's message between tool outputs: a remark, and when there is room what the user ran themselves."""
    text = _fill(rng.choice(FOLLOWUPS), rng, ws.tree)
    room = budget - _count(text) - 12
    if room >= 60 and rng.random() < 0.5:
        _command, output = tool_output(ws, rng, room)
        text += f"\n\nThis is what I get here:\n```\n{output.rstrip()}\n```"
    return _trim_to_tokens(text, budget)


def fixed_reply(tree: Tree, rng: random.Random, budget: int, next_commands: list[str], next_repro: str | None) -> str:
    """An assistant's reply of about `budget` tokens: a sentence on what it does next, code it discusses,
    and the calls whose outputs the next turn shows."""
    from pipeline.serving import tokenizer

    kind = _kind(f"$ {next_commands[0]}") if next_commands else ""
    paths = [w for c in next_commands for w in c.split() if w in tree.text]
    fn = rng.choice(tree.functions)
    lead = rng.choice(LEADS.get(kind, LEADS["sed"])).format(path=paths[0] if paths else fn.path) + "\n\n"
    calls = ""
    if next_repro:
        calls += f"```python\n# {REPRO}\n{next_repro}```\n\n"
    calls += "".join(f"```bash\n{c}\n```\n" for c in next_commands)
    room = budget - _count(lead) - _count(calls)
    pieces: list[str] = []
    estimate = 0
    # Code the reply discusses, more than enough, then cut to the room left between the lead and the calls.
    while estimate < room + 16 and len(pieces) < 400:
        f = rng.choice(tree.functions)
        pieces.append(f"`{f.path}` lines {f.start}-{f.end}:\n```python\n" + "".join(tree.lines(f.path)[f.start - 1:f.end])
                      + "```\n\n")
        estimate += sum(tree.line_tokens(f.path)[f.start - 1:f.end]) + 8
    code = "".join(pieces)
    code_offsets = tokenizer.load().encode(code, add_special_tokens=False).offsets
    reply = _trim_to_tokens(lead + calls, budget)
    target = room - 8  # room for closing a code block the cut falls inside
    for _attempt in range(4):  # the joins change a token or two: aim again at what is left
        if target <= 0:
            break
        middle = _trim_to_tokens(code, target, code_offsets)
        if middle.count("```") % 2:
            middle = middle.rstrip("\n") + "\n```\n\n"
        candidate = lead + middle + calls
        n = _count(candidate)
        if n <= budget:
            reply = candidate
        if n == budget or n > budget and target <= 1:
            break
        target += budget - n
    return reply


# --------------------------------------------------------------------------------------------------
# Generation.

def _lognormal(rng: random.Random, median: int, p95: int, lo: int, hi: int, shape: Shape) -> int:
    return int(min(hi, max(lo, round(rng.lognormvariate(math.log(median), shape.sigma(median, p95))))))


@dataclass
class Plan:
    turns: int
    first: int
    # per later turn: a list of ("tool", budget) / ("user", budget) messages
    messages: list[list[tuple[str, int]]] = field(default_factory=list)
    max_tokens: list[int] = field(default_factory=list)

    def peak(self, prefix: int) -> int:
        context = prefix + MESSAGE_OVERHEAD_TOKENS + self.first + MESSAGE_OVERHEAD_TOKENS
        peak = context + self.max_tokens[0]
        for k, messages in enumerate(self.messages, 1):
            context += self.max_tokens[k - 1] + MESSAGE_OVERHEAD_TOKENS
            context += sum(n + MESSAGE_OVERHEAD_TOKENS for _, n in messages)
            peak = max(peak, context + self.max_tokens[k])
        return peak


def _plan(rng: random.Random, shape: Shape, prefix: int, window: int) -> Plan:
    for _attempt in range(1000):
        plan = Plan(turns=rng.randint(*shape.turns),
                    first=rng.randint(shape.first_turn[0] + FIRST_TURN_SLACK, shape.first_turn[1]))
        for _ in range(plan.turns - 1):
            r = rng.random()
            tool = lambda: ("tool", _lognormal(rng, shape.tool_median, shape.tool_p95, 16, shape.tool_max, shape))  # noqa: E731
            if r < 0.05:
                plan.messages.append([("user", rng.randint(*shape.followup_tokens))])
            elif r < 0.15:
                plan.messages.append([tool(), tool()])
            elif r < 0.20:
                plan.messages.append([tool(), ("user", rng.randint(*shape.followup_tokens))])
            else:
                plan.messages.append([tool()])
        plan.max_tokens = [_lognormal(rng, shape.reply_median, shape.reply_p95, *shape.reply_bounds, shape)
                           for _ in range(plan.turns)]
        # Drawn again when the conversation would not fit the model's window with every reply at max_tokens.
        if plan.peak(prefix) <= window:
            return plan
    raise DatasetError(f"no conversation of the {shape} shape fits a window of {window} tokens; raise --window")


def _conversation(index: int, seed: int, corpus: str, trees: list[Tree], workspaces: dict[str, Workspace],
                  shape: Shape, prefix_tokens: int, window: int, canary: bool) -> dict[str, Any]:
    rng = random.Random(f"{GENERATOR_VERSION}/{corpus}/{seed}/{index}")
    tree = rng.choice(trees)
    ws = workspaces[tree.name]
    plan = _plan(rng, shape, prefix_tokens, window)
    fn = rng.choice([f for f in tree.functions if "/" in f.path and not f.path.startswith("tests/")] or tree.functions)
    turns_messages: list[list[dict[str, str]]] = [[{"role": "user", "content": first_turn(tree, rng, plan.first, fn)}]]
    commands: list[list[str]] = [[]]
    repros: list[str | None] = [None]
    for k, messages in enumerate(plan.messages, 1):
        made, cmds, repro = [], [], None
        for j, (role, budget) in enumerate(messages):
            if role == "tool":
                command, content = tool_output(ws, rng, budget)
                if command == f"python {REPRO}":
                    repro = ws.last_repro
                made.append({"role": "tool", "tool_call_id": f"call_{index:04d}_{k:02d}_{j}", "name": "bash",
                             "content": content})
                cmds.append(command)
            else:
                made.append({"role": "user", "content": followup(ws, rng, budget)})
        turns_messages.append(made)
        commands.append(cmds)
        repros.append(repro)
    turns = []
    for k, messages in enumerate(turns_messages):
        following = commands[k + 1] if k + 1 < len(commands) else []
        repro = repros[k + 1] if k + 1 < len(repros) else None
        turns.append({"messages": messages, "max_tokens": plan.max_tokens[k], "canary": canary,
                      "reply": fixed_reply(tree, rng, plan.max_tokens[k], following, repro)})
    # The id names the corpus and the place, never the seed: the hidden set's seed is the runner's secret.
    return {"id": f"{corpus}-{index:04d}", "canary": canary, "turns": turns}


def _tool_versions() -> dict[str, str]:
    versions = {"python": sys.version.split()[0]}
    for name, argv in (("git", ["git", "--version"]), ("grep", ["grep", "--version"]), ("sed", ["sed", "--version"]),
                       ("ls", ["ls", "--version"])):
        try:
            versions[name] = subprocess.run(argv, capture_output=True, text=True).stdout.splitlines()[0].strip()
        except (OSError, IndexError):
            versions[name] = "unknown"
    return versions


def generate(conversations: int, seed: int, corpus: str = "public", shape_name: str = "agentic",
             window: int = DEFAULT_WINDOW, cache: Path | None = None) -> dict[str, Any]:
    """A dataset document: `conversations` conversations from `corpus`, drawn with `seed`."""
    if shape_name not in SHAPES:
        raise DatasetError(f"unknown shape {shape_name!r}: choose one of {', '.join(SHAPES)}")
    if conversations < 1:
        raise DatasetError("--conversations must be at least 1")
    shape = SHAPES[shape_name]
    tops = fetch_corpus(corpus, cache)
    trees = [_tree(s, tops[s.name]) for s in CORPORA[corpus]]
    system = shared_prefix(corpus, trees, shape)
    prefix_tokens = _count(system)
    rng = random.Random(f"{GENERATOR_VERSION}/{corpus}/{seed}/canaries")
    canaries = set(rng.sample(range(conversations), canary_count(conversations, shape)))
    with tempfile.TemporaryDirectory(prefix="muse-dataset-") as tmp:
        workspaces = {t.name: Workspace(t, Path(tmp)) for t in trees}
        items = [_conversation(i, seed, corpus, trees, workspaces, shape, prefix_tokens, window, i in canaries)
                 for i in range(conversations)]
    document: dict[str, Any] = {"format": FORMAT, "version": FORMAT_VERSION, "metadata": {}, "system": system,
                                "conversations": items}
    document["metadata"] = {
        "generator": "pipeline.serving.dataset",
        "generator_version": GENERATOR_VERSION,
        "seed": seed,
        "corpus": corpus,
        "sources": [{"name": s.name, "version": s.version, "sha256": s.sha256, "license": s.license}
                    for s in CORPORA[corpus]],
        "shape": shape_name,
        "window": window,
        "tokenizer_sha256": _tokenizer_sha256(),
        "tools": _tool_versions(),
        "content_sha256": content_sha256(document),
        "content_sha256_of": "sha256 of the UTF-8 bytes of json.dumps({\"system\": ..., \"conversations\": ...}, "
                             "sort_keys=True, ensure_ascii=False, separators=(\",\", \":\"))",
        "summary": summarize(document, window),
    }
    return document


# --------------------------------------------------------------------------------------------------
# The command.

def _register(p) -> None:
    sub = p.add_subparsers(dest="dataset_command", metavar="{generate,check}")
    g = sub.add_parser("generate", help="generate a set of conversations from the pinned corpus",
                       description="Generate a set: the same arguments give the same file, byte for byte.")
    g.add_argument("--conversations", type=int, required=True, help="how many conversations")
    g.add_argument("--seed", type=int, required=True, help="the seed (the hidden set's is a secret of the runner)")
    g.add_argument("--out", type=Path, required=True, help="the file to write (gzip when it ends in .gz)")
    g.add_argument("--corpus", choices=sorted(CORPORA), default="public",
                   help="which pinned sdists the text comes from (default: public; the hidden set uses hidden)")
    g.add_argument("--shape", choices=sorted(SHAPES), default="agentic",
                   help="the sizes (default: agentic, the serving track's; smoke: small, for 8k-window test models)")
    g.add_argument("--window", type=int, default=DEFAULT_WINDOW,
                   help=f"the model's context window in tokens (default {DEFAULT_WINDOW}); every conversation fits "
                        "it with every reply at max_tokens")
    c = sub.add_parser("check", help="validate a set (structure, sha256, shape) and print its summary",
                       description="Exit 0 when the set is valid, 1 with every problem found otherwise.")
    c.add_argument("file", type=Path, help="the dataset file (JSON or .json.gz)")
    c.add_argument("--json", action="store_true", help="print the summary as JSON")
    c.add_argument("--window", type=int, default=None,
                   help="check the peak context against this window (the served model's) instead of the file's")


def dataset(args) -> int:
    """Generate the agentic conversations (generate) or validate a set of them (check).

    generate: exit 0 with the file written; 1 when the corpus cannot be fetched. check: exit 0 valid,
    1 with every problem (which conversation, which turn, what is wrong). Exit 2 without a sub-command.
    """
    import time

    if args.dataset_command == "generate":
        started = time.monotonic()
        try:
            document = generate(args.conversations, args.seed, args.corpus, args.shape, args.window)
        except DatasetError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        write(document, args.out)
        s = document["metadata"]["summary"]
        print(f"wrote {args.out}: {s['conversations']} conversations, {s['turns_total']} turns, "
              f"{s['total_input_tokens']} input tokens, sha256 {document['metadata']['content_sha256']} "
              f"in {time.monotonic() - started:.1f} s")
        return 0
    if args.dataset_command == "check":
        try:
            document = read(args.file)
        except DatasetError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        errors, notes, summary = check(document, args.window)
        for note in notes:
            print(f"note: {note}")
        if summary is not None:
            print(json.dumps(summary, indent=1) if args.json else _summary_text(summary))
        if errors:
            shown = errors[:50]
            for e in shown:
                print(f"error: {args.file}: {e}", file=sys.stderr)
            if len(errors) > len(shown):
                print(f"error: ... and {len(errors) - len(shown)} more", file=sys.stderr)
            return 1
        print(f"ok: {args.file} (sha256 {document['metadata']['content_sha256']})")
        return 0
    print("error: pass a sub-command: dataset generate ... or dataset check FILE", file=sys.stderr)
    return 2


def _summary_text(s: dict[str, Any]) -> str:
    def row(label: str, q: dict[str, Any]) -> str:
        keys = [k for k in ("n", "min", "p10", "p50", "p90", "p95", "max", "mean") if k in q]
        return f"  {label:<24}" + "  ".join(f"{k} {q[k]}" for k in keys)

    return "\n".join([
        f"{s['conversations']} conversations, {s['turns_total']} turns, {s['canaries']} canaries "
        f"({s['canary_rate']:.1%}), prefix {s['prefix_tokens']} tokens, window {s['window']}",
        row("turns/conversation", s["turns_per_conversation"]),
        row("first turn tokens", s["first_turn_tokens"]),
        row("tool output tokens", s["tool_output_tokens"]),
        row("reply max_tokens", s["reply_max_tokens"]),
        row("peak context tokens", s["peak_context_tokens"]),
        "  tool kinds              " + ", ".join(f"{k} {v}" for k, v in s["tool_kinds"].items()),
    ])


COMMANDS = {"dataset": (_register, dataset)}
