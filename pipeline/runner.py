"""The runner between two evaluations (github-flow.md, "The sandbox on the runner": a submission that
crashes, hangs or corrupts the GPU fails alone, and the runner checks the GPU's health before it takes
another job): `python -m pipeline runner health [--device auto|cuda|cpu] [--gpus N] [--json OUT]`.

`gather()` reads the machine. On the host: every process of a sandbox's uid still alive (a sandbox that
outlived its evaluation), the free space where evaluations write, and, as root, whether the sandbox can
isolate. On each GPU, through NVML (pynvml, from nvidia-ml-py, where installed; else `nvidia-smi`): its
memory and compute processes, read before this process touches the GPU; then a known kernel with a known
answer and time (`known_matmul`), the SM clock and NVML's clock-event reasons while it runs, the
temperature and the uncorrected ECC errors. Every GPU CUDA shows is checked, one after the other (the
serving track's node has eight); the node as a whole must show `--gpus N` of them, and none that the
driver lists but cannot read or CUDA does not see. `decide()` judges those readings against competition.toml
[limits.health]: a pure function of plain data, which the tests feed with recorded readings.

Exit 0 healthy; 1 unhealthy, every reason printed; 2 a usage or configuration error. bench.yml runs it
before and after every evaluation: an unhealthy runner fails the job before anything is posted, and the
organizers take it out of rotation (docs/RUNBOOK.md, "When the health check fails").
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from pipeline import sandbox

# [limits.health] key: (kind, built-in value)
HEALTH_LIMITS: dict[str, tuple[str, object]] = {
    "kernel_n": ("count", 2048),
    "kernel_sum": ("integer", -1476414397),
    "kernel_sum_of_squares": ("integer", 18095131757015),
    "kernel_max_ms": ("positive", 0.8),
    "min_free_gpu_memory": ("fraction", 0.95),
    "min_sm_clock": ("fraction", 0.5),
    "max_temperature_c": ("positive", 85),
    "bad_clock_reasons": ("names", ["hw_slowdown", "sw_thermal_slowdown", "hw_thermal_slowdown",
                                    "hw_power_brake_slowdown"]),
    "min_free_disk": ("bytes", 5 << 30),
}
# NVML's clock-event (formerly "throttle") reason bits, by the names competition.toml uses.
CLOCK_REASONS = {
    0x1: "gpu_idle", 0x2: "applications_clocks_setting", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
    0x10: "sync_boost", 0x20: "sw_thermal_slowdown", 0x40: "hw_thermal_slowdown", 0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}
KERNEL_REPS = 20  # timed matmuls; the median is judged
RUNBOOK = 'docs/RUNBOOK.md, "When the health check fails"'


def load_bounds(path: Path | None = None) -> dict[str, Any]:
    """competition.toml [limits.health], checked (sandbox.LimitsError names what to fix)."""
    got = sandbox.load_limits("health", HEALTH_LIMITS, path)
    unknown = sorted(set(got["bad_clock_reasons"]) - set(CLOCK_REASONS.values()))
    if unknown:
        raise sandbox.LimitsError(f"competition.toml [limits.health] bad_clock_reasons: unknown {', '.join(unknown)} "
                                  f"(NVML's reasons are {', '.join(CLOCK_REASONS.values())})")
    return got


def reason_names(mask: int) -> list[str]:
    return [name for bit, name in CLOCK_REASONS.items() if mask & bit]


# ---- the known kernel ----


def known_matmul(n: int, device: str):
    """Two n x n float32 matrices of small integers (|a| <= 2, |b| <= 3) from a fixed formula: every
    product and partial sum of a @ b is an integer below 2**24, exact in float32 (and TF32) whatever the
    order of summation, so the answer is known to the last bit on any device."""
    import torch

    i = torch.arange(n, dtype=torch.int64, device=device)
    r, c = i[:, None], i[None, :]
    a = ((r * r * 31 + c * 17 + r * c * 7 + 3) % 5 - 2).to(torch.float32)
    b = ((r * 13 + c * c * 5 + r * c * 11 + 1) % 7 - 3).to(torch.float32)
    return a, b


def checksums(c) -> dict[str, int]:
    """The sum and the sum of squares of an exact integer matrix, in float64 (exact below 2**53)."""
    c = c.double()
    return {"sum": int(c.sum().item()), "sum_of_squares": int((c * c).sum().item())}


def run_known_kernel(n: int, device: str, sample: Callable[[], None] | None = None) -> dict[str, Any]:
    """The known kernel's answer and, on a GPU, its median time per matmul; `sample` is called from a
    thread while a burst of matmuls keeps the GPU busy (the clocks are read under load, not idle)."""
    import torch

    a, b = known_matmul(n, device)
    out = {"n": n, **checksums(a @ b), "median_ms": None}
    if device == "cpu":
        return out
    # A quarter of a second of work first: an idle GPU takes a moment to raise its clocks.
    warm_until = time.monotonic() + 0.25
    while time.monotonic() < warm_until:
        for _ in range(10):
            a @ b
        torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(KERNEL_REPS)]
    for start, end in events:
        start.record()
        a @ b
        end.record()
    torch.cuda.synchronize()
    out["median_ms"] = statistics.median(s.elapsed_time(e) for s, e in events)
    if sample is not None:
        # about half a second of work queued, with the sampler reading the clocks meanwhile
        reps = max(50, int(0.5 / max(out["median_ms"] / 1e3, 1e-6)))
        busy, stop = threading.Event(), threading.Event()

        def sampler() -> None:
            busy.wait()
            while not stop.is_set():
                sample()
                time.sleep(0.02)

        thread = threading.Thread(target=sampler, daemon=True)
        thread.start()
        for k in range(reps):
            a @ b
            if k == 20:
                busy.set()
        busy.set()
        torch.cuda.synchronize()
        stop.set()
        thread.join(10)
    # The answer again, after the burst: a GPU that computes right only when cold is not healthy.
    again = checksums(a @ b)
    if again != {k: out[k] for k in again}:
        out["unstable"] = again
    del a, b
    torch.cuda.empty_cache()
    return out


# ---- NVML, or nvidia-smi ----


def _na(value: str) -> str | None:
    value = value.strip()
    return None if not value or value.startswith("[") or value in ("N/A", "Not Supported") else value


class Nvml:
    """Readings through pynvml (nvidia-ml-py)."""

    source = "nvml"

    def __init__(self) -> None:
        import pynvml

        pynvml.nvmlInit()
        self.nv = pynvml

    @staticmethod
    def _text(value) -> str:
        return value.decode() if isinstance(value, bytes) else str(value)

    def _try(self, fn, *args):
        try:
            return fn(*args)
        except Exception:  # noqa: BLE001 - NVML says NotSupported for what a GPU lacks: not a reading
            return None

    def devices(self) -> list[dict[str, Any]]:
        nv, out = self.nv, []
        for i in range(nv.nvmlDeviceGetCount()):
            try:
                h = nv.nvmlDeviceGetHandleByIndex(i)
                uuid = self._text(nv.nvmlDeviceGetUUID(h))
            except Exception as exc:  # noqa: BLE001 - a GPU fallen off the bus ("GPU is lost"): the finding
                out.append({"nvml_index": i, "uuid": None, "name": None, "memory_total": None, "memory_free": None,
                            "processes": None, "error": f"{type(exc).__name__}: {exc}"[:300]})
                continue
            mem = self._try(nv.nvmlDeviceGetMemoryInfo, h)
            procs = self._try(nv.nvmlDeviceGetComputeRunningProcesses, h)
            out.append({
                "nvml_index": i, "uuid": uuid, "name": self._try(lambda: self._text(nv.nvmlDeviceGetName(h))),
                "memory_total": int(mem.total) if mem else None, "memory_free": int(mem.free) if mem else None,
                "processes": None if procs is None else [
                    {"pid": int(p.pid), "used_bytes": int(p.usedGpuMemory) if isinstance(p.usedGpuMemory, int) else None}
                    for p in procs],
            })
        return out

    def under_load(self, entry: dict[str, Any]) -> dict[str, Any]:
        nv = self.nv
        h = nv.nvmlDeviceGetHandleByIndex(entry["nvml_index"])
        reasons = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
            getattr(nv, "nvmlDeviceGetCurrentClocksThrottleReasons")
        return {"sm_clock_mhz": self._try(nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_SM),
                "clock_reasons_mask": self._try(reasons, h)}

    def after(self, entry: dict[str, Any]) -> dict[str, Any]:
        nv = self.nv
        h = nv.nvmlDeviceGetHandleByIndex(entry["nvml_index"])
        return {"sm_clock_max_mhz": self._try(nv.nvmlDeviceGetMaxClockInfo, h, nv.NVML_CLOCK_SM),
                "temperature_c": self._try(nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU),
                "ecc_uncorrected": self._try(nv.nvmlDeviceGetTotalEccErrors, h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                                             nv.NVML_VOLATILE_ECC)}

    def close(self) -> None:
        self._try(self.nv.nvmlShutdown)


class NvidiaSmi:
    """The same readings through `nvidia-smi --query-*` (CSV, no units: memory in MiB, clocks in MHz)."""

    source = "nvidia-smi"

    def __init__(self) -> None:
        self.exe = shutil.which("nvidia-smi")
        if not self.exe:
            raise FileNotFoundError("nvidia-smi is not on PATH")
        self._reason_field = None

    def _query(self, what: str, fields: list[str]) -> list[list[str]]:
        proc = subprocess.run([self.exe, f"--{what}={','.join(fields)}", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=60)
        if proc.returncode != 0:
            raise RuntimeError(f"nvidia-smi --{what}={','.join(fields)}: {(proc.stderr or proc.stdout).strip()[:300]}")
        return [[f.strip() for f in line.split(",")] for line in proc.stdout.splitlines() if line.strip()]

    @staticmethod
    def _int(value: str, scale: int = 1) -> int | None:
        v = _na(value)
        try:
            return None if v is None else int(float(v) * scale)
        except ValueError:
            return None

    def devices(self) -> list[dict[str, Any]]:
        rows = self._query("query-gpu", ["index", "uuid", "name", "memory.total", "memory.free"])
        try:
            apps = self._query("query-compute-apps", ["gpu_uuid", "pid", "used_memory"])
        except RuntimeError:
            apps = None
        out = []
        for index, uuid, name, total, free in rows:
            out.append({"nvml_index": int(index), "uuid": uuid, "name": name,
                        "memory_total": self._int(total, 1 << 20), "memory_free": self._int(free, 1 << 20),
                        "processes": None if apps is None else [
                            {"pid": int(pid), "used_bytes": self._int(used, 1 << 20)}
                            for u, pid, used in apps if u == uuid and pid.isdigit()]})
        return out

    def _row(self, uuid: str, fields: list[str]) -> list[str] | None:
        for row in self._query("query-gpu", ["uuid", *fields]):
            if row[0] == uuid:
                return row[1:]
        return None

    def under_load(self, entry: dict[str, Any]) -> dict[str, Any]:
        uuid = entry["uuid"]
        # The field was renamed (clocks_throttle_reasons -> clocks_event_reasons); older drivers know only
        # the first, newer ones both.
        for field in ([self._reason_field] if self._reason_field else
                      ["clocks_event_reasons.active", "clocks_throttle_reasons.active"]):
            try:
                row = self._row(uuid, ["clocks.sm", field])
            except RuntimeError:
                continue
            self._reason_field = field
            if row is None:
                break
            mask = _na(row[1])
            return {"sm_clock_mhz": self._int(row[0]), "clock_reasons_mask": int(mask, 16) if mask else None}
        return {"sm_clock_mhz": None, "clock_reasons_mask": None}

    def after(self, entry: dict[str, Any]) -> dict[str, Any]:
        try:
            row = self._row(entry["uuid"], ["clocks.max.sm", "temperature.gpu", "ecc.errors.uncorrected.volatile.total"])
        except RuntimeError:
            row = None
        if row is None:
            return {"sm_clock_max_mhz": None, "temperature_c": None, "ecc_uncorrected": None}
        return {"sm_clock_max_mhz": self._int(row[0]), "temperature_c": self._int(row[1]),
                "ecc_uncorrected": self._int(row[2])}

    def close(self) -> None:
        pass


def _reader():
    """NVML where pynvml is installed, else nvidia-smi, else None (and why)."""
    try:
        return Nvml(), None
    except Exception as exc:  # noqa: BLE001 - no pynvml, or NVML refused: try the command line tool
        nvml_why = f"pynvml: {type(exc).__name__}: {exc}"
    try:
        return NvidiaSmi(), None
    except Exception as exc:  # noqa: BLE001
        return None, f"{nvml_why}; {exc}"


# ---- the host ----


def _status_ids(pid: str) -> tuple[list[int], str] | None:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    try:
        return [int(x) for x in fields["Uid"].split()], fields.get("Name", "").strip()
    except (KeyError, ValueError):
        return None


def _ppid(pid: int) -> int | None:
    fields = sandbox._stat_fields(pid)
    return int(fields[1]) if fields and len(fields) > 1 else None


def _pidns(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


def _evaluator_of(pid: int) -> int | None:
    """The process that started this sandbox process's sandbox: the parent of its launcher, which is the
    first ancestor outside its pid namespace (None where that cannot be read: not root)."""
    ns = _pidns(pid)
    if ns is None:
        return None
    p = pid
    for _ in range(64):
        parent = _ppid(p)
        if not parent or parent <= 1 and _pidns(parent) is None:
            return None
        if _pidns(parent) != ns:
            return _ppid(parent)  # parent is the launcher
        p = parent
    return None


def sandbox_processes() -> list[dict[str, Any]]:
    """Every live process with a uid of the sandbox's range: on a runner between two evaluations, none."""
    lo, hi = sandbox.UID_RANGE
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        ids = _status_ids(entry)
        if ids is None or not any(lo <= u < hi for u in ids[0]):
            continue
        fields = sandbox._stat_fields(entry)
        if not fields or fields[0] == "Z":
            continue
        evaluator = _evaluator_of(int(entry))
        found.append({"pid": int(entry), "uid": next(u for u in ids[0] if lo <= u < hi), "command": ids[1],
                      "evaluator": evaluator,
                      "evaluator_alive": bool(evaluator and Path(f"/proc/{evaluator}").exists())})
    return sorted(found, key=lambda p: p["pid"])


