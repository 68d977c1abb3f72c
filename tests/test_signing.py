"""Signed results: a tampered, unsigned or foreign-key result is refused."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline import result, signing
from pipeline.kernel.evaluate import Options, evaluate
from pipeline.problems import load_problem

ROOT = Path(__file__).resolve().parent.parent
KEY = b"k" * 48


@pytest.fixture(scope="module")
def doc():
    problem = load_problem("muse_bf16_proj")
    return evaluate(problem.directory / "template.py", problem, Options(seeds=1, timing=True))


def test_a_signed_result_verifies_and_still_matches_the_schema(doc):
    signed = signing.sign(doc, KEY)
    result.validate(signed)
    signing.verify(signed, KEY)
    assert doc["signature"] is None  # signing returns a copy


@pytest.mark.parametrize(
    "tamper",
    [
        lambda d: d.update(status="passed" if d["status"] != "passed" else "needs_review"),
        lambda d: d["performance"][0].update(median_us=d["performance"][0]["median_us"] / 2),
        lambda d: d["score"].update(speedup=d["score"]["speedup"] * 1.01),
        lambda d: d["submission"].update(login="someone-else"),
        lambda d: d["flags"].clear() or d["flags"].append({"code": "x", "message": "y", "line": None}),
    ],
)
def test_any_change_after_signing_is_refused(doc, tamper):
    signed = signing.sign(doc, KEY)
    tamper(signed)
    with pytest.raises(signing.SignatureError, match="changed after signing"):
        signing.verify(signed, KEY)


def test_unsigned_and_foreign_key_results_are_refused(doc):
    with pytest.raises(signing.SignatureError, match="not signed"):
        signing.verify(doc, KEY)
    with pytest.raises(signing.SignatureError, match="not this runner's key"):
        signing.verify(signing.sign(doc, b"x" * 48), KEY)


def test_short_or_missing_keys_are_refused(tmp_path, monkeypatch):
    monkeypatch.delenv(signing.KEY_ENV, raising=False)
    with pytest.raises(signing.SignatureError, match="set \\$PIPELINE_RESULT_KEY_FILE"):
        signing.load_key()
    short = tmp_path / "k"
    short.write_bytes(b"short")
    with pytest.raises(signing.SignatureError, match="at least 32 bytes"):
        signing.load_key(short)


def test_sign_and_verify_verbs(doc, tmp_path):
    key = tmp_path / "key"
    key.write_bytes(KEY)
    path = tmp_path / "result.json"
    result.write(doc, path)
    env = {"PIPELINE_RESULT_KEY_FILE": str(key), "PATH": "/usr/bin:/bin"}
    run = lambda *a: subprocess.run([sys.executable, "-m", "pipeline", *a], cwd=ROOT, capture_output=True,  # noqa: E731
                                    text=True, env=env)
    assert run("verify-result", str(path)).returncode == 1
    signed = run("sign", str(path))
    assert signed.returncode == 0, signed.stderr
    assert run("verify-result", str(path)).returncode == 0
    data = json.loads(path.read_text())
    data["status"] = "passed" if data["status"] != "passed" else "incorrect"
    path.write_text(json.dumps(data))
    bad = run("verify-result", str(path))
    assert bad.returncode == 1 and "changed after signing" in bad.stderr
