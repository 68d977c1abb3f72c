"""What the command sees: which host paths are bound where, read-only, in the root a sandbox assembles
(`plan`; pipeline/sandbox/__init__.py lists what is bound and why).
"""

from __future__ import annotations

import errno
import os
import re
import sys
from typing import Any

from pipeline.sandbox.inside import SCRATCH

SYSTEM_PATHS = ("/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/sys")
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")


# ---- what the command sees: the plan ----


def _within(path: str, root: str) -> bool:
    return path == root or root == "/" or path.startswith(root.rstrip("/") + "/")


def _resolve(path: str) -> tuple[str, list[tuple[str, str]]]:
    """The real path of `path` and every symlink met on the way ((link, its target) in order), so the
    new root can have the same links and `path` resolves there as it does on the host."""
    links: list[tuple[str, str]] = []
    pending = [p for p in path.split("/") if p]
    cur = "/"
    hops = 0
    while pending:
        comp = pending.pop(0)
        if comp == ".":
            continue
        if comp == "..":
            cur = os.path.dirname(cur)
            continue
        nxt = os.path.join(cur, comp)
        if os.path.islink(nxt):
            hops += 1
            if hops > 40:
                raise OSError(errno.ELOOP, f"too many links resolving {path}")
            target = os.readlink(nxt)
            links.append((nxt, target))
            if target.startswith("/"):
                cur = "/"
            pending = [p for p in target.split("/") if p] + pending
            continue
        cur = nxt
    return cur, links


def _python_paths(cwd: str, granted: list[str]) -> list[str]:
    """The Python installation: its prefixes, its real executable, and what is on sys.path, except the
    checkout: the working directory, what lies in it, and anything above a path granted explicitly."""
    out = []
    for p in (sys.base_prefix, sys.prefix, sys.exec_prefix, sys.base_exec_prefix, sys.executable,
              os.path.realpath(sys.executable)):
        if p and os.path.isabs(p) and os.path.exists(p):
            out.append(p)
    for p in sys.path:
        if not p or not os.path.isabs(p) or not os.path.exists(p):
            continue  # '' is the working directory; the editable install's hook is no path
        real = os.path.realpath(p)
        if real == "/" or any(_within(g, real) for g in granted):
            continue
        if cwd != "/" and (_within(real, cwd) or _within(cwd, real)):
            continue
        out.append(p)
    return out


# /dev/nvidiaN: one GPU's node (N its minor number); the others (nvidiactl, nvidia-uvm, nvidia-uvm-tools,
# nvidia-modeset, nvidia-caps/) are the driver's, which every CUDA process needs
_GPU_NODE = re.compile(r"nvidia(\d+)")


def gpu_nodes(names: list[str], minors: list[int] | None) -> list[str]:
    """Of the host's /dev/nvidia* names, those a CUDA sandbox binds: the driver's nodes, and a GPU's node only
    for the GPUs in `minors` (None: every GPU, where which ones the command may use is not known)."""
    out = []
    for name in names:
        m = _GPU_NODE.fullmatch(name)
        if m is None or minors is None or int(m.group(1)) in minors:
            out.append(name)
    return out


