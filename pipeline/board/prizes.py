"""The prizes, every decision as of one instant: the daily windows' winners per board (which hourly
snapshots count, which windows are complete) and, once a track has closed, the final placings of each
of its boards with the amounts of competition.toml's [[prizes]].

`python -m pipeline prizes --at T` reads the ledger as it stood at T (`as_of`: the results accepted
and the markings made at or before T), so its table is a function of the ledger and T alone: the same
bytes however often, and whenever, it runs.

Final placings: a track's boards as they stand at its close; the place is the row's position on the
board (rank groups list the earlier accepted first, as the daily prize gives a tie to the earlier), so
a tie shares the board's rank but each place, and its amount, goes to one competitor. Only ranked rows
place: the baseline is no competitor, nor are the organizers (their row, however fast, is never
ranked: the fastest competitor below it holds the board and wins the window), and results under
review, disqualified or accepted outside the track's window are not ranked.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

from pipeline.board.standings import Derived, Entry
from pipeline.competition import DailyWindow, Prize, format_instant
from pipeline.ledger import record_time


def as_of(records: Iterable[dict[str, Any]], at: str) -> Iterator[dict[str, Any]]:
    """The records of a ledger as it stood at the instant `at`: results accepted and markings made at or
    before it (a later disqualification does not reach back into a decision made at `at`)."""
    for r in records:
        if record_time(r) <= at:
            yield r


# ---- the daily windows ----

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


def daily_results(d: Derived) -> list[DailyResult]:
    """Every window that has started by `d.now`, per board: closed ones decided, the open one provisional."""
    competition, specs, instants, timeline, now = d.competition, d.specs, d.instants, d.timeline, d.now
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




# ---- the final placings ----

@dataclass(frozen=True)
class Placing:
    place: int  # the row's position on the board at the track's close, 1-based
    rank: int  # the board's rank (a tie group shares one)
    entry: Entry
    prize: Prize


@dataclass(frozen=True)
class FinalBoard:
    board: str
    track: str
    closes_at: str
    closed: bool  # the track has closed by the instant of the decision: its placings are awarded
    placings: list[Placing]


def final_placings(d: Derived) -> list[FinalBoard]:
    """Per board: its prize places at its track's close, once the track has closed by `d.now`."""
    out = []
    prizes = {n: p for p in d.competition.prizes for n in range(p.place, p.through + 1)}
    for spec in d.specs:
        track = d.competition.tracks[spec.track]
        closed = track.end <= d.now
        placings = []
        if closed:
            rows = d.standing(spec.id).rows
            placings = [Placing(k, r, e, prizes[k]) for k, (r, e) in enumerate(rows, 1) if k in prizes]
        out.append(FinalBoard(spec.id, spec.track, format_instant(track.end), closed, placings))
    return out


# ---- the table ----

def prizes_rows(d: Derived) -> list[dict[str, Any]]:
    rows = []
    for r in daily_results(d):
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


def final_rows(d: Derived) -> list[dict[str, Any]]:
    return [{"board": f.board, "track": f.track, "closes_at": f.closes_at, "closed": f.closed,
             "placings": [{"place": p.place, "rank": p.rank, "login": p.entry.login, "pr": p.entry.pr,
                           "score": p.entry.speedup, "usd": p.prize.usd, "also": p.prize.also} for p in f.placings]}
            for f in final_placings(d)]


def render_prizes(d: Derived) -> str:
    from tabulate import tabulate

    c = d.competition
    head = (f"Daily prizes: ${c.daily_usd:,} per board per {c.daily_hours}-hour window, rule {c.daily_rule}; "
            f"every decision as of {format_instant(d.now)}, from the ledger's {d.records} results accepted by then.")
    rows = prizes_rows(d)
    finals = final_rows(d)
    out = [head]
    if not rows:
        out.append("No daily window has started yet.")
    else:
        table = []
        for r in rows:
            others = ", ".join(f"{h['login']} {h['hours']}" for h in r["hours_on_top"]) or "nobody on the board"
            table.append([
                r["track"], r["window"] if r["closed"] else f"{r['window']} (open)",
                r["closes_at"][:16].replace("T", " "), r["board"],
                (f"@{r['winner']} (#{r['pr']})" if r["winner"] else "-") + ("" if r["closed"] else " so far"),
                r["winner_hours"], others, f"${r['usd']:,}" if r["usd"] else "-"])
        out.append(tabulate(table, headers=["track", "window", "closes (UTC)", "board", "winner", "hours on top",
                                            "hours on top, everyone", "prize"], tablefmt="simple",
                            disable_numparse=True))
    out += ["", "Final placings (each board at its track's close; a tie shares the rank, the earlier accepted "
            "takes the place):" if c.prizes else f"Final placings: {c.source} gives no [[prizes]]."]
    for track in c.tracks.values() if c.prizes else ():
        boards = [f for f in finals if f["track"] == track.name]
        if not boards[0]["closed"]:
            out.append(f"{track.title}: closes {format_instant(track.end)[:16].replace('T', ' ')} UTC; its final "
                       "placings are awarded then.")
            continue
        table = []
        for f in boards:
            if not f["placings"]:
                table.append([f["board"], "-", "-", "nobody ranked", "-", "-", "-"])
            for p in f["placings"]:
                table.append([f["board"], p["place"], p["rank"], f"@{p['login']} (#{p['pr']})", f"{p['score']:.3f}",
                              f"${p['usd']:,}", p["also"] or ""])
        out.append(f"{track.title}, closed {format_instant(track.end)[:16].replace('T', ' ')} UTC:")
        out.append(tabulate(table, headers=["board", "place", "rank", "competitor", "score", "prize", "also"],
                            tablefmt="simple", disable_numparse=True))
    daily = sum(r["usd"] for r in rows)
    placed = sum(p["usd"] for f in finals for p in f["placings"])
    out.append(f"Awarded so far: ${daily + placed:,} (daily ${daily:,}, final placings ${placed:,}).")
    return "\n".join(out) + "\n"
