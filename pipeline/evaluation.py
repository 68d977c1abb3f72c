"""The kernel track's verbs: `evaluate` (a submission's verdict: correctness on every shape, then timing
against the baseline), `calibrate` (the problems' tolerances against their correct and wrong variants)
and `problems` (what can be evaluated). Registered in pipeline/cli.py's VERBS.

Each parses, checks what the competitor passed (a clear message and exit 2 on a mistake), calls
pipeline/kernel/ and prints. The evaluation itself, and every rule of it, is pipeline/kernel/evaluate.py.
`evaluate --comment` prints the pull request comment the bot would post for the result (post-result's own
`pr_comment` (pipeline/post.py), with the would-be rank on the repository's board or --board's), so a competitor sees it
before opening the PR; on a terminal a progress bar shows the stages on stderr (`Progress`).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from pipeline.exits import USAGE, error

HARNESS_ERROR = 3  # the evaluation could not be completed for a reason that is not the submission's


def _usage(message: str) -> int:
    return error(USAGE, message)


BAR_WIDTH = 24


def bar(done: int, total: int, width: int = BAR_WIDTH) -> str:
    """`[#####.......] done/total`: the progress bar the evaluation and the demo draw on a terminal."""
    filled = width * done // max(1, total)
    return f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total}"


class Progress:
    """The evaluation's stages as they finish, on stderr. On a terminal: one bar, redrawn in place, with
    the stage just finished; anywhere else (a pipe, a job's log) no bar, one line per stage as before,
    so a log reads in order and a program reading stderr sees no carriage returns. A stage that runs
    longer than HEARTBEAT_S since the last line says so (`begin` names it), then again at each interval, so a
    slow phase (the Triton interpreter on a big shape, a long compile) never looks like a hang."""

    WIDTH = BAR_WIDTH
    HEARTBEAT_S = 15.0  # $PIPELINE_HEARTBEAT_S

    def __init__(self, total: int, stream: Any = None, heartbeat_s: float | None = None) -> None:
        if heartbeat_s is None:
            heartbeat_s = float(os.environ.get("PIPELINE_HEARTBEAT_S") or self.HEARTBEAT_S)
        self.stream = stream if stream is not None else sys.stderr
        self.total = max(1, total)
        self.done = 0
        self.t0 = time.monotonic()
        self.heartbeat_s = heartbeat_s
        self._phase: tuple[str, float] | None = None
        self._last = self.t0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None
        self._begun = False
        try:
            self.tty = self.stream.isatty()
        except (AttributeError, ValueError):
            self.tty = False

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def begin(self, what: str) -> None:
        """The evaluation starts `what` ("checking M32"): named by the heartbeat if it runs long."""
        with self._lock:
            self._phase = (what, time.monotonic())
            if not self._begun:  # the evaluation's clock starts with its first stage: the lines agree
                self._begun = True
                self.t0 = self._last = self._phase[1]
            if self._beat is None and self.heartbeat_s > 0:
                self._beat = threading.Thread(target=self._heartbeat, name="progress-heartbeat", daemon=True)
                self._beat.start()

    def _heartbeat(self) -> None:
        while not self._stop.wait(min(1.0, self.heartbeat_s)):
            with self._lock:
                now = time.monotonic()
                if self._phase is None or now - self._last < self.heartbeat_s:
                    continue
                what, since = self._phase
                self._last = now
                self._emit(f"{now - self.t0:6.1f} s  still {what} ({now - since:.0f} s so far)", advance=False)

    def __call__(self, line: str) -> None:
        with self._lock:
            self._last = time.monotonic()
            self._emit(line, advance=True)

    def _emit(self, line: str, advance: bool) -> None:
        if advance:
            self.done = min(self.done + 1, self.total)
        if not self.tty:
            print(f"[evaluate] {line}", file=self.stream, flush=True)
            return
        try:
            columns = os.get_terminal_size(self.stream.fileno()).columns or 80  # 0: a terminal of no size yet
        except (OSError, ValueError):
            columns = 80
        drawn = f"[evaluate] {bar(self.done, self.total)} {line.strip()}"
        self.stream.write("\r" + drawn[: max(columns - 1, 20)] + "\x1b[K")
        self.stream.flush()

    def close(self) -> None:
        """Stop the heartbeat; end the bar's line, so what is printed next starts on a line of its own."""
        self._stop.set()
        with self._lock:
            self._phase = None
            if self.tty and self.done:
                self.stream.write("\n")
                self.stream.flush()
                self.done = 0


def _evaluate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("submission", type=Path, help="a submission.py defining custom_kernel(inputs)")
    p.add_argument("--problem", help="the problem; inferred from submissions/kernel/<problem>/<login>/ paths")
    p.add_argument("--json", type=Path, metavar="OUT", help="write the result document here")
    p.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when there is one")
    p.add_argument("--model", choices=["full", "smoke"], help="default: full on cuda, smoke on cpu")
    p.add_argument("--seeds", type=int, help="seeds per shape (default: 8 on a GPU, 3 on a CPU)")
    p.add_argument("--shape", action="append", help="check only this shape (repeatable)")
    p.add_argument("--no-timing", action="store_true", help="check correctness only")
    p.add_argument("--timeout", type=float, metavar="SECONDS",
                   help="end the whole evaluation after this long, with status timeout (default: competition.toml's "
                        "[limits.wall_clock] total; a local run only, refused with --official)")
    p.add_argument("--meta", type=Path, metavar="JSON",
                   help="the submission's facts written by fetch-submission (pr, head_sha, login, path, blob_sha); "
                        "recorded in the result after the file's blob SHA is checked against them")
    p.add_argument("--official", action="store_true",
                   help="refuse to run unless the result can be official: a CUDA device, the full model, the runner's "
                        "secret seeds, every shape timed, and the submission's process isolated (root, namespaces)")
    p.add_argument("--baseline", choices=["ours", "sglang"], default="ours",
                   help="what the speedups are measured against: ours (the default, reference/<problem>.py) or "
                        "SGLang's own kernels, taken from the pinned source that `serving fetch` verifies (an "
                        "organizer's choice, for the problems reference/_sglang_baselines.py adapts; recorded)")
    p.add_argument("--grant-read", type=Path, action="append", default=[], metavar="PATH",
                   help="also let the submission's process read PATH (benchmarks that submit the reference's own "
                        "code; never on the runner, and refused with --official)")
    p.add_argument("--comment", action="store_true",
                   help="print the pull request comment the bot would post for this result (post-result's own "
                        "renderer and would-be rank) on stdout, the terminal table on stderr")
    p.add_argument("--board", type=Path, metavar="LEADERBOARD.md",
                   help="with --comment: the board to rank against, a leaderboard.md with the ledger it is made "
                        "from (results/ledger/) beside it (default: the repository's, as post-result ranks)")


def evaluate(args: argparse.Namespace) -> int:
    """Evaluate a kernel submission: correctness on every shape, then timing against the baseline.

    Exit 0 when it passed, 1 when it failed, 2 on a usage error, 3 when the baseline failed (no result:
    not the submission's fault; the runner's organizers look at it).
    """
    from pipeline.problems import ProblemError, infer_problem, list_problems, load_problem

    if not args.submission.is_file():
        return _usage(f"{args.submission}: no such file; pass the path of your submission.py")
    name = args.problem or infer_problem(args.submission)
    if not name:
        return _usage(
            f"cannot tell the problem of {args.submission}; pass --problem NAME "
            f"(one of: {', '.join(list_problems())})"
        )
    try:
        problem = load_problem(name)
    except ProblemError as exc:
        return _usage(str(exc))
    if args.seeds is not None and args.seeds < 1:
        return _usage("--seeds must be at least 1")
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        return _usage("--device cuda, but this machine has no CUDA device")
    if args.shape:
        known = {s.name for s in problem.shapes("smoke")}
        unknown = sorted(set(args.shape) - known)
        if unknown:
            return _usage(f"{problem.name} has no shape {', '.join(unknown)}; known: {', '.join(sorted(known))}")

    from pipeline import report
    from pipeline.kernel.evaluate import Options, evaluate as run_evaluation
    from pipeline.kernel.seeds import load_secret
    from pipeline.result import ResultError, read_meta

    meta = {}
    if args.meta:
        try:
            meta = read_meta(args.meta, args.submission)
        except ResultError as exc:
            return _usage(str(exc))
        if meta.get("problem") and meta["problem"] != problem.name:
            return _usage(f"--meta names problem {meta['problem']!r}, but the evaluation is for {problem.name!r}")

    if args.official and args.grant_read:
        return _usage("--grant-read cannot be used with --official: the submission's process sees its own file only")
    if args.timeout is not None and (args.official or not args.timeout > 0):
        return _usage("--timeout is for local runs and must be a positive number of seconds; an official evaluation "
                      "keeps competition.toml's limits" if args.official else
                      f"--timeout {args.timeout:g}: give a positive number of seconds")
    if args.json is not None:  # checked now, not after minutes of evaluation
        folder = args.json.parent if str(args.json.parent) else Path(".")
        if args.json.is_dir():
            return _usage(f"--json {args.json}: this is a folder; pass the path of the file to write, "
                          f"e.g. {args.json / 'result.json'}")
        if not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK):
            return _usage(f"--json {args.json}: the folder {folder} does not exist or cannot be written; create it or "
                          "pass another path")
    from pipeline.competition import REPO_ROOT

    board_root = REPO_ROOT
    if args.board is not None:
        if not args.comment:
            return _usage("--board is for --comment (the comment's would-be rank); pass both, or neither")
        if not args.board.is_file():
            return _usage(f"--board {args.board}: no such file; pass a leaderboard.md, e.g. the repository's "
                          f"{REPO_ROOT / 'leaderboard.md'}")
        board_root = args.board.resolve().parent
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    shapes = [s for s in problem.shapes(args.model or ("full" if device == "cuda" else "smoke"))
              if not args.shape or s.name in args.shape]
    # the stages the evaluation reports as it finishes them: the load, each shape checked, and when timed
    # each workload timed and the baseline timed alone (a failure ends it sooner: the bar just stops)
    stages = 1 + len(shapes) + ((sum(s.kind == "workload" for s in shapes) + 1) if not args.no_timing else 0)
    progress = Progress(stages)
    from pipeline.kernel.evaluate import Limits

    limits = Limits()
    if args.timeout is not None:
        limits.total, limits.source = args.timeout, "--timeout"
    options = Options(
        limits=limits,
        phase=progress.begin,
        device=args.device,
        model=args.model,
        seeds=args.seeds,
        secret=load_secret(),
        timing=not args.no_timing,
        shapes=args.shape,
        official=args.official,
        grant_read=[p.resolve() for p in args.grant_read],
        baseline=args.baseline,
        submission_meta={k: meta[k] for k in ("path", "login", "pr", "head_sha") if k in meta},
        progress=progress,
    )
    # A runner that cancels the job (or a harness's timeout) sends SIGTERM: end the evaluation the
    # way an error would, so the submission's process is killed and its GPU memory freed.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    from pipeline.kernel.evaluate import baseline_problem

    why = baseline_problem(options, problem)
    if why:
        return _usage(why)
    if args.official:
        from pipeline.kernel.evaluate import official_problem

        why = official_problem(options)
        if why:
            return _usage(f"refusing an official evaluation: {why}")
    from pipeline.kernel.evaluate import BaselineFailure
    from pipeline.kernel.toolchains import RunnerConfigError, image_digest

    try:
        image_digest()  # the runner's statement of its image, checked before anything runs
    except RunnerConfigError as exc:
        print(f"error: the runner is misconfigured, and no result was written: {exc}", file=sys.stderr)
        return HARNESS_ERROR
    try:
        doc = run_evaluation(args.submission, problem, options)
    except BaselineFailure as exc:
        progress.close()
        print(f"error: the evaluation could not be completed, and no result was written: {exc}", file=sys.stderr)
        return HARNESS_ERROR
    except KeyboardInterrupt:  # the evaluation's own clean-up (its workers ended) ran on the way here
        progress.close()
        print(f"interrupted after {progress.elapsed():.0f} s: the submission's processes were ended and no result "
              "was written", file=sys.stderr)
        return 130
    progress.close()
    if args.comment:  # exactly what post-result posts for this document (no log link: there is no run)
        print(report.terminal(doc), file=sys.stderr)
        from pipeline import post

        print(post.pr_comment(doc, root=board_root), end="")
    else:
        print(report.terminal(doc))
    if args.json:
        from pipeline import result

        result.write(doc, args.json)
    return 0 if doc["status"] == "passed" else 1


