"""What `ledger verify` costs per result now that it re-checks each record against its signed document
(results/evidence/): read and parse the document, validate it against result.schema.json, verify its
Ed25519 signature, derive the record from it and compare. CPU only.

    python benchmarks/evidence_verify.py [--results 1000] [--samples 2000]

A ledger of N results, each a schema-valid signed result document with `--samples` raw samples per
workload for the submission and the baseline (what makes a real document large: a CPU evaluation's is
about 40 KB, an official one's more), signed with a throwaway key and appended with its evidence as
`ledger append` does; then `python -m pipeline ledger verify` on it, in a fresh process, timed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pipeline import ledger as lg, signing  # noqa: E402
from pipeline.ledger import problem_workloads  # noqa: E402


def document(i: int, samples: int, rng: random.Random) -> dict:
    workloads = list(problem_workloads()["muse_bf16_proj"][1])
    perf = []
    for w in workloads:
        base, sub = rng.uniform(20, 200), rng.uniform(10, 100)
        perf.append({"workload": w, "median_us": sub, "interval_us": [sub * 0.99, sub * 1.01], "n": samples,
                     "baseline_median_us": base, "baseline_interval_us": [base * 0.99, base * 1.01],
                     "speedup": base / sub, "samples_us": [rng.gauss(sub, sub / 100) for _ in range(samples)],
                     "baseline_samples_us": [rng.gauss(base, base / 100) for _ in range(samples)]})
    speed = 1.0
    for p in perf:
        speed *= p["speedup"]
    speed **= 1 / len(perf)
    head = f"{i:040x}"
    return {
        "schema_version": 1, "track": "kernel", "problem": "muse_bf16_proj",
        "submission": {"path": f"submissions/kernel/muse_bf16_proj/c{i}/submission.py", "blob_sha": f"{i + 1:040x}",
                       "login": f"c{i}", "pr": i + 1, "head_sha": head},
        "status": "passed", "official": True,
        "mode": {"device": "cuda", "model": "full", "timing": "cuda-graph", "seeds": "secret"},
        "error": None,
        "correctness": [{"shape": w, "kind": "workload", "passed": True, "seeds": 8, "outputs": {}} for w in workloads],
        "performance": perf, "score": {"speedup": speed, "time_us": perf[0]["median_us"], "interval": [speed * 0.99,
                                                                                                      speed * 1.01]},
        "flags": [], "environment": {"gpu": "NVIDIA H200", "torch": "2.13.0", "python": "3.11"},
        "baseline": "reference/muse_bf16_proj.py:baseline", "started_at": "2026-10-22T09:00:00.000Z",
        "finished_at": "2026-10-22T09:05:00.000Z", "signature": None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", type=int, default=1000)
    ap.add_argument("--samples", type=int, default=2000)
    args = ap.parse_args()
    rng = random.Random(0)
    key = signing.SigningKey.from_seed(b"benchmark-only-signing-key-seed!")
    with tempfile.TemporaryDirectory() as tmp:
        root, ring = Path(tmp) / "repo", Path(tmp) / "ring"
        ring.mkdir()
        (ring / "bench.pub").write_bytes(key.public_pem())
        keyring = signing.load_keyring(ring)
        sizes = []
        t0 = time.perf_counter()
        for i in range(args.results):
            doc = signing.sign(document(i, args.samples, rng), key)
            raw = (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()
            sizes.append(len(raw))
            body = lg.result_record(doc, raw, pr=i + 1, login=f"c{i}", head_sha=doc["submission"]["head_sha"],
                                    accepted_at=f"2026-10-{22 + i * 14 // args.results:02d}T10:00:00Z",
                                    keyring=keyring)
            lg.append(root, body, evidence=raw)
        build = time.perf_counter() - t0
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "pipeline", "ledger", "verify", "--root", str(root),
                               "--keyring", str(ring)], cwd=ROOT, capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
        wall = time.perf_counter() - t0
        assert proc.returncode == 0, proc.stderr
        t0 = time.perf_counter()
        subprocess.run([sys.executable, str(ROOT / "benchmarks" / "ledger_scale.py"), "--verify-chain", str(root)],
                       check=True)
        chain = time.perf_counter() - t0
    print(json.dumps({"results": args.results, "document_kb": round(sum(sizes) / len(sizes) / 1024, 1),
                      "evidence_mb": round(sum(sizes) / 2**20, 1), "build_s": round(build, 1),
                      "ledger_verify_s": round(wall, 2), "chain_only_s": round(chain, 2),
                      "per_result_ms": round(1000 * (wall - chain) / args.results, 2)}))


if __name__ == "__main__":
    main()
