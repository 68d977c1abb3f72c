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
  processes only), /dev holds null, zero, full, random, urandom, tty and for device='cuda' every
  /dev/nvidia* node and /dev/nvidia-caps, /dev/shm is a fresh tmpfs (Limits.shm_bytes), and /tmp is the
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

How it runs: the parent starts `python -I -S -c BOOT <fd>` (the *launcher*, stdlib only), handing it the
first part of this file (compiled once per parent process) and the plan in a memfd. The launcher
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
"""

from __future__ import annotations

import os
import sys

# ------------------------------------------------------------------------------------------------------
# The inside: launcher, init and the command's last steps before exec. This part runs in the launcher
# (`python -I -S -c BOOT`, see below) and imports only small builtin modules, lazily: every sandbox pays
# for it.
# ------------------------------------------------------------------------------------------------------

CLONE_NEWNS = 0x00020000
CLONE_NEWIPC = 0x08000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID, MOUNT_ATTR_NODEV = 0x1, 0x2, 0x4
AT_FDCWD, AT_RECURSIVE = -100, 0x8000

PR_SET_PDEATHSIG, PR_CAPBSET_DROP = 1, 24
PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 36, 38, 47, 4
LINUX_CAPABILITY_VERSION_3 = 0x20080522

# Syscalls glibc may not wrap (pivot_root, mount_setattr); numbers per architecture.
SYSCALLS = {
    "x86_64": {"pivot_root": 155, "mount_setattr": 442},
    "aarch64": {"pivot_root": 41, "mount_setattr": 442},
}

# A seccomp filter refuses new user namespaces: inside one, an unprivileged process holds every
# capability over its own network and mount namespaces, the door to most kernel privilege escalations.
# clone3 answers ENOSYS (its flags sit in memory a filter cannot read), so libc falls back to clone.
SECCOMP = {  # arch: (AUDIT_ARCH, clone, unshare, clone3)
    "x86_64": (0xC000003E, 56, 272, 435),
    "aarch64": (0xC00000B7, 220, 97, 435),
}
CLONE_NEWUSER = 0x10000000
# It also refuses the kernel's keyrings (add_key, request_key, keyctl): they sit outside every namespace, so a
# key one evaluation leaves in its user's keyring would be there for the next to read.
KEYRING_SYSCALLS = {"x86_64": (248, 249, 250), "aarch64": (217, 218, 219)}

# Bringing the loopback up: SIOCGIFFLAGS / SIOCSIFFLAGS on a struct ifreq (16-byte name, then the flags).
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1

SCRATCH = "/tmp"  # the scratch as the command sees it: /tmp itself, so nothing has to be told twice
SCRATCH_TOKEN = "{scratch}"  # in argv and env values: replaced by the scratch's path before the start
EXIT_SETUP = 125  # the launcher or init failed before the command ran (the report pipe says why)


class _Libc:
    """The few libc calls the sandbox needs, raising OSError with the call named."""

    def __init__(self):
        import ctypes

        self._c = ctypes
        self.lib = ctypes.CDLL(None, use_errno=True)
        machine = os.uname().machine
        self.nr = SYSCALLS.get(machine, {})

    def _check(self, ret: int, what: str) -> int:
        if ret < 0:
            err = self._c.get_errno()
            raise OSError(err, f"{what}: {os.strerror(err)}")
        return ret

    def unshare(self, flags: int) -> None:
        self._check(self.lib.unshare(flags), "unshare")

    def mount(self, source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
        enc = lambda s: None if s is None else os.fsencode(s)  # noqa: E731
        self._check(self.lib.mount(enc(source), enc(target), enc(fstype), self._c.c_ulong(flags), enc(data)),
                    f"mount {source or ''} on {target} ({fstype or 'flags'} {flags:#x} {data or ''})")

    def umount2(self, target: str, flags: int) -> None:
        self._check(self.lib.umount2(os.fsencode(target), flags), f"umount {target}")

    def pivot_root(self, new: str, old: str) -> None:
        if "pivot_root" not in self.nr:
            raise OSError(38, f"pivot_root: no syscall number known for {os.uname().machine}")
        self._check(self.lib.syscall(self.nr["pivot_root"], os.fsencode(new), os.fsencode(old)), "pivot_root")

    def mount_setattr_rdonly(self, target: str, recursive: bool) -> None:
        """Make `target` (and with `recursive`, every mount below it) read-only, nosuid and nodev."""
        c = self._c

        class MountAttr(c.Structure):
            _fields_ = [("attr_set", c.c_uint64), ("attr_clr", c.c_uint64),
                        ("propagation", c.c_uint64), ("userns_fd", c.c_uint64)]

        if "mount_setattr" not in self.nr:
            raise OSError(38, "mount_setattr: unknown syscall number")
        attr = MountAttr(MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV, 0, 0, 0)
        self._check(self.lib.syscall(self.nr["mount_setattr"], c.c_int(AT_FDCWD), os.fsencode(target),
                                     c.c_uint(AT_RECURSIVE if recursive else 0), c.byref(attr),
                                     c.c_size_t(c.sizeof(attr))), f"mount_setattr {target}")

    def prctl(self, option: int, arg: int = 0, arg3: int = 0) -> int:
        c = self._c
        return self._check(self.lib.prctl(option, c.c_ulong(arg), c.c_ulong(arg3), c.c_ulong(0), c.c_ulong(0)),
                           f"prctl({option})")

    def seccomp_no_userns(self) -> None:
        """Install the filter above (after no_new_privs, which lets an unprivileged process do so)."""
        c = self._c
        arch, nr_clone, nr_unshare, nr_clone3 = SECCOMP[os.uname().machine]
        ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
        allow, eperm, enosys = 0x7FFF0000, 0x00050000 | 1, 0x00050000 | 38
        keyrings = [step for nr in KEYRING_SYSCALLS[os.uname().machine]
                    for step in ((jeq, 0, 1, nr), (ret, 0, 0, eperm))]
        prog = [
            (ld, 0, 0, 4), (jeq, 1, 0, arch), (ret, 0, 0, eperm),  # another ABI (i386 on x86_64): refuse all
            (ld, 0, 0, 0), (jge, 0, 1, 0x40000000), (ret, 0, 0, eperm),  # the x32 ABI: refuse all
            (jeq, 0, 1, nr_clone3), (ret, 0, 0, enosys),
            *keyrings,
            (jeq, 2, 0, nr_clone), (jeq, 1, 0, nr_unshare), (ret, 0, 0, allow),
            (ld, 0, 0, 16), (jset, 0, 1, CLONE_NEWUSER), (ret, 0, 0, eperm), (ret, 0, 0, allow),
        ]

        class Filter(c.Structure):
            _fields_ = [("code", c.c_uint16), ("jt", c.c_uint8), ("jf", c.c_uint8), ("k", c.c_uint32)]

        class Prog(c.Structure):
            _fields_ = [("len", c.c_ushort), ("filter", c.POINTER(Filter))]

        filters = (Filter * len(prog))(*[Filter(*f) for f in prog])
        fprog = Prog(len(prog), filters)
        self._check(self.lib.prctl(22, c.c_ulong(2), c.byref(fprog), c.c_ulong(0), c.c_ulong(0)),
                    "prctl(PR_SET_SECCOMP)")

    def capset_none(self) -> None:
        """Empty the effective, permitted and inheritable sets (setresuid leaves the inheritable set)."""
        c = self._c
        header = (c.c_uint32 * 2)(LINUX_CAPABILITY_VERSION_3, 0)
        data = (c.c_uint32 * 6)()
        self._check(self.lib.capset(header, data), "capset")


def _report(fd: int, *words: object) -> None:
    """One line to the parent: words separated by tabs (the parent splits on the first ones only)."""
    try:
        line = "\t".join(str(w).replace("\n", " ").replace("\t", " ") for w in words) + "\n"
        os.write(fd, line.encode("utf-8", "backslashreplace"))
    except OSError:
        pass


def _hold_none_of_the_callers(pass_fds: list[int], devnull: int) -> None:
    """Close the caller's descriptors and point stdio at /dev/null (the launcher and the init keep
    none of them, so the caller's pipes see EOF once the namespace is empty)."""
    for fd in pass_fds:
        try:
            os.close(fd)
        except OSError:
            pass
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    os.close(devnull)


