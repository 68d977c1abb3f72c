"""Verbs `sign` (bench.yml's sign job, on the signer host), `verify-result` (anyone: the committed
public keys are enough) and `keygen` (the key's owner, once per signer host).

Exit codes: 0 done, 1 refused (the result is not one that may be signed, or its signature does not
verify), 2 usage or configuration error (no key, a bad keyring).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

OK, REFUSED, USAGE = 0, 1, 2
# what the sign job checks the unsigned result against: the dispatch's inputs (bench.yml)
BINDINGS = (("pr", "pr"), ("head_sha", "head_sha"), ("login", "login"), ("blob_sha", "blob_sha"))


def _error(code: int, message: str) -> int:
    print(("refused: " if code == REFUSED else "error: ") + message, file=sys.stderr)
    return code


def _sign_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("result", type=Path, help="the unsigned result.json the evaluate job uploaded (data only)")
    p.add_argument("--out", type=Path, metavar="SIGNED.json", help="where to write the signed result (default: "
                   "in place)")
    p.add_argument("--key-file", type=Path, help="the private key (default: $PIPELINE_SIGNING_KEY_FILE)")
    p.add_argument("--pr", type=int, help="refuse unless the result is for this pull request")
    p.add_argument("--head-sha", help="refuse unless the result evaluated this head commit")
    p.add_argument("--login", help="refuse unless the result is this competitor's (case-insensitive)")
    p.add_argument("--blob-sha", help="refuse unless the result evaluated this blob")
    p.add_argument("--problem", help="refuse unless the result is for this problem")


def _bound(doc: dict, args: argparse.Namespace) -> str | None:
    """Why the result is not the evaluation the dispatch asked for, or None."""
    sub = doc["submission"]
    for key, attr in BINDINGS:
        want = getattr(args, attr)
        if want is None or want == "":
            continue
        have = sub.get(key)
        same = (str(have).lower() == str(want).lower()) if key == "login" else have == want
        if not same:
            return f"the result's submission {key} is {have!r}, but the dispatch named {want!r}"
    if args.problem and doc["problem"] != args.problem:
        return f"the result is for problem {doc['problem']!r}, but the dispatch named {args.problem!r}"
    return None


def _write(path: Path, data: bytes) -> None:
    """Atomically: a new file beside `path`, then renamed over it (a link at `path` is replaced, never
    written through)."""
    tmp = path.with_name(f".{path.name}.sign{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    os.replace(tmp, path)


def sign(args: argparse.Namespace) -> int:
    """Sign an evaluator's result with the signer host's Ed25519 key, after checking it as data.

    The result must be a regular JSON file (never a link), valid by result.schema.json, unsigned, and
    (when --pr, --head-sha, --login, --blob-sha or --problem are given) the evaluation the dispatch
    asked for. The signature covers the whole document but its signature field.
    """
    import json

    from pipeline import result, signing

    try:
        key = signing.load_private_key(args.key_file)
    except signing.SignatureError as exc:
        return _error(USAGE, str(exc))
    try:
        _, doc = result.read_data(args.result)
    except result.ResultError as exc:
        return _error(REFUSED, f"{exc}\nOnly a result the evaluator wrote is signed; nothing was signed.")
    if doc["signature"] is not None:
        return _error(REFUSED, f"{args.result} already carries a signature: the evaluator writes unsigned results, "
                      "so this one did not come from it; nothing was signed")
    why = _bound(doc, args)
    if why:
        return _error(REFUSED, f"{args.result}: {why}; nothing was signed")
    signed = signing.sign(doc, key)
    result.validate(signed)
    out = args.out or args.result
    try:
        _write(out, (json.dumps(signed, indent=2, sort_keys=True) + "\n").encode())
    except OSError as exc:
        return _error(USAGE, f"cannot write {out}: {exc.strerror}")
    sub = doc["submission"]
    print(f"signed {out} with key {key.key_id}: {doc['problem']} {doc['status']}"
          + (f", PR #{sub['pr']} at {sub['head_sha']}" if sub["pr"] else ""))
    return OK


def _verify_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("result", type=Path, help="a result.json")
    p.add_argument("--keyring", type=Path, metavar="DIR",
                   help="the runners' public keys (default: $PIPELINE_KEYRING, else keys/runners/ of the repository)")


def verify_result(args: argparse.Namespace) -> int:
    """Check a result's schema and signature against the committed public keys; exit 1 when either fails."""
    from pipeline import result, signing

    try:
        keyring = signing.load_keyring(args.keyring)
    except signing.SignatureError as exc:
        return _error(USAGE, str(exc))
    try:
        _, doc = result.read_data(args.result)
        key = signing.verify(doc, keyring)
    except (result.ResultError, signing.SignatureError) as exc:
        return _error(REFUSED, f"{args.result}: {exc}")
    print(f"ok: {args.result} is a valid result signed with key {key.key_id} ({key.name}, {key.path})")
    return OK


def _keygen_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--private", type=Path, required=True, metavar="PATH",
                   help="the new private key: created with mode 600, never over an existing file")
    p.add_argument("--public", type=Path, required=True, metavar="PATH",
                   help="the new public key, to commit as keys/runners/<host>.pub")


def keygen(args: argparse.Namespace) -> int:
    """Make a new Ed25519 signing key pair for a signer host (run on that host, as the signer's user)."""
    from pipeline import signing

    try:
        key = signing.keygen(args.private, args.public)
    except signing.SignatureError as exc:
        return _error(USAGE, str(exc))
    except OSError as exc:
        return _error(USAGE, f"cannot write the key: {exc}")
    print(f"new key {key.key_id}\n  private: {args.private} (mode 600; point ${signing.KEY_ENV} at it on this host "
          f"only)\n  public:  {args.public} (commit it as {signing.KEYRING_DIR.as_posix()}/<host>.pub through a PR)")
    return OK


VERBS = {
    "sign": (_sign_args, sign),
    "verify-result": (_verify_args, verify_result),
    "keygen": (_keygen_args, keygen),
}
