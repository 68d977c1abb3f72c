"""`competition.toml`: the calendar (each track's window), the prizes, the daily-prize rule, the rate
limit and the runner labels, loaded into plain frozen objects.

Also the one way instants are written everywhere downstream (`format_instant`): UTC, whole seconds,
`YYYY-MM-DDTHH:MM:SSZ`, so that they sort as strings.
"""

from __future__ import annotations

import datetime as dt
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.exits import UsageError

REPO_ROOT = Path(__file__).resolve().parent.parent
TRACKS = ("kernel", "serving")
DAILY_RULES = ("top_at_close", "most_hours_on_top")
HOUR = dt.timedelta(hours=1)
UTC = dt.timezone.utc


_SHA256 = re.compile(r"[0-9a-f]{64}")


class CompetitionError(ValueError):
    """competition.toml (organizer data) cannot be used; the message says where and what to change."""


class InstantError(UsageError, ValueError):
    """A time given on the command line or in a record is not a UTC instant we can use."""


def parse_instant(text: str, what: str = "time") -> dt.datetime:
    """An ISO 8601 instant with a time zone (`Z` or an offset) -> an aware UTC datetime, whole seconds."""
    try:
        value = dt.datetime.fromisoformat(text.strip())
    except (ValueError, AttributeError):
        raise InstantError(f"{what} {text!r} is not an ISO 8601 time; write it like 2026-10-22T10:00:00Z") from None
    if value.tzinfo is None:
        raise InstantError(f"{what} {text!r} has no time zone; write UTC with a Z, like 2026-10-22T10:00:00Z")
    if value.microsecond:
        raise InstantError(f"{what} {text!r} has a fraction of a second; GitHub's merged_at has whole seconds, "
                           "give it as GitHub reports it")
    try:
        return value.astimezone(UTC)
    except OverflowError:  # 9999-12-31T23:00:00-05:00 is in the year 10000
        raise InstantError(f"{what} {text!r} is outside the years a time can name; write it like "
                           "2026-10-22T10:00:00Z") from None


def format_instant(value: dt.datetime) -> str:
    return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def floor_hour(value: dt.datetime) -> dt.datetime:
    return value.astimezone(UTC).replace(minute=0, second=0, microsecond=0)


@dataclass(frozen=True)
class Track:
    name: str
    title: str
    start: dt.datetime
    end: dt.datetime  # exclusive
    runner_labels: tuple[str, ...]

    def contains(self, instant: dt.datetime) -> bool:
        return self.start <= instant < self.end

    @property
    def last_minute(self) -> dt.datetime:
        return self.end - dt.timedelta(minutes=1)


@dataclass(frozen=True)
class Prize:
    place: int
    through: int
    usd: int
    also: str | None = None

    @property
    def label(self) -> str:
        if self.through == self.place:
            return _ordinal(self.place)
        return f"{_ordinal(self.place)}-{_ordinal(self.through)}"


@dataclass(frozen=True)
class DailyWindow:
    track: str
    index: int  # 1-based
    start: dt.datetime  # exclusive: the window's hours are (start, close]
    close: dt.datetime


