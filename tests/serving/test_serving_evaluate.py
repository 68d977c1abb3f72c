"""`python -m pipeline serving evaluate` end to end: the real command, real patches made with git against the
pinned tree, real server processes launched from a template in their sandboxes, B C C B.

The server is tests/serving/scripted_server.py from a test pin's template; a patch that adds
python/sglang/srt/_scripted.json changes the candidate's server only (the template passes it {tree}), the
way a real patch changes SGLang: so a candidate that fails to launch, dies mid-level, stops answering or
answers its canaries differently is a real process doing so. The delay knob (--delay-ms-*) slows one
side. Windows of 0.4 s at c = 1 and 4, one run per block, two GSM8K questions: 5-8 s per evaluation. The real engine's evaluation is test_evaluate_against_transformers_serve, at the end.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import Scratch, pin_with, scripted_template, tiny_dataset
from pipeline import result

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = "python/sglang/srt/_scripted.json"
ACT = "python/sglang/srt/layers/activation.py"
WINDOW = ["--levels", "1,4", "--window-s", "0.4", "--warmup-s", "0.05", "--runs", "1", "--gsm8k-questions", "2"]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    d = tmp_path_factory.mktemp("evaluate")
    tag = f"evaluate-test-{os.getpid()}-{d.name}"
    pin = pin_with(d / "pin.toml",
                   scripted_template({"token_s": 0.003}, tag=tag),
                   scripted_template({"exit_at_start": 4}, name="scripted-broken", tag=tag),
                   # a server whose every stream holds a chunk of the wrong shape: as the baseline, the node's fault
                   scripted_template({"token_s": 0.003, "bad_chunk_every": 1, "bad_chunk": '{"choices":{}}'},
                                     name="scripted-garbage", tag=tag),
                   # replies that depend on the whole prompt, the run's marker included, as a real model's do
                   scripted_template({"token_s": 0.003, "words_from": "whole"}, name="scripted-whole", tag=tag))
    limits = d / "competition.toml"
    limits.write_text((ROOT / "competition.toml").read_text().replace("level_extra = 300", "level_extra = 1.5")
                      .replace("gsm8k = 3600", "gsm8k = 2"))
    return {"pin": pin, "dataset": tiny_dataset(d / "tiny.json"), "tag": tag, "limits": limits}


def _tagged(tag: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if tag.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                    found.append(int(entry))
            except OSError:
                pass
    return found


def _command(inputs, out: Path, patch: Path, *extra: str, template: str = "scripted") -> list[str]:
    return [sys.executable, "-m", "pipeline", "serving", "evaluate", str(patch), "--launch", template,
            "--pin", str(inputs["pin"]), "--dataset", str(inputs["dataset"]), "--json", str(out), *WINDOW, *extra]


def _finish(inputs, out: Path, done) -> tuple[int, dict | None, str]:
    doc = result.read(out) if out.exists() else None  # validated against the schema
    return done.returncode, doc, done.stderr


def evaluate(inputs, tmp_path, patch: Path, *extra: str, template: str = "scripted"):
    out = tmp_path / "result.json"
    done = subprocess.run(_command(inputs, out, patch, *extra, template=template), cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert _tagged(inputs["tag"]) == [], "a server of the evaluation outlived it"
    return _finish(inputs, out, done)


def write_patch(scratch, tmp_path, script: dict | None = None) -> Path:
    """A patch the gate accepts: a comment in an allowed file, and the candidate server's script when given."""
    s = scratch(ACT)
    s.append(ACT, "# tuned for the H200\n")
    if script is not None:
        s.write(SCRIPT, json.dumps(script) + "\n")
    path = tmp_path / "patch.diff"
    path.write_bytes(s.diff())
    return path


def _score(doc):
    return doc["serving"]["score"]


# ---- the score's direction ----

