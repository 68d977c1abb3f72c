"""The ledger at competition scale: a synthetic ledger of N records over a 28-day competition
(a 14-day kernel track, then a 14-day serving track: 672 hourly snapshots), then the board, every
snapshot and the prize table regenerated from it, each as the command a workflow runs, with its wall
time and peak memory (the child's max RSS). CPU only.

    python benchmarks/ledger_scale.py [--records 100000] [--sizes 25000,50000] [--json OUT]

The synthetic ledger: 500 competitors over the five kernel boards and the serving board, results
accepted uniformly over the 28 days plus a day either side (about 7% out of window), 2% held for
review, 5% arriving up to two hours late (so shards receive records out of time order), and 0.3% of
records disqualifications or clearances. It is written directly as sealed, canonical ledger lines
(appending 100,000 results one command at a time would take hours and measure nothing new).
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import hashlib
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pipeline import ledger as lg  # noqa: E402
from pipeline.competition import format_instant  # noqa: E402
from pipeline.ledger import problem_workloads  # noqa: E402

START = dt.datetime(2026, 10, 22, tzinfo=dt.timezone.utc)
DAYS = 28
COMPETITION = """name = "Synthetic Open"
repository = "example/synthetic"
[tracks.kernel]
start = 2026-10-22T00:00:00Z
end = 2026-11-05T00:00:00Z
[tracks.serving]
start = 2026-11-05T00:00:00Z
end = 2026-11-19T00:00:00Z
[[prizes]]
place = 1
usd = 50000
[daily_prize]
usd = 1000
rule = "top_at_close"
"""


def synthetic_ledger(n: int, seed: int = 0) -> dict[str, bytes]:
    rng = random.Random(seed)
    problems = problem_workloads()
    names = sorted(problems)
    logins = [f"comp{i:04d}" for i in range(500)]
    skill = {c: rng.uniform(0.3, 1.0) for c in logins}
    n_marks = n * 3 // 1000
    results = []
    span = (DAYS + 2) * 86400
    for i in range(n - n_marks):
        login = rng.choice(logins)
        at = START - dt.timedelta(days=1) + dt.timedelta(seconds=rng.randrange(span))
        progress = min(max((at - START).total_seconds() / (DAYS * 86400), 0.0), 1.0)
        serving = at >= START + dt.timedelta(days=14)
        problem = "serving" if serving else rng.choice(names)
        workloads = ["c1", "c4", "c16", "c32"] if serving else list(problems[problem][1])
        speedup_target = 1.0 + 1.2 * math.sqrt(progress) * skill[login] * rng.uniform(0.7, 1.05)
        rel = 0.003
        wl, speeds, medians = [], [], []
        for w in workloads:
            s = speedup_target * rng.uniform(0.97, 1.03)
            base = rng.uniform(20, 2000)
            med = base / s
            wl.append({"workload": w, "median_us": med, "interval_us": [med * (1 - rel), med * (1 + rel)],
                       "baseline_median_us": base, "baseline_interval_us": [base * (1 - rel), base * (1 + rel)],
                       "speedup": s})
            speeds.append(s)
            medians.append(med)
        gm = math.exp(sum(map(math.log, speeds)) / len(speeds))
        review = rng.random() < 0.02
        results.append({
            "kind": "result", "record_version": 1, "accepted_at": format_instant(at),
            "track": "serving" if serving else "kernel", "problem": problem, "login": login, "pr": 0,
            "head_sha": "", "blob_sha": hashlib.sha1(f"blob{i}".encode()).hexdigest(),
            "path": f"submissions/kernel/{problem}/{login}/submission.py",
            "status": "needs_review" if review else "passed", "official": True,
            "mode": {"device": "cuda", "model": "full", "seeds": "secret", "timing": "cuda-graph"},
            "score": {"speedup": gm, "time_us": math.exp(sum(map(math.log, medians)) / len(medians)),
                      "interval": [gm * (1 - 2 * rel), gm * (1 + 2 * rel)]},
            "workloads": wl, "flags": ["below_floor"] if review else [],
            "environment": {"gpu": "NVIDIA H200", "gpu_uuid": "GPU-0000", "driver": "580.159.04", "cuda": "13.0",
                            "torch": "2.11.0", "triton": "3.6.0", "harness_commit": "0" * 40},
            "result_sha256": hashlib.sha256(f"result{i}".encode()).hexdigest(), "result_schema_version": 1,
            "signature": None, "evaluated_at": format_instant(at - dt.timedelta(minutes=20)),
        })
    # arrival order: accepted order, 5% of records delayed by up to two hours
    arrival = sorted(results, key=lambda r: r["accepted_at"] if rng.random() > 0.05 else
                     format_instant(dt.datetime.fromisoformat(r["accepted_at"]) + dt.timedelta(seconds=rng.randrange(7200))))
    for pr, r in enumerate(arrival, 1):
        r["pr"], r["head_sha"] = pr, hashlib.sha1(f"head{pr}".encode()).hexdigest()
    marks = []
    for k in range(n_marks):
        target = rng.choice(arrival)
        at = dt.datetime.fromisoformat(target["accepted_at"]) + dt.timedelta(hours=rng.randrange(1, 72))
        marks.append({"kind": "disqualification" if k % 4 else "clearance", "record_version": 1,
                      "at": format_instant(at), "target": {"pr": target["pr"], "head_sha": target["head_sha"]},
                      "track": target["track"], "problem": target["problem"], "login": target["login"],
                      "reason": "synthetic marking", "by": "organizer"})
    # a marking arrives after its target; put each after the later of its time and its target's arrival
    position = {r["pr"]: i for i, r in enumerate(arrival)}
    events = [(i, 0, r) for i, r in enumerate(arrival)] + [(position[m["target"]["pr"]] + rng.randrange(1, 500), 1, m)
                                                           for m in marks]
    events.sort(key=lambda e: (e[0], e[1]))
    shards: dict[str, list[str]] = {}
    prev = lg.GENESIS
    for seq, (_, _, body) in enumerate(events):
        record = lg.seal(body, seq, prev)
        prev = record["sha256"]
        shards.setdefault(lg.shard_name(lg.record_time(record)), []).append(lg.canonical(record))
    return {name: ("\n".join(lines) + "\n").encode() for name, lines in shards.items()}


def run(cmd: list[str]) -> tuple[float, float, float, str]:
    """Wall seconds, CPU seconds, peak RSS in MiB (the child's own, from wait4) and stdout of one command.
    (This process stays small: Linux carries a parent's peak RSS into a forked child's figure.)"""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{err.read().decode()[-2000:]}")
        return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024, out.read().decode()


def measure(n: int, plots: bool) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        gen, _, _, _ = run([sys.executable, str(Path(__file__).resolve()), "--generate", str(root), str(n)])
        ledger_bytes = sum(p.stat().st_size for p in (root / "results" / "ledger").iterdir())
        now = "2026-11-19T00:00:00Z"
        py = [sys.executable, "-m", "pipeline"]
        common = ["--root", str(root), "--now", now]
        out = {"records": n, "ledger_mb": round(ledger_bytes / 2**20, 1), "generate_s": round(gen, 2)}
        steps = [
            ("all_three_in_process", [sys.executable, str(Path(__file__).resolve()), "--in-process", str(root), now]),
            ("board_no_plots", py + ["board", "--no-plots"] + common),
            ("snapshots_fresh", py + ["snapshots"] + common),
            ("snapshots_again", py + ["snapshots"] + common),
            ("prizes", py + ["prizes"] + common),
            # the chain alone: the synthetic records have no signed documents (benchmarks/evidence_verify.py
            # measures what `ledger verify` adds per result for those)
            ("verify_chain", [sys.executable, str(Path(__file__).resolve()), "--verify-chain", str(root)]),
        ]
        if plots:
            steps.insert(2, ("board_with_plots", py + ["board"] + common))
        for name, cmd in steps:
            wall, cpu, rss, stdout = run(cmd)
            out[name] = {"wall_s": round(wall, 3), "cpu_s": round(cpu, 3), "max_rss_mib": round(rss, 1)}
            if name == "all_three_in_process":
                out[name].update(json.loads(stdout))
        out["snapshot_files"] = len(list((root / "results" / "snapshots").glob("*/*.json")))
        out["leaderboard_md_kb"] = round((root / "leaderboard.md").stat().st_size / 1024)
        return out


def in_process(root: str, now: str) -> None:
    """Everything the three commands compute, from one read of the ledger, in one process."""
    from pipeline.board.prizes import render_prizes
    from pipeline.board.render import render_board
    from pipeline.board.snapshots import snapshots
    from pipeline.board.standings import derive
    from pipeline.competition import load, parse_instant

    gc.disable()  # as the commands run (pipeline.ledger.paused_gc)
    t0 = time.perf_counter()
    if "--list" in sys.argv:  # the records read into a list first, to time the read alone (the commands stream)
        records = list(lg.iter_records(Path(root), workloads=False))
    else:  # as the commands read: streamed into derive, each result's workloads parsed only if shown
        records = lg.iter_records(Path(root), workloads=False)
    t1 = time.perf_counter()
    d = derive(records, load(Path(root) / "competition.toml"), problem_workloads(), parse_instant(now))
    t2 = time.perf_counter()
    board = render_board(d)
    snaps = list(snapshots(d))
    prizes = render_prizes(d)
    t3 = time.perf_counter()
    assert len(snaps) == 672 and board and prizes
    print(json.dumps({"read_s": round(t1 - t0, 3), "derive_s": round(t2 - t1, 3), "render_s": round(t3 - t2, 3),
                      "total_s": round(t3 - t0, 3)}))


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--verify-chain":
        with lg.paused_gc():
            lg.verify_shards(lg.read_shards(Path(sys.argv[2])))
        return
    if len(sys.argv) in (4, 5) and sys.argv[1] == "--in-process":  # [--list]: read_s is the read alone
        in_process(sys.argv[2], sys.argv[3])
        return
    if len(sys.argv) == 4 and sys.argv[1] == "--generate":
        root = Path(sys.argv[2])
        (root / "results" / "ledger").mkdir(parents=True)
        for name, data in synthetic_ledger(int(sys.argv[3])).items():
            (root / "results" / "ledger" / name).write_bytes(data)
        (root / "competition.toml").write_text(COMPETITION)
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=100_000)
    ap.add_argument("--sizes", default="25000,50000", help="smaller ledgers too, to see memory grow linearly")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    sizes = sorted({int(s) for s in args.sizes.split(",") if s} | {args.records})
    results = [measure(n, plots=not args.no_plots and n == args.records) for n in sizes]
    for r in results:
        print(json.dumps(r))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
