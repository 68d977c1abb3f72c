"""Ledger records -> the boards: standings at an instant, `leaderboard.md`, hourly snapshots, the daily
prizes and the plots of the top score over time.

Everything here is a pure function of plain data (the ledger's records, the competition, the problems'
workloads, an instant `now`); only `pipeline.ledger_cli` reads and writes files. Records are ordered by
`accepted_at`, then PR number, then head SHA, never by their place in the ledger, so the order in which
records arrived changes nothing.

The rules, in the order they apply to a board (one per kernel problem, and the serving board):
- A result's state: `disqualified` if its latest marking is a disqualification; else `under_review` if
  its status is needs_review and no clearance credits it; else `out_of_window` if accepted outside its
  track's window [start, end); else `ranked`. Markings apply retroactively: a disqualified result is
  taken out of every standing, past hours included (the snapshots are refreshed), and a cleared one is
  credited from its own accepted_at.
- A board at instant T ranks each competitor's best `ranked` result accepted at or before T: the
  highest score (a kernel board: the geometric mean of the workloads' speedups; the serving board: S,
  which its result restates as score.speedup), the earlier accepted on equal scores.
- Ties: walking down in score order, the first entry not yet placed leads a rank group; every following
  entry whose 95% interval (score.interval; the point score when a result has none) overlaps the
  LEADER's interval joins the group. The group shares one rank (its position: 1, 1, 3, ...), and within
  it entries are listed earlier accepted first. The first entry of the first group holds the board.
- Daily windows: every 24 hours (configurable) from a track's start; a window's hours are the hourly
  snapshots in (start, close], so a result accepted exactly at the close counts for that window.
  `top_at_close`: the winner is the holder in the snapshot at the close. `most_hours_on_top`: the
  competitor who held the board in most of the window's snapshots; ties go to whoever held it first.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import math
from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from operator import attrgetter
from typing import Any, Iterable

from pipeline.competition import Competition, DailyWindow, format_instant, parse_instant
from pipeline.escape import md_heading, md_inline
from pipeline.ledger import LOGIN_RE, latest_markings

SNAPSHOT_VERSION = 2  # 2: the chain head each snapshot rests on
# The serving board's columns: the ratio of each scored figure to the baseline's, as a serving result's
# performance entries name them (pipeline/result.py's serving_document; c as in pipeline/serving/score.py).
SERVING_FIGURES = tuple(f"{m}_{c}" for c in (1, 4, 16, 32) for m in ("T", "I"))
STATES = ("ranked", "under_review", "disqualified", "out_of_window")
_KEY = attrgetter("key")


# ---- boards and entries ----

@dataclass(frozen=True)
class BoardSpec:
    id: str  # "kernel/<problem>" or "serving"
    track: str
    problem: str | None
    title: str
    workloads: tuple[str, ...]

    @property
    def slug(self) -> str:
        return self.problem if self.track == "kernel" else "serving"


def board_id(track: str, problem: str) -> str:
    return f"kernel/{problem}" if track == "kernel" else "serving"


class Entry:
    """One result on one board: what the views compare, read once from its ledger record. The
    per-workload figures stay in the record's own list and are read only for the rows shown."""

    __slots__ = ("key", "at", "login", "who", "pr", "head_sha", "speedup", "time_us", "lo", "hi", "official",
                 "status", "flags", "board", "_workloads", "state", "why")

    def __init__(self, r: dict[str, Any]):
        score = r["score"]
        self.at: str = r["accepted_at"]
        self.pr: int = r["pr"]
        self.head_sha: str = r["head_sha"]
        self.key = (self.at, self.pr, self.head_sha)
        self.login: str = r["login"]
        self.who = self.login.lower()
        self.speedup: float = score["speedup"]
        self.time_us: float = score["time_us"]
        interval = score.get("interval")
        self.lo, self.hi = (interval[0], interval[1]) if interval else (self.speedup, self.speedup)
        self.official: bool = r["official"]
        self.status: str = r["status"]
        self.flags: list[str] = r["flags"]
        self.board = board_id(r["track"], r["problem"])
        self._workloads: list[dict[str, Any]] = r["workloads"]
        self.state, self.why = "ranked", ""

    @property
    def workloads(self) -> dict[str, float]:
        return {w["workload"]: w["speedup"] for w in self._workloads}

    @property
    def baseline_us(self) -> float | None:
        """The geometric mean of the baseline medians measured in this result's own run."""
        base = [w["baseline_median_us"] for w in self._workloads if w.get("baseline_median_us", 0) > 0]
        return math.exp(sum(map(math.log, base)) / len(base)) if base else None


def collect(records: Iterable[dict[str, Any]]) -> tuple[list[Entry], list[dict[str, Any]]]:
    """One pass over the records (any order): the results as entries, and the markings."""
    results, marks = [], []
    for r in records:
        if r["kind"] == "result":
            results.append(Entry(r))
        else:
            marks.append(r)
    return results, marks


