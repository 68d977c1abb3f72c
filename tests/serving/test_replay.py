"""The closed-loop replayer against a real streaming server process whose timing the test scripts.

One scripted server (tests/serving/scripted_server.py) runs for the module; each test sets its script,
replays for a fraction of a second, and checks the records against what the server received.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.serving import metrics, replay
from scripted_server import WORDS, Server, forced_length, word

SYSTEM = "You are a coding agent. Tools: bash."
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def server():
    with Server() as s:
        yield s


@pytest.fixture(scope="module")
def tok():
    """A word-level tokenizer of the server's words (the real `tokenizers` library; one word, one token)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w.strip(): i for i, w in enumerate(WORDS)}
    vocab["[UNK]"] = len(vocab)
    t = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return t


def conversations(n=6, turns=5, max_tokens=8, canary=()):
    out = []
    for i in range(n):
        cid = f"conv{i}"
        spec = []
        for k in range(turns):
            messages = ([{"role": "user", "content": f"{cid} task"}] if k == 0 else
                        [{"role": "tool", "tool_call_id": f"call_{i}_{k}", "name": "bash", "content": f"{cid} output {k}"}])
            spec.append({"messages": messages, "max_tokens": max_tokens, "canary": i in canary,
                         "reply": f"{cid} fixed reply {k}"})
        out.append({"id": cid, "canary": i in canary, "turns": spec})
    return out


def run(server, tok, convs, *, c=1, window=0.5, warmup=0.0, engine="sglang", seed=7, timeout=30.0, **kw):
    return asyncio.run(replay.run(server.url, SYSTEM, convs, tok, engine=engine, concurrency=c, window_s=window,
                                  warmup_s=warmup, seed=seed, turn_timeout_s=timeout, **kw))


def served_reply(request: dict, short_by: int = 0, special_every: int = 0) -> str:
    """The text the scripted server streamed for a request (its words follow from its index)."""
    n = forced_length(request["body"]) - short_by
    return "".join(word(request["index"], j, special_every) for j in range(n))


def test_lanes_thread_the_whole_history_and_start_staggered(server, tok):
    convs = conversations(n=6, turns=5, max_tokens=8, canary=(5,))
    server.script(token_s=0.001)
    doc = run(server, tok, convs, c=4, window=0.8, warmup=0.2)
    log = server.log()
    requests = log["requests"]
    marker = doc["facts"]["marker"]
    assert len(requests) == len(doc["turns"]) > 20

    # Lane discipline: never more than c requests in flight, and the c lanes kept it full.
    assert log["max_in_flight"] == 4
    # each lane keeps its connection (a stream read to its end goes back to the pool)
    assert len({r["peer"] for r in requests}) <= 4
    by_lane: dict[int, list[dict]] = {}
    for r in sorted(doc["turns"], key=lambda r: r["send_ns"]):
        by_lane.setdefault(r["lane"], []).append(r)
    assert sorted(by_lane) == [0, 1, 2, 3]
    for lane, records in by_lane.items():
        # staggered: lane i starts its first conversation at turn floor(i * 5 / 4)
        assert records[0]["turn"] == replay.start_turn(lane, 4, 5) == (lane * 5) // 4
        for prev, nxt in zip(records, records[1:]):
            assert prev["end_ns"] <= nxt["send_ns"]  # one turn at a time per lane
            if nxt["turn"] > 0:
                assert (nxt["conversation"], nxt["turn"]) == (prev["conversation"], prev["turn"] + 1)
            else:
                assert prev["turn"] == 4  # a new conversation only once the last one ended

    # History threading: every request is the system message, then each earlier turn's messages and its
    # reply (the live one the server streamed for that turn's own request; the dataset's fixed one
    # before a lane's starting turn and throughout a canary), then this turn's messages.
    by_prefix = {json.dumps(r["body"]["messages"]): r for r in requests}
    spec = {c["id"]: c for c in convs}
    fixed_used = 0
    for r in requests:
        messages = r["body"]["messages"]
        assert messages[0]["role"] == "system"
        assert re.fullmatch(re.escape(marker) + r"(/[0-9]+)?\n\n" + re.escape(SYSTEM), messages[0]["content"])
        cid = messages[1]["content"].split()[0]
        turns = spec[cid]["turns"]
        expected, k, live_seen = [messages[0]], 0, False
        position = 1
        while True:
            expected.extend(turns[k]["messages"])
            position += len(turns[k]["messages"])
            if position == len(messages):
                break
            earlier = by_prefix.get(json.dumps(messages[:position]))
            if earlier is not None and not spec[cid]["canary"]:
                reply, live_seen = served_reply(earlier), True
            else:
                assert not live_seen, "a fixed reply after a live one: only a lane's start is filled in"
                reply = turns[k]["reply"]
                fixed_used += 1
            expected.append({"role": "assistant", "content": reply})
            position += 1
            k += 1
        assert messages == expected
    assert fixed_used > 0


