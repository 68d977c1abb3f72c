"""The patch gate against the real pinned tree: every hostile patch (made with real git) is refused for
its rule and file, valid ones pass, flagged ones pass with their flags; the readers must agree with git;
and validate gates a serving PR's patch.diff."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

import sys

from pipeline.__main__ import main
from pipeline.serving import gate as g

patches = sys.modules["serving_patch_fixtures"]  # tests/fixtures/serving/patches.py, loaded by conftest.py
Scratch, git, P = patches.Scratch, patches.git, patches.P


def _gate(data: bytes, tree: Path, tmp_path: Path, capsys) -> tuple[int, dict, str]:
    """The command, in process: exit code, the JSON verdict, what it printed."""
    patch = tmp_path / "patch.diff"
    patch.write_bytes(data)
    out = tmp_path / "verdict.json"
    code = main(["serving", "gate", str(patch), "--tree", str(tree), "--json", str(out)])
    return code, json.loads(out.read_text()), capsys.readouterr().out


def test_the_catalogue_covers_every_rule_the_spec_names():
    refused = {rule for case in patches.HOSTILE for rule, _ in case.refused}
    assert {"denied-path", "dotdot-path", "absolute-path", "binary", "symlink", "submodule", "mode-change", "rename",
            "copy", "deletion", "non-utf8", "too-large", "too-many-lines", "hunk-header", "malformed",
            "outside-allowed", "does-not-apply", "case-variant", "unsafe-path", "diff-header",
            "unusual-name", "shadows-module", "line-endings"} <= refused
    assert len(patches.HOSTILE) >= 15 and len(patches.VALID) >= 3 and len(patches.FLAGGED) >= 3


@pytest.mark.parametrize("name", [c.name for c in patches.HOSTILE])
def test_a_hostile_patch_is_refused_for_its_rule_and_file(name, scratch, sglang_tree, tmp_path, capsys):
    case = patches.CASES[name]
    code, verdict, printed = _gate(case.build(scratch), sglang_tree, tmp_path, capsys)
    got = {(r["rule"], r["file"]) for r in verdict["reasons"]}
    assert code == 1 and verdict["accepted"] is False, printed
    assert case.refused <= got, printed
    assert case.message in "\n".join(r["message"] for r in verdict["reasons"]), printed
    assert printed.startswith("refused:") and "Traceback" not in printed
    for r in verdict["reasons"]:
        assert set(r) == {"file", "line", "rule", "message"} and r["message"]
        assert f"[{r['rule']}]" in printed
        if r["file"] in verdict["files"]:  # a reason about a file of the patch points into the patch
            assert r["line"] >= 1


@pytest.mark.parametrize("name", [c.name for c in patches.VALID])
def test_a_valid_patch_is_accepted(name, scratch, sglang_tree, tmp_path, capsys):
    case = patches.CASES[name]
    data = case.build(scratch)
    code, verdict, printed = _gate(data, sglang_tree, tmp_path, capsys)
    assert code == 0 and verdict["accepted"] and verdict["reasons"] == [] and verdict["flags"] == [], printed
    # the counts are git's own: numstat of the very patch, applied to the pinned tree
    stat = g.git_apply(sglang_tree, data, "--numstat").stdout.decode().splitlines()
    assert verdict["added"] == sum(int(x.split("\t")[0]) for x in stat)
    assert verdict["removed"] == sum(int(x.split("\t")[1]) for x in stat)
    assert sorted(verdict["files"]) == sorted(x.split("\t", 2)[2] for x in stat)


@pytest.mark.parametrize("name", [c.name for c in patches.FLAGGED])
def test_a_flagged_patch_is_accepted_with_its_flags(name, scratch, sglang_tree, tmp_path, capsys):
    case = patches.CASES[name]
    code, verdict, printed = _gate(case.build(scratch), sglang_tree, tmp_path, capsys)
    assert code == 0 and verdict["accepted"], printed
    assert {(f["pattern"], f["file"]) for f in verdict["flags"]} == case.flags
    assert "flag:" in printed


def test_each_knob_is_flagged_with_its_line(sglang_pin, scratch, sglang_tree):
    for rule in sglang_pin.flags["knob"]:
        data = patches.flag_line(rule["pattern"])(scratch)
        verdict = g.gate(data, sglang_tree, sglang_pin)
        assert verdict.accepted
        (flag,) = verdict.flags
        line = data.decode().split("\n")[flag.line - 1]
        assert flag.pattern == rule["pattern"] and flag.file == patches.SCHEDULER
        assert line.startswith("+") and rule["pattern"] in line


def test_flags_are_capped_per_pattern(scratch, sglang_tree, sglang_pin):
    data = patches._new_file(scratch, P + "srt/layers/many.py", "".join(f"F{i} = 'ignore_eos'\n" for i in range(100)))
    verdict = g.gate(data, sglang_tree, sglang_pin)
    assert verdict.accepted and len(verdict.flags) == g.MAX_FLAGS_PER_PATTERN + 1
    assert verdict.flags[-1].why == "and 80 more added lines like these"


def test_every_denied_pattern_refuses_a_real_file_of_the_tree(sglang_pin, scratch, sglang_tree):
    index = g._index(str(sglang_tree.resolve()))
    allowed = sglang_pin.rules["allowed"]
    for deny in sglang_pin.rules["deny"]:
        matches = sorted(f for f in index.files if g.glob_match(deny["pattern"].lower(), f.lower()))
        inside = [f for f in matches if any(g.glob_match(a, f) for a in allowed)]
        target = (inside or matches)[0]
        s = scratch(target)
        s.append(target, "\n# a competitor's change\n")
        verdict = g.gate(s.diff(), sglang_tree, sglang_pin)
        assert ("denied-path", target) in {(r.rule, r.file) for r in verdict.reasons}, (deny, verdict.text())
        assert not verdict.accepted


def test_a_reason_names_the_line_its_file_starts_at(scratch, sglang_tree, sglang_pin):
    s = scratch(patches.ACT, patches.SAMPLER)
    s.append(patches.ACT, "# fine\n")
    s.append(patches.SAMPLER, "# denied\n")
    data = s.diff()
    verdict = g.gate(data, sglang_tree, sglang_pin)
    (reason,) = verdict.reasons
    lines = data.decode().split("\n")
    assert reason.rule == "denied-path" and reason.file == patches.SAMPLER
    assert lines[reason.line - 1] == f"diff --git a/{patches.SAMPLER} b/{patches.SAMPLER}"


def test_non_utf8_is_reported_at_its_line_and_capped(scratch, sglang_tree, sglang_pin):
    s = scratch(patches.ACT)
    s.append(patches.ACT, b"".join(b"# caf\xe9 %d\n" % i for i in range(120)))
    data = s.diff()
    verdict = g.gate(data, sglang_tree, sglang_pin)
    bad = [r for r in verdict.reasons if r.rule == "non-utf8"]
    assert len(bad) == g.MAX_REASONS_PER_RULE + 1 and "70 more" in bad[-1].message
    assert b"\xe9" in data.split(b"\n")[bad[0].line - 1] and bad[0].file == patches.ACT


def test_lines_are_split_as_git_splits_them(scratch, sglang_tree, sglang_pin):
    """A form feed, a CR and U+2028 inside a line are part of it for git; a reader that split lines at
    them would count other lines than git applies, and refuse a valid patch (or pass a lying one)."""
    s = scratch()
    s.write(P + "srt/layers/odd_text.py", "A = 1\x0c\nB = '\r'  # cr\nC = '\u2028'\n")
    verdict = g.gate(s.diff(), sglang_tree, sglang_pin)
    assert verdict.accepted, verdict.text()
    assert (verdict.added, verdict.removed) == (3, 0)


def test_the_caps_are_exact(scratch, sglang_tree, sglang_pin):
    at = patches._new_file(scratch, P + "srt/layers/table.py", "".join(f"V{i} = {i}\n" for i in range(5_000)))
    assert g.gate(at, sglang_tree, sglang_pin).accepted
    big = b"x" * (sglang_pin.rules["max_bytes"] + 1)
    (reason,) = g.gate(big, sglang_tree, sglang_pin).reasons
    assert reason.rule == "too-large" and "1,048,577 bytes" in reason.message


def _enclosed_tree(root: Path, tree: Path, files: list[str]) -> Path:
    """A copy of some pinned files at <root>/outer/sub, inside a git work tree at <root>/outer."""
    outer = root / "outer"
    outer.mkdir()
    git(outer, "init", "-q")
    sub = outer / "sub"
    for rel in files:
        (sub / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(tree / rel, sub / rel)
    return sub


def test_a_tree_inside_a_git_work_tree_is_checked_from_its_own_root(tmp_path, scratch, sglang_tree, sglang_pin):
    """From a subdirectory of a repository, git apply skips every path outside it and says it applied:
    the gate's git must not see the enclosing repository."""
    sub = _enclosed_tree(tmp_path, sglang_tree, [patches.ACT])
    bad = patches.does_not_apply(scratch)
    assert subprocess.run(["git", "apply", "--check", "-"], cwd=sub, input=bad).returncode == 0  # the trap
    verdict = g.gate(bad, sub, sglang_pin)
    assert ("does-not-apply", patches.ACT) in {(r.rule, r.file) for r in verdict.reasons}
    assert g.gate(patches.valid_srt(scratch), sub, sglang_pin).accepted


