"""PR validation: every hostile PR fixture is refused with the right rule and message, through both front
ends (the diff, and the same PR served by a GitHub-shaped API); valid ones pass."""

from __future__ import annotations

import datetime as dt
import json
import re
import tomllib
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from pipeline import diff, report
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
    """Serve the fixture's PR as GitHub would: its file list, and a head commit holding the new content.
    GitHub lists files, not diff headers: a header that lies (a hand-written fixture) is served as every
    name it carries, each a file of the PR."""
    author = CASES[name]["author"]
    files, tree = [], {}
    for f in v.read_diff(diff_text(name)):
        change = f.change
        entry = {"filename": change.path, "status": "copied" if change.copied_from else change.status}
        if change.previous_path or change.copied_from:
            entry["previous_filename"] = change.previous_path or change.copied_from
        files.append(entry)
        for other in change.header_names:
            files.append({"filename": other, "status": "modified"})
            if not v._segments_problem(other):
                tree[other] = (v.REGULAR, b"")
        if change.status == "removed" or v._segments_problem(change.path):
            continue  # git trees cannot hold such a name; GitHub would not list it either
        data = f.added
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
    rules = set(CASES[name]["rules"]) - {"diff-header"}  # the API lists files; there is no header to lie
    assert {x["rule"] for x in verdict["violations"]} == rules
    assert code == (1 if rules else 0)
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


def test_a_competitor_cannot_put_a_kernel_where_the_organizers_row_comes_from():
    """solutions/ is the organizers' (only a result evaluated from there may carry the organizers' mark):
    a pull request that adds or changes a file there is refused, naming whose folder it is."""
    for status in ("added", "modified"):
        verdict = v.check([_one("solutions/muse_bf16_proj/submission.py", status=status, size=10)], "bob",
                          problems=PROBLEMS)
        assert [x.rule for x in verdict.violations] == ["protected-path"], verdict.violations
        assert "the organizers' own solutions" in verdict.violations[0].message


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
    assert diff.unquote('"b/sub\\tmission.py"') == "b/sub\tmission.py"
    assert diff.unquote('"b/\\303\\274n\\303\\257.py"') == "b/ünï.py"
    assert diff.unquote('"b/a\\"b\\\\c"') == 'b/a"b\\c'
    assert diff.unquote("b/plain.py") == "b/plain.py"


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
    md = report.verdict_markdown(verdict, "Not queued.")
    row = next(line for line in md.splitlines() if "click" in line)
    # a link needs an unescaped `](`; pipeline/escape.py escapes every `[` and `]`
    assert re.search(r"(?<!\\)\]\(", row) is None and "<img" not in row and "@maintainers" not in row
    assert md.startswith("<!-- muse-pipeline:sticky-result -->\n")


def test_the_comment_lists_every_violation_up_to_a_cap():
    changes = [_one(f"pipeline/f{i}.py") for i in range(report.MAX_LISTED_VIOLATIONS + 5)]
    verdict = v.check(changes, "bob", problems=PROBLEMS)
    assert len(verdict.violations) == report.MAX_LISTED_VIOLATIONS + 5
    md = report.verdict_markdown(verdict)
    assert f"REFUSED ({report.MAX_LISTED_VIOLATIONS + 5} problems)" in md and "and 5 more" in md
    assert len(json.dumps(verdict.as_dict()["violations"])) > 0 and len(verdict.as_dict()["violations"]) == report.MAX_LISTED_VIOLATIONS + 5


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


# ---- the diff reader against git itself ----

WEIRD_NAMES = ["plain.py", "with space.py", "trailing space ", "nbsp\u00a0", "zero\u200bwidth", "tab\there",
               'quote"d', "back\\slash", "caf\u00e9/\u00fc.py", "dir b/x.py", "a b/c b/d", "-dash", "new\nline",
               "crlf.txt", "empty"]


def _git(repo: Path, *args: str) -> bytes:
    import subprocess

    return subprocess.run(["git", "-C", str(repo), "-c", "core.quotePath=true", *args], check=True,
                          capture_output=True).stdout


@pytest.mark.parametrize("flags", [(), ("-C", "--find-copies-harder"), ("--binary",), ("--no-renames",)],
                         ids=["default", "copies", "binary", "no-renames"])
