"""The closed-loop replay: c lanes of agentic conversations against a streaming chat endpoint, timed by the client.

`python -m pipeline serving replay --url URL --dataset F --concurrency C --window S --warmup S
 --engine {sglang,transformers,openai} --seed S --json OUT [--turn-timeout S] [--tokenizer FILE] [--gpus N]`

How a level is replayed (serving-track.md, "The replay"):
- C lanes, each holding one conversation at a time. A turn sends the whole history (the system message,
  every earlier turn's messages and assistant replies, this turn's new messages) to /v1/chat/completions
  with streaming, through the engine's adapter (pipeline/serving/engine.py: the forced length, greedy).
  The reply is appended as it was streamed (less any special tokens the engine was asked to keep in the
  text for counting, pipeline/serving/engine.py) and the next turn is sent at once (no think time). When a
  conversation ends, the lane takes the next one from a queue shuffled with the seed; the queue starts a
  new shuffled pass when it runs out.
- Canary conversations are replayed with fixed history: the dataset's own `reply` of each turn is
  appended instead of the live one, so every server sees the same prompts and their greedy tokens can be
  compared with the baseline's (pipeline/serving/score.py).
- Staggered starts: lane i's first conversation starts at turn floor(i * T / C) of its T turns, so the
  lanes are spread over the phases of a conversation instead of all sending a first turn at once. The
  history before that turn is formed as for a canary: the turns' messages with the dataset's fixed
  replies (text of about max_tokens tokens written for that place), so the prompt is a realistic one.
  Later conversations of a lane start at turn 0.
- A per-run random marker (from the OS's randomness, not the seed) begins the system message, the first
  message of every request: nothing cached by an earlier run matches a single token, so a flush that does
  nothing cannot help, while within the run the shared prefix is shared as in production. A conversation
  replayed again in a later pass of the queue gets the marker with the pass number (`<marker>/<pass>`), so
  it is not served from its own earlier pass either. Where the engine has one, the cache is flushed
  before the run (SGLang's POST /flush_cache, retried while it answers that requests are pending). The
  readiness check and each flush attempt must be answered within CONTROL_TIMEOUT_S, else the run stops with
  what did not answer (a server that accepts connections and never answers does not hold the replay).
- Every replay of a live conversation (each run, pass and conversation) renames about half of its code
  identifiers, the same way in all its messages and fixed replies, to others of the dataset with the same
  token count, drawn with the OS's randomness (pipeline/serving/renaming.py): the marker is a line a
  server can strip, the renaming is not, so no reply kept from an earlier run, level or block answers a
  prompt of this one. Canaries and the system prefix are not renamed. `facts.renaming` counts the
  replays and names renamed.
- Every streamed chunk is timestamped with time.perf_counter_ns as it is read. Output tokens are counted
  by re-tokenising the streamed text with the given tokenizer (the pinned one by default), after the run,
  so the tokenizer costs nothing while streams are read. Each token is attributed to the chunk whose
  arrival completed its characters (the token offsets of the whole reply), which is the incremental token
  count of the text received so far; a chunk may carry zero tokens (a token split across chunks) or
  several. A turn counts at most its max_tokens tokens, so a server that streams more gains nothing. The
  server's `usage` is recorded as it came and never used for a count.
- A measurement window of S seconds follows the warm-up; at its end every turn still open is cancelled
  (status `cancelled`, its tokens so far kept with their timestamps) and the run stops.
- A turn fails on an HTTP error (`http_error`), a connection or stream that breaks or ends without a
  finish (`broken`), an error object or malformed chunk in the stream (`stream_error`), or the per-turn
  timeout (`timeout`); a turn that finishes with fewer than max_tokens - 1 tokens is `short`. A failed
  turn ends its conversation (its history has no reply to continue from) and the lane takes the next one.

What a turn's stream must be (serving-track.md: "One choice and one content field per stream; anything
else is that turn's error"). The parse is total: every byte sequence a server can send ends as a reply,
`broken`, or `stream_error` with what was wrong and the chunk's number; none raises, and no text counts twice.
- Lines: `data: <payload>` lines count (`data:` then the payload, spaces around it ignored); every other
  line (blank separators, `event:`, `id:`, `: comments`) is skipped. A line longer than MAX_LINE_BYTES is a
  stream_error (a server that never ends its line cannot fill the client's memory).
- The payload `[DONE]`, exactly, ends the stream (whatever follows is read and dropped). Any other payload
  must be a JSON object (UTF-8, no NaN, no number beyond a double, no lone surrogate, nested less deep
  than the recursion limit); `"[DONE]"`, `[done]`, `null`, a number, a list are stream_errors.
- An object with a non-null `error`, or `object: "error"`, is the server's error: stream_error.
- `usage`: absent, null or an object. Only its token counts are kept (prompt_tokens, completion_tokens,
  total_tokens, prompt_tokens_details.cached_tokens, each where it is an integer), as the server claims
  them: logged, never used for a count.
- `choices`: absent, null or a list of at most one choice (a usage-only chunk has none). Two or more
  choices, or one whose `index` is not 0 (absent counts as 0), is a stream_error: the replay asks for one
  reply (n = 1) and counts one.
- The choice is an object; its `delta` absent, null or an object (other delta fields, `role`, `tool_calls`,
  carry no counted text); its `finish_reason` absent, null or a string (a non-empty one finishes the reply).
- The text: `delta.content` and `delta.reasoning_content`, each absent, null or a string. A reply's text is
  in one field: the first that carries text (a non-empty string) is the reply's field, and text in the other
  one, in the same chunk or a later one, is a stream_error (a reasoning parser's split reply, or the same
  words in both fields, would otherwise count twice). Text after the choice's finish_reason is a
  stream_error (a second reply appended to the first), and so is more text than max_tokens tokens could
  spell (MAX_CHARS_PER_TOKEN characters a token, plus a margin): the excess never counts anyway
  (a turn counts at most max_tokens), and the client keeps none of it.
- Everything else in a chunk (id, model, created, logprobs, extra fields) is ignored.

The audit sample (serving-track.md, "Only the model's own replies count"): of the live (non-canary) turns
that finish, AUDIT_SAMPLE are kept by reservoir sampling with the OS's randomness (random.SystemRandom,
neither the seed nor anything the server sees), each with the exact request body sent (`request`, the
JSON text) and the reply's token ids as counted (`token_ids`), plus where it came from (lane,
conversation, pass, turn, max_tokens); those whose turn ends `ok` (not short) go in the document's
`audit` list, and `facts.audit_population` says how many live turns finished. The evaluation re-sends a
sample of them to the baseline's server and compares (pipeline/serving/evaluate.py, score.py's gate (d)).
Nothing about the stream or its timing changes: the body is the one built for the send anyway.

The output (JSON, one document): `facts` (marker, seed, engine, concurrency, window bounds on the run's
own clock, the dataset's content sha256, the flush, the tokenizer) and `turns`, one plain record per
turn sent: lane, conversation, pass, turn index, canary flag, max_tokens, send_ns, first_ns (the first
token's chunk), end_ns (the last counted token's chunk, or when it failed or was cancelled), status,
error, chunk_ns and chunk_tokens (every content chunk's arrival and the tokens attributed to it),
tokens (counted, at most max_tokens), tokens_streamed (before that cap), usage (the token counts as
reported, unused),
and for canary turns the token ids; and `audit`, the sample of live turns the evaluation re-sends to the
baseline (below). Every time is in nanoseconds from the run's origin (facts.origin_ns
is that origin on the perf_counter_ns clock). pipeline/serving/metrics.py turns the records into T_c,
I_c and the unscored figures; the command adds them as `level` (with --gpus) and prints them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import secrets
import sys
import time
from bisect import bisect_left
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from pipeline.serving import engine as engines, renaming

FORMAT = "muse-serving-replay"
FORMAT_VERSION = 1

FAILED = ("http_error", "broken", "stream_error", "timeout")
STATUSES = ("ok", "short", *FAILED, "cancelled")

DEFAULT_TURN_TIMEOUT_S = 300.0
# The stream's bounds (the module's docstring): a line of the stream, and the text of one reply.
MAX_LINE_BYTES = 8 << 20
MAX_CHARS_PER_TOKEN = 256
REPLY_MARGIN_CHARS = 64 * 1024
TEXT_FIELDS = ("content", "reasoning_content")
MAX_BRACKETS_UNCHECKED = 1000  # a chunk with more [ and { is checked for its depth first (_take)
USAGE_COUNTS = ("prompt_tokens", "completion_tokens", "total_tokens")
AUDIT_SAMPLE = 16  # live turns kept per run for the audit (the module's docstring)
# SGLang refuses a flush while requests are pending (the previous level's may still be draining): retry.
FLUSH_ATTEMPTS = 20
FLUSH_RETRY_S = 0.5
CONTROL_TIMEOUT_S = 60.0  # the readiness check, and each flush attempt, answered within this or the run stops


class ReplayError(Exception):
    """The replay cannot start or its input is unusable; the message says what to do."""


class _Turn:
    """One turn in flight: what the hot loop appends to, turned into a plain record after the run."""

    __slots__ = ("lane", "conversation", "pass_", "turn", "canary", "max_tokens", "send_ns", "end_ns",
                 "status", "error", "times", "ends", "pieces", "chars", "usage", "finished", "chunks", "field",
                 "max_chars")

    def __init__(self, lane: int, conversation: str, pass_: int, turn: int, canary: bool, max_tokens: int):
        self.lane, self.conversation, self.pass_, self.turn = lane, conversation, pass_, turn
        self.canary, self.max_tokens = canary, max_tokens
        self.send_ns = 0
        self.end_ns: int | None = None
        self.status: str | None = None  # None while open; "done" once the stream finished (ok or short later)
        self.error: str | None = None
        self.times: list[int] = []  # perf_counter_ns of each content chunk
        self.ends: list[int] = []  # characters of reply received once that chunk arrived
        self.pieces: list[str] = []
        self.chars = 0
        self.usage: Any = None
        self.finished = False
        self.chunks = 0  # data lines read so far: where a stream_error names its chunk
        self.field: str | None = None  # the delta field that carries this reply's text (TEXT_FIELDS)
        self.max_chars = max_tokens * MAX_CHARS_PER_TOKEN + REPLY_MARGIN_CHARS

    def text(self) -> str:
        return "".join(self.pieces)


def start_turn(lane: int, concurrency: int, turns: int) -> int:
    """The turn lane `lane` of `concurrency` starts its first conversation at (staggered starts)."""
    return (lane * turns) // concurrency


class ConversationQueue:
    """Conversations in an order shuffled with the seed, pass after pass: (index, pass number)."""

    def __init__(self, count: int, seed: int):
        if count < 1:
            raise ReplayError("the dataset holds no conversation to replay")
        self._rng = random.Random(seed)
        self._count = count
        self._order: list[int] = []
        self._pass = -1

    def next(self) -> tuple[int, int]:
        if not self._order:
            self._pass += 1
            self._order = list(range(self._count))
            self._rng.shuffle(self._order)
            self._order.reverse()  # popped from the end: the shuffled order, first to last
        return self._order.pop(), self._pass


def new_marker() -> str:
    """A marker no earlier run used: 64 random bits from the OS, independent of the seed."""
    return f"run {secrets.token_hex(8)}"


class History:
    """A conversation's messages so far, each JSON-encoded once when it joins.

    A turn's body is then a join of bytes, not an encoding of the whole history again: a history of a
    hundred thousand tokens takes a millisecond to encode, and the event loop reading every other lane's
    stream would wait that long each turn.
    """

    def __init__(self, dumps):
        self._dumps = dumps
        self.encoded: list[bytes] = []

    def add(self, message: dict[str, Any]) -> None:
        self.encoded.append(self._dumps(message))

    def extend(self, messages: list[dict[str, Any]]) -> None:
        for message in messages:
            self.add(message)

    def body(self, fields: dict[str, Any]) -> bytes:
        """The request's JSON: these fields (the adapter's; its own `messages` is dropped) and the history."""
        rest = self._dumps({k: v for k, v in fields.items() if k != "messages"})
        head = b'{"messages":[' + b",".join(self.encoded) + b"]"
        return head + (b"," + rest[1:] if rest != b"{}" else b"}")


def special_tokens(tokenizer: Any) -> tuple[str, ...]:
    """The text of the tokenizer's special tokens (<|im_end|>, ...), longest first; none if it cannot say."""
    added = getattr(tokenizer, "get_added_tokens_decoder", None)
    if added is None:
        return ()
    return tuple(sorted({t.content for t in added().values() if getattr(t, "special", False) and t.content},
                        key=len, reverse=True))