def test_git_skipping_a_file_is_a_refusal_even_when_it_says_it_applied(tmp_path, scratch, sglang_tree, sglang_pin,
                                                                     monkeypatch):
    """The second fence: whatever makes git apply skip files (here, the enclosing repository left
    visible), numstat no longer lists them and the readers' view disagrees with git's."""
    sub = _enclosed_tree(tmp_path, sglang_tree, [patches.ACT])

    def unfenced(args, root, data):
        env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
        return subprocess.run(["git", *args], cwd=root, input=data, capture_output=True, env=env)

    monkeypatch.setattr(g, "_git", unfenced)
    verdict = g.gate(patches.valid_srt(scratch), sub, sglang_pin)
    assert ("header-mismatch", patches.ACT) in {(r.rule, r.file) for r in verdict.reasons}, verdict.text()


def test_user_git_configuration_does_not_change_the_verdict(tmp_path, scratch, sglang_tree, sglang_pin, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    (home / ".gitconfig").write_text("[apply]\n\twhitespace = error\n\tignoreWhitespace = change\n")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(home / ".config"))
    s = scratch(patches.ACT)
    s.append(patches.ACT, "X = 1   \n")  # trailing whitespace: an error under that configuration
    assert g.gate(s.diff(), sglang_tree, sglang_pin).accepted
    # context that differs from the tree in whitespace only: ignoreWhitespace would let it apply
    s = scratch(patches.ACT)
    s.replace(patches.ACT, "import logging\nimport math\n", "import  logging\nimport math\n")
    s.git("commit", "-qam", "another spacing")
    s.replace(patches.ACT, "import math\n", "import math  # used below\n")
    loose = s.git("diff", "--full-index")
    assert ("does-not-apply", patches.ACT) in {(r.rule, r.file) for r in g.gate(loose, sglang_tree, sglang_pin).reasons}


