"""Evaluate one kernel submission: the parent side.

The parent holds the problem's reference, the seeds and every expected output; the submission runs in
a freshly started child (`worker.py`) that only ever receives input tensors. For every workload and
test shape, over several seeds, the parent makes the inputs, sends them, reads back the output (and
any input the problem writes in place), checks the untouched inputs by fingerprint, and compares
with the reference. It then times the workloads against the baseline. It never raises on anything a
submission does: every failure becomes a status in the result document.
"""

from __future__ import annotations

import json
import os
import platform
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pipeline import result as result_schema
from pipeline.kernel import seeds as seedlib
from pipeline.kernel.check import compare
from pipeline.kernel.transport import BundleError, fingerprints, read_bundle, write_bundle
from pipeline.problems import Problem, Shape, geomean

WORKER = Path(__file__).resolve().parent / "worker.py"
LOG_TAIL_CHARS = 4000
MAX_REPLY_BYTES = 1 << 20
ENV_PASSTHROUGH = ("PATH", "LD_LIBRARY_PATH", "CUDA_HOME", "CUDA_PATH", "CUDA_VISIBLE_DEVICES", "LANG", "LC_ALL")


@dataclass
class Limits:
    """Seconds. The spec's: compile and warm-up 180 s, 60 s per workload, 15 min in all."""

    compile: float = 180.0
    first_call: float = 180.0
    call: float = 60.0
    total: float = 900.0


@dataclass
class Options:
    device: str | None = None  # None: cuda if available, else cpu
    model: str | None = None  # None: full on cuda, smoke on cpu
    seeds: int | None = None  # None: the problem's official count on GPU, 3 on CPU
    secret: bytes | None = None  # set: official seeds; None: public seeds
    timing: bool = True
    shapes: list[str] | None = None  # restrict to these shape names (for debugging a submission)
    limits: Limits = field(default_factory=Limits)
    submission_meta: dict[str, Any] = field(default_factory=dict)


class ChildFailure(Exception):
    def __init__(self, reply: dict[str, Any]):
        super().__init__(reply.get("error"))
        self.reply = reply


class Child:
    """The submission's process, spoken to over two private pipes with JSON lines."""

    def __init__(self, device: str, scratch: Path, deadline: float):
        self.scratch = scratch
        self.deadline = deadline
        self.log_path = scratch / "child.log"
        req_r, self._req_w = os.pipe()
        self._resp_r, resp_w = os.pipe()
        env = {k: os.environ[k] for k in ENV_PASSTHROUGH if k in os.environ}
        env.update(
            HOME=str(scratch),
            TMPDIR=str(scratch),
            TRITON_CACHE_DIR=str(scratch / "triton-cache"),
            TORCH_EXTENSIONS_DIR=str(scratch / "torch-extensions"),
            PYTHONDONTWRITEBYTECODE="1",
        )
        if device == "cpu":
            env["TRITON_INTERPRET"] = "1"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-I", "-u", str(WORKER), "--req-fd", str(req_r), "--resp-fd", str(resp_w),
             "--scratch", str(scratch), "--device", device],
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            pass_fds=(req_r, resp_w),
            cwd=scratch,
            env=env,
            start_new_session=True,
        )
        os.close(req_r)
        os.close(resp_w)
        self._buf = b""

    def request(self, req: dict[str, Any], timeout: float) -> dict[str, Any]:
        """Send one request; return the reply, or raise TimeoutError / ChildFailure (process gone)."""
        try:
            os.write(self._req_w, (json.dumps(req) + "\n").encode())
        except BrokenPipeError:
            raise ChildFailure(self._death()) from None
        limit = min(time.monotonic() + timeout, self.deadline)
        while b"\n" not in self._buf:
            remaining = limit - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            ready, _, _ = select.select([self._resp_r], [], [], remaining)
            if not ready:
                continue
            chunk = os.read(self._resp_r, 65536)
            if not chunk:
                raise ChildFailure(self._death())
            self._buf += chunk
            if len(self._buf) > MAX_REPLY_BYTES:
                raise ChildFailure({"error": "the submission's process sent an oversized reply", "status": "runtime_error"})
        line, self._buf = self._buf.split(b"\n", 1)
        try:
            reply = json.loads(line)
            if not isinstance(reply, dict):
                raise ValueError("not an object")
        except ValueError:
            raise ChildFailure({"status": "runtime_error", "error": "the harness channel was corrupted"}) from None
        return reply

    def _death(self) -> dict[str, Any]:
        try:
            code = self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            code = None
        if code is None:
            why = "the submission's process closed the harness channel"
        elif code < 0:
            why = f"the submission's process was killed by {signal.Signals(-code).name}"
        else:
            why = f"the submission's process exited with code {code} in the middle of a call"
        return {"status": "runtime_error", "error": why}

    def log_tail(self) -> str:
        try:
            data = self.log_path.read_bytes()[-LOG_TAIL_CHARS:]
        except OSError:
            return ""
        return data.decode("utf-8", errors="replace")

    def close(self) -> None:
        try:
            os.write(self._req_w, b'{"op": "exit"}\n')
        except OSError:
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        self.kill()
        for fd in (self._req_w, self._resp_r):
            try:
                os.close(fd)
            except OSError:
                pass
        self._log.close()

    def kill(self) -> None:
        # The whole process group: a submission's own children die with it.
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def _scratch_dir() -> Path:
    shm = Path("/dev/shm")
    base = None
    if shm.is_dir() and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free > (8 << 30):
        base = str(shm)
    return Path(tempfile.mkdtemp(prefix="muse-eval-", dir=base))


