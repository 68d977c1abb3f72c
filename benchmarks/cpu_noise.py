"""How the CPU's accounting check (kernel/evaluate.py, cpu_accounting) separates honest kernels from a timer that
reports 90% of its time when other processes load the machine: each submission evaluated ROUNDS times on the
CPU under a bursty load (SPINNERS processes that spin and rest at random), the difference of the lower quartiles
of the two targets' per-block unreported share printed per workload, with the verdicts.

    python benchmarks/cpu_noise.py --rounds 3 --spinners 4 [--json out.json]

The check convicts above CPU_UNACCOUNTED (5 points); docs/BENCHMARKS.md keeps the figures.
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
    from pipeline.kernel.evaluate import CPU_UNACCOUNTED

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
                diffs = {e["workload"]: round(100 * (e["unaccounted_q25"]["submission"] - e["unaccounted_q25"]["baseline"]), 1)
                         for e in doc["performance"] if "unaccounted_q25" in e}
                if not diffs and doc.get("error"):  # convicted on its first workload: the figure is in the message
                    diffs = {"message": doc["error"]["message"][:160]}
                rows.append({"round": r, "submission": label, "status": doc["status"],
                             "flags": sorted({f["code"] for f in doc["flags"]}), "q25_difference_points": diffs,
                             "seconds": round(time.monotonic() - t0, 1)})
                print(json.dumps(rows[-1]), flush=True)
    finally:
        for s in load:
            s.kill()
    honest = [v for r in rows if "honest" in r["submission"] for v in r["q25_difference_points"].values()
              if isinstance(v, float)]
    print(f"honest: {len(honest)} workloads, q25 differences {min(honest):+.1f} to {max(honest):+.1f} points "
          f"(bound {100 * CPU_UNACCOUNTED:.0f}); statuses "
          f"{sorted({r['status'] for r in rows if 'honest' in r['submission']})}; the 90% timer: "
          f"{sorted({r['status'] for r in rows if 'honest' not in r['submission']})}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