def test_a_reader_that_counts_other_lines_than_git_is_a_refusal(scratch, sglang_tree, sglang_pin, monkeypatch):
    """No real patch has been found on which unidiff and git count differently (both follow the hunk
    headers); the check stands for the day one does, so here unidiff's view is made to drop a line."""
    real = g._unidiff_view

    def miscounting(lines):
        patchset, error = real(lines)
        for f in patchset:
            added = [ln for h in f for ln in h if ln.is_added]
            for h in f:
                if added[-1] in h:
                    h.remove(added[-1])
        return patchset, error

    monkeypatch.setattr(g, "_unidiff_view", miscounting)
    verdict = g.gate(patches.valid_srt(scratch), sglang_tree, sglang_pin)
    (reason,) = verdict.reasons
    assert (reason.rule, reason.file) == ("header-mismatch", patches.ACT) and "git reads +1 -1" in reason.message


def test_git_summary_is_read_for_what_it_creates_deletes_and_renames():
    out = (b" create mode 120000 python/sglang/srt/l.py\n delete mode 100644 python/sglang/srt/d.py\n"
           b" mode change 100644 => 100755 python/sglang/srt/m.py\n"
           b" rename python/sglang/srt/{a.py => b.py} (100%)\n create mode 100644 python/sglang/srt/n [1, 2].json\n")
    assert g._summary(out) == [("create", "120000", "python/sglang/srt/l.py"),
                               ("delete", "100644", "python/sglang/srt/d.py"),
                               ("mode change", "100644 => 100755", "python/sglang/srt/m.py"),
                               ("rename", "", "python/sglang/srt/{a.py => b.py} (100%)"),
                               ("create", "100644", "python/sglang/srt/n [1, 2].json")]


