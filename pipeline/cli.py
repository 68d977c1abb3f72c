"""`python -m pipeline <verb>`: every stage's verbs, gathered into one `--help` (pipeline/__main__.py).

A verb lives with the stage whose decision it makes; each stage module has VERBS = {name: (register,
run)}: register(parser) adds the verb's arguments, run(args) returns its exit code, and run's docstring
is its help. Nothing here decides anything, and no module of the pipeline imports this one.
"""

from __future__ import annotations

from pipeline import demo, evaluation, gate, ledger, publish, report, runner, sandbox, signing
from pipeline.board import cli as board_verbs
from pipeline.serving import cli as serving_verbs

VERBS: dict = {}
for stage in (
    evaluation,  # `evaluate`, `calibrate`, `problems`: the kernel track
    gate,  # `validate`, `gate`, `fetch-submission`: may this PR be evaluated, and what exactly
    signing,  # `sign`, `verify-result`, `keygen`: the results' signatures
    report,  # `post-result`, `plot-result`, `show-result`: what is shown where
    ledger,  # `ledger append | verify | disqualify | clear`: what is recorded
    board_verbs,  # `board`, `snapshots`, `prizes`: the boards, from the ledger alone
    publish,  # `publish`, `find-result`: what ledger.yml and snapshot.yml push, by compare-and-swap
    sandbox,  # `sandbox-check`: the trust boundary
    runner,  # `runner health`: the runner between evaluations
    serving_verbs,  # `serving fetch | gate | dataset | replay | ...`: the serving track
    demo,  # `demo`: a small competition end to end, every step one of the verbs above
):
    VERBS.update(stage.VERBS)
