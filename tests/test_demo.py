"""`python -m pipeline demo --out DIR`, run once for real (a temporary git repository, every step a verb as a
subprocess, CPU evaluations, the scripted serving server): its outputs say what the scenario says.

The scenario (pipeline/demo/flow.py): on the kernel board alice (one matmul) > carol (3 matmuls) > bob (9),
erin's late kernel not ranked; on the serving board alice (1.5 ms a token) > bob (the baseline's 4 ms) >
carol (12 ms); dave's wrong kernel incorrect, erin's crashing one a runtime_error with its KeyError, dave's PR
into carol's folder, frank's competition.toml edit and frank's sampler patch refused.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from fresh_copy import fresh_copy

ROOT = Path(__file__).resolve().parents[1]
README_DEMO = "python -m pipeline demo --out demo-output"  # the README's first command, as typed
HEAVY = pytest.mark.heavy  # the demo runs about 2.5 minutes on 2 cores


def demo(out: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline", "demo", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def scoped_tmp(folder: Path) -> dict[str, str]:
    """The environment of a demo whose temporary files go to `folder` (so a test sees whatever it left)."""
    folder.mkdir(parents=True, exist_ok=True)
    return {**os.environ, "TMPDIR": str(folder)}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The README's command exactly as typed (its relative --out included), in a fresh copy of the repository."""
    from test_readme_commands import README_COMMANDS

    assert README_DEMO in dict(README_COMMANDS), "the README's demo command changed; change README_DEMO too"
    copy = fresh_copy(tmp_path_factory.mktemp("demo") / "repo")
    tmp = tmp_path_factory.mktemp("demo-tmp")
    argv = shlex.split(README_DEMO)
    done = subprocess.run([sys.executable, *argv[1:]], cwd=copy, capture_output=True, text=True, timeout=600,
                          env=scoped_tmp(tmp))
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    assert list(tmp.iterdir()) == [], "the demo left temporary files behind"
    return copy / "demo-output", done


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in found:
                found.add(c)
                todo.append(c)
    return found


def _alive(pids: set[int]) -> set[int]:
    return {p for p in pids if Path(f"/proc/{p}").exists() and "Z" not in _state(p)}


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


