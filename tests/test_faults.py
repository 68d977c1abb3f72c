"""The fault matrix (issue 15): every way a submission can break the runner fails alone, and the next
evaluation on the same runner is unaffected.

Each row runs a faulty submission through the real evaluator (CPU rows on the CPU with the smoke model;
GPU rows marked `gpu`, on the H200), checks the status and message the competitor sees, that nothing of
its sandbox is left, that the runner's own health check passes (the time that takes is the row's
recovery), then evaluates an honest submission in the same process and compares its medians with a
clean run measured in this session. The submissions are the fixtures, the exploit corpus
(tests/exploits/) where a cheat already is the fault, and tests/faults/ for the rest. Then: each limit
of competition.toml [limits] crossed, and `python -m pipeline runner health`: its decisions on recorded
readings, its CPU path for real, and on a GPU the real thing.

A table of what was measured (each fault's evaluation time, the recovery, the honest run's median over
the clean one) is printed at the end of this module's run.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from loopback import LoopbackServer
from pipeline import result, runner, sandbox
from pipeline.kernel.evaluate import WALL_CLOCK_LIMITS, BaselineFailure, Limits, Options, evaluate
from pipeline.problems import load_problem

ROOT = Path(__file__).resolve().parent.parent
FAULTS = ROOT / "tests" / "faults"
EXPLOITS = ROOT / "tests" / "exploits"
FIX = ROOT / "tests" / "fixtures" / "submissions"
TEMPLATE = ROOT / "problems" / "muse_bf16_proj" / "template.py"
PROJ = load_problem("muse_bf16_proj")
HAS_CUDA = torch.cuda.is_available()
ISOLATED, NOT_ISOLATED_WHY = sandbox.availability()
CPU = {"device": "cpu", "model": "smoke"}
# The honest evaluation after each fault: one workload timed (each costs seconds on the CPU).
HONEST = {"seeds": 1, "timing": True, "shapes": ["M1"]}
# On the GPU the honest run is scored as the band was measured (every shape, the official seed count:
# honest_gpu_run): one seed of M1 alone strayed 0.5% from the clean run's score after faults and without
# (0.995-1.001 on the H200, the clean run 0.999), five times the band of the whole score.
# A fault needs one shape and one call to show itself; short limits where it hangs.
FAULT = {"seeds": 1, "timing": False, "shapes": ["M1"]}
HANGS = Limits(compile=60, first_call=2, call=2, total=120)
BOUNDS = runner.load_bounds()

MEASURED: dict[str, dict[str, Any]] = {}


@pytest.fixture(scope="module", autouse=True)
def _print_what_was_measured(request):
    yield
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is None or not MEASURED:
        return
    with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
        _write_measured(reporter)


def _write_measured(reporter) -> None:
    reporter.write_line("")
    reporter.write_line("tests/test_faults.py, measured here: the faulty evaluation's wall time, the recovery "
                        "(from its end until the health check passed) and the honest run's M1 median over the clean "
                        "run's (a noisy 2-core CPU: only a gross bound is asserted)")
    for name, m in MEASURED.items():
        reporter.write_line(f"  {name:32s} " + "  ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                                       for k, v in m.items()))


# ---- what the matrix needs ----


def message(doc: dict) -> str:
    """What the competitor reads: the error's message, or the flags' on a passed result."""
    parts = [doc["error"]["message"]] if doc.get("error") else []
    return " | ".join(parts + [f"{f['code']}: {f['message']}" for f in doc["flags"]])


def processes_of_uid(uid: int) -> list[int]:
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            text = Path(f"/proc/{entry}/status").read_text()
        except OSError:
            continue
        line = next((x for x in text.splitlines() if x.startswith("Uid:")), "")
        if str(uid) in line.split()[1:]:
            found.append(int(entry))
    return found


def ours(readings: dict) -> dict:
    """The readings with other evaluations' live sandboxes left out: other test sessions share this
    machine. A sandbox of this process, or one whose evaluator is gone, stays in."""
    mine = copy.deepcopy(readings)
    mine["host"]["sandbox_processes"] = [
        p for p in mine["host"]["sandbox_processes"]
        if p.get("evaluator") in (None, os.getpid()) or not p.get("evaluator_alive")]
    return mine


def until_healthy(device: str, ignore: set[int] = frozenset(), within: float = 60.0) -> tuple[float, dict]:
    """Seconds until the runner's health check passes (the next evaluation could start), and its last verdict."""
    t0 = time.monotonic()
    while True:
        verdict = runner.decide(ours(runner.gather(device, BOUNDS, ignore)), BOUNDS)
        if verdict["healthy"] or time.monotonic() - t0 > within:
            return time.monotonic() - t0, verdict
        time.sleep(0.2)


def honest_cpu_run() -> dict:
    """The honest evaluation on the CPU (whatever load the machine is under, timing noise is no verdict there)."""
    return evaluate(TEMPLATE, PROJ, Options(**CPU, **HONEST))


def m1_median(doc: dict) -> float:
    (entry,) = [p for p in doc["performance"] if p["workload"] == "M1"]
    return entry["median_us"]