def test_the_verdict_is_plain_data(scratch, sglang_tree, sglang_pin):
    verdict = g.gate(patches.flag_environ(scratch), sglang_tree, sglang_pin).as_dict()
    assert set(verdict) == {"accepted", "reasons", "flags", "files", "added", "removed"}
    assert json.loads(json.dumps(verdict)) == verdict
    assert set(verdict["flags"][0]) >= {"file", "line", "pattern"}


def test_usage_errors_exit_2_and_unreadable_patches_exit_1(tmp_path, sglang_tree, capsys):
    assert main(["serving", "gate", str(tmp_path / "missing.diff"), "--tree", str(sglang_tree)]) == 2
    assert "no such file" in capsys.readouterr().err
    real = tmp_path / "real.diff"
    real.write_text("x")
    assert main(["serving", "gate", str(real), "--tree", str(tmp_path)]) == 2
    assert "not the pinned tree" in capsys.readouterr().err
    link = tmp_path / "link.diff"
    link.symlink_to(real)
    assert main(["serving", "gate", str(link), "--tree", str(sglang_tree)]) == 1
    assert "[unreadable]" in capsys.readouterr().out
    big = tmp_path / "big.diff"
    big.write_bytes(b"+" * (1024 * 1024 + 1))
    assert main(["serving", "gate", str(big), "--tree", str(sglang_tree)]) == 1
    assert "[too-large]" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        main(["serving", "gate"])
    assert exc.value.code == 2


def test_glob_semantics():
    assert g.glob_match("python/sglang/srt/**", "python/sglang/srt/a/b.py")
    assert not g.glob_match("python/sglang/srt/**", "python/sglang/srtx/a.py")
    assert g.glob_match("**/test_*.py", "test_a.py") and g.glob_match("**/test_*.py", "a/b/test_a.py")
    assert not g.glob_match("**/test_*.py", "a/test_/x.py")
    assert g.glob_match("**/tests/**", "a/tests/b/c.py") and not g.glob_match("**/tests/**", "a/testsx/c.py")
    # a file name's own brackets are text, never a pattern
    assert g.glob_match("python/**", "python/E=1,block_shape=[128, 128].json")


# ---- validate: a serving PR's patch.diff goes through the gate ----

def _pr_diff(tmp_path: Path, patch: bytes, login: str = "bob") -> tuple[Path, Path]:
    """A real PR's diff adding submissions/serving/<login>/patch.diff, and its head's checkout."""
    repo = tmp_path / "competition"
    diff = tmp_path / "pr.diff"
    diff.write_bytes(patches.pr_diff(repo, patch, login))
    return diff, repo


def test_validate_gates_a_serving_pr(tmp_path, scratch, sglang_tree, capsys):
    diff, head = _pr_diff(tmp_path, patches.lying_names(scratch))
    out = tmp_path / "verdict.json"
    code = main(["validate", "--diff", str(diff), "--author", "bob", "--tree", str(head), "--json", str(out)])
    verdict = json.loads(out.read_text())
    printed = capsys.readouterr().out
    assert code == 1
    rules = {(v["rule"], v["path"]) for v in verdict["violations"]}
    assert {("patch-denied-path", "submissions/serving/bob/patch.diff"),
            ("patch-diff-header", "submissions/serving/bob/patch.diff")} <= rules
    denied = next(v for v in verdict["violations"] if v["rule"] == "patch-denied-path")
    assert denied["message"].startswith(f"{patches.SAMPLER}, line 1 of the patch: ")
    assert "[patch-denied-path]" in printed and verdict["patch_gate"]["accepted"] is False
    # the same without the checkout: a new file's hunks are its whole content
    assert main(["validate", "--diff", str(diff), "--author", "bob", "--json", str(out)]) == 1


