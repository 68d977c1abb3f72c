"""The demo's scripted OpenAI-compatible server: a real HTTP process on loopback that streams words at a
fixed pace, standing in for SGLang (which needs GPUs) in `python -m pipeline demo`.

`python pipeline/demo/server.py --port P [--tree DIR] [--chunk-delay-ms MS]` prints `PORT <n>` once it
listens. Its pace is `token_s` seconds a token; a serving patch changes it the way a real patch changes
SGLang: by adding DIR/python/sglang/srt/_demo_server.json ({"token_s": ...}) to the tree the server is
launched from. A reply's words are a function of the conversation (the messages after the system one,
whose first line is the run's marker), so every launch answers a canary the same way.

  POST /v1/chat/completions  streamed (SSE, one word a chunk, usage in a last chunk) or one JSON object
  GET  /health               200
  POST /flush_cache          200
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import sys
import time

from aiohttp import web

# each one token for the pinned Qwen tokenizer (a leading space and letters are one pre-token)
WORDS = (" the", " of", " and", " to", " in", " is", " that", " it", " for", " on", " with", " as")
SCRIPT_FILE = os.path.join("python", "sglang", "srt", "_demo_server.json")


def _first_word(body: dict) -> int:
    key = json.dumps(body.get("messages", [])[1:], sort_keys=True).encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:4], "big")


def _length(body: dict) -> int:
    return int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)


def _chunk(cid: str, delta: dict, finish: str | None = None) -> bytes:
    choice = {"index": 0, "delta": delta, **({"finish_reason": finish} if finish else {})}
    return b"data: " + json.dumps({"id": cid, "object": "chat.completion.chunk", "created": 0, "model": "demo",
                                   "choices": [choice]}).encode() + b"\n\n"


async def chat(request: web.Request) -> web.StreamResponse:
    pace = request.app["pace"]
    body = json.loads(await request.read())
    first, n = _first_word(body), _length(body)
    words = [WORDS[(first + j) % len(WORDS)] for j in range(n)]
    cid = f"chatcmpl-{first:x}"
    prompt = sum(len(str(m.get("content", ""))) // 4 for m in body.get("messages", []))
    usage = {"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n}
    if body.get("stream") is False:
        await asyncio.sleep(pace["token_s"] * n)
        return web.json_response({"id": cid, "object": "chat.completion", "created": 0, "model": "demo",
                                  "usage": usage, "choices": [{"index": 0, "finish_reason": "length",
                                                               "message": {"role": "assistant",
                                                                           "content": "".join(words)}}]})
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    await resp.write(_chunk(cid, {"role": "assistant"}))
    start = time.perf_counter()
    for j, w in enumerate(words):
        # an absolute schedule: token j at start + (j + 1) * token_s, so a late wake-up does not drift
        await asyncio.sleep(max(0.0, start + (j + 1) * pace["token_s"] + pace["chunk_delay_s"] - time.perf_counter()))
        await resp.write(_chunk(cid, {"content": w}))
    await resp.write(_chunk(cid, {}, finish="length") + b"data: " + json.dumps(
        {"id": cid, "object": "chat.completion.chunk", "choices": [], "usage": usage}).encode()
        + b"\n\ndata: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def health(request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def flush(request: web.Request) -> web.Response:
    return web.Response(text="Cache flushed.\n")


async def serve(port: int, pace: dict) -> None:
    app = web.Application(client_max_size=64 * 1024 ** 2)
    app["pace"] = pace
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/health", health)
    app.router.add_route("*", "/flush_cache", flush)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    print(f"PORT {site._server.sockets[0].getsockname()[1]}", flush=True)
    await asyncio.Event().wait()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--tree", help="the tree it is launched from: its python/sglang/srt/_demo_server.json sets the pace")
    p.add_argument("--token-s", type=float, default=0.004, help="seconds a token (default 0.004)")
    p.add_argument("--chunk-delay-ms", type=float, default=0.0, help="the launch template's slowdown knob")
    args = p.parse_args()
    pace = {"token_s": args.token_s, "chunk_delay_s": args.chunk_delay_ms / 1000}
    if args.tree and os.path.exists(os.path.join(args.tree, SCRIPT_FILE)):
        with open(os.path.join(args.tree, SCRIPT_FILE)) as fh:
            pace["token_s"] = float(json.load(fh)["token_s"])
    try:
        asyncio.run(serve(args.port, pace))
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
