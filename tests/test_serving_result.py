"""The serving track's part of the one result schema: what serving_document builds from the levels'
figures, what validation refuses where a result crosses a trust boundary, and that the ledger records a
signed serving result through the same path as a kernel one."""

from __future__ import annotations

import copy
import json
import math
import re
from pathlib import Path

import pytest

from fixtures.serving_results import factory as sf
from ledger_factory import FOREIGN_KEY, raw, resign
from pipeline import ledger as lg, result
from pipeline.__main__ import main
from pipeline.serving import document, metrics

FIX = Path(__file__).resolve().parent / "fixtures" / "serving_results"


def test_committed_fixtures_are_what_the_factory_builds():
    for name, doc in sf.fixtures().items():
        assert (FIX / name).read_text() == sf.text(doc), f"regenerate with python {FIX / 'factory.py'}"
        result.validate(json.loads((FIX / name).read_text()))


def test_a_passing_result_restates_s_and_the_ratios_where_every_track_reads_them():
    doc = sf.serving_result(t=1.21, i=1.08)
    s = doc["serving"]["score"]
    assert doc["status"] == "passed" and doc["error"] is None and s["G"] == 1
    assert s["S"] == pytest.approx(math.sqrt(1.21 * 1.08)) == doc["score"]["speedup"]
    assert s["ratios"] == {f"{m}_{c}": pytest.approx(1.21 if m == "T" else 1.08) for c in sf.LEVELS for m in "TI"}
    # the baseline's second block is 1% above its first at its second run: medians of 0 and 1% -> spread 0.5%
    assert s["baseline_spread"] == pytest.approx(0.005) and s["eps"] == pytest.approx(0.01)
    lo, hi = doc["score"]["interval"]
    # the bootstrap over each block's runs (score.score_interval): here the baseline's 1% at one run of four
    assert lo <= s["S"] <= hi and hi / lo < 1.02, (lo, hi)
    perf = {p["workload"]: p for p in doc["performance"]}
    assert sorted(perf) == sorted(f"{m}_{c}" for c in sf.LEVELS for m in "TI")
    for c, (T, I) in sf.BASE.items():
        assert perf[f"T_{c}"]["median_us"] == pytest.approx(1e6 / (T * 1.21))
        assert perf[f"T_{c}"]["baseline_median_us"] == pytest.approx(1e6 / T)
        assert perf[f"I_{c}"]["speedup"] == pytest.approx(1.08) and perf[f"I_{c}"]["n"] == 2
    assert doc["score"]["time_us"] == pytest.approx(math.exp(sum(math.log(1e6 / (T * 1.21)) for T, _ in sf.BASE.values()) / 4))
    lv = doc["serving"]["levels"][0]
    assert lv["concurrency"] == 1 and lv["candidate"]["T"] == pytest.approx(18.5 * 1.21)
    assert lv["candidate"]["turns"] == 240 and lv["candidate"]["failed"] == 0 and lv["candidate"]["valid"]
    assert len(lv["baseline"]["runs"]) == 4 and lv["ratios"]["T"] == pytest.approx(1.21)
    assert doc["serving"]["gate"]["canary"] == {"candidate": 0.991, "baseline": 0.995, "turns": 41, "margin": 0.02}


def test_the_baseline_against_itself_scores_one():
    doc = sf.serving_result(t=1.0)
    assert doc["serving"]["score"]["S"] == pytest.approx(1.0) and doc["status"] == "passed"


def test_a_gated_result_fails_with_every_reason_and_scores_zero():
    doc = json.loads((FIX / "gated.json").read_text())
    assert doc["status"] == "incorrect" and doc["score"] is None
    assert doc["serving"]["score"]["S"] == 0 and doc["serving"]["score"]["S_ungated"] == pytest.approx(1.6)
    gate = doc["serving"]["gate"]
    assert gate["G"] == 0 and gate["invalid_levels"] == [32] and len(gate["reasons"]) == 2
    assert "canary agreement 71.00%" in doc["error"]["message"] and "c = 32" in doc["error"]["message"]
    # the candidate's c = 32 side is invalid with the run's own reason, numbered by run
    c32 = doc["serving"]["levels"][3]["candidate"]
    assert not c32["valid"] and c32["failed"] == 9 and c32["invalid_reasons"][0].startswith("run 1: 9 of 410 turns failed")