def strip_special(text: str, specials: tuple[str, ...]) -> str:
    """The reply as the next turn's history holds it: without the special tokens the stream kept for counting
    (an agent reads the text, and a literal <|im_start|> in a history would forge the chat's structure)."""
    for token in specials:
        if token in text:
            text = text.replace(token, "")
    return text


def system_message(system: str, marker: str, pass_: int) -> dict[str, str]:
    tag = marker if pass_ == 0 else f"{marker}/{pass_}"
    return {"role": "system", "content": f"{tag}\n\n{system}"}


async def _flush(session, url: str, adapter: engines.Adapter) -> dict[str, Any]:
    if adapter.flush_path is None:
        return {"flushed": None, "why": f"{adapter.name} keeps no cache the replay can flush"}
    last = ""
    for _ in range(FLUSH_ATTEMPTS):
        async with _answered_within(f"POST {adapter.flush_path} (the cache flush)", url), \
                session.post(url + adapter.flush_path) as resp:
            text = (await resp.content.read(300)).decode("utf-8", "replace")
            if resp.status == 200:
                return {"flushed": True, "response": text.strip()}
            last = f"HTTP {resp.status}: {text.strip()}"
        await asyncio.sleep(FLUSH_RETRY_S)
    raise ReplayError(f"the cache flush {url}{adapter.flush_path} failed {FLUSH_ATTEMPTS} times (last: {last}); "
                      "a level must start from an empty cache: check that the server is idle")