def _loopback_up() -> None:
    """Bring `lo` of this (new) network namespace up: 127.0.0.1 inside, nothing outside."""
    import _socket
    import fcntl
    import struct

    s = _socket.socket(_socket.AF_INET, _socket.SOCK_DGRAM)
    try:
        req = struct.pack("16sh22x", b"lo", 0)
        flags = struct.unpack("16sh22x", fcntl.ioctl(s.fileno(), SIOCGIFFLAGS, req))[1]
        fcntl.ioctl(s.fileno(), SIOCSIFFLAGS, struct.pack("16sh22x", b"lo", flags | IFF_UP))
    finally:
        s.close()


def _launcher_main(spec: dict) -> int:
    """The top process: new pid/net/ipc namespaces, then wait for pid 1 and exit the way the command did."""
    import select

    report, lifeline = spec["report_fd"], spec["lifeline_fd"]
    os.set_inheritable(lifeline, False)
    libc = _Libc()
    # No core file of ours when we re-raise the command's SIGSEGV on ourselves below.
    import resource

    resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))
    if spec.get("cgroup_procs"):
        # First of all, the sandbox's own memory cgroup: everything it starts, and every page it writes to its
        # tmpfs, is charged there, so the kernel's OOM killer picks within the sandbox, never the evaluator.
        try:
            fd = os.open(spec["cgroup_procs"], os.O_WRONLY)
            try:
                os.write(fd, str(os.getpid()).encode())
            finally:
                os.close(fd)
        except OSError as exc:
            _report(report, "error", "cgroup", exc.errno or 0, f"joining its memory cgroup: {exc.strerror}")
            return EXIT_SETUP
    try:
        libc.unshare(CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC)
    except OSError as exc:
        _report(report, "error", "unshare", exc.errno, f"unshare(pid, net, ipc): {exc.strerror}")
        return EXIT_SETUP
    if spec.get("loopback"):
        try:
            _loopback_up()
        except OSError as exc:
            _report(report, "error", "loopback", exc.errno or 0, f"bringing lo up: {exc.strerror}")
            return EXIT_SETUP
    devnull = os.open("/dev/null", os.O_RDWR)
    alive_r, alive_w = os.pipe()  # held by the launcher only: the init sees EOF once we are gone
    status_r, status_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pid 1 of the new namespace; never returns into this function's parent part
        code = EXIT_SETUP
        try:
            os.close(alive_w)
            os.close(status_r)
            os.close(lifeline)
            code = _init_main(spec, libc, report, alive_r, status_w, devnull)
        except BaseException as exc:  # noqa: BLE001 - anything at all must end this process here
            _report(report, "error", "init", getattr(exc, "errno", None) or 0, f"{type(exc).__name__}: {exc}")
        os._exit(code)
    os.close(alive_r)
    os.close(status_w)
    # Readable only once the namespace has its first process; it stays readable while that is a zombie.
    _report(report, "init", pid, os.readlink("/proc/self/ns/pid_for_children"))
    os.close(report)
    # Hold none of the caller's descriptors: its pipes must see EOF once the namespace is empty.
    _hold_none_of_the_callers(spec["pass_fds"], devnull)
    # Nothing of the sandbox may outlive the process that started it (an evaluator killed by the
    # runner's cancel, a crash): the parent alone holds the lifeline's other end, so its death is a
    # hang-up here, and then pid 1 is killed. (PR_SET_PDEATHSIG would fire when the parent's *thread*
    # that started us ends, not the parent: it is the fallback where pidfds are missing.)
    try:
        pidfd = os.pidfd_open(pid)
    except (OSError, AttributeError):
        pidfd = None
        libc.prctl(PR_SET_PDEATHSIG, 9)
        if os.getppid() != spec["parent_pid"]:
            os.kill(pid, 9)
    if pidfd is not None:
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        poller.register(lifeline, select.POLLIN)
        while True:
            ready = dict(poller.poll())
            if pidfd in ready:
                break
            if lifeline in ready:
                os.kill(pid, 9)  # our child, not yet reaped: its pid cannot name another process
                poller.unregister(lifeline)
    _, status = os.waitpid(pid, 0)
    told = b""
    if select.select([status_r], [], [], 0)[0]:
        told = os.read(status_r, 64)
    if told.strip().isdigit():
        status = int(told)  # the command's own wait status, handed over by the init
    if os.WIFEXITED(status):
        return os.WEXITSTATUS(status)
    if os.WIFSIGNALED(status):
        import _signal  # the builtin half of `signal`: no enum import on every start

        sig = os.WTERMSIG(status)
        if sig not in (_signal.SIGKILL, _signal.SIGSTOP):  # these two have no handler to reset
            _signal.signal(sig, _signal.SIG_DFL)
            _signal.pthread_sigmask(_signal.SIG_UNBLOCK, [sig])
        os.kill(os.getpid(), sig)
        return 128 + sig  # a signal we cannot die of (none such at termination): the shell's convention
    return EXIT_SETUP