def test_a_marker_begins_every_request_and_differs_per_run(server, tok):
    convs = conversations(n=2, turns=2, max_tokens=3)
    server.script()
    first = run(server, tok, convs, c=1, window=0.3)
    firsts = server.log()["requests"]
    server.script()
    second = run(server, tok, convs, c=1, window=0.3)
    seconds = server.log()["requests"]
    m1, m2 = first["facts"]["marker"], second["facts"]["marker"]
    assert m1 != m2 and m1.startswith("run ") and len(m1) == len("run ") + 16
    for marker, requests, doc in ((m1, firsts, first), (m2, seconds, second)):
        passes = {r["pass"] for r in doc["turns"]}
        assert max(passes) >= 2  # two conversations replayed over and over
        for req, rec in zip(requests, sorted(doc["turns"], key=lambda r: r["send_ns"])):
            system = req["body"]["messages"][0]
            tag = marker if rec["pass"] == 0 else f"{marker}/{rec['pass']}"
            assert system["role"] == "system" and system["content"].startswith(tag + "\n\n")


def test_the_queue_is_seeded(server, tok):
    queue_a, queue_b = replay.ConversationQueue(5, seed=3), replay.ConversationQueue(5, seed=3)
    order = [queue_a.next() for _ in range(10)]
    assert order == [queue_b.next() for _ in range(10)]
    assert sorted(i for i, p in order if p == 0) == list(range(5)) and {p for _, p in order} == {0, 1}
    assert order != [replay.ConversationQueue(5, seed=4).next() for _ in range(10)]


@pytest.mark.parametrize("engine", ["sglang", "transformers", "openai"])
def test_each_engine_gets_its_forced_length_and_flush(server, tok, engine):
    server.script()
    doc = run(server, tok, conversations(n=2, turns=2, max_tokens=5), c=1, window=0.2, engine=engine)
    log = server.log()
    bodies = [r["body"] for r in log["requests"]]
    assert bodies and all(b["stream"] is True and b["temperature"] == 0 for b in bodies)
    if engine == "sglang":
        assert len(log["flushes"]) == 1 and log["flushes"][0] < log["requests"][0]["t_start_ns"]
        assert doc["facts"]["flush"]["flushed"] is True
        assert all(b["max_tokens"] == 5 and b["ignore_eos"] is True and b["skip_special_tokens"] is False for b in bodies)
    elif engine == "transformers":
        assert log["flushes"] == [] and doc["facts"]["flush"]["flushed"] is None
        for b in bodies:
            assert "ignore_eos" not in b and "max_tokens" not in b and "stream_options" not in b
            assert isinstance(b["generation_config"], str)  # transformers serve json.loads it
            assert json.loads(b["generation_config"]) == {"max_new_tokens": 5, "min_new_tokens": 5, "do_sample": False}
    else:
        assert log["flushes"] == []
        assert all(b["max_tokens"] == 5 and "ignore_eos" not in b and "generation_config" not in b for b in bodies)
    assert {r["status"] for r in doc["turns"]} <= {"ok", "cancelled"}


def test_a_refused_flush_or_an_unready_server_stops_the_run(server, tok, monkeypatch):
    monkeypatch.setattr(replay, "FLUSH_ATTEMPTS", 3)
    monkeypatch.setattr(replay, "FLUSH_RETRY_S", 0.01)
    server.script(flush_status=400)
    with pytest.raises(replay.ReplayError, match="flush .* failed 3 times .*HTTP 400"):
        run(server, tok, conversations(), c=2)
    assert len(server.log()["flushes"]) == 3 and server.log()["requests"] == []
    server.script(healthy=False)
    with pytest.raises(replay.ReplayError, match="not ready: GET /health answered HTTP 503"):
        run(server, tok, conversations(), c=2)
    with pytest.raises(replay.ReplayError, match="cannot be reached"):
        asyncio.run(replay.run("http://127.0.0.1:9", SYSTEM, conversations(), tok, engine="openai",
                               concurrency=1, window_s=0.1, warmup_s=0, seed=0))


def test_a_server_that_never_answers_its_flush_or_health_stops_the_run_in_bounded_time(server, tok, monkeypatch):
    monkeypatch.setattr(replay, "CONTROL_TIMEOUT_S", 0.3)
    server.script(flush_hang_s=30)
    with pytest.raises(replay.ReplayError, match=r"did not answer POST /flush_cache \(the cache flush\) within 0.3 s"):
        run(server, tok, conversations(), c=1)
    assert server.log()["requests"] == []
    import socket

    with socket.socket() as silent:  # accepts connections (the kernel's backlog) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        with pytest.raises(replay.ReplayError, match="did not answer GET /health within 0.3 s"):
            asyncio.run(replay.run(url, SYSTEM, conversations(), tok, engine="sglang", concurrency=1, window_s=0.1,
                                   warmup_s=0, seed=0))


