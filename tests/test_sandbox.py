"""pipeline/sandbox/: what a command inside a Sandbox can and cannot do (argv, environment, fds, exit
status, uid, namespaces, the file system it sees, each resource limit) and the fallback where isolation
cannot be had. CI runs as root, where isolation must work: a root that cannot isolate fails here, it
does not skip. Without root (a laptop) the isolated tests skip and the fallback ones still run."""

from __future__ import annotations

import errno
import json
import os
import pwd
import resource
import select
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from pipeline.sandbox import (Limits, OutputTail, Policy, Sandbox, SandboxUnavailable, availability, plan)

CHECKOUT = Path(__file__).resolve().parents[1]  # the checkout these tests run from, not the editable one
PKG = CHECKOUT / "pipeline"
PY = sys.executable


@pytest.fixture(scope="module")
def isolated():
    if os.geteuid() != 0:
        pytest.skip("isolation needs root (CI runs as root)")
    ok, why = availability()
    assert ok, f"running as root, yet no isolation: {why}"


def read_all(fd: int, timeout: float = 60) -> bytes:
    out = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                break
            out += chunk
    os.close(fd)
    return out


def start(code: str, *args: str, policy: Policy | None = None, readable=(), env=None, **kw):
    """`python -I -c code args...` in a sandbox, stdout and stderr on one pipe: (sandbox, read end)."""
    r, w = os.pipe()
    try:
        sb = Sandbox([PY, "-I", "-c", textwrap.dedent(code), *args], policy=policy or Policy(),
                     readable=[PKG, *readable], env={} if env is None else env, stdout=w, stderr=w, **kw)
    finally:
        os.close(w)
    return sb, r


def run(code: str, *args: str, timeout: float = 60, **kw) -> tuple[int | None, str, Sandbox]:
    sb, r = start(code, *args, **kw)
    out = read_all(r, timeout).decode("utf-8", "replace")
    code_ = sb.wait(timeout)
    sb.close()
    return code_, out, sb


def last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


# ---- argv, environment, exit status ----


def test_argv_env_and_exit_code_reach_both_sides(isolated):
    args = ["a b", "ü-ß", "", "--x=1"]
    env = {"ONLY": "this", "SPACED": "x y", "UNICODE": "é"}
    code, out, sb = run("""
        import json, os, sys
        environ = open("/proc/self/environ", "rb").read().split(b"\\0")
        print(json.dumps({"argv": sys.argv[1:], "env": sorted(e.decode() for e in environ if e)}))
        sys.exit(3)
    """, *args, env=env)
    assert code == 3, out
    got = last_json(out)
    assert got["argv"] == args
    assert got["env"] == sorted(f"{k}={v}" for k, v in env.items())  # nothing of this process's environment
    assert sb.describe()["isolation"] == "namespaces"


@pytest.mark.parametrize("how,sig", [
    ("import os, signal; os.kill(os.getpid(), signal.SIGTERM)", signal.SIGTERM),
    ("import ctypes; ctypes.string_at(0)", signal.SIGSEGV),
    ("import os; os.abort()", signal.SIGABRT),
])
def test_a_signal_that_kills_the_command_is_the_returncode_like_popen(isolated, how, sig):
    code, out, _ = run(how)
    assert code == -sig, out


def test_kill_gives_minus_sigkill(isolated):
    sb, r = start("import time; print('up', flush=True); time.sleep(60)")
    os.read(r, 10)
    sb.kill()
    os.close(r)
    assert sb.returncode == -signal.SIGKILL


# ---- file descriptors ----


