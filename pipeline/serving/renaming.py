"""Renaming: every replay of a live conversation is new to the server, in a way the server cannot undo.

The dataset's conversations come back in every run, level and block of an evaluation, and a replay's live
histories are the model's own greedy replies, so without this a server sees the same prompts again and again
(less the run's marker, a first line it can strip). A server that kept its earlier replies and served them
again for the same content skipped the model's work and scored S = 4.0 (issue 40): the reply it returned
was the model's, only not computed now, so neither the canaries nor the audit's comparison with the
baseline could tell, where the model ignores the marker (a real model mostly does).

So each replay of a live (non-canary) conversation, that is each (run, pass, conversation), renames about
half of the code identifiers its messages and fixed replies hold (SHARE: names with an underscore, a digit
after letters or mixed case, i.e. functions, variables, modules and the files named for them), the same
way in every message of that replay, to other identifiers drawn from the dataset's own with the same
number of tokens under the run's tokenizer, with the OS's randomness (random.SystemRandom: neither the seed
nor anything a server sees). Which names change, and to what, is new for every replay; the server sees
only the renamed text, and the set it was drawn from is the hidden one on the runner. A reply kept from an
earlier replay answers a prompt the model now reads with other names: it names functions and files the
conversation no longer has, and the audit's greedy-prefix comparison with the baseline on the same request
sees that (pipeline/serving/score.py, gate condition (d)). Nothing repeats across runs, levels or blocks,
so no cache of replies can hit; within a replay, prefix caching works as in production (one renaming for
all the turns of a conversation, and the system prefix, shared by every conversation of a run, is never
renamed).

What it keeps: the workload. An identifier becomes one with the same token count alone, so prompts keep
their lengths to within a fraction of a percent (measured on the public sample: benchmarks/renaming.py,
docs/BENCHMARKS.md); the forced reply lengths are the dataset's. Canary conversations are not renamed:
their prompts must be the same for every server so that their greedy tokens compare with the baseline's
(they are told apart by their fixed history as before; the audit's sample of live turns is what cannot
be told apart).
"""

from __future__ import annotations

import random
import re
from collections import defaultdict
from typing import Any, Callable

# Code identifiers, not English words: snake_case and _private names (an underscore before or between word
# characters) and CapWords/camelCase ones (an upper-case letter right after a lower-case one). Dunders
# (__init__) are Python's, not the project's, and stay.
IDENTIFIER = re.compile(r"\b(?:_*[A-Za-z][A-Za-z0-9]*(?:_+[A-Za-z0-9]+)+_*|_+[A-Za-z][A-Za-z0-9]*_*"
                        r"|[A-Za-z]*[a-z][A-Z][A-Za-z0-9]*)\b")
SHARE = 0.5  # the chance that each identifier of a conversation is renamed in a replay
MIN_LENGTH = 4  # shorter names (`_x`, `a_b`) are left alone: they carry little and have few same-sized peers


def identifiers(text: str) -> set[str]:
    return {m for m in IDENTIFIER.findall(text)
            if len(m) >= MIN_LENGTH and not (m.startswith("__") and m.endswith("__"))}


def _kind(name: str, size: int) -> tuple[int, int, bool, bool, bool]:
    """What a name is replaced within: its token count, its leading underscores, and its style (snake_case,
    capitalised, a trailing underscore), so that code keeps looking like the code it was."""
    bare = name.lstrip("_")
    return size, len(name) - len(bare), "_" in bare.rstrip("_"), bare[:1].isupper(), name.endswith("_")


def _token_count(tokenizer: Any, names: list[str]) -> list[int]:
    batch = getattr(tokenizer, "encode_batch", None)
    if batch is not None:
        return [len(e.ids) for e in batch(names)]
    return [len(tokenizer.encode(n).ids) for n in names]


class Renamer:
    """The renamings of one run: built once from the conversations, before the run's clock starts; a
    replay's renaming is then drawn in microseconds and applied one message at a time as turns are sent."""

    def __init__(self, conversations: list[dict[str, Any]], tokenizer: Any,
                 rng: random.Random | None = None) -> None:
        self._rng = rng or random.SystemRandom()
        self._names: list[list[str] | None] = []
        every: set[str] = set()
        for conv in conversations:
            if conv.get("canary"):
                self._names.append(None)
                continue
            names: set[str] = set()
            for turn in conv["turns"]:
                for message in turn["messages"]:
                    names |= identifiers(str(message.get("content") or ""))
                names |= identifiers(str(turn.get("reply") or ""))
            self._names.append(sorted(names))
            every |= names
        pool = sorted(every)
        self.size_of = dict(zip(pool, _token_count(tokenizer, pool))) if pool else {}
        self._peers: dict[tuple, list[str]] = defaultdict(list)
        for name, size in self.size_of.items():
            self._peers[_kind(name, size)].append(name)
        self.replays = 0  # replays renamed so far in this run
        self.renamed = 0  # identifiers renamed over them

    def facts(self) -> dict[str, Any]:
        return {"share": SHARE, "pool": len(self.size_of), "replays": self.replays, "identifiers": self.renamed}

    def replay(self, conversation: int) -> Callable[[str], str]:
        """The renaming of one replay of conversation `conversation` (its index): text -> renamed text."""
        names = self._names[conversation]
        if not names:
            return _same
        own = set(names)
        taken: set[str] = set()
        mapping: dict[str, str] = {}
        rng = self._rng
        for name in names:
            if rng.random() >= SHARE:
                continue
            peers = self._peers[_kind(name, self.size_of[name])]
            for _ in range(8):  # a free peer of the same size, not a name of this conversation
                other = peers[rng.randrange(len(peers))]
                if other not in own and other not in taken:
                    mapping[name] = other
                    taken.add(other)
                    break
        self.replays += 1
        self.renamed += len(mapping)
        if not mapping:
            return _same

        def rename(text: str) -> str:
            return IDENTIFIER.sub(lambda m: mapping.get(m.group(0), m.group(0)), text)
        return rename


def _same(text: str) -> str:
    return text


def message(rename: Callable[[str], str], msg: dict[str, Any]) -> dict[str, Any]:
    """The message with its text renamed (its other fields as they are)."""
    content = msg.get("content")
    if rename is _same or not isinstance(content, str):
        return msg
    return {**msg, "content": rename(content)}
