"""Which toolchains this runner offers a submission, what a build needs inside the sandbox, and what a
failed build or a missing toolchain tells the competitor.

A competitor must learn from the result which toolchains the runner has, never from a silent crash on
it: the evaluator (the parent, not the submission's process) probes them once per process and records
them in `environment.toolchains`. The Python packages are read from their installed metadata by the
worker's own interpreter started the way a worker is (`python -I`, so what it lists is what a
submission can import), importing none of them; the compilers answer `--version`. A submission that
imports a package the runner lacks, or builds with a compiler it lacks, fails as a compile_error that
names what is missing and lists what there is. A build through torch.utils.cpp_extension that fails
becomes a compile_error whose message is the compiler's first error, at the submission's own line
where that line can be found, with the build's log tail.

The worker (the submission's process) imports this module for the parsing helpers only; they import
nothing beyond the standard library.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

# The toolchains a result reports, in the order the competitor reads them: key -> what to call it.
TOOLCHAINS = {
    "torch": "PyTorch: pip package torch",
    "triton": "Triton: pip package triton",
    "nvcc": "nvcc, the CUDA compiler",
    "ninja": "ninja, which torch.utils.cpp_extension builds with",
    "cxx": "a C++ compiler, c++",
    "cutlass": "the CUTLASS headers: pip package nvidia-cutlass",
    "cutlass_dsl": "the CuTe DSL: pip package nvidia-cutlass-dsl",
    "flashinfer": "FlashInfer: pip package flashinfer-python",
    "deep_gemm": "DeepGEMM: package deep_gemm",
}
# Python toolchains: key -> the distributions that provide it (the first installed one counts).
DISTRIBUTIONS = {
    "torch": ("torch",),
    "triton": ("triton",),
    "cutlass": ("nvidia-cutlass",),
    "cutlass_dsl": ("nvidia-cutlass-dsl",),
    "flashinfer": ("flashinfer-python", "flashinfer"),
    "deep_gemm": ("deep-gemm", "deep_gemm"),
}
# What a submission imports -> the toolchain it belongs to (for the message when it is missing).
MODULES = {
    "torch": "torch",
    "triton": "triton",
    "cutlass_library": "cutlass",
    "cutlass_cppgen": "cutlass",
    "cutlass": "cutlass_dsl",  # the CuTe DSL's package (nvidia-cutlass 4.2 renamed its own to cutlass_cppgen)
    "flashinfer": "flashinfer",
    "deep_gemm": "deep_gemm",
}
PROBE_TIMEOUT = 20.0  # seconds per probe command; nvcc --version answers in well under one
COMPETING = "docs/COMPETING.md"

# What the worker's interpreter runs to list the distributions it would import: metadata only.
_PACKAGE_PROBE = r"""
import importlib.metadata as md, importlib.util as iu, json, os, sys
wanted = json.loads(sys.argv[1])
out = {"versions": {}, "cutlass_include": None, "sys_path": sys.path}
for name in wanted:
    try:
        out["versions"][name] = md.version(name)
    except md.PackageNotFoundError:
        pass
try:
    spec = iu.find_spec("cutlass_library")  # a top-level find_spec runs none of the package's code
except Exception:
    spec = None
if spec is not None and spec.submodule_search_locations:
    inc = os.path.join(list(spec.submodule_search_locations)[0], "source", "include")
    if os.path.isfile(os.path.join(inc, "cutlass", "cutlass.h")):
        out["cutlass_include"] = inc
print(json.dumps(out))
"""


class RunnerConfigError(ValueError):
    """The runner's own configuration is wrong (an organizer's to fix, never the submission's)."""


# An OCI content digest, alone or after the image's name: what `docker image inspect --format
# '{{index .RepoDigests 0}}'` prints.
_DIGEST = re.compile(r"^(?:[a-z0-9][a-z0-9._/:-]*@)?sha256:[0-9a-f]{64}$")


