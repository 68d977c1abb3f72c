"""The repository as a fresh clone has it: its tracked files as they are in the working tree, in a folder of
their own (no .git). A README command run there with `python -m pipeline` imports the copy's pipeline (the
current folder comes first on sys.path), so the repository root every verb defaults to is the copy."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def fresh_copy(dest: Path) -> Path:
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in listed.decode().split("\0"):
        src = ROOT / name
        if name and src.is_file() and not src.is_symlink():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest
