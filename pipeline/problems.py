"""Problems are data: `problems/model.toml` plus `problems/<name>/problem.toml`.

This module turns that data into `Problem` and `Shape` objects and loads the problem's reference
module (`reference/<name>.py`). Nothing here knows any particular problem.
"""

from __future__ import annotations

import importlib.util
import math
import re
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
MODEL_SIZES = ("full", "smoke")
_NAME_RE = re.compile(r"^[a-z][a-z0-9_]*\Z")
_ENTRY_KEYS_RESERVED = {"name", "smoke", "note"}
_TOLERANCE_KEYS = {"atol", "rtol", "rel_l2", "min_match", "max_abs"}
MAX_PRODUCED = 4  # the late-writing kernel's slots (kernel/predecessor.py)


class ProblemError(ValueError):
    """A problem definition (organizer data) that cannot be used; the message says where and why."""


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float
    rel_l2: float
    min_match: float = 1.0
    max_abs: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None}


@dataclass(frozen=True)
class Shape:
    name: str
    kind: str  # "workload" (timed and scored) or "test" (checked only)
    model: str  # "full" or "smoke"
    params: dict[str, Any]

    def __getitem__(self, key: str) -> Any:
        return self.params[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.params.get(key, default)


@dataclass
class Problem:
    name: str
    title: str
    directory: Path
    reference_path: Path
    inplace: tuple[str, ...]
    tolerances: dict[str, Tolerance]
    workloads: list[dict[str, Any]]
    tests: list[dict[str, Any]]
    model: dict[str, dict[str, Any]]
    official_seeds: int = 8
    run_to_run: float = 0.0
    # The inputs that, in the model, the kernel before this one writes (its activations, never its weights):
    # a checked call meets them written late (kernel/predecessor.py).
    produced: tuple[str, ...] = ()
    _reference: ModuleType | None = field(default=None, repr=False)

    def shapes(self, model: str = "full", kinds: tuple[str, ...] = ("workload", "test")) -> list[Shape]:
        if model not in MODEL_SIZES:
            raise ProblemError(f"unknown model size {model!r}; use one of {MODEL_SIZES}")
        out = []
        for kind, entries in (("workload", self.workloads), ("test", self.tests)):
            if kind not in kinds:
                continue
            for entry in entries:
                params = dict(self.model[model])
                params.update({k: v for k, v in entry.items() if k not in _ENTRY_KEYS_RESERVED})
                if model == "smoke":
                    params.update(entry.get("smoke", {}))
                out.append(Shape(entry["name"], kind, model, params))
        return out

    def shape(self, name: str, model: str = "full") -> Shape:
        for s in self.shapes(model):
            if s.name == name:
                return s
        raise ProblemError(f"{self.name} has no shape named {name!r}")

    @property
    def reference(self) -> ModuleType:
        if self._reference is None:
            self._reference = load_reference(self.reference_path, self.name)
        return self._reference


def load_reference(path: Path, name: str, required: tuple[str, ...] = ("make_inputs", "reference", "baseline", "floor")) -> ModuleType:
    module_name = f"_muse_reference_{name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ProblemError(f"cannot load the reference {path}")
    module = importlib.util.module_from_spec(spec)
    # The layer references import the building blocks of the smaller problems.
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    for fn in required:
        if not callable(getattr(module, fn, None)):
            raise ProblemError(f"{path} must define {fn}()")
    return module


def reference_sources(path: Path) -> list[Path]:
    """The reference module and every sibling module of its folder it imports, transitively (the layer
    references import the smaller problems' building blocks), and the data files a module names in a
    `BASELINE_DATA` tuple of paths relative to its folder (the fused MoE's tuned block configurations):
    what the baseline is made of."""
    import ast

    seen: list[Path] = []
    todo = [path.resolve()]
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.append(current)
        tree = ast.parse(current.read_bytes())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module]
            for name in names:
                sibling = current.parent / f"{name.split('.')[0]}.py"
                if sibling.is_file():
                    todo.append(sibling.resolve())
            if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "BASELINE_DATA"
                                                     for t in node.targets)
                    and isinstance(node.value, (ast.Tuple, ast.List))):
                for item in node.value.elts:
                    if isinstance(item, ast.Constant) and isinstance(item.value, str):
                        data = (current.parent / item.value).resolve()
                        if data.is_file() and data not in seen:
                            seen.append(data)
    return sorted(seen)


def baseline_identity(problem: "Problem") -> dict[str, Any]:
    """Which baseline a result was measured against: its name and a sha256 over the source of every
    file it is made of (path and bytes), so two results compare only when their baselines are the same
    code."""
    files = reference_sources(problem.reference_path)
    root = problem.reference_path.resolve().parent.parent
    named = [(f.relative_to(root).as_posix(), f.read_bytes()) for f in files]
    return {"name": f"reference/{problem.name}.py:baseline", "sha256": sources_sha256(named),
            "files": [rel for rel, _ in named]}


