"""The verbs the workflows call, driven by fixture event payloads against a GitHub-shaped server:
`gate` (gate.yml), `fetch-submission` (bench.yml), `post-result` (report.yml), `validate --event`
(validate.yml)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline import signing
from pipeline.__main__ import main
from github_fake import FakeGitHub, blob_sha, fake_sha
from ledger_factory import FOREIGN_KEY, TEST_KEY, resign, result_doc, write_keyring, write_private_key

EVENTS = Path(__file__).resolve().parent / "fixtures" / "events"
R = "/repos/muse-competition/pipeline"
SUB = (b'import torch\n\n\ndef custom_kernel(inputs):\n    x, w = inputs["x"], inputs["w"]\n'
       b'    return (x.float() @ w.float().T).to(torch.bfloat16)\n')
README = b"# bob: fp32 matmul\n"
FOLDER = "submissions/kernel/muse_bf16_proj/bob"
NOW = "2026-10-25T12:00:00Z"


def event(name: str) -> dict:
    return json.loads((EVENTS / name).read_text())


HEAD = event("pull_request_target.labeled.json")["pull_request"]["head"]["sha"]


@pytest.fixture
def fake(httpserver, monkeypatch):
    fake = FakeGitHub(httpserver)
    for k, v in fake.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("GITHUB_RUN_ID", "4242")
    monkeypatch.delenv("GITHUB_EVENT_PATH", raising=False)
    fake.roles.update(carol="maintain", dave="triage")
    return fake


def open_pr(fake: FakeGitHub, files: dict[str, tuple[str, bytes]] | None = None, labels=("run-eval",), head=HEAD):
    files = files if files is not None else {f"{FOLDER}/submission.py": ("100644", SUB),
                                            f"{FOLDER}/README.md": ("100644", README)}
    fake.add_commit(files, sha=head)
    return fake.add_pull(7, "bob", head, [{"filename": p, "status": "added"} for p in files], labels=labels)


def write_event(tmp_path: Path, name: str, **changes) -> Path:
    data = event(name)
    for dotted, value in changes.items():
        node = data
        keys = dotted.split("__")
        for k in keys[:-1]:
            node = node[k]
        node[keys[-1]] = value
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


def gate(tmp_path: Path, event_path: Path, *extra: str) -> int:
    return main(["gate", "--event", str(event_path), "--now", NOW, "--record", str(tmp_path / "record.json"), *extra])


def tree_walk(fake: FakeGitHub, head: str, folder: str = FOLDER) -> list[str]:
    shas = [head]
    for part in folder.split("/"):
        shas.append(next(e["sha"] for e in fake.trees[shas[-1]] if e["path"] == part))
    return [f"GET {R}/git/trees/{s}" for s in shas]


def test_the_fixture_payloads_are_what_the_tests_assume():
    d = event("workflow_dispatch.bench.json")["inputs"]
    assert d["blob_sha"] == blob_sha(SUB) and d["head_sha"] == HEAD
    assert "$(curl" in event("pull_request_target.labeled.json")["pull_request"]["title"]  # hostile text is data


# ---- gate ----

def test_a_maintainers_label_dispatches_the_exact_commit_and_blob(fake, tmp_path, capsys):
    open_pr(fake)
    assert gate(tmp_path, EVENTS / "pull_request_target.labeled.json") == 0
    inputs = {"pr": "7", "head_sha": HEAD, "login": "bob", "track": "kernel", "problem": "muse_bf16_proj",
              "path": f"{FOLDER}/submission.py", "blob_sha": blob_sha(SUB), "gate_run": "4242"}
    assert fake.dispatches == [{"ref": "main", "inputs": inputs, "return_run_details": True}]
    assert fake.requests() == [
        f"GET {R}/collaborators/carol/permission",
        f"GET {R}/pulls/7",
        f"GET {R}/actions/workflows/bench.yml/runs?created=%3E%3D2026-10-25T11%3A00%3A00Z&event=workflow_dispatch"
        "&per_page=100",
        f"GET {R}/pulls/7/files?per_page=100",
        *tree_walk(fake, HEAD),
        f"GET {R}/git/blobs/{blob_sha(SUB)}",
        f"GET {R}/git/blobs/{blob_sha(README)}",
        f"GET {R}/pulls/7",  # the head is read again right before the dispatch
        f"POST {R}/actions/workflows/bench.yml/dispatches",
        f"GET {R}/issues/7/comments?per_page=100",
        f"POST {R}/issues/7/comments",
    ]
    record = json.loads((tmp_path / "record.json").read_text())
    assert record["approved_by"] == "carol" and record["pr"] == 7 and record["head_sha"] == HEAD
    assert record["blob_shas"] == {f"{FOLDER}/submission.py": blob_sha(SUB), f"{FOLDER}/README.md": blob_sha(README)}
    assert record["bench_run"]["url"].endswith("/actions/runs/1001")
    body = fake.comments[7][0]["body"]
    assert "Submission check: valid" in body and "Queued" in body and "/actions/runs/1001" in body
    assert "dispatched bench.yml" in capsys.readouterr().out


def test_a_label_from_someone_without_write_access_is_removed(fake, tmp_path, capsys):
    open_pr(fake)
    path = write_event(tmp_path, "pull_request_target.labeled.json", sender={"login": "dave"})
    assert gate(tmp_path, path) == 1
    assert fake.requests() == [f"GET {R}/collaborators/dave/permission", f"DELETE {R}/issues/7/labels/run-eval"]
    assert not fake.dispatches
    assert "@dave (triage) cannot approve" in capsys.readouterr().err


def test_a_push_between_review_and_label_is_not_evaluated(fake, tmp_path, capsys):
    open_pr(fake, head=fake_sha("pushed-after-review"))
    assert gate(tmp_path, EVENTS / "pull_request_target.labeled.json") == 1
    assert not fake.dispatches
    assert f"DELETE {R}/issues/7/labels/run-eval" in fake.requests()
    assert "label it again" in fake.comments[7][0]["body"]
    assert "label it again" in capsys.readouterr().err


def test_a_push_while_the_gate_reads_the_files_is_not_evaluated(fake, tmp_path, capsys):
    open_pr(fake)
    moved = dict(fake.pulls[7], head=dict(fake.pulls[7]["head"], sha=fake_sha("pushed-during-the-gate")))
    serve = fake._route

    def route(method, path, query, body):  # the second read of the PR sees the new push
        if method == "GET" and path == f"{R}/pulls/7" and sum(e.target == path for e in fake.log) == 2:
            fake.pulls[7] = moved
        return serve(method, path, query, body)

    fake._route = route
    assert gate(tmp_path, EVENTS / "pull_request_target.labeled.json") == 1
    assert not fake.dispatches
    assert "a maintainer must review the new commit" in capsys.readouterr().err


def test_a_refused_pr_is_not_dispatched_and_loses_its_label(fake, tmp_path):
    open_pr(fake, {f"{FOLDER}/submission.py": ("120000", b"/etc/passwd"),
                   "leaderboard.md": ("100644", b"# mine now\n")})
    assert gate(tmp_path, EVENTS / "pull_request_target.labeled.json") == 1
    assert not fake.dispatches and not (tmp_path / "record.json").exists()
    body = fake.comments[7][0]["body"]
    assert "REFUSED (2 problems)" in body and "symlink" in body and "protected" in body
    assert f"DELETE {R}/issues/7/labels/run-eval" in fake.requests()
    assert not any("/git/blobs/" in r for r in fake.requests())  # a link is never read as content


def test_the_rate_limit_counts_the_authors_runs_of_the_last_hour(fake, tmp_path, capsys):
    open_pr(fake)
    for i in range(10):
        fake.add_run(f"bench #{100 + i} @bob {fake_sha('h', i)}", f"2026-10-25T11:{10 + i * 3:02d}:00Z")
    fake.add_run(f"bench #99 @alice {fake_sha('a')}", "2026-10-25T11:59:00Z")
    assert gate(tmp_path, EVENTS / "pull_request_target.labeled.json") == 1
    assert not fake.dispatches
    out = capsys.readouterr().out
    assert "[rate-limit]" in out and "10 evaluations in the last hour" in out and "12:10 UTC" in out


def test_a_new_push_drops_the_label_and_updates_the_same_comment(fake, tmp_path):
    open_pr(fake)
    fake.add_comment(7, "<!-- muse-pipeline:sticky-result -->\n### muse_bf16_proj: PASSED", fake.bot)
    assert gate(tmp_path, EVENTS / "pull_request_target.synchronize.json") == 0
    assert not fake.dispatches
    assert fake.requests()[:2] == [f"GET {R}/pulls/7", f"DELETE {R}/issues/7/labels/run-eval"]
    assert fake.requests()[-2:] == [f"GET {R}/issues/7/comments?per_page=100", f"PATCH {R}/issues/comments/1001"]
    assert len(fake.comments[7]) == 1
    assert "Waiting for a maintainer to review commit" in fake.comments[7][0]["body"]
    assert fake.pulls[7]["labels"] == []


def test_an_opened_pr_gets_its_verdict_within_the_same_run(fake, tmp_path):
    open_pr(fake, labels=())
    assert gate(tmp_path, EVENTS / "pull_request_target.opened.json") == 0
    assert not fake.dispatches and not any(r.startswith("DELETE") for r in fake.requests())
    assert "Submission check: valid" in fake.comments[7][0]["body"]


def test_auto_mode_dispatches_a_valid_push_without_a_label(fake, tmp_path):
    open_pr(fake, labels=())
    assert gate(tmp_path, EVENTS / "pull_request_target.synchronize.json", "--auto") == 0
    assert len(fake.dispatches) == 1
    record = json.loads((tmp_path / "record.json").read_text())
    assert record["auto"] is True and record["approved_by"] is None


def test_a_second_label_on_the_same_commit_does_not_dispatch_twice(fake, tmp_path):
    open_pr(fake)
    assert gate(tmp_path, EVENTS / "pull_request_target.labeled.json") == 0
    assert gate(tmp_path, EVENTS / "pull_request_target.labeled.json") == 0
    assert len(fake.dispatches) == 1
    assert "Already queued" in fake.comments[7][0]["body"] and len(fake.comments[7]) == 1


@pytest.mark.parametrize("changes", [{"label": {"name": "bug"}}, {"action": "edited"}, {"action": "closed"}])
def test_other_events_do_nothing_at_all(fake, tmp_path, changes):
    path = write_event(tmp_path, "pull_request_target.labeled.json", **changes)
    assert gate(tmp_path, path) == 0
    assert fake.log == []


@pytest.mark.parametrize("field,value", [("state", "closed"), ("base", {"ref": "release", "sha": fake_sha("r")})])
def test_a_closed_pr_or_one_into_another_branch_is_not_evaluated(fake, tmp_path, field, value):
    open_pr(fake)
    fake.pulls[7][field] = value
    assert gate(tmp_path, EVENTS / "pull_request_target.labeled.json") == 1
    assert not fake.dispatches and not fake.comments


# ---- fetch-submission ----

def fetch(tmp_path: Path, *extra: str) -> int:
    dest = tmp_path / "checkout"
    dest.mkdir(exist_ok=True)
    return main(["fetch-submission", "--dest", str(dest), "--meta", str(tmp_path / "meta.json"), *extra])


def test_the_exact_blob_is_fetched_verified_and_written(fake, tmp_path):
    fake.blobs[blob_sha(SUB)] = SUB
    assert fetch(tmp_path, "--event", str(EVENTS / "workflow_dispatch.bench.json")) == 0
    assert (tmp_path / "checkout" / FOLDER / "submission.py").read_bytes() == SUB
    assert fake.requests() == [f"GET {R}/git/blobs/{blob_sha(SUB)}"]
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert meta == {"pr": 7, "head_sha": HEAD, "login": "bob", "track": "kernel", "problem": "muse_bf16_proj",
                    "path": f"{FOLDER}/submission.py", "blob_sha": blob_sha(SUB)}


def test_bytes_that_do_not_hash_to_the_recorded_sha_are_refused(fake, tmp_path, capsys):
    fake.blobs[blob_sha(SUB)] = SUB.replace(b"float()", b"half()")
    assert fetch(tmp_path, "--event", str(EVENTS / "workflow_dispatch.bench.json")) == 1
    assert "hash to" in capsys.readouterr().err
    assert not (tmp_path / "checkout" / FOLDER).exists()


@pytest.mark.parametrize("override,message", [
    (["--path", "pipeline/cli.py"], "not a submission of @bob"),
    (["--path", "submissions/kernel/muse_bf16_proj/alice/submission.py"], "not a submission of @bob"),
    (["--path", f"{FOLDER}/../../../../.github/workflows/x.yml"], "not a submission of @bob"),
    (["--blob-sha", "HEAD"], "is not a 40-hex-digit SHA"),
    (["--problem", "muse_moe_w4a16"], "does not match the path's"),
    (["--pr", "0"], "is not a pull request number"),
])
def test_inputs_that_name_anything_else_are_refused_before_any_request(fake, tmp_path, capsys, override, message):
    assert fetch(tmp_path, "--event", str(EVENTS / "workflow_dispatch.bench.json"), *override) == 1
    assert message in capsys.readouterr().err
    assert fake.log == []


def test_a_link_in_the_checkout_is_never_written_through(fake, tmp_path, capsys):
    fake.blobs[blob_sha(SUB)] = SUB
    dest = tmp_path / "checkout"
    (dest / "submissions" / "kernel" / "muse_bf16_proj").mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    (dest / FOLDER).symlink_to(tmp_path / "outside")
    assert fetch(tmp_path, "--event", str(EVENTS / "workflow_dispatch.bench.json")) == 1
    assert list((tmp_path / "outside").iterdir()) == []
    assert "not a directory in the checkout" in capsys.readouterr().err


def test_an_existing_file_is_replaced_not_written_through(fake, tmp_path):
    fake.blobs[blob_sha(SUB)] = SUB
    dest = tmp_path / "checkout"
    (dest / FOLDER).mkdir(parents=True)
    victim = tmp_path / "victim"
    victim.write_text("untouched")
    (dest / FOLDER / "submission.py").symlink_to(victim)
    assert fetch(tmp_path, "--event", str(EVENTS / "workflow_dispatch.bench.json")) == 0
    assert victim.read_text() == "untouched"
    assert not (dest / FOLDER / "submission.py").is_symlink()


# ---- post-result ----

@pytest.fixture
def key_file(tmp_path, monkeypatch):
    """The keyring post-result verifies against: the test runner's public key only (no private key is
    anywhere near report.yml)."""
    monkeypatch.delenv(signing.KEY_ENV, raising=False)
    ring = write_keyring(tmp_path / "keyring", TEST_KEY)
    monkeypatch.setenv(signing.KEYRING_ENV, str(ring))
    return ring


def write_result(tmp_path: Path, doc: dict) -> Path:
    path = tmp_path / "artifact" / "result.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(doc))
    return path


def post(path: Path | None, event_name: str = "workflow_run.bench_completed.json") -> int:
    args = ["post-result", "--event", str(EVENTS / event_name)]
    return main(args + (["--result", str(path)] if path else []))


def test_a_signed_result_becomes_the_comment_and_the_check_run(fake, tmp_path, key_file, capsys):
    open_pr(fake)
    fake.add_comment(7, "<!-- muse-pipeline:sticky-result -->\nQueued", fake.bot)
    doc = result_doc(login="bob", pr=7, head_sha=HEAD, speedup=1.25)
    assert post(write_result(tmp_path, doc)) == 0
    assert fake.requests() == [
        f"GET {R}/commits/{HEAD}/pulls?per_page=100",
        f"GET {R}/pulls/7",
        f"GET {R}/issues/7/comments?per_page=100",
        f"PATCH {R}/issues/comments/1001",
        f"GET {R}/commits/{HEAD}/check-runs?check_name=evaluation&per_page=100",
        f"POST {R}/check-runs",
    ]
    body = fake.comments[7][0]["body"]
    assert "PASSED" in body and "/actions/runs/9100" in body and len(fake.comments[7]) == 1
    assert "Would-be rank on the current board: 1 of 1" in body  # the repository's ledger holds no result yet
    check = fake.check_runs[0]
    assert (check["head_sha"], check["status"], check["conclusion"]) == (HEAD, "completed", "success")
    assert check["output"]["title"] == "muse_bf16_proj: PASSED, 1.250x"
    assert check["details_url"].endswith("/actions/runs/9100")
    assert "updated comment 1001 on #7" in capsys.readouterr().out
    assert post(write_result(tmp_path, doc)) == 0  # a re-run of report.yml changes nothing
    assert len(fake.comments[7]) == 1 and len(fake.check_runs) == 1


@pytest.mark.parametrize("status,conclusion", [("incorrect", "failure"), ("timeout", "failure"),
                                               ("needs_review", "neutral"), ("rejected", "failure")])
def test_each_status_maps_to_a_check_conclusion(fake, tmp_path, key_file, status, conclusion):
    open_pr(fake)
    doc = result_doc(login="bob", pr=7, head_sha=HEAD, status=status)
    assert post(write_result(tmp_path, doc)) == 0
    assert fake.check_runs[0]["conclusion"] == conclusion


@pytest.mark.parametrize("tamper,message", [
    (lambda d: d.update(signature=None), "not signed"),
    (lambda d: d["score"].update(speedup=9.0, interval=[8.9, 9.1]), "changed after signing"),
    (lambda d: d["submission"].update(pr=8), "changed after signing"),
    (lambda d: d.update(signature={"alg": "hmac-sha256", "key_id": "0" * 16, "mac": "0" * 64}), "not signed"),
    (lambda d: d["signature"].update(alg="hmac-sha256"), "unknown signature"),
    (lambda d: d.update(signature=resign({**d, "signature": None}, FOREIGN_KEY)["signature"]), "not a runner key"),
    (lambda d: d.update(status="great"), "does not match result.schema.json"),
])
def test_a_tampered_or_unsigned_result_posts_nothing(fake, tmp_path, key_file, capsys, tamper, message):
    open_pr(fake)
    doc = result_doc(login="bob", pr=7, head_sha=HEAD)
    tamper(doc)
    assert post(write_result(tmp_path, doc)) == 1
    assert message in capsys.readouterr().err
    assert fake.log == []  # refused before GitHub is even asked


def test_a_result_is_not_posted_where_it_does_not_belong(fake, tmp_path, key_file, capsys):
    open_pr(fake)
    assert post(write_result(tmp_path, result_doc(login="bob", pr=8, head_sha=HEAD))) == 1
    assert "is for #8, but commit" in capsys.readouterr().err
    assert post(write_result(tmp_path, result_doc(login="alice", pr=7, head_sha=HEAD))) == 1
    assert "is for @alice, but #7 is by @bob" in capsys.readouterr().err
    assert post(write_result(tmp_path, result_doc(login="bob", pr=7, head_sha=fake_sha("unknown")))) == 1
    assert not fake.comments and not fake.check_runs


def test_a_result_that_is_a_link_or_not_json_is_refused(fake, tmp_path, key_file, capsys):
    target = tmp_path / "secret"
    target.write_text("{}")
    link = tmp_path / "artifact" / "result.json"
    link.parent.mkdir()
    link.symlink_to(target)
    assert post(link) == 1
    assert "not a regular file" in capsys.readouterr().err
    link.unlink()
    link.write_text("{not json")
    assert post(link) == 1
    assert "not JSON" in capsys.readouterr().err
    assert fake.log == []


def test_a_broken_keyring_is_a_configuration_error(fake, tmp_path, monkeypatch, capsys):
    ring = tmp_path / "ring"
    ring.mkdir()
    (ring / "h200-a.pub").write_text("not a key\n")
    monkeypatch.setenv(signing.KEYRING_ENV, str(ring))
    open_pr(fake)
    assert post(write_result(tmp_path, result_doc(login="bob", pr=7, head_sha=HEAD))) == 2
    assert "h200-a.pub is not a PEM public key" in capsys.readouterr().err
    assert fake.log == []


def test_a_failed_bench_run_without_a_result_is_reported_on_its_pr(fake, tmp_path):
    open_pr(fake)
    assert post(None, "workflow_run.bench_failed.json") == 1
    body = fake.comments[7][0]["body"]
    assert "no result" in body and "/actions/runs/9101" in body
    assert fake.check_runs[0]["conclusion"] == "failure" and fake.check_runs[0]["head_sha"] == HEAD


# ---- validate.yml ----

def test_validate_reads_the_pr_of_a_pull_request_event(fake, tmp_path, capsys):
    open_pr(fake, labels=())
    summary = tmp_path / "summary.md"
    code = main(["validate", "--event", str(EVENTS / "pull_request.opened.json"), "--markdown", str(summary)])
    assert code == 0
    assert "valid: submissions/kernel/muse_bf16_proj/bob/submission.py" in capsys.readouterr().out
    assert "Submission check: valid" in summary.read_text()
    assert not any(r.startswith(("POST", "PATCH", "DELETE")) for r in fake.requests())  # read-only


def test_github_failures_are_messages_with_the_usage_exit_code(fake, capsys):
    assert main(["validate", "--pr", "99"]) == 2
    err = capsys.readouterr().err
    assert "reading pull request #99: GitHub answered 404" in err and "Traceback" not in err


def test_verbs_without_a_repository_say_so(monkeypatch, capsys):
    monkeypatch.delenv("GITHUB_REPOSITORY", raising=False)
    assert main(["validate", "--pr", "1"]) == 2
    assert "$GITHUB_REPOSITORY" in capsys.readouterr().err


# ---- ledger.yml ----

def test_find_result_reads_merged_at_and_the_bench_runs_over_http(fake, tmp_path, capsys):
    fake.add_pull(7, "bob", HEAD, [], state="closed", merged_at="2026-10-23T09:15:02Z")
    fake.add_run(f"bench #7 @bob {fake_sha('earlier-head')}", "2026-10-23T08:00:00Z")
    run = fake.add_run(f"bench #7 @bob {HEAD}", "2026-10-23T09:00:00Z")
    out = tmp_path / "github_output"
    assert main(["find-result", "--pr", "7", "--output", str(out)]) == 0
    facts = dict(line.split("=", 1) for line in out.read_text().splitlines())
    assert facts == {"pr": "7", "login": "bob", "head_sha": HEAD, "merged_at": "2026-10-23T09:15:02Z",
                     "run_id": str(run["id"])}
    assert fake.requests()[0] == f"GET {R}/pulls/7"


# ---- a serving PR, through every verb (the same as a kernel PR's) ----

SERVING_PATH = "submissions/serving/bob/patch.diff"


def serving_patch() -> bytes:
    """The real, valid patch inside tests/fixtures/serving/valid_serving_pr.diff (a PR adding it): what bob's
    serving PR adds. tests/serving/test_gate.py keeps that fixture current with the pinned tree."""
    pr_diff = (EVENTS.parent / "serving" / "valid_serving_pr.diff").read_bytes().split(b"\n")
    start = next(i for i, line in enumerate(pr_diff) if line.startswith(b"@@ "))
    return b"\n".join(line[1:] for line in pr_diff[start + 1:] if line.startswith(b"+")) + b"\n"


PATCH = serving_patch()
SERVING_HEAD = event("pull_request_target.labeled.serving.json")["pull_request"]["head"]["sha"]


def open_serving_pr(fake: FakeGitHub, patch: bytes = PATCH) -> dict:
    fake.add_commit({SERVING_PATH: ("100644", patch)}, sha=SERVING_HEAD)
    return fake.add_pull(8, "bob", SERVING_HEAD, [{"filename": SERVING_PATH, "status": "added"}], labels=("run-eval",))


def test_the_serving_fixture_payloads_are_what_the_tests_assume():
    d = event("workflow_dispatch.bench.serving.json")["inputs"]
    assert (d["track"], d["problem"], d["path"]) == ("serving", "", SERVING_PATH)
    assert d["blob_sha"] == blob_sha(PATCH) and d["head_sha"] == SERVING_HEAD
    assert f"index 0000000000000000000000000000000000000000..{blob_sha(PATCH)}".encode() in (
        EVENTS.parent / "serving" / "valid_serving_pr.diff").read_bytes()
    run = event("workflow_run.bench_serving_completed.json")["workflow_run"]
    assert run["display_title"] == f"bench #8 @bob {SERVING_HEAD}" and run["id"] == 9200
    assert "$(curl" in event("pull_request_target.labeled.serving.json")["pull_request"]["title"]


@pytest.fixture
def _plain_git(monkeypatch, tmp_path_factory):
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(tmp_path_factory.mktemp("gitconfig") / "none"))
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    for who in ("AUTHOR", "COMMITTER"):
        monkeypatch.setenv(f"GIT_{who}_NAME", "test")
        monkeypatch.setenv(f"GIT_{who}_EMAIL", "test@example.invalid")
    monkeypatch.delenv("PIPELINE_PUSH_TOKEN", raising=False)


def test_a_serving_pr_from_the_label_to_the_board(fake, tmp_path, key_file, _plain_git, capsys):
    """gate (the patch gated against the pinned SGLang, bench dispatched as track serving) -> fetch-submission
    (the patch's exact blob) -> the serving job's result, as `serving evaluate` writes it, for that blob ->
    sign (bound to the dispatch: problem serving) -> post-result (the per-concurrency table, the plot) ->
    merge -> publish reconcile (the ledger records it, the serving board ranks it)."""
    from fixtures.serving_results import factory as sf
    from ledger_factory import bare_origin, clone, git
    from pipeline import ledger as lg, report

    open_serving_pr(fake)
    assert gate(tmp_path, EVENTS / "pull_request_target.labeled.serving.json") == 0, capsys.readouterr().err
    (dispatch,) = fake.dispatches
    inputs = dispatch["inputs"]
    assert inputs == {**event("workflow_dispatch.bench.serving.json")["inputs"], "gate_run": "4242"}
    assert f"GET {R}/git/blobs/{blob_sha(PATCH)}" in fake.requests()
    assert "Submission check: valid" in fake.comments[8][0]["body"] and "Queued" in fake.comments[8][0]["body"]
    record = json.loads((tmp_path / "record.json").read_text())
    assert record["track"] == "serving" and record["blob_shas"] == {SERVING_PATH: blob_sha(PATCH)}

    # bench.yml's serving job: the dispatch's inputs are its event
    dispatched = tmp_path / "dispatch.json"
    dispatched.write_text(json.dumps({**event("workflow_dispatch.bench.serving.json"), "inputs": inputs}))
    assert fetch(tmp_path, "--event", str(dispatched)) == 0
    assert (tmp_path / "checkout" / SERVING_PATH).read_bytes() == PATCH
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert meta == {"pr": 8, "head_sha": SERVING_HEAD, "login": "bob", "track": "serving", "problem": None,
                    "path": SERVING_PATH, "blob_sha": blob_sha(PATCH)}
    doc = sf.serving_result(t=1.21, i=1.08, login="bob", pr=8, head_sha=SERVING_HEAD, sign=False)
    doc["submission"]["blob_sha"] = meta["blob_sha"]
    unsigned, signed = tmp_path / "unsigned.json", tmp_path / "signed" / "result.json"
    unsigned.write_text(json.dumps(doc))
    signed.parent.mkdir()
    key = write_private_key(tmp_path / "signer.key")  # the signer host's; post-result below sees only the keyring
    assert main(["sign", str(unsigned), "--out", str(signed), "--key-file", str(key), "--pr", inputs["pr"],
                 "--head-sha", inputs["head_sha"], "--login", inputs["login"], "--blob-sha", inputs["blob_sha"],
                 "--problem", "serving"]) == 0, capsys.readouterr().err
    plot = tmp_path / "plot.png"
    assert main(["plot-result", str(signed), "--out", str(plot)]) == 0

    # report.yml: the bench run (9200) holds the signed result and the plot
    run = fake.add_run(f"bench #8 @bob {SERVING_HEAD}", "2026-11-05T09:00:00Z")
    fake.runs[-1].update(id=9200, html_url="https://github.com/muse-competition/pipeline/actions/runs/9200")
    fake.add_artifact(9200, "result", {"result.json": signed.read_bytes()})
    plot_artifact = fake.add_artifact(9200, "serving-plot", {report.PLOT_NAME: plot.read_bytes()})
    assert post(signed, "workflow_run.bench_serving_completed.json") == 0, capsys.readouterr().err
    body = fake.comments[8][0]["body"]
    assert len(fake.comments[8]) == 1, "the gate's sticky comment, updated"
    assert "### serving: PASSED" in body and "| 1   | 18.5" in body and "**Score S = 1.143" in body
    assert "```text\nT_c (tokens/s/GPU)" in body
    assert f"(https://github.com/muse-competition/pipeline/actions/runs/9200/artifacts/{plot_artifact['id']})" in body
    check = fake.check_runs[0]
    assert (check["head_sha"], check["conclusion"]) == (SERVING_HEAD, "success")
    assert check["output"]["title"] == "serving: PASSED, S = 1.143"

    # merged: ledger.yml's reconcile records it and the serving board ranks it
    fake.merge(8, "2026-10-24T10:00:00Z")  # inside the test competition's serving track
    assert run["id"] == 9200
    origin = bare_origin(tmp_path)
    work = clone(origin, tmp_path / "work")
    assert main(["publish", "reconcile", "--repo", str(work), "--now", "2026-10-24T12:00:00Z", "--no-plots",
                 "--backoff", "0"]) == 0, capsys.readouterr().err
    assert "recorded 1 merged PR (#8)" in capsys.readouterr().out
    check_out = clone(origin, tmp_path / "check")
    (rec,) = lg.verify(check_out)
    assert (rec["track"], rec["problem"], rec["pr"], rec["blob_sha"]) == ("serving", "serving", 8, blob_sha(PATCH))
    board = (check_out / "leaderboard.md").read_text()
    serving = board[board.index("## Serving track"):]
    assert "| 1 | [@bob](https://github.com/bob) | 1.143 |" in serving and "/pull/8)" in serving
    assert git(origin, "log", "-1", "--format=%s", "main") == "ledger: record #8 (reconcile)"


def test_validate_reads_a_serving_pr_and_gates_its_patch(fake, tmp_path, capsys):
    """validate.yml's verb through the API (`validate --event`): the serving PR's patch.diff read from its
    blob and gated against the pinned SGLang, read-only."""
    open_serving_pr(fake)
    path = write_event(tmp_path, "pull_request.opened.json", pull_request__number=8)
    out = tmp_path / "verdict.json"
    assert main(["validate", "--event", str(path), "--json", str(out)]) == 0, capsys.readouterr().err
    verdict = json.loads(out.read_text())
    assert verdict["submission"]["track"] == "serving" and verdict["submission"]["path"] == SERVING_PATH
    assert verdict["patch_gate"]["accepted"] and verdict["patch_gate"]["files"] == ["python/sglang/srt/layers/activation.py"]
    assert not any(r.startswith(("POST", "PATCH", "DELETE")) for r in fake.requests())


def test_a_serving_pr_whose_patch_the_gate_refuses_is_not_dispatched(fake, tmp_path):
    """The gate runs the patch rules on the blob it reads through the API, as validate does: a patch of a
    denied file (the sampler) is refused with its rule, the label removed, nothing dispatched."""
    hostile = PATCH.replace(b"srt/layers/activation.py", b"srt/layers/sampler.py")
    open_serving_pr(fake, hostile)
    assert gate(tmp_path, EVENTS / "pull_request_target.labeled.serving.json") == 1
    assert not fake.dispatches and f"DELETE {R}/issues/8/labels/run-eval" in fake.requests()
    from pipeline.report import md_escape

    body = fake.comments[8][0]["body"]
    assert md_escape("patch-denied-path") in body and md_escape("sampler.py") in body and "Not queued" in body


def test_the_sign_job_signs_only_the_serving_result_the_serving_dispatch_asked_for(tmp_path, capsys):
    """bench.yml passes --problem serving for a serving dispatch: a kernel result for the same PR, head,
    login and blob is refused, nothing written; so is a serving result of another blob."""
    from fixtures.serving_results import factory as sf

    d = event("workflow_dispatch.bench.serving.json")["inputs"]
    bound = ["--pr", d["pr"], "--head-sha", d["head_sha"], "--login", d["login"], "--blob-sha", d["blob_sha"],
             "--problem", "serving"]
    kernel = result_doc(login="bob", pr=8, head_sha=SERVING_HEAD, official=True)
    kernel = {**kernel, "signature": None, "submission": {**kernel["submission"], "blob_sha": d["blob_sha"]}}
    src, out = tmp_path / "unsigned.json", tmp_path / "signed.json"
    src.write_text(json.dumps(kernel))
    assert main(["sign", str(src), "--out", str(out), *bound]) == 1
    assert "the result is for problem 'muse_bf16_proj', but the dispatch named 'serving'" in capsys.readouterr().err
    other = sf.serving_result(login="bob", pr=8, head_sha=SERVING_HEAD, sign=False)
    src.write_text(json.dumps(other))
    assert main(["sign", str(src), "--out", str(out), *bound]) == 1
    assert "submission blob_sha" in capsys.readouterr().err and not out.exists()


def test_a_gated_serving_result_is_posted_with_why_and_its_merge_records_nothing(fake, tmp_path, key_file,
                                                                                 _plain_git, capsys):
    """G = 0 (the canaries disagree): the comment says which part failed and that merging records nothing; the
    check fails; merged anyway, the reconcile says why it records nothing and the board stays empty."""
    from ledger_factory import bare_origin, clone

    open_serving_pr(fake)
    doc = result_doc(track="serving", status="incorrect", login="bob", pr=8, head_sha=SERVING_HEAD, speedup=1.6)
    path = write_result(tmp_path, doc)
    assert post(path, "workflow_run.bench_serving_completed.json") == 0
    body = fake.comments[8][0]["body"]
    assert "### serving: INCORRECT" in body and "**Correctness gate: G = 0**" in body and "FAILED" in body
    assert "never recorded in the ledger nor ranked on the serving board, even if the pull request is merged" in body
    assert fake.check_runs[0]["conclusion"] == "failure" and fake.check_runs[0]["output"]["title"] == "serving: INCORRECT"
    fake.add_run(f"bench #8 @bob {SERVING_HEAD}", "2026-10-24T09:00:00Z")
    fake.add_artifact(fake.runs[-1]["id"], "result", {"result.json": path.read_bytes()})
    fake.merge(8, "2026-10-24T10:00:00Z")
    work = clone(bare_origin(tmp_path), tmp_path / "work")
    assert main(["publish", "reconcile", "--repo", str(work), "--now", "2026-10-24T12:00:00Z", "--no-plots",
                 "--backoff", "0"]) == 0
    err = capsys.readouterr().err
    assert "#8 was merged although its evaluation" in err and "its correctness gate failed (G = 0, so S = 0)" in err
