"""The boards: ranking and ties, leaderboard.md, hourly snapshots, daily prizes, plots.

Property tests: derived outputs do not depend on the order records arrived in, running twice changes
nothing, snapshots backfilled at the end equal snapshots written hour by hour, and the prize rule
holds at window edges."""

from __future__ import annotations

import datetime as dt
import json
import random
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from ledger_factory import PROBLEMS, chain, competition, raw, result_doc, sha, write_competition
from pipeline import competition as comp, ledger as lg
from pipeline.board import plots, prizes as pz, render, snapshots as sn, standings
from pipeline.__main__ import main

ROOT = Path(__file__).resolve().parent.parent
START = comp.parse_instant("2026-10-22T00:00:00Z")
SETTINGS = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def at(hours: float = 0, seconds: int = 0) -> str:
    return comp.format_instant(START + dt.timedelta(hours=hours, seconds=seconds))


# each result body's signed document, by its result_sha256: what `put` keeps as its evidence
EVIDENCE: dict[str, bytes] = {}


def result(pr: int, login: str, speedup: float, when: str, *, rel: float = 0.001, status: str = "passed",
           official: bool = True, problem: str = "muse_bf16_proj", track: str = "kernel") -> dict:
    doc = result_doc(pr=pr, login=login, speedup=speedup, rel=rel, status=status, official=official,
                     problem=problem, track=track, flags=("below_floor",) if status == "needs_review" else ())
    body = lg.result_record(doc, raw(doc), pr=pr, login=login, head_sha=sha(f"head-{pr}"), accepted_at=when,
                            allow_unofficial=True, workloads={k: list(v[1]) for k, v in PROBLEMS.items()})
    EVIDENCE[body["result_sha256"]] = raw(doc)
    return body


def put(root: Path, body) -> dict:
    """lg.append with the result's evidence."""
    evidence = None if callable(body) or body["kind"] != "result" else EVIDENCE[body["result_sha256"]]
    return lg.append(root, body, evidence=evidence)[0]


def disqualify(records: list[dict], pr: int, when: str, kind: str = "disqualification") -> dict:
    return lg.marking_record(records, kind, pr=pr, head_sha=None, reason="read the reference", by="organizer",
                             at=when)


def derive(records: list[dict], now: str, c: comp.Competition | None = None) -> standings.Derived:
    return standings.derive(records, c or competition(), PROBLEMS, comp.parse_instant(now))


def holders(d: standings.Derived, board: str = "kernel/muse_bf16_proj") -> list[str | None]:
    return [s.holder.login if s.holder else None for s in d.timeline[board]]


def everything(d: standings.Derived) -> tuple[str, list, str, str]:
    return render.render_board(d), list(sn.snapshots(d)), pz.render_prizes(d), json.dumps(pz.prizes_rows(d))


def unchained(text: str) -> str:
    """A board or snapshot without its chain head: the one line that names the chain, which depends on
    the order records arrived in (as it must), where nothing else may."""
    kept = [line for line in text.splitlines(keepends=True)
            if not line.startswith((' "chain": ', "Ledger chain"))]
    assert len(kept) == len(text.splitlines()) - 1, "one chain line per board and snapshot"
    return "".join(kept)


def without_chains(views: tuple[str, list, str, str]) -> tuple[str, list, str, str]:
    board, snaps, prizes, rows = views
    return unchained(board), [(rel, unchained(j), unchained(m)) for rel, j, m in snaps], prizes, rows


# ---- ranking ----

def test_ties_share_a_rank_by_overlap_with_the_group_leader():
    recs = chain([
        result(1, "ann", 2.000, at(3), rel=0.005),  # interval about [1.980, 2.020]: the leader
        result(2, "bob", 1.990, at(2), rel=0.005),  # [1.970, 2.010] overlaps ann: tied, and earlier
        result(3, "cat", 1.960, at(1), rel=0.005),  # [1.940, 1.980] overlaps bob but not ann: next group
        result(4, "dan", 1.950, at(4), rel=0.005),  # overlaps cat, the leader of the second group
        result(5, "eve", 1.700, at(5), rel=0.0),    # no interval overlap with anyone
        result(6, "fay", 1.700, at(6), rel=0.0),    # exactly equal point scores tie
    ])
    d = derive(recs, at(48))
    rows = standings.standing(d.entries["kernel/muse_bf16_proj"]).rows
    assert [(r, e.login) for r, e in rows] == [(1, "bob"), (1, "ann"), (3, "cat"), (3, "dan"), (5, "eve"), (5, "fay")]


