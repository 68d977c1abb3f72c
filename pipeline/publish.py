"""What ledger.yml and snapshot.yml do around the ledger's own verbs: `publish reconcile` (record every
merged and evaluated PR the ledger lacks, asking GitHub which), `find-result` (which bench run
evaluated a merged PR's head) and `publish` (append, regenerate, commit and push, safely however many
writers race for the branch).

`publish` is a compare-and-swap on the branch head. Each attempt fetches the branch, builds on its tip
in a fresh temporary worktree (so the code that runs never changes under it), runs the ledger verbs
(`ledger append`, `board`, `snapshots`: the ledger is a hash chain, so an append must be recomputed on
the tip it lands on, never rebased), commits, and pushes with `--force-with-lease=<branch>:<tip>`: the
push lands only if the branch still points at the commit the attempt built on. When another writer got
there first (a merge, another ledger or snapshot run) the attempt is thrown away and redone on the new
tip, after a growing, jittered pause. A refusal by the ledger (an unsigned or tampered result, a head
that is not the evaluated one) is final and nothing is pushed. Re-running for a result that is already
recorded changes nothing and succeeds, so a retried workflow is harmless.

The push authenticates with $PIPELINE_PUSH_TOKEN (the project's GitHub App installation token, the one
actor allowed past the branch ruleset: docs/RUNBOOK.md), handed to git through GIT_CONFIG_* environment
variables: never on a command line, never written to .git/config.

Exit codes: 0 done (or nothing to do), 1 refused or gave up, 2 usage error.
"""

from __future__ import annotations

import argparse
import base64
import datetime as dt
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from pipeline.result import SHA1_RE
from pipeline.exits import OK, REFUSED, USAGE, error

# what the ledger verbs write, relative to the repository root: the only paths a publish commits
OUTPUTS = ("results", "leaderboard.md", "leaderboard")
TOKEN_ENV = "PIPELINE_PUSH_TOKEN"
DEFAULT_AUTHOR = "muse-pipeline[bot] <muse-pipeline[bot]@users.noreply.github.com>"
# how far back find-result looks for the bench run of a merged head (a competition lasts weeks)
LOOKBACK_DAYS = 60
# the artifact of a bench run that holds its signed result.json (bench.yml's sign job uploads it)
RESULT_ARTIFACT = "result"


class PublishError(RuntimeError):
    """The branch could not be updated (rejected for good, or kept moving for every attempt)."""


class Refused(RuntimeError):
    """A ledger verb refused; its own message is already printed. Carries its exit code."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


@dataclass(frozen=True)
class Published:
    commit: str | None  # None: nothing changed, nothing pushed
    base: str
    attempts: int


# ---- git ----

def git_env(token: str | None = None, server_url: str | None = None) -> dict[str, str]:
    """The environment for git: no prompts, and when there is a token, an Authorization header for the
    server's URLs passed as configuration through the environment (git >= 2.31)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_CONFIG_")}
    env["GIT_TERMINAL_PROMPT"] = "0"
    if token:
        server = (server_url or env.get("GITHUB_SERVER_URL") or "https://github.com").rstrip("/")
        basic = base64.b64encode(f"x-access-token:{token}".encode()).decode()
        env.update(GIT_CONFIG_COUNT="1", GIT_CONFIG_KEY_0=f"http.{server}/.extraheader",
                   GIT_CONFIG_VALUE_0=f"AUTHORIZATION: basic {basic}")
    return env


