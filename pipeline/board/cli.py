"""The verbs of the boards: `board`, `snapshots`, `prizes`. Registered in pipeline/cli.py's VERBS.

The only code of the boards that touches files: parse arguments, read the ledger and the configuration,
call the pure functions of the board's modules, write or print what they return. Exit codes: 0 done,
1 refused (the ledger is broken, or `board --check` found leaderboard.md stale), 2 usage error.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
from pathlib import Path
from typing import Any, Callable

from pipeline import ledger as lg
from pipeline.board import plots
from pipeline.board.prizes import as_of, final_rows, prizes_rows, render_prizes
from pipeline.board.render import render_board
from pipeline.board.snapshots import snapshots as hourly
from pipeline.board.standings import derive
from pipeline.competition import REPO_ROOT, CompetitionError, InstantError, format_instant, load, parse_instant
from pipeline.exits import OK, REFUSED, USAGE, error
from pipeline.ledger import problem_workloads, without_gc

SNAPSHOTS_DIR = Path("results") / "snapshots"


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--root", type=Path, default=REPO_ROOT,
                   help="the folder holding results/ and leaderboard.md (default: the repository)")
    p.add_argument("--competition", type=Path, metavar="TOML",
                   help="the competition configuration (default: ROOT/competition.toml)")
    p.add_argument("--now", metavar="ISO8601", help="the current time, UTC (default: the clock)")


def _instant(text: str | None, what: str) -> dt.datetime:
    if text:
        return parse_instant(text, what)
    return dt.datetime.now(dt.timezone.utc).replace(microsecond=0)


def _derived(args: argparse.Namespace, now: dt.datetime | None = None, up_to_now: bool = False) -> Any:
    """The derived views at `now` (default: --now, else the clock), from the whole ledger or
    the ledger as it stood at `now` (`up_to_now`); or the exit code (already explained on stderr) of why not."""
    try:
        now = now or _instant(args.now, "--now")
        competition = load(args.competition or Path(args.root) / "competition.toml")
        records = lg.iter_records(args.root, workloads=False)  # each result's parsed when it is shown
        if up_to_now:
            records = as_of(records, format_instant(now))
        return derive(records, competition, problem_workloads(), now)
    except (CompetitionError, InstantError) as exc:
        return error(USAGE, str(exc))
    except lg.LedgerBroken as exc:
        return error(REFUSED, str(exc))


def _write_if_changed(path: Path, data: bytes) -> bool:
    """Atomically replace `path` with `data` unless it already holds exactly that; True if written."""
    try:
        if path.read_bytes() == data:
            return False
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return True


# ---- board ----

def _board_args(p: argparse.ArgumentParser) -> None:
    _common(p)
    p.add_argument("--no-plots", action="store_true", help="skip the PNGs (no matplotlib needed)")
    p.add_argument("--check", action="store_true",
                   help="write nothing; exit 1 when leaderboard.md is not what the ledger gives")


def board(args: argparse.Namespace) -> int:
    """Regenerate leaderboard.md (and a PNG per board of its best score over time) from the ledger alone."""
    d = _derived(args)
    if isinstance(d, int):
        return d
    root = Path(args.root)
    written: list[str] = []
    digests = {s.id: plots.plot_digest(d, s) for s in d.specs}
    current = {s.id for s in d.specs if digests[s.id] and (root / plots.plot_path(s)).is_file()
               and plots.png_description((root / plots.plot_path(s)).read_bytes()) == f"series sha256 {digests[s.id]}"}
    if args.no_plots:
        shown = {s.id for s in d.specs if (root / plots.plot_path(s)).is_file()}
    else:
        shown = {s.id for s in d.specs if digests[s.id]}
    text = render_board(d, shown).encode()
    target = root / "leaderboard.md"
    if args.check:
        stale = sorted(plots.plot_path(s) for s in d.specs if s.id in shown - current) if not args.no_plots else []
        if (target.read_bytes() if target.is_file() else b"") != text or stale:
            what = ", ".join(["leaderboard.md"] + stale)
            return error(REFUSED, f"{what}: not what the ledger gives; regenerate with `python -m pipeline board`")
        print("leaderboard.md is up to date")
        return OK
    if not args.no_plots:
        for spec in d.specs:
            if spec.id not in shown or spec.id in current:
                continue
            try:
                png = plots.render_plot(d, spec)
            except ImportError:
                return error(USAGE, "the plots need matplotlib: pip install matplotlib, or pass --no-plots")
            if png is not None and _write_if_changed(root / plots.plot_path(spec), png):
                written.append(plots.plot_path(spec))
        folder = root / "leaderboard"
        wanted = {Path(plots.plot_path(s)).name for s in d.specs if s.id in shown}
        if folder.is_dir():
            for old in sorted(folder.glob("*.png")):
                if old.name not in wanted:
                    old.unlink()
                    written.append(f"removed {old.relative_to(root).as_posix()}")
    if _write_if_changed(target, text):
        written.insert(0, "leaderboard.md")
    print(f"board from {d.records} results: " + (", ".join(written) if written else "nothing changed"))
    return OK


# ---- snapshots ----

def _snapshots_args(p: argparse.ArgumentParser) -> None:
    _common(p)


def snapshots(args: argparse.Namespace) -> int:
    """Write every missing hourly snapshot results/snapshots/YYYY-MM-DD/HH.json (and .md) up to now.

    A snapshot that no longer matches the ledger (a record accepted in that hour arrived late, or a
    marking changed a past standing) is rewritten: a snapshot is a function of the ledger alone.
    """
    d = _derived(args)
    if isinstance(d, int):
        return d
    base = Path(args.root) / SNAPSHOTS_DIR
    missing = refreshed = 0
    for rel, text, md in hourly(d):
        path = base / f"{rel}.json"
        existed = path.exists()
        changed = _write_if_changed(path, text.encode())
        changed = _write_if_changed(base / f"{rel}.md", md.encode()) or changed
        if changed:
            missing += not existed
            refreshed += existed
    print(f"{len(d.instants)} snapshot hours up to {format_instant(d.now)}: wrote {missing} missing, "
          f"refreshed {refreshed} that the ledger now gives differently")
    return OK


# ---- prizes ----

def _prizes_args(p: argparse.ArgumentParser) -> None:
    _common(p)
    p.add_argument("--at", metavar="ISO8601",
                   help="decide every prize as of this instant, from the ledger as it stood then (results "
                        "accepted and markings made at or before it): the same table whenever it runs "
                        "(default: --now, else the clock)")
    p.add_argument("--json", action="store_true", help="print machine-readable")


def prizes(args: argparse.Namespace) -> int:
    """Print every daily window's winner per board, with hours on top, and each closed track's final
    placings, all as of one instant, from the ledger alone."""
    if args.at and args.now:
        return error(USAGE, "give --at (the instant the prizes are decided as of) or --now, not both")
    try:
        at = _instant(args.at, "--at") if args.at else None
    except InstantError as exc:
        return error(USAGE, str(exc))
    d = _derived(args, at, up_to_now=True)
    if isinstance(d, int):
        return d
    if args.json:
        print(json.dumps({"at": format_instant(d.now), "rule": d.competition.daily_rule,
                          "windows": prizes_rows(d), "final": final_rows(d)}, indent=1, sort_keys=True))
    else:
        print(render_prizes(d), end="")
    return OK


def quick_exit(run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Mark a board verb as one whose process may end as soon as it returns, without freeing what it read:
    freeing the entries of a competition-sized ledger one by one, then the interpreter, took longer than a
    tenth of the command. Only `python -m pipeline` acts on the mark (pipeline/__main__.py), and only for
    the verb it was started for: a verb called by another verb (`publish` runs `board` and `snapshots` in
    its process, then commits and pushes) returns as any function does."""
    run.quick_exit = True  # type: ignore[attr-defined]
    return run


VERBS = {
    "board": (_board_args, quick_exit(without_gc(board))),
    "prizes": (_prizes_args, quick_exit(without_gc(prizes))),
    "snapshots": (_snapshots_args, quick_exit(without_gc(snapshots))),
}