def image_digest(env: dict[str, str] | None = None) -> str | None:
    """The runner image's digest, as the runner states it in $PIPELINE_IMAGE_DIGEST (the evaluator's own
    environment, which no submission reaches: runner/README.md says how the runner sets it). None where
    the evaluator runs outside an image (a laptop, CI)."""
    value = (os.environ if env is None else env).get("PIPELINE_IMAGE_DIGEST")
    if value is None or value == "":
        return None
    if not _DIGEST.match(value):
        raise RunnerConfigError(
            f"$PIPELINE_IMAGE_DIGEST is {value[:120]!r}, not an image digest: set it to the runner image's "
            "sha256:<64 hex digits> (or name@sha256:...), as `docker image inspect --format "
            "'{{index .RepoDigests 0}}' IMAGE` prints it (runner/README.md), or leave it unset outside an image")
    return value


def worker_path(parent_path: str | None = None) -> str:
    """The PATH a worker gets: the interpreter's own bin folder first (a virtual environment's `ninja`
    lives there, and torch.utils.cpp_extension runs `ninja` from PATH), then the evaluator's PATH."""
    parent_path = parent_path if parent_path is not None else os.environ.get("PATH", os.defpath)
    own = os.path.dirname(sys.executable)
    parts = [own] + [p for p in parent_path.split(":") if p and p != own]
    return ":".join(parts)


def cuda_home(env: dict[str, str] | None = None) -> str | None:
    """The CUDA toolkit a build uses: $CUDA_HOME or $CUDA_PATH where set, else /usr/local/cuda where it
    holds nvcc (the CUDA devel images' layout), else the toolkit of the `nvcc` on the worker's PATH,
    its links resolved (a wrapper in /usr/local/bin is not a toolkit). None: no CUDA compiler here."""
    env = os.environ if env is None else env
    for key in ("CUDA_HOME", "CUDA_PATH"):
        if env.get(key) and os.path.isdir(env[key]):
            return env[key]
    if os.path.isfile("/usr/local/cuda/bin/nvcc"):
        return "/usr/local/cuda"
    nvcc = shutil.which("nvcc", path=worker_path(env.get("PATH", os.defpath)))
    if nvcc:
        real = os.path.realpath(nvcc)
        home = os.path.dirname(os.path.dirname(real))
        if os.path.isdir(os.path.join(home, "include")):
            return home
        # A shell wrapper (`exec /usr/local/cuda-13.0/bin/nvcc "$@"`): the toolkit it names.
        try:
            text = Path(real).read_text(errors="replace")[:4096]
        except OSError:
            text = ""
        m = re.search(r"(/\S+)/bin/nvcc\b", text)
        if m and os.path.isfile(m.group(1) + "/bin/nvcc"):
            return m.group(1)
    return None