def test_tokens_count_inside_the_window_and_open_work_is_cancelled(server, tok):
    # one turn far longer than the run, 2 ms a token: it is still open when the window closes
    server.script(token_s=0.002)
    doc = run(server, tok, conversations(n=1, turns=1, max_tokens=100_000), c=1, window=0.6, warmup=0.3)
    (turn,) = doc["turns"]
    facts = doc["facts"]
    assert turn["status"] == "cancelled" and turn["end_ns"] == facts["stopped_ns"] >= facts["window_end_ns"]
    start, end = facts["window_start_ns"], facts["window_end_ns"]
    inside = sum(n for t, n in zip(turn["chunk_ns"], turn["chunk_tokens"]) if start <= t < end)
    before = sum(n for t, n in zip(turn["chunk_ns"], turn["chunk_tokens"]) if t < start)
    assert before > 20 and inside > 50 and turn["tokens"] == before + inside + sum(
        n for t, n in zip(turn["chunk_ns"], turn["chunk_tokens"]) if t >= end)
    lv = metrics.level(doc, gpus=1)
    assert lv["tokens_in_window"] == inside
    assert lv["T"] == pytest.approx(inside / 0.6)
    # no more than the server sent: its schedule is a token every 2 ms from the first (late ones catch up)
    assert before + inside <= (end - turn["first_ns"]) / 2e6 + 2
    assert lv["window_turns"] == 0 and lv["I"] is None  # a cancelled turn is not a user's turn
    # the server saw the client go: its handler ended
    deadline = time.monotonic() + 5
    while server.log()["in_flight"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.log()["in_flight"] == 0


def test_buffering_the_stream_gains_nothing_in_u(server, tok):
    convs = conversations(n=2, turns=20, max_tokens=20)
    levels = {}
    for buffer in (False, True):
        server.script(ttft_s=0.02, token_s=0.01, buffer=buffer)
        levels[buffer] = metrics.level(run(server, tok, convs, c=1, window=1.2), gpus=1)
    streamed, buffered = levels[False], levels[True]
    assert streamed["valid"] and buffered["valid"] and streamed["window_turns"] >= 3
    assert buffered["I"] == pytest.approx(streamed["I"], rel=0.15)
    assert buffered["unscored"]["ttft_p50_ms"] > 5 * streamed["unscored"]["ttft_p50_ms"]


def test_a_server_that_stops_early_invalidates_the_level(server, tok):
    convs = conversations(n=3, turns=3, max_tokens=10)
    server.script(short_by=1)  # max_tokens - 1: the allowed slack
    lv = metrics.level(run(server, tok, convs, c=2, window=0.3), gpus=1)
    assert lv["valid"], lv["invalid_reasons"]
    server.script(short_by=2)
    doc = run(server, tok, convs, c=2, window=0.3)
    lv = metrics.level(doc, gpus=1)
    assert not lv["valid"] and "short of max_tokens - 1" in lv["invalid_reasons"][0]
    shorts = [r for r in doc["turns"] if r["status"] == "short"]
    assert shorts and all(r["tokens_streamed"] == 8 and "8 tokens streamed" in r["error"] for r in shorts)


def test_two_percent_failed_turns_invalidate_the_level(server, tok):
    server.script(fail_every=50)
    doc = run(server, tok, conversations(n=8, turns=10, max_tokens=4), c=4, window=1.0)
    lv = metrics.level(doc, gpus=1)
    failed = [r for r in doc["turns"] if r["status"] == "http_error"]
    ended = [r for r in doc["turns"] if r["status"] != "cancelled"]
    assert len(ended) >= 100
    # every 50th request the server received failed (the last may have been cancelled first, at the window's end)
    assert 0 <= len(server.log()["requests"]) // 50 - len(failed) <= 1 and "HTTP 500" in failed[0]["error"]
    assert not lv["valid"] and "turns failed" in lv["invalid_reasons"][0]
    # a failed turn ends its conversation: the lane's next turn starts another one
    turns = sorted(doc["turns"], key=lambda r: r["send_ns"])
    for f in failed:
        after = [r for r in turns if r["lane"] == f["lane"] and r["send_ns"] > f["send_ns"]]
        assert not after or after[0]["turn"] == 0


def test_a_turn_counts_at_most_its_max_tokens(server, tok):
    server.script(short_by=-3)  # three words more than asked for
    doc = run(server, tok, conversations(n=2, turns=3, max_tokens=6), c=1, window=0.3)
    ok = [r for r in doc["turns"] if r["status"] == "ok"]
    assert ok and all(r["tokens"] == 6 and r["tokens_streamed"] == 9 and sum(r["chunk_tokens"]) == 6 for r in ok)
    assert all(r["chunk_tokens"] == [1] * 6 + [0] * 3 and r["end_ns"] == r["chunk_ns"][5] for r in ok)


def test_usage_lies_are_logged_and_ignored(server, tok):
    server.script(usage_factor=10.0)
    doc = run(server, tok, conversations(n=2, turns=3, max_tokens=6), c=2, window=0.3)
    done = [r for r in doc["turns"] if r["status"] == "ok"]
    assert done and all(r["tokens"] == 6 and r["usage"]["completion_tokens"] == 60 for r in done)
    lv = metrics.level(doc, gpus=1)
    start, end = doc["facts"]["window_start_ns"], doc["facts"]["window_end_ns"]
    counted = sum(n for r in doc["turns"] for t, n in zip(r["chunk_ns"], r["chunk_tokens"]) if start <= t < end)
    claimed = sum(r["usage"]["completion_tokens"] for r in doc["turns"] if r["usage"])
    assert lv["tokens_in_window"] == counted and claimed > 5 * counted
    assert lv["unscored"]["cache_hit_rate_untrusted"] == 1.0  # reported as the server claims it, unscored
    # a server that stops early and claims the full length in usage is still short
    server.script(short_by=3, usage_factor=2.0)
    doc = run(server, tok, conversations(n=2, turns=3, max_tokens=6), c=1, window=0.3)
    ended = [r for r in doc["turns"] if r["status"] != "cancelled"]
    assert ended and all(r["status"] == "short" and r["tokens_streamed"] == 3 and r["usage"]["completion_tokens"] == 6
                         for r in ended)


def test_timeouts_and_broken_streams_are_failed_turns(server, tok):
    server.script(hang_s=5.0)
    doc = run(server, tok, conversations(n=3, turns=3, max_tokens=4), c=2, window=1.0, timeout=0.3)
    timeouts = [r for r in doc["turns"] if r["status"] == "timeout"]
    assert len(timeouts) >= 4
    for r in timeouts:
        assert 0.29e9 <= r["end_ns"] - r["send_ns"] < 0.6e9 and "turn timeout of 0.3 s" in r["error"]
    assert not metrics.level(doc, gpus=1)["valid"]

    server.script(break_after=3)
    doc = run(server, tok, conversations(n=3, turns=3, max_tokens=8), c=2, window=0.3)
    broken = [r for r in doc["turns"] if r["status"] == "broken"]
    assert broken and all(r["tokens"] == 3 for r in broken)
    assert not metrics.level(doc, gpus=1)["valid"]


# ---- the stream's shape: one choice, one text field, every other shape that turn's stream_error ----
# (pipeline/serving/replay.py's docstring, "What a turn's stream must be")

def _ended(doc):
    return [r for r in doc["turns"] if r["status"] != "cancelled"]


@pytest.mark.parametrize("shape, fragment", [
    ({"field": "both"}, "text in both `delta.content` and `delta.reasoning_content`"),
    ({"field": "split"}, "text in both `delta.content` and `delta.reasoning_content`"),
    ({"choices": 2}, "`choices` holds 2 choices"),
    ({"choice_index": 1}, "a choice with index 1"),
], ids=["same-words-in-both-fields", "reasoning-then-content", "two-choices", "choice-index-1"])
def test_a_reply_is_never_counted_twice(server, tok, shape, fragment):
    """The attack: a server that streams half of each reply, each word in two places (both delta fields, or
    two choices), or spreads it over two fields, was counted as a whole reply at half the work (T x1.64).
    Each such turn is a stream_error naming what was wrong, and counts nothing past the shape's first chunk."""
    server.script(short_by=4, **shape)  # 4 of max_tokens 8 words: double-counted they looked complete
    doc = run(server, tok, conversations(n=2, turns=3, max_tokens=8), c=1, window=0.2)
    ended = _ended(doc)
    assert ended and all(r["status"] == "stream_error" and fragment in r["error"] for r in ended), ended[0]
    assert all(r["tokens"] <= 2 for r in ended)  # split: its reasoning half before content came
    lv = metrics.level(doc, gpus=1)
    assert not lv["valid"] and "stream_error" in lv["invalid_reasons"][0] and fragment in lv["invalid_reasons"][0]


def test_a_reply_in_reasoning_content_alone_counts_once(server, tok):
    server.script(field="reasoning_content")
    doc = run(server, tok, conversations(n=2, turns=3, max_tokens=6), c=1, window=0.2)
    ended = _ended(doc)
    assert ended and all(r["status"] == "ok" and r["tokens"] == r["tokens_streamed"] == 6 for r in ended)


# 2 MB of nested lists: orjson alone overflowed the C stack on it (a segfault of the evaluator, no result)
DEEP = "[" * 1_000_000 + "]" * 1_000_000
BAD_CHUNKS = {
    # name: (the payload after `data: `, what the turn's error says, more of the script)
    "delta-string": ('{"choices":[{"index":0,"delta":"oops"}]}', "`delta` is a string, not an object", {}),
    "delta-list": ('{"choices":[{"index":0,"delta":[" the"]}]}', "`delta` is a list", {}),
    "content-number": ('{"choices":[{"index":0,"delta":{"content":7}}]}', "`delta.content` is a number", {}),
    "content-list": ('{"choices":[{"index":0,"delta":{"content":[" the"]}}]}', "`delta.content` is a list", {}),
    "content-object": ('{"choices":[{"index":0,"delta":{"content":{"text":" the"}}}]}', "`delta.content` is an object", {}),
    "content-true": ('{"choices":[{"index":0,"delta":{"content":true}}]}', "`delta.content` is a boolean", {}),
    "reasoning-number": ('{"choices":[{"index":0,"delta":{"reasoning_content":1.5}}]}', "`delta.reasoning_content` is a number", {}),
    "choices-object": ('{"choices":{}}', "`choices` is an object, not a list", {}),
    "choices-string": ('{"choices":"the"}', "`choices` is a string", {}),
    "choice-null": ('{"choices":[null]}', "the choice is null", {}),
    "choice-list": ('{"choices":[[{"delta":{"content":" the"}}]]}', "the choice is a list", {}),
    "two-choices": ('{"choices":[{"index":0,"delta":{}},{"index":1,"delta":{}}]}', "holds 2 choices", {}),
    "index-1": ('{"choices":[{"index":1,"delta":{"content":" the"}}]}', "a choice with index 1", {}),
    "index-string": ('{"choices":[{"index":"0","delta":{}}]}', "a choice with index '0'", {}),
    "index-false": ('{"choices":[{"index":false,"delta":{}}]}', "a choice with index False", {}),
    "index-float": ('{"choices":[{"index":0.0,"delta":{}}]}', "a choice with index 0.0", {}),
    "index-null": ('{"choices":[{"index":null,"delta":{}}]}', "a choice with index None", {}),
    "finish-number": ('{"choices":[{"index":0,"delta":{},"finish_reason":1}]}', "`finish_reason` is a number", {}),
    "finish-object": ('{"choices":[{"index":0,"delta":{},"finish_reason":{"type":"length"}}]}', "`finish_reason` is an object", {}),
    "usage-list": ('{"choices":[],"usage":[1,2]}', "`usage` is a list", {}),
    "usage-number": ('{"choices":[],"usage":12}', "`usage` is a number", {}),
    "null": ("null", "JSON of another kind (null)", {}),
    "number": ("7", "JSON of another kind (a number)", {}),
    "list": ('[{"choices":[]}]', "JSON of another kind (a list)", {}),
    "done-quoted": ('"[DONE]"', "JSON of another kind (a string)", {}),
    "done-lowercase": ("[done]", "not JSON", {}),
    "done-suffixed": ("[DONE]x", "not JSON", {}),
    "empty": ("", "not JSON", {}),
    "truncated": ('{"choices":[{"index":0,"delta":{"content":" the', "not JSON", {}),
    "nan": ('{"choices":[{"index":NaN}]}', "not JSON", {}),
    "number-beyond-double": ('{"choices":[{"index":1e999}]}', "not JSON", {}),
    "nested-too-deep": (DEEP, "not JSON (RecursionError", {}),
    "nested-too-deep-in-a-choice": ('{"choices":[{"index":0,"delta":{"content":' + DEEP + "}}]}",
                                    "not JSON (RecursionError", {}),
    "lone-surrogate": ('{"choices":[{"index":0,"delta":{"content":"\\ud800"}}]}', "not JSON", {}),
    "not-utf8": ('{"choices":[{"index":0,"delta":{"content":" th\xff"}}]}', "not JSON", {"bad_chunk_encoding": "latin-1"}),
    "error-object": ('{"error":{"message":"out of memory","code":500}}', "the server streamed an error", {}),
    "error-kind": ('{"object":"error","message":"boom"}', "the server streamed an error", {}),
    "text-after-finish": ('{"choices":[{"index":0,"delta":{"content":" the"},"finish_reason":"stop"}]}',
                          "text after the choice's finish_reason", {}),
    "more-text-than-max-tokens": ('{"choices":[{"index":0,"delta":{"content":"' + "x" * 70_000 + '"}}]}',
                                  "characters of text, more than 4 tokens (max_tokens) can spell", {}),
    "a-line-of-9-MB": ("x", "a line of more than 8,388,608 bytes", {"bad_chunk_repeat": 9 << 20, "window": 0.6}),
    "a-line-never-ended": ("x", "a line of more than 8,388,608 bytes", {"bad_chunk_repeat": 9 << 20,
                                                                       "bad_chunk_newline": False, "window": 0.6}),
}


@pytest.mark.parametrize("name", list(BAD_CHUNKS))
def test_any_other_shape_of_chunk_is_that_turn_s_stream_error(server, tok, name):
    """One chunk of any other shape, after the first content chunk of every reply: that turn is a
    stream_error naming the chunk and what was wrong, the replay goes on (the next turn is sent), nothing
    raises. Before this guard `"delta": "oops"`, `"content": 7` or `"choices": {}` raised in the replayer
    and the whole evaluation ended in exit 3 with no result."""
    payload, fragment, extra = BAD_CHUNKS[name]
    extra = dict(extra)
    window = extra.pop("window", 0.15)  # a few lines of megabytes take longer
    server.script(bad_chunk_every=1, bad_chunk=payload, **extra)
    doc = run(server, tok, conversations(n=2, turns=2, max_tokens=4), c=1, window=window)
    ended = _ended(doc)
    assert len(ended) >= 2  # a failed turn ends its conversation, and the lane went on with the next
    for r in ended:
        assert r["status"] == "stream_error" and fragment in r["error"], r["error"][:500]
        assert re.match(r"chunk [0-9]+ of the stream: ", r["error"]) and len(r["error"]) < 1000
        # the first content chunk's word before the bad one (and the finishing chunk's own word)
        assert r["tokens"] <= (2 if name == "text-after-finish" else 1)


@pytest.mark.parametrize("payload", [
    '{"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}',  # role only, empty text
    '{"choices":[{"index":0,"delta":{"content":null,"reasoning_content":null,"tool_calls":null},"finish_reason":null}]}',
    '{"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":"many","extra":[1]}}',  # usage only
    '{"choices":null,"usage":null}', "{}", '{"choices":[{"delta":null}]}', '{"choices":[{"index":0}]}',
    '{"choices":[{"index":0,"delta":{"content":""},"finish_reason":""}]}', '{"error":null,"choices":[]}',
], ids=["role-only", "all-null", "usage-only", "nulls", "empty-object", "delta-null", "no-delta", "empty-strings",
        "error-null"])
def test_chunks_that_carry_no_text_are_accepted(server, tok, payload):
    server.script(bad_chunk_every=1, bad_chunk=payload)
    doc = run(server, tok, conversations(n=2, turns=2, max_tokens=4), c=1, window=0.15)
    ended = _ended(doc)
    assert ended and all(r["status"] == "ok" and r["tokens"] == 4 for r in ended), ended[0]["error"]
    assert all(r["usage"] == {"prompt_tokens": r["usage"]["prompt_tokens"], "completion_tokens": 4,
                              "total_tokens": r["usage"]["total_tokens"]} for r in ended)


def test_one_bad_chunk_in_fifty_requests_fails_that_turn_and_invalidates_the_level(server, tok):
    server.script(bad_chunk_every=50, bad_chunk='{"choices":[{"index":0,"delta":"oops"}]}')
    doc = run(server, tok, conversations(n=8, turns=10, max_tokens=4), c=4, window=1.0)
    ended = _ended(doc)
    bad = [r for r in ended if r["status"] == "stream_error"]
    assert len(ended) >= 60 and bad and all(r["status"] in ("ok", "stream_error") for r in ended)
    assert 0 <= len(server.log()["requests"]) // 50 - len(bad) <= 1
    lv = metrics.level(doc, gpus=1)
    reason = lv["invalid_reasons"][0]
    assert not lv["valid"] and f"{len(bad)} stream_error" in reason and "`delta` is a string" in reason, reason
    assert lv["T"] > 0 and lv["I"] > 0


def test_the_chunk_parse_is_total():
    """Thousands of chunk shapes built from every JSON kind, at every place the parse reads: each is taken
    or is that turn's stream_error; none raises, and the text kept is only strings of one field."""
    import orjson

    rng = random.Random(40)
    leaves = [None, True, False, 0, 1, -1, 0.0, 2.5, 1e300, "", " the", "[DONE]", "\x00", "\u2028", "😀", [], {}]

    def value(depth=0):
        roll = rng.random()
        if depth > 3 or roll < 0.55:
            return rng.choice(leaves)
        if roll < 0.75:
            return [value(depth + 1) for _ in range(rng.randint(0, 3))]
        keys = ["choices", "delta", "content", "reasoning_content", "index", "finish_reason", "usage", "error",
                "object", "role", "prompt_tokens_details", "cached_tokens", "completion_tokens"]
        return {rng.choice(keys): value(depth + 1) for _ in range(rng.randint(0, 4))}

    def chunk_like():
        delta = {k: value(2) if rng.random() < 0.5 else rng.choice([" the", None, ""]) for k in
                 rng.sample(["content", "reasoning_content", "role", "tool_calls"], rng.randint(0, 3))}
        choice = {"delta": delta if rng.random() < 0.8 else value(1)}
        if rng.random() < 0.7:
            choice["index"] = 0 if rng.random() < 0.7 else value(2)
        if rng.random() < 0.4:
            choice["finish_reason"] = rng.choice(["length", "stop", None, ""]) if rng.random() < 0.7 else value(2)
        obj = {"choices": [choice] * rng.choice([1, 1, 1, 0, 2]) if rng.random() < 0.85 else value(1)}
        if rng.random() < 0.3:
            obj["usage"] = value(1)
        if rng.random() < 0.05:
            obj["error"] = value(1)
        return obj if rng.random() < 0.9 else value()

    outcomes = set()
    for i in range(3000):
        turn = replay._Turn(0, "c", 0, 0, False, 8)
        lines = [b"data: " + orjson.dumps(chunk_like()) for _ in range(rng.randint(1, 6))]
        if i % 10 == 0:  # and bytes: cut, non-UTF-8, [DONE] variants, other SSE lines
            lines.insert(rng.randrange(len(lines) + 1), rng.choice(
                [b"data: " + bytes(rng.randrange(256) for _ in range(8)), b"data: [DONE]", b"data:[DONE] ",
                 b"data: [DONE]\r", b"event: error", b": keep-alive", b"data: " + lines[0][6:-3], b"data:",
                 b"data: " + b'{"a":' * 200_000 + b"1" + b"}" * 200_000]))
        for n, line in enumerate(lines):
            going = replay._take(turn, line, n, orjson.loads)
            assert isinstance(going, bool)
            if not going:
                break
        assert turn.status in (None, "stream_error")
        if turn.status:
            assert turn.error.startswith(f"chunk {turn.chunks} of the stream: ")
        assert all(isinstance(p, str) and p for p in turn.pieces)
        assert turn.chars == sum(map(len, turn.pieces)) == (turn.ends[-1] if turn.ends else 0)
        assert turn.usage is None or isinstance(turn.usage, dict)
        outcomes.add(turn.status or ("done" if turn.finished else "open"))
    assert outcomes == {"stream_error", "done", "open"}


def test_canaries_replay_fixed_history_and_keep_their_tokens(server, tok):
    convs = conversations(n=2, turns=3, max_tokens=5, canary=(0,))
    server.script()
    doc = run(server, tok, convs, c=1, window=0.3)
    for req in server.log()["requests"]:
        messages = req["body"]["messages"]
        if messages[1]["content"].startswith("conv0"):
            replies = [m["content"] for m in messages if m["role"] == "assistant"]
            assert replies == [f"conv0 fixed reply {k}" for k in range(len(replies))]
    canary = [r for r in doc["turns"] if r["canary"] and r["status"] == "ok"]
    other = [r for r in doc["turns"] if not r["canary"]]
    assert canary and other and all("token_ids" not in r for r in other)
    assert all(len(r["token_ids"]) == 5 for r in canary)


def test_the_audit_keeps_a_random_sample_of_live_turns_with_their_exact_requests(server, tok):
    # (issue 40) the sample the evaluation re-sends to the baseline: live turns that ended ok, each with the
    # body exactly as sent and the reply's token ids as counted; OS randomness, so two runs with the same
    # seed keep different turns; and resend() gets the same tokens back from a server whose replies follow
    # from the prompt, other tokens from one whose replies do not.
    convs = conversations(n=6, turns=5, max_tokens=6, canary=(0,))
    server.script(words_from="prompt")
    doc = run(server, tok, convs, c=4, window=0.4)
    received = [r["body"] for r in server.log()["requests"]]
    ok_live = [r for r in doc["turns"] if not r["canary"] and r["status"] == "ok"]
    assert len(ok_live) > 2 * replay.AUDIT_SAMPLE and doc["facts"]["audit_population"] >= len(ok_live)
    audit = doc["audit"]
    assert len(audit) == replay.AUDIT_SAMPLE  # only finished turns are kept, and with this script all are ok
    for item in audit:
        assert item["conversation"] != "conv0"  # never a canary
        assert json.loads(item["request"]) in received
        record = next(r for r in doc["turns"] if (r["lane"], r["conversation"], r["pass"], r["turn"]) ==
                      (item["lane"], item["conversation"], item["pass"], item["turn"]))
        assert record["status"] == "ok" and len(item["token_ids"]) == record["tokens"] == item["max_tokens"]
        assert "_ids" not in record
    again = run(server, tok, convs, c=4, window=0.4)
    keys = [{(i["conversation"], i["pass"], i["turn"]) for i in d["audit"]} for d in (doc, again)]
    assert keys[0] != keys[1]
    bodies = [(i["request"].encode(), i["max_tokens"]) for i in audit]
    got = asyncio.run(replay.resend(server.url, bodies, tok, engine="sglang"))
    assert [g["token_ids"] for g in got] == [i["token_ids"] for i in audit] and {g["status"] for g in got} == {"ok"}
    server.script(words_from="prompt", words_offset=3)
    got = asyncio.run(replay.resend(server.url, bodies, tok, engine="sglang"))
    assert all(g["token_ids"][0] != i["token_ids"][0] for g, i in zip(got, audit))


def test_tokens_split_across_chunks_belong_to_the_chunk_that_completes_them(server, tok):
    server.script(split_words=True, token_s=0.002)
    doc = run(server, tok, conversations(n=1, turns=2, max_tokens=6), c=1, window=0.3)
    r = next(r for r in doc["turns"] if r["status"] == "ok")
    assert r["chunk_tokens"] == [0, 1] * 6 and r["tokens"] == 6
    # the first token is the second chunk's; under load both chunks may come in one read, at one instant
    assert r["first_ns"] == r["chunk_ns"][1] >= r["chunk_ns"][0]


def test_special_tokens_are_counted_and_kept_out_of_the_history(server):
    """A model forced past its end writes <|im_end|>; kept in the text it counts (one token each under the
    pinned tokenizer), and the history the next turn sends holds the reply without it."""
    from pipeline.serving import tokenizer as pinned

    tok = pinned.load()
    assert "<|im_end|>" in replay.special_tokens(tok)
    server.script(special_every=3)
    doc = run(server, tok, conversations(n=1, turns=3, max_tokens=9), c=1, window=0.3)
    ok = [r for r in doc["turns"] if r["status"] == "ok"]
    assert ok and all(r["tokens"] == 9 for r in ok)
    requests = server.log()["requests"]
    checked = False
    for earlier, later in zip(requests, requests[1:]):
        if later["body"]["messages"][:len(earlier["body"]["messages"])] != earlier["body"]["messages"]:
            continue  # a new conversation
        reply = later["body"]["messages"][len(earlier["body"]["messages"])]
        assert reply["role"] == "assistant" and "<|im_end|>" not in reply["content"]
        assert reply["content"] == served_reply(earlier, special_every=3).replace("<|im_end|>", "")
        checked = True
    assert checked


def test_attribution_follows_the_offsets_of_the_whole_reply():

    # chunk ends (characters so far) 3, 5, 9; tokens ending at 2, 3, 7, 9 and one (a trailing space) at 9
    assert replay.attribute([3, 5, 9], [2, 3, 7, 9, 9]) == [2, 0, 3]


def test_pinned_tokenizer_counts_by_offsets_like_counting_each_prefix():
    from pipeline.serving import tokenizer as pinned

    try:
        tok = pinned.load()
    except pinned.TokenizerError as exc:
        pytest.fail(f"the pinned tokenizer does not load: {exc}")
    text = "def naïve(x):\n    return x  # ✓ 漢字 ok\n" * 3
    ends = list(range(1, len(text) + 1))  # a chunk per character, the worst case for a split token
    enc = tok.encode(text, add_special_tokens=False)
    per_chunk = replay.attribute(ends, [end for _, end in enc.offsets])
    assert sum(per_chunk) == len(enc.ids) == pinned.count(text)
    token_ends = {end for _, end in enc.offsets}
    assert len(token_ends) < len(ends)  # some characters end no token (a word still growing)...
    so_far, checked = 0, 0
    for end, n in zip(ends, per_chunk):
        so_far += n
        if end in token_ends:
            # ...and where the text received so far ends a token, the count so far is the prefix's own count
            assert so_far == pinned.count(text[:end]), repr(text[:end])
            checked += 1
    assert checked == len(token_ends)
    # offsets are in characters (a multi-byte character's byte tokens all end with it)
    assert max(token_ends) == len(text)


def _cli(server, dataset_path, out, *extra):
    cmd = [sys.executable, "-m", "pipeline", "serving", "replay", "--url", server.url, "--dataset", str(dataset_path),
           "--concurrency", "2", "--window", "0.6", "--warmup", "0.2", "--engine", "sglang", "--seed", "1",
           "--json", str(out), "--turn-timeout", "10", *extra]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_replay_command_replays_the_public_sample_with_the_pinned_tokenizer(server, tmp_path):
    """The CLI end to end: the committed public sample (dataset.py's file), the pinned tokenizer by default."""
    from pipeline.serving import dataset, tokenizer as pinned

    sample = ROOT / "datasets" / "serving" / "public-sample.json.gz"
    document = dataset.read(sample)
    out = tmp_path / "out" / "replay.json"
    server.script(token_s=0.001, record_bodies=False)
    done = _cli(server, sample, out, "--gpus", "2")
    assert done.returncode == 0, done.stderr
    written = json.loads(out.read_text())
    facts = written["facts"]
    assert facts["dataset_sha256"] == document["metadata"]["content_sha256"] == dataset.content_sha256(document)
    assert facts["tokenizer"] == "pinned" and facts["tokenizer_sha256"] == pinned.pin()["sha256"]
    assert written["level"]["valid"] and written["level"]["gpus"] == 2 and written["level"]["T"] > 0
    ok = [r for r in written["turns"] if r["status"] == "ok"]
    # the server's words are one Qwen token each: the pinned tokenizer counts exactly max_tokens
    assert ok and all(r["tokens"] == r["max_tokens"] for r in ok)
    ids = {c["id"] for c in document["conversations"]}
    assert {r["conversation"] for r in written["turns"]} <= ids
    assert "c=2" in done.stdout and f"to {out}" in done.stdout


def test_replay_command_refuses_an_edited_dataset_and_writes_nothing(server, tmp_path):
    from pipeline.serving import dataset

    document = dataset.read(ROOT / "datasets" / "serving" / "public-sample.json.gz")
    document["conversations"][0]["turns"][0]["max_tokens"] += 1  # edited after generation
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(document))
    out = tmp_path / "replay.json"
    done = _cli(server, edited, out)
    assert done.returncode == 1 and "edited after it was generated" in done.stderr and not out.exists()
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    done = _cli(server, broken, out)
    assert done.returncode == 1 and "not JSON" in done.stderr and not out.exists()
    server.script(healthy=False)
    done = _cli(server, ROOT / "datasets" / "serving" / "public-sample.json.gz", out)
    assert done.returncode == 1 and "not ready" in done.stderr and not out.exists()
