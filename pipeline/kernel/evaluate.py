"""Evaluate one kernel submission: the parent side, which judges.

The parent holds the problem's reference, the seeds and every expected output. Each target runs in
a worker process of its own (`worker.py`), started in the sandbox (`pipeline/sandbox/`): the
submission's worker holds its own code and the inputs it is handed, nothing else; the baseline is
loaded and timed in another worker the submission cannot reach. For every workload and test shape,
over several seeds, the parent makes the inputs in buffers it owns and shares with the submission's
worker, asks for one call, and judges on its own buffers: the output the worker copied back against
the reference, every input against the pristine copy it kept, the in-place outputs (a layer's cache)
where the call had to write them. It then times the workloads: the two workers' graphs in
interleaved blocks (B S B S), each block bounded by the parent's own clock, then the timed graph's
outputs on the parent's buffers, fresh values the parent wrote itself, and, once the submission's
whole process tree is gone, the baseline again on its own to show that nothing slowed it down
meanwhile. It never raises on anything a submission does: every failure becomes a status.
"""

from __future__ import annotations

import ast
import json
import math
import os
import platform
import secrets
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from pipeline import result as result_schema
from pipeline import sandbox
from pipeline.kernel import seeds as seedlib
from pipeline.kernel import timing
from pipeline.kernel import toolchains
from pipeline.kernel import transport
from pipeline.kernel.check import compare
from pipeline.kernel.child import (  # noqa: F401 - WORKER_STATUSES, WorkerTimeout: the worker's, named here too
    ADVICE, PHASES, WORKER_STATUSES, BaselineFailure, Child, ChildFailure, WorkerTimeout, record_failure, worker_status)
from pipeline.problems import Problem, Shape, baseline_identity, geomean, sources_sha256

CPU_CACHE_BYTES = 256 << 10  # a nominal cache for the CPU path's rotation and flush (CPU timings are unofficial)
# The bytes of one target's input sets at most (the parent keeps a pristine copy and each target a shared one):
# the sets of a timed graph, one a call, stop here even if a replay then lasts less than 1 ms. SET_BYTES a
# workload, and TOTAL_SET_BYTES over an evaluation's workloads: the baseline's sets of every workload are kept
# until its run alone at the end (muse_prefill_layer's seven workloads of 1.7 GB sets, four or five a workload at
# 8 GiB each, ran an H100 out of memory).
SET_BYTES = {"cuda": 8 << 30, "cpu": 256 << 20}
TOTAL_SET_BYTES = {"cuda": 24 << 30, "cpu": 1 << 30}
CPU_LEAST_SETS = 4
# About this many of the submission's timed blocks are checked ones, drawn at random (each block with the same
# chance, at most 1 in 5), and one more after sampling: the parent writes new values into an eighth of its input
# sets (at least 2) drawn at random first, and reads and judges every call's output after. New sets cost the parent
# their reference outputs (a GB-sized MoE set tens of ms), so their number is bounded, not a share of the blocks.
CHECKED_BLOCKS = 3
# A submission's blocks must grow by about a replay's claimed time per added replay (`timing.replay_fit`): below
# REPLAY_PROPORTION at the 95% upper bound its result is held for review, below REPLAY_UNTRUSTED its timings are
# not believed (runtime_error). An honest graph's ratio is 1 within its noise.
REPLAY_PROPORTION = 0.9
REPLAY_UNTRUSTED = 0.5


# [limits.wall_clock] key: (kind, built-in value); the spec's: compile and warm-up 180 s, 60 s per workload,
# 15 min in all.
WALL_CLOCK_LIMITS = {"compile": ("seconds", 180.0), "first_call": ("seconds", 180.0), "call": ("seconds", 60.0),
                     "total": ("seconds", 900.0)}
_WALL_CLOCK = {k: float(v) for k, v in sandbox.load_limits("wall_clock", WALL_CLOCK_LIMITS).items()}


@dataclass
class Limits:
    """Seconds per phase; the defaults are competition.toml's [limits.wall_clock]."""

    compile: float = _WALL_CLOCK["compile"]  # importing the submission
    first_call: float = _WALL_CLOCK["first_call"]  # the first call (compiles, autotunes); warm-up and capture
    call: float = _WALL_CLOCK["call"]  # every other call, and each timed block
    total: float = _WALL_CLOCK["total"]  # the whole evaluation
    source: str = "competition.toml [limits.wall_clock]"  # where these came from, named in a timeout's message


def _env_float(name: str, default: float) -> float:
    return float(os.environ.get(name, default))


@dataclass
class Options:
    device: str | None = None  # None: cuda if available, else cpu
    model: str | None = None  # None: full on cuda, smoke on cpu
    seeds: int | None = None  # None: the problem's official count on GPU, 3 on CPU
    secret: bytes | None = None  # set: official seeds; None: public seeds
    timing: bool = True
    shapes: list[str] | None = None  # restrict to these shape names (for debugging a submission)
    official: bool = False  # refuse to run unless the result can be official (GPU, full model, secret seeds, isolation)
    grant_read: list[Path] = field(default_factory=list)  # more paths the submission may read (benchmarks only)
    baseline: str = "ours"  # or "sglang": SGLang's own kernels, from the pinned source (reference/_sglang_baselines.py)
    competition: Path | None = None  # whose [baselines] pins an official evaluation's baseline; None: the repository's
    # The timing method's knobs; None takes the device's default (GPU: docs/TIMING.md; CPU: short, unofficial).
    max_timing_seconds: float | None = None  # per workload; GPU 10 s
    # Replays discarded first: an H200 that was idle runs memory-bound kernels up to 4% faster for
    # about a second while its power climbs (docs/BENCHMARKS.md, "Where the spread comes from").
    settle_seconds: float | None = None  # GPU $PIPELINE_TIMING_SETTLE_S or 1.5 s
    # Sampling lasts at least this long even once the interval is tight, so a workload's median
    # spans the GPU's slow swings (about 1.5% for half a second) instead of one of them.
    min_timing_seconds: float | None = None  # GPU $PIPELINE_TIMING_MIN_S or 2 s
    # Rotated bytes / L2. The spec's minimum is 5; 20 spreads the inputs over 4x as many pages,
    # which cut the process-to-process offset of a 24 us GEMV from about 1.1% to 0.4%.
    l2_multiple: float | None = None  # GPU $PIPELINE_TIMING_L2_MULTIPLE or 20
    min_samples: int | None = None  # per target and workload; GPU timing.MIN_SAMPLES
    max_sets: int | None = None  # calls (one input set each) of a timed graph at most; GPU timing.MAX_CALLS_PER_GRAPH
    # The baseline alone, once the submission is gone: its blocks this long per workload.
    alone_seconds: float | None = None
    min_accounted: float = 0.85  # reported GPU time / the parent's wall time of each target's blocks
    limits: Limits = field(default_factory=Limits)
    submission_meta: dict[str, Any] = field(default_factory=dict)
    sandbox: sandbox.Policy | None = None  # None: isolate where this host can
    progress: Callable[[str], None] | None = None  # one line per finished stage (the CLI: stderr)
    phase: Callable[[str], None] | None = None  # the stage that starts now ("checking M32"), for a heartbeat


def _resolved(opts: Options, device: str) -> Options:
    """The options with each timing knob set for the device."""
    gpu = device == "cuda"
    defaults = {
        "max_timing_seconds": 10.0 if gpu else 1.0,
        "settle_seconds": _env_float("PIPELINE_TIMING_SETTLE_S", 1.5) if gpu else 0.0,
        "min_timing_seconds": _env_float("PIPELINE_TIMING_MIN_S", 2.0) if gpu else 0.1,
        "l2_multiple": _env_float("PIPELINE_TIMING_L2_MULTIPLE", 20) if gpu else 20.0,
        "min_samples": timing.MIN_SAMPLES if gpu else 8,
        "max_sets": timing.MAX_CALLS_PER_GRAPH if gpu else 8,
        "alone_seconds": 1.0 if gpu else 0.2,
    }
    out = Options(**{**opts.__dict__})
    for name, value in defaults.items():
        if getattr(out, name) is None:
            setattr(out, name, value)
    return out