def test_a_level_without_an_interactivity_is_invalid_and_gated():
    runs = [sf.sweep(1.3, overrides={4: {"I": None}}), sf.sweep(1.3)]
    doc = sf.serving_result(candidate=runs, sign=False)
    assert doc["status"] == "incorrect" and doc["serving"]["gate"]["invalid_levels"] == [4]
    assert doc["serving"]["score"]["S_ungated"] is None and "I_4" not in doc["serving"]["score"]["ratios"]
    assert "no turn ended inside the measurement window in some run" in doc["serving"]["levels"][1]["candidate"]["invalid_reasons"]


def _failing(c: int, reason: str, **figures) -> dict:
    return {c: {"valid": False, "invalid_reasons": [reason], **figures}}


@pytest.mark.parametrize("figures, reason", [
    ({"T": 0.0, "I": 0.0, "tokens_in_window": 0}, "12 turns finished short of max_tokens - 1 (e.g. conv-1 turn 0: 0 "
                                                   "tokens of 150)"),
    ({"I": 0.0}, "410 of 410 turns failed (100.00% > 0.5%: 410 timeout); the first, conv-3 turn 2: timeout: no "
                 "complete reply within the turn timeout of 300 s"),
    ({"T": 0.0, "I": None}, "no turn completed or failed in the whole run (32 still open when the window closed)"),
], ids=["no-tokens", "every-turn-failed", "nothing-ended"])
def test_a_candidate_level_with_no_output_or_no_user_rate_is_a_gated_result(figures, reason):
    """T_c = 0 or I_c = 0 (a server that produces no tokens, or whose every turn of the window fails) gave a
    ratio of 0, which the schema refused: the result could not be written, and the evaluation ended in exit 3
    as if the node had failed. It is a result: incorrect, its level invalid, the message saying what the
    candidate's server did, where, and what to do."""
    runs = [sf.sweep(1.0, overrides=_failing(16, reason, **figures)) for _ in range(2)]
    doc = sf.serving_result(candidate=runs, sign=False)  # validated
    assert doc["status"] == "incorrect" and doc["score"] is None and doc["serving"]["gate"]["invalid_levels"] == [16]
    lv = doc["serving"]["levels"][2]
    for m in ("T", "I"):
        if figures.get(m) == 0.0:
            assert lv["ratios"][m] == 0.0 and doc["serving"]["score"]["ratios"].get(f"{m}_16", 0.25) == 0.25
    message = doc["error"]["message"]
    assert "invalid levels (failed or short turns): c = 16" in message  # what failed
    assert f"c = 16: run 1: {reason}" in message  # where, and what its turns did
    assert "one choice (index 0)" in message and "--records DIR" in message  # what to do


def test_figures_beyond_what_the_schema_keeps_never_refuse_the_result():
    """A server's own claims (more cached tokens than prompt tokens), a burst (a TPOT of a nanosecond) or a
    garbage reply streamed at once (I_c above 10 million tokens/s) are the candidate's; its result is still
    written: an unscored figure out of range becomes null, a scored one is kept at the bound and invalidates
    the level."""
    unscored = {"tpot_rate": 2e9, "cache_hit_rate_untrusted": 7.5, "ttft_p50_ms": -1.0, "ttft_p90_ms": 4.0,
                "itl_p90_ms": 3.0, "usage_disagreement_untrusted": 0.0}
    runs = [sf.sweep(1.0, overrides={4: {"I": 3e7, "unscored": unscored}}), sf.sweep(1.0)]
    doc = sf.serving_result(candidate=runs, sign=False)
    lv = doc["serving"]["levels"][1]
    run = lv["candidate"]["runs"][0]
    assert run["unscored"] == {"tpot_rate": None, "cache_hit_rate_untrusted": None, "ttft_p50_ms": None,
                               "ttft_p90_ms": 4.0, "itl_p90_ms": 3.0, "usage_disagreement_untrusted": 0.0}
    assert run["I"] == 1e7 and not run["valid"] and "I_c = 3e+07 tokens/s, beyond the 1e+07" in run["invalid_reasons"][0]
    assert doc["status"] == "incorrect" and doc["serving"]["gate"]["invalid_levels"] == [4]


