"""Two trees of this repository, alternating on one ledger: each tree's `ledger_scale.py --in-process` and
its `board --no-plots`, `snapshots` (all already written) and `prizes` commands, round after round, the
order of the two swapped every round (the shared machine is noisy: compare within a round). Prints each
command's median and fastest wall seconds per tree and the range of the per-round ratio B/A.

    python benchmarks/ledger_ab.py TREE_A TREE_B LEDGER_ROOT [ROUNDS]

TREE_A, TREE_B: checkouts (e.g. `git archive HEAD~2 | tar -x -C /tmp/a`); LEDGER_ROOT: a ledger from
`ledger_scale.py --generate`. Each tree writes its views into a copy of LEDGER_ROOT's competition.toml
beside a link to its ledger (LEDGER_ROOT.a / LEDGER_ROOT.b), so neither reads the other's outputs.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

NOW = "2026-11-19T00:00:00Z"


def main() -> None:
    a, b, ledger = (Path(x).resolve() for x in sys.argv[1:4])
    rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 5
    trees = {}
    for name, tree in (("A", a), ("B", b)):
        root = ledger.with_name(f"{ledger.name}.{name.lower()}")
        (root / "results").mkdir(parents=True, exist_ok=True)
        if not (root / "results" / "ledger").exists():
            (root / "results" / "ledger").symlink_to(ledger / "results" / "ledger")
        shutil.copy(ledger / "competition.toml", root / "competition.toml")
        trees[name] = (tree, root)
    py = sys.executable
    cmds = {
        "in_process": lambda tree, root: [py, "benchmarks/ledger_scale.py", "--in-process", str(ledger), NOW],
        "board": lambda tree, root: [py, "-m", "pipeline", "board", "--no-plots", "--root", str(root), "--now", NOW],
        "snapshots": lambda tree, root: [py, "-m", "pipeline", "snapshots", "--root", str(root), "--now", NOW],
        "prizes": lambda tree, root: [py, "-m", "pipeline", "prizes", "--root", str(root), "--now", NOW],
    }
    walls: dict[tuple[str, str], list[float]] = {(t, c): [] for t in trees for c in cmds}
    for c, make in cmds.items():  # a first run of each, not counted (writes the snapshots once)
        for t, (tree, root) in trees.items():
            subprocess.run(make(tree, root), cwd=tree, check=True, capture_output=True)
    for k in range(rounds):
        for c, make in cmds.items():
            for t in ("A", "B") if k % 2 == 0 else ("B", "A"):
                tree, root = trees[t]
                t0 = time.perf_counter()
                subprocess.run(make(tree, root), cwd=tree, check=True, capture_output=True)
                walls[(t, c)].append(time.perf_counter() - t0)
    for c in cmds:
        x, y = walls[("A", c)], walls[("B", c)]
        ratios = sorted(q / p for p, q in zip(x, y))
        print(f"{c:11s} A median {statistics.median(x):.2f} s (fastest {min(x):.2f})   B median "
              f"{statistics.median(y):.2f} s (fastest {min(y):.2f})   B/A per round {ratios[0]:.2f}-{ratios[-1]:.2f}")


if __name__ == "__main__":
    main()