def environment(device: str) -> dict[str, Any]:
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "harness_commit": _harness_commit(),
        "image_digest": os.environ.get("PIPELINE_IMAGE_DIGEST"),
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except Exception:  # noqa: BLE001 - triton is optional on a CPU machine
        env["triton"] = None
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, cuda=torch.version.cuda, sm_count=props.multi_processor_count)
        env.update(_nvml_facts())
    else:
        env["gpu"] = None
        env["cpu"] = platform.processor() or platform.machine()
    return env


def _nvml_facts() -> dict[str, Any]:
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        facts = {
            "gpu_uuid": pynvml.nvmlDeviceGetUUID(handle),
            "driver": pynvml.nvmlSystemGetDriverVersion(),
        }
        pynvml.nvmlShutdown()
        return {k: (v.decode() if isinstance(v, bytes) else v) for k, v in facts.items()}
    except Exception:  # noqa: BLE001 - NVML is missing on some machines; say so rather than fail
        return {"gpu_uuid": None, "driver": None}


def _harness_commit() -> str | None:
    root = Path(__file__).resolve().parents[2]
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def _expected(problem: Problem, inputs: dict[str, Any]) -> dict[str, torch.Tensor]:
    ref = problem.reference.reference(inputs)
    if not problem.inplace:
        return {"output": ref}
    missing = [k for k in ("output", *problem.inplace) if k not in ref]
    if missing:
        raise RuntimeError(f"reference of {problem.name} returned no {missing}")
    return ref


def _params_summary(shape: Shape, problem: Problem) -> dict[str, Any]:
    model_keys = set(problem.model[shape.model])
    out = {}
    for k, v in shape.params.items():
        if k in model_keys:
            continue
        if isinstance(v, list) and len(v) > 8:
            v = f"[{len(v)} values]"
        out[k] = v
    return out


def _summary(samples: list[float]) -> dict[str, Any]:
    ordered = sorted(samples)
    n = len(ordered)
    median = statistics.median(ordered)
    mean = statistics.fmean(ordered)
    cv = statistics.pstdev(ordered) / mean if n > 1 and mean > 0 else 0.0
    return {
        "median_us": median,
        "min_us": ordered[0],
        "p10_us": ordered[int(0.1 * (n - 1))],
        "p90_us": ordered[int(0.9 * (n - 1))],
        "cv": cv,
        "n": n,
    }


