"""Top-k routing weights taken straight from the softmax over all experts, not renormalised to sum to 1.

The template with one change."""
from pathlib import Path

_TEMPLATE = Path(__file__).resolve().parents[3] / "problems" / "muse_decode_layer" / "template.py"
_src = _TEMPLATE.read_text()
_bug = _src
for _old, _new in [("    return ids, w / w.sum(-1, keepdim=True)", "    return ids, w")]:
    assert _old in _bug, f"the template changed; update this variant: {_old!r}"
    _bug = _bug.replace(_old, _new)
_doc = __doc__
exec(compile(_bug, str(_TEMPLATE) + " [wrong_topk_not_renormalised]", "exec"))
__doc__ = _doc  # the template's own docstring must not replace this variant's
