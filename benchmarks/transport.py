"""Throughput of the bundle transport (pipeline/kernel/transport.py) for one MoE input set, the
largest thing that crosses between the evaluator and the child (1.5 GB on the full model): the
write, the mapped read the child uses on the parent's files, and the counted plain read the parent
uses on the child's files. CPU only; scratch on tmpfs as the evaluator uses it.

    python benchmarks/transport.py [--gb 1.5] [--repeats 3] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.kernel.transport import read_bundle, write_bundle  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=1.5)
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    n = int(args.gb * 1e9)
    t = torch.randint(0, 255, (n,), dtype=torch.uint8)
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    rows = {"write": [], "plain_write": [], "mapped_read": [], "counted_read": []}

    def plain_write(path: Path) -> None:
        """The writer before 2026-11-30, for comparison: a host copy, then write() of it."""
        with open(path, "wb") as f:
            f.write(memoryview(t.to("cpu").contiguous().numpy()))

    with tempfile.TemporaryDirectory(dir=base) as tmp:
        path = Path(tmp) / "set.bin"
        for i in range(args.repeats):
            plain = Path(tmp) / "plain.bin"
            for key in (["write", "plain_write"] if i % 2 == 0 else ["plain_write", "write"]):
                (path if key == "write" else plain).unlink(missing_ok=True)  # a new file every time
                t0 = time.perf_counter()
                write_bundle(path, {"w": t}) if key == "write" else plain_write(plain)
                rows[key].append(n / (time.perf_counter() - t0) / 1e9)
            plain.unlink(missing_ok=True)
            order = ["mapped_read", "counted_read"][:: 1 if i % 2 == 0 else -1]  # neither always reads first
            for key in order:
                s0 = time.perf_counter()
                back = read_bundle(path, writer_trusted=key == "mapped_read")["w"]
                rows[key].append(n / (time.perf_counter() - s0) / 1e9)
                assert torch.equal(back, t)
                del back
    summary = {k: statistics.median(v) for k, v in rows.items()}
    print(f"{args.gb:g} GB bundle on {base or 'the default temp dir'}: write {summary['write']:.2f} GB/s "
          f"(a plain write() {summary['plain_write']:.2f} GB/s), "
          f"mapped read (the child's) {summary['mapped_read']:.2f} GB/s, counted read (the parent's) "
          f"{summary['counted_read']:.2f} GB/s "
          f"(medians of {args.repeats}; all runs {json.dumps(rows)})")
    if args.json:
        args.json.write_text(json.dumps({"gb": args.gb, "median_gb_per_s": summary, "runs": rows}, indent=2))


if __name__ == "__main__":
    main()