def disk_space() -> list[dict[str, Any]]:
    paths: list[str] = []
    for p in ("/tmp", os.environ.get("TMPDIR"), os.environ.get("RUNNER_TEMP")):
        if p and os.path.isdir(p) and os.path.realpath(p) not in [os.path.realpath(q) for q in paths]:
            paths.append(p)
    out = []
    for p in paths:
        st = os.statvfs(p)
        out.append({"path": p, "free_bytes": st.f_bavail * st.f_frsize, "total_bytes": st.f_blocks * st.f_frsize})
    return out


def isolation() -> dict[str, Any]:
    if os.geteuid() != 0:
        return {"checked": False, "ok": None,
                "why": f"not root (euid {os.geteuid()}): the evaluator is root through sudo; "
                       "`sudo python -m pipeline sandbox-check --device cuda` probes it"}
    ok, why = sandbox.availability()
    return {"checked": True, "ok": ok, "why": why}


def _ancestors() -> set[int]:
    """This process and those that started it: they hold no evaluation's leftovers (in a test, the
    pytest process that runs this check holds a CUDA context of its own)."""
    out, p = {os.getpid()}, os.getppid()
    while p and p > 1 and p not in out:
        out.add(p)
        p = _ppid(p) or 0
    return out


def gpu_present() -> bool:
    return bool(shutil.which("nvidia-smi")) or any(
        name.startswith("nvidia") and name[6:].isdigit() for name in os.listdir("/dev"))


