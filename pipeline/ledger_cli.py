"""The verb of the results ledger: `ledger` (append, verify, disqualify, clear). Registered in
pipeline/cli.py's VERBS (the boards' verbs are in pipeline/board/cli.py).

The only code of the ledger that touches files: parse arguments, read the ledger and the
configuration, call the pure functions of `pipeline.ledger`, write what they return.
Exit codes: 0 done, 1 refused or verification failed, 2 usage error.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from pipeline.competition import REPO_ROOT, InstantError, format_instant, parse_instant
from pipeline.signing import SignatureError

OK, REFUSED, USAGE = 0, 1, 2


def _error(code: int, message: str) -> int:
    print(("refused: " if code == REFUSED else "error: ") + message, file=sys.stderr)
    return code


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


# ---- ledger ----

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


def ledger(args: argparse.Namespace) -> int:
    """The results ledger: append a merged PR's result, verify the chain, disqualify or clear a result."""
    from pipeline import ledger as lg

    try:
        if args.action == "verify":
            keyring = _load_keyring(args)
            places: dict[int, str] = {}
            records = lg.verify_shards(lg.read_shards(args.root), places=places)
            by_key = lg.verify_evidence(args.root, records, keyring, allow_unofficial=args.allow_unofficial,
                                        places=places)
            held = {r["sha256"]: r["seq"] for r in records}
            for head in args.contains:
                if head != lg.GENESIS and head not in held:
                    return _error(REFUSED, f"the ledger does not verify: the chain no longer holds head {head} "
                                  f"(it has {len(records)} records, head {lg.chain_head(records)}): records were "
                                  "removed or rewritten since that head was printed; restore the ledger from git")
            results = sum(1 for r in records if r["kind"] == "result")
            shards = len(lg.read_shards(args.root))
            signed = ", ".join(f"{n} by {kid} ({keyring.keys[kid].name})" for kid, n in sorted(by_key.items()))
            unsigned = results - sum(by_key.values())
            print(f"ok: {len(records)} records ({results} results, {len(records) - results} markings) in {shards} "
                  f"shard{'s' if shards != 1 else ''}; every result's signed document in {lg.EVIDENCE_DIR.as_posix()}/ "
                  f"verifies ({signed or 'none signed'}{f', {unsigned} unsigned unofficial' if unsigned else ''}); "
                  f"chain head {lg.chain_head(records)}")
            return OK
        if args.action == "append":
            return _append(args)
        at = format_instant(parse_instant(args.at, "--at")) if args.at else lg.now_instant()
        record, path = lg.append(args.root, lambda records: lg.marking_record(
            records, args.kind, pr=args.pr, head_sha=args.head_sha, reason=args.reason, by=args.by, at=at))
        print(f"appended {args.kind} of PR #{args.pr} (@{record['login']}, {record['problem']}) as record seq "
              f"{record['seq']} to {_rel(path, args.root)}; regenerate the board: python -m pipeline board")
        return OK
    except InstantError as exc:
        return _error(USAGE, str(exc))
    except lg.LedgerRefusal as exc:
        return _error(REFUSED, str(exc))
    except lg.LedgerBroken as exc:
        return _error(REFUSED, f"the ledger does not verify: {exc}")
    except SignatureError as exc:
        return _error(USAGE, str(exc))
    except OSError as exc:  # a full disk, a read-only checkout: the shard is replaced whole or not at all
        return _error(REFUSED, f"the ledger could not be written ({exc.strerror or exc}); no shard was changed. "
                      "Fix the file system and run the same command again")


def _rel(path: Path, root: Path) -> str:
    try:
        return Path(path).resolve().relative_to(Path(root).resolve()).as_posix()
    except ValueError:
        return str(path)


def _append(args: argparse.Namespace) -> int:
    from pipeline import ledger as lg
    from pipeline.result import MAX_BYTES, ResultError, read_data

    if not args.result.is_file():
        return _error(USAGE, f"{args.result}: no such file; pass the result.json the runner uploaded")
    accepted_at = format_instant(parse_instant(args.merged_at, "--merged-at"))
    keyring = _load_keyring(args)
    try:  # bounded (a result is at most MAX_BYTES), a regular file, strict JSON, and valid whole
        raw, doc = read_data(args.result, MAX_BYTES)
    except ResultError as exc:
        return _error(REFUSED, f"{exc}\nOnly a result written by the evaluator can be recorded; re-run the evaluation "
                      "rather than editing its result (pass the result.json the runner uploaded, unchanged)")
    body = lg.result_record(doc, raw, pr=args.pr, login=args.login, head_sha=args.head_sha, accepted_at=accepted_at,
                            allow_unofficial=args.allow_unofficial, source=str(args.result), keyring=keyring,
                            workloads={k: list(v[1]) for k, v in problem_workloads().items()})
    record, path = lg.append(args.root, body, evidence=raw)
    print(f"appended PR #{record['pr']} (@{record['login']}, {record['track']}/{record['problem']}, "
          f"{record['score']['speedup']:.3f}x{'' if record['official'] else ', unofficial'}) as record seq "
          f"{record['seq']} to {_rel(path, args.root)}")
    return OK


def _without_gc(run: Any) -> Any:
    """The ledger's verb holds the whole ledger's records for its short life and creates no cycles
    worth collecting; the cyclic collector would rescan those millions of objects again and again."""
    from functools import wraps

    from pipeline.ledger import paused_gc

    @wraps(run)
    def wrapper(args: argparse.Namespace) -> int:
        with paused_gc():
            return run(args)

    return wrapper


VERBS = {
    "ledger": (_ledger_args, _without_gc(ledger)),
}
