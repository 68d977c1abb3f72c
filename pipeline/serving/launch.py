"""Launching a serving engine from the pin's template: a fresh tree, a sandbox of its own, ready or a clear failure.

The templates are data, sglang_pin/pin.toml `[launch.<name>]` (checked by pipeline/serving/pin.py's
`launch_template`; its TEMPLATE_KEYS say what each key means): the argv and environment, the request
adapter, the GPUs, the readiness path and its timeout, the tokenizer output is counted with, what the
server may read, the warm-up, and how the test-only delay knob slows it. A competitor's patch changes
none of it: the patch only changes the tree the server imports.

One launch (`Server`), as `python -m pipeline serving evaluate` runs one per block of B C C B:
- The tree: a fresh copy of the pinned tree (pin.py `tree_path`, the verified cache, which is never
  written), with the accepted patch applied by `git apply` exactly as the gate checked it
  (`fresh_tree`). The baseline gets a fresh copy too, unpatched, so both sides import the same way.
- How the server imports it: the tree's python/ first on PYTHONPATH (the sglang template's env), over
  the runner's own installation of the pinned sglang and its compiled sglang-kernel. Not an editable
  install into a per-evaluation venv: `pip install -e` runs the tree's build backend and resolves
  dependencies (minutes, and the index on the runner), while the patch can change neither
  (pyproject*.toml, setup.py and setup.cfg are denied by the gate), and the compiled kernels are a
  352 MB wheel already on the node; the path puts exactly the patched sources in front of exactly the
  pinned environment, and the baseline runs the same way from its own unpatched copy.
- The sandbox (pipeline/sandbox/): the server runs as a uid of its own in new pid, mount, IPC and
  network namespaces with [limits.serving]'s rlimits, reading only the Python installation and the
  template's `readable` (the model, the tree); not the dataset, not the checkout, not the runner's keys.
  Its network namespace has its own loopback, brought up (`Sandbox(loopback=True)`), and nothing else:
  the server listens on 127.0.0.1 there and reaches nothing of the host. The client (the replay, the
  health check, GSM8K) runs its event loop in a thread of its own that has setns()'d into that
  namespace (`call`), so only the evaluator's own thread reaches the server. Where namespaces cannot be
  had (not root, a container without CAP_SYS_ADMIN), the Policy's plain fallback runs it in a session of
  its own on the host's loopback, and says so in describe(); an official evaluation refuses that
  (Policy(isolate=True)).
- Ready: GET the template's `ready` path until it answers 200, within min(ready_timeout_s,
  [limits.serving] launch); the launch time (start to ready) is recorded; then the warm-up request,
  within what is left of that limit ("plain": one short forced reply; "suppress_special": transformers
  under continuous batching, where the first request's generation config sets the logits processors of
  every later one, so it suppresses the special tokens the stream would drop, pipeline/serving/engine.py).
- Every client call has a wall clock and watches the server: a server that exits mid-call ends the call
  at once (`ServerDied`), a call past its time is cancelled (`PhaseTimeout`); neither hangs.
- Stop: `stop()` kills the whole sandbox (SIGKILL of its pid 1: every process it started, however
  detached) and returns once nothing of it is left; `Server` is a context manager, so an error or a
  Ctrl-C stops it too. The server's output goes to a pipe whose last 256 KiB are kept (`log_tail`).

The delay knob (tests only; `evaluate --delay-ms-baseline/--delay-ms-candidate`, refused with
--official): "asgi" runs the template's `{python} -m MODULE ...` through this file as a script
(`python launch.py --delay-ms N -m MODULE ...`), which makes uvicorn wrap the ASGI app it serves so that
every chunk of every HTTP response body waits N ms before it is sent: each streamed token of
`transformers serve` or SGLang (both serve with uvicorn) arrives N ms later than it would. A template may
instead name extra arguments holding {delay_ms} (the tests' scripted server has a flag of its own).
This file is then bound into the sandbox, nothing else of the checkout.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time

CLONE_NEWNET = 0x40000000
LOG_KEEP = 256 << 10
HEALTH_POLL_S = 0.25
WATCH_S = 0.1  # how often a client call checks the server and its wall clock
CANCEL_GRACE_S = 10.0  # a cancelled client call gets this long to unwind before it is abandoned
LAUNCH_FILE = os.path.abspath(__file__)
REPLICAS_FILE = os.path.join(os.path.dirname(LAUNCH_FILE), "replicas.py")  # a data-parallel template's router


# ---- the delay knob's wrapper: this file run as a script inside the sandbox (stdlib + uvicorn only) ----

class _SlowedApp:
    """An ASGI app whose every non-empty HTTP response body chunk waits `delay_s` before it is sent."""

    def __init__(self, app, delay_s: float):
        self.app, self.delay_s = app, delay_s

    async def __call__(self, scope, receive, send):
        if scope.get("type") != "http":
            return await self.app(scope, receive, send)

        async def delayed(message):
            if message.get("type") == "http.response.body" and message.get("body"):
                await asyncio.sleep(self.delay_s)
            await send(message)

        return await self.app(scope, receive, delayed)


def _slowed_main(argv: list[str]) -> None:
    """`launch.py --delay-ms N -m MODULE ARGS...`: run MODULE as `python -m` would, its uvicorn app slowed."""
    import runpy

    if len(argv) < 4 or argv[0] != "--delay-ms" or argv[2] != "-m":
        sys.exit("usage: launch.py --delay-ms N -m MODULE [ARGS...]")
    delay_s = float(argv[1]) / 1000
    # sys.path[0] is this file's folder (pipeline/serving/ where the sandbox is plain): its module names
    # (tokenizer, dataset, metrics, ...) must not shadow the server's imports
    here = os.path.dirname(LAUNCH_FILE)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    import uvicorn.config

    original = uvicorn.config.Config.load

    def load(self):
        original(self)
        self.loaded_app = _SlowedApp(self.loaded_app, delay_s)

    uvicorn.config.Config.load = load
    sys.argv = [argv[3], *argv[4:]]
    runpy.run_module(argv[3], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    _slowed_main(sys.argv[1:])
    sys.exit(0)


# ---- the evaluator's side ----

import ctypes  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import socket  # noqa: E402
import threading  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import TYPE_CHECKING, Any, Awaitable, Callable  # noqa: E402

if TYPE_CHECKING:  # pragma: no cover
    from pipeline.sandbox import Limits, Policy
    from pipeline.serving.pin import LaunchTemplate, Pin


class LaunchError(RuntimeError):
    """The server could not be started or readied (the message says what and what to do)."""


class TreeError(RuntimeError):
    """A fresh tree could not be made (the cache, the copy, the apply): the node's fault, not the patch's."""


class ServerDied(RuntimeError):
    """The server exited while a client call ran (or before it began)."""

    def __init__(self, message: str, code: int | None):
        super().__init__(message)
        self.code = code


class PhaseTimeout(RuntimeError):
    """A client call ran past its wall clock and was cancelled."""

    def __init__(self, message: str, seconds: float):
        super().__init__(message)
        self.seconds = seconds


# ---- [limits.serving] ----

# key: (kind, built-in value): sandbox.load_limits reads it strictly (every key, nothing else)
SERVING_LIMITS = {
    "cpu_seconds": ("count", 172800), "memory": ("bytes", 64 << 30), "processes": ("count", 16384),
    "file_size": ("bytes", 64 << 30), "open_files": ("count", 65536), "core": ("bytes", 0),
    "scratch": ("bytes", 32 << 30), "shm": ("bytes", 64 << 30),
    "launch": ("seconds", 1800), "level_extra": ("seconds", 300), "gsm8k": ("seconds", 3600),
}
_SANDBOX_FIELDS = {"cpu_seconds": "cpu_seconds", "memory": "cpu_memory", "processes": "processes",
                   "file_size": "file_size", "open_files": "open_files", "core": "core", "scratch": "scratch_bytes",
                   "shm": "shm_bytes"}


@dataclass(frozen=True)
class ServingLimits:
    """competition.toml [limits.serving]: the server's rlimits and the wall clock of each phase."""

    sandbox: "Limits"
    launch_s: float
    level_extra_s: float
    gsm8k_s: float


