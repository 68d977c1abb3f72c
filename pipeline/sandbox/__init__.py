"""The trust boundary (kernel-track.md "The trust boundary", github-flow.md "The sandbox on the runner"):
run a stranger's command so that it can reach nothing that judges it.

As root, where the kernel lets us, a `Sandbox` runs its command
- as a uid and gid of its own, picked at random for this sandbox in a high range and checked free (in no
  passwd or group entry, no subordinate-id range, no running process); no supplementary groups,
  no_new_privs, every capability set (bounding, inheritable, ambient included) empty, and a seccomp
  filter that refuses new user namespaces (inside one an unprivileged process regains capabilities over
  network and mount namespaces of its own: the usual door to a kernel privilege escalation).
  RLIMIT_NPROC then bounds what this sandbox alone can fork, since nothing else ever runs as that uid;
- in new PID, network, IPC and mount namespaces. Every descendant dies with the namespace's pid 1 however
  deep or detached, and `kill()` returns only once the host's /proc shows nothing left in that pid
  namespace. The network is one loopback, left down: nothing, not even the host's 127.0.0.1 or its
  abstract unix sockets, is reachable. `loopback=True` brings that loopback up (and nothing else): a
  server inside can listen on its own 127.0.0.1, which only a client that enters the namespace
  (`net_namespace`, setns) reaches; the host's loopback stays as unreachable as before;
- in a root assembled from read-only bind mounts of exactly what it needs, each at its own absolute path
  (`plan()` below): /usr, /etc, /bin, /sbin, /lib* (directories or links, as the host has them), /sys, the
  Python installation (sys.base_prefix, sys.prefix, the real sys.executable, every existing directory on
  the parent's sys.path except the parent's working directory, which is the checkout, and what lies in
  it), the directories of LD_LIBRARY_PATH, CUDA_HOME and CUDA_PATH in the command's environment, and the
  caller's `readable` files and folders. Nothing else of the host exists inside: not /root (beyond the
  Python installed there), /home, /run, /var, /opt, the rest of the checkout, result folders or keys.
  /proc is a fresh procfs of the new pid namespace (hidepid=invisible: the sandbox sees its own
  processes only), /dev holds null, zero, full, random, urandom, tty and for device='cuda' the
  driver's nodes (nvidiactl, nvidia-uvm*, nvidia-modeset, nvidia-caps) and the node of each GPU the
  command's CUDA_VISIBLE_DEVICES names (plan.visible_gpu_minors; every GPU's where none is named for
  certain, with a warning), /dev/shm is a fresh tmpfs (Limits.shm_bytes), and /tmp is the
  scratch: a fresh tmpfs of Limits.scratch_bytes owned by the sandbox's uid, the one place it can write
  (with /dev/shm). The host's tree is unreachable: the root is switched with pivot_root and the old one
  detached, and no capability is left to mount, chroot or ptrace anything;
- with resource limits (Limits): no core files, file size, open files, processes (threads, really),
  CPU seconds (SIGXCPU at the limit, SIGKILL a second later), and data size for device='cpu' only (CUDA
  reserves address space far beyond what it uses; the runner's cgroup bounds a GPU job's memory);
- with only the environment the caller passes, stdin on /dev/null, stdout and stderr on the caller's fds,
  and the caller's `pass_fds` at the same numbers; nothing else.

Where that cannot be had (not root, not Linux, namespaces or mounts refused: a laptop, a container
without CAP_SYS_ADMIN), `Policy.isolate` decides: None runs the command plainly (rlimits, a new session,
this process made a child subreaper and every stray descendant killed by `kill()`, scratch a new
temporary folder) and says why in `describe()`; True raises SandboxUnavailable naming why; False never
isolates. An official evaluation must refuse a result whose describe() says "none".

How it runs: the parent starts `python -I -S -c BOOT <fd>` (the *launcher*, stdlib only), handing it
inside.py (compiled once per parent process) and the plan in a memfd. The launcher
unshares the pid, network and IPC namespaces and forks pid 1 (the *init*), which unshares the mount
namespace, assembles the root, mounts /proc, pivots, then forks the command: that child sets the rlimits,
drops to the uid and execs. The init reaps orphans; when the command ends it hands the command's wait
status to the launcher and exits, and its exit makes the kernel kill and reap everything else in the
namespace. The launcher then exits the way the command did (the same exit code, or killed by the same
signal), so `returncode` reads like Popen's. A SIGKILL of the launcher kills the init (PR_SET_PDEATHSIG),
hence the whole namespace; the death of the parent (a lifeline pipe only the parent holds) makes the
launcher kill the init, so nothing outlives an evaluator that crashed or was cancelled.

Interface (what the evaluator calls):

    Limits(file_size=16 GiB, open_files=4096, processes=512, cpu_seconds=3600, core=0,
           cpu_memory=8 GiB, scratch_bytes=16 GiB, shm_bytes=256 MiB)       # frozen dataclass
        its defaults are competition.toml's [limits.sandbox] (load_limits; these values where the
        package runs without the file)
    Policy(isolate: bool | None = None, limits: Limits = Limits())
    availability() -> tuple[bool, str | None]     # can this process isolate; why not (probed once)
    SandboxUnavailable(RuntimeError)              # isolate=True where isolation cannot be had
    SandboxError(RuntimeError)                    # this sandbox could not be set up (a bad path, ...)
    Sandbox(argv, *, policy, readable, env, pass_fds=(), stdout=None, stderr=None,
            device="cpu", cwd_scratch=True, hidden=(), scratch_base=None, loopback=False)  # starts it
        argv and env values may hold SCRATCH_TOKEN ("{scratch}"): replaced by the scratch's path, which
        is /tmp when isolated and a new folder in `scratch_base` (default: $TMPDIR) when plain.
        `hidden`: paths inside a bound tree to cover with an empty read-only folder (or /dev/null).
        .scratch: Path        the writable folder as the command sees it (/tmp when isolated)
        .host_scratch: Path   the same folder as this process reaches it: /proc/<init>/root/tmp while
                              the sandbox lives (the tmpfs ends with the namespace: read results
                              before the command exits). The command owns the folder: open what is
                              there with O_NOFOLLOW, a link it planted resolves against the HOST's root
        .pid: int             host pid of the top process (the launcher; the command itself when plain)
        .uid, .gid: int|None  the sandbox's own ids (None when plain)
        .init_pid: int|None   host pid of the sandbox's pid 1
        .net_namespace: str|None   /proc/<init>/ns/net while it lives (None when plain): what a client
                              setns()es into to reach a server listening on the sandbox's loopback
        .isolated: bool; .reason: str|None (why not)
        .poll() -> int|None; .wait(timeout=None) -> int|None   Popen-like returncode, None on timeout
        .kill() -> int        SIGKILL everything; returns once nothing of it is left (SandboxError if
                              something still is after 10 s); the number of processes killed beyond
                              the command itself (and the init)
        .close()              kill(), then remove the plain mode's scratch folder
        .processes() -> list[int]   host pids of what is alive in the sandbox now
        .describe() -> dict   {"isolation": "namespaces"|"none", "uid", "gid", "reason", "limits",
                               "namespaces", "seccomp", "scratch", "readable", "warnings"}
        context manager: close() on exit. Any thread may start a sandbox (no PR_SET_PDEATHSIG on it).
    OutputTail(fd, keep=64 KiB)   drains a pipe in a thread, keeps its last bytes (.text(limit), .total)
    plan(readable, env, device, hidden=(), cwd=None) -> dict   what would be bound where (for review)

`python -m pipeline sandbox-check [--device cuda]` runs a live probe of all of this and prints one line
per check.

Descriptors given to the command (`stdout`, `stderr`, `pass_fds`) may be copied by its descendants; when
isolated they all close once the namespace is empty, i.e. no later than `wait()` or `kill()` return.

The package, each file for what it decides: this file (the Sandbox, its uid, whether this process can
isolate, the plain fallback), inside.py (the launcher and init: namespaces, mounts, seccomp, the drop to the
uid), plan.py (what is bound where), limits.py (the limits as data, the rlimits, the memory cgroup),
check.py (`sandbox-check`).
"""

