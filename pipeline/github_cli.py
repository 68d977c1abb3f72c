"""The verbs of the GitHub flow: `validate` (validate.yml and competitors), `gate` (gate.yml),
`fetch-submission` and `plot-result` (bench.yml), `post-result` (report.yml), and `show-result` (an
organizer reading a result by hand). Registered in pipeline/cli.py's VERBS.

Each workflow step that decides anything is one of these verbs. Untrusted values (file names, titles,
branch names) reach them only as data: event payload files and API answers, never the command line
of a `run:`. Exit codes: 0 done (valid, dispatched, posted), 1 refused, 2 usage or configuration error.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import stat
import sys
from pathlib import Path
from typing import Any

OK, REFUSED, USAGE = 0, 1, 2
SHA_RE = re.compile(r"^[0-9a-f]{40}\Z")
MAX_RESULT_BYTES = 16 * 1024 * 1024
CHECK_SUMMARY_LIMIT = 65_535  # GitHub's limit on a check run's output.summary
MAX_EVENT_BYTES = 32 * 1024 * 1024


def _error(code: int, message: str) -> int:
    from pipeline.validate import printable

    text = "\n".join(printable(line) for line in message.splitlines())
    print(("refused: " if code == REFUSED else "error: ") + text, file=sys.stderr)
    return code


class _Stop(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def _read_json(path: Path, what: str, limit: int) -> Any:
    """A JSON file read as data: a regular file (never through a link), bounded in size."""
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise _Stop(USAGE, f"{path}: cannot read the {what}: {exc.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise _Stop(REFUSED, f"{path}: the {what} is not a regular file")
    if st.st_size > limit:
        raise _Stop(REFUSED, f"{path}: the {what} is {st.st_size:,} bytes, more than {limit:,}")
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    with os.fdopen(fd, "rb") as fh:
        raw = fh.read(limit + 1)
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise _Stop(REFUSED, f"{path}: the {what} is not JSON: {exc}") from None


def _client(args: argparse.Namespace):
    from pipeline.github import GitHub, GitHubError

    try:
        return GitHub.from_env(repository=getattr(args, "repo", None))
    except GitHubError as exc:
        raise _Stop(USAGE, str(exc)) from None


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
        raise _Stop(USAGE, str(exc)) from None


def _run(body):
    """Map the expected failures of a verb to its exit code and one message, never a stack trace."""
    from functools import wraps

    from pipeline.competition import InstantError
    from pipeline.github import GitHubError

    @wraps(body)
    def wrapper(args: argparse.Namespace) -> int:
        try:
            return body(args)
        except _Stop as stop:
            return _error(stop.code, str(stop))
        except InstantError as exc:
            return _error(USAGE, str(exc))
        except GitHubError as exc:
            return _error(USAGE, f"GitHub: {exc}")

    return wrapper


def _common(p: argparse.ArgumentParser, *, event: bool = True) -> None:
    p.add_argument("--repo", metavar="OWNER/NAME", help="default: $GITHUB_REPOSITORY")
    if event:
        p.add_argument("--event", type=Path, metavar="JSON",
                       default=Path(os.environ["GITHUB_EVENT_PATH"]) if os.environ.get("GITHUB_EVENT_PATH") else None,
                       help="the event payload (default: $GITHUB_EVENT_PATH)")


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
    _common(p, event=False)


@_run
def validate(args: argparse.Namespace) -> int:
    """Check a pull request's files against every submission rule; list every violation at once.

    Exit 0 when the PR is a valid submission, 1 when it is refused, 2 on a usage error.
    """
    from pipeline import validate as v
    from pipeline.problems import list_problems

    competition = _competition(args)
    if args.diff is not None:
        if not args.author:
            return _error(USAGE, "--diff needs --author LOGIN (the pull request's author)")
        try:
            text = args.diff.read_bytes().decode("utf-8", "surrogateescape")
        except OSError as exc:
            return _error(USAGE, f"{args.diff}: {exc.strerror}")
        author = args.author
        try:
            changes = v.changes_from_diff(text, args.tree)
        except v.DiffError as exc:
            verdict = v.Verdict(author=author, violations=[v.Violation(str(args.diff), "unreadable-diff", str(exc))])
            changes = None
    else:
        number = args.pr
        if args.event is not None:
            number = ((_read_json(args.event, "event payload", MAX_EVENT_BYTES) or {}).get("pull_request") or {}).get("number")
            if not isinstance(number, int):
                return _error(USAGE, f"{args.event}: not a pull_request event (no pull_request.number)")
        gh = _client(args)
        pull = gh.pull(number)
        author = args.author or pull.author
        if author.lower() != pull.author.lower():
            return _error(USAGE, f"--author {author} is not the author of #{number} (@{pull.author})")
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
            fh.write(v.verdict_markdown(verdict, status))


# ---- gate ----

def _gate_args(p: argparse.ArgumentParser) -> None:
    _common(p)
    p.add_argument("--label", default=None, help="the label that approves an evaluation (default: run-eval)")
    p.add_argument("--auto", action="store_true",
                   help="dispatch every valid push without a label (only where the competition enables it)")
    p.add_argument("--ref", default="main", help="the branch bench.yml is dispatched on (default: main)")
    p.add_argument("--record", type=Path, metavar="OUT", help="write the record of what was dispatched here")
    p.add_argument("--now", metavar="ISO8601", help="the current time (default: the clock)")
    p.add_argument("--competition", type=Path, metavar="TOML", help="default: the repository's competition.toml")


@_run
def gate(args: argparse.Namespace) -> int:
    """gate.yml: approve, re-validate through the API and dispatch bench.yml for a pull request event.

    labeled (run-eval): the labeler must have write access; the PR is re-fetched, its head must be the
    one that was labeled, its files are re-validated and the rate limit applied; then bench.yml is
    dispatched on main with the PR, head SHA, path and blob SHA as inputs. synchronize: the label is
    dropped (a new commit needs a new review) and the sticky comment shows the new verdict.
    """
    from pipeline import validate as v
    from pipeline.github import APPROVER_ROLES, EVAL_LABEL, BENCH_TITLE
    from pipeline.problems import list_problems

    if args.event is None:
        return _error(USAGE, "no event: pass --event or set $GITHUB_EVENT_PATH")
    event = _read_json(args.event, "event payload", MAX_EVENT_BYTES)
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
    gh = _client(args)
    run_id = os.environ.get("GITHUB_RUN_ID", "")

    def comment(verdict, status: str) -> None:
        gh.upsert_comment(number, v.verdict_markdown(verdict, status))

    approver = None
    if action == "labeled":
        approver = (event.get("sender") or {}).get("login") or ""
        role = gh.role(approver)
        if role not in APPROVER_ROLES:
            gh.remove_label(number, label)
            return _error(REFUSED, f"@{approver} ({role}) cannot approve an evaluation: the {label!r} label needs "
                          f"a maintainer with write access ({', '.join(APPROVER_ROLES)}); the label was removed")
    pull = gh.pull(number)
    if pull.state != "open":
        return _error(REFUSED, f"#{number} is {pull.state}; nothing is evaluated")
    if pull.base_ref != args.ref:
        return _error(REFUSED, f"#{number} is into {pull.base_ref!r}; only pull requests into {args.ref!r} are evaluated")
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
        return _error(REFUSED, verdict.violations[0].message)

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
                + (f": [bench run]({already.html_url})" if _safe_url(already.html_url) else "."))
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
    link = f" ([bench run]({run.html_url}))" if run and _safe_url(run.html_url) else ""
    comment(verdict, f"Queued: commit {pull.head_sha[:12]} is being evaluated on the GPU runner{link}. "
            "This comment will hold the result.")
    _emit(verdict, args)
    print(f"dispatched bench.yml for #{number} at {pull.head_sha} ({sub.path}, blob {sub.blob_sha})")
    return OK


def _safe_url(url: str | None) -> bool:
    return bool(url) and re.match(r"^https?://[\w./:-]+\Z", url) is not None


# ---- fetch-submission ----

def _fetch_args(p: argparse.ArgumentParser) -> None:
    _common(p)
    p.add_argument("--dest", type=Path, required=True, metavar="DIR",
                   help="the scratch checkout the submission is written into (at its repository path)")
    p.add_argument("--meta", type=Path, metavar="OUT",
                   help="write the submission's facts (pr, head_sha, login, path, blob_sha) here for `evaluate`")
    for name in ("pr", "head-sha", "login", "track", "problem", "path", "blob-sha"):
        p.add_argument(f"--{name}", help=f"default: the dispatch input {name.replace('-', '_')}")


@_run
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
        inputs = dict((_read_json(args.event, "event payload", MAX_EVENT_BYTES) or {}).get("inputs") or {})
    for key in ("pr", "head_sha", "login", "track", "problem", "path", "blob_sha"):
        given = getattr(args, key)
        if given is not None:
            inputs[key] = given
    missing = [k for k in ("pr", "head_sha", "login", "path", "blob_sha") if not inputs.get(k)]
    if missing:
        return _error(USAGE, f"missing input(s) {', '.join(missing)}: pass --event (a workflow_dispatch payload) "
                      "or the options")
    pr, head_sha, login, path, blob_sha = (str(inputs[k]) for k in ("pr", "head_sha", "login", "path", "blob_sha"))
    if not pr.isdigit() or int(pr) < 1:
        return _error(REFUSED, f"pr {pr!r} is not a pull request number")
    for name, value in (("head_sha", head_sha), ("blob_sha", blob_sha)):
        if not SHA_RE.match(value):
            return _error(REFUSED, f"{name} {value!r} is not a 40-hex-digit SHA")
    probe = v.check([v.Change(path, "added", new_mode=v.REGULAR)], login, problems=list_problems())
    if not probe.ok:
        return _error(REFUSED, "the recorded path is not a submission of @" + login + ":\n" + probe.text())
    sub = probe.submission
    if inputs.get("track") and inputs["track"] != sub.track:
        return _error(REFUSED, f"the recorded track {inputs['track']!r} does not match the path's {sub.track!r}")
    if inputs.get("problem") and inputs["problem"] != sub.problem:
        return _error(REFUSED, f"the recorded problem {inputs['problem']!r} does not match the path's {sub.problem!r}")
    from pipeline.github import BlobMismatch

    gh = _client(args)
    try:
        data = gh.blob(blob_sha)
    except BlobMismatch as exc:
        return _error(REFUSED, str(exc))
    limit = v.ALLOWED_FILES[sub.track][path.rsplit("/", 1)[-1]]
    final = v.check([v.Change(path, "added", new_mode=v.REGULAR, size=len(data), blob_sha=blob_sha,
                              binary=b"\0" in data or not v._is_utf8(data))], login, problems=list_problems())
    if not final.ok:
        return _error(REFUSED, f"blob {blob_sha} cannot be evaluated (limit {limit:,} bytes):\n" + final.text())
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
        raise _Stop(USAGE, f"{root}: the destination checkout does not exist")
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
            raise _Stop(REFUSED, f"{current} is not a directory in the checkout (a link?); refusing to write there")
    target = current / parts[-1]
    tmp = current / f".{parts[-1]}.fetch{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    os.replace(tmp, target)
    return target


# ---- post-result ----

CONCLUSIONS = {
    "passed": "success",
    "needs_review": "neutral",
    "incorrect": "failure",
    "compile_error": "failure",
    "runtime_error": "failure",
    "timeout": "failure",
    "rejected": "failure",
}


def _post_args(p: argparse.ArgumentParser) -> None:
    _common(p)
    p.add_argument("--result", type=Path, metavar="JSON", help="the downloaded result.json (data only)")
    p.add_argument("--keyring", type=Path, metavar="DIR", help="the runners' public keys (default: "
                   "$PIPELINE_KEYRING, else keys/runners/ of the repository)")
    p.add_argument("--run-url", help="the bench run's page (default: the workflow_run event's html_url)")


def _would_be_rank(doc: dict) -> str | None:
    """The rank the comment shows, from main's ledger; a comment is still posted if it cannot be had."""
    from pipeline import competition, ledger
    from pipeline.board.standings import would_be_rank
    from pipeline.ledger_cli import problem_workloads
    from pipeline.problems import REPO_ROOT

    try:
        return would_be_rank(ledger.read(REPO_ROOT), competition.load(), problem_workloads(), doc,
                                   ledger.now_instant())
    except Exception as exc:  # noqa: BLE001 - the rank is a courtesy; the verdict must still be posted
        print(f"note: no would-be rank ({type(exc).__name__}: {exc})", file=sys.stderr)
        return None


