"""The organizers' own solutions on the boards (issue 18): recorded only by `ledger append --organizers`
from solutions/, shown on their kernel board beside the baseline as an unranked row, and never holding a
board, a snapshot's top or a prize, however fast."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ledger_factory import PROBLEMS, chain, competition, raw, resign, result_doc, sha
from pipeline import competition as comp, ledger as lg
from pipeline.__main__ import main
from pipeline.board import prizes as pz, render, snapshots as sn, standings

START = comp.parse_instant("2026-10-22T00:00:00Z")
BOARD = "kernel/muse_bf16_proj"
EVIDENCE: dict[str, bytes] = {}


def at(hours: float) -> str:
    return comp.format_instant(START + comp.HOUR * hours)


def solution_doc(*, pr: int, login: str = "organizer", speedup: float = 1.384, problem: str = "muse_bf16_proj",
                 track: str = "kernel") -> dict:
    """A signed result of the organizers' solution, evaluated from solutions/<problem>/submission.py."""
    doc = result_doc(pr=pr, login=login, speedup=speedup, problem=problem, track=track)
    doc["submission"]["path"] = f"solutions/{problem}/submission.py"
    return resign(doc)


def body(doc: dict, *, pr: int, login: str, when: str, organizers: bool = False) -> dict:
    rec = lg.result_record(doc, raw(doc), pr=pr, login=login, head_sha=sha(f"head-{pr}"), accepted_at=when,
                           allow_unofficial=True, workloads={k: list(v[1]) for k, v in PROBLEMS.items()},
                           organizers=organizers)
    EVIDENCE[rec["result_sha256"]] = raw(doc)
    return rec


def competitor(pr: int, login: str, speedup: float, when: str) -> dict:
    return body(result_doc(pr=pr, login=login, speedup=speedup, rel=0.001), pr=pr, login=login, when=when)


def ours(pr: int, speedup: float, when: str, login: str = "organizer") -> dict:
    return body(solution_doc(pr=pr, login=login, speedup=speedup), pr=pr, login=login, when=when, organizers=True)


def derive(records: list[dict], now: str) -> standings.Derived:
    return standings.derive(records, competition(), PROBLEMS, comp.parse_instant(now))


def board_rows(text: str, problem: str = "muse_bf16_proj") -> list[tuple[str, str, str]]:
    """(rank, competitor, speedup) of each row of one kernel board's table in leaderboard.md."""
    part = text.split(f"### `{problem}`", 1)[1].split("\n### ", 1)[0]
    rows = [line for line in part.splitlines() if line.startswith("| ") and not line.startswith("| rank")]
    return [tuple(c.strip() for c in line.strip("|").split("|")[:4]) for line in rows if "---" not in line]


# ---- the record: only the organizers' command writes it, only from solutions/ ----

def test_only_append_organizers_marks_a_result_and_verify_holds_it(tmp_path, capsys):
    path = tmp_path / "solution.json"
    path.write_bytes(raw(solution_doc(pr=5)))
    argv = ["ledger", "append", str(path), "--pr", "5", "--login", "organizer", "--head-sha", sha("head-5"),
            "--merged-at", "2026-10-22T10:00:00Z", "--root", str(tmp_path)]
    assert main(argv) == 1, "a result of solutions/ is never recorded as a competitor's"
    assert "record it with --organizers" in capsys.readouterr().err
    assert main([*argv, "--organizers"]) == 0
    assert "the organizers' row (not ranked for prizes)" in capsys.readouterr().out
    (rec,) = lg.verify(tmp_path)
    assert rec[lg.ENTRANT_KEY] == lg.ORGANIZERS and rec["login"] == "organizer" and rec["pr"] == 5
    assert lg.record_problem(rec) is None and not lg.schema_problems(rec)
    assert main(["ledger", "verify", "--root", str(tmp_path)]) == 0

    # a competitor's result, from the folder their PR names, carries no mark (and none can be asked for)
    comp_path = tmp_path / "competitor.json"
    comp_path.write_bytes(raw(result_doc(pr=6, login="organizers")))
    base = ["ledger", "append", str(comp_path), "--pr", "6", "--login", "organizers", "--head-sha", sha("head-6"),
            "--merged-at", "2026-10-22T11:00:00Z", "--root", str(tmp_path)]
    assert main([*base, "--organizers"]) == 1, "a competitor's result is never the organizers'"
    assert "not from the organizers' solutions/" in capsys.readouterr().err
    assert main(base) == 0
    assert lg.ENTRANT_KEY not in lg.verify(tmp_path)[1], "a login spelled `organizers` is just a competitor"


