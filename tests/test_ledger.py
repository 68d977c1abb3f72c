"""The results ledger: appending (and every refusal), the hash chain across monthly shards, records
arriving out of time order, markings, `verify` naming the first bad record, and competition.toml."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from ledger_factory import (FOREIGN_KEY, TEST_KEY, competition_toml, raw, resign, result_doc, sha, write_competition,
                            write_keyring)
from pipeline import competition as comp, ledger as lg
from pipeline.__main__ import main

ROOT = Path(__file__).resolve().parent.parent
FAST = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def append(root: Path, doc: dict, *, pr: int, login: str = "alice", merged_at: str = "2026-10-22T10:00:00Z",
           head: str | None = None, extra: tuple[str, ...] = ("--allow-unofficial",)) -> int:
    path = root / f"result-{pr}-{head or ''}-{len(list(root.glob('result-*')))}.json"
    path.write_bytes(raw(doc))
    return main(["ledger", "append", str(path), "--pr", str(pr), "--login", login,
                 "--head-sha", head or sha(f"head-{pr}"), "--merged-at", merged_at, "--root", str(root), *extra])


def body(doc: dict, *, pr: int, login: str = "alice", at: str = "2026-10-22T10:00:00Z", head: str | None = None) -> dict:
    return lg.result_record(doc, raw(doc), pr=pr, login=login, head_sha=head or sha(f"head-{pr}"), accepted_at=at,
                            allow_unofficial=True)


def put(root: Path, doc: dict, **kw) -> dict:
    """Append a result's record with its evidence (the library call, as `ledger append` makes it)."""
    record, _ = lg.append(root, body(doc, **kw), evidence=raw(doc))
    return record


def shard_lines(root: Path, name: str) -> list[dict]:
    return [json.loads(x) for x in (root / "results" / "ledger" / name).read_text().splitlines()]


# ---- appending ----

def test_append_records_what_the_board_needs_and_chains_it(tmp_path, capsys):
    doc = result_doc(pr=7, login="Alice", flags=("below_floor",), status="needs_review")
    assert append(tmp_path, doc, pr=7, login="Alice", extra=()) == 0
    assert "record seq 0 to results/ledger/2026-10.jsonl" in capsys.readouterr().out
    (rec,) = shard_lines(tmp_path, "2026-10.jsonl")
    assert rec["seq"] == 0 and rec["prev"] == lg.GENESIS and rec["sha256"] == lg.digest(rec)
    assert (rec["kind"], rec["pr"], rec["login"], rec["accepted_at"], rec["status"]) == (
        "result", 7, "Alice", "2026-10-22T10:00:00Z", "needs_review")
    assert rec["flags"] == ["below_floor"] and rec["score"] == doc["score"]
    assert [w["workload"] for w in rec["workloads"]] == ["M1", "M16", "M32"]
    assert "samples_us" not in json.dumps(rec), "raw samples stay in the result artifact"
    assert "extra" not in rec["environment"] and rec["environment"]["gpu"] == "NVIDIA H200"
    assert rec["result_sha256"] == __import__("hashlib").sha256(raw(doc)).hexdigest()
    assert not lg.schema_problems(rec) and lg.record_problem(rec) is None
    line = (tmp_path / "results/ledger/2026-10.jsonl").read_text()
    assert line == lg.canonical(rec) + "\n", "one canonical JSON line per record"
    assert main(["ledger", "verify", "--root", str(tmp_path)]) == 0
    assert "ok: 1 records (1 results, 0 markings) in 1 shard" in capsys.readouterr().out


def test_a_late_record_goes_to_its_own_month_and_continues_the_chain(tmp_path):
    assert append(tmp_path, result_doc(pr=1), pr=1, merged_at="2026-10-31T23:00:00Z") == 0
    assert append(tmp_path, result_doc(pr=2, login="bob"), pr=2, login="bob", merged_at="2026-11-01T00:00:00Z") == 0
    # merged before the previous one, recorded after it (a delayed workflow)
    assert append(tmp_path, result_doc(pr=3, login="carol"), pr=3, login="carol", merged_at="2026-10-31T23:30:00+00:00") == 0
    october, november = shard_lines(tmp_path, "2026-10.jsonl"), shard_lines(tmp_path, "2026-11.jsonl")
    assert [r["seq"] for r in october] == [0, 2] and [r["seq"] for r in november] == [1]
    assert november[0]["prev"] == october[0]["sha256"] and october[1]["prev"] == november[0]["sha256"]
    assert october[1]["accepted_at"] == "2026-10-31T23:30:00Z"
    assert [r["pr"] for r in lg.verify(tmp_path)] == [1, 2, 3]


