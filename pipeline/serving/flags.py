"""What of an accepted serving patch a maintainer should read: the gate's flags (never a refusal).

pipeline/serving/gate.py decides whether a patch may run at all (its paths, its shape, whether git
applies it); this module decides what in it a maintainer must look at. It applies the patch for real to
a copy of the files it touches and reads each changed Python file with Python's own parser, as the
import will (the same decoding: a BOM, a coding declaration), comparing the syntax trees before and
after, so:

- comments, docstrings and bare string statements are never flagged (they are not in the tree);
- only what the patch changes is flagged: a statement of the patched file whose structure the pinned
  file does not have (positions, comments and docstrings aside). A compound statement (`def`, `class`,
  `if`, `for`, `with`, `try`, `match`) is flagged for its own header only when that header changed, and
  its body is read statement by statement; a `def` or `class` whose name is a knob (`flush_cache`) is
  flagged whenever anything in it changed, with what it no longer calls and any statement it no longer
  reaches (a `return True` at the top of `flush_cache` is "body changed", wherever the hunk says it is);
  a knob-named `def` the patch removes is flagged too;
- a knob (sglang_pin/pin.toml [[flags.knob]]: `ignore_eos`, `flush_cache`, `stream_interval`, ...) is
  found in every identifier (names, attributes, keywords, parameters, imports and their aliases, `def`
  and `class` names, dataclass fields such as a ServerArgs default) and in every string the file can
  compute without running: literals (implicit `"a" "b"` concatenation included), `+`, `%`, `*`,
  f-strings, `.join`, `.format`, `.replace`, case changes, slices (`[::-1]`), `bytes.decode`, `chr`,
  and names bound to such strings anywhere in the file. Matching ignores case and every character but
  letters and digits (`STREAM-INTERVAL`, `streamInterval`, `FlushCacheReqInput` all match);
- a name reached through a value the gate cannot compute is flagged where it matters, whatever it is:
  `getattr`/`setattr`/`hasattr`/`delattr` (and `__setattr__`, `__getattribute__`, `operator.attrgetter`),
  `os.environ[...]`/`.get`/`.pop`/`.setdefault`/`.update`, `os.getenv`/`putenv`, `importlib.import_module`
  and `__import__`, `sys.modules[...]`, `__dict__`/`vars()`/`globals()` subscripts and updates, a
  `**{...}` whose keys are computed, `exec`/`eval`/`compile` of a computed string (a constant one is
  parsed and read like the file), and these functions passed around as values; every module alias
  (`import os as o`, `from os import environ as E`, `e = os.environ`) is followed to its module;
- a reference to a denied module (`[[rules.deny]]`'s modules and packages: imports of any shape,
  relative ones resolved against the file's package, dotted chains, module names or paths in strings)
  and an import of the HTTP framework (`fastapi`, `starlette`, `uvicorn`: reaching the server's app
  from an allowed file could rewrite requests and streams) are flagged; so is a write into a library
  the stream runs through ([flags] stream_libraries: `orjson.dumps = ...`) or into a module of SGLang
  outside the allowed paths (`sglang.utils.find_printable_text`), and whatever finds objects by value
  or behind their names (`gc.get_objects`, `sys.modules`, frames, `__defaults__`, `__code__`);
- a file Python cannot parse, or decodes as something other than UTF-8, is flagged, and its added
  lines are then searched for the knobs as text (so are the added lines of files that are not Python).

What it cannot see (a name computed at run time and passed through a function argument, code loaded
from a data file by a path it cannot compute, native code) is what the replay's checks are for: tokens
counted by the client, canaries matched against the baseline's greedy output, GSM8K, a flushed cache
and a fresh marker on every run.
"""

from __future__ import annotations

import ast
import io
import re
import shutil
import tempfile
import tokenize
import unicodedata
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

from pipeline.pysource import dotted

if TYPE_CHECKING:  # pragma: no cover
    from pipeline.serving.pin import Pin

MAX_FLAGS_PER_PATTERN = 20
MAX_VALUES = 32  # the strings one expression may fold to (an `if` in each of ten f-string parts is not 1,024)
HTTP_MODULES = ("fastapi", "starlette", "uvicorn", "sse_starlette")
WHY_COMPUTED = ("a name reached through a value the gate cannot compute: it could be a flagged knob, an "
                "environment variable or a denied module; read what it evaluates to")
WHY_HTTP = ("the HTTP framework: requests and streams are closed to patches (http_server.py and the OpenAI "
            "layer are denied), and code that reaches the server's app could rewrite them")
WHY_UNPARSEABLE = ("Python cannot parse the patched file (it would fail to import), so its knobs were searched as text "
                   "only; fix its syntax")
WHY_ENCODING = ("Python decodes the patched file as {enc}, not UTF-8: the code that runs is not the text a "
                "reviewer reads")


@dataclass(frozen=True)
class Flag:
    file: str
    line: int  # the line of patch.diff
    pattern: str  # a knob, `module:<name>`, `http:<module>`, `computed-name`, `file:<path>`, ...
    why: str
    text: str = ""  # the patched file's line that holds it (or the added line), shortened


@dataclass(frozen=True)
class _Found:
    """A flag inside one patched file, before it is placed on a line of the patch."""

    line: int  # of the patched file; 0 for the file as a whole
    end: int
    pattern: str
    why: str
    text: str = ""
    outer: tuple[int, int] = (0, 0)  # the changed statement it lies in, where the node's own lines did not change


