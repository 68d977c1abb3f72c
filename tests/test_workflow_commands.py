"""Every `python -m pipeline ...` step of .github/workflows/*.yml, run as the runner runs it: the step's own
script from the YAML, as a process of its own, with the workflow's arguments and env: (tests/workflow_steps.py),
against the GitHub stand-in (tests/github_fake.py, real HTTP) and a real bare repository; each test asserts
what the step changed in the world (the dispatch, the comment, the file written, the remote's ledger), not
only its exit code. The steps that need the runner's GPU or the serving node are run here as a CPU machine
runs them (they refuse, clearly, and write nothing); a `gpu` test runs the kernel job's steps for real.

tests/test_github_flow.py drives the same verbs in-process for their many cases; this file is the proof
that the commands the workflows hold, spelled as they hold them, do what those tests say."""

from __future__ import annotations

import ast
import json
import re
import subprocess
from pathlib import Path

import pytest

from github_fake import FakeGitHub, blob_sha, fake_sha
from test_github_flow import _plain_git  # noqa: F401 - a fixture: git without this machine's configuration
from ledger_factory import TEST_KEY, bare_origin, clone, git, raw, result_doc, write_private_key
from workflow_steps import Job, pipeline_steps, step, steps

ROOT = Path(__file__).resolve().parents[1]
EVENTS = ROOT / "tests" / "fixtures" / "events"
SUB = (b'import torch\n\n\ndef custom_kernel(inputs):\n    x, w = inputs["x"], inputs["w"]\n'
       b'    return (x.float() @ w.float().T).to(torch.bfloat16)\n')
FOLDER = "submissions/kernel/muse_bf16_proj/bob"


def event(name: str) -> dict:
    return json.loads((EVENTS / name).read_text())


@pytest.fixture
def fake(httpserver):
    fake = FakeGitHub(httpserver)
    fake.roles.update(carol="maintain")
    return fake


def test_every_pipeline_step_of_the_workflows_is_run_by_a_test_here():
    """The steps named in this file's step(...) calls are exactly the workflows' pipeline steps: a new
    `python -m pipeline` step, or a renamed one, fails here until a test runs it."""
    tree = ast.parse(Path(__file__).read_text(encoding="utf-8"))
    named = {tuple(a.value for a in node.args) for node in ast.walk(tree)
             if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "step"
             and len(node.args) == 3 and all(isinstance(a, ast.Constant) for a in node.args)}
    found = {(s.workflow, s.job, s.name) for s in pipeline_steps()}
    assert len(found) >= 12
    missing = sorted(s for s in found if not any(s[:2] == n[:2] and s[2].startswith(n[2]) for n in named))
    assert not missing, "workflow steps that run `python -m pipeline` and no test here runs:\n  " + "\n  ".join(
        " / ".join(m) for m in missing)
    every = {(s.workflow, s.job, s.name) for wf in {n[0] for n in named} for s in steps(wf)}
    stale = sorted(n for n in named if not any(s[:2] == n[:2] and s[2].startswith(n[2]) for s in every))
    assert not stale, f"named here but no longer in the workflows: {stale}"


# ---- validate.yml ----

def _pr_checkout(job: Job, files: dict[str, bytes]) -> tuple[str, str]:
    """The `pr` checkout validate.yml makes (the PR's commits as data): a base commit and the PR's head."""
    pr = job.workspace / "pr"
    git(job.workspace, "init", "--quiet", "-b", "main", str(pr))
    for who in (("user.name", "bob"), ("user.email", "bob@example.invalid")):
        git(pr, "config", *who)
    (pr / "README.md").write_text("the competition\n")
    git(pr, "add", "-A")
    git(pr, "commit", "--quiet", "-m", "base")
    base = git(pr, "rev-parse", "HEAD")
    for rel, data in files.items():
        (pr / rel).parent.mkdir(parents=True, exist_ok=True)
        (pr / rel).write_bytes(data)
    git(pr, "add", "-A")
    git(pr, "commit", "--quiet", "-m", "my kernel")
    return base, git(pr, "rev-parse", "HEAD")