# ---- gathering ----


def gather(device: str = "auto", bounds: dict[str, Any] | None = None, ignore_pids: set[int] = frozenset(),
           gpus: int | None = None) -> dict:
    """What the machine looks like now, as plain data for `decide`. `ignore_pids`: GPU processes known not
    to be an evaluation's leftovers (beyond this process and its ancestors, always ignored). `gpus`: how
    many GPUs this runner must show (the serving track's node: 8); every visible one is checked anyway."""
    bounds = bounds or load_bounds()
    readings: dict[str, Any] = {
        "device": device,
        "host": {"sandbox_processes": sandbox_processes(), "disk": disk_space(), "isolation": isolation()},
        "gpu": None,
    }
    if device == "cpu" or device == "auto" and not gpu_present():
        readings["gpu_skipped"] = ("--device cpu" if device == "cpu" else
                                   "no NVIDIA GPU on this machine (no /dev/nvidia*, no nvidia-smi)")
        return readings
    readings["gpu"] = _gather_gpu(bounds, _ancestors() | set(ignore_pids), gpus=gpus)
    return readings


def _gather_gpu(bounds: dict[str, Any], ignore: set[int], *, gpus: int | None = None, torch=None,
                reader: Any = "auto") -> dict[str, Any]:
    """Every CUDA device this process sees, one after the other, and what the driver lists (NVML or
    nvidia-smi, read first). `torch` and `reader` stand in for the real ones in the tests (a machine of
    eight GPUs is not here)."""
    why = None
    if reader == "auto":
        reader, why = _reader()
    before: list[dict[str, Any]] = []
    if reader is not None:
        try:
            before = reader.devices()  # before this process has a CUDA context of its own
        except Exception as exc:  # noqa: BLE001
            reader, why = None, f"{reader.source}: {type(exc).__name__}: {exc}"
    gpu: dict[str, Any] = {"source": reader.source if reader else None, "source_missing": why, "devices": [],
                           "expected": gpus, "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
                           "driver_devices": [{"nvml_index": d["nvml_index"], "uuid": d["uuid"], "name": d["name"],
                                               **({"error": d["error"]} if d.get("error") else {})} for d in before]}
    try:
        if torch is None:
            import torch

        if not torch.cuda.is_available():
            gpu["error"] = ("CUDA is not usable here (torch.cuda.is_available() is False) although the machine has an "
                            "NVIDIA GPU: the driver or the runtime is broken" if gpu_present() else
                            "this machine has no NVIDIA GPU (no /dev/nvidia*, no nvidia-smi, no CUDA device)")
            return gpu
        usable = [d for d in before if not d.get("error")]
        for i in range(torch.cuda.device_count()):
            gpu["devices"].append(_gather_device(torch, i, usable, reader, bounds, ignore))
    finally:
        if reader is not None:
            reader.close()
    return gpu