def test_only_stdio_and_pass_fds_survive_at_their_numbers(isolated):
    data_r, data_w = os.pipe()
    high = os.dup2(data_w, 77)  # the number, not the object, must reach the command
    os.close(data_w)
    parent_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    stray_r, stray_w = os.pipe()  # open in this process, not passed: must not be inside
    os.set_inheritable(stray_w, True)
    sock_fd = child_end.fileno()
    try:
        sb, r = start(f"""
            import array, json, os, socket, sys
            fds = sorted(int(f) for f in os.listdir("/proc/self/fd"))
            os.write(77, b"through 77")
            sock = socket.socket(fileno={child_end.fileno()})
            memfd = os.memfd_create("x")
            os.write(memfd, b"an fd from inside")
            socket.send_fds(sock, [b"fd"], [memfd])
            print(json.dumps({{"fds": fds, "stdin": os.read(0, 10).decode()}}))
        """, pass_fds=(high, child_end.fileno()))
        os.close(high)
        child_end.close()
        msg, fds, _, _ = socket.recv_fds(parent_end, 16, 1)
        out = read_all(r).decode()
        assert sb.wait(30) == 0, out
        got = last_json(out)
        assert {0, 1, 2, 77, sock_fd} <= set(got["fds"]) and stray_w not in got["fds"]
        assert len(got["fds"]) == 6  # those five and the listing's own descriptor
        assert got["stdin"] == ""  # /dev/null
        assert os.read(data_r, 100) == b"through 77"
        assert msg == b"fd" and len(fds) == 1
        os.lseek(fds[0], 0, 0)
        assert os.read(fds[0], 100) == b"an fd from inside"  # SCM_RIGHTS across the namespaces
        os.close(fds[0])
        sb.close()
    finally:
        parent_end.close()
        for fd in (data_r, stray_r, stray_w):
            os.close(fd)


# ---- the uid ----


def test_a_uid_of_its_own_without_any_privilege(isolated):
    code = """
        import json, os
        st = dict(l.split(":", 1) for l in open("/proc/self/status").read().splitlines() if ":" in l)
        print(json.dumps({"ids": [os.getresuid(), os.getresgid()], "groups": os.getgroups(),
                          "caps": [st[k].strip() for k in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")],
                          "nnp": st["NoNewPrivs"].strip()}))
        import time; time.sleep(0.5)
    """
    one, r1 = start(code)
    two, r2 = start(code)  # at the same time: another uid
    a, b = last_json(read_all(r1).decode()), last_json(read_all(r2).decode())
    one.close()
    two.close()
    assert one.uid != two.uid
    for sb, got in ((one, a), (two, b)):
        assert sb.uid not in (0, 65534, os.getuid()) and sb.gid == sb.uid
        assert got["ids"] == [[sb.uid] * 3, [sb.gid] * 3]
        with pytest.raises(KeyError):
            pwd.getpwuid(sb.uid)
        assert got["groups"] == []
        assert got["caps"] == ["0000000000000000"] * 5
        assert got["nnp"] == "1"


def test_no_user_namespace_for_the_command_and_threads_still_start(isolated):
    # Inside a user namespace of its own the command would hold every capability over new network and
    # mount namespaces: the entry to most kernel privilege escalations. The seccomp filter refuses it.
    code, out, _ = run("""
        import ctypes, os, threading
        libc = ctypes.CDLL(None, use_errno=True)
        res = libc.unshare(0x10000000)  # CLONE_NEWUSER
        print(res, ctypes.get_errno())
        t = threading.Thread(target=print, args=("thread",))  # clone3 refused: libc falls back to clone
        t.start()
        t.join()
        pid = os.fork()
        if pid == 0:
            os._exit(7)
        print("child", os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
    """)
    assert out.split("\n")[:3] == ["-1 1", "thread", "child 7"], out


# ---- the pid namespace ----


def test_the_pid_namespace_shows_only_the_sandbox(isolated):
    code, out, _ = run("""
        import json, os, sys
        print(json.dumps({"pid": os.getpid(), "ppid": os.getppid(),
                          "proc": sorted(int(p) for p in os.listdir("/proc") if p.isdigit()),
                          "host": os.path.exists(f"/proc/{sys.argv[1]}")}))
    """, str(os.getpid()))
    got = last_json(out)
    assert got["pid"] == 2 and got["ppid"] == 1  # pid 1 is the sandbox's init
    assert got["proc"] == [2]  # the init (root) is hidden too (hidepid)
    assert got["host"] is False


DETACH = textwrap.dedent("""
    import os, sys, time
    r, w = os.pipe()
    if os.fork() == 0:          # a grandchild in a session of its own, orphaned: no group kill reaches it
        os.setsid()
        if os.fork() == 0:
            os.write(w, b"x")
            time.sleep(600)
        os._exit(0)
    os.read(r, 1)
    print("detached", flush=True)
""")


