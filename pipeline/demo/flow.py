"""The demo's competition (pipeline/demo/__init__.py says what it is): the scenario, and each step as the
subprocess `python -m pipeline <verb>` a workflow runs, against a temporary git repository."""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from pipeline.evaluation import bar

HERE = Path(__file__).resolve().parent
KERNELS = HERE / "kernels"
SERVER = HERE / "server.py"
HARNESS = HERE.parents[1]  # the checkout pipeline/ lives in: competition.toml, sglang_pin/, problems/
MARKER = ".pipeline-demo"
OUR_FILES = ("comments", "leaderboard", "snapshots", "leaderboard.md", "prizes.md", "steps.txt", "git-log.txt",
             "summary.json", MARKER)

PROBLEM = "muse_bf16_proj"
# The shortened calendar: the kernel track three days, the serving track two, the demo's "now" an hour
# after the serving track closed (every daily window closed, every prize decided).
KERNEL_START, KERNEL_END = "2026-10-22T00:00:00Z", "2026-10-25T00:00:00Z"
SERVING_START, SERVING_END = "2026-10-25T00:00:00Z", "2026-10-27T00:00:00Z"
NOW = "2026-10-27T01:00:00Z"
REPOSITORY = "example/muse-demo"
# The serving evaluation, shortened (the official plan is competition.toml [serving])
SERVING_PLAN = ["--levels", "1,4,16,32", "--window-s", "0.4", "--warmup-s", "0.05", "--runs", "1",
                "--gsm8k-questions", "2"]
# the baseline's server streams a token every 4 ms (pipeline/demo/server.py); a patch sets its own pace
BASELINE_TOKEN_S = 0.004
RUNNER_ENV = {"PIPELINE_KEYRING", "PIPELINE_SIGNING_KEY_FILE", "PIPELINE_RESULT_KEY_FILE", "PIPELINE_SEED_SECRET_FILE",
              "PIPELINE_SERVING_DATASET", "PIPELINE_SERVING_DATASET_SHA256", "PIPELINE_SERVING_MODEL",
              "PIPELINE_HARNESS_COMMIT", "PIPELINE_IMAGE_DIGEST", "PIPELINE_TEST_KILL_APPEND_AT"}
ACT = "python/sglang/srt/layers/activation.py"
SAMPLER = "python/sglang/srt/layers/sampler.py"
PACE_FILE = "python/sglang/srt/_demo_server.json"


class OutError(Exception):
    """--out cannot be used (exit 2)."""


class StepFailed(Exception):
    """A step of the flow did not go as the scenario says (exit 1)."""


# ---- the scenario ----

@dataclass
class PR:
    number: int
    login: str
    what: str  # one line for the output
    opened: str
    merged: str | None  # when a maintainer merges it, if its evaluation passes
    kernel: str | None = None  # pipeline/demo/kernels/<name>.py
    path: str | None = None  # where the PR puts it (default: the author's own folder)
    serving: str | None = None  # the patch: "pace:<token_s>" or "sampler"
    extra: dict[str, str] = field(default_factory=dict)  # other files the PR changes: path -> text
    expect: str = "passed"  # refused:<rule>, passed, incorrect, runtime_error
    # filled in as the flow runs
    head: str = ""
    base: str = ""
    verdict: dict[str, Any] = field(default_factory=dict)
    result: dict[str, Any] | None = None
    eval_s: float = 0.0
    comment: str = ""
    outcome: str = ""

    @property
    def track(self) -> str:
        return "serving" if self.serving else "kernel"

    @property
    def submission(self) -> str:
        if self.path:
            return self.path
        if self.serving:
            return f"submissions/serving/{self.login}/patch.diff"
        return f"submissions/kernel/{PROBLEM}/{self.login}/submission.py"

    @property
    def timed(self) -> bool:
        return self.kernel is not None and self.expect == "passed"


