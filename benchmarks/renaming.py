"""What the replay's renaming (pipeline/serving/renaming.py) costs the workload and the replayer, on a dataset
with the pinned tokenizer: prompt tokens before and after (per message and in all), the share of names renamed,
and the time to build the dataset's Names, to set up a run, and to make one turn's text in the window.

    python benchmarks/renaming.py [--dataset datasets/serving/public-sample.json.gz] [--replays 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from pipeline.serving import renaming, tokenizer as pinned, trace


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", type=Path, default=Path("datasets/serving/public-sample.json.gz"))
    p.add_argument("--replays", type=int, default=3)
    args = p.parse_args()
    doc = trace.read(args.dataset)
    tok = pinned.load()
    t0 = time.perf_counter()
    names = renaming.Names(doc["conversations"], tok)
    t1 = time.perf_counter()
    renamer = renaming.Renamer(names)
    t2 = time.perf_counter()
    ratios, turn_ms, draw_ms = [], [], []
    before = after = 0
    for _ in range(args.replays + renaming.PREPARED):
        for ci, conv in enumerate(doc["conversations"]):
            s = time.perf_counter()
            replay = renamer.replay(ci)
            draw_ms.append((time.perf_counter() - s) * 1e3)
            for k, turn in enumerate(conv["turns"]):
                s = time.perf_counter()
                msgs, reply = replay.messages(k), replay.reply(k)
                turn_ms.append((time.perf_counter() - s) * 1e3)
                for a, b in zip([m["content"] for m in turn["messages"]] + [turn["reply"]],
                                [m["content"] for m in msgs] + [reply]):
                    n, m = len(tok.encode(a).ids), len(tok.encode(b).ids)
                    before, after = before + n, after + m
                    if n:
                        ratios.append(m / n)
    chars = sum(len(m["content"]) for c in doc["conversations"] for t in c["turns"] for m in t["messages"])
    facts = renamer.facts()
    print(f"dataset {args.dataset} ({chars / 1e6:.1f} M characters of messages), {facts['pool']} names")
    print(f"names renamed a replay: {facts['identifiers'] / max(facts['replays'], 1):.0f} on average")
    print(f"prompt tokens after / before, all texts: {after / before:.5f}; a text: median "
          f"{statistics.median(ratios):.4f}, p1 {_pct(ratios, 0.01):.4f}, p99 {_pct(ratios, 0.99):.4f}, "
          f"min {min(ratios):.4f}, max {max(ratios):.4f}")
    print(f"Names (once an evaluation) {t1 - t0:.2f} s; a run's set-up {t2 - t1:.2f} s")
    print(f"a turn's text in the window: p50 {_pct(turn_ms, 0.5):.3f} ms, p99 {_pct(turn_ms, 0.99):.3f} ms, "
          f"max {max(turn_ms):.3f} ms; a replay's names: p50 {_pct(draw_ms, 0.5):.3f} ms, max {max(draw_ms):.3f} ms")


if __name__ == "__main__":
    main()
