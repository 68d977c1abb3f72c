"""The replay's renaming (pipeline/serving/renaming.py) on the committed public sample, with the pinned
tokenizer: each replay of a live conversation is new and self-consistent, the workload keeps its lengths,
and what must stay the same for every server (canaries, the system prefix, Python's own names) does."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest

from pipeline.serving import renaming, tokenizer as pinned, trace

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def sample():
    doc = trace.read(ROOT / "datasets" / "serving" / "public-sample.json.gz")
    tok = pinned.load()
    return doc, tok, renaming.Renamer(renaming.Names(doc["conversations"], tok), rng=random.Random(5))


def _texts(conv):
    for turn in conv["turns"]:
        for m in turn["messages"]:
            yield m["content"]
        yield turn["reply"]


def _pairs(conv, replay):
    """Every text of a conversation beside the same text in one replay."""
    for k, turn in enumerate(conv["turns"]):
        for m, renamed in zip(turn["messages"], replay.messages(k), strict=True):
            assert {**m, "content": None} == {**renamed, "content": None}  # only the text changes
            yield m["content"], renamed["content"]
        yield turn["reply"], replay.reply(k)


def _mapping(conv, replay):
    """The names a replay renamed, read back from its output: name -> its new name."""
    seen = {}
    for text, renamed in _pairs(conv, replay):
        before = [m.group(0) for m in renaming.IDENTIFIER.finditer(text)]
        after = [m.group(0) for m in renaming.IDENTIFIER.finditer(renamed)]
        assert len(before) == len(after)  # one name for one name: the text's shape is kept
        for a, b in zip(before, after):
            assert seen.setdefault(a, b) == b, f"{a} renamed two ways in one replay: {seen[a]} and {b}"
        assert renaming.IDENTIFIER.sub("#", text) == renaming.IDENTIFIER.sub("#", renamed)  # nothing else moved
    return {a: b for a, b in seen.items() if a != b}


def test_a_replay_renames_half_its_code_names_the_same_way_everywhere(sample):
    doc, tok, renamer = sample
    live = [(i, c) for i, c in enumerate(doc["conversations"]) if not c["canary"]]
    shares = []
    for ci, conv in live:
        mapping = _mapping(conv, renamer.replay(ci))
        own = set().union(*(renaming.identifiers(t) for t in _texts(conv)))
        shares.append(len(mapping) / len(own))
        assert len(set(mapping.values())) == len(mapping)  # two names never become one
        assert not set(mapping.values()) & own  # nor a name the conversation already has
        for old, new in mapping.items():
            assert renaming._kind(old, renamer.names.size_of[old]) == renaming._kind(new, renamer.names.size_of[new])
            assert not (old.startswith("__") and old.endswith("__"))
    assert 0.4 < sum(shares) / len(shares) < 0.6


def test_every_replay_of_a_conversation_differs_from_the_others_from_its_first_message(sample):
    doc, _, renamer = sample
    for ci, conv in enumerate(doc["conversations"]):
        first = conv["turns"][0]["messages"][0]["content"]
        seen = {renamer.replay(ci).messages(0)[0]["content"] for _ in range(2 * renaming.PREPARED)}
        if conv["canary"]:
            assert seen == {first}  # a canary's prompts are the same for every server
        else:
            assert len(seen) == 2 * renaming.PREPARED and first not in seen


def test_the_workload_keeps_its_lengths(sample):
    doc, tok, renamer = sample
    before = after = 0
    for ci, conv in enumerate(doc["conversations"]):
        for text, renamed in _pairs(conv, renamer.replay(ci)):
            n, m = len(tok.encode(text).ids), len(tok.encode(renamed).ids)
            before, after = before + n, after + m
            assert abs(m - n) <= max(3, 0.08 * n), (n, m)
    assert abs(after / before - 1) < 0.005, after / before


def test_english_braces_and_python_s_own_names_stay():
    text = "The function __init__ of self calls os.path.join and parse_it({x}) with MaxValue; see README.md."
    convs = [{"canary": False, "turns": [{"messages": [{"role": "user", "content": text}], "reply": "parse_it"}]},
             {"canary": False, "turns": [{"messages": [{"role": "user", "content": "get_all SomeThing"}],
                                          "reply": ""}]}]
    renamer = renaming.Renamer(renaming.Names(convs, pinned.load()), rng=random.Random(1))
    assert renaming.identifiers(text) == {"parse_it", "MaxValue"}
    outputs = {renamer.replay(0).messages(0)[0]["content"] for _ in range(30)}
    assert len(outputs) > 1  # something was renamed
    for renamed in outputs:
        assert re.sub(r"\b(parse_it|MaxValue|get_all|SomeThing)\b", "X", renamed) == \
            re.sub(r"\b(parse_it|MaxValue)\b", "X", text)


def test_the_replay_records_what_it_renamed(sample):
    doc, _, renamer = sample
    renamer.replay(1)
    facts = renamer.facts()
    assert facts["share"] == renaming.SHARE and facts["pool"] > 1000 and facts["replays"] > 0
    assert facts["identifiers"] > 50 * facts["replays"] / 2