# A worker's reply may only choose between the two failures it can tell apart: its code did not load or
# compile, or it raised when called. Anything else it claims was written by a submission that patched
# the worker's reporter in its own process, and the parent's status for the phase stands.
def environment(device: str) -> dict[str, Any]:
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "harness_commit": _harness_commit(),
        # The runner's own statement (runner/README.md), from the evaluator's environment: no submission reaches it.
        "image_digest": toolchains.image_digest(),
        "toolchains": json.loads(json.dumps(toolchains.probe())),  # a copy: the probe is cached per process
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except Exception:  # noqa: BLE001 - triton is optional on a CPU machine
        env["triton"] = None
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, cuda=torch.version.cuda, sm_count=props.multi_processor_count)
        env.update(_nvml_facts())
    else:
        env["gpu"] = None
        env["cpu"] = platform.processor() or platform.machine()
    return env


def _nvml_facts() -> dict[str, Any]:
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        facts = {
            "gpu_uuid": pynvml.nvmlDeviceGetUUID(handle),
            "driver": pynvml.nvmlSystemGetDriverVersion(),
        }
        pynvml.nvmlShutdown()
        return {k: (v.decode() if isinstance(v, bytes) else v) for k, v in facts.items()}
    except Exception:  # noqa: BLE001 - NVML is missing on some machines; say so rather than fail
        return {"gpu_uuid": None, "driver": None}


def _harness_commit() -> str | None:
    """The commit of the harness that ran (the runner may state it where the checkout has no .git)."""
    if os.environ.get("PIPELINE_HARNESS_COMMIT"):
        return os.environ["PIPELINE_HARNESS_COMMIT"]
    root = Path(__file__).resolve().parents[2]
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "--verify", "-q", "HEAD"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    sha = out.stdout.strip()
    if out.returncode != 0 or len(sha) != 40:
        return None
    dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True, timeout=10).stdout.strip()
    return sha + ("-dirty" if dirty else "")


def _expected(problem: Problem, inputs: dict[str, Any]) -> dict[str, torch.Tensor]:
    ref = problem.reference.reference(inputs)
    if not problem.inplace:
        return {"output": ref}
    missing = [k for k in ("output", *problem.inplace) if k not in ref]
    if missing:
        raise RuntimeError(f"reference of {problem.name} returned no {missing}")
    return ref