def _problems_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print machine-readable")
    p.add_argument("--competition", type=Path, metavar="TOML", help="default: the repository's competition.toml")
    p.add_argument("--pin-baselines", action="store_true",
                   help="write every problem's baseline sha256 into the competition's [baselines] table (an organizer, "
                        "on day 0 or when a baseline is deliberately changed): official evaluations are refused "
                        "against any other baseline")


PIN_BEGIN = "# --- the pinned baselines: `python -m pipeline problems --pin-baselines` rewrites this block ---"
PIN_END = "# --- end of the pinned baselines ---"


def pin_block(identities: dict[str, dict]) -> str:
    lines = [PIN_BEGIN,
             "# Each problem's official results are measured against this baseline (the sha256 over its files,",
             "# pipeline/problems.py:baseline_identity): the competition's unit of measure. `evaluate --official`",
             "# refuses any other, and `ledger append` refuses a result measured against any other.",
             "[baselines]"]
    lines += [f'{name} = "{ident["sha256"]}"  # {", ".join(ident["files"])}' for name, ident in sorted(identities.items())]
    return "\n".join(lines + [PIN_END]) + "\n"


def write_pins(path: Path, identities: dict[str, dict]) -> None:
    """Replace the pinned block of `path` (or append one): the rest of the file, comments included, kept."""
    text = path.read_text()
    block = pin_block(identities)
    if PIN_BEGIN in text and PIN_END in text:
        head, rest = text.split(PIN_BEGIN, 1)
        text = head + block + rest.split(PIN_END, 1)[1].lstrip("\n")
    else:
        text = text.rstrip("\n") + "\n\n" + block
    path.write_text(text)