def test_each_competitor_best_result_only_and_equal_scores_go_to_the_earlier():
    recs = chain([result(1, "ann", 1.5, at(1)), result(2, "Ann", 1.8, at(2)), result(3, "ann", 1.8, at(3)),
                  result(4, "bob", 1.2, at(4))])
    rows = standings.standing(derive(recs, at(48)).entries["kernel/muse_bf16_proj"]).rows
    assert [(r, e.login, e.pr) for r, e in rows] == [(1, "Ann", 2), (2, "bob", 4)]


# ---- leaderboard.md ----

def mixed_ledger() -> list[dict]:
    bodies = [
        result(1, "ann", 1.60, at(2)),
        result(2, "ann", 1.40, at(1)),                                   # ann's worse result: not shown
        result(3, "bob", 1.59, at(3), rel=0.01),                         # ties ann, later: same rank, below her
        result(4, "cat", 0.80, at(4), official=False),                   # slower than the baseline; unofficial
        result(5, "dan", 3.00, at(5), status="needs_review"),            # held for review
        result(6, "eve", 2.50, at(-5)),                                  # before the track opened
        result(7, "fay", 2.40, at(6)),                                   # disqualified below
        result(8, "gus", 2.20, at(48)),                                  # exactly at the kernel track's end
        result(9, "hal", 1.30, at(49), track="serving"),                 # the serving board
        result(10, "ivy", 1.10, at(10), problem="muse_moe_w4a16"),
    ]
    bodies.append(disqualify(bodies, 7, at(20)))
    return chain(bodies)


def test_board_shows_every_part_the_spec_asks_for():
    text = render.render_board(derive(mixed_ledger(), at(30)), plots={"kernel/muse_bf16_proj"})
    bf16 = text[text.index("### `muse_bf16_proj`"):text.index("### `muse_decode_layer`")]
    lines = [x for x in bf16.splitlines() if x.startswith("| ")]
    assert lines[0] == ("| rank | competitor | time (us) | speedup | 95% interval | M1 | M16 | M32 | PR | "
                        "accepted (UTC) | notes |")
    ranked = [x for x in lines[2:] if "baseline" in x or x.split("|")[1].strip().isdigit()]
    assert [x.split("|")[2].strip() for x in ranked] == [
        "[@ann](https://github.com/ann)", "[@bob](https://github.com/bob)",
        "baseline (`reference/muse_bf16_proj.py:baseline`)", "[@cat](https://github.com/cat)"]
    assert ranked[0].startswith("| 1 |") and ranked[1].startswith("| 1 |") and ranked[3].startswith("| 3 |")
    assert "| 1.000x | | 1.000x | 1.000x | 1.000x |" in ranked[2] and "| 100.0 |" in ranked[2]
    assert "[#1](https://github.com/example/comp/pull/1)" in ranked[0] and "2026-10-22 02:00:00" in ranked[0]
    assert "| 1.600x | 1.600x | 1.600x |" in ranked[0]
    assert "unofficial (CPU)" in ranked[3]
    assert "#2]" not in bf16, "only each competitor's best result"
    unranked = bf16[bf16.index("Not ranked:"):]
    assert "under review (below_floor)" in unranked and "[#5]" in unranked
    assert "disqualified 2026-10-22 by @organizer: read the reference" in unranked and "[#7]" in unranked
    assert "accepted before the track opened" in unranked and "[#6]" in unranked
    assert "accepted after the track closed" in unranked and "[#8]" in unranked, "the end is exclusive"
    assert "![muse_bf16_proj: the best score over time](leaderboard/muse_bf16_proj.png)" in bf16
    assert "> **Unofficial results:** 1 result on these boards was timed on a CPU" in text
    serving = text[text.index("## Serving track"):text.index("## Past daily winners")]
    assert "| 1 | [@hal](https://github.com/hal) | 1.100 |" not in serving  # hal is at 1.300
    assert "| 1 | [@hal](https://github.com/hal) | 1.300 |" in serving
    assert "| | baseline (unpatched SGLang) | 1.000 |" in serving
    assert "Kernel track: window 2 of 2, 2026-10-23 00:00 to 2026-10-24 00:00 UTC." in text
    assert "| muse_bf16_proj | [@ann](https://github.com/ann) | 1.600x |" in text
    assert "| muse_moe_w4a16 | [@ivy](https://github.com/ivy) | 1.100x |" in text
    past = text[text.index("## Past daily winners"):]
    assert ("| 1 | 2026-10-23 00:00 | - | [@ann](https://github.com/ann) (24 h) | - | [@ivy](https://github.com/ivy) "
            "(15 h) | - |") in past


