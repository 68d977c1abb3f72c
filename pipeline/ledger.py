"""The results ledger: the only source of truth for the boards.

`results/ledger/YYYY-MM.jsonl`, append-only, one canonical JSON line per record: orjson's sorted keys, no
spaces, UTF-8 (record_version 2; orjson both writes and reads the ledger, so a line reads back as exactly
the record that was written). A record of version 1 keeps the form it was written in (the standard
library's json.dumps, ASCII), so that its sha256 and the chain over it still hold. Kinds of record:
- `result`: one accepted (merged) evaluation, what the board needs of its result document (never the
  raw samples), with `accepted_at` = the PR's merged_at (GitHub's server time); a result of the
  organizers' own solution carries `"entrant": "organizers"` (ENTRANT_KEY, see `result_record`), which
  no other record has;
- `disqualification` / `clearance`: marks an earlier result (by PR and head SHA). The result itself is
  never edited; the latest marking of a result (by `at`) decides its state: disqualified, or credited
  (a clearance credits a result held for review, or withdraws a disqualification).

Each result record's signed result document is kept beside the ledger, byte for byte, as
`results/evidence/<sha256>.json` (the record's `result_sha256`): `verify` re-checks its Ed25519
signature against the committed keyring (pipeline/signing.py) and that the record says exactly what the
signed document says, so a chain re-sealed from an edited record onward still fails, naming the record.

The hash chain runs over append (arrival) order across all shards: `seq` is the record's position in
that order, `prev` the `sha256` of the record with seq - 1 (64 zeros for the first), and `sha256` the
sha256 of the record's canonical JSON without its own `sha256` key. A record goes to the shard of the
month of its own time (`accepted_at` or `at`), so a record that arrives late (a delayed workflow) lands
in an older shard with the next seq; nothing is ever rewritten. Every derived view (board, snapshots,
prizes) orders records by time, never by seq, so arrival order cannot change them.

Every record is checked whole before anything is written (`record_problem`: the schema's rules and
bounds; `check_new`: no second record of a PR, one login per PR), and `append` writes the new shard
beside the old one and renames it into place: a refused, failing or killed append leaves every shard as
it was, byte for byte.

Pure functions of plain data first; the few that touch files (`read_shards`, `append`) come next, and the
`ledger` verb (append, verify, disqualify, clear: registered in pipeline/cli.py's VERBS) last.
"""

from __future__ import annotations

import argparse
import datetime as dt
import fcntl
import gc
import hashlib
import json
import os
import re
import signal
import stat
from contextlib import contextmanager
from functools import lru_cache, wraps
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import orjson

from pipeline.competition import REPO_ROOT, InstantError, format_instant, parse_instant as given_instant
from pipeline.exits import OK, REFUSED, USAGE, error
from pipeline.signing import SignatureError
# the years a record's times may name, as a result's; evaluated_at is the result's finished_at
from pipeline.result import EARLIEST, LATEST, SHA1_RE, parse_instant

LEDGER_DIR = Path("results") / "ledger"
EVIDENCE_DIR = Path("results") / "evidence"
SCHEMA_PATH = Path(__file__).resolve().parent / "schema" / "ledger.schema.json"
RECORD_VERSION = 2  # 2: canonical by orjson (UTF-8); 1: by json.dumps (ASCII), read and verified, never written
RECORD_VERSIONS = (1, 2)
GENESIS = "0" * 64
MARKINGS = ("disqualification", "clearance")
RECORDED_STATUSES = ("passed", "needs_review")
LOGIN_RE = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9-]{0,38})\Z")
SHARD_RE = re.compile(r"^(\d{4})-(\d{2})\.jsonl\Z")
CHAIN_KEYS = ("seq", "prev", "sha256")
# What the board and an auditor need of the environment; the rest stays in the result artifact.
ENVIRONMENT_KEYS = ("gpu", "gpu_uuid", "driver", "cuda", "torch", "triton", "harness_commit", "image_digest",
                    "python", "cpu")
WORKLOAD_KEYS = ("workload", "median_us", "interval_us", "baseline_median_us", "baseline_interval_us", "speedup")
# Bounds of a record (pipeline/result.py bounds the result it comes from the same way)
MAX_PR = 2**31 - 1  # GitHub's pull request numbers are GraphQL Ints (32 bits)
MAX_SAFE_INT = 2**53 - 1
MAX_RECORD_BYTES = 64 * 1024  # a record is a summary: its result's samples stay in the evidence
MAX_SHARD_BYTES = 95 * 1024 * 1024  # GitHub refuses a push of a file over 100 MB
# The organizers' own solutions (issue 18): shown on each kernel board beside the baseline, never ranked
ENTRANT_KEY, ORGANIZERS = "entrant", "organizers"
FLAG_CODE_RE = re.compile(r"[a-z][a-z0-9_]{0,63}")
# tests only: the name of a point at which `append` kills its own process with SIGKILL (tests/exploits)
CRASH_ENV = "PIPELINE_TEST_KILL_APPEND_AT"


class LedgerRefusal(Exception):
    """A record that may not be appended; the message says what, where and what to do."""


class LedgerBroken(Exception):
    """`verify` found a bad record; the message names the first one (file, line, seq) and why."""


# ---- canonical form and the chain ----

def canonical(obj: Any) -> str:
    """A record's line (without its newline): orjson, sorted keys, compact, UTF-8; a version 1 record in
    the form it was written in. Raises ValueError for an integer past 64 bits or a lone surrogate; orjson
    would write a NaN as null, which `record_problem` refuses first and `append` checks by reading the
    line back."""
    if isinstance(obj, dict) and obj.get("record_version") == 1:
        return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    try:
        return orjson.dumps(obj, option=orjson.OPT_SORT_KEYS).decode()
    except orjson.JSONEncodeError as exc:
        raise ValueError(str(exc)) from None


def digest(record: dict[str, Any]) -> str:
    """The record's sha256: over its canonical JSON without the `sha256` key itself."""
    body = {k: v for k, v in record.items() if k != "sha256"}
    return hashlib.sha256(canonical(body).encode()).hexdigest()


def seal(body: dict[str, Any], seq: int, prev: str) -> dict[str, Any]:
    record = {k: v for k, v in body.items() if k not in CHAIN_KEYS}
    record["seq"], record["prev"] = seq, prev
    record["sha256"] = digest(record)
    return record


def record_time(record: dict[str, Any]) -> str:
    return record["accepted_at"] if record["kind"] == "result" else record["at"]


def shard_name(instant: str) -> str:
    return f"{instant[:7]}.jsonl"


def content_key(record: dict[str, Any]) -> str:
    """A record's identity without its place in the chain: the same content appended in any order."""
    return canonical({k: v for k, v in record.items() if k not in CHAIN_KEYS})


@lru_cache(maxsize=1)
def _record_validator() -> Any:
    from pipeline.result import strict_validator

    return strict_validator(json.loads(SCHEMA_PATH.read_text()))


