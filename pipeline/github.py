"""Every call the pipeline makes to GitHub, through PyGithub: PR facts and files, trees and blobs, the
labeler's permission, the one sticky comment, the check run, dispatching bench.yml, reading merged_at,
the merged pull requests and a bench run's artifact (the ledger's reconcile).

Retries: reads, edits and deletes are idempotent and are retried by the HTTP layer (PyGithub's
GithubRetry over urllib3) on 5xx, 429 and rate-limit 403 answers, with exponential backoff, honouring
Retry-After and X-RateLimit-Reset. A POST is never retried blindly: a comment, a check run or a
dispatch whose answer was lost may have been created, so before each retry `_create` looks for what
the first attempt may have made (the marker comment, the named check run, the titled bench run).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, TypeVar

from pipeline.exits import USAGE, Stop, UsageError

DEFAULT_API = "https://api.github.com"
DEFAULT_BOT = "github-actions[bot]"
BENCH_WORKFLOW = "bench.yml"
CHECK_NAME = "evaluation"
# bench.yml's `run-name:`, so that its runs can be counted per competitor (the rate limit) and a lost
# dispatch found again: run-name: bench #${{ inputs.pr }} @${{ inputs.login }} ${{ inputs.head_sha }}
BENCH_TITLE = "bench #{pr} @{login} {head_sha}"
BENCH_TITLE_RE = re.compile(r"^bench #(?P<pr>\d+) @(?P<login>[A-Za-z0-9-]+) (?P<head_sha>[0-9a-f]{40})\b")
BENCH_INPUTS = ("pr", "head_sha", "login", "track", "problem", "path", "blob_sha", "gate_run")

T = TypeVar("T")


class GitHubError(UsageError, RuntimeError):
    """A GitHub call failed for good (after retries); the message says which call and why."""

    prefix = "GitHub: "


class BlobMismatch(GitHubError):
    """The bytes GitHub sent for a blob do not hash to its SHA."""


@dataclass(frozen=True)
class PullFacts:
    number: int
    author: str
    state: str
    head_sha: str
    head_repo: str | None
    base_ref: str
    merged: bool
    merged_at: str | None  # GitHub's merged_at, `YYYY-MM-DDTHH:MM:SSZ`
    labels: tuple[str, ...]
    changed_files: int | None
    html_url: str


@dataclass(frozen=True)
class PullFile:
    path: str
    status: str
    previous_path: str | None
    sha: str | None


@dataclass(frozen=True)
class TreeEntry:
    path: str
    mode: str
    type: str
    sha: str
    size: int | None


@dataclass(frozen=True)
class ArtifactFacts:
    id: int
    name: str
    expired: bool
    size: int
    download_url: str


@dataclass(frozen=True)
class BenchRun:
    id: int
    title: str
    created_at: dt.datetime
    status: str | None
    conclusion: str | None
    html_url: str
    pr: int | None
    login: str | None
    head_sha: str | None


def _instant(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, dt.datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=dt.timezone.utc)
        return value.astimezone(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return str(value)


class GitHub:
    """One repository on one GitHub (api.github.com, an Enterprise server, or a test server)."""

    def __init__(self, repository: str, *, token: str | None = None, base_url: str = DEFAULT_API,
                 bot_login: str = DEFAULT_BOT, retries: int = 5, backoff: float = 1.0, max_wait: float = 900.0,
                 throttle: bool = True, per_page: int = 100) -> None:
        from github import Auth, Github
        from github.GithubRetry import GithubRetry

        if repository.count("/") != 1:
            raise GitHubError(f"repository {repository!r} must be owner/name")
        self.repository = repository
        self.token = token
        self.bot_login = bot_login
        self.backoff = backoff
        self.retries = retries
        self.max_wait = max_wait
        retry = GithubRetry(
            total=retries,
            backoff_factor=backoff,
            backoff_max=max_wait,
            status_forcelist=[429, *range(500, 600)],
            allowed_methods=frozenset({"GET", "HEAD", "PUT", "PATCH", "DELETE", "OPTIONS"}),
            raise_on_status=False,
            secondary_rate_wait=min(60.0, max_wait),
            max_rate_limit_wait=max_wait,
        )
        self.client = Github(
            auth=Auth.Token(token) if token else None,
            base_url=base_url.rstrip("/"),
            retry=retry,
            per_page=per_page,
            lazy=True,
            seconds_between_requests=0.25 if throttle else None,
            seconds_between_writes=1.0 if throttle else None,
        )
        self.repo = self.client.get_repo(repository)
        self._trees: dict[str, dict[str, TreeEntry]] = {}

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, repository: str | None = None) -> "GitHub":
        """The client a workflow step gets: $GITHUB_REPOSITORY, $GITHUB_TOKEN, $GITHUB_API_URL (set by
        Actions), $PIPELINE_BOT_LOGIN (the App's `<slug>[bot]`; default github-actions[bot]);
        $PIPELINE_GITHUB_BACKOFF and $PIPELINE_GITHUB_THROTTLE=0 are for tests."""
        env = os.environ if environ is None else environ
        repo = repository or env.get("GITHUB_REPOSITORY")
        if not repo:
            raise GitHubError("no repository: set $GITHUB_REPOSITORY to owner/name or pass --repo")
        return cls(
            repo,
            token=env.get("GITHUB_TOKEN") or None,
            base_url=env.get("GITHUB_API_URL") or DEFAULT_API,
            bot_login=env.get("PIPELINE_BOT_LOGIN") or DEFAULT_BOT,
            backoff=float(env.get("PIPELINE_GITHUB_BACKOFF", "1.0")),
            max_wait=float(env.get("PIPELINE_GITHUB_MAX_WAIT", "900")),
            throttle=env.get("PIPELINE_GITHUB_THROTTLE", "1") != "0",
        )

    # ---- failures and the one retry loop of our own (for POSTs) ----

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        from github.GithubException import GithubException

        try:
            return fn()
        except GithubException as exc:
            raise GitHubError(f"{what}: GitHub answered {exc.status}: {_message(exc)}") from None
        except OSError as exc:  # requests' connection errors are OSErrors
            raise GitHubError(f"{what}: {exc}") from None

    def _retryable(self, exc: Exception) -> float | None:
        """Seconds to wait before retrying a POST that failed with `exc`, or None when it cannot help."""
        from github.GithubException import GithubException, RateLimitExceededException

        if isinstance(exc, GithubException):
            headers = {k.lower(): v for k, v in (exc.headers or {}).items()}
            limited = isinstance(exc, RateLimitExceededException) or exc.status == 429 or (
                exc.status == 403 and (headers.get("x-ratelimit-remaining") == "0" or "retry-after" in headers))
            if not limited and exc.status < 500:
                return None
            if "retry-after" in headers:
                return float(headers["retry-after"])
            if headers.get("x-ratelimit-remaining") == "0" and str(headers.get("x-ratelimit-reset", "")).isdigit():
                return max(0.0, int(headers["x-ratelimit-reset"]) - time.time() + 1)
            return 0.0
        if isinstance(exc, OSError):
            return 0.0
        return None

    def _create(self, what: str, post: Callable[[], T], find: Callable[[], T | None]) -> T:
        """POST once; when the answer is lost or refused for load, look for what it may have created
        before trying again, so that a retried POST never makes a second object."""
        from github.GithubException import GithubException

        for attempt in range(self.retries + 1):
            try:
                return post()
            except (GithubException, OSError) as exc:
                wait = self._retryable(exc)
                if wait is None or attempt == self.retries:
                    status = getattr(exc, "status", None)
                    detail = f"GitHub answered {status}: {_message(exc)}" if status else str(exc)
                    raise GitHubError(f"{what}: {detail}") from None
                wait = max(wait, self.backoff * 2 ** attempt)
                if wait > self.max_wait:
                    raise GitHubError(f"{what}: GitHub asks to wait {wait:.0f} s, more than {self.max_wait:.0f} s"
                                      ) from None
                time.sleep(wait)
            found = self._call(f"{what} (looking for the first attempt's result)", find)
            if found is not None:
                return found
        raise AssertionError("unreachable")

    # ---- pull requests ----

    def pull(self, number: int) -> PullFacts:
        return self._call(f"reading pull request #{number}", lambda: _pull_facts(self.repo.get_pull(number).raw_data))

    def merged_pulls(self, since: dt.datetime, base: str = "main") -> list[PullFacts]:
        """Every pull request into `base` merged at or after `since`, in merged_at order. Reads the closed
        pull requests most recently updated first and stops at the first one last updated before
        `since` (a merge updates a pull request, so none merged since can come after it)."""
        stamp = _instant(since)

        def get() -> list[PullFacts]:
            out = []
            for p in self.repo.get_pulls(state="closed", sort="updated", direction="desc", base=base):
                # the list's own fields only: reading raw_data, `merged` or `changed_files` of a listed pull
                # request makes PyGithub fetch each one again
                if (_instant(p.updated_at) or stamp) < stamp:
                    break
                merged_at = _instant(p.merged_at)
                if not merged_at or merged_at < stamp:
                    continue
                head_repo = p.head.repo
                out.append(PullFacts(
                    number=p.number, author=p.user.login, state=p.state, head_sha=p.head.sha,
                    head_repo=head_repo.full_name if head_repo is not None else None, base_ref=p.base.ref,
                    merged=True, merged_at=merged_at, labels=tuple(label.name for label in p.labels),
                    changed_files=None, html_url=p.html_url or ""))
            return sorted(out, key=lambda f: (f.merged_at, f.number))

        return self._call(f"listing the pull requests merged into {base} since {stamp}", get)

    def merged_at(self, number: int) -> str | None:
        """GitHub's merged_at of a PR (None while it is not merged): the ledger's accepted_at."""
        return self.pull(number).merged_at

    def pull_files(self, number: int) -> list[PullFile]:
        def get() -> list[PullFile]:
            out = []
            for f in self.repo.get_pull(number).get_files():
                raw = f.raw_data
                out.append(PullFile(raw["filename"], raw["status"], raw.get("previous_filename"), raw.get("sha")))
            return out

        return self._call(f"listing the files of pull request #{number}", get)

    def pulls_for_commit(self, sha: str) -> list[PullFacts]:
        def get() -> list[int]:
            return [p.number for p in self.repo.get_commit(sha).get_pulls()]

        numbers = self._call(f"finding the pull requests of commit {sha}", get)
        return [self.pull(n) for n in numbers]

    def find_pull(self, head_sha: str) -> PullFacts | None:
        """The pull request whose head is (or was, when later commits came) `head_sha`."""
        pulls = self.pulls_for_commit(head_sha)
        for p in pulls:
            if p.head_sha == head_sha:
                return p
        if pulls:
            return pulls[0]

        def scan() -> int | None:  # a fork's commit the association index does not know yet
            for p in self.repo.get_pulls(state="open"):
                if p.head.sha == head_sha:
                    return p.number
            return None

        number = self._call(f"looking for an open pull request at {head_sha}", scan)
        return self.pull(number) if number is not None else None

    def role(self, login: str) -> str:
        """The login's role on the repository: admin, maintain, write, triage, read or none."""
        from github.GithubException import UnknownObjectException

        def get() -> str:
            try:
                return self.repo.get_collaborator_role_name(login) or "none"
            except UnknownObjectException:  # not a user GitHub knows
                return "none"

        return self._call(f"reading @{login}'s permission", get)

    def remove_label(self, number: int, label: str) -> bool:
        """Remove a label; False when it was not there (a retried DELETE lands here too)."""
        from github.GithubException import GithubException

        def delete() -> bool:
            try:
                self.repo.get_issue(number).remove_from_labels(label)
                return True
            except GithubException as exc:
                if exc.status == 404:  # "Label does not exist"
                    return False
                raise

        return self._call(f"removing the label {label!r} from #{number}", delete)

    # ---- trees and blobs ----

    def _tree(self, sha: str) -> dict[str, TreeEntry]:
        if sha not in self._trees:
            def get() -> dict[str, TreeEntry]:
                tree = self.repo.get_git_tree(sha)
                return {e.path: TreeEntry(e.path, e.mode, e.type, e.sha, e.size) for e in tree.tree}

            self._trees[sha] = self._call(f"reading tree {sha}", get)
        return self._trees[sha]

    def tree_entry(self, commit_sha: str, path: str) -> TreeEntry | None:
        """The entry (mode, type, blob SHA, size) of `path` in a commit, walking one directory at a time
        (small answers, never truncated); None when the path is not there. A symlink or submodule on the
        way is returned as the entry, since nothing lies under it."""
        sha = commit_sha
        parts = path.split("/")
        for i, part in enumerate(parts):
            entry = self._tree(sha).get(part)
            if entry is None:
                return None
            if i == len(parts) - 1:
                return TreeEntry(path, entry.mode, entry.type, entry.sha, entry.size)
            if entry.type == "tree":
                sha = entry.sha
                continue
            if entry.type == "commit" or entry.mode == "120000":  # nothing lies under a link or submodule
                return TreeEntry("/".join(parts[: i + 1]), entry.mode, entry.type, entry.sha, entry.size)
            return None
        return None

    def blob(self, sha: str) -> bytes:
        """A blob's bytes, checked against its SHA (what git would compute), so they are exactly what the
        tree names."""
        import base64

        from pipeline.files import git_blob_sha

        def get() -> bytes:
            b = self.repo.get_git_blob(sha)
            if b.encoding != "base64":
                raise GitHubError(f"blob {sha}: unexpected encoding {b.encoding!r}")
            return base64.b64decode(b.content)

        data = self._call(f"reading blob {sha}", get)
        if git_blob_sha(data) != sha:
            raise BlobMismatch(f"blob {sha}: the bytes GitHub sent hash to {git_blob_sha(data)}; refusing them")
        return data

    # ---- the sticky comment ----

    def find_sticky(self, number: int, marker: str) -> Any | None:
        """The PR's sticky comment: holds the hidden marker AND was written by the bot (anyone can paste
        the marker into a comment of their own)."""
        def get() -> Any | None:
            for c in self.repo.get_issue(number).get_comments():
                if c.user is not None and c.user.login == self.bot_login and marker in (c.body or ""):
                    return c
            return None

        return self._call(f"listing the comments of #{number}", get)

    def upsert_comment(self, number: int, body: str, marker: str) -> tuple[int, bool]:
        """Create or update the one sticky comment, the bot's comment that holds `marker` (the hidden line
        pipeline/report.py's comments start with); (comment id, True when it was created)."""
        if marker not in body:
            body = marker + "\n" + body
        existing = self.find_sticky(number, marker)
        if existing is not None:
            if (existing.body or "") != body:
                self._call(f"updating the comment on #{number}", lambda: existing.edit(body))
            return existing.id, False
        created = self._create(
            f"commenting on #{number}",
            lambda: self.repo.get_issue(number).create_comment(body),
            lambda: self.find_sticky(number, marker),
        )
        if (created.body or "") != body:  # a lost first POST of an older body
            self._call(f"updating the comment on #{number}", lambda: created.edit(body))
        return created.id, True

    # ---- the check run ----

    def find_check_run(self, head_sha: str, name: str = CHECK_NAME) -> Any | None:
        def get() -> Any | None:
            for run in self.repo.get_commit(head_sha).get_check_runs(check_name=name):
                return run
            return None

        return self._call(f"listing the check runs of {head_sha}", get)

    def upsert_check_run(self, head_sha: str, *, conclusion: str | None, title: str, summary: str,
                         details_url: str | None = None, name: str = CHECK_NAME) -> tuple[int, bool]:
        """Create or update the named check run on a commit; completed with `conclusion`, or in progress
        when it is None. (id, True when it was created)."""
        from github.GithubObject import NotSet

        fields: dict[str, Any] = {"output": {"title": title[:255], "summary": summary[:65_535]}}
        if conclusion is None:
            fields["status"] = "in_progress"
        else:
            fields.update(status="completed", conclusion=conclusion,
                          completed_at=dt.datetime.now(dt.timezone.utc).replace(microsecond=0))
        fields["details_url"] = details_url if details_url else NotSet
        existing = self.find_check_run(head_sha, name)
        if existing is not None:
            self._call(f"updating check run {existing.id}", lambda: existing.edit(**fields))
            return existing.id, False
        created = self._create(
            f"creating the check run on {head_sha}",
            lambda: self.repo.create_check_run(name=name, head_sha=head_sha, **fields),
            lambda: self.find_check_run(head_sha, name),
        )
        return created.id, True

    # ---- bench.yml ----

    def bench_runs(self, since: dt.datetime, workflow: str = BENCH_WORKFLOW) -> list[BenchRun]:
        """bench.yml's dispatched runs created since `since`, newest first, with what their title names."""
        stamp = since.astimezone(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")

        def get() -> list[BenchRun]:
            out = []
            for run in self.repo.get_workflow(workflow).get_runs(event="workflow_dispatch", created=f">={stamp}"):
                title = run.display_title or ""
                m = BENCH_TITLE_RE.match(title)
                created = run.created_at
                if created.tzinfo is None:
                    created = created.replace(tzinfo=dt.timezone.utc)
                out.append(BenchRun(run.id, title, created, run.status, run.conclusion, run.html_url or "",
                                    int(m["pr"]) if m else None, m["login"] if m else None,
                                    m["head_sha"] if m else None))
            return out

        return self._call(f"listing the runs of {workflow}", get)

    def run_artifacts(self, run_id: int) -> list[ArtifactFacts]:
        """The artifacts of workflow run `run_id`, in the order GitHub lists them."""
        from github.Artifact import Artifact
        from github.PaginatedList import PaginatedList

        def get() -> list[ArtifactFacts]:
            url = f"{self.repo.url}/actions/runs/{int(run_id)}/artifacts"
            return [ArtifactFacts(int(a.id), a.name, bool(a.expired), a.size_in_bytes or 0, a.archive_download_url)
                    for a in PaginatedList(Artifact, self.repo.requester, url, None, list_item="artifacts")]

        return self._call(f"listing the artifacts of run {run_id}", get)

    def artifact(self, run_id: int, name: str, member: str, limit: int) -> bytes:
        """The bytes of file `member` in the artifact `name` of workflow run `run_id`, as data: the zip is
        read in memory, bounded (`limit` for the file, 4x that for the archive), never extracted to disk."""
        import io
        import zipfile

        found = [a for a in self.run_artifacts(run_id) if a.name == name]
        if not found:
            raise GitHubError(f"run {run_id} has no artifact {name!r}")
        expired, url, size = found[-1].expired, found[-1].download_url, found[-1].size
        if expired:
            raise GitHubError(f"run {run_id}'s artifact {name!r} has expired (see the repository's artifact retention)")
        if size > 4 * limit:
            raise GitHubError(f"run {run_id}'s artifact {name!r} is {size:,} bytes, more than a result's")
        data = self._download(f"downloading run {run_id}'s artifact {name!r}", url, 4 * limit)
        try:
            with zipfile.ZipFile(io.BytesIO(data)) as zf:
                info = next((i for i in zf.infolist() if i.filename == member), None)
                if info is None:
                    raise GitHubError(f"run {run_id}'s artifact {name!r} holds no {member} "
                                      f"({', '.join(i.filename for i in zf.infolist()[:5]) or 'nothing'})")
                if info.file_size > limit:
                    raise GitHubError(f"{member} in run {run_id}'s artifact {name!r} is {info.file_size:,} bytes")
                with zf.open(info) as fh:
                    out = fh.read(limit + 1)
        except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, ValueError) as exc:
            raise GitHubError(f"run {run_id}'s artifact {name!r} is not a readable zip ({exc})") from None
        if len(out) > limit:
            raise GitHubError(f"{member} in run {run_id}'s artifact {name!r} is larger than it says")
        return out

    def _download(self, what: str, url: str, limit: int) -> bytes:
        """GET `url` with the token, following GitHub's redirect to its storage (requests drops the
        Authorization header when the host changes); retried on 5xx and connection errors."""
        import requests

        headers = {"Accept": "application/vnd.github+json", "User-Agent": "muse-pipeline"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        for attempt in range(self.retries + 1):
            try:
                with requests.get(url, headers=headers, stream=True, timeout=60) as resp:
                    if resp.status_code < 400:
                        data = resp.raw.read(limit + 1, decode_content=True)
                        if len(data) > limit:
                            raise GitHubError(f"{what}: more than {limit:,} bytes")
                        return data
                    status = resp.status_code
                    if status < 500 and status != 429:
                        raise GitHubError(f"{what}: GitHub answered {status}")
            except requests.RequestException as exc:
                if attempt == self.retries:
                    raise GitHubError(f"{what}: {exc}") from None
            if attempt < self.retries:
                time.sleep(self.backoff * 2 ** attempt)
        raise GitHubError(f"{what}: GitHub kept answering with errors")

    def dispatch_bench(self, inputs: dict[str, str], ref: str = "main", workflow: str = BENCH_WORKFLOW) -> BenchRun | None:
        """Dispatch bench.yml on `ref` with the gate's record as inputs. Returns the run when GitHub says
        which it is (or when a lost dispatch is found again), else None."""
        unknown = set(inputs) - set(BENCH_INPUTS)
        if unknown:
            raise GitHubError(f"bench.yml has no input(s) {sorted(unknown)}")
        inputs = {k: str(v) for k, v in inputs.items()}
        started = dt.datetime.now(dt.timezone.utc) - dt.timedelta(minutes=2)

        def post() -> BenchRun | None:
            result = self.repo.get_workflow(workflow).create_dispatch(ref, inputs, throw=True, return_run_details=True)
            if result is True or result is False:
                return None
            return BenchRun(result.id, BENCH_TITLE.format(**{k: inputs.get(k) for k in ("pr", "login", "head_sha")}),
                            dt.datetime.now(dt.timezone.utc), "queued", None, result.html_url or "",
                            int(inputs["pr"]) if inputs.get("pr", "").isdigit() else None, inputs.get("login"),
                            inputs.get("head_sha"))

        def find() -> BenchRun | None:
            for run in self.bench_runs(started, workflow):
                if run.head_sha == inputs.get("head_sha") and str(run.pr) == inputs.get("pr"):
                    return run
            return None

        return self._create(f"dispatching {workflow}", post, find)


def _pull_facts(raw: dict[str, Any]) -> PullFacts:
    head_repo = (raw.get("head") or {}).get("repo") or {}
    return PullFacts(
        number=raw["number"],
        author=raw["user"]["login"],
        state=raw["state"],
        head_sha=raw["head"]["sha"],
        head_repo=head_repo.get("full_name"),
        base_ref=raw["base"]["ref"],
        merged=bool(raw.get("merged") or raw.get("merged_at")),
        merged_at=_instant(raw.get("merged_at")),
        labels=tuple(label["name"] for label in raw.get("labels") or []),
        changed_files=raw.get("changed_files"),
        html_url=raw.get("html_url", ""),
    )


def _message(exc: Any) -> str:
    data = getattr(exc, "data", None)
    if isinstance(data, dict) and data.get("message"):
        return str(data["message"])
    return str(data or exc)[:300]


# ---- for the verbs a workflow runs ----

def github_args(p: argparse.ArgumentParser, *, event: bool = True) -> None:
    """--repo, and --event (a workflow's payload file), for a verb that a workflow runs."""
    p.add_argument("--repo", metavar="OWNER/NAME", help="default: $GITHUB_REPOSITORY")
    if event:
        p.add_argument("--event", type=Path, metavar="JSON",
                       default=Path(os.environ["GITHUB_EVENT_PATH"]) if os.environ.get("GITHUB_EVENT_PATH") else None,
                       help="the event payload (default: $GITHUB_EVENT_PATH)")


def github_client(args: argparse.Namespace) -> GitHub:
    """The client of the environment (pipeline.github.GitHub.from_env) for a verb's --repo; exit 2 without one."""
    try:
        return GitHub.from_env(repository=getattr(args, "repo", None))
    except GitHubError as exc:
        raise Stop(USAGE, str(exc)) from None
