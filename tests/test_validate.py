"""PR validation: every hostile PR fixture is refused with the right rule and message, through both front
ends (the diff, and the same PR served by a GitHub-shaped API); valid ones pass."""

from __future__ import annotations

import datetime as dt
import json
import tomllib
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st
from unidiff import PatchSet

from pipeline import validate as v
from pipeline.__main__ import main
from pipeline.problems import list_problems
from github_fake import FakeGitHub, fake_sha

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "prs"
CASES = tomllib.loads((FIXTURES / "cases.toml").read_text())
NOW = "2026-10-25T00:00:00Z"
PROBLEMS = list_problems()
UTC = dt.timezone.utc


def diff_text(name: str) -> str:
    return (FIXTURES / f"{name}.diff").read_bytes().decode("utf-8", "surrogateescape")


def test_every_fixture_has_a_case_and_the_issue_list_is_covered():
    files = {p.stem for p in FIXTURES.glob("*.diff")}
    assert files == set(CASES)
    issue_list = {"others_folder", "login_mismatch", "dotdot_path", "absolute_path", "symlink", "binary",
                  "mode_change", "oversized", "edits_leaderboard", "edits_results", "edits_pipeline", "edits_problems",
                  "edits_reference", "edits_github", "two_problems", "unknown_problem", "empty", "deletes_others"}
    assert issue_list <= files
    assert all(CASES[n]["rules"] for n in issue_list)


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_verb_on_each_diff(name, tmp_path, capsys):
    case = CASES[name]
    out = tmp_path / "verdict.json"
    code = main(["validate", "--diff", str(FIXTURES / f"{name}.diff"), "--author", case["author"],
                 "--json", str(out), "--now", NOW])
    verdict = json.loads(out.read_text())
    printed = capsys.readouterr().out
    rules = {x["rule"] for x in verdict["violations"]}
    assert rules == set(case["rules"]), printed
    assert code == (1 if case["rules"] else 0)
    if case["rules"]:
        assert any(case["message"] in x["message"] for x in verdict["violations"]), printed
        assert printed.startswith("refused:") and "Traceback" not in printed
        for x in verdict["violations"]:  # every violation names its file and rule in the text
            assert f"[{x['rule']}]" in printed and v.printable(x["path"]) in printed
    else:
        assert verdict["ok"] and verdict["submission"]["path"] == case["submission"]
        assert printed.startswith("valid:")


def _pr_from_diff(fake: FakeGitHub, name: str, number: int = 7) -> str:
    """Serve the fixture's PR as GitHub would: its file list, and a head commit holding the new content."""
    author = CASES[name]["author"]
    patch = PatchSet(diff_text(name))
    changes = v.changes_from_diff(diff_text(name))
    files, tree = [], {}
    for change, pf in zip(changes, patch, strict=True):
        entry = {"filename": change.path, "status": change.status}
        if change.previous_path:
            entry["previous_filename"] = change.previous_path
        files.append(entry)
        if change.status == "removed" or v._segments_problem(change.path):
            continue  # git trees cannot hold such a name; GitHub would not list it either
        data = b"".join(line.value.encode("utf-8", "surrogateescape") for h in pf for line in h if line.is_added)
        if change.binary and b"\0" not in data:
            data = b"\x00\x01binary" + data
        mode = change.new_mode or v.REGULAR
        if mode == "160000":
            data = b"0123456789abcdef0123456789abcdef01234567"
        tree[change.path] = (mode, data)
    head = fake.add_commit(tree, sha=fake_sha("head", name))
    fake.add_pull(number, author, head, files)
    return head


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_same_prs_through_the_api(name, httpserver, monkeypatch, tmp_path):
    fake = FakeGitHub(httpserver)
    for k, val in fake.env().items():
        monkeypatch.setenv(k, val)
    _pr_from_diff(fake, name)
    out = tmp_path / "verdict.json"
    code = main(["validate", "--pr", "7", "--json", str(out), "--now", NOW])
    verdict = json.loads(out.read_text())
    assert {x["rule"] for x in verdict["violations"]} == set(CASES[name]["rules"])
    assert code == (1 if CASES[name]["rules"] else 0)
    # only the author's own, allowed files are ever looked up: a hostile name never reaches a tree or blob
    for entry in fake.log:
        assert "/contents/" not in entry.target and ".." not in entry.target
        assert entry.auth == "token test-token"