def serving_limits(path: Path | None = None) -> ServingLimits:
    """[limits.serving], checked (sandbox.LimitsError names the key to fix)."""
    from pipeline import sandbox

    got = sandbox.load_limits("serving", SERVING_LIMITS, path)
    return ServingLimits(sandbox=sandbox.Limits(**{f: got[k] for k, f in _SANDBOX_FIELDS.items()}),
                         launch_s=float(got["launch"]), level_extra_s=float(got["level_extra"]),
                         gsm8k_s=float(got["gsm8k"]))


# ---- the template, filled in ----

def resolve_device(template: "LaunchTemplate") -> str:
    if template.device == "auto":
        return "cuda" if os.path.exists("/dev/nvidiactl") else "cpu"
    return template.device


def resolve_model(template: "LaunchTemplate", environ: dict[str, str] | None = None) -> str | None:
    """The served model's path from the runner's environment ($<model_env>); None when the template needs
    none. LaunchError when it needs one that is not there."""
    environ = os.environ if environ is None else environ
    if not template.needs_model:
        return None
    value = environ.get(template.model_env or "")
    if not value:
        raise LaunchError(f"the launch template {template.name!r} serves the model at ${template.model_env}, which is "
                          "not set: export it to the model's directory on this machine (docs/RUNBOOK.md)")
    if not os.path.exists(value):
        raise LaunchError(f"${template.model_env} is {value}, which does not exist on this machine")
    return os.path.abspath(value)


