"""A local server that answers like GitHub's REST API, for the parts the pipeline uses.

Served by pytest-httpserver over real HTTP, so PyGithub runs unmodified (its requester, retries,
pagination). State is plain data (pulls, files, trees, blobs, comments, labels, roles, check runs,
workflow runs and their artifacts); every request is logged as "METHOD /path?query" with its JSON body, so tests assert
the exact requests. Lists are paginated with `Link` headers like GitHub's (`page_size` caps per_page,
so small pages can be forced). `fail(...)` makes the next matching requests answer an error, before
or after doing their work (a POST whose answer is lost); `hold(...)` keeps matching requests waiting
(a client to be killed mid-way).
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import itertools
import json
import re
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

from werkzeug.wrappers import Request, Response

REPO = "muse-competition/pipeline"
TOKEN = "test-token"


def blob_sha(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def fake_sha(*parts: Any) -> str:
    return hashlib.sha1(repr(parts).encode()).hexdigest()


@dataclass
class Fault:
    method: str
    path: re.Pattern
    status: int
    times: int
    headers: dict[str, str]
    message: str
    after: bool  # do the work, then answer the error


@dataclass
class Logged:
    method: str
    target: str  # path?query
    body: Any
    auth: str | None

    def __repr__(self) -> str:
        return f"{self.method} {self.target}"


@dataclass
class FakeGitHub:
    server: Any
    repo: str = REPO
    page_size: int = 100
    bot: str = "github-actions[bot]"
    pulls: dict[int, dict] = field(default_factory=dict)
    files: dict[int, list[dict]] = field(default_factory=dict)
    trees: dict[str, list[dict]] = field(default_factory=dict)
    blobs: dict[str, bytes] = field(default_factory=dict)
    comments: dict[int, list[dict]] = field(default_factory=dict)
    roles: dict[str, str] = field(default_factory=dict)
    check_runs: list[dict] = field(default_factory=list)
    runs: list[dict] = field(default_factory=list)
    dispatches: list[dict] = field(default_factory=list)
    commit_pulls: dict[str, list[int]] = field(default_factory=dict)
    artifacts: dict[int, list[dict]] = field(default_factory=dict)  # run id -> its artifacts
    blobs_storage: dict[int, bytes] = field(default_factory=dict)  # artifact id -> its zip
    log: list[Logged] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    holds: list[tuple[str, re.Pattern, Any]] = field(default_factory=list)
    run_details: bool = True

    def __post_init__(self) -> None:
        self._ids = itertools.count(1001)
        self.server.expect_request(re.compile(".*")).respond_with_handler(self._handle)

    # ---- test set-up ----

    @property
    def base(self) -> str:
        return self.server.url_for("").rstrip("/")

    def env(self) -> dict[str, str]:
        return {"GITHUB_API_URL": self.base, "GITHUB_REPOSITORY": self.repo, "GITHUB_TOKEN": TOKEN,
                "PIPELINE_GITHUB_THROTTLE": "0", "PIPELINE_GITHUB_BACKOFF": "0.001", "PIPELINE_BOT_LOGIN": self.bot}

    def add_commit(self, files: dict[str, tuple[str, bytes]], sha: str | None = None) -> str:
        """A commit whose tree holds `files` (path -> (mode, content)); a submodule's content is its SHA."""
        root: dict = {}
        for path, (mode, content) in files.items():
            node = root
            parts = path.split("/")
            for part in parts[:-1]:
                node = node.setdefault(part, {})
            node[parts[-1]] = (mode, content)
        sha = sha or fake_sha("commit", sorted(files.items()))
        self.trees[sha] = self._tree(root)
        return sha

    def _tree(self, node: dict) -> list[dict]:
        entries = []
        for name, value in sorted(node.items()):
            if isinstance(value, dict):
                sha = fake_sha("tree", name, repr(value))
                self.trees[sha] = self._tree(value)
                entries.append({"path": name, "mode": "040000", "type": "tree", "sha": sha,
                                "url": f"{self.base}/repos/{self.repo}/git/trees/{sha}"})
            else:
                mode, content = value
                if mode == "160000":
                    entries.append({"path": name, "mode": mode, "type": "commit", "sha": content.decode()})
                    continue
                sha = blob_sha(content)
                self.blobs[sha] = content
                entries.append({"path": name, "mode": mode, "type": "blob", "sha": sha, "size": len(content),
                                "url": f"{self.base}/repos/{self.repo}/git/blobs/{sha}"})
        return entries

    def add_pull(self, number: int, author: str, head_sha: str, files: list[dict], *, state: str = "open",
                 labels: tuple[str, ...] = (), merged_at: str | None = None, changed_files: int | None = None) -> dict:
        """`files`: the PR files API's entries ({"filename", "status", ...}); the head commit's tree is
        added separately with add_commit(..., sha=head_sha)."""
        pull = {
            "url": f"{self.base}/repos/{self.repo}/pulls/{number}",
            "html_url": f"https://github.com/{self.repo}/pull/{number}",
            "number": number,
            "state": state,
            "title": "my kernel",
            "user": {"login": author, "type": "User"},
            "head": {"sha": head_sha, "ref": "my-branch", "repo": {"full_name": f"{author}/pipeline"}},
            "base": {"sha": fake_sha("base"), "ref": "main", "repo": {"full_name": self.repo}},
            "merged": merged_at is not None,
            "merged_at": merged_at,
            "created_at": "2026-10-20T00:00:00Z",
            "updated_at": merged_at or "2026-10-20T00:00:00Z",
            "labels": [{"name": n} for n in labels],
            "changed_files": len(files) if changed_files is None else changed_files,
        }
        self.pulls[number] = pull
        self.files[number] = [{"sha": f.get("sha"), "additions": 1, "deletions": 0, "changes": 1, **f} for f in files]
        self.commit_pulls.setdefault(head_sha, []).append(number)
        return pull

    def add_comment(self, number: int, body: str, login: str) -> dict:
        cid = next(self._ids)
        comment = {"id": cid, "url": f"{self.base}/repos/{self.repo}/issues/comments/{cid}", "body": body,
                   "user": {"login": login}, "html_url": f"https://github.com/{self.repo}/pull/{number}#c{cid}",
                   "issue_url": f"{self.base}/repos/{self.repo}/issues/{number}",
                   "created_at": "2026-10-23T10:00:00Z", "updated_at": "2026-10-23T10:00:00Z"}
        self.comments.setdefault(number, []).append(comment)
        return comment

    def add_run(self, title: str, created_at: str, status: str = "completed") -> dict:
        rid = next(self._ids)
        run = {"id": rid, "name": "bench", "display_title": title, "event": "workflow_dispatch", "status": status,
               "conclusion": "success" if status == "completed" else None, "created_at": created_at,
               "html_url": f"https://github.com/{self.repo}/actions/runs/{rid}",
               "url": f"{self.base}/repos/{self.repo}/actions/runs/{rid}"}
        self.runs.append(run)
        return run

    def merge(self, number: int, merged_at: str) -> dict:
        """The PR is merged now: closed, with GitHub's merged_at, and updated then."""
        pull = self.pulls[number]
        pull.update(state="closed", merged=True, merged_at=merged_at, updated_at=merged_at, closed_at=merged_at)
        return pull

    def add_artifact(self, run_id: int, name: str, files: dict[str, bytes], *, expired: bool = False) -> dict:
        """An artifact of a workflow run: a zip of `files`, served from a storage URL the API redirects to."""
        import io
        import zipfile

        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
            for path, data in files.items():
                zf.writestr(path, data)
        aid = next(self._ids)
        self.blobs_storage[aid] = buf.getvalue()
        artifact = {"id": aid, "node_id": f"A{aid}", "name": name, "size_in_bytes": len(buf.getvalue()),
                    "url": f"{self.base}/repos/{self.repo}/actions/artifacts/{aid}",
                    "archive_download_url": f"{self.base}/repos/{self.repo}/actions/artifacts/{aid}/zip",
                    "expired": expired, "created_at": "2026-10-22T09:00:00Z", "expires_at": "2027-01-20T09:00:00Z",
                    "updated_at": "2026-10-22T09:00:00Z", "workflow_run": {"id": run_id}}
        self.artifacts.setdefault(run_id, []).append(artifact)
        return artifact

    def fail(self, method: str, path: str, status: int, *, times: int = 1, headers: dict[str, str] | None = None,
             message: str = "Server Error", after: bool = False) -> None:
        self.faults.append(Fault(method, re.compile(path), status, times, headers or {}, message, after))

    def hold(self, method: str, path: str):
        """Matching requests wait (up to a minute) until the returned event is set: a client caught in the
        middle of its work, to be killed there."""
        import threading

        event = threading.Event()
        self.holds.append((method, re.compile(path), event))
        return event

    def requests(self) -> list[str]:
        return [repr(entry) for entry in self.log]

    def bodies(self, method: str) -> list[Any]:
        return [entry.body for entry in self.log if entry.method == method]

    # ---- serving ----

    def _handle(self, request: Request) -> Response:
        path = request.path
        query = request.query_string.decode()
        body = json.loads(request.data) if request.data else None
        self.log.append(Logged(request.method, path + (f"?{query}" if query else ""), body,
                               request.headers.get("Authorization")))
        for method, pattern, event in self.holds:
            if method == request.method and pattern.fullmatch(path):
                event.wait(60)
        fault = next((f for f in self.faults if f.times > 0 and f.method == request.method and f.path.fullmatch(path)),
                     None)
        if fault and not fault.after:
            fault.times -= 1
            return self._error(fault)
        response = self._route(request.method, path, dict(urllib.parse.parse_qsl(query)), body)
        if fault and fault.after:
            fault.times -= 1
            return self._error(fault)
        return response

    def _error(self, fault: Fault) -> Response:
        return Response(json.dumps({"message": fault.message, "documentation_url": "https://docs.github.com/rest"}),
                        status=fault.status, headers=fault.headers, content_type="application/json")

    def _json(self, data: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
        return Response(json.dumps(data), status=status, headers=headers or {}, content_type="application/json")

    def _not_found(self) -> Response:
        return self._json({"message": "Not Found", "documentation_url": "https://docs.github.com/rest"}, 404)

    def _page(self, path: str, query: dict[str, str], items: list, key: str | None = None) -> Response:
        per_page = min(int(query.get("per_page", 30)), 100, self.page_size)
        page = int(query.get("page", 1))
        last = max(1, -(-len(items) // per_page))
        chunk = items[(page - 1) * per_page: page * per_page]
        links = []
        for rel, n in (("next", page + 1), ("last", last)) if page < last else ():
            q = dict(query, page=str(n))
            links.append(f'<{self.base}{path}?{urllib.parse.urlencode(q)}>; rel="{rel}"')
        headers = {"Link": ", ".join(links)} if links else {}
        data = {"total_count": len(items), key: chunk} if key else chunk
        return self._json(data, headers=headers)

    def _route(self, method: str, path: str, query: dict[str, str], body: Any) -> Response:
        prefix = f"/repos/{self.repo}"
        m = re.fullmatch(r"/_storage/artifacts/(\d+)\.zip", path)
        if m and method == "GET":  # where GitHub's artifact download redirects (another host in reality)
            data = self.blobs_storage.get(int(m[1]))
            return Response(data, content_type="application/zip") if data is not None else self._not_found()
        if not path.startswith(prefix + "/"):
            return self._not_found()
        rest = path[len(prefix):]
        m = re.fullmatch(r"/pulls/(\d+)", rest)
        if m and method == "GET":
            pull = self.pulls.get(int(m[1]))
            return self._json(pull) if pull else self._not_found()
        m = re.fullmatch(r"/pulls/(\d+)/files", rest)
        if m and method == "GET":
            return self._page(path, query, self.files.get(int(m[1]), []))
        if rest == "/pulls" and method == "GET":
            state = query.get("state", "open")
            items = [p for _, p in sorted(self.pulls.items()) if (state == "all" or p["state"] == state)
                     and ("base" not in query or p["base"]["ref"] == query["base"])]
            sort = query.get("sort", "created")
            field_ = {"created": "created_at", "updated": "updated_at"}.get(sort)
            if field_:
                # GitHub's default direction is desc for any explicit sort but created, asc for that one
                desc = query.get("direction", "asc" if sort == "created" else "desc") == "desc"
                items.sort(key=lambda p: (p[field_], p["number"]), reverse=desc)
            return self._page(path, query, items)
        m = re.fullmatch(r"/git/trees/([^/]+)", rest)
        if m and method == "GET":
            entries = self.trees.get(m[1])
            if entries is None:
                return self._not_found()
            return self._json({"sha": m[1], "url": f"{self.base}{path}", "tree": entries, "truncated": False})
        m = re.fullmatch(r"/git/blobs/([0-9a-f]{40})", rest)
        if m and method == "GET":
            data = self.blobs.get(m[1])
            if data is None:
                return self._not_found()
            return self._json({"sha": m[1], "size": len(data), "url": f"{self.base}{path}", "encoding": "base64",
                               "content": base64.encodebytes(data).decode()})
        m = re.fullmatch(r"/collaborators/([^/]+)/permission", rest)
        if m and method == "GET":
            login = urllib.parse.unquote(m[1])
            role = self.roles.get(login, "read")
            legacy = {"maintain": "write", "triage": "read"}.get(role, role)
            return self._json({"permission": legacy, "role_name": role, "user": {"login": login}})
        m = re.fullmatch(r"/issues/(\d+)/labels/(.+)", rest)
        if m and method == "DELETE":
            pull = self.pulls.get(int(m[1]))
            name = urllib.parse.unquote(m[2])
            if not pull or name not in [label["name"] for label in pull["labels"]]:
                return self._json({"message": "Label does not exist"}, 404)
            pull["labels"] = [label for label in pull["labels"] if label["name"] != name]
            return self._json(pull["labels"])
        m = re.fullmatch(r"/issues/(\d+)/comments", rest)
        if m and method == "GET":
            return self._page(path, query, self.comments.get(int(m[1]), []))
        if m and method == "POST":
            return self._json(self.add_comment(int(m[1]), body["body"], self.bot), 201)
        m = re.fullmatch(r"/issues/comments/(\d+)", rest)
        if m and method == "PATCH":
            for comment in itertools.chain.from_iterable(self.comments.values()):
                if comment["id"] == int(m[1]):
                    comment["body"] = body["body"]
                    comment["updated_at"] = "2026-10-23T11:00:00Z"
                    return self._json(comment)
            return self._not_found()
        m = re.fullmatch(r"/commits/([0-9a-f]{40})/pulls", rest)
        if m and method == "GET":
            items = [self.pulls[n] for n in self.commit_pulls.get(m[1], [])]
            return self._page(path, query, items)
        m = re.fullmatch(r"/commits/([0-9a-f]{40})/check-runs", rest)
        if m and method == "GET":
            items = [c for c in self.check_runs if c["head_sha"] == m[1]
                     and ("check_name" not in query or c["name"] == query["check_name"])]
            return self._page(path, query, items, key="check_runs")
        if rest == "/check-runs" and method == "POST":
            cid = next(self._ids)
            run = {"id": cid, "url": f"{self.base}{prefix}/check-runs/{cid}", "app": {"slug": "github-actions"},
                   "html_url": f"https://github.com/{self.repo}/runs/{cid}", **body}
            self.check_runs.append(run)
            return self._json(run, 201)
        m = re.fullmatch(r"/check-runs/(\d+)", rest)
        if m and method == "PATCH":
            for run in self.check_runs:
                if run["id"] == int(m[1]):
                    run.update(body)
                    return self._json(run)
            return self._not_found()
        m = re.fullmatch(r"/actions/workflows/([^/]+)/runs", rest)
        if m and method == "GET":
            items = [r for r in reversed(self.runs) if ("event" not in query or r["event"] == query["event"])
                     and ("created" not in query or r["created_at"] >= query["created"].lstrip(">="))]
            return self._page(path, query, items, key="workflow_runs")
        m = re.fullmatch(r"/actions/runs/(\d+)/artifacts", rest)
        if m and method == "GET":
            return self._page(path, query, self.artifacts.get(int(m[1]), []), key="artifacts")
        m = re.fullmatch(r"/actions/artifacts/(\d+)/zip", rest)
        if m and method == "GET":
            if int(m[1]) not in self.blobs_storage:
                return self._not_found()
            return Response(status=302, headers={"Location": f"{self.base}/_storage/artifacts/{m[1]}.zip"})
        m = re.fullmatch(r"/actions/workflows/([^/]+)/dispatches", rest)
        if m and method == "POST":
            self.dispatches.append(body)
            inputs = body.get("inputs") or {}
            now = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
            run = self.add_run(f"bench #{inputs.get('pr')} @{inputs.get('login')} {inputs.get('head_sha')}", now,
                               status="queued")
            if body.get("return_run_details") and self.run_details:
                return self._json({"workflow_run_id": run["id"], "run_url": run["url"], "html_url": run["html_url"]})
            return Response(status=204)
        return self._not_found()