def schema_problems(record: dict[str, Any]) -> list[str]:
    """What is wrong with a record by ledger.schema.json (the published contract); used on append."""
    errors = sorted(_record_validator().iter_errors(record), key=lambda e: list(e.absolute_path))
    return [f"/{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in errors[:5]]


_INSTANT_RE = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z\Z")
_HEX64_RE = re.compile(r"^[0-9a-f]{64}\Z")
_PROBLEM_RE = re.compile(r"^[a-z][a-z0-9_]*\Z")
_RESULT_KEYS = frozenset(("kind", "record_version", "seq", "prev", "sha256", "accepted_at", "track", "problem",
                          "login", "pr", "head_sha", "blob_sha", "path", "status", "official", "mode", "score",
                          "workloads", "flags", "environment", "result_sha256", "result_schema_version",
                          "signature", "evaluated_at"))
_OPTIONAL_RESULT_KEYS = frozenset((ENTRANT_KEY,))  # present only on the organizers' results
_MARKING_KEYS = frozenset(("kind", "record_version", "seq", "prev", "sha256", "at", "target", "track", "problem",
                           "login", "reason", "by"))


def _num(v: Any, lo: float = -1e300, hi: float = 1e300) -> bool:
    """A finite JSON number in [lo, hi] (orjson reads no NaN, but a record built in Python may hold one)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and lo <= v <= hi and v == v


def _pos(v: Any, hi: float) -> bool:
    return _num(v, 0, hi) and v > 0


def _int(v: Any, lo: int, hi: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def _pos_int(v: Any) -> bool:
    return _int(v, 1, MAX_PR)


def _str_match(pattern: re.Pattern[str], v: Any) -> bool:
    return isinstance(v, str) and pattern.fullmatch(v) is not None


def _text(v: Any, cap: int) -> bool:
    return isinstance(v, str) and len(v) <= cap and v.isprintable()


def _pair(v: Any) -> bool:
    return isinstance(v, list) and len(v) == 2 and _num(v[0]) and _num(v[1]) and v[0] <= v[1]


def _scalars(v: Any, keys: int, cap: int) -> bool:
    """A small object of JSON scalars (mode, environment): strings printable within `cap`."""
    return isinstance(v, dict) and len(v) <= keys and all(
        isinstance(k, str) and len(k) <= 64 and (x is None or isinstance(x, bool) or _num(x) or _text(x, cap))
        for k, x in v.items())


def _instant_ok(v: Any) -> bool:
    """YYYY-MM-DDTHH:MM:SSZ naming a real second in the years EARLIEST-LATEST."""
    if not _str_match(_INSTANT_RE, v):
        return False
    try:
        t = dt.datetime.fromisoformat(v[:19])
    except ValueError:
        return False
    return EARLIEST <= t.year <= LATEST


def _score_ok(score: Any) -> bool:
    if not (isinstance(score, dict) and set(score) <= {"speedup", "time_us", "interval"}
            and _pos(score.get("speedup"), 1e6) and _pos(score.get("time_us"), 1e12)):
        return False
    lo_hi = score.get("interval")
    return lo_hi is None or (_pair(lo_hi) and 0 <= lo_hi[0] <= score["speedup"] <= lo_hi[1])


def _workload_ok(w: Any) -> bool:
    return (isinstance(w, dict) and set(w) <= set(WORKLOAD_KEYS) and _text(w.get("workload"), 128)
            and _pos(w.get("median_us"), 1e12) and _pos(w.get("baseline_median_us"), 1e12)
            and _pos(w.get("speedup"), 1e6)
            and all(_pair(w[k]) for k in ("interval_us", "baseline_interval_us") if k in w))


def _signature_ok(v: Any) -> bool:
    return v is None or (isinstance(v, dict) and set(v) == {"alg", "key_id", "sig"}
                         and all(_text(x, 512) for x in v.values()))


def record_problem(record: dict[str, Any]) -> str | None:
    """The same rules as ledger.schema.json and the bounds of a record, checked by hand: `verify` runs this
    on every record (jsonschema would take minutes on a competition-sized ledger), `append` on the new
    one before anything is written. None when the record is sound."""
    if not isinstance(record, dict):
        return "not a JSON object"
    kind = record.get("kind")
    keys = _RESULT_KEYS if kind == "result" else _MARKING_KEYS if kind in MARKINGS else None
    if keys is None:
        return f"unknown kind {str(kind)[:40]!r}"
    given = set(record) - _OPTIONAL_RESULT_KEYS if kind == "result" else set(record)
    if given != keys:
        missing, extra = sorted(keys - given), sorted(str(k)[:40] for k in given - keys)
        return "keys " + ", ".join(filter(None, [f"missing {missing}" if missing else "",
                                                  f"unexpected {extra[:10]}" if extra else ""]))
    checks: list[tuple[str, bool]] = [
        ("record_version", _int(record["record_version"], 1, 2)),
        ("seq", _int(record["seq"], 0, MAX_SAFE_INT)),
        ("prev", _str_match(_HEX64_RE, record["prev"])),
        ("sha256", _str_match(_HEX64_RE, record["sha256"])),
        ("track", record["track"] in ("kernel", "serving")),
        ("login", _str_match(LOGIN_RE, record["login"])),
    ]
    if kind == "result":
        checks += [
            ("accepted_at", _instant_ok(record["accepted_at"])),
            ("problem", _str_match(_PROBLEM_RE, record["problem"]) and len(record["problem"]) <= 64),
            ("pr", _pos_int(record["pr"])),
            ("head_sha", _str_match(SHA1_RE, record["head_sha"])),
            ("blob_sha", _str_match(SHA1_RE, record["blob_sha"])),
            ("path", _text(record["path"], 1024)),
            ("status", record["status"] in RECORDED_STATUSES),
            ("official", isinstance(record["official"], bool)),
            ("mode", _scalars(record["mode"], 16, 200)),
            ("score", _score_ok(record["score"])),
            ("workloads", isinstance(record["workloads"], list) and len(record["workloads"]) <= 256
             and all(_workload_ok(w) for w in record["workloads"])),
            ("flags", isinstance(record["flags"], list) and len(record["flags"]) <= 256
             and all(_str_match(FLAG_CODE_RE, f) for f in record["flags"])),
            ("environment", _scalars(record["environment"], len(ENVIRONMENT_KEYS), 1024)
             and set(record["environment"]) <= set(ENVIRONMENT_KEYS)),
            ("result_sha256", _str_match(_HEX64_RE, record["result_sha256"])),
            ("result_schema_version", _int(record["result_schema_version"], 1, 1000)),
            ("signature", _signature_ok(record["signature"])),
            ("evaluated_at", parse_instant(record["evaluated_at"]) is not None),
            (ENTRANT_KEY, ENTRANT_KEY not in record  # the organizers' row is a kernel board's
             or (record[ENTRANT_KEY] == ORGANIZERS and record["track"] == "kernel")),
        ]
    else:
        target = record["target"]
        checks += [
            ("at", _instant_ok(record["at"])),
            ("target", isinstance(target, dict) and set(target) == {"pr", "head_sha"} and _pos_int(target["pr"])
             and _str_match(SHA1_RE, target["head_sha"])),
            ("problem", _text(record["problem"], 64)),
            ("reason", _text(record["reason"], 2000) and record["reason"] != ""),
            ("by", _str_match(LOGIN_RE, record["by"])),
        ]
    bad = [name for name, ok in checks if not ok]
    return f"bad {', '.join(bad)}" if bad else None


# ---- building records ----

def check_signature(doc: dict[str, Any], *, allow_unofficial: bool = False, keyring: Any = None,
                    allow_retired: bool = False) -> None:
    """The runner's signature over the result document: raise LedgerRefusal when it does not verify.

    Every result needs a signature by a key of the committed keyring (`keyring`, default
    pipeline.signing.load_keyring()), except an unofficial result appended with --allow-unofficial
    (tests and demos), which may be unsigned. A retired key counts only with `allow_retired` (for what
    the ledger already holds).
    """
    from pipeline import signing

    if doc.get("signature") is None and allow_unofficial and not doc.get("official"):
        return
    try:
        signing.verify(doc, keyring if keyring is not None else signing.load_keyring(), allow_retired=allow_retired)
    except signing.SignatureError as exc:
        raise LedgerRefusal(f"the result's signature does not verify: {exc}. Record only the result.json that the "
                            "runner signed, unchanged.") from None


def organizers_path(path: str) -> bool:
    """A submission path of the organizers' own solutions: solutions/<problem>/<file>, as given to
    `evaluate` (relative or absolute), never under a competitor's submissions/ (whose deepest folder may
    be a login such as `solutions`)."""
    p = path.replace("\\", "/")
    return _SOLUTION_RE.fullmatch(p) is not None and _SUBMISSIONS_RE.search(p) is None


_SOLUTION_RE = re.compile(r"(?:.*/)?solutions/[^/]+/[^/]+")
_SUBMISSIONS_RE = re.compile(r"(?:^|/)submissions/")


def result_record(
    doc: dict[str, Any],
    raw: bytes,
    *,
    pr: int,
    login: str,
    head_sha: str,
    accepted_at: str,
    allow_unofficial: bool = False,
    workloads: dict[str, list[str]] | None = None,
    source: str = "the result",
    keyring: Any = None,
    signature_checked: bool = False,
    organizers: bool = False,
) -> dict[str, Any]:
    """A result document (and the bytes it was read from) -> the body of a `result` record.

    `workloads` maps each known kernel problem to its workload names; a kernel result must time exactly
    those. `keyring`: the public keys the signature is checked against (default: the repository's);
    `signature_checked`: the caller already validated the document and checked its signature (verify,
    which also accepts retired and revoked keys). Raises LedgerRefusal for anything that may not be
    recorded.

    `organizers`: the result is the organizers' own solution (`ledger append --organizers`, by hand): the
    record carries `"entrant": "organizers"`, and the boards show it as the organizers' row beside the
    baseline, never ranked and never holding a board or a prize (pipeline/board/). A field rather than a
    reserved login: the record keeps the real PR and author (audited like any other), no competitor's
    GitHub login is taken from them, and no path a PR can name produces it, since a competitor's identity
    is the login of their folder (pipeline/validate.py) and publish's appends, made from merged PRs, never
    pass the flag. Only a kernel result evaluated from solutions/ can be the organizers' (never one from
    a competitor's folder, which would take that competitor's result off the ranking), and a result from
    solutions/ only with the flag, so `verify` (which rebuilds the record from its signed result) also
    fails a re-sealed record that gained or lost the mark. Records without it are written as before.
    """
    from pipeline.result import ResultError, validate

    try:
        if not signature_checked:
            validate(doc)
    except ResultError as exc:
        raise LedgerRefusal(f"{source}: {exc}\nOnly a result written by the evaluator can be recorded; "
                            "re-run the evaluation rather than editing its result.") from None
    if not _pos_int(pr):
        shown = f"{str(pr)[:20]}... ({len(str(pr))} digits)" if len(str(pr)) > 24 else repr(pr)
        raise LedgerRefusal(f"--pr {shown}: a pull request number is an integer from 1 to {MAX_PR:,}; pass the "
                            "merged PR's number")
    if not isinstance(login, str) or not LOGIN_RE.fullmatch(login):
        raise LedgerRefusal(f"--login {str(login)[:60]!r} is not a GitHub login (letters, digits, hyphens, at most 39)")
    if not isinstance(head_sha, str) or not SHA1_RE.fullmatch(head_sha):
        raise LedgerRefusal(f"--head-sha {str(head_sha)[:60]!r} is not a 40-hex-digit commit SHA")
    if not _instant_ok(accepted_at):
        raise LedgerRefusal(f"--merged-at {str(accepted_at)[:60]!r} is not a UTC time (YYYY-MM-DDTHH:MM:SSZ) in the "
                            f"years {EARLIEST}-{LATEST}; pass the PR's merged_at as the GitHub API gives it")
    sub = doc["submission"]
    if not doc["official"] and not allow_unofficial:
        raise LedgerRefusal(
            f"{source} is unofficial (device {doc['mode']['device']}, {doc['mode']['seeds']} seeds): only the "
            "runner's official results are recorded. Evaluate it on the runner (the run-eval label), or pass "
            "--allow-unofficial for a test or demo ledger (the board marks such results).")
    if not signature_checked:
        check_signature(doc, allow_unofficial=allow_unofficial, keyring=keyring)
    if doc["official"] and (sub["pr"] is None or sub["head_sha"] is None):
        raise LedgerRefusal(f"{source} is official but names no PR or head SHA; the runner always records both")
    for key, given, flag in (("pr", pr, "--pr"), ("head_sha", head_sha, "--head-sha")):
        if sub[key] is not None and sub[key] != given:
            raise LedgerRefusal(f"{source} was evaluated for {key} {sub[key]} but {flag} says {given}: the merged "
                                "head must be the evaluated one; evaluate the merged head and record that result")
    if sub["login"] is not None and sub["login"].lower() != login.lower():
        raise LedgerRefusal(f"{source} belongs to {sub['login']!r} but --login says {login!r}")
    if doc["status"] not in RECORDED_STATUSES:
        raise LedgerRefusal(f"{source} has status {doc['status']!r}: only a passing result (or one held for review) "
                            "is recorded; a PR whose evaluation failed should not have been merged")
    if doc["score"] is None or not doc["performance"]:
        raise LedgerRefusal(f"{source} has no score (it was not timed); record a result evaluated with timing")
    if doc["track"] == "kernel":
        timed = [p["workload"] for p in doc["performance"]]
        if workloads is not None:
            if doc["problem"] not in workloads:
                raise LedgerRefusal(f"{source} is for problem {doc['problem']!r}, which is not in problems/ "
                                    f"(known: {', '.join(sorted(workloads))})")
            expected = workloads[doc["problem"]]
            if sorted(timed) != sorted(expected):
                raise LedgerRefusal(f"{source} timed workloads {timed} but {doc['problem']} has {expected}: a partial "
                                    "run (--shape) cannot be ranked; evaluate every workload")
    if doc["track"] == "serving":
        from pipeline.serving.score import LEVELS, METRICS

        figures = sorted(p["workload"] for p in doc["performance"])
        expected = sorted(f"{m}_{c}" for c in LEVELS for m in METRICS)
        if figures != expected:
            raise LedgerRefusal(f"{source} measured {', '.join(figures)}, but the serving board ranks "
                                f"{', '.join(expected)}: a partial run (--levels) cannot be ranked; evaluate every "
                                "level")
    ours = organizers_path(sub["path"])
    if ours and not organizers:
        raise LedgerRefusal(f"{source} was evaluated from the organizers' solutions/ ({sub['path']}): record it "
                            "with --organizers, as the organizers' row, never as a competitor's result")
    if organizers:
        if doc["track"] != "kernel":
            raise LedgerRefusal(f"{source} is a {doc['track']} result: the organizers' row is shown on the kernel "
                                "boards only; record the organizers' kernel solutions with --organizers")
        if not ours:
            raise LedgerRefusal(f"{source} was evaluated from {sub['path']}, not from the organizers' solutions/: "
                                "recording a competitor's result as the organizers' would take it off the prize "
                                "ranking; --organizers is for solutions/<problem>/submission.py alone")
    score = {k: doc["score"][k] for k in ("speedup", "time_us", "interval") if k in doc["score"]}
    env = doc["environment"]
    marked = {ENTRANT_KEY: ORGANIZERS} if organizers else {}
    return {
        "kind": "result",
        "record_version": RECORD_VERSION,
        "accepted_at": accepted_at,
        "track": doc["track"],
        "problem": doc["problem"],
        "login": login,
        "pr": pr,
        "head_sha": head_sha,
        "blob_sha": sub["blob_sha"],
        "path": sub["path"],
        "status": doc["status"],
        "official": doc["official"],
        "mode": doc["mode"],
        "score": score,
        "workloads": [{k: p[k] for k in WORKLOAD_KEYS if k in p} for p in doc["performance"]],
        "flags": sorted({f["code"] for f in doc["flags"]}),
        "environment": {k: env[k] for k in ENVIRONMENT_KEYS if k in env},
        "result_sha256": hashlib.sha256(raw).hexdigest(),
        "result_schema_version": doc["schema_version"],
        "signature": doc["signature"],
        "evaluated_at": doc["finished_at"],
        **marked,
    }


def latest_markings(records: list[dict[str, Any]]) -> dict[tuple[int, str], dict[str, Any]]:
    """(pr, head_sha) -> the marking that decides that result's state: the latest by `at`, then by
    content (so that arrival order never matters)."""
    marks = sorted((r for r in records if r["kind"] in MARKINGS), key=lambda r: (r["at"], content_key(r)))
    out: dict[tuple[int, str], dict[str, Any]] = {}
    for m in marks:
        out[(m["target"]["pr"], m["target"]["head_sha"])] = m
    return out


def find_result(records: list[dict[str, Any]], pr: int, head_sha: str | None) -> dict[str, Any]:
    found = [r for r in records if r["kind"] == "result" and r["pr"] == pr
             and (head_sha is None or r["head_sha"] == head_sha)]
    if not found:
        raise LedgerRefusal(f"the ledger has no result of PR #{pr}" + (f" at head {head_sha}" if head_sha else "")
                            + "; check the number with `python -m pipeline prizes` or the board")
    if len(found) > 1:
        heads = ", ".join(r["head_sha"] for r in found)
        raise LedgerRefusal(f"PR #{pr} has {len(found)} results in the ledger (heads {heads}); pass --head-sha")
    return found[0]


def marking_record(records: list[dict[str, Any]], kind: str, *, pr: int, head_sha: str | None, reason: str,
                   by: str, at: str) -> dict[str, Any]:
    """The body of a disqualification or clearance of the result of PR `pr` (head `head_sha`)."""
    if kind not in MARKINGS:
        raise ValueError(kind)
    if not reason.strip():
        raise LedgerRefusal("--reason is empty: say why, it is shown on the board and kept as evidence")
    if len(reason) > 2000 or not " ".join(reason.split()).isprintable():
        raise LedgerRefusal("--reason: at most 2,000 printable characters (it is shown on the board); say it shorter")
    if not _instant_ok(at):
        raise LedgerRefusal(f"--at {at!r} is not a UTC time in the years {EARLIEST}-{LATEST}")
    if not isinstance(by, str) or not LOGIN_RE.fullmatch(by):
        raise LedgerRefusal(f"--by {by!r} is not a GitHub login: name the organizer who decided")
    target = find_result(records, pr, head_sha)
    if at < target["accepted_at"]:
        raise LedgerRefusal(f"--at {at} is before the result was accepted ({target['accepted_at']})")
    last = latest_markings(records).get((target["pr"], target["head_sha"]))
    disqualified = last is not None and last["kind"] == "disqualification"
    if kind == "disqualification" and disqualified:
        raise LedgerRefusal(f"PR #{pr}'s result is already disqualified ({last['at']}: {last['reason']})")
    if kind == "clearance" and not disqualified and (target["status"] != "needs_review" or last is not None):
        raise LedgerRefusal(f"PR #{pr}'s result is neither under review nor disqualified: nothing to clear")
    return {
        "kind": kind,
        "record_version": RECORD_VERSION,
        "at": at,
        "target": {"pr": target["pr"], "head_sha": target["head_sha"]},
        "track": target["track"],
        "problem": target["problem"],
        "login": target["login"],
        "reason": " ".join(reason.split()),
        "by": by,
    }


def check_new(records: list[dict[str, Any]], body: dict[str, Any]) -> None:
    """Refuse a result that is already in the ledger (same PR and head SHA, or the same result file), and
    a PR recorded for a second login (a PR has one author: whoever records it for another is wrong)."""
    if body["kind"] != "result":
        return
    for r in records:
        if r["kind"] != "result":
            continue
        if r["pr"] == body["pr"] and r["login"].lower() != body["login"].lower():
            raise LedgerRefusal(f"PR #{body['pr']} is recorded for @{r['login']} (record seq {r['seq']}), not "
                                f"@{body['login']}: a pull request has one author; check --pr and --login")
        if (r["pr"], r["head_sha"]) == (body["pr"], body["head_sha"]):
            raise LedgerRefusal(f"PR #{body['pr']} at head {body['head_sha']} is already in the ledger "
                                f"(record seq {r['seq']}, {shard_name(r['accepted_at'])}); nothing to do")
        if r["result_sha256"] == body["result_sha256"]:
            raise LedgerRefusal(f"this result file (sha256 {body['result_sha256'][:12]}...) is already recorded for "
                                f"PR #{r['pr']} (record seq {r['seq']}); one evaluation is recorded once")


# ---- verification ----

def verify_shards(shards: dict[str, bytes], check_schema: bool = True,
                  places: dict[int, str] | None = None) -> list[dict[str, Any]]:
    """Check every shard and the chain; return the records in append order, or raise LedgerBroken naming
    the first bad record (in file order for a line that is not a record at all, else in chain order).
    `places`, when given, is filled with each record's place (seq -> "results/ledger/F line N")."""
    entries: list[tuple[int, str, int, dict[str, Any], bytes]] = []
    where_dir = LEDGER_DIR.as_posix()
    loads = _loader()
    for name in sorted(shards):
        if not SHARD_RE.match(name):
            raise LedgerBroken(f"{where_dir}/{name}: not a ledger shard (YYYY-MM.jsonl); move it out of {where_dir}/")
        data = shards[name]
        if data and not data.endswith(b"\n"):
            n = data.count(b"\n") + 1
            raise LedgerBroken(f"{where_dir}/{name} line {n}: the last line has no newline (a write was cut short); "
                               "restore the shard from git")
        last_seq = -1
        for lineno, line in enumerate(data.split(b"\n")[:-1], 1):
            where = f"{where_dir}/{name} line {lineno}"
            if len(line) > MAX_RECORD_BYTES:
                raise LedgerBroken(f"{where}: a line of {len(line):,} bytes, more than a record's {MAX_RECORD_BYTES:,}; "
                                   "restore the shard from git")
            try:
                record = loads(line)
            except ValueError:
                raise LedgerBroken(f"{where}: not a JSON record; restore the shard from git") from None
            seq = record.get("seq") if isinstance(record, dict) else None
            if not isinstance(seq, int) or isinstance(seq, bool):
                raise LedgerBroken(f"{where}: not a ledger record (no integer seq); restore the shard from git")
            if record["seq"] <= last_seq:
                raise LedgerBroken(f"{where} (record seq {record['seq']}): comes after seq {last_seq} in its shard; "
                                   "records are only ever appended, so lines were moved")
            last_seq = record["seq"]
            entries.append((record["seq"], name, lineno, record, line))
    entries.sort(key=lambda e: e[0])
    prev = GENESIS
    results: set[tuple[int, str]] = set()
    authors: dict[int, str] = {}
    out = []
    for i, (seq, name, lineno, record, line) in enumerate(entries):
        where = f"{where_dir}/{name} line {lineno} (record seq {seq})"
        if seq != i:
            what = f"a second record with seq {seq}" if seq < i else f"record seq {i} is missing (removed?)"
            raise LedgerBroken(f"{where}: {what}; the chain must number records 0, 1, 2, ... without gaps")
        try:
            sealed = record.get("sha256") == digest(record)
        except (ValueError, TypeError):
            sealed = False
        if not sealed:
            raise LedgerBroken(f"{where}: its sha256 does not match its content: the record was changed after it "
                               "was written; restore it from git")
        if line != canonical(record).encode():  # digest() above has shown canonical() can write it
            raise LedgerBroken(f"{where}: not in canonical form (sorted keys, no spaces): edited by hand?")
        if record.get("prev") != prev:
            what = "the first record's prev must be 64 zeros" if i == 0 else (
                f"its prev does not match the sha256 of record seq {i - 1}: a record was changed, removed or "
                "inserted before it")
            raise LedgerBroken(f"{where}: {what}")
        if check_schema:
            bad = record_problem(record)
            if bad:
                raise LedgerBroken(f"{where}: not a valid ledger record ({bad}); restore it from git")
        time = record_time(record)
        if shard_name(time) != name:
            raise LedgerBroken(f"{where}: its time {time} belongs in {shard_name(time)}, not {name}")
        pr = record["pr"] if record["kind"] == "result" else record["target"]["pr"]
        author = authors.setdefault(pr, record["login"].lower())
        if author != record["login"].lower():
            raise LedgerBroken(f"{where}: names @{record['login']} for PR #{pr}, which an earlier record gives to "
                               f"@{author}: a pull request has one author; restore the ledger from git")
        if record["kind"] == "result":
            key = (record["pr"], record["head_sha"])
            if key in results:
                raise LedgerBroken(f"{where}: PR #{key[0]} at head {key[1]} was already recorded earlier")
            results.add(key)
        elif (record["target"]["pr"], record["target"]["head_sha"]) not in results:
            raise LedgerBroken(f"{where}: marks PR #{record['target']['pr']}, which has no earlier result record")
        prev = record["sha256"]
        out.append(record)
        if places is not None:
            places[seq] = f"{where_dir}/{name} line {lineno}"
    return out