def test_empty_boards_show_the_baseline_and_say_so():
    text = render.render_board(derive([], at(-30)))
    assert text.count("No ranked results yet.") == len(PROBLEMS) and "No results yet." in text
    assert "| | baseline (`reference/muse_moe_w4a16.py:baseline`) | - | 1.000x |" in text
    assert "No window is open. The kernel track opens 2026-10-22 00:00 UTC; its first window closes 2026-10-23 00:00 UTC." in text
    assert "No daily window has closed yet." in text
    assert "Unofficial" not in text and "![" not in text


def test_the_repository_leaderboard_is_what_its_ledger_gives(capsys):
    assert main(["board", "--check"]) == 0, capsys.readouterr().err


# ---- order independence and idempotence ----

results_strategy = st.lists(
    st.tuples(st.sampled_from(["ann", "bob", "cat", "dan"]), st.sampled_from([0.9, 1.2, 1.5, 1.5, 1.8, 2.4]),
              st.integers(-3 * 60, 80 * 60), st.sampled_from(["passed", "passed", "passed", "needs_review"]),
              st.sampled_from([0.0, 0.001, 0.02]), st.sampled_from(["muse_bf16_proj", "muse_moe_w4a16", "serving"])),
    min_size=1, max_size=12)


def bodies_from(spec: list[tuple], marks: list[int]) -> list[dict]:
    bodies = []
    for i, (login, speedup, minute, status, rel, problem) in enumerate(spec):
        track = "serving" if problem == "serving" else "kernel"
        bodies.append(result(i + 1, login, speedup, at(minute / 60), rel=rel, status=status,
                             problem="muse_bf16_proj" if track == "serving" else problem, track=track))
    for k, m in enumerate(marks):
        target = bodies[m % len(spec)]
        kind = "clearance" if target["status"] == "needs_review" and k % 2 else "disqualification"
        if not any(b["kind"] != "result" and b["target"]["pr"] == target["pr"] for b in bodies):
            bodies.append(disqualify(bodies, target["pr"], comp.format_instant(
                comp.parse_instant(target["accepted_at"]) + dt.timedelta(hours=k + 1)), kind))
    return bodies


@SETTINGS
@given(results_strategy, st.lists(st.integers(0, 20), max_size=3), st.randoms(use_true_random=False),
       st.sampled_from([at(13), at(30), at(80)]))
def test_same_ledger_same_bytes_whatever_the_arrival_order(spec, marks, rnd, now):
    bodies = bodies_from(spec, marks)
    results, markings = [b for b in bodies if b["kind"] == "result"], [b for b in bodies if b["kind"] != "result"]
    shuffled = results[:]
    rnd.shuffle(shuffled)
    # a marking still arrives after the result it marks
    a, b = chain(results + markings), chain(shuffled + markings)
    da, db = derive(a, now), derive(b, now)
    assert without_chains(everything(da)) == without_chains(everything(db))
    for d, records in ((da, a), (db, b)):
        assert d.chain == standings.ChainHead(len(records), records[-1]["sha256"])
        assert f"Ledger chain head: `{records[-1]['sha256']}` (record seq {len(records) - 1}," in render.render_board(d)


