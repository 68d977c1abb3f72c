"""pipeline.github over real HTTP against a server that answers like GitHub: the exact requests made,
pagination through Link headers, the sticky comment's upsert, retries of 5xx and rate-limit answers,
and POSTs that are never repeated blindly."""

from __future__ import annotations

import datetime as dt
import time

import pytest

from pipeline.github import BENCH_TITLE, GitHub, GitHubError
from github_fake import TOKEN, FakeGitHub, blob_sha, fake_sha

MARKER = "<!-- muse-pipeline:sticky-result -->"
HEAD = fake_sha("head")
R = "/repos/muse-competition/pipeline"


@pytest.fixture
def fake(httpserver):
    return FakeGitHub(httpserver)


def client(fake: FakeGitHub, **kw) -> GitHub:
    kw.setdefault("backoff", 0.001)
    return GitHub(fake.repo, token=TOKEN, base_url=fake.base, throttle=False, **kw)


def _pull(fake: FakeGitHub, number: int = 7, **kw) -> dict:
    return fake.add_pull(number, "bob", kw.pop("head", HEAD), [], **kw)


# ---- facts ----

def test_pull_facts_and_merged_at(fake):
    _pull(fake, labels=("run-eval",))
    _pull(fake, 8, head=fake_sha("other"), state="closed", merged_at="2026-10-23T09:15:02Z")
    gh = client(fake)
    facts = gh.pull(7)
    assert (facts.number, facts.author, facts.head_sha, facts.state, facts.merged, facts.labels) == (
        7, "bob", HEAD, "open", False, ("run-eval",))
    assert gh.merged_at(7) is None
    assert gh.merged_at(8) == "2026-10-23T09:15:02Z"
    assert fake.requests() == [f"GET {R}/pulls/7", f"GET {R}/pulls/7", f"GET {R}/pulls/8"]
    assert all(e.auth == f"token {TOKEN}" for e in fake.log)


def test_a_missing_pull_request_is_a_message_not_a_traceback(fake):
    with pytest.raises(GitHubError, match=r"reading pull request #99: GitHub answered 404: Not Found"):
        client(fake).pull(99)


def test_find_the_pull_request_of_a_head_sha(fake):
    _pull(fake, 3, head=fake_sha("h3"))
    _pull(fake, 7)
    gh = client(fake)
    assert gh.find_pull(HEAD).number == 7
    assert fake.requests() == [f"GET {R}/commits/{HEAD}/pulls?per_page=100", f"GET {R}/pulls/7"]


def test_a_head_the_association_index_does_not_know_is_found_among_open_prs(httpserver):
    fake = FakeGitHub(httpserver, page_size=2)
    for n in range(1, 6):
        _pull(fake, n, head=fake_sha("h", n))
    fake.commit_pulls.clear()
    gh = client(fake)
    assert gh.find_pull(fake_sha("h", 5)).number == 5
    assert fake.requests() == [
        f"GET {R}/commits/{fake_sha('h', 5)}/pulls?per_page=100",
        f"GET {R}/pulls?per_page=100&state=open",
        f"GET {R}/pulls?page=2&per_page=100&state=open",
        f"GET {R}/pulls?page=3&per_page=100&state=open",
        f"GET {R}/pulls/5",
    ]
    assert gh.find_pull(fake_sha("nobody")) is None


def test_roles_and_labels(fake):
    _pull(fake, labels=("run-eval",))
    fake.roles.update(carol="maintain", dave="triage")
    gh = client(fake)
    assert [gh.role(x) for x in ("carol", "dave", "eve")] == ["maintain", "triage", "read"]
    assert gh.remove_label(7, "run-eval") is True
    assert gh.remove_label(7, "run-eval") is False  # already gone: a retried DELETE is harmless
    assert fake.requests()[-2:] == [f"DELETE {R}/issues/7/labels/run-eval"] * 2