def _git(cwd: Path, *args: str, env: dict[str, str] | None = None, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["git", *args], cwd=cwd, env=env, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise PublishError(f"git {' '.join(args)} failed ({proc.returncode}): {(proc.stderr or proc.stdout).strip()}")
    return proc


# a push refused because the branch moved: the compare-and-swap lost, so build again on the new tip
_LOST_RACE = ("[rejected]", "stale info", "fetch first", "non-fast-forward", "cannot lock ref",
              "failed to update ref", "incorrect old value")


def lost_race(output: str) -> bool:
    text = output.lower()
    if "[remote rejected]" in text:  # a hook or a ruleset said no; only a lock race is worth retrying
        return any(s in text for s in ("cannot lock ref", "failed to update ref", "incorrect old value"))
    return any(s in text for s in _LOST_RACE)


def _author(spec: str) -> tuple[str, str]:
    m = re.match(r"^\s*([^<>]+?)\s*<([^<>\s]+)>\s*\Z", spec or "")
    if not m:
        raise ValueError(f"--author {spec!r}: give it as 'Name <email>'")
    return m.group(1), m.group(2)


def publish(
    repo: Path,
    steps: Callable[[Path], None],
    message: str,
    *,
    remote: str = "origin",
    branch: str = "main",
    attempts: int = 6,
    backoff: float = 2.0,
    author: str = DEFAULT_AUTHOR,
    token: str | None = None,
    before_push: Callable[[int], None] | None = None,
    sleep: Callable[[float], None] = time.sleep,
    log: Callable[[str], None] = print,
) -> Published:
    """Run `steps(root)` on the branch's tip in a fresh worktree, commit OUTPUTS and push with a lease on
    that tip; redo everything on the new tip when the push loses the race. `before_push(attempt)` is
    for tests (to make another writer win)."""
    repo = Path(repo).resolve()
    name, email = _author(author)
    env = git_env(token)
    ref = f"refs/heads/{branch}"
    tracking = f"refs/remotes/{remote}/{branch}"
    scratch = Path(tempfile.mkdtemp(prefix="publish-"))
    try:
        for attempt in range(1, attempts + 1):
            _git(repo, "fetch", "--quiet", "--no-tags", remote, f"+{ref}:{tracking}", env=env)
            base = _git(repo, "rev-parse", "--verify", f"{tracking}^{{commit}}").stdout.strip()
            tree = scratch / f"attempt-{attempt}"
            _git(repo, "worktree", "add", "--quiet", "--detach", str(tree), base)
            try:
                steps(tree)
                present = [p for p in OUTPUTS if (tree / p).exists() or _git(tree, "ls-files", "--", p).stdout]
                if present:
                    _git(tree, "add", "--all", "--", *present)
                if _git(tree, "diff", "--cached", "--quiet", check=False).returncode == 0:
                    log(f"nothing to commit on {branch} at {base[:12]}")
                    return Published(None, base, attempt)
                who = {**env, "GIT_AUTHOR_NAME": name, "GIT_AUTHOR_EMAIL": email, "GIT_COMMITTER_NAME": name,
                       "GIT_COMMITTER_EMAIL": email}
                _git(tree, "commit", "--quiet", "--no-verify", "-m", message, env=who)
                commit = _git(tree, "rev-parse", "HEAD").stdout.strip()
                if before_push is not None:
                    before_push(attempt)
                push = _git(tree, "push", "--porcelain", f"--force-with-lease={ref}:{base}", remote,
                            f"{commit}:{ref}", env=env, check=False)
            finally:
                _git(repo, "worktree", "remove", "--force", str(tree), check=False)
            if push.returncode == 0:
                log(f"pushed {commit[:12]} onto {branch} at {base[:12]} (attempt {attempt})")
                return Published(commit, base, attempt)
            output = f"{push.stdout}\n{push.stderr}"
            if not lost_race(output):
                raise PublishError(f"pushing to {branch} was refused: {output.strip()}")
            if attempt < attempts:
                pause = backoff * 2 ** (attempt - 1) * (0.5 + random.random())
                log(f"{branch} moved past {base[:12]} (attempt {attempt} of {attempts}); rebuilding on the new tip "
                    f"in {pause:.1f} s")
                sleep(pause)
        raise PublishError(f"gave up after {attempts} attempts: {branch} kept moving under every push")
    finally:
        _git(repo, "worktree", "prune", check=False)
        shutil.rmtree(scratch, ignore_errors=True)


# ---- the verbs' steps ----

def _run_verb(argv: list[str]) -> None:
    """Run one of the ledger's or the boards' verbs as `python -m pipeline` would (its own parser and
    run function), in this process; a refusal ends the attempt."""
    from pipeline.board.cli import VERBS as BOARD_VERBS
    from pipeline.ledger import VERBS as LEDGER_VERBS

    name, rest = argv[0], argv[1:]
    register, run = {**LEDGER_VERBS, **BOARD_VERBS}[name]
    parser = argparse.ArgumentParser(prog=f"python -m pipeline {name}")
    register(parser)
    code = run(parser.parse_args(rest))
    if code != OK:
        raise Refused(code)


def _recorded(root: Path, pr: int, head_sha: str) -> bool:
    from pipeline import ledger as lg

    return any(r.get("kind") == "result" and r.get("pr") == pr and r.get("head_sha") == head_sha
               for r in lg.iter_records(root))


def _board_options(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """(board's extra options, snapshots' extra options) from publish's --now and --no-plots."""
    now = ["--now", args.now] if getattr(args, "now", None) else []
    return now + (["--no-plots"] if getattr(args, "no_plots", False) else []), now


def ledger_steps(args: argparse.Namespace, result: Path) -> Callable[[Path], None]:
    board_opts, snapshot_opts = _board_options(args)

    def steps(root: Path) -> None:
        if _recorded(root, args.pr, args.head_sha):
            print(f"PR #{args.pr} at {args.head_sha} is already in the ledger; regenerating the board only")
        else:
            _run_verb(["ledger", "append", str(result), "--pr", str(args.pr), "--login", args.login,
                       "--head-sha", args.head_sha, "--merged-at", args.merged_at, "--root", str(root),
                       *(["--allow-unofficial"] if args.allow_unofficial else [])])
        _run_verb(["board", "--root", str(root), *board_opts])
        _run_verb(["snapshots", "--root", str(root), *snapshot_opts])

    return steps


def snapshot_steps(args: argparse.Namespace) -> Callable[[Path], None]:
    board_opts, snapshot_opts = _board_options(args)

    def steps(root: Path) -> None:
        _run_verb(["snapshots", "--root", str(root), *snapshot_opts])
        _run_verb(["board", "--root", str(root), *board_opts])

    return steps


def reconcile_steps(args: argparse.Namespace, found: list["Evaluated"], outcome: dict) -> Callable[[Path], None]:
    """Append every evaluated merge that the tip's ledger lacks, in merged_at order, then regenerate
    the board and the snapshots. `outcome` tells the caller what the last attempt did."""
    board_opts, snapshot_opts = _board_options(args)

    def steps(root: Path) -> None:
        from pipeline import ledger as lg

        recorded = {(r["pr"], r["head_sha"]) for r in lg.iter_records(root) if r.get("kind") == "result"}
        outcome.update(appended=[], refused=[], already=[])
        for e in found:
            if (e.pr, e.head_sha) in recorded:
                outcome["already"].append(e)
                continue
            try:
                _run_verb(["ledger", "append", str(e.result), "--pr", str(e.pr), "--login", e.login,
                           "--head-sha", e.head_sha, "--merged-at", e.merged_at, "--root", str(root)])
            except Refused:
                outcome["refused"].append(e)
                continue
            recorded.add((e.pr, e.head_sha))
            outcome["appended"].append(e)
        if outcome["appended"]:  # nothing is pushed that `ledger verify` would refuse: chain, evidence, signatures
            _run_verb(["ledger", "verify", "--root", str(root)])
        _run_verb(["board", "--root", str(root), *board_opts])
        _run_verb(["snapshots", "--root", str(root), *snapshot_opts])

    return steps


# ---- publish ----

def _publish_args(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="what", metavar="WHAT", required=True)
    a = sub.add_parser("ledger", help="append a merged PR's result, regenerate the board and snapshots, push")
    a.add_argument("result", type=Path, metavar="RESULT.json", help="the signed result the bench run uploaded")
    a.add_argument("--pr", type=int, required=True)
    a.add_argument("--login", required=True)
    a.add_argument("--head-sha", required=True)
    a.add_argument("--merged-at", required=True, metavar="ISO8601")
    a.add_argument("--allow-unofficial", action="store_true", help="for a test or demo ledger only")
    sub.add_parser("snapshots", help="backfill the hourly snapshots, regenerate the board, push")
    r = sub.add_parser("reconcile", help="record every merged and evaluated PR the ledger lacks (asking GitHub), "
                       "regenerate the board and snapshots, push")
    r.add_argument("--pr", type=int, action="append", default=[], metavar="N",
                   help="this PR must end up recorded (repeatable): exit 1 when it cannot be (ledger.yml passes the "
                        "merged PR that triggered it)")
    r.add_argument("--since", metavar="ISO8601",
                   help="merges since then (default: the first track's start in ROOT/competition.toml)")
    r.add_argument("--days", type=int, default=LOOKBACK_DAYS,
                   help=f"how far before the earliest merge to look for its bench run (default {LOOKBACK_DAYS})")
    r.add_argument("--github-repo", metavar="OWNER/NAME", help="default: $GITHUB_REPOSITORY")
    for q in sub.choices.values():
        q.add_argument("--repo", type=Path, default=Path("."), help="the clone to publish from (default: .)")
        q.add_argument("--remote", default="origin")
        q.add_argument("--branch", default="main")
        q.add_argument("--attempts", type=int, default=6, help="pushes to try before giving up (default 6)")
        q.add_argument("--backoff", type=float, default=2.0, help="seconds before the first retry, doubled each time")
        q.add_argument("--author", default=os.environ.get("PIPELINE_COMMIT_AUTHOR") or DEFAULT_AUTHOR,
                       help="the commits' author, 'Name <email>' (default: $PIPELINE_COMMIT_AUTHOR)")
        q.add_argument("--now", metavar="ISO8601", help="passed to board and snapshots (default: the clock)")
        q.add_argument("--no-plots", action="store_true", help="passed to board: skip the PNGs")


def publish_verb(args: argparse.Namespace) -> int:
    """ledger.yml / snapshot.yml: run the ledger verbs on the branch tip, commit, push with a compare-and-swap.

    `publish reconcile [--pr N]` (what both workflows run) records every merged and evaluated PR the
    ledger lacks, asking GitHub which, and regenerates leaderboard.md and the snapshots; `publish ledger
    RESULT.json --pr N --login L --head-sha S --merged-at T` appends one result by hand; `publish
    snapshots` backfills the snapshots and regenerates the board. When the branch moved, everything is
    redone on the new tip and pushed again.
    """
    if args.attempts < 1 or args.backoff < 0:
        return error(USAGE, "--attempts must be at least 1 and --backoff not negative")
    try:
        _author(args.author)
    except ValueError as exc:
        return error(USAGE, str(exc))
    if not (Path(args.repo) / ".git").exists():
        return error(USAGE, f"{args.repo}: not a git clone; pass --repo with the checkout of the repository")
    if args.what == "reconcile":
        return reconcile(args)
    if args.what == "ledger":
        result = args.result.resolve()
        if not result.is_file():
            return error(USAGE, f"{args.result}: no such file; pass the result.json the bench run uploaded")
        if not SHA1_RE.match(args.head_sha):
            return error(USAGE, f"--head-sha {args.head_sha!r} is not a 40-hex-digit commit SHA")
        steps = ledger_steps(args, result)
        message = f"ledger: PR #{args.pr} (@{args.login}) at {args.head_sha[:12]}, merged {args.merged_at}"
    else:
        steps = snapshot_steps(args)
        message = f"snapshots: backfill up to {args.now or format(dt.datetime.now(dt.timezone.utc), '%Y-%m-%dT%H:00Z')}"
    # Import everything the steps use now: the worktrees are data, never the code that runs.
    import pipeline.board.cli  # noqa: F401
    import pipeline.ledger  # noqa: F401

    try:
        publish(Path(args.repo), steps, message, remote=args.remote, branch=args.branch, attempts=args.attempts,
                backoff=args.backoff, author=args.author, token=os.environ.get(TOKEN_ENV) or None)
    except Refused as exc:
        return error(exc.code, "nothing was pushed")
    except PublishError as exc:
        return error(REFUSED, str(exc))
    return OK


# ---- reconcile ----

@dataclass(frozen=True)
class Evaluated:
    """A merged PR, the bench run that evaluated its merged head, and that run's signed result (a file)."""
    pr: int
    login: str
    head_sha: str
    merged_at: str
    run_id: int
    result: Path


def _since(args: argparse.Namespace) -> dt.datetime:
    from pipeline.competition import load, parse_instant

    if args.since:
        return parse_instant(args.since, "--since")
    competition = load(Path(args.repo) / "competition.toml")
    return min(t.start for t in competition.tracks.values())


def _tip_results(repo: Path, remote: str, branch: str) -> set[tuple[int, str]]:
    """(PR, head SHA) of every result in the ledger at the branch's tip on the remote, read from git
    (the checkout may be older): which merges need nothing downloaded. Each attempt checks again."""
    from pipeline import ledger as lg

    env = git_env(os.environ.get(TOKEN_ENV) or None)
    tracking = f"refs/remotes/{remote}/{branch}"
    _git(repo, "fetch", "--quiet", "--no-tags", remote, f"+refs/heads/{branch}:{tracking}", env=env)
    names = _git(repo, "ls-tree", "--name-only", f"{tracking}:{lg.LEDGER_DIR.as_posix()}", check=False).stdout.split()
    shards = {}
    for name in names:
        if lg.SHARD_RE.match(name):
            shards[name] = subprocess.run(["git", "cat-file", "blob", f"{tracking}:{lg.LEDGER_DIR.as_posix()}/{name}"],
                                          cwd=repo, capture_output=True, check=True).stdout
    return {(r["pr"], r["head_sha"]) for r in lg.iter_shards(shards) if r.get("kind") == "result"}


def _touches_submissions(gh, number: int) -> bool:
    return any(f.path.startswith("submissions/") or (f.previous_path or "").startswith("submissions/")
               for f in gh.pull_files(number))


def find_evaluated(gh, args: argparse.Namespace, recorded: set[tuple[int, str]], folder: Path,
                   log: Callable[[str], None] = print) -> tuple[list[Evaluated], list[str], list[str]]:
    """Ask GitHub which merged PRs the ledger lacks and, for each, the latest successful bench run of its
    merged head; download that run's signed `result` into `folder`. Returns (what can be recorded, in
    merged_at order; notes: why others are not, such as a merge whose evaluation failed; errors: a
    result that does not verify, which nobody should ever see)."""
    from pipeline import result, signing
    from pipeline.github import GitHubError
    from pipeline.ledger import RECORDED_STATUSES
    from pipeline.result import MAX_BYTES

    since = _since(args)
    pulls = {p.number: p for p in gh.merged_pulls(since)}
    for n in args.pr:
        if n not in pulls:
            pulls[n] = gh.pull(n)
    problems: list[str] = []
    missing = []
    for p in sorted(pulls.values(), key=lambda p: (p.merged_at or "", p.number)):
        if not p.merged or not p.merged_at:
            problems.append(f"#{p.number} is not merged ({p.state}); only a merged PR's result is recorded")
        elif (p.number, p.head_sha) not in recorded:
            missing.append(p)
    errors: list[str] = []
    if not missing:
        return [], problems, errors
    keyring = signing.load_keyring(signing.keyring_dir(args.repo))
    earliest = min(dt.datetime.strptime(p.merged_at, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.timezone.utc)
                   for p in missing)
    runs = gh.bench_runs(earliest - dt.timedelta(days=args.days))
    found = []
    for p in missing:
        mine = [r for r in runs if r.pr == p.number]
        done = [r for r in mine if r.head_sha == p.head_sha and r.status == "completed" and r.conclusion == "success"]
        if not done:
            if not mine and p.number not in args.pr and not _touches_submissions(gh, p.number):
                continue  # an organizer's PR: nothing to record
            evaluated = sorted({r.head_sha[:12] for r in mine if r.head_sha and r.conclusion == "success"})
            problems.append(f"#{p.number} was merged at head {p.head_sha}, which no bench run evaluated successfully"
                            + (f" (evaluated: {', '.join(evaluated)})" if evaluated else " (no evaluation at all)")
                            + ": the merged head must be the evaluated one. Label the head with run-eval; once its "
                            "run succeeds, the next ledger or snapshot run records it")
            continue
        run = max(done, key=lambda r: (r.created_at, r.id))
        try:
            data = gh.artifact(run.id, RESULT_ARTIFACT, "result.json", MAX_BYTES)
        except GitHubError as exc:
            problems.append(f"#{p.number}: {exc}; re-run its evaluation (label the head with run-eval)")
            continue
        try:  # its status decides only whether to try; `ledger append` checks everything again
            doc = result.loads(data)
            signing.verify(doc, keyring)
            status = doc.get("status")
            gated = status == "incorrect" and doc.get("track") == "serving"
        except (ValueError, UnicodeDecodeError, AttributeError, signing.SignatureError) as exc:
            errors.append(f"#{p.number}: the result of bench run {run.id} does not verify ({exc}): an artifact "
                          "that is not the signer's; investigate before anything else")
            continue
        if status not in RECORDED_STATUSES:
            problems.append(f"#{p.number} was merged although its evaluation (bench run {run.id}) says {status!r}"
                            + (": its correctness gate failed (G = 0, so S = 0), and a gated serving result is never "
                               "recorded or ranked" if gated else ": nothing to record"))
            continue
        path = folder / f"pr-{p.number}-{p.head_sha[:12]}-run-{run.id}.json"
        path.write_bytes(data)
        found.append(Evaluated(p.number, p.author, p.head_sha, p.merged_at, run.id, path))
        log(f"#{p.number} by @{p.author}, merged {p.merged_at} at {p.head_sha[:12]}: not in the ledger yet; "
            f"bench run {run.id} evaluated it")
    return found, problems, errors


def reconcile(args: argparse.Namespace) -> int:
    """ledger.yml and snapshot.yml: record EVERY merged and evaluated PR still missing from the ledger.

    GitHub keeps one pending run per concurrency group and cancels the others, so no run may be the only
    one that records its PR: each run asks GitHub for the PRs merged since the competition's start,
    keeps those whose merged head a bench run evaluated successfully and that the branch tip's ledger
    lacks, downloads each one's signed result (as data), and appends them in merged_at order, then
    regenerates the board and the snapshots and pushes with the compare-and-swap of `publish`. Running
    it again, or many at once, records nothing twice. Exit 1 when a result was refused, or a PR named by
    --pr could not be recorded; the others are recorded and pushed all the same.
    """
    from pipeline import ledger as lg
    from pipeline.competition import CompetitionError, InstantError
    from pipeline.github import GitHub, GitHubError
    from pipeline.signing import SignatureError

    import pipeline.board.cli  # noqa: F401 - everything the steps use, before the worktrees exist

    repo = Path(args.repo)
    try:
        gh = GitHub.from_env(repository=args.github_repo)
        with tempfile.TemporaryDirectory(prefix="reconcile-") as folder:
            recorded = _tip_results(repo, args.remote, args.branch)
            found, problems, errors = find_evaluated(gh, args, recorded, Path(folder))
            for line in problems:
                print(f"note: {line}", file=sys.stderr)
            for line in errors:
                print(f"refused: {line}", file=sys.stderr)
            outcome: dict = {}
            prs = ", ".join(f"#{e.pr}" for e in found)
            message = (f"ledger: record {prs} (reconcile)" if found else
                       f"snapshots: backfill up to {args.now or format(dt.datetime.now(dt.timezone.utc), '%Y-%m-%dT%H:00Z')}")
            published = publish(repo, reconcile_steps(args, found, outcome), message, remote=args.remote,
                                branch=args.branch, attempts=args.attempts, backoff=args.backoff, author=args.author,
                                token=os.environ.get(TOKEN_ENV) or None)
    except (CompetitionError, InstantError, GitHubError, SignatureError) as exc:
        return error(USAGE, str(exc))
    except lg.LedgerBroken as exc:
        return error(REFUSED, f"the ledger does not verify: {exc}")
    except Refused as exc:
        return error(exc.code, "nothing was pushed")
    except PublishError as exc:
        return error(REFUSED, str(exc))
    appended = outcome.get("appended", [])
    if published.commit:
        print(f"recorded {len(appended)} merged PR{'s' if len(appended) != 1 else ''}"
              + (f" ({', '.join(f'#{e.pr}' for e in appended)})" if appended else ""))
    done = recorded | {(e.pr, e.head_sha) for e in appended + outcome.get("already", [])}
    unrecorded = [n for n in args.pr if not any(pr == n for pr, _ in done)]
    refused = outcome.get("refused", [])
    if refused or unrecorded or errors:
        what = [f"#{e.pr} (run {e.run_id}): its result was refused (above)" for e in refused]
        what += [f"{len(errors)} result{'s' if len(errors) != 1 else ''} did not verify (above)"] if errors else []
        what += [f"#{n} is not recorded (see the notes above)" for n in unrecorded if n not in {e.pr for e in refused}]
        return error(REFUSED, "; ".join(what) + ("; everything else was recorded and pushed" if published.commit
                                                  else ""))
    return OK


# ---- find-result ----

def _find_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pr", type=int, required=True, metavar="N", help="the merged pull request")
    p.add_argument("--repo", metavar="OWNER/NAME", help="default: $GITHUB_REPOSITORY")
    p.add_argument("--output", type=Path, metavar="FILE",
                   help="append key=value lines here (a step's $GITHUB_OUTPUT): pr, login, head_sha, merged_at, run_id")
    p.add_argument("--days", type=int, default=LOOKBACK_DAYS, help=f"how far back to look (default {LOOKBACK_DAYS})")


def find_result(args: argparse.Namespace) -> int:
    """ledger.yml: check that a PR is merged at an evaluated head and name the bench run that evaluated it.

    The merged head must be the commit the gate dispatched and the runner evaluated (a bench run titled
    with that PR and head SHA that completed); its signed result is what `publish ledger` records.
    """
    from pipeline.github import GitHub, GitHubError

    try:
        gh = GitHub.from_env(repository=args.repo)
        pull = gh.pull(args.pr)
        if not pull.merged or not pull.merged_at:
            return error(REFUSED, f"#{args.pr} is not merged ({pull.state}); only a merged PR's result is recorded")
        merged = dt.datetime.strptime(pull.merged_at, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.timezone.utc)
        runs = gh.bench_runs(merged - dt.timedelta(days=args.days))
    except GitHubError as exc:
        return error(USAGE, str(exc))
    mine = [r for r in runs if r.pr == pull.number]
    done = [r for r in mine if r.head_sha == pull.head_sha and r.status == "completed" and r.conclusion == "success"]
    if not done:
        evaluated = sorted({r.head_sha[:12] for r in mine if r.head_sha and r.conclusion == "success"})
        return error(REFUSED, (
            f"#{pull.number} was merged at head {pull.head_sha}, which no bench run evaluated successfully"
            + (f" (evaluated: {', '.join(evaluated)})" if evaluated else " (no evaluation at all)")
            + ": the merged head must be the evaluated one. Label the head with run-eval, let it finish, then "
            "re-run ledger.yml for this PR."))
    run = max(done, key=lambda r: r.created_at)
    facts = {"pr": str(pull.number), "login": pull.author, "head_sha": pull.head_sha, "merged_at": pull.merged_at,
             "run_id": str(run.id)}
    # every value is a number, a login, a hex SHA or an instant: none can carry a newline into the file
    for key, value in facts.items():
        if not re.match(r"^[A-Za-z0-9:._-]+\Z", value):
            return error(REFUSED, f"unexpected {key} {value!r} from the API")
    if args.output:
        with open(args.output, "a", encoding="utf-8") as fh:
            fh.writelines(f"{k}={v}\n" for k, v in facts.items())
    print(f"#{pull.number} by @{pull.author}, merged {pull.merged_at} at {pull.head_sha}: evaluated by bench run "
          f"{run.id} ({run.html_url})")
    return OK


VERBS = {
    "find-result": (_find_args, find_result),
    "publish": (_publish_args, publish_verb),
}