def unreadable_by_others(paths: list[str], limit: int = 5) -> list[str]:
    """Files and folders under `paths` that a uid of its own cannot read (or folders it cannot enter): the
    isolated server runs as one, and a 0600 weights file would fail it deep inside its loader."""
    import stat

    bad: list[str] = []

    def check(p: str, st: os.stat_result) -> None:
        need = stat.S_IROTH | (stat.S_IXOTH if stat.S_ISDIR(st.st_mode) else 0)
        if st.st_mode & need != need:
            bad.append(p)

    for root in paths:
        if not os.path.exists(root):
            continue
        check(root, os.stat(root))
        if os.path.isdir(root):
            for folder, dirs, files in os.walk(root):
                for name in dirs + files:
                    full = os.path.join(folder, name)
                    try:
                        check(full, os.stat(full))
                    except OSError:
                        continue
                    if len(bad) >= limit:
                        return bad
    return bad


def fill(value: str, values: dict[str, str]) -> str:
    """{name} -> values[name] for the names given; every other brace is left as it is ({scratch} is the
    sandbox's, and JSON in an argument is not a placeholder)."""
    return re.sub(r"\{([A-Za-z_][A-Za-z0-9_]*)\}", lambda m: values.get(m.group(1), m.group(0)), value)


@dataclass(frozen=True)
class Command:
    """A template filled in for one launch: what the sandbox runs, with what, reading what."""

    argv: list[str]
    env: dict[str, str]
    readable: list[str]
    device: str
    port: int


def base_env() -> dict[str, str]:
    from pipeline.sandbox import SCRATCH_TOKEN

    return {"PATH": os.environ.get("PATH", os.defpath), "HOME": SCRATCH_TOKEN, "TMPDIR": SCRATCH_TOKEN,
            "XDG_CACHE_HOME": f"{SCRATCH_TOKEN}/cache", "HF_HOME": f"{SCRATCH_TOKEN}/huggingface",
            # the sandbox's uid has no passwd entry: getpass.getuser() (torch inductor's cache path, on a GPU)
            # raises KeyError unless the environment names a user; the compilers' caches go to the scratch
            "USER": "muse-server", "LOGNAME": "muse-server",
            "TORCHINDUCTOR_CACHE_DIR": f"{SCRATCH_TOKEN}/inductor-cache",
            "TRITON_CACHE_DIR": f"{SCRATCH_TOKEN}/triton-cache", "CUDA_CACHE_PATH": f"{SCRATCH_TOKEN}/cuda-cache",
            # NVLink multicast off in every launched engine (it can take a shared node's GPUs out of service)
            "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
            "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1", "LANG": "C.UTF-8"}