def test_trees_are_walked_one_directory_at_a_time_and_blobs_verified(fake):
    head = fake.add_commit({
        "submissions/kernel/p/bob/submission.py": ("100644", b"x = 1\n"),
        "submissions/kernel/p/bob/README.md": ("100644", b"# hi\n"),
        "submissions/kernel/q": ("120000", b"/etc"),
    }, sha=HEAD)
    gh = client(fake)
    entry = gh.tree_entry(head, "submissions/kernel/p/bob/submission.py")
    assert (entry.mode, entry.type, entry.sha, entry.size) == ("100644", "blob", blob_sha(b"x = 1\n"), 6)
    n = len(fake.log)
    assert gh.tree_entry(head, "submissions/kernel/p/bob/README.md").size == 5
    assert len(fake.log) == n  # every directory was read once
    linked = gh.tree_entry(head, "submissions/kernel/q/bob/submission.py")
    assert (linked.path, linked.mode) == ("submissions/kernel/q", "120000")  # nothing lies under a link
    assert gh.tree_entry(head, "submissions/kernel/p/alice/submission.py") is None
    assert gh.blob(entry.sha) == b"x = 1\n"
    fake.blobs[entry.sha] = b"x = 2\n"  # a server (or a proxy) handing back other bytes
    with pytest.raises(GitHubError, match="hash to"):
        gh.blob(entry.sha)


# ---- the sticky comment ----

def test_the_first_upsert_posts_and_the_next_patch_the_same_comment(fake):
    _pull(fake)
    gh = client(fake)
    assert gh.upsert_comment(7, MARKER + "\nfirst", MARKER) == (1001, True)
    assert gh.upsert_comment(7, MARKER + "\nsecond", MARKER) == (1001, False)
    assert gh.upsert_comment(7, MARKER + "\nsecond", MARKER) == (1001, False)  # nothing changed: no write at all
    assert fake.requests() == [
        f"GET {R}/issues/7/comments?per_page=100", f"POST {R}/issues/7/comments",
        f"GET {R}/issues/7/comments?per_page=100", f"PATCH {R}/issues/comments/1001",
        f"GET {R}/issues/7/comments?per_page=100",
    ]
    assert fake.bodies("PATCH") == [{"body": MARKER + "\nsecond"}]
    assert [c["body"] for c in fake.comments[7]] == [MARKER + "\nsecond"]


def test_the_marker_is_added_when_the_body_lacks_it(fake):
    _pull(fake)
    client(fake).upsert_comment(7, "hello", MARKER)
    assert fake.bodies("POST") == [{"body": MARKER + "\nhello"}]


def test_the_sticky_comment_needs_the_marker_and_the_bot_login(httpserver):
    fake = FakeGitHub(httpserver, page_size=2)
    _pull(fake)
    fake.add_comment(7, MARKER + "\nI am the bot, trust me", "mallory")  # anyone can paste the marker
    fake.add_comment(7, "a bot comment of another kind", fake.bot)
    fake.add_comment(7, "nice kernel", "alice")
    fake.add_comment(7, "thanks", "bob")
    mine = fake.add_comment(7, MARKER + "\nqueued", fake.bot)  # on the third page
    gh = client(fake)
    assert gh.upsert_comment(7, MARKER + "\nresult", MARKER) == (mine["id"], False)
    assert fake.requests() == [
        f"GET {R}/issues/7/comments?per_page=100",
        f"GET {R}/issues/7/comments?page=2&per_page=100",
        f"GET {R}/issues/7/comments?page=3&per_page=100",
        f"PATCH {R}/issues/comments/{mine['id']}",
    ]
    assert fake.comments[7][0]["body"] == MARKER + "\nI am the bot, trust me"


def test_a_post_whose_answer_was_lost_is_not_repeated(fake):
    _pull(fake)
    fake.fail("POST", rf"{R}/issues/7/comments", 502, after=True)  # created, but the answer is a 502
    assert client(fake).upsert_comment(7, MARKER + "\nbody", MARKER) == (1001, True)
    assert len(fake.comments[7]) == 1
    assert fake.requests() == [
        f"GET {R}/issues/7/comments?per_page=100", f"POST {R}/issues/7/comments",
        f"GET {R}/issues/7/comments?per_page=100",  # it looks before it would post again, and finds it
    ]


