"""The walls around a submission's process (github-flow.md, "The sandbox on the runner").

Applied between fork and exec of the child, in this order:
1. resource limits: no core dumps, bounded file size, open files, processes and CPU time;
2. a fresh network namespace (only an unconfigured loopback inside) when the parent may create one
   (root, or CAP_SYS_ADMIN): a submission cannot reach the network or the runner's local services;
3. an unprivileged user (`$PIPELINE_SANDBOX_USER`, set on the runner host), so the host's secrets (the
   result-signing key, the seed secret, the runner's token) are unreadable by file permissions.
The environment is rebuilt from an allow-list and no file descriptor is inherited beyond the two
protocol pipes (evaluate.Child). What a submission prints is drained by the parent into a bounded
tail, so flooding its output costs nothing. On a runner with a container engine the same command
runs inside a digest-pinned image with `--network none --read-only --cap-drop ALL` (docs/RUNBOOK.md).
"""

from __future__ import annotations

import ctypes
import os
import pwd
import resource
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path

USER_ENV = "PIPELINE_SANDBOX_USER"
CLONE_NEWNET = 0x40000000


@dataclass(frozen=True)
class Limits:
    file_size: int = 16 << 30  # output bundles of the layer problems reach a few GB
    open_files: int = 4096
    processes: int = 512  # per sandbox user; a fork bomb stops here (not enforced for root)
    cpu_seconds: int = 3600  # CPU time over all threads; the wall-clock limits are the parent's
    core: int = 0
    # Data segment + private mappings. Only without a GPU: CUDA maps address space far beyond what it
    # uses, so on the runner memory is bounded by the job's cgroup (docs/RUNBOOK.md) instead.
    cpu_memory: int = 8 << 30


@dataclass
class Policy:
    user: str | None = None  # None: keep the parent's user (a developer's laptop, CI)
    network: bool = False  # True: leave the network reachable (only when no namespace can be made)
    limits: Limits = field(default_factory=Limits)

    @classmethod
    def from_environment(cls) -> "Policy":
        return cls(user=os.environ.get(USER_ENV) or None)

    def describe(self) -> dict:
        return {"user": self.user or "(the evaluator's)", "network_namespace": can_unshare_network(),
                "limits": self.limits.__dict__}


_NETNS_PROBE: bool | None = None


def can_unshare_network() -> bool:
    """Whether this process may give a child its own network namespace (probed once, in a child)."""
    global _NETNS_PROBE
    if _NETNS_PROBE is None:
        try:
            probe = subprocess.run(["true"], preexec_fn=_unshare_network, timeout=10,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            _NETNS_PROBE = probe.returncode == 0
        except (OSError, subprocess.SubprocessError):
            _NETNS_PROBE = False
    return _NETNS_PROBE


def _unshare_network() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNET) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNET) failed")


def prepare_scratch(scratch: Path, policy: Policy) -> None:
    """The scratch folder is the one place the child may write: hand it to the sandbox user."""
    if policy.user:
        pw = pwd.getpwnam(policy.user)
        os.chown(scratch, pw.pw_uid, pw.pw_gid)
        os.chmod(scratch, 0o700)


def preexec(policy: Policy, device: str = "cpu"):
    """The function Popen runs in the child between fork and exec."""
    limits = policy.limits
    memory = limits.cpu_memory if device == "cpu" else None
    netns = not policy.network and can_unshare_network()
    pw = pwd.getpwnam(policy.user) if policy.user else None

    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_CORE, (limits.core, limits.core))
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_size, limits.file_size))
        resource.setrlimit(resource.RLIMIT_NOFILE, (limits.open_files, limits.open_files))
        resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_seconds, limits.cpu_seconds))
        if memory:
            resource.setrlimit(resource.RLIMIT_DATA, (memory, memory))
        if netns:
            _unshare_network()
        if pw is not None:
            resource.setrlimit(resource.RLIMIT_NPROC, (limits.processes, limits.processes))
            os.setgroups([])
            os.setgid(pw.pw_gid)
            os.setuid(pw.pw_uid)

    return apply


PR_SET_CHILD_SUBREAPER = 36
_SUBREAPER = False


def become_subreaper() -> bool:
    """Make the evaluator adopt every orphaned descendant, so a process a submission detaches into a
    new session (outside the killed process group) still ends up in `reap_strays`."""
    global _SUBREAPER
    if not _SUBREAPER:
        try:
            _SUBREAPER = ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
        except (OSError, AttributeError):
            _SUBREAPER = False
    return _SUBREAPER


def children() -> set[int]:
    me = os.getpid()
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # the command name is in parentheses and may hold spaces: the ppid is the 2nd field after it
        fields = stat.rsplit(")", 1)[-1].split()
        if len(fields) > 1 and int(fields[1]) == me:
            found.add(int(entry))
    return found


LIVE_WORKERS: set[int] = set()  # workers of evaluations still running in this process: never strays


def reap_strays(keep: set[int], rounds: int = 20) -> int:
    """Kill and reap every child of the evaluator that it did not start itself (adopted orphans).

    Children that existed before the evaluation (`keep`) and the workers of other evaluations running in
    this process are spared; anything else this process starts while an evaluation runs would not be,
    so the runner evaluates in a process of its own (the `evaluate` verb)."""
    import signal
    import time

    killed = 0
    for _ in range(rounds):
        strays = children() - keep - LIVE_WORKERS
        if not strays:
            break
        for pid in strays:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
        for pid in strays:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
        time.sleep(0.05)  # their own children are re-parented to us in the meantime
    return killed


class OutputTail:
    """Drains a pipe in a thread and keeps only its last `keep` bytes: a submission that floods its
    output fills nothing on disk and never blocks on a full pipe."""

    def __init__(self, fd: int, keep: int = 64 << 10):
        self._fd = fd
        self._keep = keep
        self._buf = bytearray()
        self.total = 0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._drain, daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        while True:
            try:
                chunk = os.read(self._fd, 1 << 16)
            except OSError:
                break
            if not chunk:
                break
            with self._lock:
                self.total += len(chunk)
                self._buf += chunk
                if len(self._buf) > 2 * self._keep:
                    del self._buf[: len(self._buf) - self._keep]
        os.close(self._fd)

    def text(self, limit: int) -> str:
        self._thread.join(timeout=0.5)
        with self._lock:
            data = bytes(self._buf[-limit:])
            dropped = self.total - len(data)
        head = f"[{dropped:,} earlier bytes of output not kept]\n" if dropped > 0 else ""
        return head + data.decode("utf-8", errors="replace")