def test_cli_outputs_are_byte_identical_across_arrival_orders_and_reruns(tmp_path, capsys):
    rng = random.Random(4)
    bodies = [b for b in mixed_ledger() if b["kind"] == "result"]
    roots = []
    for n, order in enumerate([bodies, rng.sample(bodies, len(bodies))]):
        root = tmp_path / f"r{n}"
        root.mkdir()
        write_competition(root)
        for b in order:
            put(root, b)
        put(root, lambda records: disqualify(records, 7, at(20)))
        roots.append(root)
    assert (roots[0] / "results/ledger/2026-10.jsonl").read_bytes() != (roots[1] / "results/ledger/2026-10.jsonl").read_bytes()
    outputs = []
    for root in roots:
        args = ["--root", str(root), "--now", at(30)]
        assert main(["board", *args]) == 0
        assert main(["snapshots", *args]) == 0
        capsys.readouterr()
        assert main(["prizes", *args]) == 0
        prizes = capsys.readouterr().out
        files = {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
                 if p.is_file() and "ledger" not in p.parts and "evidence" not in p.parts}
        head = lg.verify(root, allow_unofficial=True)[-1]["sha256"]
        assert f"Ledger chain head: `{head}` (record seq 10, 11 records)".encode() in files["leaderboard.md"]
        assert json.loads(files["results/snapshots/2026-10-23/06.json"])["chain"] == {"records": 11, "sha256": head}
        # and running again changes nothing
        assert main(["board", *args]) == 0 and main(["snapshots", *args]) == 0
        out = capsys.readouterr().out
        assert "board from 10 results: nothing changed" in out and "wrote 0 missing, refreshed 0" in out
        assert files == {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
                         if p.is_file() and "ledger" not in p.parts and "evidence" not in p.parts}
        outputs.append((files, prizes))
    differ = sorted(f for f in outputs[0][0] if outputs[0][0][f] != outputs[1][0][f])
    assert differ and all(f == "leaderboard.md" or f.startswith("results/snapshots/") for f in differ)
    for files in (outputs[0][0], outputs[1][0]):
        for f in differ:
            if not f.endswith(".png"):
                files[f] = unchained(files[f].decode()).encode()
    assert outputs[0] == outputs[1]
    files = outputs[0][0]
    assert "leaderboard/muse_bf16_proj.png" in files and "leaderboard/serving.png" in files
    assert "leaderboard/muse_decode_layer.png" not in files, "no plot for an empty board"
    assert len([f for f in files if f.startswith("results/snapshots/") and f.endswith(".json")]) == 30
    snap = json.loads(files["results/snapshots/2026-10-22/04.json"])
    assert snap["at"] == "2026-10-22T04:00:00Z" and snap["results"] == 5
    bf16 = snap["boards"]["kernel/muse_bf16_proj"]
    assert bf16["holder"] == {"login": "ann", "pr": 1} and [t["login"] for t in bf16["top"]] == ["ann", "bob", "cat"]
    assert (bf16["out_of_window"], bf16["disqualified"], bf16["under_review"]) == (1, 0, 0)
    assert snap["daily"] == {"kernel": {"closes_at": "2026-10-23T00:00:00Z", "window": 1}, "serving": None}
    assert b"| 1 | @ann | 1.600x | #1 |" in files["results/snapshots/2026-10-22/04.md"]
    assert "@ann (#1)" in outputs[0][1]


def test_board_check_and_stale_plots(tmp_path, capsys, monkeypatch):
    write_competition(tmp_path)
    put(tmp_path, result(1, "ann", 1.5, at(2)))
    args = ["--root", str(tmp_path), "--now", at(30)]
    assert main(["board", "--check", *args]) == 1
    assert main(["board", *args]) == 0 and main(["board", "--check", *args]) == 0
    png = tmp_path / "leaderboard/muse_bf16_proj.png"
    assert png.read_bytes().startswith(b"\x89PNG") and plots.png_description(png.read_bytes()).startswith("series sha256 ")

    def no_rendering(*_):
        raise AssertionError("a plot whose series did not change is not drawn again")

    monkeypatch.setattr(plots, "render_plot", no_rendering)
    assert main(["board", *args, "--now", at(40)]) == 0, "a later now changes no plot"
    monkeypatch.undo()
    png.unlink()
    capsys.readouterr()
    assert main(["board", "--check", *args]) == 1
    assert "leaderboard/muse_bf16_proj.png: not what the ledger gives" in capsys.readouterr().err
    assert main(["board", *args]) == 0 and png.is_file()
    put(tmp_path, lambda records: disqualify(records, 1, at(3)))
    assert main(["board", "--check", *args]) == 1
    assert main(["board", *args]) == 0
    assert "removed leaderboard/muse_bf16_proj.png" in capsys.readouterr().out
    assert not (tmp_path / "leaderboard/muse_bf16_proj.png").exists()


# ---- snapshots: backfilled == hour by hour ----

arrivals = st.lists(st.tuples(st.sampled_from(["ann", "bob", "cat"]), st.sampled_from([1.1, 1.3, 1.6, 2.0]),
                              st.integers(0, 47 * 60), st.sampled_from([0, 0, 0, 30, 200])),  # minutes late
                    min_size=1, max_size=10)