@dataclass(frozen=True)
class Competition:
    name: str
    repository: str
    tracks: dict[str, Track]
    prizes: tuple[Prize, ...]
    daily_usd: int
    daily_hours: int
    daily_rule: str
    rate_limit_per_hour: int
    snapshot_top: int
    source: str = "competition.toml"
    # problem -> the sha256 of the baseline its official results are measured against
    # (problems.baseline_identity): the competition's unit of measure, fixed on day 0 (`python -m pipeline
    # problems --pin-baselines`); an official evaluation against any other baseline is refused
    baselines: dict[str, str] = field(default_factory=dict)

    def pin_problem(self, problem: str, identity: dict[str, Any]) -> str | None:
        """Why a baseline (`identity`: problems.baseline_identity's name and sha256, or a result's
        baseline_source) is not the one pinned for `problem` in [baselines], or None."""
        pinned = self.baselines.get(problem)
        if pinned is None:
            return (f"{self.source} pins no baseline for {problem}: an organizer pins them with `python -m pipeline "
                    "problems --pin-baselines` (docs/RUNBOOK.md, day 0)")
        if identity.get("sha256") != pinned:
            return (f"the baseline measured ({identity.get('name')}, sha256 {str(identity.get('sha256'))[:16]}...) is "
                    f"not the one {self.source} pins for {problem} ({pinned[:16]}...)")
        return None

    def windows(self, track: str) -> list[DailyWindow]:
        """The daily windows of a track: every `daily_hours` from its start; the last closes at its end."""
        t = self.tracks[track]
        step = dt.timedelta(hours=self.daily_hours)
        out, start, index = [], t.start, 1
        while start < t.end:
            close = min(start + step, t.end)
            out.append(DailyWindow(track, index, start, close))
            start, index = close, index + 1
        return out

    @property
    def first_start(self) -> dt.datetime:
        return min(t.start for t in self.tracks.values())

    @property
    def last_end(self) -> dt.datetime:
        return max(t.end for t in self.tracks.values())

    def snapshot_instants(self, now: dt.datetime) -> list[dt.datetime]:
        """Every HH:00 in (first track start, min(now, last track end)]: 24 per day of the competition."""
        last = min(floor_hour(now), self.last_end)
        out, t = [], self.first_start + HOUR
        while t <= last:
            out.append(t)
            t += HOUR
        return out


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _need(table: dict[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if key not in table:
        raise CompetitionError(f"{where} needs `{key}`")
    value = table[key]
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise CompetitionError(f"{where}: `{key}` must be a {names}, not {value!r}")
    return value


def _instant(table: dict[str, Any], key: str, where: str) -> dt.datetime:
    value = table.get(key)
    if not isinstance(value, dt.datetime) or value.tzinfo is None:
        raise CompetitionError(f"{where}: `{key}` must be a UTC date-time with a Z, like 2026-10-22T00:00:00Z "
                               f"(got {value!r})")
    value = value.astimezone(UTC)
    if value != floor_hour(value):
        raise CompetitionError(f"{where}: `{key}` = {format_instant(value)} must fall on a whole hour "
                               "(snapshots and daily windows are hourly)")
    return value


def parse(data: dict[str, Any], source: str = "competition.toml") -> Competition:
    """The checked configuration; a CompetitionError names the table and key to fix."""
    tracks_raw = data.get("tracks")
    if not isinstance(tracks_raw, dict) or not tracks_raw:
        raise CompetitionError(f"{source}: needs [tracks.kernel] and [tracks.serving] tables")
    unknown = sorted(set(tracks_raw) - set(TRACKS))
    if unknown:
        raise CompetitionError(f"{source}: unknown track(s) {unknown}; the tracks are {list(TRACKS)}")
    tracks = {}
    for name in TRACKS:
        where = f"{source}: [tracks.{name}]"
        raw = tracks_raw.get(name)
        if not isinstance(raw, dict):
            raise CompetitionError(f"{source}: needs a [tracks.{name}] table with start and end")
        start, end = _instant(raw, "start", where), _instant(raw, "end", where)
        if end <= start:
            raise CompetitionError(f"{where}: end {format_instant(end)} must be after start {format_instant(start)} "
                                   "(end is exclusive)")
        labels = raw.get("runner_labels", [])
        if not isinstance(labels, list) or not all(isinstance(x, str) and x for x in labels):
            raise CompetitionError(f"{where}: `runner_labels` must be a list of strings")
        tracks[name] = Track(name, str(raw.get("title", name.capitalize() + " track")), start, end, tuple(labels))

    prizes = []
    taken: set[int] = set()
    for i, raw in enumerate(data.get("prizes", [])):
        where = f"{source}: [[prizes]] entry {i + 1}"
        place = _need(raw, "place", int, where)
        through = raw.get("through", place)
        usd = _need(raw, "usd", int, where)
        if not isinstance(through, int) or place < 1 or through < place or usd < 0:
            raise CompetitionError(f"{where}: needs 1 <= place <= through and usd >= 0")
        places = set(range(place, through + 1))
        if places & taken:
            raise CompetitionError(f"{where}: place {min(places & taken)} is already given by an earlier entry")
        taken |= places
        also = raw.get("also")
        prizes.append(Prize(place, through, usd, str(also) if also else None))
    prizes.sort(key=lambda p: p.place)

    daily = data.get("daily_prize", {})
    where = f"{source}: [daily_prize]"
    usd = _need(daily, "usd", int, where) if "usd" in daily else 1000
    hours = _need(daily, "window_hours", int, where) if "window_hours" in daily else 24
    rule = daily.get("rule", "top_at_close")
    if rule not in DAILY_RULES:
        raise CompetitionError(f"{where}: rule = {rule!r}; use one of {list(DAILY_RULES)}")
    if hours < 1 or usd < 0:
        raise CompetitionError(f"{where}: window_hours must be >= 1 and usd >= 0")

    limit_raw = data.get("rate_limit", {})
    limit = limit_raw.get("evaluations_per_competitor_per_hour", 10)
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
        raise CompetitionError(f"{source}: [rate_limit] evaluations_per_competitor_per_hour must be an integer >= 1")
    top = data.get("snapshots", {}).get("top", 10)
    if not isinstance(top, int) or isinstance(top, bool) or top < 1:
        raise CompetitionError(f"{source}: [snapshots] top must be an integer >= 1")
    repository = data.get("repository", "")
    if not isinstance(repository, str) or repository.count("/") != 1:
        raise CompetitionError(f"{source}: `repository` must be owner/name on GitHub (got {repository!r})")
    pins = data.get("baselines", {})
    if not isinstance(pins, dict) or not all(isinstance(v, str) and _SHA256.fullmatch(v) for v in pins.values()):
        raise CompetitionError(f"{source}: [baselines] maps each problem to its baseline's sha256 (64 lowercase hex "
                               "digits); `python -m pipeline problems --pin-baselines` writes the table")
    return Competition(
        name=str(data.get("name", "Competition")),
        repository=repository,
        tracks=tracks,
        prizes=tuple(prizes),
        daily_usd=usd,
        daily_hours=hours,
        daily_rule=rule,
        rate_limit_per_hour=limit,
        snapshot_top=top,
        source=source,
        baselines=dict(pins),
    )


def load(path: Path | None = None) -> Competition:
    path = Path(path) if path else REPO_ROOT / "competition.toml"
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise CompetitionError(f"{path} does not exist; copy the repository's competition.toml there "
                               "or pass --competition PATH") from None
    except tomllib.TOMLDecodeError as exc:
        raise CompetitionError(f"{path}: invalid TOML: {exc}") from None
    return parse(data, str(path))
