"""A scripted OpenAI-compatible chat server for the GSM8K tests, run as its own process.

`python tests/serving/gsm8k_server.py` listens on a free loopback port and prints `PORT <n>` once it does
(Server below starts and stops it). It reads the GSM8K test split from datasets/gsm8k/ and recognises a
question by the last user message of a request (`Question: <text>\\nAnswer:`, pipeline/serving/score.py's
gsm8k_messages). What it does with each is the plan, set by POST /_plan (which also clears the log):
{"default": BEHAVIOUR, "lines": {"<0-based test line>": BEHAVIOUR}, "delay_s": seconds before answering}.

  right          a worked reply ending in `#### <the reference number>`
  right_dollars  "... the answer is $<reference with thousands commas>." (no marker)
  ramble         the right `#### n`, then a question of its own with other numbers (a model that goes on
                 instead of ending its turn)
  wrong          `#### <reference + 1>`
  none           a reply with no number
  http_500       HTTP 500 with an error object
  bad_json       HTTP 200 whose body is not JSON
  hang           never answers (until the client goes away)

A question it does not know gets `none`. Non-streaming requests only (stream: true is a 400). GET /_log:
{"requests": [every body, in arrival order], "max_in_flight": the most requests it held at once}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

from child_server import ChildServer  # noqa: E402 - beside this script, also when run as one

DATA = Path(__file__).resolve().parents[2] / "datasets" / "gsm8k" / "test.jsonl"
BEHAVIOURS = ("right", "right_dollars", "ramble", "wrong", "none", "http_500", "bad_json", "hang")


def reference(answer: str) -> int:
    return int(answer.rpartition("####")[2].strip().replace(",", ""))


def reply_text(behaviour: str, ref: int) -> str:
    if behaviour == "right":
        return f"Let me work it out in 2 steps.\nThe total is {ref}.\n#### {ref}"
    if behaviour == "right_dollars":
        return f"Adding up the 3 parts, the answer is ${ref:,}."
    if behaviour == "ramble":
        return (f"So the total is {ref}.\n#### {ref}\n\nQuestion: A farmer has 17 cows and buys 5 more. "
                "How many cows does he have?\nAnswer: 17 + 5 = 22 cows.\n#### 22")
    if behaviour == "wrong":
        return f"I think it is {ref + 1}.\n#### {ref + 1}"
    if behaviour == "none":
        return "I cannot work this one out."
    raise ValueError(f"no reply text for behaviour {behaviour!r}")


def make_app():
    from aiohttp import web

    known = {}
    for line, text in enumerate(DATA.read_text().splitlines()):
        row = json.loads(text)
        known[row["question"]] = (line, reference(row["answer"]))
    state = {"plan": {"default": "right"}, "requests": [], "in_flight": 0, "max_in_flight": 0}

    async def chat(request: web.Request) -> web.StreamResponse:
        state["in_flight"] += 1
        state["max_in_flight"] = max(state["max_in_flight"], state["in_flight"])
        try:
            body = await request.json()
            state["requests"].append(body)
            if body.get("stream"):
                return web.json_response({"error": {"message": "this server answers stream: false only"}}, status=400)
            plan = state["plan"]
            question = body["messages"][-1]["content"].removeprefix("Question: ").removesuffix("\nAnswer:")
            line, ref = known.get(question, (None, 0))
            behaviour = "none" if line is None else plan.get("lines", {}).get(str(line), plan.get("default", "right"))
            if plan.get("delay_s"):
                await asyncio.sleep(plan["delay_s"])
            if behaviour == "hang":
                await asyncio.sleep(3600)
            if behaviour == "http_500":
                return web.json_response({"error": {"message": "scripted failure"}}, status=500)
            if behaviour == "bad_json":
                return web.Response(text="<html>not json</html>", content_type="application/json")
            text = reply_text(behaviour, ref)
            return web.json_response({
                "id": f"chatcmpl-{len(state['requests'])}", "object": "chat.completion",
                "created": int(time.time()), "model": body.get("model", "scripted"),
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 0, "completion_tokens": len(text.split()), "total_tokens": 0},
            })
        finally:
            state["in_flight"] -= 1

    async def set_plan(request: web.Request) -> web.Response:
        plan = await request.json()
        for b in [plan.get("default", "right"), *plan.get("lines", {}).values()]:
            if b not in BEHAVIOURS:
                return web.json_response({"error": f"unknown behaviour {b!r}"}, status=400)
        state.update(plan=plan, requests=[], max_in_flight=0)
        return web.json_response({"ok": True})

    async def get_log(request: web.Request) -> web.Response:
        return web.json_response({"requests": state["requests"], "max_in_flight": state["max_in_flight"]})

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application(client_max_size=16 * 1024 * 1024)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/_plan", set_plan)
    app.router.add_get("/_log", get_log)
    app.router.add_get("/health", health)
    return app


async def main(port: int) -> None:
    from aiohttp import web

    runner = web.AppRunner(make_app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    print(f"PORT {site._server.sockets[0].getsockname()[1]}", flush=True)
    await asyncio.Event().wait()


class Server(ChildServer):
    """The server as a child process: start() waits for its port, stop() kills it and waits."""

    script_path = __file__
    name = "GSM8K test server"

    def plan(self, default: str = "right", lines: dict[int, str] | None = None, delay_s: float = 0.0) -> None:
        """Replace the plan and clear the log."""
        self._call("/_plan", {"default": default, "lines": {str(k): v for k, v in (lines or {}).items()},
                              "delay_s": delay_s})

    def log(self) -> dict:
        return self._call("/_log")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0)
    asyncio.run(main(parser.parse_args().port))
