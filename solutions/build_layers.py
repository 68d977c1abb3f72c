"""Build the organizers' layer solutions from their parts (issue 18).

A submission is one file, and a layer's solution is made of the kernel problems' solutions: so
solutions/<layer>/submission.py is GENERATED from solutions/<layer>/layer.py (the layer's own kernels and
its composition) and the named parts' submission.py, each part's CONFIGS, config_for and custom_kernel
renamed with the part's prefix (attn_CONFIGS, attn_config_for, attn_kernel), its docstring and imports
dropped (the build puts one set of imports first). One copy of every kernel in the tree's sources; the
test suite fails while a generated file differs from its build.

    python solutions/build_layers.py           # write every layer's submission.py
    python solutions/build_layers.py --check   # exit 1, naming the file, where one differs
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
# layer -> its parts, (a problem's solution or a file under solutions/, the prefix of its renamed names or
# None), in the order they are placed
LAYERS = {
    "muse_decode_layer": [("muse_attention_decode", "attn"), ("muse_moe_w4a16", "moe"), ("layer_ops.py", None)],
    "muse_prefill_layer": [("muse_moe_w4a16", "moe"), ("layer_ops.py", None)],
}
RENAMED = ("CONFIGS", "config_for", "custom_kernel")


def _split(text: str, where: str) -> tuple[str, list[str], str]:
    """(docstring, import lines, the rest) of a module's source: the imports are the top-level `import` and
    `from` statements before the first other statement."""
    tree = ast.parse(text, where)
    body = tree.body
    doc = ast.get_docstring(tree, clean=False) or ""
    start = 1 if doc else 0
    imports = []
    lines = text.splitlines(keepends=True)
    end = body[start].lineno - 1 if len(body) > start else len(lines)
    for node in body[start:]:
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            end = (node.decorator_list[0].lineno if getattr(node, "decorator_list", None) else node.lineno) - 1
            break
        imports.append("".join(lines[node.lineno - 1:node.end_lineno]).strip())
    else:
        end = len(lines)
    return doc, imports, "".join(lines[end:]).lstrip("\n")


def _renamed(text: str, prefix: str) -> str:
    for name in RENAMED:
        new = f"{prefix}_kernel" if name == "custom_kernel" else f"{prefix}_{name}"
        text = re.sub(rf"\b{name}\b", new, text)
    return text


def build(layer: str) -> str:
    own = HERE / layer / "layer.py"
    doc, imports, body = _split(own.read_text(), str(own))
    sections = []
    for part, prefix in LAYERS[layer]:
        path = HERE / part if part.endswith(".py") else HERE / part / "submission.py"
        _, part_imports, part_body = _split(path.read_text(), str(path))
        imports += [line for line in part_imports if line not in imports]
        how = f" ({', '.join(RENAMED)} prefixed {prefix}_)" if prefix else ""
        text = _renamed(part_body, prefix) if prefix else part_body
        sections.append(f"# ---- from {path.relative_to(HERE.parent)}{how} ----\n\n" + text.rstrip("\n") + "\n")
    plain = sorted(line for line in imports if line.startswith("import "))
    froms = sorted(line for line in imports if line.startswith("from "))
    head = f'"""{doc}"""\n\n' + "\n".join(plain + froms) + "\n\n\n"
    return head + "\n\n".join(sections) + f"\n\n# ---- the layer's own part: solutions/{layer}/layer.py ----\n\n" + body


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    stale = []
    for layer in LAYERS:
        target = HERE / layer / "submission.py"
        text = build(layer)
        if args.check:
            if not target.is_file() or target.read_text() != text:
                stale.append(target)
        else:
            target.write_text(text)
            print(f"wrote {target}")
    for target in stale:
        print(f"{target} differs from its build: run `python solutions/build_layers.py`", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
