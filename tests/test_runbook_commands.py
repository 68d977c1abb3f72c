"""Every command in docs/RUNBOOK.md's fenced blocks, as an organizer types it, is run by a test here or named with
the test that runs it, or with the machine it needs (a GPU runner, the serving node) and the test that runs its
verb on this one.

Commands run here run in a fresh copy of the repository (tests/fresh_copy.py), exactly as written, each with its
effect checked. Those that write where an organizer's host keeps its files (/etc/muse, /tmp) run as root in a
mount namespace of their own, where /etc and /tmp are overlays of the real ones (what they write lands in the
test's own folders): the same arguments, and nothing of this machine is touched.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from fresh_copy import fresh_copy
from test_readme_commands import commands

ROOT = Path(__file__).resolve().parents[1]
RUNBOOK = ROOT / "docs" / "RUNBOOK.md"
RUNBOOK_COMMANDS = commands(RUNBOOK.read_text(encoding="utf-8"))

# run here, in a fresh copy, in this order (sign before verify-result), each with its effect checked
RUN = [
    "python -m pipeline prizes --at 2026-11-20T00:00:00Z",
    "python -m pipeline board",
    "python -m pipeline board --check",
    "python -m pipeline problems --pin-baselines",
    "python -m pipeline problems",
    "python -m pipeline ledger verify",
    "python -m pipeline sign result.json --out signed.json",
    "python -m pipeline verify-result signed.json",
]
# run here as root with /etc an overlay and /tmp the test's own (they write to the organizer's host paths)
PRIVATE = [
    "python -m pipeline keygen --private /etc/muse/signing.key --public h200-signer-1.pub",
    "python -m pipeline show-result /tmp/dry-run.json --markdown /tmp/dry-run.md",
    "python -m pipeline plot-result /tmp/dry-run.json --out /tmp/dry-run.png",
]
# run by another test, with the same verb and arguments (and why not here)
MAPPED = {
    "python -m pytest -q tests/test_workflows.py": "tests/test_workflows.py (the suite runs it whole)",
    "python -m pipeline demo --out /tmp/day0-demo":
        "tests/test_demo.py::test_it_leaves_every_output_and_says_each_step (the README's demo command, a relative "
        "--out; 150 s, run once)",
    "python -m pipeline serving dataset generate --conversations 200 --seed $SECRET_SEED --corpus hidden --out "
    "/etc/muse/hidden-set.json.gz": "tests/serving/test_dataset.py (the generator, seeded; 200 conversations of the "
                                    "hidden corpus take minutes: the node's one-off step)",
    "python -m pipeline serving dataset check /etc/muse/hidden-set.json.gz --window 131072":
        "tests/test_readme_commands.py::test_the_readme_command_runs (dataset check of the public sample)",
    "sudo /opt/muse/venv/bin/python -m pipeline serving fetch":
        "tests/serving/test_pin.py::test_a_second_fetch_is_instant_and_prints_the_same_tree (the cache's path aside)",
}
# need a machine this is not; the verb itself is tested here as named
ELSEWHERE = {
    "sudo /opt/muse/venv/bin/python -m pipeline evaluate problems/muse_bf16_proj/template.py --no-timing --json "
    "/tmp/seeds.json": "the GPU runner's seed secret; tests/test_evaluate.py (secret seeds, --json)",
    "python -c import json; print(json.load(open('/tmp/seeds.json'))['mode']['seeds'])":
        "reads the line above's result on the GPU runner",
    "sudo /opt/muse/venv/bin/python -m pipeline runner health --device cuda":
        "a GPU; tests/test_workflow_commands.py runs bench.yml's health steps on this CPU",
    "sudo /opt/muse/venv/bin/python -m pipeline sandbox-check --device cuda": "a GPU; tests/test_sandbox.py",
    "python benchmarks/repeatability.py --as-baseline --problem muse_bf16_proj --runs 3 --seeds 8":
        "a GPU runner (the run-to-run band); docs/BENCHMARKS.md",
    "sudo /opt/muse/venv/bin/python -m pipeline runner health --device cuda --gpus 8": "the 8-GPU serving node",
    "sudo /opt/muse/venv/bin/python -m pipeline serving evaluate --official /tmp/dry-run.diff --launch sglang "
    "--json /tmp/dry-run.json": "the 8-GPU serving node; tests/serving/test_serving_evaluate.py",
}


def test_every_runbook_command_is_run_or_accounted_for():
    listed = {c for c, _ in RUNBOOK_COMMANDS}
    known = set(RUN) | set(PRIVATE) | set(MAPPED) | set(ELSEWHERE)
    assert not listed - known, "docs/RUNBOOK.md commands no test accounts for:\n  " + "\n  ".join(sorted(listed - known))
    assert not known - listed, "no longer in docs/RUNBOOK.md:\n  " + "\n  ".join(sorted(known - listed))


def _argv(command: str) -> list[str]:
    argv = shlex.split(command)
    return [sys.executable, *argv[1:]] if argv[0].startswith("python") else argv


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("PIPELINE_")}


@pytest.fixture(scope="module")
def copy(tmp_path_factory) -> Path:
    dest = fresh_copy(tmp_path_factory.mktemp("runbook") / "repo")
    # `sign result.json`: any result evaluate's --json wrote (a committed one), unsigned
    doc = json.loads((ROOT / "tests/fixtures/kernel_results/passed.json").read_text())
    (dest / "result.json").write_text(json.dumps({**doc, "signature": None}))
    return dest


def _effects(copy: Path, keyring: Path) -> dict:
    from pipeline import signing

    def signed(out: str, err: str) -> str | None:
        doc = json.loads((copy / "signed.json").read_text())
        signing.verify(doc, signing.load_keyring(keyring))
        return None if re.search(r"^signed signed\.json with key ed25519:", out + err, re.M) else "no `signed ...` line"

    return {
        RUN[0]: lambda out, err: None if "Awarded so far: $" in out else "no prize table",
        RUN[1]: lambda out, err: None if out.startswith("board from ") else out,
        RUN[2]: lambda out, err: None if "leaderboard.md is up to date" in out else out,
        RUN[3]: lambda out, err: None if (copy / "competition.toml").read_bytes() ==
        (ROOT / "competition.toml").read_bytes() and "pinned 5 baselines" in err else "the pins changed: " + err,
        RUN[4]: lambda out, err: None if out.count("(pinned)") == 5 else out,
        RUN[5]: lambda out, err: None if re.search(r"^ok: \d+ records", out, re.M) else out,
        RUN[6]: signed,
        RUN[7]: lambda out, err: None if re.search(r"^ok: signed\.json is a valid result signed with key ed25519:",
                                                   out, re.M) else out + err,
    }


def test_the_runbook_commands_run_in_order(copy, tmp_path):
    from ledger_factory import write_keyring, write_private_key

    key = write_private_key(tmp_path / "signing.key")
    keyring = write_keyring(tmp_path / "keyring")
    effects = _effects(copy, keyring)
    for command in RUN:
        env = {**_env(), "PIPELINE_SIGNING_KEY_FILE": str(key), "PIPELINE_KEYRING": str(keyring)}
        done = subprocess.run(_argv(command), cwd=copy, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, f"`{command}` exited {done.returncode}:\n{(done.stdout + done.stderr)[-3000:]}"
        why = effects[command](done.stdout, done.stderr)
        assert why is None, f"`{command}`: {why}"


def _private(command: str, cwd: Path, etc: Path, tmp: Path) -> subprocess.CompletedProcess:
    """`command` as root in a mount namespace of its own, /etc and /tmp overlays of the real ones whose writes
    land in `etc` and `tmp` (folders outside both, each with its overlay's work folder beside it): the host's
    files stay as they were, and everything below /tmp (the repository's copy, an editable install) is seen."""
    mounts = []
    for target, upper in (("/etc", etc), ("/tmp", tmp)):
        work = upper.parent / f"{upper.name}-work"
        for d in (upper, work):
            d.mkdir(parents=True, exist_ok=True)
        mounts.append(f"mount -t overlay overlay -o lowerdir={target},upperdir={shlex.quote(str(upper))},"
                      f"workdir={shlex.quote(str(work))} {target}")
    script = " && ".join(mounts + [f"exec {shlex.join(_argv(command))}"])
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", script], cwd=cwd,
                          env=_env(), capture_output=True, text=True, timeout=120)


@pytest.fixture
def uppers():
    """Where the overlays' writes land: a folder outside /etc and /tmp (an overlay's upper folder may not lie
    inside its lower one), removed afterwards."""
    import shutil
    import tempfile

    base = Path(tempfile.mkdtemp(prefix="muse-runbook-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    try:
        yield base / "etc", base / "tmp"
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="a mount namespace of its own needs root (CI and the runners are)")
def test_the_runbook_commands_that_write_to_the_hosts_paths(copy, uppers):
    upper, tmp = uppers
    keygen = _private(PRIVATE[0], copy, upper, tmp)
    assert keygen.returncode == 0, keygen.stderr
    private = upper / "muse" / "signing.key"
    assert stat.S_IMODE(private.stat().st_mode) == 0o600 and b"PRIVATE KEY" in private.read_bytes()
    assert stat.S_IMODE(private.parent.stat().st_mode) == 0o700, "a new host's /etc/muse is the key's alone"
    assert re.search(r"new key ed25519:[0-9a-f]{32}", keygen.stdout + keygen.stderr), keygen.stdout + keygen.stderr
    assert b"PUBLIC KEY" in (copy / "h200-signer-1.pub").read_bytes()
    assert not Path("/etc/muse/signing.key").exists() or Path("/etc/muse/signing.key").read_bytes() != \
        private.read_bytes(), "the host's /etc was written"
    (tmp / "dry-run.json").write_text((ROOT / "tests/fixtures/serving_results/passed.json").read_text())
    shown = _private(PRIVATE[1], copy, upper, tmp)
    assert shown.returncode == 0, shown.stderr
    assert "### serving: PASSED" in (tmp / "dry-run.md").read_text()
    plotted = _private(PRIVATE[2], copy, upper, tmp)
    assert plotted.returncode == 0, plotted.stderr
    assert (tmp / "dry-run.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