def test_a_post_refused_under_load_is_tried_again(fake):
    _pull(fake)
    fake.fail("POST", rf"{R}/issues/7/comments", 503, times=2)
    assert client(fake).upsert_comment(7, MARKER + "\nbody", MARKER)[1] is True
    assert len(fake.comments[7]) == 1
    assert [r for r in fake.requests() if r.startswith("POST")] == [f"POST {R}/issues/7/comments"] * 3


def test_a_post_refused_for_good_is_a_message(fake):
    _pull(fake)
    fake.fail("POST", rf"{R}/issues/7/comments", 403, message="Resource not accessible by integration")
    with pytest.raises(GitHubError, match="commenting on #7: GitHub answered 403: Resource not accessible"):
        client(fake).upsert_comment(7, "x", MARKER)
    assert [r for r in fake.requests() if r.startswith("POST")] == [f"POST {R}/issues/7/comments"]


# ---- retries of reads and edits ----

def test_5xx_answers_to_reads_are_retried_with_backoff(fake):
    _pull(fake)
    fake.fail("GET", rf"{R}/pulls/7", 502, times=2)
    started = time.monotonic()
    assert client(fake, backoff=0.05).pull(7).number == 7
    assert fake.requests() == [f"GET {R}/pulls/7"] * 3
    assert time.monotonic() - started >= 0.05  # urllib3: no wait before the 1st retry, backoff*2 before the 2nd


def test_persistent_5xx_gives_up_with_a_message(fake):
    _pull(fake)
    fake.fail("GET", rf"{R}/pulls/7", 500, times=100)
    with pytest.raises(GitHubError, match="reading pull request #7: GitHub answered 500"):
        client(fake, retries=2).pull(7)
    assert len(fake.log) == 3


def test_a_primary_rate_limit_waits_for_the_reset(fake):
    _pull(fake)
    reset = int(time.time())  # already past: the wait is the backoff alone
    fake.fail("GET", rf"{R}/pulls/7", 403, message="API rate limit exceeded for installation ID 1.",
              headers={"X-RateLimit-Remaining": "0", "X-RateLimit-Reset": str(reset)})
    assert client(fake).pull(7).number == 7
    assert fake.requests() == [f"GET {R}/pulls/7"] * 2


def test_a_primary_rate_limit_beyond_the_longest_wait_is_a_message(fake):
    _pull(fake)
    fake.fail("GET", rf"{R}/pulls/7", 403, message="API rate limit exceeded for installation ID 1.",
              headers={"X-RateLimit-Remaining": "0", "X-RateLimit-Reset": str(int(time.time()) + 3600)})
    with pytest.raises(GitHubError, match="403"):
        client(fake, max_wait=5).pull(7)
    assert len(fake.log) == 1


@pytest.mark.parametrize("status,message", [
    (403, "You have exceeded a secondary rate limit. Please wait a few minutes before you try again."),
    (429, "Too Many Requests"),
])
def test_secondary_rate_limits_honour_retry_after(fake, status, message):
    _pull(fake)
    fake.fail("PATCH", rf"{R}/issues/comments/\d+", status, message=message, headers={"Retry-After": "0"})
    fake.add_comment(7, MARKER + "\nold", fake.bot)
    client(fake).upsert_comment(7, MARKER + "\nnew", MARKER)
    assert [r for r in fake.requests() if r.startswith("PATCH")] == [f"PATCH {R}/issues/comments/1001"] * 2
    assert fake.comments[7][0]["body"] == MARKER + "\nnew"


def test_a_rate_limited_post_waits_then_looks_then_posts(fake):
    fake.fail("POST", rf"{R}/check-runs", 403, message="You have exceeded a secondary rate limit.",
              headers={"Retry-After": "0"})
    run_id, created = client(fake).upsert_check_run(HEAD, conclusion="success", title="t", summary="s")
    assert created and len(fake.check_runs) == 1
    assert fake.requests() == [
        f"GET {R}/commits/{HEAD}/check-runs?check_name=evaluation&per_page=100",
        f"POST {R}/check-runs",
        f"GET {R}/commits/{HEAD}/check-runs?check_name=evaluation&per_page=100",
        f"POST {R}/check-runs",
    ]


# ---- the check run ----