# ---- the rules' names ----

def denied_modules(rules: dict) -> list[str]:
    """The dotted names of the denied paths that are modules or packages (python/sglang/srt/layers/
    sampler.py -> sglang.srt.layers.sampler); the anywhere-patterns (**/test_*.py) name none."""
    out = []
    for deny in rules.get("deny", []):
        p = deny["pattern"]
        base = p.removesuffix("/**")
        if p.startswith("python/") and "*" not in base:
            out.append(base.removeprefix("python/").removesuffix(".py").replace("/", "."))
    return out


def _fold(text: str) -> str:
    """What a knob is matched on: NFKC (as Python reads identifiers), lowercased, letters and digits only."""
    return re.sub(r"[^0-9a-z]", "", unicodedata.normalize("NFKC", text).casefold())


def _module_of(path: str) -> tuple[str, str] | None:
    """(module, package) of a Python file in git layout: python/sglang/srt/x/y.py -> (sglang.srt.x.y,
    sglang.srt.x); an __init__.py is its package."""
    if not (path.startswith("python/") and path.endswith(".py")):
        return None
    parts = path.removeprefix("python/").removesuffix(".py").split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
        return ".".join(parts), ".".join(parts)
    return ".".join(parts), ".".join(parts[:-1])


class _Rules:
    def __init__(self, pin: "Pin"):
        spec = pin.flags
        self.knobs = [(rule["pattern"], _fold(rule["pattern"]), rule["why"]) for rule in spec.get("knob", [])]
        self.module_why = spec.get("denied_module_references")
        self.modules = denied_modules(pin.rules) if self.module_why else []
        self.module_paths = [(m, m.replace(".", "/")) for m in self.modules]
        self.libraries = list(spec.get("stream_libraries", []))
        self.library_why = spec.get("stream_libraries_why", "")
        allowed = [a.removesuffix("/**").removeprefix("python/").replace("/", ".") for a in pin.rules["allowed"]]
        self.patchable = [a for a in allowed if "*" not in a]  # sglang.srt, sglang.jit_kernel

    def library(self, full: str) -> str | None:
        """The stream-path library (or module of SGLang a patch cannot edit) that `full` lies in."""
        for lib in self.libraries:
            if full == lib or full.startswith(lib + "."):
                return lib
        if full.split(".")[0] == "sglang" and not any(full == a or full.startswith(a + ".") for a in self.patchable):
            return ".".join(full.split(".")[:2])
        return None

    def knob_hits(self, text: str) -> Iterator[tuple[str, str]]:
        folded = _fold(text)
        for pattern, key, why in self.knobs:
            if key and key in folded:
                yield pattern, why

    def denied(self, module: str) -> str | None:
        for m in self.modules:
            if module == m or module.startswith(m + "."):
                return m
        return None

    def denied_in_string(self, text: str) -> str | None:
        for m, path in self.module_paths:
            for form in (m, path):
                if re.search(r"(?<![\w.])" + re.escape(form) + r"(?![\w])", text):
                    return m
        return None


# ---- the syntax trees ----

_BODIES = ("body", "orelse", "finalbody", "handlers", "cases")


def _is_bare_string(node: ast.AST) -> bool:
    """A docstring, or any string standing alone as a statement: it does nothing."""
    return (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, (str, bytes)))


def _statements(body: list) -> list:
    return [s for s in body if not _is_bare_string(s)]


def _children(stmt: ast.AST) -> list[ast.stmt]:
    """The statements directly inside a compound statement (through its except handlers and match cases)."""
    out = []
    for name in _BODIES:
        for item in getattr(stmt, name, None) or []:
            if isinstance(item, ast.stmt):
                if not _is_bare_string(item):
                    out.append(item)
            else:  # an ExceptHandler or a match_case
                out.extend(_statements(item.body))
    return out


def _header(stmt: ast.AST) -> list[ast.AST]:
    """The parts of a statement that are not statements: a def's name, arguments and decorators, an if's
    test, a for's target and iterable, an except's type, a case's pattern and guard."""
    out = []
    for name, value in ast.iter_fields(stmt):
        if name in _BODIES:
            for item in value or []:
                if not isinstance(item, ast.stmt):
                    out.extend(v for n, v in ast.iter_fields(item) if n != "body" and isinstance(v, ast.AST))
                    out.extend(x for n, v in ast.iter_fields(item) if n != "body" and isinstance(v, list)
                               for x in v if isinstance(x, ast.AST))
        elif isinstance(value, ast.AST):
            out.append(value)
        elif isinstance(value, list):
            out.extend(x for x in value if isinstance(x, ast.AST))
    return out


