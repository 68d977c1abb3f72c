"""ledger.yml's and snapshot.yml's verbs: `publish` (append, regenerate, commit, push with a compare-and-
swap on the branch head, redone on the new tip when another writer got there first) against a real git
remote (a bare repository in a temp folder), and `find-result` (the merged head must be the evaluated
one) against a stand-in for the GitHub client."""

from __future__ import annotations

import base64
import datetime as dt
import json
import re
import subprocess
from pathlib import Path

import pytest

from ledger_factory import bare_origin, clone, git, raw, resign, result_doc, sha
from pipeline import ledger as lg, publish as pub
from pipeline.__main__ import main

NOW = "2026-10-22T12:00:00Z"
MERGED = "2026-10-22T10:00:00Z"


@pytest.fixture(autouse=True)
def _plain_git(monkeypatch, tmp_path_factory):
    # no user or system configuration of this machine may change what git does in these tests
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(tmp_path_factory.mktemp("gitconfig") / "none"))
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    monkeypatch.setenv("GIT_AUTHOR_NAME", "test")
    monkeypatch.setenv("GIT_AUTHOR_EMAIL", "test@example.invalid")
    monkeypatch.setenv("GIT_COMMITTER_NAME", "test")
    monkeypatch.setenv("GIT_COMMITTER_EMAIL", "test@example.invalid")
    monkeypatch.delenv(pub.TOKEN_ENV, raising=False)


@pytest.fixture
def origin(tmp_path) -> Path:
    return bare_origin(tmp_path, {"README.md": "the competition\n"})


def head(origin: Path) -> str:
    return git(origin, "rev-parse", "main")


def result_file(tmp_path: Path, pr: int, **kw) -> tuple[Path, str]:
    head_sha = sha(f"head-{pr}")
    path = tmp_path / f"result-{pr}.json"
    path.write_bytes(raw(result_doc(pr=pr, head_sha=head_sha, **kw)))
    return path, head_sha


def publish_ledger(repo: Path, result: Path, pr: int, head_sha: str, login: str = "alice", *extra: str) -> int:
    return main(["publish", "ledger", str(result), "--pr", str(pr), "--login", login, "--head-sha", head_sha,
                 "--merged-at", MERGED, "--repo", str(repo), "--now", NOW, "--no-plots", "--backoff", "0", *extra])


def ledger_at(origin: Path, tmp_path: Path, name: str = "check") -> list[dict]:
    return lg.verify(clone(origin, tmp_path / name))


def test_publish_ledger_appends_regenerates_and_pushes(origin, tmp_path, capsys):
    work = clone(origin, tmp_path / "work")
    before = head(origin)
    result, head_sha = result_file(tmp_path, 3)
    assert publish_ledger(work, result, 3, head_sha) == 0
    assert f"pushed" in capsys.readouterr().out
    assert git(origin, "rev-parse", "main~1") == before, "one commit on top of the tip it was built on"
    assert git(origin, "log", "-1", "--format=%s%n%an", "main").splitlines() == [
        f"ledger: PR #3 (@alice) at {head_sha[:12]}, merged {MERGED}", "muse-pipeline[bot]"]
    files = git(origin, "ls-tree", "-r", "--name-only", "main").splitlines()
    assert "results/ledger/2026-10.jsonl" in files and "leaderboard.md" in files
    assert "results/snapshots/2026-10-22/12.json" in files
    changed = git(origin, "diff", "--name-only", "main~1", "main").splitlines()
    assert all(p.startswith(("results/", "leaderboard")) for p in changed), changed
    (record,) = ledger_at(origin, tmp_path)
    assert (record["pr"], record["head_sha"], record["accepted_at"]) == (3, head_sha, MERGED)
    assert git(work, "status", "--porcelain") == "", "the clone the code runs from is never touched"
    assert git(work, "worktree", "list").count("\n") == 0, "the attempt's worktree is removed"