def test_kill_returns_when_a_detached_grandchild_is_gone_too(isolated):
    sb, r = start(DETACH + "time.sleep(600)\n")
    assert os.read(r, 100).startswith(b"detached")
    before = sb.processes()
    assert len(before) >= 3  # init, command, grandchild (and the intermediate's zombie)
    killed = sb.kill()
    assert killed >= 1
    assert sb.processes() == []
    assert not any(os.path.exists(f"/proc/{p}") and Path(f"/proc/{p}/stat").exists() for p in before)
    os.close(r)


def test_the_command_ending_ends_everything_it_left(isolated):
    sb, r = start(DETACH)  # the command exits at once, the grandchild would sleep on
    assert sb.wait(30) == 0
    assert sb.processes() == []  # gone by the time wait() returns
    assert read_all(r, 5).startswith(b"detached")  # and the pipe it held is closed: EOF
    sb.close()


def test_sigkill_of_the_top_process_kills_the_namespace(isolated):
    sb, r = start(DETACH + "time.sleep(600)\n")
    assert os.read(r, 100).startswith(b"detached")
    assert len(sb.processes()) >= 3
    os.kill(sb.pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while sb.processes() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sb.processes() == []
    assert sb.wait(5) == -signal.SIGKILL
    os.close(r)


def members_of(pidns: str) -> list[int]:
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.readlink(f"/proc/{entry}/ns/pid") == pidns and Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                found.append(int(entry))
        except OSError:
            pass
    return found


def test_nothing_outlives_the_process_that_started_it(isolated):
    # An evaluator killed by the runner (a cancelled job) or crashing must not leave the submission running.
    parent = subprocess.Popen([PY, "-c", textwrap.dedent(f"""
        import os, sys, threading
        sys.path.insert(0, {str(CHECKOUT)!r})
        from pipeline.sandbox import Policy, Sandbox
        code = {DETACH!r} + "time.sleep(600)\\n"
        boxes = []
        def start():  # from a thread that ends at once: the sandbox must not die with the thread
            r, w = os.pipe()
            boxes.append((Sandbox([sys.executable, "-I", "-c", code], policy=Policy(), readable=[], env={{}},
                                  stdout=w), r))
        t = threading.Thread(target=start)
        t.start()
        t.join()
        sb, r = boxes[0]
        os.read(r, 9)
        print(os.readlink(f"/proc/{{sb.init_pid}}/ns/pid"), flush=True)
        import time; time.sleep(600)
    """)], stdout=subprocess.PIPE, text=True)
    pidns = parent.stdout.readline().strip()
    assert pidns.startswith("pid:")
    time.sleep(0.3)
    assert len(members_of(pidns)) >= 3  # alive after its starting thread ended: init, command, grandchild
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 5
    while members_of(pidns) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert members_of(pidns) == []


# ---- the network ----


def test_only_an_unconfigured_loopback(isolated):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    code, out, _ = run("""
        import json, socket, sys
        devs = [l.split(":")[0].strip() for l in open("/proc/net/dev").read().splitlines()[2:]]
        try:
            socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=2)
            tcp = "connected"
        except OSError as exc:
            tcp = exc.errno
        print(json.dumps({"devs": devs, "tcp": tcp}))
    """, str(server.getsockname()[1]))
    server.close()
    got = last_json(out)
    assert got == {"devs": ["lo"], "tcp": errno.ENETUNREACH}


# ---- the file system ----


VIEW = """
    import errno, json, os, sys
    def tryw(path):
        try:
            with open(path, "w") as f:
                f.write("x")
            return "written"
        except OSError as exc:
            return errno.errorcode[exc.errno]
    def ls(path):
        try:
            return sorted(os.listdir(path))
        except OSError as exc:
            return errno.errorcode[exc.errno]
    cfg = json.loads(sys.argv[1])
    mounts = [l.split() for l in open("/proc/self/mountinfo")]
    print(json.dumps({
        "root": ls("/"), "dev": ls("/dev"), "shm": ls("/dev/shm"), "checkout": ls(cfg["checkout"]),
        "home": ls("/home"), "root_home": ls("/root"), "cwd": os.getcwd(), "tmp_entries": ls("/tmp"),
        "writes": {p: tryw(p) for p in cfg["writes"]},
        "scratch": tryw("/tmp/f"), "shm_write": tryw("/dev/shm/f"),
        "rw_mounts": sorted(m[4] for m in mounts if "rw" in m[5].split(",")),
        "statvfs": os.statvfs("/tmp").f_blocks * os.statvfs("/tmp").f_frsize,
    }))
"""


def test_the_view_is_read_only_binds_and_nothing_else(isolated):
    writes = ["/x", "/etc/x", "/usr/x", str(PKG / "x"), str(Path(sys.prefix) / "x"), "/sys/x", "/dev/x",
              str(CHECKOUT / "x"), "/root/x"]
    limits = Limits(scratch_bytes=32 << 20)
    code, out, sb = run(VIEW, json.dumps({"checkout": str(CHECKOUT), "writes": writes}),
                        policy=Policy(limits=limits))
    assert code == 0, out
    got = last_json(out)
    described = sb.describe()
    tops = {Path(p).parts[1] for p in described["readable"]} | {"dev", "proc", "tmp"}
    tops |= {name for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32") if os.path.islink("/" + name)}
    assert set(got["root"]) == tops
    for absent in ("home", "var", "run", "opt", "mnt", "srv", "boot"):
        if not any(p == f"/{absent}" or p.startswith(f"/{absent}/") for p in described["readable"]):
            assert absent not in got["root"]
    assert got["home"] == "ENOENT"
    assert got["checkout"] == ["pipeline"]  # only what was granted of the checkout

    def firsts(under: str) -> list[str]:  # what the bound paths put in a folder of the new root
        return sorted({Path(p).relative_to(under).parts[0] for p in described["readable"] if p.startswith(under + "/")})

    assert got["tmp_entries"] == firsts("/tmp")  # a fresh scratch (with the checkout, when it is in /tmp)
    if firsts("/root"):
        assert got["root_home"] == firsts("/root")  # the Python installed there (.pyenv), no more
    assert set(got["dev"]) <= {"null", "zero", "full", "random", "urandom", "tty", "shm", "fd", "stdin",
                                "stdout", "stderr"}
    assert {"null", "zero", "urandom", "shm"} <= set(got["dev"])
    assert got["shm"] == []
    assert got["cwd"] == "/tmp" == str(sb.scratch)
    assert set(got["writes"].values()) <= {"EROFS", "EACCES", "ENOENT"}, got["writes"]
    assert got["scratch"] == "written" and got["shm_write"] == "written"
    # Writable mounts: the scratch, /dev/shm, the fresh /proc (its files guard themselves), the device nodes.
    assert set(got["rw_mounts"]) == {"/tmp", "/dev/shm", "/proc"} | {f"/dev/{d}" for d in
                                                                    ("null", "zero", "full", "random", "urandom", "tty")
                                                                    if d in got["dev"]}
    assert got["statvfs"] == 32 << 20


def test_a_single_granted_file_shows_and_its_neighbours_do_not(isolated, tmp_path):
    (tmp_path / "granted.txt").write_text("yes")
    (tmp_path / "secret.txt").write_text("no")
    code, out, _ = run("""
        import json, os, sys
        d = sys.argv[1]
        print(json.dumps({"ls": sorted(os.listdir(d)), "read": open(os.path.join(d, "granted.txt")).read()}))
    """, str(tmp_path), readable=[tmp_path / "granted.txt"])
    assert last_json(out) == {"ls": ["granted.txt"], "read": "yes"}


def test_a_hidden_path_inside_a_bound_tree_is_empty(isolated):
    target = next(p for p in ("/usr/share/doc", "/usr/share", "/usr/lib") if os.path.isdir(p) and os.listdir(p))
    code, out, sb = run("import json, os, sys; print(json.dumps(os.listdir(sys.argv[1])))", target,
                        hidden=[Path(target)])
    assert last_json(out) == [] and target in plan([PKG], {}, hidden=[target])["masked"]


def test_the_working_directory_inside_a_bound_tree_is_masked():
    # A checkout at /usr/src/app (a common image layout) would show through the /usr bind.
    p = plan([], {}, cwd="/usr/share")
    assert "/usr/share" in p["masked"]
    p = plan(["/usr/share/zoneinfo"] if os.path.isdir("/usr/share/zoneinfo") else [], {}, cwd="/usr/share")
    assert "/usr/share" in p["masked"]
    assert plan([], {}, cwd=str(CHECKOUT))["masked"] == []  # not in any bound tree: absent anyway
    assert not any(s[1] == str(CHECKOUT) for s in plan([PKG], {}, cwd=str(CHECKOUT))["steps"])


def test_cwd_is_the_scratch_or_the_root(isolated):
    code, out, _ = run("import os; print(os.getcwd())", cwd_scratch=False)
    assert out.strip() == "/"


def test_the_parent_reaches_the_scratch_while_the_sandbox_lives(isolated):
    go_r, go_w = os.pipe()
    sb, r = start("""
        import os
        os.read(int(__import__("sys").argv[1]), 1)
        print(open("/tmp/from-parent").read())
    """, str(go_r), pass_fds=(go_r,))
    os.close(go_r)
    (sb.host_scratch / "from-parent").write_text("hello inside")
    os.write(go_w, b"g")
    os.close(go_w)
    assert read_all(r).decode().strip() == "hello inside"
    sb.close()


def test_torch_and_the_harness_import_inside(isolated):
    code, out, _ = run("""
        import sys
        sys.path.insert(0, sys.argv[1])
        import torch
        import pipeline.kernel.transport
        print(torch.ones(3).sum().item(), pipeline.kernel.transport.__file__)
    """, str(CHECKOUT), env={"PYTHONDONTWRITEBYTECODE": "1", "HOME": "/tmp", "TMPDIR": "/tmp"}, timeout=120)
    assert code == 0, out
    total, where = out.strip().splitlines()[-1].split()
    assert float(total) == 3.0 and where == str(PKG / "kernel" / "transport.py")


def test_a_missing_readable_path_or_command_is_a_clear_error(isolated, tmp_path):
    with pytest.raises(FileNotFoundError):
        Sandbox([PY, "-c", ""], policy=Policy(), readable=[tmp_path / "nope"], env={})
    with pytest.raises(FileNotFoundError, match="readable"):
        Sandbox([str(tmp_path / "not-granted")], policy=Policy(), readable=[], env={})
    with pytest.raises(ValueError):
        Sandbox([PY, "-c", ""], policy=Policy(), readable=["/"], env={})


# ---- the limits: each one bites ----


def test_file_size_limit(isolated):
    code, out, _ = run("""
        import errno
        try:
            with open("/tmp/big", "wb") as f:
                f.write(b"x" * (3 << 20))
            print("wrote")
        except OSError as exc:
            print(errno.errorcode[exc.errno])
    """, policy=Policy(limits=Limits(file_size=1 << 20)))
    assert out.strip() == "EFBIG"  # Python ignores SIGXFSZ: the write fails instead


def test_open_files_limit(isolated):
    code, out, _ = run("""
        import errno
        fds = []
        try:
            for _ in range(200):
                fds.append(open("/dev/null"))
            print("opened", len(fds))
        except OSError as exc:
            print(errno.errorcode[exc.errno], len(fds))
    """, policy=Policy(limits=Limits(open_files=32)))
    name, count = out.split()
    assert name == "EMFILE" and int(count) < 32


def test_cpu_limit_kills_a_busy_loop(isolated):
    t0 = time.monotonic()
    code, out, _ = run("""
        import time
        end = time.monotonic() + 30
        while time.monotonic() < end:
            pass
        print("ran 30 s")
    """, policy=Policy(limits=Limits(cpu_seconds=1)), timeout=40)
    assert code in (-signal.SIGXCPU, -signal.SIGKILL), out
    assert time.monotonic() - t0 < 25  # its 1 s of CPU, not the 30 s loop


def test_data_limit_on_cpu_only(isolated):
    code_ = "import resource; print(resource.getrlimit(resource.RLIMIT_DATA)[0])\ntry:\n    b = bytearray(512 << 20)\n    print('allocated')\nexcept MemoryError:\n    print('MemoryError')"
    limits = Limits(cpu_memory=256 << 20)
    _, out, _ = run(code_, policy=Policy(limits=limits))
    assert out.split() == [str(256 << 20), "MemoryError"]
    _, out, sb = run(code_, policy=Policy(limits=limits), device="cuda")  # CUDA: no address-space bound
    assert out.split() == [str(resource.RLIM_INFINITY), "allocated"]
    assert sb.describe()["limits"]["cpu_memory"] is None


def test_every_limit_is_set_inside(isolated):
    # core: not the default 0, which the launcher's own limit would give anyway
    limits = Limits(file_size=5 << 20, open_files=100, processes=50, cpu_seconds=77, cpu_memory=1 << 30, core=4096)
    _, out, sb = run("""
        import json, resource as r
        print(json.dumps({n: r.getrlimit(getattr(r, n)) for n in
                          ("RLIMIT_CORE", "RLIMIT_FSIZE", "RLIMIT_NOFILE", "RLIMIT_NPROC", "RLIMIT_CPU", "RLIMIT_DATA")}))
    """, policy=Policy(limits=limits))
    got = last_json(out)
    hard = resource.getrlimit(resource.RLIMIT_CORE)[1]
    core = 4096 if hard == resource.RLIM_INFINITY else min(4096, hard)  # never above the host's hard limit
    assert got == {"RLIMIT_CORE": [core, core], "RLIMIT_FSIZE": [5 << 20] * 2, "RLIMIT_NOFILE": [100, 100],
                   "RLIMIT_NPROC": [50, 50], "RLIMIT_CPU": [77, 78], "RLIMIT_DATA": [1 << 30] * 2}
    assert sb.describe()["limits"] == {"core": 4096, "file_size": 5 << 20, "open_files": 100, "cpu_seconds": 77,
                                       "processes": 50, "cpu_memory": 1 << 30,
                                       "scratch_bytes": Limits().scratch_bytes, "shm_bytes": Limits().shm_bytes,
                                       "group_memory": Limits().group_memory}  # its cgroup: test_sandbox_exploits


def test_processes_limit_stops_forking_and_the_host_is_unaffected(isolated):
    sb, r = start("""
        import os, time
        made, refused = 0, 0
        for _ in range(100):
            try:
                if os.fork() == 0:
                    time.sleep(600)
                    os._exit(0)
                made += 1
            except BlockingIOError:
                refused += 1
        print(made, refused, flush=True)
        time.sleep(600)
    """, policy=Policy(limits=Limits(processes=16)))
    made, refused = map(int, os.read(r, 100).split())
    assert made == 15 and refused == 85  # 16 processes of the sandbox's uid: the command and 15 children
    assert subprocess.run(["true"]).returncode == 0  # this uid's forks are not counted against it
    assert sb.kill() == 15
    assert sb.processes() == []
    os.close(r)


# ---- output ----


def test_output_tail_keeps_the_last_bytes(isolated):
    r, w = os.pipe()
    sb = Sandbox([PY, "-I", "-c", "import sys; sys.stdout.write('x' * 300000 + 'END')"], policy=Policy(),
                 readable=[PKG], env={}, stdout=w, stderr=w)
    os.close(w)
    tail = OutputTail(r, keep=1000)
    assert sb.wait(30) == 0
    time.sleep(0.1)
    text = tail.text(100)
    assert text.endswith("x" * 97 + "END") and "earlier bytes" in text and tail.total == 300003
    sb.close()


# ---- the fallback ----


def test_isolate_false_runs_plainly_and_says_so(tmp_path):
    marker = tmp_path / "host-file"
    marker.write_text("visible")
    sb, r = start(DETACH + "print(open(sys.argv[1]).read(), os.getcwd(), flush=True)\ntime.sleep(600)\n",
                  str(marker), policy=Policy(isolate=False))
    out = b""
    while out.count(b"\n") < 2:
        out += os.read(r, 1000)
    lines = out.decode().splitlines()
    assert lines[0] == "detached"
    assert lines[1].split() == ["visible", str(sb.scratch)]  # the host's files, a temp folder as scratch
    d = sb.describe()
    assert d["isolation"] == "none" and "isolate=False" in d["reason"] and sb.uid is None
    assert d["limits"]["processes"] is None  # not applied: no uid of its own to count
    assert sb.scratch.is_dir() and sb.host_scratch == sb.scratch
    assert sb.kill() >= 1  # the detached grandchild, adopted by this process (a subreaper), killed too
    assert sb.returncode == -signal.SIGKILL
    sb.close()
    assert not sb.scratch.exists()
    os.close(r)


def test_fallback_limits_still_apply():
    code, out, _ = run("import resource; print(resource.getrlimit(resource.RLIMIT_FSIZE)[0])",
                       policy=Policy(isolate=False, limits=Limits(file_size=12345)))
    assert out.strip() == "12345"


UNAVAILABLE = """
import json, sys
sys.path.insert(0, sys.argv[1])
from pipeline.sandbox import Policy, Sandbox, SandboxUnavailable, availability
ok, why = availability()
try:
    Sandbox(["true"], policy=Policy(isolate=True), readable=[], env={})
    required = "started"
except SandboxUnavailable as exc:
    required = str(exc)
sb = Sandbox([sys.executable, "-c", ""], policy=Policy(), readable=[], env={})
sb.wait()
sb.close()
print(json.dumps({"ok": ok, "why": why, "required": required, "fallback": sb.describe(), "rc": sb.returncode}))
"""


def probe_as(*setpriv: str) -> dict:
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv to take privileges away")
    out = subprocess.run(["setpriv", *setpriv, "--", PY, "-c", UNAVAILABLE, str(CHECKOUT)],
                         capture_output=True, text=True, timeout=60, env={"PATH": os.environ.get("PATH", "")})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_not_root_means_no_isolation_and_a_clear_reason():
    # A real non-root process; it keeps the right to read (DAC caps) only so it can run this Python at all
    # (it lives under /root, mode 700).
    got = probe_as("--reuid=4242", "--regid=4242", "--clear-groups", "--inh-caps=+dac_read_search,+dac_override",
                   "--ambient-caps=+dac_read_search,+dac_override")
    assert got["ok"] is False and "not root" in got["why"]
    assert "isolation required but unavailable" in got["required"] and "not root" in got["required"]
    assert got["fallback"]["isolation"] == "none" and got["fallback"]["reason"] == got["why"] and got["rc"] == 0


def test_root_without_cap_sys_admin_means_no_isolation():
    # What a container without CAP_SYS_ADMIN gives: root, but namespaces refused.
    got = probe_as("--inh-caps=-sys_admin", "--bounding-set=-sys_admin")
    assert got["ok"] is False and "Operation not permitted" in got["why"], got
    assert "isolation required but unavailable" in got["required"]
    assert got["fallback"]["isolation"] == "none" and got["rc"] == 0


# ---- the verb ----


def test_sandbox_check_passes_here(isolated):
    out = subprocess.run([PY, "-c", f"import sys; sys.path.insert(0, {str(CHECKOUT)!r}); from pipeline.__main__ "
                          "import main; sys.exit(main(['sandbox-check']))"],
                         capture_output=True, text=True, timeout=180, cwd=CHECKOUT)
    assert out.returncode == 0, out.stdout + out.stderr
    checks = [line.split(":")[0].split(None, 1) for line in out.stdout.splitlines() if line[:4] in ("ok  ", "FAIL")]
    assert [c[1] for c in checks] == ["isolation", "uid", "parent invisible", "network", "writes", "reads",
                                      "harness imports", "kill"]
    assert all(c[0] == "ok" for c in checks)


def test_sandbox_check_fails_where_isolation_is_refused():
    got = subprocess.run(["setpriv", "--inh-caps=-sys_admin", "--bounding-set=-sys_admin", "--", PY, "-c",
                          f"import sys; sys.path.insert(0, {str(CHECKOUT)!r}); from pipeline.__main__ "
                          "import main; sys.exit(main(['sandbox-check']))"],
                         capture_output=True, text=True, timeout=60) if os.geteuid() == 0 else pytest.skip("root")
    assert got.returncode == 1 and got.stdout.startswith("FAIL  isolation:"), got.stdout + got.stderr



# ---- which GPU nodes a CUDA sandbox binds (issue 39: only the runner's own GPU) ----

HOST_NODES = ["nvidia-caps", "nvidia-modeset", "nvidia-uvm", "nvidia-uvm-tools", *(f"nvidia{i}" for i in range(8)),
              "nvidiactl"]
DRIVER_NODES = ["nvidia-caps", "nvidia-modeset", "nvidia-uvm", "nvidia-uvm-tools", "nvidiactl"]


class FakeNvml:
    """Stands in for the NVIDIA driver's library (no GPU here): UUIDs and PCI-order indices to minor numbers."""

    def __init__(self, minors: dict[str, int]):
        self.minors, self.closed = minors, False

    def minor(self, visible: str) -> int:
        if visible not in self.minors:
            raise LookupError(f"no GPU {visible}")
        return self.minors[visible]

    def close(self) -> None:
        self.closed = True


def test_a_cuda_sandbox_binds_the_driver_nodes_and_its_own_gpus_node_alone():
    from pipeline.sandbox.plan import gpu_nodes

    assert gpu_nodes(HOST_NODES, [3]) == DRIVER_NODES[:4] + ["nvidia3", "nvidiactl"]
    assert gpu_nodes(HOST_NODES, [0, 7]) == DRIVER_NODES[:4] + ["nvidia0", "nvidia7", "nvidiactl"]
    assert gpu_nodes(HOST_NODES, None) == HOST_NODES  # which GPU is not known for certain: all, with a warning


@pytest.mark.parametrize("env,minors,why", [
    ({"CUDA_VISIBLE_DEVICES": "GPU-aaaa-1111"}, [5], ""),
    ({"CUDA_VISIBLE_DEVICES": "3", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}, [3], ""),
    ({"CUDA_VISIBLE_DEVICES": "GPU-aaaa-1111,GPU-bbbb-2222"}, [5, 6], ""),
    ({}, None, "no CUDA_VISIBLE_DEVICES"),
    ({"CUDA_VISIBLE_DEVICES": "3"}, None, "CUDA_DEVICE_ORDER=PCI_BUS_ID"),  # CUDA's own order is a guess
    ({"CUDA_VISIBLE_DEVICES": "MIG-0c4d-77"}, None, "only a GPU's UUID"),
    ({"CUDA_VISIBLE_DEVICES": "GPU-aaaa"}, None, "cannot name the node"),  # a prefix CUDA takes, NVML does not
])
def test_the_gpus_node_comes_from_cuda_visible_devices_through_nvml_or_every_node_is_bound(env, minors, why):
    from pipeline.sandbox.plan import visible_gpu_minors

    nvml = FakeNvml({"GPU-aaaa-1111": 5, "GPU-bbbb-2222": 6, "3": 3})
    got, reason = visible_gpu_minors(env, nvml)
    assert got == minors and why in reason, (got, reason)
    assert nvml.closed or not env.get("CUDA_VISIBLE_DEVICES", "").startswith("GPU-")


# ---- the GPU's settings are the host's ----

_GPU_SETTINGS = """
    import ctypes, json
    nvml = ctypes.CDLL("libnvidia-ml.so.1")
    out = {"init": nvml.nvmlInit_v2()}
    if out["init"] == 0:
        h = ctypes.c_void_p()
        nvml.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(h))
        a, b = ctypes.c_uint(), ctypes.c_uint()
        # Each setting set to the value it has: a success changes nothing, and says the process could change it.
        if nvml.nvmlDeviceGetComputeMode(h, ctypes.byref(a)) == 0:
            out["compute_mode"] = nvml.nvmlDeviceSetComputeMode(h, a.value)
        if nvml.nvmlDeviceGetPersistenceMode(h, ctypes.byref(a)) == 0:
            out["persistence_mode"] = nvml.nvmlDeviceSetPersistenceMode(h, a.value)
        if nvml.nvmlDeviceGetApplicationsClock(h, 2, ctypes.byref(a)) == 0 and \\
                nvml.nvmlDeviceGetApplicationsClock(h, 0, ctypes.byref(b)) == 0:
            out["application_clocks"] = nvml.nvmlDeviceSetApplicationsClocks(h, a.value, b.value)
    print(json.dumps(out))
"""
NVML_SUCCESS = 0


@pytest.mark.gpu
@pytest.mark.parametrize("isolate", [True, False], ids=["isolated", "plain"])
def test_a_sandbox_cannot_change_the_gpus_settings_for_the_next_evaluation(isolate):
    """Compute mode, persistence and application clocks are the device's, kept from one process to
    the next: a submission that could set them could slow the next evaluation's baseline. Through NVML from
    inside a CUDA sandbox (its own uid, no capabilities) every setter is refused; from a plain process of
    root's the same calls succeed (each sets the value already there, so nothing changes): the sandbox is
    what stops them."""
    if os.geteuid() != 0:
        pytest.skip("isolation needs root")
    code, out, _ = run(_GPU_SETTINGS, policy=Policy(isolate=isolate), device="cuda")
    assert code == 0, out
    got = last_json(out)
    tried = {k: v for k, v in got.items() if k != "init"}
    if isolate:
        assert NVML_SUCCESS not in tried.values(), got
    else:
        assert got["init"] == NVML_SUCCESS and tried.get("compute_mode") == NVML_SUCCESS, got
