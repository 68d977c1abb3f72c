"""Every shell command in README.md's fenced code blocks is run by a test.

A command is a `python ...` or `bash ...` invocation on a line of a fenced block (continuation lines joined,
comments dropped, `a && b` and `a; b` split, leading `VAR=value` assignments set aside). Each one is either
in RUN, run here as written (its `python` this interpreter) in a fresh copy of the repository's tracked
files, with a time limit, and must exit 0; or in MAPPED, which names the existing test that runs it (the
test must exist); or in CI, the test command itself, which `.ci/run` runs and ci.yml runs `.ci/run`. A
README command in none of them fails here, and so does an entry that names a command README.md no
longer has: the lists and the README stay one list.
"""

from __future__ import annotations

import ast
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fresh_copy import fresh_copy

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
RUNNERS = {"python", "python3", "bash"}

# Run here, in a copy of the repository (they write leaderboard.md, results/snapshots/): fast, CPU, no network.
RUN = [
    "python -m pipeline serving dataset check datasets/serving/public-sample.json.gz",
    "python -m pipeline ledger verify",
    "python -m pipeline board",
    "python -m pipeline snapshots",
    "python -m pipeline prizes",
]


def _snapshot_hours(copy: Path) -> int:
    return len(list((copy / "results" / "snapshots").glob("*/*.json")))


# What each RUN command must have done, beyond exiting 0: (its output, the copy it ran in) -> None or why not.
EFFECTS = {
    "python -m pipeline serving dataset check datasets/serving/public-sample.json.gz":
        lambda out, copy: None if re.search(r"^ok: datasets/serving/public-sample\.json\.gz \(sha256 [0-9a-f]{64}\)$",
                                            out, re.M) else "no `ok: <file> (sha256 ...)` line",
    "python -m pipeline ledger verify":
        lambda out, copy: None if re.search(r"^ok: \d+ records .* chain head [0-9a-f]{64}$", out, re.M)
        else "no `ok: N records ... chain head` line",
    "python -m pipeline board":
        lambda out, copy: None if out.startswith("board from ") and subprocess.run(
            [sys.executable, "-m", "pipeline", "board", "--check"], cwd=copy, capture_output=True).returncode == 0
        else "leaderboard.md is not what the ledger gives afterwards (`board --check`)",
    "python -m pipeline snapshots":
        lambda out, copy: None if (m := re.search(r"^(\d+) snapshot hours up to", out, re.M)) and
        int(m.group(1)) == _snapshot_hours(copy) > 0 else f"{_snapshot_hours(copy)} snapshot files for: {out[:200]}",
    "python -m pipeline prizes":
        lambda out, copy: None if "Awarded so far: $" in out and "Serving track" in out else "no prize table",
}
# Run by an existing test (too slow to run twice, or it needs a server, GitHub, a model or an input file).
MAPPED = {
    # 150 s: the demo runs once, in test_demo.py's module fixture, which every test there checks
    "python -m pipeline demo --out demo-output": "tests/test_demo.py::test_it_leaves_every_output_and_says_each_step",
    "python -m pipeline serving fetch": "tests/serving/test_pin.py::test_a_second_fetch_is_instant_and_prints_the_same_tree",
    "python -m pipeline serving gate patch.diff": "tests/serving/test_gate.py::test_a_valid_patch_is_accepted",
    "python -m pipeline serving replay --url http://127.0.0.1:30000 --dataset datasets/serving/public-sample.json.gz "
    "--concurrency 4 --window 60 --warmup 10 --engine sglang --seed 1 --json level.json":
        "tests/serving/test_replay.py::test_replay_command_replays_the_public_sample_with_the_pinned_tokenizer",
    # the same command against a real `transformers serve` (the template's CPU variant, SmolLM2-135M)
    "python -m pipeline serving evaluate patch.diff --launch transformers --dataset "
    "datasets/serving/public-sample.json.gz --levels 1,4 --window-s 60 --runs 1 --json result.json":
        "tests/serving/test_serving_evaluate.py::test_evaluate_against_transformers_serve",
    "python -m pipeline publish reconcile": "tests/test_github_flow.py::test_a_serving_pr_from_the_label_to_the_board",
    "python -m pipeline ledger append result.json --pr 12 --login alice --head-sha <sha> --merged-at 2026-10-23T10:00:00Z":
        "tests/test_ledger.py::test_append_records_what_the_board_needs_and_chains_it",
}
# The test command: CI runs it (ci.yml -> bash .ci/run -> this line).
CI = {"python -m pytest -q", "python -m pytest -q -m heavy"}
TIME_LIMIT_S = 60


def commands(text: str) -> list[tuple[str, dict[str, str]]]:
    """(command, its VAR=value assignments) for each python/bash command in `text`'s fenced code blocks, in order.
    The command is its words joined by one space, as a shell would split them."""
    found: list[tuple[str, dict[str, str]]] = []
    fence: str | None = None
    pending = ""
    for raw in text.splitlines():
        stripped = raw.strip()
        opener = re.match(r"(`{3,}|~{3,})", stripped)
        if fence is None:
            if opener:
                fence = opener.group(1)
            continue
        if stripped.startswith(fence) and not stripped[len(fence):].strip():
            fence, pending = None, ""
            continue
        line = pending + raw
        if line.rstrip().endswith("\\"):
            pending = line.rstrip()[:-1] + " "
            continue
        pending = ""
        if not re.search(r"(^|[\s;&|/])(python3?|bash)(\s|$)", line):
            continue  # no command of ours on this line (a fenced block can hold a file tree)
        lexer = shlex.shlex(line, posix=True, punctuation_chars="&;|")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        try:
            tokens = list(lexer)
        except ValueError as exc:  # an unclosed quote: not a command line (or a broken one: say so)
            raise AssertionError(f"README.md: cannot split {line.strip()!r} as a shell line: {exc}") from exc
        part: list[str] = []
        for tok in [*tokens, ";"]:
            if tok in ("&&", ";", "||", "|", "&"):
                env: dict[str, str] = {}
                sudo = bool(part) and part[0] == "sudo"  # `sudo [-n] [VAR=value]... /path/to/python ...`
                if sudo:
                    part.pop(0)
                    while part and part[0].startswith("-"):
                        part.pop(0)
                while part and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", part[0]):
                    key, value = part.pop(0).split("=", 1)
                    env[key] = value
                if part and (part[0] in RUNNERS or sudo and part[0].rsplit("/", 1)[-1] in RUNNERS):
                    found.append((("sudo " if sudo else "") + " ".join(part), env))
                part = []
            else:
                part.append(tok)
    return found


