"""SGLang's own kernels as the baseline: the organizer switch `evaluate --baseline sglang` (issue 12), and
the benchmark that times them beside ours (benchmarks/sglang_kernels.py).

SGLang itself cannot be installed on this project's machines (it needs its compiled sgl-kernel package and
CUDA), but the kernels its fused MoE runs on an H200 are Triton, and Triton runs wherever we run. So the
kernels are taken from the **pinned source** (sglang_pin/pin.toml: the 0.5.10.post1 sdist, fetched and
verified by sha256 with `python -m pipeline serving fetch`): `build_kernels` copies the named top-level
functions out of the pinned files, unchanged, into one generated module (never committed, rebuilt and
checked byte for byte at every evaluation), and the adapters below call them in the order SGLang's
`fused_experts_impl` does. Nothing of SGLang is written here; the adapters are the glue its Python layer
would be.

muse_moe_w4a16, SGLang's CUDA path for a W4A16 (GPTQ/AWQ-style, symmetric, group 128) MoE at <= 32 tokens,
step by step (fused_moe.py of the pin):
1. `moe_align_block_size` is sgl-kernel's CUDA op: here ours (reference/_fused_moe_w4a16.py), which
   writes the same three tensors (pairs sorted by expert, each run padded to BLOCK_SIZE_M with the
   sentinel M*topk; each block's expert; the padded total), sized as SGLang sizes them (`numel * BM`
   below E + 1 pairs, else `numel + (E + 1) * (BM - 1)`), so its grid is SGLang's.
2. `invoke_fused_moe_kernel` -> `fused_moe_kernel_gptq_awq` over w13 (pinned, unchanged). Our layout is
   the one it reads: w13 [E, 2I, H/2] uint8 with the even k in the low nibble, scales [E, 2I, H/group],
   and no zero points (it subtracts 8).
3. `act_and_mul_triton` (pinned; SGLang's CUDA path takes it whenever filter_expert is on, the default).
4. `invoke_fused_moe_kernel` over w2 with the top-k weights applied (pinned).
5. The top-k sum: at <= 32 tokens SGLang calls `moe_sum_reduce_torch_compile` (pinned: torch.sum and
   mul_, under @torch.compile); here its body runs eagerly (two small kernels instead of one fused one:
   inductor inside the sandboxed worker would be a second compiler to trust). Above 32 tokens SGLang
   calls sgl-kernel's `moe_sum_reduce` (CUDA): here the pinned `moe_sum_reduce_triton`, its own fallback.
The block configuration is SGLang's rule: its tuned JSON for (E, N, device, dtype) if the pin ships one,
else `get_default_config` (pinned). The pin ships none for E=128, N=768, int4_w4a16 on any GPU, so SGLang
runs the default (BLOCK_SIZE_M 16, N 32, K 64) for this model unless a deployer tunes it; `config=`
overrides it (benchmarks/sglang_kernels.py searches SGLang's own space to see what a tuned deployment gets).

On a CPU (Triton's interpreter) the activations and caches are float32 with compute_type float32 (the
interpreter's bf16 dot is wrong); on a GPU everything is as SGLang runs it (bf16).

muse_bf16_proj: SGLang's unquantised linear layers call torch's F.linear (cuBLAS), as ours does.
The attention and layer problems are not adapted: SGLang's decode and extend attention read a token-level
KV layout through per-batch index tensors that its attention backend builds once per forward for all
layers; an adapter that builds them inside every call would not be what SGLang times.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import os
import sys
from pathlib import Path

ADAPTED = ("muse_bf16_proj", "muse_moe_w4a16")
MODULE = "_sglang_pinned"  # the generated module's name (and file stem)
_HERE = Path(__file__).resolve().parent

# The pinned files (git layout, relative to the tree's root) and the top-level functions taken from each,
# in the order they are written out. Their decorators are kept, except @torch.compile (see step 5 above).
PINNED = {
    "python/sglang/srt/layers/moe/fused_moe_triton/fused_moe_triton_kernels.py": (
        "write_zeros_to_output", "fused_moe_kernel_gptq_awq", "invoke_fused_moe_kernel", "tanh",
        "_apply_activation", "act_and_mul_kernel", "act_and_mul_triton", "_moe_sum_reduce_kernel",
        "moe_sum_reduce_triton"),
    "python/sglang/srt/layers/moe/fused_moe_triton/fused_moe_triton_config.py": ("get_default_config",),
    "python/sglang/srt/layers/moe/fused_moe_triton/fused_moe.py": ("moe_sum_reduce_torch_compile",),
}
# What the taken functions read from their modules' globals on the paths the adapters take, as those
# modules define them on a CUDA machine with SGLang's defaults (no SGLANG_MOE_PADDING, not ROCm, the
# server's deterministic-inference switch off).
PRELUDE = '''from __future__ import annotations

import types
from typing import Any, Dict, List, Optional, Tuple

import torch
import triton
import triton.language as tl

padding_size = 0
_is_cuda = True
_is_hip = False
_SERVER_ARGS = types.SimpleNamespace(enable_deterministic_inference=False, enable_fused_moe_sum_all_reduce=False)


def get_global_server_args():
    return _SERVER_ARGS
'''


class PinnedSourceMissing(RuntimeError):
    """The pinned SGLang source is not here (or lacks what the adapters take); the message says what to do."""


def _pin():
    """pipeline.serving.pin, the stage that fetches and verifies the pinned source (this file is loaded by
    path, with the repository's root maybe not on sys.path)."""
    sys.path.insert(0, str(_HERE.parent))
    try:
        from pipeline.serving import pin
    finally:
        sys.path.remove(str(_HERE.parent))
    return pin


def pinned_tree() -> Path | None:
    """The verified pinned tree (git layout), or None when it has not been fetched."""
    return _pin().cached_tree()


def available() -> tuple[bool, str | None]:
    """Whether the adapters can run here, and if not why (nothing is imported or built)."""
    if importlib.util.find_spec("triton") is None:
        return False, "Triton is not installed in this Python (SGLang's kernels are Triton kernels)"
    if pinned_tree() is None:
        return False, ("the pinned SGLang source is not fetched on this runner: run `python -m pipeline serving "
                       "fetch` once (it downloads and verifies sglang_pin/pin.toml's sdist)")
    return True, None


def version() -> str:
    p = _pin().load_pin()
    return f"{p.version} (sdist sha256 {p.sha256[:12]})"


def kernels_source(tree: Path) -> str:
    """The generated module's text: the prelude, then each taken function's source exactly as the pinned
    file has it (decorators included, @torch.compile dropped), under a comment naming its file and lines."""
    parts = ['"""Generated by reference/_sglang_baselines.py from the pinned SGLang source; not edited, never '
             'committed."""\n', PRELUDE]
    for rel, names in PINNED.items():
        path = Path(tree) / rel
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise PinnedSourceMissing(f"{path}: cannot read the pinned file ({exc.strerror}); fetch the pin again "
                                      "with `python -m pipeline serving fetch`") from None
        lines = text.splitlines(keepends=True)
        found = {node.name: node for node in ast.parse(text).body if isinstance(node, ast.FunctionDef)}
        for name in names:
            node = found.get(name)
            if node is None:
                raise PinnedSourceMissing(f"{rel} of the pinned SGLang has no top-level function {name}: the pin "
                                          "changed; update reference/_sglang_baselines.py PINNED")
            start = min([d.lineno for d in node.decorator_list] + [node.lineno])
            kept = [ln for i, ln in enumerate(lines[start - 1:node.end_lineno], start)
                    if not any(d.lineno <= i <= d.end_lineno and _is_torch_compile(d) for d in node.decorator_list)]
            parts.append(f"\n\n# {rel}:{start}-{node.end_lineno}\n" + "".join(kept))
    return "".join(parts)


def _is_torch_compile(decorator: ast.expr) -> bool:
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    return ast.unparse(target) == "torch.compile"


def build_kernels(tree: Path | None = None, into: Path | None = None) -> Path:
    """Write the generated module for the pinned tree into `into` (default: beside the cached tree, in a
    folder named by its content's hash) and return its folder (for sys.path). An existing file is used
    only if its bytes are exactly what the pinned source gives now; the file and its folder are readable
    by the sandboxed baseline's uid."""
    tree = tree or pinned_tree()
    if tree is None:
        raise PinnedSourceMissing(available()[1])
    data = kernels_source(Path(tree)).encode()
    digest = hashlib.sha256(data).hexdigest()
    folder = Path(into) if into else Path(tree).parent / f"{Path(tree).name}-muse-kernels" / digest[:16]
    target = folder / f"{MODULE}.py"
    try:
        if target.read_bytes() == data:
            return folder
    except OSError:
        pass
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{MODULE}.{os.getpid()}.tmp"
    tmp.write_bytes(data)
    tmp.chmod(0o644)
    os.replace(tmp, target)
    folder.chmod(folder.stat().st_mode | 0o055)  # the sandbox binds this folder; its parents are made there
    return folder


def _kernels():
    """The generated module (it must be on sys.path: the evaluator puts its folder there)."""
    if MODULE not in sys.modules:
        try:
            __import__(MODULE)
        except ImportError:
            sys.path.insert(0, str(build_kernels()))
            __import__(MODULE)
    return sys.modules[MODULE]


def muse_bf16_proj(inputs: dict):
    import torch.nn.functional as F

    return F.linear(inputs["x"], inputs["w"])


def moe_config(M: int, E: int, w13, w2, topk: int, group: int) -> dict:
    """SGLang's choice for this call: its tuned file if the pin ships one for this GPU, else its default.
    The pin ships no int4_w4a16 file for E=128, N=768 (and get_moe_configs' lookup needs SGLang's server
    state), so this is get_default_config, pinned, with SGLang's arguments (N is w2's last dim: I/2)."""
    k = _kernels()
    return dict(k.get_default_config(M, E, w2.shape[2], w13.shape[2], topk, "int4_w4a16", False, [0, group]))


def sglang_capacity(n_pairs: int, num_experts: int, bm: int) -> int:
    """moe_align_block_size's sizing of the sorted pairs (fused_moe_triton/moe_align_block_size.py)."""
    if n_pairs < num_experts + 1:
        return n_pairs * bm
    return n_pairs + (num_experts + 1) * (bm - 1)


def muse_moe_w4a16(inputs: dict, config: dict | None = None):
    import torch
    import triton.language as tl

    import _fused_moe_w4a16 as ours  # the alignment (sgl-kernel's op is CUDA C++)

    k = _kernels()
    x, topk_ids, topk_weights = inputs["x"], inputs["topk_ids"], inputs["topk_weights"]
    w13, w13_scale, w2, w2_scale = inputs["w13"], inputs["w13_scale"], inputs["w2"], inputs["w2_scale"]
    M, H = x.shape
    E, N, _ = w13.shape
    topk = topk_ids.shape[1]
    group = H // w13_scale.shape[-1]
    block_shape = [0, group]
    cfg = dict(config or moe_config(M, E, w13, w2, topk, group))
    interpreting = os.environ.get("TRITON_INTERPRET") == "1"
    act_dtype = torch.float32 if interpreting else x.dtype
    compute_type = tl.float32 if interpreting else (tl.bfloat16 if x.dtype == torch.bfloat16 else tl.float16)
    a = x.to(act_dtype)
    bm = cfg["BLOCK_SIZE_M"]
    sorted_ids, expert_ids, post_padded = ours.align_block_size(
        topk_ids, E, bm, capacity=sglang_capacity(topk_ids.numel(), E, bm))
    cache1 = torch.empty(M * topk, N, device=x.device, dtype=act_dtype)
    cache2 = torch.empty(M * topk, N // 2, device=x.device, dtype=act_dtype)
    cache3 = torch.empty(M, topk, w2.shape[1], device=x.device, dtype=act_dtype)
    quant = {"use_fp8_w8a8": False, "use_int8_w8a8": False, "use_int8_w8a16": False, "use_int4_w4a16": True,
             "per_channel_quant": False, "block_shape": block_shape}
    k.invoke_fused_moe_kernel(a, w13, None, cache1, None, w13_scale, None, topk_weights, topk_ids, sorted_ids,
                              expert_ids, post_padded, False, topk, cfg, compute_type=compute_type, c_sorted=False,
                              filter_expert=True, **quant)
    k.act_and_mul_triton(cache1, cache2, cfg, topk_ids, expert_ids, False, "silu")
    k.invoke_fused_moe_kernel(cache2, w2, None, cache3, None, w2_scale, None, topk_weights, topk_ids, sorted_ids,
                              expert_ids, post_padded, True, 1, cfg, compute_type=compute_type, a_use_tma=False,
                              b_use_tma=False, filter_expert=True, fuse_sum_all_reduce=False, router_topk=topk,
                              **quant)
    out = torch.empty(M, w2.shape[1], device=x.device, dtype=act_dtype)
    if M <= 32:
        k.moe_sum_reduce_torch_compile(cache3, out, 1.0)
    else:
        k.moe_sum_reduce_triton(cache3, out, 1.0)
    return out.to(x.dtype)