def problems(args: argparse.Namespace) -> int:
    """List the kernel problems, their workloads and their baselines (pinned or not); --pin-baselines pins them."""
    from pipeline import competition
    from pipeline.problems import baseline_identity, list_problems, load_problem

    path = args.competition or competition.REPO_ROOT / "competition.toml"
    try:
        pins = competition.load(path).baselines
    except competition.CompetitionError as exc:
        return _usage(str(exc))
    out, identities = {}, {}
    for name in list_problems():
        p = load_problem(name)
        identities[name] = ident = baseline_identity(p)
        pinned = pins.get(name)
        out[name] = {"title": p.title, "workloads": [w["name"] for w in p.workloads], "tests": [t["name"] for t in p.tests],
                     "baseline": {"name": ident["name"], "sha256": ident["sha256"], "pinned": pinned,
                                  "matches_pin": pinned == ident["sha256"]}}
    if args.pin_baselines:
        write_pins(path, identities)
        print(f"pinned {len(identities)} baselines in {path}", file=sys.stderr)
        for info in out.values():
            info["baseline"].update(pinned=info["baseline"]["sha256"], matches_pin=True)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for name, info in out.items():
            b = info["baseline"]
            state = ("pinned" if b["matches_pin"] else f"NOT the pinned {b['pinned'][:12]}..." if b["pinned"]
                     else "not pinned")
            print(f"{name}: {info['title']}\n  workloads: {', '.join(info['workloads'])}\n  tests: {', '.join(info['tests'])}"
                  f"\n  baseline: {b['name']} sha256 {b['sha256'][:12]}... ({state})")
    return 0


