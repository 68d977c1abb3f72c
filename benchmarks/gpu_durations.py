"""Fold the seconds each GPU test took (the junit XML of `benchmarks/gpu.sh tests`) into tests/gpu_durations.json,
which `pytest --shard K/N` cuts the GPU suite by. A test measured again replaces its old figure; the card is
the caller's to record (docs/BENCHMARKS.md says which).

    python benchmarks/gpu_durations.py /work/.device/.../gpu-tests-1-of-3.xml [...]
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET = ROOT / "tests" / "gpu_durations.json"


def nodeid(case: ET.Element) -> str:
    """pytest's node id of a junit testcase: classname a.b.c (the file's path, dotted) and the test's name."""
    parts = case.get("classname", "").split(".")
    name = case.get("name", "")
    # the file is the longest prefix of parts that names a tests/ file; the rest are classes
    for cut in range(len(parts), 0, -1):
        path = Path(*parts[:cut]).with_suffix(".py")
        if (ROOT / path).is_file():
            return "::".join([path.as_posix(), *parts[cut:], name])
    return f"{'/'.join(parts)}::{name}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("xml", nargs="+", type=Path)
    p.add_argument("--into", type=Path, default=TARGET, help="the times' file (default tests/gpu_durations.json)")
    args = p.parse_args(argv)
    target = args.into.resolve()
    known = json.loads(target.read_text()) if target.is_file() else {}
    found = 0
    for path in args.xml:
        for case in ET.parse(path).getroot().iter("testcase"):
            # a skipped test took no time worth keeping; a nameless case is the one a SIGINT at the share's
            # limit leaves (pytest's junit writes the interrupted test's stub without its name)
            if case.find("skipped") is not None or not case.get("classname") or not case.get("name"):
                continue
            known[nodeid(case)] = round(float(case.get("time", 0)), 2)
            found += 1
    target.write_text(json.dumps(dict(sorted(known.items())), indent=1) + "\n")
    print(f"{found} test times folded into {target} ({len(known)} in all, "
          f"{sum(known.values()):.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