def check_outputs(problem: Problem, got: dict[str, Any], expected: dict[str, torch.Tensor],
                  inputs: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Every output of one call against the reference: the returned tensor, and each input the problem
    writes in place (its written slots within tolerance, every other element bit-identical to `inputs`)."""
    ref_mod = problem.reference
    masks = ref_mod.written(inputs) if problem.inplace else {}
    verdicts = {"output": compare(got.get("output"), expected["output"], problem.tolerances["output"],
                                  expected_dtype=getattr(ref_mod, "OUTPUT_DTYPE", torch.bfloat16))}
    for name in problem.inplace:
        verdicts[name] = compare(got.get(name), expected[name], problem.tolerances[name],
                                 expected_dtype=inputs[name].dtype, mask=masks.get(name), pristine=inputs[name])
    return verdicts


def _params_summary(shape: Shape, problem: Problem) -> dict[str, Any]:
    model_keys = set(problem.model[shape.model])
    out = {}
    for k, v in shape.params.items():
        if k in model_keys:
            continue
        if isinstance(v, list) and len(v) > 8:
            v = f"[{len(v)} values]"
        out[k] = v
    return out


def isolation_problem(opts: Options) -> str | None:
    """Why an evaluation with these options could not be official here, or None when it can be."""
    policy = opts.sandbox or sandbox.Policy()
    if policy.isolate is False:
        return "the sandbox is switched off (Policy(isolate=False))"
    can, why = sandbox.availability()
    return None if can else f"the submission's process cannot be isolated here: {why}"


def official_problem(opts: Options) -> str | None:
    """Why `--official` must refuse (no GPU, not the full model, no secret seeds, no isolation), or None."""
    if not torch.cuda.is_available() or opts.device == "cpu":
        return "an official evaluation needs a CUDA device"
    if opts.model not in (None, "full"):
        return "an official evaluation uses the full model"
    if not opts.secret:
        return "an official evaluation needs the runner's seed secret ($PIPELINE_SEED_SECRET_FILE)"
    if not opts.timing or opts.shapes:
        return "an official evaluation checks and times every shape"
    if opts.grant_read:
        return "an official evaluation lets the submission's process read its own file only"
    return isolation_problem(opts)


SGLANG_ADAPTERS = Path(__file__).resolve().parents[2] / "reference" / "_sglang_baselines.py"


def _sglang_adapters():
    from pipeline.problems import load_reference

    return load_reference(SGLANG_ADAPTERS, "_sglang_adapters", required=())


def pin_problem(opts: Options, problem: Problem, identity: dict[str, Any]) -> str | None:
    """Why this baseline is not the one the competition pinned for the problem (competition.toml
    [baselines]), or None. Official results are ranked against each other, so they must share one unit of
    measure: a runner whose reference/ (or its tuned configurations) differ from day 0's, or a baseline
    changed without the organizers re-pinning it, would make every speedup after it incomparable."""
    from pipeline import competition

    try:
        why = competition.load(opts.competition).pin_problem(problem.name, identity)
    except competition.CompetitionError as exc:
        return f"cannot read the pinned baselines: {exc}"
    return why and (f"{why}: this runner's checkout ({', '.join(identity.get('files', []))}) differs from the "
                    "competition's, or the baseline was changed without re-pinning it")


def baseline_problem(opts: Options, problem: Problem) -> str | None:
    """Why the chosen baseline cannot be used here, or None."""
    if opts.baseline == "ours":
        return None
    if opts.baseline != "sglang":
        return f"unknown baseline {opts.baseline!r}: choose ours (the default) or sglang"
    adapters = _sglang_adapters()
    if problem.name not in adapters.ADAPTED:
        return (f"--baseline sglang has no adapter for {problem.name} (adapted: {', '.join(adapters.ADAPTED)}); "
                "use the default baseline")
    ok, why = adapters.available()
    return None if ok else f"--baseline sglang needs SGLang's pinned source on this runner: {why}"


def _baseline_target(opts: Options, problem: Problem) -> tuple[dict[str, Any], str, dict[str, Any], list[Path]]:
    """(the baseline worker's load request, the result's `baseline`, its `baseline_source`, the paths its
    sandbox may read)."""
    folder = problem.reference_path.parent
    if opts.baseline == "sglang":
        adapters = _sglang_adapters()
        try:
            kernels = adapters.build_kernels()  # SGLang's kernels, taken from the verified pinned source
        except adapters.PinnedSourceMissing as exc:
            raise BaselineFailure(f"--baseline sglang: {exc}") from None
        module = kernels / f"{adapters.MODULE}.py"
        sha = sources_sha256([("reference/_sglang_baselines.py", SGLANG_ADAPTERS.read_bytes()),
                              (module.name, module.read_bytes())])
        version = adapters.version()
        source = {"name": f"sglang {version}: {problem.name}", "sha256": sha,
                  "files": ["reference/_sglang_baselines.py", *adapters.PINNED]}
        load = {"op": "load", "path": str(SGLANG_ADAPTERS), "module": "_sglang_baseline", "function": problem.name,
                "sys_path": [str(folder), str(kernels)]}
        return load, f"sglang {version}: reference/_sglang_baselines.py:{problem.name}", source, [folder, kernels]
    load = {"op": "load", "path": str(problem.reference_path), "module": "_muse_baseline", "function": "baseline",
            "sys_path": [str(folder)]}
    return load, f"reference/{problem.name}.py:baseline", baseline_identity(problem), [folder]


# The timing mode of a Triton submission on a CPU: its kernels run in Triton's interpreter (TRITON_INTERPRET=1),
# Python emulating each program of the grid, hundreds of times slower than anything it says of a GPU. Its
# times are kept and shown as such; no score is computed from them, so no rank either.
INTERPRETED = "wall-clock, Triton interpreter (unofficial)"


def imports_triton(source: bytes) -> bool:
    """Whether the submission's source imports triton (then on a CPU its kernels are interpreted)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return False
    for node in ast.walk(tree):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                 [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
        if any(n == "triton" or n.startswith("triton.") for n in names):
            return True
    return False


def evaluate(submission: Path, problem: Problem, options: Options | None = None) -> dict[str, Any]:
    """Run the whole evaluation and return the result document (valid against the schema). Every
    process of the evaluation is gone when it returns."""
    device = (options.device if options else None) or ("cuda" if torch.cuda.is_available() else "cpu")
    opts = _resolved(options or Options(), device)
    model = opts.model or ("full" if device == "cuda" else "smoke")
    n_seeds = opts.seeds or (problem.official_seeds if device == "cuda" else 3)
    started = result_schema.now()
    data = Path(submission).read_bytes()
    doc: dict[str, Any] = {
        "schema_version": result_schema.SCHEMA_VERSION,
        "track": "kernel",
        "problem": problem.name,
        "submission": {
            "path": str(opts.submission_meta.get("path", submission)),
            "blob_sha": result_schema.git_blob_sha(data),
            "login": opts.submission_meta.get("login"),
            "pr": opts.submission_meta.get("pr"),
            "head_sha": opts.submission_meta.get("head_sha"),
        },
        "status": "passed",
        "official": False,
        "mode": {
            "device": device,
            "model": model,
            "timing": (("cuda-graph" if device == "cuda" else INTERPRETED if imports_triton(data) else
                        "wall-clock (unofficial)") if opts.timing else "none"),
            "seeds": "secret" if opts.secret else "public",
        },
        "error": None,
        "correctness": [],
        "performance": [],
        "score": None,
        "flags": [],
        "environment": environment(device),
        "baseline": None,
        "baseline_source": None,
        "started_at": started,
        "finished_at": started,
        "signature": None,
    }
    why = baseline_problem(opts, problem)
    if why:
        raise ValueError(why)
    baseline_load, doc["baseline"], doc["baseline_source"], baseline_readable = _baseline_target(opts, problem)
    if opts.official:
        why = pin_problem(opts, problem, doc["baseline_source"])
        if why:  # the runner's fault, not the submission's: no result (the CLI exits 3)
            raise BaselineFailure(f"refusing an official evaluation: {why}")
    from pipeline.kernel.static import scan

    doc["flags"].extend(f.as_dict() for f in scan(data))
    if opts.official:
        why = official_problem(opts)
        if why:
            raise sandbox.SandboxUnavailable(f"refusing an official evaluation: {why}")
    shapes = problem.shapes(model)
    if opts.shapes:
        shapes = [s for s in shapes if s.name in opts.shapes]
    deadline = time.monotonic() + opts.limits.total
    policy = opts.sandbox or sandbox.Policy(isolate=True if opts.official else None)
    t_start = time.monotonic()
    # The submission's worker sees the harness package and its own file, nothing else of the checkout.
    child = Child(device, deadline, policy, [Path(submission).resolve(), *opts.grant_read])
    baseline: Child | None = None
    doc["environment"]["sandbox"] = {"submission": child.describe()}
    current_shape: str | None = None

    def say(line: str) -> None:
        if opts.progress is not None:
            opts.progress(f"{time.monotonic() - t_start:6.1f} s  {line}")

    def begin(what: str) -> None:
        if opts.phase is not None:
            opts.phase(what)

    def fail(status: str, reply: dict[str, Any]) -> None:
        record_failure(doc, status, reply, current_shape, child.log_tail())

    try:
        begin("loading the submission (imports, module-level compiles)")
        reply = child.request({"op": "load", "path": str(Path(submission).resolve()), "module": "submission",
                               "function": "custom_kernel"}, opts.limits.compile)
        if not reply.get("ok"):
            fail(worker_status(reply, "compile_error"), reply)
            return _finish(doc)
        say(f"loaded {problem.name} submission in {time.monotonic() - t_start:.1f} s")
        first = True
        for shape in shapes:
            current_shape = shape.name
            begin(f"checking {shape.name}" + (" (the first call compiles and autotunes)" if first else ""))
            entry = _check_shape(child, problem, shape, n_seeds, opts, device, first, fail)
            first = False
            doc["correctness"].append(entry)
            say(f"checked {shape.name}: {entry['seeds']} seed(s), {'passed' if entry['passed'] else 'FAILED'}; "
                f"{_phases(entry.get('wall_s'))}")
            if doc["status"] != "passed":
                break
        if doc["status"] == "passed" and any(not e["passed"] for e in doc["correctness"]):
            doc["status"] = "incorrect"
        if doc["status"] == "passed" and opts.timing:
            current_shape = None
            # The baseline in a process of its own: nothing the submission does in its process reaches it.
            # Its time is its own too: each of its requests has its own limit, and the evaluation's total,
            # which the submission's requests may use up, is not shared with it (a submission that spent it
            # made the baseline's load time out: exit 3, the runner blamed for the submission's doing).
            baseline = Child(device, math.inf, policy, baseline_readable, role="baseline")
            doc["environment"]["sandbox"]["baseline"] = baseline.describe()
            reply = baseline.request(baseline_load, opts.limits.compile)
            if not reply.get("ok"):
                raise BaselineFailure(f"the baseline of {problem.name} did not load: {reply.get('error')}\n"
                                   f"{reply.get('traceback', '')}\n{baseline.log_tail()}")
            kept: list[dict[str, Any]] = []
            timed_shapes = [s for s in shapes if s.kind == "workload"]
            for shape in timed_shapes:
                current_shape = shape.name
                begin(f"timing {shape.name}")
                timed = _bench_workload(child, baseline, problem, shape, opts, device, doc, fail, len(timed_shapes))
                if timed is None:
                    break
                kept.append(timed)
                say(f"timed {shape.name}: {_phases(doc['performance'][-1].get('wall_s'))}")
            current_shape = None
            # The submission's whole process tree ends here; then the baseline runs alone.
            child.close()
            if doc["status"] in ("passed", "needs_review") and kept:
                begin("timing the baseline alone")
                _baseline_alone(baseline, kept, opts, device, doc, fail)
                say("timed the baseline alone")
            _score(doc, problem.run_to_run if device == "cuda" else 0.0)
    except TimeoutError as exc:
        if getattr(exc, "role", "submission") == "baseline":
            raise BaselineFailure(f"the baseline of {problem.name} did not answer within its time limit "
                                  f"(shape {current_shape}); this is not the submission's result") from exc
        child.kill()
        phase = PHASES.get(getattr(exc, "op", None) or "", "its request")
        if getattr(exc, "total", False) or time.monotonic() >= deadline:
            limit = f"the evaluation's total of {opts.limits.total:g} s"
        elif getattr(exc, "seconds", None):
            limit = f"{exc.seconds:g} s, the limit for {phase}"
        else:
            limit = f"its time limit for {phase}"
        where = f", on shape {current_shape}" if current_shape else ""
        fail("timeout", {"error": f"the submission did not answer within {limit} ({opts.limits.source})"
                                  f"{where}: its processes were killed. Make it finish well "
                                  f"within the limit; to see where its time goes, {ADVICE}"})
    except ChildFailure as exc:
        if exc.role == "baseline":
            raise BaselineFailure(f"the baseline of {problem.name} failed (shape {current_shape}): "
                                  f"{exc.reply.get('error')}; this is not the submission's result") from exc
        fail(worker_status(exc.reply, "runtime_error"), exc.reply)
    except (torch.OutOfMemoryError, transport.TransportError) as exc:
        # The evaluator's own allocation on the GPU failed. The health check before the evaluation found
        # the GPU's memory free, and the baseline's needs are small and known: the submission's process,
        # alive meanwhile, holds it (tests/faults/gpu_memory_held.py).
        if device != "cuda" or not isinstance(exc, torch.OutOfMemoryError) and "OUT_OF_MEMORY" not in str(exc):
            raise
        child.kill()
        where = f" on shape {current_shape}" if current_shape else ""
        fail("runtime_error", {"error": f"the evaluator could not allocate GPU memory{where} while the submission's "
                                        f"process was alive ({str(exc).splitlines()[0][:300]}): the submission held "
                                        "the GPU's memory beyond its call; free what custom_kernel allocates and keep "
                                        "nothing between calls beyond what it needs"})
    finally:
        child.close()
        if baseline is not None:
            baseline.close()
        if child.killed:
            doc["flags"].append({"code": "detached_processes", "line": None, "message": (
                f"{child.killed} process(es) the submission left running were killed with its sandbox")})
    return _finish(doc)


def _phases(wall_s: dict[str, float] | None) -> str:
    return ", ".join(f"{k} {v:.1f} s" for k, v in (wall_s or {}).items())


def _finish(doc: dict[str, Any]) -> dict[str, Any]:
    doc["finished_at"] = result_schema.now()
    isolated = all(d.get("isolation") == "namespaces" for d in doc["environment"].get("sandbox", {}).values()) \
        and bool(doc["environment"].get("sandbox"))
    doc["official"] = (
        doc["status"] in ("passed", "needs_review")
        and doc["mode"] == {"device": "cuda", "model": "full", "timing": "cuda-graph", "seeds": "secret"}
        and isolated
    )
    result_schema.validate(result_schema.bounded(doc))
    return doc


class Stopwatch:
    """Wall seconds per phase of one shape's evaluation, kept in the result (`wall_s`) so that a slow
    evaluation says where its time went without a profiler on the runner."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._t0 = self._last = time.monotonic()

    def lap(self, phase: str) -> None:
        """Charge the time since the last lap to `phase`."""
        now = time.monotonic()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self._last
        self._last = now

    def summary(self) -> dict[str, float]:
        return {"total": round(time.monotonic() - self._t0, 3), **{k: round(v, 3) for k, v in self.seconds.items()}}


def _check_shape(child, problem, shape, n_seeds, opts, device, first, fail) -> dict[str, Any]:
    ref_mod = problem.reference
    entry: dict[str, Any] = {
        "shape": shape.name,
        "kind": shape.kind,
        "params": _params_summary(shape, problem),
        "passed": True,
        "seeds": 0,
        "failed_seed_index": None,
        "reason": None,
        "outputs": {},
    }
    worst: dict[str, dict[str, Any]] = {}
    watch = Stopwatch()
    out_dtype = getattr(ref_mod, "OUTPUT_DTYPE", torch.bfloat16)

    def prepare(i: int):
        seed = (
            seedlib.secret_seed(opts.secret, problem.name, shape.name, i)
            if opts.secret
            else seedlib.public_seed(problem.name, shape.name, i)
        )
        inputs = ref_mod.make_inputs(shape, seed, device)  # the pristine copy: the worker never sees it
        watch.lap("inputs")
        shared = transport.share(inputs)
        watch.lap("transport")
        expected = _expected(problem, inputs)
        # Our own reference must not write its inputs: checked once per shape against the shared copy,
        # which nothing has touched yet.
        if i == 0:
            touched = _changed_inputs(shared, inputs, problem)
            if touched:
                raise RuntimeError(f"reference of {problem.name} modified its inputs: {', '.join(touched)}")
        out = transport.output_buffer(expected["output"].numel() * out_dtype.itemsize, device)
        watch.lap("reference")
        return inputs, expected, shared, out

    upcoming = prepare(0)
    for i in range(n_seeds):
        inputs, expected, shared, out = upcoming
        arenas = [*shared.arenas.values(), out]
        timeout = opts.limits.first_call if (first and i == 0) else opts.limits.call
        pending = child.send(
            {"op": "call", "inputs": shared.spec(), "output": out.id, "poison_bytes": out.nbytes,
             "produced": list(problem.produced)}, timeout, arenas)
        # The next seed is made and shared while the worker works on this one (a layer's input set is
        # gigabytes), except during a shape's first call: that is where a submission compiles and
        # autotunes, and it must have the device to itself.
        overlap = i > 0 and i + 1 < n_seeds
        if overlap:
            upcoming = prepare(i + 1)
        try:
            reply = child.receive(pending)
            watch.lap("call")
            entry["seeds"] = i + 1
            entry["wall_s"] = watch.summary()
            if not reply.get("ok"):
                fail(worker_status(reply, "runtime_error"), reply)
                entry.update(passed=False, failed_seed_index=i, reason=reply.get("error"))
                return entry
            verdicts = _judge_call(problem, reply.get("output"), out, shared, inputs, expected)
            watch.lap("check")
        finally:
            child.release(arenas)
            shared.close()
            out.close()
        for name, v in verdicts.items():
            prev = worst.get(name)
            if prev is None or not v["passed"] or (prev["passed"] and v.get("rel_l2", 0) > prev.get("rel_l2", 0)):
                worst[name] = v
        failed = [f"{name}: {v['reason']}" for name, v in verdicts.items() if not v["passed"]]
        if failed:
            entry.update(passed=False, failed_seed_index=i, reason="; ".join(failed))
            break
        if not overlap and i + 1 < n_seeds:
            upcoming = prepare(i + 1)
    entry["outputs"] = worst
    entry["wall_s"] = watch.summary()
    return entry


def _changed_inputs(shared: transport.Shared, pristine: dict[str, Any], problem: Problem) -> list[str]:
    """The inputs (other than those the problem writes in place) whose shared buffer no longer holds
    the pristine bits: read by the parent from its own memory, whatever the worker says."""
    return sorted(k for k, v in pristine.items()
                  if isinstance(v, torch.Tensor) and k not in problem.inplace
                  and not transport.identical(shared.views[k], v))


def _judge_call(problem, claim, out, shared, pristine, expected) -> dict[str, dict[str, Any]]:
    """The verdicts of one call, all from the parent's buffers: the output the worker copied into
    `out` (read with the dtype and shape it claims), the in-place outputs where the call had to write
    them, and every other input against its pristine copy."""
    if isinstance(claim, dict) and claim.get("error"):
        got_output: Any = claim["error"]
    else:
        got_output = transport.read_output(out, claim)
    got = {"output": got_output, **{name: shared.views[name] for name in problem.inplace}}
    verdicts = check_outputs(problem, got, expected, pristine)
    if isinstance(got_output, str):
        verdicts["output"] = {"passed": False, "reason": got_output}
    changed = _changed_inputs(shared, pristine, problem)
    if changed:
        verdicts["inputs"] = {"passed": False, "reason": f"the submission modified its inputs: {', '.join(changed)}"}
    return verdicts


# ---- the official timing, parent side ----

_CEILINGS: dict[str, float] = {}


def device_ceilings() -> dict[str, float]:
    """Measured once per process: device-to-device copy bandwidth (bytes read + written per second),
    read bandwidth (a sum over a 1 GiB buffer) and the dense bf16 matmul rate. A floor divides the
    bytes by the faster of the two bandwidths: on the H200 a read-mostly kernel (attention over a KV
    cache) moves its bytes faster than a copy does: the attention baseline ran at 0.99x the copy-only
    floor at B32, which left a faster honest submission no room above the 0.95x gate."""
    if _CEILINGS:
        return _CEILINGS
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def seconds(op, reps: int = 10) -> float:
        for _ in range(3):
            op()
        start.record()
        for _ in range(reps):
            op()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / reps

    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    bw = 2 * src.numel() / seconds(lambda: dst.copy_(src))
    del dst
    buf, sink = src.view(torch.float32), torch.empty((), dtype=torch.float32, device="cuda")
    buf.normal_()
    read_bw = buf.numel() * 4 / seconds(lambda: torch.sum(buf, dim=0, out=sink))
    del src, buf
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    rate = 2 * 8192**3 / seconds(lambda: a @ b)
    del a, b
    torch.cuda.empty_cache()
    _CEILINGS.update(copy_bytes_per_s=bw, read_bytes_per_s=read_bw, bf16_flops_per_s=rate,
                     peak_bytes_per_s=_nvml_memory_peak())
    return _CEILINGS


def memory_peak_bytes_per_s(bus_width_bits: int, max_mem_clock_mhz: float) -> float:
    """The memory's theoretical peak: two transfers per clock over the whole bus (H200: 6144 bits at
    3201 MHz, 4.92 TB/s; the datasheet says 4.8)."""
    return 2 * max_mem_clock_mhz * 1e6 * bus_width_bits / 8


def _nvml_memory_peak() -> float | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        peak = memory_peak_bytes_per_s(pynvml.nvmlDeviceGetMemoryBusWidth(handle),
                                       pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_MEM))
        pynvml.nvmlShutdown()
        return peak
    except Exception:  # noqa: BLE001 - no NVML: the floor falls back on the measured bandwidths
        return None


def floor_us(floor: dict[str, float], ceilings: dict[str, Any]) -> float:
    """The analytic floor of a workload: its bytes at the fastest bandwidth known for the device (the
    memory's theoretical peak where NVML tells it, else the faster of the measured copy and read), or
    its FLOPs at the measured bf16 rate, whichever takes longer. The spec divides by the measured copy
    bandwidth; on the H200 the attention baseline already moves its bytes at that speed (1.00x at B32),
    so an honest kernel a little better than it would have been held for review (docs/TIMING.md)."""
    bandwidth = max(ceilings["copy_bytes_per_s"], ceilings["read_bytes_per_s"], ceilings.get("peak_bytes_per_s") or 0)
    return max(floor["bytes"] / bandwidth, floor["flops"] / ceilings["bf16_flops_per_s"]) * 1e6


def _timing_seed(problem: Problem, shape: Shape, opts: Options, index: int) -> int:
    tag = f"{shape.name}/timing"
    return seedlib.secret_seed(opts.secret, problem.name, tag, index) if opts.secret else seedlib.public_seed(problem.name, tag, index)


def _in_range(v: Any, lo: float, hi: float) -> bool:
    """A finite number (not a bool) in (lo, hi]: what a worker reports as a time must be one."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and lo < v <= hi


def _judge_sets(problem, reply, outs, shared_sets, pristine_sets, expecteds, what) -> str | None:
    """The timed graph's outputs for every input set, judged on the parent's buffers (as `_judge_call`):
    None when every one is right, else the first thing wrong."""
    if not reply.get("ok"):
        return reply.get("error") or "the worker failed"
    claims = reply.get("outputs")
    if not isinstance(claims, list) or len(claims) != len(outs):
        return f"{what}: the worker did not hand back one output per input set"
    for r, (claim, out, shared, pristine, expected) in enumerate(zip(claims, outs, shared_sets, pristine_sets, expecteds)):
        wrong = [f"{name}: {v['reason']}" for name, v in _judge_call(problem, claim, out, shared, pristine, expected).items()
                 if not v["passed"]]
        if wrong:
            return f"{what}, input set {r}: {'; '.join(wrong)}"
    return None


# Fresh content per call this much slower, relative to the baseline: held for review. On a CPU, where
# the two workers share two cores and nothing is official, only a gross reuse of work is held.
CONTENT_REVIEW = {"cuda": 1.25, "cpu": 2.0}
# The spec flags a read-flush disagreement above 5%; the figure here is the difference of two graph
# times with a large common part (new content and the flush), and at 5% an honest Triton split-K
# kernel was flagged in one of two H200 runs. 10%, with 40 replays of each graph, keeps the flag for
# what is more than noise.
FLUSH_FLAG = 0.10
CROSS_REPEATS = {"cuda": 40, "cpu": 4}
CROSS_SECONDS = {"cuda": 1.0, "cpu": 0.2}  # per target: a slow kernel gets fewer replays (at least timing.MIN_CROSS_PAIRS)
# The baseline's median while interleaved with the submission, over its median alone once the
# submission's processes are gone: beyond this the submission's process may have slowed the
# baseline down (work left queued on the GPU, host threads hogging the CPU), and the result is held.
# On a CPU the two processes share two cores (an honest run's baseline strayed +64% there): the
# figure is only flagged, never held, beyond a bound that only a gross slowdown crosses.
INTERFERENCE = {"cuda": 0.02, "cpu": 1.0}


# The share of the submission's blocks' wall time that neither its reported GPU time nor the per-block
# overhead measured on the baseline's blocks explains: on the H200 the two workers' accounting agreed
# within 0.7% (docs/BENCHMARKS.md); on a CPU the two workers share two cores.
UNEXPLAINED = {"cuda": 0.03, "cpu": 0.06}
# The per-block overhead allowed to the submission's blocks is the baseline's, measured while the two
# interleave, but never more than CAP_FACTOR times the baseline's own overhead measured again once the
# submission's process tree is gone (`_baseline_alone`): a submission whose threads load the host while
# the baseline's blocks run would otherwise widen its own allowance with the delay it causes. The cap is
# measured on the runner itself, not fixed: the request around a block costs 0.6-0.7 ms on the H200 and
# ~1.3 ms on the lent H100's host, where a fixed 1 ms cap failed honest kernels (docs/BENCHMARKS.md,
# "The trust boundary's cost", and its appendix, 2026-12-06). On a CPU (never official) the round trip swings
# 0.8-8 ms with the machine's load, so the factor there only bounds the arithmetic.
CAP_FACTOR = {"cuda": 1.5, "cpu": 20.0}


# On a CPU (never official) a worker's own clock cannot be bounded tightly by the parent's: the request around
# a block costs 0.8-8 ms with the machine's load on blocks of about 10 ms, so bounds that catch a timer
# reporting 90% of its time failed honest kernels whenever another process competed for the cores, and
# bounds loose enough for the load let that timer pass. There the parent's clock is the sample: the wall
# time of the whole block less a request's own cost, the median of the last ROUND_TRIPS requests with nothing
# to time that the same worker answered right after its blocks (so both workers are measured alike, each
# woken as it is for its blocks). A submission's worker can only make its own round trips slower, which
# would make its blocks look cheaper: its allowance is never more than the baseline's. Nothing a worker
# reports is used (its claims are kept in the result as worker_claimed_us), so a patched timer changes
# nothing.
ROUND_TRIPS = 9


def cpu_sample(wall_us: float, round_trips: dict[str, list[float]], target: str, calls: int) -> float:
    """The per-call time of one CPU block by the parent's clock: its wall time less a request's own cost (the
    target's recent round trips, the submission's capped at the baseline's), never less than half the wall
    time (a round trip caught in a burst of load), over the calls it made."""
    own = statistics.median(round_trips[target][-ROUND_TRIPS:])
    if target != "baseline" and round_trips.get("baseline"):
        own = min(own, statistics.median(round_trips["baseline"][-ROUND_TRIPS:]))
    return max(wall_us - own, wall_us / 2) / calls


def block_overhead_us(wall_us: dict[str, float], reported_us: dict[str, float], rounds: int, worker: str) -> float:
    """The evaluator's wall time around each of a worker's timed blocks that its reported GPU time leaves."""
    return (wall_us[worker] - reported_us[worker]) / rounds


def unexplained_share(wall_us: dict[str, float], reported_us: dict[str, float], rounds: int,
                      alone_overhead_us: float, device: str) -> tuple[float, float]:
    """(the share of the submission's blocks' wall time that neither its reported GPU time nor the
    allowed per-block overhead explains, that overhead in us). `alone_overhead_us`: the baseline's
    overhead per block with the submission gone, which caps the overhead measured beside it."""
    measured = max(0.0, block_overhead_us(wall_us, reported_us, rounds, "baseline"))
    overhead = min(measured, CAP_FACTOR[device] * max(0.0, alone_overhead_us))
    return (wall_us["submission"] - reported_us["submission"] - rounds * overhead) / wall_us["submission"], overhead


class _Abort(Exception):
    """The workload's timing ended with a verdict already recorded by `fail`."""


def sets_at_most(set_bytes: int, device: str, workloads: int, least: int, max_sets: int) -> int:
    """The most input sets (calls) a timed graph of one of `workloads` workloads may have: within the
    workload's share of the evaluation's set bytes, never fewer than `least` (the L2 multiple's)."""
    budget = min(SET_BYTES[device], TOTAL_SET_BYTES[device] // max(1, workloads))
    return max(least, min(max_sets, budget // max(1, set_bytes)))


def _bench_workload(child, base, problem, shape, opts, device, doc, fail, workloads: int) -> dict[str, Any] | None:
    """Time one workload (of `workloads` timed in this evaluation), both targets in their own workers, and check
    what the submission's timed graph computed. Returns what the baseline's run alone needs of it, or None when
    it failed."""
    ref_mod = problem.reference
    watch = Stopwatch()
    cache = torch.cuda.get_device_properties(0).L2_cache_size if device == "cuda" else CPU_CACHE_BYTES
    first = ref_mod.make_inputs(shape, _timing_seed(problem, shape, opts, 0), device)
    # At least the sets that fill the L2 multiple for the trial; then one set a call (`calls` below).
    # (On a CPU the cache is nominal and a call slow, an interpreted Triton kernel's 50 ms: at most 4 sets there.)
    least = timing.rotation_sets(first, cache, opts.l2_multiple, opts.max_sets if device == "cuda" else CPU_LEAST_SETS)
    most = sets_at_most(timing.set_bytes(first), device, workloads, least, opts.max_sets)
    sets = [first] + [ref_mod.make_inputs(shape, _timing_seed(problem, shape, opts, r), device)
                      for r in range(1, least)]
    # Which target's buffers are allocated, warmed up and captured first is drawn per workload: with a
    # fixed order, the baseline submitted against itself scored 0.55% apart at M=1 in every one of five
    # evaluations (docs/BENCHMARKS.md), a bias of the order, not of the code.
    order = ["baseline", "submission"]
    secrets.SystemRandom().shuffle(order)
    workers = {t: {"baseline": base, "submission": child}[t] for t in order}
    shares = {t: [transport.share(s) for s in sets] for t in workers}
    outs: list[transport.Arena] = []
    key = shape.name
    watch.lap("inputs")

    def ask(t: str, req: dict[str, Any], timeout: float, arenas=()) -> dict[str, Any]:
        reply = workers[t].request({**req, "key": key}, timeout, list(arenas))
        if not reply.get("ok"):
            if t == "baseline":
                raise BaselineFailure(f"the baseline of {problem.name} failed on {key}: {reply.get('error')}\n"
                                   f"{reply.get('traceback', '')}\n{base.log_tail()}")
            fail(worker_status(reply, "runtime_error"), reply)
            raise _Abort
        return reply

    def arenas_of(t: str) -> list[transport.Arena]:
        return [a for sh in shares[t] for a in sh.arenas.values()]

    try:
        per_call = {t: ask(t, {"op": "bench_prepare", "sets": [sh.spec() for sh in shares[t]]},
                           opts.limits.first_call, arenas_of(t)).get("per_call_us") for t in workers}
        for t, estimate in per_call.items():
            if not _in_range(estimate, 0, 1e9):
                if t == "baseline":
                    raise BaselineFailure(f"the baseline's trial graph on {key} gave a per-call time of {estimate!r}")
                fail("runtime_error", {"error": f"the submission's trial graph reported a per-call time of "
                                                f"{str(estimate)[:40]}: not a time, so the timings cannot be trusted"})
                raise _Abort
        # The parent, not a worker, fixes the calls per replay and the replays per block, so the only
        # thing a worker reports is each replay's duration, and the parent's clock bounds their sum.
        # Each call has an input set of its own, so every call of a timed graph leaves an output that is
        # read and judged: no call can skip its work behind another's answer.
        calls = {t: timing.choose_calls(per_call[t], least, most) for t in workers}
        watch.lap("prepare")
        sets += [ref_mod.make_inputs(shape, _timing_seed(problem, shape, opts, r), device)
                 for r in range(len(sets), max(calls.values()))]
        for t in workers:
            shares[t] += [transport.share(s) for s in sets[len(shares[t]):calls[t]]]
        del sets[calls["submission"]:]  # the parent's pristine copies: of the submission's sets only
        expecteds = [_expected(problem, s) for s in sets]
        out_nbytes = expecteds[0]["output"].numel() * getattr(ref_mod, "OUTPUT_DTYPE", torch.bfloat16).itemsize
        outs += [transport.output_buffer(out_nbytes, device) for _ in sets]
        watch.lap("inputs")
        # Replays per block: about 10 ms of them (timing.replays_per_round), so each block is long next
        # to the request around it and short next to the GPU's slow swings.
        replays = {t: timing.replays_per_round(per_call[t] * calls[t]) for t in workers}
        for t in workers:
            # The timed graph and the cross-check's graphs are captured in an order the worker cannot
            # predict, so a submission that counts its captures cannot behave only when checked.
            order = ["timed", "cross"]
            secrets.SystemRandom().shuffle(order)
            ask(t, {"op": "bench_capture", "calls": calls[t], "order": order, "flush_bytes": 4 * cache,
                    "sets": [sh.spec() for sh in shares[t]]}, opts.limits.first_call, arenas_of(t))
        watch.lap("prepare")
        clocks = timing.Clocks(torch.cuda.current_device()) if device == "cuda" else None
        persisting = 0
        round_trips: dict[str, list[float]] = {t: [] for t in workers}  # CPU: a request with nothing to time, us
        claimed: dict[str, list[float]] = {t: [] for t in workers}  # CPU: what each worker said, for the record

        def block(t: str, n: int | None = None) -> tuple[list[float], float]:
            """One block of one target (`n` replays, its nominal count unless given), timed by the parent's own
            clock around the whole request. On a GPU the samples are the worker's events, bounded by that clock;
            on a CPU the sample is that clock itself (`cpu_sample`): nothing a worker reports is used there."""
            nonlocal persisting
            n = replays[t] if n is None else n
            if clocks is not None:
                clocks.sample()
            t0 = time.monotonic()
            m = ask(t, {"op": "bench_measure", "replays": n}, opts.limits.call)
            wall = time.monotonic() - t0
            got = m.get("samples_us")
            if not isinstance(got, list) or len(got) != n or not all(
                    isinstance(x, (int, float)) and not isinstance(x, bool) and 0 < x < 1e9 for x in got):
                fail("runtime_error", {"error": f"the {t}'s timed block returned malformed samples: "
                                                "the timings cannot be trusted"})
                raise _Abort
            if t == "submission" and isinstance(m.get("persisting_l2_bytes"), int):
                persisting = max(persisting, m["persisting_l2_bytes"])
            if device == "cuda":
                return [float(x) for x in got], wall
            claimed[t].append(statistics.median(float(x) for x in got))
            t1 = time.monotonic()
            ask(t, {"op": "bench_measure", "replays": 0}, opts.limits.call)
            round_trips[t].append((time.monotonic() - t1) * 1e6)
            return [cpu_sample(wall * 1e6, round_trips, t, n * calls[t])], wall

        # Let clocks and caches settle on this workload's graphs before any sample counts.
        settle_end = time.monotonic() + opts.settle_seconds
        while time.monotonic() < settle_end:
            for t in workers:
                block(t)
        watch.lap("settle")
        mine = shares["submission"]
        checked = 0

        def poison(buffers: list[transport.Arena]) -> None:
            for o in buffers:
                o.flat.fill_(0xFF)  # NaN in every floating dtype
            if device == "cuda":
                torch.cuda.synchronize()

        def checked_block() -> str | None:
            """A block of the submission's like every other (the same request, graph and buffers), after the
            parent has written new values into some of its input sets, drawn at random; then every call's output is
            read from the parent's buffers and judged. The worker cannot tell it from a timed block but by
            the content, which the cross-check prices (`_judge_fresh_content`)."""
            nonlocal checked
            checked += 1
            # New values in a few sets drawn at random (every set costs the parent a reference output): a kernel
            # that answers a call from an earlier one is wrong on them; which ones, it can only tell by content.
            fresh = draw.sample(range(len(mine)), min(len(mine), max(2, len(mine) // 8)))
            for r in fresh:
                shared = mine[r]
                values = ref_mod.make_inputs(shape, _timing_seed(problem, shape, opts, checked * 10_000 + r), device)
                for name, value in values.items():
                    if isinstance(value, torch.Tensor):
                        shared.views[name].copy_(value)
                sets[r], expecteds[r] = values, _expected(problem, values)
            if device == "cuda":
                torch.cuda.synchronize()
            block("submission")  # its samples are not kept: the parent's writes have just passed through the cache
            # Poisoned only now: during the block the output buffers (which the worker maps) hold what they held
            # during every other block, the last outputs read.
            poison(outs)
            reply = child.request({"op": "bench_outputs", "key": key, "outputs": [o.id for o in outs]},
                                  opts.limits.call, outs)
            return _judge_sets(problem, reply, outs, mine, sets, expecteds,
                               f"a timed block on fresh inputs (#{checked})")

        samples: dict[str, list[float]] = {t: [] for t in workers}
        fits: dict[str, list[tuple[int, float, float]]] = {t: [] for t in workers}  # (replays, wall us, claimed us)
        wall_us = {t: 0.0 for t in workers}
        reported_us = {t: 0.0 for t in workers}
        phase_start = time.monotonic()
        phase_end = phase_start + opts.max_timing_seconds
        rounds = 0
        why = None
        draw = secrets.SystemRandom()
        round_s = sum(replays[t] * calls[t] * per_call[t] for t in workers) * 1e-6
        # over the sampling's usual length: its minimum on a GPU (it converges), its limit on a CPU (it rarely does)
        horizon = opts.min_timing_seconds if device == "cuda" else opts.max_timing_seconds
        chance = min(0.2, CHECKED_BLOCKS * round_s / max(horizon, round_s))
        while why is None:
            for t in (("baseline", "submission") if rounds % 2 == 0 else ("submission", "baseline")):
                if t == "submission" and draw.random() < chance:
                    t_check = time.monotonic()
                    why = checked_block()  # besides the round's timed block, which it does not replace
                    if why is not None:
                        break
                    spent = time.monotonic() - t_check  # the sampling's own minimum and limit are not spent on it
                    phase_start += spent
                    phase_end += spent
                # Each block's replays are drawn around the nominal count, so that its wall time can be
                # fitted against them (`timing.replay_fit`): a graph that does its work in one replay of a
                # block, the last one that is read, does not take a replay's time per replay.
                n = timing.drawn_replays(replays[t], draw)
                got, wall = block(t, n)
                fits[t].append((n, wall * 1e6, sum(got) * calls[t] if device == "cuda" else got[0] * n * calls[t]))
                samples[t].extend(got)
                wall_us[t] += wall * 1e6
                reported_us[t] += sum(got) * calls[t]
            rounds += 1
            converged = all(timing.converged(v, opts.min_samples) for v in samples.values())
            now = time.monotonic()
            if (converged and now - phase_start >= opts.min_timing_seconds) or now > phase_end:
                break
        watch.lap("sampling")
        # Each target's reported GPU time must fit the parent's wall time of that target's own blocks:
        # a worker that reports replays faster than its blocks took is not believed. Each block also
        # costs the request around it (about 0.7 ms on the H200), so on its own that bound leaves a
        # worker room to under-report by the overhead's share (7%); the baseline's worker (ours,
        # trusted) measures that overhead per block in the same run, and the submission's blocks may
        # leave no more than UNEXPLAINED of their wall time unaccounted beyond it: judged in
        # `_baseline_alone`, once the baseline's overhead has also been measured with the submission gone.
        accounted = {t: reported_us[t] / wall_us[t] if wall_us[t] else 0.0 for t in workers}
        untrusted = None  # judged after the outputs: a graph that computes nothing is told as such first
        if device == "cuda" and why is None:  # a CPU's samples are the parent's own (cpu_sample): nothing to bound
            for t in workers:
                if not (opts.min_accounted <= accounted[t] <= 1.02):
                    message = (f"the {t}'s timed blocks reported {reported_us[t] / 1e3:.1f} ms of GPU time in "
                               f"{wall_us[t] / 1e3:.1f} ms of the evaluator's wall time ({accounted[t]:.0%}): "
                               "the timings cannot be trusted")
                    if t == "baseline":
                        doc["status"] = "needs_review"
                        doc["flags"].append({"code": "baseline_accounting", "message": f"{key}: {message}", "line": None})
                    else:
                        untrusted = message
        fit = {t: timing.replay_fit(fits[t]) for t in workers}
        held, control = fit["submission"], fit["baseline"]
        # Beside the bound, the point estimate against the baseline's in the same run (the control for the load):
        # a replay that grows the wall time by under a quarter of its claim, where the baseline's grows by most of
        # its own, is not noise (a CPU's bound is wide: one lazy graph's ratios 0.04-0.19, honest ones 0.75-1.1).
        lazy = (held is not None and control is not None and held["blocks"] >= 20 and held["ratio"] < REPLAY_UNTRUSTED / 2
                and control["ratio"] >= 0.75)
        if why is None and untrusted is None and held is not None and (held["upper"] < REPLAY_PROPORTION or lazy):
            message = (f"the submission's timed blocks grew by {held['slope_us']:.1f} us of the evaluator's wall time per "
                       f"added replay, against the {held['claimed_us']:.1f} us a replay took by its own figures "
                       f"({held['ratio']:.1%} of it, {held['ratio']:.2f}x; at most {held['upper']:.2f}x at 95%, over {held['blocks']} blocks of a "
                       "drawn number of replays): its graph does not do a replay's work in every replay")
            if held["upper"] < REPLAY_UNTRUSTED or lazy:
                untrusted = message + ", so the timings cannot be trusted"
            elif device == "cuda":
                doc["status"] = "needs_review"
                doc["flags"].append({"code": "replay_proportion", "message": f"{key}: {message}; held for review",
                                     "line": None})
            else:
                doc["flags"].append({"code": "timing_noise", "line": None, "message": (
                    f"{key}: {message}, or the load of a shared CPU changed under it: these unofficial timings are "
                    "noisy, nothing is held")})
        if persisting:
            doc["status"] = "needs_review"
            doc["flags"].append({"code": "persisting_l2", "message": f"{key}: the submission reserved "
                                 f"{persisting >> 20} MiB of persisting L2; it was reset before every "
                                 "timed block, and the result is held for review", "line": None})
        # After timing: what the last timed block left for every call, in the parent's buffers; then one
        # more checked block on fresh inputs (besides those drawn during sampling); then the cross-check,
        # which gives every call new content.
        if why is None:
            poison(outs)  # what a checked block left there must not pass for this read's answers
            reply = child.request({"op": "bench_outputs", "key": key, "outputs": [o.id for o in outs]},
                                  opts.limits.call, outs)
            why = _judge_sets(problem, reply, outs, mine, sets, expecteds, "after timing")
        if why is None:
            why = checked_block()
        cross: dict[str, float] = {}
        if why is None:
            for t in workers:
                got = ask(t, {"op": "bench_crosscheck", "repeats": CROSS_REPEATS[device],
                              "seconds": CROSS_SECONDS[device]}, opts.limits.call).get("per_call_us")
                if not _in_range(got, -1e9, 1e9):  # a difference of two medians: may be below zero
                    if t == "baseline":
                        raise BaselineFailure(f"the baseline's cross-check on {key} gave {got!r}")
                    fail("runtime_error", {"error": f"the submission's cross-check reported {str(got)[:40]}: not "
                                                    "a time, so the timings cannot be trusted"})
                    raise _Abort
                cross[t] = float(got)
        ask("submission", {"op": "bench_release", "keys": [key]}, opts.limits.call)
        watch.lap("checks")
    except _Abort:  # the verdict is recorded already
        _release(base, shares["baseline"], [])
        return None
    finally:
        _release(child, shares["submission"], outs)
    del sets, expecteds
    if why or untrusted:
        # Only a workload that was timed and checked keeps the baseline's buffers, for its run alone.
        _release(base, shares["baseline"], [])
        if why:
            doc["status"] = "incorrect"
            doc["error"] = {"message": f"the CUDA graph that was timed does not compute the right answer ({why})",
                            "shape": shape.name, "where": None, "traceback": "", "log_tail": child.log_tail()}
        else:
            fail("runtime_error", {"error": untrusted})
        return None
    sub, basel = timing.summary(samples["submission"]), timing.summary(samples["baseline"])
    entry = {
        "workload": shape.name,
        **sub,
        "baseline_median_us": basel["median_us"],
        "baseline_interval_us": basel["interval_us"],
        "speedup": basel["median_us"] / sub["median_us"],
        "floor_us": None,
        "floor": ref_mod.floor(shape),
        "clocks": clocks.summary() if clocks is not None else None,
        "calls_per_replay": calls,
        "input_sets": {t: len(shares[t]) for t in workers},
        "checked_blocks": checked,
        "replay_fit": fit,
        "converged": converged,
        "wall_accounted": accounted,
        **({"worker_claimed_us": {t: statistics.median(v) for t, v in claimed.items() if v},
            "round_trip_us": {t: statistics.median(v) for t, v in round_trips.items() if v}}
           if round_trips["baseline"] else {}),
        "wall_s": watch.summary(),
        "read_flush_us": cross.get("submission"),
        "baseline_read_flush_us": cross.get("baseline"),
        "samples_us": samples["submission"],
        "baseline_samples_us": samples["baseline"],
    }
    if device == "cuda":
        ceilings = device_ceilings()
        entry["floor_us"] = floor_us(entry["floor"], ceilings)
        entry["floor"] = {**entry["floor"], **ceilings}
    doc["performance"].append(entry)
    if not converged and device == "cuda":
        doc["flags"].append({"code": "timing_not_converged", "message": f"{shape.name}: the 95% interval of the "
                             "median did not reach +-0.5% within the time limit", "line": None})
    _judge_fresh_content(doc, entry, device)
    if entry["floor_us"] and sub["median_us"] < 0.95 * entry["floor_us"]:
        doc["status"] = "needs_review"
        doc["flags"].append({"code": "below_floor", "message": f"{shape.name}: {sub['median_us']:.2f} us is below 0.95x "
                             f"the analytic floor of {entry['floor_us']:.2f} us; not credited until reviewed", "line": None})
    return {"key": key, "replays": replays["baseline"], "calls": calls["baseline"], "shares": shares["baseline"],
            "entry": entry, "submission_block_s": wall_us["submission"] / 1e6 / max(1, rounds),
            "wall_us": wall_us, "reported_us": reported_us, "rounds": rounds}


def _release(worker: Child, shared_sets: list[transport.Shared], outs: list[transport.Arena]) -> None:
    arenas = [a for sh in shared_sets for a in sh.arenas.values()] + list(outs)
    worker.release(arenas)
    for sh in shared_sets:
        sh.close()
    for o in outs:
        o.close()


class _Filler:
    """Memory-bound work of the evaluator's own on the GPU, for a given time: what fills the gaps
    between the baseline's blocks when the submission's blocks are no longer there to."""

    def __init__(self) -> None:
        self.src = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
        self.dst = torch.empty_like(self.src)
        self.dst.copy_(self.src)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(5):
            self.dst.copy_(self.src)
        torch.cuda.synchronize()
        self.copy_s = (time.perf_counter() - t0) / 5

    def run(self, seconds: float) -> None:
        for _ in range(max(1, round(seconds / self.copy_s))):
            self.dst.copy_(self.src)
        torch.cuda.synchronize()


def _baseline_alone(base: Child, kept: list[dict[str, Any]], opts: Options, device: str, doc: dict[str, Any],
                    fail: Callable[[str, dict[str, Any]], None]) -> None:
    """Each timed workload's baseline graph once more, with the submission's process tree gone: the
    same process, graph and memory as in the interleaved blocks, so a median that was slower there
    than here says that something slowed the baseline down while the submission was alive. Its
    blocks' overhead here (the parent's wall time around each request less the GPU time it reports)
    caps the allowance the submission's blocks got for theirs, and their accounting is judged."""
    filler = _Filler() if device == "cuda" else None

    round_trips: dict[str, list[float]] = {"baseline": []}  # CPU: as in the interleaved blocks, the parent's clock

    def median_alone(item: dict[str, Any], req: dict[str, Any], fill_s: float) -> tuple[float, list[float]]:
        samples: list[float] = []
        overheads: list[float] = []
        t_end = time.monotonic() + opts.alone_seconds
        while time.monotonic() < t_end or len(samples) < opts.min_samples:
            if filler is not None and fill_s > 0:
                filler.run(fill_s)
            t0 = time.monotonic()
            reply = base.request(req, opts.limits.call)
            wall = time.monotonic() - t0
            if not reply.get("ok"):
                raise BaselineFailure(f"the baseline failed when timed alone: {reply.get('error')}")
            got = [float(x) for x in reply["samples_us"]]
            overheads.append(wall * 1e6 - sum(got) * item["calls"])
            if device != "cuda":
                t1 = time.monotonic()
                base.request({**req, "replays": 0}, opts.limits.call)
                round_trips["baseline"].append((time.monotonic() - t1) * 1e6)
                got = [cpu_sample(wall * 1e6, round_trips, "baseline", item["replays"] * item["calls"])]
            samples.extend(got)
        return timing.summary(samples)["median_us"], overheads

    try:
        for item in kept:
            req = {"op": "bench_measure", "key": item["key"], "replays": item["replays"]}
            settle_end = time.monotonic() + min(0.5, opts.settle_seconds)
            while time.monotonic() < settle_end:
                base.request(req, opts.limits.call)
            entry = item["entry"]
            # As in the interleaved blocks, the GPU is kept busy between the baseline's blocks for as
            # long as the submission's blocks lasted (by this process: the submission is gone).
            entry["baseline_alone_idle_us"], overheads = median_alone(item, req, 0.0)
            if filler is not None:
                alone, more = median_alone(item, req, item["submission_block_s"])
                overheads += more
            else:
                alone = entry["baseline_alone_idle_us"]
            entry["baseline_alone_us"] = alone
            alone_overhead = statistics.median(overheads)
            unexplained, allowed = unexplained_share(item["wall_us"], item["reported_us"], item["rounds"],
                                                     alone_overhead, device)
            per_block = {t: block_overhead_us(item["wall_us"], item["reported_us"], item["rounds"], t)
                         for t in ("baseline", "submission")}
            entry["block_overhead_us"] = {"baseline": max(0.0, per_block["baseline"]), "baseline_alone": alone_overhead,
                                          "allowed": allowed, "submission": per_block["submission"]}
            entry["wall_unexplained"] = unexplained
            if device == "cuda" and unexplained > UNEXPLAINED[device]:  # a CPU's samples are its own clock
                wall, reported = item["wall_us"]["submission"], item["reported_us"]["submission"]
                fail("runtime_error", {"error": (
                    f"{item['key']}: the submission's timed blocks took {wall / 1e3:.1f} ms of the evaluator's wall "
                    f"time and reported {reported / 1e3:.1f} ms of GPU time: beyond the {allowed / 1e3:.2f} ms per "
                    f"block that the baseline's blocks cost around their replays (beside it; "
                    f"{alone_overhead / 1e3:.2f} ms alone), {unexplained:.1%} of it is unaccounted for (at most "
                    f"{UNEXPLAINED[device]:.0%}): the timings cannot be trusted")})
                break
            slower = entry["baseline_median_us"] / alone - 1
            if slower > INTERFERENCE[device]:
                figures = (f"{item['key']}: the baseline took {entry['baseline_median_us']:.2f} us while the "
                           f"submission's process was alive and {alone:.2f} us alone afterwards ({slower:+.1%}, more "
                           f"than {INTERFERENCE[device]:.0%})")
                if device == "cuda":
                    doc["status"] = "needs_review"
                    doc["flags"].append({"code": "baseline_interference", "line": None, "message": (
                        figures + ": something slowed it down during the run; held for review")})
                else:
                    doc["flags"].append({"code": "timing_noise", "line": None, "message": (
                        figures + ": on a CPU shared with other processes the load changes from one second to the "
                        "next; these unofficial timings are noisy, nothing is held")})
        base.request({"op": "bench_release"}, opts.limits.call)
    finally:
        for item in kept:
            _release(base, item["shares"], [])


def _judge_fresh_content(doc: dict[str, Any], entry: dict[str, Any], device: str = "cuda") -> None:
    """The cross-check gives every call content it has never seen, behind a read flush. An honest
    kernel costs about what it cost in the rotation, as the baseline does; a kernel that reuses work
    across calls with the same content (a device-side cache keyed on a sample of its inputs) costs
    far more once nothing repeats. The baseline's own ratio is the yardstick for this workload: on
    the H200 cuBLAS itself runs 8% faster behind a read flush than in the rotation at M=1
    (docs/BENCHMARKS.md), so an absolute 5% rule would flag the baseline's own code."""
    rf, bf = entry.get("read_flush_us"), entry.get("baseline_read_flush_us")
    if not rf or not bf or rf <= 0 or bf <= 0:
        return
    name, med = entry["workload"], entry["median_us"]
    mine, theirs = rf / med, bf / entry["baseline_median_us"]
    if device != "cuda":  # the CPU's figures are kept, never judged: two workers on two cores are too noisy
        return
    if mine > CONTENT_REVIEW[device] * theirs:
        doc["status"] = "needs_review"
        doc["flags"].append({"code": "content_reuse", "message": f"{name}: with new content in every call it takes "
                             f"{rf:.2f} us against {med:.2f} us in the timed rotation ({mine:.2f}x; the baseline: "
                             f"{theirs:.2f}x): it may reuse work across calls; held for review", "line": None})
    elif device == "cuda" and abs(mine / theirs - 1) > FLUSH_FLAG:
        doc["flags"].append({"code": "flush_disagreement", "message": f"{name}: read-flush timing {rf:.2f} us vs rotation "
                             f"{med:.2f} us ({mine:.3f}x) where the baseline's is {theirs:.3f}x: more than {FLUSH_FLAG:.0%} apart",
                             "line": None})


def _score(doc: dict[str, Any], run_to_run: float = 0.0) -> None:
    """The score: the geometric mean of the workloads' speedups, and its 95% interval. The interval
    from the samples (order statistics of each median) covers what varies within one evaluation; what
    varies between evaluations of the same code (each graph's memory is placed anew in every process)
    is the problem's measured run-to-run band, by which the interval is widened on each side, so two
    results that a re-run could swap are a tie on the board (docs/TIMING.md, "Score interval")."""
    perf = doc["performance"]
    interpreted = (doc.get("mode") or {}).get("timing") == INTERPRETED
    if not perf or doc["status"] not in ("passed", "needs_review") or interpreted:
        return
    lo = geomean([p["baseline_interval_us"][0] / p["interval_us"][1] for p in perf])
    hi = geomean([p["baseline_interval_us"][1] / p["interval_us"][0] for p in perf])
    doc["score"] = {
        "speedup": geomean([p["speedup"] for p in perf]),
        "time_us": geomean([p["median_us"] for p in perf]),
        "interval": [lo / (1 + run_to_run), hi * (1 + run_to_run)],
        "within_run_interval": [lo, hi],
        "run_to_run": run_to_run,
    }
