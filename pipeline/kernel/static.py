"""Static checks of a submission's source: advisory flags, never a rejection.

They point a reviewer at the lines where a submission does something an honest kernel rarely needs:
stream or event manipulation, monkeypatching torch or the harness, gc/inspect/sys.modules tricks,
threads, subprocesses, sockets, environment reads, ctypes. Flags do not reject; leaders are reviewed
before prizes. Honest fast kernels (Triton, cuBLAS, load_inline) raise none of them.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

# module (or module prefix) imported -> (code, why)
_IMPORTS = {
    "threading": ("threads", "starts or manages threads"),
    "_thread": ("threads", "starts or manages threads"),
    "concurrent": ("threads", "uses a thread or process pool"),
    "multiprocessing": ("subprocess", "starts processes"),
    "subprocess": ("subprocess", "starts processes"),
    "socket": ("network", "opens sockets"),
    "http": ("network", "talks HTTP"),
    "urllib": ("network", "talks HTTP"),
    "requests": ("network", "talks HTTP"),
    "ctypes": ("ctypes", "calls native code through ctypes"),
    "cffi": ("ctypes", "calls native code through cffi"),
    "gc": ("introspection", "walks the garbage collector"),
    "inspect": ("introspection", "inspects frames or objects"),
    "pipeline": ("harness", "imports the harness"),
    "signal": ("process", "installs signal handlers"),
    "atexit": ("process", "runs code at exit"),
    "builtins": ("monkeypatch", "reaches into builtins"),
    "importlib": ("introspection", "imports modules dynamically"),
    "pickle": ("introspection", "unpickles data"),
}
# dotted call or attribute -> (code, why)
_ATTRS = {
    "torch.cuda.Stream": ("streams", "creates a CUDA stream"),
    "torch.cuda.stream": ("streams", "switches CUDA streams"),
    "torch.cuda.set_stream": ("streams", "switches CUDA streams"),
    "torch.cuda.Event": ("streams", "creates CUDA events"),
    "torch.cuda.synchronize": ("streams", "synchronizes the device"),
    "torch.cuda.current_stream": ("streams", "reads the current stream"),
    "torch.cuda.default_stream": ("streams", "reads the default stream"),
    "torch.cuda.graph": ("streams", "captures its own CUDA graph"),
    "torch.cuda.CUDAGraph": ("streams", "captures its own CUDA graph"),
    "torch.cuda.caching_allocator_alloc": ("allocator", "allocates raw device memory"),
    "torch.cuda.memory": ("allocator", "manipulates the allocator"),
    "sys.modules": ("introspection", "reads or edits sys.modules"),
    "sys._getframe": ("introspection", "reads interpreter frames"),
    "sys.settrace": ("introspection", "installs a tracer"),
    "sys.setprofile": ("introspection", "installs a profiler hook"),
    "os.environ": ("environment", "reads the environment"),
    "os.getenv": ("environment", "reads the environment"),
    "os.fork": ("subprocess", "forks"),
    "os.system": ("subprocess", "runs a shell command"),
    "os.popen": ("subprocess", "runs a shell command"),
    "os.write": ("file_descriptors", "writes to a raw file descriptor"),
    "os.fdopen": ("file_descriptors", "opens a raw file descriptor"),
    "os.dup2": ("file_descriptors", "duplicates file descriptors"),
    "os.kill": ("process", "sends signals"),
    "os._exit": ("process", "exits the process without cleanup"),
    "sys.exit": ("process", "exits the process"),
}
_NAMES = {
    "globals": ("introspection", "reads module globals"),
    "vars": ("introspection", "reads an object's namespace"),
    "__import__": ("introspection", "imports dynamically"),
    "eval": ("introspection", "evaluates a string"),
    "exec": ("introspection", "executes a string"),
    "compile": ("introspection", "compiles a string"),
    "setattr": ("monkeypatch", "sets attributes dynamically"),
    "open": ("files", "opens files"),
}
_PATCHABLE_ROOTS = {"torch", "triton", "pipeline", "sys", "os", "time", "builtins", "numpy", "np", "F"}


@dataclass(frozen=True)
class Flag:
    code: str
    message: str
    line: int | None

    def as_dict(self) -> dict:
        return {"code": self.code, "message": self.message, "line": self.line}


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def scan(source: str) -> list[Flag]:
    """Every flag in `source`, one per (code, line), in line order. Unparseable source gets none
    here: the evaluator reports the syntax error itself."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    aliases: dict[str, str] = {}  # local name -> full dotted module path
    flags: dict[tuple[str, int | None, str], Flag] = {}

    def add(code: str, why: str, line: int | None, what: str) -> None:
        flags.setdefault((code, line, what), Flag(code, f"{what}: {why}", line))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                aliases[(a.asname or a.name).split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
                root = a.name.split(".")[0]
                if root in _IMPORTS:
                    code, why = _IMPORTS[root]
                    add(code, why, node.lineno, f"import {a.name}")
        elif isinstance(node, ast.ImportFrom) and node.module:
            root = node.module.split(".")[0]
            if root in _IMPORTS:
                code, why = _IMPORTS[root]
                add(code, why, node.lineno, f"from {node.module} import ...")
            for a in node.names:
                full = f"{node.module}.{a.name}"
                aliases[a.asname or a.name] = full
                for key, (code, why) in _ATTRS.items():
                    if full == key or full.startswith(key + "."):
                        add(code, why, node.lineno, full)

    def resolve(name: str | None) -> str | None:
        if not name:
            return None
        head, _, rest = name.partition(".")
        if head in aliases:
            return aliases[head] + ("." + rest if rest else "")
        return name

    for node in ast.walk(tree):
        if isinstance(node, (ast.Attribute, ast.Name)):
            full = resolve(_dotted(node))
            if full:
                for key, (code, why) in _ATTRS.items():
                    if full == key or full.startswith(key + "."):
                        add(code, why, node.lineno, full)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _NAMES:
            code, why = _NAMES[node.func.id]
            add(code, why, node.lineno, f"{node.func.id}()")
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if isinstance(t, ast.Attribute):
                    full = resolve(_dotted(t))
                    if full and full.split(".")[0] in _PATCHABLE_ROOTS | {"pipeline"}:
                        add("monkeypatch", "assigns to an attribute of a library or the harness", node.lineno, full)
        if isinstance(node, ast.Delete):
            for t in node.targets:
                full = resolve(_dotted(t)) if isinstance(t, ast.Attribute) else None
                if full and full.split(".")[0] in _PATCHABLE_ROOTS:
                    add("monkeypatch", "deletes an attribute of a library", node.lineno, full)
    return sorted(flags.values(), key=lambda f: (f.line or 0, f.code, f.message))