@pytest.fixture(scope="module")
def clean_cpu() -> dict:
    """A clean honest run, measured in this session before any fault: what the runs after faults are
    compared with."""
    doc = honest_cpu_run()
    assert doc["status"] == "passed", message(doc)
    MEASURED["clean run (cpu)"] = {"median_us": m1_median(doc)}
    return doc


CLEAN_GPU_RUNS = 3


def honest_gpu_run(out: Path) -> dict:
    """The honest evaluation on the GPU as the bench job runs one: `python -m pipeline evaluate --device
    cuda` in a process of its own (every shape, the official seed count), its --json read back. This test
    process holds a CUDA context of its own once it has evaluated a fault in-process (the rows need their
    own limits); the honest runs never share it, so what they measure is what the next official
    evaluation on this GPU would meet."""
    proc = _cli("evaluate", str(TEMPLATE), "--problem", PROJ.name, "--device", "cuda", "--json", str(out),
                timeout=600)
    assert out.is_file(), f"the honest evaluation wrote no result (exit {proc.returncode}): {proc.stderr[-2000:]}"
    doc = json.loads(out.read_text())
    assert proc.returncode == 0 and doc["status"] == "passed", message(doc) or proc.stderr[-2000:]
    assert {c["seeds"] for c in doc["correctness"]} == {PROJ.official_seeds}, "not the official seed count"
    return doc


