"""Attends over the cached tokens only (positions[b] of them), missing the new token: an off-by-one context length.

The template with one change: attention gets positions instead of seq_lens."""
from pathlib import Path

_TEMPLATE = Path(__file__).resolve().parents[3] / "problems" / "muse_decode_layer" / "template.py"
_src = _TEMPLATE.read_text()
_bug = _src
for _old, _new in [("o = attention(q, k_cache, v_cache, block_table, seq_lens,", "o = attention(q, k_cache, v_cache, block_table, pos,")]:
    assert _old in _bug, f"the template changed; update this variant: {_old!r}"
    _bug = _bug.replace(_old, _new)
_doc = __doc__
exec(compile(_bug, str(_TEMPLATE) + " [wrong_context_misses_new_token]", "exec"))
__doc__ = _doc  # the template's own docstring must not replace this variant's
