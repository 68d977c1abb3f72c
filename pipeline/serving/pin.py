"""The pinned SGLang source: fetched through pip, verified against sglang_pin/pin.toml, extracted once.

The tree is laid out as the git repository is (`<root>/python/sglang/...`: the sdist's top folder is
the repository's python/ folder), so a patch made in a clone of SGLang applies to `<root>` as it is.
It lives in a cache keyed by the archive's sha256, written atomically (extracted into a temp folder,
then renamed), with a marker holding the verified hash: a tree without the marker was never finished
and is never used, and a second fetch only reads the marker.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

PIN_FILE = Path(__file__).resolve().parents[2] / "sglang_pin" / "pin.toml"
MARKER = ".verified-sha256"
CACHE_ENV = "PIPELINE_SGLANG_CACHE"
PIP_TIMEOUT_S = 600


class PinError(RuntimeError):
    """The pinned source could not be fetched or verified; the message says what to do."""


@dataclass(frozen=True)
class Pin:
    """sglang_pin/pin.toml as read: the version, the sdist, the layout, the patch rules, the launch
    templates. `data` is the whole document, for the stages that read their own tables."""

    path: Path
    version: str
    sdist: dict[str, Any]
    kernel: dict[str, Any]
    layout: dict[str, Any]
    rules: dict[str, Any]
    flags: dict[str, Any]
    launch: dict[str, Any]
    data: dict[str, Any] = field(repr=False)

    @property
    def sha256(self) -> str:
        return self.sdist["sha256"]


def load_pin(path: Path | None = None) -> Pin:
    path = Path(path or PIN_FILE)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise PinError(f"{path}: cannot read the pin: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise PinError(f"{path}: the pin is not valid TOML: {exc}") from None
    try:
        sdist = data["sdist"]
        for key, kind in (("name", str), ("requirement", str), ("sha256", str), ("size", int), ("top", str)):
            if not isinstance(sdist.get(key), kind):
                raise KeyError(f"sdist.{key}")
        if len(sdist["sha256"]) != 64 or any(c not in "0123456789abcdef" for c in sdist["sha256"]):
            raise KeyError("sdist.sha256 (64 lowercase hex digits)")
        return Pin(path=path, version=data["sglang"]["version"], sdist=sdist, kernel=data.get("kernel", {}),
                   layout=data["layout"], rules=data["rules"], flags=data.get("flags", {}),
                   launch=data.get("launch", {}), data=data)
    except (KeyError, TypeError) as exc:
        raise PinError(f"{path}: the pin lacks {exc.args[0] if exc.args else 'a required field'}") from None


# ---- the launch templates: sglang_pin/pin.toml [launch.<name>] ----

# What a template may name in braces; pipeline/serving/launch.py fills them in. {scratch} is the
# sandbox's own (pipeline/sandbox/ SCRATCH_TOKEN: its /tmp), {delay_ms} exists only in `slowdown`.
PLACEHOLDERS = ("python", "model", "port", "gpus", "context_length", "tree", "device", "scratch")
TEMPLATE_KEYS = {
    # key: (required, what it is)
    "engine": (True, "the request adapter of pipeline/serving/engine.py"),
    "argv": (True, "the command, run without a shell"),
    "version": (True, '"pin" (the pinned SGLang) or the distribution whose installed version is recorded'),
    "gpus": (True, "GPUs the server runs on: {gpus}, and what T_c divides by"),
    "device": (True, '"cuda", "cpu" or "auto" (cuda where /dev/nvidiactl exists)'),
    "ready": (True, "the readiness path, answered 200 once the server serves"),
    "ready_timeout_s": (True, "seconds from the start to ready (capped by [limits.serving] launch_s)"),
    "tokenizer": (True, '"pinned" (sglang_pin\'s) or the path of the tokenizer.json output is counted with'),
    "env": (False, "environment of the server, on top of the launch's own (HOME, TMPDIR, PATH)"),
    "passthrough": (False, "names of the runner's environment variables handed to the server as they are"),
    "readable": (False, "what the server may read besides the Python installation"),
    "model_env": (False, "the runner's environment variable that holds {model}, the served model's path"),
    "context_length": (False, "{context_length}; the dataset's window must fit it"),
    "warmup": (False, '"plain" (one short forced request) or "suppress_special" (transformers under '
                      'continuous batching: the first request sets every later one\'s logits processors)'),
    "slowdown": (False, '"asgi" or extra arguments holding {delay_ms}: how evaluate\'s test-only delay knob '
                        'slows this server'),
    "data_parallel": (False, "true: {gpus} replicas of argv, one a GPU, behind {port} (pipeline/serving/replicas.py), "
                             "for an engine with no tensor parallelism of its own"),
}


@dataclass(frozen=True)
class LaunchTemplate:
    """One [launch.<name>] table of the pin, checked: how a server is started. Competitors control none of it."""

    name: str
    engine: str
    argv: tuple[str, ...]
    version: str
    gpus: int
    device: str
    ready: str
    ready_timeout_s: float
    tokenizer: str
    env: dict[str, str] = field(default_factory=dict)
    passthrough: tuple[str, ...] = ()
    readable: tuple[str, ...] = ()
    model_env: str | None = None
    context_length: int | None = None
    warmup: str | None = None
    slowdown: str | tuple[str, ...] | None = None
    data_parallel: bool = False

    @property
    def runs_patch(self) -> bool:
        """Whether the server runs the patched tree at all (argv or env names {tree}): an official result
        measures a patch, so a template that ignores it can never give one."""
        return any("{tree}" in a for a in self.argv) or any("{tree}" in v for v in self.env.values())

    @property
    def needs_model(self) -> bool:
        return any("{model}" in x for x in (*self.argv, *self.env.values(), *self.readable, self.tokenizer))


def _placeholders_ok(value: str, where: str, allowed: tuple[str, ...]) -> None:
    import re

    for name in re.findall(r"\{([A-Za-z_][A-Za-z0-9_]*)\}", value):
        if name not in allowed:
            raise PinError(f"{where}: unknown placeholder {{{name}}} (known: {', '.join('{' + a + '}' for a in allowed)})")


def launch_template(pin: Pin, name: str) -> LaunchTemplate:
    """The checked template [launch.<name>]; PinError naming the key to fix (an unknown key is refused, not
    ignored: a misspelt `passthru` must not launch a server without what it names)."""
    table = pin.launch.get(name)
    where = f"{pin.path.name} [launch.{name}]"
    if not isinstance(table, dict):
        known = ", ".join(sorted(k for k, v in pin.launch.items() if isinstance(v, dict))) or "none"
        raise PinError(f"{pin.path.name} has no launch template {name!r} (known: {known})")
    unknown = sorted(set(table) - set(TEMPLATE_KEYS))
    missing = [k for k, (req, _) in TEMPLATE_KEYS.items() if req and k not in table]
    if unknown or missing:
        raise PinError(f"{where}: " + "; ".join(
            ([f"unknown key(s) {', '.join(unknown)}"] if unknown else []) +
            ([f"missing key(s) {', '.join(missing)}"] if missing else [])) + f" (the keys: {', '.join(TEMPLATE_KEYS)})")
    from pipeline.serving import engine

    if table["engine"] not in engine.ADAPTERS:
        raise PinError(f"{where} engine: {table['engine']!r} is not one of {', '.join(sorted(engine.ADAPTERS))}")

    def strings(key: str, value: Any, allowed=PLACEHOLDERS) -> tuple[str, ...]:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise PinError(f"{where} {key}: a list of strings, not {value!r}")
        for v in value:
            _placeholders_ok(v, f"{where} {key}", allowed)
        return tuple(value)

    argv = strings("argv", table["argv"])
    if not argv or not argv[0]:
        raise PinError(f"{where} argv: empty")
    env = table.get("env", {})
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise PinError(f"{where} env: a table of strings, not {env!r}")
    for k, v in env.items():
        _placeholders_ok(v, f"{where} env.{k}", PLACEHOLDERS)
    for key, kind in (("version", str), ("ready", str), ("tokenizer", str), ("device", str)):
        if not isinstance(table[key], kind) or not table[key]:
            raise PinError(f"{where} {key}: a non-empty string, not {table[key]!r}")
    _placeholders_ok(table["tokenizer"], f"{where} tokenizer", PLACEHOLDERS)
    if table["device"] not in ("cuda", "cpu", "auto"):
        raise PinError(f"{where} device: \"cuda\", \"cpu\" or \"auto\", not {table['device']!r}")
    gpus = table["gpus"]
    if isinstance(gpus, bool) or not isinstance(gpus, int) or not 1 <= gpus <= 64:
        raise PinError(f"{where} gpus: a whole number from 1 to 64, not {gpus!r}")
    timeout = table["ready_timeout_s"]
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise PinError(f"{where} ready_timeout_s: seconds, more than 0, not {timeout!r}")
    context = table.get("context_length")
    if context is not None and (isinstance(context, bool) or not isinstance(context, int) or context < 1):
        raise PinError(f"{where} context_length: a whole number of tokens, not {context!r}")
    if any("{context_length}" in a for a in argv) and context is None:
        raise PinError(f"{where}: argv names {{context_length}} but the template sets no context_length")
    model_env = table.get("model_env")
    if model_env is not None and (not isinstance(model_env, str) or not model_env):
        raise PinError(f"{where} model_env: the name of an environment variable, not {model_env!r}")
    warmup = table.get("warmup")
    if warmup is not None and warmup not in ("plain", "suppress_special"):
        raise PinError(f"{where} warmup: \"plain\" or \"suppress_special\", not {warmup!r}")
    slowdown = table.get("slowdown")
    if isinstance(slowdown, list):
        slowdown = strings("slowdown", slowdown, PLACEHOLDERS + ("delay_ms",))
        if not any("{delay_ms}" in a for a in slowdown):
            raise PinError(f"{where} slowdown: the extra arguments must hold {{delay_ms}}")
    elif slowdown is not None and slowdown != "asgi":
        raise PinError(f"{where} slowdown: \"asgi\" or a list of extra arguments, not {slowdown!r}")
    if slowdown == "asgi" and argv[1:2] != ("-m",):
        raise PinError(f"{where}: slowdown \"asgi\" runs `{{python}} -m MODULE ...` through our wrapper; argv must "
                       "start that way")
    data_parallel = table.get("data_parallel", False)
    if not isinstance(data_parallel, bool):
        raise PinError(f"{where} data_parallel: true or false, not {data_parallel!r}")
    if data_parallel and (any("{tree}" in a for a in argv) or any("{tree}" in v for v in env.values())):
        raise PinError(f"{where}: data_parallel cannot run a patch ({{tree}}): the replicas would share a sandbox "
                       "with the router (pipeline/serving/replicas.py), whose flush broadcast and routing a "
                       "candidate's code, under the same uid, could tamper with; an engine that runs patches "
                       "spreads over its GPUs itself (SGLang: --tp {gpus})")
    if data_parallel and not any("{port}" in a for a in argv):
        raise PinError(f"{where}: data_parallel starts one replica a GPU, each on a port of its own: argv must "
                       "name {port}")
    template = LaunchTemplate(
        name=name, engine=table["engine"], argv=argv, version=table["version"], gpus=gpus, device=table["device"],
        ready=table["ready"], ready_timeout_s=float(timeout), tokenizer=table["tokenizer"], env=dict(env),
        passthrough=strings("passthrough", table.get("passthrough", [])),
        readable=strings("readable", table.get("readable", [])), model_env=model_env, context_length=context,
        warmup=warmup, slowdown=slowdown, data_parallel=data_parallel)
    if template.needs_model and model_env is None:
        raise PinError(f"{where}: it names {{model}} but sets no model_env (where the runner keeps the model's path)")
    return template


def cache_root() -> Path:
    """Where trees are kept: $PIPELINE_SGLANG_CACHE, else $XDG_CACHE_HOME/muse-pipeline/sglang, else
    ~/.cache/muse-pipeline/sglang."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = Path(os.environ["XDG_CACHE_HOME"]) if os.environ.get("XDG_CACHE_HOME") else Path.home() / ".cache"
    return base / "muse-pipeline" / "sglang"