@contextlib.asynccontextmanager
async def _answered_within(what: str, url: str):
    """A control request of the replay (readiness, flush) answered within CONTROL_TIMEOUT_S, or a ReplayError:
    a server that accepts the connection and never answers must not hold the replay forever."""
    try:
        async with asyncio.timeout(CONTROL_TIMEOUT_S):
            yield
    except TimeoutError:
        raise ReplayError(f"the server at {url} did not answer {what} within {CONTROL_TIMEOUT_S:g} s; "
                          "a server must answer its control routes while idle: read its log") from None


async def _ready(session, url: str, adapter: engines.Adapter) -> None:
    import aiohttp

    try:
        async with _answered_within(f"GET {adapter.health_path}", url), \
                session.get(url + adapter.health_path) as resp:
            if resp.status != 200:
                raise ReplayError(f"the server at {url} is not ready: GET {adapter.health_path} answered "
                                  f"HTTP {resp.status}; wait for it to answer 200 before replaying")
    except aiohttp.ClientError as exc:
        raise ReplayError(f"the server at {url} cannot be reached (GET {adapter.health_path}: {exc}); "
                          "is it running, and is --url right?") from None


def _kind(value: Any) -> str:
    """The JSON name of a parsed value's type, for messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    return {dict: "an object", list: "a list", str: "a string", int: "a number", float: "a number"}.get(
        type(value), f"a {type(value).__name__}")


def _bad(turn: _Turn, data: bytes, what: str) -> bool:
    """The turn's stream_error: which chunk, what was wrong with it, the chunk as it came (cut)."""
    shown = data[:160]
    turn.status = "stream_error"
    turn.error = (f"chunk {turn.chunks} of the stream: {what} (data: {shown!r}{'...' if len(data) > 160 else ''}); "
                  "a turn streams chat.completion.chunk objects with one choice, index 0, its text in one delta field")
    return False


