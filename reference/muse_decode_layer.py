"""muse_decode_layer: one whole decoder layer for B decode tokens (one new token per request).

Inputs (see problems/muse_decode_layer/README.md):
  x            [B, H]                  bf16   hidden states of the new tokens
  positions    [B]                     int32  the new token's position = its request's cached length
  seq_lens     [B]                     int32  positions + 1: the tokens attention covers, the new one included
  k_cache      [pages, page, Hkv, D]   bf16   paged KV pool (written in place at the new tokens' slots)
  v_cache      [pages, page, Hkv, D]   bf16
  block_table  [B, max_pages]          int32  covers every request's seq_lens[b] tokens
  attn_norm [H], wqkv [(Hq+2Hkv)*D, H], wo [H, Hq*D], ffn_norm [H], router [E, H]   bf16
  w13, w13_scale, w2, w2_scale                          W4A16 experts, as in muse_moe_w4a16
  eps, theta (floats), topk (int)                       model constants
Output [B, H] bf16, and the caches written at (block_table[b, positions[b] // page], positions[b] % page).

A workload's `seq_lens` are the context lengths of muse_attention_decode: the layer appends the token at
position seq_lens - 1 and then attends over exactly the tokens that problem attends over.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:  # the evaluator's child loads this file by path, without reference/ on sys.path
    sys.path.insert(0, _HERE)

import _muse_layer as layer  # noqa: E402
from muse_attention_decode import attention_decode_ref, make_paged_cache, torch_decode  # noqa: E402

try:
    from muse_attention_decode import split_kv_decode  # noqa: E402
except ImportError:  # pragma: no cover - without triton
    split_kv_decode = None

OUTPUT_DTYPE = torch.bfloat16


def _lens(shape) -> list[int]:
    lens = [int(n) for n in shape["seq_lens"]]
    if "B" in shape.params and int(shape["B"]) != len(lens):
        raise ValueError(f"{shape.name}: B = {shape['B']} but {len(lens)} seq_lens")
    if min(lens) < 1:
        raise ValueError(f"{shape.name}: every seq_len must count the new token (>= 1)")
    return lens


def _tokens(inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    pos = inputs["positions"]
    return torch.arange(pos.shape[0], device=pos.device), pos


def make_inputs(shape, seed: int, device) -> dict:
    g = torch.Generator(device=device).manual_seed(seed)
    lens = _lens(shape)
    B = len(lens)
    inputs, _ = layer.make_layer_inputs(shape, B, g, device)
    k_cache, v_cache, block_table = make_paged_cache(lens, shape, g, device)
    positions = torch.tensor([n - 1 for n in lens], dtype=torch.int32, device=device)
    inputs.update(
        positions=positions,
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        k_cache=k_cache,
        v_cache=v_cache,
        block_table=block_table,
    )
    slots = layer.cache_slots(block_table, torch.arange(B, device=device), positions, int(shape["page"]))
    layer.scribble(k_cache, slots, g)
    layer.scribble(v_cache, slots, g)
    return inputs


def reference(inputs: dict) -> dict:
    req, pos = _tokens(inputs)
    scale = layer.dims(inputs)["D"] ** -0.5

    def attend(q, k_cache, v_cache):
        return attention_decode_ref(q, k_cache, v_cache, inputs["block_table"], inputs["seq_lens"], scale)

    return layer.layer_reference(inputs, req, pos, attend)


def written(inputs: dict) -> dict:
    req, pos = _tokens(inputs)
    mask = layer.written_mask(inputs, req, pos)
    return {"k_cache": mask, "v_cache": mask}


def baseline(inputs: dict, experts=None, fused_ops: bool | None = None) -> torch.Tensor:
    """Production-style composition in bf16 (see _muse_layer.layer_bf16): cuBLAS F.linear GEMMs, the
    Triton split-KV paged decode kernel of muse_attention_decode (batched PyTorch on a CPU), muse_moe_w4a16's
    baseline experts (the fused MoE on a GPU, moe_torch on a CPU). On a GPU (fused_ops None: unless
    `experts` is given) SGLang's small fused kernels between the GEMMs (reference/_layer_ops.py: RMSNorm,
    RoPE with the cache write, the residual add with the second norm, softmax-top-k) and the residual added
    in the MoE's last kernel; measured 1.09-1.43x faster than the unfused composition on the H200
    (docs/BENCHMARKS.md, "Production baselines"). No host synchronisation: CUDA-graph capturable."""
    req, pos = _tokens(inputs)
    scale = layer.dims(inputs)["D"] ** -0.5

    def attend(q, k_cache, v_cache):
        args = (q, k_cache, v_cache, inputs["block_table"], inputs["seq_lens"], scale)
        if q.is_cuda and split_kv_decode is not None:
            return split_kv_decode(*args)
        return torch_decode(*args)

    if fused_ops is None:  # SGLang's small fused kernels between the GEMMs on a GPU (_layer_ops.py)
        fused_ops = experts is None and inputs["x"].is_cuda and layer.triton is not None
    return layer.layer_bf16(inputs, req, pos, attend, experts=experts, fused_ops=fused_ops)


def floor(shape) -> dict:
    lens = _lens(shape)
    return layer.layer_floor(shape, new=[1] * len(lens), prefix=[n - 1 for n in lens], attn_pairs=sum(lens))