def test_a_push_that_loses_the_race_is_rebuilt_on_the_new_tip(origin, tmp_path):
    """Another ledger run lands between this run's fetch and its push: the lease fails, the append is
    recomputed on the new tip (the chain continues from the other record), and the second push lands."""
    work = clone(origin, tmp_path / "work")
    other = clone(origin, tmp_path / "other")
    mine, my_head = result_file(tmp_path, 3)
    theirs, their_head = result_file(tmp_path, 4, login="bob")
    args = pub_args(mine, 3, my_head)
    pauses = []

    def rival(attempt: int) -> None:
        if attempt == 1:
            assert publish_ledger(other, theirs, 4, their_head, "bob") == 0

    out = pub.publish(work, pub.ledger_steps(args, mine), "mine", backoff=1.0, before_push=rival,
                      sleep=pauses.append, log=lambda _: None)
    assert out.attempts == 2 and len(pauses) == 1 and 0.5 <= pauses[0] <= 1.5
    records = ledger_at(origin, tmp_path)
    assert [(r["seq"], r["pr"]) for r in records] == [(0, 4), (1, 3)], "one chain, both records"
    assert git(origin, "log", "--format=%s", "-2", "main").splitlines() == [
        "mine", f"ledger: PR #4 (@bob) at {their_head[:12]}, merged {MERGED}"]


