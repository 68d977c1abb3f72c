"""Seeds for the inputs of each (problem, shape, index). The child never sees one.

Local runs use public seeds, so a competitor reproduces the bot's correctness verdict exactly. Official
runs derive each seed from HMAC(secret, problem, shape, i) with a secret held by the runner host only,
so no submission can know in advance which inputs it will be checked on.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path

SECRET_ENV = "PIPELINE_SEED_SECRET_FILE"


def public_seed(problem: str, shape: str, index: int) -> int:
    digest = hashlib.sha256(f"public|{problem}|{shape}|{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def secret_seed(secret: bytes, problem: str, shape: str, index: int) -> int:
    digest = hmac.new(secret, f"{problem}|{shape}|{index}".encode(), hashlib.sha256).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def load_secret() -> bytes | None:
    """The runner's secret, from the file named by $PIPELINE_SEED_SECRET_FILE (never from the repo)."""
    path = os.environ.get(SECRET_ENV)
    if not path:
        return None
    secret = Path(path).read_bytes().strip()
    if len(secret) < 16:
        raise ValueError(f"{path}: the seed secret must be at least 16 bytes")
    return secret