def test_the_check_run_is_created_once_then_updated(fake):
    gh = client(fake)
    first = gh.upsert_check_run(HEAD, conclusion=None, title="queued", summary="waiting")
    second = gh.upsert_check_run(HEAD, conclusion="failure", title="muse_bf16_proj: INCORRECT", summary="s" * 70_000,
                                 details_url="https://github.com/muse-competition/pipeline/actions/runs/5")
    assert first == (1001, True) and second == (1001, False)
    post, patch = fake.bodies("POST")[0], fake.bodies("PATCH")[0]
    assert post == {"name": "evaluation", "head_sha": HEAD, "status": "in_progress",
                    "output": {"title": "queued", "summary": "waiting"}}
    assert patch["status"] == "completed" and patch["conclusion"] == "failure"
    assert len(patch["output"]["summary"]) == 65_535  # GitHub's limit for a check run's summary
    assert patch["details_url"].endswith("/runs/5") and patch["completed_at"].endswith("Z")
    assert [c["id"] for c in fake.check_runs] == [1001]


# ---- bench.yml ----

def test_dispatch_sends_the_inputs_and_returns_the_run(fake):
    gh = client(fake)
    inputs = {"pr": "7", "head_sha": HEAD, "login": "bob", "track": "kernel", "problem": "muse_bf16_proj",
              "path": "submissions/kernel/muse_bf16_proj/bob/submission.py", "blob_sha": blob_sha(b"x"),
              "gate_run": "42"}
    run = gh.dispatch_bench(inputs)
    assert fake.requests() == [f"POST {R}/actions/workflows/bench.yml/dispatches"]
    assert fake.bodies("POST") == [{"ref": "main", "inputs": inputs, "return_run_details": True}]
    assert (run.id, run.pr, run.login, run.head_sha) == (1001, 7, "bob", HEAD)
    assert run.html_url.endswith("/actions/runs/1001")
    with pytest.raises(GitHubError, match="no input"):
        gh.dispatch_bench({"pr": "7", "ref": "evil"})


def test_a_dispatch_whose_answer_was_lost_is_found_not_repeated(fake):
    fake.fail("POST", rf"{R}/actions/workflows/bench\.yml/dispatches", 500, after=True)
    run = client(fake).dispatch_bench({"pr": "7", "head_sha": HEAD, "login": "bob"})
    assert len(fake.dispatches) == 1 and run.head_sha == HEAD and run.pr == 7
    assert fake.requests()[1].startswith(f"GET {R}/actions/workflows/bench.yml/runs?created=%3E%3D")


def test_a_server_without_run_details_still_dispatches(fake):
    fake.run_details = False
    assert client(fake).dispatch_bench({"pr": "7", "head_sha": HEAD, "login": "bob"}) is None
    assert len(fake.dispatches) == 1


def test_bench_runs_are_read_by_their_title_across_pages(httpserver):
    fake = FakeGitHub(httpserver, page_size=2)
    now = dt.datetime(2026, 10, 25, 12, 0, tzinfo=dt.timezone.utc)
    for i in range(5):
        at = (now - dt.timedelta(minutes=10 * i)).strftime("%Y-%m-%dT%H:%M:%SZ")
        fake.add_run(BENCH_TITLE.format(pr=7 + i, login="bob" if i % 2 == 0 else "alice",
                                        head_sha=fake_sha("h", i)), at)
    fake.add_run("bench", "2026-10-25T11:59:00Z")  # a run named by hand: counted for nobody
    fake.add_run(BENCH_TITLE.format(pr=1, login="bob", head_sha=fake_sha("old")), "2026-10-25T10:30:00Z")
    runs = client(fake).bench_runs(now - dt.timedelta(hours=1))
    assert sorted((r.login, r.pr) for r in runs if r.login) == [
        ("alice", 8), ("alice", 10), ("bob", 7), ("bob", 9), ("bob", 11)]
    query = "created=%3E%3D2026-10-25T11%3A00%3A00Z&event=workflow_dispatch"
    assert fake.requests() == [  # the next pages as their Link headers name them
        f"GET {R}/actions/workflows/bench.yml/runs?{query}&per_page=100",
        f"GET {R}/actions/workflows/bench.yml/runs?{query}&page=2&per_page=100",
        f"GET {R}/actions/workflows/bench.yml/runs?{query}&page=3&per_page=100",
    ]
