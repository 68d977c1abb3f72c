"""The serving board: signed serving results recorded through the ledger, ranked by S with the kernel
boards' rules (each competitor's best, ties by overlap with the group leader's interval, earlier accepted
first), the baseline row at 1.000, per-figure ratios, and what is not ranked and why."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import pytest

from fixtures.serving_results import factory as sf
from ledger_factory import PROBLEMS, competition, raw, write_competition
from pipeline import competition as comp, ledger as lg
from pipeline.board import render, snapshots as sn, standings
from pipeline.__main__ import main

START = comp.parse_instant("2026-10-24T00:00:00Z")  # the test competition's serving track opens here
REPO = "https://github.com/example/comp/pull"


def at(hours: float) -> str:
    return comp.format_instant(START + dt.timedelta(hours=hours))


def record(doc: dict, hours: float) -> tuple[dict, bytes]:
    sub = doc["submission"]
    body = lg.result_record(doc, raw(doc), pr=sub["pr"], login=sub["login"], head_sha=sub["head_sha"],
                            accepted_at=at(hours))
    return body, raw(doc)


def ledger(root: Path) -> None:
    """Serving results appended through the ledger with their signed documents as evidence."""
    write_competition(root)
    entries = [
        (sf.serving_result(t=1.30, i=1.20, login="ann", pr=21), 5),     # S = sqrt(1.3 * 1.2); the leader
        (sf.serving_result(t=1.20, login="ann", pr=22), 3),             # ann's worse result: not shown
        (sf.serving_result(t=1.24, i=1.25, login="bob", pr=23), 2),     # within ann's interval, earlier: tied, first
        (sf.serving_result(t=1.235, login="cat", pr=24), 4),            # overlaps bob, not ann: the next group
        (sf.serving_result(t=0.90, login="dan", pr=25), 6),             # regressed: below the baseline row
        (sf.serving_result(t=2.50, login="fay", pr=26, needs_review=True, patch_gate={**sf.PATCH_GATE, "flags": [
            {"file": "python/sglang/srt/environ.py", "line": 9, "pattern": "file:srt/environ.py",
             "why": "changes the server's environment", "text": "+X = 1"}]}), 7),  # held for review
        (sf.serving_result(t=3.00, login="gus", pr=27), 8),             # disqualified below
        (sf.serving_result(t=1.50, login="hal", pr=28), -3),            # before the serving track opened
    ]
    for doc, hours in entries:
        body, evidence = record(doc, hours)
        lg.append(root, body, evidence=evidence)
    lg.append(root, lambda records: lg.marking_record(records, "disqualification", pr=27, head_sha=None,
                                                      reason="patched the token count", by="organizer", at=at(9)))


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("serving-ledger")
    ledger(root)
    return root


def serving_section(text: str) -> str:
    return text[text.index("## Serving track"):text.index("## Past daily winners")]


def test_ranks_by_s_with_ties_within_intervals_and_the_best_result_each(root):
    records = lg.verify(root)
    assert len(records) == 9
    d = standings.derive(records, competition(), PROBLEMS, comp.parse_instant(at(20)))
    st = standings.standing(d.entries["serving"])
    assert [(r, e.login, e.pr) for r, e in st.rows] == [(1, "bob", 23), (1, "ann", 21), (3, "cat", 24), (4, "dan", 25)]
    assert st.holder.login == "bob", "a tie goes to the earlier accepted"
    ann = next(e for _, e in st.rows if e.login == "ann")
    # the bootstrap over each block's runs (score.score_interval): the candidate's runs agree, the baseline's
    # second block is 1% off at one run of two, so the interval reaches down by that and not up
    assert ann.speedup == pytest.approx((1.3 * 1.2) ** 0.5) and (ann.lo, ann.hi) == pytest.approx(
        (ann.speedup / 1.005, ann.speedup))
    assert {e.login: e.state for e in st.unranked} == {"fay": "under_review", "gus": "disqualified",
                                                       "hal": "out_of_window"}


def test_the_board_markdown_of_serving_results(root):
    d = standings.derive(lg.verify(root), competition(), PROBLEMS, comp.parse_instant(at(20)))
    text = serving_section(render.render_board(d))
    lines = [x for x in text.splitlines() if x.startswith("| ")]
    assert lines[0] == ("| rank | competitor | score | 95% interval | T c=1 | I c=1 | T c=4 | I c=4 | T c=16 | I c=16 | "
                        "T c=32 | I c=32 | PR | accepted (UTC) | notes |")
    s_ann, s_bob = (1.3 * 1.2) ** 0.5, (1.24 * 1.25) ** 0.5
    assert lines[2] == (f"| 1 | [@bob](https://github.com/bob) | {s_bob:.3f} | {s_bob / 1.005:.3f}-{s_bob:.3f} | "
                        + "1.240 | 1.250 | " * 4 + f"[#23]({REPO}/23) | 2026-10-24 02:00:00 |  |")
    assert lines[3].startswith(f"| 1 | [@ann](https://github.com/ann) | {s_ann:.3f} | ") and "| 1.300 | 1.200 |" in lines[3]
    assert lines[4].startswith("| 3 | [@cat](https://github.com/cat) | 1.235 | 1.229-1.235 | 1.235 |")
    assert lines[5] == "| | baseline (unpatched SGLang) | 1.000 | | " + "1.000 | " * 8 + "| | |"
    # 0.9 is below 1 - eps (eps = 1%): the shortfall counts twice, S = 0.9^2 / 0.99
    assert lines[6].startswith(f"| 4 | [@dan](https://github.com/dan) | {0.81 / 0.99:.3f} |") and "| 0.900 |" in lines[6]
    assert "[#22]" not in text, "only each competitor's best result"
    unranked = text[text.index("Not ranked:"):]
    assert "| competitor | score | PR | accepted (UTC) | why |" in unranked
    assert f"| [@fay](https://github.com/fay) | 2.500 | [#26]({REPO}/26) | 2026-10-24 07:00:00 | under review (patch_flag) |" \
        in unranked
    assert "disqualified 2026-10-24 by @organizer: patched the token count" in unranked
    assert "| [@hal](https://github.com/hal) | 1.500 |" in unranked and "accepted before the track opened" in unranked
    assert "1.500x" not in text and "time (us)" not in text


def test_current_window_and_snapshot_show_the_serving_score_without_an_x(root):
    d = standings.derive(lg.verify(root), competition(), PROBLEMS, comp.parse_instant(at(20)))
    board = render.render_board(d)
    assert "| board | holds it now | score | PR | accepted (UTC) |" in board
    assert f"| serving | [@bob](https://github.com/bob) | {(1.24 * 1.25) ** 0.5:.3f} | [#23]({REPO}/23) |" in board
    snaps = {rel: (j, m) for rel, j, m in sn.snapshots(d)}
    j, m = snaps["2026-10-24/06"]
    assert json.loads(j)["boards"]["serving"]["holder"] == {"login": "bob", "pr": 23}
    section = m[m.index("## serving"):]
    assert "| rank | competitor | score | PR |" in section and "| 1 | @bob | 1.245 | #23 |" in section


def test_a_gated_result_is_refused_by_the_ledger_and_the_board_regenerates_without_it(root, tmp_path, capsys):
    gated = json.loads((Path(__file__).parent / "fixtures" / "serving_results" / "gated.json").read_text())
    assert gated["serving"]["score"]["S_ungated"] == pytest.approx(1.6), "it would lead the board ungated"
    path = tmp_path / "gated.json"
    path.write_bytes(raw(gated))
    args = ["--root", str(root)]
    assert main(["ledger", "append", str(path), "--pr", "12", "--login", "bob", "--head-sha",
                 gated["submission"]["head_sha"], "--merged-at", at(10), *args]) == 1
    assert "status 'incorrect'" in capsys.readouterr().err
    assert main(["board", *args, "--now", at(20)]) == 0
    text = (root / "leaderboard.md").read_text()
    assert "[#12]" not in text and "(G = 0: its canary replies" in text
    assert (root / "leaderboard" / "serving.png").read_bytes().startswith(b"\x89PNG")
    assert main(["board", "--check", *args, "--now", at(20)]) == 0
    assert main(["ledger", "verify", *args]) == 0


def test_would_be_rank_of_a_serving_result(root):
    records = lg.verify(root)
    new = sf.serving_result(t=1.236, login="ivy", pr=30)  # outside ann's interval, above cat: leads group 3
    assert standings.would_be_rank(records, competition(), PROBLEMS, new, at(20)) == "3 of 5"
    top = sf.serving_result(t=1.9, login="ivy", pr=31)
    assert standings.would_be_rank(records, competition(), PROBLEMS, top, at(20)) == "1 of 5"
    gated = json.loads((Path(__file__).parent / "fixtures" / "serving_results" / "gated.json").read_text())
    assert standings.would_be_rank(records, competition(), PROBLEMS, gated, at(20)) is None