def build_env(scratch: str, env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a worker's builds need: every cache in its scratch (never $HOME, which the sandbox
    does not have), the interpreter's bin folder on PATH, and the CUDA toolkit named where there is one,
    so that torch finds the toolkit the sandbox binds."""
    out = {
        "PATH": worker_path((env or os.environ).get("PATH", os.defpath)),
        "TORCH_EXTENSIONS_DIR": f"{scratch}/torch-extensions",
        "TRITON_CACHE_DIR": f"{scratch}/triton-cache",
        "CCACHE_DIR": f"{scratch}/ccache",
        "XDG_CACHE_HOME": f"{scratch}/cache",
        "CUDA_CACHE_PATH": f"{scratch}/cuda-cache",  # the driver's JIT cache of PTX
        "FLASHINFER_WORKSPACE_BASE": scratch,  # FlashInfer's JIT builds under <base>/.cache/flashinfer
    }
    home = cuda_home(env)
    if home:
        out["CUDA_HOME"] = home
    return out


def _run(argv: list[str]) -> str | None:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=PROBE_TIMEOUT)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout + done.stderr if done.returncode == 0 else None


def _packages() -> dict[str, Any]:
    wanted = sorted({d for dists in DISTRIBUTIONS.values() for d in dists})
    text = _run([sys.executable, "-I", "-c", _PACKAGE_PROBE, json.dumps(wanted)])
    try:
        return json.loads(text) if text else {}
    except ValueError:
        return {}


@functools.lru_cache(maxsize=None)
def probe() -> dict[str, dict[str, Any] | None]:
    """Every toolchain of TOOLCHAINS: {version, ...} where the runner has it, None where it has not.
    Probed once per process (a few short commands, about a quarter of a second)."""
    found: dict[str, dict[str, Any] | None] = {k: None for k in TOOLCHAINS}
    pkgs = _packages()
    versions = pkgs.get("versions", {})
    for key, dists in DISTRIBUTIONS.items():
        for dist in dists:
            if dist in versions:
                found[key] = {"version": versions[dist], "package": dist}
                break
    if found["torch"] is not None:
        try:
            import torch

            found["torch"]["cuda"] = torch.version.cuda
        except ImportError:
            pass
    if found["cutlass"] is not None:
        found["cutlass"]["include"] = pkgs.get("cutlass_include")
        if not pkgs.get("cutlass_include"):
            found["cutlass"] = None  # the package without its headers offers nothing to build with
    path = worker_path()
    ninja = shutil.which("ninja", path=path)
    if ninja:
        out = _run([ninja, "--version"])
        found["ninja"] = {"version": out.strip() if out else None, "path": ninja}
    cxx_name = os.environ.get("CXX") or "c++"
    cxx = shutil.which(cxx_name, path=path)
    if cxx:
        out = _run([cxx, "--version"])
        found["cxx"] = {"version": out.splitlines()[0].strip() if out else None, "path": cxx}
    home = cuda_home()
    nvcc = os.path.join(home, "bin", "nvcc") if home else None
    if nvcc and os.path.isfile(nvcc):
        out = _run([nvcc, "--version"]) or ""
        m = re.search(r"release [\d.]+, V([\d.]+)", out)
        found["nvcc"] = {"version": m.group(1) if m else None, "path": nvcc, "cuda_home": home}
    return found


def describe(found: dict[str, dict[str, Any] | None]) -> str:
    """What the runner has, in one line for a competitor."""
    have = []
    for key, entry in found.items():
        if not entry:
            continue
        text = f"{key} {entry.get('version') or '(version unknown)'}"
        if key == "torch" and entry.get("cuda"):
            text += f" (CUDA {entry['cuda']})"
        have.append(text)
    missing = [k for k, v in found.items() if not v]
    line = ", ".join(have) if have else "nothing beyond Python"
    if missing:
        line += f"; not on this runner: {', '.join(missing)}"
    return line


# ---- a failure told in the competitor's terms ----

_NO_MODULE = re.compile(r"^(?:ModuleNotFoundError|ImportError): No module named '([\w.]+)'")
_BUILD = "Error building extension"
# gcc/clang: "path:line:col: error: msg"; nvcc's front end: "path(line): error: msg"; ld and ptxas.
_ERROR_LINES = (
    re.compile(r"^(?P<file>[^\s:()][^:()]*):(?P<line>\d+):(?:(?P<col>\d+):)?\s*(?:fatal )?error:\s*(?P<msg>.+)$"),
    re.compile(r"^(?P<file>[^\s()][^()]*)\((?P<line>\d+)\):\s*(?:catastrophic )?error(?: #[\w-]+)?:\s*(?P<msg>.+)$"),
    re.compile(r"^(?P<file>)(?P<line>)(?P<msg>(?:ptxas|nvlink|ld)[^:]*(?:error|fatal)\s*:.+|.*undefined reference to .+)$"),
)


def is_build_failure(text: str) -> bool:
    return _BUILD in text


def first_compiler_error(text: str) -> dict[str, Any] | None:
    """The first error line a compiler, assembler or linker wrote in `text`: {file, line, column, message,
    text} (file and line None where the tool names none), or None."""
    for raw in text.splitlines():
        line = raw.strip()
        for pattern in _ERROR_LINES:
            m = pattern.match(line)
            if m:
                d = m.groupdict()
                return {"file": d.get("file") or None, "line": int(d["line"]) if d.get("line") else None,
                        "column": int(d["col"]) if d.get("col") else None, "message": d["msg"].strip(),
                        "text": line}
    return None


def submission_line(source: str, code: str) -> int | None:
    """The line of the submission that holds `code` (a line of the generated source the compiler named),
    where exactly one line does; None where none or several do."""
    code = code.strip()
    if len(code) < 3:
        return None
    hits = [i + 1 for i, line in enumerate(source.splitlines()) if line.strip() == code]
    return hits[0] if len(hits) == 1 else None


def build_failure(text: str, submission: str) -> dict[str, Any]:
    """What the worker reports of a failed build (the exception's text holds ninja's whole output):
    the first error, the submission's line it comes from where it can be found, and the log's tail
    without the compiler's command lines (one is a few thousand characters of include paths)."""
    err = first_compiler_error(text)
    where = None
    if err and err["file"] and err["line"]:
        try:
            with open(err["file"], errors="replace") as f:
                generated = f.read().splitlines()
        except OSError:
            generated = []
        if 0 < err["line"] <= len(generated):
            code = generated[err["line"] - 1]
            try:
                with open(submission, errors="replace") as f:
                    line = submission_line(f.read(), code)
            except OSError:
                line = None
            if line is not None:
                where = {"file": os.path.basename(submission), "line": line,
                         "function": os.path.basename(err["file"]), "code": code.strip()}
    lines = []
    for ln in text.splitlines():
        m = _COMMAND.search(ln)
        lines.append(ln[:m.start()] + "[the compiler's command line]" if m and len(ln) - m.start() > 200 else ln)
    first = None
    if err:  # the generated file by its name only: its folder is the sandbox's scratch
        first = err["text"].replace(err["file"], os.path.basename(err["file"]), 1) if err["file"] else err["text"]
    return {"first_error": first, "where": where, "log_tail": "\n".join(lines)[-3000:]}