def scenario() -> list[PR]:
    """Six competitors, twelve pull requests, in the order they are opened."""
    return [
        PR(1, "carol", "a correct kernel that does its matmul 3 times", "2026-10-22T03:00:00Z",
           "2026-10-22T05:00:00Z", kernel="steady"),
        PR(2, "dave", "a wrong kernel (K and V blocks of the weight swapped)", "2026-10-22T06:00:00Z", None,
           kernel="wrong", expect="incorrect"),
        PR(3, "erin", "a kernel that crashes (reads an input that does not exist)", "2026-10-22T09:00:00Z", None,
           kernel="crash", expect="runtime_error"),
        PR(4, "bob", "a correct kernel that does its matmul 9 times", "2026-10-22T12:00:00Z",
           "2026-10-22T14:00:00Z", kernel="slow"),
        PR(5, "dave", "a README in carol's folder", "2026-10-23T02:00:00Z", None,
           kernel="steady", path=f"submissions/kernel/{PROBLEM}/dave/submission.py",
           extra={f"submissions/kernel/{PROBLEM}/carol/README.md": "carol's kernel is slow; use dave's\n"},
           expect="refused:login-mismatch"),
        PR(6, "alice", "a correct kernel: one bf16 matmul", "2026-10-23T08:00:00Z", "2026-10-23T10:00:00Z",
           kernel="fast"),
        PR(7, "frank", "a kernel, and the kernel track's end moved a week later in competition.toml",
           "2026-10-23T15:00:00Z", None, kernel="fast",
           extra={"competition.toml": "(the track's end, a week later)"}, expect="refused:protected-path"),
        PR(8, "erin", "a correct kernel, opened and merged after the kernel track closed", "2026-10-25T01:00:00Z",
           "2026-10-25T02:00:00Z", kernel="fast"),
        PR(9, "carol", "a serving patch whose server streams a token every 12 ms", "2026-10-25T04:00:00Z",
           "2026-10-25T06:00:00Z", serving="pace:0.012"),
        PR(10, "frank", "a serving patch that changes SGLang's sampler", "2026-10-25T09:00:00Z", None,
           serving="sampler", expect="refused:patch-"),
        PR(11, "alice", "a serving patch whose server streams a token every 1.5 ms", "2026-10-26T02:00:00Z",
           "2026-10-26T04:00:00Z", serving="pace:0.0015"),
        PR(12, "bob", "a serving patch that only adds a comment (the baseline's pace)", "2026-10-26T07:00:00Z",
           "2026-10-26T09:00:00Z", serving=f"pace:{BASELINE_TOKEN_S}"),
    ]


# ---- output ----