def test_a_competitors_folder_named_solutions_is_still_theirs():
    assert lg.organizers_path("solutions/muse_bf16_proj/submission.py")
    assert lg.organizers_path("/home/runner/work/comp/solutions/muse_bf16_proj/submission.py")
    for path in ("submissions/kernel/muse_bf16_proj/solutions/submission.py",
                 "submissions/serving/solutions/patch.diff", "submissions/kernel/solutions/bob/submission.py",
                 "solutions/submission.py"):
        assert not lg.organizers_path(path), path


def test_the_mark_is_refused_where_it_does_not_belong():
    with pytest.raises(lg.LedgerRefusal, match="kernel boards only"):
        doc = result_doc(pr=3, login="organizer", track="serving")
        lg.result_record(doc, raw(doc), pr=3, login="organizer", head_sha=sha("head-3"),
                         accepted_at="2026-10-24T10:00:00Z", allow_unofficial=True, organizers=True)
    rec = lg.seal(ours(1, 1.4, at(1)), 0, lg.GENESIS)
    assert lg.record_problem(rec) is None
    for value in ("organizer", True, None, ""):
        bad = {**rec, lg.ENTRANT_KEY: value}
        assert lg.record_problem(bad) == "bad entrant" and lg.schema_problems(bad), value


def _reseal(root: Path, edit) -> None:
    shard = root / "results" / "ledger" / "2026-10.jsonl"
    records = lg.parse_shards({shard.name: shard.read_bytes()})
    edit(records[0])
    shard.write_text(lg.canonical(lg.seal(records[0], 0, lg.GENESIS)) + "\n")
    lg.verify_shards(lg.read_shards(root))  # the chain alone is fooled


@pytest.mark.parametrize("which", ["competitor gains the mark", "organizers lose it"])
def test_a_resealed_record_that_gained_or_lost_the_mark_fails_verify(tmp_path, which):
    if which == "competitor gains the mark":
        doc = result_doc(pr=1, login="bob")
        lg.append(tmp_path, body(doc, pr=1, login="bob", when=at(1)), evidence=raw(doc))
        _reseal(tmp_path, lambda r: r.update({lg.ENTRANT_KEY: lg.ORGANIZERS}))
    else:
        rec = ours(1, 1.4, at(1))
        lg.append(tmp_path, rec, evidence=EVIDENCE[rec["result_sha256"]])
        _reseal(tmp_path, lambda r: r.pop(lg.ENTRANT_KEY))
    with pytest.raises(lg.LedgerBroken, match="does not belong to its signed result"):
        lg.verify(tmp_path)


# ---- the board: the organizers' row beside the baseline, unranked ----