# the bench run's artifact that holds a serving result's plot (bench.yml's sign job uploads it)
PLOT_ARTIFACT = "serving-plot"


def _plot_link(gh, run: dict) -> str | None:
    """The page of the bench run's serving-plot artifact, for the comment to link (GitHub cannot show an
    artifact inline, and the report job has nowhere to host an image); None where there is none."""
    run_id, page = run.get("id"), run.get("html_url")
    if not isinstance(run_id, int) or not page or not _safe_url(page):
        return None
    from pipeline.github import GitHubError

    try:
        found = [a for a in gh.run_artifacts(run_id) if a.name == PLOT_ARTIFACT and not a.expired]
    except GitHubError as exc:  # the link is a courtesy; the verdict must still be posted
        print(f"note: no plot link ({exc})", file=sys.stderr)
        return None
    return f"{page.rstrip('/')}/artifacts/{found[-1].id}" if found else None


@_run
def post_result(args: argparse.Namespace) -> int:
    """report.yml: verify a bench run's result.json and post it as the sticky comment and check run.

    The result is read as data, validated against the schema and its signature verified before
    anything is posted; the PR is found from the recorded head SHA and must match the recorded PR and
    login. With a workflow_run event and no result (the run failed before writing one), the PR its
    title names is told so.
    """
    from pipeline import report, result
    from pipeline.github import BENCH_TITLE_RE

    event = _read_json(args.event, "event payload", MAX_EVENT_BYTES) if args.event else {}
    run = (event or {}).get("workflow_run") or {}
    log_url = args.run_url or run.get("html_url")
    if log_url and not _safe_url(log_url):
        log_url = None
    if args.result is None or not os.path.lexists(args.result):
        m = BENCH_TITLE_RE.match(run.get("display_title") or "")
        if not m:
            return _error(USAGE, "no result.json, and no bench run event naming a pull request")
        gh = _client(args)
        pull = gh.pull(int(m["pr"]))
        head = m["head_sha"]
        text = (f"### Evaluation of {head[:12]}: no result\n\nThe bench run ended ({report.md_escape(run.get('conclusion'))})"
                " before writing a result" + (f"; see [the run log]({log_url})." if log_url else ".")
                + " The organizers have been notified; a maintainer can label the pull request again.")
        gh.upsert_comment(pull.number, report.MARKER + "\n" + text + "\n")
        gh.upsert_check_run(head, conclusion="failure", title="no result", summary=text, details_url=log_url)
        return _error(REFUSED, f"bench run for #{pull.number} at {head} produced no result")

    from pipeline import signing

    doc = _read_json(args.result, "result", MAX_RESULT_BYTES)
    try:
        result.validate(doc)
    except result.ResultError as exc:
        return _error(REFUSED, f"{args.result}: {exc}")
    try:
        keyring = signing.load_keyring(args.keyring)
    except signing.SignatureError as exc:
        return _error(USAGE, str(exc))
    try:
        signing.verify(doc, keyring)
    except signing.SignatureError as exc:
        return _error(REFUSED, f"{args.result}: {exc}; nothing was posted")
    sub = doc["submission"]
    head = sub["head_sha"]
    if not head:
        return _error(REFUSED, f"{args.result}: the result names no head commit; it is not a pull request's evaluation")
    gh = _client(args)
    pull = gh.find_pull(head)
    if pull is None:
        return _error(REFUSED, f"no pull request has commit {head}")
    if sub["pr"] is not None and sub["pr"] != pull.number:
        return _error(REFUSED, f"the result is for #{sub['pr']}, but commit {head} belongs to #{pull.number}")
    if sub["login"] is not None and sub["login"].lower() != pull.author.lower():
        return _error(REFUSED, f"the result is for @{sub['login']}, but #{pull.number} is by @{pull.author}")
    standing = _would_be_rank(doc)
    plot = _plot_link(gh, run) if doc.get("serving") else None
    body = report.comment_markdown(doc, log_url=log_url, rank=standing, plot_artifact_url=plot)
    comment_id, created = gh.upsert_comment(pull.number, body)
    title = f"{doc['problem']}: {report.VERDICT[doc['status']]}"
    if doc.get("score"):  # a serving score is S, shown without an x as on its board
        title += (f", S = {doc['score']['speedup']:.3f}" if doc.get("serving") else f", {doc['score']['speedup']:.3f}x")
    check_id, _ = gh.upsert_check_run(head, conclusion=CONCLUSIONS[doc["status"]], title=title,
                                      summary=report.comment_markdown(doc, log_url=log_url, rank=standing,
                                                                      limit=CHECK_SUMMARY_LIMIT,
                                                                      plot_artifact_url=plot),
                                      details_url=log_url)
    print(f"{'posted' if created else 'updated'} comment {comment_id} on #{pull.number} and check run {check_id}: "
          f"{title}")
    return OK