def _uuid_of(torch, i: int) -> str | None:
    try:
        u = str(torch.cuda.get_device_properties(i).uuid)
    except Exception:  # noqa: BLE001 - older torch has no uuid
        return None
    return u if u.startswith(("GPU-", "MIG-")) else "GPU-" + u


def _gather_device(torch, i: int, before: list[dict], reader, bounds: dict, ignore: set[int]) -> dict[str, Any]:
    uuid = _uuid_of(torch, i)
    match = [d for d in before if uuid and d["uuid"] == uuid]
    if not match and len(before) == 1 and torch.cuda.device_count() == 1:
        match = before  # one GPU each way: the same one
    nv = match[0] if match else None
    dev: dict[str, Any] = {"index": i, "name": torch.cuda.get_device_name(i), "uuid": uuid or (nv or {}).get("uuid")}
    if nv is not None:
        dev.update(memory_total=nv["memory_total"], memory_free=nv["memory_free"], memory_source=reader.source,
                   processes=None if nv["processes"] is None else
                   [{**p, "ignored": p["pid"] in ignore} for p in nv["processes"]])
    else:
        dev.update(memory_total=None, memory_free=None, memory_source=None, processes=None)
    samples: list[dict[str, Any]] = []

    def sample() -> None:
        try:
            samples.append(reader.under_load(nv))
        except Exception:  # noqa: BLE001 - a reading missed is a skip, not a crash
            pass

    with torch.cuda.device(i):
        try:
            dev["kernel"] = run_known_kernel(bounds["kernel_n"], f"cuda:{i}", sample if nv is not None else None)
        except Exception as exc:  # noqa: BLE001 - a GPU that cannot run the kernel is the finding
            dev["kernel"] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"}
        if dev["memory_free"] is None:
            free, total = torch.cuda.mem_get_info(i)  # with this process's own context in it: a fallback
            dev.update(memory_total=int(total), memory_free=int(free), memory_source="torch (after this check's own work)")
    clocks = [s["sm_clock_mhz"] for s in samples if s.get("sm_clock_mhz") is not None]
    masks = [s["clock_reasons_mask"] for s in samples if s.get("clock_reasons_mask") is not None]
    dev["sm_clock_mhz"] = max(clocks) if clocks else None
    dev["clock_reasons"] = sorted({n for m in masks for n in reason_names(m)}) if masks else None
    after = {}
    if nv is not None:
        try:
            after = reader.after(nv)
        except Exception:  # noqa: BLE001
            after = {}
    dev["sm_clock_max_mhz"] = after.get("sm_clock_max_mhz")
    dev["temperature_c"] = after.get("temperature_c")
    dev["ecc_uncorrected"] = after.get("ecc_uncorrected")
    return dev