def prepare_out(out: Path) -> Path:
    """The output folder, made ready: new, empty, or an earlier demo's (whose files are replaced). Returned
    absolute: the verbs run as processes in the temporary repository, where a relative path means another
    place."""
    out = Path(out).absolute()
    if out.exists() and not out.is_dir():
        raise OutError(f"--out {out}: this is a file, not a folder; pass a folder to write the demo's outputs into "
                       "(a new one, an empty one, or an earlier demo's)")
    if out.is_dir():
        try:
            names = set(os.listdir(out))
        except OSError as exc:
            raise OutError(f"--out {out}: cannot list it ({exc.strerror}); pass a folder you can write to") from None
        if names and MARKER not in names:
            raise OutError(f"--out {out}: the folder is not empty and holds no earlier demo's output "
                           f"({len(names)} entries, e.g. {sorted(names)[0]!r}); pass a new or empty folder")
        if names - set(OUR_FILES):
            raise OutError(f"--out {out}: besides an earlier demo's output it holds "
                           f"{', '.join(sorted(names - set(OUR_FILES))[:3])}; pass a new or empty folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
        for name in OUR_FILES:
            target = out / name
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            elif target.exists() or target.is_symlink():
                target.unlink()
        (out / MARKER).write_text("written by python -m pipeline demo; its next run replaces this folder's files\n")
    except OSError as exc:
        raise OutError(f"--out {out}: cannot write there ({exc.strerror or exc}); pass a folder you can write to") \
            from None
    return out


class Progress:
    """One line a step: with a bar on a terminal (stderr), plain lines otherwise; every step and the
    commands it ran also go to steps.txt."""

    def __init__(self, total: int, log: Path) -> None:
        self.total, self.done, self.log = total, 0, log
        self.tty = sys.stderr.isatty()
        self.lock = threading.Lock()
        self.t0 = time.monotonic()
        log.write_text("")

    def step(self, text: str) -> None:
        with self.lock:
            self.done += 1
            n, total = self.done, max(self.total, self.done)
            clock = f"{time.monotonic() - self.t0:5.0f}s"
            if self.tty:
                print(f"\r\x1b[2K{bar(n, total)} {clock}  {text}", file=sys.stderr, flush=True)
            else:
                print(f"[{n:>2}/{total}] {clock}  {text}", file=sys.stderr, flush=True)
            with open(self.log, "a") as fh:
                fh.write(f"[{n}/{total}] {text}\n")

    def note(self, text: str) -> None:
        with self.lock:
            print("  " + text, file=sys.stderr, flush=True)
            with open(self.log, "a") as fh:
                fh.write(f"  {text}\n")

    def command(self, argv: list[str], done: subprocess.CompletedProcess) -> None:
        with self.lock, open(self.log, "a") as fh:
            shown = " ".join(a if re.fullmatch(r"[\w@%+=:,./-]+", a) else json.dumps(a) for a in argv)
            fh.write(f"    $ {shown}\n      exit {done.returncode}\n")


# ---- the machinery: git and the verbs, as processes ----

class Stopped(StepFailed):
    """The demo is stopping (a step failed elsewhere, or Ctrl-C): no new process is started."""


class Shell:
    def __init__(self, repo: Path, work: Path, progress: Progress) -> None:
        self.repo, self.work, self.progress = repo, work, progress
        self._lock = threading.Lock()
        self._running: set[subprocess.Popen] = set()
        self._stopping = False
        # the demo's own keys, dataset and seeds: a runner's settings in the environment must not reach its verbs
        # (the caches stay: the pinned tree, the tokenizer, the corpus)
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_") and k not in RUNNER_ENV}
        self.env.update(GIT_CONFIG_NOSYSTEM="1", GIT_CONFIG_GLOBAL=os.devnull, GIT_CEILING_DIRECTORIES=str(work),
                        PYTHONPATH=os.pathsep.join([str(HARNESS)] + ([os.environ["PYTHONPATH"]]
                                                                      if os.environ.get("PYTHONPATH") else [])))

    def process(self, argv: list[str], cwd: Path, env: dict[str, str], timeout: float | None = None,
                text: bool = True) -> subprocess.CompletedProcess:
        """Run `argv` to its end, as one of the demo's processes: `stop` ends it if the demo stops first."""
        with self._lock:
            if self._stopping:
                raise Stopped("the demo is stopping")
            proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=text)
            self._running.add(proc)
        try:
            out, err = proc.communicate(timeout=timeout)
        except BaseException:  # a timeout, or Ctrl-C while this thread waits: it is ended before it is forgotten
            _end(proc)
            raise
        finally:
            with self._lock:
                self._running.discard(proc)
        if self._stopping:
            raise Stopped("the demo is stopping")
        return subprocess.CompletedProcess(argv, proc.returncode, out, err)

    def stop(self) -> None:
        """Start no more processes, and end those running: SIGTERM (an evaluation then ends its workers),
        SIGKILL after 10 s. Returns when none is left."""
        with self._lock:
            self._stopping = True
            procs = list(self._running)
        for proc in procs:
            proc.terminate()
        for proc in procs:
            _end(proc)

    def git(self, *args: str, at: str | None = None, cwd: Path | None = None, who: str = "demo") -> str:
        env = dict(self.env)
        if at:
            env.update(GIT_AUTHOR_DATE=at, GIT_COMMITTER_DATE=at)
        ident = ["-c", f"user.name={who}", "-c", f"user.email={who}@users.noreply.example"]
        done = self.process(["git", *ident, *args], cwd=cwd or self.repo, env=env)
        if done.returncode != 0:
            raise StepFailed(f"git {' '.join(args)}: {done.stderr.strip()[-2000:]}")
        return done.stdout

    def verb(self, *args: str, ok: tuple[int, ...] = (0,), timeout: float = 300) -> subprocess.CompletedProcess:
        argv = [sys.executable, "-m", "pipeline", *args]
        try:
            done = self.process(argv, cwd=self.work, env=self.env, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise StepFailed(f"python -m pipeline {' '.join(args[:2])} ran past {timeout:.0f} s") from None
        self.progress.command(["python", "-m", "pipeline", *args], done)
        if done.returncode not in ok:
            raise StepFailed(f"python -m pipeline {' '.join(args)} exited {done.returncode}:\n"
                             + (done.stderr or done.stdout).strip()[-3000:])
        return done


def _end(proc: subprocess.Popen) -> None:
    """SIGTERM (an evaluation then ends its own workers), SIGKILL after 10 s; returns once it has ended."""
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# ---- the flow ----

def run(out: Path) -> int:
    prs = scenario()
    merged = [p for p in prs if p.merged]
    evaluated = [p for p in prs if not p.expect.startswith("refused")]
    total = 4 + len(prs) + len(evaluated) + len(prs) + 4
    progress = Progress(total, out / "steps.txt")
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="pipeline-demo-") as tmp:
        work = Path(tmp)
        repo = work / "repo"
        sh = Shell(repo, work, progress)
        try:
            _competition(sh, prs, out)
        except (StepFailed, OSError) as exc:  # OSError: an output that cannot be written
            print(f"\nthe demo stopped: {exc}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the clean-up short
            sh.stop()
            print(f"\ninterrupted after {progress.done} of {progress.total} steps: every process of the demo "
                  f"ended and its temporary repository removed; {out / 'steps.txt'} says what ran", file=sys.stderr)
            return 130
        finally:
            sh.stop()  # whatever happened, nothing of the demo outlives it, and nothing writes into `tmp` now
    elapsed = time.monotonic() - t0
    summary = json.loads((out / "summary.json").read_text())
    summary["seconds"] = round(elapsed, 1)
    (out / "summary.json").write_text(json.dumps(summary, indent=1, sort_keys=True) + "\n")
    print(f"\nThe demo's competition ran in {elapsed:.0f} s: {len(prs)} pull requests, {len(merged)} merged.")
    print(f"Open {out / 'leaderboard.md'}, {out / 'prizes.md'}, {out / 'comments'}/ and {out / 'snapshots'}/.")
    wrong = [p for p in prs if p.outcome != "as scripted"]
    if wrong:
        for p in wrong:
            print(f"not as scripted: #{p.number} @{p.login}: {p.outcome}", file=sys.stderr)
        return 1
    return 0


def _competition(sh: Shell, prs: list[PR], out: Path) -> None:
    step, note = sh.progress.step, sh.progress.note
    work, repo = sh.work, sh.repo

    # -- setup: the pinned SGLang (the patch gate and the serving runs need it), the repository, the key --
    done = sh.verb("serving", "fetch", timeout=600)
    tree = Path(done.stdout.strip().splitlines()[-1])
    step(f"serving fetch: the pinned SGLang tree at {tree}")
    repo.mkdir()
    sh.git("init", "-q")
    sh.git("symbolic-ref", "HEAD", "refs/heads/main")
    (repo / "competition.toml").write_text(_calendar((HARNESS / "competition.toml").read_text()))
    (repo / "README.md").write_text("# Muse Spark Open (demo)\n\nA temporary repository of `python -m pipeline demo`.\n")
    (repo / "submissions").mkdir()
    (repo / "submissions" / ".gitkeep").write_text("")
    sh.git("add", "competition.toml", "README.md", "submissions/.gitkeep")
    sh.git("commit", "-q", "-m", "the competition, its calendar shortened for the demo", at="2026-10-21T12:00:00Z",
           who="organizer")
    step(f"repository: a git repository with competition.toml (kernel track {KERNEL_START[:10]} to "
         f"{KERNEL_END[:10]}, serving track {SERVING_START[:10]} to {SERVING_END[:10]}, exclusive ends)")
    key = work / "signer" / "demo.key"
    key.parent.mkdir()
    (repo / "keys" / "runners").mkdir(parents=True)
    sh.verb("keygen", "--private", str(key), "--public", str(repo / "keys" / "runners" / "demo.pub"))
    sh.git("add", "keys/runners/demo.pub")
    sh.git("commit", "-q", "-m", "the demo signer's public key", at="2026-10-21T12:30:00Z", who="organizer")
    step("keygen: a demo Ed25519 signing key (the private half outside the repository, the public one in "
         "keys/runners/demo.pub)")
    pin, dataset = _serving_inputs(work)
    step("serving inputs: a launch template for pipeline/demo/server.py (a scripted OpenAI-compatible server on "
         "loopback, standing in for SGLang) and a dataset of 8 conversations of 4 turns")
    note("shortened: kernels on the CPU with the smoke model, 1 seed a shape, unofficial timings; serving runs "
         "replay 0.4 s windows at c = 1, 4, 16, 32, one run per block, 2 GSM8K questions, against the scripted "
         "server")

    # -- the pull requests: a branch and a commit each, validated as validate.yml does; each valid one queued
    # for bench.yml (evaluate, then sign) as soon as it is: the serving runs one after another on one queue,
    # the kernels that time nothing on another, side by side with the validations --
    (out / "comments").mkdir()
    queues = {"serving": ThreadPoolExecutor(max_workers=1), "untimed": ThreadPoolExecutor(max_workers=1)}
    futures: list[Future] = []

    def bench(p: PR) -> None:
        _evaluate(sh, p, pin, dataset)
        _sign_and_comment(sh, p, key, out)
        step(_evaluated(p))

    try:
        for p in prs:
            _open(sh, p, tree)
            refused = [v["rule"] for v in p.verdict.get("violations", [])]
            notes = p.verdict.get("notices", [])
            if refused:
                first = p.verdict["violations"][0]
                step(f"validate #{p.number} @{p.login} ({p.what}): REFUSED [{', '.join(refused)}] {first['path']}: "
                     f"{first['message'][:140]}")
                _write_comment(p, out)
            else:
                step(f"validate #{p.number} @{p.login} ({p.what}): valid"
                     + (f"; note: {notes[0][:120]}" if notes else ""))
                if not p.timed:
                    futures.append(queues["serving" if p.serving else "untimed"].submit(bench, p))
        for f in futures:
            f.result()  # a step that failed raises here
    except BaseException:
        sh.stop()  # the steps still queued or running end now; the workers are joined before anything is removed
        raise
    finally:
        for q in queues.values():
            q.shutdown(wait=True, cancel_futures=True)
    # the timed kernels one at a time, alone: two timed evaluations on two cores disturb each other's timing
    for p in prs:
        if p.timed and not p.verdict.get("violations"):
            bench(p)

    # -- merges in the order of their (simulated) times; each recorded as ledger.yml does --
    events = sorted(prs, key=lambda p: (p.merged or p.opened, p.number))
    for p in events:
        status = p.result["status"] if p.result else None
        if p.merged and status == "passed":
            seq = _merge(sh, p)
            step(f"merge #{p.number} at {p.merged[:16].replace('T', ' ')}: git merge --no-ff, ledger append (seq "
                 f"{seq}), board")
        else:
            why = (f"refused by validation ({', '.join(v['rule'] for v in p.verdict['violations'])})" if status is None
                   else f"its evaluation says {status}")
            step(f"close #{p.number} without merging: {why}")
        p.outcome = _as_scripted(p)

    # -- the hourly snapshots, the prizes, the ledger's verification, the final board --
    sh.verb("snapshots", "--root", str(repo), "--now", NOW)
    hours = sorted((repo / "results" / "snapshots").rglob("*.json"))
    step(f"snapshots: {len(hours)} hourly snapshots from {KERNEL_START[:10]} to {NOW[:16].replace('T', ' ')}")
    daily_text = sh.verb("prizes", "--root", str(repo), "--now", NOW).stdout
    daily = json.loads(sh.verb("prizes", "--root", str(repo), "--now", NOW, "--json").stdout)
    winners = [f"{r['track']} {r['window']}: @{r['winner']}" for r in daily["windows"] if r["winner"]]
    step("prizes (daily): " + ", ".join(winners))
    final = _final_placings(repo)
    (out / "prizes.md").write_text(_prizes_md(daily_text, final, repo))
    step("final prizes: " + "; ".join(f"{b}: " + ", ".join(f"{r['place_label']} @{r['login']}" for r in rows)
                                      for b, rows in final.items()))
    verified = sh.verb("ledger", "verify", "--allow-unofficial", "--root", str(repo)).stdout.strip()
    sh.verb("board", "--root", str(repo), "--now", NOW)
    sh.git("add", "-A", "results", "leaderboard.md", "leaderboard")
    sh.git("commit", "-q", "--allow-empty", "-m", "snapshots up to the end of the competition", at=NOW, who="pipeline-bot")
    step("ledger verify: " + verified.splitlines()[-1][:160])

    # -- the outputs --
    shutil.copy(repo / "leaderboard.md", out / "leaderboard.md")
    if (repo / "leaderboard").is_dir():
        shutil.copytree(repo / "leaderboard", out / "leaderboard")
    shutil.copytree(repo / "results" / "snapshots", out / "snapshots")
    (out / "git-log.txt").write_text(sh.git("log", "--graph", "--format=%h %ad %an: %s", "--date=iso-strict", "main"))
    summary = {"prs": [{"pr": p.number, "login": p.login, "track": p.track, "what": p.what,
                        "violations": p.verdict.get("violations", []), "notices": p.verdict.get("notices", []),
                        "status": p.result["status"] if p.result else None,
                        "score": (p.result.get("score") or {}).get("speedup") if p.result else None,
                        "merged_at": p.merged if p.result and p.result["status"] == "passed" else None,
                        "evaluation_s": round(p.eval_s, 1), "outcome": p.outcome}
                       for p in prs],
               "final": final, "daily": daily["windows"], "now": NOW}
    (out / "summary.json").write_text(json.dumps(summary, indent=1, sort_keys=True) + "\n")


def _calendar(text: str) -> str:
    """The repository's competition.toml with both tracks' windows shortened and the demo's repository."""
    for track, start, end in (("kernel", KERNEL_START, KERNEL_END), ("serving", SERVING_START, SERVING_END)):
        section = re.search(rf"^\[tracks\.{track}\]\n(?:(?!\[).*\n)*", text, re.M)
        if section is None:
            raise StepFailed(f"competition.toml has no [tracks.{track}] table to shorten")
        body = re.sub(r"^start = .*$", f"start = {start}", section.group(0), flags=re.M)
        body = re.sub(r"^end = .*$", f"end = {end}", body, flags=re.M)
        text = text[:section.start()] + body + text[section.end():]
    return re.sub(r'^repository = ".*"$', f'repository = "{REPOSITORY}"', text, count=1, flags=re.M)


def _serving_inputs(work: Path) -> tuple[Path, Path]:
    """The demo's pin (sglang_pin/pin.toml and a [launch.demo] template for the scripted server) and its
    dataset (in the replay's format, checked whole by the evaluation)."""
    from pipeline.serving import dataset as ds

    argv = ["{python}", str(SERVER), "--port", "{port}", "--tree", "{tree}", "--token-s", str(BASELINE_TOKEN_S)]
    template = "\n".join([
        "[launch.demo]", 'engine = "sglang"', 'version = "demo"', "gpus = 1", 'device = "cpu"',
        f"argv = {json.dumps(argv)}", 'tokenizer = "pinned"', f'readable = ["{{tree}}", {json.dumps(str(SERVER))}]',
        'ready = "/health"', "ready_timeout_s = 30", 'warmup = "plain"',
        'slowdown = ["--chunk-delay-ms", "{delay_ms}"]'])
    pin = work / "pin.toml"
    pin.write_text((HARNESS / "sglang_pin" / "pin.toml").read_text() + "\n" + template + "\n")
    convs = []
    for i in range(8):
        turns = []
        for k in range(4):
            messages = ([{"role": "user", "content": f"task {i}: the test in tests/test_module_{i}.py fails; fix it"}]
                        if k == 0 else
                        [{"role": "tool", "tool_call_id": f"call_{i}_{k}", "name": "bash",
                          "content": f"$ pytest -q tests/test_module_{i}.py\n{k} failed, {3 - k % 3} passed"}])
            turns.append({"messages": messages, "max_tokens": 6 + (i + k) % 3, "canary": i in (1, 4),
                          "reply": f"I will run the tests of module_{i} again ({k})."})
        convs.append({"id": f"conv-{i}", "canary": i in (1, 4), "turns": turns})
    doc = {"format": ds.FORMAT, "version": ds.FORMAT_VERSION, "metadata": {},
           "system": "You are a coding agent. Tools: bash.", "conversations": convs}
    doc["metadata"] = {"generator": "pipeline/demo", "generator_version": ds.GENERATOR_VERSION, "seed": 0,
                       "corpus": "test", "shape": "agentic", "window": 4096, "content_sha256": ds.content_sha256(doc),
                       "summary": {}}
    path = work / "conversations.json"
    path.write_text(json.dumps(doc))
    return pin, path


def _patch(sh: Shell, p: PR, tree: Path) -> bytes:
    """A serving patch made with git against copies of the pinned tree's files, as a competitor makes it."""
    scratch = sh.work / f"patch-{p.number}"
    scratch.mkdir()
    files = [ACT] if p.serving.startswith("pace:") else [SAMPLER]
    for rel in files:
        (scratch / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(tree / rel, scratch / rel)
    sh.git("init", "-q", cwd=scratch)
    sh.git("add", "-A", cwd=scratch)
    sh.git("commit", "-q", "-m", "the pinned tree", cwd=scratch)
    if p.serving.startswith("pace:"):
        with open(scratch / ACT, "a") as fh:
            fh.write("# tuned for the demo's server\n")
        (scratch / PACE_FILE).write_text(json.dumps({"token_s": float(p.serving.split(":", 1)[1])}) + "\n")
    else:
        with open(scratch / SAMPLER, "a") as fh:
            fh.write("\n# greedy, always (fewer branches)\n")
    sh.git("add", "-A", cwd=scratch)
    return sh.git("diff", "--cached", "--full-index", cwd=scratch).encode()


def _open(sh: Shell, p: PR, tree: Path) -> None:
    """The PR's branch (from main as it is), its commit at the opening time, and validate.yml's step."""
    repo = sh.repo
    branch = f"{p.login}/pr-{p.number}"
    p.base = sh.git("rev-parse", "main").strip()
    sh.git("checkout", "-q", "-b", branch, "main")
    files: dict[str, str] = dict(p.extra)
    if p.serving:
        files[p.submission] = _patch(sh, p, tree).decode()
    else:
        files[p.submission] = (KERNELS / f"{p.kernel}.py").read_text()
    for rel, text in files.items():
        target = repo / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if rel == "competition.toml":
            text = target.read_text().replace(f"end = {KERNEL_END}", "end = 2026-11-01T00:00:00Z", 1)
        target.write_text(text)
        sh.git("add", rel)
    sh.git("commit", "-q", "-m", p.what, at=p.opened, who=p.login)
    p.head = sh.git("rev-parse", "HEAD").strip()
    sh.git("checkout", "-q", "main")
    # validate.yml: the diff of base...head, the PR's head checked out as data, the verdict as JSON and markdown
    diff = sh.work / f"pr-{p.number}.diff"
    diff.write_text(sh.git("diff", "--full-index", "--no-ext-diff", "--no-textconv", f"{p.base}...{p.head}"))
    checkout = sh.work / f"pr-{p.number}-head"
    sh.git("worktree", "add", "-q", "--detach", str(checkout), p.head)
    verdict = sh.work / f"pr-{p.number}-verdict.json"
    comment = sh.work / f"pr-{p.number}-validation.md"
    sh.verb("validate", "--diff", str(diff), "--author", p.login, "--tree", str(checkout), "--json", str(verdict),
            "--markdown", str(comment), "--now", p.opened, "--competition", str(repo / "competition.toml"), ok=(0, 1))
    p.verdict = json.loads(verdict.read_text())
    p.comment = comment.read_text()


def _meta(sh: Shell, p: PR) -> Path:
    """What fetch-submission writes for bench.yml (it reads the blob through the GitHub API; here git gives it)."""
    blob = sh.git("rev-parse", f"{p.head}:{p.submission}").strip()
    problem = None if p.serving else PROBLEM
    meta = {"pr": p.number, "head_sha": p.head, "login": p.login, "track": p.track, "problem": problem,
            "path": p.submission, "blob_sha": blob}
    path = sh.work / f"pr-{p.number}-submission.json"
    path.write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    return path


def _evaluate(sh: Shell, p: PR, pin: Path, dataset: Path) -> None:
    """bench.yml's evaluating job: the exact blob into a scratch checkout, then the evaluation."""
    scratch = sh.work / f"pr-{p.number}-scratch"
    target = scratch / p.submission
    target.parent.mkdir(parents=True)
    blob = sh.process(["git", "cat-file", "blob", f"{p.head}:{p.submission}"], cwd=sh.repo, env=sh.env, text=False)
    if blob.returncode != 0:
        raise StepFailed(f"git cat-file {p.head}:{p.submission}: {blob.stderr.decode(errors='replace').strip()}")
    target.write_bytes(blob.stdout)
    meta = _meta(sh, p)
    result = sh.work / f"pr-{p.number}-result.json"
    t0 = time.monotonic()
    if p.serving:
        sh.verb("serving", "evaluate", str(target), "--launch", "demo", "--pin", str(pin), "--dataset",
                str(dataset), "--meta", str(meta), "--json", str(result), *SERVING_PLAN, ok=(0, 1))
    else:
        sh.verb("evaluate", str(target), "--problem", PROBLEM, "--device", "cpu", "--model", "smoke", "--seeds",
                "1", "--meta", str(meta), "--json", str(result), ok=(0, 1))
    p.eval_s = time.monotonic() - t0
    p.result = json.loads(result.read_text())


def _evaluated(p: PR) -> str:
    doc = p.result
    how = "timed alone" if p.timed else ("serving queue" if p.serving else "untimed queue")
    line = f"evaluate and sign #{p.number} @{p.login} ({p.track}): {doc['status']}"
    if doc.get("score"):
        line += f", score {doc['score']['speedup']:.3f}{'' if p.serving else 'x'}"
    if doc["status"] not in ("passed", "needs_review"):
        line += ": " + _failure(doc)[:150]
    return line + f" ({p.eval_s:.0f} s, {how})"


def _failure(doc: dict[str, Any]) -> str:
    """The first reason a result failed: its error (with the submission's line), else its first failed shape."""
    err = doc.get("error") or {}
    if err:
        where = err.get("where") or {}
        return err["message"] + (f" (line {where['line']} of {Path(where['file']).name})"
                                 if where.get("file") and where.get("line") else "")
    bad = [c for c in doc.get("correctness") or [] if not c.get("passed")]
    if bad:
        return f"{bad[0]['shape']}: {bad[0].get('reason') or 'failed'}"
    return doc["status"]


def _sign_and_comment(sh: Shell, p: PR, key: Path, out: Path) -> None:
    unsigned = sh.work / f"pr-{p.number}-result.json"
    signed = sh.work / f"pr-{p.number}-signed.json"
    blob = json.loads((sh.work / f"pr-{p.number}-submission.json").read_text())["blob_sha"]
    sh.verb("sign", str(unsigned), "--out", str(signed), "--key-file", str(key), "--pr", str(p.number),
            "--head-sha", p.head, "--login", p.login, "--blob-sha", blob, "--problem", "serving" if p.serving else PROBLEM)
    markdown = sh.work / f"pr-{p.number}-comment.md"
    sh.verb("show-result", str(signed), "--markdown", str(markdown))
    p.result = json.loads(signed.read_text())
    if p.serving:
        sh.verb("plot-result", str(signed), "--out", str(out / "comments" / f"pr-{p.number:02d}-plot.png"))
    _write_comment(p, out, markdown.read_text())


def _write_comment(p: PR, out: Path, result_md: str | None = None) -> None:
    """The sticky comment as it stood after validation (gate.yml) and after the run (report.yml)."""
    parts = [f"<!-- pull request #{p.number} by @{p.login}: {p.what} -->",
             f"# Pull request #{p.number} (@{p.login})", "", f"_{p.what}; opened {p.opened[:16].replace('T', ' ')} "
             "UTC._", "", "## The bot's comment after validation", "", p.comment.strip(), ""]
    if result_md is not None:
        parts += ["## The bot's comment after the evaluation (it replaces the one above)", "", result_md.strip(), ""]
    (out / "comments" / f"pr-{p.number:02d}.md").write_text("\n".join(parts))


def _merge(sh: Shell, p: PR) -> int:
    """ledger.yml on a merged PR: the merge commit at merged_at, ledger append, the board, one commit."""
    repo = sh.repo
    sh.git("merge", "-q", "--no-ff", "-m", f"Merge pull request #{p.number} from {p.login}/pr-{p.number}",
           f"{p.login}/pr-{p.number}", at=p.merged, who="maintainer")
    done = sh.verb("ledger", "append", str(sh.work / f"pr-{p.number}-signed.json"), "--pr", str(p.number),
                   "--login", p.login, "--head-sha", p.head, "--merged-at", p.merged, "--allow-unofficial",
                   "--root", str(repo))
    seq = int(re.search(r"record seq (\d+)", done.stdout).group(1))
    sh.verb("board", "--root", str(repo), "--now", p.merged)
    sh.git("add", "-A", "results", "leaderboard.md", "leaderboard")
    sh.git("commit", "-q", "-m", f"ledger: record #{p.number}, regenerate leaderboard.md", at=p.merged,
           who="pipeline-bot")
    return seq


def _as_scripted(p: PR) -> str:
    rules = [v["rule"] for v in p.verdict.get("violations", [])]
    if p.expect.startswith("refused:"):
        want = p.expect.split(":", 1)[1]
        return "as scripted" if any(r == want or r.startswith(want) for r in rules) else \
            f"expected a refusal ({want}), got {rules or 'valid'}"
    if rules:
        return f"expected it valid, refused: {rules}"
    status = p.result["status"] if p.result else None
    return "as scripted" if status == p.expect else f"expected {p.expect}, evaluated {status}"


def _final_placings(repo: Path) -> dict[str, list[dict[str, Any]]]:
    """Each board at its track's close (the snapshot at the end instant) with competition.toml's prizes."""
    comp = tomllib.loads((repo / "competition.toml").read_text())
    prizes = comp.get("prizes", [])
    out: dict[str, list[dict[str, Any]]] = {}
    for name, track in comp["tracks"].items():
        end = track["end"].astimezone(dt.timezone.utc)
        snap = repo / "results" / "snapshots" / end.strftime("%Y-%m-%d") / f"{end:%H}.json"
        if not snap.is_file():
            raise StepFailed(f"no snapshot at the {name} track's close ({snap.relative_to(repo)})")
        boards = json.loads(snap.read_text())["boards"]
        for board, state in sorted(boards.items()):
            if not board.startswith(name):
                continue
            rows = []
            for row in json.loads(json.dumps(state["top"])):
                prize = next((z for z in prizes if z["place"] <= row["rank"] <= z.get("through", z["place"])), None)
                rows.append({"rank": row["rank"], "place_label": _ordinal(row["rank"]), "login": row["login"],
                             "pr": row["pr"], "score": row["speedup"],
                             "usd": prize["usd"] if prize else 0, "also": (prize or {}).get("also")})
            if rows:
                out[board] = rows
    return out


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def _prizes_md(daily_text: str, final: dict[str, list[dict[str, Any]]], repo: Path) -> str:
    lines = ["# Prizes of the demo's competition", "",
             f"From the ledger alone, as of {NOW[:16].replace('T', ' ')} UTC (the demo's calendar: kernel track "
             f"{KERNEL_START[:10]} to {KERNEL_END[:10]}, serving track {SERVING_START[:10]} to {SERVING_END[:10]}, "
             "ends exclusive). The results are unofficial CPU runs.", "",
             "## Final placings", "",
             "Each board as its track's last hourly snapshot shows it (at the track's close), with competition.toml's "
             "`[[prizes]]`; competitors whose results tie share a rank and each is listed with its prize.", ""]
    for board, rows in final.items():
        lines += [f"### {board}", "", "| place | competitor | score | PR | prize |", "| ---: | --- | ---: | --- | --- |"]
        for r in rows:
            prize = f"${r['usd']:,}" + (f" + {r['also']}" if r["also"] else "") if r["usd"] else "-"
            lines.append(f"| {r['place_label']} | @{r['login']} | {r['score']:.3f} | #{r['pr']} | {prize} |")
        if not rows:
            lines.append("| - | nobody ranked | | | |")
        lines.append("")
    lines += ["## Daily prizes", "", "`python -m pipeline prizes` (every 24-hour window's winner per board):", "",
              "```text", daily_text.rstrip(), "```", ""]
    return "\n".join(lines)