def _usage(usage: dict[str, Any]) -> dict[str, Any]:
    """The token counts of a chunk's usage, where they are non-negative integers; nothing else of it."""
    out: dict[str, Any] = {}
    for key in USAGE_COUNTS:
        v = usage.get(key)
        if type(v) is int and v >= 0:
            out[key] = v
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and type(details.get("cached_tokens")) is int and details["cached_tokens"] >= 0:
        out["prompt_tokens_details"] = {"cached_tokens": details["cached_tokens"]}
    return out


def _take(turn: _Turn, line: bytes, t: int, loads) -> bool:
    """Fold one SSE line, read at t, into the turn; False once the stream is over ([DONE] or an error).

    Total: whatever the line holds, it returns (the rules are the module's docstring's); a malformed
    chunk sets the turn's status to stream_error and says what was wrong."""
    if not line.startswith(b"data:"):
        return True  # blank separators, comments, event names
    data = line[5:].strip()
    turn.chunks += 1
    if data == b"[DONE]":
        turn.finished = True
        return False
    try:
        if data.count(b"[") + data.count(b"{") > MAX_BRACKETS_UNCHECKED:
            # orjson recurses without a bound: a few hundred thousand nested brackets (a chunk of a few
            # hundred KB) overflow the C stack, a segfault of the whole evaluator. The standard library's
            # parser stops at the recursion limit; it reads such a chunk first.
            json.loads(data)
        obj = loads(data)
    except (ValueError, RecursionError) as exc:  # not JSON, not UTF-8, too deep, NaN, a number beyond a double
        return _bad(turn, data, f"not JSON ({type(exc).__name__}: {str(exc)[:200]})")
    if not isinstance(obj, dict):
        return _bad(turn, data, f"JSON of another kind ({_kind(obj)}), not an object")
    if obj.get("error") is not None or obj.get("object") == "error":
        turn.status, turn.error = "stream_error", f"chunk {turn.chunks} of the stream: the server streamed an error: {data[:300]!r}"
        return False
    usage = obj.get("usage")
    if usage is not None:
        if not isinstance(usage, dict):
            return _bad(turn, data, f"`usage` is {_kind(usage)}, not an object")
        turn.usage = _usage(usage)
    choices = obj.get("choices")
    if choices is None:
        return True
    if not isinstance(choices, list):
        return _bad(turn, data, f"`choices` is {_kind(choices)}, not a list")
    if not choices:
        return True  # a usage-only chunk
    if len(choices) > 1:
        return _bad(turn, data, f"`choices` holds {len(choices)} choices; the replay asks for one reply and counts one")
    choice = choices[0]
    if not isinstance(choice, dict):
        return _bad(turn, data, f"the choice is {_kind(choice)}, not an object")
    index = choice.get("index", 0)
    if type(index) is not int or index != 0:
        return _bad(turn, data, f"a choice with index {index!r}; the one reply asked for is index 0")
    delta = choice.get("delta")
    if delta is None:
        delta = {}
    elif not isinstance(delta, dict):
        return _bad(turn, data, f"`delta` is {_kind(delta)}, not an object")
    finish = choice.get("finish_reason")
    if finish is not None and not isinstance(finish, str):
        return _bad(turn, data, f"`finish_reason` is {_kind(finish)}, not a string or null")
    texts = []
    for key in TEXT_FIELDS:
        piece = delta.get(key)
        if piece is None:
            continue
        if not isinstance(piece, str):
            return _bad(turn, data, f"`delta.{key}` is {_kind(piece)}, not a string or null")
        if piece:
            texts.append((key, piece))
    if texts:
        if turn.finished:
            return _bad(turn, data, "text after the choice's finish_reason (a reply ends at its finish)")
        fields = {key for key, _ in texts} | ({turn.field} if turn.field else set())
        if len(fields) > 1:
            return _bad(turn, data, "text in both `delta.content` and `delta.reasoning_content` of one reply; a reply's "
                                    "text is in one field, counted once")
        key, piece = texts[0]
        turn.field = key
        if turn.chars + len(piece) > turn.max_chars:
            return _bad(turn, data, f"more than {turn.max_chars:,} characters of text, more than {turn.max_tokens} "
                                    "tokens (max_tokens) can spell")
        turn.chars += len(piece)
        turn.pieces.append(piece)
        turn.ends.append(turn.chars)
        turn.times.append(t)
    if finish:
        turn.finished = True
    return True


