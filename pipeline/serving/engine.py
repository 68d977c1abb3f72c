"""The engines the replayer talks to: how each one is asked for a reply of exactly N tokens (and, for GSM8K,
for a reply of its own length).

The replay forces every reply to its dataset length, so that a server cannot shorten its work by stopping
early, and decodes greedily, so that canary turns can be compared token for token with the baseline's.
Engines spell that differently, and the launch template (never the competitor) picks the adapter:

  sglang        `max_tokens: N`, `ignore_eos: true`, `temperature: 0`; usage in the last chunk through
                `stream_options.include_usage`; `skip_special_tokens: false` (and no spaces between them),
                so that the special tokens a model writes once forced past its end stay in the text and
                the client counts them (SGLang 0.5.10's ChatCompletionRequest has both fields); the radix
                cache is emptied with POST /flush_cache (its http_server answers 200 when flushed, 400
                while requests are pending).
  transformers  `transformers serve` refuses unknown fields (`ignore_eos` is a 422) and, given a
                `generation_config`, builds its GenerationConfig from it alone: the field is a JSON
                *string* (transformers 5's cli/serving/utils.py does `GenerationConfig(**json.loads(...))`;
                an object is a 500), so the forced length is `min_new_tokens = max_new_tokens = N` in that
                string, with `do_sample: false`. `max_tokens` is left out: it would override
                max_new_tokens after the string is read. `stream_options` is accepted and ignored; usage
                comes in the final chunk anyway. No cache to flush. Its stream always drops special
                tokens (a DecodeStream with skip_special_tokens unless a response parser is set), so the
                engine must be kept from writing them or its forced turns count short; with continuous
                batching the first request's generation_config sets the logits processors of every later
                one (transformers 5.24's CBGenerateManager.init_cb), so the launch's warm-up request
                carries `suppress_tokens` with the special ids (tests/serving/test_transformers_serve.py).
  openai        `max_tokens: N` only (an OpenAI-compatible server that knows no forced length: its turns
                may stop early, and the replay then says so). No cache to flush.

The GSM8K gate asks the same engines for the opposite: a free-length greedy reply, the model stopping by
itself (its end-of-turn token), capped at max_tokens, not streamed (Adapter.free_body):

  sglang        `max_tokens`, `temperature: 0`; no `ignore_eos`, and the default detokenizer, which drops
                special tokens from the text.
  transformers  `max_tokens` and `temperature: 0`, and no `generation_config`: given that string,
                transformers serve builds the request's GenerationConfig from it alone, with no
                `eos_token_id` (transformers 5.24's _build_generation_config), and under continuous
                batching a request without one inherits the batch's (the first request's; -1, none, when
                that one carried a string too: continuous_api.py's init_continuous_batching), so the reply
                would never end before the cap. Without the string it starts from a copy of the model's
                own generation config, end-of-sequence ids included; `max_tokens` sets max_new_tokens and
                `temperature: 0` sets do_sample false. (Under continuous batching the first request's
                logits processors still apply to every later one: a warm-up that suppressed the special
                tokens for the forced replay suppresses the end of turn here too, and the replies run to
                the cap; the reading of the answer allows for it, pipeline/serving/score.py.)
  openai        `max_tokens`, `temperature: 0`.

Every engine is ready when GET /health answers 200 (`transformers serve`'s /v1/models scans the hub cache
and fails offline; SGLang's /health is its own readiness route).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable

HEALTH_PATH = "/health"


def _sglang(messages: list[dict[str, Any]], n: int, seed: int) -> dict[str, Any]:
    return {
        "messages": messages,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": n,
        "ignore_eos": True,
        "temperature": 0,
        "seed": seed,
        # Forced past its natural end a model writes <|im_end|> and other special tokens; the default
        # detokenizer drops them from the text, and the client's count of the text would come out short.
        # Kept, each counts as one token under the pinned tokenizer (the replay strips them from the history).
        "skip_special_tokens": False,
        # and no spaces put around them by a slow tokenizer's decode (SGLang reads this one from here)
        "chat_template_kwargs": {"spaces_between_special_tokens": False},
    }


def _transformers(messages: list[dict[str, Any]], n: int, seed: int) -> dict[str, Any]:
    generation = {"max_new_tokens": n, "min_new_tokens": n, "do_sample": False}
    return {
        "messages": messages,
        "stream": True,
        "temperature": 0,
        "seed": seed,
        "generation_config": json.dumps(generation, sort_keys=True),
    }


def _openai(messages: list[dict[str, Any]], n: int, seed: int) -> dict[str, Any]:
    return {
        "messages": messages,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": n,
        "temperature": 0,
        "seed": seed,
    }


def _free_greedy(messages: list[dict[str, Any]], n: int) -> dict[str, Any]:
    # The same plain OpenAI fields suit all three (docstring); transformers in particular gets no
    # generation_config string, which would replace the model's own, end-of-sequence ids and all.
    return {"messages": messages, "stream": False, "max_tokens": n, "temperature": 0}


@dataclass(frozen=True)
class Adapter:
    """How one engine is asked for a forced-length greedy stream, flushed and checked for readiness."""

    name: str
    build: Callable[[list[dict[str, Any]], int, int], dict[str, Any]]
    free: Callable[[list[dict[str, Any]], int], dict[str, Any]]  # the free-length greedy body (GSM8K)
    flush_path: str | None  # POSTed before a run; None where the engine keeps no cache we can empty
    health_path: str = HEALTH_PATH

    def body(self, messages: list[dict[str, Any]], max_tokens: int, seed: int,
             model: str | None = None) -> dict[str, Any]:
        """The JSON body of a streaming /v1/chat/completions request for a reply of exactly max_tokens."""
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise ValueError(f"max_tokens is {max_tokens!r}; a forced length is a positive integer")
        body = self.build(messages, max_tokens, seed)
        if model is not None:
            # Without a model the engine serves the one it was launched with (SGLang and transformers serve
            # both do); with one, transformers serve refuses any other than its pinned model.
            body["model"] = model
        return body

    def free_body(self, messages: list[dict[str, Any]], max_tokens: int,
                  model: str | None = None) -> dict[str, Any]:
        """The JSON body of a non-streaming /v1/chat/completions request for a greedy reply that ends where
        the model ends it, at most max_tokens long."""
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise ValueError(f"max_tokens is {max_tokens!r}; a cap on the reply is a positive integer")
        body = self.free(messages, max_tokens)
        if model is not None:
            body["model"] = model
        return body


ADAPTERS: dict[str, Adapter] = {
    "sglang": Adapter("sglang", _sglang, _free_greedy, flush_path="/flush_cache"),
    "transformers": Adapter("transformers", _transformers, _free_greedy, flush_path=None),
    "openai": Adapter("openai", _openai, _free_greedy, flush_path=None),
}

CHAT_PATH = "/v1/chat/completions"


def adapter(name: str) -> Adapter:
    """The adapter of an engine by name; a clear error naming the known ones otherwise."""
    try:
        return ADAPTERS[name]
    except KeyError:
        raise ValueError(f"unknown engine {name!r}: one of {', '.join(sorted(ADAPTERS))}") from None