def test_the_api_path_makes_exactly_these_requests(httpserver):
    fake = FakeGitHub(httpserver)
    head = _pr_from_diff(fake, "valid_kernel_new")
    from pipeline.github import GitHub

    gh = GitHub(fake.repo, token="test-token", base_url=fake.base, throttle=False, backoff=0.001)
    pull = gh.pull(7)
    verdict = v.check(v.changes_from_pull(gh, pull, pull.author), pull.author, problems=PROBLEMS)
    assert verdict.ok
    walk = [head]
    for part in ("submissions", "kernel", "muse_bf16_proj"):
        walk.append(next(e["sha"] for e in fake.trees[walk[-1]] if e["path"] == part))
    walk.append(next(e["sha"] for e in fake.trees[walk[-1]] if e["path"] == "bob"))
    blobs = {e["path"]: e["sha"] for e in fake.trees[walk[-1]]}
    r = f"/repos/{fake.repo}"
    assert fake.requests() == [
        f"GET {r}/pulls/7",
        f"GET {r}/pulls/7/files?per_page=100",
        *(f"GET {r}/git/trees/{sha}" for sha in walk),  # one directory at a time, each read once
        f"GET {r}/git/blobs/{blobs['README.md']}",
        f"GET {r}/git/blobs/{blobs['submission.py']}",
    ]
    assert verdict.submission.blob_sha == blobs["submission.py"]


def test_a_pr_larger_than_the_api_lists_is_refused(httpserver, monkeypatch, tmp_path):
    fake = FakeGitHub(httpserver, page_size=1)
    for k, val in fake.env().items():
        monkeypatch.setenv(k, val)
    _pr_from_diff(fake, "valid_kernel_new")
    fake.pulls[7]["changed_files"] = 3001  # GitHub lists at most 3,000 files of a PR
    assert main(["validate", "--pr", "7", "--json", str(tmp_path / "v.json")]) == 1
    assert {x["rule"] for x in json.loads((tmp_path / "v.json").read_text())["violations"]} == {"too-many-files"}
    assert "page=2" in " ".join(fake.requests())  # the file list was followed through its Link header


def test_an_oversized_submission_is_not_even_downloaded(httpserver):
    fake = FakeGitHub(httpserver)
    path = "submissions/kernel/muse_bf16_proj/bob/submission.py"
    head = fake.add_commit({path: ("100644", b"x = 1\n" * 50_000)})
    fake.add_pull(7, "bob", head, [{"filename": path, "status": "added"}])
    from pipeline.github import GitHub

    gh = GitHub(fake.repo, base_url=fake.base, throttle=False)
    verdict = v.check(v.changes_from_pull(gh, gh.pull(7), "bob"), "bob", problems=PROBLEMS)
    assert [x.rule for x in verdict.violations] == ["too-large"]
    assert "300,000 bytes" in verdict.violations[0].message
    assert not any("/git/blobs/" in r for r in fake.requests())


# ---- the rules, one at a time ----

def _one(path: str, **kw) -> v.Change:
    return v.Change(path, kw.pop("status", "added"), new_mode=kw.pop("new_mode", v.REGULAR), **kw)


@pytest.mark.parametrize("size,ok", [(256 * 1024, True), (256 * 1024 + 1, False)])
def test_the_kernel_file_limit_is_256_kib(size, ok):
    c = _one("submissions/kernel/muse_bf16_proj/bob/submission.py", size=size)
    assert v.check([c], "bob", problems=PROBLEMS).ok is ok


def test_the_rate_limit_names_the_next_free_slot():
    from pipeline.competition import load

    now = dt.datetime(2026, 10, 25, 12, 0, tzinfo=UTC)
    recent = [now - dt.timedelta(minutes=m) for m in range(50, 0, -5)]  # 10 in the last hour
    c = _one("submissions/kernel/muse_bf16_proj/bob/submission.py", size=10)
    verdict = v.check([c], "bob", problems=PROBLEMS, competition=load(), now=now, recent_evaluations=recent)
    assert [x.rule for x in verdict.violations] == ["rate-limit"]
    assert "10 evaluations in the last hour" in verdict.violations[0].message
    assert "12:10 UTC" in verdict.violations[0].message
    assert v.check([c], "bob", problems=PROBLEMS, competition=load(), now=now, recent_evaluations=recent[:9]).ok


