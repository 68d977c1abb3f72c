"""Result signatures: Ed25519, made by the signer runner's private key, checked against the public keys
committed to the repository.

Who holds what:
- The private key is a file on the signer runner's host (PEM, PKCS#8, mode 600, its path in
  $PIPELINE_SIGNING_KEY_FILE; `python -m pipeline keygen` makes one). No GitHub secret and no workflow
  on GitHub holds anything that can sign.
- The public keys are committed: `keys/runners/*.pub` (PEM SubjectPublicKeyInfo), one file per signer
  host. A key is named by its key id, derived from the public key itself, so a signature says which key
  made it and nobody has to trust a name. `keys/runners/retired/*.pub` still verify what is already in
  the ledger, nothing new (a rotated key); `keys/runners/revoked/*.pub` verify nothing (a compromised
  key: `ledger verify` demands that each of its records be disqualified). $PIPELINE_KEYRING names
  another folder of the same layout (tests, or a verifier's own copy).

What is signed: the canonical JSON (sorted keys, no spaces, ASCII, no NaN) of the whole result
document except its `signature` field, behind a fixed context string, so the key can never be made to
sign anything that is not a result. The signature field is {"alg": "ed25519", "key_id", "sig"}.

`cryptography` is imported inside the functions that need it: the GPU machine that evaluates kernels
never signs or verifies, and need not have it.
"""

from __future__ import annotations

import argparse
import base64
import copy
import hashlib
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.exits import OK, REFUSED, USAGE, error

KEY_ENV = "PIPELINE_SIGNING_KEY_FILE"
KEYRING_ENV = "PIPELINE_KEYRING"
KEYRING_DIR = Path("keys") / "runners"
ALG = "ed25519"
CONTEXT = b"muse-pipeline result v1\n"
STATUSES = ("active", "retired", "revoked")  # keys/runners/, keys/runners/retired/, keys/runners/revoked/
MAX_KEY_FILE = 16 * 1024


class SignatureError(ValueError):
    pass


class KeyringError(SignatureError):
    """The committed keyring itself is unusable (a bad file, the same key twice); says which file."""


def canonical(doc: dict[str, Any]) -> bytes:
    body = {k: v for k, v in doc.items() if k != "signature"}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def message(doc: dict[str, Any]) -> bytes:
    """The exact bytes the key signs."""
    try:
        return CONTEXT + canonical(doc)
    except (ValueError, TypeError) as exc:  # NaN/Inf or a value JSON cannot hold
        raise SignatureError(f"the result cannot be canonicalised: {exc}") from None


def key_id(public: bytes) -> str:
    """A key's name, derived from its raw 32-byte public key: `ed25519:` and 32 hex digits."""
    return "ed25519:" + hashlib.sha256(b"muse-runner-key|" + public).hexdigest()[:32]


def _crypto():
    try:
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError:
        raise SignatureError("signing and verifying results need the cryptography package: pip install "
                             "cryptography (the evaluator itself never needs it)") from None
    return ed25519, serialization, InvalidSignature


def _raw_public(public_key: Any) -> bytes:
    _, serialization, _ = _crypto()
    return public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


# ---- the private key (the signer's host only) ----

@dataclass(frozen=True)
class SigningKey:
    private: Any  # cryptography's Ed25519PrivateKey
    key_id: str

    @classmethod
    def from_private(cls, private: Any) -> "SigningKey":
        return cls(private, key_id(_raw_public(private.public_key())))

    @classmethod
    def from_seed(cls, seed: bytes) -> "SigningKey":
        """A key from its 32-byte seed (tests use a fixed one; a real key comes from keygen)."""
        ed25519, _, _ = _crypto()
        return cls.from_private(ed25519.Ed25519PrivateKey.from_private_bytes(seed))

    def public_pem(self) -> bytes:
        _, serialization, _ = _crypto()
        return self.private.public_key().public_bytes(serialization.Encoding.PEM,
                                                      serialization.PublicFormat.SubjectPublicKeyInfo)

    def private_pem(self) -> bytes:
        _, serialization, _ = _crypto()
        return self.private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption())


