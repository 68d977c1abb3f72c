"""The gate's decisions, one verb each: `validate` (validate.yml and competitors: is this PR a valid
submission), `gate` (gate.yml: may this labeled commit be evaluated, and what exactly is dispatched) and
`fetch-submission` (bench.yml: is the blob fetched the one that was approved). Registered in
pipeline/cli.py's VERBS.

The rules for a PR's files are pipeline/validate.py's (static: nothing is executed); the rules here are
the approval's: only a maintainer with write access (APPROVER_ROLES) approves, by adding EVAL_LABEL to
the exact head commit; a new push drops the label; the PR is re-read through the API (never the event's
copy), its files re-validated, the competitor's rate limit applied, and the head checked again right
before bench.yml is dispatched with the PR, head SHA, path and blob SHA. Untrusted values (file names,
titles, branch names) reach these verbs only as data: event payload files and API answers, never the
command line of a `run:`. Exit codes (pipeline/exits.py): 0 done (valid, dispatched), 1 refused, 2 usage
or configuration error.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import stat
from pathlib import Path
from typing import Any

from pipeline.result import SHA1_RE
from pipeline.exits import MAX_EVENT_BYTES, OK, REFUSED, USAGE, Stop, error, guarded, read_json
from pipeline.github import github_args, github_client
from pipeline import report
from pipeline.report import safe_url

EVAL_LABEL = "run-eval"
# roles that may approve running a stranger's code on the GPU runner (triage may label, but not approve)
APPROVER_ROLES = ("admin", "maintain", "write")


def _now(args: argparse.Namespace) -> dt.datetime:
    from pipeline.competition import parse_instant

    if getattr(args, "now", None):
        return parse_instant(args.now, "--now")
    return dt.datetime.now(dt.timezone.utc).replace(microsecond=0)


def _competition(args: argparse.Namespace):
    from pipeline.competition import CompetitionError, load

    try:
        return load(getattr(args, "competition", None))
    except CompetitionError as exc:
        raise Stop(USAGE, str(exc)) from None


# ---- validate ----

def _validate_args(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--diff", type=Path, metavar="FILE", help="a unified diff, e.g. `git diff --full-index main...HEAD`")
    src.add_argument("--pr", type=int, metavar="N", help="read pull request N's files through the GitHub API")
    src.add_argument("--event", type=Path, metavar="JSON",
                     help="a pull_request event payload ($GITHUB_EVENT_PATH): its PR, read through the API")
    p.add_argument("--author", metavar="LOGIN", help="the PR author's login (required with --diff)")
    p.add_argument("--tree", type=Path, metavar="DIR",
                   help="with --diff: a checkout of the PR's head, to measure whole files (never executed)")
    p.add_argument("--json", type=Path, metavar="OUT", help="write the verdict here")
    p.add_argument("--markdown", type=Path, metavar="OUT", help="append the verdict as markdown (a job summary)")
    p.add_argument("--now", metavar="ISO8601", help="the time the calendar notes are for (default: now)")
    p.add_argument("--competition", type=Path, metavar="TOML", help="default: the repository's competition.toml")
    github_args(p, event=False)


@guarded
def validate(args: argparse.Namespace) -> int:
    """Check a pull request's files against every submission rule; list every violation at once.

    Exit 0 when the PR is a valid submission, 1 when it is refused, 2 on a usage error.
    """
    from pipeline import validate as v
    from pipeline.problems import list_problems

    competition = _competition(args)
    if args.diff is not None:
        if not args.author:
            return error(USAGE, "--diff needs --author LOGIN (the pull request's author)")
        try:
            text = args.diff.read_bytes().decode("utf-8", "surrogateescape")
        except OSError as exc:
            return error(USAGE, f"{args.diff}: {exc.strerror}")
        author = args.author
        try:
            changes = v.changes_from_diff(text, args.tree)
        except v.DiffError as exc:
            verdict = v.Verdict(author=author, violations=[v.Violation(str(args.diff), "unreadable-diff", str(exc))])
            changes = None
    else:
        number = args.pr
        if args.event is not None:
            number = ((read_json(args.event, "event payload", MAX_EVENT_BYTES) or {}).get("pull_request") or {}).get("number")
            if not isinstance(number, int):
                return error(USAGE, f"{args.event}: not a pull_request event (no pull_request.number)")
        gh = github_client(args)
        pull = gh.pull(number)
        author = args.author or pull.author
        if author.lower() != pull.author.lower():
            return error(USAGE, f"--author {author} is not the author of #{number} (@{pull.author})")
        changes = v.changes_from_pull(gh, pull, pull.author)
    if changes is not None:
        verdict = v.check(changes, author, problems=list_problems(), competition=competition, now=_now(args))
    _emit(verdict, args)
    return OK if verdict.ok else REFUSED


def _emit(verdict, args: argparse.Namespace, status: str | None = None) -> None:
    from pipeline import validate as v

    print(verdict.text())
    if getattr(args, "json", None):
        Path(args.json).write_text(json.dumps(verdict.as_dict(), indent=2) + "\n")
    if getattr(args, "markdown", None):
        with open(args.markdown, "a") as fh:
            fh.write(report.verdict_markdown(verdict, status))


# ---- gate ----

def _gate_args(p: argparse.ArgumentParser) -> None:
    github_args(p)
    p.add_argument("--label", default=None, help="the label that approves an evaluation (default: run-eval)")
    p.add_argument("--auto", action="store_true",
                   help="dispatch every valid push without a label (only where the competition enables it)")
    p.add_argument("--ref", default="main", help="the branch bench.yml is dispatched on (default: main)")
    p.add_argument("--record", type=Path, metavar="OUT", help="write the record of what was dispatched here")
    p.add_argument("--now", metavar="ISO8601", help="the current time (default: the clock)")
    p.add_argument("--competition", type=Path, metavar="TOML", help="default: the repository's competition.toml")


@guarded
def gate(args: argparse.Namespace) -> int:
    """gate.yml: approve, re-validate through the API and dispatch bench.yml for a pull request event.

    labeled (run-eval): the labeler must have write access; the PR is re-fetched, its head must be the
    one that was labeled, its files are re-validated and the rate limit applied; then bench.yml is
    dispatched on main with the PR, head SHA, path and blob SHA as inputs. synchronize: the label is
    dropped (a new commit needs a new review) and the sticky comment shows the new verdict.
    """
    from pipeline import validate as v
    from pipeline.github import BENCH_TITLE
    from pipeline.problems import list_problems

    if args.event is None:
        return error(USAGE, "no event: pass --event or set $GITHUB_EVENT_PATH")
    event = read_json(args.event, "event payload", MAX_EVENT_BYTES)
    label = args.label or EVAL_LABEL
    action = event.get("action")
    pr = event.get("pull_request") or {}
    number = pr.get("number")
    if not isinstance(number, int) or action not in ("labeled", "synchronize", "opened", "reopened"):
        print(f"nothing to do for a {action!r} event")
        return OK
    if action == "labeled" and (event.get("label") or {}).get("name") != label:
        print(f"nothing to do: the label added is not {label!r}")
        return OK
    competition = _competition(args)
    now = _now(args)
    gh = github_client(args)
    run_id = os.environ.get("GITHUB_RUN_ID", "")

    def comment(verdict, status: str) -> None:
        gh.upsert_comment(number, report.verdict_markdown(verdict, status), report.MARKER)

    approver = None
    if action == "labeled":
        approver = (event.get("sender") or {}).get("login") or ""
        role = gh.role(approver)
        if role not in APPROVER_ROLES:
            gh.remove_label(number, label)
            return error(REFUSED, f"@{approver} ({role}) cannot approve an evaluation: the {label!r} label needs "
                          f"a maintainer with write access ({', '.join(APPROVER_ROLES)}); the label was removed")
    pull = gh.pull(number)
    if pull.state != "open":
        return error(REFUSED, f"#{number} is {pull.state}; nothing is evaluated")
    if pull.base_ref != args.ref:
        return error(REFUSED, f"#{number} is into {pull.base_ref!r}; only pull requests into {args.ref!r} are evaluated")
    if action == "synchronize" and label in pull.labels:
        gh.remove_label(number, label)

    def head_moved(approved: str, now_head: str) -> int:
        if action == "labeled":
            gh.remove_label(number, label)
        verdict = v.Verdict(author=pull.author)
        verdict.violations.append(v.Violation("", "head-moved", (
            f"the pull request's head is now {now_head[:12]}, not the {approved[:12]} that was approved: "
            "a maintainer must review the new commit and label it again")))
        comment(verdict, "Not queued: the commit changed while it was being approved.")
        return error(REFUSED, verdict.violations[0].message)

    labeled_head = str((pr.get("head") or {}).get("sha"))
    if action == "labeled" and labeled_head != pull.head_sha:
        return head_moved(labeled_head, pull.head_sha)

    dispatching = action == "labeled" or args.auto
    runs = gh.bench_runs(v.rate_window_start(now)) if dispatching else []
    mine = [r for r in runs if r.login and r.login.lower() == pull.author.lower()]
    already = next((r for r in mine if r.head_sha == pull.head_sha and r.pr == number), None)
    recent = [r.created_at for r in mine] if dispatching and already is None else None
    changes = v.changes_from_pull(gh, pull, pull.author)
    verdict = v.check(changes, pull.author, problems=list_problems(), competition=competition, now=now,
                      recent_evaluations=recent)
    if not verdict.ok:
        if action == "labeled":
            gh.remove_label(number, label)
        comment(verdict, "Not queued." + (" The label was removed; a maintainer can add it again after the "
                                          "next push." if action == "labeled" else ""))
        _emit(verdict, args)
        return REFUSED
    if not dispatching:
        comment(verdict, f"Waiting for a maintainer to review commit {pull.head_sha[:12]} and add the "
                f"`{label}` label.")
        _emit(verdict, args)
        return OK
    if already is not None:
        comment(verdict, f"Already queued for commit {pull.head_sha[:12]}"
                + (f": [bench run]({already.html_url})" if safe_url(already.html_url) else "."))
        _emit(verdict, args)
        return OK
    latest = gh.pull(number).head_sha  # a push while the files were read: they may be of either commit
    if latest != pull.head_sha:
        return head_moved(pull.head_sha, latest)
    sub = verdict.submission
    inputs = {"pr": str(number), "head_sha": pull.head_sha, "login": pull.author, "track": sub.track,
              "problem": sub.problem or "", "path": sub.path, "blob_sha": sub.blob_sha, "gate_run": run_id}
    run = gh.dispatch_bench(inputs, ref=args.ref)
    record = {
        **inputs,
        "pr": number,
        "approved_by": approver,
        "auto": bool(args.auto and action != "labeled"),
        "blob_shas": {c.path: c.blob_sha for c in changes if c.status != "removed" and c.blob_sha},
        "bench_title": BENCH_TITLE.format(pr=number, login=pull.author, head_sha=pull.head_sha),
        "bench_run": {"id": run.id, "url": run.html_url} if run else None,
        "dispatched_at": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    if args.record:
        args.record.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    link = f" ([bench run]({run.html_url}))" if run and safe_url(run.html_url) else ""
    comment(verdict, f"Queued: commit {pull.head_sha[:12]} is being evaluated on the GPU runner{link}. "
            "This comment will hold the result.")
    _emit(verdict, args)
    print(f"dispatched bench.yml for #{number} at {pull.head_sha} ({sub.path}, blob {sub.blob_sha})")
    return OK


# ---- fetch-submission ----

def _fetch_args(p: argparse.ArgumentParser) -> None:
    github_args(p)
    p.add_argument("--dest", type=Path, required=True, metavar="DIR",
                   help="the scratch checkout the submission is written into (at its repository path)")
    p.add_argument("--meta", type=Path, metavar="OUT",
                   help="write the submission's facts (pr, head_sha, login, path, blob_sha) here for `evaluate`")
    for name in ("pr", "head-sha", "login", "track", "problem", "path", "blob-sha"):
        p.add_argument(f"--{name}", help=f"default: the dispatch input {name.replace('-', '_')}")


@guarded
def fetch_submission(args: argparse.Namespace) -> int:
    """bench.yml: fetch the submission's exact blob through the API, verify its SHA, write it in place.

    The inputs come from the dispatch (the gate's record). The path is re-checked against the rules,
    the bytes must hash to the recorded blob SHA, and the file is written into the scratch checkout
    without following any link.
    """
    from pipeline import validate as v
    from pipeline.problems import list_problems

    inputs: dict[str, Any] = {}
    if args.event is not None:
        inputs = dict((read_json(args.event, "event payload", MAX_EVENT_BYTES) or {}).get("inputs") or {})
    for key in ("pr", "head_sha", "login", "track", "problem", "path", "blob_sha"):
        given = getattr(args, key)
        if given is not None:
            inputs[key] = given
    missing = [k for k in ("pr", "head_sha", "login", "path", "blob_sha") if not inputs.get(k)]
    if missing:
        return error(USAGE, f"missing input(s) {', '.join(missing)}: pass --event (a workflow_dispatch payload) "
                      "or the options")
    pr, head_sha, login, path, blob_sha = (str(inputs[k]) for k in ("pr", "head_sha", "login", "path", "blob_sha"))
    if not pr.isdigit() or int(pr) < 1:
        return error(REFUSED, f"pr {pr!r} is not a pull request number")
    for name, value in (("head_sha", head_sha), ("blob_sha", blob_sha)):
        if not SHA1_RE.match(value):
            return error(REFUSED, f"{name} {value!r} is not a 40-hex-digit SHA")
    probe = v.check([v.Change(path, "added", new_mode=v.REGULAR)], login, problems=list_problems())
    if not probe.ok:
        return error(REFUSED, "the recorded path is not a submission of @" + login + ":\n" + probe.text())
    sub = probe.submission
    if inputs.get("track") and inputs["track"] != sub.track:
        return error(REFUSED, f"the recorded track {inputs['track']!r} does not match the path's {sub.track!r}")
    if inputs.get("problem") and inputs["problem"] != sub.problem:
        return error(REFUSED, f"the recorded problem {inputs['problem']!r} does not match the path's {sub.problem!r}")
    from pipeline.github import BlobMismatch

    gh = github_client(args)
    try:
        data = gh.blob(blob_sha)
    except BlobMismatch as exc:
        return error(REFUSED, str(exc))
    limit = v.ALLOWED_FILES[sub.track][path.rsplit("/", 1)[-1]]
    final = v.check([v.Change(path, "added", new_mode=v.REGULAR, size=len(data), blob_sha=blob_sha,
                              binary=b"\0" in data or not v.is_utf8(data))], login, problems=list_problems())
    if not final.ok:
        return error(REFUSED, f"blob {blob_sha} cannot be evaluated (limit {limit:,} bytes):\n" + final.text())
    target = _write_inside(Path(args.dest), path, data)
    meta = {"pr": int(pr), "head_sha": head_sha, "login": login, "track": sub.track, "problem": sub.problem,
            "path": path, "blob_sha": blob_sha}
    if args.meta:
        args.meta.write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    print(f"wrote {target} ({len(data):,} bytes, blob {blob_sha} verified)")
    return OK


def _write_inside(root: Path, rel: str, data: bytes) -> Path:
    """Write `data` at root/rel, refusing any link on the way and replacing (never writing through) what
    is there."""
    root = root.resolve()
    if not root.is_dir():
        raise Stop(USAGE, f"{root}: the destination checkout does not exist")
    current = root
    parts = rel.split("/")
    for part in parts[:-1]:
        current = current / part
        try:
            st = os.lstat(current)
        except FileNotFoundError:
            os.mkdir(current, 0o755)
            continue
        if not stat.S_ISDIR(st.st_mode):
            raise Stop(REFUSED, f"{current} is not a directory in the checkout (a link?); refusing to write there")
    target = current / parts[-1]
    tmp = current / f".{parts[-1]}.fetch{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    os.replace(tmp, target)
    return target


VERBS = {
    "validate": (_validate_args, validate),
    "gate": (_gate_args, gate),
    "fetch-submission": (_fetch_args, fetch_submission),
}