def assign_states(results: list[Entry], marks: list[dict[str, Any]], competition: Competition) -> None:
    """Each result's state on its board (see the module's docstring), in place."""
    latest = latest_markings(marks)
    bounds = {name: (format_instant(t.start), format_instant(t.end)) for name, t in competition.tracks.items()}
    for e in results:
        mark = latest.get((e.pr, e.head_sha)) if latest else None
        start, end = bounds["serving" if e.board == "serving" else "kernel"]
        if mark is not None and mark["kind"] == "disqualification":
            # `why` is the board's markdown: the organizer's reason and the result's flag codes escaped
            e.state, e.why = "disqualified", (f"disqualified {mark['at'][:10]} by {_handle(mark['by'])}: "
                                              f"{_cell(mark['reason'])}")
        elif e.status == "needs_review" and mark is None:
            e.state, e.why = "under_review", "under review" + (f" ({', '.join(map(_cell, e.flags))})" if e.flags else "")
        elif e.at < start:
            e.state, e.why = "out_of_window", "accepted before the track opened"
        elif e.at >= end:
            e.state, e.why = "out_of_window", "accepted after the track closed"


def board_specs(problems: dict[str, tuple[str, tuple[str, ...]]], results: Iterable[Entry] = ()) -> list[BoardSpec]:
    """One board per kernel problem (name -> (title, workload names)), one per problem only the
    ledger knows (a problem since removed), then the serving board."""
    known = dict(problems)
    extra: dict[str, list[str]] = {}
    for e in sorted(results, key=_KEY):
        name = e.board[len("kernel/"):]
        if e.board != "serving" and name not in known:
            names = extra.setdefault(name, [])
            names.extend(w for w in e.workloads if w not in names)
    for name, names in extra.items():
        known[name] = (f"{name} (not in problems/)", tuple(names))
    specs = [BoardSpec(f"kernel/{n}", "kernel", n, known[n][0], tuple(known[n][1])) for n in sorted(known)]
    specs.append(BoardSpec("serving", "serving", None, "Serving (SGLang patch)", SERVING_FIGURES))
    return specs


def entries(records: Iterable[dict[str, Any]], competition: Competition,
            problems: dict[str, tuple[str, tuple[str, ...]]]) -> tuple[list[BoardSpec], dict[str, list[Entry]]]:
    """The boards, and each board's results as entries in accepted order, each with its state."""
    results, marks = collect(records)
    assign_states(results, marks, competition)
    specs = board_specs(problems, results)
    out: dict[str, list[Entry]] = {s.id: [] for s in specs}
    for e in results:
        out[e.board].append(e)
    for lst in out.values():
        lst.sort(key=_KEY)
    return specs, out


# ---- ranking ----

def score_order(best: Iterable[Entry]) -> list[Entry]:
    return sorted(best, key=lambda e: (-e.speedup, e.key))


def rank(ordered: list[Entry], limit: int | None = None) -> list[tuple[int, Entry]]:
    """Entries in score order -> (rank, entry) rows: rank groups of overlapping intervals (each entry
    compared with its group's leader), earlier accepted first inside a group. With `limit`, only the
    groups whose rank is at most `limit`."""
    rows: list[tuple[int, Entry]] = []
    i, n = 0, len(ordered)
    while i < n and (limit is None or i < limit):
        leader = ordered[i]
        j = i + 1
        while j < n and ordered[j].hi >= leader.lo and ordered[j].lo <= leader.hi:
            j += 1
        group = ordered[i:j] if j == i + 1 else sorted(ordered[i:j], key=_KEY)
        rows.extend((i + 1, e) for e in group)
        i = j
    return rows


def best_per_competitor(items: Iterable[Entry]) -> list[Entry]:
    """Each competitor's best entry: the highest score, the earlier accepted on equal scores."""
    best: dict[str, Entry] = {}
    for e in sorted(items, key=_KEY):
        old = best.get(e.who)
        if old is None or e.speedup > old.speedup:
            best[e.who] = e
    return list(best.values())


@dataclass
class Standing:
    rows: list[tuple[int, Entry]]
    unranked: list[Entry]  # disqualified and under review (all), out of window (each competitor's best)

    @property
    def holder(self) -> Entry | None:
        return self.rows[0][1] if self.rows else None


def standing(items: list[Entry]) -> Standing:
    ranked = rank(score_order(best_per_competitor(e for e in items if e.state == "ranked")))
    marked = [e for e in items if e.state in ("under_review", "disqualified")]
    late = best_per_competitor(e for e in items if e.state == "out_of_window")
    return Standing(ranked, sorted(marked + late, key=_KEY))


# ---- the hourly timeline ----

class HourState:
    """A board at one snapshot instant: its top rows, its holder, how many competitors are ranked.
    Shared between consecutive hours while nothing changes."""

    __slots__ = ("rows", "ranked", "_json")

    def __init__(self, rows: list[tuple[int, Entry]], ranked: int):
        self.rows, self.ranked, self._json = rows, ranked, None

    @property
    def holder(self) -> Entry | None:
        return self.rows[0][1] if self.rows else None

    def top_json(self) -> str:
        if self._json is None:
            self._json = json.dumps([_row_dict(r, e) for r, e in self.rows], sort_keys=True, separators=(",", ":"))
        return self._json


