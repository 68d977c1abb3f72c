"""Reading Python source as syntax, for the checks that read a submission or a patch without running it (the
kernel track's static scan, pipeline/kernel/static.py; the serving gate's flags, pipeline/serving/flags.py)."""

from __future__ import annotations

import ast


def dotted(node: ast.AST) -> str | None:
    """`a.b.c` for a chain of attributes on a plain name; None for anything else (a call, a subscript...)."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None