SEND_BUFFER_BYTES = 64 * 1024


def _small_send_buffer() -> dict[str, Any]:
    # A history of 100k tokens is a 400 KB request; sent in one send() over loopback, the kernel spends a
    # millisecond on it in the event loop's thread, and every other lane's chunks wait. A small send buffer
    # cuts it into slices the loop interleaves with reading. (aiohttp >= 3.12's socket_factory.)
    import inspect
    import socket

    import aiohttp

    if not SEND_BUFFER_BYTES or "socket_factory" not in inspect.signature(aiohttp.TCPConnector.__init__).parameters:
        return {}

    def factory(addr_info):
        family, type_, proto, _, _ = addr_info
        sock = socket.socket(family=family, type=type_, proto=proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
        return sock

    return {"socket_factory": factory}


async def _stream(session, url: str, payload: bytes, turn: _Turn) -> None:
    """Send one turn and read its stream into `turn`; sets status to done or a failure."""
    import aiohttp
    import orjson

    perf = time.perf_counter_ns
    loads = orjson.loads
    turn.send_ns = perf()
    try:
        async with session.post(url, data=payload, headers={"Content-Type": "application/json"}) as resp:
            if resp.status != 200:
                body = (await resp.text())[:300]
                turn.status, turn.error = "http_error", f"HTTP {resp.status}: {body.strip()}"
                return
            # Whatever the socket delivered at once is read at once and split into lines here: one await
            # per read rather than per line (aiohttp's readline costs more than the rest of a chunk), and
            # the lines that arrived together share the time they arrived.
            partial: list[bytes] = []  # a line still without its end, in the pieces it came in
            held = 0
            going = True
            async for data in resp.content.iter_any():
                t = perf()
                if b"\n" not in data:
                    partial.append(data)
                    held += len(data)
                    if held > MAX_LINE_BYTES:
                        turn.chunks += 1
                        going = _bad(turn, partial[0][:200], f"a line of more than {MAX_LINE_BYTES:,} bytes (its end not yet come)")
                        break
                    continue
                if partial:  # joined once, when its end came: never a copy per read
                    data = b"".join((*partial, data))
                    partial, held = [], 0
                lines = data.split(b"\n")
                rest = lines.pop()
                for line in lines:
                    if len(line) > MAX_LINE_BYTES:
                        turn.chunks += 1
                        going = _bad(turn, line[:200], f"a line of more than {MAX_LINE_BYTES:,} bytes ({len(line):,})")
                    elif line and not _take(turn, line, t, loads):
                        going = False
                    if not going:
                        break
                if not going:
                    break
                if rest:
                    partial, held = [rest], len(rest)
            if going and partial:
                _take(turn, b"".join(partial), perf(), loads)  # a last line without its newline
            elif not going and turn.status is None:
                # [DONE]: read the stream to its end (nothing after [DONE] counts), so that the connection
                # goes back to the pool; a response left unread is closed, and the lane's next turn would
                # pay for a new connection inside the event loop. Read and dropped, and no more than a line's
                # worth: a server that goes on streaming after [DONE] has its connection closed instead.
                drained = 0
                async for data in resp.content.iter_any():
                    drained += len(data)
                    if drained > MAX_LINE_BYTES:
                        break
        if turn.status is not None:
            return
        if not turn.finished:
            turn.status, turn.error = "broken", "the stream ended without a finish_reason or [DONE]"
            return
        turn.status = "done"
    except (aiohttp.ClientError, ConnectionError, ValueError) as exc:
        turn.status, turn.error = "broken", f"{type(exc).__name__}: {exc}"
    finally:
        turn.end_ns = perf()


async def _stream_within(session, url: str, payload: bytes, turn: _Turn, timeout_s: float) -> None:
    """`_stream`, ended as a `timeout` turn when no complete reply came within `timeout_s`."""
    try:
        async with asyncio.timeout(timeout_s):
            await _stream(session, url, payload, turn)
    except TimeoutError:
        turn.status = "timeout"
        turn.error = f"no complete reply within the turn timeout of {timeout_s:g} s"
        turn.end_ns = time.perf_counter_ns()


async def run(url: str, system: str, conversations: list[dict[str, Any]], tokenizer: Any, *,
              engine: str, concurrency: int, window_s: float, warmup_s: float, seed: int,
              turn_timeout_s: float = DEFAULT_TURN_TIMEOUT_S, model: str | None = None,
              marker: str | None = None, facts: dict[str, Any] | None = None,
              names: renaming.Names | None = None) -> dict[str, Any]:
    """Replay one level; returns {"facts": ..., "turns": [...]} as plain data (see the module's docstring).

    `conversations` are the dataset's (each {"id", "canary", "turns": [{"messages", "max_tokens",
    "canary", "reply"}]}), `system` its shared prefix; `tokenizer` anything whose encode(text) has .ids
    (a tokenizers.Tokenizer: its offsets and encode_batch are used when present).
    """
    import aiohttp

    if concurrency < 1:
        raise ReplayError(f"--concurrency is {concurrency}; it must be at least 1")
    if window_s <= 0 or warmup_s < 0 or turn_timeout_s <= 0:
        raise ReplayError(f"window {window_s} s, warm-up {warmup_s} s, turn timeout {turn_timeout_s} s: "
                          "the window and the timeout must be positive and the warm-up not negative")
    adapter = engines.adapter(engine)
    base = url.rstrip("/")
    chat_url = base + engines.CHAT_PATH
    marker = marker or new_marker()
    queue = ConversationQueue(len(conversations), seed)
    specials = special_tokens(tokenizer)
    # before the clock starts; `names` is the dataset's, built once for an evaluation's many runs
    renamer = renaming.Renamer(names or renaming.Names(conversations, tokenizer))
    opened: list[_Turn] = []
    # the audit's reservoir: (turn, its request body) for AUDIT_SAMPLE of the live turns that finished
    chooser = random.SystemRandom()
    reservoir: list[tuple[_Turn, bytes]] = []
    finished_live = 0

    async def lane(index: int, session) -> None:
        import orjson

        nonlocal finished_live
        first = True
        while True:
            ci, pass_ = queue.next()
            conv = conversations[ci]
            turns = conv["turns"]
            begin = start_turn(index, concurrency, len(turns)) if first else 0
            first = False
            named = renamer.replay(ci)  # this replay's text, with names of its own (a canary's: the dataset's)
            history = History(orjson.dumps)
            history.add(system_message(system, marker, pass_))
            for k in range(begin):
                history.extend(named.messages(k))
                history.add({"role": "assistant", "content": named.reply(k)})
            for k in range(begin, len(turns)):
                spec = turns[k]
                history.extend(named.messages(k))
                turn = _Turn(index, conv["id"], pass_, k, bool(spec.get("canary", conv.get("canary"))),
                             int(spec["max_tokens"]))
                # Let the other lanes' chunks that arrived meanwhile be read (and timestamped) first: the
                # body and its send are the longest thing a lane does without waiting.
                await asyncio.sleep(0)
                payload = history.body(adapter.body([], turn.max_tokens, seed, model))
                opened.append(turn)
                try:
                    await _stream_within(session, chat_url, payload, turn, turn_timeout_s)
                except asyncio.CancelledError:
                    if turn.status is None:
                        turn.status, turn.end_ns = "cancelled", time.perf_counter_ns()
                    raise
                if turn.status != "done":
                    break  # no reply to continue this conversation from
                if not turn.canary:
                    finished_live += 1
                    if len(reservoir) < AUDIT_SAMPLE:
                        reservoir.append((turn, payload))
                    else:
                        j = chooser.randrange(finished_live)
                        if j < AUDIT_SAMPLE:
                            reservoir[j] = (turn, payload)
                reply = spec["reply"] if turn.canary else strip_special(turn.text(), specials)
                history.add({"role": "assistant", "content": reply})

    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30)
    # One connection per lane at most: the lanes are the only concurrency the server sees.
    connector = aiohttp.TCPConnector(limit=concurrency, **_small_send_buffer())
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False) as session:
        await _ready(session, base, adapter)
        flush = await _flush(session, base, adapter)
        started_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
        origin = time.perf_counter_ns()
        tasks = [asyncio.create_task(lane(i, session)) for i in range(concurrency)]
        # Lanes run until the window closes; a lane that crashed (a bug, not a failed turn) stops the run.
        done, _ = await asyncio.wait(tasks, timeout=warmup_s + window_s, return_when=asyncio.FIRST_EXCEPTION)
        stopped = time.perf_counter_ns()
        for task in tasks:
            task.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException) and not isinstance(result, asyncio.CancelledError):
                raise result
    for turn in opened:
        if turn.status in (None, "cancelled"):
            # open when the window closed: it ends at the stop, whenever its task noticed the cancel
            turn.status, turn.end_ns = "cancelled", stopped
    records = _records(opened, tokenizer, origin)
    audit = _audit(reservoir, opened, records)
    window_start = int(warmup_s * 1e9)
    out_facts = {
        "format": FORMAT, "version": FORMAT_VERSION, "engine": engine, "url": base, "model": model,
        "concurrency": concurrency, "seed": seed, "marker": marker,
        "warmup_s": warmup_s, "window_s": window_s, "turn_timeout_s": turn_timeout_s,
        "origin_ns": origin, "window_start_ns": window_start, "window_end_ns": window_start + int(window_s * 1e9),
        "stopped_ns": stopped - origin, "started_at": started_at, "flush": flush,
        "conversations": len(conversations), "turns_sent": len(records), "audit_population": finished_live,
        "renaming": renamer.facts(),
    }
    out_facts.update(facts or {})
    return {"facts": out_facts, "turns": records, "audit": audit}