def _row_dict(rank_: int, e: Entry) -> dict[str, Any]:
    return {"rank": rank_, "login": e.login, "pr": e.pr, "head_sha": e.head_sha, "speedup": e.speedup,
            "interval": [e.lo, e.hi], "time_us": e.time_us, "accepted_at": e.at, "official": e.official}


def board_timeline(items: list[Entry], instants: list[str], top: int) -> list[HourState]:
    """The board at every instant (each an HH:00 string, ascending): one pass over the board's ranked
    entries in accepted order, keeping each competitor's best in a list sorted by score."""
    ranked = [e for e in items if e.state == "ranked"]
    keys: list[tuple[float, tuple[str, int, str]]] = []
    ordered: list[Entry] = []
    best: dict[str, Entry] = {}
    state = HourState([], 0)
    out = []
    i, n = 0, len(ranked)
    for t in instants:
        changed = False
        while i < n and ranked[i].at <= t:
            e = ranked[i]
            i += 1
            old = best.get(e.who)
            if old is not None:
                if old.speedup >= e.speedup:
                    continue
                j = bisect_left(keys, (-old.speedup, old.key))
                del keys[j], ordered[j]
            k = (-e.speedup, e.key)
            j = bisect_left(keys, k)
            keys.insert(j, k)
            ordered.insert(j, e)
            best[e.who] = e
            changed = True
        if changed:
            state = HourState(rank(ordered, top), len(ordered))
        out.append(state)
    return out


@dataclass
class DailyResult:
    window: DailyWindow
    board: str
    closed: bool
    winner: Entry | None  # the winning competitor's entry (at the close, or their last hour on top)
    hours: list[tuple[str, int]]  # (login, hours on top), most first

    @property
    def winner_hours(self) -> int:
        who = self.winner.who if self.winner else None
        return next((n for login, n in self.hours if login.lower() == who), 0)


def daily_results(competition: Competition, specs: list[BoardSpec], instants: list[str],
                  timeline: dict[str, list[HourState]], now: dt.datetime) -> list[DailyResult]:
    """Every window that has started by `now`, per board: closed ones decided, the open one provisional."""
    index = {t: k for k, t in enumerate(instants)}
    out = []
    for track in competition.tracks:
        for w in competition.windows(track):
            if w.start >= now:
                break
            closed = w.close <= now
            lo = bisect_right(instants, format_instant(w.start))
            hi = bisect_right(instants, format_instant(w.close))
            for spec in specs:
                if spec.track != track:
                    continue
                states = timeline[spec.id][lo:hi]
                hours: dict[str, int] = {}
                first: dict[str, int] = {}
                last: dict[str, Entry] = {}
                logins: dict[str, str] = {}
                for k, s in enumerate(states):
                    h = s.holder
                    if h is None:
                        continue
                    hours[h.who] = hours.get(h.who, 0) + 1
                    first.setdefault(h.who, k)
                    last[h.who] = h
                    logins[h.who] = h.login
                if competition.daily_rule == "top_at_close" or not closed:
                    at_close = index.get(format_instant(w.close))
                    winner = timeline[spec.id][at_close].holder if closed and at_close is not None else (
                        states[-1].holder if states else None)
                else:
                    who = min(hours, key=lambda c: (-hours[c], first[c])) if hours else None
                    winner = last[who] if who else None
                table = sorted(((logins[c], n) for c, n in hours.items()), key=lambda x: (-x[1], x[0].lower()))
                out.append(DailyResult(w, spec.id, closed, winner, table))
    return out


# ---- the chain's head, as the committed views print it ----

@dataclass(frozen=True)
class ChainHead:
    """The first `records` records of the ledger's hash chain (append order), named by the sha256 of
    the last of them (64 zeros for none). Anyone holding a committed board or snapshot can check that
    the ledger still has this sha256 at seq `records - 1`: an edit before it changes every hash after."""
    records: int
    sha256: str

    def json(self) -> str:
        return json.dumps({"records": self.records, "sha256": self.sha256}, sort_keys=True, separators=(",", ":"))

    def markdown(self) -> str:
        if not self.records:
            return "Ledger chain: no records yet (head `" + self.sha256 + "`)."
        return (f"Ledger chain head: `{self.sha256}` (record seq {self.records - 1}, {self.records} "
                f"record{'s' if self.records != 1 else ''}); `python -m pipeline ledger verify` re-checks the chain "
                "and every result's signed document.")


GENESIS_HEAD = ChainHead(0, "0" * 64)


class _ChainReader:
    """Passes the records through, keeping what the chain heads need: (time, seq) of each, and the
    sha256 of each seq."""

    def __init__(self, records: Iterable[dict[str, Any]]):
        self.records = records
        self.times: list[tuple[str, int]] = []
        self.sha: dict[int, str] = {}

    def __iter__(self):
        for r in self.records:
            seq = r.get("seq")
            if isinstance(seq, int):
                self.times.append((r["accepted_at"] if r["kind"] == "result" else r["at"], seq))
                self.sha[seq] = r.get("sha256", "")
            yield r

    def head(self) -> ChainHead:
        if not self.sha:
            return GENESIS_HEAD
        last = max(self.sha)
        return ChainHead(last + 1, self.sha[last])

    def heads_at(self, instants: list[str]) -> list[ChainHead]:
        """Per instant T: the shortest prefix of the chain that holds every record of time <= T."""
        times = sorted(self.times)
        out, best, i = [], -1, 0
        for t in instants:
            while i < len(times) and times[i][0] <= t:
                best = max(best, times[i][1])
                i += 1
            out.append(GENESIS_HEAD if best < 0 else ChainHead(best + 1, self.sha[best]))
        return out


