"""A worker process as the parent sees it (`Child`): started in its sandbox, sent requests and their buffers,
its replies read within their deadlines, and every way it can fail named for the result (a reply that says
so, a death by a signal, silence past a deadline): `ChildFailure`, `WorkerTimeout`, `BaselineFailure`,
`record_failure`. pipeline/kernel/evaluate.py decides what is asked of it and what its answers earn.
"""

from __future__ import annotations

import json
import os
import secrets
import select
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

from pipeline import sandbox
from pipeline.kernel import toolchains
from pipeline.kernel import transport

WORKER = Path(__file__).resolve().parent / "worker.py"
PACKAGE_DIR = Path(__file__).resolve().parents[1]  # pipeline/: the only part of the checkout a worker sees
LOG_TAIL_CHARS = 4000
WAKE_S = 0.5  # the longest the parent's main thread sleeps waiting for a reply
MAX_REPLY_BYTES = 1 << 20
# CUDA_DEVICE_ORDER with CUDA_VISIBLE_DEVICES: an index names the GPU whose node alone the sandbox binds (sandbox/plan.py)
ENV_PASSTHROUGH = ("PATH", "LD_LIBRARY_PATH", "CUDA_HOME", "CUDA_PATH", "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "LANG",
                   "LC_ALL")


WORKER_STATUSES = ("compile_error", "runtime_error")


