"""muse_prefill_layer: one whole decoder layer over the new tokens of a ragged batch ("extend").

Inputs (see problems/muse_prefill_layer/README.md):
  x            [T, H]                  bf16   hidden states of every request's new tokens, concatenated
  cu_seqlens   [B + 1]                 int32  request b's new tokens are x[cu_seqlens[b]:cu_seqlens[b+1]]
  prefix_lens  [B]                     int32  tokens already cached for request b (0: a plain prefill)
  k_cache      [pages, page, Hkv, D]   bf16   paged KV pool; holds each prefix; the new tokens' K/V are
  v_cache      [pages, page, Hkv, D]   bf16   written in place at positions prefix_lens[b] + j
  block_table  [B, max_pages]          int32  covers prefix_lens[b] + new tokens of every request
  attn_norm [H], wqkv [(Hq+2Hkv)*D, H], wo [H, Hq*D], ffn_norm [H], router [E, H]   bf16
  w13, w13_scale, w2, w2_scale                          W4A16 experts, as in muse_moe_w4a16
  eps, theta (floats), topk (int)                       model constants
Output [T, H] bf16. New token j of request b sits at position prefix_lens[b] + j and attends causally to
positions 0 .. prefix_lens[b] + j of its own request.

Shape keys: `new` (new tokens per request) and `prefix` (cached tokens per request), equal-length lists.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:  # the evaluator's child loads this file by path, without reference/ on sys.path
    sys.path.insert(0, _HERE)

import _muse_layer as layer  # noqa: E402
from muse_attention_decode import make_paged_cache  # noqa: E402

OUTPUT_DTYPE = torch.bfloat16


def _lens(shape) -> tuple[list[int], list[int]]:
    new = [int(n) for n in shape["new"]]
    prefix = [int(n) for n in shape.get("prefix", [0] * len(new))]
    if len(prefix) != len(new) or not new or min(new) < 1 or min(prefix) < 0:
        raise ValueError(f"{shape.name}: need equal-length lists new (>= 1) and prefix (>= 0)")
    return new, prefix


def _requests(inputs: dict):
    """(starts, prefix, new) as python lists, and per-token (req, pos) tensors."""
    cu = inputs["cu_seqlens"]
    cu_l = [int(v) for v in cu.tolist()]
    prefix = [int(v) for v in inputs["prefix_lens"].tolist()]
    new = [b - a for a, b in zip(cu_l[:-1], cu_l[1:])]
    dev = cu.device
    counts = torch.tensor(new, device=dev)
    req = torch.repeat_interleave(torch.arange(len(new), device=dev), counts)
    pos = torch.arange(cu_l[-1], device=dev) - cu.long()[req] + inputs["prefix_lens"].long()[req]
    return cu_l[:-1], prefix, new, req, pos


def make_inputs(shape, seed: int, device) -> dict:
    g = torch.Generator(device=device).manual_seed(seed)
    new, prefix = _lens(shape)
    T = sum(new)
    inputs, _ = layer.make_layer_inputs(shape, T, g, device)
    k_cache, v_cache, block_table = make_paged_cache([p + n for p, n in zip(prefix, new)], shape, g, device)
    cu = [0]
    for n in new:
        cu.append(cu[-1] + n)
    inputs.update(
        cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=device),
        prefix_lens=torch.tensor(prefix, dtype=torch.int32, device=device),
        k_cache=k_cache,
        v_cache=v_cache,
        block_table=block_table,
    )
    _, _, _, req, pos = _requests(inputs)
    slots = layer.cache_slots(block_table, req, pos, int(shape["page"]))
    layer.scribble(k_cache, slots, g)
    layer.scribble(v_cache, slots, g)
    return inputs


def reference(inputs: dict) -> dict:
    starts, prefix, new, req, pos = _requests(inputs)
    scale = layer.dims(inputs)["D"] ** -0.5

    def attend(q, k_cache, v_cache):
        return layer.extend_attention_ref(q, k_cache, v_cache, inputs["block_table"], starts, prefix, new, scale)

    return layer.layer_reference(inputs, req, pos, attend)


def written(inputs: dict) -> dict:
    *_, req, pos = _requests(inputs)
    mask = layer.written_mask(inputs, req, pos)
    return {"k_cache": mask, "v_cache": mask}


def baseline(inputs: dict, experts=None, fused_ops: bool | None = None) -> torch.Tensor:
    """Production-style composition in bf16 (see _muse_layer.layer_bf16): cuBLAS F.linear GEMMs, a Triton
    paged extend-attention kernel (_muse_layer.extend_attention_triton), muse_moe_w4a16's baseline experts
    (the fused MoE on a GPU, moe_torch on a CPU). On a GPU (fused_ops None: unless `experts` is given)
    SGLang's small fused kernels between the GEMMs (reference/_layer_ops.py) and the residual added in the
    MoE's last kernel, and no host synchronisation (CUDA-graph capturable); on a CPU the composition, with
    the attention per-request SDPA over the gathered pages (the interpreter would be slow)."""
    scale = layer.dims(inputs)["D"] ** -0.5
    if inputs["x"].is_cuda and layer.triton is not None:
        req, pos = layer.token_index(inputs["cu_seqlens"], inputs["prefix_lens"], inputs["x"].shape[0])

        def attend(q, k_cache, v_cache):
            return layer.extend_attention_triton(q, k_cache, v_cache, inputs["block_table"], inputs["cu_seqlens"],
                                                 inputs["prefix_lens"], scale)
    else:
        starts, prefix, new, req, pos = _requests(inputs)

        def attend(q, k_cache, v_cache):
            return layer.extend_attention_bf16(q, k_cache, v_cache, inputs["block_table"], starts, prefix, new,
                                               scale)

    if fused_ops is None:  # SGLang's small fused kernels between the GEMMs on a GPU (_layer_ops.py)
        fused_ops = experts is None and inputs["x"].is_cuda and layer.triton is not None
    return layer.layer_bf16(inputs, req, pos, attend, experts=experts, fused_ops=fused_ops)


def floor(shape) -> dict:
    new, prefix = _lens(shape)
    pairs = sum(n * p + n * (n + 1) // 2 for n, p in zip(new, prefix))
    return layer.layer_floor(shape, new=new, prefix=prefix, attn_pairs=pairs)