# ---- deciding ----


def _gib(n: int | float) -> str:
    return f"{n / (1 << 30):.1f} GiB"


def decide(readings: dict[str, Any], bounds: dict[str, Any]) -> dict[str, Any]:
    """The verdict on `readings` (gather's plain data): {"healthy", "reasons" (every failed check, each a
    sentence), "skipped" (what could not be checked), "checks" ([state, name, detail]: ok, FAIL, skip)}."""
    checks: list[list[str]] = []

    def add(state: str, name: str, detail: str) -> None:
        checks.append([state, name, detail])

    host = readings["host"]
    procs = host["sandbox_processes"]
    if procs:
        listed = "; ".join(
            f"pid {p['pid']} ({p['command']}, uid {p['uid']}"
            + (f", started by evaluator pid {p['evaluator']}, {'still running' if p['evaluator_alive'] else 'gone'}"
               if p.get("evaluator") else "") + ")" for p in procs)
        add("FAIL", "sandbox processes", f"{len(procs)} process(es) of a sandbox's uid alive: {listed}; a sandbox "
            "outlived its evaluation, or an evaluation is still running: kill them and read that evaluation's log")
    else:
        add("ok", "sandbox processes", "no process of a sandbox's uid is alive")
    for d in host["disk"]:
        ok = d["free_bytes"] >= bounds["min_free_disk"]
        add("ok" if ok else "FAIL", f"disk {d['path']}", f"{_gib(d['free_bytes'])} free of {_gib(d['total_bytes'])}"
            f" (at least {_gib(bounds['min_free_disk'])})" + ("" if ok else ": an evaluation may have filled it; clean it"))
    iso = host["isolation"]
    if not iso["checked"]:
        add("skip", "isolation", iso["why"])
    elif iso["ok"]:
        add("ok", "isolation", "root, pid/network/mount namespaces, a uid of its own")
    else:
        add("FAIL", "isolation", f"the sandbox cannot isolate a submission here: {iso['why']}")

    gpu = readings.get("gpu")
    if gpu is None:
        why = readings.get("gpu_skipped") or "not asked"
        if readings.get("device") == "cuda":
            add("FAIL", "gpu", f"--device cuda, but no GPU was checked: {why}")
        else:
            add("skip", "gpu", f"GPU checks skipped: {why} (the known kernel, the GPU's memory and processes, "
                "clocks, temperature and ECC were not checked)")
    elif gpu.get("error"):
        add("FAIL", "gpu", gpu["error"])
    elif not gpu["devices"]:
        add("FAIL", "gpu", "no CUDA device to check")
    else:
        if gpu.get("source") is None:
            add("skip", "nvml", f"neither NVML nor nvidia-smi answered ({gpu.get('source_missing')}): the GPU's "
                "processes, clocks, temperature and ECC were not checked")
        _decide_gpu_set(gpu, add)
        for dev in gpu["devices"]:
            _decide_device(dev, bounds, add)
    reasons = [f"{name}: {detail}" for state, name, detail in checks if state == "FAIL"]
    skipped = [f"{name}: {detail}" for state, name, detail in checks if state == "skip"]
    return {"healthy": not reasons, "reasons": reasons, "skipped": skipped, "checks": checks}


