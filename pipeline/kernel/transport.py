"""How tensors cross between the evaluator (parent) and the submission's process (child).

The child runs a stranger's code, so nothing it writes is ever unpickled: a bundle is a JSON header
(names, dtypes from an allow-list, shapes, byte offsets) followed by the raw bytes of each tensor,
and the reader checks every size against the file before it touches a byte. Scalars travel in the
header. Files live in the run's scratch folder (tmpfs where there is room).
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from pathlib import Path
from typing import Any

import torch

MAGIC = b"MUSEBNDL"
MAX_HEADER = 1 << 20
DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float64": torch.float64,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "bool": torch.bool,
}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class BundleError(ValueError):
    pass


MAX_LIST = 1 << 20


def _is_number_list(value: Any) -> bool:
    """Host-side copies of small index tensors (a ragged batch's lengths, as engines keep them) travel
    as flat lists of numbers."""
    return (
        isinstance(value, (list, tuple))
        and len(value) <= MAX_LIST
        and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
    )


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise BundleError(f"dtype {dtype} is not allowed across the process boundary") from None


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor where it lives (no copy when already contiguous)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


_STAGE_BYTES = 64 << 20


def write_bundle(path: Path, values: dict[str, Any]) -> None:
    """The header, then each tensor's bytes. A GPU tensor goes through a small pinned buffer in 64 MB
    pieces (fast device-to-host copies, no gigabyte-sized host copy; an MoE input set is 1.5 GB and
    every checked call ships one); a CPU tensor is written from where it lies. (Writing through a
    mapping of the file instead ran at half the speed of write() on tmpfs: benchmarks/transport.py.)"""
    entries: dict[str, Any] = {}
    tensors: list[torch.Tensor] = []
    offset = 0
    for name, value in values.items():
        if isinstance(value, torch.Tensor):
            raw = _flat_bytes(value)
            entries[name] = {
                "tensor": True,
                "dtype": dtype_name(value.dtype),
                "shape": list(value.shape),
                "offset": offset,
                "nbytes": raw.numel(),
            }
            tensors.append(raw)
            offset += raw.numel()
        elif isinstance(value, (bool, int, float, str)) or value is None or _is_number_list(value):
            entries[name] = {"tensor": False, "value": list(value) if isinstance(value, tuple) else value}
        else:
            raise BundleError(f"{name}: cannot send a {type(value).__name__}")
    text = json.dumps(entries).encode()
    # A new file, never one found at the path: the other side shares the folder and could have left
    # a link there to a file of ours (a write through it would overwrite that file).
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(MAGIC + struct.pack("<Q", len(text)) + text)
        stage: torch.Tensor | None = None
        for raw in tensors:
            if not raw.numel():
                continue
            if raw.device.type == "cpu":
                f.write(memoryview(raw.numpy()))
                continue
            if stage is None:
                size = min(_STAGE_BYTES, max(t.numel() for t in tensors if t.device.type != "cpu"))
                stage = torch.empty(size, dtype=torch.uint8, pin_memory=True)
            for at in range(0, raw.numel(), stage.numel()):
                n = min(stage.numel(), raw.numel() - at)
                stage[:n].copy_(raw[at : at + n])
                f.write(memoryview(stage[:n].numpy()))


def read_bundle(path: Path, device: str | torch.device = "cpu", *, writer_trusted: bool = False) -> dict[str, Any]:
    """Parse a bundle written by either side, trusting nothing in its contents.

    `writer_trusted` (the child reading what the parent wrote) maps the file and copies from the map,
    the faster read (benchmarks/transport.py). A file the child wrote is read with plain reads that
    count their bytes: the child could cut the file short while it is read, which in a mapping is a
    SIGBUS that kills the evaluator, and here is a BundleError."""
    try:  # the file itself, never what a link the other side left at the path points to
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        raise BundleError(f"{path.name}: cannot open it as a plain file ({exc.strerror})") from None
    size = os.fstat(fd).st_size
    with os.fdopen(fd, "rb", buffering=0) as f:
        head = f.read(len(MAGIC) + 8)
        if len(head) != len(MAGIC) + 8 or head[: len(MAGIC)] != MAGIC:
            raise BundleError(f"{path.name}: not a tensor bundle")
        (hlen,) = struct.unpack("<Q", head[len(MAGIC) :])
        if hlen > MAX_HEADER or hlen > size:
            raise BundleError(f"{path.name}: header of {hlen} bytes is too large")
        try:
            entries = json.loads(f.read(hlen))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise BundleError(f"{path.name}: unreadable header: {exc}") from None
        base = len(MAGIC) + 8 + hlen
        if not isinstance(entries, dict):
            raise BundleError(f"{path.name}: header is not an object")
        out: dict[str, Any] = {}
        for name, e in entries.items():
            if not isinstance(e, dict):
                raise BundleError(f"{path.name}: entry {name!r} is malformed")
            if not e.get("tensor"):
                value = e.get("value")
                if not isinstance(value, (bool, int, float, str)) and value is not None and not _is_number_list(value):
                    raise BundleError(f"{path.name}: entry {name!r} has a non-scalar value")
                out[name] = value
                continue
            dtype = DTYPES.get(e.get("dtype"))
            shape = e.get("shape")
            offset, nbytes = e.get("offset"), e.get("nbytes")
            if dtype is None:
                raise BundleError(f"{path.name}: {name!r} has a disallowed dtype {e.get('dtype')!r}")
            if (
                not isinstance(shape, list)
                or not all(isinstance(d, int) and d >= 0 for d in shape)
                or not isinstance(offset, int)
                or not isinstance(nbytes, int)
                or offset < 0
            ):
                raise BundleError(f"{path.name}: {name!r} has a malformed shape or offset")
            numel = 1
            for d in shape:
                numel *= d
            itemsize = torch.empty((), dtype=dtype).element_size()
            if numel * itemsize != nbytes or base + offset + nbytes > size:
                raise BundleError(f"{path.name}: {name!r} claims {nbytes} bytes that the file does not hold")
            if nbytes == 0:
                out[name] = torch.empty(shape, dtype=dtype, device=device)
                continue
            if writer_trusted:
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
                raw = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes, offset=base + offset)
                # To a GPU: one host-to-device copy straight from the map. On the CPU: a copy of
                # its own (the tensor must outlive the map).
                t = raw.clone() if torch.device(device).type == "cpu" else raw.to(device)
                del raw  # the mmap cannot close while a tensor still exports it
                mm.close()
                out[name] = t.view(dtype).reshape(shape)
                continue
            t = torch.empty(nbytes, dtype=torch.uint8)
            view = memoryview(t.numpy()).cast("B")
            f.seek(base + offset)
            got = 0
            while got < nbytes:  # one read returns at most about 2 GB on Linux
                n = f.readinto(view[got:])
                if not n:
                    raise BundleError(f"{path.name}: {name!r} ends after {got} of its {nbytes} bytes")
                got += n
            del view
            out[name] = t.view(dtype).reshape(shape).to(device)
    return out


_CHUNK = 1 << 24


def fingerprint(t: torch.Tensor) -> str:
    """An exact, order-sensitive digest of a tensor's bits, computed where the tensor lives.

    Integer arithmetic wraps identically on every device and in any reduction order, so the parent
    (holding the pristine input) and the child (holding the input after the call) get the same
    value exactly when no bit changed, without shipping the tensor back. The bytes are read as
    32-bit words where they divide evenly (1.5 GB of int4 MoE weights are 375 M words, not 1.5 G
    bytes: the digest is taken three times per checked call), element by element otherwise.
    """
    flat = t.detach().contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    bits = flat.view(_INT_VIEW[flat.element_size()])
    if flat.element_size() < 4 and (flat.numel() * flat.element_size()) % 4 == 0:
        try:
            bits = flat.view(torch.uint8).view(torch.int32)
        except RuntimeError:  # a storage offset that is not word-aligned: the same bits, aligned
            bits = flat.clone().view(torch.uint8).view(torch.int32)
    plain = torch.zeros((), dtype=torch.int64, device=flat.device)
    weighted = torch.zeros((), dtype=torch.int64, device=flat.device)
    for start in range(0, bits.numel(), _CHUNK):
        chunk = bits[start : start + _CHUNK].to(torch.int64)
        pos = torch.arange(start, start + chunk.numel(), device=flat.device, dtype=torch.int64)
        plain += chunk.sum()
        weighted += (chunk * (pos % 1_000_003 + 1) ^ (pos * 0x9E3779B1)).sum()
    return f"{dtype_name(t.dtype)}:{list(t.shape)}:{int(plain)}:{int(weighted)}"


def fingerprints(values: dict[str, Any]) -> dict[str, str]:
    return {k: fingerprint(v) if isinstance(v, torch.Tensor) else repr(v) for k, v in values.items()}