def evidence_path(root: Path, result_sha256: str) -> Path:
    return Path(root) / EVIDENCE_DIR / f"{result_sha256}.json"


def chain_head(records: list[dict[str, Any]]) -> str:
    return records[-1]["sha256"] if records else GENESIS


def _read_evidence(root: Path, sha: str) -> bytes | None:
    path = evidence_path(root, sha)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise LedgerBroken(f"{EVIDENCE_DIR.as_posix()}/{path.name}: cannot be read ({exc.strerror}); "
                           "restore it from git") from None
    with os.fdopen(fd, "rb") as fh:
        if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
            raise LedgerBroken(f"{EVIDENCE_DIR.as_posix()}/{path.name}: not a regular file; restore it from git")
        return fh.read()


def verify_evidence(root: Path, records: list[dict[str, Any]], keyring: Any, *, allow_unofficial: bool = False,
                    places: dict[int, str] | None = None) -> dict[str, int]:
    """Every result record against its signed document in results/evidence/: the file is there and hashes
    to the record's result_sha256, its signature verifies against `keyring` (a retired key too; a revoked
    key only for a result that is disqualified), and every field of the record is what the document
    gives. Raises LedgerBroken naming the first bad record (in chain order); returns {key id: results}."""
    from pipeline import result, signing
    from pipeline.result import ResultError, validate

    places = places or {}
    by_key: dict[str, int] = {}
    revoked: list[tuple[dict[str, Any], str]] = []
    for record in records:
        if record["kind"] != "result":
            continue
        place = f"{places.get(record['seq'], LEDGER_DIR.as_posix())} (record seq {record['seq']}, PR #{record['pr']})"
        sha = record["result_sha256"]
        rel = f"{EVIDENCE_DIR.as_posix()}/{sha}.json"
        raw = _read_evidence(root, sha)
        if raw is None:
            raise LedgerBroken(f"{place}: its signed result {rel} is missing, so nothing shows the record is what the "
                               "runner measured; restore the file from git (or the bench run's `result` artifact)")
        if hashlib.sha256(raw).hexdigest() != sha:
            raise LedgerBroken(f"{place}: {rel} does not hash to the record's result_sha256: the evidence was changed; "
                               "restore it from git")
        try:
            doc = result.loads(raw)
            if not isinstance(doc, dict):
                raise ValueError("not a JSON object")
            if doc.get("signature") is None:
                # a signed document was validated by `sign` before it was signed (against the schema of its
                # day, which a later schema must not overrule); an unsigned one is checked here
                validate(doc)
        except (ValueError, UnicodeDecodeError, ResultError) as exc:
            raise LedgerBroken(f"{place}: {rel} is not a valid result ({str(exc).splitlines()[0]}); restore it from "
                               "git") from None
        sig = doc.get("signature")
        if sig is None:
            if doc["official"] or not allow_unofficial:
                raise LedgerBroken(f"{place}: its result {rel} is not signed"
                                   + ("" if doc["official"] else " (an unofficial result: pass --allow-unofficial for "
                                      "a test or demo ledger)"))
        else:
            kid = sig.get("key_id") if isinstance(sig, dict) else None
            key = keyring.keys.get(kid) if isinstance(kid, str) else None
            try:
                if key is not None and key.status == "revoked":
                    ring = signing.Keyring(keyring.directory, {kid: signing.RunnerKey(
                        key.key_id, key.name, "retired", key.path, key.public)})
                    signing.verify(doc, ring, allow_retired=True)
                    revoked.append((record, place))
                else:
                    key = signing.verify(doc, keyring, allow_retired=True)
            except signing.SignatureError as exc:
                raise LedgerBroken(f"{place}: the signature of {rel} does not verify: {exc}") from None
            by_key[key.key_id] = by_key.get(key.key_id, 0) + 1
        body = {k: v for k, v in record.items() if k not in CHAIN_KEYS}
        try:
            expected = result_record(doc, raw, pr=record["pr"], login=record["login"], head_sha=record["head_sha"],
                                     accepted_at=record["accepted_at"], allow_unofficial=True, source=rel,
                                     signature_checked=True, organizers=record.get(ENTRANT_KEY) == ORGANIZERS)
        except LedgerRefusal as exc:
            raise LedgerBroken(f"{place}: the record does not belong to its signed result: "
                               f"{str(exc).splitlines()[0]}") from None
        except (KeyError, TypeError, AttributeError) as exc:  # a signed document of a shape no signer writes
            raise LedgerBroken(f"{place}: {rel} is not a result this ledger can read ({type(exc).__name__}: {exc})"
                               ) from None
        if record["record_version"] in RECORD_VERSIONS:  # written by an earlier version, kept as it was
            expected["record_version"] = record["record_version"]
        differ = sorted(k for k in set(body) | set(expected) if body.get(k, ...) != expected.get(k, ...))
        if differ:
            raise LedgerBroken(f"{place}: {', '.join(differ)} differ{'s' if len(differ) == 1 else ''} from its signed "
                               f"result {rel}: the record was changed after it was written (and the chain re-sealed "
                               "over it); restore the ledger from git")
    if revoked:
        marks = latest_markings(records)
        for record, place in revoked:
            mark = marks.get((record["pr"], record["head_sha"]))
            if mark is None or mark["kind"] != "disqualification":
                raise LedgerBroken(f"{place}: signed with a revoked key ({record['signature'].get('key_id')}); "
                                   "disqualify it (`python -m pipeline ledger disqualify --pr "
                                   f"{record['pr']} --head-sha {record['head_sha']} --reason 'signed with a revoked "
                                   "key' --by <you>`) and have the head evaluated again")
    return by_key