class _Keys:
    """Structural keys of every statement (whole, and header alone): equal for equal code, whatever its
    position, comments or docstrings. Built bottom-up once per tree (a hash of the children's hashes)."""

    def __init__(self, tree: ast.AST):
        self.whole: dict[int, int] = {}
        self.head: dict[int, int] = {}
        self._memo: dict[int, int] = {}
        self.count_whole: Counter = Counter()
        self.count_head: Counter = Counter()
        for node in ast.walk(tree):
            if isinstance(node, ast.stmt) and not _is_bare_string(node):
                w, h = self._hash(node), self._head_hash(node)
                self.whole[id(node)], self.head[id(node)] = w, h
                self.count_whole[w] += 1
                self.count_head[h] += 1

    def _value(self, value: Any) -> Any:
        if isinstance(value, ast.AST):
            return self._hash(value)
        if isinstance(value, list):
            return tuple(self._value(v) for v in value if not _is_bare_string(v))
        return (type(value).__name__, value)

    def _hash(self, node: ast.AST) -> int:
        key = id(node)
        if key not in self._memo:
            self._memo[key] = hash((type(node).__name__,) + tuple(
                (name, self._value(value)) for name, value in ast.iter_fields(node) if name != "type_comment"))
        return self._memo[key]

    def _head_hash(self, node: ast.AST) -> int:
        parts = [type(node).__name__]
        for name, value in ast.iter_fields(node):
            if name in _BODIES:
                parts.append((name, tuple(self._hash_without_body(v) for v in value or []
                                          if not isinstance(v, ast.stmt))))
            elif name != "type_comment":
                parts.append((name, self._value(value)))
        return hash(tuple(parts))

    def _hash_without_body(self, node: ast.AST) -> int:
        return hash((type(node).__name__,) + tuple((n, self._value(v)) for n, v in ast.iter_fields(node) if n != "body"))


def _qualified_defs(tree: ast.AST) -> dict[str, ast.AST]:
    """Every def and class by its dotted name within the file (Scheduler.flush_cache); the first of a name."""
    out: dict[str, ast.AST] = {}

    def visit(body: list, prefix: str) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = prefix + node.name
                out.setdefault(name, node)
                visit(node.body, name + ".")
            elif isinstance(node, ast.stmt):
                visit(_children(node), prefix)

    visit(tree.body, "")
    return out


def _calls(node: ast.AST) -> set[str]:
    names = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Call):
            name = dotted(n.func)
            if name:
                names.add(name)
    return names




def _unreachable(node: ast.AST) -> ast.stmt | None:
    """The first statement after a `return`, `raise`, `break` or `continue` in the same block."""
    for block_owner in ast.walk(node):
        for name in ("body", "orelse", "finalbody"):
            block = getattr(block_owner, name, None)
            if not isinstance(block, list):
                continue  # a lambda's or a conditional expression's body is an expression
            block = _statements(block)
            for i, stmt in enumerate(block[:-1]):
                if isinstance(stmt, (ast.Return, ast.Raise, ast.Break, ast.Continue)):
                    return block[i + 1]
    return None


# ---- the strings a file can compute without running ----

_STR_METHODS = {"lower", "upper", "casefold", "title", "capitalize", "swapcase", "strip", "lstrip", "rstrip"}


