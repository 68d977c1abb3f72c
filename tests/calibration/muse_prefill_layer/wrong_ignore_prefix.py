"""Ignores the cached prefix: the new tokens attend only to each other (causally).

The template with one change: keys before the request's first new position are masked out."""
from pathlib import Path

_TEMPLATE = Path(__file__).resolve().parents[3] / "problems" / "muse_prefill_layer" / "template.py"
_src = _TEMPLATE.read_text()
_bug = _src
for _old, _new in [("mask = (key_pos[None, :] <= pos[:, None]) & mine[:, None]", "mask = (key_pos[None, :] <= pos[:, None]) & mine[:, None] & (key_pos[None, :] >= torch.where(mine, pos, pos.max()).min())")]:
    assert _old in _bug, f"the template changed; update this variant: {_old!r}"
    _bug = _bug.replace(_old, _new)
_doc = __doc__
exec(compile(_bug, str(_TEMPLATE) + " [wrong_ignore_prefix]", "exec"))
__doc__ = _doc  # the template's own docstring must not replace this variant's
