"""Writes the new K/V one slot too far (at seq_lens[b] instead of positions[b]).

The template with one change: the append uses position + 1; attention then reads the unwritten slot."""
from pathlib import Path

_TEMPLATE = Path(__file__).resolve().parents[3] / "problems" / "muse_decode_layer" / "template.py"
_src = _TEMPLATE.read_text()
_bug = _src
for _old, _new in [("    p = pos.long()\n", "    p = pos.long() + 1\n")]:
    assert _old in _bug, f"the template changed; update this variant: {_old!r}"
    _bug = _bug.replace(_old, _new)
_doc = __doc__
exec(compile(_bug, str(_TEMPLATE) + " [wrong_kv_slot_off_by_one]", "exec"))
__doc__ = _doc  # the template's own docstring must not replace this variant's