def render(template: "LaunchTemplate", *, tree: Path, model: str | None, port: int, delay_ms: float = 0,
           environ: dict[str, str] | None = None) -> Command:
    """The template for this launch: placeholders filled, the delay knob applied, the environment built."""
    environ = os.environ if environ is None else environ
    device = resolve_device(template)
    values = {"python": sys.executable, "port": str(port), "gpus": str(template.gpus), "tree": str(tree),
              "device": device}
    if template.data_parallel:  # each replica's {port} is filled by replicas.py, one free port each
        del values["port"]
    if model is not None:
        values["model"] = model
    if template.context_length is not None:
        values["context_length"] = str(template.context_length)
    argv = [fill(a, values) for a in template.argv]
    readable = [fill(r, values) for r in template.readable]
    if delay_ms:
        if template.slowdown is None:
            raise LaunchError(f"the launch template {template.name!r} has no `slowdown`: the delay knob cannot slow it")
        if template.slowdown == "asgi":
            argv = [argv[0], LAUNCH_FILE, "--delay-ms", f"{delay_ms:g}", *argv[1:]]
            readable.append(LAUNCH_FILE)
        else:
            argv += [fill(a, {**values, "delay_ms": f"{delay_ms:g}"}) for a in template.slowdown]
    if template.data_parallel:
        argv = [sys.executable, REPLICAS_FILE, "--replicas", str(template.gpus), "--port", str(port), "--ready",
                template.ready, "--device", device, "--", *argv]
        readable.append(REPLICAS_FILE)
    env = base_env()
    for name in template.passthrough:
        if name in environ:
            env[name] = environ[name]
    env.update({k: fill(v, values) for k, v in template.env.items()})
    return Command(argv=argv, env=env, readable=readable, device=device, port=port)


def counting_tokenizer(template: "LaunchTemplate", model: str | None):
    """(tokenizer, facts) that output tokens are counted with: the pinned one or the template's file."""
    from pipeline.serving import replay

    if template.tokenizer == "pinned":
        return replay._load_tokenizer(None)
    return replay._load_tokenizer(Path(fill(template.tokenizer, {"model": model or ""})))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- a fresh tree ----

def fresh_tree(pin: "Pin", into: Path, patch: bytes | None = None) -> Path:
    """A copy of the pinned tree at `into`/tree (git layout), with `patch` applied when given. The cache is
    only read. TreeError when it cannot be made."""
    from pipeline.serving import gate
    from pipeline.serving.pin import MARKER, PinError, tree_path

    try:
        source = tree_path(pin, log=lambda m: print(f"[serving] {m}", file=sys.stderr))
    except PinError as exc:
        raise TreeError(f"the pinned SGLang tree is not available: {exc}") from None
    dest = Path(into) / "tree"
    try:
        shutil.copytree(source, dest, symlinks=True, ignore=lambda d, names: [MARKER] if Path(d) == source else [])
    except (OSError, shutil.Error) as exc:
        raise TreeError(f"copying the pinned tree {source} to {dest} failed: {exc}") from None
    # The isolated server runs as a uid of its own, so the tree must be readable by any user: the extracted
    # members are (tarfile's data filter keeps 0644 and 0755), the cache's root is a mkdtemp folder (0700,
    # which copytree copies), and what the patch creates follows the umask, hence 022 around the apply.
    os.chmod(dest, 0o755)
    if patch is not None:
        umask = os.umask(0o022)
        try:
            done = gate.git_apply(dest, patch)
        except gate.GateUnavailable as exc:
            raise TreeError(str(exc)) from None
        finally:
            os.umask(umask)
        if done.returncode != 0:
            tail = (done.stderr or b"").decode("utf-8", "replace").strip()[-2000:]
            raise TreeError(f"the patch the gate accepted did not apply to a fresh copy of the pinned tree: {tail}")
    return dest


# ---- a client call inside the server's network namespace ----

