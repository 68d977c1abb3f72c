"""The inside of a sandbox: the launcher, the init (pid 1 of the new pid namespace) and the command's last steps
before exec (pipeline/sandbox/__init__.py says how they fit). This file runs in the launcher
(`python -I -S -c BOOT`): the parent compiles it once and hands the code over a memfd. It imports only small
builtin modules, lazily, and nothing of the pipeline: every sandbox pays for it.

The namespaces and the root's mounts (`_launcher_main`, `_init_main`, `_build_root`), the seccomp filter and
the drop to the sandbox's uid (`_exec_command`) are here.
"""

from __future__ import annotations

import os

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


def set_rlimits(rlimits: list) -> None:
    """Each (name, value or (soft, hard)) as soft and hard limit: the command cannot raise them again (CPU's hard
    limit sits a second above its soft one). Never above the host's hard limit: raising one needs
    CAP_SYS_RESOURCE, which containers often lack. rlimit calls only: it also runs between fork and exec."""
    import resource

    for name, value in rlimits:
        soft, hard = value if isinstance(value, tuple) else (value, value)
        which = getattr(resource, name)
        ceiling = resource.getrlimit(which)[1]
        if ceiling != resource.RLIM_INFINITY:
            soft, hard = min(soft, ceiling), min(hard, ceiling)
        resource.setrlimit(which, (soft, hard))


def _exec_command(spec: dict, libc: _Libc, report: int) -> None:
    """In the command's process (pid 2): limits, then drop every privilege, then exec."""
    import _signal

    # Dispositions and the mask survive exec: Python ignores SIGPIPE and SIGXFSZ, the command must not.
    for sig in range(1, _signal.NSIG):
        if sig not in (_signal.SIGKILL, _signal.SIGSTOP):
            try:
                _signal.signal(sig, _signal.SIG_DFL)
            except (OSError, ValueError):
                pass
    _signal.pthread_sigmask(_signal.SIG_SETMASK, [])
    os.setsid()
    set_rlimits(spec["rlimits"])
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
