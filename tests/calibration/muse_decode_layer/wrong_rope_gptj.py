"""RoPE in the GPT-J interleaved layout (pairs 2i, 2i+1) instead of neox (pairs i, i + D/2).

The template with one change: its rope() rotates adjacent pairs."""
from pathlib import Path

_TEMPLATE = Path(__file__).resolve().parents[3] / "problems" / "muse_decode_layer" / "template.py"
_src = _TEMPLATE.read_text()
_bug = _src
for _old, _new in [(
    "    t1, t2 = t[..., : D // 2].float(), t[..., D // 2:].float()\n    return torch.cat((t1 * cos - t2 * sin, t2 * cos + t1 * sin), dim=-1).to(t.dtype)",
    "    t1, t2 = t[..., 0::2].float(), t[..., 1::2].float()\n    return torch.stack((t1 * cos - t2 * sin, t2 * cos + t1 * sin), dim=-1).flatten(-2).to(t.dtype)",
)]:
    assert _old in _bug, f"the template changed; update this variant: {_old!r}"
    _bug = _bug.replace(_old, _new)
_doc = __doc__
exec(compile(_bug, str(_TEMPLATE) + " [wrong_rope_gptj]", "exec"))
__doc__ = _doc  # the template's own docstring must not replace this variant's