# ---- everything derived from one ledger at one instant ----

@dataclass
class Derived:
    competition: Competition
    specs: list[BoardSpec]
    entries: dict[str, list[Entry]]
    instants: list[str]
    timeline: dict[str, list[HourState]]
    daily: list[DailyResult]
    now: dt.datetime
    records: int
    unofficial: int
    chain: ChainHead = GENESIS_HEAD  # the whole ledger's
    chain_at: list[ChainHead] | None = None  # per instant: what the snapshot at that instant rests on

    def hour_counts(self, board: str) -> list[dict[str, int]]:
        """Per instant: how many of the board's results accepted by then are in each unranked state."""
        times = {s: [e.at for e in self.entries[board] if e.state == s] for s in STATES[1:]}
        return [{s: bisect_right(times[s], t) for s in STATES[1:]} for t in self.instants]


def derive(records: Iterable[dict[str, Any]], competition: Competition,
           problems: dict[str, tuple[str, tuple[str, ...]]], now: dt.datetime) -> Derived:
    """Everything the board, the snapshots and the prizes show, from the ledger's records (in any
    order: only their content matters) at the instant `now`. The chain heads are the one thing that
    depends on the order records arrived in, as they must: they name the chain."""
    chain = _ChainReader(records)
    specs, by_board = entries(chain, competition, problems)
    instants = [format_instant(t) for t in competition.snapshot_instants(now)]
    timeline = {s.id: board_timeline(by_board[s.id], instants, competition.snapshot_top) for s in specs}
    daily = daily_results(competition, specs, instants, timeline, now)
    results = [e for lst in by_board.values() for e in lst]
    return Derived(competition, specs, by_board, instants, timeline, daily, now, len(results),
                   sum(1 for e in results if not e.official), chain.head(), chain.heads_at(instants))


# ---- snapshots ----

def snapshot_path(instant: str) -> str:
    """results/snapshots/YYYY-MM-DD/HH (add .json or .md)."""
    return f"{instant[:10]}/{instant[11:13]}"


def snapshots(d: Derived) -> Iterable[tuple[str, str, str]]:
    """(relative path without suffix, JSON text, markdown text) for every snapshot instant."""
    counts = {s.id: d.hour_counts(s.id) for s in d.specs}
    windows = {t: d.competition.windows(t) for t in d.competition.tracks}
    accepted = sorted(e.at for lst in d.entries.values() for e in lst)
    heads = d.chain_at or [GENESIS_HEAD] * len(d.instants)
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
            holder = state.holder
            h = "null" if holder is None else json.dumps({"login": holder.login, "pr": holder.pr}, sort_keys=True,
                                                         separators=(",", ":"))
            parts.append(f'  {json.dumps(s.id)}: {{"disqualified":{c["disqualified"]},"holder":{h},'
                         f'"out_of_window":{c["out_of_window"]},"ranked":{state.ranked},"top":{state.top_json()},'
                         f'"under_review":{c["under_review"]}}}')
        text = (f'{{\n "at": "{t}",\n "boards": {{\n' + ",\n".join(parts) + "\n },\n"
                f' "chain": {heads[k].json()},\n'
                f' "daily": {json.dumps(daily, sort_keys=True, separators=(",", ":"))},\n'
                f' "results": {bisect_right(accepted, t)},\n "snapshot_version": {SNAPSHOT_VERSION}\n}}\n')
        yield snapshot_path(t), text, _snapshot_md(d, k, t, heads[k])


def _snapshot_md(d: Derived, k: int, t: str, head: ChainHead) -> str:
    lines = [f"# Snapshot {t[:10]} {t[11:16]} UTC", "",
             "Each board as it stood at this instant, from ledger results accepted at or before it "
             "(`python -m pipeline snapshots`); the JSON beside this file is the record.", "",
             head.markdown().replace("Ledger chain head:", "Ledger chain up to this instant:"), ""]
    for s in d.specs:
        state = d.timeline[s.id][k]
        lines.append(f"## {s.id}")
        if not state.rows:
            lines += ["", "No ranked results.", ""]
            continue
        lines += ["", f"| rank | competitor | {_score_name(s)} | PR |", "| ---: | --- | ---: | --- |"]
        for r, e in state.rows:
            lines.append(f"| {r} | {_handle(e.login)} | {_score(s, e.speedup)} | #{int(e.pr)} |")
        lines.append("")
    return "\n".join(lines)


# ---- prizes (text) ----

def prizes_rows(d: Derived) -> list[dict[str, Any]]:
    rows = []
    for r in d.daily:
        rows.append({
            "track": r.window.track,
            "window": r.window.index,
            "closes_at": format_instant(r.window.close),
            "board": r.board,
            "closed": r.closed,
            "winner": None if r.winner is None else r.winner.login,
            "pr": None if r.winner is None else r.winner.pr,
            "winner_hours": r.winner_hours,
            "hours_on_top": [{"login": login, "hours": n} for login, n in r.hours],
            "usd": d.competition.daily_usd if r.closed and r.winner else 0,
        })
    return rows


