"""The plots: a PNG per board of its best score over time, redrawn only when what it shows changes."""

from __future__ import annotations

import hashlib
import json

from pipeline.board.standings import BoardSpec, Derived, Entry
from pipeline.competition import format_instant, parse_instant


def plot_path(spec: BoardSpec) -> str:
    return f"leaderboard/{spec.slug}.png"


def best_over_time(items: list[Entry]) -> list[tuple[str, float]]:
    """(accepted_at, best score so far) at every ranked result that raised the board's best."""
    out: list[tuple[str, float]] = []
    for e in items:
        if e.state == "ranked" and (not out or e.speedup > out[-1][1]):
            out.append((e.at, e.speedup))
    return out



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
