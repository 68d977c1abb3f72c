"""What a sandbox may use: competition.toml's [limits] as data (`load_limits`, `sandbox_limits`, `Limits`,
`Policy`), the rlimits the command gets before it drops to its uid, and the memory cgroup of its own
(`MemoryGroup`) that bounds its memory, the scratch tmpfs included, where cgroup v2 is available.
"""

from __future__ import annotations

import os
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path

# ---- the limits, as data: competition.toml's [limits] ----

COMPETITION_TOML = Path(__file__).resolve().parents[2] / "competition.toml"
_UNITS = {"bytes": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}


class LimitsError(ValueError):
    """competition.toml's [limits] cannot be used; the message names the table and key to fix."""


def _bytes(value, where: str) -> int:
    """A size: an integer of bytes, or a string such as "16 GiB" (bytes, KiB, MiB, GiB, TiB)."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str):
        parts = value.split()
        if len(parts) == 2 and parts[1] in _UNITS:
            try:
                number = float(parts[0])
            except ValueError:
                number = -1.0
            if number >= 0 and number * _UNITS[parts[1]] == int(number * _UNITS[parts[1]]):
                return int(number * _UNITS[parts[1]])
    raise LimitsError(f"{where} must be a size such as \"16 GiB\" (units: {', '.join(_UNITS)}) or an integer "
                      f"of bytes, not {value!r}")


def _number(value, where: str, kind: str) -> float | int:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise LimitsError(f"{where} must be a number, not {value!r}")
    if kind == "count" and (not isinstance(value, int) or value < 1):
        raise LimitsError(f"{where} must be a whole number of at least 1, not {value!r}")
    if kind == "fraction" and not 0 <= value <= 1:
        raise LimitsError(f"{where} must be a fraction between 0 and 1, not {value!r}")
    if kind in ("seconds", "positive") and not value > 0:
        raise LimitsError(f"{where} must be more than 0, not {value!r}")
    return value


def load_limits(section: str, spec: dict[str, tuple[str, object]], path: Path | None = None) -> dict:
    """competition.toml's [limits.<section>], checked against `spec` ({key: (kind, built-in value)}; kinds:
    bytes, count, seconds, positive, number, fraction, integer, names): {key: value}. Every key of the spec
    must be there and nothing else (a misspelt limit must not pass silently as its default). Where the
    file does not exist (the package installed without its checkout) the built-in values are the limits."""
    import tomllib

    path = COMPETITION_TOML if path is None else Path(path)
    if not path.is_file():
        return {key: built_in for key, (_, built_in) in spec.items()}
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise LimitsError(f"{path}: cannot be read as TOML ({exc})") from None
    table = data.get("limits", {}).get(section) if isinstance(data.get("limits"), dict) else None
    where = f"{path.name} [limits.{section}]"
    if not isinstance(table, dict):
        raise LimitsError(f"{where}: the table is missing; it needs {', '.join(spec)}")
    unknown = sorted(set(table) - set(spec))
    missing = [k for k in spec if k not in table]
    if unknown or missing:
        raise LimitsError(f"{where}: " + "; ".join(
            ([f"unknown key(s) {', '.join(unknown)}"] if unknown else []) +
            ([f"missing key(s) {', '.join(missing)}"] if missing else [])) + f" (the keys are {', '.join(spec)})")
    out = {}
    for key, (kind, _) in spec.items():
        value, at = table[key], f"{where} {key}"
        if kind == "bytes":
            out[key] = _bytes(value, at)
        elif kind == "names":
            if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
                raise LimitsError(f"{at} must be a list of names, not {value!r}")
            out[key] = list(value)
        elif kind == "integer":
            if isinstance(value, bool) or not isinstance(value, int):
                raise LimitsError(f"{at} must be an integer, not {value!r}")
            out[key] = value
        else:
            out[key] = _number(value, at, kind)
    return out


# [limits.sandbox] key: (kind, built-in value, the Limits field it sets)
SANDBOX_LIMITS = {
    "cpu_seconds": ("count", 3600, "cpu_seconds"),
    "memory": ("bytes", 8 << 30, "cpu_memory"),
    "processes": ("count", 512, "processes"),
    "file_size": ("bytes", 16 << 30, "file_size"),
    "open_files": ("count", 4096, "open_files"),
    "core": ("bytes", 0, "core"),
    "scratch": ("bytes", 16 << 30, "scratch_bytes"),
    "shm": ("bytes", 256 << 20, "shm_bytes"),
    "group_memory": ("bytes", 48 << 30, "group_memory"),
}


def sandbox_limits(path: Path | None = None) -> dict[str, int]:
    """[limits.sandbox] as Limits' keyword arguments."""
    got = load_limits("sandbox", {k: (kind, v) for k, (kind, v, _) in SANDBOX_LIMITS.items()}, path)
    return {field_: got[k] for k, (_, _, field_) in SANDBOX_LIMITS.items()}


_CONFIGURED = sandbox_limits()