def _audit(reservoir: list[tuple[_Turn, bytes]], opened: list[_Turn],
           records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The kept live turns that ended ok: where each came from, its exact request body, its reply's token ids."""
    place = {id(t): i for i, t in enumerate(opened)}
    out = []
    for turn, payload in reservoir:
        record = records[place[id(turn)]]
        if record["status"] != "ok":
            continue
        out.append({"lane": turn.lane, "conversation": turn.conversation, "pass": turn.pass_, "turn": turn.turn,
                    "max_tokens": turn.max_tokens, "request": payload.decode("utf-8"),
                    "token_ids": record.pop("_ids")})
    for record in records:
        record.pop("_ids", None)
    return out


async def resend(url: str, requests: list[tuple[bytes, int]], tokenizer: Any, *, engine: str, concurrency: int = 4,
                 turn_timeout_s: float = DEFAULT_TURN_TIMEOUT_S) -> list[dict[str, Any]]:
    """Send these request bodies (each with the max_tokens it asks for) again (the audit: pipeline/serving/evaluate.py) and return per body, in order,
    {"status", "error", "token_ids"}: the reply read and tokenised as the replay reads and counts it (the
    same stream parse, the same tokenizer, special tokens kept), at most `concurrency` at once, no cache
    flush. The body is sent byte for byte, its forced length and greedy decoding included."""
    import aiohttp

    adapter = engines.adapter(engine)
    base = url.rstrip("/")
    chat_url = base + engines.CHAT_PATH
    turns: list[_Turn] = []
    for i, (_body, max_tokens) in enumerate(requests):
        turns.append(_Turn(0, "audit", 0, i, False, int(max_tokens)))
    gate = asyncio.Semaphore(max(1, concurrency))

    async def one(session, turn: _Turn, body: bytes) -> None:
        async with gate:
            await _stream_within(session, chat_url, body, turn, turn_timeout_s)

    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30)
    connector = aiohttp.TCPConnector(limit=max(1, concurrency))
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False) as session:
        await _ready(session, base, adapter)
        await asyncio.gather(*(one(session, t, b) for t, (b, _n) in zip(turns, requests)))
    texts = [t.text() for t in turns]
    encodings = _encode_all(tokenizer, texts) if texts else []
    out = []
    for turn, enc in zip(turns, encodings):
        done = turn.status == "done"
        out.append({"status": "ok" if done else turn.status, "error": None if done else turn.error,
                    "token_ids": list(enc.ids)[:turn.max_tokens] if done else None})
    return out


