"""GSM8K 5-shot through the chat endpoint: the accuracy half of the serving track's correctness gate.

`python -m pipeline serving gsm8k --url URL --engine {sglang,transformers,openai} [--questions N] --json OUT
 [--concurrency C] [--timeout S] [--max-tokens N] [--model NAME]`

After the perf runs, on the same server, the baseline and the candidate each answer the same GSM8K test
questions; the candidate passes (b) of the gate when its accuracy is at least the baseline's minus 1.7
points (serving-track.md, "Score and correctness gate"; pipeline/serving/score.py's gate).

- The data: datasets/gsm8k/ (test.jsonl, the 1,319 test questions unchanged; shots.jsonl, lines 1-5 of
  the train split; their README says where they come from). Both are checked against the sha256s below
  when loaded: a different file would make the two sides' accuracies incomparable with earlier runs, so it
  is refused, never scored.
- The questions: all 1,319, or the first N in file order (deterministic, the same N for both sides).
- The prompt: score.gsm8k_messages: the five shots as user `Question: ...\\nAnswer:` / assistant
  worked-answer turns, then the test question as the last user turn.
- The request: the adapter's free-length greedy body (engine.Adapter.free_body: the model ends the reply
  itself, at most max_tokens long; temperature 0; not streamed), POSTed to /v1/chat/completions, at most
  `concurrency` at once, each bounded by `timeout_s`.
- The answer: score.extract_answer of the reply's message content, compared with the question's
  `#### <number>` (score.gsm8k_correct).
- A request that fails (an HTTP error, a broken connection, a response that is not a chat completion,
  the timeout) counts as a wrong answer and is counted in "failed". More than FAILURES_ALLOWED(n) of
  them (3, or 0.5% of the questions if more) and the run stops with GSM8KError: the server, not the
  model, is what was measured, and an accuracy from it would gate on noise.

run() returns plain data, which the command writes as JSON: "accuracy" (correct / questions), "questions",
"correct", "failed", "failures_allowed", "dataset" and "dataset_sha256" (the whole test file's, whatever
the prefix), "shots" ({"count", "file", "sha256", "train_lines"}), "engine", "url", "model", "max_tokens",
"concurrency", "timeout_s", "finish_reasons" (counts over the answered requests: many "length" means the
replies ran to the cap), "wall_s", and "per_question", one record per question in file order: "index"
(its 0-based line in test.jsonl), "reference", "extracted" (decimal strings; extracted None when the reply
holds no number or the request failed), "correct", "status" ("ok" or one of FAILED_STATUSES), "error",
"finish_reason", "latency_s", "usage" (as the server reported it, unused) and "reply" (the message text).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any

from pipeline.problems import REPO_ROOT
from pipeline.serving import engine
from pipeline.serving import score

DATA_DIR = REPO_ROOT / "datasets" / "gsm8k"
TEST_FILE = "test.jsonl"
SHOTS_FILE = "shots.jsonl"
# The files' sha256 (datasets/gsm8k/README.md): the test split of openai/grade-school-math at 3101c7d, and
# lines 1-5 of its train split (sha256 17f347dc51477c50d4efb83959dbb7c56297aba886e5544ee2aaed3024813465).
TEST_SHA256 = "3730d312f6e3440559ace48831e51066acaca737f6eabec99bccb9e4b3c39d14"
SHOTS_SHA256 = "5cf05b0ccca50349f5f5185a439502ec50117d1021ec7dfce2f09dd2083f9a25"
TEST_QUESTIONS = 1319
SHOT_TRAIN_LINES = (1, 2, 3, 4, 5)

DEFAULT_MAX_TOKENS = 512
DEFAULT_CONCURRENCY = 16
DEFAULT_TIMEOUT_S = 120.0
FAILED_FRACTION = 0.005  # the replay's bound on failed turns, for the same reason
FAILED_FLOOR = 3

FAILED_STATUSES = ("http_error", "broken", "bad_response", "timeout")


class GSM8KError(Exception):
    """The GSM8K run cannot start (bad data, bad arguments) or its server failed too often; the message says what to do."""


def failures_allowed(questions: int) -> int:
    """Failed requests a run of this many questions may have and still give an accuracy."""
    return max(FAILED_FLOOR, int(questions * FAILED_FRACTION))


def _read_verified(path: Path, sha256: str, what: str) -> bytes:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise GSM8KError(f"{path}: cannot read {what} ({exc.strerror}); it ships in the repository's "
                         "datasets/gsm8k/: restore it with `git checkout -- datasets/gsm8k/`") from None
    got = hashlib.sha256(data).hexdigest()
    if got != sha256:
        raise GSM8KError(f"{path}: {what} has sha256 {got}, expected {sha256} (datasets/gsm8k/README.md); "
                         "the file was changed, and accuracies on it are not comparable: restore it with "
                         "`git checkout -- datasets/gsm8k/`")
    return data


def _jsonl(data: bytes, path: Path) -> list[dict[str, str]]:
    rows = []
    for n, line in enumerate(data.decode("utf-8").splitlines(), 1):
        row = json.loads(line)
        if not (isinstance(row, dict) and isinstance(row.get("question"), str) and isinstance(row.get("answer"), str)):
            raise GSM8KError(f"{path}:{n}: not a GSM8K line (an object with `question` and `answer` strings)")
        rows.append(row)
    return rows


def load(data_dir: Path | None = None) -> tuple[list[dict[str, str]], list[dict[str, str]], str]:
    """(test questions, the five shots, the test file's sha256), each file checked against its sha256."""
    root = Path(data_dir) if data_dir is not None else DATA_DIR
    test_path, shots_path = root / TEST_FILE, root / SHOTS_FILE
    test = _jsonl(_read_verified(test_path, TEST_SHA256, "the GSM8K test split"), test_path)
    shots = _jsonl(_read_verified(shots_path, SHOTS_SHA256, "the GSM8K 5-shot examples"), shots_path)
    return test, shots, TEST_SHA256


def _reply_of(document: Any) -> tuple[str, Any, Any]:
    """(content, finish_reason, usage) of a non-streamed chat completion; ValueError if it is none."""
    if not isinstance(document, dict):
        raise ValueError("the response is not a JSON object")
    if "error" in document:
        raise ValueError(f"the server answered an error: {str(document['error'])[:300]}")
    choices = document.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise ValueError("the response has no choices")
    message = choices[0].get("message")
    if not isinstance(message, dict):
        raise ValueError("the response's first choice has no message")
    content = message.get("content")
    if content is not None and not isinstance(content, str):
        raise ValueError(f"the message content is a {type(content).__name__}, not text")
    return content or "", choices[0].get("finish_reason"), document.get("usage")


async def _ask(session, url: str, payload: bytes, timeout_s: float) -> dict[str, Any]:
    import aiohttp

    started = time.monotonic()
    out: dict[str, Any] = {"status": "ok", "error": None, "reply": None, "finish_reason": None, "usage": None}
    try:
        async with asyncio.timeout(timeout_s):
            async with session.post(url, data=payload, headers={"Content-Type": "application/json"}) as resp:
                text = await resp.text()
                if resp.status != 200:
                    out.update(status="http_error", error=f"HTTP {resp.status}: {text[:300].strip()}")
                else:
                    try:
                        out["reply"], out["finish_reason"], out["usage"] = _reply_of(json.loads(text))
                    except ValueError as exc:  # json's errors are ValueErrors too
                        out.update(status="bad_response", error=f"{exc} (response: {text[:200]!r})")
    except TimeoutError:
        out.update(status="timeout", error=f"no answer within the request timeout of {timeout_s:g} s")
    except (aiohttp.ClientError, ConnectionError) as exc:
        out.update(status="broken", error=f"{type(exc).__name__}: {exc}")
    out["latency_s"] = round(time.monotonic() - started, 6)
    return out


async def run(url: str, adapter: engine.Adapter, *, questions: int | None, concurrency: int, timeout_s: float,
              model: str | None = None, max_tokens: int = DEFAULT_MAX_TOKENS,
              data_dir: Path | None = None) -> dict[str, Any]:
    """Ask the server at `url` the first `questions` GSM8K test questions (None: all 1,319), 5-shot, and score
    its replies; the module's docstring says how. Raises GSM8KError for bad arguments or data, or when
    more than failures_allowed(n) requests fail."""
    import aiohttp
    import orjson

    if questions is not None and (isinstance(questions, bool) or not isinstance(questions, int)
                                  or not 1 <= questions <= TEST_QUESTIONS):
        raise GSM8KError(f"questions is {questions!r}: between 1 and {TEST_QUESTIONS} (the test split's "
                         "size), or None for all of them")
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
        raise GSM8KError(f"concurrency is {concurrency!r}; it must be a positive integer")
    if not timeout_s > 0:
        raise GSM8KError(f"the request timeout is {timeout_s!r} s; it must be positive")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise GSM8KError(f"max_tokens is {max_tokens!r}; the cap on a reply is a positive integer")
    test, shots, sha = load(data_dir)
    chosen = test if questions is None else test[:questions]
    n = len(chosen)
    allowed = failures_allowed(n)
    chat_url = url.rstrip("/") + engine.CHAT_PATH
    payloads = [orjson.dumps(adapter.free_body(score.gsm8k_messages(shots, q["question"]), max_tokens, model))
                for q in chosen]
    results: list[dict[str, Any] | None] = [None] * n
    failed: list[int] = []
    queue = iter(range(n))
    too_many = asyncio.Event()

    async def worker(session) -> None:
        for i in queue:  # one shared iterator: each index is taken by exactly one worker
            if too_many.is_set():
                return
            results[i] = await _ask(session, chat_url, payloads[i], timeout_s)
            if results[i]["status"] != "ok":
                failed.append(i)
                if len(failed) > allowed:
                    too_many.set()
                    return

    started = time.monotonic()
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30)
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        workers = [asyncio.create_task(worker(session)) for _ in range(min(concurrency, n))]
        all_done = asyncio.gather(*workers, return_exceptions=True)
        stop = asyncio.create_task(too_many.wait())
        await asyncio.wait([stop, all_done], return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        for task in workers:
            task.cancel()  # those still waiting on a reply, once the run is stopped
        outcomes = await all_done
    for outcome in outcomes:
        if isinstance(outcome, BaseException) and not isinstance(outcome, asyncio.CancelledError):
            raise outcome  # a bug of this module, not a failed request
    wall = time.monotonic() - started
    if too_many.is_set():
        shown = "; ".join(f"test line {i + 1}: {results[i]['error']}" for i in sorted(failed)[:3])
        raise GSM8KError(f"{len(failed)} GSM8K requests to {chat_url} failed before the run was stopped (more "
                         f"than {allowed} of {n} fail the run: the server, not the model, would be measured); "
                         f"first: {shown}")

    per_question = []
    correct = 0
    for i, (q, res) in enumerate(zip(chosen, results)):
        assert res is not None  # every index was asked: no early stop
        reference = score.reference_answer(q["answer"])
        extracted = score.extract_answer(res["reply"]) if res["status"] == "ok" else None
        right = extracted is not None and extracted == reference
        correct += right
        per_question.append({
            "index": i, "reference": str(reference), "extracted": None if extracted is None else str(extracted),
            "correct": right, "status": res["status"], "error": res["error"], "finish_reason": res["finish_reason"],
            "latency_s": res["latency_s"], "usage": res["usage"], "reply": res["reply"],
        })
    finish: dict[str, int] = {}
    for row in per_question:
        if row["status"] == "ok":
            key = str(row["finish_reason"])
            finish[key] = finish.get(key, 0) + 1
    return {
        "accuracy": correct / n, "questions": n, "correct": correct, "failed": len(failed),
        "failures_allowed": allowed, "per_question": per_question,
        "dataset": f"datasets/gsm8k/{TEST_FILE}", "dataset_sha256": sha,
        "shots": {"count": len(shots), "file": f"datasets/gsm8k/{SHOTS_FILE}", "sha256": SHOTS_SHA256,
                  "train_lines": list(SHOT_TRAIN_LINES)},
        "engine": adapter.name, "url": url.rstrip("/"), "model": model, "max_tokens": max_tokens,
        "concurrency": concurrency, "timeout_s": timeout_s, "finish_reasons": finish, "wall_s": round(wall, 3),
    }


def summary_text(result: dict[str, Any]) -> str:
    capped = result["finish_reasons"].get("length", 0)
    return (f"GSM8K 5-shot: {100 * result['accuracy']:.2f}% ({result['correct']} of {result['questions']} "
            f"questions), {result['failed']} failed requests, {capped} replies stopped at max_tokens "
            f"{result['max_tokens']}, {result['wall_s']:.1f} s")


# ----- the command -----

def _register(p) -> None:
    p.add_argument("--url", required=True, help="the server's base URL, e.g. http://127.0.0.1:30000")
    p.add_argument("--engine", required=True, choices=sorted(engine.ADAPTERS), help="the request adapter")
    p.add_argument("--questions", type=int, default=None,
                   help=f"the first N test questions (default: all {TEST_QUESTIONS})")
    p.add_argument("--json", required=True, type=Path, help="where the result goes (JSON)")
    p.add_argument("--concurrency", type=int, default=DEFAULT_CONCURRENCY,
                   help=f"requests in flight at once (default {DEFAULT_CONCURRENCY})")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                   help=f"seconds one request may take before it fails (default {DEFAULT_TIMEOUT_S:g})")
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                   help=f"the cap on a reply's length (default {DEFAULT_MAX_TOKENS})")
    p.add_argument("--model", default=None, help="the model name to put in requests (default: none; the engine's own)")


def gsm8k_command(args) -> int:
    """Ask a running server GSM8K 5-shot through its chat endpoint and write the accuracy and every reply.

    Exit 0 when OUT was written; 1 when the data, an argument or the server failed (the message says
    which; nothing is written).
    """
    from pipeline.serving import replay

    try:
        result = asyncio.run(run(args.url, engine.adapter(args.engine), questions=args.questions,
                                 concurrency=args.concurrency, timeout_s=args.timeout, model=args.model,
                                 max_tokens=args.max_tokens))
    except (GSM8KError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    replay.write_json(result, args.json)
    print(summary_text(result))
    print(f"wrote {result['questions']} GSM8K records to {args.json}")
    return 0


COMMANDS = {"gsm8k": (_register, gsm8k_command)}