def test_patch_flags_become_advisory_flags_and_a_review_is_held():
    gate = {**sf.PATCH_GATE, "flags": [{"file": "python/sglang/srt/environ.py", "line": 14, "pattern": "file:srt/environ.py",
                                        "why": "a change to the server's environment", "text": "+FOO = 1"}]}
    doc = sf.serving_result(patch_gate=gate, needs_review=True, sign=False)
    assert doc["status"] == "needs_review"
    assert doc["flags"] == [{"code": "patch_flag", "line": 14, "message": "python/sglang/srt/environ.py: "
                             "[file:srt/environ.py] a change to the server's environment: +FOO = 1"}]


def replay_document(c: int, tokens: int = 40, seconds: float = 0.5, n: int = 6) -> dict:
    """A small replay document (pipeline/serving/replay.py's shape): n turns of `tokens` tokens, one per
    chunk, each taking `seconds`, all inside a 10 s window."""
    turns = []
    for k in range(n):
        send = int(1e9 * (1 + k))
        chunks = [send + int(1e9 * seconds * (j + 1) / tokens) for j in range(tokens)]
        turns.append({"conversation": f"conv-{k}", "turn": 1, "pass": 0, "canary": False, "status": "ok",
                      "max_tokens": tokens, "tokens": tokens, "tokens_streamed": tokens, "send_ns": send,
                      "first_ns": chunks[0], "end_ns": chunks[-1], "chunk_ns": chunks, "chunk_tokens": [1] * tokens,
                      "usage": {"prompt_tokens": 100, "prompt_tokens_details": {"cached_tokens": 40}}})
    return {"facts": {"concurrency": c, "window_start_ns": 0, "window_end_ns": int(10e9)}, "turns": turns}


def test_what_metrics_level_gives_is_what_the_schema_keeps():
    """The per-level entry is metrics.level's own output: a key added there and not here fails this test."""
    def real(scale: float) -> dict:
        return {c: metrics.level(replay_document(c, seconds=0.5 / scale), gpus=1) for c in (1, 4)}

    doc = document.serving_document(
        submission={"path": "submissions/serving/bob/patch.diff", "blob_sha": sf.sha("b"), "login": None, "pr": None,
                    "head_sha": None},
        patch_gate=sf.PATCH_GATE, engine={"name": "transformers", "version": "5.0", "gpus": 1},
        dataset={"sha256": "cd" * 32, "conversations": 20}, baseline_first=[real(1.0)], baseline_second=[real(1.0)],
        candidate=[real(2.0)], canary={"candidate": 1.0, "baseline": 1.0, "turns": 2}, audit=sf.AUDIT,
        gsm8k={"candidate": 0.1, "baseline": 0.1, "questions": 50}, official=False,
        mode={"device": "cpu", "model": "smoke", "timing": "closed-loop replay", "seeds": "public"},
        environment={"cpu": "test"}, started_at=result.now(), finished_at=result.now())
    lv = doc["serving"]["levels"][0]
    assert lv["candidate"]["runs"][0] == metrics.level(replay_document(1, seconds=0.25), gpus=1)
    # same tokens in the window, twice the per-turn rate: T unchanged, I doubled
    assert lv["ratios"]["T"] == pytest.approx(1.0) and lv["ratios"]["I"] == pytest.approx(2.0)
    assert doc["serving"]["score"]["S"] == pytest.approx(math.sqrt(2.0))
    assert lv["candidate"]["unscored"]["cache_hit_rate_untrusted"] == 0.4


@pytest.mark.parametrize("change,where", [
    (lambda r: r[1].update(T=math.nan), "T = nan"),
    (lambda r: r[1].update(I=math.inf), "I = inf"),
    (lambda r: r.pop(16), "has levels [1, 4, 32]"),
    (lambda r: r[4].update(concurrency=5), "says concurrency 5"),
])
def test_serving_document_refuses_figures_it_cannot_keep(change, where):
    runs = [sf.sweep(1.1), sf.sweep(1.1)]
    change(runs[1])
    with pytest.raises(result.ResultError, match="candidate run 2") as exc:
        sf.serving_result(candidate=runs, sign=False)
    assert where in str(exc.value)


