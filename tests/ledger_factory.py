"""Schema-valid result documents and small competitions for the ledger and board tests."""

from __future__ import annotations

import hashlib
import functools
import json
import math
import subprocess
from pathlib import Path
from typing import Any

from pipeline import competition as comp
from pipeline.ledger import GENESIS, problem_workloads, seal
from pipeline import signing
from pipeline.result import validate

# The key tests sign official results with (a fixed seed, so results are reproducible); tests/conftest.py
# writes its private half to a mode-600 file named by $PIPELINE_SIGNING_KEY_FILE and its public half to
# a keyring named by $PIPELINE_KEYRING.
TEST_KEY = signing.SigningKey.from_seed(b"muse-test-only-signing-key-seed!")
# A key no keyring knows: what a forger holds.
FOREIGN_KEY = signing.SigningKey.from_seed(b"muse-test-only-foreign-key-seed!")


def write_keyring(folder: Path, *keys: signing.SigningKey, status: str = "active") -> Path:
    """A keyring folder holding these keys' public halves (retired/ or revoked/ for those statuses)."""
    target = Path(folder) / ("" if status == "active" else status)
    target.mkdir(parents=True, exist_ok=True)
    for key in keys or (TEST_KEY,):
        (target / f"runner-{key.key_id[8:16]}.pub").write_bytes(key.public_pem())
    return Path(folder)


def write_private_key(path: Path, key: signing.SigningKey = TEST_KEY) -> Path:
    path = Path(path)
    path.write_bytes(key.private_pem())
    path.chmod(0o600)
    return path

WORKLOADS = {name: list(v[1]) for name, v in problem_workloads().items()}
PROBLEMS = problem_workloads()