@pytest.mark.parametrize("files,code,expect", [
    ({f"{FOLDER}/submission.py": SUB}, 0, "valid"),
    ({f"{FOLDER}/submission.py": SUB, "competition.toml": b"# mine now\n"}, 1, "protected-path"),
])
def test_validate_yml_diffs_the_pr_and_writes_its_verdict(tmp_path, files, code, expect):
    job = Job(tmp_path, event("pull_request.opened.json"))
    base, head = _pr_checkout(job, files)
    job.event["pull_request"]["base"]["sha"], job.event["pull_request"]["head"]["sha"] = base, head
    job.event_path.write_text(json.dumps(job.event))
    (job.workspace / "harness").symlink_to(ROOT)  # the harness's checkout (the base commit's code)
    diff = job.run(step("validate.yml", "validate", "Diff the PR against its base"))
    assert diff.returncode == 0, diff.stderr
    assert f"+++ b/{FOLDER}/submission.py" in (job.temp / "pr.diff").read_text()
    done = job.run(step("validate.yml", "validate", "Validate"))
    assert done.returncode == code, done.stdout + done.stderr
    verdict = json.loads((job.temp / "verdict.json").read_text())
    summary = job.summary.read_text()
    if code == 0:
        assert verdict["submission"]["path"] == f"{FOLDER}/submission.py" and not verdict["violations"]
        assert "Submission check: valid" in summary
    else:
        assert [v["rule"] for v in verdict["violations"]] == [expect]
        assert expect in summary and "competition.toml" in summary


# ---- gate.yml ----

HEAD = event("pull_request_target.labeled.json")["pull_request"]["head"]["sha"]


def _open_pr(fake: FakeGitHub, labels=("run-eval",)) -> None:
    files = {f"{FOLDER}/submission.py": ("100644", SUB)}
    fake.add_commit(files, sha=HEAD)
    fake.add_pull(7, "bob", HEAD, [{"filename": p, "status": "added"} for p in files], labels=labels)


@pytest.mark.parametrize("name,auto,labels", [("pull_request_target.labeled.json", "", ("run-eval",)),
                                              ("pull_request_target.synchronize.json", "true", ())])
def test_gate_yml_dispatches_the_approved_head_and_says_so_on_the_pr(tmp_path, fake, name, auto, labels):
    _open_pr(fake, labels)
    job = Job(tmp_path, event(name), api=fake.env(), vars={"PIPELINE_AUTO_EVAL": auto} if auto else {})
    done = job.run(step("gate.yml", "gate", "Gate"))
    assert done.returncode == 0, done.stderr
    (dispatch,) = fake.dispatches
    assert dispatch["inputs"] | {"gate_run": None} == {
        "pr": "7", "head_sha": HEAD, "login": "bob", "track": "kernel", "problem": "muse_bf16_proj",
        "path": f"{FOLDER}/submission.py", "blob_sha": blob_sha(SUB), "gate_run": None}
    record = json.loads((job.temp / "gate-record.json").read_text())
    assert record["head_sha"] == HEAD and record["auto"] is bool(auto)
    assert "Queued" in fake.comments[7][0]["body"]


# ---- bench.yml ----

def _bench_job(tmp_path: Path, fake: FakeGitHub, name: str, data: bytes, **host_env: str) -> Job:
    dispatch = event(name)
    fake.blobs[dispatch["inputs"]["blob_sha"]] = data
    return Job(tmp_path, dispatch, api=fake.env(), host_env=host_env)


def test_bench_yml_kernel_job_fetches_the_exact_blob_and_a_cpu_host_refuses_the_rest(tmp_path, fake):
    """On the CPU the health check fails (no GPU: the job stops there on a real runner) and the official
    evaluation refuses to run (through the sudoers rule's command); the fetch writes the exact blob."""
    job = _bench_job(tmp_path, fake, "workflow_dispatch.bench.json", SUB)
    health = job.run(step("bench.yml", "evaluate", "Check the runner's health before"))
    assert health.returncode == 1 and "FAIL  gpu: this machine has no NVIDIA GPU" in health.stdout
    fetched = job.run(step("bench.yml", "evaluate", "Fetch the submission's exact blob"))
    assert fetched.returncode == 0, fetched.stderr
    assert (job.temp / "scratch" / FOLDER / "submission.py").read_bytes() == SUB
    assert json.loads((job.temp / "submission.json").read_text())["blob_sha"] == blob_sha(SUB)
    done = job.run(step("bench.yml", "evaluate", "Evaluate, officially"))
    # exit 2 (usage) is not a verdict: `|| [ "$?" -eq 1 ]` fails the step, and nothing is uploaded
    assert done.returncode != 0 and "refusing an official evaluation: an official evaluation needs a CUDA device" \
        in done.stderr, done.stderr
    assert not (job.temp / "result" / "result.json").exists()
    after = job.run(step("bench.yml", "evaluate", "Check the runner's health after"))
    assert after.returncode == 1 and "UNHEALTHY" in after.stdout + after.stderr


