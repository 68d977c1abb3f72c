"""Signed results (Ed25519): the signature covers every value of the document; a result signed by a key
outside the committed keyring, or changed after signing, is refused; keygen makes a private key only
its owner can read and never overwrites one; `sign` reads its input as data; evaluation never needs
the `cryptography` package."""

from __future__ import annotations

import copy
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from ledger_factory import FOREIGN_KEY, TEST_KEY, result_doc, write_keyring, write_private_key
from pipeline import result, signing

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def doc():
    """A realistic result: the evaluator's own document for a template, with timing (committed:
    tests/fixtures/kernel_results/make.py)."""
    from fixtures.kernel_results import make as kernel_results

    out = kernel_results.load("passed")
    # what the runner records of its submission, so that those leaves are values too
    out["submission"].update(login="alice", pr=12, head_sha="a" * 40)
    result.validate(out)
    return out


@pytest.fixture(scope="module")
def keyring(tmp_path_factory):
    return signing.load_keyring(write_keyring(tmp_path_factory.mktemp("ring"), TEST_KEY))


def test_a_signed_result_verifies_and_still_matches_the_schema(doc, keyring):
    signed = signing.sign(doc, TEST_KEY)
    result.validate(signed)
    assert signing.verify(signed, keyring).key_id == TEST_KEY.key_id
    assert signed["signature"]["alg"] == "ed25519" and set(signed["signature"]) == {"alg", "key_id", "sig"}
    assert doc["signature"] is None  # signing returns a copy
    # the signature does not depend on the order of keys or on the signature field's old value
    shuffled = json.loads(json.dumps(dict(reversed(list(signed.items())))))
    assert signing.verify(shuffled, keyring)


def leaves(node, path=()):
    """Every place of a JSON document that holds a value: scalars, and empty lists and objects."""
    if isinstance(node, dict) and node:
        for k, v in node.items():
            yield from leaves(v, path + (k,))
    elif isinstance(node, list) and node:
        for i, v in enumerate(node):
            yield from leaves(v, path + (i,))
    else:
        yield path, node


