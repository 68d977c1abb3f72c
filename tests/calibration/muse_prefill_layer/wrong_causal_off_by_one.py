"""Causal mask off by one: each new token also sees the token after it.

The template with one change: key position <= query position + 1."""
from pathlib import Path

_TEMPLATE = Path(__file__).resolve().parents[3] / "problems" / "muse_prefill_layer" / "template.py"
_src = _TEMPLATE.read_text()
_bug = _src
for _old, _new in [("mask = (key_pos[None, :] <= pos[:, None]) & mine[:, None]", "mask = (key_pos[None, :] <= pos[:, None] + 1) & mine[:, None]")]:
    assert _old in _bug, f"the template changed; update this variant: {_old!r}"
    _bug = _bug.replace(_old, _new)
_doc = __doc__
exec(compile(_bug, str(_TEMPLATE) + " [wrong_causal_off_by_one]", "exec"))
__doc__ = _doc  # the template's own docstring must not replace this variant's