def render_prizes(d: Derived) -> str:
    from tabulate import tabulate

    c = d.competition
    head = (f"Daily prizes: ${c.daily_usd:,} per board per {c.daily_hours}-hour window, rule {c.daily_rule}; "
            f"from the ledger as of {format_instant(d.now)} ({d.records} results).")
    rows = prizes_rows(d)
    if not rows:
        return head + "\nNo daily window has started yet.\n"
    table = []
    for r in rows:
        others = ", ".join(f"{h['login']} {h['hours']}" for h in r["hours_on_top"]) or "nobody on the board"
        table.append([
            r["track"], r["window"] if r["closed"] else f"{r['window']} (open)", r["closes_at"][:16].replace("T", " "),
            r["board"], (f"@{r['winner']} (#{r['pr']})" if r["winner"] else "-") + ("" if r["closed"] else " so far"),
            r["winner_hours"], others, f"${r['usd']:,}" if r["usd"] else "-"])
    total = sum(r["usd"] for r in rows)
    return (head + "\n" + tabulate(table, headers=["track", "window", "closes (UTC)", "board", "winner",
                                                   "hours on top", "hours on top, everyone", "prize"],
                                   tablefmt="simple", disable_numparse=True)
            + f"\nAwarded so far: ${total:,}.\n")


# ---- leaderboard.md ----

def _cell(text: Any) -> str:
    """A table cell of the board: flag codes, the reasons of markings and workload names are text that a
    result or an organizer wrote, so they go through the one inline rule (pipeline/escape.py)."""
    return md_inline(text, 300)


def _t(at: str) -> str:
    return f"{at[:10]} {at[11:19]}"


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}x"


def _score(s: BoardSpec | None, v: float | None) -> str:
    """A board's score as it shows it: a kernel board's speedup with an x, the serving board's S without."""
    if s is not None and s.track == "serving":
        return "-" if v is None else f"{v:.3f}"
    return _x(v)


def _score_name(s: BoardSpec) -> str:
    return "score" if s.track == "serving" else "speedup"


def _us(v: float | None) -> str:
    return "-" if v is None else f"{v:,.1f}"


def _day(value: dt.datetime) -> str:
    return value.strftime("%Y-%m-%d %H:%M")


def _who(login: str) -> str:
    """A competitor's profile link; only a login that is one (the ledger checks it) makes a link."""
    if LOGIN_RE.fullmatch(login):
        return f"[@{login}](https://github.com/{login})"
    return md_inline(login, 60)


def _handle(login: str) -> str:
    return f"@{login}" if LOGIN_RE.fullmatch(login) else md_inline(login, 60)


def _pr(repo: str, pr: int) -> str:
    return f"[#{int(pr)}](https://github.com/{repo}/pull/{int(pr)})"


def _notes(e: Entry) -> str:
    notes = [] if e.official else ["unofficial (CPU)"]
    notes += e.flags
    return _cell(", ".join(notes))


def plot_path(spec: BoardSpec) -> str:
    return f"leaderboard/{spec.slug}.png"


def best_over_time(items: list[Entry]) -> list[tuple[str, float]]:
    """(accepted_at, best score so far) at every ranked result that raised the board's best."""
    out: list[tuple[str, float]] = []
    for e in items:
        if e.state == "ranked" and (not out or e.speedup > out[-1][1]):
            out.append((e.at, e.speedup))
    return out


def render_board(d: Derived, plots: set[str] | None = None) -> str:
    """The whole leaderboard.md. `plots`: the board ids that have a PNG beside it."""
    c = d.competition
    plots = plots or set()
    standings = {s.id: standing(d.entries[s.id]) for s in d.specs}
    out = [f"# {c.name}: leaderboard", "",
           "<!-- Generated by `python -m pipeline board` from results/ledger/ alone; never edit by hand. -->", "",
           f"Regenerated from the results ledger ({d.records} recorded result{'s' if d.records != 1 else ''}) by "
           "`python -m pipeline board`. Each board ranks every competitor's best result by its score, the "
           "geometric mean of its workloads' speedups over the baseline; results whose 95% intervals overlap "
           "share a rank, the earlier accepted listed first (the rules in full are at the end).", "",
           d.chain.markdown(), ""]
    if d.unofficial:
        out += [f"> **Unofficial results:** {d.unofficial} result{'s' if d.unofficial != 1 else ''} on these "
                f"boards {'were' if d.unofficial != 1 else 'was'} timed on a CPU, not by the H200 runner "
                "(a test or demo ledger); they are marked "
                "`unofficial (CPU)`.", ""]
    out += _calendar(d)
    out += _current_window(d, standings)
    out += ["## Kernel track", ""]
    for s in d.specs:
        if s.track == "kernel":
            out += _kernel_board(d, s, standings[s.id], s.id in plots)
    out += ["## Serving track", ""]
    for s in d.specs:
        if s.track == "serving":
            out += _serving_board(d, s, standings[s.id], s.id in plots)
    out += _past_winners(d)
    out += _rules(d)
    return "\n".join(out).rstrip("\n") + "\n"