@pytest.mark.gpu
def test_bench_yml_kernel_job_evaluates_officially_on_a_gpu_runner(tmp_path, fake):
    """The kernel job's steps for real on a GPU host: health, the exact blob, the official evaluation (as
    root through the sudoers rule's command, the runner's seed secret from the host's environment), health
    again; the unsigned result the upload step takes is the dispatched submission's, official."""
    secret = tmp_path / "seed-secret"
    secret.write_bytes(b"a runner's secret seed material, 32+ bytes long")
    secret.chmod(0o600)
    job = _bench_job(tmp_path, fake, "workflow_dispatch.bench.json", SUB, PIPELINE_SEED_SECRET_FILE=str(secret))
    for name in ("Check the runner's health before", "Fetch the submission's exact blob", "Evaluate, officially",
                 "Check the runner's health after"):
        done = job.run(step("bench.yml", "evaluate", name), timeout=900)
        assert done.returncode == 0, f"{name}: {done.stdout[-3000:]}{done.stderr[-3000:]}"
    doc = json.loads((job.temp / "result" / "result.json").read_text())
    assert doc["official"] and doc["status"] == "passed", doc["status"]
    assert (doc["submission"]["blob_sha"], doc["submission"]["pr"]) == (blob_sha(SUB), 7)


def test_the_sudo_stand_in_allows_only_the_rules_commands(tmp_path):
    job = Job(tmp_path, {})
    for argv, ok in ((["-n", "/opt/muse/venv/bin/python", "-m", "pipeline", "evaluate", "--official", "x"], True),
                     (["-n", "/opt/muse/venv/bin/python", "-m", "pipeline", "ledger", "verify"], False),
                     (["/opt/muse/venv/bin/python", "-m", "pipeline", "evaluate", "--official", "x"], False),
                     (["-n", "bash", "-c", "id"], False)):
        done = subprocess.run([str(job.bin / "sudo"), *argv], capture_output=True, text=True)
        assert ("sudo:" not in done.stderr) is ok, (argv, done.stderr)


def test_bench_yml_serving_job_fetches_the_patch_and_a_cpu_host_refuses_the_rest(tmp_path, fake):
    from test_github_flow import PATCH, SERVING_PATH

    job = _bench_job(tmp_path, fake, "workflow_dispatch.bench.serving.json", PATCH)
    health = job.run(step("bench.yml", "serving", "Check the node's health before"))
    assert health.returncode == 1 and "FAIL  gpu" in health.stdout
    fetched = job.run(step("bench.yml", "serving", "Fetch the patch's exact blob"))
    assert fetched.returncode == 0, fetched.stderr
    assert (job.temp / "scratch" / SERVING_PATH).read_bytes() == PATCH
    done = job.run(step("bench.yml", "serving", "Evaluate, officially"))
    assert done.returncode == 2, done.stdout + done.stderr
    assert "::error title=serving evaluation failed::serving evaluate exited 2 without a result" in done.stdout
    assert "no dataset" in done.stderr and not (job.temp / "result" / "result.json").exists()
    after = job.run(step("bench.yml", "serving", "Check the node's health after"))
    assert after.returncode == 1


