"""Result signatures: an HMAC over the result document, keyed by a secret held by the runner host.

The bench workflow's runner signs `result.json` with a key that lives on the host (not a GitHub
secret, so no workflow on GitHub can sign); report and ledger verify before anything is posted or
recorded, so a tampered or unsigned result is refused. The MAC covers the canonical JSON of the whole
document except the signature itself.
"""

from __future__ import annotations

import copy
import hashlib
import hmac
import json
import os
from pathlib import Path
from typing import Any

KEY_ENV = "PIPELINE_RESULT_KEY_FILE"
ALG = "hmac-sha256"


class SignatureError(ValueError):
    pass


def canonical(doc: dict[str, Any]) -> bytes:
    body = {k: v for k, v in doc.items() if k != "signature"}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def key_id(key: bytes) -> str:
    """Names a key without revealing it, so a verifier can say which key it expected."""
    return hashlib.sha256(b"muse-result-key|" + key).hexdigest()[:16]


def load_key(path: str | os.PathLike | None = None) -> bytes:
    path = path or os.environ.get(KEY_ENV)
    if not path:
        raise SignatureError(f"no signing key: set ${KEY_ENV} to the key file the runner host holds")
    try:
        key = Path(path).read_bytes().strip()
    except OSError as exc:
        raise SignatureError(f"cannot read the signing key {path}: {exc.strerror}") from None
    if len(key) < 32:
        raise SignatureError(f"{path}: a signing key must be at least 32 bytes (it is {len(key)})")
    return key


def sign(doc: dict[str, Any], key: bytes) -> dict[str, Any]:
    signed = copy.deepcopy(doc)
    mac = hmac.new(key, canonical(signed), hashlib.sha256).hexdigest()
    signed["signature"] = {"alg": ALG, "key_id": key_id(key), "mac": mac}
    return signed


def verify(doc: dict[str, Any], key: bytes) -> None:
    sig = doc.get("signature")
    if not isinstance(sig, dict) or not sig.get("mac"):
        raise SignatureError("the result is not signed: only results signed by a runner can be posted or recorded")
    if sig.get("alg") != ALG:
        raise SignatureError(f"unknown signature algorithm {sig.get('alg')!r}; expected {ALG}")
    if sig.get("key_id") != key_id(key):
        raise SignatureError(f"signed with key {sig.get('key_id')!r}, not this runner's key {key_id(key)!r}")
    try:
        expected = hmac.new(key, canonical(doc), hashlib.sha256).hexdigest()
    except ValueError as exc:  # NaN/Inf cannot be canonical
        raise SignatureError(f"the result cannot be canonicalised: {exc}") from None
    if not hmac.compare_digest(expected, str(sig["mac"])):
        raise SignatureError("the signature does not match the result: it was changed after signing")