def _loader() -> Callable[[bytes], Any]:
    """orjson when installed (about 3x faster on a large ledger), else the standard library: both
    parse a canonical line to the same values, so nothing derived depends on which one ran."""
    try:
        import orjson

        return orjson.loads
    except ImportError:  # pragma: no cover - orjson is a dependency; the fallback keeps a bare install working
        return json.loads


class Unparsed(bytes):
    """A value of a record left as its JSON text (exactly the bytes of its line), parsed when it is read:
    the boards show a result's workloads only in the rows they print, and parsing every result's list
    up front was a third of a competition-sized ledger's parse and most of its memory."""

    __slots__ = ()

    def value(self) -> Any:
        try:
            return _loader()(bytes(self))  # (orjson takes bytes themselves, not a subclass)
        except ValueError:
            raise LedgerBroken("a result's workloads in the ledger are not JSON; run `python -m pipeline ledger "
                               "verify`") from None


_WORKLOADS_KEY = b',"workloads":'


def _parse_lines(name: str, lines: Iterable[bytes], workloads: bool = True) -> Iterator[dict[str, Any]]:
    """The records of a shard's lines. With `workloads` False, a result's `workloads` (the last key of its
    canonical line, its keys being sorted) stays Unparsed: the line up to it is parsed as an object of
    its own, and a line of any other shape (not canonical, not a result) is parsed whole."""
    loads = _loader()
    key, skip = _WORKLOADS_KEY, len(_WORKLOADS_KEY)
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            if not workloads:
                n = len(line) - (line[-1] == 10)  # without its newline
                i = line.rfind(key)
                if i > 0 and line[n - 2:n] == b"]}" and line[i + skip:i + skip + 1] == b"[":
                    try:
                        record = loads(line[:i] + b"}")
                    except ValueError:
                        record = None  # the cut fell inside a nested value: parse the whole line below
                    # a valid object up to the cut means the cut is at the top level: `workloads` is the
                    # record's last key and the rest of the line its value
                    if record.__class__ is dict and record.get("kind") == "result" and "workloads" not in record:
                        record["workloads"] = Unparsed(memoryview(line)[i + skip:n - 1])
                        yield record
                        continue
            record = loads(line)
            if not isinstance(record, dict) or not isinstance(record.get("kind"), str):
                raise ValueError
        except ValueError:
            raise LedgerBroken(f"{LEDGER_DIR.as_posix()}/{name} line {lineno}: not a ledger record; run "
                               "`python -m pipeline ledger verify`") from None
        yield record