@FAST
@given(st.permutations(list(range(6))), st.lists(st.integers(0, 60 * 24 * 40), min_size=6, max_size=6))
def test_records_in_any_arrival_order_are_all_kept(tmp_path_factory, order, minutes):
    root = tmp_path_factory.mktemp("ledger")
    for i in order:
        at = comp.format_instant(comp.parse_instant("2026-10-20T00:00:00Z") + comp.dt.timedelta(minutes=minutes[i]))
        put(root, result_doc(pr=i + 1, login=f"c{i}"), pr=i + 1, login=f"c{i}", at=at)
    records = lg.verify(root)
    assert [r["pr"] for r in records] == [i + 1 for i in order], "seq is arrival order"
    for r in records:
        assert lg.shard_name(r["accepted_at"]) in {p.name for p in (root / "results/ledger").iterdir()}


REFUSALS = {
    "unofficial without --allow-unofficial": (lambda: result_doc(official=False), {}, (), "--allow-unofficial"),
    "fails the schema": (lambda: {**result_doc(), "score": "fast"}, {}, ("--allow-unofficial",), "result.schema.json"),
    "failed status": (lambda: resign({**result_doc(status="incorrect"), "score": None}), {}, (), "status 'incorrect'"),
    "not timed": (lambda: resign({**result_doc(), "score": None, "performance": []}), {}, (), "no score"),
    "tampered after signing": (lambda: {**result_doc(), "status": "needs_review"}, {}, (), "changed after signing"),
    "unsigned official result": (lambda: {**result_doc(), "signature": None}, {}, ("--allow-unofficial",), "not signed"),
    "signed with another key": (lambda: resign({**result_doc(), "signature": None}, FOREIGN_KEY), {}, (),
                                "which is not a runner key"),
    "evaluated head differs": (lambda: result_doc(), {"head": sha("other")}, (), "merged head must be the evaluated"),
    "evaluated PR differs": (lambda: result_doc(pr=2), {}, (), "evaluated for pr 2"),
    "another competitor's result": (lambda: result_doc(login="mallory"), {}, (), "belongs to 'mallory'"),
    "partial run": (lambda: result_doc(workloads=["M1"]), {}, (), "a partial run"),
    "unknown problem": (lambda: result_doc(problem="muse_nope", workloads=["M1"]), {}, (), "not in problems/"),
    "bad login": (lambda: result_doc(official=False), {"login": "not a login"}, ("--allow-unofficial",),
                  "not a GitHub login"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_append_refuses(tmp_path, capsys, case):
    make, kwargs, extra, message = REFUSALS[case]
    doc = make()
    path = tmp_path / "result.json"
    path.write_text(json.dumps(doc))
    code = main(["ledger", "append", str(path), "--pr", "1", "--login", kwargs.get("login", "alice"),
                 "--head-sha", kwargs.get("head", sha("head-1")), "--merged-at", "2026-10-22T10:00:00Z",
                 "--root", str(tmp_path), *extra])
    err = capsys.readouterr().err
    assert code == 1 and message in err, err
    assert err.startswith("refused: ")
    assert not (tmp_path / "results/ledger/2026-10.jsonl").exists(), "nothing is written on a refusal"


def test_append_refuses_a_duplicate(tmp_path, capsys):
    doc = result_doc(pr=4)
    assert append(tmp_path, doc, pr=4) == 0
    assert append(tmp_path, doc, pr=4) == 1
    assert "PR #4 at head" in capsys.readouterr().err
    # the same result file recorded again under another PR (a local result names no PR)
    local = result_doc(official=False)
    assert append(tmp_path, local, pr=5) == 0
    assert append(tmp_path, local, pr=6, head=sha("x")) == 1
    assert "already recorded for PR #5" in capsys.readouterr().err
    assert len(lg.verify(tmp_path, allow_unofficial=True)) == 2
    with pytest.raises(lg.LedgerBroken, match=r"record seq 1, PR #5\): its result .* is not signed"):
        lg.verify(tmp_path)


def test_append_usage_errors(tmp_path, capsys):
    path = tmp_path / "r.json"
    path.write_bytes(raw(result_doc()))
    base = ["ledger", "append", str(path), "--pr", "1", "--login", "alice", "--head-sha", sha("head-1"),
            "--root", str(tmp_path)]
    assert main(base + ["--merged-at", "2026-10-22T10:00:00"]) == 2
    assert "no time zone" in capsys.readouterr().err
    assert main(base + ["--merged-at", "2026-10-22T10:00:00.5Z"]) == 2
    assert main(base + ["--merged-at", "yesterday"]) == 2
    missing = ["ledger", "append", str(tmp_path / "nope.json"), "--pr", "1", "--login", "a", "--head-sha", sha("h"),
               "--merged-at", "2026-10-22T10:00:00Z", "--root", str(tmp_path)]
    assert main(missing) == 2
    with pytest.raises(SystemExit) as exc:
        main(["ledger", "append", str(path), "--login", "alice"])
    assert exc.value.code == 2
    (tmp_path / "bad.json").write_text("{not json")
    assert main(["ledger", "append", str(tmp_path / "bad.json"), *base[3:], "--merged-at", "2026-10-22T10:00:00Z"]) == 1


def test_the_signature_check_is_called_on_append(tmp_path, capsys, monkeypatch):
    seen = []

    def refuse(doc, **_):
        seen.append(doc["submission"]["pr"])
        raise lg.LedgerRefusal("the runner's signature does not verify")

    monkeypatch.setattr(lg, "check_signature", refuse)
    assert append(tmp_path, result_doc(pr=3), pr=3) == 1
    assert seen == [3] and "signature does not verify" in capsys.readouterr().err


def test_append_refuses_to_extend_a_broken_chain(tmp_path, capsys):
    assert append(tmp_path, result_doc(pr=1), pr=1) == 0
    shard = tmp_path / "results/ledger/2026-10.jsonl"
    shard.write_text(shard.read_text().replace('"speedup":1.5', '"speedup":2.5', 1))
    assert append(tmp_path, result_doc(pr=2, login="bob"), pr=2, login="bob") == 1
    assert "does not verify" in capsys.readouterr().err
    assert len(shard.read_text().splitlines()) == 1


# ---- markings ----

def test_disqualify_and_clear(tmp_path, capsys):
    assert append(tmp_path, result_doc(pr=1), pr=1) == 0
    assert append(tmp_path, result_doc(pr=2, login="bob", status="needs_review", flags=("below_floor",)), pr=2,
                  login="bob") == 0
    mark = ["--reason", "read the | reference's output", "--by", "organizer", "--root", str(tmp_path)]
    assert main(["ledger", "disqualify", "--pr", "1", "--at", "2026-11-02T08:00:00Z", *mark]) == 0
    assert main(["ledger", "disqualify", "--pr", "1", "--at", "2026-11-02T09:00:00Z", *mark]) == 1
    assert "already disqualified" in capsys.readouterr().err
    assert main(["ledger", "disqualify", "--pr", "99", *mark]) == 1
    assert "no result of PR #99" in capsys.readouterr().err
    assert main(["ledger", "disqualify", "--pr", "1", "--at", "2026-10-01T00:00:00Z", *mark]) == 1
    assert main(["ledger", "clear", "--pr", "2", "--at", "2026-10-23T00:00:00Z", *mark]) == 0
    assert main(["ledger", "clear", "--pr", "2", "--at", "2026-10-23T01:00:00Z", *mark]) == 1
    assert "nothing to clear" in capsys.readouterr().err
    assert main(["ledger", "disqualify", "--pr", "2", "--by", "not a login", "--reason", "x",
                 "--root", str(tmp_path)]) == 1
    records = lg.verify(tmp_path)
    assert [r["kind"] for r in records] == ["result", "result", "disqualification", "clearance"]
    dq = records[2]
    assert dq["target"] == {"pr": 1, "head_sha": sha("head-1")} and dq["login"] == "alice"
    assert lg.shard_name(dq["at"]) == "2026-11.jsonl" and dq["reason"] == "read the | reference's output"
    latest = lg.latest_markings(records)
    assert latest[(1, sha("head-1"))]["kind"] == "disqualification"
    assert latest[(2, sha("head-2"))]["kind"] == "clearance"
    # a PR with two recorded heads needs --head-sha
    assert append(tmp_path, result_doc(pr=1, head_sha=sha("second")), pr=1, head=sha("second")) == 0
    assert main(["ledger", "clear", "--pr", "1", *mark]) == 1
    assert "pass --head-sha" in capsys.readouterr().err
    assert main(["ledger", "clear", "--pr", "1", "--head-sha", sha("head-1"), "--at", "2026-11-03T00:00:00Z", *mark]) == 0


# ---- verify ----

def _ledger(n: int) -> dict[str, bytes]:
    """n sealed records over two months, shards as bytes (verify_shards is pure)."""
    shards: dict[str, list[str]] = {}
    prev = lg.GENESIS
    for i in range(n):
        at = f"2026-{10 + i % 2}-{10 + i:02d}T12:00:00Z"
        rec = lg.seal(body(result_doc(pr=i + 1, login=f"c{i}"), pr=i + 1, login=f"c{i}", at=at), i, prev)
        prev = rec["sha256"]
        shards.setdefault(lg.shard_name(at), []).append(lg.canonical(rec))
    return {k: ("\n".join(v) + "\n").encode() for k, v in shards.items()}


BASE = _ledger(8)


def _locate(shards: dict[str, bytes], seq: int) -> tuple[str, int]:
    for name, data in shards.items():
        for i, line in enumerate(data.splitlines()):
            if json.loads(line)["seq"] == seq:
                return name, i
    raise AssertionError(seq)


def _edit(shards: dict[str, bytes], seq: int, fn) -> dict[str, bytes]:
    name, i = _locate(shards, seq)
    lines = shards[name].splitlines()
    lines[i] = fn(lines[i])
    return {**shards, name: b"\n".join(lines) + b"\n"}


def _change_value(line: bytes) -> bytes:
    rec = json.loads(line)
    rec["score"]["speedup"] *= 1.01
    return lg.canonical(rec).encode()


def _change_and_reseal(line: bytes) -> bytes:
    rec = json.loads(line)
    rec["login"] = "mallory"
    rec["sha256"] = lg.digest(rec)
    return lg.canonical(rec).encode()


def _respace(line: bytes) -> bytes:
    return json.dumps(json.loads(line), sort_keys=True).encode()


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(["value", "reseal", "respace", "delete", "duplicate", "swap", "truncate", "garbage"]),
       st.integers(0, 6))
def test_verify_names_the_first_bad_record(mutation, seq):
    shards = copy.deepcopy(BASE)
    if mutation == "value":
        bad, expect = _edit(shards, seq, _change_value), f"(record seq {seq}): its sha256 does not match"
    elif mutation == "reseal":  # the attacker recomputes the record's own hash: the next record's prev breaks
        bad, expect = _edit(shards, seq, _change_and_reseal), f"(record seq {seq + 1}): its prev does not match"
    elif mutation == "respace":
        bad, expect = _edit(shards, seq, _respace), f"(record seq {seq}): not in canonical form"
    elif mutation == "delete":
        name, i = _locate(shards, seq)
        lines = shards[name].splitlines()
        del lines[i]
        bad, expect = {**shards, name: b"".join(x + b"\n" for x in lines)}, f"record seq {seq} is missing"
    elif mutation == "duplicate":
        name, i = _locate(shards, seq)
        lines = shards[name].splitlines()
        lines.insert(i, lines[i])
        bad, expect = {**shards, name: b"\n".join(lines) + b"\n"}, f"(record seq {seq}): comes after seq {seq}"
    elif mutation == "swap":
        name, i = _locate(shards, seq)
        lines = shards[name].splitlines()
        j = i + 1 if i + 1 < len(lines) else i - 1
        lines[i], lines[j] = lines[j], lines[i]
        bad, expect = {**shards, name: b"\n".join(lines) + b"\n"}, "comes after seq"
    elif mutation == "truncate":
        name, _ = _locate(shards, seq)
        bad, expect = {**shards, name: shards[name][:-1]}, "the last line has no newline"
    else:
        name, i = _locate(shards, seq)
        lines = shards[name].splitlines()
        lines[i] = lines[i][: len(lines[i]) // 2]
        bad, expect = {**shards, name: b"\n".join(lines) + b"\n"}, f"line {i + 1}: not a JSON record"
    with pytest.raises(lg.LedgerBroken) as exc:
        lg.verify_shards(bad)
    assert expect in str(exc.value), str(exc.value)


def test_verify_checks_the_shard_and_record_shape():
    assert len(lg.verify_shards(BASE)) == 8
    name, i = _locate(BASE, 3)
    other = "2026-10.jsonl" if name == "2026-11.jsonl" else "2026-11.jsonl"
    lines = BASE[name].splitlines()
    into_other = sorted(BASE[other].splitlines() + [lines[i]], key=lambda x: json.loads(x)["seq"])
    moved = {name: b"".join(x + b"\n" for k, x in enumerate(lines) if k != i),
             other: b"".join(x + b"\n" for x in into_other)}
    with pytest.raises(lg.LedgerBroken, match=f"belongs in {name}"):
        lg.verify_shards(moved)
    with pytest.raises(lg.LedgerBroken, match="not a ledger shard"):
        lg.verify_shards({**BASE, "notes.txt": b""})

    def bad_status(line: bytes) -> bytes:
        rec = json.loads(line)
        rec["status"] = "incorrect"
        rec["sha256"] = lg.digest(rec)
        return lg.canonical(rec).encode()

    with pytest.raises(lg.LedgerBroken, match=r"\(record seq 7\): not a valid ledger record \(bad status\)"):
        lg.verify_shards(_edit(BASE, 7, bad_status))


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(["pr", "head_sha", "accepted_at", "score", "status", "flags", "workloads", "kind", "login"]),
       st.sampled_from([None, "x", -1, 1.5, [], {}, True]))
def test_the_hand_check_agrees_with_the_published_record_schema(key, value):
    rec = lg.seal(body(result_doc(), pr=1), 0, lg.GENESIS)
    assert lg.record_problem(rec) is None and not lg.schema_problems(rec)
    rec[key] = value
    assert (lg.record_problem(rec) is None) == (not lg.schema_problems(rec)), (key, value)


def test_verify_from_the_command_line(tmp_path, capsys):
    assert append(tmp_path, result_doc(pr=1), pr=1) == 0
    assert append(tmp_path, result_doc(pr=2, login="bob"), pr=2, login="bob") == 0
    shard = tmp_path / "results/ledger/2026-10.jsonl"
    lines = shard.read_text().splitlines()
    shard.write_text(lines[0].replace('"login":"alice"', '"login":"mallory"') + "\n" + lines[1] + "\n")
    proc = subprocess.run([sys.executable, "-m", "pipeline", "ledger", "verify", "--root", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 1
    assert "results/ledger/2026-10.jsonl line 1 (record seq 0): its sha256 does not match" in proc.stderr


# ---- evidence: every result record against its signed document ----

def _reseal_from(root: Path, seq: int, edit) -> None:
    """What an attacker with write access does: edit record `seq`, then re-seal it and every record after
    it, so that the chain alone verifies again."""
    shard_dir = root / "results" / "ledger"
    shards = {p.name: p.read_bytes() for p in shard_dir.iterdir()}
    records = lg.parse_shards(shards)
    edit(records[seq])
    prev = records[seq - 1]["sha256"] if seq else lg.GENESIS
    for r in records[seq:]:
        sealed = lg.seal(r, r["seq"], prev)
        r.clear()
        r.update(sealed)
        prev = r["sha256"]
    lines: dict[str, list[str]] = {name: [] for name in shards}
    for r in records:
        lines[lg.shard_name(lg.record_time(r))].append(lg.canonical(r))
    for name, ls in lines.items():
        (shard_dir / name).write_text("".join(x + "\n" for x in ls))
    lg.verify_shards(lg.read_shards(root))  # the chain alone is fooled


@pytest.fixture
def three(tmp_path):
    for i, who in enumerate(("alice", "bob", "carol")):
        put(tmp_path, result_doc(pr=i + 1, login=who, speedup=1.2 + i / 10), pr=i + 1, login=who,
            at=f"2026-10-22T1{i}:00:00Z")
    assert len(lg.verify(tmp_path)) == 3
    return tmp_path


def test_append_keeps_the_signed_document_beside_the_ledger(three):
    for r in lg.verify(three):
        path = three / "results" / "evidence" / f"{r['result_sha256']}.json"
        assert __import__("hashlib").sha256(path.read_bytes()).hexdigest() == r["result_sha256"]
    with pytest.raises(lg.LedgerRefusal, match="with its signed result document"):
        lg.append(three, body(result_doc(pr=9), pr=9))
    with pytest.raises(lg.LedgerRefusal, match="does not hash to the record's result_sha256"):
        lg.append(three, body(result_doc(pr=9), pr=9), evidence=b"{}")


# every field of a result record that its signed document decides (accepted_at comes from GitHub)
SIGNED_FIELDS = {
    "score": lambda r: r["score"].update(speedup=r["score"]["speedup"] * 1.5,
                                         interval=[x * 1.5 for x in r["score"]["interval"]]),
    "workloads": lambda r: r["workloads"][0].update(median_us=r["workloads"][0]["median_us"] / 2),
    "status": lambda r: r.update(status="passed" if r["status"] != "passed" else "needs_review"),
    "login": lambda r: r.update(login="mallory"),
    "pr": lambda r: r.update(pr=99),
    "head_sha": lambda r: r.update(head_sha=sha("elsewhere")),
    "problem": lambda r: r.update(problem="muse_moe_w4a16"),
    "track": lambda r: r.update(track="serving"),
    "blob_sha": lambda r: r.update(blob_sha=sha("another blob")),
    "path": lambda r: r.update(path="submissions/kernel/muse_bf16_proj/mallory/submission.py"),
    "flags": lambda r: r.update(flags=["below_floor"]),
    "environment": lambda r: r["environment"].update(gpu="NVIDIA B200"),
    "mode": lambda r: r["mode"].update(seeds="public"),
    "official": lambda r: r.update(official=False),
    "evaluated_at": lambda r: r.update(evaluated_at="2026-10-22T08:00:00.000Z"),
    "result_schema_version": lambda r: r.update(result_schema_version=2),
    "signature": lambda r: r["signature"].update(key_id="ed25519:" + "0" * 32),
    "result_sha256": lambda r: r.update(result_sha256="ab" * 32),
}


@pytest.mark.parametrize("field", list(SIGNED_FIELDS))
def test_a_record_edited_and_resealed_fails_verify_naming_it(three, field):
    _reseal_from(three, 1, SIGNED_FIELDS[field])
    with pytest.raises(lg.LedgerBroken) as exc:
        lg.verify(three)
    message = str(exc.value)
    assert "results/ledger/2026-10.jsonl line 2 (record seq 1, PR #" in message, message
    if field == "result_sha256":
        assert "is missing" in message
    elif field not in ("login", "pr", "head_sha"):
        assert f"{field} differ" in message or f", {field}" in message, message


def test_the_evidence_itself_is_checked(three):
    records = lg.verify(three)
    path = three / "results" / "evidence" / f"{records[2]['result_sha256']}.json"
    original = path.read_bytes()
    path.write_bytes(original.replace(b'"passed"', b'"needs_review"', 1))
    with pytest.raises(lg.LedgerBroken, match=r"record seq 2, PR #3\): .* does not hash to the record's result_sha256"):
        lg.verify(three)
    path.unlink()
    with pytest.raises(lg.LedgerBroken, match=r"record seq 2, PR #3\): its signed result .* is missing"):
        lg.verify(three)
    path.symlink_to(three / "elsewhere.json")
    (three / "elsewhere.json").write_bytes(original)
    with pytest.raises(lg.LedgerBroken, match="cannot be read"):
        lg.verify(three)
    path.unlink()
    path.write_bytes(original)
    assert len(lg.verify(three)) == 3


def test_verify_from_the_command_line_rechecks_the_evidence(three, capsys):
    assert main(["ledger", "verify", "--root", str(three)]) == 0
    out = capsys.readouterr().out
    assert f"3 by {TEST_KEY.key_id}" in out and "chain head " + lg.verify(three)[-1]["sha256"] in out
    _reseal_from(three, 0, SIGNED_FIELDS["score"])
    assert main(["ledger", "verify", "--root", str(three)]) == 1
    assert "(record seq 0, PR #1): score differs from its signed result" in capsys.readouterr().err


def test_rotated_and_revoked_keys(three, tmp_path_factory, capsys):
    """A retired key still verifies what the ledger holds but signs nothing new; a revoked key verifies
    nothing until each of its results is disqualified."""
    ring = tmp_path_factory.mktemp("ring")
    write_keyring(ring, FOREIGN_KEY)
    write_keyring(ring, TEST_KEY, status="retired")
    assert len(lg.verify(three, keyring=__import__("pipeline.signing").signing.load_keyring(ring))) == 3
    path = three / "r.json"
    path.write_bytes(raw(result_doc(pr=4, login="dan")))
    argv = ["ledger", "append", str(path), "--pr", "4", "--login", "dan", "--head-sha", sha("head-4"),
            "--merged-at", "2026-10-22T13:00:00Z", "--root", str(three), "--keyring", str(ring)]
    assert main(argv) == 1
    assert "which is retired" in capsys.readouterr().err
    path.write_bytes(raw(resign({**result_doc(pr=4, login="dan"), "signature": None}, FOREIGN_KEY)))
    assert main(argv) == 0
    revoked = tmp_path_factory.mktemp("revoked")
    write_keyring(revoked, FOREIGN_KEY)
    write_keyring(revoked, TEST_KEY, status="revoked")
    assert main(["ledger", "verify", "--root", str(three), "--keyring", str(revoked)]) == 1
    assert "(record seq 0, PR #1): signed with a revoked key" in capsys.readouterr().err
    for pr in (1, 2, 3):
        assert main(["ledger", "disqualify", "--pr", str(pr), "--reason", "signed with a revoked key",
                     "--by", "organizer", "--at", "2026-10-23T00:00:00Z", "--root", str(three)]) == 0
    assert main(["ledger", "verify", "--root", str(three), "--keyring", str(revoked)]) == 0
    both = tmp_path_factory.mktemp("both")
    write_keyring(both, TEST_KEY)
    write_keyring(both, TEST_KEY, status="retired")
    assert main(["ledger", "verify", "--root", str(three), "--keyring", str(both)]) == 2
    assert "the same key" in capsys.readouterr().err


# ---- competition.toml ----

def test_the_repository_calendar():
    c = comp.load()
    k, s = c.tracks["kernel"], c.tracks["serving"]
    assert comp.format_instant(k.start) == "2026-10-22T00:00:00Z" and comp.format_instant(k.end) == "2026-11-05T00:00:00Z"
    assert k.last_minute.strftime("%Y-%m-%d %H:%M") == "2026-11-04 23:59"
    assert comp.format_instant(s.start) == "2026-11-05T00:00:00Z" and s.last_minute.strftime("%Y-%m-%d %H:%M") == "2026-11-19 23:59"
    assert [(p.place, p.through, p.usd) for p in c.prizes] == [(1, 1, 50000), (2, 2, 30000), (3, 3, 10000), (4, 4, 3000),
                                                             (5, 5, 2000), (6, 10, 1000)]
    assert c.prizes[0].also == "a signed H200"
    assert (c.daily_usd, c.daily_hours, c.daily_rule, c.rate_limit_per_hour) == (1000, 24, "top_at_close", 10)
    assert k.runner_labels and s.runner_labels
    assert len(c.windows("kernel")) == 14 and len(c.windows("serving")) == 15
    assert not k.contains(k.end) and k.contains(k.start)


BAD_CONFIGS = {
    "rule": ('rule = "top_at_close"', 'rule = "loudest"', "[daily_prize]: rule = 'loudest'"),
    "order": ("end = 2026-10-24T00:00:00Z", "end = 2026-10-21T00:00:00Z", "[tracks.kernel]: end 2026-10-21T00:00:00Z must be after start"),
    "hour": ("start = 2026-10-22T00:00:00Z", "start = 2026-10-22T00:30:00Z", "must fall on a whole hour"),
    "zone": ("start = 2026-10-22T00:00:00Z", "start = 2026-10-22T00:00:00", "must be a UTC date-time"),
    "track": ("[tracks.serving]", "[tracks.dancing]", "unknown track(s) ['dancing']"),
    "prize": ("usd = 100", "usd = \"lots\"", "`usd` must be a int"),
    "repo": ('repository = "example/comp"', 'repository = "comp"', "`repository` must be owner/name"),
    "toml": ("[[prizes]]", "[[prizes]", "invalid TOML"),
}


@pytest.mark.parametrize("case", list(BAD_CONFIGS))
def test_competition_errors_name_what_to_fix(tmp_path, case):
    old, new, message = BAD_CONFIGS[case]
    text = competition_toml()
    assert old in text
    path = tmp_path / "competition.toml"
    path.write_text(text.replace(old, new, 1))
    with pytest.raises(comp.CompetitionError) as exc:
        comp.load(path)
    assert message in str(exc.value) and str(path) in str(exc.value)


def test_a_missing_competition_is_a_usage_error(tmp_path, capsys):
    assert main(["board", "--root", str(tmp_path), "--no-plots"]) == 2
    assert "competition.toml does not exist" in capsys.readouterr().err
    write_competition(tmp_path)
    assert main(["prizes", "--root", str(tmp_path), "--now", "2026-10-22"]) == 2


@pytest.mark.parametrize("flag, value", [("--login", "alice\n"), ("--head-sha", sha("head-1") + "\n")])
def test_a_value_with_a_trailing_newline_is_refused(tmp_path, capsys, flag, value):
    """Python's `$` matches before a final newline: a login or head SHA ending in one would pass an
    anchored check and split a board row. Every anchored check ends with \\Z, so it is refused, and the
    ledger is left as it was."""
    path = tmp_path / "r.json"
    path.write_bytes(raw(result_doc()))
    argv = {"--login": "alice", "--head-sha": sha("head-1")}
    argv[flag] = value
    code = main(["ledger", "append", str(path), "--pr", "1", "--login", argv["--login"], "--head-sha",
                 argv["--head-sha"], "--merged-at", "2026-10-22T10:00:00Z", "--root", str(tmp_path)])
    assert code == 1 and flag in capsys.readouterr().err
    assert not list(tmp_path.rglob("*.jsonl"))


def test_every_anchored_check_refuses_a_trailing_newline():
    from pipeline import ledger, problems, result, validate

    for pattern, good in ((ledger.LOGIN_RE, "alice"), (ledger.SHA1_RE, sha("x")), (validate.LOGIN_RE, "alice"),
                          (result.SHA1_RE, sha("x")), (problems._NAME_RE, "muse_moe")):
        assert pattern.match(good) and not pattern.match(good + "\n"), pattern.pattern


# ---- serving results ----

def test_a_serving_result_is_recorded_with_its_figures_and_a_partial_one_is_refused(tmp_path):
    """The serving board ranks S over the figures T_c and I_c at c = 1, 4, 16 and 32: a serving result is
    recorded with all eight (each its ratio to the baseline's), and an unofficial run of fewer levels
    (--levels 1,4) is refused as a kernel run of fewer workloads is. A gated one (G = 0) is never recorded."""
    from fixtures.serving_results import factory as sf

    write_competition(tmp_path)
    record = put(tmp_path, result_doc(track="serving", speedup=1.25, pr=3), pr=3, at="2026-10-24T10:00:00Z")
    assert (record["track"], record["problem"], record["path"]) == ("serving", "serving",
                                                                    "submissions/serving/alice/patch.diff")
    assert sorted(w["workload"] for w in record["workloads"]) == sorted(
        f"{m}_{c}" for c in (1, 4, 16, 32) for m in "TI")
    assert record["score"]["speedup"] == pytest.approx(1.25)
    assert all(w["speedup"] == pytest.approx(1.25) for w in record["workloads"])
    partial = sf.serving_result(t=1.25, official=False, levels=(1, 4), login="alice", pr=4)
    with pytest.raises(lg.LedgerRefusal, match=r"measured I_1, I_4, T_1, T_4, but the serving board ranks .*a "
                                                r"partial run \(--levels\) cannot be ranked"):
        body(partial, pr=4)
    gated = result_doc(track="serving", status="incorrect", pr=5)
    assert gated["serving"]["gate"]["G"] == 0
    with pytest.raises(lg.LedgerRefusal, match="status 'incorrect'"):
        body(gated, pr=5)
    assert [r["pr"] for r in lg.verify(tmp_path)] == [3]


# ---- the boards' read: a result's workloads left unparsed until shown ----

def test_the_boards_read_gives_every_record_as_the_full_parse_does(tmp_path):
    """iter_records(workloads=False) parses a result's line up to its `workloads` (the last key of a
    canonical line) and keeps the rest as its JSON text: read back, every record is exactly what the full
    parse gives, for canonical lines and for lines where a cut at the last `,"workloads":` would fall inside
    a nested value (those are parsed whole); a result whose workloads are not JSON fails when they are read."""
    canonical = [line.decode() for data in _ledger(3).values() for line in data.splitlines()]
    nested = json.loads(canonical[0])
    nested["mode"]["workloads"] = [1]  # a key of that name inside an object before the top-level one
    # the top-level workloads first and a list last: the last `,"workloads":` is the one inside `mode`
    unsorted = {"workloads": nested["workloads"], **{k: v for k, v in nested.items() if k not in ("workloads", "flags")},
                "flags": ["x"]}
    spaced = json.dumps(json.loads(canonical[1]), indent=1).replace("\n", " ")
    lines = canonical + [json.dumps(nested, sort_keys=True, separators=(",", ":")),
                         json.dumps(unsorted, separators=(",", ":")), spaced]
    (tmp_path / "results" / "ledger").mkdir(parents=True)
    (tmp_path / "results" / "ledger" / "2026-10.jsonl").write_text("\n".join(lines) + "\n")
    full = list(lg.iter_records(tmp_path))
    lazy = list(lg.iter_records(tmp_path, workloads=False))
    assert len(full) == len(lines) == 6
    kept = [isinstance(r["workloads"], lg.Unparsed) for r in lazy]
    assert kept == [True, True, True, True, False, False]
    for r in lazy:
        if isinstance(r["workloads"], lg.Unparsed):
            r["workloads"] = r["workloads"].value()
    assert lazy == full and [list(r) for r in lazy] == [list(r) for r in full]
    broken = canonical[2].replace('"workloads":[{', '"workloads":[{{')
    (tmp_path / "results" / "ledger" / "2026-10.jsonl").write_text(broken + "\n")
    [record] = lg.iter_records(tmp_path, workloads=False)
    with pytest.raises(lg.LedgerBroken, match="workloads in the ledger are not JSON"):
        record["workloads"].value()
    with pytest.raises(lg.LedgerBroken, match="line 1: not a ledger record"):
        list(lg.iter_records(tmp_path))
