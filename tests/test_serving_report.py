"""The serving result in the PR comment and the terminal: the per-concurrency table, the gate's parts
and S, the unscored figures, the throughput-per-GPU against interactivity plot; untrusted text inert,
numbers checked, the size limit kept; and post-result posting it."""

from __future__ import annotations

import copy
import io
import json
import math
import re
from pathlib import Path

import pytest

from fixtures.serving_results import factory as sf
from pipeline import report, result
from test_github_flow import HEAD, R, fake, key_file, open_pr, post, write_result  # noqa: F401 - fixtures
from test_report import HOSTILE, outside_code

FIX = Path(__file__).resolve().parent / "fixtures" / "serving_results"


def load(name: str) -> dict:
    return json.loads((FIX / name).read_text())


def rows_of(md: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")] for line in md.splitlines() if line.startswith("| ")]


def test_the_comment_shows_the_per_concurrency_table_the_gate_and_s():
    doc = load("passed.json")
    md = report.comment_markdown(doc, rank="2 of 5", log_url="https://github.com/o/r/actions/runs/3")
    assert md.startswith(report.MARKER) and "### serving: PASSED" in md
    table = rows_of(md)
    assert table[0] == report.SERVING_HEADERS
    assert table[1] == ["1", "18.5", "22.4", "1.210x", "142.0", "153.4", "1.080x", "240", "0", "valid"]
    assert [r[0] for r in table[1:5]] == ["1", "4", "16", "32"]
    assert "**Score S = 1.143 (G = 1; 95% interval 1.137 - 1.143; eps 1.00%" in md
    assert "Would-be rank on the current board: 2 of 5" in md
    assert "- canary agreement 99.10% over 41 turns (the baseline's self-agreement 99.50%; needs 97.50%): ok" in md
    assert "- GSM8K 5-shot 62.00% of 1319 questions (the baseline 62.50%; needs 60.80%): ok" in md
    assert "- invalid levels: none" in md and "**Correctness gate: G = 1**" in md
    assert ("- audit of live turns 99.80% agreement over 48 turns re-sent to the baseline (its self-agreement 99.90% "
            "over 48; needs 94.90%), length x1.000 (band 0.9 - 1.1): ok") in md
    unscored = [r for r in table if len(r) == len(report.UNSCORED_HEADERS)]
    assert unscored[0] == report.UNSCORED_HEADERS
    assert unscored[2] == ["1", "candidate", "214.7", "189.0", "440.0", "7.82", "83.00%", "240", "0"]
    assert f"`{report.PLOT_NAME}` in the run's artifacts ([run log](https://github.com/o/r/actions/runs/3))" in md
    assert "sglang 0.5.10.post1 on 8 GPU" in md and "torch" not in md
    # the terminal shows the same rows: one set of row builders
    term = report.terminal(doc)
    for row in report.serving_rows(doc) + report.unscored_rows(doc):
        assert re.search(r"\s+".join(map(re.escape, row)), term), row
    assert "S = 1.143" in term and "verdict: PASSED" in term


def test_an_unofficial_serving_result_says_so_in_the_serving_track_s_words():
    # the kernel track's note ("a wall-clock loop, not the official CUDA-graph method") printed under the H200's
    # serving smoke run of 2026-12-02; a serving result is unofficial for the plan it ran, not for a timing method
    doc = load("passed.json")
    assert report.timing_note(doc) is None  # the fixture is the official node's result
    doc["official"] = False
    doc["mode"]["device"] = "cuda"
    note = report.timing_note(doc)
    assert "UNOFFICIAL" in note and "serving node" in note and "CUDA-graph" not in note
    assert note in report.terminal(doc) and note in report.comment_markdown(doc)


def test_a_gated_comment_says_which_part_failed_and_why():
    md = report.comment_markdown(load("gated.json"))
    assert "### serving: INCORRECT" in md and "**Correctness gate: G = 0**" in md
    assert "S = 0.000 (G = 0; 1.600 before the gate" in md and "not ranked" in md
    assert "never recorded in the ledger nor ranked on the serving board, even if the pull request is merged" in md
    assert "needs 97.50%): FAILED" in md and "- invalid levels: c = 32: FAILED" in md
    assert rows_of(md)[4][-1] == "INVALID" and rows_of(md)[4][-2] == "9"
    assert "c = 32, candidate: run 1: 9 of 410 turns failed" in md
    assert "Would-be rank" not in md


def test_a_comment_gated_by_the_audit_says_so():
    audit = {"candidate": {"agreement": 0.31, "length_ratio": 1.0, "turns": 48, "failed": 0},
             "baseline": {"agreement": 1.0, "length_ratio": 1.0, "turns": 48, "failed": 0}, "required": True}
    doc = sf.serving_result(audit=audit, sign=False)
    md = report.comment_markdown(doc)
    assert "**Correctness gate: G = 0**" in md and "audit: the candidate's live replies agree 31.00%" in md
    assert "- audit of live turns 31.00% agreement over 48 turns" in md and "(band 0.9 - 1.1): FAILED" in md
    assert "- canary agreement 99.10%" in md and "): ok" in md


def test_the_plot_is_embedded_only_from_a_safe_url():
    doc = load("passed.json")
    url = "https://github.com/o/r/releases/download/plots/pr-11.png"
    assert f"![{report.PLOT_ALT}]({url})" in report.comment_markdown(doc, plot_url=url)
    for bad in ("http://evil.example/p.png", "javascript:alert(1)", "https://x/p.png) ![x](https://evil",
                "https://x/a b.png", "data:image/png;base64,AAAA"):
        md = report.comment_markdown(doc, plot_url=bad)
        assert "![" not in md and "evil" not in md and report.PLOT_NAME in md


def hostile_doc() -> dict:
    """A result whose every free string says something hostile: the patch's flag (the competitor's
    text), a level's reason (the server's error), the engine and dataset names."""
    gate = {**sf.PATCH_GATE, "files": [f"python/sglang/srt/{HOSTILE}.py"],
            "flags": [{"file": f"python/sglang/srt/{HOSTILE}.py", "line": 3, "pattern": HOSTILE, "why": HOSTILE,
                       "text": HOSTILE}]}
    runs = [sf.sweep(1.1, overrides={4: {"valid": False, "invalid_reasons": [HOSTILE] * 7}}), sf.sweep(1.1)]
    doc = sf.serving_result(candidate=runs, patch_gate=gate, sign=False)
    doc["serving"]["engine"].update(version=HOSTILE, name="sglang")
    doc["serving"]["dataset"]["name"] = HOSTILE
    doc["environment"]["gpu"] = HOSTILE
    result.validate(doc)
    return doc


def test_untrusted_strings_stay_inert_in_the_comment():
    doc = hostile_doc()
    md = report.comment_markdown(doc)
    text = outside_code(md)
    for bad in ("@octocat", "](https://evil", "![pixel]", "<img", "**bold**", ":tada:", "www.evil", "#1 "):
        assert bad not in text, bad
    assert "&lt;img src=x onerror=alert(1)&gt;" in text
    assert text.count(f"c = 4, candidate: run 1: @\u200boctocat") == report._MAX_REASONS
    assert "c = 4, candidate: and 2 more" in text
    # every table row keeps its columns: a | in a cell is escaped, not a column break
    for row in rows_of(md):
        assert len(row) in (len(report.SERVING_HEADERS), len(report.UNSCORED_HEADERS)), row


@pytest.mark.parametrize("value", [math.nan, math.inf, -1.0, 1e300, "12", True])
def test_a_number_is_written_only_when_it_is_finite_and_in_range(value):
    doc = load("passed.json")  # a document that skipped validation: the renderer checks its numbers itself
    doc["serving"]["levels"][0]["candidate"]["T"] = value
    doc["serving"]["levels"][0]["ratios"]["I"] = value
    doc["serving"]["levels"][0]["candidate"]["unscored"]["ttft_p50_ms"] = value
    doc["serving"]["score"]["S"] = value
    md = report.comment_markdown(doc)
    row = rows_of(md)[1]
    assert row[2] == "invalid" and row[6] == "invalid"
    assert "S = invalid" in md
    for shown in ("nan", "inf", "1e+300", "True", "-1.0"):
        assert shown not in md.lower().replace("info", "")
    assert "invalid" in report.terminal(doc)


def test_the_comment_stays_under_the_limit():
    doc = hostile_doc()
    for lv in doc["serving"]["levels"]:
        lv["candidate"]["valid"] = False
        lv["candidate"]["invalid_reasons"] = ["x" * 2000] * 50
    doc["flags"] += [{"code": "patch_flag", "line": i, "message": "y" * 2000} for i in range(200)]
    md = report.comment_markdown(doc)
    assert len(md) <= report.GITHUB_LIMIT and md.startswith(report.MARKER)
    assert "more reasons are in the result" in md
    assert len(report.comment_markdown(doc, limit=3000)) <= 3000


# ---- the plot ----

def pixels(png: bytes):
    import matplotlib.image as mpimg

    return (mpimg.imread(io.BytesIO(png), format="png")[..., :3] * 255).round().astype(int)


def count_color(img, rgb: tuple[int, int, int], tol: int = 12) -> int:
    return int((abs(img - rgb).max(axis=-1) <= tol).sum())


def test_the_plot_shows_baseline_and_candidate_one_point_per_concurrency_in_order(tmp_path):
    doc = load("passed.json")
    series = report.plot_series(doc)
    assert [p[0] for p in series["candidate"]] == [1, 4, 16, 32] == [p[0] for p in series["baseline"]]
    assert series["candidate"][0][1:] == pytest.approx((142.0 * 1.08, 18.5 * 1.21))  # (I_c, T_c)
    png = report.serving_plot(doc)
    assert png.startswith(b"\x89PNG") and png == report.serving_plot(copy.deepcopy(doc)), "deterministic"
    from pipeline.board.plots import png_description

    assert png_description(png).startswith("series sha256 ")
    img = pixels(png)
    blue, grey = count_color(img, (31, 119, 180)), count_color(img, (115, 115, 115))
    assert blue > 500 and grey > 300, (blue, grey)
    # without the candidate's line the plot loses its blue: the test sees what is drawn
    only_base = copy.deepcopy(doc)
    for lv in only_base["serving"]["levels"]:
        lv["candidate"]["I"] = None
    assert report.plot_series(only_base)["candidate"] == []
    assert count_color(pixels(report.serving_plot(only_base)), (31, 119, 180)) < blue / 5
    path = report.write_serving_plot(doc, tmp_path)
    assert path == tmp_path / report.PLOT_NAME and path.read_bytes() == png


def test_a_changed_figure_changes_the_plot_and_no_levels_no_plot():
    doc = load("passed.json")
    other = copy.deepcopy(doc)
    other["serving"]["levels"][2]["candidate"]["T"] *= 1.5
    assert report.serving_plot(other) != report.serving_plot(doc)
    empty = copy.deepcopy(doc)
    empty["serving"]["levels"] = []
    assert report.serving_plot(empty) is None
    from ledger_factory import result_doc

    assert report.serving_plot(result_doc(official=False)) is None


# ---- post-result (report.yml) with a serving result ----

def test_post_result_posts_a_signed_serving_result_and_refuses_a_malformed_one(fake, tmp_path, key_file, capsys):
    open_pr(fake)
    doc = sf.serving_result(login="bob", pr=7, head_sha=HEAD, t=1.21, i=1.08)
    assert post(write_result(tmp_path, doc)) == 0, capsys.readouterr().err
    body = fake.comments[7][0]["body"]
    assert "### serving: PASSED" in body and "| 1   | 18.5" in body and "Correctness gate: G = 1" in body
    assert "Would-be rank on the current board: 1 of 1" in body
    assert fake.check_runs[0]["conclusion"] == "success"
    fake.log.clear()
    bad = copy.deepcopy(doc)
    bad["serving"]["levels"][1]["candidate"]["T"] = float("nan")
    path = write_result(tmp_path, bad)
    assert post(path) == 1
    err = capsys.readouterr().err
    assert "serving/levels/1/candidate/T: not a finite number" in err
    assert fake.log == []  # refused before GitHub is asked


def test_the_comment_draws_the_plot_as_text_each_point_where_its_figures_put_it():
    doc = load("passed.json")
    drawn = report.text_plot(doc)
    md = report.comment_markdown(doc)
    assert f"```text\n{drawn}\n```" in md and "B: baseline, C: candidate; the number is c" in md
    rows = drawn.splitlines()
    where = {m: (r, line.index(m)) for r, line in enumerate(rows) for m in ("B1", "C1", "B4", "B16", "C16", "B32", "C32")
             if f"{m} " in line + " "}
    assert set(where) == {"B1", "C1", "B4", "B16", "C16", "B32", "C32"}, drawn  # C4 shares B4's row, after it
    # up is throughput, right is interactivity: c = 32 the highest and leftmost, the candidate above its baseline
    assert where["C32"][0] < where["B32"][0] < where["C16"][0] <= where["B16"][0] < where["B4"][0] <= where["B1"][0]
    assert where["B32"][1] < where["B16"][1] < where["B4"][1] < where["B1"][1] < where["C1"][1]
    assert rows[1].strip().startswith(f"{max(lv['candidate']['T'] for lv in doc['serving']['levels']) * 1.08:,.0f}")
    # a figure that moves moves its point; no figure, no plot
    faster = copy.deepcopy(doc)
    faster["serving"]["levels"][0]["candidate"]["T"] = 300.0
    assert report.text_plot(faster) != drawn
    empty = copy.deepcopy(doc)
    empty["serving"]["levels"] = []
    assert report.text_plot(empty) is None and "```text" not in report.comment_markdown(empty)


def test_post_result_links_the_plot_the_sign_job_uploaded(fake, tmp_path, key_file):
    """bench.yml's sign job uploads `serving-plot` beside the signed result; the comment links that
    artifact's page (an expired one, or none, leaves the sentence that names the file)."""
    from pipeline.post import PLOT_ARTIFACT

    open_pr(fake)
    doc = sf.serving_result(login="bob", pr=7, head_sha=HEAD, t=1.21, i=1.08)
    png = report.serving_plot(doc)
    old = fake.add_artifact(9100, PLOT_ARTIFACT, {report.PLOT_NAME: png}, expired=True)
    fake.add_artifact(9100, "result", {"result.json": json.dumps(doc).encode()})
    assert post(write_result(tmp_path, doc)) == 0
    body = fake.comments[7][0]["body"]
    assert f"`{report.PLOT_NAME}` in the run's artifacts" in body and f"/artifacts/{old['id']}" not in body
    plot = fake.add_artifact(9100, PLOT_ARTIFACT, {report.PLOT_NAME: png})
    assert post(write_result(tmp_path, doc)) == 0
    body = fake.comments[7][0]["body"]
    link = f"https://github.com/muse-competition/pipeline/actions/runs/9100/artifacts/{plot['id']}"
    assert f"The plot as a PNG: [`{report.PLOT_NAME}`]({link})" in body and "```text\nT_c (tokens/s/GPU)" in body
    assert f"GET {R}/actions/runs/9100/artifacts?per_page=100" in fake.requests()
    assert link in fake.check_runs[0]["output"]["summary"]


def test_plot_result_writes_the_png_of_a_serving_result_only(tmp_path, capsys):
    from ledger_factory import raw, result_doc
    from pipeline.__main__ import main

    doc = load("passed.json")
    src, out = tmp_path / "result.json", tmp_path / "plot" / report.PLOT_NAME
    src.write_text(json.dumps(doc))
    assert main(["plot-result", str(src), "--out", str(out)]) == 2, "its folder must exist"
    out.parent.mkdir()
    assert main(["plot-result", str(src), "--out", str(out)]) == 0
    assert out.read_bytes() == report.serving_plot(doc)
    unlaunched = copy.deepcopy(doc)  # a patch the gate refused: never launched, no levels
    unlaunched.update(status="rejected", score=None, performance=[], error={
        "message": "the patch gate refused the patch", "shape": None, "where": None, "log_tail": ""})
    unlaunched["serving"].update(levels=[], score=None, gate=None, patch_gate={**doc["serving"]["patch_gate"],
                                                                                "accepted": False})
    result.validate(unlaunched)
    out.unlink()
    src.write_text(json.dumps(unlaunched))
    assert main(["plot-result", str(src), "--out", str(out)]) == 0 and not out.exists()
    assert "no plot" in capsys.readouterr().out
    src.write_bytes(raw(result_doc()))
    assert main(["plot-result", str(src), "--out", str(out)]) == 1 and not out.exists()
    assert "only a serving result has this plot" in capsys.readouterr().err
    src.write_text(json.dumps({**doc, "status": "great"}))
    assert main(["plot-result", str(src), "--out", str(out)]) == 1


def test_show_result_prints_what_the_evaluator_and_the_pr_would_show(tmp_path, capsys):
    """An organizer reads a hand-run (unsigned) serving result: the terminal table, and the PR's comment."""
    from pipeline.__main__ import main

    doc = sf.serving_result(sign=False, login="bob", pr=7)
    src, md = tmp_path / "result.json", tmp_path / "comment.md"
    src.write_text(json.dumps(doc))
    assert main(["show-result", str(src), "--markdown", str(md)]) == 0
    assert capsys.readouterr().out.strip() == report.terminal(doc)
    assert md.read_text() == report.comment_markdown(doc)
    src.write_text(json.dumps({**doc, "track": "kernel"}))
    assert main(["show-result", str(src)]) == 1
    assert "does not match result.schema.json" in capsys.readouterr().err
