"""RoPE at each new token's index within the request (0, 1, ...) instead of its position after the prefix.

The template with one change: q and k are rotated at pos - prefix; the cache slots are right."""
from pathlib import Path

_TEMPLATE = Path(__file__).resolve().parents[3] / "problems" / "muse_prefill_layer" / "template.py"
_src = _TEMPLATE.read_text()
_bug = _src
for _old, _new in [("pos, theta)\n", "pos - prefix_lens.long()[req], theta)\n")]:
    assert _old in _bug, f"the template changed; update this variant: {_old!r}"
    _bug = _bug.replace(_old, _new)
_doc = __doc__
exec(compile(_bug, str(_TEMPLATE) + " [wrong_rope_positions_from_zero]", "exec"))
__doc__ = _doc  # the template's own docstring must not replace this variant's