def unaccounted(text: str) -> list[str]:
    """README commands that no list accounts for."""
    return [c for c, _ in commands(text) if c not in RUN and c not in MAPPED and c not in CI]


def _test_exists(node: str) -> str | None:
    """None when `path::name` (or `path::Class::name`) is a test function there; else why not."""
    path, *names = node.split("::")
    file = ROOT / path
    if not file.is_file() or not names:
        return f"{node}: no such test file"
    body = ast.parse(file.read_text(encoding="utf-8")).body
    for i, name in enumerate(names):
        match = [n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.name == name]
        if not match:
            return f"{node}: {path} defines no {name}"
        if i < len(names) - 1:
            body = match[0].body
        elif not (name.startswith("test") and isinstance(match[0], (ast.FunctionDef, ast.AsyncFunctionDef))):
            return f"{node}: {name} is not a test function"
    return None


README_COMMANDS = commands(README.read_text(encoding="utf-8"))


def test_every_command_run_here_has_its_effect_checked():
    assert set(EFFECTS) == set(RUN)


def test_every_readme_command_is_run_by_a_test():
    missing = unaccounted(README.read_text(encoding="utf-8"))
    assert not missing, ("README.md commands that no test runs; add each to RUN (run here) or MAPPED (the test "
                         "that runs it) in tests/test_readme_commands.py:\n  " + "\n  ".join(missing))
    listed = {c for c, _ in README_COMMANDS}
    stale = [c for c in [*RUN, *MAPPED, *CI] if c not in listed]
    assert not stale, "listed in tests/test_readme_commands.py but no longer in README.md:\n  " + "\n  ".join(stale)
    assert len(README_COMMANDS) >= len(RUN) + len(MAPPED) + len(CI)


def test_each_mapped_test_exists():
    problems = [why for why in map(_test_exists, MAPPED.values()) if why]
    assert not problems, "\n".join(problems)


def test_the_test_command_is_what_ci_runs():
    ci_run = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    workflow = (ROOT / ".github" / "workflows" / "ci.yml").read_text(encoding="utf-8")
    assert re.search(r"^\s*run: bash \.ci/run\s*$", workflow, re.M), "ci.yml no longer runs `bash .ci/run`"
    for command in CI:
        as_ci = command.replace("python ", "python3 ", 1)
        assert re.search(rf"^{re.escape(as_ci)}\s*$", ci_run, re.M), f".ci/run no longer runs `{command}`"


def test_a_command_nobody_runs_fails():
    """The check above can fail: a README with one more command, anywhere a fenced block can hold one."""
    text = README.read_text(encoding="utf-8")
    assert unaccounted(text) == []
    fake = text + "\n```bash\nFOO=1 python -m pipeline frobnicate --all \\\n    --now   # nobody runs this\n```\n"
    assert unaccounted(fake) == ["python -m pipeline frobnicate --all --now"]
    chained = text.replace("python -m pipeline board ", "python -m pipeline board && bash scripts/new.sh ", 1)
    assert unaccounted(chained) == ["bash scripts/new.sh"]
    # a command outside a fence is prose, not a README command
    assert unaccounted(text + "\npython -m pipeline frobnicate\n") == []


@pytest.fixture(scope="module")
def copy(tmp_path_factory) -> Path:
    return fresh_copy(tmp_path_factory.mktemp("readme") / "repo")


@pytest.mark.parametrize("command", RUN)
def test_the_readme_command_runs(command, copy):
    """`python -m pipeline ...` from the copy imports the copy's pipeline (the current folder comes first on
    sys.path), so the repository root every verb defaults to is the copy, and nothing here is written."""
    env_of = dict(README_COMMANDS)
    assert command in env_of, f"{command!r} is not in README.md"
    argv = shlex.split(command)
    argv[0] = sys.executable if argv[0].startswith("python") else shutil.which(argv[0]) or argv[0]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIPELINE_")}
    env.update(env_of[command])
    start = time.monotonic()
    done = subprocess.run(argv, cwd=copy, env=env, capture_output=True, text=True, timeout=TIME_LIMIT_S)
    took = time.monotonic() - start
    assert done.returncode == 0, f"`{command}` exited {done.returncode} after {took:.1f} s:\n{(done.stdout + done.stderr)[-4000:]}"
    why = EFFECTS[command](done.stdout, copy)
    assert why is None, f"`{command}`: {why}\n{done.stdout[-2000:]}"
    if argv[1:3] == ["-m", "pipeline"]:
        probe = subprocess.run([sys.executable, "-c", "import pipeline; print(pipeline.__file__)"], cwd=copy,
                               env=env, capture_output=True, text=True, check=True)
        assert Path(probe.stdout.strip()).is_relative_to(copy), f"the copy imported {probe.stdout.strip()}"
