"""Forgets the residual around attention: h = wo @ attention instead of x + wo @ attention.

The template with one change."""
from pathlib import Path

_TEMPLATE = Path(__file__).resolve().parents[3] / "problems" / "muse_decode_layer" / "template.py"
_src = _TEMPLATE.read_text()
_bug = _src
for _old, _new in [("    h = x + F.linear(", "    h = F.linear(")]:
    assert _old in _bug, f"the template changed; update this variant: {_old!r}"
    _bug = _bug.replace(_old, _new)
_doc = __doc__
exec(compile(_bug, str(_TEMPLATE) + " [wrong_no_attn_residual]", "exec"))
__doc__ = _doc  # the template's own docstring must not replace this variant's
