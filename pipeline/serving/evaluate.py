"""`python -m pipeline serving evaluate`: a serving patch, gated, served B C C B against the baseline, scored.

`python -m pipeline serving evaluate PATCH --launch TEMPLATE --json OUT [--dataset F] [--meta submission.json]
 [--official] [--levels 1,4,16,32] [--window-s N] [--warmup-s N] [--runs N] [--gsm8k-questions N]
 [--gsm8k-max-tokens N] [--turn-timeout-s N] [--records DIR]
 [--delay-ms-baseline MS] [--delay-ms-candidate MS] [--pin TOML] [--limits TOML]`

What it does (serving-track.md; competition.toml [serving] holds the official plan):
1. Inputs: the launch template TEMPLATE of sglang_pin/pin.toml (pipeline/serving/launch.py), the model
   from the runner's environment ($PIPELINE_SERVING_MODEL for both templates), the dataset (--dataset, by
   default $PIPELINE_SERVING_DATASET: the hidden set on the runner), checked whole with its content
   sha256 (and, official, against the hidden set's recorded sha256 and shape), the tokenizer output is
   counted with. A bad input is a usage error: exit 2, nothing written.
2. The gate (pipeline/serving/gate.py) on PATCH against the pinned tree: a refused patch is never
   launched; its result says `rejected` with every reason (exit 1).
3. Two fresh copies of the pinned tree, the candidate's with the patch applied (launch.fresh_tree).
4. Four blocks in the order B C C B, each a fresh launch of the template in its own sandbox (baseline:
   the unpatched copy; candidate: the patched one), waited for (its launch time recorded), then `runs`
   sweeps of the levels: each level one closed-loop replay (pipeline/serving/replay.py) with its warm-up
   and window (window_s, window_s_c1 at c = 1), its queue seeded with seed + 1000 r + c, the same in
   every block, so both sides replay the same conversations in the same order; the figures of each run
   are pipeline/serving/metrics.level's. After the perf runs of the last candidate block (the second C)
   and of the last baseline block (the second B), GSM8K 5-shot on that same server
   (pipeline/serving/gsm8k.py). Then the server is stopped with everything it started, whatever happened.
   The block layout, with the official plan's windows:

       block 1 baseline   launch | 3 x (c=1: 60+300 s, c=4: 60+600 s, c=16: 60+600 s, c=32: 60+600 s) | stop
       block 2 candidate  launch | the same sweeps                                                    | stop
       block 3 candidate  launch | the same sweeps | GSM8K (1,319 questions)                          | stop
       block 4 baseline   launch | the same sweeps | the audit's re-sends (step 6) | GSM8K           | stop

5. The canaries (the dataset's canary conversations, replayed with fixed history): the first baseline
   block's greedy tokens are the reference; the second baseline block's agreement with them is the
   baseline's self-agreement, the candidate blocks' the candidate's (pipeline/serving/score.py).
6. The audit (serving-track.md, "Only the model's own replies count"): every replay run keeps a random
   sample of its completed live turns, each with its exact request body and reply tokens (replay.py). In
   the last block (the second B), after its perf runs, AUDIT_RESEND of the candidate blocks' kept turns and
   AUDIT_RESEND of the first baseline block's (chosen with the OS's randomness) are sent again, byte for
   byte, to that unpatched server (replay.resend: the same adapter's greedy forced-length body, the same
   stream parse and tokenizer). Agreement of a turn: score.common_prefix_fraction(the baseline's new reply,
   the recorded reply); the first block's turns give the baseline's self-agreement, the calibration, the
   candidate's are gated against it (score.py's condition (d)). A calibration turn the baseline cannot
   answer is the node's or the harness's fault (exit 3); a candidate turn it cannot answer (the candidate's
   own earlier replies are in that history) counts as agreement 0.
7. The result: pipeline/serving/document.py's serving_document (S, G, eps from the two baseline blocks' spread,
   every run's figures), status passed, or needs_review when the gate flagged lines for a maintainer,
   or incorrect when G = 0.

Failures, each a clear status with what, where and what to do, and the server's log tail, never a score:
- the candidate's server does not start, exits before it is ready, or is not ready within the launch's
  wall clock ([limits.serving] launch and the template's ready_timeout_s): runtime_error / timeout;
- the candidate's server exits during a level or GSM8K: runtime_error; its cache flush or its readiness
  failing at a level's start: runtime_error;
- a level past warm-up + window + [limits.serving] level_extra, or GSM8K past [limits.serving] gsm8k:
  timeout; GSM8K with too many failed requests: runtime_error;
- the baseline failing in any of these ways: the node or the harness is at fault, not the patch: exit 3
  and no result (bench.yml then posts nothing and an organizer looks at the node).

Exit codes (those of the kernel track's `python -m pipeline evaluate`): 0 a result was written and its
status is passed or needs_review; 1 a result was written with another status (rejected, incorrect,
runtime_error, timeout); 2 bad input, nothing written; 3 harness error (the baseline, the pinned tree,
the node), nothing written. Progress goes to stderr, one line per launch, level run and GSM8K pass.

Official (--official): the competition.toml [serving] plan unchanged (no --levels, --window-s,
--warmup-s, --runs, --gsm8k-questions, --gsm8k-max-tokens, --turn-timeout-s), no delay knob, the
checkout's pin and limits, a template that runs the patched tree, the dataset being the runner's hidden
set (its sha256 recorded in datasets/serving/hidden-set-summary.json as `hidden_set_sha256`, or given by
the runner's $PIPELINE_SERVING_DATASET_SHA256; its corpus, generator and tokenizer those of the summary),
and both servers isolated (Policy(isolate=True): no plain fallback). Otherwise it refuses (exit 2).

The test-only knobs: --delay-ms-baseline / --delay-ms-candidate slow that side's server by an injected
per-chunk delay (launch.py, the template's `slowdown`): a slowed candidate scores below 1, a slowed
baseline (the candidate then being the baseline's own server, faster) above 1, and the baseline against
itself 1 within eps. --pin and --limits take another pin (test templates) and [limits.serving].
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from pipeline.exits import UsageError  # bad input: nothing was run, nothing is written (exit 2)
from pipeline.problems import REPO_ROOT

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_HARNESS = 0, 1, 2, 3
DATASET_ENV = "PIPELINE_SERVING_DATASET"
DATASET_SHA_ENV = "PIPELINE_SERVING_DATASET_SHA256"
HIDDEN_SUMMARY = REPO_ROOT / "datasets" / "serving" / "hidden-set-summary.json"
COMPETITION_TOML = REPO_ROOT / "competition.toml"
ORDER = ("baseline", "candidate", "candidate", "baseline")
GSM8K_BLOCKS = (2, 3)  # the last candidate block and the last baseline block
AUDIT_BLOCK = 3  # the last baseline block re-sends the audit's turns (step 5 of the docstring)
AUDIT_RESEND = 48  # turns re-sent per side: of the candidate blocks' audit samples, and of the first baseline block's
AUDIT_CONCURRENCY = 8


class HarnessFailure(Exception):
    """The baseline, the pinned tree or the node failed: not the patch's fault, no result (exit 3)."""