def evaluate(submission: Path, problem: Problem, options: Options | None = None) -> dict[str, Any]:
    """Run the whole evaluation and return the result document (valid against the schema)."""
    opts = options or Options()
    device = opts.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = opts.model or ("full" if device == "cuda" else "smoke")
    n_seeds = opts.seeds or (problem.official_seeds if device == "cuda" else 3)
    started = result_schema.now()
    data = Path(submission).read_bytes()
    doc: dict[str, Any] = {
        "schema_version": result_schema.SCHEMA_VERSION,
        "track": "kernel",
        "problem": problem.name,
        "submission": {
            "path": str(opts.submission_meta.get("path", submission)),
            "blob_sha": result_schema.git_blob_sha(data),
            "login": opts.submission_meta.get("login"),
            "pr": opts.submission_meta.get("pr"),
            "head_sha": opts.submission_meta.get("head_sha"),
        },
        "status": "passed",
        "official": False,
        "mode": {
            "device": device,
            "model": model,
            "timing": "wall-clock (unofficial)" if opts.timing else "none",
            "seeds": "secret" if opts.secret else "public",
        },
        "error": None,
        "correctness": [],
        "performance": [],
        "score": None,
        "flags": [],
        "environment": environment(device),
        "baseline": f"reference/{problem.name}.py:baseline",
        "started_at": started,
        "finished_at": started,
        "signature": None,
    }
    shapes = problem.shapes(model)
    if opts.shapes:
        shapes = [s for s in shapes if s.name in opts.shapes]
    scratch = _scratch_dir()
    deadline = time.monotonic() + opts.limits.total
    child = Child(device, scratch, deadline)
    current_shape: str | None = None

    def fail(status: str, reply: dict[str, Any]) -> None:
        doc["status"] = status
        doc["error"] = {
            "message": reply.get("error") or status,
            "shape": current_shape,
            "where": reply.get("where"),
            "traceback": reply.get("traceback", ""),
            "log_tail": child.log_tail(),
        }

    try:
        reply = child.request(
            {"op": "load", "submission": str(Path(submission).resolve()), "reference": str(problem.reference_path)},
            opts.limits.compile,
        )
        if not reply.get("ok"):
            fail(reply.get("status", "compile_error"), reply)
            return _finish(doc)
        first = True
        for shape in shapes:
            current_shape = shape.name
            entry = _check_shape(child, problem, shape, n_seeds, opts, device, first, fail)
            first = False
            doc["correctness"].append(entry)
            if doc["status"] != "passed":
                break
        if doc["status"] == "passed" and any(not e["passed"] for e in doc["correctness"]):
            doc["status"] = "incorrect"
        if doc["status"] == "passed" and opts.timing:
            current_shape = None
            _time_workloads(child, problem, [s for s in shapes if s.kind == "workload"], device, opts, doc, fail)
    except TimeoutError:
        child.kill()
        limit = "the 15-minute total" if time.monotonic() >= deadline else "its time limit"
        fail("timeout", {"error": f"the submission did not answer within {limit} (shape {current_shape})"})
    except ChildFailure as exc:
        fail(exc.reply.get("status", "runtime_error"), exc.reply)
    finally:
        child.close()
        shutil.rmtree(scratch, ignore_errors=True)
    return _finish(doc)


def _finish(doc: dict[str, Any]) -> dict[str, Any]:
    doc["finished_at"] = result_schema.now()
    result_schema.validate(doc)
    return doc


