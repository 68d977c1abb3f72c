"""`python -m pipeline <verb>`: every step of the competition's flow is one verb."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable

from pipeline import cli


def _parse(argv: list[str]) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    parser = argparse.ArgumentParser(prog="python -m pipeline", description=__doc__)
    verbs = parser.add_subparsers(dest="verb", metavar="VERB")
    only = argv[0] if argv and argv[0] in cli.NAMES else None  # a command imports its own stage alone
    for name, (register, run) in cli.verbs(only).items():
        sub = verbs.add_parser(name, help=run.__doc__.strip().splitlines()[0], description=run.__doc__)
        register(sub)
        sub.set_defaults(_run=run)
    return parser, parser.parse_args(argv)


def _dispatch(argv: list[str] | None) -> tuple[int, Callable[[Any], int] | None]:
    parser, args = _parse(sys.argv[1:] if argv is None else list(argv))
    run = getattr(args, "_run", None)
    if not run:
        parser.print_help()
        return 2, None
    return run(args), run


def main(argv: list[str] | None = None) -> int:
    """Run one verb and return its exit code (tests, and any caller in a process of its own)."""
    return _dispatch(argv)[0]


def entry() -> None:
    """The process's entry point (`python -m pipeline`, the `pipeline` script): run the verb it was started
    for and end with its exit code. A verb marked `quick_exit` (the board verbs) ends the process at once,
    its output flushed, without freeing what it read; no verb ever ends a process itself, so a verb that
    calls another (`publish` runs `board`) always gets control back."""
    try:
        code, run = _dispatch(None)
    except KeyboardInterrupt:  # Ctrl-C: the verb's clean-up ran on the way out; one line, not a traceback
        verb = next((a for a in sys.argv[1:] if not a.startswith("-")), "")
        print(f"\ninterrupted: python -m pipeline {verb} stopped before it finished", file=sys.stderr)
        sys.exit(130)
    if getattr(run, "quick_exit", False):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
