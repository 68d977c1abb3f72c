"""`python -m pipeline sandbox-check [--device cuda]`: a live probe of the sandbox on this machine, one line per
check (the runner's setup runs it before a runner registers; RUNBOOK).
"""

from __future__ import annotations

import os
import secrets
import select
import sys
import time
from pathlib import Path

from pipeline.sandbox import Policy, Sandbox, SandboxError, availability
from pipeline.sandbox.inside import SCRATCH

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
                "name": torch.cuda.get_device_name(0),
                "nodes": sorted(n for n in os.listdir("/dev") if n.startswith("nvidia"))}
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
    pkg = Path(__file__).resolve().parents[1]  # pipeline/
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
    for k in ("LD_LIBRARY_PATH", "CUDA_HOME", "CUDA_PATH", "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER"):
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
