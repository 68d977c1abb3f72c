"""How tensors cross between the evaluator (the parent) and a worker: through buffers the parent owns.

The parent allocates every buffer a worker reads or writes (each call's inputs, the output it hands
back, the input sets of the timed graphs) in memory it shares with that worker by file descriptor:
a sealed memfd on the CPU, a CUDA virtual-memory allocation exported as a POSIX file descriptor on a
GPU (legacy CUDA IPC handles cannot be opened across PID namespaces, and the worker lives in one of
its own). Descriptors travel over a unix socket with SCM_RIGHTS; a bundle's layout (names, dtypes,
shapes, offsets, and the scalars) in the JSON request beside them.

Because the buffers are the parent's, the parent judges them itself: after every call it compares
each input with the pristine copy it kept and reads the in-place outputs (a layer's KV cache) from
the very buffers it handed over, never from fingerprints or tensors the worker reports. What the
worker writes back is only raw bytes into an output buffer of the parent's size, which the parent
reads with the dtype and shape the worker claims, checked against the expected ones.
"""

from __future__ import annotations

import ctypes
import fcntl
import itertools
import mmap
import os
import socket
from dataclasses import dataclass, field
from typing import Any

import torch

ALIGN = 512  # bytes between tensors in one buffer: vector loads stay aligned
MAX_LIST = 1 << 20
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


class TransportError(ValueError):
    pass


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise TransportError(f"dtype {dtype} is not allowed across the process boundary") from None


def is_number_list(value: Any) -> bool:
    """Host-side copies of small index tensors (a ragged batch's lengths, as engines keep them) travel
    as flat lists of numbers."""
    return (
        isinstance(value, (list, tuple))
        and len(value) <= MAX_LIST
        and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
    )


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as integers of its element size: equality of these is bit-exact (NaN == NaN)."""
    return t.view(torch.uint8 if t.dtype == torch.bool else _INT_VIEW[t.element_size()])


def identical(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bits, wherever the two live (compared on the device of `a`)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bool(torch.equal(bits(a.contiguous()), bits(b.to(a.device).contiguous())))


# ---- shared memory: the CPU ----

F_ADD_SEALS, F_SEAL_SEAL, F_SEAL_SHRINK, F_SEAL_GROW = 1033, 0x0001, 0x0002, 0x0004


class _HostMemory:
    """A memfd, sealed so that its size never changes: a worker cannot truncate it under the parent's
    mapping (which would be a SIGBUS in the evaluator at its next read)."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self.fd = os.memfd_create("muse-arena", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(self.fd, nbytes)
        fcntl.fcntl(self.fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL)
        self._map = mmap.mmap(self.fd, nbytes)
        self.flat = torch.frombuffer(self._map, dtype=torch.uint8, count=nbytes)

    def close(self) -> None:
        self.flat = None
        try:
            self._map.close()
        except BufferError:  # a view is still alive somewhere: the mapping goes with the last of them
            pass
        _close(self.fd)


def _map_host(fd: int, nbytes: int) -> tuple[torch.Tensor, Any]:
    if os.fstat(fd).st_size < nbytes:
        raise TransportError(f"a shared buffer holds {os.fstat(fd).st_size} bytes, not the {nbytes} announced")
    mm = mmap.mmap(fd, nbytes)
    return torch.frombuffer(mm, dtype=torch.uint8, count=nbytes), mm


# ---- shared memory: a CUDA device (the driver's virtual memory management, through ctypes) ----

class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _AllocProp(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _MemLocation),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]


class _AccessDesc(ctypes.Structure):
    _fields_ = [("location", _MemLocation), ("flags", ctypes.c_int)]


_ALLOCATION_PINNED, _HANDLE_POSIX_FD, _LOCATION_DEVICE, _ACCESS_READWRITE = 1, 1, 1, 3
_DRIVER: Any = None


