"""`python -m pipeline <verb>`: every stage's verbs, gathered into one `--help` (pipeline/__main__.py).

A verb lives with the stage whose decision it makes; each stage module has VERBS = {name: (register,
run)}: register(parser) adds the verb's arguments, run(args) returns its exit code, and run's docstring
is its help. Nothing here decides anything, and no module of the pipeline imports this one.

STAGES names each stage's verbs, so a command imports only its own stage (importing all of them cost
0.25-0.5 s of every command, the board's among them); `--help`, or a verb that is no verb, imports
them all. tests/test_house.py holds STAGES to the stages' own VERBS.
"""

from __future__ import annotations

import importlib

STAGES: dict[str, tuple[str, ...]] = {
    "pipeline.evaluation": ("calibrate", "evaluate", "problems"),  # the kernel track
    "pipeline.gate": ("validate", "gate", "fetch-submission"),  # may this PR be evaluated, and what exactly
    "pipeline.signing": ("sign", "verify-result", "keygen"),  # the results' signatures
    "pipeline.report": ("plot-result", "show-result"),  # what a result looks like
    "pipeline.post": ("post-result",),  # what is posted on a pull request, once believed
    "pipeline.ledger": ("ledger",),  # `ledger append | verify | disqualify | clear`: what is recorded
    "pipeline.board.cli": ("board", "prizes", "snapshots"),  # the boards, from the ledger alone
    "pipeline.publish": ("find-result", "publish"),  # what ledger.yml and snapshot.yml push, by compare-and-swap
    "pipeline.sandbox.check": ("sandbox-check",),  # the trust boundary
    "pipeline.runner": ("runner",),  # `runner health`: the runner between evaluations
    "pipeline.serving.cli": ("serving",),  # `serving fetch | gate | dataset | replay | ...`: the serving track
    "pipeline.demo": ("demo",),  # a small competition end to end, every step one of the verbs above
}
NAMES = frozenset(name for names in STAGES.values() for name in names)


def verbs(only: str | None = None) -> dict:
    """{verb: (register, run)}: every stage's, or with `only` a verb's name, its stage's alone."""
    out: dict = {}
    for module, names in STAGES.items():
        if only is None or only in names:
            out.update(importlib.import_module(module).VERBS)
    return out


def __getattr__(name: str):
    if name == "VERBS":  # every verb, in the stages' order (what --help lists)
        return verbs()
    raise AttributeError(f"module 'pipeline.cli' has no attribute {name!r}")