# A compiler's command line in ninja's output (`[1/2] c++ -MMD ...`, `/usr/local/cuda/bin/nvcc --generate...`)
_COMMAND = re.compile(r"(\[\d+/\d+\]\s+)?(\S*/)?(c\+\+|g\+\+|gcc|clang\+*|nvcc)\s+-")


def explain(reply: dict[str, Any], found: dict[str, dict[str, Any] | None]) -> dict[str, Any]:
    """The worker's failure reply, told in the competitor's terms where a toolchain is the cause: an
    import of a package the runner lacks, a build without ninja, nvcc or a C++ compiler, a build that
    failed. Returns the reply with `error` rewritten and status compile_error, or the reply unchanged."""
    error = str(reply.get("error") or "")
    have = describe(found)
    hint = f"the runner has: {have} ({COMPETING} says how to build with each)"
    m = _NO_MODULE.match(error)
    if m:
        module = m.group(1)
        key = MODULES.get(module.split(".")[0])
        if key and found.get(key):
            return reply  # the toolchain is there (a part of it is not): its own ImportError says which
        what = f" ({TOOLCHAINS[key]})" if key else ""
        return {**reply, "status": "compile_error", "error": f"{module} is not on this runner{what}; {hint}"}
    if "Ninja is required to load C++ extensions" in error:
        return {**reply, "status": "compile_error", "error": f"ninja is not on this runner, so torch.utils.cpp_extension "
                                                               f"cannot build; {hint}"}
    if "CUDA_HOME environment variable is not set" in error or re.search(r"nvcc: (not found|No such file)", error):
        return {**reply, "status": "compile_error", "error": f"nvcc (a CUDA toolkit) is not on this runner, so CUDA "
                                                               f"sources cannot be built; {hint}"}
    build = reply.get("build")
    if isinstance(build, dict) or is_build_failure(error):
        first = build.get("first_error") if isinstance(build, dict) else None
        name = re.search(r"Error building extension '([^']+)'", error)
        what = f"the extension {name.group(1)!r}" if name else "the extension"
        message = f"{what} did not build: {first}" if first else f"{what} did not build (see the build log below)"
        out = {**reply, "status": "compile_error", "error": message}
        if isinstance(build, dict) and isinstance(build.get("where"), dict):
            out["where"] = build["where"]
        return out
    return reply