def test_the_baseline_against_itself_scores_one_within_eps(inputs, scratch, tmp_path):
    # The scripted server's figures are counted in whole turns of a 0.7 s window (tens to ~140 turns a
    # level: one turn is 0.7-3% of a figure), so the two baseline blocks can agree to the turn by chance
    # and make eps (twice their spread) near 0 while a candidate block is a turn off (one CI run on two
    # busy cores: S 0.9978 against eps 0.0015); and a block that another job on the two shared cores
    # slows scores a few percent off (one CI run: S 0.940 against eps 0.017). The claim held: a no-op
    # patch scores 1 within the larger of eps and that 1% grain, and an evaluation outside it is run once
    # more (a real bias repeats and still fails);
    # the slowed-side tests below show S leaving 1 by far more.
    patch = write_patch(scratch, tmp_path)
    for attempt in range(2):
        (tmp_path / f"try{attempt}").mkdir()
        records = tmp_path / f"records{attempt}"
        # windows a little longer than the other tests': this one's claim is about noise
        rc, doc, err = evaluate(inputs, tmp_path / f"try{attempt}", patch, "--records", str(records),
                                "--window-s", "0.7")
        assert rc == 0, err[-3000:]
        s = _score(doc)
        allowed = max(s["eps"], 0.01)
        if 1 - allowed <= s["S"] <= 1 + allowed:
            break
    kept = sorted(p.name for p in records.iterdir())
    assert "block1-baseline-c1-run1.json.gz" in kept and "block3-candidate-gsm8k.json.gz" in kept
    assert "block4-baseline-server.log" in kept and "block4-baseline-audit.json.gz" in kept
    assert len(kept) == 4 * 2 + 2 + 4 + 1
    assert doc["status"] == "passed" and s["G"] == 1 and doc["serving"]["gate"]["reasons"] == []
    assert 1 - allowed <= s["S"] <= 1 + allowed, (s, [line for line in err.splitlines() if "T_c" in line])
    assert doc["serving"]["order"] == ["baseline", "candidate", "candidate", "baseline"]
    levels = doc["serving"]["levels"]
    assert [lv["concurrency"] for lv in levels] == [1, 4]
    # every block's run kept with its place in B C C B
    assert sorted(r["block"] for r in levels[0]["baseline"]["runs"]) == [0, 3]
    assert sorted(r["block"] for r in levels[0]["candidate"]["runs"]) == [1, 2]
    gate = doc["serving"]["gate"]
    assert gate["canary"]["candidate"] == gate["canary"]["baseline"] == 1.0 and gate["canary"]["turns"] >= 2
    assert gate["gsm8k"]["questions"] == 2
    # the audit: an honest candidate's live turns, re-sent to the last baseline block, are the baseline's replies
    audit = gate["audit"]
    assert audit["candidate"] == audit["baseline"] == 1.0 and audit["length_ratio"] == 1.0, audit
    assert audit["turns"] >= 8 and audit["baseline_turns"] >= 4 and audit["required"] and audit["failed"] == 0
    assert "block 4/4 (baseline): audit, " in err
    env = doc["environment"]["sandbox"]
    assert set(env) == {"baseline", "candidate"}
    if os.geteuid() == 0:
        assert all(d["isolation"] == "namespaces" and d["network"] == "own loopback up" for d in env.values())
    assert set(doc["serving"]["engine"]["launch_s"]) >= {"baseline", "candidate", "block_1_baseline", "block_4_baseline"}
    for line in ("block 1/4 (baseline): ready in", "block 2/4 (candidate) c = 4, run 1/1: T_c",
                 "block 3/4 (candidate): GSM8K 5-shot", "block 4/4 (baseline): stopped"):
        assert line in err