def test_the_diff_reader_names_every_file_as_git_does(tmp_path, flags):
    """Adds, edits, renames (with and without edits), copies, mode changes, deletions, binaries, symlinks
    and an empty file, under names git must quote or pad: each path read off the diff is the byte-exact
    name `git diff --name-status -z` gives, with the same kind of change."""
    repo = tmp_path / "r"
    repo.mkdir()
    _git(repo, "init", "-q", "-b", "main")
    _git(repo, "config", "user.email", "t@example.invalid")
    _git(repo, "config", "user.name", "t")
    body = "".join(f"line {i}\n" for i in range(40))
    for i, name in enumerate(WEIRD_NAMES):
        (repo / "old" / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / "old" / name).write_text(body + f"{i}\n")
    (repo / "old" / "bin").write_bytes(bytes(range(256)))
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "base")
    _git(repo, "checkout", "-q", "-b", "pr")
    for i, name in enumerate(WEIRD_NAMES):
        src, dst = repo / "old" / name, repo / "new" / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        kind = i % 5
        if kind == 0:
            src.write_text(src.read_text() + "edited\n")
        elif kind == 1:
            src.rename(dst)
        elif kind == 2:
            src.rename(dst)
            dst.write_text(dst.read_text().replace("line 3\n", "line three\n"))
        elif kind == 3:
            dst.write_text(src.read_text())  # a copy (found with -C)
            src.chmod(0o755)
        else:
            src.unlink()
    (repo / "new" / "added \u00e9").write_text("x\r\ny\r\n")
    (repo / "new" / "empty new").write_text("")
    (repo / "new" / "link").symlink_to("../old/plain.py")
    (repo / "old" / "bin").write_bytes(bytes(range(255, -1, -1)))
    (repo / "new" / "bin2").write_bytes(b"\0" * 10 + bytes(range(256)))
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "pr")
    diff = _git(repo, "diff", "--full-index", *flags, "main...pr").decode("utf-8", "surrogateescape")
    listed = _git(repo, "diff", "--name-status", "-z", *flags, "main...pr").split(b"\0")[:-1]
    expected = []
    i = 0
    while i < len(listed):
        letter = listed[i].decode()[0]
        names = [n.decode("utf-8", "surrogateescape") for n in listed[i + 1:i + (3 if letter in "RC" else 2)]]
        i += 3 if letter in "RC" else 2
        if letter in "RC":
            old, new = names
            expected.append(("renamed", new, old, None) if letter == "R" else ("added", new, None, old))
        else:
            expected.append(({"A": "added", "D": "removed"}.get(letter, "modified"), names[0], None, None))
    got = [(c.status, c.path, c.previous_path, c.copied_from) for c in v.changes_from_diff(diff)]
    assert sorted(got, key=repr) == sorted(expected, key=repr)
    assert not any(c.header_problem for c in v.changes_from_diff(diff))
    if "-C" in flags:
        assert any(c.copied_from for c in v.changes_from_diff(diff))
    new_files = {f.change.path: f for f in v.read_diff(diff) if f.change.status == "added" and not f.change.copied_from}
    if "new/added \u00e9" in new_files:  # a new file's hunks are all of it, CRs and all
        assert new_files["new/added \u00e9"].added == b"x\r\ny\r\n"
        assert new_files["new/added \u00e9"].change.size == 6


def test_a_name_that_is_not_utf8_is_refused_as_git_spells_it():
    diff = ('diff --git "a/submissions/kernel/muse_bf16_proj/bob/submission\\377.py" '
            '"b/submissions/kernel/muse_bf16_proj/bob/submission\\377.py"\n'
            "new file mode 100644\nindex 0000000000000000000000000000000000000000..e69de29bb2d1d6434b8b29ae775ad8c2e48c5391\n")
    verdict = v.check(v.changes_from_diff(diff), "bob", problems=PROBLEMS)
    assert ("unsafe-path", "a path that is not UTF-8") in {(x.rule, x.message.split(":")[0]) for x in verdict.violations}
    assert "\\udcff" in verdict.text() and report.verdict_markdown(verdict).encode("utf-8")


@pytest.mark.parametrize("diff,why", [
    ("@@ -1 +1 @@\n-a\n+b\n", "a hunk outside any file"),
    ("diff --git a/x b/x\n--- a/x\n+++ b/x\n@@ -1,3 +1,3 @@\n-a\n+b\n", "ends before its header says"),
    ("diff --git a/x b/x\n--- a/x\n+++ b/x\n@@ -1 +1 @@\n-a\n-b\n+c\n", "longer than its header says"),
    ("diff --git a/x b/x\n--- a/x\n@@ -1 +1 @@\n-a\n+b\n", "without its `+++` line"),
    ("just some text\n", "no file in it"),
])
def test_a_diff_that_cannot_be_read_says_where_and_what_to_do(diff, why):
    with pytest.raises(v.DiffError, match=re.escape(why)) as err:
        v.changes_from_diff(diff)
    assert "git diff --full-index" in str(err.value)