def iter_shards(shards: dict[str, bytes]) -> Iterator[dict[str, Any]]:
    """The records shard by shard, in file order, without checking the chain (the boards read this way,
    since no derived view depends on the order; `verify` checks)."""
    for name in sorted(shards):
        yield from _parse_lines(name, shards[name].splitlines())


def parse_shards(shards: dict[str, bytes]) -> list[dict[str, Any]]:
    """The records in append order (by seq), without checking the chain."""
    return sorted(iter_shards(shards), key=lambda r: r["seq"])


@contextmanager
def paused_gc() -> Iterator[None]:
    """Reading a large ledger allocates millions of objects and no cycles; the cyclic collector would
    rescan them all again and again (3x the parse time at 100,000 records)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


# ---- files ----

def read_shards(root: Path) -> dict[str, bytes]:
    directory = Path(root) / LEDGER_DIR
    if not directory.is_dir():
        return {}
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file() and not p.name.startswith(".")}


def read(root: Path) -> list[dict[str, Any]]:
    return parse_shards(read_shards(root))


def iter_records(root: Path, workloads: bool = True) -> Iterator[dict[str, Any]]:
    """Every record, one shard in memory at a time, in no particular order; with `workloads` False, each
    result's workloads Unparsed until read (what the boards read: _parse_lines)."""
    directory = Path(root) / LEDGER_DIR
    if not directory.is_dir():
        return
    for path in sorted(directory.iterdir()):
        if path.is_file() and not path.name.startswith("."):
            with open(path, "rb") as f:
                yield from _parse_lines(path.name, f, workloads)