def _hour_by_hour(spec: list[tuple], c: comp.Competition) -> tuple[dict[str, str], int]:
    """Run `snapshots` every hour on the records that had arrived by then; (files, rewrites)."""
    bodies = [result(i + 1, login, s, at(minute / 60)) for i, (login, s, minute, _) in enumerate(spec)]
    arrive = [comp.parse_instant(b["accepted_at"]) + dt.timedelta(minutes=late) for b, (*_, late) in zip(bodies, spec, strict=True)]
    order = sorted(range(len(bodies)), key=lambda i: (arrive[i], i))
    files: dict[str, str] = {}
    rewrites = 0
    for hour in c.snapshot_instants(START + dt.timedelta(days=3)):
        arrived = chain([bodies[i] for i in order if arrive[i] <= hour])
        for rel, text, _ in sn.snapshots(derive(arrived, comp.format_instant(hour), c)):
            if rel in files and files[rel] != text:
                rewrites += 1
            files[rel] = text
    return files, rewrites


@SETTINGS
@given(arrivals)
def test_backfilled_snapshots_equal_snapshots_written_hour_by_hour(spec):
    c = competition(days=2)
    hourly, rewrites = _hour_by_hour(spec, c)
    bodies = [result(i + 1, login, s, at(minute / 60)) for i, (login, s, minute, _) in enumerate(spec)]
    arrive = [comp.parse_instant(b["accepted_at"]) + dt.timedelta(minutes=late) for b, (*_, late) in zip(bodies, spec, strict=True)]
    ledger = chain([bodies[i] for i in sorted(range(len(bodies)), key=lambda i: (arrive[i], i))])
    backfill = {rel: text for rel, text, _ in sn.snapshots(derive(ledger, at(72), c))}
    assert hourly == backfill, "the same ledger (in its own arrival order), the same snapshots, chain heads included"
    if all(late == 0 for *_, late in spec):
        assert rewrites == 0, "records that arrive on time never change a snapshot already written"


def test_snapshots_command_backfills_and_refreshes_after_a_late_record(tmp_path, capsys):
    write_competition(tmp_path)
    put(tmp_path, result(1, "ann", 1.5, at(1.5)))
    args = ["--root", str(tmp_path)]
    assert main(["snapshots", *args, "--now", at(5, 1800)]) == 0
    assert "5 snapshot hours up to 2026-10-22T05:30:00Z: wrote 5 missing, refreshed 0" in capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "results/snapshots/2026-10-22").iterdir()) == [
        f"{h:02d}.{x}" for h in range(1, 6) for x in ("json", "md")]
    # merged at 02:30, recorded at 06:10 by a delayed workflow: the 03:00-05:00 snapshots now read differently
    put(tmp_path, result(2, "bob", 2.0, at(2.5)))
    assert main(["snapshots", *args, "--now", at(6, 600)]) == 0
    assert "wrote 1 missing, refreshed 3" in capsys.readouterr().out
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    write_competition(fresh)
    shutil.copytree(tmp_path / "results/ledger", fresh / "results/ledger")
    assert main(["snapshots", "--root", str(fresh), "--now", at(6, 600)]) == 0
    for p in (fresh / "results/snapshots").rglob("*.*"):
        assert p.read_bytes() == (tmp_path / p.relative_to(fresh)).read_bytes()


# ---- daily prizes ----

def _prize(d: standings.Derived, window: int, board: str = "kernel/muse_bf16_proj") -> pz.DailyResult:
    return next(r for r in pz.daily_results(d) if r.window.index == window and r.board == board and r.window.track == "kernel")


def test_a_result_accepted_exactly_at_the_close_counts_for_that_window():
    base = [result(1, "ann", 1.5, at(2))]
    d = derive(chain(base + [result(2, "bob", 2.0, at(24))]), at(48))
    first = _prize(d, 1)
    assert first.closed and first.winner.login == "bob" and dict(first.hours) == {"ann": 22, "bob": 1}
    d = derive(chain(base + [result(2, "bob", 2.0, at(24, seconds=1))]), at(48))
    assert _prize(d, 1).winner.login == "ann" and dict(_prize(d, 1).hours) == {"ann": 23}
    assert _prize(d, 2).winner.login == "bob" and dict(_prize(d, 2).hours) == {"bob": 24}


def test_two_competitors_tied_at_the_close_the_earlier_wins():
    recs = chain([result(1, "ann", 1.500, at(20), rel=0.01), result(2, "bob", 1.510, at(23), rel=0.01)])
    d = derive(recs, at(48))
    assert _prize(d, 1).winner.login == "ann"
    rows = [r for r in pz.prizes_rows(d) if r["board"] == "kernel/muse_bf16_proj" and r["window"] == 1]
    assert rows[0]["winner"] == "ann" and rows[0]["usd"] == 10 and rows[0]["winner_hours"] == 5
    # without overlap the faster one wins
    d = derive(chain([result(1, "ann", 1.500, at(20), rel=0.0), result(2, "bob", 1.510, at(23), rel=0.0)]), at(48))
    assert _prize(d, 1).winner.login == "bob"


