"""The GSM8K half of the serving gate: pipeline/serving/gsm8k.py against a real HTTP server process.

One scripted chat server (tests/serving/gsm8k_server.py) runs for the module; each test sets its plan
(which questions it answers right, wrong, with an HTTP 500, or never), runs the real client, and checks
the accuracy, the failures and what the server received. Also: the answer extraction of
pipeline/serving/score.py on its edge cases and on every worked answer of the data, the data's sha256
check, and the engines' free-length bodies (transformers' against its real request handling).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import shutil
import subprocess
import sys
import time
from decimal import Decimal
from pathlib import Path

import pytest

from gsm8k_server import Server
from pipeline.serving import engine, gsm8k, score

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "datasets" / "gsm8k"


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


TEST = _jsonl(DATA / "test.jsonl")
SHOTS = _jsonl(DATA / "shots.jsonl")


@pytest.fixture(scope="module")
def server():
    with Server() as s:
        yield s


def ask(server, *, questions, engine_name="openai", concurrency=4, timeout_s=5.0, **kw):
    return asyncio.run(gsm8k.run(server.url, engine.adapter(engine_name), questions=questions,
                                 concurrency=concurrency, timeout_s=timeout_s, **kw))


# ----- the data -----

def test_the_data_is_the_published_split_with_its_licence():
    assert len(TEST) == gsm8k.TEST_QUESTIONS == 1319
    assert hashlib.sha256((DATA / "test.jsonl").read_bytes()).hexdigest() == gsm8k.TEST_SHA256
    assert hashlib.sha256((DATA / "shots.jsonl").read_bytes()).hexdigest() == gsm8k.SHOTS_SHA256
    readme = (DATA / "README.md").read_text()
    assert gsm8k.TEST_SHA256 in readme and gsm8k.SHOTS_SHA256 in readme and "3101c7d" in readme
    licence = (DATA / "LICENSE").read_text()
    assert licence.startswith("MIT License") and "Copyright (c) 2021 OpenAI" in licence
    # the shots are train lines 1-5 byte for byte: the scorer's fixture was copied from the same file
    assert (DATA / "shots.jsonl").read_bytes() == (ROOT / "tests/fixtures/serving/gsm8k/train_shots.jsonl").read_bytes()
    assert len(SHOTS) == len(gsm8k.SHOT_TRAIN_LINES) == 5


def test_a_changed_or_missing_file_is_refused(tmp_path, server):
    tampered = tmp_path / "gsm8k"
    shutil.copytree(DATA, tampered)
    test_bytes = (tampered / "test.jsonl").read_bytes()
    (tampered / "test.jsonl").write_bytes(test_bytes.replace(b"#### 18", b"#### 19", 1))
    with pytest.raises(gsm8k.GSM8KError) as err:
        gsm8k.load(tampered)
    message = str(err.value)
    assert str(tampered / "test.jsonl") in message and gsm8k.TEST_SHA256 in message
    assert hashlib.sha256((tampered / "test.jsonl").read_bytes()).hexdigest() in message and "git checkout" in message
    # refused before a single request goes out
    server.plan()
    with pytest.raises(gsm8k.GSM8KError, match="sha256"):
        ask(server, questions=3, data_dir=tampered)
    assert server.log()["requests"] == []

    (tampered / "test.jsonl").write_bytes(test_bytes)
    (tampered / "shots.jsonl").write_text((tampered / "shots.jsonl").read_text().replace("72", "73"))
    with pytest.raises(gsm8k.GSM8KError, match="5-shot examples has sha256"):
        gsm8k.load(tampered)
    (tampered / "shots.jsonl").unlink()
    with pytest.raises(gsm8k.GSM8KError, match="cannot read the GSM8K 5-shot examples"):
        gsm8k.load(tampered)
    assert gsm8k.load(DATA)[2] == gsm8k.TEST_SHA256


# ----- reading the answer -----

@pytest.mark.parametrize("reply, expected", [
    ("#### 42", "42"),
    ("The answer is 42.", "42"),  # a trailing period is not a decimal point
    ("She pays $1,234.50 in all.", "1234.50"),  # dollars and thousands commas
    ("#### 1,000,000", "1000000"),
    ("#### $18", "18"),
    ("so x = -5.", "-5"),
    ("a change of \u22123 degrees", "-3"),  # U+2212, the minus sign
    ("#### -10", "-10"),
    ("pages 3-4", "4"),  # a hyphen between numbers is no minus sign
    ("half of 4.5 is 2.25", "2.25"),
    ("it costs .5 dollars", "0.5"),  # never 5
    ("the numbers 1,2,3", "3"),  # not 123: a comma groups exactly three digits
    ("18 apples, then 19.", "19"),
    ("**72**", "72"),
    ("\\boxed{72}", "72"),
    ("#### 18 eggs, 3 of them cracked", "18"),  # the marker's number, not the last one
    ("#### 540.00", "540.00"),
    ("#### 18\n\nQuestion: Tom has 7 apples and eats 2.\nAnswer: 7 - 2 = 5\n#### 5", "18"),  # its own question cut
    ("It makes 18.\nQuestion: and how many are 3 + 4?", "18"),
    ("v2 of the plan", None),
    ("no digits at all", None),
    ("####", None),
])
def test_answer_extraction_edge_cases(reply, expected):
    assert score.extract_answer(reply) == (None if expected is None else Decimal(expected))


def test_decimal_equality_and_the_reference():
    assert score.gsm8k_correct("#### 18.00", "work\n#### 18")
    assert score.gsm8k_correct("So $2,125 in all.", "work\n#### 2,125")
    assert not score.gsm8k_correct("so 0.5", "work\n#### 5")
    assert not score.gsm8k_correct("nothing", "work\n#### 5")


def test_every_worked_answer_of_the_data_reads_as_its_own_reference():
    # 1,324 real GSM8K solutions (calculator annotations <<a*b=c>>, dollars, commas, negatives): as a reply,
    # each must read as its reference, also when the model then goes on with a question of its own
    for row in TEST + SHOTS:
        ref = score.reference_answer(row["answer"])
        assert score.extract_answer(row["answer"]) == ref, row["answer"][-80:]
        assert score.gsm8k_correct(row["answer"] + "\n\nQuestion: What is 9 + 99?\nAnswer: 108", row["answer"])
    assert sum(score.reference_answer(r["answer"]) < 0 for r in TEST) == 2  # -10 and -3 are in the split


# ----- the run against a real server -----

def test_accuracy_failures_and_a_hung_request(server):
    plan = {1: "wrong", 2: "http_500", 3: "hang", 4: "ramble", 5: "right_dollars", 6: "bad_json", 7: "none",
            9: "wrong"}
    server.plan(lines=plan, delay_s=0.05)
    started = time.monotonic()
    result = ask(server, questions=14, concurrency=4, timeout_s=1.0)
    elapsed = time.monotonic() - started
    assert elapsed < 1.0 + 2.0, "the hung request was not cut at its timeout"
    rows = result["per_question"]
    assert [r["index"] for r in rows] == list(range(14))
    assert [r["reference"] for r in rows] == [str(score.reference_answer(q["answer"])) for q in TEST[:14]]
    right = [i for i in range(14) if plan.get(i, "right") in ("right", "ramble", "right_dollars")]
    assert [i for i, r in enumerate(rows) if r["correct"]] == right
    assert result["correct"] == len(right) == 8 and result["questions"] == 14
    assert result["accuracy"] == pytest.approx(8 / 14)
    assert result["failed"] == 3 and result["failures_allowed"] == 3
    assert {i: rows[i]["status"] for i in (2, 3, 6)} == {2: "http_error", 3: "timeout", 6: "bad_response"}
    assert "HTTP 500" in rows[2]["error"] and "1 s" in rows[3]["error"]
    assert rows[1]["extracted"] == str(int(rows[1]["reference"]) + 1) and rows[7]["extracted"] is None
    assert rows[4]["extracted"] == rows[4]["reference"]  # the invented question after the answer is not read
    assert result["finish_reasons"] == {"stop": 11}
    assert result["dataset_sha256"] == gsm8k.TEST_SHA256 and result["shots"]["count"] == 5
    log = server.log()
    assert len(log["requests"]) == 14
    assert 2 <= log["max_in_flight"] <= 4  # concurrent, and never more than asked


def test_too_many_failures_stop_the_run_with_a_clear_error(server):
    server.plan(default="http_500")
    with pytest.raises(gsm8k.GSM8KError, match=r"failed .*more than 3 of 40.*test line \d+: HTTP 500"):
        ask(server, questions=40, concurrency=2)
    assert len(server.log()["requests"]) <= 3 + 1 + 2  # stopped at the fourth failure, not after 40

    server.plan(default="hang")
    started = time.monotonic()
    with pytest.raises(gsm8k.GSM8KError, match="request timeout of 0.5 s"):
        ask(server, questions=20, concurrency=4, timeout_s=0.5)
    assert time.monotonic() - started < 15  # not 20 questions waited out one by one
    assert len(server.log()["requests"]) <= 3 + 1 + 4  # stopped at the fourth failure, the others in flight
    assert gsm8k.failures_allowed(1319) == 6 and gsm8k.failures_allowed(50) == 3


def test_the_five_shot_prompt_and_the_request_as_the_server_got_them(server):
    server.plan()
    for name in sorted(engine.ADAPTERS):
        server.plan()
        result = ask(server, questions=3, engine_name=name, concurrency=1, model="the-model", max_tokens=256)
        assert result["accuracy"] == 1.0 and result["engine"] == name
        bodies = server.log()["requests"]
        assert [b["messages"][-1]["content"] for b in bodies] == [f"Question: {q['question']}\nAnswer:" for q in TEST[:3]]
        for body in bodies:
            assert set(body) == {"messages", "stream", "max_tokens", "temperature", "model"}
            assert body["stream"] is False and body["max_tokens"] == 256 and body["temperature"] == 0
            assert body["model"] == "the-model"
            messages = body["messages"]
            assert [m["role"] for m in messages] == ["user", "assistant"] * 5 + ["user"]
            for k, shot in enumerate(SHOTS):
                assert messages[2 * k] == {"role": "user", "content": f"Question: {shot['question']}\nAnswer:"}
                assert messages[2 * k + 1] == {"role": "assistant", "content": shot["answer"]}
            assert messages[1]["content"].endswith("#### 72")  # train line 1


def test_all_questions_by_default(server):
    server.plan()
    result = ask(server, questions=None, concurrency=16)
    assert result["questions"] == 1319 and result["correct"] == 1319 and result["failed"] == 0
    assert len(server.log()["requests"]) == 1319


@pytest.mark.parametrize("kw, message", [
    ({"questions": 0}, "between 1 and 1319"), ({"questions": 1320}, "between 1 and 1319"),
    ({"questions": True}, "between 1 and 1319"), ({"questions": 3, "concurrency": 0}, "concurrency"),
    ({"questions": 3, "timeout_s": 0}, "timeout"), ({"questions": 3, "max_tokens": 0}, "max_tokens"),
])
def test_bad_arguments_are_refused_before_any_request(server, kw, message):
    server.plan()
    with pytest.raises(gsm8k.GSM8KError, match=message):
        ask(server, **kw)
    assert server.log()["requests"] == []


def test_the_command(server, tmp_path):
    server.plan(lines={0: "wrong"})
    out = tmp_path / "gsm8k.json"
    cmd = [sys.executable, "-m", "pipeline", "serving", "gsm8k", "--url", server.url, "--engine", "sglang",
           "--questions", "4", "--json", str(out)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "GSM8K 5-shot: 75.00% (3 of 4 questions), 0 failed requests" in done.stdout
    document = json.loads(out.read_text())
    assert document["accuracy"] == 0.75 and document["engine"] == "sglang" and len(document["per_question"]) == 4

    bad = tmp_path / "bad.json"
    done = subprocess.run(cmd[:-4] + ["--questions", "2000", "--json", str(bad)], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 1 and "between 1 and 1319" in done.stderr and not bad.exists()


# ----- the engines' free-length bodies -----

def test_free_bodies_and_the_forced_ones_unchanged():
    messages = [{"role": "user", "content": "Question: 1 + 1?\nAnswer:"}]
    for name in engine.ADAPTERS:
        body = engine.adapter(name).free_body(messages, 300)
        assert body == {"messages": messages, "stream": False, "max_tokens": 300, "temperature": 0}
        with pytest.raises(ValueError, match="positive integer"):
            engine.adapter(name).free_body(messages, 0)
    # the replay's forced-length bodies are not touched by the free one
    assert engine.adapter("sglang").body(messages, 7, 3) == {
        "messages": messages, "stream": True, "stream_options": {"include_usage": True}, "max_tokens": 7,
        "ignore_eos": True, "temperature": 0, "seed": 3, "skip_special_tokens": False,
        "chat_template_kwargs": {"spaces_between_special_tokens": False}}
    assert engine.adapter("transformers").body(messages, 7, 3) == {
        "messages": messages, "stream": True, "temperature": 0, "seed": 3,
        "generation_config": '{"do_sample": false, "max_new_tokens": 7, "min_new_tokens": 7}'}
    assert engine.adapter("openai").body(messages, 7, 3) == {
        "messages": messages, "stream": True, "stream_options": {"include_usage": True}, "max_tokens": 7,
        "temperature": 0, "seed": 3}


def test_transformers_serve_keeps_the_models_end_of_sequence_for_the_free_body():
    # transformers serve's own request handling (transformers >= 5), without a model: the body passes its
    # field check, and the generation config it builds stops at the model's end-of-sequence ids, greedy,
    # capped at max_tokens, with no forced minimum.
    chat = pytest.importorskip("transformers.cli.serving.chat_completion")
    from types import SimpleNamespace

    from transformers import GenerationConfig

    handler = object.__new__(chat.ChatCompletionHandler)
    handler.generation_state = SimpleNamespace(_compile=False)
    model_config = GenerationConfig(eos_token_id=[2, 7], do_sample=True, temperature=0.7)
    body = engine.adapter("transformers").free_body([{"role": "user", "content": "hi"}], 300)
    handler._validate_request(body)
    for use_cb in (False, True):
        built = handler._build_generation_config(body, model_config, use_cb=use_cb)
        assert built.eos_token_id == [2, 7] and built.max_new_tokens == 300
        assert built.do_sample is False and built.min_new_tokens is None
    # why there is no generation_config string in it: one replaces the model's config, end-of-sequence and all
    forced = engine.adapter("transformers").body([{"role": "user", "content": "hi"}], 300, 0)
    assert handler._build_generation_config(forced, model_config, use_cb=True).eos_token_id is None