def test_validate_passes_a_valid_serving_pr_with_its_flags_as_notes(tmp_path, scratch, capsys):
    diff, head = _pr_diff(tmp_path, patches.flag_environ(scratch))
    out = tmp_path / "verdict.json"
    assert main(["validate", "--diff", str(diff), "--author", "bob", "--tree", str(head), "--json", str(out)]) == 0
    verdict = json.loads(out.read_text())
    assert verdict["ok"] and verdict["submission"]["track"] == "serving"
    assert any("flagged for a maintainer's review" in n and patches.ENVIRON in n for n in verdict["notices"])
    assert verdict["patch_gate"]["accepted"] and verdict["patch_gate"]["files"] == [patches.ENVIRON]


def test_the_pr_fixture_for_a_valid_serving_submission_is_current(tmp_path, scratch):
    """tests/fixtures/serving/valid_serving_pr.diff: a PR adding a real, valid patch.diff (made by
    `patches.py --pr-fixture`), for the validate tests' valid serving case."""
    committed = (Path(patches.__file__).parent / "valid_serving_pr.diff").read_bytes()
    diff, _ = _pr_diff(tmp_path, patches.valid_srt(scratch))
    assert diff.read_bytes() == committed
    assert main(["validate", "--diff", str(diff), "--author", "bob"]) == 0


def test_validate_gates_the_patch_it_reads_through_the_api(httpserver, monkeypatch, tmp_path, scratch):
    """gate.yml's path: the PR's files from the API, the patch.diff's content from its blob."""
    from github_fake import FakeGitHub, fake_sha

    fake = FakeGitHub(httpserver)
    for key, value in fake.env().items():
        monkeypatch.setenv(key, value)
    path = "submissions/serving/bob/patch.diff"
    head = fake.add_commit({path: ("100644", patches.shadow_namespace(scratch))}, sha=fake_sha("head", "shadow"))
    fake.add_pull(7, "bob", head, [{"filename": path, "status": "added"}])
    out = tmp_path / "verdict.json"
    assert main(["validate", "--pr", "7", "--json", str(out)]) == 1
    verdict = json.loads(out.read_text())
    assert [(v["path"], v["rule"]) for v in verdict["violations"]] == [(path, "patch-shadows-module")]
    assert f"{P}srt/sampling.py, line 1 of the patch: " in verdict["violations"][0]["message"]


def test_a_changed_patch_is_gated_whole_from_the_checkout(tmp_path, scratch):
    """A push that changes an existing patch.diff: the PR's diff shows only hunks of it, so the gate reads
    the whole file from the checkout (validate.yml passes --tree); without one it says it did not gate."""
    path = "submissions/serving/bob/patch.diff"
    repo = Scratch(tmp_path / "competition", tmp_path, ())
    repo.write(path, patches.valid_srt(scratch))
    repo.git("add", "-A")
    repo.git("commit", "-qm", "bob's first patch")
    repo.write(path, patches.valid_srt(scratch) + patches.dotdot(scratch))
    diff = tmp_path / "pr.diff"
    diff.write_bytes(repo.diff())
    out = tmp_path / "verdict.json"
    assert main(["validate", "--diff", str(diff), "--author", "bob", "--tree", str(repo.root), "--json", str(out)]) == 1
    assert "patch-dotdot-path" in {v["rule"] for v in json.loads(out.read_text())["violations"]}
    assert main(["validate", "--diff", str(diff), "--author", "bob", "--json", str(out)]) == 0
    assert any("were not applied" in n for n in json.loads(out.read_text())["notices"])