from __future__ import annotations

import os
import sys
import ctypes
import errno
import grp
import marshal
import pwd
import secrets
import select
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from pipeline.sandbox.inside import PR_SET_CHILD_SUBREAPER, SCRATCH, SCRATCH_TOKEN, SECCOMP, set_rlimits
from pipeline.sandbox.limits import (COMPETITION_TOML, SANDBOX_LIMITS, Limits, LimitsError, MemoryGroup,  # noqa: F401
                                     Policy, _applied_limits, _rlimits, load_limits, sandbox_limits)
from pipeline.sandbox.plan import plan

INSIDE_FILE = Path(__file__).resolve().with_name("inside.py")
# The launcher runs inside.py, compiled here once (compiling in every launcher cost 10-25 ms per sandbox).
# Read at import, so a checkout updated meanwhile changes nothing.
_INSIDE_SOURCE = INSIDE_FILE.read_text()
_INSIDE_CODE = None
BOOT = (
    "import marshal, os, sys\n"
    "fd = int(sys.argv[1])\n"
    "data = b''\n"
    "while chunk := os.read(fd, 1 << 20):\n"
    "    data += chunk\n"
    "os.close(fd)\n"
    "code, spec = marshal.loads(data)\n"
    "inside = {'__name__': 'pipeline.sandbox.inside'}\n"
    "exec(code, inside)\n"
    "sys.exit(inside['_launcher_main'](spec))\n"
)


