"""`python -m pipeline demo [--out DIR]`: a small competition, end to end, on this machine.

In a temporary git repository (real `git`: a branch and a commit per pull request, `--no-ff` merges into
main), six competitors open twelve pull requests over both tracks' calendars shortened to five simulated
days (competition.toml's windows rewritten in the temporary repository). Every step is the verb a
workflow runs, as a subprocess `python -m pipeline <verb>` with the workflow's flags:

  validate.yml   validate --diff (git diff base...head) --tree (the PR head checked out) --now (the PR's time)
  bench.yml      evaluate --device cpu --model smoke --seeds 1 --meta (kernel), serving evaluate --meta
                 (against pipeline/demo/server.py, a scripted OpenAI-compatible server on loopback, from a
                 launch template of the demo's pin), then sign --pr --head-sha --login --blob-sha --problem
                 with a demo key made by keygen, and plot-result for a serving result
  report.yml     show-result --markdown: the comment post-result posts (post-result itself needs GitHub)
  ledger.yml     git merge, ledger append --merged-at (the simulated merge time) --allow-unofficial, board
  snapshot.yml   snapshots, then prizes (daily), and the final placings from the last snapshot of each track

What is shortened, and said so in the output: the kernel evaluations are unofficial (CPU, smoke model, one
seed a shape); the serving evaluations replay 0.4 s windows of a dozen-turn dataset at c = 1, 4, 16, 32,
one run per block, two GSM8K questions, against the scripted server instead of SGLang. Evaluations that
time nothing (a wrong or crashing kernel fails before timing) and the serving ones (their server sleeps
between tokens) run side by side; the timed kernel evaluations run one at a time, alone, since two on two
cores disturb each other's timing (the verdicts would stand: a CPU's timing noise is no verdict).

DIR (default ./demo-output) receives comments/pr-NN.md (the sticky comment after validation and after the
run), comments/pr-NN-plot.png (serving), leaderboard.md and leaderboard/*.png, snapshots/, prizes.md,
steps.txt (every step and the command it ran) and git-log.txt. Exit 0 when the competition went as
scripted, 1 when a step did not, 2 for a bad --out.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

DEFAULT_OUT = Path("demo-output")


def _register(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, metavar="DIR",
                   help=f"where the comments, leaderboard.md, snapshots and prizes go (default: ./{DEFAULT_OUT}); "
                        "it must be empty, new, or an earlier demo's output")


def demo(args: argparse.Namespace) -> int:
    """Run a small competition end to end (both tracks, a dozen PRs, in a temporary git repository).

    Exit 0 when it went as scripted, 1 when a step did not (the step and its output are printed), 2 for an
    --out that cannot be used.
    """
    from pipeline.demo import flow

    try:
        out = flow.prepare_out(args.out)
    except flow.OutError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return flow.run(out)


VERBS = {"demo": (_register, demo)}