def _encode_all(tokenizer: Any, texts: list[str]) -> list[Any]:
    batch = getattr(tokenizer, "encode_batch", None)
    if batch is not None:
        try:
            return batch(texts, add_special_tokens=False)
        except TypeError:
            return batch(texts)
    out = []
    for text in texts:
        try:
            out.append(tokenizer.encode(text, add_special_tokens=False))
        except TypeError:
            out.append(tokenizer.encode(text))
    return out


def attribute(ends: list[int], token_ends: list[int]) -> list[int]:
    """Tokens per chunk: token j belongs to the first chunk whose cumulative characters reach its end."""
    counts = [0] * len(ends)
    for end in token_ends:
        at = bisect_left(ends, end)
        counts[min(at, len(ends) - 1)] += 1
    return counts


def _prefix_counts(tokenizer: Any, text: str, ends: list[int]) -> list[int]:
    # A tokenizer without offsets: count the tokens of each prefix (quadratic, for small test tokenizers).
    counts, before = [], 0
    for end in ends:
        n = len(_encode_all(tokenizer, [text[:end]])[0].ids)
        n = max(n, before)
        counts.append(n - before)
        before = n
    return counts


def _records(opened: list[_Turn], tokenizer: Any, origin: int) -> list[dict[str, Any]]:
    texts = [t.text() for t in opened]
    encodings = _encode_all(tokenizer, texts) if texts else []
    records = []
    for turn, text, enc in zip(opened, texts, encodings):
        ids = list(enc.ids)
        offsets = getattr(enc, "offsets", None)
        if turn.ends:
            if offsets is not None:
                per_chunk = attribute(turn.ends, [end for _start, end in offsets])
            else:
                per_chunk = _prefix_counts(tokenizer, text, turn.ends)
        else:
            per_chunk = []
        streamed = len(ids)
        # At most max_tokens count: the excess is dropped from the last chunks that carried it.
        excess = max(0, sum(per_chunk) - turn.max_tokens)
        for i in range(len(per_chunk) - 1, -1, -1):
            if excess == 0:
                break
            take = min(excess, per_chunk[i])
            per_chunk[i] -= take
            excess -= take
        counted = sum(per_chunk)
        status = turn.status
        if status == "done":
            status = "ok" if streamed >= turn.max_tokens - 1 else "short"
        carrying = [i for i, n in enumerate(per_chunk) if n]
        first_ns = turn.times[carrying[0]] - origin if carrying else None
        end_ns = (turn.end_ns or origin) - origin
        if status in ("ok", "short") and carrying:
            end_ns = turn.times[carrying[-1]] - origin
        error = turn.error
        if status == "short":
            error = f"{streamed} tokens streamed, fewer than max_tokens - 1 = {turn.max_tokens - 1}"
        record = {
            "lane": turn.lane, "conversation": turn.conversation, "pass": turn.pass_, "turn": turn.turn,
            "canary": turn.canary, "max_tokens": turn.max_tokens,
            "send_ns": turn.send_ns - origin if turn.send_ns else None, "first_ns": first_ns, "end_ns": end_ns,
            "status": status, "error": error,
            "chunk_ns": [t - origin for t in turn.times], "chunk_tokens": per_chunk,
            "tokens": counted, "tokens_streamed": streamed, "usage": turn.usage,
        }
        if turn.canary:
            record["token_ids"] = ids
        else:
            record["_ids"] = ids[:turn.max_tokens]  # for the audit sample (_audit), dropped from the record there
        records.append(record)
    return records