@pytest.fixture(scope="module")
def clean_gpu(tmp_path_factory) -> dict:
    """CLEAN_GPU_RUNS honest runs before any fault, each in its own process: their median score is what
    a run after a fault is compared with, and their spread (the largest distance of one from that median)
    is how far an honest score strays on this GPU when nothing is wrong, measured in this session rather
    than assumed."""
    docs = []
    tmp = tmp_path_factory.mktemp("clean")
    for i in range(CLEAN_GPU_RUNS):
        docs.append(honest_gpu_run(tmp / f"clean{i}.json"))
    scores = sorted(d["score"]["speedup"] for d in docs)
    mid = scores[len(scores) // 2]
    doc = next(d for d in docs if d["score"]["speedup"] == mid)
    spread = max(abs(x / mid - 1) for x in scores)
    MEASURED["clean runs (cuda)"] = {"median_us": m1_median(doc), "speedup": mid, "spread": spread,
                                     "scores": " ".join(f"{x:.4f}" for x in scores)}
    return {**doc, "clean_spread": spread}


@pytest.fixture(scope="module")
def known_gpu_processes(clean_gpu) -> set[int]:
    """The GPU's processes once the clean run is over (this test process among them, in whatever pid
    numbering NVML uses here): none of them is a fault's leftover."""
    readings = runner.gather("cuda", BOUNDS)
    return {p["pid"] for d in readings["gpu"]["devices"] for p in (d.get("processes") or [])}


# ---- the rows ----


def fork_bomb(tmp: Path) -> Path:
    """tests/exploits/fork_bomb.py as a submission: its bomb, wide enough to reach the sandbox's process
    limit, set off inside custom_kernel once the answer is computed."""
    src = (EXPLOITS / "fork_bomb.py").read_text()
    tail = 'bomb(0)\nprint("bomb done", flush=True)\ntime.sleep(600)\n'
    assert src.endswith(tail) and "WIDTH, DEPTH = 6, 3" in src, "tests/exploits/fork_bomb.py changed: update this row"
    path = tmp / "fork_bomb.py"
    path.write_text(src[: -len(tail)].replace("WIDTH, DEPTH = 6, 3", "WIDTH, DEPTH = 64, 3") + textwrap.dedent("""
        def custom_kernel(inputs):
            out = inputs["x"] @ inputs["w"].T
            bomb(0)
            return out
    """))
    return path


SERVERS: dict[str, LoopbackServer] = {}


def network(tmp: Path) -> Path:
    server = SERVERS["network"] = LoopbackServer()
    path = tmp / "network_exfiltration.py"
    path.write_text((EXPLOITS / "network_exfiltration.py").read_text().replace("PORT = 0", f"PORT = {server.port}"))
    return path


def killed_count(doc: dict) -> int:
    (flag,) = [f for f in doc["flags"] if f["code"] == "detached_processes"]
    return int(flag["message"].split()[0])


def check_fork_bomb(doc: dict) -> None:
    # Unbounded, the bomb would make 64 + 64**2 + 64**3 processes. The uid's processes and threads are
    # capped at the limit (459 of 512 here; the worker's own threads, torch's among them, take the rest,
    # more of them on a machine with more cores).
    limit = sandbox.Limits().processes
    assert limit // 2 <= killed_count(doc) < limit, message(doc)


def check_network(doc: dict) -> None:
    server = SERVERS.pop("network")
    server.close()
    assert server.hits == [], "the submission reached a server on the runner's loopback"


@dataclass
class Row:
    name: str
    submission: Callable[[Path], Path]
    status: str
    says: tuple[str, ...]  # in the message the competitor reads (the error's, or the flags' when passed)
    options: dict = field(default_factory=dict)
    isolated: bool = False  # meaningful only in the sandbox (plain mode would fill the host's disk, ...)
    check: Callable[[dict], None] | None = None
    marks: tuple = ()
    cli: bool = False  # also through the CLI: its exit code and --json (a few rows: each costs a process)


def at(folder: Path, name: str) -> Callable[[Path], Path]:
    return lambda tmp: folder / name


ROWS = [
    Row("segfault", at(FIX, "segfault.py"), "runtime_error", ("killed by SIGSEGV", "a call of custom_kernel",
        "segmentation fault", "python -m pipeline evaluate"), cli=True),
    Row("os._exit", at(FIX, "os_exit.py"), "runtime_error", ("exited with code 0", "must return its output")),
    Row("infinite Python loop", at(FIX, "infinite_loop.py"), "timeout",
        ("did not answer within 2 s", "a call of custom_kernel", "[limits.wall_clock]"), {"limits": HANGS}),
    Row("SIGTERM-ignoring sleep", at(FAULTS, "ignores_sigterm.py"), "timeout",
        ("did not answer within 2 s", "its processes were killed"), {"limits": HANGS}),
    Row("fork bomb", fork_bomb, "passed", ("were killed with its sandbox",), isolated=True, check=check_fork_bomb),
    Row("host memory exhaustion", at(FAULTS, "host_memory_growth.py"), "runtime_error", ("can't allocate memory",),
        check=lambda doc: doc["error"]["where"]["file"] == "host_memory_growth.py" or pytest.fail(str(doc["error"]))),
    Row("output flood", at(EXPLOITS, "output_flood.py"), "passed", ()),
    Row("filling the scratch disk", at(FAULTS, "fill_the_scratch.py"), "runtime_error", ("No space left on device",),
        # a 64 MiB scratch instead of the configured 16 GiB: a tmpfs is memory, and this machine is shared
        {"sandbox": sandbox.Policy(limits=sandbox.Limits(scratch_bytes=64 << 20))}, isolated=True,
        check=lambda doc: doc["error"]["where"]["line"] == 12 or pytest.fail(str(doc["error"]))),
    Row("opening every file descriptor", at(FAULTS, "open_every_file.py"), "runtime_error",
        # (4096, the configured limit, unless the host's own hard limit is lower)
        ("file descriptors it may open", "[limits.sandbox] open_files", "close the files"), {"seeds": 2}),
    Row("a network attempt", network, "passed", ("network:",), isolated=True, check=check_network),
    Row("a daemon left running", at(EXPLOITS, "escape_process_group.py"), "passed",
        ("1 process(es) the submission left running were killed",), cli=True),
]

GPU_ROWS = [
    Row("GPU memory exhaustion", at(FAULTS, "gpu_memory_exhaustion.py"), "runtime_error", ("OutOfMemoryError",)),
    Row("GPU memory held past the call", at(FAULTS, "gpu_memory_held.py"), "runtime_error",
        ("could not allocate GPU memory", "held the GPU's memory"), {"seeds": 2}),
    Row("illegal memory access", at(FAULTS, "illegal_memory_access.py"), "runtime_error", ("CUDA error",)),
    Row("a kernel that never returns", at(FAULTS, "device_infinite_loop.py"), "timeout",
        # Triton compiles at the first call: time for that, then the hang
        ("did not answer within 30 s", "a call of custom_kernel"), {"limits": Limits(compile=60, first_call=30, call=30)}),
]


def _run_fault(row: Row, tmp_path: Path, device_options: dict) -> tuple[dict, float]:
    if row.isolated and not ISOLATED:
        pytest.skip(f"meaningful only in the sandbox, which this machine cannot give: {NOT_ISOLATED_WHY}")
    sub = row.submission(tmp_path)
    t0 = time.monotonic()
    doc = evaluate(sub, PROJ, Options(**{**FAULT, **device_options, **row.options}))
    fault_s = time.monotonic() - t0
    result.validate(doc)
    said = message(doc)
    assert doc["status"] == row.status, said
    for needle in row.says:
        assert needle in said, f"{needle!r} not in: {said}"
    if doc["status"] != "passed":
        assert doc["error"]["shape"] == "M1", doc["error"]  # where: the shape, and in the message the phase
    if row.check is not None:
        row.check(doc)
    described = doc["environment"]["sandbox"]["submission"]
    if described["isolation"] == "namespaces":
        assert processes_of_uid(described["uid"]) == [], "a process of the fault's sandbox is still alive"
    return doc, fault_s


# the default tier's slice: a crash, a hang, a process left behind; the heavy tier runs every row
FAST_ROWS = {"segfault", "infinite Python loop", "a daemon left running"}


@pytest.mark.parametrize("row", [pytest.param(r, id=r.name, marks=(*r.marks, *(() if r.name in FAST_ROWS else
                                                                                (pytest.mark.heavy,))))
                                 for r in ROWS])
def test_a_fault_fails_alone_and_the_next_evaluation_is_unaffected(row, clean_cpu, tmp_path):
    doc, fault_s = _run_fault(row, tmp_path, CPU)
    recovery_s, verdict = until_healthy("cpu")
    assert verdict["healthy"], verdict["reasons"]
    honest = honest_cpu_run()
    assert honest["status"] == "passed", message(honest)
    # A fault's leftover is looked for where it would be (the health check above: no process of a sandbox's
    # uid, no GPU memory held; _run_fault: none of the fault's uid). The honest run's median against the clean
    # run's is a measurement, not a check: two workers share this machine's two cores with whatever else runs
    # on it, and a median taken minutes apart strays by tens of percent (3.015x once, on a loaded machine).
    # What one run measures of itself holds under any load: the template against the baseline, interleaved.
    ratio = m1_median(honest) / m1_median(clean_cpu)
    MEASURED[row.name] = {"fault_s": fault_s, "recovery_s": recovery_s, "honest/clean": ratio}
    speedup = honest["score"]["speedup"]
    assert 1 / 3 <= speedup <= 3, f"after {row.name} the honest template scored {speedup:.2f}x against the baseline"


@pytest.mark.gpu
@pytest.mark.parametrize("row", [pytest.param(r, id=r.name, marks=r.marks) for r in GPU_ROWS])
def test_a_gpu_fault_fails_alone_and_the_gpu_comes_back(row, clean_gpu, known_gpu_processes, tmp_path):
    doc, fault_s = _run_fault(row, tmp_path, {"device": "cuda"})
    recovery_s, verdict = until_healthy("cuda", known_gpu_processes)
    assert verdict["healthy"], verdict["reasons"]
    honest = honest_gpu_run(tmp_path / "honest.json")
    band = PROJ.run_to_run
    score = honest["score"]["speedup"] / clean_gpu["score"]["speedup"]
    ratio = m1_median(honest) / m1_median(clean_gpu)
    MEASURED[row.name] = {"fault_s": fault_s, "recovery_s": recovery_s, "score/clean": score, "honest/clean": ratio}
    # The band is measured on scores (the baseline against itself, docs/BENCHMARKS.md "Run to run"): each
    # of the two runs may stray by it from the truth; or by the clean runs' own spread in this session
    # where that is wider (the template is not the baseline's code: 0.9987-1.0020 over three runs on the
    # H200, in this test process; each run now has its own process, as the bench job's). A median alone moves more
    # from process to process (where its graph's memory lands: 0.2-0.4%, up to 3.9% at M=1), so it is
    # held to that spread.
    allowed = 2 * max(band, clean_gpu["clean_spread"])
    assert abs(score - 1) <= allowed, (f"after {row.name} the score is {score:.4f}x the clean runs' (band {band}, "
                                       f"clean spread {clean_gpu['clean_spread']:.4f})")
    assert abs(ratio - 1) <= 0.05, f"after {row.name} the M1 median is {ratio:.4f}x the clean run's"


def _cli(*args: str, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=None if env is None else {**os.environ, **env})


@pytest.mark.parametrize("row", [pytest.param(r, id=r.name, marks=r.marks) for r in ROWS if r.cli])
def test_the_cli_exits_with_the_verdict_and_writes_the_result(row, tmp_path):
    """The evaluator's exit code after a fault: 1 for a failed verdict, 0 for one that passed anyway (a
    sample of the rows: the others' verdicts are the same evaluate() behind the same CLI)."""
    if row.isolated and not ISOLATED:
        pytest.skip(NOT_ISOLATED_WHY)
    out = tmp_path / "result.json"
    args = ["--seeds", str(row.options.get("seeds", 1)), "--shape", "M1", "--no-timing"]
    proc = _cli("evaluate", str(row.submission(tmp_path)), "--problem", PROJ.name, "--device", "cpu", "--model",
                "smoke", *args, "--json", str(out))
    if row.check is check_network:
        check_network({})
    assert proc.returncode == (0 if row.status == "passed" else 1), proc.stderr[-2000:]
    doc = result.read(out)
    assert doc["status"] == row.status
    for needle in row.says:
        assert needle in message(doc)


def _descendants(pid: int) -> set[int]:
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                kids = [int(k) for k in (task / "children").read_text().split()]
            except OSError:
                continue
            todo += [k for k in kids if k not in out]
            out.update(kids)
    return out


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return False


def test_a_cancelled_evaluation_kills_a_submission_that_ignores_sigterm():
    """The runner cancels a job with SIGTERM to the evaluator: it exits 143 and the submission, which
    ignores SIGTERM itself, dies with it (SIGKILL of its whole sandbox, never a polite request)."""
    proc = subprocess.Popen([sys.executable, "-m", "pipeline", "evaluate", str(FAULTS / "ignores_sigterm.py"),
                             "--problem", PROJ.name, "--device", "cpu", "--seeds", "1", "--no-timing"],
                            cwd=ROOT, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    try:
        line = proc.stderr.readline()
        assert "loaded muse_bf16_proj" in line, line
        time.sleep(0.5)  # inside the endless call now
        tree = _descendants(proc.pid)
        assert tree, "the evaluation should have started its worker"
        t0 = time.monotonic()
        proc.terminate()
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
        while any(_alive(p) for p in tree) and time.monotonic() - t0 < 10:
            time.sleep(0.05)
        left = [p for p in tree if _alive(p)]
        MEASURED["SIGTERM of the evaluator"] = {"until_all_gone_s": time.monotonic() - t0}
        assert left == [], "processes of the cancelled evaluation are still alive"
    finally:
        proc.kill()
        proc.stderr.close()


# ---- each limit of competition.toml [limits], crossed ----


def _sleeps(tmp: Path, body: str) -> Path:
    path = tmp / "sleeps.py"
    path.write_text(textwrap.dedent(body))
    return path


LIMIT_CASES = {
    # [limits.sandbox] cpu_seconds: a busy loop under a 4 s CPU budget and a wall clock that never comes
    "cpu_seconds": (lambda tmp: FIX / "infinite_loop.py",
                    {"sandbox": sandbox.Policy(limits=sandbox.Limits(cpu_seconds=4))},
                    "runtime_error", ("killed by SIGXCPU", "it used up its CPU time, 4 s", "cpu_seconds")),
    # [limits.sandbox] file_size: Python ignores SIGXFSZ, so the write itself fails
    "file_size": (lambda tmp: _sleeps(tmp, """
                      import os, tempfile
                      def custom_kernel(inputs):
                          with open(os.path.join(tempfile.gettempdir(), "big"), "wb") as f:
                              f.write(b"x" * (3 << 20))
                  """), {"sandbox": sandbox.Policy(limits=sandbox.Limits(file_size=1 << 20))},
                  "runtime_error", ("File too large",)),
    # [limits.sandbox] shm: the sandbox's own /dev/shm, a tmpfs of that size
    "shm": (lambda tmp: _sleeps(tmp, """
                def custom_kernel(inputs):
                    with open("/dev/shm/big", "wb") as f:
                        f.write(b"x" * (3 << 20))
            """), {"sandbox": sandbox.Policy(limits=sandbox.Limits(shm_bytes=1 << 20))},
            "runtime_error", ("No space left on device",)),
    # [limits.wall_clock] compile: an import that never ends
    "compile": (lambda tmp: _sleeps(tmp, """
                    import time
                    time.sleep(3600)
                """), {"limits": Limits(compile=2, first_call=60, call=60)},
                "timeout", ("within 2 s, the limit for importing the submission",)),
    # [limits.wall_clock] call: the second call hangs (the first had first_call's limit)
    "call": (lambda tmp: _sleeps(tmp, """
                 import time
                 calls = []
                 def custom_kernel(inputs):
                     calls.append(1)
                     if len(calls) > 1:
                         time.sleep(3600)
                     return inputs["x"] @ inputs["w"].T
             """), {"seeds": 2, "limits": Limits(compile=60, first_call=60, call=2)},
             "timeout", ("within 2 s, the limit for a call of custom_kernel",)),
    # [limits.wall_clock] total: every call within its limit, the evaluation past its total
    "total": (lambda tmp: _sleeps(tmp, """
                  import time
                  def custom_kernel(inputs):
                      time.sleep(1)
                      return inputs["x"] @ inputs["w"].T
              """), {"seeds": 20, "limits": Limits(compile=60, first_call=60, call=60, total=5)},
              "timeout", ("the evaluation's total of 5 s",)),
}
# The other limits are crossed by the matrix's rows and the sandbox's own tests (docs/SECURITY.md, "Faults"):
# memory (host memory exhaustion), processes (fork bomb), open_files (opening every file descriptor),
# scratch (filling the scratch disk), first_call (infinite Python loop); tests/test_sandbox.py crosses
# each rlimit at its lowest level, and core is checked there too (test_every_limit_is_set_inside).


@pytest.mark.parametrize("name", sorted(LIMIT_CASES))
def test_each_limit_is_enforced_by_the_evaluation(name, tmp_path):
    make, options, status, says = LIMIT_CASES[name]
    if "sandbox" in options and not ISOLATED and name not in ("file_size", "cpu_seconds"):
        pytest.skip(NOT_ISOLATED_WHY)
    doc = evaluate(make(tmp_path), PROJ, Options(**{**FAULT, **CPU, **options}))
    result.validate(doc)
    assert doc["status"] == status, message(doc)
    for needle in says:
        assert needle in message(doc), message(doc)


def test_the_limits_are_competition_toml_s(tmp_path):
    """Limits take their defaults from competition.toml [limits] (the values the spec and the earlier
    code had), strictly: a missing, unknown or malformed key is refused with its name, never defaulted."""
    sb = sandbox.Limits()
    assert sb == sandbox.Limits(**sandbox.sandbox_limits(sandbox.COMPETITION_TOML))
    assert (sb.cpu_seconds, sb.cpu_memory, sb.processes, sb.file_size, sb.open_files, sb.core, sb.scratch_bytes,
            sb.shm_bytes) == (3600, 8 << 30, 512, 16 << 30, 4096, 0, 16 << 30, 256 << 20)
    assert Limits() == Limits(compile=180, first_call=180, call=60, total=900)
    assert BOUNDS["kernel_n"] == 2048 and 0 < BOUNDS["min_free_gpu_memory"] <= 1

    text = sandbox.COMPETITION_TOML.read_text()
    changed = tmp_path / "competition.toml"
    changed.write_text(text.replace('processes = 512 ', 'processes = 64 ').replace('shm = "256 MiB"', 'shm = "1 GiB"'))
    got = sandbox.sandbox_limits(changed)
    assert got["processes"] == 64 and got["shm_bytes"] == 1 << 30
    for old, new, said in [
        ('open_files = 4096', 'open_file = 4096', "unknown key(s) open_file; missing key(s) open_files"),
        ('memory = "8 GiB"', 'memory = "8 GB"', 'memory must be a size such as "16 GiB"'),
        ('cpu_seconds = 3600', 'cpu_seconds = 0', "cpu_seconds must be a whole number of at least 1"),
        ('call = 60 ', 'call = -1 ', "[limits.wall_clock] call must be more than 0"),
        ('min_free_gpu_memory = 0.95', 'min_free_gpu_memory = 95', "min_free_gpu_memory must be a fraction"),
        ('"hw_slowdown", ', '"hw_slow", ', "bad_clock_reasons: unknown hw_slow"),
    ]:
        assert old in text, old
        changed.write_text(text.replace(old, new))
        with pytest.raises(sandbox.LimitsError) as caught:
            sandbox.sandbox_limits(changed)
            sandbox.load_limits("wall_clock", WALL_CLOCK_LIMITS, changed)
            runner.load_bounds(changed)
        assert said in str(caught.value) and "competition.toml [limits." in str(caught.value), str(caught.value)
    assert sandbox.sandbox_limits(tmp_path / "absent.toml") == {
        f: v for _, (_, v, f) in sandbox.SANDBOX_LIMITS.items()}  # the package without its checkout


# ---- `python -m pipeline runner health` ----

# Readings shaped like an idle, healthy H200's through NVML, as plain data.
H200 = {
    "device": "cuda",
    "host": {"sandbox_processes": [], "disk": [{"path": "/tmp", "free_bytes": 400 << 30, "total_bytes": 900 << 30}],
             "isolation": {"checked": False, "ok": None, "why": "not root (euid 1001)"}},
    "gpu": {"source": "nvml", "source_missing": None, "devices": [{
        "index": 0, "name": "NVIDIA H200", "uuid": "GPU-5a3e2f0c-1111-2222-3333-444455556666",
        "memory_total": 143771 << 20, "memory_free": 143220 << 20, "memory_source": "nvml",
        "processes": [{"pid": 4242, "used_bytes": 512 << 20, "ignored": True}],  # the checking process itself
        "kernel": {"n": 2048, "sum": BOUNDS["kernel_sum"], "sum_of_squares": BOUNDS["kernel_sum_of_squares"],
                   "median_ms": 0.31},
        "sm_clock_mhz": 1980, "sm_clock_max_mhz": 1980, "clock_reasons": ["sw_power_cap"], "temperature_c": 41,
        "ecc_uncorrected": 0}]},
}


def with_(readings: dict, **changes) -> dict:
    """A copy with `host__x`, `gpu0__x` (the first GPU's x) or a top-level key set."""
    out = copy.deepcopy(readings)
    for key, value in changes.items():
        where, _, name = key.rpartition("__")
        target = {"host": out["host"], "": out}.get(where) or out["gpu"]["devices"][0]
        target[name] = value
    return out


def test_healthy_readings_pass_with_every_check_ok():
    verdict = runner.decide(H200, BOUNDS)
    assert verdict["healthy"] and verdict["reasons"] == [], verdict
    states = {name: state for state, name, _ in verdict["checks"]}
    assert states == {"sandbox processes": "ok", "disk /tmp": "ok", "isolation": "skip", "gpu 0 kernel": "ok",
                      "gpu 0 memory": "ok", "gpu 0 processes": "ok", "gpu 0 clocks": "ok",
                      "gpu 0 clock reasons": "ok", "gpu 0 temperature": "ok", "gpu 0 ECC": "ok"}


SICK = {
    "a sandbox's process left": ({"host__sandbox_processes": [{"pid": 77, "uid": 1234567890, "command": "python3",
                                                              "evaluator": 70, "evaluator_alive": False}]},
                                 "sandbox processes: 1 process(es) of a sandbox's uid alive: pid 77 (python3, uid "
                                 "1234567890, started by evaluator pid 70, gone)"),
    "no room on disk": ({"host__disk": [{"path": "/tmp", "free_bytes": 1 << 30, "total_bytes": 900 << 30}]},
                        "disk /tmp: 1.0 GiB free"),
    "isolation refused": ({"host__isolation": {"checked": True, "ok": False, "why": "unshare: Operation not permitted"}},
                          "isolation: the sandbox cannot isolate a submission here: unshare"),
    "a wrong answer": ({"gpu0__kernel": {"n": 2048, "sum": BOUNDS["kernel_sum"] + 1,
                                         "sum_of_squares": BOUNDS["kernel_sum_of_squares"], "median_ms": 0.3}},
                       "gpu 0 kernel: wrong answer"),
    "an answer that changes under load": ({"gpu0__kernel": {**H200["gpu"]["devices"][0]["kernel"], "unstable": {
        "sum": 1, "sum_of_squares": 1}}}, "changed under load"),
    "a slow kernel": ({"gpu0__kernel": {**H200["gpu"]["devices"][0]["kernel"], "median_ms": 2.5}},
                      "right answer, but 2.500 ms per matmul"),
    "a kernel that fails": ({"gpu0__kernel": {"error": "RuntimeError: CUDA error: an illegal memory access was encountered"}},
                            "the known kernel failed: RuntimeError: CUDA error"),
    "memory still held": ({"gpu0__memory_free": 20 << 30}, "gpu 0 memory: 20.0 GiB free of 140.4 GiB"),
    "a leftover process on the GPU": ({"gpu0__processes": [{"pid": 4242, "used_bytes": 1 << 30, "ignored": True},
                                                           {"pid": 999, "used_bytes": 100 << 30, "ignored": False}]},
                                      "gpu 0 processes: 1 process(es) on the GPU: pid 999 (100.0 GiB)"),
    "clocks locked low": ({"gpu0__sm_clock_mhz": 345}, "gpu 0 clocks: SM clock 345 MHz under the kernel, of 1980"),
    "thermal slowdown": ({"gpu0__clock_reasons": ["hw_thermal_slowdown", "sw_power_cap"]},
                         "the GPU slows itself down: hw_thermal_slowdown"),
    "too hot": ({"gpu0__temperature_c": 91}, "gpu 0 temperature: 91 C (at most 85 C)"),
    "uncorrected ECC errors": ({"gpu0__ecc_uncorrected": 3}, "gpu 0 ECC: 3 uncorrected"),
    "CUDA broken": ({"gpu": {"source": None, "error": "CUDA is not usable here"}}, "gpu: CUDA is not usable here"),
    "no GPU where one is required": ({"gpu": None, "gpu_skipped": "no NVIDIA GPU on this machine"},
                                     "gpu: --device cuda, but no GPU was checked"),
}


@pytest.mark.parametrize("case", sorted(SICK))
def test_each_sickness_is_a_reason_that_says_what_is_wrong(case):
    changes, said = SICK[case]
    verdict = runner.decide(with_(H200, **changes), BOUNDS)
    assert not verdict["healthy"]
    assert len(verdict["reasons"]) == 1 and said in verdict["reasons"][0], verdict["reasons"]


def test_every_reason_is_given_at_once():
    everything = {}
    for case, (changes, _) in SICK.items():
        if case not in ("CUDA broken", "no GPU where one is required", "a kernel that fails",
                        "an answer that changes under load", "a slow kernel"):
            everything.update(changes)
    verdict = runner.decide(with_(H200, **everything), BOUNDS)
    assert len(verdict["reasons"]) == 10, verdict["reasons"]


def test_what_cannot_be_read_is_skipped_and_said():
    blind = with_(H200, gpu0__processes=None, gpu0__temperature_c=None, gpu0__sm_clock_mhz=None,
                  gpu0__clock_reasons=None, gpu0__ecc_uncorrected=None)
    blind["gpu"].update(source=None, source_missing="pynvml: ModuleNotFoundError; nvidia-smi is not on PATH")
    verdict = runner.decide(blind, BOUNDS)
    assert verdict["healthy"], verdict["reasons"]
    assert any("neither NVML nor nvidia-smi answered" in s for s in verdict["skipped"])
    assert len(verdict["skipped"]) == 7  # isolation, nvml, processes, clocks, reasons, temperature, ECC
    cpu = {"device": "auto", "host": H200["host"], "gpu": None, "gpu_skipped": "no NVIDIA GPU on this machine"}
    verdict = runner.decide(cpu, BOUNDS)
    assert verdict["healthy"] and any(s.startswith("gpu: GPU checks skipped: no NVIDIA GPU") for s in verdict["skipped"])


def test_the_known_kernel_s_answer_is_the_data():
    """The checksum in competition.toml is what the matmul gives, computed here on the CPU (exact there
    as on any GPU: small integers, float32)."""
    got = runner.run_known_kernel(BOUNDS["kernel_n"], "cpu")
    assert (got["sum"], got["sum_of_squares"]) == (BOUNDS["kernel_sum"], BOUNDS["kernel_sum_of_squares"])
    a, b = runner.known_matmul(64, "cpu")
    assert torch.equal((a.double() @ b.double()), (a @ b).double())  # exact: float32 loses nothing
    assert a.abs().max() == 2 and b.abs().max() == 3


def test_runner_health_on_this_machine(tmp_path):
    """The real CPU path: the sandbox processes, the disk, isolation; the GPU checks said to be skipped.
    Its verdict is decide()'s on the readings it wrote (another session's evaluation may be alive on this
    shared machine: never one of this process's)."""
    out = tmp_path / "health.json"
    proc = _cli("runner", "health", "--json", str(out), timeout=120)
    doc = json.loads(out.read_text())
    assert proc.returncode == (0 if doc["healthy"] else 1), proc.stdout + proc.stderr
    assert runner.decide(doc["readings"], doc["bounds"]) == {k: doc[k] for k in ("healthy", "reasons", "skipped", "checks")}
    assert not [p for p in doc["readings"]["host"]["sandbox_processes"] if p.get("evaluator") == os.getpid()]
    if not HAS_CUDA and not runner.gpu_present():
        assert "skip  gpu: GPU checks skipped: no NVIDIA GPU on this machine" in proc.stdout
    assert runner.decide(ours(doc["readings"]), doc["bounds"])["healthy"], doc["reasons"]
    usage = _cli("runner", "health", "--json", str(tmp_path / "nowhere" / "h.json"))
    assert usage.returncode == 2 and "does not exist" in usage.stderr
    assert _cli("runner", "health", "--device", "tpu").returncode == 2
    if not HAS_CUDA:  # as bench.yml runs it: no GPU is a failure, said loudly to the organizer on GitHub
        required = _cli("runner", "health", "--device", "cuda", timeout=120, env={"GITHUB_ACTIONS": "true"})
        assert required.returncode == 1 and "FAIL  gpu:" in required.stdout and "UNHEALTHY" in required.stderr
        assert "::error title=runner unhealthy::gpu: " in required.stdout


def test_a_sandbox_left_alive_is_found_and_named():
    if not ISOLATED:
        pytest.skip(NOT_ISOLATED_WHY)
    r, w = os.pipe()
    sb = sandbox.Sandbox([sys.executable, "-I", "-c", "import time; print('up', flush=True); time.sleep(600)"],
                         policy=sandbox.Policy(isolate=True), readable=[], env={}, stdout=w, stderr=w)
    os.close(w)
    try:
        assert os.read(r, 10).startswith(b"up")
        found = [p for p in runner.sandbox_processes() if p["uid"] == sb.uid]
        assert found and found[0]["evaluator"] == os.getpid() and found[0]["evaluator_alive"], found
        verdict = runner.decide(ours(runner.gather("cpu", BOUNDS)), BOUNDS)
        assert not verdict["healthy"] and f"uid {sb.uid}, started by evaluator pid {os.getpid()}" in verdict["reasons"][0]
    finally:
        sb.kill()
        os.close(r)
    assert not [p for p in runner.sandbox_processes() if p["uid"] == sb.uid]


FAKE_SMI = r'''#!/bin/sh
# nvidia-smi as an H200 answers these queries (recorded shapes), for the parser
case "$1" in
  --query-gpu=index,uuid,name,memory.total,memory.free) echo "0, GPU-abc, NVIDIA H200, 143771, 143220";;
  --query-compute-apps=gpu_uuid,pid,used_memory) echo "GPU-abc, 4242, 512"; echo "GPU-other, 17, 100";;
  --query-gpu=uuid,clocks.sm,clocks_event_reasons.active) echo "GPU-abc, 1980, 0x0000000000000044";;
  --query-gpu=uuid,clocks.max.sm,temperature.gpu,ecc.errors.uncorrected.volatile.total) echo "GPU-abc, 1980, 41, [N/A]";;
  *) echo "unknown query $1" >&2; exit 2;;
esac
'''


def test_nvidia_smi_s_answers_are_read_as_nvml_s(tmp_path, monkeypatch):
    """Where pynvml is not installed the readings come from `nvidia-smi --query-*`: MiB, hex reason
    masks and [N/A] read right (a recorded H200's answers; the real tool runs in the GPU test)."""
    smi = tmp_path / "nvidia-smi"
    smi.write_text(FAKE_SMI)
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    reader = runner.NvidiaSmi()
    (dev,) = reader.devices()
    assert dev == {"nvml_index": 0, "uuid": "GPU-abc", "name": "NVIDIA H200", "memory_total": 143771 << 20,
                   "memory_free": 143220 << 20, "processes": [{"pid": 4242, "used_bytes": 512 << 20}]}
    load = reader.under_load(dev)
    assert load == {"sm_clock_mhz": 1980, "clock_reasons_mask": 0x44}
    assert runner.reason_names(load["clock_reasons_mask"]) == ["sw_power_cap", "hw_thermal_slowdown"]
    assert reader.after(dev) == {"sm_clock_max_mhz": 1980, "temperature_c": 41, "ecc_uncorrected": None}


@pytest.mark.gpu
def test_the_real_health_check_on_the_gpu(tmp_path):
    """The H200 between two evaluations: every check ok (this test's own process, an ancestor of the
    check's, holds a CUDA context and is not a leftover). Prints the known kernel's median, from which
    competition.toml's kernel_max_ms is to be set."""
    import gc

    import torch

    # the GPU tests before this one ran in this process: their freed blocks stay cached by torch's allocator,
    # and NVML counts them as used (13 GiB of 80 after the official timings on an H100)
    gc.collect()
    torch.cuda.empty_cache()
    out = tmp_path / "health.json"
    proc = _cli("runner", "health", "--device", "cuda", "--json", str(out), timeout=300)
    doc = json.loads(out.read_text())
    devices = doc["readings"]["gpu"]["devices"]
    MEASURED["health check (cuda)"] = {"seconds": doc["seconds"], **{
        f"gpu{d['index']}_kernel_ms": d["kernel"].get("median_ms") for d in devices},
        "source": doc["readings"]["gpu"]["source"]}
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert all(state != "FAIL" for state, _, _ in doc["checks"])
    assert not [s for s in doc["skipped"] if s.startswith("gpu ")], doc["skipped"]  # NVML or nvidia-smi read all