def changed(value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value * 1.0000001 if value else 1e-300
    if isinstance(value, str):
        return value + " "
    if value is None:
        return 0
    if isinstance(value, list):
        return [0]
    return {"x": 0}


def at(doc, path):
    """The node at `path`."""
    for p in path:
        doc = doc[p]
    return doc


def test_tampering_any_leaf_of_a_result_is_refused(doc, keyring):
    """The signature's whole scope: every value of a realistic result, each changed by the least that
    JSON can show, and every key added or removed, is refused."""
    signed = signing.sign(doc, TEST_KEY)
    paths = [p for p, _ in leaves(signed) if p[0] != "signature"]
    assert len(paths) > 200, "a realistic result (samples, shapes, environment) has hundreds of values"
    for path, value in leaves(signed):
        if path[0] == "signature":
            continue
        bad = copy.deepcopy(signed)
        at(bad, path[:-1])[path[-1]] = changed(value)
        with pytest.raises(signing.SignatureError, match="changed after signing"):
            signing.verify(bad, keyring)
    objects = [(p, v) for p, v in leaves_objects(signed) if not p or p[0] != "signature"]
    for path, obj in objects:
        for key in list(obj):
            if not path and key == "signature":
                continue
            bad = copy.deepcopy(signed)
            del at(bad, path)[key]
            with pytest.raises(signing.SignatureError, match="changed after signing"):
                signing.verify(bad, keyring)
        bad = copy.deepcopy(signed)
        at(bad, path)["added"] = 1
        with pytest.raises(signing.SignatureError, match="changed after signing"):
            signing.verify(bad, keyring)


def leaves_objects(node, path=()):
    """Every JSON object of a document with its path."""
    if isinstance(node, dict):
        yield path, node
        for k, v in node.items():
            yield from leaves_objects(v, path + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from leaves_objects(v, path + (i,))


@pytest.mark.parametrize("tamper,message", [
    (lambda s: s.update(sig=s["sig"][:-4] + ("AAA=" if not s["sig"].endswith("AAA=") else "BBB=")), "changed after"),
    (lambda s: s.update(sig="not base64!"), "not base64"),
    (lambda s: s.update(sig=""), "not signed"),
    (lambda s: s.update(alg="hmac-sha256"), "unknown signature"),
    (lambda s: s.update(mac="0" * 64), "unknown signature"),
    (lambda s: s.update(key_id=FOREIGN_KEY.key_id), "not a runner key"),
])
def test_the_signature_field_itself_is_checked(doc, keyring, tamper, message):
    signed = signing.sign(doc, TEST_KEY)
    tamper(signed["signature"])
    with pytest.raises(signing.SignatureError, match=message):
        signing.verify(signed, keyring)


def test_unsigned_and_foreign_key_results_are_refused(doc, keyring):
    with pytest.raises(signing.SignatureError, match="not signed"):
        signing.verify(doc, keyring)
    with pytest.raises(signing.SignatureError, match=f"signed with key '{FOREIGN_KEY.key_id}', which is not a runner"):
        signing.verify(signing.sign(doc, FOREIGN_KEY), keyring)
    # a forger who relabels their signature with the runner's key id gains nothing
    forged = signing.sign(doc, FOREIGN_KEY)
    forged["signature"]["key_id"] = TEST_KEY.key_id
    with pytest.raises(signing.SignatureError, match="changed after signing"):
        signing.verify(forged, keyring)


def test_the_committed_keyring_loads(monkeypatch):
    monkeypatch.delenv(signing.KEYRING_ENV, raising=False)
    ring = signing.load_keyring()
    assert Path(ring.directory) == ROOT / "keys" / "runners"
    assert all(k.key_id.startswith("ed25519:") for k in ring.keys.values())


def test_key_ids_are_derived_from_the_public_key(tmp_path):
    assert TEST_KEY.key_id != FOREIGN_KEY.key_id and TEST_KEY.key_id.startswith("ed25519:")
    assert signing.public_key_id(TEST_KEY.public_pem())[0] == TEST_KEY.key_id
    ring = signing.load_keyring(write_keyring(tmp_path, TEST_KEY, FOREIGN_KEY))
    assert sorted(ring.keys) == sorted([TEST_KEY.key_id, FOREIGN_KEY.key_id])
    (tmp_path / "broken.pub").write_text("-----BEGIN PUBLIC KEY-----\nnope\n-----END PUBLIC KEY-----\n")
    with pytest.raises(signing.KeyringError, match="broken.pub is not a PEM public key"):
        signing.load_keyring(tmp_path)


def test_keygen_writes_an_owner_only_key_and_never_overwrites(tmp_path, capsys):
    from pipeline.__main__ import main

    private, public = tmp_path / "signer.key", tmp_path / "signer.pub"
    old = os.umask(0)  # the mode must not depend on the caller's umask
    try:
        assert main(["keygen", "--private", str(private), "--public", str(public)]) == 0
    finally:
        os.umask(old)
    assert stat.S_IMODE(private.stat().st_mode) == 0o600
    assert private.read_bytes().startswith(b"-----BEGIN PRIVATE KEY-----")
    assert public.read_bytes().startswith(b"-----BEGIN PUBLIC KEY-----")
    key = signing.load_private_key(private)
    assert key.key_id in capsys.readouterr().out
    ring_dir = tmp_path / "ring"
    ring_dir.mkdir()
    (ring_dir / "h200-a.pub").write_bytes(public.read_bytes())
    assert signing.verify(signing.sign(result_doc(), key), signing.load_keyring(ring_dir)).name == "h200-a"
    before = (private.read_bytes(), public.read_bytes())
    for args in (["--private", str(private), "--public", str(tmp_path / "other.pub")],
                 ["--private", str(tmp_path / "other.key"), "--public", str(public)]):
        assert main(["keygen", *args]) == 2
        assert "already exists; keygen never overwrites a key" in capsys.readouterr().err
    assert (private.read_bytes(), public.read_bytes()) == before
    assert not (tmp_path / "other.key").exists() and not (tmp_path / "other.pub").exists()
    link = tmp_path / "link.key"
    link.symlink_to(tmp_path / "nowhere")
    assert main(["keygen", "--private", str(link), "--public", str(tmp_path / "l.pub")]) == 2
    assert not (tmp_path / "nowhere").exists()


def test_a_private_key_others_can_read_or_the_wrong_kind_is_refused(tmp_path, monkeypatch):
    monkeypatch.delenv(signing.KEY_ENV, raising=False)
    with pytest.raises(signing.SignatureError, match="set \\$PIPELINE_SIGNING_KEY_FILE"):
        signing.load_private_key()
    path = write_private_key(tmp_path / "k")
    assert signing.load_private_key(path).key_id == TEST_KEY.key_id
    path.chmod(0o640)
    with pytest.raises(signing.SignatureError, match="readable by others .* chmod 600"):
        signing.load_private_key(path)
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    other = tmp_path / "ec"
    other.write_bytes(ec.generate_private_key(ec.SECP256R1()).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    other.chmod(0o600)
    with pytest.raises(signing.SignatureError, match="not an Ed25519 key"):
        signing.load_private_key(other)


def run(*args, env=None):
    return subprocess.run([sys.executable, "-m", "pipeline", *args], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, **(env or {})})


def test_sign_and_verify_verbs(doc, tmp_path):
    unsigned = tmp_path / "unsigned" / "result.json"
    unsigned.parent.mkdir()
    result.write(doc, unsigned)
    out = tmp_path / "signed.json"
    assert run("verify-result", str(unsigned)).returncode == 1
    signed = run("sign", str(unsigned), "--out", str(out), "--pr", "12", "--head-sha", "a" * 40, "--login", "Alice",
                 "--blob-sha", doc["submission"]["blob_sha"], "--problem", "muse_bf16_proj")
    assert signed.returncode == 0, signed.stderr
    assert TEST_KEY.key_id in signed.stdout
    ok = run("verify-result", str(out))
    assert ok.returncode == 0 and TEST_KEY.key_id in ok.stdout, ok.stderr
    assert json.loads(unsigned.read_text())["signature"] is None, "--out leaves the input alone"
    data = json.loads(out.read_text())
    data["status"] = "passed" if data["status"] != "passed" else "incorrect"
    out.write_text(json.dumps(data))
    bad = run("verify-result", str(out))
    assert bad.returncode == 1 and "changed after signing" in bad.stderr
    foreign = tmp_path / "foreign"
    assert run("verify-result", str(out), "--keyring", str(write_keyring(foreign, FOREIGN_KEY))).returncode == 1


def test_sign_refuses_anything_but_the_evaluator_s_unsigned_result(doc, tmp_path):
    good = tmp_path / "result.json"
    result.write(doc, good)
    cases = {}
    link = tmp_path / "link.json"
    link.symlink_to(good)
    cases["a link"] = (link, "a link, which is never followed")
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    cases["a fifo"] = (fifo, "not a regular file")
    cases["a folder"] = (tmp_path, "not a regular file")
    for name, text, message in (
        ("notjson", "{not json", "not JSON"),
        ("nan", good.read_text().replace('"schema_version": 1', '"schema_version": NaN'), "NaN is not JSON"),
        ("dup", good.read_text().replace('"schema_version": 1', '"schema_version": 1, "schema_version": 1'),
         "appears twice"),
        ("list", "[]", "a result is a JSON object"),
        ("schema", json.dumps({**doc, "status": "great"}), "does not match result.schema.json"),
        ("signed", json.dumps(signing.sign(doc, FOREIGN_KEY)), "already carries a signature"),
    ):
        path = tmp_path / f"{name}.json"
        path.write_text(text)
        cases[name] = (path, message)
    for name, (path, message) in cases.items():
        out = tmp_path / f"out-{name}.json"
        proc = run("sign", str(path), "--out", str(out))
        assert proc.returncode == 1 and message in proc.stderr, (name, proc.stderr)
        assert not out.exists(), name
    for flag, value, message in (("--pr", "13", "submission pr is 12"), ("--head-sha", "b" * 40, "head_sha"),
                                 ("--login", "mallory", "login is 'alice'"), ("--blob-sha", "c" * 40, "blob_sha"),
                                 ("--problem", "muse_moe_w4a16", "is for problem 'muse_bf16_proj'")):
        proc = run("sign", str(good), "--out", str(tmp_path / "o.json"), flag, value)
        assert proc.returncode == 1 and message in proc.stderr, (flag, proc.stderr)
    proc = run("sign", str(good), env={signing.KEY_ENV: ""})
    assert proc.returncode == 2 and "no signing key" in proc.stderr
    assert json.loads(good.read_text())["signature"] is None


def test_evaluation_never_needs_the_cryptography_package(tmp_path):
    """The GPU machine that evaluates kernels has no `cryptography`: evaluating must not import it."""
    out = tmp_path / "result.json"
    code = ("import sys; sys.modules['cryptography'] = None\n"
            "from pipeline.__main__ import main\n"
            f"code = main(['evaluate', 'problems/muse_bf16_proj/template.py', '--no-timing', '--seeds', '1', "
            f"'--json', {str(out)!r}])\n"
            "import pipeline.signing, pipeline.result\n"
            "sys.exit(code)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode in (0, 1) and out.is_file(), proc.stderr[-2000:]
    assert json.loads(out.read_text())["signature"] is None
    blocked = subprocess.run([sys.executable, "-c", "import sys; sys.modules['cryptography'] = None\n"
                              "from pipeline import signing\nsigning.load_private_key()"], cwd=ROOT,
                             capture_output=True, text=True)
    assert blocked.returncode == 1 and "need the cryptography package: pip install cryptography" in blocked.stderr