def verify(root: Path, *, keyring: Any = None, evidence: bool = True, allow_unofficial: bool = False
           ) -> list[dict[str, Any]]:
    """The chain, and (with `evidence`) every result record against its signed document (verify_evidence;
    `keyring` defaults to the one for `root`: $PIPELINE_KEYRING or ROOT/keys/runners)."""
    places: dict[int, str] = {}
    records = verify_shards(read_shards(root), places=places)
    if evidence:
        from pipeline import signing

        ring = keyring if keyring is not None else signing.load_keyring(signing.keyring_dir(root))
        verify_evidence(root, records, ring, allow_unofficial=allow_unofficial, places=places)
    return records


@contextmanager
def _locked(root: Path) -> Iterator[Path]:
    directory = Path(root) / LEDGER_DIR
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield directory
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def write_evidence(root: Path, raw: bytes) -> Path:
    """Keep a signed result document, byte for byte, as results/evidence/<sha256>.json (a new file
    renamed into place; one that is already there with these bytes is left alone)."""
    sha = hashlib.sha256(raw).hexdigest()
    path = evidence_path(root, sha)
    existing = _read_evidence(root, sha) if path.exists() or path.is_symlink() else None
    if existing is not None and hashlib.sha256(existing).hexdigest() == sha:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o644)
    with os.fdopen(fd, "wb") as fh:
        fh.write(raw)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    return path