class CandidateFailure(Exception):
    """The candidate's server failed: a result with this status (exit 1)."""

    def __init__(self, status: str, message: str, log_tail: str = ""):
        super().__init__(message)
        self.status, self.log_tail = status, log_tail


# ---- the plan: competition.toml [serving] ----

SERVING_KEYS = {"levels": "levels", "runs": "count", "window_s": "seconds", "window_s_c1": "seconds",
                "warmup_s": "seconds0", "turn_timeout_s": "seconds", "gsm8k_questions": "count",
                "gsm8k_concurrency": "count", "gsm8k_max_tokens": "count", "seed": "integer"}


@dataclass(frozen=True)
class Plan:
    """What one evaluation measures."""

    levels: tuple[int, ...]
    runs: int
    window_s: float
    window_s_c1: float
    warmup_s: float
    turn_timeout_s: float
    gsm8k_questions: int
    gsm8k_concurrency: int
    gsm8k_max_tokens: int
    seed: int

    def window(self, c: int) -> float:
        return self.window_s_c1 if c == 1 else self.window_s

    def level_seed(self, run: int, c: int) -> int:
        return self.seed + 1000 * run + c

    def measured_s(self) -> float:
        """Seconds of replay per evaluation: 4 blocks x runs x the levels' warm-ups and windows."""
        return len(ORDER) * self.runs * sum(self.warmup_s + self.window(c) for c in self.levels)


def load_plan(path: Path | None = None) -> Plan:
    """competition.toml [serving], read strictly: every key present, none unknown, each of its kind."""
    import tomllib

    path = Path(path or COMPETITION_TOML)
    try:
        table = tomllib.loads(path.read_text()).get("serving")
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise UsageError(f"{path}: cannot be read as TOML ({exc})") from None
    where = f"{path.name} [serving]"
    if not isinstance(table, dict):
        raise UsageError(f"{where}: the table is missing; it needs {', '.join(SERVING_KEYS)}")
    unknown, missing = sorted(set(table) - set(SERVING_KEYS)), [k for k in SERVING_KEYS if k not in table]
    if unknown or missing:
        raise UsageError(f"{where}: " + "; ".join(([f"unknown key(s) {', '.join(unknown)}"] if unknown else []) +
                                                  ([f"missing key(s) {', '.join(missing)}"] if missing else [])))
    out: dict[str, Any] = {}
    for key, kind in SERVING_KEYS.items():
        v = table[key]
        number = isinstance(v, (int, float)) and not isinstance(v, bool)
        if kind == "levels":
            ok = isinstance(v, list) and v and all(isinstance(c, int) and not isinstance(c, bool) and c >= 1 for c in v) \
                and v == sorted(set(v))
            v = tuple(v) if ok else v
        elif kind == "count":
            ok = isinstance(v, int) and not isinstance(v, bool) and v >= 1
        elif kind == "integer":
            ok = isinstance(v, int) and not isinstance(v, bool)
        elif kind == "seconds0":
            ok = number and v >= 0
        else:
            ok = number and v > 0
        if not ok:
            raise UsageError(f"{where} {key}: {v!r} is not {'ascending distinct concurrencies' if kind == 'levels' else kind}")
        out[key] = float(v) if kind.startswith("seconds") else v
    return Plan(**out)


# ---- small facts ----

def _harness_commit() -> str | None:
    import subprocess

    try:
        done = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    sha = done.stdout.strip()
    return sha if done.returncode == 0 and len(sha) == 40 else None


def _gpus() -> dict[str, Any]:
    import subprocess

    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=name,uuid,driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    rows = [[x.strip() for x in line.split(",")] for line in done.stdout.splitlines() if line.strip()]
    if done.returncode != 0 or not rows:
        return {}
    names = sorted({r[0] for r in rows})
    return {"gpu": f"{len(rows)}x {' / '.join(names)}", "gpu_uuid": ",".join(r[1] for r in rows if len(r) > 1),
            "driver": rows[0][2] if len(rows[0]) > 2 else None}


def engine_version(template, pin) -> str:
    if template.version == "pin":
        return pin.version
    from importlib import metadata

    try:
        return metadata.version(template.version)
    except metadata.PackageNotFoundError:
        return f"{template.version} (not installed here)"