def sources_sha256(named: list[tuple[str, bytes]]) -> str:
    """sha256 over (name, bytes) pairs, each framed by its name and length: a baseline's code identity."""
    import hashlib

    digest = hashlib.sha256()
    for name, data in named:
        digest.update(f"{name}\0{len(data)}\0".encode() + data)
    return digest.hexdigest()


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ProblemError(f"{path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ProblemError(f"{path}: invalid TOML: {exc}") from None


def load_model(root: Path = REPO_ROOT) -> dict[str, dict[str, Any]]:
    path = root / "problems" / "model.toml"
    data = _read_toml(path)
    for size in MODEL_SIZES:
        if size not in data:
            raise ProblemError(f"{path} must have a [{size}] table")
    return {size: dict(data[size]) for size in MODEL_SIZES}


def _tolerance(path: Path, key: str, raw: dict[str, Any]) -> Tolerance:
    unknown = set(raw) - _TOLERANCE_KEYS
    if unknown:
        raise ProblemError(f"{path}: [tolerance.{key}] has unknown keys {sorted(unknown)}")
    for need in ("atol", "rtol", "rel_l2"):
        if need not in raw:
            raise ProblemError(f"{path}: [tolerance.{key}] needs {need}")
    tol = Tolerance(
        atol=float(raw["atol"]),
        rtol=float(raw["rtol"]),
        rel_l2=float(raw["rel_l2"]),
        min_match=float(raw.get("min_match", 1.0)),
        max_abs=float(raw["max_abs"]) if "max_abs" in raw else None,
    )
    if not (0 < tol.min_match <= 1) or min(tol.atol, tol.rtol, tol.rel_l2) < 0:
        raise ProblemError(f"{path}: [tolerance.{key}] has an out-of-range bound")
    return tol


# A problem whose baseline was not yet evaluated against itself on the H200 gets the widest band measured
# on any problem (docs/BENCHMARKS.md, "Run to run").
DEFAULT_RUN_TO_RUN = 0.003


def _run_to_run(path: Path, data: dict[str, Any]) -> float:
    """The score's run-to-run band: how far the baseline's score against itself strays from 1 across
    evaluations on the H200 (benchmarks/repeatability.py --as-baseline), a fraction."""
    value = data.get("run_to_run", DEFAULT_RUN_TO_RUN)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 0.05:
        raise ProblemError(f"{path}: run_to_run = {value!r} is not a fraction between 0 and 0.05 (0.003 is 0.3%); "
                           "measure it with benchmarks/repeatability.py --as-baseline")
    return float(value)


def _produced(path: Path, data: dict[str, Any], inplace: tuple[str, ...]) -> tuple[str, ...]:
    value = data.get("produced", [])
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value) or len(set(value)) != len(value):
        raise ProblemError(f"{path}: produced = {value!r} must be a list of distinct input names, e.g. [\"x\"]")
    if len(value) > MAX_PRODUCED:
        raise ProblemError(f"{path}: produced names {len(value)} inputs; at most {MAX_PRODUCED} (the activations the "
                           "kernel before this one writes)")
    both = sorted(set(value) & set(inplace))
    if both:
        raise ProblemError(f"{path}: {', '.join(both)} cannot be both produced and written in place")
    return tuple(value)


def load_problem(name: str, root: Path = REPO_ROOT) -> Problem:
    if not _NAME_RE.match(name or ""):
        raise ProblemError(f"{name!r} is not a problem name (lowercase letters, digits, underscores)")
    directory = root / "problems" / name
    if not directory.is_dir():
        known = ", ".join(list_problems(root)) or "none"
        raise ProblemError(f"unknown problem {name!r}; known problems: {known}")
    path = directory / "problem.toml"
    data = _read_toml(path)
    if data.get("name") != name:
        raise ProblemError(f"{path}: name = {data.get('name')!r} does not match its folder {name!r}")
    inplace = tuple(data.get("inplace", []))
    tolerances = {k: _tolerance(path, k, v) for k, v in data.get("tolerance", {}).items()}
    if "output" not in tolerances:
        raise ProblemError(f"{path}: needs a [tolerance.output] table")
    for key in inplace:
        if key not in tolerances:
            raise ProblemError(f"{path}: in-place input {key!r} needs a [tolerance.{key}] table")
    workloads = list(data.get("workload", []))
    tests = list(data.get("test", []))
    if not workloads:
        raise ProblemError(f"{path}: needs at least one [[workload]]")
    seen: set[str] = set()
    for entry in workloads + tests:
        shape_name = entry.get("name")
        if not shape_name or shape_name in seen:
            raise ProblemError(f"{path}: every shape needs a unique name (got {shape_name!r})")
        seen.add(shape_name)
    problem = Problem(
        name=name,
        title=data.get("title", name),
        directory=directory,
        reference_path=root / "reference" / f"{name}.py",
        inplace=inplace,
        tolerances=tolerances,
        workloads=workloads,
        tests=tests,
        model=load_model(root),
        official_seeds=int(data.get("official_seeds", 8)),
        run_to_run=_run_to_run(path, data),
        produced=_produced(path, data, inplace),
    )
    if not problem.reference_path.is_file():
        raise ProblemError(f"problem {name!r} has no reference at {problem.reference_path}")
    return problem


def list_problems(root: Path = REPO_ROOT) -> list[str]:
    base = root / "problems"
    if not base.is_dir():
        return []
    return sorted(p.name for p in base.iterdir() if (p / "problem.toml").is_file())


def infer_problem(submission: Path, root: Path = REPO_ROOT) -> str | None:
    """The problem named by a `submissions/kernel/<problem>/<login>/submission.py` path (or a
    problem's own `problems/<problem>/template.py`), if any."""
    parts = submission.resolve().parts
    for i in range(len(parts) - 3):
        if parts[i] == "submissions" and parts[i + 1] == "kernel":
            return parts[i + 2]
    if len(parts) >= 3 and parts[-3] == "problems" and parts[-1] == "template.py":
        return parts[-2]
    return None


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))
