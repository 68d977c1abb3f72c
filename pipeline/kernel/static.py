"""Static checks of a submission's source: advisory flags, never a rejection.

They point a reviewer at the lines where a submission does something an honest kernel rarely needs:
stream or event manipulation, monkeypatching torch or the harness, gc/inspect/sys.modules tricks,
threads, subprocesses, sockets, environment reads, ctypes. Flags do not reject; leaders are reviewed
before prizes. Honest fast kernels (Triton, cuBLAS, load_inline) raise none of them.

The scanner reads what Python reads: the file's bytes go to the same parser the import uses, with the
same decoding (a UTF-8 byte order mark, a PEP 263 coding declaration), so no encoding trick shows the
scanner other code than the code that runs. A file Python cannot compile gets an `unparseable` flag
(it fails to load as a compile error) rather than no flag. Names reached dynamically (`getattr` with a
string, `__import__`/`importlib.import_module` of a string, `exec` passed around as a value) are
resolved where the string is a constant and flagged where it is computed. What the scanner cannot see
(code built at run time, objects passed through function arguments, native code) is the reviewer's.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
import unicodedata
from dataclasses import dataclass

from pipeline.pysource import dotted

# module (or module prefix) imported -> (code, why)
_IMPORTS = {
    "threading": ("threads", "starts or manages threads"),
    "_thread": ("threads", "starts or manages threads"),
    "concurrent": ("threads", "uses a thread or process pool"),
    "asyncio": ("subprocess", "runs an event loop (subprocesses, sockets)"),
    "multiprocessing": ("subprocess", "starts processes"),
    "subprocess": ("subprocess", "starts processes"),
    "pty": ("subprocess", "starts processes on a terminal"),
    "socket": ("network", "opens sockets"),
    "ssl": ("network", "opens sockets"),
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
    "resource": ("process", "changes resource limits"),
    "builtins": ("monkeypatch", "reaches into builtins"),
    "importlib": ("introspection", "imports modules dynamically"),
    "imp": ("introspection", "imports modules dynamically"),
    "zipimport": ("introspection", "imports modules dynamically"),
    "runpy": ("introspection", "runs modules dynamically"),
    "code": ("introspection", "compiles and runs code from strings"),
    "codeop": ("introspection", "compiles code from strings"),
    "marshal": ("introspection", "loads code objects"),
    "pickle": ("introspection", "unpickles data"),
    "dill": ("introspection", "unpickles data"),
    "cloudpickle": ("introspection", "unpickles data"),
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
    "torch.library": ("monkeypatch", "registers operator kernels (it can replace torch's own)"),
    "torch.utils._python_dispatch": ("monkeypatch", "intercepts every torch operator"),
    "torch.overrides": ("monkeypatch", "intercepts torch functions"),
    "torch._C": ("introspection", "reaches into torch's C internals"),
    "sys.modules": ("introspection", "reads or edits sys.modules"),
    "sys._getframe": ("introspection", "reads interpreter frames"),
    "sys.settrace": ("introspection", "installs a tracer"),
    "sys.setprofile": ("introspection", "installs a profiler hook"),
    "sys.meta_path": ("introspection", "installs an import hook"),
    "sys.path_hooks": ("introspection", "installs an import hook"),
    "sys.addaudithook": ("introspection", "installs an audit hook"),
    "torch.load": ("introspection", "unpickles data (it can run any code)"),
    "operator.attrgetter": ("introspection", "reaches attributes by a string"),
    "operator.methodcaller": ("introspection", "calls methods by a string"),
    "types.FunctionType": ("introspection", "builds a function from a code object"),
    "types.CodeType": ("introspection", "builds a code object"),
    "os.environ": ("environment", "reads the environment"),
    "os.environb": ("environment", "reads the environment"),
    "os.getenv": ("environment", "reads the environment"),
    "os.putenv": ("environment", "changes the environment"),
    "os.fork": ("subprocess", "forks"),
    "os.forkpty": ("subprocess", "forks"),
    "os.system": ("subprocess", "runs a shell command"),
    "os.popen": ("subprocess", "runs a shell command"),
    "os.posix_spawn": ("subprocess", "starts a process"),
    "os.posix_spawnp": ("subprocess", "starts a process"),
    **{f"os.{f}": ("subprocess", "replaces the process with another program")
       for f in ("execl", "execle", "execlp", "execlpe", "execv", "execve", "execvp", "execvpe")},
    **{f"os.{f}": ("subprocess", "starts a process")
       for f in ("spawnl", "spawnle", "spawnlp", "spawnlpe", "spawnv", "spawnve", "spawnvp", "spawnvpe")},
    "os.write": ("file_descriptors", "writes to a raw file descriptor"),
    "os.fdopen": ("file_descriptors", "opens a raw file descriptor"),
    "os.dup2": ("file_descriptors", "duplicates file descriptors"),
    "os.kill": ("process", "sends signals"),
    "os.killpg": ("process", "sends signals"),
    "os.setsid": ("process", "leaves its process group"),
    "os.setpgid": ("process", "leaves its process group"),
    "os._exit": ("process", "exits the process without cleanup"),
    "sys.exit": ("process", "exits the process"),
    "os.open": ("files", "opens files"),
    "io.open": ("files", "opens files"),
    "io.FileIO": ("files", "opens files"),
    "codecs.open": ("files", "opens files"),
    "pathlib.Path": ("files", "reaches files through pathlib"),
    "pathlib.PosixPath": ("files", "reaches files through pathlib"),
    **{f"traceback.{f}": ("introspection", "walks interpreter frames")
       for f in ("walk_stack", "walk_tb", "extract_stack", "StackSummary", "FrameSummary", "TracebackException")},
}
# Other names of the same modules: the os module under its platform's name, the sys module that os
# imports, io's C implementation. A path is checked under its canonical name.
_CANONICAL = {"posix": "os", "nt": "os", "os.sys": "sys", "_io": "io", "_posixsubprocess": "subprocess"}
# builtins, flagged wherever they are named (called, or passed around as a value)
_NAMES = {
    "globals": ("introspection", "reads module globals"),
    "locals": ("introspection", "reads a frame's locals"),
    "vars": ("introspection", "reads an object's namespace"),
    "__import__": ("introspection", "imports dynamically"),
    "__builtins__": ("monkeypatch", "reaches into builtins"),
    "eval": ("introspection", "evaluates a string"),
    "exec": ("introspection", "executes a string"),
    "compile": ("introspection", "compiles a string"),
    "breakpoint": ("introspection", "enters a debugger hook"),
    "setattr": ("monkeypatch", "sets attributes dynamically"),
    "delattr": ("monkeypatch", "deletes attributes dynamically"),
    "open": ("files", "opens files"),
}
# attributes that reach namespaces, frames and code behind an object's back
_DUNDERS = {
    "__dict__": ("introspection", "reads or edits an object's namespace"),
    "__globals__": ("introspection", "reads a function's module globals"),
    "__builtins__": ("monkeypatch", "reaches into builtins"),
    "__code__": ("introspection", "reads or replaces a function's code"),
    "__closure__": ("introspection", "reads a function's closure"),
    "__subclasses__": ("introspection", "walks the class hierarchy"),
    "__setattr__": ("monkeypatch", "sets attributes behind the object's back"),
    "__delattr__": ("monkeypatch", "deletes attributes behind the object's back"),
    "__getattribute__": ("introspection", "reads attributes behind the object's back"),
    "__loader__": ("introspection", "reads the module's loader"),
    "__traceback__": ("introspection", "walks a traceback's frames"),
    "tb_frame": ("introspection", "walks a traceback's frames"),
    "tb_next": ("introspection", "walks a traceback's frames"),
    "f_back": ("introspection", "walks interpreter frames"),
    "f_globals": ("introspection", "reads a frame's globals"),
    "f_locals": ("introspection", "reads a frame's locals"),
    "f_builtins": ("introspection", "reads a frame's builtins"),
    "gi_frame": ("introspection", "reads a generator's frame"),
    "cr_frame": ("introspection", "reads a coroutine's frame"),
    "ag_frame": ("introspection", "reads a generator's frame"),
}
_PATCHABLE_ROOTS = {"torch", "triton", "pipeline", "sys", "os", "time", "builtins", "numpy", "np", "F"}
_IMPORTERS = {"__import__", "importlib.import_module", "importlib.__import__"}
# PEP 263: where Python looks for a coding declaration (line 1, or 2 after a comment or blank line)
_CODING = re.compile(rb"^[ \t\f]*#.*?coding[:=][ \t]*([-\w.]+)")
_LINE_BREAK = re.compile(r"\r\n|\r|\n")


@dataclass(frozen=True)
class Flag:
    code: str
    message: str
    line: int | None

    def as_dict(self) -> dict:
        return {"code": self.code, "message": self.message, "line": self.line}


def _as_bytes(source: str | bytes) -> bytes:
    """The bytes a file held. Text is taken as the UTF-8 decoding of them (as the evaluator decodes)."""
    if isinstance(source, bytes):
        return source
    try:
        return source.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a lone surrogate that no UTF-8 file holds: Python will refuse it too
        return source.encode("utf-8", "surrogatepass")


def _unparseable(exc: BaseException) -> Flag:
    if isinstance(exc, SyntaxError):
        what, line = exc.msg, exc.lineno if exc.lineno and exc.lineno > 0 else None
    elif isinstance(exc, RecursionError):
        what, line = "it nests deeper than the compiler goes", None
    else:
        what, line = str(exc) or type(exc).__name__, None
    return Flag("unparseable", f"Python cannot compile this file ({what}): it fails to load as a compile error, "
                "and the scanner could not check any of it", line)


def _char_name(ch: str) -> str:
    return f"U+{ord(ch):04X} {unicodedata.name(ch, 'an unnamed character')}"


def _text_flags(data: bytes, text: str, encoding: str, add) -> None:
    """What a reviewer's eye can be fooled by while Python reads the file as the AST says: another
    encoding than UTF-8, invisible characters, a form feed in an indentation, a bare carriage return."""
    if encoding not in ("utf-8", "utf-8-sig"):
        line = 1
        for n, raw in enumerate(data.split(b"\n")[:2], 1):
            if _CODING.match(raw):
                line = n
                break
        add("encoding", f"Python decodes this file as {encoding}, so the code that runs is not the text an editor, "
            "GitHub or a reviewer shows; submissions are UTF-8", line, "a coding declaration")
    if text.startswith("\ufeff"):
        text = text[1:]
    for n, line_text in enumerate(_LINE_BREAK.split(text), 1):
        for ch in dict.fromkeys(c for c in line_text if unicodedata.category(c) in ("Cf", "Co", "Cs")):
            add("invisible", "an invisible or direction-changing character: the line reads differently on "
                "screen than to Python", n, _char_name(ch))
        indent = line_text[:len(line_text) - len(line_text.lstrip(" \t\f"))]
        if "\f" in indent:
            add("whitespace", "a form feed in the indentation resets Python's column count, so the line's block is "
                "not the one it appears in", n, "a form feed")
    if re.search(r"\r(?!\n)", text):
        n = len(_LINE_BREAK.findall(text[:re.search(r"\r(?!\n)", text).start()])) + 1
        add("line_endings", "a bare carriage return ends a line for Python but not in every viewer, so code can "
            "hide on what looks like one line", n, "a carriage return")
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            folded = unicodedata.normalize("NFKC", tok.string) if tok.type == tokenize.NAME else tok.string
            if folded != tok.string:
                add("invisible", f"a name spelled with non-ASCII characters, which Python reads as {folded!r}",
                    tok.start[0], repr(tok.string))
    except (tokenize.TokenError, SyntaxError, ValueError):
        pass  # the AST was built; tokenize is stricter about a few things the parser accepts


def scan(source: str | bytes) -> list[Flag]:
    """Every flag in `source` (the file's bytes, or its UTF-8 text), one per (code, line, what), in line
    order. A file Python cannot compile gets one `unparseable` flag."""
    data = _as_bytes(source)
    try:
        tree = ast.parse(data)  # the import's own decoding (BOM, coding declaration) and parser
        encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
        text = data.decode(encoding)
    except (SyntaxError, ValueError, MemoryError, RecursionError, LookupError) as exc:
        return [_unparseable(exc)]
    flags: dict[tuple[str, int | None, str], Flag] = {}

    def add(code: str, why: str, line: int | None, what: str) -> None:
        flags.setdefault((code, line, what), Flag(code, f"{what}: {why}", line))

    _text_flags(data, text, encoding, add)
    try:
        _tree_flags(tree, add)
    except RecursionError as exc:  # a tree the compiler built but too deep to walk here
        add("unparseable", str(_unparseable(exc).message), None, "the syntax tree")
    return sorted(flags.values(), key=lambda f: (f.line or 0, f.code, f.message))


def _tree_flags(tree: ast.AST, add) -> None:
    aliases: dict[str, str] = {}  # local name -> full dotted path
    star_modules: list[str] = []  # `from m import *`: any bare name may be m.<name>

    def resolve(name: str | None) -> str | None:
        if not name:
            return None
        head, _, rest = name.partition(".")
        if head in aliases:
            return aliases[head] + ("." + rest if rest else "")
        return name

    def dotted(node: ast.AST) -> str | None:
        """`a.b.c`, also when a link of the chain is `getattr(x, "c")` or `__import__("m")`."""
        parts = []
        while True:
            if isinstance(node, ast.Attribute):
                parts.append(node.attr)
                node = node.value
            elif (isinstance(node, ast.Call) and _called(node) == "getattr" and len(node.args) >= 2
                  and _constant_str(node.args[1]) is not None):
                parts.append(_constant_str(node.args[1]))
                node = node.args[0]
            elif isinstance(node, ast.Call) and resolve(_called(node)) in _IMPORTERS and node.args:
                module = _constant_str(node.args[0])
                if module is None:
                    return None
                if resolve(_called(node)) != "importlib.import_module":
                    module = module.split(".")[0]  # __import__("a.b") returns a
                parts.append(module)
                return ".".join(reversed(parts))
            elif isinstance(node, ast.Name):
                parts.append(node.id)
                return resolve(".".join(reversed(parts)))
            else:
                return None

    def check_module(module: str, line: int, what: str) -> None:
        module = _canonical(module)
        root = module.split(".")[0]
        if root in _IMPORTS:
            code, why = _IMPORTS[root]
            add(code, why, line, what)
        check_attr(module, line)

    def check_attr(full: str, line: int) -> None:
        full = _canonical(full)
        for key, (code, why) in _ATTRS.items():
            if full == key or full.startswith(key + "."):
                add(code, why, line, full)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                aliases[(a.asname or a.name).split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
                check_module(a.name, node.lineno, f"import {a.name}")
        elif isinstance(node, ast.ImportFrom) and node.module:
            check_module(node.module, node.lineno, f"from {node.module} import ...")
            for a in node.names:
                if a.name == "*":
                    # only a module that a flagged path lies in or under can make a bare name one: the others
                    # are not kept (every bare name is checked against every star module kept, so 7,000 star
                    # imports of other modules made a 250 KB file take minutes)
                    if node.module not in star_modules and any(
                            key == node.module or key.startswith(node.module + ".") or node.module.startswith(key + ".")
                            for key in _ATTRS):
                        star_modules.append(node.module)
                    continue
                full = f"{node.module}.{a.name}"
                aliases[a.asname or a.name] = full
                check_attr(full, node.lineno)
                if full in _IMPORTS or (node.module == "builtins" and a.name in _NAMES):
                    check_module(full, node.lineno, full)
    # `c = torch.cuda`, `imp = __import__`: a name bound to a module path is an alias of it (everywhere:
    # the scan does not follow control flow), repeated until no new alias appears
    for _ in range(8):
        before = dict(aliases)
        roots = _known_roots(aliases)  # kept up to date below, not rebuilt per assignment (20,000 aliases: 47 s)
        for node in ast.walk(tree):
            target, value = None, None
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                target, value = node.targets[0].id, node.value
            elif isinstance(node, (ast.AnnAssign, ast.NamedExpr)) and isinstance(node.target, ast.Name) and node.value:
                target, value = node.target.id, node.value
            if target and value is not None:
                full = dotted(value)
                if full and full != target and full.split(".")[0] in roots:
                    aliases[target] = full
                    roots.add(target)
        if aliases == before:
            break

    callees = {id(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    for node in ast.walk(tree):
        line = getattr(node, "lineno", None)
        if (isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and id(node) not in callees
                and (resolve(node.id) or node.id) in ("getattr", "builtins.getattr")):
            add("introspection", "passes getattr around as a value (attributes reached by names it is given)", line,
                "getattr")
        if isinstance(node, (ast.Attribute, ast.Name, ast.Call)):
            full = dotted(node)
            if full:
                check_attr(full, line)
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            name = resolve(node.id) or node.id
            name = name[len("builtins."):] if name.startswith("builtins.") else name
            if name in _NAMES:
                code, why = _NAMES[name]
                add(code, why, line, f"{name}()")
            for module in star_modules:
                check_attr(f"{module}.{node.id}", line)
        if isinstance(node, ast.Attribute) and node.attr in _DUNDERS:
            code, why = _DUNDERS[node.attr]
            add(code, why, line, f".{node.attr}")
        if isinstance(node, ast.Call):
            called = resolve(_called(node))
            if called in _IMPORTERS and node.args:
                module = _constant_str(node.args[0])
                if module is None:
                    add("introspection", "imports a module by a computed name", line, f"{called}()")
                else:
                    check_module(module, line, f"{called}({module!r})")
            if called in ("getattr", "setattr", "delattr", "hasattr") and len(node.args) >= 2:
                if _constant_str(node.args[1]) is None:
                    add("introspection", "reaches an attribute by a computed name", line, f"{called}()")
                else:
                    attr = _constant_str(node.args[1])
                    if attr in _DUNDERS:
                        code, why = _DUNDERS[attr]
                        add(code, why, line, f"{called}(..., {attr!r})")
                    owner = dotted(node.args[0])
                    if called in ("setattr", "delattr") and owner and owner.split(".")[0] in _PATCHABLE_ROOTS:
                        add("monkeypatch", "sets an attribute of a library or the harness", line, f"{owner}.{attr}")
            if (isinstance(node.func, ast.Attribute) and node.func.attr in ("__setattr__", "__delattr__")
                    and node.args):
                owner = dotted(node.args[0])
                if owner and owner.split(".")[0] in _PATCHABLE_ROOTS:
                    add("monkeypatch", "sets an attribute of a library or the harness", line, owner)
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del)):
            # every way of binding an attribute: `=`, `+=`, unpacking, `for x.y in`, `with ... as x.y`
            full = dotted(node)
            if full and full.split(".")[0] in _PATCHABLE_ROOTS:
                if isinstance(node.ctx, ast.Store):
                    add("monkeypatch", "assigns to an attribute of a library or the harness", line, full)
                else:
                    add("monkeypatch", "deletes an attribute of a library", line, full)
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, (ast.Store, ast.Del)):
            full = dotted(node.value)
            if full and full.split(".")[0] in _PATCHABLE_ROOTS and full.split(".")[0] != "os":
                add("monkeypatch", "writes into a library's table", line, full + "[...]")


def _canonical(path: str) -> str:
    """`path` under the name its module is flagged by (`posix.environ` -> `os.environ`, `os.sys.modules` ->
    `sys.modules`), the longest alias first."""
    for alias in sorted(_CANONICAL, key=len, reverse=True):
        if path == alias or path.startswith(alias + "."):
            return _CANONICAL[alias] + path[len(alias):]
    return path


def _called(node: ast.Call) -> str | None:
    return dotted(node.func)


def _constant_str(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _known_roots(aliases: dict[str, str]) -> set[str]:
    return (set(_IMPORTS) | {k.split(".")[0] for k in _ATTRS} | _PATCHABLE_ROOTS | set(aliases)
            | {"builtins", "getattr", "__import__", "exec", "eval", "compile"})