def _driver() -> Any:
    global _DRIVER
    if _DRIVER is None:
        lib = ctypes.CDLL("libcuda.so.1")
        u64 = ctypes.c_ulonglong
        sigs = {
            "cuMemGetAllocationGranularity": [ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(_AllocProp), ctypes.c_int],
            "cuMemCreate": [ctypes.POINTER(u64), ctypes.c_size_t, ctypes.POINTER(_AllocProp), u64],
            "cuMemExportToShareableHandle": [ctypes.c_void_p, u64, ctypes.c_int, u64],
            "cuMemImportFromShareableHandle": [ctypes.POINTER(u64), ctypes.c_void_p, ctypes.c_int],
            "cuMemAddressReserve": [ctypes.POINTER(u64), ctypes.c_size_t, ctypes.c_size_t, u64, u64],
            "cuMemMap": [u64, ctypes.c_size_t, ctypes.c_size_t, u64, u64],
            "cuMemSetAccess": [u64, ctypes.c_size_t, ctypes.POINTER(_AccessDesc), ctypes.c_size_t],
            "cuMemUnmap": [u64, ctypes.c_size_t],
            "cuMemAddressFree": [u64, ctypes.c_size_t],
            "cuMemRelease": [u64],
            "cuGetErrorName": [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
        }
        for name, args in sigs.items():
            getattr(lib, name).argtypes = args
            getattr(lib, name).restype = ctypes.c_int
        _DRIVER = lib
    return _DRIVER


def _check(result: int, what: str) -> None:
    if result != 0:
        name = ctypes.c_char_p()
        _driver().cuGetErrorName(result, ctypes.byref(name))
        raise TransportError(f"{what} failed: {(name.value or b'?').decode()} ({result})")


def _prop(device: int) -> _AllocProp:
    prop = _AllocProp()
    prop.type = _ALLOCATION_PINNED
    prop.requestedHandleTypes = _HANDLE_POSIX_FD
    prop.location = _MemLocation(_LOCATION_DEVICE, device)
    return prop


def _granularity(device: int) -> int:
    g = ctypes.c_size_t(0)
    _check(_driver().cuMemGetAllocationGranularity(ctypes.byref(g), ctypes.byref(_prop(device)), 0), "cuMemGetAllocationGranularity")
    return int(g.value)


class _ArrayInterface:
    """Lets torch wrap a device pointer it did not allocate (zero-copy, through __cuda_array_interface__)."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3,
                                         "strides": None}


class _DeviceMapping:
    """An allocation mapped into this process's address space, readable and writable by `device`."""

    def __init__(self, handle: int, size: int, device: int, nbytes: int):
        drv = _driver()
        self.handle, self.size = handle, size
        ptr = ctypes.c_ulonglong(0)
        _check(drv.cuMemAddressReserve(ctypes.byref(ptr), size, 0, 0, 0), "cuMemAddressReserve")
        self.ptr = int(ptr.value)
        _check(drv.cuMemMap(self.ptr, size, 0, handle, 0), "cuMemMap")
        access = _AccessDesc(_MemLocation(_LOCATION_DEVICE, device), _ACCESS_READWRITE)
        _check(drv.cuMemSetAccess(self.ptr, size, ctypes.byref(access), 1), "cuMemSetAccess")
        self.flat = torch.as_tensor(_ArrayInterface(self.ptr, nbytes), device=f"cuda:{device}")

    def close(self) -> None:
        if self.ptr is None:
            return
        self.flat = None
        drv = _driver()
        drv.cuMemUnmap(self.ptr, self.size)
        drv.cuMemAddressFree(self.ptr, self.size)
        drv.cuMemRelease(self.handle)
        self.ptr = None


def _current_device() -> int:
    torch.cuda.init()
    torch.empty(1, device="cuda")  # makes the primary context current on this thread for the driver calls
    return torch.cuda.current_device()


class _DeviceMemory:
    def __init__(self, nbytes: int):
        device = _current_device()
        g = _granularity(device)
        size = -(-nbytes // g) * g
        handle = ctypes.c_ulonglong(0)
        _check(_driver().cuMemCreate(ctypes.byref(handle), size, ctypes.byref(_prop(device)), 0), "cuMemCreate")
        self._mapping = _DeviceMapping(int(handle.value), size, device, nbytes)
        fd = ctypes.c_int(-1)
        _check(_driver().cuMemExportToShareableHandle(ctypes.byref(fd), int(handle.value), _HANDLE_POSIX_FD, 0),
               "cuMemExportToShareableHandle")
        self.fd, self.nbytes = fd.value, nbytes
        os.set_inheritable(self.fd, False)
        self.flat = self._mapping.flat

    def close(self) -> None:
        self.flat = None
        self._mapping.close()
        _close(self.fd)


def _map_device(fd: int, nbytes: int) -> tuple[torch.Tensor, Any]:
    device = _current_device()
    handle = ctypes.c_ulonglong(0)
    _check(_driver().cuMemImportFromShareableHandle(ctypes.byref(handle), ctypes.c_void_p(fd), _HANDLE_POSIX_FD),
           "cuMemImportFromShareableHandle")
    g = _granularity(device)
    mapping = _DeviceMapping(int(handle.value), -(-nbytes // g) * g, device, nbytes)
    return mapping.flat, mapping


def _close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


# ---- the parent's side ----

_IDS = itertools.count(1)


class Arena:
    """One buffer the parent owns and shares: `flat` is its bytes as a uint8 tensor on `device`."""

    def __init__(self, nbytes: int, device: str | torch.device):
        self.device = torch.device(device)
        self.nbytes = max(int(nbytes), 1)
        self.id = next(_IDS)
        self._mem = _DeviceMemory(self.nbytes) if self.device.type == "cuda" else _HostMemory(self.nbytes)
        self.flat: torch.Tensor = self._mem.flat

    @property
    def fd(self) -> int:
        return self._mem.fd

    def spec(self) -> dict[str, Any]:
        return {"id": self.id, "nbytes": self.nbytes, "device": self.device.type}

    def view(self, offset: int, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if offset < 0 or offset + nbytes > self.nbytes:
            raise TransportError(f"{nbytes} bytes at {offset} do not fit a buffer of {self.nbytes}")
        return self.flat[offset : offset + nbytes].view(dtype).reshape(shape)

    def close(self) -> None:
        self.flat = None
        self._mem.close()


def layout(values: dict[str, Any]) -> tuple[dict[str, dict[str, Any]], dict[str, int]]:
    """Where each value of a bundle goes: tensors at aligned offsets of one buffer per device type,
    scalars and number lists inline. Returns (entries, bytes needed per device type)."""
    entries: dict[str, dict[str, Any]] = {}
    sizes: dict[str, int] = {}
    for name, value in values.items():
        if isinstance(value, torch.Tensor):
            if type(value) is not torch.Tensor:
                raise TransportError(f"{name}: a {type(value).__name__} cannot cross the process boundary")
            where = value.device.type
            offset = -(-sizes.get(where, 0) // ALIGN) * ALIGN
            nbytes = value.numel() * value.element_size()
            entries[name] = {"tensor": True, "device": where, "dtype": dtype_name(value.dtype),
                             "shape": list(value.shape), "offset": offset}
            sizes[where] = offset + nbytes
        elif isinstance(value, (bool, int, float, str)) or value is None or is_number_list(value):
            entries[name] = {"tensor": False, "value": list(value) if isinstance(value, tuple) else value}
        else:
            raise TransportError(f"{name}: cannot send a {type(value).__name__}")
    return entries, sizes


@dataclass
class Shared:
    """A bundle of values in buffers the parent owns: `views` are the parent's handles on exactly the
    memory the worker sees (tensors), or the scalars themselves."""

    entries: dict[str, dict[str, Any]]
    arenas: dict[str, Arena]
    views: dict[str, Any] = field(default_factory=dict)

    def spec(self) -> dict[str, Any]:
        return {"entries": self.entries, "arenas": {k: a.id for k, a in self.arenas.items()}}

    def close(self) -> None:
        self.views.clear()
        for a in self.arenas.values():
            a.close()
        self.arenas.clear()


def share(values: dict[str, Any]) -> Shared:
    """Copy `values` into new shared buffers (the caller keeps `values` as its pristine copy)."""
    entries, sizes = layout(values)
    arenas = {where: Arena(n, values_device(values, where)) for where, n in sizes.items()}
    shared = Shared(entries, arenas)
    for name, e in entries.items():
        if e["tensor"]:
            view = arenas[e["device"]].view(e["offset"], DTYPES[e["dtype"]], e["shape"])
            view.copy_(values[name])
            shared.views[name] = view
        else:
            shared.views[name] = e["value"]
    if "cuda" in arenas:
        torch.cuda.synchronize()  # the worker must never read a buffer this process is still writing
    return shared


def values_device(values: dict[str, Any], where: str) -> torch.device:
    for v in values.values():
        if isinstance(v, torch.Tensor) and v.device.type == where:
            return v.device
    return torch.device(where)


def output_buffer(nbytes: int, device: str | torch.device) -> Arena:
    """A buffer for a worker's output: poisoned (NaN bytes) so that nothing stale can pass for an answer."""
    arena = Arena(nbytes, device)
    arena.flat.fill_(0xFF)  # 0xFFFF.. is a NaN in every floating dtype
    if arena.device.type == "cuda":
        # As in `share`: the fill is queued behind whatever this process queued before (the check's
        # reference on the next seed's inputs); unsynchronised, it landed after the worker's answer
        # and turned a correct output into NaN (the attention solution at B32, 5 of 6 evaluations).
        torch.cuda.synchronize()
    return arena


def read_output(arena: Arena, claim: Any) -> torch.Tensor | str:
    """The worker's output as the tensor it says it wrote: its claimed dtype and shape over the bytes of
    the parent's buffer. A claim that is malformed or does not fit is a message, never a crash."""
    if not isinstance(claim, dict):
        return "the worker reported no output"
    name, shape = claim.get("dtype"), claim.get("shape")
    dtype = DTYPES.get(name) if isinstance(name, str) else None
    if dtype is None:
        return f"output dtype {claim.get('dtype')!r} is not allowed"
    if not isinstance(shape, list) or not all(type(d) is int and 0 <= d < (1 << 40) for d in shape):
        return f"output shape {shape!r} is malformed"
    numel = extent = 1  # extent: the non-zero sizes' product (torch refuses strides that overflow, zeros or not)
    for d in shape:
        numel *= d
        extent *= max(d, 1)
    if extent >= 1 << 62:
        return f"output shape {shape} ({name}) is larger than any tensor"
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes > arena.nbytes:
        # Not copied: the shape and dtype alone say what is wrong with it (a tensor without storage).
        try:
            return torch.empty(shape, dtype=dtype, device="meta")
        except RuntimeError:  # a shape whose size overflows even a tensor without storage
            return f"output shape {shape} ({name}) is larger than any tensor"
    if claim.get("too_large"):
        return (f"the worker said its output ({claim.get('dtype')}, shape {shape}) did not fit a buffer it fits: "
                "nothing was handed back")
    return arena.view(0, dtype, shape)


def send(sock: socket.socket, payload: bytes, fds: list[int]) -> None:
    socket.send_fds(sock, [payload], fds)


# ---- the worker's side ----

class Mappings:
    """The buffers a worker has received, by the parent's arena id."""

    def __init__(self, device: torch.device):
        self.device = device
        self._maps: dict[int, tuple[torch.Tensor, Any]] = {}

    def receive(self, specs: list[dict[str, Any]], fds: list[int]) -> None:
        if len(specs) != len(fds):
            for fd in fds:
                _close(fd)
            raise TransportError(f"{len(fds)} descriptors arrived for {len(specs)} buffers")
        for spec, fd in zip(specs, fds):
            try:
                if spec["device"] == "cuda":
                    self._maps[int(spec["id"])] = _map_device(fd, int(spec["nbytes"]))
                else:
                    self._maps[int(spec["id"])] = _map_host(fd, int(spec["nbytes"]))
            finally:
                _close(fd)

    def flat(self, arena_id: int) -> torch.Tensor:
        return self._maps[int(arena_id)][0]

    def unpack(self, spec: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, e in spec["entries"].items():
            if not e.get("tensor"):
                out[name] = e.get("value")
                continue
            flat = self.flat(spec["arenas"][e["device"]])
            dtype = DTYPES[e["dtype"]]
            numel = 1
            for d in e["shape"]:
                numel *= d
            nbytes = numel * torch.empty((), dtype=dtype).element_size()
            out[name] = flat[e["offset"] : e["offset"] + nbytes].view(dtype).reshape(e["shape"])
        return out

    def drop(self, ids: list[int]) -> None:
        for i in ids:
            entry = self._maps.pop(int(i), None)
            if entry is None:
                continue
            _, handle = entry
            del entry
            if isinstance(handle, mmap.mmap):
                try:
                    handle.close()
                except BufferError:  # the submission kept a view: the mapping lives as long as it does
                    pass
            else:
                handle.close()


def write_output(flat: torch.Tensor, out: torch.Tensor) -> dict[str, Any]:
    """Copy a worker's output into the parent's buffer and say what was written."""
    nbytes = out.numel() * out.element_size()
    claim = {"dtype": dtype_name(out.dtype), "shape": list(out.shape)}
    if nbytes > flat.numel():
        return {**claim, "too_large": True}
    if nbytes:
        flat[:nbytes].copy_(out.detach().reshape(-1).view(torch.uint8))
    return claim