def test_a_closed_track_is_evaluated_but_told_it_is_not_ranked():
    from pipeline.competition import load

    c = _one("submissions/kernel/muse_bf16_proj/bob/submission.py", size=10)
    after = dt.datetime(2026, 11, 5, 0, 0, tzinfo=UTC)
    verdict = v.check([c], "bob", problems=PROBLEMS, competition=load(), now=after)
    assert verdict.ok and "closed at 2026-11-05T00:00:00Z" in verdict.notices[0] and "not ranked" in verdict.notices[0]
    during = v.check([c], "bob", problems=PROBLEMS, competition=load(), now=after - dt.timedelta(days=3))
    assert during.ok and not during.notices


def test_a_serving_submission_is_checked_against_its_own_limits():
    ok = _one("submissions/serving/bob/patch.diff", size=1024 * 1024)
    big = _one("submissions/serving/bob/patch.diff", size=1024 * 1024 + 1)
    wrong = _one("submissions/serving/bob/submission.py", size=10)
    assert v.check([ok], "bob", problems=PROBLEMS).submission.track == "serving"
    assert [x.rule for x in v.check([big], "bob", problems=PROBLEMS).violations] == ["too-large"]
    assert "file-name" in {x.rule for x in v.check([wrong], "bob", problems=PROBLEMS).violations}


def test_git_quoting_is_undone_before_the_rules_apply():
    assert v._unquote('"b/sub\\tmission.py"') == "b/sub\tmission.py"
    assert v._unquote('"b/\\303\\274n\\303\\257.py"') == "b/ünï.py"
    assert v._unquote('"b/a\\"b\\\\c"') == 'b/a"b\\c'
    assert v._unquote("b/plain.py") == "b/plain.py"


def test_a_checkout_is_measured_without_following_links(tmp_path):
    tree = tmp_path / "head"
    own = tree / "submissions" / "kernel" / "muse_bf16_proj" / "bob"
    own.mkdir(parents=True)
    (own / "submission.py").write_bytes(b"x = 1\n" * 50_000)  # the diff shows a small hunk of a big file
    (own / "README.md").symlink_to("/etc/passwd")
    diff = (
        "diff --git a/submissions/kernel/muse_bf16_proj/bob/submission.py b/submissions/kernel/muse_bf16_proj/bob/submission.py\n"
        "index 1111111111111111111111111111111111111111..2222222222222222222222222222222222222222 100644\n"
        "--- a/submissions/kernel/muse_bf16_proj/bob/submission.py\n+++ b/submissions/kernel/muse_bf16_proj/bob/submission.py\n"
        "@@ -1 +1 @@\n-x = 0\n+x = 1\n"
        "diff --git a/submissions/kernel/muse_bf16_proj/bob/README.md b/submissions/kernel/muse_bf16_proj/bob/README.md\n"
        "index 1111111111111111111111111111111111111111..2222222222222222222222222222222222222222 100644\n"
        "--- a/submissions/kernel/muse_bf16_proj/bob/README.md\n+++ b/submissions/kernel/muse_bf16_proj/bob/README.md\n"
        "@@ -1 +1 @@\n-a\n+b\n"
    )
    without = v.check(v.changes_from_diff(diff), "bob", problems=PROBLEMS)
    assert without.ok  # a diff alone cannot know the size of a modified file
    verdict = v.check(v.changes_from_diff(diff, tree), "bob", problems=PROBLEMS)
    assert {(x.path.rsplit("/", 1)[-1], x.rule) for x in verdict.violations} == {
        ("submission.py", "too-large"), ("README.md", "symlink")}