def _setns(fd: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns into the server's network namespace: {os.strerror(err)}")


class Server:
    """One launched engine (see the module's docstring): start(), wait_ready(), call(...), stop()."""

    def __init__(self, template: "LaunchTemplate", *, tree: Path, model: str | None, policy: "Policy",
                 limits: ServingLimits, delay_ms: float = 0, label: str = "server",
                 environ: dict[str, str] | None = None):
        self.template, self.tree, self.model, self.policy, self.limits = template, Path(tree), model, policy, limits
        self.delay_ms, self.label = delay_ms, label
        self.environ = os.environ if environ is None else environ
        self.box = None
        self._tail = None
        self._netns_fd: int | None = None
        self.command: Command | None = None
        self.launch_s: float | None = None
        self.warmup_s: float | None = None
        self.killed = 0
        self._started = 0.0

    # -- lifecycle --

    def start(self) -> "Server":
        from pipeline import sandbox

        self.command = render(self.template, tree=self.tree, model=self.model, port=free_port(),
                              delay_ms=self.delay_ms, environ=self.environ)
        r, w = os.pipe()
        self._started = time.monotonic()
        try:
            self.box = sandbox.Sandbox(self.command.argv, policy=self.policy, readable=self.command.readable,
                                       env=self.command.env, stdout=w, stderr=w, device=self.command.device,
                                       loopback=True)
        except (sandbox.SandboxError, OSError) as exc:
            os.close(r)
            raise LaunchError(f"the {self.label} server could not be started: {exc}") from None
        finally:
            os.close(w)
        self._tail = sandbox.OutputTail(r, keep=LOG_KEEP)
        if self.box.net_namespace is not None:
            try:
                # held from here on: the namespace outlives a server that dies, so a call can still say so
                self._netns_fd = os.open(self.box.net_namespace, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                self._netns_fd = None  # it died already; wait_ready says so
        return self

    @property
    def url(self) -> str:
        assert self.command is not None
        return f"http://127.0.0.1:{self.command.port}"

    def alive(self) -> bool:
        return self.box is not None and self.box.poll() is None

    def exit_code(self) -> int | None:
        return None if self.box is None else self.box.poll()

    def log_tail(self, limit: int = 6000) -> str:
        return self._tail.text(limit) if self._tail is not None else ""

    def describe(self) -> dict[str, Any]:
        return self.box.describe() if self.box is not None else {}

    def stop(self) -> None:
        """Kill the server and everything it started; returns once nothing of it is left."""
        if self.box is not None:
            try:
                self.killed = self.box.kill()
            finally:
                self.box.close()
        if self._netns_fd is not None:
            os.close(self._netns_fd)
            self._netns_fd = None

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- readiness --

    def wait_ready(self) -> float:
        """Wait for the readiness path to answer 200, then send the warm-up; returns the launch time (s)."""
        limit = min(self.template.ready_timeout_s, self.limits.launch_s)
        left = limit - (time.monotonic() - self._started)
        self.call(self._poll_ready, timeout_s=max(left, 0.001), what="the launch (waiting for "
                  f"GET {self.template.ready} to answer 200)", limit=limit)
        self.launch_s = time.monotonic() - self._started
        if self.template.warmup:
            t0 = time.monotonic()
            left = limit - (time.monotonic() - self._started)
            self.call(self._warm_up, timeout_s=max(left, 0.001), what="the launch's warm-up request", limit=limit)
            self.warmup_s = time.monotonic() - t0
        return self.launch_s

    async def _poll_ready(self) -> None:
        import aiohttp

        timeout = aiohttp.ClientTimeout(total=10)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                try:
                    async with session.get(self.url + self.template.ready) as resp:
                        await resp.read()
                        if resp.status == 200:
                            return
                except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
                    pass
                await asyncio.sleep(HEALTH_POLL_S)

    def _warmup_body(self) -> dict[str, Any]:
        import json

        from pipeline.serving import engine

        messages = [{"role": "user", "content": "Say hello."}]
        if self.template.warmup == "suppress_special":
            tok, _ = counting_tokenizer(self.template, self.model)
            special = sorted(i for i, t in tok.get_added_tokens_decoder().items() if t.special)
            return {"messages": messages, "stream": False,
                    "generation_config": json.dumps({"max_new_tokens": 2, "do_sample": False,
                                                     "suppress_tokens": special}, sort_keys=True)}
        return engine.adapter(self.template.engine).body(messages, 2, 0)

    async def _warm_up(self) -> None:
        import aiohttp

        from pipeline.serving import engine

        body = self._warmup_body()
        async with aiohttp.ClientSession() as session:
            async with session.post(self.url + engine.CHAT_PATH, json=body) as resp:
                text = await resp.text()
                if resp.status != 200:
                    raise LaunchError(f"the {self.label} server answered its warm-up request with HTTP {resp.status}: "
                                      f"{text[:500]}")

    # -- client calls --

    def call(self, factory: Callable[[], Awaitable[Any]], *, timeout_s: float, what: str,
             limit: float | None = None) -> Any:
        """Run the coroutine `factory()` in a thread inside the server's network namespace (the host's when
        the sandbox is plain) and return its result. Watched from here: the server exiting ends it with
        ServerDied, `timeout_s` passing with PhaseTimeout; either way the coroutine is cancelled first.
        An exception of the coroutine is raised here; so is a KeyboardInterrupt, after the cancel."""
        if self.box is None:
            raise ServerDied(f"the {self.label} server was never started", None)
        holder: dict[str, Any] = {}
        ready = threading.Event()
        netns = self._netns_fd

        async def main():
            holder["loop"], holder["task"] = asyncio.get_running_loop(), asyncio.current_task()
            ready.set()
            return await factory()

        def target():
            try:
                if netns is not None:
                    _setns(netns)
                holder["result"] = asyncio.run(main())
            except BaseException as exc:  # noqa: BLE001 - handed to the calling thread
                holder["error"] = exc
            finally:
                ready.set()

        thread = threading.Thread(target=target, name=f"serving-client-{self.label}", daemon=True)
        deadline = time.monotonic() + timeout_s
        thread.start()

        def cancel() -> None:
            ready.wait(CANCEL_GRACE_S)
            loop, task = holder.get("loop"), holder.get("task")
            if loop is not None and task is not None:
                try:
                    loop.call_soon_threadsafe(task.cancel)
                except RuntimeError:
                    pass  # the loop closed meanwhile: the call is over
            thread.join(CANCEL_GRACE_S)

        try:
            while thread.is_alive():
                thread.join(WATCH_S)
                if not thread.is_alive():
                    break
                code = self.box.poll()
                if code is not None:
                    cancel()
                    raise ServerDied(f"the {self.label} server exited with {_describe_exit(code)} during {what}", code)
                if time.monotonic() > deadline:
                    cancel()
                    shown = limit if limit is not None else timeout_s
                    raise PhaseTimeout(f"{what} took more than {shown:g} s (competition.toml [limits.serving])", shown)
        except BaseException:
            if thread.is_alive():
                cancel()
            raise
        if "error" in holder:
            error = holder["error"]
            # a client error (the replay's "cannot be reached", a broken warm-up) from a server that is gone
            # is the server's death, said as such
            code = self.box.wait(0.5)
            if code is not None and not isinstance(error, KeyboardInterrupt):
                raise ServerDied(f"the {self.label} server exited with {_describe_exit(code)} during {what}", code)
            if isinstance(error, asyncio.CancelledError):
                raise ServerDied(f"the {self.label} server's call was cancelled during {what}", self.box.poll())
            raise error
        return holder.get("result")


GPU_CLEAR_S = 30.0  # how long a stopped server's GPU contexts may take to go (the driver frees them after the exit)


def gpu_leftovers(reader, ignore: set[int] = frozenset(), timeout_s: float | None = None,
                  poll_s: float = 0.5) -> list[dict[str, Any]]:
    """After a stop: the compute processes still on any GPU (NVML's view through runner._reader(): every
    GPU of the node, not only the template's), polled until none is left or `timeout_s` passes. Each
    left: {"gpu": index, "uuid", "pid", "used_bytes"}; [] when every GPU is clear. A GPU whose processes
    NVML cannot list counts as not clear (pid None): what cannot be checked is not called clean."""
    deadline = time.monotonic() + (GPU_CLEAR_S if timeout_s is None else timeout_s)
    while True:
        left = []
        for dev in reader.devices():
            procs = dev.get("processes")
            if procs is None:
                left.append({"gpu": dev.get("nvml_index"), "uuid": dev.get("uuid"), "pid": None, "used_bytes": None})
                continue
            left += [{"gpu": dev.get("nvml_index"), "uuid": dev.get("uuid"), **p} for p in procs if p["pid"] not in ignore]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(poll_s)


def _describe_exit(code: int) -> str:
    if code < 0:
        import signal

        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"