def _root_for(pin: Pin, cache: Path | None) -> Path:
    return Path(cache or cache_root()) / pin.sha256


def cached_tree(pin: Pin | None = None, cache: Path | None = None) -> Path | None:
    """The finished tree for this pin, or None when it has not been fetched (or was left unfinished)."""
    pin = pin or load_pin()
    root = _root_for(pin, cache)
    try:
        if (root / MARKER).read_text().strip() == pin.sha256 and (root / pin.layout["sdist_is"]).is_dir():
            return root
    except OSError:
        pass
    return None


def tree_path(pin: Pin | None = None, cache: Path | None = None, *, log: Callable[[str], None] | None = None) -> Path:
    """The root of the pinned tree in git layout, fetched and verified first if it is not cached.
    Raises PinError when it cannot be."""
    pin = pin or load_pin()
    return cached_tree(pin, cache) or fetch(pin, cache, log=log)


def verify_archive(archive: Path, pin: Pin) -> None:
    """The archive's size and sha256 must be the pin's; raises PinError saying which is not."""
    size = archive.stat().st_size
    digest = hashlib.sha256()
    with open(archive, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    got = digest.hexdigest()
    if size != pin.sdist["size"] or got != pin.sha256:
        raise PinError(
            f"{archive.name}: {size:,} bytes with sha256 {got}, but {pin.path.name} pins {pin.sdist['size']:,} bytes "
            f"with sha256 {pin.sha256}. The archive is not the pinned SGLang (tampered, truncated, or a different "
            "release): nothing was extracted. Check the package index you use, or fix the pin if SGLang was "
            "deliberately re-pinned.")


def download(pin: Pin, into: Path) -> Path:
    """The sdist, through pip (so the machine's index settings apply). pip checks the hash itself
    (--require-hashes) before it prepares the package's metadata, so a tampered archive's build code
    never runs; verify_archive checks again."""
    req = into / "requirements.txt"
    req.write_text(f"{pin.sdist['requirement']} --hash=sha256:{pin.sha256}\n")
    dest = into / "download"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--require-hashes",
           "--disable-pip-version-check", "--no-input", "-d", str(dest), "-r", str(req)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise PinError(f"pip download of {pin.sdist['requirement']} took more than {PIP_TIMEOUT_S} s; "
                       "check the network or the package index") from None
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-8:])
        if "DO NOT MATCH THE HASHES" in proc.stdout + proc.stderr:
            raise PinError(f"the package index served an archive of {pin.sdist['requirement']} whose sha256 is not "
                           f"the pinned {pin.sha256}; nothing was extracted. pip said:\n{tail}")
        raise PinError(f"pip download of {pin.sdist['requirement']} failed (exit {proc.returncode}):\n{tail}")
    archive = dest / pin.sdist["name"]
    if not archive.is_file():
        found = ", ".join(sorted(p.name for p in dest.iterdir())) if dest.is_dir() else "nothing"
        raise PinError(f"pip download saved {found}, not {pin.sdist['name']}")
    return archive


