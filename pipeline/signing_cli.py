"""Verbs `sign` (the runner, after evaluating) and `verify-result` (anyone holding the key)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _args(p: argparse.ArgumentParser) -> None:
    p.add_argument("result", type=Path, help="a result.json")
    p.add_argument("--key-file", type=Path, help="default: $PIPELINE_RESULT_KEY_FILE")


def sign(args: argparse.Namespace) -> int:
    """Sign a result document in place with the runner host's key (HMAC-SHA256)."""
    from pipeline import result, signing

    try:
        doc = result.read(args.result)
        key = signing.load_key(args.key_file)
    except (result.ResultError, signing.SignatureError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    result.write(signing.sign(doc, key), args.result)
    print(f"signed {args.result} with key {signing.key_id(key)}")
    return 0


def verify_result(args: argparse.Namespace) -> int:
    """Check a result's schema and signature; exit 1 when either fails."""
    from pipeline import result, signing

    try:
        key = signing.load_key(args.key_file)
    except signing.SignatureError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        doc = json.loads(args.result.read_text())
        result.validate(doc)
        signing.verify(doc, key)
    except (OSError, json.JSONDecodeError, result.ResultError, signing.SignatureError) as exc:
        print(f"refused: {args.result}: {exc}", file=sys.stderr)
        return 1
    print(f"ok: {args.result} is a valid result signed with key {signing.key_id(key)}")
    return 0


VERBS = {"sign": (_args, sign), "verify-result": (_args, verify_result)}
