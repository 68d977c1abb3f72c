"""Adds the experts' output to the layer's input x instead of to the post-attention residual h.

The template with one change."""
from pathlib import Path

_TEMPLATE = Path(__file__).resolve().parents[3] / "problems" / "muse_prefill_layer" / "template.py"
_src = _TEMPLATE.read_text()
_bug = _src
for _old, _new in [("    return h + moe(hn, ids, w,", "    return x + moe(hn, ids, w,")]:
    assert _old in _bug, f"the template changed; update this variant: {_old!r}"
    _bug = _bug.replace(_old, _new)
_doc = __doc__
exec(compile(_bug, str(_TEMPLATE) + " [wrong_moe_residual_from_input]", "exec"))
__doc__ = _doc  # the template's own docstring must not replace this variant's
