"""The hourly snapshots: results/snapshots/YYYY-MM-DD/HH.json (and .md), each board at HH:00 UTC
from the results accepted by then, and the chain prefix that holds them. A board's holder and top rows
are its ranked competitors' alone: the organizers' row (leaderboard.md's) is never in a snapshot."""

from __future__ import annotations

import json
from bisect import bisect_right
from typing import Iterable

from pipeline.board.render import handle, score, score_name
from pipeline.board.standings import GENESIS_HEAD, BoardSpec, ChainHead, Derived, HourState
from pipeline.competition import format_instant, parse_instant

SNAPSHOT_VERSION = 2  # 2: the chain head each snapshot rests on


def snapshot_path(instant: str) -> str:
    """results/snapshots/YYYY-MM-DD/HH (add .json or .md)."""
    return f"{instant[:10]}/{instant[11:13]}"


def snapshots(d: Derived) -> Iterable[tuple[str, str, str]]:
    """(relative path without suffix, JSON text, markdown text) for every snapshot instant."""
    counts = {s.id: d.hour_counts(s.id) for s in d.specs}
    windows = {t: d.competition.windows(t) for t in d.competition.tracks}
    accepted = sorted(e.at for lst in d.entries.values() for e in lst)
    heads = d.chain_at or [GENESIS_HEAD] * len(d.instants)
    shown: dict[int, tuple[str, list[str]]] = {}  # per board state (shared by the hours it lasts): holder JSON, md
    for k, t in enumerate(d.instants):
        at = parse_instant(t)
        daily = {}
        for track, ws in windows.items():
            w = next((w for w in ws if w.start < at <= w.close), None)
            daily[track] = None if w is None else {"window": w.index, "closes_at": format_instant(w.close)}
        parts = []
        for s in d.specs:
            state = d.timeline[s.id][k]
            c = counts[s.id][k]
            h = _shown(shown, s, state)[0]
            parts.append(f'  {json.dumps(s.id)}: {{"disqualified":{c["disqualified"]},"holder":{h},'
                         f'"out_of_window":{c["out_of_window"]},"ranked":{state.ranked},"top":{state.top_json()},'
                         f'"under_review":{c["under_review"]}}}')
        text = (f'{{\n "at": "{t}",\n "boards": {{\n' + ",\n".join(parts) + "\n },\n"
                f' "chain": {heads[k].json()},\n'
                f' "daily": {json.dumps(daily, sort_keys=True, separators=(",", ":"))},\n'
                f' "results": {bisect_right(accepted, t)},\n "snapshot_version": {SNAPSHOT_VERSION}\n}}\n')
        yield snapshot_path(t), text, _snapshot_md(d, k, t, heads[k], shown)


def _shown(shown: dict[int, tuple[str, list[str]]], s: BoardSpec, state: HourState) -> tuple[str, list[str]]:
    """A board state's holder as JSON and its markdown lines, made once per state."""
    got = shown.get(id(state))
    if got is None:
        holder = state.holder
        h = "null" if holder is None else json.dumps({"login": holder.login, "pr": holder.pr}, sort_keys=True,
                                                     separators=(",", ":"))
        lines = [f"## {s.id}"]
        if not state.rows:
            lines += ["", "No ranked results.", ""]
        else:
            lines += ["", f"| rank | competitor | {score_name(s)} | PR |", "| ---: | --- | ---: | --- |"]
            lines += [f"| {r} | {handle(e.login)} | {score(s, e.speedup)} | #{int(e.pr)} |" for r, e in state.rows]
            lines.append("")
        got = shown[id(state)] = (h, lines)
    return got


def _snapshot_md(d: Derived, k: int, t: str, head: ChainHead, shown: dict[int, tuple[str, list[str]]]) -> str:
    lines = [f"# Snapshot {t[:10]} {t[11:16]} UTC", "",
             "Each board as it stood at this instant, from ledger results accepted at or before it "
             "(`python -m pipeline snapshots`); the JSON beside this file is the record.", "",
             head.markdown().replace("Ledger chain head:", "Ledger chain up to this instant:"), ""]
    for s in d.specs:
        lines += _shown(shown, s, d.timeline[s.id][k])[1]
    return "\n".join(lines)