@pytest.mark.parametrize("diff,why", [
    ('diff --git "a/x\\q" "b/x\\q"\nold mode 100644\nnew mode 100755\n', "no `a/<path> b/<path>`"),
    ("diff --git a/x b/y\nold mode 100644\nnew mode 100755\n", "disagree"),
    ("diff --git a/x b/x\nrename  from y\nrename to x\n", "no header line git writes"),
    ("diff --git a/x b/x\nnew file mode 100644\ndeleted file mode 100644\n", "both new and deleted"),
    ("diff --git a/x b/x\nnew file mode 100644\nnew file mode 100755\n", "appears 2 times"),
    ("diff --git a/x b/x\n--- /dev/null\n+++ b/x\n@@ -0,0 +1 @@\n+a\n", "no `new file mode`"),
    ("diff --git a/x b/x\nnew file mode 100644\nBinary files /dev/null and b/y differ\n", "disagree"),
    ("diff --git a/x b/x\nindex 1..2 100644\n--- x\n+++ b/x\n@@ -1 +1 @@\n-a\n+b\n", "not a/<path>"),
])
def test_a_header_git_would_not_write_is_refused_with_its_reason(diff, why):
    [change] = v.changes_from_diff(diff)
    assert change.header_problem and why in change.header_problem
    assert "diff-header" in {x.rule for x in v.check([change], "bob", problems=PROBLEMS).violations}


_DIFF_LINES = ["diff --git a/x b/x", 'diff --git "a/x\\303" "b/y"', "diff --git a/x b/y b/z", "new file mode 100644",
               "deleted file mode 100644", "old mode 100644", "new mode 100755", "index 1..2 100644", "rename from x",
               "rename to y", 'copy from "q\\', "copy to x", "similarity index 90%", "--- a/x", "--- /dev/null",
               "+++ b/x", '+++ "b/x\\t"', "+++ /dev/null", "@@ -1 +1 @@", "@@ -0,0 +1,2 @@", "@@ -1,2 +0,0 @@", "@@ x",
               "+a", "-a", " a", "", "\\ No newline at end of file", "Binary files a/x and b/x differ",
               "GIT binary patch", "literal 3", "-- ", "From 0 Mon Sep 17 00:00:00 2001", "diff --cc x"]


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from(_DIFF_LINES) | st.text(max_size=12), max_size=14))
def test_any_diff_is_read_or_refused_with_a_message_never_a_crash(lines):
    text = "\n".join(lines) + "\n"
    try:
        changes = v.changes_from_diff(text)
    except v.DiffError as exc:
        assert "git diff --full-index" in str(exc)
        return
    verdict = v.check(changes, "bob", problems=PROBLEMS)
    verdict.text()
    report.verdict_markdown(verdict).encode("utf-8")


def test_a_copy_or_rename_of_an_executable_is_caught_in_the_checkout(tmp_path):
    """At 100% similarity git writes no mode line for a copy or a rename: the checkout says what it is."""
    repo = tmp_path / "r"
    (repo / "tools").mkdir(parents=True)
    _git(repo.parent, "init", "-q", "-b", "main", str(repo))
    _git(repo, "config", "user.email", "t@example.invalid")
    _git(repo, "config", "user.name", "t")
    (repo / "tools" / "run").write_text("import torch\n" * 20)
    (repo / "tools" / "run").chmod(0o755)
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "base")
    _git(repo, "checkout", "-q", "-b", "pr")
    own = repo / "submissions" / "kernel" / "muse_bf16_proj" / "bob"
    own.mkdir(parents=True)
    (own / "submission.py").write_bytes((repo / "tools" / "run").read_bytes())
    (own / "submission.py").chmod(0o755)
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "pr")
    diff = _git(repo, "diff", "--full-index", "-C", "--find-copies-harder", "main...pr").decode()
    assert "copy from tools/run" in diff and "mode" not in diff
    verdict = v.check(v.changes_from_diff(diff, repo), "bob", problems=PROBLEMS)
    assert [x.rule for x in verdict.violations] == ["mode-change"]