@dataclass(frozen=True)
class Limits:
    """What one process of a sandbox may use. The defaults are competition.toml's [limits.sandbox]."""

    file_size: int = _CONFIGURED["file_size"]  # output bundles of the layer problems reach a few GB
    open_files: int = _CONFIGURED["open_files"]
    processes: int = _CONFIGURED["processes"]  # RLIMIT_NPROC of the sandbox's own uid: counts threads too (torch, CUDA)
    # CPU time of a process over all its threads; wall-clock limits are the caller's
    cpu_seconds: int = _CONFIGURED["cpu_seconds"]
    core: int = _CONFIGURED["core"]
    # Data segment + private mappings. Only without a GPU: CUDA maps address space far beyond what it
    # uses, so on the runner memory is bounded by the job's cgroup (docs/RUNBOOK.md) instead.
    cpu_memory: int = _CONFIGURED["cpu_memory"]
    # The scratch tmpfs; a layer's input set is gigabytes. A tmpfs is memory: RLIMIT_DATA does not count
    # it, the runner's cgroup does.
    scratch_bytes: int = _CONFIGURED["scratch_bytes"]
    shm_bytes: int = _CONFIGURED["shm_bytes"]  # the fresh /dev/shm
    # All the sandbox's memory, its tmpfs pages included, in a memory cgroup of its own (where the host has one)
    group_memory: int = _CONFIGURED["group_memory"]


@dataclass
class Policy:
    isolate: bool | None = None  # None: when possible; True: required (SandboxUnavailable); False: never
    limits: Limits = field(default_factory=Limits)


def _rlimits(limits: Limits, device: str, own_uid: bool) -> list[tuple[str, object]]:
    out: list[tuple[str, object]] = [
        ("RLIMIT_CORE", limits.core),
        ("RLIMIT_FSIZE", limits.file_size),
        ("RLIMIT_NOFILE", limits.open_files),
        # SIGXCPU at the limit (a clear cause of death), SIGKILL one second later if it is caught.
        ("RLIMIT_CPU", (limits.cpu_seconds, limits.cpu_seconds + 1)),
    ]
    if own_uid:  # per uid: only meaningful for a uid nothing else runs as (root ignores it anyway)
        out.append(("RLIMIT_NPROC", limits.processes))
    if device == "cpu":
        out.append(("RLIMIT_DATA", limits.cpu_memory))
    return out


def _applied_limits(limits: Limits, device: str, own_uid: bool) -> dict:
    applied = dict(_rlimits(limits, device, own_uid))
    return {
        "core": limits.core,
        "file_size": limits.file_size,
        "open_files": limits.open_files,
        "cpu_seconds": limits.cpu_seconds,
        "processes": limits.processes if "RLIMIT_NPROC" in applied else None,
        "cpu_memory": limits.cpu_memory if "RLIMIT_DATA" in applied else None,
        "scratch_bytes": limits.scratch_bytes if own_uid else None,
        "shm_bytes": limits.shm_bytes if own_uid else None,
        "group_memory": None,  # set by the sandbox once its cgroup exists
    }


# ---- the sandbox's memory: a cgroup of its own ----

CGROUP_ROOT = Path("/sys/fs/cgroup")


class MemoryGroup:
    """A memory cgroup made for one sandbox (v2, or v1's memory controller), under this process's own: the
    sandbox's launcher joins it before anything else, so its processes and the pages they write to its
    tmpfs are charged there, and the OOM killer's victim is in the sandbox."""

    def __init__(self, path: Path, version: int, limit: int):
        self.path, self.version, self.limit = path, version, limit

    @classmethod
    def create(cls, limit: int) -> tuple["MemoryGroup | None", str | None]:
        """(the group, None), or (None, why there is none on this host)."""
        try:
            lines = Path("/proc/self/cgroup").read_text().splitlines()
        except OSError as exc:
            return None, f"/proc/self/cgroup: {exc.strerror}"
        name = f"muse-sandbox-{os.getpid()}-{secrets.token_hex(4)}"
        own = {f[1]: f[2] for f in (line.split(":", 2) for line in lines) if len(f) == 3}
        if (CGROUP_ROOT / "cgroup.controllers").is_file() and "" in own:
            parent = CGROUP_ROOT / own[""].lstrip("/")
            control = parent / "cgroup.subtree_control"
            try:
                if "memory" not in control.read_text().split():
                    control.write_text("+memory")
            except OSError as exc:
                return None, (f"cgroup v2: the memory controller is not enabled below {parent} ({exc.strerror}); "
                              "docs/RUNBOOK.md says how to delegate it")
            files = [("memory.max", limit), ("memory.swap.max", 0)]
            version = 2
        elif "memory" in {c for k in own for c in k.split(",")}:
            key = next(k for k in own if "memory" in k.split(","))
            parent = CGROUP_ROOT / "memory" / own[key].lstrip("/")
            files = [("memory.limit_in_bytes", limit), ("memory.memsw.limit_in_bytes", limit)]
            version = 1
        else:
            return None, "no memory cgroup on this host"
        path = parent / name
        try:
            path.mkdir()
        except OSError as exc:
            return None, f"cgroup v{version}: cannot make {path} ({exc.strerror})"
        group = cls(path, version, limit)
        for file, value in files:
            try:
                (path / file).write_text(str(value))
            except FileNotFoundError:
                continue  # no swap accounting on this host: nothing to bound there
            except OSError as exc:
                group.remove()
                return None, f"cgroup v{version}: cannot set {file} ({exc.strerror})"
        return group, None

    @property
    def procs(self) -> str:
        return str(self.path / "cgroup.procs")

    def oom_kills(self) -> int:
        """Processes of the group the kernel's OOM killer has killed."""
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        try:
            for line in (self.path / name).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill" and value.strip().isdigit():
                    return int(value)
        except OSError:
            pass
        return 0

    def remove(self) -> None:
        """Remove the group once it is empty (its last processes may take a moment to leave it)."""
        deadline = time.monotonic() + 5
        while True:
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                if time.monotonic() > deadline:
                    return
                time.sleep(0.02)