def _calendar(d: Derived) -> list[str]:
    c = d.competition
    out = ["## Calendar and prizes", "", "| track | window (UTC) | now |", "| --- | --- | --- |"]
    for t in c.tracks.values():
        state = "not open yet" if d.now < t.start else ("closed" if d.now >= t.end else "open")
        out.append(f"| {t.title} | {_day(t.start)} to {_day(t.last_minute)} | {state} |")
    if c.prizes:
        parts = [f"{p.label} ${p.usd:,}" + (f" + {p.also}" if p.also else "") + (" each" if p.through > p.place else "")
                 for p in c.prizes]
        out += ["", "Prizes: " + ", ".join(parts) + "."]
    rule = ("whoever holds rank 1 at the close of each window" if c.daily_rule == "top_at_close"
            else "whoever holds rank 1 in the most of the window's hourly snapshots")
    out += ["", f"Daily prize: ${c.daily_usd:,} per board per {c.daily_hours}-hour window (counted from each "
            f"track's start) to {rule} (rule `{c.daily_rule}`).", ""]
    return out


def _current_window(d: Derived, standings: dict[str, Standing]) -> list[str]:
    c = d.competition
    out = ["## Daily prize: the current window", ""]
    open_tracks = [t for t in c.tracks.values() if t.contains(d.now)]
    if not open_tracks:
        upcoming = [t for t in c.tracks.values() if d.now < t.start]
        if upcoming:
            t = min(upcoming, key=lambda t: t.start)
            out += [f"No window is open. The {t.title.lower()} opens {_day(t.start)} UTC; its first window closes "
                    f"{_day(c.windows(t.name)[0].close)} UTC.", ""]
        else:
            out += ["No window is open: the competition has ended. The past winners are below.", ""]
        return out
    for t in open_tracks:
        ws = c.windows(t.name)
        w = next(w for w in ws if w.start <= d.now < w.close)
        name = "score" if t.name == "serving" else "speedup"
        out += [f"{t.title}: window {w.index} of {len(ws)}, {_day(w.start)} to {_day(w.close)} UTC.", "",
                f"| board | holds it now | {name} | PR | accepted (UTC) |", "| --- | --- | ---: | --- | --- |"]
        for s in d.specs:
            if s.track != t.name:
                continue
            h = standings[s.id].holder
            out.append(f"| {s.slug} | " + ("nobody yet | - | - | - |" if h is None else
                       f"{_who(h.login)} | {_score(s, h.speedup)} | {_pr(c.repository, h.pr)} | {_t(h.at)} |"))
        out.append("")
    return out


def _unranked(d: Derived, st: Standing, s: BoardSpec | None = None) -> list[str]:
    if not st.unranked:
        return []
    serving = s is not None and s.track == "serving"
    out = ["Not ranked:", "", "| competitor | score | PR | accepted (UTC) | why |", "| --- | ---: | --- | --- | --- |"] \
        if serving else ["Not ranked:", "", "| competitor | time (us) | speedup | PR | accepted (UTC) | why |",
                         "| --- | ---: | ---: | --- | --- | --- |"]
    for e in st.unranked:
        why = e.why + ("" if e.official else "; unofficial (CPU)")  # markdown already (assign_states)
        figures = _score(s, e.speedup) if serving else f"{_us(e.time_us)} | {_x(e.speedup)}"
        out.append(f"| {_who(e.login)} | {figures} | {_pr(d.competition.repository, e.pr)} | {_t(e.at)} | {why} |")
    return out + [""]


def _first_rank_below_baseline(st: Standing) -> int | None:
    """The rank of the first group whose best score is below 1.000x: the baseline row goes above it."""
    best: dict[int, float] = {}
    for r, e in st.rows:
        best[r] = max(best.get(r, 0.0), e.speedup)
    return next((r for r, v in best.items() if v < 1.0), None)