# ---- plot-result ----

def _plot_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("result", type=Path, help="a serving result.json (read as data)")
    p.add_argument("--out", type=Path, required=True, metavar="PNG", help="where to write the plot")


@_run
def plot_result(args: argparse.Namespace) -> int:
    """bench.yml: a serving result's throughput per GPU against interactivity, as a PNG beside it.

    The result is read as data and validated first. A serving result without levels (a patch the gate
    refused, a server that never came up) has no plot: nothing is written, exit 0. Exit 1 for a file that
    is not a serving result, 2 for a folder that does not exist.
    """
    from pipeline import report, result

    try:
        _, doc = result.read_data(args.result)
    except result.ResultError as exc:
        return _error(REFUSED, str(exc))
    if doc["track"] != "serving":
        return _error(REFUSED, f"{args.result} is a {doc['track']} result; only a serving result has this plot")
    if not args.out.parent.is_dir():
        return _error(USAGE, f"--out {args.out}: the folder {args.out.parent} does not exist")
    data = report.serving_plot(doc)
    if data is None:
        print(f"no plot: {args.result} has no measured level ({doc['status']})")
        return OK
    tmp = args.out.with_name(f".{args.out.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    os.replace(tmp, args.out)
    print(f"wrote {args.out} ({len(data):,} bytes)")
    return OK


# ---- show-result ----

def _show_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("result", type=Path, help="a result.json (read as data)")
    p.add_argument("--markdown", type=Path, metavar="OUT", help="also write the PR comment post-result would post")


@_run
def show_result(args: argparse.Namespace) -> int:
    """Print a result as the evaluator's terminal table (a serving result: its per-concurrency table, gate and S).

    The result is read as data and validated; it need not be signed (an organizer reads a hand-run
    evaluation with it). --markdown writes the sticky comment the PR would get. Exit 1 for a file that is
    not a valid result.
    """
    from pipeline import report, result

    try:
        _, doc = result.read_data(args.result)
    except result.ResultError as exc:
        return _error(REFUSED, str(exc))
    print(report.terminal(doc))
    if args.markdown:
        args.markdown.write_text(report.comment_markdown(doc))
    return OK


VERBS = {
    "validate": (_validate_args, validate),
    "gate": (_gate_args, gate),
    "fetch-submission": (_fetch_args, fetch_submission),
    "post-result": (_post_args, post_result),
    "plot-result": (_plot_args, plot_result),
    "show-result": (_show_args, show_result),
}
