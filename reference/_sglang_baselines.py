"""SGLang's own kernels as the baseline: the organizer switch `evaluate --baseline sglang` (issue 12).

On a runner where the pinned SGLang (sglang_pin/, 0.5.10.post1) is installed, an organizer may time
submissions against SGLang's kernels themselves instead of ours; every result records which baseline
it was measured against (`baseline`, `baseline_source`), and ours stays the default. SGLang cannot run
on this project's machines (it needs CUDA and its compiled sgl-kernel package), so nothing here has run
here: the tests check the selection and the clear refusal where SGLang is absent; the adapters were
written against the pinned source (the function and argument names below are 0.5.10.post1's).

One function per adapted problem, named after it, taking the problem's inputs (its README's layouts):
- muse_bf16_proj: SGLang's unquantised linear layers call torch's F.linear (cuBLAS), as ours does.
- muse_moe_w4a16: `fused_experts(..., use_int4_w4a16=True, block_shape=[0, group])`, the GPTQ/AWQ
  Triton MoE kernel. Our layout is the one it reads: w13 [E, 2I, H/2] uint8 with the even k in the low
  nibble, scales [E, 2I, H/group], the zero point 8 of a symmetric int4 (it subtracts 8 when given no
  zero points), and `inplace=False` (its default writes the hidden states in place).
The attention and layer problems are not adapted: SGLang's decode and extend attention read a token-level
KV layout through per-batch index tensors that its attention backend builds once per forward for all
layers, and an adapter that builds them inside every call would not be what SGLang times.
"""

from __future__ import annotations

import importlib.util

ADAPTED = ("muse_bf16_proj", "muse_moe_w4a16")


def available() -> tuple[bool, str | None]:
    """Whether SGLang can be imported here, and if not why (without importing it)."""
    if importlib.util.find_spec("sglang") is None:
        return False, "the sglang package is not installed in this Python (the pinned version: sglang_pin/)"
    return True, None


def version() -> str | None:
    try:
        from importlib.metadata import version as _version

        return _version("sglang")
    except Exception:  # noqa: BLE001 - not installed, or installed without metadata
        return None


def muse_bf16_proj(inputs: dict):
    import torch.nn.functional as F

    return F.linear(inputs["x"], inputs["w"])


def muse_moe_w4a16(inputs: dict):
    from sglang.srt.layers.moe.fused_moe_triton.fused_moe import fused_experts
    from sglang.srt.layers.moe.moe_runner import MoeRunnerConfig
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    x, w13, w2 = inputs["x"], inputs["w13"], inputs["w2"]
    group = x.shape[1] // inputs["w13_scale"].shape[-1]
    topk = StandardTopKOutput(topk_weights=inputs["topk_weights"], topk_ids=inputs["topk_ids"], router_logits=None)
    return fused_experts(x, w13, w2, topk, MoeRunnerConfig(inplace=False), use_int4_w4a16=True,
                         w1_scale=inputs["w13_scale"], w2_scale=inputs["w2_scale"], block_shape=[0, group])