def _calibrate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--problem", action="append", help="only this problem (repeatable); default: all")
    p.add_argument("--model", choices=["full", "smoke"], help="default: full on cuda, smoke on cpu")
    p.add_argument("--seeds", type=int, default=2, help="seeds per shape (default 2)")
    p.add_argument("--write", type=Path, metavar="MD", help="write the markdown table here (docs/TOLERANCES.md)")


def calibrate(args: argparse.Namespace) -> int:
    """Run the correct and wrong variants of each problem and tabulate their errors against the bounds.

    Exit 1 when any correct variant fails or any wrong variant passes.
    """
    import torch

    from pipeline.kernel.calibrate import calibrate as run, render
    from pipeline.problems import ProblemError, list_problems, load_problem

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = args.model or ("full" if device == "cuda" else "smoke")
    try:
        problems = {n: load_problem(n) for n in (args.problem or list_problems())}
    except ProblemError as exc:
        return _usage(str(exc))
    results = {}
    for name, problem in problems.items():
        results[name] = run(problem, model=model, device=device, seeds=args.seeds)
        for r in results[name]:
            print(f"{name:24s} {r.name:32s} {r.expect:8s} {'ok' if r.ok else 'WRONG VERDICT'}"
                  f"{'  ' + r.error if r.error else ''}", flush=True)
    command = "python -m pipeline calibrate" + (f" --model {model}" if args.model else "") + (
        f" --seeds {args.seeds}" if args.seeds != 2 else "") + (f" --write {args.write}" if args.write else "")
    text = render(results, problems, model, device, command)
    if args.write:
        args.write.parent.mkdir(parents=True, exist_ok=True)
        args.write.write_text(text)
    bad = [f"{n}/{r.name}" for n, rs in results.items() for r in rs if not r.ok]
    if bad:
        print("wrong verdicts: " + ", ".join(bad), file=sys.stderr)
    return 1 if bad else 0


VERBS = {
    "calibrate": (_calibrate_args, calibrate),
    "evaluate": (_evaluate_args, evaluate),
    "problems": (_problems_args, problems),
}
