"""`python -m pipeline serving <command>`: the serving track's commands, gathered from its stages.

Each stage module in STAGES defines COMMANDS = {name: (register, run)} like pipeline/cli.py's VERBS
(register(parser) adds the arguments, run(args) -> exit code, its docstring is the help). A stage
imports its heavy dependencies inside its functions, so `--help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

STAGES: tuple[str, ...] = ("tokenizer", "pin", "gate", "dataset", "replay", "gsm8k", "evaluate")


def _register(p: argparse.ArgumentParser) -> None:
    commands = p.add_subparsers(dest="serving_command", metavar="COMMAND")
    for stage in STAGES:
        module = importlib.import_module(f"pipeline.serving.{stage}")
        for name, (register, run) in module.COMMANDS.items():
            sub = commands.add_parser(name, help=run.__doc__.strip().splitlines()[0], description=run.__doc__)
            register(sub)
            sub.set_defaults(_serving_run=run)


def serving(args: argparse.Namespace) -> int:
    """The serving track: fetch the pinned SGLang, gate a patch, build the dataset, replay, score.

    Exit 2 without a command (usage).
    """
    run = getattr(args, "_serving_run", None)
    if run is None:
        print("error: pass a serving command; see python -m pipeline serving --help", file=sys.stderr)
        return 2
    return run(args)


VERBS = {"serving": (_register, serving)}