def _inside_code():
    global _INSIDE_CODE
    if _INSIDE_CODE is None:
        _INSIDE_CODE = compile(_INSIDE_SOURCE, str(INSIDE_FILE), "exec")
    return _INSIDE_CODE

# The uid range sandboxes draw from: far above login users (1000+), system users, nobody (65534) and
# the subordinate ranges container tools allot (100000 + 65536 k, usually well below 10^8).
UID_RANGE = (1_000_000_000, 2_000_000_000)
START_TIMEOUT = 60.0


class SandboxUnavailable(RuntimeError):
    """Isolation was required (Policy.isolate=True) and this process cannot have it."""


class SandboxError(RuntimeError):
    """This sandbox could not be set up (the message names the stage: a path, a mount, the uid drop)."""


# ---- the sandbox's uid ----

_CLAIMED: set[int] = set()
_CLAIM_LOCK = threading.Lock()


def _id_ranges_in_use() -> list[tuple[int, int]]:
    ranges = []
    for name in ("/etc/subuid", "/etc/subgid"):
        try:
            for line in Path(name).read_text().splitlines():
                parts = line.strip().split(":")
                if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit():
                    ranges.append((int(parts[1]), int(parts[1]) + int(parts[2])))
        except OSError:
            pass
    return ranges


def _mapped(n: int) -> bool:
    """Whether id `n` exists in this process's user namespace (a container maps only some ids)."""
    for name in ("/proc/self/uid_map", "/proc/self/gid_map"):
        try:
            lines = Path(name).read_text().split("\n")
        except OSError:
            return True
        if not any(len(f := line.split()) == 3 and int(f[0]) <= n < int(f[0]) + int(f[2]) for line in lines):
            return False
    return True


def _ids_of_processes() -> set[int]:
    """Every real, effective, saved and filesystem uid and gid of a running process (raw reads: this runs
    at every start, over every process of the host)."""
    seen: set[int] = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fd = os.open(f"/proc/{entry}/status", os.O_RDONLY)
            try:
                data = os.read(fd, 8192)
            finally:
                os.close(fd)
        except OSError:
            continue
        start = data.find(b"\nUid:")
        for line in data[start:].split(b"\n")[1:3]:  # the Uid: and Gid: lines
            seen.update(int(x) for x in line.split()[1:] if x.isdigit())
    return seen