def _crash_point(name: str) -> None:
    """Tests only (CRASH_ENV): die here as a killed process dies, with nothing cleaned up."""
    if os.environ.get(CRASH_ENV) == name:
        os.kill(os.getpid(), signal.SIGKILL)


def new_line(record: dict[str, Any]) -> bytes:
    """The record's line, once it is shown to be sound: its bounds (record_problem), the published schema,
    its size, and that the reader reads the line back as exactly this record."""
    bad = record_problem(record)
    if bad:
        raise LedgerRefusal(f"the new record is not a valid ledger record ({bad}); nothing was written")
    problems = schema_problems(record)
    if problems:
        raise LedgerRefusal(f"the new record is not a valid ledger record: {'; '.join(problems)}; nothing was written")
    try:
        line = canonical(record).encode()
    except ValueError as exc:
        raise LedgerRefusal(f"the new record cannot be written as JSON ({exc}); nothing was written") from None
    if len(line) > MAX_RECORD_BYTES:
        raise LedgerRefusal(f"the new record is {len(line):,} bytes, more than {MAX_RECORD_BYTES:,}: a record is a "
                            "summary of its result (the samples stay in the evidence); nothing was written")
    if _loader()(line) != record or b"\n" in line:
        raise LedgerRefusal("the new record does not read back as written (a value JSON readers disagree on); "
                            "nothing was written")
    return line


def _clear_stale(directory: Path) -> None:
    """Temporary shards an append that was killed left behind (under the lock, none is in use)."""
    for p in directory.iterdir():
        if p.name.startswith(".") and ".jsonl.tmp" in p.name and p.is_file() and not p.is_symlink():
            p.unlink()


def _replace_shard(path: Path, line: bytes) -> None:
    """The shard with `line` added, written beside it, flushed and renamed into place: the shard is
    either as it was or holds the whole new line, whatever happens to this process."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        old = b""
    else:
        with os.fdopen(fd, "rb") as fh:
            if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
                raise LedgerBroken(f"{LEDGER_DIR.as_posix()}/{path.name}: not a regular file; restore it from git")
            old = fh.read()
    if len(old) + len(line) + 1 > MAX_SHARD_BYTES:
        raise LedgerRefusal(f"{LEDGER_DIR.as_posix()}/{path.name} would grow past {MAX_SHARD_BYTES:,} bytes, near "
                            "GitHub's 100 MB limit on a file; nothing was written: a month this busy needs shards "
                            "smaller than a month, which pipeline/ledger.py does not have yet (tell the maintainers)")
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o644)
    try:
        with os.fdopen(fd, "wb") as fh:
            data = old + line + b"\n"
            half = len(old) + len(line) // 2
            fh.write(data[:half])
            fh.flush()
            _crash_point("mid-write")
            fh.write(data[half:])
            fh.flush()
            os.fsync(fh.fileno())
        _crash_point("before-rename")
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def append(root: Path, body: dict[str, Any] | Callable[[list[dict[str, Any]]], dict[str, Any]],
           evidence: bytes | None = None) -> tuple[dict[str, Any], Path]:
    """Seal a record body onto the end of the chain and write it to its month's shard. `body` may be a
    function of the records already there (a marking names its target). A result record needs
    `evidence`, the exact bytes of its signed result document (they must hash to its result_sha256),
    kept in results/evidence/ before the record is written. Under a lock, the whole chain is verified
    (nothing is appended to a broken chain) and the new record checked whole (new_line) before anything
    is written; the shard is then replaced, never appended to in place (_replace_shard). Returns the
    record and its shard."""
    with _locked(root) as directory:
        _clear_stale(directory)
        records = verify_shards(read_shards(root))
        if callable(body):
            body = body(records)
        if body["kind"] == "result":
            if evidence is None:
                raise LedgerRefusal("a result record is appended with its signed result document (the evidence "
                                    "`ledger verify` re-checks); none was given")
            if hashlib.sha256(evidence).hexdigest() != body["result_sha256"]:
                raise LedgerRefusal("the evidence given does not hash to the record's result_sha256: append the "
                                    "record of the result file it was read from")
        record = seal_new(body, records)
        check_new(records, record)
        line = new_line(record)
        if evidence is not None and body["kind"] == "result":
            write_evidence(root, evidence)
            _crash_point("after-evidence")
        path = directory / shard_name(record_time(record))
        _replace_shard(path, line)
        _crash_point("after-rename")
        return record, path


def seal_new(body: dict[str, Any], records: list[dict[str, Any]]) -> dict[str, Any]:
    """The body sealed as the next record of the chain; a body that cannot be hashed is refused."""
    try:
        return seal(body, len(records), records[-1]["sha256"] if records else GENESIS)
    except (ValueError, TypeError) as exc:
        raise LedgerRefusal(f"the new record cannot be written as JSON ({exc}); nothing was written") from None


def now_instant() -> str:
    return format_instant(dt.datetime.now(dt.timezone.utc).replace(microsecond=0))


# ---- the verb: `ledger append | verify | disqualify | clear`, the only code of the ledger that parses
# arguments. Exit codes (pipeline/exits.py): 0 done, 1 refused or verification failed, 2 usage error.

def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--root", type=Path, default=REPO_ROOT,
                   help="the folder holding results/ and leaderboard.md (default: the repository)")
    p.add_argument("--competition", type=Path, metavar="TOML",
                   help="the competition configuration (default: ROOT/competition.toml)")


def problem_workloads() -> dict[str, tuple[str, tuple[str, ...]]]:
    """Every kernel problem of this repository: name -> (title, workload names)."""
    from pipeline.problems import list_problems, load_problem

    out = {}
    for name in list_problems():
        p = load_problem(name)
        out[name] = (p.title, tuple(w["name"] for w in p.workloads))
    return out


def _ledger_args(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    a = sub.add_parser("append", help="record a merged PR's result (refuses a bad, unsigned or duplicate one)")
    a.add_argument("result", type=Path, metavar="RESULT.json")
    a.add_argument("--pr", type=int, required=True, help="the merged pull request's number")
    a.add_argument("--login", required=True, help="the PR author's GitHub login")
    a.add_argument("--head-sha", required=True, help="the merged head commit (must be the evaluated one)")
    a.add_argument("--merged-at", required=True, metavar="ISO8601", help="the PR's merged_at from the GitHub API")
    a.add_argument("--allow-unofficial", action="store_true",
                   help="accept a CPU (unofficial) result: for tests and demos; the board marks it")
    a.add_argument("--organizers", action="store_true",
                   help="the organizers' own solution (solutions/<problem>/): shown on its kernel board beside the "
                        "baseline as the organizers' row, never ranked, never eligible for prizes")
    _keyring(a)
    _common(a)
    v = sub.add_parser("verify", help="check every shard, the hash chain, and every result record against its "
                       "signed document in results/evidence/; name the first bad record")
    v.add_argument("--allow-unofficial", action="store_true",
                   help="accept unsigned unofficial (CPU) results: a test or demo ledger")
    v.add_argument("--contains", action="append", default=[], metavar="SHA256",
                   help="a chain head printed in an earlier leaderboard.md or snapshot: refuse unless the chain "
                        "still holds it (a history cut short or rewritten does not); repeatable")
    _keyring(v)
    _common(v)
    for kind, verb, text in (("disqualification", "disqualify", "mark a recorded result disqualified"),
                             ("clearance", "clear", "credit a result held for review, or withdraw a disqualification")):
        m = sub.add_parser(verb, help=text)
        m.add_argument("--pr", type=int, required=True, help="the PR whose result is marked")
        m.add_argument("--head-sha", help="which of the PR's results, when it has several")
        m.add_argument("--reason", required=True, help="why (shown on the board, kept as evidence)")
        m.add_argument("--by", required=True, metavar="LOGIN", help="the organizer who decided")
        m.add_argument("--at", metavar="ISO8601", help="when it was decided (default: now)")
        m.set_defaults(kind=kind)
        _common(m)


def _keyring(p: argparse.ArgumentParser) -> None:
    p.add_argument("--keyring", type=Path, metavar="DIR", help="the runners' public keys (default: "
                   "$PIPELINE_KEYRING, else ROOT/keys/runners)")


def _load_keyring(args: argparse.Namespace):
    from pipeline import signing

    return signing.load_keyring(args.keyring if args.keyring is not None else signing.keyring_dir(args.root))


def ledger_verb(args: argparse.Namespace) -> int:
    """The results ledger: append a merged PR's result, verify the chain, disqualify or clear a result."""
    try:
        if args.action == "verify":
            keyring = _load_keyring(args)
            places: dict[int, str] = {}
            records = verify_shards(read_shards(args.root), places=places)
            by_key = verify_evidence(args.root, records, keyring, allow_unofficial=args.allow_unofficial,
                                        places=places)
            held = {r["sha256"]: r["seq"] for r in records}
            for head in args.contains:
                if head != GENESIS and head not in held:
                    return error(REFUSED, f"the ledger does not verify: the chain no longer holds head {head} "
                                  f"(it has {len(records)} records, head {chain_head(records)}): records were "
                                  "removed or rewritten since that head was printed; restore the ledger from git")
            results = sum(1 for r in records if r["kind"] == "result")
            shards = len(read_shards(args.root))
            signed = ", ".join(f"{n} by {kid} ({keyring.keys[kid].name})" for kid, n in sorted(by_key.items()))
            unsigned = results - sum(by_key.values())
            print(f"ok: {len(records)} records ({results} results, {len(records) - results} markings) in {shards} "
                  f"shard{'s' if shards != 1 else ''}; every result's signed document in {EVIDENCE_DIR.as_posix()}/ "
                  f"verifies ({signed or 'none signed'}{f', {unsigned} unsigned unofficial' if unsigned else ''}); "
                  f"chain head {chain_head(records)}")
            return OK
        if args.action == "append":
            return _append(args)
        at = format_instant(given_instant(args.at, "--at")) if args.at else now_instant()
        record, path = append(args.root, lambda records: marking_record(
            records, args.kind, pr=args.pr, head_sha=args.head_sha, reason=args.reason, by=args.by, at=at))
        print(f"appended {args.kind} of PR #{args.pr} (@{record['login']}, {record['problem']}) as record seq "
              f"{record['seq']} to {_rel(path, args.root)}; regenerate the board: python -m pipeline board")
        return OK
    except InstantError as exc:
        return error(USAGE, str(exc))
    except LedgerRefusal as exc:
        return error(REFUSED, str(exc))
    except LedgerBroken as exc:
        return error(REFUSED, f"the ledger does not verify: {exc}")
    except SignatureError as exc:
        return error(USAGE, str(exc))
    except OSError as exc:  # a full disk, a read-only checkout: the shard is replaced whole or not at all
        return error(REFUSED, f"the ledger could not be written ({exc.strerror or exc}); no shard was changed. "
                      "Fix the file system and run the same command again")