def _start(tmp_path: Path) -> tuple[subprocess.Popen, Path, Path]:
    out, tmp = tmp_path / "out", tmp_path / "tmp"
    proc = subprocess.Popen([sys.executable, "-m", "pipeline", "demo", "--out", str(out)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=scoped_tmp(tmp))
    return proc, out, tmp


def _wait_for(proc: subprocess.Popen, out: Path, text: str, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        steps = out / "steps.txt"
        if steps.is_file() and text in steps.read_text():
            return
        time.sleep(0.1)
    proc.kill()
    raise AssertionError(f"the demo never reached {text!r}: {proc.communicate()[1][-3000:]}")


@HEAVY
def test_ctrl_c_ends_every_process_and_removes_the_temporary_repository(tmp_path):
    """SIGINT to the demo alone (a terminal's Ctrl-C reaches the whole group; this is the harder case: the
    children do not hear it) while evaluations run beside the validations: one line, exit 130, none of its
    processes alive afterwards, its temporary folder gone."""
    proc, out, tmp = _start(tmp_path)
    _wait_for(proc, out, "validate #3")
    family = _descendants(proc.pid)
    assert family, "the demo runs its steps as processes"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("interrupted after "), err[-3000:]
    assert _alive(family) == set(), "processes of the demo outlived it"
    assert list(tmp.iterdir()) == [], "the demo's temporary repository is left behind"


@HEAVY
def test_a_step_that_fails_meanwhile_stops_everything_and_leaves_nothing(tmp_path):
    """A step fails (here the comments' folder is replaced by a file once the first PR is validated, so the
    next comment cannot be written) while evaluations run on the worker threads: one message, exit 1, the
    workers joined before the temporary repository is removed, no process left."""
    proc, out, tmp = _start(tmp_path)
    _wait_for(proc, out, "validate #1")
    family = _descendants(proc.pid)
    shutil.rmtree(out / "comments")
    (out / "comments").write_text("not a folder any more\n")
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 1, err[-3000:]
    assert "Traceback" not in err and "the demo stopped: " in err and "comments" in err, err[-3000:]
    assert _alive(family) == set()
    assert list(tmp.iterdir()) == [], "the demo's temporary repository is left behind"


def _board_rows(text: str, heading: str) -> list[tuple[str, str]]:
    """(rank, login) of a board's ranked rows in leaderboard.md, under the heading that starts with `heading`."""
    section = text.split(heading, 1)[1].split("\n### ", 1)[0].split("\n## ", 1)[0]
    ranked = section.split("Not ranked:", 1)[0]
    return re.findall(r"^\| (\d+) \| \[@([\w-]+)\]", ranked, re.M)


@HEAVY
def test_the_boards_rank_by_speed_and_leave_the_late_one_unranked(run):
    out, _ = run
    board = (out / "leaderboard.md").read_text()
    assert _board_rows(board, "### `muse_bf16_proj`") == [("1", "alice"), ("2", "carol"), ("3", "bob")]
    kernel = board.split("### `muse_bf16_proj`", 1)[1].split("\n## ", 1)[0]
    late = kernel.split("Not ranked:", 1)[1]
    assert re.search(r"\[@erin\].*\[#8\].*accepted after the track closed", late)
    serving = board.split("## Serving track", 1)[1]
    assert re.findall(r"^\| (\d+) \| \[@([\w-]+)\]", serving.split("## Daily", 1)[0].split("Not ranked:", 1)[0],
                      re.M)[:3] == [("1", "alice"), ("2", "bob"), ("3", "carol")]
    for png in ("leaderboard/muse_bf16_proj.png", "leaderboard/serving.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"]({png})" in board


@HEAVY
def test_the_prize_table_names_the_winners(run):
    out, _ = run
    prizes = (out / "prizes.md").read_text()
    kernel = prizes.split("### kernel/muse_bf16_proj", 1)[1].split("###", 1)[0]
    assert re.findall(r"^\| (\w+) \| @(\w+) \|.*\| (\$[\d,]+[^|]*) \|$", kernel, re.M) == [
        ("1st", "alice", "$50,000 + a signed H200"), ("2nd", "carol", "$30,000"), ("3rd", "bob", "$10,000")]
    serving = prizes.split("### serving", 1)[1].split("##", 1)[0]
    assert [m[:2] for m in re.findall(r"^\| (\w+) \| @(\w+) \|", serving, re.M)] == [
        ("1st", "alice"), ("2nd", "bob"), ("3rd", "carol")]
    summary = json.loads((out / "summary.json").read_text())
    daily = [(w["track"], w["window"], w["winner"], w["usd"]) for w in summary["daily"] if w["board"].endswith(
        ("muse_bf16_proj", "serving"))]
    assert daily == [("kernel", 1, "carol", 1000), ("kernel", 2, "alice", 1000), ("kernel", 3, "alice", 1000),
                     ("serving", 1, "carol", 1000), ("serving", 2, "alice", 1000)]
    assert "python -m pipeline prizes" in prizes and "@carol (#1)" in prizes


@HEAVY
def test_the_refused_and_failed_pull_requests_say_why(run):
    out, _ = run
    c = {n: (out / "comments" / f"pr-{n:02d}.md").read_text() for n in range(1, 13)}
    # the wrong kernel: incorrect, with the failing shape's errors
    assert "### muse_bf16_proj: INCORRECT" in c[2] and "FAIL" in c[2] and "rel-L2" in c[2]
    # the crashing one: its error and its line
    assert "RUNTIME ERROR" in c[3].upper() and "KeyError" in c[3] and "weight" in c[3]
    # another competitor's folder, the protected calendar, the patch gate
    assert "REFUSED" in c[5] and "login-mismatch" in c[5] and "carol/README.md" in c[5]
    assert "REFUSED" in c[7] and "protected-path" in c[7] and "competition.toml" in c[7]
    assert "REFUSED" in c[10] and "patch-denied-path" in c[10] and "sampler.py" in c[10]
    # the late one: evaluated and commented on, told that it is not ranked
    assert "closed at 2026-10-25" in c[8] and "not ranked" in c[8] and "PASSED" in c[8]
    for n in (5, 7, 10):
        assert "after the evaluation" not in c[n]  # refused: never evaluated
    for n in (1, 4, 6, 9, 11, 12):
        assert "PASSED" in c[n] and "UNOFFICIAL" in c[n].upper()
    summary = {p["pr"]: p for p in json.loads((out / "summary.json").read_text())["prs"]}
    assert {n: p["status"] for n, p in summary.items()} == {
        1: "passed", 2: "incorrect", 3: "runtime_error", 4: "passed", 5: None, 6: "passed", 7: None, 8: "passed",
        9: "passed", 10: None, 11: "passed", 12: "passed"}
    assert all(p["outcome"] == "as scripted" for p in summary.values())


@HEAVY
def test_it_leaves_every_output_and_says_each_step(run):
    out, done = run
    for n in (9, 11, 12):
        assert (out / "comments" / f"pr-{n:02d}-plot.png").read_bytes()[:4] == b"\x89PNG"
    hours = sorted(p.relative_to(out / "snapshots").as_posix() for p in (out / "snapshots").rglob("*.json"))
    # every hour of both tracks: from the kernel track's first hour to the serving track's close
    assert hours[0] == "2026-10-22/01.json" and hours[-1] == "2026-10-27/00.json" and len(hours) == 5 * 24
    last = json.loads((out / "snapshots" / "2026-10-27" / "00.json").read_text())
    assert last["results"] == 7
    log = (out / "git-log.txt").read_text()
    for n in (1, 4, 6, 8, 9, 11, 12):
        assert f"Merge pull request #{n} from" in log
    assert "Merge pull request #2 " not in log and "ledger: record #6" in log
    lines = [line for line in done.stderr.splitlines() if re.match(r"\[\s*\d+/\d+\]", line)]
    assert len(lines) == int(lines[-1].split("/")[1].split("]")[0])  # one line a step, numbered to the total
    for verb in ("validate", "evaluate", "sign", "merge", "snapshots", "prizes", "final prizes", "ledger verify"):
        assert any(verb in line for line in lines), verb


def test_a_bad_out_is_a_usage_error(tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder\n")
    done = demo(a_file, timeout=60)
    assert done.returncode == 2 and "is a file, not a folder" in done.stderr
    done = demo(a_file / "below", timeout=60)
    assert done.returncode == 2 and "cannot write there" in done.stderr
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine\n")
    done = demo(busy, timeout=60)
    assert done.returncode == 2 and "not empty" in done.stderr and (busy / "notes.txt").read_text() == "mine\n"


def test_ctrl_c_while_a_step_waits_on_its_process_ends_that_process(tmp_path):
    """Ctrl-C lands while the main thread waits on one of its steps' processes (a validation): that process
    ends with it, not left running into a folder about to be removed (CI once saw `Directory not empty`)."""
    from pipeline.demo.flow import Progress, Shell

    sh = Shell(tmp_path, tmp_path, Progress(1, tmp_path / "steps.txt"))
    marker = tmp_path / "started"
    child = [sys.executable, "-c", "import os, pathlib, sys, time;"
             " pathlib.Path(sys.argv[1]).write_text(str(os.getpid())); time.sleep(60)", str(marker)]
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        def interrupt() -> None:
            while not marker.exists():
                time.sleep(0.02)
            os.kill(os.getpid(), signal.SIGINT)

        threading.Thread(target=interrupt, daemon=True).start()
        with pytest.raises(KeyboardInterrupt):
            sh.process(child, cwd=tmp_path, env=dict(os.environ), timeout=30)
    finally:
        signal.signal(signal.SIGINT, old)
    pid = int(marker.read_text())
    assert not Path(f"/proc/{pid}").exists() or _state(pid) == "Z", "the step's process outlived the Ctrl-C"
    sh.stop()