def _claim_id() -> int:
    """A uid (also the gid) nothing on this host uses: no passwd or group entry, no subordinate range, no
    process, no other sandbox of ours; drawn at random so another evaluator on the host picks another."""
    busy = _ids_of_processes()
    taken = _id_ranges_in_use()
    for _ in range(1000):
        n = UID_RANGE[0] + secrets.randbelow(UID_RANGE[1] - UID_RANGE[0])
        if n in busy or any(lo <= n < hi for lo, hi in taken) or not _mapped(n):
            continue
        try:
            pwd.getpwuid(n)
            continue
        except KeyError:
            pass
        try:
            grp.getgrgid(n)
            continue
        except KeyError:
            pass
        with _CLAIM_LOCK:
            if n in _CLAIMED:
                continue
            _CLAIMED.add(n)
        return n
    raise SandboxError("no free uid found in the sandbox range")


# ---- can we isolate? ----

_AVAILABILITY: tuple[bool, str | None] | None = None
_AVAILABILITY_LOCK = threading.Lock()


def availability() -> tuple[bool, str | None]:
    """(True, None) where this process can isolate a command, else (False, why). Probed once, by starting
    a real sandbox (namespaces, mounts, uid drop, exec), and cached."""
    global _AVAILABILITY
    with _AVAILABILITY_LOCK:
        if _AVAILABILITY is None:
            _AVAILABILITY = _probe()
        return _AVAILABILITY


def _probe() -> tuple[bool, str | None]:
    if not sys.platform.startswith("linux"):
        return False, f"not Linux ({sys.platform}): no namespaces"
    if os.geteuid() != 0:
        return False, (f"not root (euid {os.geteuid()}): a uid of its own and new pid, network and mount "
                       "namespaces need root")
    try:
        sb = Sandbox([sys.executable, "-I", "-S", "-c", ""], policy=Policy(isolate=True), readable=[], env={},
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, _probing=True)
    except (SandboxError, OSError) as exc:
        return False, f"the namespaces could not be set up: {exc}"
    try:
        code = sb.wait(30)
    finally:
        sb.kill()
    if code != 0:
        return False, f"a probe inside the namespaces exited with {code}"
    return True, None


# ---- plain runs: the fallback ----

_SUBREAPER = False
LIVE: set[int] = set()  # top processes of sandboxes still running in this process: never strays


def become_subreaper() -> bool:
    """Make this process adopt every orphaned descendant, so a process a command detached into a new
    session (outside the killed process group) still ends up in `reap_strays`."""
    global _SUBREAPER
    if not _SUBREAPER:
        try:
            _SUBREAPER = ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
        except (OSError, AttributeError):
            _SUBREAPER = False
    return _SUBREAPER


def _stat_fields(pid: int | str) -> list[str] | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name is in parentheses and may hold spaces: the fields after it start at the state
    return stat.rsplit(")", 1)[-1].split()


def children() -> set[int]:
    me = os.getpid()
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat_fields(entry)
            if fields and len(fields) > 1 and int(fields[1]) == me:
                found.add(int(entry))
    return found


def reap_strays(keep: set[int], seconds: float = 10.0) -> int:
    """Kill and reap every child of this process it did not start itself (adopted orphans), round after
    round until none is left: each round's victims hand their own children to us (a chain 33 deep takes
    33 rounds). Children that existed before (`keep`) and live sandboxes are spared."""
    killed = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        strays = children() - keep - LIVE
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
        time.sleep(0.01)  # their own children are re-parented to us in the meantime
    return killed


