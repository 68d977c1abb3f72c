"""`python -m pipeline <verb>`: every step of the competition's flow is one verb."""

from __future__ import annotations

import argparse
import sys

from pipeline import cli


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="python -m pipeline", description=__doc__)
    verbs = parser.add_subparsers(dest="verb", metavar="VERB")
    only = argv[0] if argv and argv[0] in cli.NAMES else None  # a command imports its own stage alone
    for name, (register, run) in cli.verbs(only).items():
        sub = verbs.add_parser(name, help=run.__doc__.strip().splitlines()[0], description=run.__doc__)
        register(sub)
        sub.set_defaults(_run=run)
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    return args._run(args)


if __name__ == "__main__":
    sys.exit(main())
