"""Causal mask aligned top-left (SDPA's is_causal=True) instead of bottom-right: new token j sees positions 0..j instead of 0..P+j.

The template with one change: is_causal=True in place of the explicit mask."""
from pathlib import Path

_TEMPLATE = Path(__file__).resolve().parents[3] / "problems" / "muse_prefill_layer" / "template.py"
_src = _TEMPLATE.read_text()
_bug = _src
for _old, _new in [("attn_mask=mask,", "is_causal=True,")]:
    assert _old in _bug, f"the template changed; update this variant: {_old!r}"
    _bug = _bug.replace(_old, _new)
_doc = __doc__
exec(compile(_bug, str(_TEMPLATE) + " [wrong_causal_top_left]", "exec"))
__doc__ = _doc  # the template's own docstring must not replace this variant's
