"""Local parity: `python -m pipeline evaluate FILE --comment` prints exactly the comment post-result posts
for that result (the same renderer, the same would-be rank, on the repository's board or --board's), and
the progress bar: on a terminal (a real pty) a bar redrawn in place on stderr, on a pipe none."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest

from pipeline import ledger as lg, post, report, signing
from pipeline.__main__ import main
from pipeline.evaluation import Progress
from pipeline.result import git_blob_sha
from github_fake import FakeGitHub, fake_sha
from ledger_factory import TEST_KEY, raw, result_doc, resign, sha, write_competition, write_keyring

ROOT = Path(__file__).resolve().parent.parent
TEMPLATE = ROOT / "problems" / "muse_bf16_proj" / "template.py"
HEAD = fake_sha("bob's head")
FOLDER = "submissions/kernel/muse_bf16_proj/bob"


def evaluate(tmp_path: Path, *extra: str, tty: bool = False) -> tuple[dict, str, str]:
    """The CLI on the template, timed on the CPU (retried on a noise verdict of the shared cores):
    (the result it wrote, its stdout, its stderr as a pipe or a terminal received it)."""
    out = tmp_path / "result.json"
    cmd = [sys.executable, "-m", "pipeline", "evaluate", str(TEMPLATE), "--problem", "muse_bf16_proj",
           "--device", "cpu", "--seeds", "1", "--json", str(out), "--comment", *extra]
    got: dict = {}

    def once() -> dict:
        stdout = tmp_path / "stdout"
        with open(stdout, "wb") as so:
            if tty:
                master, slave = pty.openpty()
                fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))  # rows, columns
                proc = subprocess.Popen(cmd, cwd=ROOT, stdout=so, stderr=slave, stdin=subprocess.DEVNULL)
                os.close(slave)
                chunks = []
                while True:
                    try:
                        chunk = os.read(master, 65536)
                    except OSError:  # EIO: the child closed the terminal's last end
                        break
                    if not chunk:
                        break
                    chunks.append(chunk)
                os.close(master)
                proc.wait(timeout=300)
                err = b"".join(chunks).decode()
            else:
                proc = subprocess.run(cmd, cwd=ROOT, stdout=so, stderr=subprocess.PIPE, timeout=300)
                err = proc.stderr.decode()
        assert proc.returncode in (0, 1), err
        got.update(stdout=stdout.read_text(), stderr=err)
        return json.loads(out.read_text())

    doc = once()
    return doc, got["stdout"], got["stderr"]


@pytest.fixture
def fake(httpserver, monkeypatch):
    fake = FakeGitHub(httpserver)
    for k, v in fake.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("GITHUB_EVENT_PATH", raising=False)
    return fake


def test_the_comment_is_what_post_result_posts_for_the_same_result(fake, tmp_path, monkeypatch):
    meta = tmp_path / "meta.json"
    meta.write_text(json.dumps({"pr": 7, "head_sha": HEAD, "login": "bob", "path": f"{FOLDER}/submission.py",
                                "blob_sha": git_blob_sha(TEMPLATE.read_bytes()), "problem": "muse_bf16_proj"}))
    doc, stdout, stderr = evaluate(tmp_path, "--meta", str(meta))
    assert doc["score"], "a timed result: the comment has a would-be rank to show"
    assert "Would-be rank on the current board:" in stdout
    assert stdout.startswith(report.MARKER)
    # a pipe gets no bar: the stage lines as before, the terminal table after them
    assert "\r" not in stderr and "[#" not in stderr and "[." not in stderr
    assert stderr.startswith("[evaluate] ") and "loaded muse_bf16_proj" in stderr
    assert report.terminal(doc) in stderr

    # the same document, signed by the signer, through post-result against the GitHub double
    ring = write_keyring(tmp_path / "keyring", TEST_KEY)
    monkeypatch.setenv(signing.KEYRING_ENV, str(ring))
    signed = tmp_path / "signed.json"
    signed.write_text(json.dumps(resign(doc)))
    fake.add_commit({f"{FOLDER}/submission.py": ("100644", TEMPLATE.read_bytes())}, sha=HEAD)
    fake.add_pull(7, "bob", HEAD, [{"filename": f"{FOLDER}/submission.py", "status": "added"}], labels=("run-eval",))
    assert main(["post-result", "--result", str(signed)]) == 0
    [posted] = fake.comments[7]
    assert posted["body"] == stdout


@pytest.mark.heavy  # an evaluation in a terminal
def test_the_comment_ranks_against_the_board_given_and_a_terminal_shows_a_bar(tmp_path):
    board = tmp_path / "board"
    board.mkdir()
    write_competition(board)
    for i, (who, speed) in enumerate([("alice", 1000.0), ("carol", 0.001)]):
        d = result_doc(login=who, pr=i + 1, speedup=speed, rel=0.001, head_sha=sha(f"head-{i}"))
        lg.append(board, lg.result_record(d, raw(d), pr=i + 1, login=who, head_sha=sha(f"head-{i}"),
                                          accepted_at="2026-10-22T10:00:00Z"), evidence=raw(d))
    assert main(["board", "--root", str(board), "--no-plots", "--now", "2026-10-22T12:00:00Z"]) == 0
    doc, stdout, stderr = evaluate(tmp_path, "--board", str(board / "leaderboard.md"), tty=True)
    assert "Would-be rank on the current board: 2 of 3" in stdout
    assert stdout == post.pr_comment(doc, root=board)
    # the terminal: one bar redrawn in place, every stage counted, then a line of its own for the table
    stages = 1 + len(doc["correctness"]) + len(doc["performance"]) + 1  # load, check each, time each, alone
    draws = [d for d in stderr.split("\r") if d.startswith("[evaluate] [")]
    assert len(draws) >= 3 and "[evaluate] [" + "#" * Progress.WIDTH + f"] {stages}/{stages}" in stderr, stderr
    assert "\n[evaluate]" not in stderr.replace("\r\n", "\n"), "a terminal gets the bar, not a line per stage"


def test_board_without_comment_or_missing_is_a_usage_error(tmp_path, capsys):
    base = ["evaluate", str(TEMPLATE), "--problem", "muse_bf16_proj", "--device", "cpu", "--no-timing"]
    assert main([*base, "--board", str(ROOT / "leaderboard.md")]) == 2
    assert "--board is for --comment" in capsys.readouterr().err
    assert main([*base, "--comment", "--board", str(tmp_path / "nowhere.md")]) == 2
    assert "no such file" in capsys.readouterr().err


@pytest.mark.parametrize("on_a_terminal", [True, False])
def test_the_progress_bar_is_drawn_only_on_a_terminal(on_a_terminal):
    if on_a_terminal:
        master, slave = pty.openpty()
        stream = os.fdopen(slave, "w")
    else:
        read_end, write_end = os.pipe()
        stream = os.fdopen(write_end, "w")
    progress = Progress(4, stream)
    for line in ("loaded", "checked a", "checked b", "timed a"):
        progress(line)
    progress.close()
    stream.close()
    fd = master if on_a_terminal else read_end
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(fd)
    text = b"".join(chunks).decode()
    if on_a_terminal:
        assert text.count("\r[evaluate] [") == 4 and text.endswith("\n") and text.count("\n") == 1
        assert "[evaluate] [######..................] 1/4 loaded" in text
        assert f"[evaluate] [{'#' * Progress.WIDTH}] 4/4 timed a" in text
    else:
        assert text == "[evaluate] loaded\n[evaluate] checked a\n[evaluate] checked b\n[evaluate] timed a\n"