def _decide_gpu_set(gpu: dict[str, Any], add) -> None:
    """The node as a whole: as many GPUs as its track needs (the serving track's tensor parallelism spans
    all eight), none that the driver lists but cannot read, and, where CUDA_VISIBLE_DEVICES hides none,
    none that the driver lists but CUDA does not see (such a GPU would never be checked or used)."""
    devices, driver = gpu["devices"], gpu.get("driver_devices") or []
    expected = gpu.get("expected")
    if expected:
        names = ", ".join(f"{d['index']} ({d.get('uuid') or 'uuid unknown'})" for d in devices)
        if len(devices) < expected:
            add("FAIL", "gpu count", f"{len(devices)} CUDA device(s) visible ({names}), this runner needs {expected}: a GPU "
                "is missing, hidden (CUDA_VISIBLE_DEVICES) or failed to initialise; `nvidia-smi -L` lists what the "
                "driver sees")
        else:
            add("ok", "gpu count", f"{len(devices)} CUDA device(s) visible (at least {expected})")
    for d in driver:
        if d.get("error"):
            i = d["nvml_index"]
            add("FAIL", f"gpu {i} (driver)", f"the driver cannot read this GPU: {d['error']}; it may have fallen off "
                f"the bus (`nvidia-smi -q -i {i}`, the kernel log's Xid lines): reset it or retire the node")
    seen = {d.get("uuid") for d in devices}
    if gpu.get("cuda_visible_devices") is None and driver and None not in seen:
        unseen = [d for d in driver if not d.get("error") and d.get("uuid") not in seen]
        if unseen:
            add("FAIL", "gpu visibility", "the driver lists " + ", ".join(
                f"GPU {d['nvml_index']} ({d['uuid']})" for d in unseen) + " but CUDA does not see it: a GPU that "
                "failed to initialise, or a driver and runtime that disagree; reset it or retire the node")