def _kernel_board(d: Derived, s: BoardSpec, st: Standing, plot: bool) -> list[str]:
    repo = d.competition.repository
    link = f"problems/{s.problem}/"
    out = [f"### `{s.problem}`: {md_heading(s.title)}", "", f"Problem statement: [{link}]({link}).", ""]
    head = ["rank", "competitor", "time (us)", "speedup", "95% interval"] + [_cell(w) for w in s.workloads] + \
        ["PR", "accepted (UTC)", "notes"]
    align = ["---:", "---", "---:", "---:", "---"] + ["---:"] * len(s.workloads) + ["---", "---", "---"]
    out += ["| " + " | ".join(head) + " |", "| " + " | ".join(align) + " |"]
    bases = sorted(e.baseline_us for _, e in st.rows if e.baseline_us)
    base_us = bases[len(bases) // 2] if bases else None
    baseline = (f"| | baseline (`reference/{s.problem}.py:baseline`) | {_us(base_us)} | 1.000x | | "
                + " | ".join("1.000x" for _ in s.workloads) + (" | " if s.workloads else "") + "| | |")
    below = _first_rank_below_baseline(st)
    for r, e in st.rows:
        if r == below:
            out.append(baseline)
        per = [_x(e.workloads.get(w)) for w in s.workloads]
        out.append("| " + " | ".join([str(r), _who(e.login), _us(e.time_us), f"**{_x(e.speedup)}**" if r == 1 else
                                      _x(e.speedup), f"{e.lo:.3f}-{e.hi:.3f}", *per, _pr(repo, e.pr), _t(e.at),
                                      _notes(e)]) + " |")
    if below is None:
        out.append(baseline)
    out.append("")
    if not st.rows:
        out += ["No ranked results yet.", ""]
    elif base_us is not None:
        out += ["The baseline's time is the median of the baseline times measured in the ranked results' own runs.", ""]
    out += _unranked(d, st)
    if plot:
        out += [f"![{s.problem}: the best score over time]({plot_path(s)})", ""]
    return out


def _serving_board(d: Derived, s: BoardSpec, st: Standing, plot: bool) -> list[str]:
    repo = d.competition.repository
    out = ["Each result's score S combines the ratios of its throughput per GPU (T_c) and interactivity (I_c) to "
           "the unpatched SGLang's, measured on the same node in the same run at concurrency c = 1, 4, 16 and 32 "
           "(the columns, before clipping): the unpatched SGLang scores 1.000. A result whose correctness gate "
           "failed (G = 0: its canary replies, its GSM8K accuracy or a level's failed turns) scores 0 and, like a "
           "kernel that fails its check, is never recorded.", ""]
    head = ["rank", "competitor", "score", "95% interval"] + [_cell(f"{f[0]} c={f[2:]}") for f in s.workloads] + \
        ["PR", "accepted (UTC)", "notes"]
    align = ["---:", "---", "---:", "---"] + ["---:"] * len(s.workloads) + ["---", "---", "---"]
    out += ["| " + " | ".join(head) + " |", "| " + " | ".join(align) + " |"]
    baseline = ("| | baseline (unpatched SGLang) | 1.000 | | " + " | ".join("1.000" for _ in s.workloads)
                + (" | " if s.workloads else "") + "| | |")
    below = _first_rank_below_baseline(st)
    for r, e in st.rows:
        if r == below:
            out.append(baseline)
        ratios = e.workloads
        per = [_score(s, ratios.get(f)) for f in s.workloads]
        out.append("| " + " | ".join([str(r), _who(e.login), f"{e.speedup:.3f}",
                                      f"{e.lo:.3f}-{e.hi:.3f}", *per, _pr(repo, e.pr), _t(e.at), _notes(e)]) + " |")
    if below is None:
        out.append(baseline)
    out.append("")
    if not st.rows:
        out += ["No results yet.", ""]
    out += _unranked(d, st, s)
    if plot:
        out += [f"![serving: the best score over time]({plot_path(s)})", ""]
    return out


def _past_winners(d: Derived) -> list[str]:
    c = d.competition
    out = ["## Past daily winners", ""]
    closed = [r for r in d.daily if r.closed]
    if not closed:
        return out + ["No daily window has closed yet.", ""]
    for track, t in c.tracks.items():
        rows = [r for r in closed if r.window.track == track]
        if not rows:
            continue
        boards = [s for s in d.specs if s.track == track]
        out += [f"{t.title} (rule `{c.daily_rule}`, ${c.daily_usd:,} per board per window; hours on top in brackets):",
                "", "| window | closed (UTC) | " + " | ".join(s.slug for s in boards) + " |",
                "| ---: | --- | " + " | ".join("---" for _ in boards) + " |"]
        by_key = {(r.window.index, r.board): r for r in rows}
        for w in c.windows(track):
            if w.close > d.now:
                break
            cells = []
            for s in boards:
                r = by_key[(w.index, s.id)]
                if r.winner is None:
                    cells.append("-")
                else:
                    cells.append(f"{_who(r.winner.login)} ({r.winner_hours} h)")
            out.append(f"| {w.index} | {_day(w.close)} | " + " | ".join(cells) + " |")
        out.append("")
    return out


def _rules(d: Derived) -> list[str]:
    return [
        "## How the boards are computed", "",
        "- Source: `results/ledger/*.jsonl` only, a hash-chained append-only record of merged evaluations "
        "(`python -m pipeline ledger verify` checks it). A result's time is its PR's merge time on GitHub.",
        "- Score: the geometric mean of the workloads' speedups (baseline median / submission median, both "
        "from the same run); time: the geometric mean of the submission's medians. Each competitor's best "
        "result is ranked.",
        "- Serving score: S = G x exp(the mean over the eight ratios r, T_c and I_c to the baseline's at c = 1, 4, "
        "16, 32, each clipped to [0.25, 4], of log r less any shortfall below 1 - eps once more), eps twice the "
        "baseline's spread against itself in the same run (B C C B on one node); G is the correctness gate. Its "
        "95% interval is S widened on each side by that spread.",
        "- Ties: a score's 95% interval is the interval from its own samples widened by the problem's "
        "measured run-to-run band (how far the baseline scores against itself across evaluations on the H200). "
        "Walking down the scores, an entry whose 95% interval overlaps that of the first entry of "
        "the current rank group joins that group; a group shares one rank and lists the earlier accepted "
        "result first. The first entry of rank 1 holds the board.",
        "- Results under review (for example a time below 0.95x the analytic floor) and disqualified "
        "results are listed but not ranked until an organizer clears them; a disqualification applies to "
        "every past hour as well. Results accepted outside their track's window are listed, not ranked.",
        "- Hourly snapshots: `results/snapshots/YYYY-MM-DD/HH.json`, each board at HH:00 UTC from the "
        "results accepted by then. A daily window's hours are the snapshots after its start up to and "
        "including its close; `python -m pipeline prizes` prints every window's winner.",
        "",
    ]


# ---- plots ----

PLOT_VERSION = 1


def plot_digest(d: Derived, spec: BoardSpec) -> str | None:
    """What the board's plot shows, as a sha256 (kept in the PNG's Description), or None when the board
    has nothing to plot. A PNG whose digest matches is left as it is: re-rendering is the slow part of
    `board`, and this keeps the file a function of the ledger alone, whatever matplotlib drew it."""
    series = best_over_time(d.entries[spec.id])
    if not series:
        return None
    track = d.competition.tracks[spec.track]
    latest = max(e.at for e in d.entries[spec.id] if e.state == "ranked")
    what = [PLOT_VERSION, spec.id, format_instant(track.start), format_instant(track.end), latest, series]
    return hashlib.sha256(json.dumps(what).encode()).hexdigest()


def png_description(data: bytes) -> str | None:
    """The Description text chunk of a PNG, if any."""
    pos = 8
    while pos + 8 <= len(data):
        size = int.from_bytes(data[pos:pos + 4], "big")
        kind = data[pos + 4:pos + 8]
        if kind == b"tEXt":
            key, _, text = data[pos + 8:pos + 8 + size].partition(b"\0")
            if key == b"Description":
                return text.decode("latin-1")
        if kind == b"IEND":
            break
        pos += 12 + size
    return None


def render_plot(d: Derived, spec: BoardSpec) -> bytes | None:
    """A PNG of the board's best score over time (its track's window on the x axis), or None when the
    board has no ranked result. Needs matplotlib."""
    digest = plot_digest(d, spec)
    if digest is None:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.dates as mdates
    import matplotlib.pyplot as plt

    from pipeline.report import png_bytes

    series = best_over_time(d.entries[spec.id])
    track = d.competition.tracks[spec.track]
    latest = max(e.at for e in d.entries[spec.id] if e.state == "ranked")
    xs = [parse_instant(t).replace(tzinfo=None) for t, _ in series]
    ys = [v for _, v in series]
    xs.append(parse_instant(latest).replace(tzinfo=None))
    ys.append(ys[-1])
    fig, ax = plt.subplots(figsize=(7, 2.6), dpi=100)
    try:
        ax.axhline(1.0, color="0.5", linestyle="--", linewidth=1, label="baseline 1.000x")
        ax.step(xs, ys, where="post", color="C0", linewidth=1.8, label="best score")
        ax.plot(xs[:-1], ys[:-1], "o", color="C0", markersize=3)
        ax.set_xlim(track.start.replace(tzinfo=None), track.end.replace(tzinfo=None))
        ax.set_ylim(bottom=min(0.9, min(ys) * 0.95), top=max(ys) * 1.08)
        locator = mdates.AutoDateLocator(minticks=4, maxticks=10)
        ax.xaxis.set_major_locator(locator)
        ax.xaxis.set_major_formatter(mdates.ConciseDateFormatter(locator))
        ax.set_ylabel("speedup (x)" if spec.track == "kernel" else "score")
        ax.set_title(f"{spec.slug}: best score over time (UTC), as of {latest[:16].replace('T', ' ')}", fontsize=9)
        ax.grid(True, linewidth=0.3)
        ax.legend(loc="lower right", fontsize=7)
        return png_bytes(fig, digest)
    finally:
        plt.close(fig)


# ---- the would-be rank a PR comment shows ----

def would_be_rank(records: Iterable[dict[str, Any]], competition: Competition,
                  problems: dict[str, tuple[str, tuple[str, ...]]], doc: dict[str, Any], at: str) -> str | None:
    """Where `doc` would stand if it were accepted at `at`, against the board as the ledger has it now:
    "3 of 12" (ties share a rank, as on the board), or why it would not move the competitor's entry."""
    if doc["status"] not in ("passed", "needs_review") or not doc.get("score"):
        return None
    _, boards = entries(records, competition, problems)
    current = [e for e in boards.get(board_id(doc["track"], doc["problem"]), []) if e.state == "ranked"]
    sub = doc["submission"]
    candidate = Entry({
        "accepted_at": at, "pr": sub.get("pr") or 0, "head_sha": sub.get("head_sha") or "0" * 40,
        "login": sub.get("login") or "(this submission)", "score": doc["score"], "official": doc["official"],
        "status": doc["status"], "flags": [], "track": doc["track"], "problem": doc["problem"], "workloads": [],
    })
    rows = rank(score_order(best_per_competitor(current + [candidate])))
    for place, e in rows:
        if e is candidate:
            return f"{place} of {len(rows)}"
    return "below your own best on the board (it stays)"