def sha(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()


def result_doc(
    *,
    problem: str = "muse_bf16_proj",
    speedup: float = 1.5,
    rel: float = 0.005,
    login: str = "alice",
    pr: int = 1,
    head_sha: str | None = None,
    official: bool = True,
    status: str = "passed",
    track: str = "kernel",
    flags: tuple[str, ...] = (),
    workloads: list[str] | None = None,
) -> dict[str, Any]:
    """A result as the evaluator writes it: every workload at `speedup` (so the geometric mean is
    `speedup`), medians known to +-`rel`, baselines at 100 us. track="serving": a real serving result
    (pipeline/serving/document.py's serving_document, its `serving` section whole) whose candidate runs at `speedup`
    times the baseline's T_c and I_c at every level, so S = `speedup` (above 1 - eps), its interval +-`rel`;
    `problem` and `workloads` are the kernel track's and ignored."""
    if track == "serving":
        return _serving_doc(speedup=speedup, rel=rel, login=login, pr=pr, head_sha=head_sha, official=official,
                            status=status, flags=flags)
    names = workloads if workloads is not None else WORKLOADS[problem]
    perf = []
    for w in names:
        base, sub = 100.0, 100.0 / speedup
        perf.append({
            "workload": w, "median_us": sub, "interval_us": [sub * (1 - rel), sub * (1 + rel)], "n": 50,
            "baseline_median_us": base, "baseline_interval_us": [base * (1 - rel), base * (1 + rel)],
            "speedup": base / sub, "samples_us": [sub] * 3, "baseline_samples_us": [base] * 3,
        })
    lo = [p["baseline_interval_us"][0] / p["interval_us"][1] for p in perf]
    hi = [p["baseline_interval_us"][1] / p["interval_us"][0] for p in perf]

    def gm(xs: list[float]) -> float:
        return math.exp(sum(map(math.log, xs)) / len(xs))

    head = head_sha or sha(f"head-{pr}")
    doc = {
        "schema_version": 1,
        "track": track,
        "problem": problem if track == "kernel" else "serving",
        "submission": {
            "path": f"submissions/{track}/{problem}/{login}/submission.py",
            "blob_sha": sha(f"blob-{pr}-{login}"),
            "login": login if official else None,
            "pr": pr if official else None,
            "head_sha": head if official else None,
        },
        "status": status,
        "official": official,
        "mode": {"device": "cuda" if official else "cpu", "model": "full" if official else "smoke",
                 "timing": "cuda-graph" if official else "wall-clock (unofficial)",
                 "seeds": "secret" if official else "public"},
        "error": None,
        "correctness": [{"shape": w, "kind": "workload", "passed": True, "seeds": 8, "outputs": {}} for w in names],
        "performance": perf,
        "score": {"speedup": gm([p["speedup"] for p in perf]), "time_us": gm([p["median_us"] for p in perf]),
                  "interval": [gm(lo), gm(hi)]},
        "flags": [{"code": f, "message": f"{f} flagged", "line": None} for f in flags],
        "environment": {"gpu": "NVIDIA H200" if official else None, "torch": "2.13.0", "python": "3.11",
                        "harness_commit": None, "extra": "dropped from the ledger"},
        "baseline": f"reference/{problem}.py:baseline",
        # what the evaluator records: the baseline's identity, the one competition.toml pins
        **({"baseline_source": _baseline_source(problem)} if track == "kernel" else {}),
        "started_at": "2026-10-22T09:00:00.000Z",
        "finished_at": "2026-10-22T09:05:00.000Z",
        "signature": None,
    }
    validate(doc)
    return signing.sign(doc, TEST_KEY) if official else doc


@functools.lru_cache(maxsize=None)
def _identity(problem: str) -> tuple[tuple[str, Any], ...]:
    from pipeline.problems import ProblemError, baseline_identity, load_problem

    try:
        return tuple(baseline_identity(load_problem(problem)).items())
    except ProblemError:  # a result for no problem (the ledger's refusals): the evaluator never writes one
        return (("name", f"reference/{problem}.py:baseline"), ("sha256", "0" * 64), ("files", []))


def _baseline_source(problem: str) -> dict[str, Any]:
    return {k: (list(v) if isinstance(v, list) else v) for k, v in _identity(problem)}


def _serving_doc(*, speedup: float, rel: float, login: str, pr: int, head_sha: str | None, official: bool,
                 status: str, flags: tuple[str, ...]) -> dict[str, Any]:
    """result_doc's serving result, through tests/fixtures/serving_results/factory.py: the baseline's two
    blocks 2 * rel apart (its spread `rel`, so the interval is S / (1 + rel) .. S * (1 + rel)); status
    needs_review holds it for review, incorrect fails the canaries (G = 0), anything else is written as
    serving_failure_document writes it."""
    from fixtures.serving_results import factory as sf
    from pipeline.serving.document import serving_failure_document

    flagged = tuple({"code": f, "message": f"{f} flagged", "line": None} for f in flags)
    if status in ("passed", "needs_review", "incorrect"):
        doc = sf.serving_result(t=speedup, login=login, pr=pr, head_sha=head_sha, official=official, noise=2 * rel,
                                flags=flagged, needs_review=status == "needs_review", sign=False,
                                canary=(0.5, 0.995) if status == "incorrect" else (0.991, 0.995))
    else:
        head = head_sha or sha(f"head-{pr}")
        doc = serving_failure_document(
            status=status, message=f"the candidate's server: {status}",
            submission={"path": f"submissions/serving/{login}/patch.diff", "blob_sha": sha(f"blob-{pr}-{login}"),
                        "login": login if official else None, "pr": pr if official else None,
                        "head_sha": head if official else None},
            patch_gate={**sf.PATCH_GATE, "accepted": status != "rejected",
                        "reasons": [] if status != "rejected" else [{"rule": "denied-path", "file": "x", "line": 1,
                                                                     "message": "denied"}]},
            engine=dict(sf.ENGINE), dataset=dict(sf.DATASET), official=official, mode=dict(sf.MODE),
            environment=dict(sf.ENV), started_at="2026-11-05T09:00:00.000Z", finished_at="2026-11-05T09:30:00.000Z",
            flags=list(flagged))
    return signing.sign(doc, TEST_KEY) if official else doc


def resign(doc: dict[str, Any], key: signing.SigningKey = TEST_KEY) -> dict[str, Any]:
    """A result changed by a test, signed again as if the runner had produced it that way."""
    return signing.sign(doc, key)


def chain(bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Seal record bodies into a chain in this (arrival) order, as `ledger append` would."""
    out, prev = [], GENESIS
    for i, b in enumerate(bodies):
        out.append(seal(b, i, prev))
        prev = out[-1]["sha256"]
    return out


def raw(doc: dict[str, Any]) -> bytes:
    return (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()


def competition(days: int = 2, start: str = "2026-10-22T00:00:00Z", rule: str = "top_at_close",
                window_hours: int = 24, top: int = 10) -> comp.Competition:
    """A small competition: a kernel track of `days` days, then a one-day serving track."""
    s = comp.parse_instant(start)
    k_end = s + comp.HOUR * 24 * days
    return comp.parse({
        "name": "Test Open", "repository": "example/comp",
        "tracks": {"kernel": {"start": s, "end": k_end},
                   "serving": {"start": k_end, "end": k_end + comp.HOUR * 24}},
        "prizes": [{"place": 1, "usd": 100}],
        "daily_prize": {"usd": 10, "window_hours": window_hours, "rule": rule},
        "snapshots": {"top": top},
    })


def competition_toml(days: int = 2, rule: str = "top_at_close") -> str:
    return f"""name = "Test Open"
repository = "example/comp"
[tracks.kernel]
start = 2026-10-22T00:00:00Z
end = 2026-10-{22 + days:02d}T00:00:00Z
[tracks.serving]
start = 2026-10-{22 + days:02d}T00:00:00Z
end = 2026-10-{23 + days:02d}T00:00:00Z
[[prizes]]
place = 1
usd = 100
[daily_prize]
usd = 10
rule = "{rule}"
""" + _pins()


def _pins() -> str:
    """The repository's pinned baselines (what result_doc's baseline_source carries), so an official
    result appends as on the real ledger."""
    pins = comp.load().baselines
    return "[baselines]\n" + "".join(f'{k} = "{v}"\n' for k, v in sorted(pins.items()))


def write_competition(root: Path, days: int = 2, rule: str = "top_at_close") -> Path:
    path = Path(root) / "competition.toml"
    path.write_text(competition_toml(days, rule))
    return path


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def bare_origin(tmp_path: Path, files: dict[str, str] | None = None) -> Path:
    """A real bare repository holding one commit: competition.toml and `files` (the remote that publish
    pushes to in the tests)."""
    bare = tmp_path / "origin.git"
    git(tmp_path, "init", "--quiet", "--bare", "-b", "main", str(bare))
    seed = tmp_path / "seed"
    git(tmp_path, "init", "--quiet", "-b", "main", str(seed))
    write_competition(seed)
    for name, text in (files or {}).items():
        (seed / name).write_text(text)
    git(seed, "add", "-A")
    git(seed, "commit", "--quiet", "-m", "seed")
    git(seed, "push", "--quiet", str(bare), "main")
    return bare


def clone(origin: Path, dest: Path) -> Path:
    # through git's transport (file://), never by copying the object folder, which a push landing at the
    # same moment can change under the copy
    git(dest.parent, "clone", "--quiet", f"file://{origin}", str(dest))
    return dest