def visible_gpu_minors(env: dict[str, str], nvml: Any = None) -> tuple[list[int] | None, str]:
    """The minor numbers (the N of /dev/nvidiaN) of the GPUs the command's CUDA_VISIBLE_DEVICES names, through
    NVML; (None, why) where they cannot be known for certain: no CUDA_VISIBLE_DEVICES, an index without
    CUDA_DEVICE_ORDER=PCI_BUS_ID (CUDA's default order is its own guess, not NVML's), a MIG instance, no NVML."""
    visible = [v.strip() for v in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if not visible:
        return None, ("the command's environment has no CUDA_VISIBLE_DEVICES; set it to the runner's GPU (its UUID, "
                      "or its index with CUDA_DEVICE_ORDER=PCI_BUS_ID) to bind that GPU's node alone")
    pci_order = env.get("CUDA_DEVICE_ORDER") == "PCI_BUS_ID"
    for v in visible:
        if not (v.startswith("GPU-") or (v.isdigit() and pci_order)):
            return None, (f"CUDA_VISIBLE_DEVICES holds {v!r}: only a GPU's UUID, or its index with "
                          "CUDA_DEVICE_ORDER=PCI_BUS_ID, names one GPU for certain")
    try:
        lib = nvml if nvml is not None else _Nvml()
    except OSError as exc:
        return None, f"NVML cannot be loaded to find the GPUs' nodes ({exc})"
    try:
        return [lib.minor(v) for v in visible], ""
    except (OSError, LookupError) as exc:
        return None, f"NVML cannot name the node of {', '.join(visible)} ({exc})"
    finally:
        lib.close()


class _Nvml:
    """The few NVML calls visible_gpu_minors needs, through ctypes (no Python binding needed)."""

    def __init__(self) -> None:
        import ctypes

        self._ct = ctypes
        self._lib = ctypes.CDLL("libnvidia-ml.so.1")
        if self._lib.nvmlInit_v2() != 0:
            raise OSError("nvmlInit failed")

    def minor(self, visible: str) -> int:
        ct = self._ct
        handle = ct.c_void_p()
        if visible.startswith("GPU-"):
            rc = self._lib.nvmlDeviceGetHandleByUUID(visible.encode(), ct.byref(handle))
        else:
            rc = self._lib.nvmlDeviceGetHandleByIndex_v2(ct.c_uint(int(visible)), ct.byref(handle))
        if rc != 0:
            raise LookupError(f"no GPU {visible} (NVML error {rc}; a UUID must be whole)")
        minor = ct.c_uint()
        rc = self._lib.nvmlDeviceGetMinorNumber(handle, ct.byref(minor))
        if rc != 0:
            raise LookupError(f"no minor number for GPU {visible} (NVML error {rc})")
        return minor.value

    def close(self) -> None:
        self._lib.nvmlShutdown()


def plan(readable: list, env: dict[str, str], device: str = "cpu", hidden: list = (), cwd: str | None = None) -> dict:
    """What the new root holds: the steps the init runs, in order, and what was left out and why.

    Each step is ("bind", path, is_file) (the host's `path`, read-only, at `path`), ("link", path, target)
    (a symlink as the host has it), ("mask", path, is_file) (an empty read-only folder over a path inside a
    bound tree: the checkout under /usr, say) or ("scratch", "/tmp"). Parents come before children."""
    cwd = os.path.realpath(cwd or os.getcwd())
    warnings: list[str] = []
    granted = []
    for p in readable:
        p = os.path.abspath(os.fspath(p))
        if not os.path.lexists(p):
            raise FileNotFoundError(errno.ENOENT, "a readable path of the sandbox does not exist", p)
        granted.append(os.path.realpath(p))
        if os.path.realpath(p) in ("/", SCRATCH) or _within(os.path.realpath(p), "/proc") or \
                _within(os.path.realpath(p), "/dev"):
            raise ValueError(f"{p}: the sandbox makes its own /, /tmp, /proc and /dev; grant what lies in them")
    implicit = [p for p in SYSTEM_PATHS if os.path.lexists(p)]
    implicit += _python_paths(cwd, granted)
    lib_dirs = env.get("LD_LIBRARY_PATH", "").split(":") + [env.get("CUDA_HOME", ""), env.get("CUDA_PATH", "")]
    if device == "cuda":
        lib_dirs += ["/usr/local/nvidia", "/usr/local/cuda"]
    for p in lib_dirs:
        if p and os.path.isabs(p) and os.path.isdir(p):
            real = os.path.realpath(p)
            if real == "/" or cwd != "/" and (_within(cwd, real) or _within(real, cwd)):
                warnings.append(f"{p} (library path) not bound: it holds or lies in the working directory")
                continue
            implicit.append(p)

    links: dict[str, str] = {}
    wanted: list[tuple[str, bool, bool]] = []  # (real path, is_file, explicit)
    for p, explicit in [(p, False) for p in implicit] + [(os.path.abspath(os.fspath(p)), True) for p in readable]:
        real, met = _resolve(p)
        if not explicit and (real in ("/", SCRATCH) or _within(real, "/proc") or _within(real, "/dev")):
            continue  # the sandbox's own: a script's folder /tmp on sys.path must not cover the scratch
        if not os.path.exists(real):
            if explicit:
                raise FileNotFoundError(errno.ENOENT, "a readable path of the sandbox is a dangling link", p)
            continue
        for link, target in met:
            links.setdefault(link, target)
        wanted.append((real, not os.path.isdir(real), explicit))
        need = 0o005 if os.path.isdir(real) else 0o004
        if explicit and os.stat(real).st_mode & need != need:
            warnings.append(f"{p}: not readable by others on the host, so not by the sandbox's uid either")

    def depth(p: str) -> int:
        return len([c for c in p.split("/") if c])

    # The working directory (the checkout) stays out even where an implicit tree holds it (/usr/src/app),
    # unless it holds part of that installation itself, or the caller granted it or a folder above it.
    masks = []
    implicit_roots = [r for r, _, e in wanted if not e]
    candidates = [(cwd, True)] if cwd != "/" else []
    candidates += [(os.path.realpath(os.path.abspath(os.fspath(h))), False) for h in hidden]
    for h, is_cwd in candidates:
        above = [r for r, _, e in wanted if h != r and _within(h, r) and (e is False or not is_cwd)]
        if not above:
            continue  # not in any bound tree: it does not show anyway
        if is_cwd and any(_within(h, g) for g in granted):
            continue
        if is_cwd and any(_within(r, h) for r in implicit_roots):
            warnings.append(f"the working directory {h} is visible: it holds part of the Python installation")
            continue
        masks.append((h, not os.path.isdir(h)))

    steps: list[tuple] = []
    kept: list[str] = []

    def covered(p: str) -> bool:
        """Whether `p` already shows in the new root: the deepest bind or mask above it is a bind."""
        best, kind = -1, None
        for b in kept:
            if _within(p, b) and depth(b) > best:
                best, kind = depth(b), "bind"
        for m, _ in masks:
            if _within(p, m) and depth(m) >= best and m != p:
                best, kind = depth(m), "mask"
        return kind == "bind"

    entries = sorted({(r, f) for r, f, _ in wanted}, key=lambda e: (depth(e[0]), e[0]))
    order = [(depth(SCRATCH), 0, ("scratch", SCRATCH))]
    for m, is_file in masks:
        order.append((depth(m), 1, ("mask", m, is_file)))
    for r, is_file in entries:
        order.append((depth(r), 2, ("bind", r, is_file)))
    order.sort(key=lambda o: (o[0], o[1], o[2][1]))
    for _, _, step in order:
        if step[0] == "bind":
            if covered(step[1]):
                continue
            kept.append(step[1])
        steps.append(step)
    for link, target in sorted(links.items(), key=lambda kv: depth(kv[0])):
        if link in (SCRATCH, "/dev", "/proc") or covered(link):
            continue
        steps.append(("link", link, target))
    devices = [(d, False) for d in DEVICES if os.path.exists("/dev/" + d)]
    if device == "cuda":
        names = sorted(n for n in os.listdir("/dev") if n.startswith("nvidia"))
        minors, why = visible_gpu_minors(env)
        if minors is None and any(_GPU_NODE.fullmatch(n) for n in names):
            warnings.append(f"every GPU of the host is bound: {why}")
        for name in gpu_nodes(names, minors):
                full = "/dev/" + name
                if os.path.isdir(full):
                    devices.append((name, True))
                elif os.path.exists(full):
                    devices.append((name, False))
                    if not os.stat(full).st_mode & 0o006 == 0o006:
                        warnings.append(f"{full} is not read-write for others: the sandbox's uid cannot open it")
    return {"steps": steps, "devices": devices, "warnings": warnings,
            "readable": sorted(kept), "masked": [m for m, _ in masks]}
