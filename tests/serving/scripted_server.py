"""A scripted OpenAI-compatible streaming server: a real HTTP process whose timing the test controls.

Run as `python tests/serving/scripted_server.py [--port P] [--script JSON] [--tree DIR] [--chunk-delay-ms N]`;
it prints `PORT <n>` once it listens (port 0 picks a free one) and serves until killed. `--script` sets
the fields of SCRIPT below from the start; `--tree` reads more of them from DIR/python/sglang/srt/_scripted.json
when that file exists (how a test's patch changes the candidate's server: `python -m pipeline serving
evaluate` launches this server from a test pin's template with {tree}, the tree the patch was applied
to); `--chunk-delay-ms` is the template's delay knob (every content chunk waits that long first). The tests talk to it over loopback like the replayer talks to
an engine:

  POST /v1/chat/completions  an SSE stream of chat.completion.chunk objects, one word a chunk by default
                             (each word is one token under the pinned tokenizer and under the tests'
                             word-level one), for the forced length the body asks for (SGLang's
                             `max_tokens`, or transformers' `generation_config` string)
  GET  /health               200 (503 while the script says unhealthy)
  POST /flush_cache          200, counted (the script can make it answer 400, as SGLang does while busy)
  POST /_script              replace the script (JSON, the fields of SCRIPT below) and clear the log
  GET  /_log                 what was received: every request's body, its start and end on the server's
                             perf_counter_ns clock, the most requests in flight at once, the flushes

The script's modes: `ttft_s` and `token_s` set the timing; `buffer` computes the stream with that timing
but sends it all at the end; `short_by` stops that many tokens early (and says finish_reason "stop");
`fail_every` answers every k-th request with HTTP 500 (k-th of the launch's requests, whatever
`words_from` makes of their words; so do `bad_chunk_every` and `hang_from`); `usage_factor` makes `usage` lie about the
completion tokens and claim every prompt token was cached; `hang_s` stalls before the first token (from
the `hang_from`-th request of the launch on: 2 lets a launch's warm-up request through);
`break_after` cuts the connection after that many tokens; `split_words` sends each word in two chunks
(" th", "e": a token split across chunks); `special_every` makes every k-th token `<|im_end|>` (what a
model forced past its end writes); `timestamps` puts the server's send time
(`t_send_ns`, perf_counter_ns: the same clock as the client's on this machine) in every chunk, and
`log_sends` keeps every content chunk's send time in the request's log entry (`sends`).
For the evaluation's tests: `words_from: "prompt"` picks a reply's words from a hash of its conversation
(every message after the system message, whose first line is the run's random marker), so the same prompt
gets the same reply from every launch (a canary agrees with itself), and `words_offset` shifts them (a
server whose greedy tokens differ); `die_after` ends the process at the start of that many-plus-one'th
chat request (a server that crashes mid-level), `exit_at_start` exits before it listens (a launch that
fails), `spawn_detached` starts a grandchild in a session of its own that sleeps (what a stop must kill too),
`flush_hang_s` makes /flush_cache answer that late (a server that stops answering between levels),
`answer_hang_s` a request that is not streamed (GSM8K's) wait that long first.
For the audit (serving-track.md, "Only the model's own replies count"): `words_from: "whole"` picks the words
from a hash of every message, the system message's first line (the run's marker) included, as a real model's
greedy reply depends on its whole prompt; `filler_live` answers a live turn (one whose history holds a reply
of this server's own words) with other words of the same length (WORDS shifted by FILLER_SHIFT), while a
turn whose history holds only the dataset's fixed replies (a canary, a conversation's first turn) is
answered properly; `reply_cache` serves the stored reply for any request whose messages, less the system
message's first line, were seen before by this launch (across runs and levels: a cache of earlier replies
keyed on the content a run's marker cannot change); `reply_cache: "skeleton"` keys on that content with every
code identifier replaced by a placeholder (a cache that looks past the replay's renaming); each request's
log entry says whether the cache held its key (`cached`).
The shapes of a stream (what the replay must refuse, pipeline/serving/replay.py's docstring): `field` puts a
reply's text in `content` (the default), `reasoning_content`, `both` (every word in both fields of its chunk)
or `split` (the first half of the words in reasoning_content, the rest in content: a reasoning parser's split);
`choices` sends that many choices a chunk (each the same words, index 0, 1, ...) and `choice_index` numbers
the one choice otherwise; `bad_chunk_every` k sends, in every k-th request (1: all), one extra line
`data: <bad_chunk>` after the first content chunk, the payload `bad_chunk` repeated `bad_chunk_repeat` times
and encoded as `bad_chunk_encoding` (latin-1 makes any byte), and `bad_chunk_newline` false leaves that
line without its end (the stream goes on after it on the same line). `done_payload` replaces `[DONE]`.
`asgi_app` is a minimal ASGI app (GET /health, GET /stream: five chunks at once) for the launch's
delay knob, which wraps what uvicorn serves.
A request with `"stream": false` gets one chat.completion object with the whole reply.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import re
import time

import orjson
from aiohttp import web

from child_server import ChildServer  # noqa: E402 - beside this script, also when run as one

SCRIPT = {
    "ttft_s": 0.0,
    "token_s": 0.0,
    "words_per_chunk": 1,
    "split_words": False,
    "special_every": 0,
    "buffer": False,
    "short_by": 0,
    "fail_every": 0,
    "usage_factor": 1.0,
    "hang_s": 0.0,
    "hang_from": 0,
    "break_after": None,
    "timestamps": False,
    "log_sends": False,
    "record_bodies": True,
    "healthy": True,
    "flush_status": 200,
    "done": True,
    "words_from": "index",
    "words_offset": 0,
    "chunk_delay_s": 0.0,
    "die_after": None,
    "exit_at_start": None,
    "spawn_detached": False,
    "flush_hang_s": 0.0,
    "answer_hang_s": 0.0,
    "field": "content",
    "choices": 1,
    "choice_index": 0,
    "bad_chunk_every": 0,
    "bad_chunk": "",
    "bad_chunk_repeat": 1,
    "bad_chunk_encoding": "utf-8",
    "bad_chunk_newline": True,
    "done_payload": "[DONE]",
    "filler_live": False,
    "reply_cache": False,
}

FILLER_SHIFT = 7  # filler_live's words: every position a different word from the proper reply's

# Common English words, each one token for Qwen's BPE (a leading space and letters are one pre-token).
WORDS = (" the", " of", " and", " to", " in", " is", " that", " it", " for", " on", " with", " as", " was",
         " by", " at", " from", " this", " be", " or", " an")


def word(index: int, j: int, special_every: int = 0) -> str:
    """The j-th token the server streams for request `index`."""
    if special_every and (j + 1) % special_every == 0:
        return "<|im_end|>"
    return WORDS[(index + j) % len(WORDS)]


def prompt_index(body: dict, offset: int = 0) -> int:
    """A reply's first word, from its conversation less the system message (whose first line is the run's
    marker): the same prompt gives the same reply from any launch."""
    import hashlib

    msgs = body.get("messages") or []
    digest = hashlib.sha256(orjson.dumps(msgs[1:], option=orjson.OPT_SORT_KEYS)).digest()
    return int.from_bytes(digest[:4], "big") + offset


def whole_index(body: dict, offset: int = 0) -> int:
    """A reply's first word from every message, the run's marker included (words_from "whole")."""
    import hashlib

    digest = hashlib.sha256(orjson.dumps(body.get("messages") or [], option=orjson.OPT_SORT_KEYS)).digest()
    return int.from_bytes(digest[:4], "big") + offset


def content_key(body: dict, skeleton: bool = False) -> bytes:
    """The request's messages less the system message's first line (the run's marker and pass): what
    reply_cache keys its stored replies on; with `skeleton`, every code identifier replaced by one
    placeholder too (a cache that reads the replay's renaming, pipeline/serving/renaming.py, and looks
    past it)."""
    msgs = list(body.get("messages") or [])
    if msgs and msgs[0].get("role") == "system":
        msgs[0] = {**msgs[0], "content": str(msgs[0].get("content", "")).split("\n", 1)[-1]}
    if skeleton:  # every word with an underscore or a lower-case letter before an upper-case one
        msgs = [{**m, "content": CODE_NAME.sub("#", str(m.get("content", "")))} for m in msgs]
    return orjson.dumps(msgs, option=orjson.OPT_SORT_KEYS)


CODE_NAME = re.compile(r"\b\w*(?:_|[a-z][A-Z])\w*\b")  # the skeleton cache's own idea of a renamed name
OWN_WORDS = frozenset(w.strip() for w in WORDS)


def live_turn(body: dict) -> bool:
    """Whether the history holds a reply made of this server's words (its own earlier reply: a live turn);
    the dataset's fixed replies (canaries, staggered starts) are sentences with other words."""
    for m in body.get("messages") or []:
        if m.get("role") == "assistant":
            pieces = str(m.get("content", "")).split()
            if pieces and all(p in OWN_WORDS for p in pieces):
                return True
    return False


class State:
    def __init__(self) -> None:
        self.script = dict(SCRIPT)
        self.reset()

    def reset(self) -> None:
        self.requests: list[dict] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.flushes: list[int] = []  # perf_counter_ns of each flush call
        self.count = 0
        self.cache: dict[bytes, int] = {}  # reply_cache: content_key -> the stored reply's index


def forced_length(body: dict) -> int:
    if body.get("generation_config") is not None:
        # transformers serve's convention: a JSON string (an object there is a server error)
        config = json.loads(body["generation_config"])
        return int(config["max_new_tokens"])
    return int(body.get("max_tokens") or 16)


def chunk(cid: str, content: str | None, finish: str | None = None, t_send: int | None = None,
          field: str = "content", choices: int = 1, index: int = 0) -> bytes:
    if content is None:
        delta: dict = {}
    elif field == "both":
        delta = {"reasoning_content": content, "content": content}
    else:
        delta = {field: content}
    choice: dict = {"index": index, "delta": delta}
    if finish is not None:
        choice["finish_reason"] = finish
    listed = [choice] if choices == 1 else [{**choice, "index": i} for i in range(choices)]
    obj: dict = {"id": cid, "object": "chat.completion.chunk", "created": 0, "model": "scripted",
                 "choices": listed}
    if t_send is not None:
        obj["t_send_ns"] = t_send
    return b"data: " + orjson.dumps(obj) + b"\n\n"


async def chat(request: web.Request) -> web.StreamResponse:
    state: State = request.app["state"]
    script = state.script
    t_start = time.perf_counter_ns()
    body = orjson.loads(await request.read())  # a long history is a large body: orjson keeps up
    state.count += 1
    index = number = state.count  # number: the request's place in this launch's count, whatever its words
    if script["die_after"] is not None and index > int(script["die_after"]):
        print(f"scripted server: dying at request {index} as scripted (die_after {script['die_after']})", flush=True)
        os._exit(70)
    if script["words_from"] == "prompt":
        index = prompt_index(body, int(script["words_offset"]))
    elif script["words_from"] == "whole":
        index = whole_index(body, int(script["words_offset"]))
    cached = None
    if script["reply_cache"] and body.get("stream") is not False:
        key = content_key(body, skeleton=script["reply_cache"] == "skeleton")
        cached = key in state.cache
        index = state.cache.setdefault(key, index)
    if script["filler_live"] and live_turn(body):
        index += FILLER_SHIFT
    entry = {"index": index, "t_start_ns": t_start, "t_end_ns": None, "cached": cached,
             "peer": (request.transport.get_extra_info("peername") or [None, None])[1],
             "body": body if script["record_bodies"] else {k: v for k, v in body.items() if k != "messages"}}
    state.requests.append(entry)
    state.in_flight += 1
    state.max_in_flight = max(state.max_in_flight, state.in_flight)
    try:
        if script["fail_every"] and number % script["fail_every"] == 0:
            return web.json_response({"error": {"message": "scripted failure", "code": 500}}, status=500)
        n = forced_length(body)
        sent = max(0, n - int(script["short_by"]))
        if body.get("stream") is False:
            if script["answer_hang_s"]:
                await asyncio.sleep(script["answer_hang_s"])
            text = "".join(word(index, j, script["special_every"]) for j in range(sent))
            usage = {"prompt_tokens": 0, "completion_tokens": sent, "total_tokens": sent}
            return web.json_response({"id": f"chatcmpl-{index}", "object": "chat.completion", "created": 0,
                                      "model": "scripted", "usage": usage, "choices": [{
                                          "index": 0, "finish_reason": "length",
                                          "message": {"role": "assistant", "content": text}}]})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        cid = f"chatcmpl-{index}"
        per = max(1, int(script["words_per_chunk"]))
        stamps = script["timestamps"]
        sends: list[int] | None = [] if script["log_sends"] else None
        if sends is not None:
            entry["sends"] = sends
            # which turn this is, without keeping the body: the system message's first line (the run's
            # marker and pass), the conversation's first message, the number of messages
            msgs = body.get("messages") or [{}, {}]
            entry["key"] = json.dumps([str(msgs[0].get("content", "")).split("\n\n", 1)[0],
                                       str(msgs[1].get("content", ""))[:200], len(msgs)])
        pending: list[bytes] = []
        if script["hang_s"] and number >= int(script["hang_from"]):
            await asyncio.sleep(script["hang_s"])
        if script["ttft_s"]:
            await asyncio.sleep(script["ttft_s"])
        await resp.write(chunk(cid, None) if not script["buffer"] else b"")
        k = 0
        paced_from = time.perf_counter()
        shape = script["field"]
        bad = b""
        if script["bad_chunk_every"] and number % int(script["bad_chunk_every"]) == 0:
            bad = b"data: " + (script["bad_chunk"] * int(script["bad_chunk_repeat"])).encode(script["bad_chunk_encoding"])
            bad += b"\n\n" if script["bad_chunk_newline"] else b""
        while k < sent:
            words = "".join(word(index, j, script["special_every"]) for j in range(k, min(sent, k + per)))
            field = shape if shape != "split" else "reasoning_content" if 2 * k < sent else "content"
            k = min(sent, k + per)
            data = chunk(cid, words, t_send=time.perf_counter_ns() if stamps else None, field=field,
                         choices=int(script["choices"]), index=int(script["choice_index"]))
            if bad:
                data, bad = data + bad, b""  # after the first content chunk
            if script["split_words"]:
                data = chunk(cid, words[:2]) + chunk(cid, words[2:])
            if script["buffer"]:
                pending.append(data)
            elif script["split_words"]:
                head, _, tail = data.partition(b"\n\n")
                await resp.write(head + b"\n\n")
                await asyncio.sleep(0.001)  # so the halves arrive as two reads, at two times
                await resp.write(tail)
            else:
                if script["chunk_delay_s"]:
                    await asyncio.sleep(script["chunk_delay_s"])
                if sends is not None:
                    sends.append(time.perf_counter_ns())
                await resp.write(data)
            if script["break_after"] is not None and k >= script["break_after"]:
                # an abrupt end of the connection mid-stream: no final chunk, no terminating chunk
                request.transport.close()
                return resp
            if script["token_s"] and k < sent:
                # an absolute schedule (token k at first + k * token_s): a late wake-up is caught up, so
                # the stream keeps its rate instead of drifting by every sleep's overshoot
                await asyncio.sleep(max(0.0, paced_from + k / per * script["token_s"] - time.perf_counter()))
        factor = float(script["usage_factor"])
        prompt = sum(len(str(m.get("content", ""))) // 4 for m in body.get("messages", []))
        usage = {"prompt_tokens": prompt, "completion_tokens": int(round(sent * factor)),
                 "total_tokens": prompt + int(round(sent * factor))}
        if factor != 1.0:
            usage["prompt_tokens_details"] = {"cached_tokens": prompt}
        pending.append(chunk(cid, None, finish="length" if sent == n else "stop"))
        # usage in a chunk of its own with no choices, as SGLang sends it under include_usage
        pending.append(b"data: " + json.dumps({"id": cid, "object": "chat.completion.chunk", "choices": [],
                                               "usage": usage}).encode() + b"\n\n")
        if script["done"]:
            pending.append(b"data: " + script["done_payload"].encode() + b"\n\n")
        await resp.write(b"".join(pending))
        await resp.write_eof()
        return resp
    except ConnectionResetError:
        # the client went away mid-stream (a turn it refused, a timeout): nothing to log, since a test reads
        # neither of this process's pipes and a traceback a request would fill them until the server stalls
        return web.Response(status=499)
    finally:
        state.in_flight -= 1
        entry["t_end_ns"] = time.perf_counter_ns()


async def health(request: web.Request) -> web.Response:
    ok = request.app["state"].script["healthy"]
    return web.Response(status=200 if ok else 503, text="ok" if ok else "starting")


async def flush(request: web.Request) -> web.Response:
    state: State = request.app["state"]
    state.flushes.append(time.perf_counter_ns())
    if state.script["flush_hang_s"]:
        await asyncio.sleep(state.script["flush_hang_s"])
    status = int(state.script["flush_status"])
    return web.Response(status=status, text="Cache flushed.\n" if status == 200 else "pending requests\n")


async def set_script(request: web.Request) -> web.Response:
    state: State = request.app["state"]
    update = await request.json()
    unknown = set(update) - set(SCRIPT)
    if unknown:
        return web.json_response({"error": f"unknown script fields {sorted(unknown)}"}, status=400)
    state.script = {**SCRIPT, **update}
    state.reset()
    return web.json_response(state.script)


async def get_log(request: web.Request) -> web.Response:
    state: State = request.app["state"]
    return web.json_response({"requests": state.requests, "max_in_flight": state.max_in_flight,
                              "in_flight": state.in_flight, "flushes": state.flushes})


async def asgi_app(scope, receive, send):
    """GET /health: ok; GET /stream: five body chunks sent one after another with no wait between them."""
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    if scope["path"] == "/stream":
        for i in range(5):
            await send({"type": "http.response.body", "body": f"chunk {i}\n".encode(), "more_body": True})
        await send({"type": "http.response.body", "body": b""})
    else:
        await send({"type": "http.response.body", "body": b"ok"})


def _spawn_detached() -> None:
    """A grandchild in a session of its own, sleeping: outside the server's process group."""
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            time.sleep(3600)
        os._exit(0)
    os.wait()


async def main(port: int, script: dict | None = None) -> None:
    app = web.Application(client_max_size=256 * 1024 ** 2)
    app["state"] = State()
    app["state"].script.update(script or {})
    script = app["state"].script
    if script["exit_at_start"] is not None:
        print("scripted server: exiting before it listens, as scripted", file=sys.stderr, flush=True)
        sys.exit(int(script["exit_at_start"]))
    if script["spawn_detached"]:
        _spawn_detached()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/health", health)
    app.router.add_route("*", "/flush_cache", flush)
    app.router.add_post("/_script", set_script)
    app.router.add_get("/_log", get_log)
    # handler_cancellation: a client that gives up (a turn timeout) ends its handler, as in a real engine
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    sockets = site._server.sockets  # the bound port, when port 0 asked for a free one
    print(f"PORT {sockets[0].getsockname()[1]}", flush=True)
    await asyncio.Event().wait()


class Server(ChildServer):
    """The server as a child process of a test: start(), script(**fields), log(), stop().

    Used as a context manager; stop() kills it and waits, so nothing is left running.
    """

    script_path = __file__
    name = "scripted server"

    def start(self, timeout: float = 20.0) -> "Server":
        import urllib.request

        super().start()
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        return self
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("the scripted server never answered /health")
            time.sleep(0.05)

    def script(self, **fields) -> dict:
        """Replace the script (unnamed fields take their defaults) and clear the log."""
        return self._call("/_script", fields)

    def log(self) -> dict:
        return self._call("/_log")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--script", default="{}", help="JSON: fields of SCRIPT from the start")
    parser.add_argument("--tree", default=None, help="read more fields from TREE/python/sglang/srt/_scripted.json")
    parser.add_argument("--chunk-delay-ms", type=float, default=0.0, help="every content chunk waits this long")
    parser.add_argument("--tag", default=None, help="ignored: a word a test finds its servers by")
    args = parser.parse_args()
    initial = json.loads(args.script)
    if args.tree:
        extra = os.path.join(args.tree, "python", "sglang", "srt", "_scripted.json")
        if os.path.exists(extra):
            with open(extra) as f:
                initial.update(json.load(f))
    if args.chunk_delay_ms:
        initial["chunk_delay_s"] = args.chunk_delay_ms / 1000
    unknown = set(initial) - set(SCRIPT)
    if unknown:
        sys.exit(f"unknown script fields {sorted(unknown)}")
    try:
        asyncio.run(main(args.port, initial))
    except KeyboardInterrupt:
        sys.exit(0)