def test_a_linked_folder_in_the_checkout_is_a_symlink(tmp_path):
    tree = tmp_path / "head"
    (tree / "submissions" / "kernel" / "muse_bf16_proj").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "submission.py").write_text("x = 1\n")
    (tree / "submissions" / "kernel" / "muse_bf16_proj" / "bob").symlink_to(tmp_path / "elsewhere")
    changes = v.changes_from_diff(diff_text("valid_kernel_new"), tree)
    assert "symlink" in {x.rule for x in v.check(changes, "bob", problems=PROBLEMS).violations}


def test_an_unreadable_diff_is_refused_with_a_message(tmp_path, capsys):
    bad = tmp_path / "bad.diff"
    bad.write_text("@@ -1 +1 @@\n-a\n+b\n")
    assert main(["validate", "--diff", str(bad), "--author", "bob"]) == 1
    out = capsys.readouterr().out
    assert "[unreadable-diff]" in out and "Traceback" not in out
    assert main(["validate", "--diff", str(bad)]) == 2  # --author is needed


def test_the_comment_escapes_what_the_pr_chose():
    hostile = "submissions/kernel/muse_bf16_proj/bob/[click](https:__evil.example)_@maintainers_<img src=x>.py"
    verdict = v.check([_one(hostile, size=1)], "bob", problems=PROBLEMS)
    md = v.verdict_markdown(verdict, "Not queued.")
    row = next(line for line in md.splitlines() if "click" in line)
    assert "](" not in row and "<img" not in row and "@maintainers" not in row
    assert md.startswith("<!-- muse-pipeline:sticky-result -->\n")


def test_the_comment_lists_every_violation_up_to_a_cap():
    changes = [_one(f"pipeline/f{i}.py") for i in range(v.MAX_LISTED + 5)]
    verdict = v.check(changes, "bob", problems=PROBLEMS)
    assert len(verdict.violations) == v.MAX_LISTED + 5
    md = v.verdict_markdown(verdict)
    assert f"REFUSED ({v.MAX_LISTED + 5} problems)" in md and "and 5 more" in md
    assert len(json.dumps(verdict.as_dict()["violations"])) > 0 and len(verdict.as_dict()["violations"]) == v.MAX_LISTED + 5


_TOKENS = list("abB0_-.~ \\\t\n:@[]") + ["..", "submissions", "kernel", "serving", "bob", "BoB", "alice",
                                           "muse_bf16_proj", "submission.py", "README.md", "patch.diff"]
_segment = st.lists(st.sampled_from(_TOKENS), max_size=3).map("".join)


def _allowed(path: str) -> bool:
    parts = path.split("/")
    if len(parts) == 5 and parts[:2] == ["submissions", "kernel"]:
        return parts[2] in PROBLEMS and parts[3].lower() == "bob" and parts[4] in ("submission.py", "README.md")
    if len(parts) == 4 and parts[:2] == ["submissions", "serving"]:
        return parts[2].lower() == "bob" and parts[3] in ("patch.diff", "README.md")
    return False


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.lists(_segment, min_size=1, max_size=6).map("/".join),
                          st.sampled_from(["submissions/kernel/muse_bf16_proj/bob/submission.py",
                                           "submissions/serving/BoB/patch.diff"])), min_size=1, max_size=4),
       st.sampled_from(["added", "modified", "removed"]))
def test_only_the_authors_own_allowed_files_ever_pass(paths, status):
    verdict = v.check([_one(p, status=status, size=10) for p in paths], "bob", problems=PROBLEMS)  # never raises
    if status == "removed" or not all(_allowed(p) for p in paths):
        assert not verdict.ok
    if verdict.ok:
        assert verdict.submission is not None and all(_allowed(p) for p in paths)


def test_a_file_name_cannot_write_a_line_of_its_own_into_the_log(capsys, tmp_path):
    hostile = "submissions/kernel/muse_bf16_proj/bob/x\n::set-output name=blob_sha::0000\r\x1b[2J\u2028.py"
    verdict = v.check([_one(hostile, size=1)], "bob", problems=PROBLEMS)
    text = verdict.text()
    assert len(text.splitlines()) == 2 and "\x1b" not in text and "\u2028" not in text
    assert not any(line.lstrip().startswith("::") for line in text.splitlines())
    assert "x\\n::set-output" in text
