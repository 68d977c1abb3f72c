"""A worker: the process that runs one target, the submission or the baseline, started by `evaluate`.

Each target has a process of its own, so a submission that patches torch, walks frames or rebinds
names changes only its own process, never the baseline it is compared with. A worker never sees a
seed or a reference output: it receives requests (JSON) with the file descriptors of buffers the
parent owns on a unix socket, maps those buffers, calls its target on them, copies the output into
the parent's output buffer and answers on a pipe. Whatever the target prints goes to a log the parent
reads only as text. Run as a script (`python -I worker.py`), so that neither the environment nor the
current directory shapes imports.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import re
import socket
import statistics
import sys
import time
import traceback
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from pipeline.kernel import predecessor, timing, toolchains  # noqa: E402
from pipeline.kernel.transport import Mappings, write_output  # noqa: E402

TAIL_LINES = 40
MAX_REQUEST = 4 << 20
MAX_FDS = 250


def _target_frame(tb: traceback.StackSummary, path: str) -> dict | None:
    frames = [f for f in tb if os.path.abspath(f.filename) == path]
    if not frames:
        return None
    f = frames[-1]
    return {"file": Path(path).name, "line": f.lineno, "function": f.name, "code": (f.line or "").strip()}


def _error(status: str, exc: BaseException, path: str) -> dict:
    tb = traceback.extract_tb(exc.__traceback__)
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    where = _target_frame(tb, path)
    if where is None and isinstance(exc, SyntaxError) and exc.filename and os.path.abspath(exc.filename) == path:
        where = {"file": Path(path).name, "line": exc.lineno, "function": "<module>", "code": (exc.text or "").strip()}
    message = f"{type(exc).__name__}: {exc}"
    reply = {
        "ok": False,
        "status": status,
        "error": message[:2000],
        "where": where,
        "traceback": "\n".join(text.splitlines()[-TAIL_LINES:]),
    }
    if toolchains.is_build_failure(str(exc)):
        # ninja's whole output is in the exception's text: its first error (and the submission's line it
        # comes from) for the message, its tail for the log, which the parent reads from this output.
        build = toolchains.build_failure(str(exc), path)
        reply["build"] = build
        head = re.match(r"Error building extension '[^']*'", str(exc))
        reply["error"] = f"{type(exc).__name__}: {head.group(0) if head else str(exc).splitlines()[0][:200]}"
        frames = "".join(traceback.format_list(tb)) + reply["error"]
        reply["traceback"] = "\n".join(frames.splitlines()[-TAIL_LINES:])
        print(f"---- the build's log (tail) ----\n{build['log_tail']}", file=sys.stderr, flush=True)
    return reply


def _is_compile_failure(exc: BaseException) -> bool:
    # Triton compiles at the first call; a kernel that does not compile is a compile error, not a crash.
    # So is an extension built at the first call (load_inline) that does not build, and a toolchain
    # imported there that the runner lacks.
    names = {c.__name__ for c in type(exc).__mro__}
    return bool(names & {"CompilationError", "CompileTimeAssertionFailure", "OutOfResources", "ModuleNotFoundError"}) \
        or toolchains.is_build_failure(str(exc))


_CUDART: list = []


def _cudart():
    """The CUDA runtime this process already loaded (through torch), for the calls torch does not expose
    (found once: reading /proc/self/maps at every timed block cost about a millisecond each)."""
    if not _CUDART:
        _CUDART.append(_find_cudart())
    return _CUDART[0]


def _find_cudart():
    import ctypes

    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart.so" in line}
    except OSError:
        paths = set()
    for path in sorted(paths) + ["libcudart.so"]:
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


CUDA_LIMIT_PERSISTING_L2 = 0x06


def persisting_l2_reset() -> int | None:
    """Bytes of L2 set aside for persisting accesses (then set back to 0), or None if unknown.

    A carve-out lets a kernel keep its 'cold' inputs resident in L2 across calls: it is reset before
    every timed round and reported when a submission has set it."""
    import ctypes

    rt = _cudart()
    if rt is None:
        return None
    value = ctypes.c_size_t(0)
    if rt.cudaDeviceGetLimit(ctypes.byref(value), ctypes.c_int(CUDA_LIMIT_PERSISTING_L2)) != 0:
        return None
    if value.value:
        rt.cudaDeviceSetLimit(ctypes.c_int(CUDA_LIMIT_PERSISTING_L2), ctypes.c_size_t(0))
    # Lines already marked persisting stay so until reset, whatever the limit says now (the hole
    # pygpubench closed in its PR #49: a reset alone is not enough, nor is the limit alone).
    rt.cudaCtxResetPersistingL2Cache()
    return int(value.value)


class Bench:
    """One workload's timed state in a worker: its input sets, graphs and cross-check graphs."""

    def __init__(self, sets: list[dict]):
        self.sets = sets
        self.timed: timing.Graph | None = None
        self.cross: tuple[timing.Graph, timing.Graph] | None = None


