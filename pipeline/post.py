"""`post-result` (report.yml): what is posted on a pull request, and only once it is believed.

A result is posted only once it is valid by the schema and its signature verifies against the committed
keys, on the pull request its signed head SHA belongs to, and only if the signed PR and login are that
PR's; with the would-be rank from main's ledger (`pr_comment`, which `evaluate --comment` prints too, so
a competitor sees the comment before opening the PR). What the comment says is pipeline/report.py's (it
renders; this module decides what is posted where, and pipeline/github.py posts it).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from pipeline import competition, ledger, result, signing
from pipeline.board.standings import would_be_rank as place
from pipeline.competition import REPO_ROOT
from pipeline.exits import MAX_EVENT_BYTES, OK, REFUSED, USAGE, error, guarded, read_json
from pipeline.github import BENCH_TITLE_RE, GitHubError, github_args, github_client
from pipeline.report import GITHUB_LIMIT, MARKER, VERDICT, comment_markdown, md_escape, safe_url

MAX_RESULT_BYTES = 16 * 1024 * 1024
CHECK_SUMMARY_LIMIT = 65_535  # GitHub's limit on a check run's output.summary

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
    github_args(p)
    p.add_argument("--result", type=Path, metavar="JSON", help="the downloaded result.json (data only)")
    p.add_argument("--keyring", type=Path, metavar="DIR", help="the runners' public keys (default: "
                   "$PIPELINE_KEYRING, else keys/runners/ of the repository)")
    p.add_argument("--run-url", help="the bench run's page (default: the workflow_run event's html_url)")


def would_be_rank(doc: dict[str, Any], root: Path) -> str | None:
    """Where `doc` would stand on the board that root's ledger gives now (post-result: main's checkout;
    `evaluate --comment --board`: the board's folder); None (a note on stderr) if it cannot be had, as
    the rank is a courtesy and the verdict is shown all the same."""
    try:
        toml = root / "competition.toml"
        return place(ledger.read(root), competition.load(toml if toml.is_file() else None),
                     ledger.problem_workloads(), doc, ledger.now_instant())
    except Exception as exc:  # noqa: BLE001 - the rank is a courtesy; the verdict must still be posted
        print(f"note: no would-be rank ({type(exc).__name__}: {exc})", file=sys.stderr)
        return None


def pr_comment(doc: dict[str, Any], *, root: Path, log_url: str | None = None,
               plot_artifact_url: str | None = None, limit: int = GITHUB_LIMIT) -> str:
    """The sticky comment post-result posts for `doc` (and, at CHECK_SUMMARY_LIMIT, its check run's
    summary), with the would-be rank on root's board. `evaluate --comment` prints exactly this."""
    return comment_markdown(doc, log_url=log_url, rank=would_be_rank(doc, root), limit=limit,
                            plot_artifact_url=plot_artifact_url)


# the bench run's artifact that holds a serving result's plot (bench.yml's sign job uploads it)
PLOT_ARTIFACT = "serving-plot"


def _plot_link(gh, run: dict) -> str | None:
    """The page of the bench run's serving-plot artifact, for the comment to link (GitHub cannot show an
    artifact inline, and the report job has nowhere to host an image); None where there is none."""
    run_id, page = run.get("id"), run.get("html_url")
    if not isinstance(run_id, int) or not page or not safe_url(page):
        return None
    try:
        found = [a for a in gh.run_artifacts(run_id) if a.name == PLOT_ARTIFACT and not a.expired]
    except GitHubError as exc:  # the link is a courtesy; the verdict must still be posted
        print(f"note: no plot link ({exc})", file=sys.stderr)
        return None
    return f"{page.rstrip('/')}/artifacts/{found[-1].id}" if found else None


@guarded
def post_result(args: argparse.Namespace) -> int:
    """report.yml: verify a bench run's result.json and post it as the sticky comment and check run.

    The result is read as data, validated against the schema and its signature verified before
    anything is posted; the PR is found from the recorded head SHA and must match the recorded PR and
    login. With a workflow_run event and no result (the run failed before writing one), the PR its
    title names is told so.
    """
    event = read_json(args.event, "event payload", MAX_EVENT_BYTES) if args.event else {}
    run = (event or {}).get("workflow_run") or {}
    log_url = args.run_url or run.get("html_url")
    if log_url and not safe_url(log_url):
        log_url = None
    if args.result is None or not os.path.lexists(args.result):
        m = BENCH_TITLE_RE.match(run.get("display_title") or "")
        if not m:
            return error(USAGE, "no result.json, and no bench run event naming a pull request")
        gh = github_client(args)
        pull = gh.pull(int(m["pr"]))
        head = m["head_sha"]
        text = (f"### Evaluation of {head[:12]}: no result\n\nThe bench run ended ({md_escape(run.get('conclusion'))})"
                " before writing a result" + (f"; see [the run log]({log_url})." if log_url else ".")
                + " The organizers have been notified; a maintainer can label the pull request again.")
        gh.upsert_comment(pull.number, MARKER + "\n" + text + "\n", MARKER)
        gh.upsert_check_run(head, conclusion="failure", title="no result", summary=text, details_url=log_url)
        return error(REFUSED, f"bench run for #{pull.number} at {head} produced no result")

    doc = read_json(args.result, "result", MAX_RESULT_BYTES)
    try:
        result.validate(doc)
    except result.ResultError as exc:
        return error(REFUSED, f"{args.result}: {exc}")
    try:
        keyring = signing.load_keyring(args.keyring)
    except signing.SignatureError as exc:
        return error(USAGE, str(exc))
    try:
        signing.verify(doc, keyring)
    except signing.SignatureError as exc:
        return error(REFUSED, f"{args.result}: {exc}; nothing was posted")
    sub = doc["submission"]
    head = sub["head_sha"]
    if not head:
        return error(REFUSED, f"{args.result}: the result names no head commit; it is not a pull request's evaluation")
    gh = github_client(args)
    pull = gh.find_pull(head)
    if pull is None:
        return error(REFUSED, f"no pull request has commit {head}")
    if sub["pr"] is not None and sub["pr"] != pull.number:
        return error(REFUSED, f"the result is for #{sub['pr']}, but commit {head} belongs to #{pull.number}")
    if sub["login"] is not None and sub["login"].lower() != pull.author.lower():
        return error(REFUSED, f"the result is for @{sub['login']}, but #{pull.number} is by @{pull.author}")
    plot = _plot_link(gh, run) if doc.get("serving") else None
    body = pr_comment(doc, root=REPO_ROOT, log_url=log_url, plot_artifact_url=plot)
    comment_id, created = gh.upsert_comment(pull.number, body, MARKER)
    title = f"{doc['problem']}: {VERDICT[doc['status']]}"
    if doc.get("score"):  # a serving score is S, shown without an x as on its board
        title += (f", S = {doc['score']['speedup']:.3f}" if doc.get("serving") else f", {doc['score']['speedup']:.3f}x")
    check_id, _ = gh.upsert_check_run(head, conclusion=CONCLUSIONS[doc["status"]], title=title,
                                      summary=pr_comment(doc, root=REPO_ROOT, log_url=log_url,
                                                         limit=CHECK_SUMMARY_LIMIT, plot_artifact_url=plot),
                                      details_url=log_url)
    print(f"{'posted' if created else 'updated'} comment {comment_id} on #{pull.number} and check run {check_id}: "
          f"{title}")
    return OK


VERBS = {
    "post-result": (_post_args, post_result),
}