# ----- the command -----

def _register(p) -> None:
    p.add_argument("--url", required=True, help="the server's base URL, e.g. http://127.0.0.1:30000")
    p.add_argument("--dataset", required=True, type=Path, help="the conversations (dataset generate's JSON, .gz too)")
    p.add_argument("--concurrency", required=True, type=int, help="lanes, each one conversation at a time")
    p.add_argument("--window", required=True, type=float, help="the measurement window in seconds")
    p.add_argument("--warmup", required=True, type=float, help="seconds replayed before the window opens")
    p.add_argument("--engine", required=True, choices=sorted(engines.ADAPTERS), help="the request adapter")
    p.add_argument("--seed", required=True, type=int, help="seeds the conversation queue (not the marker)")
    p.add_argument("--json", required=True, type=Path, help="where the records go (JSON)")
    p.add_argument("--turn-timeout", type=float, default=DEFAULT_TURN_TIMEOUT_S,
                   help=f"seconds a turn may take before it fails (default {DEFAULT_TURN_TIMEOUT_S:g})")
    p.add_argument("--tokenizer", type=Path, default=None,
                   help="the tokenizer.json to count output tokens with (default: the pinned one, "
                        "pipeline/serving/tokenizer.py); it must be the one the engine serves with")
    p.add_argument("--model", default=None, help="the model name to put in requests (default: none; the engine's own)")
    p.add_argument("--gpus", type=int, default=1, help="GPUs the engine runs on, for the printed T_c (default 1)")


def _load_tokenizer(path: Path | None):
    if path is None:
        from pipeline.serving import tokenizer as pinned

        try:
            return pinned.load(), {"tokenizer": "pinned", "tokenizer_sha256": pinned.pin()["sha256"]}
        except pinned.TokenizerError as exc:
            raise ReplayError(str(exc)) from None
    import hashlib

    from tokenizers import Tokenizer

    try:
        data = path.read_bytes()
        tok = Tokenizer.from_str(data.decode("utf-8"))
    except OSError as exc:
        raise ReplayError(f"--tokenizer {path}: cannot read it ({exc.strerror})") from None
    except Exception as exc:  # tokenizers raises its own Exception type for a file it cannot parse
        raise ReplayError(f"--tokenizer {path}: not a tokenizer.json that tokenizers can load ({exc})") from None
    return tok, {"tokenizer": str(path), "tokenizer_sha256": hashlib.sha256(data).hexdigest()}


def load_dataset(path: Path) -> tuple[str, list[dict[str, Any]], str]:
    """(system, conversations, content sha256) of a dataset file, refused with every structural problem."""
    from pipeline.serving import trace

    try:
        document = trace.read(path)
    except trace.DatasetError as exc:
        raise ReplayError(str(exc)) from None
    errors = trace.check_structure(document)
    if errors:
        shown = "\n  ".join(errors[:20])
        raise ReplayError(f"{path} is not a dataset the replay can use:\n  {shown}\n"
                          f"(python -m pipeline serving dataset check {path} lists everything)")
    sha = trace.content_sha256(document)
    recorded = document["metadata"]["content_sha256"]
    if sha != recorded:
        raise ReplayError(f"{path}: its content has sha256 {sha}, but its metadata says {recorded}: "
                          "the file was edited after it was generated; generate it again")
    return document["system"], document["conversations"], sha


def write_json(document: dict[str, Any], path: Path) -> None:
    """Written beside and renamed, so an interrupted write never leaves half a record file."""
    import orjson

    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    partial.write_bytes(orjson.dumps(document))
    os.replace(partial, path)


def replay_command(args) -> int:
    """Replay one concurrency level against a running server and write every turn's record.

    Exit 0 when the run completed and OUT was written (valid or not: the printed summary says, and
    metrics.py decides); 1 when the server is not ready, the flush fails or an input is unusable.
    """
    from pipeline.serving import metrics

    try:
        system, conversations, sha = load_dataset(args.dataset)
        tok, tok_facts = _load_tokenizer(args.tokenizer)
        document = asyncio.run(run(
            args.url, system, conversations, tok, engine=args.engine, concurrency=args.concurrency,
            window_s=args.window, warmup_s=args.warmup, seed=args.seed, turn_timeout_s=args.turn_timeout,
            model=args.model, facts={"dataset": str(args.dataset), "dataset_sha256": sha, **tok_facts}))
    except (ReplayError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    level = metrics.level(document, gpus=args.gpus)
    document["level"] = level
    write_json(document, args.json)
    print(metrics.summary_text(level))
    print(f"wrote {len(document['turns'])} turn records to {args.json}")
    return 0


COMMANDS = {"replay": (_register, replay_command)}