def _init_main(spec: dict, libc: _Libc, report: int, alive_r: int, status_w: int, devnull: int) -> int:
    """Pid 1: build the root, start the command, reap everything, hand the command's status up."""
    import select

    # Die with the launcher. The launcher may already be gone (before prctl took effect): then the
    # pipe it alone holds has reached EOF.
    import _signal

    libc.prctl(PR_SET_PDEATHSIG, int(_signal.SIGKILL))
    if select.select([alive_r], [], [], 0)[0]:
        return EXIT_SETUP
    stage = "mount namespace"
    try:
        libc.unshare(CLONE_NEWNS)
        # Nothing we mount may propagate back to the host (its / is often shared).
        libc.mount(None, "/", None, MS_REC | MS_PRIVATE)
        os.umask(0o022)
        stage = "root"
        _build_root(spec, libc)
    except OSError as exc:
        _report(report, "error", stage, exc.errno or 0, str(exc))
        return EXIT_SETUP
    cmd = os.fork()
    if cmd == 0:
        try:
            _exec_command(spec, libc, report)
        except BaseException as exc:  # noqa: BLE001
            _report(report, "error", "exec", getattr(exc, "errno", None) or 0, f"{type(exc).__name__}: {exc}")
        os._exit(127)
    os.close(report)
    _hold_none_of_the_callers(spec["pass_fds"], devnull)
    while True:  # pid 1 adopts every orphan of the namespace: reap them so they do not count as processes
        pid, status = os.wait()
        if pid == cmd:
            break
    os.write(status_w, str(status).encode())
    # Returning ends pid 1: the kernel then SIGKILLs and reaps whatever else is left in the namespace
    # before the launcher's waitpid returns.
    return 0