def extract(archive: Path, pin: Pin, cache: Path | None = None) -> Path:
    """Verify `archive`, extract it into the cache in git layout and mark it verified, all or nothing.
    tarfile's `data` filter refuses members that are absolute, climb out with `..`, or link outside,
    and drops special files and permission bits; every member must also lie under the pin's top folder."""
    import tarfile

    verify_archive(archive, pin)
    final = _root_for(pin, cache)
    final.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{pin.sha256[:12]}.", dir=final.parent))
    try:
        top = pin.sdist["top"]
        with tarfile.open(archive, "r:gz") as tar:
            members = tar.getmembers()
            strays = [m.name for m in members if (m.name != top and not m.name.startswith(top + "/"))
                      or ".." in m.name.split("/")]
            if strays:
                raise PinError(f"{archive.name}: {len(strays)} member(s) outside {top}/ (first: {strays[0]!r}); "
                               "refusing to extract it")
            try:
                tar.extractall(work / "x", members=members, filter="data")
            except tarfile.FilterError as exc:
                raise PinError(f"{archive.name}: an unsafe member, refused: {exc}") from None
        (work / "x" / top).rename(work / pin.layout["sdist_is"])
        (work / "x").rmdir()
        (work / MARKER).write_text(pin.sha256 + "\n")
        try:
            work.rename(final)
        except OSError:
            if cached_tree(pin, cache) is None:  # not a concurrent fetch that finished first
                if final.exists():
                    raise PinError(f"{final} exists but holds no verified tree (no {MARKER}); remove it and "
                                   "fetch again") from None
                raise
    finally:
        if work.exists():
            shutil.rmtree(work, ignore_errors=True)
    return final


