"""The standings: each ledger record read once as an entry, its state on its board, the ranking with
its ties, each board at every hourly instant, the chain head the views rest on, and where a new result
would stand. The rules are in pipeline/board/__init__.py."""

from __future__ import annotations

import datetime as dt
import json
import math
from bisect import bisect_left, bisect_right
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any, Iterable

from pipeline.competition import Competition, format_instant
from pipeline.ledger import ENTRANT_KEY, ORGANIZERS, Unparsed, latest_markings

# The serving board's columns: the ratio of each scored figure to the baseline's, as a serving result's
# performance entries name them (pipeline/serving/document.py's serving_document; c as in pipeline/serving/score.py).
SERVING_FIGURES = tuple(f"{m}_{c}" for c in (1, 4, 16, 32) for m in ("T", "I"))
STATES = ("ranked", "under_review", "disqualified", "out_of_window")
# the state of the organizers' own results: shown beside the baseline, never ranked (not one of STATES,
# which the snapshots count)
ORGANIZERS_STATE = "organizers"
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
                 "status", "flags", "board", "_workloads", "state", "mark", "organizers")

    def __init__(self, r: dict[str, Any]):
        # read once per record of the ledger (100,000 at competition scale): locals, no calls
        score = r["score"]
        self.at = at = r["accepted_at"]
        self.pr = pr = r["pr"]
        self.head_sha = head = r["head_sha"]
        self.key = (at, pr, head)
        self.login = login = r["login"]
        self.who = login.lower()
        self.speedup = speedup = score["speedup"]
        self.time_us = score["time_us"]
        interval = score.get("interval")
        if interval:
            self.lo, self.hi = interval[0], interval[1]
        else:
            self.lo = self.hi = speedup
        self.official = r["official"]
        self.status = r["status"]
        self.flags = r["flags"]
        self.board = f"kernel/{r['problem']}" if r["track"] == "kernel" else "serving"
        self._workloads = r["workloads"]
        self.organizers = r.get(ENTRANT_KEY) == ORGANIZERS
        self.state = "ranked"
        self.mark = None  # the disqualification that took it off the board

    def _workload_list(self) -> list[dict[str, Any]]:
        wl = self._workloads
        if wl.__class__ is Unparsed:  # as the boards read the ledger (iter_records): parsed when first shown
            wl = self._workloads = wl.value()
        return wl

    @property
    def workloads(self) -> dict[str, float]:
        return {w["workload"]: w["speedup"] for w in self._workload_list()}

    @property
    def baseline_us(self) -> float | None:
        """The geometric mean of the baseline medians measured in this result's own run."""
        base = [w["baseline_median_us"] for w in self._workload_list() if w.get("baseline_median_us", 0) > 0]
        return math.exp(sum(map(math.log, base)) / len(base)) if base else None


def collect(records: Iterable[dict[str, Any]], chain: Chain | None = None) -> tuple[list[Entry], list[dict[str, Any]]]:
    """One pass over the records (any order): the results as entries, and the markings; with `chain`,
    what the chain heads need of each record noted in it."""
    results, marks = [], []
    times, sha = (chain.times, chain.sha) if chain is not None else ([], {})
    for r in records:
        if r["kind"] == "result":
            e = Entry(r)
            results.append(e)
            t = e.at
        else:
            marks.append(r)
            t = r["at"]
        seq = r.get("seq")
        if seq.__class__ is int:
            times.append((t, seq))
            sha[seq] = r.get("sha256", "")
    return results, marks


def assign_states(results: list[Entry], marks: list[dict[str, Any]], competition: Competition) -> None:
    """Each result's state on its board (see the module's docstring), in place."""
    latest = latest_markings(marks)
    bounds = {name: (format_instant(t.start), format_instant(t.end)) for name, t in competition.tracks.items()}
    for e in results:
        mark = latest.get((e.pr, e.head_sha)) if latest else None
        start, end = bounds["serving" if e.board == "serving" else "kernel"]
        if mark is not None and mark["kind"] == "disqualification":
            e.state, e.mark = "disqualified", mark
        elif e.status == "needs_review" and mark is None:
            e.state = "under_review"
        elif e.organizers:  # whenever it was accepted: the organizers' row is a bar, not an entry in a window
            e.state = ORGANIZERS_STATE
        elif not start <= e.at < end:
            e.state = "out_of_window"


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
            problems: dict[str, tuple[str, tuple[str, ...]]], chain: Chain | None = None
            ) -> tuple[list[BoardSpec], dict[str, list[Entry]]]:
    """The boards, and each board's results as entries in accepted order, each with its state."""
    results, marks = collect(records, chain)
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
    """Each competitor's best entry of `items`, given in accepted order: the highest score, the earlier
    accepted on equal scores."""
    best: dict[str, Entry] = {}
    for e in items:
        old = best.get(e.who)
        if old is None or e.speedup > old.speedup:
            best[e.who] = e
    return list(best.values())


