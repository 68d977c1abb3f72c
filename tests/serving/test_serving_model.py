"""benchmarks/serving_model.py: the random-weight Qwen checkpoint the H200 serving run uses is a model
transformers loads with the pinned tokenizer and ChatML, the same for the same seed, readable by others."""

from __future__ import annotations

import hashlib
import importlib.util
import stat
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.heavy  # two checkpoints built and a model loaded: ~20 s on 2 cores


def _builder():
    spec = importlib.util.spec_from_file_location("serving_model", ROOT / "benchmarks" / "serving_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    pytest.importorskip("transformers")
    mod = _builder()
    a = mod.build(tmp_path_factory.mktemp("a"), "tiny", seed=3)
    b = mod.build(tmp_path_factory.mktemp("b"), "tiny", seed=3)
    return mod, a, b


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_same_seed_gives_the_same_checkpoint(built):
    _, a, b = built
    for name in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"):
        assert _sha(a / name) == _sha(b / name), name


def test_the_checkpoint_speaks_chatml_with_the_pinned_tokenizer(built):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.serving import tokenizer as pinned

    _, a, _ = built
    assert _sha(a / "tokenizer.json") == _sha(pinned.path())
    tok = AutoTokenizer.from_pretrained(a)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token_id == pinned.SPECIAL_TOKENS[pinned.IM_END]
    model = AutoModelForCausalLM.from_pretrained(a)
    ids = torch.tensor([tok(text)["input_ids"]])
    out = model.generate(ids, max_new_tokens=3, min_new_tokens=3, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 3
    assert model.config.vocab_size == 151_936 and model.config.architectures == ["Qwen3ForCausalLM"]


def test_a_greedy_reply_counts_back_to_its_length(built):
    """What the replayer does with a forced reply: decode the generated ids to text, re-tokenise it with the
    pinned tokenizer: the count is the number generated (random weights left alone wrote "\n" runs, which
    merge: 2 tokens counted of 21 generated)."""
    import torch
    from transformers import AutoModelForCausalLM

    from pipeline.serving import tokenizer as pinned

    _, a, _ = built
    model = AutoModelForCausalLM.from_pretrained(a)
    tok = pinned.load()
    for prompt in ("<|im_start|>user\nfix the bug in parse()<|im_end|>\n<|im_start|>assistant\n",
                   "<|im_start|>user\n$ grep -n def x.py\n1:def f():<|im_end|>\n<|im_start|>assistant\n"):
        ids = torch.tensor([tok.encode(prompt, add_special_tokens=False).ids])
        out = model.generate(ids, max_new_tokens=40, min_new_tokens=40, do_sample=False)[0, ids.shape[1]:]
        text = tok.decode(out.tolist(), skip_special_tokens=False)
        assert pinned.count(text) == 40, (text, out.tolist())


def test_every_file_is_readable_by_the_servers_own_uid(built):
    _, a, _ = built
    for f in a.iterdir():
        assert f.stat().st_mode & stat.S_IROTH, f"{f.name} is {oct(f.stat().st_mode)}"