def test_concurrent_publish_ledger_processes_leave_exactly_one_record_each(origin, tmp_path):
    """ledger.yml's writers as the workflow runs them: N `python -m pipeline publish ledger` processes at
    once, each from its own clone, racing for one real bare repository. Each says that it pushed, and the
    remote's ledger then holds exactly N records that verify (a verb that ended its own process after the
    board step once left 0 of 16, every process exiting 0)."""
    import os
    import sys

    n = 8
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    procs = {}
    for pr in range(1, n + 1):
        result, head_sha = result_file(tmp_path, pr, login=f"c{pr}")
        repo = clone(origin, tmp_path / f"runner-{pr}")
        procs[pr] = subprocess.Popen(
            [sys.executable, "-m", "pipeline", "publish", "ledger", str(result), "--pr", str(pr), "--login",
             f"c{pr}", "--head-sha", head_sha, "--merged-at", MERGED, "--now", NOW, "--no-plots", "--backoff",
             "0.05", "--attempts", "40"], cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for pr, p in procs.items():
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        assert re.search(r"^pushed [0-9a-f]{12} onto main", out, re.M), f"#{pr} says nothing of a push:\n{out}{err}"
    records = ledger_at(origin, tmp_path)
    assert sorted(r["pr"] for r in records) == list(range(1, n + 1))
    assert git(origin, "rev-list", "--count", "main") == str(n + 1), "one commit a record on the seed"


def pub_args(result: Path, pr: int, head_sha: str, login: str = "alice"):
    import argparse

    return argparse.Namespace(pr=pr, login=login, head_sha=head_sha, merged_at=MERGED, allow_unofficial=False,
                              now=NOW, no_plots=True, result=result)


def test_a_merge_landing_meanwhile_is_kept(origin, tmp_path):
    work = clone(origin, tmp_path / "work")
    other = clone(origin, tmp_path / "other")
    result, head_sha = result_file(tmp_path, 3)

    def merge(attempt: int) -> None:
        if attempt == 1:
            path = other / "submissions/kernel/muse_bf16_proj/bob/submission.py"
            path.parent.mkdir(parents=True)
            path.write_text("def custom_kernel(inputs):\n    return None\n")
            git(other, "add", "-A")
            git(other, "commit", "--quiet", "-m", "Merge pull request #5")
            git(other, "push", "--quiet", "origin", "main")

    out = pub.publish(work, pub.ledger_steps(pub_args(result, 3, head_sha), result), "mine", before_push=merge,
                      sleep=lambda _: None, log=lambda _: None)
    assert out.attempts == 2
    files = git(origin, "ls-tree", "-r", "--name-only", "main").splitlines()
    assert "submissions/kernel/muse_bf16_proj/bob/submission.py" in files
    assert "results/ledger/2026-10.jsonl" in files


def test_recording_again_changes_nothing_and_succeeds(origin, tmp_path, capsys):
    work = clone(origin, tmp_path / "work")
    result, head_sha = result_file(tmp_path, 3)
    assert publish_ledger(work, result, 3, head_sha) == 0
    tip = head(origin)
    assert publish_ledger(work, result, 3, head_sha) == 0
    out = capsys.readouterr().out
    assert "already in the ledger" in out and "nothing to commit" in out
    assert head(origin) == tip


def test_a_tampered_result_is_refused_and_nothing_is_pushed(origin, tmp_path, capsys):
    work = clone(origin, tmp_path / "work")
    doc = result_doc(pr=3, head_sha=sha("head-3"))
    doc["score"]["speedup"] = 9.0  # after signing
    result = tmp_path / "tampered.json"
    result.write_bytes(raw(doc))
    tip = head(origin)
    assert publish_ledger(work, result, 3, sha("head-3")) == 1
    assert "nothing was pushed" in capsys.readouterr().err
    assert head(origin) == tip


def test_a_head_that_is_not_the_evaluated_one_is_refused(origin, tmp_path, capsys):
    work = clone(origin, tmp_path / "work")
    result, _ = result_file(tmp_path, 3)
    tip = head(origin)
    assert publish_ledger(work, result, 3, "f" * 40) == 1
    assert "the merged head must be the evaluated one" in capsys.readouterr().err
    assert head(origin) == tip


def test_a_refusal_by_the_server_is_final(origin, tmp_path, capsys):
    hook = origin / "hooks" / "pre-receive"
    hook.write_text("#!/bin/sh\necho 'protected branch hook declined' >&2\nexit 1\n")
    hook.chmod(0o755)
    work = clone(origin, tmp_path / "work")
    result, head_sha = result_file(tmp_path, 3)
    assert publish_ledger(work, result, 3, head_sha) == 1
    err = capsys.readouterr().err
    assert "was refused" in err and "protected branch hook declined" in err and "gave up" not in err


def test_it_gives_up_when_the_branch_keeps_moving(origin, tmp_path):
    work = clone(origin, tmp_path / "work")
    other = clone(origin, tmp_path / "other")
    result, head_sha = result_file(tmp_path, 3)

    def always(attempt: int) -> None:
        (other / f"note-{attempt}.txt").write_text("x")
        git(other, "add", "-A")
        git(other, "commit", "--quiet", "-m", f"someone else {attempt}")
        git(other, "push", "--quiet", "origin", "main")

    with pytest.raises(pub.PublishError, match="gave up after 3 attempts"):
        pub.publish(work, pub.ledger_steps(pub_args(result, 3, head_sha), result), "mine", attempts=3,
                    before_push=always, sleep=lambda _: None, log=lambda _: None)
    assert "results/ledger/2026-10.jsonl" not in git(origin, "ls-tree", "-r", "--name-only", "main")


def test_publish_snapshots_backfills_and_pushes_then_has_nothing_to_do(origin, tmp_path, capsys):
    work = clone(origin, tmp_path / "work")
    argv = ["publish", "snapshots", "--repo", str(work), "--now", NOW, "--no-plots", "--backoff", "0"]
    assert main(argv) == 0
    files = git(origin, "ls-tree", "-r", "--name-only", "main").splitlines()
    assert {f"results/snapshots/2026-10-22/{h:02d}.json" for h in range(1, 13)} <= set(files)
    assert "leaderboard.md" in files
    tip = head(origin)
    assert main(argv) == 0
    assert "nothing to commit" in capsys.readouterr().out and head(origin) == tip


def test_publish_usage_errors(tmp_path, capsys):
    result, head_sha = result_file(tmp_path, 3)
    assert publish_ledger(tmp_path, result, 3, head_sha) == 2
    assert "not a git clone" in capsys.readouterr().err
    assert main(["publish", "snapshots", "--repo", str(tmp_path), "--author", "nobody"]) == 2
    assert "Name <email>" in capsys.readouterr().err


def test_lost_race_tells_a_moved_branch_from_a_refusal():
    assert pub.lost_race("!\tabc:refs/heads/main\t[rejected] (stale info)")
    assert pub.lost_race("!\tabc:refs/heads/main\t[rejected] (fetch first)")
    assert pub.lost_race("! [remote rejected] main -> main (cannot lock ref 'refs/heads/main': is at 1 but expected 2)")
    assert not pub.lost_race("! [remote rejected] main -> main (protected branch hook declined)")
    assert not pub.lost_race("remote: Repository not found.\nfatal: repository not found")


def test_the_push_token_travels_in_the_environment_only():
    env = pub.git_env("s3cret", "https://github.com")
    assert env["GIT_CONFIG_COUNT"] == "1" and env["GIT_CONFIG_KEY_0"] == "http.https://github.com/.extraheader"
    value = env["GIT_CONFIG_VALUE_0"]
    assert value.startswith("AUTHORIZATION: basic ")
    assert base64.b64decode(value.split()[-1]) == b"x-access-token:s3cret"
    assert "GIT_CONFIG_COUNT" not in pub.git_env(None) and pub.git_env(None)["GIT_TERMINAL_PROMPT"] == "0"


# ---- find-result ----

class StubGitHub:
    def __init__(self, pull, runs):
        self._pull, self._runs, self.since = pull, runs, None

    def pull(self, number):
        assert number == self._pull.number
        return self._pull

    def bench_runs(self, since):
        self.since = since
        return self._runs


def facts(**kw):
    from pipeline.github import PullFacts

    base = dict(number=12, author="Alice", state="closed", head_sha="a" * 40, head_repo="alice/fork", base_ref="main",
                merged=True, merged_at="2026-10-23T08:00:00Z", labels=(), changed_files=1, html_url="")
    base.update(kw)
    return PullFacts(**base)


def run(run_id, head_sha, conclusion="success", pr=12, minutes=0, status="completed"):
    from pipeline.github import BenchRun

    created = dt.datetime(2026, 10, 23, 7, 0, tzinfo=dt.timezone.utc) + dt.timedelta(minutes=minutes)
    return BenchRun(run_id, f"bench #{pr} @Alice {head_sha}", created, status, conclusion,
                    f"https://github.com/o/r/actions/runs/{run_id}", pr, "Alice", head_sha)


@pytest.fixture
def stub(monkeypatch):
    from pipeline import github

    holder = {}
    monkeypatch.setattr(github.GitHub, "from_env", classmethod(lambda cls, environ=None, repository=None: holder["gh"]))
    return holder


def test_find_result_names_the_latest_successful_run_of_the_merged_head(stub, tmp_path, capsys):
    stub["gh"] = StubGitHub(facts(), [run(9, "a" * 40, minutes=30), run(8, "a" * 40, "failure", minutes=40),
                                     run(7, "a" * 40, minutes=10), run(6, "b" * 40, minutes=50),
                                     run(5, "a" * 40, pr=13, minutes=55)])
    out = tmp_path / "github_output"
    out.write_text("earlier=1\n")
    assert main(["find-result", "--pr", "12", "--output", str(out)]) == 0
    assert out.read_text().splitlines() == ["earlier=1", "pr=12", "login=Alice", f"head_sha={'a' * 40}",
                                            "merged_at=2026-10-23T08:00:00Z", "run_id=9"]
    assert stub["gh"].since == dt.datetime(2026, 8, 24, 8, 0, tzinfo=dt.timezone.utc)
    assert "evaluated by bench run 9" in capsys.readouterr().out


def test_find_result_refuses_a_merged_head_nobody_evaluated(stub, tmp_path, capsys):
    stub["gh"] = StubGitHub(facts(head_sha="c" * 40), [run(9, "a" * 40), run(8, "c" * 40, "failure"),
                                                      run(7, "c" * 40, None, status="in_progress")])
    out = tmp_path / "github_output"
    assert main(["find-result", "--pr", "12", "--output", str(out)]) == 1
    err = capsys.readouterr().err
    assert "which no bench run evaluated successfully (evaluated: aaaaaaaaaaaa)" in err
    assert "the merged head must be the evaluated one" in err
    assert not out.exists()


def test_find_result_refuses_an_unmerged_pr(stub, capsys):
    stub["gh"] = StubGitHub(facts(merged=False, merged_at=None, state="closed"), [run(9, "a" * 40)])
    assert main(["find-result", "--pr", "12"]) == 1
    assert "#12 is not merged (closed)" in capsys.readouterr().err


# ---- reconcile: every merged and evaluated PR, however many runs were cancelled ----

@pytest.fixture
def fake(httpserver, monkeypatch):
    from github_fake import FakeGitHub

    fake = FakeGitHub(httpserver)
    for k, v in fake.env().items():
        monkeypatch.setenv(k, v)
    return fake


def merged_and_evaluated(fake, pr: int, login: str, merged_at: str, *, doc: dict | None = None,
                         merge: bool = True) -> str:
    """A PR whose head a bench run evaluated (its signed `result` artifact uploaded), then merged."""
    head_sha = sha(f"head-{pr}")
    fake.add_pull(pr, login, head_sha, [{"filename": f"submissions/kernel/muse_bf16_proj/{login}/submission.py",
                                          "status": "added"}])
    run = fake.add_run(f"bench #{pr} @{login} {head_sha}", "2026-10-22T08:00:00Z")
    fake.add_artifact(run["id"], "result", {"result.json": raw(doc or result_doc(pr=pr, login=login,
                                                                                  head_sha=head_sha))})
    if merge:
        fake.merge(pr, merged_at)
    return head_sha


def reconcile(repo: Path, *extra: str) -> int:
    return main(["publish", "reconcile", "--repo", str(repo), "--now", NOW, "--no-plots", "--backoff", "0", *extra])


def test_reconcile_records_every_merged_and_evaluated_pr_in_merged_at_order(origin, tmp_path, fake, capsys):
    fake.page_size = 2  # every list is paginated, through GitHub's Link headers
    merged_and_evaluated(fake, 5, "carol", "2026-10-22T10:30:00Z")
    merged_and_evaluated(fake, 3, "alice", "2026-10-22T11:00:00Z")
    merged_and_evaluated(fake, 4, "bob", "2026-10-22T10:00:00Z")
    merged_and_evaluated(fake, 6, "dan", "2026-10-22T10:45:00Z", merge=False)  # open: not recorded
    fake.add_pull(7, "organizer", sha("docs"), [{"filename": "docs/RUNBOOK.md", "status": "modified"}])
    fake.merge(7, "2026-10-22T09:00:00Z")  # an organizer's PR: nothing to record, nothing to say
    failed = result_doc(pr=8, login="erin", head_sha=sha("head-8"), status="incorrect")
    merged_and_evaluated(fake, 8, "erin", "2026-10-22T09:30:00Z", doc=resign({**failed, "score": None}))
    fake.add_pull(9, "fay", sha("head-9"), [{"filename": "submissions/kernel/muse_bf16_proj/fay/submission.py",
                                             "status": "added"}])
    fake.merge(9, "2026-10-22T09:45:00Z")  # merged without any evaluation
    work = clone(origin, tmp_path / "work")
    assert reconcile(work) == 0
    captured = capsys.readouterr()
    assert "recorded 3 merged PRs (#4, #5, #3)" in captured.out
    assert "#8 was merged although its evaluation (bench run" in captured.err and "says 'incorrect'" in captured.err
    assert "#9 was merged at head" in captured.err and "(no evaluation at all)" in captured.err
    assert "#7" not in captured.err
    assert not [r for r in fake.requests() if re.fullmatch(r"GET /repos/[^ ]+/pulls/\d+", r)], \
        "the merged pull requests come from one paginated list, never one request each"
    assert git(origin, "log", "-1", "--format=%s", "main") == "ledger: record #4, #5, #3 (reconcile)"
    check = clone(origin, tmp_path / "check")
    records = lg.verify(check)
    assert [(r["pr"], r["accepted_at"]) for r in records] == [
        (4, "2026-10-22T10:00:00Z"), (5, "2026-10-22T10:30:00Z"), (3, "2026-10-22T11:00:00Z")]
    assert all((check / "results/evidence" / f"{r['result_sha256']}.json").is_file() for r in records)
    assert f"Ledger chain head: `{records[-1]['sha256']}`" in (check / "leaderboard.md").read_text()
    # again, from the same (now stale) clone: nothing recorded is downloaded again, nothing changes
    tip, before = head(origin), len(fake.log)
    assert reconcile(work) == 0
    assert head(origin) == tip
    recorded_runs = [r["id"] for r in fake.runs if r["display_title"].startswith(("bench #3 ", "bench #4 ", "bench #5 "))]
    downloads = [r for r in fake.requests()[before:] if "/artifacts" in r]
    assert downloads and not any(f"/runs/{i}/" in r for r in downloads for i in recorded_runs), downloads


def test_a_merge_whose_ledger_run_was_cancelled_is_recorded_by_the_next_run(origin, tmp_path, fake):
    """GitHub cancels a pending ledger run when another queues: the one that runs records both."""
    work = clone(origin, tmp_path / "work")
    merged_and_evaluated(fake, 3, "alice", "2026-10-22T10:00:00Z")
    merged_and_evaluated(fake, 4, "bob", "2026-10-22T10:01:00Z")
    assert reconcile(work, "--pr", "4") == 0  # the run of #4's merge; #3's was cancelled
    assert [r["pr"] for r in lg.verify(clone(origin, tmp_path / "check"))] == [3, 4]


def test_reconcile_names_what_it_cannot_record_and_records_the_rest(origin, tmp_path, fake, capsys):
    merged_and_evaluated(fake, 3, "alice", "2026-10-22T10:00:00Z")
    tampered = result_doc(pr=4, login="bob", head_sha=sha("head-4"))
    tampered["score"]["speedup"] = 9.0
    merged_and_evaluated(fake, 4, "bob", "2026-10-22T10:05:00Z", doc=tampered)
    fake.add_pull(5, "carol", sha("head-5"), [{"filename": "submissions/kernel/muse_bf16_proj/carol/submission.py",
                                               "status": "added"}])
    fake.add_run(f"bench #5 @carol {sha('an-earlier-head')}", "2026-10-22T08:00:00Z")
    fake.merge(5, "2026-10-22T10:10:00Z")
    work = clone(origin, tmp_path / "work")
    assert reconcile(work, "--pr", "5") == 1
    err = capsys.readouterr().err
    assert "#4: the result of bench run" in err and "changed after signing" in err
    assert "#5 was merged at head" in err and "the merged head must be the evaluated one" in err
    assert "#5 is not recorded" in err and "everything else was recorded and pushed" in err
    assert [r["pr"] for r in lg.verify(clone(origin, tmp_path / "check"))] == [3]


def test_reconcile_needs_github(origin, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("GITHUB_REPOSITORY", raising=False)
    assert reconcile(clone(origin, tmp_path / "work")) == 2
    assert "$GITHUB_REPOSITORY" in capsys.readouterr().err


@pytest.mark.heavy  # 150 processes
def test_a_burst_of_50_merges_with_racing_and_killed_runs_records_each_exactly_once(origin, tmp_path, fake):
    """50 merges in a burst against one real bare repository: ledger and snapshot runs start while merges
    land, several at once, each from its own clone, racing for the branch; some are killed (SIGKILL,
    as a cancelled job is) in the middle of their work. A final run then leaves exactly 50 result records,
    a chain and evidence that verify."""
    import os
    import random
    import signal
    import sys
    import time

    rng = random.Random(11)
    heads = {pr: merged_and_evaluated(fake, pr, f"c{pr}", "", merge=False) for pr in range(1, 51)}
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent), "PYTHONUNBUFFERED": "1"}
    procs: list[subprocess.Popen] = []

    def start(n: int) -> None:
        repo = clone(origin, tmp_path / f"runner-{n}")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "pipeline", "publish", "reconcile", "--repo", str(repo), "--now", NOW,
             "--no-plots", "--backoff", "0.05", "--attempts", "30"], env=env,
            stdout=open(tmp_path / f"runner-{n}.log", "w"), stderr=subprocess.STDOUT))

    def merge_commits(prs: range) -> None:
        """The merges themselves land on main too (the submissions' files), racing the ledger's pushes,
        each wave from a fresh clone (as GitHub merges on its side: nothing keeps a lost commit)."""
        merger = clone(origin, tmp_path / f"merger-{prs[0]}")
        for pr in prs:
            path = merger / f"submissions/kernel/muse_bf16_proj/c{pr}/submission.py"
            path.parent.mkdir(parents=True)
            path.write_text(f"# PR {pr}\n")
            git(merger, "add", "-A")
            git(merger, "commit", "--quiet", "-m", f"Merge pull request #{pr}")
        for _ in range(50):
            git(merger, "fetch", "--quiet", "origin")
            git(merger, "rebase", "--quiet", "origin/main")
            if subprocess.run(["git", "push", "--quiet", "origin", "HEAD:main"], cwd=merger,
                              capture_output=True).returncode == 0:
                return
        raise AssertionError("the merges never landed")

    killed = 0
    for wave in range(5):
        for pr in range(wave * 10 + 1, wave * 10 + 11):
            fake.merge(pr, f"2026-10-22T{10 + wave:02d}:{pr % 60:02d}:00Z")
        merge_commits(range(wave * 10 + 1, wave * 10 + 11))
        for _ in range(3):
            start(len(procs))
        # the first of the three is cancelled in the middle of its work: once it has appended to its
        # attempt's ledger (before it pushed), or at a random moment before that; the other two race
        victim, log = procs[-3], tmp_path / f"runner-{len(procs) - 3}.log"
        deadline = time.monotonic() + rng.uniform(0.5, 3.0)
        while time.monotonic() < deadline and victim.poll() is None and "appended PR" not in log.read_text():
            time.sleep(0.01)
        if victim.poll() is None:
            victim.send_signal(signal.SIGKILL)
            killed += 1
    for p in procs:
        p.wait(timeout=120)
    assert killed >= 2, "the burst must include runs killed mid-way"
    assert sum(p.returncode == 0 for p in procs) >= 8
    for n, p in enumerate(procs):  # every run that was not killed pushed, or said why it had nothing to push
        if p.returncode != -signal.SIGKILL:
            log = (tmp_path / f"runner-{n}.log").read_text()
            assert p.returncode == 0 and re.search(r"^(pushed [0-9a-f]{12} onto main|nothing to commit on main)",
                                                   log, re.M), f"run {n} exited {p.returncode}:\n{log[-3000:]}"
    start(len(procs))  # the final run is a process too, as ledger.yml's is
    procs[-1].wait(timeout=120)
    log = (tmp_path / f"runner-{len(procs) - 1}.log").read_text()
    assert procs[-1].returncode == 0 and re.search(r"^(pushed|nothing to commit)", log, re.M), log[-3000:]
    check = clone(origin, tmp_path / "check")
    records = lg.verify(check)
    assert sorted(r["pr"] for r in records) == list(range(1, 51)), "each merge recorded exactly once"
    assert {r["pr"]: r["head_sha"] for r in records} == heads
    assert all((check / "results/evidence" / f"{r['result_sha256']}.json").is_file() for r in records)
    assert main(["ledger", "verify", "--root", str(check)]) == 0
    assert all((check / f"submissions/kernel/muse_bf16_proj/c{pr}/submission.py").is_file() for pr in heads), \
        "no merge was pushed over"