@pytest.mark.heavy  # whole serving evaluations
def test_a_slowed_candidate_scores_below_one_and_a_slowed_baseline_above(inputs, scratch, tmp_path):
    # the two evaluations at once (their servers mostly sleep between chunks): the margins are wide, a
    # 12 ms delay per chunk against 3 ms per token
    patch = write_patch(scratch, tmp_path)
    outs = {side: tmp_path / f"{side}.json" for side in ("candidate", "baseline")}
    procs = {side: subprocess.Popen(_command(inputs, out, patch, f"--delay-ms-{side}", "12"), cwd=ROOT,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for side, out in outs.items()}
    done = {}
    for side, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        done[side] = _finish(inputs, outs[side], subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
    assert _tagged(inputs["tag"]) == [], "a server of the evaluation outlived it"
    rc, doc, err = done["candidate"]
    assert rc == 0, err[-3000:]
    s = _score(doc)
    assert s["S"] < 1 - s["eps"] and s["G"] == 1, s
    assert all(r < 1 for r in s["ratios"].values()), s["ratios"]
    assert any(f["code"] == "delay_knob" for f in doc["flags"])
    rc, doc, err = done["baseline"]
    assert rc == 0, err[-3000:]
    s = _score(doc)
    assert s["S"] > 1 + s["eps"] and s["G"] == 1, s
    assert all(r > 1 for r in s["ratios"].values()), s["ratios"]


# ---- the gate and the failures: a status, a message, the log's tail; never a hang, never a score ----
# Five evaluations at once (their servers sleep between chunks, or fail, or hang): each test reads its own.

FAILING = {
    # name: (the candidate server's script from the patch, extra arguments, template)
    "canaries": ({"words_offset": 5}, (), "scripted"),
    "launch": ({"exit_at_start": 3}, (), "scripted"),
    "dies": ({"die_after": 12}, (), "scripted"),
    # the candidate stops answering its cache flush: the level's replay cannot start, and its wall clock
    # (warm-up + window + [limits.serving] level_extra, 1.5 s here) ends it
    "hangs": ({"flush_hang_s": 120}, ("--limits",), "scripted"),
    # GSM8K's requests hang: its pass has [limits.serving] gsm8k (2 s here)
    "gsm8k": ({"answer_hang_s": 120}, ("--limits",), "scripted"),
    "baseline": (None, (), "scripted-broken"),
}
# The candidate's own failures, each a result (exit 1), never the harness's exit 3 (issue 40), and a baseline
# that streams garbage, which is exit 3: five more evaluations at once, so the heavy tier's (the default tier
# has the replay's and the result's tests of the same failures: tests/serving/test_replay.py,
# tests/test_serving_result.py). One chunk of the wrong shape in 50 requests (the launch's 50th, in its c = 4
# level), every turn stalled past its timeout (the launch's warm-up request let through), 20% of turns
# failed, no token at all.
CANDIDATE_FAILS = {
    "baseline-garbage": (None, (), "scripted-garbage"),
    "bad-chunk": ({"bad_chunk_every": 50, "bad_chunk": '{"choices":[{"index":0,"delta":"oops"}]}'}, (), "scripted"),
    "stalls": ({"hang_s": 120, "hang_from": 2}, ("--turn-timeout-s", "0.3"), "scripted"),
    "fails-turns": ({"fail_every": 5}, (), "scripted"),
    "no-tokens": ({"short_by": 10_000}, (), "scripted"),
}


def _evaluate_all(inputs, sglang_tree, tmp_path_factory, cases: dict) -> dict:
    procs = {}
    for name, (script, extra, template) in cases.items():
        d = tmp_path_factory.mktemp(f"failing-{name}")
        s = Scratch(d / "clone", sglang_tree, (ACT,))
        s.append(ACT, "# tuned for the H200\n")
        if script is not None:
            s.write(SCRIPT, json.dumps(script) + "\n")
        patch = d / "patch.diff"
        patch.write_bytes(s.diff())
        args = ["--limits", str(inputs["limits"])] if "--limits" in extra else list(extra)
        out = d / "result.json"
        procs[name] = (out, subprocess.Popen(_command(inputs, out, patch, *args, template=template), cwd=ROOT,
                                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    got = {}
    for name, (out, proc) in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        got[name] = _finish(inputs, out, subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
    assert _tagged(inputs["tag"]) == [], "a server of the evaluation outlived it"
    return got


@pytest.fixture(scope="module")
def failing(inputs, sglang_tree, tmp_path_factory):
    return _evaluate_all(inputs, sglang_tree, tmp_path_factory, FAILING)


@pytest.fixture(scope="module")
def candidate_fails(inputs, sglang_tree, tmp_path_factory):
    return _evaluate_all(inputs, sglang_tree, tmp_path_factory, CANDIDATE_FAILS)


# The audit (issue 40; serving-track.md, "Only the model's own replies count"): servers that pass the canaries,
# GSM8K and every level, but whose live replies are not the model's own. Two evaluations at once.
AUDITED = {
    # live turns (a history holding the server's own words) answered with other words of the same length
    "filler": ({"filler_live": True}, (), "scripted"),
    # earlier replies served again for the same content under a new run's marker (across runs and levels),
    # the content read past the replay's renaming (every code identifier blanked): without that, the
    # renaming leaves the cache no live turn to answer (tests/exploits/test_serving_exploits.py)
    "cache": ({"reply_cache": "skeleton"}, (), "scripted-whole"),
}


@pytest.fixture(scope="module")
def audited(inputs, sglang_tree, tmp_path_factory):
    return _evaluate_all(inputs, sglang_tree, tmp_path_factory, AUDITED)


@pytest.mark.heavy  # whole serving evaluations (AUDITED)
def test_a_candidate_that_answers_live_turns_with_filler_is_gated_by_the_audit(audited):
    rc, doc, err = audited["filler"]
    assert rc == 1, err[-3000:]
    assert doc["status"] == "incorrect" and doc["score"] is None and _score(doc)["S"] == 0
    gate = doc["serving"]["gate"]
    # everything else passes: the canaries (fixed history) are answered properly, every level is valid
    assert gate["canary"]["candidate"] == gate["canary"]["baseline"] == 1.0 and gate["invalid_levels"] == []
    (reason,) = gate["reasons"]
    assert reason.startswith("audit: the candidate's live replies agree") and "not the model's own" in reason
    audit = gate["audit"]
    assert audit["baseline"] == 1.0 and audit["candidate"] < 1.0 - audit["margin"] and audit["turns"] >= 8, audit
    assert audit["length_ratio"] == 1.0  # filler of the same length: the agreement, not the length, catches it
    assert "audit: the candidate's live replies agree" in doc["error"]["message"]


@pytest.mark.heavy  # whole serving evaluations (AUDITED)
def test_a_candidate_that_serves_cached_replies_is_gated_by_the_audit(audited):
    rc, doc, err = audited["cache"]
    assert rc == 1, err[-3000:]
    assert doc["status"] == "incorrect" and _score(doc)["S"] == 0
    gate = doc["serving"]["gate"]
    assert gate["invalid_levels"] == []
    # (the canaries of a marker-dependent server disagree between any two runs, for the baseline too: the
    # canary condition may or may not fail by chance here; the audit's must)
    assert any(r.startswith("audit: the candidate's live replies agree") for r in gate["reasons"]), gate["reasons"]
    audit = gate["audit"]
    assert audit["baseline"] == 1.0 and audit["candidate"] < 1.0 - audit["margin"], audit


@pytest.mark.heavy  # whole serving evaluations
def test_a_candidate_whose_canaries_disagree_is_gated(failing):
    rc, doc, err = failing["canaries"]
    assert rc == 1, err[-3000:]
    assert doc["status"] == "incorrect" and doc["score"] is None and _score(doc)["S"] == 0
    gate = doc["serving"]["gate"]
    assert gate["canary"]["baseline"] == 1.0 and gate["canary"]["candidate"] < 0.5
    assert "canary agreement" in doc["error"]["message"]


def test_a_refused_patch_is_never_launched(inputs, scratch, tmp_path):
    s = scratch("python/sglang/srt/layers/sampler.py")
    s.append("python/sglang/srt/layers/sampler.py", "# faster sampling\n")
    patch = tmp_path / "patch.diff"
    patch.write_bytes(s.diff())
    rc, doc, err = evaluate(inputs, tmp_path, patch)
    assert rc == 1 and doc["status"] == "rejected", err[-2000:]
    assert "launched" not in err
    assert doc["error"]["where"] == {"file": "python/sglang/srt/layers/sampler.py", "line": 1}
    assert "sampling semantics" in doc["error"]["message"] and doc["serving"]["patch_gate"]["accepted"] is False
    assert doc["serving"]["levels"] == [] and doc["serving"]["score"] is None and doc["score"] is None


def test_a_candidate_that_fails_to_launch_is_a_runtime_error(failing):
    rc, doc, err = failing["launch"]
    assert rc == 1, err[-3000:]
    assert doc["status"] == "runtime_error" and doc["score"] is None and doc["serving"]["levels"] == []
    message = doc["error"]["message"]
    assert "block 2/4 (candidate)" in message and "exit code 3" in message and "read the log below" in message
    assert "exiting before it listens" in doc["error"]["log_tail"]
    assert "block 1/4 (baseline) c = 4, run 1/1" in err  # the baseline's block ran first, whole


def test_a_candidate_that_dies_mid_level_is_a_runtime_error(failing):
    rc, doc, err = failing["dies"]
    assert rc == 1, err[-3000:]
    assert doc["status"] == "runtime_error", doc["error"]
    message = doc["error"]["message"]
    assert "block 2/4 (candidate), c = 1, run 1/1" in message and "exit code 70" in message, message
    assert "dying at request 13" in doc["error"]["log_tail"]


def test_a_level_past_its_wall_clock_is_a_timeout(failing):
    rc, doc, err = failing["hangs"]
    assert rc == 1, err[-3000:]
    assert doc["status"] == "timeout"
    assert "block 2/4 (candidate), c = 1, run 1/1" in doc["error"]["message"]
    assert "took more than 1.95 s" in doc["error"]["message"]


def test_gsm8k_past_its_wall_clock_is_a_timeout(failing):
    rc, doc, err = failing["gsm8k"]
    assert rc == 1, err[-3000:]
    assert doc["status"] == "timeout" and "block 3/4 (candidate), GSM8K" in doc["error"]["message"]
    assert "the GSM8K pass took more than 2 s" in doc["error"]["message"]


def test_the_baseline_failing_is_the_harness_s_fault_and_writes_nothing(failing):
    rc, doc, err = failing["baseline"]
    assert rc == 3 and doc is None, err[-3000:]
    assert "no result was written" in err and "block 1/4 (baseline)" in err and "exiting before it listens" in err


@pytest.mark.heavy  # whole serving evaluations (CANDIDATE_FAILS)
def test_a_baseline_that_streams_garbage_is_the_harness_s_fault_and_writes_nothing(candidate_fails):
    rc, doc, err = candidate_fails["baseline-garbage"]
    assert rc == 3 and doc is None, err[-3000:]
    assert "block 1/4 (baseline) c = 1, run 1/1: the unpatched baseline's level is invalid" in err
    assert "`choices` is an object, not a list" in err and "no result was written" in err


def _gated(failing, name: str) -> tuple[dict, str]:
    """The candidate's failure as a result: exit 1, a document the schema validates (result.read), status
    incorrect with no score, and a message that says what the server did, where, and what to do."""
    rc, doc, err = failing[name]
    assert rc == 1 and doc is not None, err[-3000:]
    assert doc["status"] == "incorrect" and doc["score"] is None and doc["serving"]["score"]["S"] == 0, doc["error"]
    message = doc["error"]["message"]
    assert message.startswith("the correctness gate failed (G = 0, so S = 0)")
    assert "What the candidate's server did: c = " in message and "--records DIR" in message, message
    assert "the unpatched baseline's level is invalid" not in err
    return doc, message


@pytest.mark.heavy  # whole serving evaluations (CANDIDATE_FAILS)
def test_a_candidate_with_one_bad_chunk_in_fifty_requests_gets_a_failing_result(candidate_fails):
    doc, message = _gated(candidate_fails, "bad-chunk")
    invalid = doc["serving"]["gate"]["invalid_levels"]
    assert invalid and "stream_error" in message and "`delta` is a string, not an object" in message, message
    for lv in doc["serving"]["levels"]:
        k = lv["candidate"]
        # one turn of ~50 requests a launch: a few a level, however many requests the machine's speed allows
        turns = sum(k["turns_by_status"].values())
        assert k["turns_by_status"].get("stream_error", 0) <= max(3, turns // 25) and k["T"] > 0, k["turns_by_status"]
        assert (lv["concurrency"] in invalid) == bool(k["failed"])


@pytest.mark.heavy  # whole serving evaluations (CANDIDATE_FAILS)
def test_a_candidate_whose_turns_stall_past_their_timeout_gets_a_failing_result(candidate_fails):
    doc, message = _gated(candidate_fails, "stalls")
    assert doc["serving"]["gate"]["invalid_levels"] == [1, 4]
    assert "timeout: no complete reply within the turn timeout of 0.3 s" in message, message
    for lv in doc["serving"]["levels"]:
        assert lv["candidate"]["T"] == 0 and lv["candidate"]["I"] in (0, None) and lv["ratios"]["T"] == 0


@pytest.mark.heavy  # whole serving evaluations (CANDIDATE_FAILS)
def test_a_candidate_that_fails_a_fifth_of_its_turns_gets_a_failing_result(candidate_fails):
    doc, message = _gated(candidate_fails, "fails-turns")
    assert doc["serving"]["gate"]["invalid_levels"] == [1, 4]
    assert "http_error: HTTP 500" in message and "scripted failure" in message, message
    for lv in doc["serving"]["levels"]:
        k = lv["candidate"]
        assert k["I"] == 0 and lv["ratios"]["I"] == 0  # P10 of u over the window's turns, a fifth of them 0
        assert 0.1 < k["failed"] / sum(k["turns_by_status"].get(s, 0) for s in ("ok", "http_error")) < 0.3


@pytest.mark.heavy  # whole serving evaluations (CANDIDATE_FAILS)
def test_a_candidate_that_produces_no_tokens_gets_a_failing_result(candidate_fails):
    doc, message = _gated(candidate_fails, "no-tokens")
    assert doc["serving"]["gate"]["invalid_levels"] == [1, 4]
    assert "turns finished short of max_tokens - 1" in message and ": 0 tokens of" in message, message
    for lv in doc["serving"]["levels"]:
        assert lv["candidate"]["T"] == 0 and lv["candidate"]["I"] == 0 and lv["ratios"] == {"T": 0, "I": 0}


def test_a_cancelled_evaluation_stops_every_server_and_writes_nothing(inputs, scratch, tmp_path):
    # SIGTERM is what a runner sends when the job is cancelled; SIGINT is Ctrl-C
    import signal
    import time

    patch = write_patch(scratch, tmp_path)
    outs = {sig: tmp_path / f"{sig.name}.json" for sig in (signal.SIGTERM, signal.SIGINT)}
    procs = {}
    for sig, out in outs.items():
        cmd = _command(inputs, out, patch) + ["--window-s", "60"]
        # Ctrl-C as in a terminal: a shell's background job (`bash .ci/run &`) starts its children with SIGINT
        # ignored, and Python then installs no KeyboardInterrupt handler, so the disposition is set here
        procs[sig] = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                      preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    for sig, proc in procs.items():
        for line in proc.stderr:
            if "block 1/4 (baseline): ready in" in line:
                break
        time.sleep(0.3)  # inside the first level's replay
        t0 = time.monotonic()
        proc.send_signal(sig)
        rest = proc.stderr.read()
        assert proc.wait(30) == (143 if sig == signal.SIGTERM else 130), rest[-2000:]
        assert time.monotonic() - t0 < 25 and "block 1/4 (baseline): stopped" in rest  # at once, not the level's end
        assert not outs[sig].exists()
    assert _tagged(inputs["tag"]) == [], "a server outlived its cancelled evaluation"


# ---- bad input: exit 2, nothing written, nothing launched ----

@pytest.mark.parametrize("args, message", [
    (["--launch", "nope"], "no launch template 'nope'"),
    (["--launch", "scripted", "--official"], "refusing an official evaluation"),
    (["--launch", "scripted", "--delay-ms-candidate", "-1"], "must not be negative"),
    (["--launch", "scripted", "--runs", "0"], "--runs 0"),
])
def test_bad_input_is_a_usage_error(inputs, scratch, tmp_path, args, message):
    out = tmp_path / "result.json"
    cmd = [sys.executable, "-m", "pipeline", "serving", "evaluate", str(write_patch(scratch, tmp_path)),
           "--pin", str(inputs["pin"]), "--dataset", str(inputs["dataset"]), "--json", str(out), *args]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and message in done.stderr, done.stderr[-2000:]
    assert not out.exists() and "launched" not in done.stderr


@pytest.mark.parametrize("facts, message", [
    ({"blob_sha": "b" * 40}, "but --meta names bbbb"),
    ("the patch's blob, track kernel", "--meta names track 'kernel'"),
    ([1, 2], "expected a JSON object"),
    (None, "cannot read it"),
], ids=["other-blob", "other-track", "not-an-object", "unreadable"])
def test_meta_that_does_not_name_this_patch_is_a_usage_error(inputs, scratch, tmp_path, facts, message):
    # --meta (fetch-submission's facts) is checked against the patch's own blob before anything launches,
    # by the same reader as the kernel track's (result.read_meta)
    patch = write_patch(scratch, tmp_path)
    meta = tmp_path / "meta.json"
    if facts == "the patch's blob, track kernel":
        facts = {"blob_sha": result.git_blob_sha(patch.read_bytes()), "track": "kernel"}
    if facts is not None:
        meta.write_text(json.dumps(facts))
    out = tmp_path / "result.json"
    cmd = [sys.executable, "-m", "pipeline", "serving", "evaluate", str(patch), "--launch", "scripted",
           "--pin", str(inputs["pin"]), "--dataset", str(inputs["dataset"]), "--meta", str(meta), "--json", str(out)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and message in done.stderr, done.stderr[-2000:]
    assert not out.exists() and "launched" not in done.stderr


def test_no_dataset_is_a_usage_error(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PIPELINE_SERVING_DATASET"}
    (tmp_path / "p.diff").write_text("")
    done = subprocess.run([sys.executable, "-m", "pipeline", "serving", "evaluate", str(tmp_path / "p.diff"),
                           "--launch", "sglang", "--json", str(tmp_path / "r.json")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "$PIPELINE_SERVING_DATASET" in done.stderr


def test_an_official_run_measures_the_plan_and_the_hidden_set_only(inputs, tmp_path):
    from pipeline.serving import evaluate as ev

    plan = ev.load_plan()
    assert plan.levels == (1, 4, 16, 32) and plan.runs == 3 and plan.window(1) == 300 and plan.window(4) == 600
    # sglang_pin/README.md states the official evaluation's replay time; it is the plan's
    readme = (ROOT / "sglang_pin" / "README.md").read_text()
    assert f"the four blocks {plan.measured_s():,.0f} s ({plan.measured_s() / 3600:.1f} h) of replay" in readme
    meta = {"corpus": "hidden", "generator_version": "1", "shape": "agentic",
            "tokenizer_sha256": json.loads(ev.HIDDEN_SUMMARY.read_text())["tokenizer_sha256"]}
    assert "recorded nowhere" in ev.check_official_dataset(meta, "a" * 64, environ={})
    assert "not the runner's hidden set" in ev.check_official_dataset(meta, "a" * 64, environ={ev.DATASET_SHA_ENV: "b" * 64})
    assert ev.check_official_dataset(meta, "a" * 64, environ={ev.DATASET_SHA_ENV: "a" * 64}) is None
    assert "corpus" in ev.check_official_dataset({**meta, "corpus": "public"}, "a" * 64,
                                                 environ={ev.DATASET_SHA_ENV: "a" * 64})


# ---- the real engine: `transformers serve` with SmolLM2-135M on the CPU, the shipped template ----

@pytest.mark.heavy
def test_evaluate_against_transformers_serve(smollm2_checkpoint, scratch, tmp_path):
    """The whole evaluation through the real command against a real engine: the pin's transformers-cpu
    template, four launches of `transformers serve --continuous-batching` in their sandboxes (each waited
    for, warmed up and stopped), c = 1 and 4 with windows of a few seconds, one GSM8K question per side. On
    two shared cores the figures are noise; what must hold is the flow and the document."""
    dataset = tiny_dataset(tmp_path / "tiny.json", conversations=6, turns=3, max_tokens=3,
                           canaries=(0, 1, 2, 3, 4, 5))  # every turn a canary: a few seconds hold some
    out = tmp_path / "result.json"
    # one thread for the engine, the other core for the replay: two OpenMP threads on two cores shared with
    # the client (and, on a busy machine, other jobs) spin at every barrier, and a level can end with no turn
    env = {**os.environ, "PIPELINE_SERVING_MODEL": str(smollm2_checkpoint), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "pipeline", "serving", "evaluate", str(write_patch(scratch, tmp_path)),
           "--launch", "transformers-cpu", "--dataset", str(dataset), "--json", str(out), "--levels", "1,4",
           "--window-s", "3.5", "--warmup-s", "0.5", "--runs", "1", "--gsm8k-questions", "1", "--gsm8k-max-tokens", "4"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode == 3 and "the unpatched baseline's level is invalid" in done.stderr:
        # windows of seconds on two shared cores: a burst of another job's load can leave a baseline level
        # without one whole turn, which the evaluation rightly refuses to score (exit 3); once more
        print("the baseline's level held no whole turn (a loaded machine); evaluating once more:\n"
              + done.stderr[-1500:])
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode in (0, 1) and out.exists(), done.stderr[-5000:]
    doc = result.read(out)
    assert (done.returncode == 0) == (doc["status"] in ("passed", "needs_review")), doc["status"]
    assert doc["status"] in ("passed", "incorrect"), doc["error"]  # G may fall on a canary flip: noise, not flow
    serving = doc["serving"]
    assert serving["engine"]["name"] == "transformers" and serving["engine"]["gpus"] == 1
    assert [lv["concurrency"] for lv in serving["levels"]] == [1, 4]
    for lv in serving["levels"]:
        for side in ("baseline", "candidate"):
            assert lv[side]["T"] > 0 and lv[side]["runs"] and lv[side]["valid"], (lv["concurrency"], side, lv[side])
    gate = serving["gate"]
    assert gate["gsm8k"]["questions"] == 1 and gate["canary"]["turns"] >= 1
    assert 0 < serving["score"]["S_ungated"] <= 4
    if os.geteuid() == 0:
        assert all(d["isolation"] == "namespaces" for d in doc["environment"]["sandbox"].values())
    assert set(serving["engine"]["launch_s"]) >= {"baseline", "candidate"}
    assert done.stderr.count("): stopped") == 4
    print(f"S = {serving['score']['S']:.3f}, eps {serving['score']['eps']:.3f}, launch {serving['engine']['launch_s']}")