def _group_members(pgid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat_fields(entry)
            if fields and len(fields) > 2 and int(fields[2]) == pgid:
                out.append(int(entry))
    return out


# ---- the sandbox ----


class Sandbox:
    """One command in its sandbox; started by the constructor. See the module docstring."""

    def __init__(self, argv: list[str], *, policy: Policy, readable: list[Path], env: dict[str, str],
                 pass_fds: tuple[int, ...] = (), stdout: int | None = None, stderr: int | None = None,
                 device: str = "cpu", cwd_scratch: bool = True, hidden: list[Path] = (),
                 scratch_base: Path | None = None, loopback: bool = False, _probing: bool = False):
        argv = [os.fspath(a) for a in argv]
        if not argv:
            raise ValueError("an empty argv")
        for s in argv + [k + v for k, v in env.items()]:
            if "\0" in s:
                raise ValueError("an argument or environment entry holds a NUL byte")
        if any(fd in (0, 1, 2) for fd in pass_fds):
            raise ValueError("pass_fds must not name 0, 1 or 2: give stdout/stderr instead")
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', not {device!r}")
        self.policy = policy
        self.device = device
        self.loopback = loopback
        self.returncode: int | None = None
        self.uid: int | None = None
        self.gid: int | None = None
        self.init_pid: int | None = None
        self._pidfd: int | None = None
        self._lifeline: int | None = None
        self._pidns: str | None = None
        self._plan: dict | None = None
        self._done = False
        self.memory: MemoryGroup | None = None
        self.memory_reason: str | None = None
        self.oom_kills = 0
        if policy.isolate is False:
            ok, why = False, "isolation disabled by policy (isolate=False)"
        elif _probing:
            ok, why = True, None
        else:
            ok, why = availability()
        if not ok and policy.isolate:
            raise SandboxUnavailable(f"isolation required but unavailable: {why}")
        self.isolated = ok
        self.reason = why
        # The scratch must be known before the command starts (it goes into HOME, TMPDIR, argv...): the
        # caller writes SCRATCH_TOKEN where it belongs, in argv or env values, and gets the real path.
        self.scratch = Path(SCRATCH) if ok else Path(tempfile.mkdtemp(prefix="muse-sandbox-", dir=scratch_base))
        argv = [a.replace(SCRATCH_TOKEN, str(self.scratch)) for a in argv]
        env = {k: v.replace(SCRATCH_TOKEN, str(self.scratch)) for k, v in env.items()}
        if ok:
            self._start_isolated(argv, readable, env, tuple(pass_fds), stdout, stderr, cwd_scratch, hidden)
        else:
            self._start_plain(argv, env, tuple(pass_fds), stdout, stderr, cwd_scratch)

    # -- starting --

    def _start_isolated(self, argv, readable, env, pass_fds, stdout, stderr, cwd_scratch, hidden) -> None:
        self._plan = plan(readable, env, self.device, hidden)
        self.uid = self.gid = _claim_id()
        self.memory, self.memory_reason = MemoryGroup.create(self.policy.limits.group_memory)
        spec = {
            "argv": argv, "env": dict(env), "uid": self.uid, "gid": self.gid,
            "pass_fds": list(pass_fds), "ops": [tuple(s) for s in self._plan["steps"]],
            "devices": self._plan["devices"], "rlimits": _rlimits(self.policy.limits, self.device, True),
            "scratch_bytes": self.policy.limits.scratch_bytes, "shm_bytes": self.policy.limits.shm_bytes,
            "cwd": SCRATCH if cwd_scratch else "/", "loopback": self.loopback,
            "cgroup_procs": self.memory.procs if self.memory else None,
        }
        rep_r, rep_w = os.pipe()
        life_r, self._lifeline = os.pipe()  # the write end stays here, in this process only
        spec.update(report_fd=rep_w, lifeline_fd=life_r, parent_pid=os.getpid())
        # The spec travels in a memfd, not argv: the command would read argv in /proc/<launcher>... (it
        # cannot see the launcher, but nothing of the plan needs to be on any command line).
        memfd = os.memfd_create("sandbox-spec")
        try:
            os.write(memfd, marshal.dumps((_inside_code(), spec)))
            os.lseek(memfd, 0, os.SEEK_SET)
            self._proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", BOOT, str(memfd)],
                stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr,
                pass_fds=(memfd, rep_w, life_r, *pass_fds),
                env={}, cwd="/", start_new_session=True, close_fds=True)
        except BaseException:
            os.close(rep_r)
            self._release()
            raise
        finally:
            os.close(memfd)
            os.close(rep_w)
            os.close(life_r)
        self.pid = self._proc.pid
        LIVE.add(self.pid)
        try:
            lines = self._read_report(rep_r)
        finally:
            os.close(rep_r)
        errors = []
        for words in lines:
            if words[0] == "init" and len(words) >= 3:
                self.init_pid, self._pidns = int(words[1]), words[2]
                try:
                    self._pidfd = os.pidfd_open(self.init_pid)
                except OSError:
                    self._pidfd = None  # already gone (a command that exited at once)
            elif words[0] == "error":
                errors.append(words)
        if errors or self.init_pid is None:
            self.kill()
            if not errors:
                raise SandboxError(f"the sandbox's launcher exited with {self.returncode} before starting the command")
            _, stage, num, message = (errors[0] + ["", "", ""])[:4]
            num = int(num) if num.isdigit() else 0
            if stage == "exec" and num in (errno.ENOENT, errno.EACCES, errno.ENOEXEC, errno.ENOTDIR):
                raise OSError(num, f"{message} (inside the sandbox: is it among the readable paths?)", argv[0])
            raise SandboxError(f"sandbox setup failed at {stage}: {message}")

    def _read_report(self, fd: int) -> list[list[str]]:
        """The launcher's, init's and command's lines until the last writer is gone: the command's copy
        closes at its exec, so EOF means it runs (or that everything died)."""
        buf = b""
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.kill()
                raise SandboxError(f"the sandbox did not start within {START_TIMEOUT:.0f} s")
            if not select.select([fd], [], [], left)[0]:
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                break
            buf += chunk
        return [line.split("\t") for line in buf.decode("utf-8", "replace").splitlines() if line]

    def _start_plain(self, argv, env, pass_fds, stdout, stderr, cwd_scratch) -> None:
        become_subreaper()
        self._keep = children()
        limits = _rlimits(self.policy.limits, self.device, own_uid=False)

        def apply() -> None:  # between fork and exec: rlimit calls only
            set_rlimits(limits)

        try:
            self._proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr, pass_fds=pass_fds, env=dict(env),
                cwd=str(self.scratch) if cwd_scratch else "/", start_new_session=True, close_fds=True,
                preexec_fn=apply)
        except BaseException:
            shutil.rmtree(self.scratch, ignore_errors=True)
            raise
        self.pid = self._proc.pid
        LIVE.add(self.pid)

    # -- state --

    @property
    def host_scratch(self) -> Path:
        """The scratch folder as this process reaches it: through the init's root while it lives."""
        if not self.isolated:
            return self.scratch
        if self.init_pid is None:
            raise SandboxError("the sandbox has no init")
        return Path(f"/proc/{self.init_pid}/root") / SCRATCH.lstrip("/")

    @property
    def net_namespace(self) -> str | None:
        """The sandbox's network namespace as a path to open and setns() into; None when plain (the host's)."""
        if not self.isolated or self.init_pid is None:
            return None
        return f"/proc/{self.init_pid}/ns/net"

    def poll(self) -> int | None:
        code = self._proc.poll()
        if code is not None:
            self._finished(code)
        return code

    def wait(self, timeout: float | None = None) -> int | None:
        """The returncode (negative: killed by that signal), or None when `timeout` passed first. When
        isolated, a return means nothing of the sandbox is left (the namespace empties before the
        launcher exits)."""
        try:
            code = self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        self._finished(code)
        return code

    def processes(self) -> list[int]:
        """Host pids of every process of this sandbox alive now (a zombie is not: it holds nothing)."""
        if self.isolated:
            if self._pidns is None:
                return []
            found = []
            for entry in os.listdir("/proc"):
                if entry.isdigit():
                    try:
                        if os.readlink(f"/proc/{entry}/ns/pid") != self._pidns:
                            continue
                    except OSError:
                        continue
                    fields = _stat_fields(entry)
                    if fields and fields[0] != "Z":
                        found.append(int(entry))
            return found
        return [p for p in _group_members(self.pid) if (_stat_fields(p) or ["Z"])[0] != "Z"]

    def _inner_pid(self, host_pid: int) -> int | None:
        try:
            for line in Path(f"/proc/{host_pid}/status").read_text().splitlines():
                if line.startswith("NSpid:"):
                    return int(line.split()[-1])
        except (OSError, ValueError):
            pass
        return None

    def kill(self) -> int:
        """SIGKILL everything of the sandbox; return once nothing of it is left. Returns how many
        processes were killed beyond the command itself (and the sandbox's own pid 1)."""
        if self.isolated:
            return self._kill_isolated()
        return self._kill_plain()

    def _kill_isolated(self) -> int:
        extra = 0
        if self._proc.poll() is None:
            members = self.processes()
            extra = len([p for p in members if self._inner_pid(p) not in (1, 2, None)])
            # Killing pid 1 makes the kernel kill and reap the whole namespace before pid 1 is gone; the
            # pidfd makes sure the signal reaches that process and no other that reused its number.
            try:
                if self._pidfd is not None:
                    signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
                else:
                    self._proc.kill()
            except ProcessLookupError:
                pass
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()  # the init is gone with it (PR_SET_PDEATHSIG)
                self._proc.wait()
        if self._pidfd is not None:
            # A launcher killed by someone else orphans the init; where this process is a subreaper the
            # init's zombie is ours to reap (waitid on the pidfd: that process and no other).
            try:
                os.waitid(os.P_PIDFD, self._pidfd, os.WEXITED | os.WNOHANG)
            except (ChildProcessError, OSError, AttributeError):
                pass
        self._finished(self._proc.returncode)
        deadline = time.monotonic() + 10
        while (left := self.processes()) and time.monotonic() < deadline:
            time.sleep(0.005)
        if left:
            raise SandboxError(f"processes of the sandbox still alive after kill: {left}")
        return extra

    def _kill_plain(self) -> int:
        members = [p for p in _group_members(self.pid) if p != self.pid]
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        LIVE.discard(self.pid)
        strays = reap_strays(self._keep)
        self._finished(self._proc.returncode)
        return len(members) + strays

    def _finished(self, code: int | None) -> None:
        if code is None:
            return
        self.returncode = code
        if self.isolated:
            # The launcher exits only after pid 1, which leaves only after the namespace is empty.
            LIVE.discard(self.pid)
            self._release()

    def _release(self) -> None:
        if self._done:
            return
        self._done = True
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None
        if self._lifeline is not None:
            os.close(self._lifeline)
            self._lifeline = None
        if self.uid is not None:
            with _CLAIM_LOCK:
                _CLAIMED.discard(self.uid)
        if self.memory is not None:
            self.oom_kills = self.memory.oom_kills()
            self.memory.remove()

    def close(self) -> None:
        """kill(), then drop what is left on the host (the plain scratch folder)."""
        self.kill()
        if not self.isolated:
            shutil.rmtree(self.scratch, ignore_errors=True)

    def describe(self) -> dict:
        """The sandbox as the result document records it."""
        limits = _applied_limits(self.policy.limits, self.device, self.isolated)
        if self.memory is not None:
            limits["group_memory"] = self.memory.limit
        if self.isolated:
            return {"isolation": "namespaces", "uid": self.uid, "gid": self.gid, "reason": None,
                    "namespaces": ["pid", "network", "mount", "ipc"], "limits": limits,
                    "network": "own loopback up" if self.loopback else "own loopback down",
                    "seccomp": "no user namespaces, no keyrings" if os.uname().machine in SECCOMP else None,
                    "scratch": str(self.scratch), "readable": self._plan["readable"],
                    "memory_cgroup": f"v{self.memory.version}" if self.memory else None,
                    "warnings": self._plan["warnings"] + ([f"memory not capped in a cgroup: {self.memory_reason}"]
                                                          if self.memory is None else [])}
        return {"isolation": "none", "uid": os.geteuid(), "gid": os.getegid(), "reason": self.reason,
                "namespaces": [], "limits": limits, "network": "the host's", "seccomp": None,
                "scratch": str(self.scratch), "readable": None, "warnings": []}

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---- a bounded tail of what the command prints ----


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