def test_the_board_shows_baseline_organizers_and_competitors_as_the_original_did():
    bodies = [competitor(1, "ann", 1.612, at(1)), competitor(2, "bob", 1.2, at(2)), competitor(3, "cat", 0.9, at(3)),
              ours(4, 1.384, at(0.5)), ours(5, 1.1, at(4), login="other-organizer"),
              competitor(6, "dan", 1.384, at(5))]  # as fast as the organizers: a competitor stays above
    text = render.render_board(derive(chain(bodies), at(30)))
    assert [r[:2] for r in board_rows(text)] == [
        ("1", "[@ann](https://github.com/ann)"),
        ("2", "[@dan](https://github.com/dan)"),
        ("", render.ORGANIZERS_ROW),
        ("3", "[@bob](https://github.com/bob)"),
        ("", "baseline (`reference/muse_bf16_proj.py:baseline`)"),
        ("4", "[@cat](https://github.com/cat)"),
    ], "the competitors' ranks are what they would be without the organizers' row"
    line = next(x for x in text.splitlines() if render.ORGANIZERS_ROW in x)
    assert "| 1.384x |" in line and "pull/4)" in line, "the organizers' best result, with its PR"
    assert "1.100x" not in text.split("### `muse_bf16_proj`")[1].split("###")[0], "one organizers' row"
    assert "measured in the ranked results' own runs" in text, "the spec's baseline time: the ranked results'"
    assert "| muse_bf16_proj | [@ann](https://github.com/ann) | 1.612x |" in text, "ann holds the board now"
    others = [b for b in text.split("\n### ")[1:] if not b.startswith("`muse_bf16_proj`")]
    assert others and not any(render.ORGANIZERS_ROW in b for b in others), "only its own problem's board"


def test_an_organizers_row_alone_shows_beside_the_baseline():
    text = render.render_board(derive(chain([ours(4, 1.384, at(-30))]), at(30)))
    rows = board_rows(text)
    assert [r[:2] for r in rows] == [("", render.ORGANIZERS_ROW),
                                     ("", "baseline (`reference/muse_bf16_proj.py:baseline`)")]
    assert "No ranked results yet." in text and "| 100.0 | 1.000x |" in text
    assert "measured in the organizers' own runs (no result is ranked yet)" in text
    assert "| muse_bf16_proj | nobody yet |" in text


# ---- holders, snapshots and prizes: the competitors' alone ----

def test_the_fastest_organizers_never_hold_a_board_nor_win_a_window_or_a_place():
    with_ours = chain([competitor(1, "ann", 1.2, at(1)), ours(2, 3.0, at(2)), competitor(3, "bob", 1.5, at(3)),
                       ours(4, 2.5, at(30))])
    without = chain([r for r in with_ours if lg.ENTRANT_KEY not in r])
    now = at(24 * 4)  # both tracks closed: every window and the final placings decided
    d, base = derive(with_ours, now), derive(without, now)
    holders = [s.holder.login if s.holder else None for s in d.timeline[BOARD]]
    assert "organizer" not in holders and holders[3:] == ["bob"] * (len(holders) - 3)
    won = [(r.window.index, r.winner.login) for r in pz.daily_results(d) if r.board == BOARD]
    assert won == [(1, "bob"), (2, "bob")], "the organizers' 3.000x from hour 2 on wins nothing"
    assert pz.prizes_rows(d) == pz.prizes_rows(base)
    assert json.dumps(pz.final_rows(d)) == json.dumps(pz.final_rows(base))
    assert pz.final_rows(d)[[f["board"] for f in pz.final_rows(d)].index(BOARD)]["placings"][0]["login"] == "bob"
    assert d.standing(BOARD).holder.login == "bob" and d.standing(BOARD).organizers.pr == 2
    for (rel, text, md), (rel0, text0, md0) in zip(sn.snapshots(d), sn.snapshots(base), strict=True):
        assert rel == rel0 and json.loads(text)["boards"] == json.loads(text0)["boards"], rel
        assert "organizer" not in md


def test_a_disqualified_organizers_result_leaves_the_row_and_is_listed_as_theirs():
    bodies = [competitor(1, "ann", 1.2, at(1)), ours(2, 1.5, at(2))]
    bodies.append(lg.marking_record(bodies, "disqualification", pr=2, head_sha=None, reason="a wrong tolerance",
                                    by="organizer", at=at(3)))
    text = render.render_board(derive(chain(bodies), at(30)))
    assert render.ORGANIZERS_ROW not in text
    assert "| organizers (@organizer) | " in text and "a wrong tolerance" in text