class Worker:
    def __init__(self, device: str):
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if self.device.type == "cuda":
            # The driver may start with a persisting-L2 set-aside (11 MiB seen on the H200). The harness
            # owns this setting: zero before any submission code runs, so any later non-zero value is
            # the submission's doing.
            torch.cuda.init()
            torch.empty(1, device=self.device)
            persisting_l2_reset()
        self.buffers = Mappings(self.device)
        self.fn = None
        self.path = ""
        self.benches: dict[str, Bench] = {}
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.overlaps = predecessor.overlaps_possible(self.device)
        if self.overlaps:
            # The late-writing kernel is built and run, and a fenced graph captured, before the target is
            # loaded: a harness part that fails here is the runner's failure, never the submission's.
            predecessor.LateWrite({"x": torch.zeros(8, device=self.device)}, ["x"]).launch(delay_ns=0)
            probe = torch.zeros(1, device=self.device)
            timing.replays_us([timing.capture(lambda s: s["x"].add_(1), [{"x": probe}], 2, self.stream)])
            if probe.item() != 2:
                raise RuntimeError(f"a fenced graph of two calls left {probe.item()}, not 2")

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def load(self, req: dict) -> dict:
        """Import the target's module and find its function (`custom_kernel`, or the reference's
        `baseline`)."""
        self.path = os.path.abspath(req["path"])
        for extra in req.get("sys_path", []):
            # The layer references import the smaller problems' building blocks from their folder.
            sys.path.insert(0, extra)
        try:
            spec = importlib.util.spec_from_file_location(req.get("module", "submission"), self.path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            spec.loader.exec_module(module)
            fn = getattr(module, req.get("function", "custom_kernel"), None)
            if not callable(fn):
                return {
                    "ok": False,
                    "status": "compile_error",
                    "error": f"the submission defines no function {req.get('function', 'custom_kernel')}(inputs)",
                    "where": {"file": Path(self.path).name, "line": None, "function": None, "code": ""},
                    "traceback": "",
                }
            self.fn = fn
        except BaseException as exc:  # noqa: BLE001 - anything the submission raises is its verdict
            return _error("compile_error", exc, self.path)
        return {"ok": True}

    def _poison(self, nbytes: int) -> None:
        # Fill the blocks the allocator will hand out next with bytes drawn afresh for every call, so a
        # submission that returns uninitialised memory cannot pass on what an earlier call left there,
        # and cannot tell a checked call by a fixed filler (NaN, say) in what it allocates.
        if nbytes <= 0:
            return
        n = max(1, math.ceil(nbytes / 4))
        blocks = [torch.randint(-2**31, 2**31 - 1, (m,), dtype=torch.int32, device=self.device)
                  for m in (n, n, n, n, 2 * n)]
        self.sync()
        del blocks

    def _hand_back(self, out, arena_id: int) -> dict:
        """What the parent reads of one output: its bytes in the parent's buffer, and what they are."""
        if type(out) is not torch.Tensor:
            return {"error": f"custom_kernel returned a {type(out).__module__}.{type(out).__qualname__}, "
                             "expected a torch.Tensor"}
        if out.device != self.device:
            return {"error": f"output is on {out.device}, expected {self.device}"}
        if not out.is_contiguous():
            return {"error": f"output is not contiguous (strides {list(out.stride())}); return a contiguous tensor"}
        return write_output(self.buffers.flat(arena_id), out)

    def call(self, req: dict) -> dict:
        inputs = self.buffers.unpack(req["inputs"])
        # Where a launch may start before the one ahead of it ends, the activations are written late by the
        # kernel just before the call, which lets it start at once (predecessor.py).
        late = predecessor.LateWrite(inputs, req.get("produced", ())) if self.overlaps else None
        self._poison(int(req.get("poison_bytes", 0)))
        self.sync()
        if late is not None:
            late.launch()
        try:
            out = self.fn(inputs)
            self.sync()
        except BaseException as exc:  # noqa: BLE001
            status = "compile_error" if _is_compile_failure(exc) else "runtime_error"
            return _error(status, exc, self.path)
        reply = {"ok": True, "output": self._hand_back(out, req["output"])}
        self.sync()
        del inputs, out
        return reply

    # ---- the official timing method (timing.py); one workload at a time, kept by its key ----

    def bench_prepare(self, req: dict) -> dict:
        """Map the input sets, warm the target up (compilation and autotuning happen here and never
        later) and estimate its per-call time from a short trial graph."""
        bench = Bench([self.buffers.unpack(s) for s in req["sets"]])
        self.benches[req["key"]] = bench
        try:
            for j in range(max(3, len(bench.sets))):
                self.fn(bench.sets[j % len(bench.sets)])
            self.sync()
            trial = timing.capture(self.fn, bench.sets, len(bench.sets) * 2, self.stream)
            estimate = min(timing.replays_us([trial] * 3))
            del trial
        except BaseException as exc:  # noqa: BLE001
            return self._capture_failure(exc)
        return {"ok": True, "per_call_us": estimate}

    def _capture_failure(self, exc: BaseException) -> dict:
        reply = _error("compile_error" if _is_compile_failure(exc) else "runtime_error", exc, self.path)
        reply["error"] = "while warming up and capturing a CUDA graph of custom_kernel: " + reply["error"]
        return reply

    def bench_capture(self, req: dict) -> dict:
        """Capture the timed graph with exactly the number of calls the parent chose, and the
        fresh-content cross-check's graphs, in the order the parent chose (so a submission cannot
        tell by counting its captures which graph is the one that is timed)."""
        bench = self.benches[req["key"]]
        if "sets" in req:  # the parent's final sets: one a call of the timed graph
            bench.sets = [self.buffers.unpack(s) for s in req["sets"]]
        flush_buf = torch.empty(int(req["flush_bytes"]) // 4, dtype=torch.float32, device=self.device).normal_()
        sink = torch.empty((), dtype=torch.float32, device=self.device)

        def fresh_then_flush(s: dict) -> None:
            # New content in every floating input of the set about to be used (rolled by one element:
            # never the same content twice), then a read flush that evicts it, dirty lines and all.
            for t in s.values():
                if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() > 1:
                    t.copy_(torch.roll(t, 1))
            torch.sum(flush_buf, dim=0, out=sink)

        k = max(len(bench.sets), 8)
        for kind in req["order"]:
            try:
                if kind == "timed":
                    bench.timed = timing.capture(self.fn, bench.sets, int(req["calls"]), self.stream)
                else:
                    bench.cross = (
                        timing.capture(self.fn, bench.sets, k, self.stream, prologue=fresh_then_flush),
                        timing.capture(lambda _s: None, bench.sets, k, self.stream, prologue=fresh_then_flush))
                self.sync()
            except BaseException as exc:  # noqa: BLE001
                return self._capture_failure(exc)
        return {"ok": True}

    def bench_measure(self, req: dict) -> dict:
        """One block: exactly `replays` timed replays of this target's graph."""
        carve_out = persisting_l2_reset() if self.device.type == "cuda" else 0
        samples = timing.replays_us([self.benches[req["key"]].timed] * int(req["replays"]))
        return {"ok": True, "samples_us": samples, "persisting_l2_bytes": carve_out or 0}

    def bench_outputs(self, req: dict) -> dict:
        """Copy what the last timed replay left for each call (one input set a call) into the parent's
        buffers."""
        bench = self.benches[req["key"]]
        claims = [self._hand_back(bench.timed.outputs.get(r), arena) for r, arena in enumerate(req["outputs"])]
        self.sync()
        return {"ok": True, "outputs": claims}

    def bench_crosscheck(self, req: dict) -> dict:
        """Per-call time when every call meets new content behind a read flush:
        ([fresh content, flush, call] - [fresh content, flush]) / k. It rewrites the inputs, so it runs
        after the timed graph's outputs were checked."""
        bench = self.benches[req["key"]]
        xs: list[float] = []
        t_end = time.monotonic() + float(req.get("seconds", 1.0))
        while len(xs) < 2 * int(req.get("repeats", 20)) and (
                len(xs) < 2 * timing.MIN_CROSS_PAIRS or time.monotonic() < t_end):
            xs += timing.replays_us(list(bench.cross))
        bench.cross = None
        return {"ok": True, "per_call_us": statistics.median(xs[0::2]) - statistics.median(xs[1::2])}

    def bench_release(self, req: dict) -> dict:
        for key in req.get("keys") or list(self.benches):
            self.benches.pop(key, None)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return {"ok": True}


class NoDescriptorLeft(RuntimeError):
    """The request's buffers did not arrive: this process has no file descriptor left to receive them."""


def _receive(sock: socket.socket, buffers: Mappings) -> tuple[dict | None, NoDescriptorLeft | None]:
    data, fds, flags, _addr = socket.recv_fds(sock, MAX_REQUEST, MAX_FDS)
    if not data:
        for fd in fds:
            os.close(fd)
        return None, None
    req = json.loads(data)
    wanted = len(req.get("arenas", []))
    if flags & socket.MSG_CTRUNC and len(fds) < wanted:
        # The kernel drops the descriptors a process at its RLIMIT_NOFILE cannot take: the submission
        # holds every one it may open. Answered (with this request's nonce) as the submission's error.
        for fd in fds:
            os.close(fd)
        buffers.drop(req.get("drop", []))
        import resource

        limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        return req, NoDescriptorLeft(
            f"the harness could not hand this process its next buffers ({len(fds)} of {wanted} descriptors "
            f"arrived): it holds all {limit} file descriptors it may open (competition.toml [limits.sandbox] "
            "open_files); close the files custom_kernel opens")
    buffers.receive(req.get("arenas", []), fds)
    buffers.drop(req.get("drop", []))
    return req, None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--req-fd", type=int, required=True, help="a SOCK_SEQPACKET unix socket: requests and fds")
    parser.add_argument("--resp-fd", type=int, required=True, help="a pipe: replies, one JSON line each")
    parser.add_argument("--device", required=True)
    args = parser.parse_args()
    requests = socket.socket(fileno=args.req_fd)
    replies = os.fdopen(args.resp_fd, "w", buffering=1)
    worker = Worker(args.device)
    ops = {"load": worker.load, "call": worker.call,
           "bench_prepare": worker.bench_prepare, "bench_capture": worker.bench_capture,
           "bench_measure": worker.bench_measure, "bench_outputs": worker.bench_outputs,
           "bench_crosscheck": worker.bench_crosscheck, "bench_release": worker.bench_release}
    while True:
        nonce = None
        try:
            req, refused = _receive(requests, worker.buffers)
            if req is None or req.get("op") == "exit":
                break
            nonce = req.get("nonce")
            if refused is not None:
                raise refused
            reply = ops[req["op"]](req)
        except BaseException as exc:  # noqa: BLE001 - a bad request or the target's failure: reported, not raised
            reply = _error("runtime_error", exc, worker.path)
        reply["nonce"] = nonce
        replies.write(json.dumps(reply) + "\n")
        replies.flush()
    replies.close()


if __name__ == "__main__":
    main()