def _decide_device(dev: dict[str, Any], bounds: dict[str, Any], add) -> None:
    name = f"gpu {dev['index']}"
    k = dev.get("kernel") or {"error": "not run"}
    if k.get("error"):
        add("FAIL", f"{name} kernel", f"the known kernel failed: {k['error']}")
    else:
        want = {"sum": bounds["kernel_sum"], "sum_of_squares": bounds["kernel_sum_of_squares"]}
        got = {key: k.get(key) for key in want}
        if k.get("n") != bounds["kernel_n"] or got != want:
            add("FAIL", f"{name} kernel", f"wrong answer from the known {k.get('n')}x{k.get('n')} matmul: {got}, "
                f"expected {want}: the GPU computes wrong; reset it or retire it")
        elif k.get("unstable"):
            add("FAIL", f"{name} kernel", f"the known matmul's answer changed under load: {k['unstable']}, expected {want}")
        elif k.get("median_ms") is None:
            add("skip", f"{name} kernel", "right answer; not timed")
        elif k["median_ms"] > bounds["kernel_max_ms"]:
            add("FAIL", f"{name} kernel", f"right answer, but {k['median_ms']:.3f} ms per matmul (at most "
                f"{bounds['kernel_max_ms']} ms): the GPU is slow (clocks, power, another process)")
        else:
            add("ok", f"{name} kernel", f"right answer, {k['median_ms']:.3f} ms per matmul (at most {bounds['kernel_max_ms']})")
    total, free = dev.get("memory_total"), dev.get("memory_free")
    if not total or free is None:
        add("skip", f"{name} memory", "not read")
    else:
        ok = free / total >= bounds["min_free_gpu_memory"]
        add("ok" if ok else "FAIL", f"{name} memory", f"{_gib(free)} free of {_gib(total)} ({free / total:.1%}; at "
            f"least {bounds['min_free_gpu_memory']:.0%}" + (f", read by {dev['memory_source']})" if dev.get("memory_source") else ")")
            + ("" if ok else ": something still holds the GPU's memory"))
    procs = dev.get("processes")
    if procs is None:
        add("skip", f"{name} processes", "not read")
    else:
        left = [p for p in procs if not p.get("ignored")]
        if left:
            add("FAIL", f"{name} processes", f"{len(left)} process(es) on the GPU: " + ", ".join(
                f"pid {p['pid']}" + (f" ({_gib(p['used_bytes'])})" if p.get("used_bytes") else "") for p in left)
                + ": kill them before the next evaluation")
        else:
            add("ok", f"{name} processes", "no other process on the GPU")
    clock, top = dev.get("sm_clock_mhz"), dev.get("sm_clock_max_mhz")
    if clock is None or not top:
        add("skip", f"{name} clocks", "not read")
    else:
        ok = clock / top >= bounds["min_sm_clock"]
        add("ok" if ok else "FAIL", f"{name} clocks", f"SM clock {clock} MHz under the kernel, of {top} MHz "
            f"({clock / top:.0%}; at least {bounds['min_sm_clock']:.0%})" + ("" if ok else ": clocks locked low or throttled"))
    reasons = dev.get("clock_reasons")
    if reasons is None:
        add("skip", f"{name} clock reasons", "not read")
    else:
        bad = sorted(set(reasons) & set(bounds["bad_clock_reasons"]))
        add("FAIL" if bad else "ok", f"{name} clock reasons",
            (f"the GPU slows itself down: {', '.join(bad)}" if bad else f"{', '.join(reasons) or 'none'}"))
    temp = dev.get("temperature_c")
    if temp is None:
        add("skip", f"{name} temperature", "not read")
    else:
        ok = temp <= bounds["max_temperature_c"]
        add("ok" if ok else "FAIL", f"{name} temperature", f"{temp} C (at most {bounds['max_temperature_c']} C)"
            + ("" if ok else ": check the cooling"))
    ecc = dev.get("ecc_uncorrected")
    if ecc is None:
        add("skip", f"{name} ECC", "not read")
    else:
        add("ok" if ecc == 0 else "FAIL", f"{name} ECC", f"{ecc} uncorrected volatile ECC error(s)"
            + ("" if ecc == 0 else ": the GPU's memory is failing; reset it, retire it if they come back"))