def test_most_hours_on_top_is_selectable():
    recs = chain([result(1, "ann", 1.5, at(1)), result(2, "bob", 2.0, at(20))])
    close = derive(recs, at(48), competition(rule="top_at_close"))
    hours = derive(recs, at(48), competition(rule="most_hours_on_top"))
    assert _prize(close, 1).winner.login == "bob" and _prize(hours, 1).winner.login == "ann"
    assert dict(_prize(hours, 1).hours) == {"ann": 19, "bob": 5}
    # equal hours: whoever held the board first in the window
    tied = chain([result(1, "ann", 1.5, at(0.5)), result(2, "bob", 2.0, at(12.5))])
    d = derive(tied, at(48), competition(rule="most_hours_on_top"))
    assert dict(_prize(d, 1).hours) == {"ann": 12, "bob": 12} and _prize(d, 1).winner.login == "ann"
    assert "rule most_hours_on_top" in pz.render_prizes(d)


def test_a_disqualified_holder_loses_every_window_retroactively_and_an_empty_board_pays_nobody():
    bodies = [result(1, "ann", 1.5, at(1)), result(2, "bob", 1.2, at(2))]
    before = derive(chain(bodies), at(48))
    assert [_prize(before, w).winner.login for w in (1, 2)] == ["ann", "ann"]
    after = derive(chain(bodies + [disqualify(bodies, 1, at(40))]), at(48))
    assert [_prize(after, w).winner.login for w in (1, 2)] == ["bob", "bob"]
    assert set(holders(after)[1:]) == {"bob"}
    empty = _prize(after, 1, "kernel/muse_decode_layer")
    assert empty.winner is None and empty.hours == []
    assert sum(r["usd"] for r in pz.prizes_rows(after)) == 20


def test_the_open_window_is_provisional():
    d = derive(chain([result(1, "ann", 1.5, at(1))]), at(30))
    open_ = _prize(d, 2)
    assert not open_.closed and open_.winner.login == "ann" and dict(open_.hours) == {"ann": 6}
    row = next(r for r in pz.prizes_rows(d) if r["window"] == 2 and r["board"] == "kernel/muse_bf16_proj")
    assert row["usd"] == 0
    assert "2 (open)" in pz.render_prizes(d)