def test_serving_document_refuses_a_refused_patch_an_invalid_baseline_and_a_partial_official_run():
    with pytest.raises(result.ResultError, match="refused this patch"):
        sf.serving_result(patch_gate={**sf.PATCH_GATE, "accepted": False}, sign=False)
    with pytest.raises(result.ResultError, match="official serving result measures c = \\[1, 4, 16, 32\\]"):
        sf.serving_result(levels=(1, 4), sign=False)
    unscored = copy.deepcopy(sf.sweep())
    # a non-finite unscored figure (1000 / median TPOT of a zero TPOT) is kept as null, not refused
    unscored[1]["unscored"]["tpot_rate"] = math.inf
    assert sf.serving_result(candidate=[unscored], sign=False)["serving"]["levels"][0]["candidate"]["unscored"][
        "tpot_rate"] is None


def _set(path: str, value):
    def change(doc: dict) -> None:
        node = doc
        keys = path.split("/")
        for k in keys[:-1]:
            node = node[int(k) if isinstance(node, list) else k]
        last = keys[-1]
        if value is KeyError:
            del node[last]
        else:
            node[int(last) if isinstance(node, list) else last] = value
    return change


MALFORMED = [
    ("serving/levels/0/candidate/T", math.nan, "not a finite number"),
    ("serving/levels/0/candidate/runs/0/I", math.inf, "not a finite number"),
    ("serving/levels/0/candidate/T", -1.0, "less than the minimum of 0"),
    ("serving/levels/0/candidate/T", 5e7, "greater than the maximum"),
    ("serving/levels/0/candidate/turns", 1.5, "not of type 'integer'"),
    ("serving/levels/0/candidate/turns_by_status", {"ok": 3, "sneaky": 1}, "is not one of"),
    ("serving/levels/0/candidate/runs/0/unscored/cache_hit_rate_untrusted", 1.5, "greater than the maximum of 1"),
    ("serving/levels/0/candidate/runs/0/extra", 1, "Additional properties"),
    ("serving/levels/0/concurrency", 0, "less than the minimum of 1"),
    ("serving/levels/0/ratios/T", -0.5, "less than the minimum of 0"),
    ("serving/levels/0/baseline/invalid_reasons", ["x" * 2001], "is too long"),
    ("serving/score/S", 4.5, "greater than the maximum of 4"),
    ("serving/score/G", 2, "is not one of"),
    ("serving/score/ratios/T_1", 9.0, "greater than the maximum of 4"),
    ("serving/score/ratios/X_1", 1.0, "does not match"),
    ("serving/score/eps", 0.6, "greater than the maximum of 0.5"),
    ("serving/gate/G", 0, "1 was expected"),
    ("serving/gate/gsm8k/candidate", 61.0, "greater than the maximum of 1"),
    ("serving/patch_gate/accepted", False, "True was expected"),
    ("serving/engine/name", "vllm", "is not one of"),
    ("serving/dataset/sha256", "not-a-sha", "does not match"),
    ("serving/levels", [], "should be non-empty"),
    ("serving/gate", KeyError, "'gate' is a required property"),
    ("score", None, "None is not of type 'object'"),
    ("score/speedup", 0.0, "less than or equal to the minimum of 0"),
    ("score/speedup", 7.0, "greater than the maximum of 4"),
    ("performance/0/workload", "M1", "does not match"),
    ("performance/0/speedup", math.inf, "not a finite number"),
    ("problem", "muse_bf16_proj", "'serving' was expected"),
]


@pytest.mark.parametrize("path,value,message", MALFORMED, ids=[f"{p}={v!r}"[:60] for p, v, _ in MALFORMED])
def test_validation_refuses_a_malformed_serving_result_naming_the_place(path, value, message):
    doc = sf.serving_result(sign=False)
    _set(path, value)(doc)
    with pytest.raises(result.ResultError) as exc:
        result.validate(doc)
    text = str(exc.value)
    assert message in text and "result.schema.json" in text
    # named at its own place, or at its object's for a key that is missing, extra or misnamed
    assert f"at /{path}" in text or f"at /{path.rsplit('/', 1)[0]}:" in text


def test_a_serving_section_on_a_kernel_result_is_refused():
    from ledger_factory import result_doc

    doc = result_doc(official=False)
    doc["serving"] = sf.serving_result(sign=False)["serving"]
    with pytest.raises(result.ResultError, match="should not be valid"):
        result.validate(doc)


