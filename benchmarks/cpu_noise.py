"""What other processes' load does to a CPU evaluation (kernel/evaluate.py, cpu_sample: the parent's clock is the
sample): each submission evaluated ROUNDS times on the CPU under a bursty load (SPINNERS processes that spin and
rest at random), its status, flags and score, and per workload the parent's median against what the
submission's worker claimed (a patched timer's claim is the lie; it is never used).

    python benchmarks/cpu_noise.py --rounds 3 --spinners 4 [--json out.json]

docs/BENCHMARKS.md keeps the figures.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUBMISSIONS = {
    "template (honest)": "problems/muse_bf16_proj/template.py",
    "demo steady (honest, 3 matmuls)": "pipeline/demo/kernels/steady.py",
    "demo fast (honest)": "pipeline/demo/kernels/fast.py",
    "timer reporting 90%": "tests/exploits/timer_reports_nine_tenths.py",
}
SPIN = """
import random, time
rng = random.Random()
while True:
    end = time.monotonic() + rng.uniform(0.05, 0.9)
    while time.monotonic() < end:
        pass
    time.sleep(rng.uniform(0.0, 0.4))
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--spinners", type=int, default=4)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    load = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(args.spinners)]
    rows = []
    try:
        for r in range(args.rounds):
            order = list(SUBMISSIONS.items())
            random.Random(r).shuffle(order)
            for label, path in order:
                with tempfile.TemporaryDirectory() as tmp:
                    out = Path(tmp) / "r.json"
                    t0 = time.monotonic()
                    subprocess.run([sys.executable, "-m", "pipeline", "evaluate", path, "--problem", "muse_bf16_proj",
                                    "--seeds", "1", "--json", str(out)], cwd=ROOT, capture_output=True)
                    doc = json.loads(out.read_text())
                measured = {e["workload"]: [round(e["median_us"], 1), round(e["worker_claimed_us"]["submission"], 1)]
                            for e in doc["performance"]}
                rows.append({"round": r, "submission": label, "status": doc["status"],
                             "flags": sorted({f["code"] for f in doc["flags"]}),
                             "score": round(doc["score"]["speedup"], 3) if doc.get("score") else None,
                             "median_and_claimed_us": measured, "seconds": round(time.monotonic() - t0, 1)})
                print(json.dumps(rows[-1]), flush=True)
    finally:
        for s in load:
            s.kill()
    for label in SUBMISSIONS:
        mine = [r for r in rows if r["submission"] == label]
        scores = [r["score"] for r in mine if r["score"] is not None]
        print(f"{label}: statuses {sorted({r['status'] for r in mine})}, flags {sorted({f for r in mine for f in r['flags']})}, "
              f"scores {min(scores):.3f}-{max(scores):.3f}" if scores else f"{label}: no score")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