def _read_small_file(path: Path, what: str, fix: str) -> tuple[bytes, os.stat_result]:
    """A regular file read without following a link, bounded in size."""
    from pipeline.files import UnreadableFile, read_regular_file

    try:
        return read_regular_file(path, MAX_KEY_FILE)
    except UnreadableFile as exc:
        raise SignatureError(f"cannot read {what} {path}: {exc}; {fix}") from None


def load_private_key(path: str | os.PathLike | None = None) -> SigningKey:
    """The signer's private key, from `path` or $PIPELINE_SIGNING_KEY_FILE: a PEM PKCS#8 Ed25519 key in a
    file nobody but its owner can read."""
    path = path or os.environ.get(KEY_ENV)
    if not path:
        raise SignatureError(f"no signing key: set ${KEY_ENV} to the private key file the signer host holds "
                             "(docs/RUNBOOK.md, \"The signing key\")")
    path = Path(path)
    data, st = _read_small_file(path, "the signing key", "point $" + KEY_ENV + " at the file keygen wrote")
    if st.st_mode & 0o077:
        raise SignatureError(f"the signing key {path} is readable by others (mode {stat.S_IMODE(st.st_mode):03o}); "
                             f"chmod 600 {path}, and since others could read it, consider it leaked: rotate it "
                             "(docs/RUNBOOK.md)")
    ed25519, serialization, _ = _crypto()
    try:
        private = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise SignatureError(f"{path} is not an unencrypted PEM private key ({exc}); make one with "
                             "`python -m pipeline keygen`") from None
    if not isinstance(private, ed25519.Ed25519PrivateKey):
        raise SignatureError(f"{path} is a {type(private).__name__}, not an Ed25519 key; make one with "
                             "`python -m pipeline keygen`")
    return SigningKey.from_private(private)


