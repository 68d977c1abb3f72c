"""The PR comment: every status renders, untrusted text stays inert, and the size limit holds."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest

from pipeline import report, result
from fixtures.kernel_results import make as kernel_results

ROOT = Path(__file__).resolve().parent.parent

def test_the_committed_results_are_valid_and_of_their_status():
    """Each fixture still matches result.schema.json and says what its name says: after a schema change,
    `python tests/fixtures/kernel_results/make.py` writes them again."""
    for status in kernel_results.RUNS:
        doc = kernel_results.load(status)
        result.validate(doc)
        assert doc["status"] == status and doc["schema_version"] == result.SCHEMA_VERSION


HOSTILE = ("@octocat please merge [click](https://evil.example/x) ![pixel](https://evil.example/p.png) "
           "<img src=x onerror=alert(1)> **bold** | table | #1 ```` :tada: www.evil.example")


@pytest.fixture(scope="module")
def docs() -> dict[str, dict]:
    """A result of each status, as the real evaluator wrote it (tests/fixtures/kernel_results/make.py)."""
    out = {status: kernel_results.load(status) for status in kernel_results.RUNS}
    review = copy.deepcopy(out["passed"])
    review["status"] = "needs_review"
    review["flags"].append({"code": "below_floor", "message": "M1: 1.00 us is below 0.95x the floor", "line": None})
    out["needs_review"] = review
    rejected = copy.deepcopy(out["compile_error"])
    rejected.update(status="rejected", correctness=[])
    rejected["error"] = {"message": "submissions/kernel/x/y/evil.bin: binary files are not allowed", "shape": None,
                         "where": None, "traceback": "", "log_tail": ""}
    out["rejected"] = rejected
    for d in out.values():
        result.validate(d)
    return out


def outside_code(md: str) -> str:
    """The markdown with every fenced block removed: what GitHub would interpret."""
    return re.sub(r"(`{3,})[^\n]*\n.*?\n\1", "", md, flags=re.S)


@pytest.mark.parametrize("status", ["passed", "incorrect", "compile_error", "runtime_error", "timeout",
                                    "rejected", "needs_review"])
def test_every_status_renders_with_marker_and_verdict(docs, status):
    md = report.comment_markdown(docs[status])
    assert md.startswith(report.MARKER)
    assert report.VERDICT[status] in md
    assert docs[status]["status"] == status
    assert len(md) <= report.GITHUB_LIMIT
    assert md.count("```") % 2 == 0 or re.search(r"`{4,}", md)


def test_passed_comment_has_the_workload_table_and_score(docs):
    doc = docs["passed"]
    md = report.comment_markdown(doc, rank="3rd of 12", log_url="https://github.com/o/r/actions/runs/1")
    for p in doc["performance"]:
        assert f"{p['median_us']:,.2f}" in md and f"{p['speedup']:.3f}x" in md
    assert "geometric means" in md and "3rd of 12" in md and "[run log](https://github.com/o/r/actions/runs/1)" in md
    # The same numbers as the terminal table: one set of row builders.
    term = report.terminal(doc)
    for row in report.performance_rows(doc):
        assert row[1] in term and row[1] in md


def test_failure_comment_shows_the_first_error_and_the_line(docs):
    md = report.comment_markdown(docs["runtime_error"])
    assert "ValueError: boom from the submission" in md and "line 5" in md
    assert "Traceback (tail)" in md


def test_untrusted_text_cannot_inject_markdown_links_or_mentions(docs):
    doc = copy.deepcopy(docs["runtime_error"])
    doc["error"]["message"] = HOSTILE
    doc["error"]["log_tail"] = HOSTILE + "\n```\n@octocat [x](https://evil.example)\n"
    doc["error"]["where"]["code"] = HOSTILE
    doc["correctness"][0].update(passed=False, reason=HOSTILE)
    doc["flags"].append({"code": "x@evil", "message": HOSTILE, "line": 3})
    doc["submission"]["login"] = "@octocat"
    md = report.comment_markdown(doc)
    live = outside_code(md)
    assert "@octocat" not in live  # a zero-width space follows every @ outside code
    assert "](https://evil" not in live and "![" not in live
    assert "<img" not in live
    assert "**bold**" not in live
    assert re.search(r"(?<!\\)\|\s*table\s*(?<!\\)\|", live) is None  # no extra table cells
    assert "#1 " not in live  # no issue reference
    # Fences: the hostile ``` inside the log cannot close its block.
    blocks = re.findall(r"(`{3,})text\n(.*?)\n\1", md, flags=re.S)
    assert any("@octocat [x](https://evil.example)" in body for _, body in blocks)


def test_huge_logs_are_cut_to_fit_githubs_limit(docs):
    doc = copy.deepcopy(docs["runtime_error"])
    doc["error"]["log_tail"] = ("x" * 199 + "\n") * 2000
    doc["error"]["traceback"] = ("y" * 199 + "\n") * 2000
    md = report.comment_markdown(doc, log_url="https://github.com/o/r/actions/runs/2")
    assert len(md) <= report.GITHUB_LIMIT
    assert "Truncated to fit" in md and "the run log has everything" in md
    assert "ValueError: boom" in md


def test_many_shapes_are_cut_keeping_the_failures(docs):
    doc = copy.deepcopy(docs["incorrect"])
    row = doc["correctness"][0]
    doc["correctness"] = [dict(row, shape=f"s{i}", passed=i % 500 != 7, reason="r" * 300 if i % 500 == 7 else None)
                          for i in range(3000)]
    md = report.comment_markdown(doc, limit=20_000)
    assert len(md) <= 20_000 and "s7 " in md.replace("|", " ")
