"""A Qwen-architecture checkpoint with random weights, for serving measurements where no weights can be
downloaded (the H200 we test on reaches no network; issue 14).

The shape is Qwen3-0.6B's (its public config.json: hidden 1024, 28 layers, 16 query heads and 8 KV heads
of 128, intermediate 3072, vocabulary 151,936, RoPE theta 1e6; the output head untied, below), so the engine does the
work a real small Qwen does per token; `--preset tiny` is a 2-layer, 64-wide one for CPU tests. The
tokenizer is the pinned one (pipeline/serving/tokenizer.py: Qwen's ranks and its three chat markers at
Qwen's ids), with ChatML as the chat template and <|im_end|> as the end of a turn, so the engine and the
replayer count with the same file. The weights come from a seeded initialisation: the same seed gives
the same checkpoint.

One change to the random weights: the replayer counts a reply's tokens by re-tokenising its text, and
random weights repeat a token or two under greedy decoding, often one that merges with itself ("\n\n"
is one token, as are runs of "!"), so the count came out far short of what was generated and every level
was invalid. So the output head is not tied to the embeddings, and its rows are zero except for the
words that re-tokenise as themselves in any order: a space and lowercase letters, one token alone (" the",
" of", ...; about half the vocabulary's first 50,000). A zero row's logit is 0 and some word's is above it
(of thousands of random ones, one is positive), so greedy decoding writes words, which the pre-tokeniser
splits back one token each.

    python benchmarks/serving_model.py OUT_DIR [--preset qwen3-0.6b|tiny] [--seed 0] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PRESETS = {
    "qwen3-0.6b": {"hidden_size": 1024, "num_hidden_layers": 28, "num_attention_heads": 16,
                   "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 3072},
    "tiny": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 16, "intermediate_size": 128},
}
VOCAB = 151_936  # Qwen2/2.5/3's embedding rows (151,643 ranks, the chat markers and padding)
CONTEXT = 40_960

# ChatML, as Qwen's templates write it for plain messages (no tools, no thinking blocks).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def word_tokens() -> list[int]:
    """Ids of the pinned vocabulary's words that re-tokenise as themselves whatever precedes or follows
    them: a space and lowercase ASCII letters, encoded alone as that one id."""
    from pipeline.serving import tokenizer as pinned

    tok = pinned.load()
    words = [(piece[1:], i) for piece, i in tok.get_vocab().items()
             if piece.startswith("\u0120") and len(piece) > 2 and piece[1:].isascii() and piece[1:].isalpha()
             and piece[1:].islower()]
    encoded = tok.encode_batch([" " + w for w, _ in words], add_special_tokens=False)
    return sorted(i for (_, i), e in zip(words, encoded) if e.ids == [i])


def build(out: Path, preset: str = "qwen3-0.6b", seed: int = 0, device: str = "cpu") -> Path:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from pipeline.serving import tokenizer as pinned

    ids = pinned.SPECIAL_TOKENS
    config = Qwen3Config(vocab_size=VOCAB, max_position_embeddings=CONTEXT, rope_theta=1_000_000.0,
                         tie_word_embeddings=False, rms_norm_eps=1e-6, torch_dtype="bfloat16",
                         bos_token_id=ids[pinned.ENDOFTEXT], eos_token_id=ids[pinned.IM_END],
                         pad_token_id=ids[pinned.ENDOFTEXT], **PRESETS[preset])
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    words = torch.tensor(word_tokens(), device=model.lm_head.weight.device)
    keep = torch.zeros(VOCAB, dtype=torch.bool, device=words.device)
    keep[words] = True
    with torch.no_grad():
        model.lm_head.weight[~keep] = 0
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    model.generation_config.eos_token_id = ids[pinned.IM_END]
    model.generation_config.pad_token_id = ids[pinned.ENDOFTEXT]
    model.generation_config.do_sample = False
    model.generation_config.save_pretrained(out)
    shutil.copyfile(pinned.path(), out / pinned.FILE_NAME)
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHAT_TEMPLATE,
        "eos_token": pinned.IM_END, "pad_token": pinned.ENDOFTEXT, "bos_token": None,
        "model_max_length": CONTEXT, "clean_up_tokenization_spaces": False,
        "additional_special_tokens": [pinned.IM_START, pinned.IM_END],
    }, indent=2, sort_keys=True) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps({
        "eos_token": pinned.IM_END, "pad_token": pinned.ENDOFTEXT,
        "additional_special_tokens": [pinned.IM_START, pinned.IM_END]}, indent=2, sort_keys=True) + "\n")
    for f in out.iterdir():  # safetensors writes 0600: the sandboxed server runs as a uid of its own
        f.chmod(0o644)
    params = sum(p.numel() for p in model.parameters())
    (out / "MODEL.md").write_text(
        f"Random weights (seed {seed}) in Qwen3's architecture, preset {preset}: {params:,} parameters, bf16. "
        "Built by benchmarks/serving_model.py for serving measurements; not a trained model.\n")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="qwen3-0.6b")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu", help="where to initialise the weights (cuda is faster)")
    args = ap.parse_args()
    path = build(args.out, args.preset, args.seed, args.device)
    print(f"wrote {path}: {(path / 'MODEL.md').read_text().strip()}")


if __name__ == "__main__":
    main()