def test_prizes_command(tmp_path, capsys):
    write_competition(tmp_path)
    put(tmp_path, result(1, "ann", 1.5, at(1)))
    assert main(["prizes", "--root", str(tmp_path), "--now", at(30), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    row = next(r for r in data["windows"] if r["board"] == "kernel/muse_bf16_proj" and r["window"] == 1)
    assert row["winner"] == "ann" and row["winner_hours"] == 24 and row["usd"] == 10 and row["closed"]
    assert main(["prizes", "--root", str(tmp_path), "--now", at(-1)]) == 0
    assert "No daily window has started yet." in capsys.readouterr().out


def test_a_problem_only_the_ledger_knows_still_gets_a_board():
    body = result(1, "ann", 1.5, at(1))
    body["problem"] = "muse_retired"
    d = derive(chain([body]), at(30))
    assert "kernel/muse_retired" in d.entries and d.entries["kernel/muse_retired"][0].login == "ann"
    assert "### `muse_retired`: muse_retired (not in problems/)" in render.render_board(d)


def test_would_be_rank_places_a_new_result_on_the_current_board(tmp_path):
    c = competition()
    for i, (who, speed) in enumerate([("alice", 1.5), ("bob", 1.2)]):
        doc = result_doc(login=who, pr=i + 1, speedup=speed, rel=0.001)
        lg.append(tmp_path, lg.result_record(doc, raw(doc), pr=i + 1, login=who, head_sha=sha(f"head-{i + 1}"),
                                             accepted_at="2026-10-22T10:00:00Z"), evidence=raw(doc))
    records = lg.read(tmp_path)
    at = "2026-10-22T12:00:00Z"
    assert standings.would_be_rank(records, c, PROBLEMS, result_doc(login="carol", pr=9, speedup=1.3, rel=0.001), at) == "2 of 3"
    assert standings.would_be_rank(records, c, PROBLEMS, result_doc(login="carol", pr=9, speedup=2.0, rel=0.001), at) == "1 of 3"
    # inside alice's interval: a tie shares her rank, listed after her (accepted later)
    assert standings.would_be_rank(records, c, PROBLEMS, result_doc(login="carol", pr=9, speedup=1.5005, rel=0.001), at) == "1 of 3"
    assert "below your own best" in standings.would_be_rank(records, c, PROBLEMS,
                                                     result_doc(login="alice", pr=9, speedup=1.1, rel=0.001), at)
    failed = {**result_doc(login="carol", pr=9), "status": "incorrect", "score": None}
    assert standings.would_be_rank(records, c, PROBLEMS, failed, at) is None


# ---- prizes as of an instant, and the final placings ----

def _final_competition() -> comp.Competition:
    c = competition()  # a two-day kernel track (closes at(48)), then a one-day serving track
    return comp.parse({
        "name": c.name, "repository": c.repository,
        "tracks": {n: {"start": t.start, "end": t.end} for n, t in c.tracks.items()},
        "prizes": [{"place": 1, "usd": 500, "also": "a signed H200"}, {"place": 2, "usd": 300},
                   {"place": 3, "through": 4, "usd": 100}],
        "daily_prize": {"usd": 10},
    })


def _final_ledger() -> list[dict]:
    bodies = [
        result(1, "ann", 1.50, at(2), rel=0.01),   # ann and bob overlap: both rank 1, ann accepted first
        result(2, "bob", 1.51, at(5), rel=0.01),
        result(3, "cat", 1.30, at(3), rel=0.0),
        result(4, "dan", 1.20, at(4), rel=0.0),
        result(5, "eve", 1.10, at(6), rel=0.0),    # fifth: no prize for place 5
        result(6, "fay", 2.00, at(7), status="needs_review"),
        result(7, "gus", 3.00, at(8)),
        result(8, "hal", 2.50, at(48)),            # accepted at the close: out of the track's window
        result(9, "ivy", 1.40, at(9), problem="muse_moe_w4a16"),
    ]
    return bodies + [disqualify(bodies, 7, at(10))]


def _placings(d: standings.Derived, board: str = "kernel/muse_bf16_proj") -> list[tuple]:
    f = next(f for f in pz.final_placings(d) if f.board == board)
    return [(p.place, p.rank, p.entry.login, p.prize.usd) for p in f.placings]


def test_final_placings_are_awarded_per_board_once_the_track_closes():
    records, c = chain(_final_ledger()), _final_competition()
    before = standings.derive(records, c, PROBLEMS, comp.parse_instant(at(47, 3599)))
    assert all(not f.placings for f in pz.final_placings(before)), "nothing is awarded before the close"
    assert "Kernel track: closes 2026-10-24 00:00 UTC; its final placings are awarded then." in pz.render_prizes(before)
    d = standings.derive(records, c, PROBLEMS, comp.parse_instant(at(48)))
    # the tie shares rank 1 and the earlier accepted takes place 1; under review, disqualified, out of
    # window and the baseline place nowhere; place 5 has no prize
    assert _placings(d) == [(1, 1, "ann", 500), (2, 1, "bob", 300), (3, 3, "cat", 100), (4, 4, "dan", 100)]
    assert _placings(d, "kernel/muse_moe_w4a16") == [(1, 1, "ivy", 500)]
    assert _placings(d, "kernel/muse_decode_layer") == []
    serving = next(f for f in pz.final_placings(d) if f.board == "serving")
    assert not serving.closed and serving.placings == []
    text = pz.render_prizes(d)
    assert "Kernel track, closed 2026-10-24 00:00 UTC:" in text and "Serving track: closes 2026-10-25 00:00 UTC" in text
    line = next(x for x in text.splitlines() if x.startswith("kernel/muse_bf16_proj") and "@ann" in x)
    assert line.split()[1:3] == ["1", "1"] and "$500" in line and "a signed H200" in line
    assert "final placings $1,500)" in text  # 500 + 300 + 100 + 100 on bf16_proj, 500 on moe
    rows = pz.final_rows(d)
    bob = next(r for r in rows if r["board"] == "kernel/muse_bf16_proj")["placings"][1]
    assert bob.pop("score") == pytest.approx(1.51)
    assert bob == {"place": 2, "rank": 1, "login": "bob", "pr": 2, "usd": 300, "also": None}


def _prizes_cli(root: Path, *args: str) -> bytes:
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "pipeline", "prizes", "--root", str(root), *args], cwd=ROOT,
                          check=True, capture_output=True).stdout