# ---- `python -m pipeline runner health` ----


def _annotation(text: str) -> str:
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def health(device: str = "auto", out: Path | None = None, gpus: int | None = None) -> int:
    try:
        bounds = load_bounds()
    except sandbox.LimitsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    started = time.monotonic()
    readings = gather(device, bounds, gpus=gpus)
    verdict = decide(readings, bounds)
    seconds = time.monotonic() - started
    for state, name, detail in verdict["checks"]:
        print(f"{state:4s}  {name}: {detail}", flush=True)
    if verdict["healthy"]:
        print(f"healthy ({seconds:.1f} s)" + (f"; {len(verdict['skipped'])} check(s) skipped" if verdict["skipped"] else ""))
    else:
        print(f"UNHEALTHY: {len(verdict['reasons'])} reason(s); take this runner out of rotation ({RUNBOOK})",
              file=sys.stderr)
        if os.environ.get("GITHUB_ACTIONS") == "true":
            for reason in verdict["reasons"]:
                print(f"::error title=runner unhealthy::{_annotation(reason)}")
    if out is not None:
        out.write_text(json.dumps({"healthy": verdict["healthy"], "reasons": verdict["reasons"],
                                   "skipped": verdict["skipped"], "checks": verdict["checks"], "readings": readings,
                                   "bounds": bounds, "seconds": round(seconds, 3)}, indent=2) + "\n")
    return 0 if verdict["healthy"] else 1


def _runner_args(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    h = sub.add_parser("health", help="check the runner between two evaluations (exit 0 healthy, 1 unhealthy)")
    h.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                   help="cuda: a GPU must be there and healthy (the bench job); auto (default): check the GPU where "
                        "the machine has one, and say that the GPU checks were skipped where it has none")
    h.add_argument("--gpus", type=int, metavar="N",
                   help="the number of GPUs this runner must show (the serving track's node: 8); every visible GPU is "
                        "checked whatever N is")
    h.add_argument("--json", type=Path, metavar="OUT", help="also write the readings and the verdict here")


def runner(args: argparse.Namespace) -> int:
    """The runner between evaluations: `runner health` checks it (leftover processes, disk, the GPU).

    Prints one line per check (ok, FAIL, skip). Exit 0 healthy, 1 unhealthy (every reason printed; on
    GitHub also as error annotations), 2 on a usage or configuration error.
    """
    if args.action == "health":
        if args.json is not None and not args.json.parent.is_dir():
            print(f"error: --json {args.json}: the folder {args.json.parent} does not exist", file=sys.stderr)
            return 2
        if args.gpus is not None and args.gpus < 1:
            print(f"error: --gpus {args.gpus}: a runner needs at least one GPU; leave --gpus out to check whatever is "
                  "there", file=sys.stderr)
            return 2
        if args.gpus is not None and args.device == "cpu":
            print("error: --gpus with --device cpu: the GPU checks are skipped there", file=sys.stderr)
            return 2
        return health(args.device, args.json, args.gpus)
    print(f"error: unknown action {args.action!r}; the action is health", file=sys.stderr)
    return 2


VERBS = {"runner": (_runner_args, runner)}