class _Context:
    """A patched file's names: module aliases (imports and `x = module.path` assignments, followed
    everywhere: the reading ignores control flow) and the strings each plain name may be bound to."""

    def __init__(self, tree: ast.AST, package: str):
        self.package = package
        self.aliases: dict[str, str] = {}
        self.bindings: dict[str, list[ast.AST]] = {}
        self._memo: dict[int, frozenset[str] | None] = {}
        self._active: set[int] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname:
                        self.aliases[a.asname] = a.name
                    else:
                        root = a.name.split(".")[0]
                        self.aliases.setdefault(root, root)
            elif isinstance(node, ast.ImportFrom):
                module = self.absolute(node.module, node.level)
                for a in node.names:
                    if a.name != "*" and module:
                        self.aliases[a.asname or a.name] = f"{module}.{a.name}"
            targets: list[ast.AST] = []
            value = None
            if isinstance(node, ast.Assign):
                targets, value = node.targets, node.value
            elif isinstance(node, (ast.AnnAssign, ast.NamedExpr, ast.AugAssign)) and node.value is not None:
                targets, value = [node.target], node.value
            elif isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
                if isinstance(node.iter, (ast.Tuple, ast.List, ast.Set)):
                    for elt in node.iter.elts:
                        self._bind(node.target, elt)
                continue
            for t in targets:
                if isinstance(node, ast.AugAssign):
                    if isinstance(t, ast.Name):  # x += "_eos": x may be any of its values plus any of these
                        self.bindings.setdefault(t.id, []).append(ast.BinOp(ast.Name(t.id, ast.Load()), ast.Add(), value))
                else:
                    self._bind(t, value)
        for _ in range(8):  # `e = os.environ`, `g = getattr`: names bound to a module path or a builtin
            changed = False
            for name, values in self.bindings.items():
                for v in values:
                    full = self.dotted(v) if isinstance(v, (ast.Name, ast.Attribute)) else None
                    if full and full != name and self.aliases.get(name) != full and (
                            full.split(".")[0] in self.aliases.values() or full in _SINK_NAMES
                            or full.split(".")[0] in ("os", "sys", "builtins", "importlib", "operator")):
                        self.aliases[name] = full
                        changed = True
            if not changed:
                break

    def _bind(self, target: ast.AST, value: ast.AST) -> None:
        if isinstance(target, ast.Name):
            self.bindings.setdefault(target.id, []).append(value)
        elif isinstance(target, (ast.Tuple, ast.List)) and isinstance(value, (ast.Tuple, ast.List)) \
                and len(target.elts) == len(value.elts):
            for t, v in zip(target.elts, value.elts):
                self._bind(t, v)

    def absolute(self, module: str | None, level: int) -> str | None:
        if not level:
            return module
        base = self.package.split(".") if self.package else []
        if level > 1:
            base = base[:len(base) - (level - 1)] if level - 1 <= len(base) else []
        return ".".join(base + ([module] if module else [])) or None

    def dotted(self, node: ast.AST) -> str | None:
        """`a.b.c` with its head resolved through the aliases (`o.environ` -> `os.environ`)."""
        plain = dotted(node)
        if plain is None:
            return None
        head, _, rest = plain.partition(".")
        if head in self.aliases:
            return self.aliases[head] + ("." + rest if rest else "")
        return plain

    def strings(self, node: ast.AST) -> frozenset[str] | None:
        """Every string `node` may evaluate to, or None when that is not known without running it."""
        key = id(node)
        if key in self._memo:
            return self._memo[key]
        if key in self._active:
            return None  # x = x + "a": a cycle is not a constant
        self._active.add(key)
        try:
            got = self._strings(node)
        except (ValueError, TypeError, KeyError, IndexError, OverflowError, UnicodeError):
            got = None
        finally:
            self._active.discard(key)
        if got is not None and len(got) > MAX_VALUES:
            got = None
        self._memo[key] = got
        return got

    def _product(self, parts: list[frozenset[str] | None]) -> frozenset[str] | None:
        out = {""}
        for p in parts:
            if p is None:
                return None
            out = {a + b for a in out for b in p}
            if len(out) > MAX_VALUES:
                return None
        return frozenset(out)

    def _strings(self, node: ast.AST) -> frozenset[str] | None:
        s = self.strings
        if isinstance(node, ast.Constant):
            if isinstance(node.value, str):
                return frozenset([node.value])
            if isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
                return frozenset([str(node.value)])
            return None
        if isinstance(node, ast.JoinedStr):
            return self._product([s(v) for v in node.values])
        if isinstance(node, ast.FormattedValue):
            if node.format_spec is not None:
                return None
            return s(node.value)
        if isinstance(node, ast.BinOp):
            if isinstance(node.op, ast.Add):
                return self._product([s(node.left), s(node.right)])
            if isinstance(node.op, ast.Mult):
                left, right = (node.left, node.right) if _int(node.right) is not None else (node.right, node.left)
                n, base = _int(right), s(left)
                if n is None or base is None or not 0 <= n <= 64:
                    return None
                return frozenset(b * n for b in base)
            if isinstance(node.op, ast.Mod):
                fmt = s(node.left)
                args = node.right.elts if isinstance(node.right, ast.Tuple) else [node.right]
                values = [s(a) for a in args]
                if fmt is None or any(v is None for v in values):
                    return None
                out = set()
                for f in fmt:
                    for combo in _combinations(values):
                        out.add(f % tuple(combo))
                return frozenset(out)
            return None
        if isinstance(node, ast.IfExp):
            a, b = s(node.body), s(node.orelse)
            return None if a is None or b is None else a | b
        if isinstance(node, ast.Name):
            values = self.bindings.get(node.id)
            if not values:
                return None
            out: set[str] = set()
            for v in values:
                got = s(v)
                if got is None:
                    return None
                out |= got
            return frozenset(out)
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Slice):
            base = s(node.value)
            bounds = [_int(x) if x is not None else None for x in (node.slice.lower, node.slice.upper, node.slice.step)]
            given = [x for x in (node.slice.lower, node.slice.upper, node.slice.step) if x is not None]
            if base is None or any(_int(x) is None for x in given):
                return None
            return frozenset(b[slice(*bounds)] for b in base)
        if isinstance(node, ast.Call):
            return self._call(node)
        return None

    def _call(self, node: ast.Call) -> frozenset[str] | None:
        s = self.strings
        func = node.func
        if isinstance(func, ast.Name) and func.id in ("str",) and len(node.args) == 1:
            return s(node.args[0])
        if isinstance(func, ast.Name) and func.id == "chr" and len(node.args) == 1:
            n = _int(node.args[0])
            return frozenset([chr(n)]) if n is not None and 0 <= n < 0x110000 else None
        if not isinstance(func, ast.Attribute):
            return None
        if func.attr == "decode" and isinstance(func.value, ast.Constant) and isinstance(func.value.value, bytes):
            encoding = _const_str(node.args[0]) if node.args else "utf-8"
            return frozenset([func.value.value.decode(encoding or "utf-8")])
        base = s(func.value)
        if base is None:
            return None
        if func.attr == "join" and len(node.args) == 1 and isinstance(node.args[0], (ast.List, ast.Tuple)):
            items = [s(e) for e in node.args[0].elts]
            if any(i is None for i in items):
                return None
            return frozenset(sep.join(combo) for sep in base for combo in _combinations(items))
        if func.attr == "format" and not node.keywords:
            items = [s(a) for a in node.args]
            if any(i is None for i in items):
                return None
            return frozenset(f.format(*combo) for f in base for combo in _combinations(items))
        if func.attr == "replace" and len(node.args) == 2:
            old, new = s(node.args[0]), s(node.args[1])
            if old is None or new is None:
                return None
            return frozenset(b.replace(o, n) for b in base for o in old for n in new)
        if func.attr in _STR_METHODS:
            args = [s(a) for a in node.args]
            if any(a is None for a in args):
                return None
            return frozenset(getattr(b, func.attr)(*combo) for b in base for combo in _combinations(args))
        return None