def fetch(pin: Pin | None = None, cache: Path | None = None, *, sdist: Path | None = None,
          log: Callable[[str], None] | None = None) -> Path:
    """The pinned tree in git layout: from the cache when it is there, else downloaded with pip (or
    read from `sdist`, a local copy of the archive), verified and extracted."""
    pin = pin or load_pin()
    done = cached_tree(pin, cache)
    if done is not None:
        return done
    if sdist is not None:
        if not Path(sdist).is_file():
            raise PinError(f"{sdist}: no such archive")
        return extract(Path(sdist), pin, cache)
    if log:
        log(f"downloading {pin.sdist['requirement']} ({pin.sdist['size']:,} bytes) with pip")
    with tempfile.TemporaryDirectory(prefix="sglang-sdist-") as tmp:
        archive = download(pin, Path(tmp))
        return extract(archive, pin, cache)


# ---- the command ----

def _fetch_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cache", type=Path, metavar="DIR",
                   help=f"where trees are kept (default: ${CACHE_ENV}, else $XDG_CACHE_HOME or ~/.cache, "
                        "under muse-pipeline/sglang)")
    p.add_argument("--sdist", type=Path, metavar="FILE",
                   help="verify and extract this copy of the archive instead of downloading it (offline machines)")
    p.add_argument("--pin", type=Path, metavar="TOML", help="default: sglang_pin/pin.toml")


def fetch_command(args: argparse.Namespace) -> int:
    """Fetch the pinned SGLang source, verify its sha256, extract it once into a cache; print its path.

    The path printed is the root of the tree in git layout (python/sglang/...). A second call reads the
    cache and prints the same path at once. Exit 0 done, 1 when the archive is not the pinned one or
    cannot be fetched, 2 on a usage error.
    """
    try:
        pin = load_pin(args.pin)
    except PinError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        root = fetch(pin, args.cache, sdist=args.sdist, log=lambda m: print(m, file=sys.stderr))
    except PinError as exc:
        print(f"refused: {exc}", file=sys.stderr)
        return 1
    print(root)
    return 0


COMMANDS = {"fetch": (_fetch_args, fetch_command)}