def _check_shape(child, problem, shape, n_seeds, opts, device, first, fail) -> dict[str, Any]:
    ref_mod = problem.reference
    entry: dict[str, Any] = {
        "shape": shape.name,
        "kind": shape.kind,
        "params": _params_summary(shape, problem),
        "passed": True,
        "seeds": 0,
        "failed_seed_index": None,
        "reason": None,
        "outputs": {},
    }
    worst: dict[str, dict[str, Any]] = {}
    for i in range(n_seeds):
        seed = (
            seedlib.secret_seed(opts.secret, problem.name, shape.name, i)
            if opts.secret
            else seedlib.public_seed(problem.name, shape.name, i)
        )
        inputs = ref_mod.make_inputs(shape, seed, device)
        before = fingerprints({k: v for k, v in inputs.items() if k not in problem.inplace})
        expected = _expected(problem, inputs)
        after_ref = fingerprints({k: v for k, v in inputs.items() if k not in problem.inplace})
        if after_ref != before:
            raise RuntimeError(f"reference of {problem.name} modified its inputs")
        masks = ref_mod.written(inputs) if problem.inplace else {}
        pristine = {k: inputs[k] for k in problem.inplace}
        write_bundle(child.scratch / "inputs.bin", inputs)
        poison = expected["output"].numel() * 2
        timeout = opts.limits.first_call if (first and i == 0) else opts.limits.call
        reply = child.request(
            {"op": "call", "target": "submission", "inputs": "inputs.bin", "output": "output.bin",
             "inplace": list(problem.inplace), "poison_bytes": poison},
            timeout,
        )
        entry["seeds"] = i + 1
        if not reply.get("ok"):
            fail(reply.get("status", "runtime_error"), reply)
            entry.update(passed=False, failed_seed_index=i, reason=reply.get("error"))
            return entry
        try:
            got = read_bundle(child.scratch / "output.bin", device)
        except (BundleError, OSError) as exc:
            fail("runtime_error", {"error": f"the submission's output could not be read: {exc}"})
            entry.update(passed=False, failed_seed_index=i, reason=str(exc))
            return entry
        verdicts: dict[str, dict[str, Any]] = {}
        if reply.get("output_error"):
            verdicts["output"] = {"passed": False, "reason": reply["output_error"]}
        else:
            dtype = problem.reference.OUTPUT_DTYPE if hasattr(problem.reference, "OUTPUT_DTYPE") else torch.bfloat16
            verdicts["output"] = compare(got.get("output"), expected["output"], problem.tolerances["output"],
                                         expected_dtype=dtype)
        for name in problem.inplace:
            verdicts[name] = compare(got.get(name), expected[name], problem.tolerances[name],
                                     expected_dtype=pristine[name].dtype, mask=masks.get(name),
                                     pristine=pristine[name])
        changed = sorted(k for k, v in (reply.get("fingerprints") or {}).items() if before.get(k) != v)
        changed += sorted(k for k in before if k not in (reply.get("fingerprints") or {}))
        if changed:
            verdicts["inputs"] = {"passed": False, "reason": f"the submission modified its inputs: {', '.join(changed)}"}
        for name, v in verdicts.items():
            prev = worst.get(name)
            if prev is None or not v["passed"] or (prev["passed"] and v.get("rel_l2", 0) > prev.get("rel_l2", 0)):
                worst[name] = v
        failed = [f"{name}: {v['reason']}" for name, v in verdicts.items() if not v["passed"]]
        if failed:
            entry.update(passed=False, failed_seed_index=i, reason="; ".join(failed))
            break
    entry["outputs"] = worst
    return entry


def _time_workloads(child, problem, workloads, device, opts, doc, fail) -> None:
    ref_mod = problem.reference
    speedups, medians = [], []
    for shape in workloads:
        # Timing inputs come from their own public stream: timing needs valid data, not secret data.
        inputs = ref_mod.make_inputs(shape, seedlib.public_seed(problem.name, shape.name, 10_000), device)
        write_bundle(child.scratch / "timing.bin", inputs)
        figures = {}
        for target in ("baseline", "submission"):
            reply = child.request(
                {"op": "time", "target": target, "inputs": "timing.bin", "seconds": 0.3 if device == "cpu" else 1.0,
                 "min_samples": 5, "max_samples": 200},
                opts.limits.call,
            )
            if not reply.get("ok"):
                fail(reply.get("status", "runtime_error"), reply)
                return
            figures[target] = reply["samples_us"]
        sub, base = _summary(figures["submission"]), _summary(figures["baseline"])
        speedup = base["median_us"] / sub["median_us"]
        floor = ref_mod.floor(shape)
        doc["performance"].append({
            "workload": shape.name,
            **sub,
            "baseline_median_us": base["median_us"],
            "speedup": speedup,
            "floor_us": None,
            "floor": floor,
            "clocks": None,
            "samples_us": figures["submission"],
            "baseline_samples_us": figures["baseline"],
        })
        speedups.append(speedup)
        medians.append(sub["median_us"])
    if speedups:
        doc["score"] = {"speedup": geomean(speedups), "time_us": geomean(medians)}