@pytest.mark.parametrize("dispatch", ["workflow_dispatch.bench.json", "workflow_dispatch.bench.serving.json"])
def test_bench_yml_sign_job_signs_what_was_dispatched_and_plots_a_serving_result(tmp_path, dispatch):
    from fixtures.serving_results import factory as sf
    from pipeline import result, signing

    inputs = event(dispatch)["inputs"]
    serving = inputs["track"] == "serving"
    if serving:
        doc = sf.serving_result(login=inputs["login"], pr=int(inputs["pr"]), head_sha=inputs["head_sha"], sign=False)
    else:
        doc = {**result_doc(login=inputs["login"], pr=int(inputs["pr"]), head_sha=inputs["head_sha"]), "signature": None}
    doc["submission"]["blob_sha"] = inputs["blob_sha"]
    job = Job(tmp_path, event(dispatch), host_env={"PIPELINE_SIGNING_KEY_FILE": str(
        write_private_key(tmp_path / "signer.key"))})
    (job.temp / "unsigned").mkdir()
    (job.temp / "unsigned" / "result.json").write_text(json.dumps(doc))
    done = job.run(step("bench.yml", "sign", "Check and sign it"))
    assert done.returncode == 0, done.stderr
    signed = result.loads((job.temp / "signed" / "result.json").read_bytes())
    assert signing.verify(signed, signing.load_keyring(signing.keyring_dir())).key_id == TEST_KEY.key_id
    assert (signed["submission"]["pr"], signed["problem"]) == (int(inputs["pr"]), "serving" if serving
                                                               else inputs["problem"])
    plot = job.run(step("bench.yml", "sign", "Plot a serving result"))
    if serving:
        assert plot.returncode == 0, plot.stderr
        assert (job.temp / "plot" / "serving-plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_yml_sign_job_refuses_a_result_of_another_dispatch(tmp_path):
    inputs = event("workflow_dispatch.bench.json")["inputs"]
    doc = {**result_doc(login="mallory", pr=int(inputs["pr"]), head_sha=inputs["head_sha"]), "signature": None}
    job = Job(tmp_path, event("workflow_dispatch.bench.json"),
              host_env={"PIPELINE_SIGNING_KEY_FILE": str(write_private_key(tmp_path / "signer.key"))})
    (job.temp / "unsigned").mkdir()
    (job.temp / "unsigned" / "result.json").write_text(json.dumps(doc))
    done = job.run(step("bench.yml", "sign", "Check and sign it"))
    assert done.returncode == 1 and "login is 'mallory', but the dispatch named 'bob'" in done.stderr, done.stderr
    assert not (job.temp / "signed" / "result.json").exists()


# ---- report.yml ----

def test_report_yml_posts_the_signed_result_on_its_pr(tmp_path, fake):
    _open_pr(fake)
    job = Job(tmp_path, event("workflow_run.bench_completed.json"), api=fake.env())
    (job.temp / "artifact").mkdir()
    (job.temp / "artifact" / "result.json").write_bytes(raw(result_doc(login="bob", pr=7, head_sha=HEAD,
                                                                       speedup=1.25)))
    done = job.run(step("report.yml", "report", "Verify"))
    assert done.returncode == 0, done.stderr
    (comment,) = fake.comments[7]
    assert "PASSED" in comment["body"] and "1.250" in comment["body"]
    (check,) = fake.check_runs
    assert (check["head_sha"], check["conclusion"]) == (HEAD, "success")


# ---- ledger.yml and snapshot.yml ----

NOW_MERGED = "2026-10-22T10:00:00Z"


def _merged_and_evaluated(fake: FakeGitHub, pr: int, login: str) -> str:
    head_sha = fake_sha("head", pr)
    fake.add_pull(pr, login, head_sha, [{"filename": f"submissions/kernel/muse_bf16_proj/{login}/submission.py",
                                          "status": "added"}])
    run = fake.add_run(f"bench #{pr} @{login} {head_sha}", "2026-10-22T08:00:00Z")
    fake.add_artifact(run["id"], "result", {"result.json": raw(result_doc(pr=pr, login=login, head_sha=head_sha))})
    fake.merge(pr, NOW_MERGED)
    return head_sha


def _app_outputs() -> dict[str, dict[str, str]]:
    # what actions/create-github-app-token gives the step (a local remote needs no token)
    return {"app": {"token": "app-installation-token", "app-slug": "muse-pipeline"}}


@pytest.mark.parametrize("trigger", ["merged", "dispatch"])
def test_ledger_yml_records_the_merged_pr_on_the_remote(tmp_path, fake, _plain_git, trigger):
    origin = bare_origin(tmp_path)
    head_sha = _merged_and_evaluated(fake, 7, "bob")
    if trigger == "merged":
        ev = event("pull_request_target.labeled.json")
        ev.update(action="closed")
        ev["pull_request"].update(merged=True, merged_at=NOW_MERGED, state="closed")
    else:
        ev = {"inputs": {"pr": 7}, "ref": "refs/heads/main"}
    job = Job(tmp_path / "job", ev, api=fake.env(), step_outputs=_app_outputs())
    job.workspace.rmdir()
    clone(origin, job.workspace)  # actions/checkout of main
    done = job.run(step("ledger.yml", "record", "Record every merged and evaluated PR"))
    assert done.returncode == 0, done.stdout + done.stderr
    check = clone(origin, tmp_path / "check")
    from pipeline import ledger as lg

    (record,) = lg.verify(check)
    assert (record["pr"], record["login"], record["head_sha"], record["accepted_at"]) == (7, "bob", head_sha, NOW_MERGED)
    assert "[@bob](https://github.com/bob)" in (check / "leaderboard.md").read_text()
    assert git(origin, "log", "-1", "--format=%an <%ae>", "main") == \
        "muse-pipeline[bot] <muse-pipeline[bot]@users.noreply.github.com>"


def test_snapshot_yml_records_what_is_missing_and_backfills_the_hours(tmp_path, fake, _plain_git):
    origin = bare_origin(tmp_path)
    _merged_and_evaluated(fake, 7, "bob")
    job = Job(tmp_path / "job", {"schedule": "17 * * * *"}, api=fake.env(), step_outputs=_app_outputs())
    job.workspace.rmdir()
    clone(origin, job.workspace)
    done = job.run(step("snapshot.yml", "snapshot", "Record every merged and evaluated PR"))
    assert done.returncode == 0, done.stdout + done.stderr
    check = clone(origin, tmp_path / "check")
    assert "recorded 1 merged PR (#7)" in done.stdout
    hours = sorted(p.relative_to(check / "results" / "snapshots").as_posix()
                   for p in (check / "results" / "snapshots").rglob("*.json"))
    assert hours[0] == "2026-10-22/01.json" and len(hours) >= 48, hours[:3]  # every hour after the start
    again = job.run(step("snapshot.yml", "snapshot", "Record every merged and evaluated PR"))
    assert again.returncode == 0 and re.search(r"^nothing to commit on main", again.stdout, re.M), again.stdout