def test_prizes_at_an_instant_are_the_same_bytes_whenever_they_run_and_whatever_came_later(tmp_path):
    import time

    root = tmp_path / "ledger"
    root.mkdir()
    write_competition(root)
    bodies = [result(1, "ann", 1.5, at(1)), result(2, "bob", 1.2, at(2))]
    for b in bodies:
        put(root, b)
    first = _prizes_cli(root, "--at", at(30))
    time.sleep(1.1)  # the wall clock has moved on: nothing printed may follow it
    assert _prizes_cli(root, "--at", at(30)) == first
    assert b"every decision as of 2026-10-23T06:00:00Z, from the ledger's 2 results accepted by then." in first
    assert "@ann (#1)" in first.decode() and "$10" in first.decode()
    # records after the instant: a faster result, and a disqualification of the winner, change nothing then
    put(root, result(3, "cat", 9.0, at(30, 1)))
    put(root, lambda records: disqualify(records, 1, at(31)))
    assert _prizes_cli(root, "--at", at(30)) == first
    assert json.loads(_prizes_cli(root, "--at", at(30), "--json"))["at"] == at(30)
    # later, both count: the disqualification reaches back into every window
    later = _prizes_cli(root, "--at", at(48)).decode()
    assert "@ann" not in later.split("Final placings")[0] and "@bob (#2)" in later and "@cat (#3)" in later
    final = next(x.split() for x in later.splitlines() if x.startswith("kernel/muse_bf16_proj") and "@cat" in x)
    assert final[1:5] == ["1", "1", "@cat", "(#3)"] and "$100" in final, "the kernel track closed at(48): cat is first"


def test_prizes_refuse_a_bad_instant_and_both_instants(tmp_path, capsys):
    write_competition(tmp_path)
    assert main(["prizes", "--root", str(tmp_path), "--at", "2026-10-23 06:00"]) == 2
    assert "--at '2026-10-23 06:00' has no time zone" in capsys.readouterr().err
    assert main(["prizes", "--root", str(tmp_path), "--at", at(30), "--now", at(30)]) == 2
    assert "not both" in capsys.readouterr().err


def test_the_baseline_row_shows_the_median_of_the_baseline_times_the_ranked_results_measured():
    bodies = []
    for pr, (who, base, status) in enumerate([("ann", 80.0, "passed"), ("bob", 120.0, "passed"),
                                              ("cat", 400.0, "passed"), ("dan", 1000.0, "needs_review")], 1):
        b = result(pr, who, 1.2 + pr / 10, at(pr), status=status)
        for w in b["workloads"]:
            w["baseline_median_us"] = base
        bodies.append(b)
    text = render.render_board(derive(chain(bodies), at(30)))
    row = next(x for x in text.splitlines() if x.startswith("| | baseline (`reference/muse_bf16_proj.py:baseline`)"))
    assert row.split("|")[3].strip() == "120.0", "the median of 80, 120 and 400 us; dan's run is not ranked"
    assert "The baseline's time is the median of the baseline times measured in the ranked results' own runs." in text


def test_a_board_verb_run_as_a_process_ends_with_its_own_exit_code_and_every_output_written(tmp_path):
    """Run as `python -m pipeline`, the board verbs end their process without freeing what they read
    (cli.exit_without_teardown): what they printed and wrote is all there, and the exit code is theirs;
    called in-process (every other test here), they return."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # stdout buffered, as in a workflow

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "pipeline", *args, "--root", str(tmp_path), "--now", at(30)],
                              cwd=ROOT, capture_output=True, env=env)

    write_competition(tmp_path)
    put(tmp_path, result(1, "ann", 1.5, at(1)))
    done = run("board", "--no-plots")
    assert (done.returncode, done.stdout) == (0, b"board from 1 results: leaderboard.md\n")
    assert main(["board", "--no-plots", "--check", "--root", str(tmp_path), "--now", at(30)]) == 0
    written = (tmp_path / "leaderboard.md").read_bytes()
    (tmp_path / "leaderboard.md").write_bytes(written + b"\n")
    stale = run("board", "--no-plots", "--check")
    assert stale.returncode == 1 and stale.stderr.startswith(b"refused: leaderboard.md: not what the ledger gives")
    snaps = run("snapshots")
    assert snaps.returncode == 0 and b"wrote 30 missing" in snaps.stdout
    assert len(list((tmp_path / "results" / "snapshots").glob("*/*.json"))) == 30
    assert run("prizes", "--json").returncode == 0 and run("prizes", "--at", "2026-13-01").returncode == 2