def check_official_dataset(document_meta: dict[str, Any], sha: str, summary_path: Path = HIDDEN_SUMMARY,
                           environ: dict[str, str] | None = None) -> str | None:
    """Why the dataset cannot be the official hidden set, or None when it is."""
    environ = os.environ if environ is None else environ
    try:
        summary = json.loads(Path(summary_path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        return f"{summary_path} cannot be read ({exc})"
    recorded = summary.get("hidden_set_sha256") or environ.get(DATASET_SHA_ENV)
    if not recorded:
        return (f"the hidden set's sha256 is recorded nowhere: neither {summary_path.name} (hidden_set_sha256) nor "
                f"${DATASET_SHA_ENV} holds it (docs/RUNBOOK.md: record it when the set is generated)")
    if sha != recorded:
        return f"the dataset's content sha256 is {sha}, but the hidden set's is {recorded}: not the runner's hidden set"
    for key, want in (("corpus", summary.get("corpus")), ("generator_version", summary.get("generator_version")),
                      ("tokenizer_sha256", summary.get("tokenizer_sha256")),
                      ("shape", (summary.get("shape") or {}).get("name"))):
        if want is not None and document_meta.get(key) != want:
            return f"the dataset's metadata {key} is {document_meta.get(key)!r}, the hidden set's {want!r}"
    return None


# ---- the evaluation ----

@dataclass
class Inputs:
    patch: Path
    template_name: str
    dataset: Path
    plan: Plan
    official: bool = False
    meta: dict[str, Any] = field(default_factory=dict)
    delay_ms: dict[str, float] = field(default_factory=lambda: {"baseline": 0.0, "candidate": 0.0})
    pin_path: Path | None = None
    limits_path: Path | None = None
    records: Path | None = None
    isolate: bool | None = None  # None: where this host can; the official run forces True


def _say(progress: Callable[[str], None] | None, line: str) -> None:
    if progress:
        progress(line)


def evaluate(inputs: Inputs, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run one serving evaluation; returns the result document (validated). Raises UsageError (nothing ran)
    or HarnessFailure (the baseline or the node failed; no result)."""
    from pipeline import result, sandbox
    from pipeline.files import UnreadableFile
    from pipeline.serving import document, gate, launch, replay
    from pipeline.serving import pin as pin_stage

    started_at = result.now()
    plan = inputs.plan
    try:
        pin = pin_stage.load_pin(inputs.pin_path)
        template = pin_stage.launch_template(pin, inputs.template_name)
    except pin_stage.PinError as exc:
        raise UsageError(str(exc)) from None
    try:
        limits = launch.serving_limits(inputs.limits_path)
    except sandbox.LimitsError as exc:
        raise UsageError(str(exc)) from None
    try:
        model = launch.resolve_model(template)
    except launch.LaunchError as exc:
        raise UsageError(str(exc)) from None
    if not inputs.dataset.is_file():
        raise UsageError(f"{inputs.dataset}: no such dataset file (pass --dataset, or set ${DATASET_ENV})")
    try:
        system, conversations, dataset_sha = replay.load_dataset(inputs.dataset)
    except replay.ReplayError as exc:
        raise UsageError(str(exc)) from None
    from pipeline.serving import trace

    meta_of_set = trace.read(inputs.dataset)["metadata"]
    if template.context_length is not None and meta_of_set.get("window", 0) > template.context_length:
        raise UsageError(f"{inputs.dataset} was made for a {meta_of_set['window']:,}-token window, more than the "
                         f"{template.context_length:,} tokens the template {template.name!r} serves")
    try:
        tokenizer, tok_facts = launch.counting_tokenizer(template, model)
    except replay.ReplayError as exc:
        raise UsageError(f"the tokenizer output is counted with: {exc}") from None
    from pipeline.serving import gsm8k

    if plan.gsm8k_questions > gsm8k.TEST_QUESTIONS:
        raise UsageError(f"--gsm8k-questions {plan.gsm8k_questions}: the GSM8K test split has {gsm8k.TEST_QUESTIONS}")
    for side, ms in inputs.delay_ms.items():
        if ms and template.slowdown is None:
            raise UsageError(f"--delay-ms-{side}: the template {template.name!r} has no `slowdown`, so nothing can slow it")
    if inputs.official:
        why = official_problem(inputs, template, plan, meta_of_set, dataset_sha)
        if why:
            raise UsageError(f"refusing an official evaluation: {why}")
    policy = sandbox.Policy(isolate=True if inputs.official else inputs.isolate, limits=limits.sandbox)
    if inputs.official:
        ok, why = sandbox.availability()
        if not ok:
            raise UsageError(f"refusing an official evaluation: the servers cannot be isolated here: {why}")
    if model is not None and policy.isolate is not False and sandbox.availability()[0]:
        hidden = launch.unreadable_by_others([model])
        if hidden:
            raise UsageError(f"the isolated server runs as a uid of its own, which cannot read {', '.join(hidden)} "
                             f"(of ${template.model_env}): make the model readable by every user (chmod -R a+rX)")
    try:
        patch_bytes = gate.read_patch(inputs.patch, pin.rules["max_bytes"] + 1)
    except UnreadableFile as exc:
        if "bytes" not in str(exc):
            raise UsageError(f"{inputs.patch}: {exc}") from None
        patch_bytes = None  # larger than the gate's limit: the gate says so, as a rejection
    submission = {
        "path": str(inputs.meta.get("path", inputs.patch)),
        "blob_sha": result.git_blob_sha(patch_bytes if patch_bytes is not None else inputs.patch.read_bytes()),
        "login": inputs.meta.get("login"), "pr": inputs.meta.get("pr"), "head_sha": inputs.meta.get("head_sha"),
    }
    device = launch.resolve_device(template)
    engine_facts: dict[str, Any] = {"name": template.engine, "version": engine_version(template, pin),
                                    "gpus": template.gpus, "launch": " ".join(template.argv)[:2000]}
    if model:
        engine_facts["model"] = model[-2000:]
    dataset_facts = {"sha256": dataset_sha, "conversations": len(conversations), "name": inputs.dataset.name[:2000]}
    mode = {"device": device, "model": "full" if inputs.official else "smoke",
            "timing": "closed-loop replay, client timestamps", "seeds": "secret" if inputs.official else "public"}
    environment: dict[str, Any] = {"python": sys.version.split()[0], "platform": sys.platform,
                                   "harness_commit": _harness_commit(), "tokenizer": tok_facts,
                                   "launch_template": template.name, "sandbox": {}}
    if device == "cuda":
        environment.update(_gpus())
    flags: list[dict[str, Any]] = []
    for side, ms in inputs.delay_ms.items():
        if ms:
            flags.append({"code": "delay_knob", "line": None,
                          "message": f"the {side}'s server was slowed by {ms:g} ms per chunk (a test knob, never official)"})

    def failure(status: str, message: str, verdict: dict[str, Any], log_tail: str = "",
                where: dict[str, Any] | None = None) -> dict[str, Any]:
        return document.serving_failure_document(
            status=status, message=message, submission=submission, patch_gate=verdict, engine=engine_facts,
            dataset=dataset_facts, official=False, mode=mode, environment=environment, started_at=started_at,
            finished_at=result.now(), log_tail=log_tail, where=where, flags=flags)

    # the gate, before anything runs
    try:
        verdict = gate.gate_file(inputs.patch, None, pin)
    except gate.GateUnavailable as exc:
        raise HarnessFailure(f"the patch gate cannot run on this machine: {exc}") from None
    verdict_dict = verdict.as_dict()
    _say(progress, verdict.text().splitlines()[0])
    if not verdict.accepted:
        lines = [f"{r.file or '(the patch)'}" + (f" (patch line {r.line})" if r.line else "") + f": [{r.rule}] {r.message}"
                 for r in verdict.reasons]
        first = verdict.reasons[0] if verdict.reasons else None
        where = {"file": first.file or "patch.diff", "line": first.line or None} if first else None
        return failure("rejected", "the patch gate refused the patch, so it was never launched:\n" + "\n".join(lines[:50]),
                       verdict_dict, where=where)

    from pipeline.serving import renaming

    names = renaming.Names(conversations, tokenizer)  # once, past the gate: every run's replays are renamed from it
    work = Path(tempfile.mkdtemp(prefix="muse-serving-"))
    os.chmod(work, 0o755)
    runs: dict[int, list[dict[int, dict[str, Any]]]] = {}
    canaries: dict[int, dict[tuple[str, int], list[int]]] = {}
    audits: dict[int, list[dict[str, Any]]] = {}
    population: dict[int, int] = {}
    audit_sample: dict[str, list[dict[str, Any]]] = {}
    resent: dict[str, list[dict[str, Any]]] = {}
    gsm8k_results: dict[int, dict[str, Any]] = {}
    launch_s: dict[str, float] = {}
    try:
        try:
            trees = {"baseline": launch.fresh_tree(pin, work / "baseline", None),
                     "candidate": launch.fresh_tree(pin, work / "candidate", patch_bytes)}
        except launch.TreeError as exc:
            raise HarnessFailure(str(exc)) from None
        for block, side in enumerate(ORDER):
            if block == AUDIT_BLOCK:
                audit_sample = audit_choice(audits)
            try:
                runs[block], canaries[block], gsm8k, audits[block], population[block] = _block(
                    block, side, template, trees[side], model, policy, limits, plan, inputs, system, conversations,
                    tokenizer, dataset_sha, environment, launch_s, progress,
                    audit_sample if block == AUDIT_BLOCK else None, resent, names)
            except CandidateFailure as exc:
                if side == "baseline":
                    raise HarnessFailure(f"{exc} (the unpatched baseline failed: the node or the harness is at fault, "
                                         f"not the patch)\n--- the baseline server's output ---\n{exc.log_tail}") from None
                return failure(exc.status, str(exc), verdict_dict, log_tail=exc.log_tail)
            if gsm8k is not None:
                gsm8k_results[block] = gsm8k
    finally:
        shutil.rmtree(work, ignore_errors=True)

    from pipeline.serving import score as sc

    reference = canaries[0]
    candidate_outputs: dict[tuple[str, int], list[int]] = {}
    for block in (1, 2):
        for k, v in canaries[block].items():
            candidate_outputs.setdefault(k, v)
    cand_agreement, turns = sc.canary_agreement(reference, candidate_outputs)
    base_agreement, _ = sc.canary_agreement(reference, canaries[3])
    audit = {side: sc.audit_summary((r["token_ids"], item["token_ids"])
                                    for item, r in zip(audit_sample.get(side, []), resent.get(side, [])))
             for side in ("candidate", "baseline")}
    # no audit turn is no evidence: a failure where evidence was due (score.py, condition (d))
    audit["required"] = bool(inputs.official or population.get(1, 0) + population.get(2, 0) > 0)
    engine_facts["launch_s"] = {**launch_s}
    for side in ("baseline", "candidate"):
        values = [v for k, v in launch_s.items() if k.endswith(side)]
        if values:
            engine_facts["launch_s"][side] = round(sum(values) / len(values), 3)
    for why in node_drift(environment.get("node_probes") or []):
        flags.append({"code": "node_drift", "line": None, "message": why + ": the candidate's blocks may have left the "
                      "node slower for the baseline's last block; held for review"})
    isolated = all(d.get("isolation") == "namespaces" for d in environment["sandbox"].values())
    if not isolated:
        flags.append({"code": "not_isolated", "line": None,
                      "message": "a server ran without isolation (no namespaces on this host): never official"})
    try:
        doc = document.serving_document(
            submission=submission, patch_gate=verdict_dict, engine=engine_facts, dataset=dataset_facts,
            baseline_first=runs[0], baseline_second=runs[3], candidate=runs[1] + runs[2],
            canary={"candidate": cand_agreement, "baseline": base_agreement, "turns": turns}, audit=audit,
            gsm8k={"candidate": gsm8k_results[2]["accuracy"], "baseline": gsm8k_results[3]["accuracy"],
                   "questions": gsm8k_results[3]["questions"]},
            official=bool(inputs.official and isolated), mode=mode, environment=environment, started_at=started_at,
            finished_at=result.now(), flags=flags,
            needs_review=bool(verdict.flags) or any(f["code"] == "node_drift" for f in flags))
    except result.ResultError as exc:
        raise HarnessFailure(str(exc)) from None
    return doc


def audit_choice(audits: dict[int, list[dict[str, Any]]], count: int = AUDIT_RESEND) -> dict[str, list[dict[str, Any]]]:
    """The turns the last baseline block re-sends: `count` of the candidate blocks' kept turns and `count` of the
    first baseline block's, each drawn without replacement with the OS's randomness (all of them when fewer)."""
    import random

    chooser = random.SystemRandom()
    out = {}
    for side, blocks in (("candidate", (1, 2)), ("baseline", (0,))):
        pool = [item for b in blocks for item in audits.get(b, [])]
        out[side] = chooser.sample(pool, min(count, len(pool)))
    return out


def _resend_audit(server, plan: Plan, limits, template, tokenizer, sample: dict[str, list[dict[str, Any]]],
                  resent: dict[str, list[dict[str, Any]]], name: str, progress) -> None:
    """The audit's re-sends to this (the last baseline) server; fills `resent` per side, in the sample's order."""
    import math
    import random

    from pipeline.serving import replay

    items = [(side, item) for side in ("candidate", "baseline") for item in sample.get(side, [])]
    if not items:
        return
    # both sides' turns in one random order, so the calibration sees the same load and batching as the audit
    random.SystemRandom().shuffle(items)
    bodies = [(item["request"].encode("utf-8"), int(item["max_tokens"])) for _side, item in items]

    def ask():
        return replay.resend(server.url, bodies, tokenizer, engine=template.engine, concurrency=AUDIT_CONCURRENCY,
                             turn_timeout_s=plan.turn_timeout_s)

    waves = math.ceil(len(bodies) / AUDIT_CONCURRENCY)
    got = server.call(ask, timeout_s=waves * plan.turn_timeout_s + limits.level_extra_s,
                      what=f"the audit's {len(bodies)} re-sent turns")
    order = {side: [] for side in ("candidate", "baseline")}
    for (side, item), r in zip(items, got):
        if side == "baseline" and r["status"] != "ok":
            raise replay.ReplayError(f"the audit: the baseline did not answer a turn of its own first block again "
                                     f"({item['conversation']} turn {item['turn']}: {r['status']}, {r['error']})")
        order[side].append((item, r))
    for side, pairs in order.items():
        # in the sample's order, which the caller zips with: the sample itself is reordered to match
        sample[side] = [item for item, _r in pairs]
        resent[side] = [r for _item, r in pairs]
    for side in ("candidate", "baseline"):
        if sample.get(side):
            ok = [r for r in resent.get(side, []) if r["status"] == "ok"]
            _say(progress, f"{name}: audit, {len(sample[side])} of the {side}'s live turns re-sent"
                 + (f" ({len(sample[side]) - len(ok)} not answered)" if len(ok) < len(sample[side]) else ""))


def _block(block: int, side: str, template, tree: Path, model: str | None, policy, limits, plan: Plan,
           inputs: Inputs, system: str, conversations: list, tokenizer, dataset_sha: str,
           environment: dict[str, Any], launch_s: dict[str, float], progress,
           audit_sample: dict[str, list[dict[str, Any]]] | None = None,
           resent: dict[str, list[dict[str, Any]]] | None = None, names=None):
    """One block: launch, the sweeps, the audit's re-sends where due, GSM8K where it is due, stop.
    CandidateFailure says how it failed. Returns (sweeps, canary outputs, GSM8K, audit turns, live turns finished)."""
    from pipeline.serving import engine, gsm8k, launch, metrics, replay
    from pipeline.serving import score as sc

    name = f"block {block + 1}/{len(ORDER)} ({side})"
    delay = inputs.delay_ms.get(side, 0.0)
    server = launch.Server(template, tree=tree, model=model, policy=policy, limits=limits, delay_ms=delay, label=side)
    sweeps: list[dict[int, dict[str, Any]]] = []
    outputs: dict[tuple[str, int], list[int]] = {}
    kept: list[dict[str, Any]] = []
    finished_live = 0
    accuracy = None
    what = "its launch"
    clean_exit = False
    try:
        try:
            server.start()
            environment["sandbox"].setdefault(side, server.describe())
            _say(progress, f"{name}: launched {template.name} ({server.describe().get('isolation')} isolation"
                           + (f", {delay:g} ms per chunk added" if delay else "") + "); waiting for "
                           f"GET {template.ready}")
            launch_s[f"block_{block + 1}_{side}"] = round(server.wait_ready(), 3)
            _say(progress, f"{name}: ready in {server.launch_s:.1f} s"
                 + (f", warm-up {server.warmup_s:.1f} s" if server.warmup_s is not None else ""))
            for r in range(plan.runs):
                sweep: dict[int, dict[str, Any]] = {}
                for c in plan.levels:
                    what = f"c = {c}, run {r + 1}/{plan.runs}"
                    window = plan.window(c)

                    def replay_level(c=c, r=r, window=window):
                        return replay.run(server.url, system, conversations, tokenizer, engine=template.engine,
                                          concurrency=c, window_s=window, warmup_s=plan.warmup_s,
                                          seed=plan.level_seed(r, c), turn_timeout_s=plan.turn_timeout_s,
                                          facts={"dataset_sha256": dataset_sha, "block": block, "side": side},
                                          names=names)

                    doc = server.call(replay_level, timeout_s=plan.warmup_s + window + limits.level_extra_s,
                                      what=f"the level (warm-up {plan.warmup_s:g} s + window {window:g} s + "
                                           f"{limits.level_extra_s:g} s)")
                    lv = metrics.level(doc, gpus=template.gpus)
                    lv["block"], lv["run"] = block, r
                    sweep[c] = lv
                    if inputs.records is not None:
                        _write_record(inputs.records / f"block{block + 1}-{side}-c{c}-run{r + 1}.json.gz", doc)
                    for k, v in sc.canary_outputs([doc]).items():
                        outputs.setdefault(k, v)
                    kept += doc.get("audit") or []
                    finished_live += int(doc["facts"].get("audit_population") or 0)
                    u = lv["unscored"]
                    _say(progress, f"{name} {what}: T_c {lv['T']:.1f} tok/s/GPU, I_c "
                         + ("-" if lv["I"] is None else f"{lv['I']:.1f}") + " tok/s, TTFT p50 "
                         + ("-" if u["ttft_p50_ms"] is None else f"{u['ttft_p50_ms']:.0f}") + f" ms, "
                         f"{lv['window_turns']} turns in the window, " + ("valid" if lv["valid"] else
                                                                         "INVALID: " + "; ".join(lv["invalid_reasons"])))
                    if side == "baseline" and (not lv["valid"] or lv["I"] is None or not lv["T"]):
                        # no score can be had without it: stop now rather than after hours of candidate runs
                        why = "; ".join(lv["invalid_reasons"]) or "no turn ended inside its measurement window"
                        raise HarnessFailure(f"{name} {what}: the unpatched baseline's level is invalid ({why}): the "
                                             "node, the dataset or the windows are at fault (a window must hold "
                                             "whole turns at every level)")
                sweeps.append(sweep)
            if audit_sample is not None and resent is not None:
                what = "the audit"
                _resend_audit(server, plan, limits, template, tokenizer, audit_sample, resent, name, progress)
                if inputs.records is not None:
                    _write_record(inputs.records / f"block{block + 1}-{side}-audit.json.gz",
                                  {"sample": audit_sample, "resent": resent})
            if block in GSM8K_BLOCKS:
                what = "GSM8K"
                _say(progress, f"{name}: GSM8K 5-shot, {plan.gsm8k_questions} questions")

                def ask():
                    return gsm8k.run(server.url, engine.adapter(template.engine), questions=plan.gsm8k_questions,
                                     concurrency=plan.gsm8k_concurrency, timeout_s=gsm8k.DEFAULT_TIMEOUT_S,
                                     max_tokens=plan.gsm8k_max_tokens)

                got = server.call(ask, timeout_s=limits.gsm8k_s, what="the GSM8K pass")
                accuracy = {"accuracy": got["accuracy"], "questions": got["questions"], "correct": got["correct"],
                            "failed": got["failed"]}
                if inputs.records is not None:
                    _write_record(inputs.records / f"block{block + 1}-{side}-gsm8k.json.gz", got)
                _say(progress, f"{name}: {gsm8k.summary_text(got)}")
        except launch.LaunchError as exc:
            raise CandidateFailure("runtime_error", f"{name}: {exc}. {_advice(side, 'launch')}", server.log_tail()) from None
        except launch.ServerDied as exc:
            advice = _advice(side, "launch" if what == "its launch" else "died")
            raise CandidateFailure("runtime_error", f"{name}, {what}: {exc}. {advice}", server.log_tail()) from None
        except launch.PhaseTimeout as exc:
            raise CandidateFailure("timeout", f"{name}, {what}: {exc}; the server was stopped. {_advice(side, 'timeout')}",
                                   server.log_tail()) from None
        except replay.ReplayError as exc:
            raise CandidateFailure("runtime_error", f"{name}, {what}: {exc}. {_advice(side, 'replay')}",
                                   server.log_tail()) from None
        except gsm8k.GSM8KError as exc:
            raise CandidateFailure("runtime_error", f"{name}, GSM8K: {exc}. {_advice(side, 'gsm8k')}",
                                   server.log_tail()) from None
        clean_exit = True
    finally:
        server.stop()
        if inputs.records is not None:
            inputs.records.mkdir(parents=True, exist_ok=True)
            (inputs.records / f"block{block + 1}-{side}-server.log").write_text(server.log_tail(1 << 20))
        _say(progress, f"{name}: stopped" + (f" ({server.killed} more processes of it killed)" if server.killed else ""))
    if clean_exit and server.command is not None and server.command.device == "cuda":
        _gpus_clear(name, environment, progress)  # a failed block stops the evaluation; the runner's check follows
        _node_probe(name, environment, progress)
    return sweeps, outputs, accuracy, kept, finished_live


# The node between blocks (B2 runs right after C2: a candidate that left the node slower would gain): the known
# kernel of `runner health` on every GPU after each block, in a process of its own so that the evaluator holds no
# GPU memory. After a candidate block against after the first baseline block, a kernel slower by NODE_KERNEL_DRIFT,
# an SM clock under load lower by NODE_CLOCK_DROP, a GPU hotter by NODE_HEAT_C, or an unhealthy node holds the
# result for review.
NODE_KERNEL_DRIFT = 0.03
NODE_CLOCK_DROP = 0.05
NODE_HEAT_C = 15
NODE_PROBE_S = 180


def _node_probe(name: str, environment: dict[str, Any], progress) -> None:
    import subprocess

    with tempfile.TemporaryDirectory(prefix="muse-node-") as tmp:
        out = Path(tmp) / "health.json"
        try:
            done = subprocess.run([sys.executable, "-m", "pipeline", "runner", "health", "--device", "cuda", "--json",
                                   str(out)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=NODE_PROBE_S)
            doc = json.loads(out.read_text()) if out.is_file() else None
        except (subprocess.TimeoutExpired, OSError, ValueError) as exc:
            done, doc = None, None
            why = f"{type(exc).__name__}: {exc}"
        else:
            why = None if doc is not None else f"exit {done.returncode}: {done.stderr[-300:]}"
    environment.setdefault("node_probes", []).append(node_reading(name, doc, why))
    _say(progress, f"{name}: node probe " + ("taken" if doc is not None else f"failed ({why})"))


def node_reading(name: str, health: dict[str, Any] | None, why: str | None = None) -> dict[str, Any]:
    """What the node check keeps of one `runner health --json` document: per GPU the known kernel's median, the SM
    clock under load and the temperature; whether the node was healthy."""
    if health is None:
        return {"after": name, "healthy": None, "why": why, "devices": []}
    devices = []
    for d in ((health.get("readings") or {}).get("gpu") or {}).get("devices") or []:
        devices.append({"index": d.get("index"), "kernel_ms": (d.get("kernel") or {}).get("median_ms"),
                        "sm_clock_mhz": d.get("sm_clock_mhz"), "temperature_c": d.get("temperature_c")})
    return {"after": name, "healthy": bool(health.get("healthy")), "reasons": list(health.get("reasons") or [])[:8],
            "devices": devices}


def node_drift(probes: list[dict[str, Any]]) -> list[str]:
    """Why the node after a candidate block is not the node the first baseline block left (empty when it is):
    the probes in block order, the first after block 1 (baseline), the next after the candidate blocks."""
    if len(probes) < 2:
        return []
    before = {d["index"]: d for d in probes[0]["devices"]}
    out = []
    for probe in probes[1:3]:
        where = probe["after"]
        if probe["healthy"] is False or probe["healthy"] is None:
            out.append(f"after {where} the node's health check " + (
                "failed: " + "; ".join(probe.get("reasons") or []) if probe["healthy"] is False else
                f"could not run ({probe.get('why')})"))
            continue
        for d in probe["devices"]:
            b = before.get(d["index"])
            if b is None:
                continue
            k0, k1 = b.get("kernel_ms"), d.get("kernel_ms")
            if k0 and k1 and k1 / k0 - 1 > NODE_KERNEL_DRIFT:
                out.append(f"after {where} GPU {d['index']}'s known kernel took {k1:.3f} ms against {k0:.3f} ms after "
                           f"the first baseline block ({k1 / k0 - 1:+.1%}, more than {NODE_KERNEL_DRIFT:.0%})")
            c0, c1 = b.get("sm_clock_mhz"), d.get("sm_clock_mhz")
            if c0 and c1 and 1 - c1 / c0 > NODE_CLOCK_DROP:
                out.append(f"after {where} GPU {d['index']}'s SM clock under load was {c1} MHz against {c0} MHz "
                           f"({c1 / c0 - 1:+.1%})")
            t0, t1 = b.get("temperature_c"), d.get("temperature_c")
            if t0 is not None and t1 is not None and t1 - t0 > NODE_HEAT_C:
                out.append(f"after {where} GPU {d['index']} was at {t1} C against {t0} C")
    return out


def _gpus_clear(name: str, environment: dict[str, Any], progress) -> None:
    """Every GPU of the node free again after a block's server stopped (NVML; issue 19: on 8 GPUs a replica
    or a tensor-parallel worker that outlived the stop would take its GPU from the next block)."""
    from pipeline import runner
    from pipeline.serving import launch

    reader, why = runner._reader()
    if reader is None:
        raise HarnessFailure(f"{name}: the GPUs cannot be read after the stop ({why}); install nvidia-ml-py")
    try:
        left = launch.gpu_leftovers(reader, ignore={os.getpid()})
    finally:
        reader.close()
    environment.setdefault("gpus_clear_after_stop", []).append({"block": name, "left": left})
    if left:
        listed = ", ".join(f"GPU {x['gpu']}: " + ("its processes cannot be listed" if x["pid"] is None else
                                                   f"pid {x['pid']}") for x in left)
        raise HarnessFailure(f"{name}: after the server stopped, {launch.GPU_CLEAR_S:g} s on, a process still holds "
                             f"a GPU ({listed}): the node is not clean for the next block; take the runner out "
                             "of rotation (docs/RUNBOOK.md, \"When the health check fails\")")
    _say(progress, f"{name}: every GPU clear")


def _advice(side: str, what: str) -> str:
    if side == "baseline":
        return "The unpatched server failed this way: check the node (docs/RUNBOOK.md)"
    return {
        "launch": "The patched server must start and answer its readiness check like the unpatched one: run "
                  "it locally from the pinned tree with your patch applied and read the log below",
        "died": "The patched server must keep serving through every level: the log below ends where it stopped",
        "timeout": "A level must finish within its warm-up, window and a margin; a server that stops answering "
                   "(its readiness check, its cache flush, its streams) is stopped",
        "replay": "The server must answer its readiness check and flush its cache at the start of every level "
                  "as the unpatched one does",
        "gsm8k": "The server must answer GSM8K's chat requests after the perf runs as the unpatched one does",
    }[what]


def _write_record(path: Path, document: dict[str, Any]) -> None:
    import gzip

    import orjson

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(orjson.dumps(document), compresslevel=5, mtime=0))


def official_problem(inputs: Inputs, template, plan: Plan, meta_of_set: dict[str, Any], sha: str) -> str | None:
    """Why this evaluation cannot be official, or None."""
    if plan != load_plan():
        return "it must measure competition.toml's [serving] plan unchanged (no --levels, --window-s, --warmup-s, " \
               "--runs, --gsm8k-*, --turn-timeout-s)"
    if any(inputs.delay_ms.values()):
        return "the delay knob is for tests"
    if inputs.pin_path is not None or inputs.limits_path is not None:
        return "it uses the checkout's sglang_pin/pin.toml and competition.toml (no --pin, --limits)"
    if not template.runs_patch:
        return f"the template {template.name!r} does not run the patched tree (no {{tree}} in its argv or env)"
    if inputs.isolate is False:
        return "the servers must be isolated"
    return check_official_dataset(meta_of_set, sha)


# ---- the command ----

def _levels(text: str) -> tuple[int, ...]:
    try:
        levels = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: concurrencies separated by commas, e.g. 1,4,16,32") from None
    if not levels or any(c < 1 for c in levels) or list(levels) != sorted(set(levels)):
        raise argparse.ArgumentTypeError(f"{text!r}: ascending distinct concurrencies of at least 1")
    return levels


def _register(p: argparse.ArgumentParser) -> None:
    p.add_argument("patch", type=Path, help="the serving patch.diff (a git diff against the pinned SGLang)")
    p.add_argument("--launch", required=True, metavar="TEMPLATE",
                   help="a launch template of sglang_pin/pin.toml [launch.<name>]: sglang (the 8xH200 node), "
                        "transformers (CPU, one GPU)")
    p.add_argument("--json", required=True, type=Path, metavar="OUT", help="write the result document here")
    p.add_argument("--dataset", type=Path, default=None,
                   help=f"the conversations (default: ${DATASET_ENV}, the hidden set on the runner)")
    p.add_argument("--meta", type=Path, metavar="JSON",
                   help="the submission's facts written by fetch-submission (pr, head_sha, login, path, blob_sha); "
                        "recorded after the patch's blob SHA is checked against them")
    p.add_argument("--official", action="store_true",
                   help="refuse to run unless the result can be official (the [serving] plan, the hidden set, "
                        "isolated servers, a template that runs the patch)")
    p.add_argument("--levels", type=_levels, help="concurrencies (default: competition.toml [serving] levels)")
    p.add_argument("--window-s", type=float, help="the window of every level (default: [serving] window_s, "
                                                  "window_s_c1 at c = 1)")
    p.add_argument("--warmup-s", type=float, help="the warm-up before each window (default: [serving] warmup_s)")
    p.add_argument("--runs", type=int, help="sweeps of the levels per block (default: [serving] runs)")
    p.add_argument("--gsm8k-questions", type=int, help="the first N GSM8K questions (default: [serving], all)")
    p.add_argument("--gsm8k-max-tokens", type=int, help="the cap on a GSM8K reply (default: [serving])")
    p.add_argument("--turn-timeout-s", type=float, help="a turn failing after this long (default: [serving])")
    p.add_argument("--records", type=Path, metavar="DIR",
                   help="also write every level's replay records, GSM8K's replies and the servers' logs here")
    p.add_argument("--delay-ms-baseline", type=float, default=0.0, metavar="MS",
                   help="tests only: slow the baseline's server by MS per streamed chunk (the template's slowdown)")
    p.add_argument("--delay-ms-candidate", type=float, default=0.0, metavar="MS",
                   help="tests only: slow the candidate's server by MS per streamed chunk")
    p.add_argument("--pin", type=Path, metavar="TOML", help="tests only: another pin (its launch templates)")
    p.add_argument("--limits", type=Path, metavar="TOML",
                   help="tests only: a competition.toml whose [limits.serving] replaces the checkout's")


def evaluate_command(args: argparse.Namespace) -> int:
    """Evaluate a serving patch: gate it, serve it B C C B against the unpatched baseline, score it.

    Exit 0 when a result was written with status passed or needs_review, 1 when a result was written with
    another status (rejected, incorrect, runtime_error, timeout), 2 on bad input (nothing written), 3 when
    the baseline, the pinned tree or the node failed (nothing written: not the patch's fault).
    """
    import signal

    from pipeline import result

    def usage(message: str) -> int:
        print(f"error: {message}", file=sys.stderr)
        return EXIT_USAGE

    if not os.path.lexists(args.patch):
        return usage(f"{args.patch}: no such file; pass the path of the patch.diff")
    dataset = args.dataset or (Path(os.environ[DATASET_ENV]) if os.environ.get(DATASET_ENV) else None)
    if dataset is None:
        return usage(f"no dataset: pass --dataset F or set ${DATASET_ENV} (the hidden set on the runner)")
    try:
        plan = load_plan()
    except UsageError as exc:
        return usage(str(exc))
    overrides = {}
    if args.levels is not None:
        overrides["levels"] = args.levels
    if args.window_s is not None:
        overrides["window_s"] = overrides["window_s_c1"] = args.window_s
    for name in ("warmup_s", "runs", "gsm8k_questions", "gsm8k_max_tokens", "turn_timeout_s"):
        if getattr(args, name) is not None:
            overrides[name] = getattr(args, name)
    for name, v in overrides.items():
        if name == "levels":
            continue
        if not (v > 0 or (name == "warmup_s" and v == 0)) or (name in ("runs", "gsm8k_questions", "gsm8k_max_tokens")
                                                               and v < 1):
            return usage(f"--{name.replace('_', '-')} {v}: it must be positive")
    plan = replace(plan, **overrides)
    meta: dict[str, Any] = {}
    if args.meta:
        try:
            meta = result.read_meta(args.meta, args.patch)
        except result.ResultError as exc:
            return usage(str(exc))
        if meta.get("track") not in (None, "serving"):
            return usage(f"--meta names track {meta['track']!r}; this is the serving track's evaluation")
    for side in ("baseline", "candidate"):
        if getattr(args, f"delay_ms_{side}") < 0:
            return usage(f"--delay-ms-{side} must not be negative")
    inputs = Inputs(patch=args.patch, template_name=args.launch, dataset=dataset, plan=plan, official=args.official,
                    meta={k: meta[k] for k in ("path", "login", "pr", "head_sha") if k in meta},
                    delay_ms={"baseline": args.delay_ms_baseline, "candidate": args.delay_ms_candidate},
                    pin_path=args.pin, limits_path=args.limits, records=args.records)
    # A runner that cancels the job sends SIGTERM: unwind as an error would, so every server is stopped.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    seconds = plan.measured_s()
    print(f"[serving] plan: {len(ORDER)} blocks (B C C B) x {plan.runs} run(s) x c = "
          f"{', '.join(map(str, plan.levels))}: " + (f"{seconds / 3600:.2f} h" if seconds >= 3600 else f"{seconds:.0f} s")
          + " of replay, plus 4 launches and 2 GSM8K passes", file=sys.stderr, flush=True)
    try:
        doc = evaluate(inputs, progress=lambda line: print(f"[serving] {line}", file=sys.stderr, flush=True))
    except UsageError as exc:
        return usage(str(exc))
    except HarnessFailure as exc:
        print(f"error: the evaluation could not be completed, and no result was written: {exc}", file=sys.stderr)
        return EXIT_HARNESS
    except KeyboardInterrupt:
        print("interrupted: every server of the evaluation was stopped; no result was written", file=sys.stderr)
        return 130
    except Exception:  # noqa: BLE001 - a fault of the harness itself: every server was stopped on the way out
        import traceback

        traceback.print_exc()
        print("error: the harness failed (the traceback above); no result was written", file=sys.stderr)
        return EXIT_HARNESS
    from pipeline import report

    try:
        print(report.terminal(doc))
    except Exception as exc:  # noqa: BLE001 - the report is another stage's; the result is what counts
        print(f"[serving] (the terminal report could not be printed: {type(exc).__name__}: {exc})", file=sys.stderr)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    result.write(doc, args.json)
    print(f"[serving] wrote {args.json}: {doc['status']}", file=sys.stderr)
    return EXIT_OK if doc["status"] in ("passed", "needs_review") else EXIT_FAILED


COMMANDS = {"evaluate": (_register, evaluate_command)}