def keygen(private_path: Path, public_path: Path) -> SigningKey:
    """A new key pair: the private key created with mode 600 (never over an existing file; its folder made,
    mode 700, where it is missing), the public key beside it for the repository's keyring. Returns the key."""
    ed25519, _, _ = _crypto()
    private_path, public_path = Path(private_path), Path(public_path)
    for p in (private_path, public_path):
        if os.path.lexists(p):
            raise SignatureError(f"{p} already exists; keygen never overwrites a key. Move it away first (or "
                                 "choose another name): a key that is replaced cannot sign again, and a public "
                                 "key that is replaced no longer verifies what it signed")
    if private_path.resolve() == public_path.resolve():
        raise SignatureError("--private and --public must be two different files")
    key = SigningKey.from_private(ed25519.Ed25519PrivateKey.generate())
    if not private_path.parent.exists():  # a new host's /etc/muse: made for the key alone (mode 700)
        private_path.parent.mkdir(mode=0o700, parents=True)
    fd = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    try:
        os.fchmod(fd, 0o600)  # whatever the umask said
        os.write(fd, key.private_pem())
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        fd = os.open(public_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    except OSError as exc:
        private_path.unlink()
        raise SignatureError(f"cannot create {public_path}: {exc.strerror}") from None
    with os.fdopen(fd, "wb") as fh:
        fh.write(key.public_pem())
    return key


def sign(doc: dict[str, Any], key: SigningKey) -> dict[str, Any]:
    signed = copy.deepcopy(doc)
    signed["signature"] = None
    sig = key.private.sign(message(signed))
    signed["signature"] = {"alg": ALG, "key_id": key.key_id, "sig": base64.b64encode(sig).decode("ascii")}
    return signed


# ---- the public keys (committed) ----

@dataclass(frozen=True)
class RunnerKey:
    key_id: str
    name: str  # the file's stem: which host it was made for
    status: str  # active | retired | revoked
    path: str  # as committed, relative to the keyring's parent when it can be
    public: bytes  # raw 32 bytes

    def verifies(self, signature: bytes, data: bytes) -> bool:
        ed25519, _, invalid = _crypto()
        try:
            ed25519.Ed25519PublicKey.from_public_bytes(self.public).verify(signature, data)
            return True
        except invalid:
            return False


@dataclass(frozen=True)
class Keyring:
    directory: str
    keys: dict[str, RunnerKey]

    def active(self) -> list[RunnerKey]:
        return [k for k in self.keys.values() if k.status == "active"]


def keyring_dir(root: str | os.PathLike | None = None) -> Path:
    """$PIPELINE_KEYRING, else ROOT/keys/runners (ROOT: the repository by default)."""
    if os.environ.get(KEYRING_ENV):
        return Path(os.environ[KEYRING_ENV])
    if root is None:
        from pipeline.competition import REPO_ROOT

        root = REPO_ROOT
    return Path(root) / KEYRING_DIR


def public_key_id(pem: bytes, where: str = "the public key") -> tuple[str, bytes]:
    ed25519, serialization, _ = _crypto()
    try:
        public = serialization.load_pem_public_key(pem)
    except (ValueError, TypeError) as exc:
        raise KeyringError(f"{where} is not a PEM public key ({exc}); commit the .pub file keygen wrote, unchanged"
                           ) from None
    if not isinstance(public, ed25519.Ed25519PublicKey):
        raise KeyringError(f"{where} is a {type(public).__name__}, not an Ed25519 key")
    raw = _raw_public(public)
    return key_id(raw), raw


def load_keyring(directory: str | os.PathLike | None = None) -> Keyring:
    """Every committed public key: DIR/*.pub (active), DIR/retired/*.pub, DIR/revoked/*.pub."""
    base = Path(directory) if directory is not None else keyring_dir()
    keys: dict[str, RunnerKey] = {}
    for status, folder in (("active", base), ("retired", base / "retired"), ("revoked", base / "revoked")):
        if not folder.is_dir():
            continue
        for path in sorted(folder.glob("*.pub")):
            data, _ = _read_small_file(path, "the public key", f"commit the .pub file keygen wrote to {folder}")
            kid, raw = public_key_id(data, str(path))
            if kid in keys:
                raise KeyringError(f"{path} is the same key ({kid}) as {keys[kid].path}: a key lives in one place "
                                   "only (active, retired/ or revoked/); remove one of them")
            keys[kid] = RunnerKey(kid, path.stem, status, str(path), raw)
    return Keyring(str(base), keys)


def verify(doc: dict[str, Any], keyring: Keyring, *, allow_retired: bool = False) -> RunnerKey:
    """Check the document's signature against the keyring; returns the key that made it. Raises
    SignatureError saying why not. A retired key verifies only with `allow_retired` (what is already
    in the ledger); a revoked key never does."""
    sig = doc.get("signature")
    if not isinstance(sig, dict) or not sig.get("sig"):
        raise SignatureError("the result is not signed: only results signed by a runner can be posted or recorded")
    if sig.get("alg") != ALG or set(sig) != {"alg", "key_id", "sig"}:
        raise SignatureError(f"unknown signature {sorted(sig)} with algorithm {sig.get('alg')!r}; expected {ALG} "
                             "with alg, key_id and sig")
    kid = sig.get("key_id")
    key = keyring.keys.get(kid) if isinstance(kid, str) else None
    if key is None:
        known = ", ".join(sorted(k.key_id for k in keyring.active())) or "none"
        raise SignatureError(f"signed with key {kid!r}, which is not a runner key in {keyring.directory} (active: "
                             f"{known}): only a result signed by a registered signer counts")
    if key.status == "revoked":
        raise SignatureError(f"signed with key {kid} ({key.path}), which is revoked: nothing it signed is trusted")
    if key.status == "retired" and not allow_retired:
        raise SignatureError(f"signed with key {kid} ({key.path}), which is retired: it verifies only what the "
                             "ledger already holds; evaluate again so that the current signer signs the result")
    try:
        raw = base64.b64decode(str(sig["sig"]), validate=True)
    except ValueError:
        raise SignatureError("the signature is not base64") from None
    if len(raw) != 64 or not key.verifies(raw, message(doc)):
        raise SignatureError("the signature does not match the result: it was changed after signing")
    return key


# ---- the verbs: sign (bench.yml's sign job, on the signer host), verify-result (anyone: the committed
# public keys are enough), keygen (the key's owner, once per signer host). Exit codes (pipeline/exits.py):
# 0 done, 1 refused (not a result that may be signed, or its signature does not verify), 2 usage or
# configuration error (no key, a bad keyring).

# what the sign job checks the unsigned result against: the dispatch's inputs (bench.yml)
BINDINGS = (("pr", "pr"), ("head_sha", "head_sha"), ("login", "login"), ("blob_sha", "blob_sha"))


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


def _replace(path: Path, data: bytes) -> None:
    """Atomically: a new file beside `path`, then renamed over it (a link at `path` is replaced, never
    written through)."""
    tmp = path.with_name(f".{path.name}.sign{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    os.replace(tmp, path)


def sign_verb(args: argparse.Namespace) -> int:
    """Sign an evaluator's result with the signer host's Ed25519 key, after checking it as data.

    The result must be a regular JSON file (never a link), valid by result.schema.json, unsigned, and
    (when --pr, --head-sha, --login, --blob-sha or --problem are given) the evaluation the dispatch
    asked for. The signature covers the whole document but its signature field.
    """
    from pipeline import result

    try:
        key = load_private_key(args.key_file)
    except SignatureError as exc:
        return error(USAGE, str(exc))
    try:
        _, doc = result.read_data(args.result)
    except result.ResultError as exc:
        return error(REFUSED, f"{exc}\nOnly a result the evaluator wrote is signed; nothing was signed.")
    if doc["signature"] is not None:
        return error(REFUSED, f"{args.result} already carries a signature: the evaluator writes unsigned results, "
                      "so this one did not come from it; nothing was signed")
    why = _bound(doc, args)
    if why:
        return error(REFUSED, f"{args.result}: {why}; nothing was signed")
    signed = sign(doc, key)
    result.validate(signed)
    out = args.out or args.result
    try:
        _replace(out, (json.dumps(signed, indent=2, sort_keys=True) + "\n").encode())
    except OSError as exc:
        return error(USAGE, f"cannot write {out}: {exc.strerror}")
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
    from pipeline import result

    try:
        keyring = load_keyring(args.keyring)
    except SignatureError as exc:
        return error(USAGE, str(exc))
    try:
        _, doc = result.read_data(args.result)
        key = verify(doc, keyring)
    except (result.ResultError, SignatureError) as exc:
        return error(REFUSED, f"{args.result}: {exc}")
    print(f"ok: {args.result} is a valid result signed with key {key.key_id} ({key.name}, {key.path})")
    return OK


def _keygen_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--private", type=Path, required=True, metavar="PATH",
                   help="the new private key: created with mode 600, never over an existing file")
    p.add_argument("--public", type=Path, required=True, metavar="PATH",
                   help="the new public key, to commit as keys/runners/<host>.pub")


def keygen_verb(args: argparse.Namespace) -> int:
    """Make a new Ed25519 signing key pair for a signer host (run on that host, as the signer's user)."""
    try:
        key = keygen(args.private, args.public)
    except SignatureError as exc:
        return error(USAGE, str(exc))
    except OSError as exc:
        return error(USAGE, f"cannot write the key: {exc}")
    print(f"new key {key.key_id}\n  private: {args.private} (mode 600; point ${KEY_ENV} at it on this host "
          f"only)\n  public:  {args.public} (commit it as {KEYRING_DIR.as_posix()}/<host>.pub through a PR)")
    return OK


VERBS = {
    "sign": (_sign_args, sign_verb),
    "verify-result": (_verify_args, verify_result),
    "keygen": (_keygen_args, keygen_verb),
}
