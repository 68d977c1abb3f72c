"""Renaming: every replay of a live conversation is new to the server, in a way the server cannot undo.

The dataset's conversations come back in every run, level and block of an evaluation, and a replay's live
histories are the model's own greedy replies, so without this a server sees the same prompts again and again
(less the run's marker, a first line it can strip). A server that kept its earlier replies and served them
again for the same content skipped the model's work and scored S = 4.0 (issue 40): the reply it returned
was the model's, only not computed now, so neither the canaries nor the audit's comparison with the
baseline could tell, where the model ignores the marker (a real model mostly does).

So each replay of a live (non-canary) conversation, that is each (run, pass, conversation), renames about
half of the code identifiers its messages and fixed replies hold (SHARE: names with an underscore or of mixed
case, i.e. functions, variables, classes, modules and the files named for them), the same way in every message
of that replay, to other identifiers drawn from the dataset's own with the same number of tokens under the
run's tokenizer, with the OS's randomness (256 bits from the OS seed each replay's draws: neither the replay's
seed nor anything a server sees). Which names change, and to what, is new for every replay; the server sees
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
import secrets
from collections import defaultdict
from typing import Any

# Code identifiers, not English words: snake_case and _private names (an underscore before or between word
# characters) and CapWords/camelCase ones (an upper-case letter right after a lower-case one). Dunders
# (__init__) are Python's, not the project's, and stay.
IDENTIFIER = re.compile(r"\b(?:_*[A-Za-z][A-Za-z0-9]*(?:_+[A-Za-z0-9]+)+_*|_+[A-Za-z][A-Za-z0-9]*_*"
                        r"|[A-Za-z]*[a-z][A-Z][A-Za-z0-9]*)\b")
SHARE = 0.5  # the chance that each identifier of a conversation is renamed in a replay
PREPARED = 3  # replays of each conversation whose names are drawn before the run's clock starts
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


class Replay:
    """One replay's text: turn k's messages and fixed reply with this replay's names, each one str.format
    of a template made before the clock started (tens of microseconds for the longest message)."""

    def __init__(self, conv: "_Templates | None", original: dict[str, Any], names: list[str]) -> None:
        self._conv, self._original, self.names = conv, original, names

    def messages(self, k: int) -> list[dict[str, Any]]:
        if self._conv is None:
            return self._original["turns"][k]["messages"]
        return [{**m, "content": t.format(*self.names)} if t is not None else m
                for m, t in zip(self._original["turns"][k]["messages"], self._conv.messages[k])]

    def reply(self, k: int) -> str:
        if self._conv is None:
            return self._original["turns"][k]["reply"]
        return self._conv.replies[k].format(*self.names)


class _Templates:
    """A live conversation's names (sorted) and its texts with {i} where name i stands."""

    def __init__(self, conv: dict[str, Any]) -> None:
        texts = [str(m.get("content") or "") for t in conv["turns"] for m in t["messages"]]
        texts += [str(t.get("reply") or "") for t in conv["turns"]]
        self.own = set().union(*(identifiers(t) for t in texts))
        self.names = sorted(self.own)
        slot = {n: "{%d}" % i for i, n in enumerate(self.names)}

        def template(text: str) -> str:
            escaped = text.replace("{", "{{").replace("}", "}}")  # names hold no braces
            return IDENTIFIER.sub(lambda m: slot.get(m.group(0), m.group(0)), escaped)
        self.messages = [[template(m["content"]) if isinstance(m.get("content"), str) else None
                          for m in t["messages"]] for t in conv["turns"]]
        self.replies = [template(str(t.get("reply") or "")) for t in conv["turns"]]


class Names:
    """What a dataset offers to rename, built once for an evaluation (it reads every text once: about a
    second for each 4 MB): each live conversation's templates, each name's token count and its peers."""

    def __init__(self, conversations: list[dict[str, Any]], tokenizer: Any) -> None:
        self.conversations = conversations
        self.templates = [None if c.get("canary") else _Templates(c) for c in conversations]
        pool = sorted(set().union(*(t.names for t in self.templates if t is not None)))
        self.size_of = dict(zip(pool, _token_count(tokenizer, pool))) if pool else {}
        kinds: dict[tuple, list[str]] = defaultdict(list)
        for name, size in self.size_of.items():
            kinds[_kind(name, size)].append(name)
        self.peers = {name: kinds[_kind(name, size)] for name, size in self.size_of.items()}


class Renamer:
    """The renamings of one run, over a dataset's Names, set up before the run's clock starts; a replay's
    text is then made from its templates as its turns are sent (Replay)."""

    def __init__(self, names: Names, rng: random.Random | None = None) -> None:
        # Each replay draws from a generator seeded with 256 bits from the OS (fast, and what one replay
        # shows a server says nothing about another's); `rng` fixes the draws for a test.
        self._rng = rng
        self.names = names
        # the first PREPARED replays of each conversation, drawn now rather than in the window
        self._ready = [[self._draw(t) for _ in range(PREPARED)] if t is not None else [] for t in names.templates]
        self.replays = 0  # replays renamed so far in this run
        self.renamed = 0  # identifiers renamed over them

    def facts(self) -> dict[str, Any]:
        return {"share": SHARE, "pool": len(self.names.size_of), "replays": self.replays,
                "identifiers": self.renamed}

    def replay(self, conversation: int) -> Replay:
        """A new replay of conversation `conversation` (its index), with names of its own: one of those drawn
        before the clock started while they last, else drawn now (about a millisecond)."""
        conv, templates = self.names.conversations[conversation], self.names.templates[conversation]
        if templates is None:
            return Replay(None, conv, [])
        ready = self._ready[conversation]
        names, renamed = ready.pop() if ready else self._draw(templates)
        self.replays += 1
        self.renamed += renamed
        return Replay(templates, conv, names)

    def _draw(self, templates: _Templates) -> tuple[list[str], int]:
        rng = self._rng or random.Random(secrets.token_bytes(32))
        own, taken = templates.own, set()
        names = list(templates.names)
        renamed = 0
        peers_of, draw = self.names.peers, rng.random
        for i, name in enumerate(templates.names):
            if draw() >= SHARE:
                continue
            peers = peers_of[name]
            for _ in range(8):  # a free peer of the same kind, not a name of this conversation
                other = peers[int(draw() * len(peers))]
                if other not in own and other not in taken:
                    names[i] = other
                    taken.add(other)
                    renamed += 1
                    break
        return names, renamed