def test_a_serving_result_without_its_serving_section_is_refused():
    """Every serving result carries its section (a rejected or failed one too, with no levels): without it
    nothing would hold its problem, its figures or its S to the serving rules, and the ledger would record
    a bare score. The stand-ins the ledger and board tests use are real serving results for this reason."""
    from ledger_factory import result_doc

    for doc in (sf.serving_result(sign=False), result_doc(track="serving", official=False),
                result_doc(track="serving", status="rejected", official=False)):
        result.validate(doc)
        bare = {k: v for k, v in doc.items() if k != "serving"}
        with pytest.raises(result.ResultError, match="'serving' is a required property"):
            result.validate(bare)
    passed = result_doc(track="serving", speedup=1.3, official=False)
    assert passed["score"]["speedup"] == pytest.approx(1.3) and passed["serving"]["score"]["S"] == pytest.approx(1.3)


def test_reading_a_serving_result_across_the_trust_boundary(tmp_path):
    good = tmp_path / "result.json"
    good.write_bytes((FIX / "passed.json").read_bytes())
    assert result.read_data(good)[1]["serving"]["score"]["G"] == 1
    bad = json.loads(good.read_text())
    bad["serving"]["levels"][2]["candidate"]["I"] = -3
    good.write_text(json.dumps(bad))
    with pytest.raises(result.ResultError, match="serving/levels/2/candidate/I"):
        result.read_data(good)
    good.write_text(re.sub(r'"T": [0-9.]+', '"T": NaN', (FIX / "passed.json").read_text(), count=1))
    with pytest.raises(result.ResultError, match="not JSON"):
        result.read_data(good)


# ---- the ledger: a signed serving result through the kernel's path ----

def test_the_ledger_records_a_signed_serving_result_and_verifies_it(tmp_path, capsys):
    from ledger_factory import write_competition

    write_competition(tmp_path)
    path = tmp_path / "result.json"
    path.write_bytes((FIX / "passed.json").read_bytes())
    doc = json.loads(path.read_text())
    args = ["ledger", "append", str(path), "--pr", "11", "--login", "alice", "--head-sha",
            doc["submission"]["head_sha"], "--merged-at", "2026-10-24T05:00:00Z", "--root", str(tmp_path)]
    assert main(args) == 0, capsys.readouterr().err
    record = lg.verify(tmp_path)[0]
    assert record["track"] == "serving" and record["problem"] == "serving"
    assert record["score"] == doc["score"]
    assert {w["workload"]: w["speedup"] for w in record["workloads"]} == pytest.approx(
        {f"{m}_{c}": 1.21 if m == "T" else 1.08 for c in sf.LEVELS for m in "TI"})
    assert lg.evidence_path(tmp_path, record["result_sha256"]).read_bytes() == path.read_bytes()


def test_the_ledger_refuses_a_gated_a_forged_and_a_malformed_serving_result(tmp_path, capsys):
    from ledger_factory import write_competition

    write_competition(tmp_path)
    gated = json.loads((FIX / "gated.json").read_text())

    def append(doc: dict, pr: int) -> int:
        path = tmp_path / f"r{pr}.json"
        path.write_bytes(raw(doc))
        return main(["ledger", "append", str(path), "--pr", str(pr), "--login", doc["submission"]["login"],
                     "--head-sha", doc["submission"]["head_sha"], "--merged-at", "2026-10-24T05:00:00Z",
                     "--root", str(tmp_path)])

    assert append(gated, 12) == 1
    assert "status 'incorrect': only a passing result" in capsys.readouterr().err
    forged = json.loads((FIX / "passed.json").read_text())
    forged["serving"]["score"]["S"] = forged["score"]["speedup"] = 3.9
    forged["serving"]["score"]["interval"] = forged["score"]["interval"] = [3.8, 4.0]  # in bounds: only the signature tells
    assert append(forged, 11) == 1
    assert "signature does not verify" in capsys.readouterr().err
    assert append(resign(forged, FOREIGN_KEY), 11) == 1
    assert "signature does not verify" in capsys.readouterr().err
    malformed = resign({**forged, "signature": None})
    malformed["serving"]["levels"][0]["candidate"]["T"] = -1
    assert append(malformed, 11) == 1
    err = capsys.readouterr().err
    assert "serving/levels/0/candidate/T" in err and "re-run the evaluation" in err
    assert not (tmp_path / "results" / "ledger").exists() or lg.read(tmp_path) == []