def _makedirs(path: str) -> None:
    os.makedirs(path, mode=0o755, exist_ok=True)


def _readonly(libc: _Libc, target: str, recursive: bool) -> None:
    """Read-only, nosuid, nodev: mount_setattr where the kernel has it (5.12), else remount each mount."""
    try:
        libc.mount_setattr_rdonly(target, recursive)
        return
    except OSError as exc:
        if exc.errno not in (38, 22):  # ENOSYS, EINVAL: an older kernel; anything else is real
            raise
    mounts = [target]
    if recursive:
        with open("/proc/self/mountinfo") as f:
            points = [line.split()[4].replace("\\040", " ") for line in f]
        mounts += [p for p in points if p.startswith(target.rstrip("/") + "/")]
    for point in mounts:
        libc.mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _build_root(spec: dict, libc: _Libc) -> None:
    """Assemble the new root under /new and switch to it (pivot_root), leaving the host's tree behind."""
    # A tmpfs over /tmp becomes a staging root, with the host's whole tree (its /tmp included, now that
    # the tmpfs no longer covers it) reachable under /host while the new root is built from it.
    libc.mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0700")
    os.mkdir("/tmp/host")
    libc.pivot_root("/tmp", "/tmp/host")
    os.chdir("/")
    os.mkdir("/new")
    libc.mount("tmpfs", "/new", "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    uid, gid = spec["uid"], spec["gid"]
    masks = []
    for op in spec["ops"]:
        kind, path = op[0], op[1]
        dst, src = "/new" + path, "/host" + path
        if kind == "link":
            _makedirs(os.path.dirname(dst))
            os.symlink(op[2], dst)
        elif kind == "bind":
            _makedirs(os.path.dirname(dst))
            if op[2]:  # a file: the mount point is an empty file
                if not os.path.lexists(dst):
                    os.close(os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
            else:
                _makedirs(dst)
            libc.mount(src, dst, None, MS_BIND | MS_REC)
            _readonly(libc, dst, recursive=True)
        elif kind == "mask":  # a path inside a bound tree that must not show (the checkout)
            if op[2]:
                libc.mount("/host/dev/null", dst, None, MS_BIND)  # the staging root has no /dev: the host's
            else:
                libc.mount("tmpfs", dst, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=64k,mode=0755")
                masks.append(dst)
        elif kind == "scratch":
            _makedirs(dst)
            libc.mount("tmpfs", dst, "tmpfs", MS_NOSUID | MS_NODEV,
                       f"size={spec['scratch_bytes']},mode=0700,uid={uid},gid={gid}")
        else:
            raise OSError(22, f"unknown plan step {kind}")
    for d in ("/new/dev", "/new/proc"):
        _makedirs(d)
    for m in masks:
        _readonly(libc, m, recursive=False)
    _readonly(libc, "/new", recursive=False)  # the skeleton itself: no new files anywhere but scratch
    # /dev: a tmpfs holding only the nodes the command needs, each a bind of the host's node.
    libc.mount("tmpfs", "/new/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "size=64k,mode=0755")
    for name, is_dir in spec["devices"]:
        dst = "/new/dev/" + name
        if is_dir:
            _makedirs(dst)
            libc.mount("/host/dev/" + name, dst, None, MS_BIND | MS_REC)
        else:
            os.close(os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
            libc.mount("/host/dev/" + name, dst, None, MS_BIND)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                         ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
        os.symlink(target, "/new/dev/" + name)
    os.mkdir("/new/dev/shm")
    libc.mount("tmpfs", "/new/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
               f"size={spec['shm_bytes']},mode=1777")
    _readonly(libc, "/new/dev", recursive=False)
    # A procfs of the new pid namespace (we are its pid 1); hidepid hides pid 1 (root) from the command.
    for options in ("hidepid=invisible", "hidepid=2", None):
        try:
            libc.mount("proc", "/new/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, options)
            break
        except OSError:
            if options is None:
                raise
    # Switch roots: stack the staging root on the new one and detach it, with the host's tree below it.
    os.chdir("/new")
    libc.pivot_root(".", ".")
    libc.umount2(".", MNT_DETACH)
    os.chdir("/")
    with open("/proc/self/mountinfo") as f:
        left = [p for p in (line.split()[4] for line in f) if p in ("/host", "/new") or p.startswith(("/host/", "/new/"))]
    if left:
        raise OSError(16, f"the host's tree is still mounted at {left[:3]}")
    os.chdir(spec["cwd"])


def _exec_command(spec: dict, libc: _Libc, report: int) -> None:
    """In the command's process (pid 2): limits, then drop every privilege, then exec."""
    import _signal
    import resource

    # Dispositions and the mask survive exec: Python ignores SIGPIPE and SIGXFSZ, the command must not.
    for sig in range(1, _signal.NSIG):
        if sig not in (_signal.SIGKILL, _signal.SIGSTOP):
            try:
                _signal.signal(sig, _signal.SIG_DFL)
            except (OSError, ValueError):
                pass
    _signal.pthread_sigmask(_signal.SIG_SETMASK, [])
    os.setsid()
    for name, value in spec["rlimits"]:
        # soft and hard: the command cannot raise them again; CPU's hard limit sits a second above. Never
        # above the host's hard limit: raising one needs CAP_SYS_RESOURCE, which containers often lack.
        soft, hard = value if isinstance(value, tuple) else (value, value)
        which = getattr(resource, name)
        ceiling = resource.getrlimit(which)[1]
        if ceiling != resource.RLIM_INFINITY:
            soft, hard = min(soft, ceiling), min(hard, ceiling)
        resource.setrlimit(which, (soft, hard))
    with open("/proc/sys/kernel/cap_last_cap") as f:
        last_cap = int(f.read())
    for cap in range(last_cap + 1):  # no file capability or setuid binary can hand anything back
        libc.prctl(PR_CAPBSET_DROP, cap)
    uid, gid = spec["uid"], spec["gid"]
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    libc.capset_none()
    libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)
    libc.prctl(PR_SET_NO_NEW_PRIVS, 1)
    if os.uname().machine in SECCOMP:
        libc.seccomp_no_userns()
    # Check rather than trust: a kernel or libc surprise here would be a hole, not an error message.
    with open("/proc/self/status") as f:
        status = dict(line.split(":", 1) for line in f.read().splitlines() if ":" in line)
    caps = {k: int(status[k].strip(), 16) for k in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")}
    ids = [int(x) for x in status["Uid"].split()] + [int(x) for x in status["Gid"].split()]
    if any(caps.values()) or set(ids) != {uid} | {gid} or status["Groups"].strip() or \
            status["NoNewPrivs"].strip() != "1":
        raise OSError(1, f"privileges left after the drop: {caps} ids {ids} groups {status['Groups'].strip()!r}")
    keep = {0, 1, 2, report, *spec["pass_fds"]}
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass
    for fd in spec["pass_fds"]:
        os.set_inheritable(fd, True)
    os.set_inheritable(report, False)  # closed by a successful exec: the parent's sign that we started
    argv, env = spec["argv"], spec["env"]
    os.execvpe(argv[0], argv, env)


# ---- end of the inside ----

# ------------------------------------------------------------------------------------------------------
# The outside: the parent's API.
# ------------------------------------------------------------------------------------------------------

import ctypes  # noqa: E402
import errno  # noqa: E402
import grp  # noqa: E402
import marshal  # noqa: E402
import pwd  # noqa: E402
import resource  # noqa: E402
import secrets  # noqa: E402
import select  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402

LAUNCHER = Path(__file__).resolve()
# The launcher runs the inside part of this file, compiled here once: compiling the whole file in every
# launcher cost 10-25 ms per sandbox. Read at import, so a checkout updated meanwhile changes nothing.
_INSIDE_SOURCE = LAUNCHER.read_text().split("# ---- end of the inside ----", 1)[0]
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
        _INSIDE_CODE = compile(_INSIDE_SOURCE, str(LAUNCHER), "exec")
    return _INSIDE_CODE


SYSTEM_PATHS = ("/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/sys")
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
# The uid range sandboxes draw from: far above login users (1000+), system users, nobody (65534) and
# the subordinate ranges container tools allot (100000 + 65536 k, usually well below 10^8).
UID_RANGE = (1_000_000_000, 2_000_000_000)
START_TIMEOUT = 60.0


# ---- the limits, as data: competition.toml's [limits] ----

COMPETITION_TOML = LAUNCHER.parent.parent / "competition.toml"
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


class SandboxUnavailable(RuntimeError):
    """Isolation was required (Policy.isolate=True) and this process cannot have it."""


class SandboxError(RuntimeError):
    """This sandbox could not be set up (the message names the stage: a path, a mount, the uid drop)."""


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
        for name in sorted(os.listdir("/dev")):
            if name.startswith("nvidia"):
                full = "/dev/" + name
                if os.path.isdir(full):
                    devices.append((name, True))
                elif os.path.exists(full):
                    devices.append((name, False))
                    if not os.stat(full).st_mode & 0o006 == 0o006:
                        warnings.append(f"{full} is not read-write for others: the sandbox's uid cannot open it")
    return {"steps": steps, "devices": devices, "warnings": warnings,
            "readable": sorted(kept), "masked": [m for m, _ in masks]}


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
            for name, value in limits:
                soft, hard = value if isinstance(value, tuple) else (value, value)
                which = getattr(resource, name)
                ceiling = resource.getrlimit(which)[1]
                if ceiling != resource.RLIM_INFINITY:
                    soft, hard = min(soft, ceiling), min(hard, ceiling)
                resource.setrlimit(which, (soft, hard))

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


# ---- `python -m pipeline sandbox-check` ----

_PROBE = r'''
import json, os, socket, sys, time
cfg = json.loads(sys.argv[1])
out = {"uid": os.getuid(), "gid": os.getgid(), "groups": os.getgroups(), "pid": os.getpid()}
status = dict(l.split(":", 1) for l in open("/proc/self/status").read().splitlines() if ":" in l)
out["caps"] = {k: status[k].strip() for k in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")}
out["no_new_privs"] = status["NoNewPrivs"].strip()
out["proc_pids"] = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())

def attempt(fn):
    try:
        r = fn()
        return {"ok": True, "value": r}
    except Exception as exc:
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}

out["parent_proc"] = {
    "host_pid_visible": os.path.exists(f"/proc/{cfg['host_pid']}"),
    "init_environ": attempt(lambda: len(open("/proc/1/environ", "rb").read())),
    "ppid_environ": attempt(lambda: len(open(f"/proc/{os.getppid()}/environ", "rb").read())),
}
out["net_devices"] = [l.split(":")[0].strip() for l in open("/proc/net/dev").read().splitlines()[2:]]
out["tcp_to_host"] = attempt(lambda: socket.create_connection(("127.0.0.1", cfg["port"]), timeout=2).close())
writes = {}
for d in cfg["unwritable"]:
    def w(d=d):
        with open(os.path.join(d, ".sandbox-check-write"), "w") as f:
            f.write("x")
    writes[d] = attempt(w)
out["writes"] = writes
out["scratch_write"] = attempt(lambda: open("/tmp/ok", "w").write("ok"))
out["reads"] = {p: attempt(lambda p=p: len(open(p, "rb").read())) for p in cfg["unreadable"]}
sys.path.insert(0, cfg["checkout"])
def harness():
    import torch
    import pipeline.kernel.transport
    return {"torch": torch.__version__, "harness": pipeline.kernel.transport.__file__}
out["imports"] = attempt(harness)
if cfg["device"] == "cuda":
    def cuda():
        import torch
        return {"available": torch.cuda.is_available(), "sum": torch.ones(4, device="cuda").sum().item(),
                "name": torch.cuda.get_device_name(0)}
    out["cuda"] = attempt(cuda)
r, w = os.pipe()
if os.fork() == 0:  # a grandchild detached in a session of its own: it must die with the sandbox
    os.setsid()
    if os.fork() == 0:
        os.write(w, str(os.getpid()).encode())
        time.sleep(3600)
    os._exit(0)
out["detached_pid"] = int(os.read(r, 32))
print(json.dumps(out), flush=True)
time.sleep(3600)
'''


def _check_args(p) -> None:
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cuda: also bind the NVIDIA devices and check torch.cuda inside")


def sandbox_check(args) -> int:
    """Probe the submission sandbox on this machine (run it on the runner, as root).

    Prints one line per check: isolation available; a live sandbox's uid is its own; the parent's
    processes are invisible; no network; nothing writable outside scratch; /root and the checkout
    unreadable beyond what was granted; the harness imports inside; a detached grandchild is gone after
    kill; with --device cuda, CUDA works inside. Exit 0 only when every check passes.
    """
    import json
    import socket

    failures = []

    def line(ok: bool, name: str, detail: str) -> None:
        print(f"{'ok  ' if ok else 'FAIL'}  {name}: {detail}", flush=True)
        if not ok:
            failures.append(name)

    ok, why = availability()
    line(ok, "isolation", why or "root, pid/network/mount namespaces, a uid of its own")
    if not ok:
        return 1
    pkg = LAUNCHER.parent
    checkout = pkg.parent
    canary = Path("/root") / f".sandbox-check-{secrets.token_hex(6)}"
    unreadable = []
    try:
        canary.write_text("a file of root's that the sandbox must not see\n")
        canary.chmod(0o644)  # readable by anyone on the host: only the sandbox's view hides it
        unreadable.append(str(canary))
    except OSError as exc:
        line(False, "canary", f"cannot write {canary}: {exc}")
        canary = None
    outside = sorted(p for p in checkout.iterdir() if p.is_file() and p.name != "sandbox.py") if checkout.is_dir() else []
    if outside:
        unreadable.append(str(outside[0]))
    key = os.environ.get("PIPELINE_RESULT_KEY_FILE")
    if key and os.path.isfile(key):
        unreadable.append(key)
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    env = {"PATH": os.environ.get("PATH", os.defpath), "HOME": SCRATCH, "TMPDIR": SCRATCH,
           "PYTHONDONTWRITEBYTECODE": "1"}
    for k in ("LD_LIBRARY_PATH", "CUDA_HOME", "CUDA_PATH", "CUDA_VISIBLE_DEVICES"):
        if k in os.environ:
            env[k] = os.environ[k]
    if args.device == "cpu":
        env["TRITON_INTERPRET"] = "1"
    cfg = {"host_pid": os.getpid(), "port": server.getsockname()[1], "checkout": str(checkout),
           "device": args.device, "unreadable": unreadable,
           "unwritable": ["/", "/etc", "/usr", str(pkg), sys.prefix, "/sys/kernel", "/root", "/dev"]}
    r, w = os.pipe()
    try:
        sb = Sandbox([sys.executable, "-I", "-c", _PROBE, json.dumps(cfg)], policy=Policy(isolate=True),
                     readable=[pkg], env=env, stdout=w, stderr=w, device=args.device)
    except (SandboxError, OSError) as exc:
        os.close(w)
        line(False, "start", str(exc))
        return 1
    finally:
        try:
            os.close(w)
        except OSError:
            pass
    def report(data: bytes) -> dict | None:
        # stdout and stderr share the pipe: the report is the line that is a JSON object (a warning
        # printed by the probe's imports, a fork in a process with threads, may come first).
        for raw in data.splitlines():
            try:
                doc = json.loads(raw)
            except ValueError:
                continue
            if isinstance(doc, dict):
                return doc
        return None

    buf = b""
    deadline = time.monotonic() + 300
    while report(buf) is None and time.monotonic() < deadline:
        if select.select([r], [], [], 1)[0]:
            chunk = os.read(r, 1 << 16)
            if not chunk:
                break
            buf += chunk
    tail = buf.decode("utf-8", "replace")
    try:
        out = report(buf)
        if out is None:
            raise ValueError("no report")
    except (ValueError, IndexError):
        sb.kill()
        os.close(r)
        line(False, "probe", f"no report from inside (exit {sb.returncode}): {tail[-2000:]}")
        return 1
    alive = sb.processes()
    killed = sb.kill()
    left = sb.processes()
    os.close(r)
    server.close()
    if canary is not None:
        canary.unlink(missing_ok=True)

    zero = all(int(v, 16) == 0 for v in out["caps"].values())
    line(out["uid"] == sb.uid and out["uid"] != 0 and out["gid"] == sb.gid and not out["groups"] and zero
         and out["no_new_privs"] == "1", "uid",
         f"uid {out['uid']} gid {out['gid']} groups {out['groups']} caps {out['caps']} no_new_privs {out['no_new_privs']}")
    pp = out["parent_proc"]
    line(not pp["host_pid_visible"] and not pp["init_environ"]["ok"] and not pp["ppid_environ"]["ok"]
         and all(p >= 2 for p in out["proc_pids"]), "parent invisible",
         f"pid {out['pid']} inside, /proc holds {out['proc_pids']}, the checker's pid {os.getpid()} "
         f"{'VISIBLE' if pp['host_pid_visible'] else 'absent'}, /proc/1/environ "
         f"{pp['init_environ'].get('error', 'READ')}")
    line(out["net_devices"] == ["lo"] and not out["tcp_to_host"]["ok"], "network",
         f"devices {out['net_devices']}, TCP to the host's 127.0.0.1: {out['tcp_to_host'].get('error', 'CONNECTED')}")
    written = [d for d, res in out["writes"].items() if res["ok"]]
    line(not written and out["scratch_write"]["ok"], "writes",
         f"refused in {len(out['writes']) - len(written)}/{len(out['writes'])} places"
         + (f", WRITTEN in {written}" if written else "") + f"; scratch {SCRATCH} writable: {out['scratch_write']['ok']}")
    read = [p for p, res in out["reads"].items() if res["ok"]]
    line(bool(out["reads"]) and not read, "reads",
         f"{', '.join(out['reads'])}: " + ("; ".join(f"{p} READ" for p in read) if read else "none visible"))
    imp = out["imports"]
    line(imp["ok"], "harness imports", json.dumps(imp.get("value") or imp.get("error")))
    line(out["detached_pid"] > 0 and not left, "kill",
         f"{len(alive)} processes alive before kill (a detached grandchild among them), {killed} killed beyond "
         f"the command, {len(left)} left")
    if args.device == "cuda":
        c = out.get("cuda", {})
        line(bool(c.get("ok") and c["value"]["available"] and c["value"]["sum"] == 4.0), "cuda",
             json.dumps(c.get("value") or c.get("error")))
    d = sb.describe()
    print(f"      isolation {d['isolation']}, bound read-only: {', '.join(d['readable'])}"
          + (f"; warnings: {'; '.join(d['warnings'])}" if d["warnings"] else ""))
    return 1 if failures else 0


VERBS = {"sandbox-check": (_check_args, sandbox_check)}
