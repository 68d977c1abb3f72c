"""The competition's unit of measure is pinned: competition.toml [baselines] holds each problem's baseline
sha256 (problems.baseline_identity over its files, tuned configurations included), `python -m pipeline
problems --pin-baselines` writes it, and an official evaluation against any other baseline is refused
before anything runs (the runner's fault: no result, exit 3), so two ranked results never carry speedups
over different baselines."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pipeline import competition
from pipeline.evaluation import PIN_BEGIN, PIN_END, write_pins
from pipeline.kernel.evaluate import BaselineFailure, Options
from pipeline.kernel.evaluate import evaluate, pin_problem
from pipeline.problems import baseline_identity, list_problems, load_problem

ROOT = Path(__file__).resolve().parent.parent
PROJ = load_problem("muse_bf16_proj")
TEMPLATE = ROOT / "problems" / "muse_bf16_proj" / "template.py"


def _toml(tmp_path: Path, pins: dict[str, str] | None) -> Path:
    text = (ROOT / "competition.toml").read_text()
    if PIN_BEGIN in text:
        head, rest = text.split(PIN_BEGIN, 1)
        text = head + rest.split(PIN_END, 1)[1]
    if pins is not None:
        text += "\n[baselines]\n" + "".join(f'{k} = "{v}"\n' for k, v in pins.items())
    path = tmp_path / "competition.toml"
    path.write_text(text)
    return path


def test_the_repository_pins_exactly_today_s_baselines():
    """Red when a baseline's code or tuned configurations change and nobody re-pins (and says why in the
    commit): every speedup measured after such a change would be in another unit."""
    pins = competition.load().baselines
    assert set(pins) == set(list_problems())
    for name in list_problems():
        assert pins[name] == baseline_identity(load_problem(name))["sha256"], (
            f"{name}'s baseline changed; re-pin with `python -m pipeline problems --pin-baselines`")


def test_an_official_evaluation_against_another_baseline_is_refused_before_anything_runs(tmp_path):
    wrong = _toml(tmp_path, {"muse_bf16_proj": "0" * 64})
    with pytest.raises(BaselineFailure, match=r"not the one .* pins for muse_bf16_proj \(0000000000000000"):
        evaluate(TEMPLATE, PROJ, Options(official=True, competition=wrong))


def test_an_unpinned_problem_refuses_official_runs_and_says_how_to_pin(tmp_path):
    none = _toml(tmp_path, None)
    with pytest.raises(BaselineFailure, match="pins no baseline for muse_bf16_proj.*--pin-baselines"):
        evaluate(TEMPLATE, PROJ, Options(official=True, competition=none))


def test_the_pinned_baseline_passes_the_pin_check(tmp_path):
    right = _toml(tmp_path, {"muse_bf16_proj": baseline_identity(PROJ)["sha256"]})
    assert pin_problem(Options(competition=right), PROJ, baseline_identity(PROJ)) is None
    # and an unofficial evaluation never asks for a pin
    doc = evaluate(TEMPLATE, PROJ, Options(device="cpu", model="smoke", seeds=1, timing=False,
                                           competition=_toml(tmp_path, {"muse_bf16_proj": "1" * 64})))
    assert doc["status"] == "passed"


@pytest.mark.parametrize("bad", ['muse_bf16_proj = "abc"', 'muse_bf16_proj = 3', 'muse_bf16_proj = "' + "A" * 64 + '"'])
def test_a_malformed_pin_is_refused_with_the_command_that_writes_it(tmp_path, bad):
    path = _toml(tmp_path, None)
    path.write_text(path.read_text() + "\n[baselines]\n" + bad + "\n")
    with pytest.raises(competition.CompetitionError, match=r"\[baselines\].*--pin-baselines"):
        competition.load(path)


def test_pinning_rewrites_its_block_and_keeps_the_rest(tmp_path):
    path = _toml(tmp_path, None)
    before = path.read_text()
    proc = subprocess.run([sys.executable, "-m", "pipeline", "problems", "--competition", str(path), "--pin-baselines"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    once = path.read_text()
    assert once.startswith(before.rstrip("\n")) and once.count("[baselines]") == 1
    assert competition.load(path).baselines == {n: baseline_identity(load_problem(n))["sha256"] for n in list_problems()}
    write_pins(path, {"muse_bf16_proj": {"sha256": "2" * 64, "files": ["x"]}})  # a later re-pin replaces the block
    again = path.read_text()
    assert again.count("[baselines]") == 1 and competition.load(path).baselines == {"muse_bf16_proj": "2" * 64}
    assert again.split(PIN_BEGIN)[0] == once.split(PIN_BEGIN)[0]


def test_ledger_append_refuses_an_official_result_measured_against_another_baseline(tmp_path, capsys):
    """Defence in depth behind the evaluator's refusal: a signed official result whose baseline is not the
    pinned one (a runner that ran an old checkout) is refused at the ledger, nothing appended; the same
    result against the pinned baseline is recorded."""
    from ledger_factory import raw, resign, result_doc, sha, write_competition

    from pipeline.__main__ import main

    write_competition(tmp_path)
    args = ["--pr", "7", "--login", "alice", "--head-sha", sha("head-7"), "--merged-at", "2026-10-22T10:00:00Z",
            "--root", str(tmp_path)]
    good = result_doc(pr=7, login="alice")
    other = resign({**good, "baseline_source": {**good["baseline_source"], "sha256": "f" * 64}})
    (tmp_path / "other.json").write_bytes(raw(other))
    assert main(["ledger", "append", str(tmp_path / "other.json"), *args]) != 0
    err = capsys.readouterr().err
    assert "sha256 ffffffffffffffff" in err and "competition.toml pins" in err, err
    assert not (tmp_path / "results" / "ledger").exists() or not any((tmp_path / "results" / "ledger").iterdir())
    (tmp_path / "good.json").write_bytes(raw(good))
    assert main(["ledger", "append", str(tmp_path / "good.json"), *args]) == 0