def _int(node: ast.AST | None) -> int | None:
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        inner = _int(node.operand)
        return -inner if inner is not None else None
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
        return node.value
    return None


def _const_str(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _combinations(values: list[frozenset[str]]) -> Iterator[tuple[str, ...]]:
    if not values:
        yield ()
        return
    for head in values[0]:
        for rest in _combinations(values[1:]):
            yield (head,) + rest


# where a name given as a value picks what is reached: the function -> which argument is the name
_SINK_NAMES = {
    "getattr": 1, "setattr": 1, "hasattr": 1, "delattr": 1,
    "builtins.getattr": 1, "builtins.setattr": 1, "builtins.hasattr": 1, "builtins.delattr": 1,
    "operator.attrgetter": 0, "operator.methodcaller": 0,
    "importlib.import_module": 0, "__import__": 0, "importlib.__import__": 0, "builtins.__import__": 0,
    "importlib.util.find_spec": 0,
    "os.getenv": 0, "os.putenv": 0, "os.unsetenv": 0, "os.getenvb": 0,
    "sys.modules.get": 0, "sys.modules.pop": 0, "sys.modules.setdefault": 0, "sys.modules.__getitem__": 0,
    "sys.modules.__setitem__": 0,
    **{f"os.{env}.{m}": 0 for env in ("environ", "environb")
       for m in ("get", "pop", "setdefault", "__getitem__", "__setitem__", "__delitem__")},
}
_CODE_RUNNERS = {"exec", "eval", "compile", "builtins.exec", "builtins.eval", "builtins.compile"}
_NAMESPACE_SUBSCRIPTS = {"os.environ", "os.environb", "sys.modules"}
_DUNDER_CALLS = {"__setattr__": 0, "__getattribute__": 0, "__getattr__": 0, "__delattr__": 0}
# what finds objects by value rather than by name (how a patch would reach the server's app or a denied
# module without naming either), and what reaches behind a function's names (its defaults by position)
_REACH = {"sys.modules", "gc.get_objects", "gc.get_referrers", "gc.get_referents", "sys._getframe",
          "inspect.currentframe", "inspect.stack", "inspect.getmembers"}
_REACH_DUNDERS = {"__defaults__", "__kwdefaults__", "__code__", "__globals__", "__builtins__", "__subclasses__"}
WHY_REACH = ("reaches objects by value or behind their names (modules, frames, the garbage collector, a "
             "function's defaults or code): how a patch would change the request path or a denied module "
             "without naming it")


# ---- reading one changed file ----

class _Reader:
    def __init__(self, rules: _Rules, path: str, before: bytes | None, after: bytes):
        self.rules, self.path = rules, path
        self.before, self.after = before, after
        self.found: list[_Found] = []
        self.lines: list[str] = []
        self.outer: tuple[int, int] = (0, 0)  # the changed statement being read

    def add(self, node_or_line: Any, pattern: str, why: str, end: int | None = None, text: str | None = None) -> None:
        line = node_or_line if isinstance(node_or_line, int) else getattr(node_or_line, "lineno", 0) or 0
        last = end if end is not None else (line if isinstance(node_or_line, int)
                                            else getattr(node_or_line, "end_lineno", line) or line)
        if text is None:
            text = self.lines[line - 1].strip()[:160] if 0 < line <= len(self.lines) else ""
        self.found.append(_Found(line, max(line, last), pattern, why, text, self.outer))

    def read(self) -> list[_Found] | None:
        """The flags of this file, or None when its added lines must be searched as text instead."""
        try:
            after_tree = ast.parse(self.after)
            encoding, _ = tokenize.detect_encoding(io.BytesIO(self.after).readline)
            self.lines = self.after.decode(encoding, "replace").splitlines()
        except (SyntaxError, ValueError, MemoryError, RecursionError, LookupError, UnicodeError) as exc:
            where = f" (line {exc.lineno}: {exc.msg})" if isinstance(exc, SyntaxError) and exc.lineno else ""
            self.add(getattr(exc, "lineno", 0) or 0, "unparseable", WHY_UNPARSEABLE + where)
            return None
        if encoding not in ("utf-8", "utf-8-sig"):
            self.add(1, "encoding", WHY_ENCODING.format(enc=encoding))
        try:
            before_tree = ast.parse(self.before) if self.before is not None else None
        except (SyntaxError, ValueError, MemoryError, RecursionError):
            before_tree = None  # the pinned files parse on the Python the gate runs; if one did not, all of it is new
        module = _module_of(self.path)
        try:
            self._compare(before_tree, after_tree, _Context(after_tree, module[1] if module else ""))
        except RecursionError:
            self.add(0, "unparseable", "the patched file nests deeper than the gate reads, so its knobs were "
                     "searched as text only")
            return None
        return self.found

    def _compare(self, before: ast.AST | None, after: ast.AST, ctx: _Context) -> None:
        old = _Keys(before) if before is not None else None
        new = _Keys(after)

        def changed(node: ast.AST, table: str) -> bool:
            if old is None:
                return True
            key, counts_new, counts_old = ((new.whole[id(node)], new.count_whole, old.count_whole) if table == "whole"
                                           else (new.head[id(node)], new.count_head, old.count_head))
            return counts_new[key] > counts_old[key]

        old_defs = _qualified_defs(before) if before is not None else {}
        new_defs = _qualified_defs(after)
        names = {id(node): name for name, node in new_defs.items()}

        def visit(stmts: list[ast.stmt]) -> None:
            for stmt in stmts:
                if not changed(stmt, "whole"):
                    continue
                self.outer = (stmt.lineno, stmt.end_lineno or stmt.lineno)
                if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    self._changed_def(stmt, names.get(id(stmt), stmt.name), old_defs)
                if changed(stmt, "head"):
                    self._scan(_header(stmt), ctx, stmt)
                visit(_children(stmt))

        visit(_statements(after.body))
        self.outer = (0, 0)
        for name, node in old_defs.items():  # a knob-named def the patch removed
            if name not in new_defs:
                for pattern, why in self.rules.knob_hits(node.name):
                    self.add(0, pattern, f"{why}; the patch removes {name}", text=f"(removed) def {name}")

    def _changed_def(self, node: ast.AST, qualified: str, old_defs: dict[str, ast.AST]) -> None:
        hits = list(self.rules.knob_hits(node.name))
        if not hits:
            return
        what = [f"{qualified} changed"]
        previous = old_defs.get(qualified)
        if previous is not None:
            lost = sorted(_calls(previous) - _calls(node))
            if lost:
                what.append("it no longer calls " + ", ".join(lost[:6]) + (" ..." if len(lost) > 6 else ""))
        else:
            what.append("a new definition")
        dead = _unreachable(node)
        if dead is not None:
            what.append(f"line {dead.lineno} of the patched file is never reached (after a return, raise, break "
                        "or continue)")
        for pattern, why in hits:
            self.add(node, pattern, f"{why}; " + "; ".join(what), end=node.end_lineno)

    def _scan(self, parts: Iterable[ast.AST], ctx: _Context, stmt: ast.AST) -> None:
        """Every knob, denied module, HTTP import and computed name in these nodes (no statement inside)."""
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            for pattern, why in self.rules.knob_hits(stmt.name):
                self.add(stmt.lineno, pattern, why)
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            self._imports(stmt, ctx)
        if isinstance(stmt, (ast.Global, ast.Nonlocal)):
            for name in stmt.names:
                for pattern, why in self.rules.knob_hits(name):
                    self.add(stmt, pattern, why)
        for part in parts:
            for node in ast.walk(part):
                self._node(node, ctx, stmt)

    def _imports(self, stmt: ast.AST, ctx: _Context) -> None:
        if isinstance(stmt, ast.Import):
            modules = [a.name for a in stmt.names]
        else:
            base = ctx.absolute(stmt.module, stmt.level)
            modules = [base] if base else []
            modules += [f"{base}.{a.name}" if base else a.name for a in stmt.names if a.name != "*"]
        for module in modules:
            denied = self.rules.denied(module)
            if denied:
                self.add(stmt, f"module:{denied}", self.rules.module_why)
            if module.split(".")[0] in HTTP_MODULES:
                self.add(stmt, f"http:{module.split('.')[0]}", WHY_HTTP)

    def _node(self, node: ast.AST, ctx: _Context, stmt: ast.AST) -> None:
        line_node = node if getattr(node, "lineno", None) else stmt
        for name, value in ast.iter_fields(node):  # identifiers: names, attributes, keywords, aliases, ...
            if name == "type_comment" or isinstance(node, ast.Constant):
                continue
            for ident in (value if isinstance(value, list) else [value]):
                if isinstance(ident, str):
                    for pattern, why in self.rules.knob_hits(ident):
                        self.add(line_node, pattern, why)
        if isinstance(node, ast.expr):
            values = ctx.strings(node)
            if values is not None and not isinstance(node, ast.Name):
                for text in values:
                    self._string(text, line_node)
            elif isinstance(node, ast.Constant) and isinstance(node.value, bytes):
                self._string(node.value.decode("latin-1"), line_node)
        if isinstance(node, (ast.Attribute, ast.Name)):
            # a denied module reached through a name: the module itself (`tm.TokenizerManager` after `from
            # ...managers import tokenizer_manager as tm`, `sglang.srt.layers.sampler.Sampler`), or anything
            # of it written to (`Sampler.forward = ...`); a class imported from one and only used is not (its
            # import is flagged where it changes)
            full = ctx.dotted(node)
            denied = self.rules.denied(full) if full and "." in full else None
            if denied and (self._names_module(node, ctx, denied) or isinstance(node.ctx, (ast.Store, ast.Del))):
                self.add(line_node, f"module:{denied}", self.rules.module_why)
            if full and "." in full and isinstance(node.ctx, (ast.Store, ast.Del)) and self._names_module_head(node):
                lib = self.rules.library(full)
                if lib:
                    self.add(line_node, f"library:{lib}", self.rules.library_why)
            if full and any(full == r or full.startswith(r + ".") for r in _REACH):
                self.add(line_node, "reach", WHY_REACH)
        if isinstance(node, ast.Attribute) and node.attr in _REACH_DUNDERS:
            self.add(line_node, "reach", WHY_REACH)
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            full = ctx.aliases.get(node.id, node.id)
            if (full in _SINK_NAMES or full in _CODE_RUNNERS) and not self._is_called(node, stmt):
                self.add(line_node, "computed-name", f"{full} passed around as a value: " + WHY_COMPUTED)
        if isinstance(node, ast.Call):
            self._call(node, ctx, line_node)
        if isinstance(node, ast.Subscript):
            owner = ctx.dotted(node.value)
            namespace = owner in _NAMESPACE_SUBSCRIPTS or (owner or "").endswith(".__dict__") or (
                isinstance(node.value, ast.Call) and ctx.dotted(node.value.func) in ("vars", "globals", "locals"))
            if namespace and not isinstance(node.slice, ast.Slice) and ctx.strings(node.slice) is None:
                self.add(line_node, "computed-name", f"{owner or 'a namespace'}[...]: " + WHY_COMPUTED)

    @staticmethod
    def _names_module(node: ast.AST, ctx: _Context, denied: str) -> bool:
        """Whether the chain's head names the denied module (or a package above it) rather than one of
        its classes or functions."""
        while isinstance(node, ast.Attribute):
            node = node.value
        if not isinstance(node, ast.Name):
            return False
        head = ctx.aliases.get(node.id, node.id)
        return denied == head or denied.startswith(head + ".")

    @staticmethod
    def _names_module_head(node: ast.AST) -> bool:
        """Whether a chain starts at a plain name (an import's alias), not at a call or `self`."""
        while isinstance(node, ast.Attribute):
            node = node.value
        return isinstance(node, ast.Name) and node.id not in ("self", "cls")

    def _is_called(self, name: ast.Name, stmt: ast.AST) -> bool:
        for node in ast.walk(stmt):
            if isinstance(node, ast.Call) and node.func is name:
                return True
        return False

    def _call(self, node: ast.Call, ctx: _Context, line_node: ast.AST) -> None:
        called = ctx.dotted(node.func)
        index = _SINK_NAMES.get(called) if called else None
        if index is None and isinstance(node.func, ast.Attribute) and node.func.attr in _DUNDER_CALLS:
            owner = ctx.dotted(node.func.value)
            index = 1 if owner in ("object", "type", "builtins.object", "builtins.type") else 0
            called = called or f"....{node.func.attr}"
        if index is None and called and (called.endswith(".__dict__.get") or called.endswith(".__dict__.pop")
                                         or called.endswith(".__dict__.setdefault")):
            index = 0
        if called in ("setattr", "delattr", "builtins.setattr", "builtins.delattr") and node.args:
            owner = ctx.dotted(node.args[0])
            denied = self.rules.denied(owner) if owner and "." in owner else None
            if denied:
                self.add(line_node, f"module:{denied}", self.rules.module_why)
            lib = self.rules.library(owner) if owner and self._names_module_head(node.args[0]) else None
            if lib:
                self.add(line_node, f"library:{lib}", self.rules.library_why)
        if index is not None:
            args = node.args[index:index + 1] if called not in ("operator.attrgetter", "operator.methodcaller") \
                else node.args[:1] if called == "operator.methodcaller" else node.args
            if len(node.args) <= index and not (called and called.startswith("operator.")):
                return
            for arg in args:
                if ctx.strings(arg) is None:
                    self.add(line_node, "computed-name", f"{called}(...): " + WHY_COMPUTED)
        if called in _CODE_RUNNERS and node.args:
            codes = ctx.strings(node.args[0])
            if codes is None:
                if not isinstance(node.args[0], ast.Constant):  # compile(a code object): nothing to read either
                    self.add(line_node, "computed-name", f"{called}() of code the gate cannot compute: " + WHY_COMPUTED)
            else:
                for code in codes:
                    try:
                        inner = ast.parse(code)
                    except (SyntaxError, ValueError, MemoryError, RecursionError):
                        continue
                    for n in ast.walk(inner):
                        self._node(n, ctx, line_node)
                        if isinstance(n, (ast.Import, ast.ImportFrom)):
                            self._imports_at(n, ctx, line_node)
        updates = (called or "").endswith((".__dict__.update", "os.environ.update", "os.environb.update")) or (
            isinstance(node.func, ast.Attribute) and node.func.attr == "update" and isinstance(node.func.value, ast.Call)
            and ctx.dotted(node.func.value.func) in ("vars", "globals", "locals"))
        if updates:
            for arg in node.args:
                self._mapping(arg, ctx, line_node, f"{called}(...)")
        for kw in node.keywords:
            if kw.arg is None:
                self._mapping(kw.value, ctx, line_node, "**{...}", strict=False)

    def _imports_at(self, stmt: ast.AST, ctx: _Context, line_node: ast.AST) -> None:
        before = len(self.found)
        self._imports(stmt, ctx)
        for i in range(before, len(self.found)):  # placed on the exec's line, not the inner code's
            f = self.found[i]
            line = getattr(line_node, "lineno", 0) or 0
            self.found[i] = _Found(line, getattr(line_node, "end_lineno", line) or line, f.pattern, f.why,
                                   self.lines[line - 1].strip()[:160] if 0 < line <= len(self.lines) else "")

    def _mapping(self, value: ast.AST, ctx: _Context, line_node: ast.AST, what: str, strict: bool = True) -> None:
        """A mapping whose keys become names: its literal keys are read; computed ones are flagged."""
        if isinstance(value, ast.Dict):
            if any(k is not None and ctx.strings(k) is None for k in value.keys) or (
                    strict and any(k is None for k in value.keys)):
                self.add(line_node, "computed-name", f"{what} with keys the gate cannot compute: " + WHY_COMPUTED)
        elif isinstance(value, ast.DictComp):
            if ctx.strings(value.key) is None:
                self.add(line_node, "computed-name", f"{what} with keys the gate cannot compute: " + WHY_COMPUTED)
        elif strict:
            self.add(line_node, "computed-name", f"{what} with keys the gate cannot compute: " + WHY_COMPUTED)

    def _string(self, text: str, line_node: ast.AST) -> None:
        for pattern, why in self.rules.knob_hits(text):
            self.add(line_node, pattern, why)
        denied = self.rules.denied_in_string(text)
        if denied:
            self.add(line_node, f"module:{denied}", self.rules.module_why)


def _text_flags(rules: _Rules, added: list[tuple[int, str]]) -> list[tuple[int, str, str, str]]:
    """The knobs and denied modules in added lines as text: for files that are not Python, or that Python
    cannot parse."""
    out = []
    for n, text in added:
        hits = list(rules.knob_hits(text))
        denied = rules.denied_in_string(text)
        if denied:
            hits.append((f"module:{denied}", rules.module_why))
        out.extend((n, pattern, why, text.strip()[:160]) for pattern, why in hits)
    return out


# ---- the patch as a whole ----

def patch_flags(pin: "Pin", patch: bytes, tree: Path, files: list, git_apply: Callable,
                refused: set[str] = frozenset()) -> list[Flag]:
    """Every flag of `patch` (already read by the gate into `files`, its _File records) against `tree`, the patch
    applied to a copy by `git_apply` (the gate's own, fenced as its check is). A refused patch (`refused`: the files
    its reasons name) has its added lines searched as text only: it will not run, may not apply, and reading the
    syntax trees of a big denied file costs a second."""
    rules = _Rules(pin)
    found: list[Flag] = []
    spec = pin.flags
    for f in files:
        for rule in spec.get("file", []):
            if f.path == rule["path"]:
                found.append(Flag(f.path, f.line, f"file:{rule['path']}", rule["why"]))
    patched = None
    if not refused and any(f.path.endswith(".py") for f in files):
        patched = _apply(patch, tree, files, git_apply)
    seen: set[str] = set()
    for f in files:
        if f.path in seen:
            continue
        seen.add(f.path)
        sections = [x for x in files if x.path == f.path]
        added = [pair for x in sections for pair in x.added_lines]
        result = None
        if f.path.endswith(".py") and patched is not None and f.path in patched and f.path not in refused:
            before, after = patched[f.path]
            reader = _Reader(rules, f.path, before, after)
            result = reader.read()
            for x in reader.found:
                found.append(Flag(f.path, _patch_line(sections, x), x.pattern, x.why, x.text))
        if result is None:  # not Python, not parseable, or the patch does not apply (the refusal says why)
            for n, pattern, why, text in _text_flags(rules, added):
                found.append(Flag(f.path, n, pattern, why, text))
    found.sort(key=lambda x: (x.line, x.pattern))
    kept, counts, unique = [], {}, set()
    for flag in found:  # a pattern on every line of a big file is one thing to look at, not thousands
        if (flag.file, flag.line, flag.pattern) in unique:
            continue
        unique.add((flag.file, flag.line, flag.pattern))
        counts[flag.pattern] = counts.get(flag.pattern, 0) + 1
        if counts[flag.pattern] <= MAX_FLAGS_PER_PATTERN:
            kept.append(flag)
    for pattern, n in counts.items():
        if n > MAX_FLAGS_PER_PATTERN:
            kept.append(Flag("", 0, pattern, f"and {n - MAX_FLAGS_PER_PATTERN} more added lines like these"))
    return kept


def _apply(patch: bytes, tree: Path, files: list, git_apply) -> dict[str, tuple[bytes | None, bytes]] | None:
    """{path: (pinned bytes or None for a new file, patched bytes)} for the patch's Python files: the patch
    applied for real to a copy of the files it touches (hunk positions cannot be trusted: git applies a
    hunk wherever its context matches). None when it does not apply."""
    with tempfile.TemporaryDirectory(prefix="gate-flags-") as tmp:
        copy = Path(tmp) / "tree"
        (copy / "python").mkdir(parents=True)
        originals: dict[str, bytes | None] = {}
        for f in files:
            if f.path in originals or not _inside(f.path):
                continue
            source = tree / f.path
            if source.is_file() and not source.is_symlink():
                (copy / f.path).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(source, copy / f.path)
                originals[f.path] = source.read_bytes()
            else:
                originals[f.path] = None
        done = git_apply(copy, patch)
        if done.returncode != 0:
            return None
        out = {}
        for path, before in originals.items():
            target = copy / path
            if path.endswith(".py") and target.is_file() and not target.is_symlink():
                out[path] = (before, target.read_bytes())
        return out


def _inside(path: str) -> bool:
    parts = path.split("/")
    return bool(path) and not path.startswith("/") and ".." not in parts and "" not in parts and "." not in parts


def _patch_line(sections: list, found: _Found) -> int:
    """The line of patch.diff for a flag at lines [line, end] of the patched file: the first added or
    removed line that falls there (else in the changed statement around it), else the first line of a
    hunk around them, else the line where the file's diff starts."""
    for first, last in ((found.line, found.end), found.outer):
        if first > 0:
            for f in sections:
                for target, n in f.positions:
                    if first <= target <= last:
                        return n
    for first, last in ((found.line, found.end), found.outer):
        if first > 0:
            for f in sections:
                for start, end, n in f.hunks:
                    if start <= last and first <= end:
                        return n
    return sections[0].line