@dataclass
class Standing:
    rows: list[tuple[int, Entry]]
    unranked: list[Entry]  # disqualified and under review (all), out of window (each competitor's best)
    organizers: Entry | None = None  # the organizers' best result: shown beside the baseline, never ranked

    @property
    def holder(self) -> Entry | None:
        return self.rows[0][1] if self.rows else None


def standing(items: list[Entry]) -> Standing:
    """A board now, from its entries in accepted order."""
    ranked = rank(score_order(best_per_competitor(e for e in items if e.state == "ranked")))
    marked = [e for e in items if e.state in ("under_review", "disqualified")]
    late = best_per_competitor(e for e in items if e.state == "out_of_window")
    ours = score_order(e for e in items if e.state == ORGANIZERS_STATE)  # one row, whichever organizer ran it
    return Standing(ranked, sorted(marked + late, key=_KEY), ours[0] if ours else None)


# ---- the hourly timeline ----

class HourState:
    """A board at one snapshot instant: its top rows, its holder, how many competitors are ranked.
    Shared between consecutive hours while nothing changes."""

    __slots__ = ("rows", "ranked", "_json", "_row_json")

    def __init__(self, rows: list[tuple[int, Entry]], ranked: int, row_json: dict | None = None):
        self.rows, self.ranked, self._json = rows, ranked, None
        self._row_json = {} if row_json is None else row_json  # (rank, entry) -> its JSON, shared by a board's hours

    @property
    def holder(self) -> Entry | None:
        return self.rows[0][1] if self.rows else None

    def top_json(self) -> str:
        """The rows as JSON (sorted keys, compact): the same text as json.dumps of the list, each row
        written once however many hours it stays in the top."""
        if self._json is None:
            cache, parts = self._row_json, []
            for r, e in self.rows:
                text = cache.get((r, e))
                if text is None:
                    text = cache[(r, e)] = json.dumps(_row_dict(r, e), sort_keys=True, separators=(",", ":"))
                parts.append(text)
            self._json = "[" + ",".join(parts) + "]"
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
    row_json: dict = {}
    state = HourState([], 0, row_json)
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
            state = HourState(rank(ordered, top), len(ordered), row_json)
        out.append(state)
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


class Chain:
    """What the chain heads need of the records, noted by `collect` as it passes: (time, seq) of each,
    and the sha256 of each seq."""

    def __init__(self) -> None:
        self.times: list[tuple[str, int]] = []
        self.sha: dict[int, str] = {}

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
    now: dt.datetime
    records: int
    unofficial: int
    chain: ChainHead = GENESIS_HEAD  # the whole ledger's
    chain_at: list[ChainHead] | None = None  # per instant: what the snapshot at that instant rests on
    _standings: dict[str, Standing] = field(default_factory=dict, repr=False)

    def standing(self, board: str) -> Standing:
        """The board at `now` (computed once: the board and the final placings both read it)."""
        st = self._standings.get(board)
        if st is None:
            st = self._standings[board] = standing(self.entries[board])
        return st

    def hour_counts(self, board: str) -> list[dict[str, int]]:
        """Per instant: how many of the board's results accepted by then are in each unranked state."""
        times = {s: [e.at for e in self.entries[board] if e.state == s] for s in STATES[1:]}
        return [{s: bisect_right(times[s], t) for s in STATES[1:]} for t in self.instants]


def derive(records: Iterable[dict[str, Any]], competition: Competition,
           problems: dict[str, tuple[str, tuple[str, ...]]], now: dt.datetime) -> Derived:
    """Everything the board, the snapshots and the prizes show, from the ledger's records (in any
    order: only their content matters) at the instant `now`. The chain heads are the one thing that
    depends on the order records arrived in, as they must: they name the chain."""
    chain = Chain()
    specs, by_board = entries(records, competition, problems, chain)
    instants = [format_instant(t) for t in competition.snapshot_instants(now)]
    timeline = {s.id: board_timeline(by_board[s.id], instants, competition.snapshot_top) for s in specs}
    results = [e for lst in by_board.values() for e in lst]
    return Derived(competition, specs, by_board, instants, timeline, now, len(results),
                   sum(1 for e in results if not e.official), chain.head(), chain.heads_at(instants))


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
    rows = rank(score_order(best_per_competitor(sorted(current + [candidate], key=_KEY))))
    for place, e in rows:
        if e is candidate:
            return f"{place} of {len(rows)}"
    return "below your own best on the board (it stays)"