def _text(value: Any) -> str:
    """A field of a worker's reply that the result shows as text: a string as it is, anything else as its JSON."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value)[:MAX_REPLY_BYTES]
    except (TypeError, ValueError, RecursionError):
        return repr(type(value))


def _where(value: Any) -> dict[str, Any] | None:
    """The submission's line a worker's reply points at, with each field of the type the result holds; None when
    it is no such thing."""
    if not isinstance(value, dict):
        return None
    line = value.get("line")
    return {"file": _text(value.get("file") or ""),
            "line": line if type(line) is int and 0 <= line <= 10**9 else None,
            "function": None if value.get("function") is None else _text(value.get("function")),
            "code": _text(value.get("code") or "")}


def record_failure(doc: dict[str, Any], status: str, reply: Any, shape: str | None, log_tail: str) -> None:
    """The document's status and error for a failure a worker's reply describes. The reply is the submission's to
    write (its process can rewrite its worker): every field is typed here and every text bounded by `_finish`, so
    no reply can make the result invalid."""
    reply = reply if isinstance(reply, dict) else {}
    if status in WORKER_STATUSES:
        # A missing toolchain or a failed build, told in the competitor's terms (what the runner has).
        told = toolchains.explain(reply, doc["environment"]["toolchains"])
        reply, status = told, worker_status(told, status)
    doc["status"] = status
    doc["error"] = {
        "message": _text(reply.get("error") or status),
        "shape": shape,
        "where": _where(reply.get("where")),
        "traceback": _text(reply.get("traceback", "")),
        "log_tail": log_tail,
    }


def worker_status(reply: dict[str, Any], default: str) -> str:
    status = reply.get("status")
    return status if status in WORKER_STATUSES else default


class ChildFailure(Exception):
    """A worker died or broke the channel; `role` says whose worker."""

    def __init__(self, reply: dict[str, Any], role: str = "submission"):
        super().__init__(reply.get("error"))
        self.reply = reply
        self.role = role


class WorkerTimeout(TimeoutError):
    """A worker did not answer in time; `role` says whose worker, `op` what it was asked, `seconds` the
    limit it was given (`total`: the evaluation's total limit ran out first)."""

    def __init__(self, role: str = "submission", op: str | None = None, seconds: float | None = None,
                 total: bool = False):
        super().__init__(f"the {role}'s worker did not answer in time")
        self.role = role
        self.op = op
        self.seconds = seconds
        self.total = total


# What a worker was doing when it failed, by the request's op: the "where" of a fault's message.
PHASES = {
    "load": "importing the submission (with whatever it builds as it is imported: load_inline, ...)",
    "call": "a call of custom_kernel",
    "bench_prepare": "warming up custom_kernel and capturing a trial CUDA graph of it",
    "bench_capture": "capturing the timed CUDA graphs",
    "bench_measure": "a timed block",
    "bench_outputs": "reading back the timed graph's outputs",
    "bench_crosscheck": "the fresh-content cross-check",
    "bench_release": "releasing a workload's graphs",
}
# What a signal that killed a worker most likely means, for the competitor.
SIGNAL_MEANING = {
    "SIGSEGV": "a segmentation fault: native code, an extension, ctypes or a custom op, touched memory it does not own",
    "SIGBUS": "a bus error: native code touched a mapping with nothing behind it",
    "SIGABRT": "an abort: a native library gave up, on a failed assertion, corrupted memory or an uncaught C++ exception",
    "SIGFPE": "an arithmetic fault in native code, such as an integer division by zero",
    "SIGILL": "an illegal instruction: native code built for another processor",
    "SIGXCPU": "it used up its CPU time, {cpu_seconds} s, competition.toml [limits.sandbox] cpu_seconds",
    "SIGXFSZ": "it wrote a file past its size limit, {file_size} bytes, competition.toml [limits.sandbox] file_size",
    "SIGKILL": "past its CPU-time limit, or by the runner's memory limit, the kernel's OOM killer",
}
ADVICE = "run `python -m pipeline evaluate <your submission.py>` on your own machine (--device cpu without a GPU)"


class BaselineFailure(RuntimeError):
    """The baseline's worker failed (an error, a crash, a timeout): the evaluation cannot be completed,
    and nothing about it is the submission's result. The CLI exits 3 and writes no result; the bench job
    fails loudly for the organizers (docs/RUNBOOK.md)."""


class Child:
    """One worker process (the submission's or the baseline's), in its own sandbox. Requests go
    down a unix socket with the descriptors of the parent's buffers; replies come back as JSON
    lines on a pipe, each echoing the request's nonce."""

    def __init__(self, device: str, deadline: float, policy: sandbox.Policy, readable: list[Path],
                 role: str = "submission"):
        self.deadline = deadline
        self.role = role
        self.limits = policy.limits
        self.op: str | None = None  # the last request's op: where a failure happened
        self._sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._resp_r, resp_w = os.pipe()
        out_r, out_w = os.pipe()
        env = {k: os.environ[k] for k in ENV_PASSTHROUGH if k in os.environ}
        scratch = sandbox.SCRATCH_TOKEN  # the sandbox puts the path of the worker's own writable folder here
        # Builds (load_inline, Triton, FlashInfer's JIT) and their caches live in the scratch; the
        # interpreter's bin folder (a venv's ninja) and the CUDA toolkit are where the worker finds them.
        env.update(HOME=scratch, TMPDIR=scratch, PYTHONDONTWRITEBYTECODE="1", **toolchains.build_env(scratch))
        # Idle OpenMP threads sleep instead of spinning: two workers take turns on the CPU, and one's
        # spinning pool would otherwise eat into the other's timed block.
        env["OMP_WAIT_POLICY"] = "PASSIVE"
        if device == "cpu":
            env["TRITON_INTERPRET"] = "1"
        argv = [sys.executable, "-I", "-u", str(WORKER), "--req-fd", str(theirs.fileno()), "--resp-fd", str(resp_w),
                "--device", device]
        try:
            self.box = sandbox.Sandbox(argv, policy=policy, readable=[PACKAGE_DIR, *readable], env=env,
                                       pass_fds=(theirs.fileno(), resp_w), stdout=out_w, stderr=out_w, device=device)
        finally:
            theirs.close()
            for fd in (resp_w, out_w):
                os.close(fd)
        self._output = sandbox.OutputTail(out_r)
        self._buf = b""
        self._sent: set[int] = set()  # arenas the worker has mapped
        self._drop: list[int] = []  # arenas the parent released: the worker unmaps them with the next request
        self.killed = 0

    def request(self, req: dict[str, Any], timeout: float, arenas: list[transport.Arena] = ()) -> dict[str, Any]:
        """Send one request; return the reply, or raise TimeoutError / ChildFailure (process gone)."""
        return self.receive(self.send(req, timeout, arenas))

    def send(self, req: dict[str, Any], timeout: float, arenas: list[transport.Arena] = ()) -> tuple[str, float]:
        """Send a request with the buffers it names (those the worker has not mapped yet travel as
        descriptors): (its nonce, the instant its reply is due) for `receive`."""
        # Every reply must echo a fresh nonce: a line that the submission writes to the reply pipe
        # itself (its number is no secret) cannot pass for the harness's answer.
        nonce = secrets.token_hex(16)
        self.op = req.get("op")
        new = [a for a in arenas if a.id not in self._sent]
        req = {**req, "nonce": nonce, "arenas": [a.spec() for a in new], "drop": self._drop}
        try:
            transport.send(self._sock, json.dumps(req).encode(), [a.fd for a in new])
        except OSError:
            raise ChildFailure(self._death(), self.role) from None
        self._sent.update(a.id for a in new)
        self._drop = []
        return nonce, min(time.monotonic() + timeout, self.deadline), timeout, self.op

    def release(self, arenas) -> None:
        """The parent is done with these buffers: it frees its side now, the worker unmaps its own with
        the next request (its memory is returned when both have)."""
        for a in arenas:
            if a.id in self._sent:
                self._sent.discard(a.id)
                self._drop.append(a.id)

    def receive(self, pending: tuple[str, float, float, str | None]) -> dict[str, Any]:
        nonce, limit, seconds, op = pending
        while b"\n" not in self._buf:
            remaining = limit - time.monotonic()
            if remaining <= 0:
                raise WorkerTimeout(self.role, op, seconds, total=limit >= self.deadline)
            # never longer than WAKE_S: a SIGINT or SIGTERM the kernel hands to another thread (the progress
            # ticker, an output drain) interrupts only that thread; Python acts on it when this one wakes
            ready, _, _ = select.select([self._resp_r], [], [], min(remaining, WAKE_S))
            if not ready:
                continue
            chunk = os.read(self._resp_r, 65536)
            if not chunk:
                raise ChildFailure(self._death(), self.role)
            self._buf += chunk
            if len(self._buf) > MAX_REPLY_BYTES:
                raise ChildFailure({"error": f"the {self.role}'s process sent an oversized reply",
                                    "status": "runtime_error"}, self.role)
        line, self._buf = self._buf.split(b"\n", 1)
        try:
            reply = json.loads(line)
            if not isinstance(reply, dict):
                raise ValueError("not an object")
        except (ValueError, RecursionError):  # RecursionError: a line nested deeper than the parser goes
            reply = {}
        if reply.get("nonce") != nonce:
            raise ChildFailure({"status": "runtime_error",
                                "error": "the harness channel was corrupted: a reply the harness did not send "
                                         "(a submission must not write to the harness's file descriptors)"}, self.role)
        return reply

    def _death(self) -> dict[str, Any]:
        code = self.box.wait(timeout=10)
        phase = f" during {PHASES[self.op]}" if self.op in PHASES else ""
        if code is None:
            why = (f"the {self.role}'s process closed the harness channel{phase}: a submission must not close "
                   "or write to the harness's file descriptors")
        elif code < 0:
            name = signal.Signals(-code).name
            meaning = SIGNAL_MEANING.get(name, "").format(cpu_seconds=self.limits.cpu_seconds,
                                                          file_size=self.limits.file_size)
            if name == "SIGKILL" and getattr(self.box, "oom_kills", 0):
                meaning = (f"the kernel's OOM killer: its sandbox used all of its {self.limits.group_memory >> 20} MiB "
                           "of memory, what it wrote to /tmp and /dev/shm included (competition.toml [limits.sandbox] "
                           "group_memory)")
            why = (f"the {self.role}'s process was killed by {name}{phase}" + (f" ({meaning})" if meaning else "")
                   + f"; to see where, {ADVICE}")
        else:
            why = (f"the {self.role}'s process exited with code {code}{phase or ' in the middle of a call'}: "
                   "custom_kernel must return its output, never end the process (sys.exit, os._exit, a native "
                   "library's exit)")
        return {"status": "runtime_error", "error": why}

    def log_tail(self) -> str:
        return self._output.text(LOG_TAIL_CHARS)

    def describe(self) -> dict[str, Any]:
        return self.box.describe()

    def close(self) -> None:
        """End the worker and everything it started; returns once none of it is left."""
        if self._sock is None:
            return
        # Killed, not asked to exit: a worker has nothing to save, and this counts what it left running.
        self.kill()
        self._sock.close()
        self._sock = None
        try:
            os.close(self._resp_r)
        except OSError:
            pass

    def kill(self) -> None:
        """Kill the worker's whole sandbox (again is harmless), counting what it had left running."""
        self.killed += self.box.kill()
