"""The house's rules about imports, read from the source with `ast` (nothing is imported): no module of
the pipeline imports the CLI (`pipeline.cli`, which only gathers the stages' verbs, or `pipeline.__main__`);
the imports of pipeline/ and reference/ form no circle, function-level ones included (a function-level
import is lazy, not free: it still ties the two modules together); and the layers a reader relies on hold
(LAYERS: the result schema imports no stage, exit codes are a leaf, rendering knows no transport, the
transport renders nothing). And the CLI's table of stages: each stage's own verbs, and a command imports
its own stage alone (run as a process, to see what it imported)."""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "pipeline"
REF = PKG.parent / "reference"
CLI = {"pipeline.cli", "pipeline.__main__"}


def module_name(path: Path, root: Path = PKG) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports(path: Path, modules: set[str], root: Path = PKG) -> tuple[set[str], set[str]]:
    """(every pipeline module `path` imports anywhere, those it imports when it is itself imported)."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))

    def targets(node: ast.Import | ast.ImportFrom) -> set[str]:
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            # `from pipeline import ledger` imports the module pipeline.ledger
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules | CLI else base for a in node.names]
        out = set()
        for n in names:
            out.update(c for c in CLI if n == c or n.startswith(c + "."))
            while n and n not in modules:  # pipeline.board.standings.x -> pipeline.board.standings
                n = n.rpartition(".")[0]
            if n:
                out.add(n)
                # importing pipeline.a.b runs pipeline.a's __init__ first (unless the importer lies in pipeline.a
                # itself: that __init__ ran before the importer did)
                parent = n.rpartition(".")[0]
                while parent:
                    if parent in modules and parent != name and not name.startswith(parent + "."):
                        out.add(parent)
                    parent = parent.rpartition(".")[0]
        out.discard(name)
        return out

    everywhere: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            everywhere |= targets(node)

    at_import: set[str] = set()

    def walk(body: list[ast.stmt]) -> None:  # statements run when the module is imported
        for node in body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                at_import.update(targets(node))
            elif isinstance(node, ast.If):
                if not _type_checking(node.test):
                    walk(node.body)
                walk(node.orelse)
            elif isinstance(node, ast.Try):
                walk(node.body)
                for h in node.handlers:
                    walk(h.body)
                walk(node.orelse)
                walk(node.finalbody)
            elif isinstance(node, (ast.With, ast.For, ast.While)):
                walk(node.body)
            elif isinstance(node, ast.ClassDef):
                walk(node.body)

    walk(tree.body)
    return everywhere, at_import


def graph(root: Path = PKG) -> dict[str, tuple[set[str], set[str]]]:
    files = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    return {name: imports(path, set(files), root) for name, path in files.items()}


@functools.lru_cache(maxsize=None)
def whole_graph(roots: tuple[Path, ...] = (PKG, REF)) -> dict[str, tuple[set[str], set[str]]]:
    """graph() over several packages beside each other (pipeline/ and reference/), each resolving the others'."""
    files = {module_name(p, root): (p, root) for root in roots for p in sorted(root.rglob("*.py"))}
    return {name: imports(path, set(files), root) for name, (path, root) in files.items()}


def cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the directed graph, as the modules along it, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(edges.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(edges):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def test_no_module_imports_the_cli():
    found = {name: sorted(every & CLI) for name, (every, _) in whole_graph().items() if name not in CLI and every & CLI}
    assert not found, f"these modules import the CLI, which only gathers the stages' verbs: {found}"


def test_no_import_cycle_at_module_level():
    found = cycle({name: at_import for name, (_, at_import) in whole_graph().items()})
    assert found is None, "module-level imports in a circle: " + " -> ".join(found)


def test_no_import_circle_even_through_function_level_imports():
    found = cycle({name: every for name, (every, _) in whole_graph().items()})
    assert found is None, "imports in a circle (function-level ones included): " + " -> ".join(found)


# module: (the pipeline modules it may import, anywhere; None: any but `never`), (those it must never import)
LAYERS: dict[str, tuple[set[str] | None, set[str]]] = {
    "pipeline.escape": (set(), set()),  # where a string lands: a leaf
    "pipeline.files": (set(), set()),  # reading a file without following a link: a leaf
    "pipeline.exits": ({"pipeline.escape"}, set()),  # exit codes and the one way to say no
    "pipeline.result": ({"pipeline.files"}, set()),  # the one schema imports no stage
    "pipeline.diff": ({"pipeline.escape"}, set()),  # reading a diff decides nothing
    "pipeline.github": ({"pipeline.exits", "pipeline.files"}, set()),  # the transport renders nothing
    "pipeline.report": (None, {"pipeline.github", "pipeline.post", "pipeline.ledger", "pipeline.signing",
                               "pipeline.publish", "pipeline.board"}),  # rendering knows no transport
}


def layer_breaches(g: dict[str, tuple[set[str], set[str]]]) -> list[str]:
    out = []
    for name, (may, never) in LAYERS.items():
        every = {m for m in g[name][0] if m != "pipeline"}  # the package's own (empty) __init__
        bad = (every - may if may is not None else set()) | {m for m in every for n in never
                                                              if m == n or m.startswith(n + ".")}
        out += [f"{name} imports {m}" for m in sorted(bad)]
    return out


def test_the_layers_hold():
    assert layer_breaches(whole_graph()) == []


def test_the_layer_check_sees_a_breach():
    """The check above can fail: the house's graph with the schema importing a stage and the renderer the
    transport (function-level imports count: test_a_function_level_import_is_no_cycle's walk reads them)."""
    g = dict(whole_graph())
    g["pipeline.result"] = (g["pipeline.result"][0] | {"pipeline.serving", "pipeline.serving.score"}, set())
    g["pipeline.report"] = (g["pipeline.report"][0] | {"pipeline.github"}, set())
    assert layer_breaches(g) == ["pipeline.result imports pipeline.serving",
                                 "pipeline.result imports pipeline.serving.score",
                                 "pipeline.report imports pipeline.github"]


def test_every_verb_lives_in_a_stage_module_and_none_in_a_transport_named_one():
    from pipeline import cli

    homes = {run.__module__ for _, run in cli.VERBS.values()}
    assert not {h for h in homes if h.endswith("_cli") or h in CLI}, homes
    assert not list(PKG.glob("*_cli.py")), "a verb belongs to the stage whose decision it makes"


def test_the_cli_s_table_of_stages_is_each_stage_s_own_verbs():
    """cli.STAGES (what lets a command import its own stage alone) names exactly each stage's VERBS."""
    import importlib

    from pipeline import cli

    for module, names in cli.STAGES.items():
        assert tuple(sorted(importlib.import_module(module).VERBS)) == tuple(sorted(names)), module


def test_a_command_imports_its_own_stage_and_not_the_others():
    probe = ("import sys\nfrom pipeline import __main__ as m\ntry:\n    m.main([sys.argv[1], '--help'])\n"
             "except SystemExit:\n    pass\nprint(' '.join(sorted(k for k in sys.modules if k.startswith('pipeline'))))\n")
    for verb, home, stranger in (("prizes", "pipeline.board.cli", "pipeline.demo"),
                                 ("keygen", "pipeline.signing", "pipeline.serving.cli")):
        out = subprocess.run([sys.executable, "-c", probe, verb], capture_output=True, text=True, cwd=PKG.parent,
                             timeout=120)
        loaded = out.stdout.split()
        assert home in loaded and stranger not in loaded, (verb, out.stderr[-1000:], loaded)


@pytest.mark.parametrize("source,offence", [
    ("import pipeline.cli\n", "import"),
    ("def f():\n    from pipeline.__main__ import main\n", "import"),
    ("from pipeline import cli as c\n", "import"),
    ("from . import cli\n", "import"),
    ("from pipeline import a\n", "cycle"),
    ("from pipeline.a import x\n", "cycle"),
])
def test_the_checks_see_each_kind_of_offence(tmp_path, source, offence):
    """A copy of a tiny package with one offending line: the same walk finds it (and, without the line,
    finds nothing)."""
    pkg = tmp_path / "pipeline"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "cli.py").write_text("from pipeline import a\n")
    (pkg / "a.py").write_text("from pipeline import b\n")
    (pkg / "b.py").write_text("import os\n")
    clean = graph(pkg)
    assert cycle({n: e[1] for n, e in clean.items()}) is None
    assert not any(e[0] & CLI for n, e in clean.items() if n not in CLI)
    (pkg / "b.py").write_text("import os\n" + source)
    g = graph(pkg)
    if offence == "import":
        assert g["pipeline.b"][0] & CLI
    else:
        assert cycle({n: e[1] for n, e in g.items()}) in (["pipeline.a", "pipeline.b", "pipeline.a"],
                                                           ["pipeline.b", "pipeline.a", "pipeline.b"])


def test_a_function_level_import_is_no_cycle(tmp_path):
    pkg = tmp_path / "pipeline"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pipeline import b\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pipeline import a\n"
                              "def f():\n    from pipeline import a\n")
    assert cycle({n: e[1] for n, e in graph(pkg).items()}) is None


# Where a process may be ended on purpose: the entry point (after the verb it was started for returned), and
# the sandbox's forked launcher and init (a child process that must never return into the parent's code).
ENDS_A_PROCESS = {"pipeline/__main__.py", "pipeline/sandbox/inside.py", "pipeline/sandbox/check.py"}
# and these calls, each for its reason
ALLOWED_EXITS = {
    ("pipeline/evaluation.py", "sys.exit(128 + signum)"): "the SIGTERM handler: a cancelled job ends as an error would",
    ("pipeline/serving/evaluate.py", "sys.exit(128 + signum)"): "the same, for the serving evaluation",
    ("pipeline/serving/launch.py", "sys.exit('usage: launch.py --delay-ms N -m MODULE [ARGS...]')"):
        "a script of its own (a server's launcher inside the sandbox), never a verb",
}


def test_no_verb_can_end_another_verbs_process():
    """A verb returns its exit code; only `python -m pipeline`'s entry ends the process with it. A verb that
    called os._exit or sys.exit would end whichever verb called it in-process (`publish` runs `board`,
    then commits and pushes: a board verb that ended its process lost every merge's record)."""
    offenders = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG.parent).as_posix()
        if rel in ENDS_A_PROCESS:
            continue
        tree = ast.parse(path.read_text(), rel)
        guarded = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and "__main__" in ast.unparse(node.test) for n in ast.walk(node)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and id(node) not in guarded and ast.unparse(node.func) in (
                    "os._exit", "sys.exit", "exit", "quit", "os.abort"):
                if (rel, ast.unparse(node)) not in ALLOWED_EXITS:
                    offenders.append(f"{rel}:{node.lineno}: {ast.unparse(node)[:100]}")
    assert offenders == [], "calls that end the process outside the entry point:\n" + "\n".join(offenders)


def test_the_exit_check_sees_an_exit(tmp_path):
    """The check above can fail: a verb module that ends its process is named."""
    pkg = tmp_path / "pipeline"
    pkg.mkdir()
    (pkg / "board.py").write_text("import os\n\ndef board(args):\n    os._exit(0)\n")
    global PKG
    saved, PKG = PKG, pkg
    try:
        with pytest.raises(AssertionError, match=r"pipeline/board.py:4: os._exit\(0\)"):
            test_no_verb_can_end_another_verbs_process()
    finally:
        PKG = saved