def _rel(path: Path, root: Path) -> str:
    try:
        return Path(path).resolve().relative_to(Path(root).resolve()).as_posix()
    except ValueError:
        return str(path)


def unpinned(doc: dict[str, Any], path: Path | None) -> str | None:
    """Why an official kernel result may not be appended because it was measured against a baseline other
    than the one the competition pins (the [baselines] of `path`; None: the repository's competition.toml),
    or None. Checked when a result is appended, not by `verify`: a deliberate re-pin mid-competition must
    not turn the records already made into errors (the organizers re-evaluate those; RUNBOOK, day 0)."""
    if doc.get("track") != "kernel" or not doc.get("official"):
        return None
    from pipeline import competition

    try:
        why = competition.load(path).pin_problem(doc.get("problem"), doc.get("baseline_source") or {})
    except competition.CompetitionError as exc:
        return f"cannot read the pinned baselines: {exc}"
    return why and (f"{why}: this result's speedups are in another unit than the board's. Re-evaluate it on a "
                    "runner with the pinned checkout (docs/RUNBOOK.md, day 0).")


def _append(args: argparse.Namespace) -> int:
    from pipeline.result import MAX_BYTES, ResultError, read_data

    if not args.result.is_file():
        return error(USAGE, f"{args.result}: no such file; pass the result.json the runner uploaded")
    accepted_at = format_instant(given_instant(args.merged_at, "--merged-at"))
    keyring = _load_keyring(args)
    try:  # bounded (a result is at most MAX_BYTES), a regular file, strict JSON, and valid whole
        raw, doc = read_data(args.result, MAX_BYTES)
    except ResultError as exc:
        return error(REFUSED, f"{exc}\nOnly a result written by the evaluator can be recorded; re-run the evaluation "
                      "rather than editing its result (pass the result.json the runner uploaded, unchanged)")
    body = result_record(doc, raw, pr=args.pr, login=args.login, head_sha=args.head_sha, accepted_at=accepted_at,
                            allow_unofficial=args.allow_unofficial, source=str(args.result), keyring=keyring,
                            workloads={k: list(v[1]) for k, v in problem_workloads().items()},
                            organizers=args.organizers)
    here = Path(args.root) / "competition.toml"
    why = unpinned(doc, args.competition or (here if here.is_file() else None))
    if why:
        return error(REFUSED, why)
    record, path = append(args.root, body, evidence=raw)
    row = ", the organizers' row (not ranked for prizes)" if args.organizers else ""
    print(f"appended PR #{record['pr']} (@{record['login']}, {record['track']}/{record['problem']}, "
          f"{record['score']['speedup']:.3f}x{'' if record['official'] else ', unofficial'}"
          f"{row}) as record seq "
          f"{record['seq']} to {_rel(path, args.root)}")
    return OK


def without_gc(run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """A verb over the whole ledger (`ledger`, and the boards' verbs) holds its records for its short life
    and creates no cycles worth collecting; the cyclic collector would rescan those millions of objects
    again and again."""

    @wraps(run)
    def wrapper(args: argparse.Namespace) -> int:
        with paused_gc():
            return run(args)

    return wrapper


VERBS = {
    "ledger": (_ledger_args, without_gc(ledger_verb)),
}
