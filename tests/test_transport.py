"""Buffers the parent owns and shares with a worker: what the worker writes the parent sees in its own
memory, the worker cannot change a buffer's size under the parent, and what the worker claims about
its output is read as a claim (a malformed one is a message, never a crash)."""

import os
import socket
import subprocess
import sys
import textwrap

import pytest
import torch

from pipeline.kernel import transport
from pipeline.kernel.transport import Arena, Mappings, TransportError, identical, read_output, share

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int8, torch.uint8,
          torch.int16, torch.int32, torch.int64, torch.bool]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _values(device: str, dtype: torch.dtype = torch.bfloat16) -> dict:
    return {"t": (torch.randn(3, 5, 7) * 100).to(dtype).to(device), "empty": torch.empty(0, 4, dtype=dtype, device=device),
            "scale": 0.125, "n": 3, "lens": [1, 17, 16], "u": torch.arange(11, dtype=torch.int32, device=device)}


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_shared_bundle_holds_exactly_the_values(dtype):
    values = _values("cpu", dtype)
    shared = share(values)
    for name in ("t", "empty", "u"):
        assert identical(shared.views[name], values[name])
    assert shared.views["scale"] == 0.125 and shared.views["lens"] == [1, 17, 16]
    for e in shared.entries.values():
        if e["tensor"]:
            assert e["offset"] % transport.ALIGN == 0
    shared.close()


def test_identical_is_bit_exact():
    a = torch.tensor([0.0, float("nan"), 1.0])
    assert identical(a, a.clone())  # NaN == NaN, bit for bit
    assert not identical(a, torch.tensor([-0.0, float("nan"), 1.0]))  # -0.0 == 0.0 numerically, not in bits
    assert not identical(a, a.to(torch.float64))
    assert not identical(a, a[:2])


def test_what_cannot_cross_is_refused_with_its_name():
    class Sub(torch.Tensor):
        pass

    with pytest.raises(TransportError, match="x: a Sub cannot cross"):
        transport.layout({"x": torch.zeros(2).as_subclass(Sub)})
    with pytest.raises(TransportError, match="f: cannot send a function"):
        transport.layout({"f": lambda: 0})
    with pytest.raises(TransportError, match="not allowed"):
        transport.layout({"c": torch.zeros(2, dtype=torch.complex64)})


_WORKER_SIDE = textwrap.dedent("""
    import json, socket, sys
    sys.path.insert(0, sys.argv[2])
    import torch
    from pipeline.kernel.transport import Mappings
    sock = socket.socket(fileno=int(sys.argv[1]))
    data, fds, _, _ = socket.recv_fds(sock, 1 << 20, 16)
    req = json.loads(data)
    maps = Mappings(torch.device(req["device"]))
    maps.receive(req["arenas"], fds)
    inputs = maps.unpack(req["bundle"])
    inputs["t"].add_(1)             # a write into the parent's buffer
    out = maps.flat(req["out"])
    out[:4].copy_(torch.tensor([1, 2, 3, 4], dtype=torch.uint8))
    if req["device"] == "cuda":
        torch.cuda.synchronize()
    sock.send(b"done")
""")


@pytest.mark.parametrize("device", DEVICES)
def test_a_write_by_the_other_process_lands_in_the_parents_own_buffer(device):
    values = _values(device, torch.float32)
    shared = share(values)
    out = transport.output_buffer(64, device)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    proc = subprocess.Popen([sys.executable, "-c", _WORKER_SIDE, str(theirs.fileno()), ROOT], pass_fds=(theirs.fileno(),))
    theirs.close()
    arenas = [*shared.arenas.values(), out]
    req = {"device": device, "arenas": [a.spec() for a in arenas], "bundle": shared.spec(), "out": out.id}
    import json

    transport.send(ours, json.dumps(req).encode(), [a.fd for a in arenas])
    assert ours.recv(16) == b"done"
    assert proc.wait(timeout=60) == 0
    assert torch.equal(shared.views["t"], values["t"] + 1)  # the parent sees the write, and can judge it
    assert not identical(shared.views["t"], values["t"])
    assert out.flat[:4].tolist() == [1, 2, 3, 4] and out.flat[4:].eq(0xFF).all()
    shared.close()
    out.close()


def test_the_other_side_cannot_shrink_or_grow_a_host_buffer():
    """A truncated mapping is a SIGBUS in the evaluator at its next read: the memfd is sealed."""
    arena = Arena(1 << 16, "cpu")
    other = os.open(f"/proc/self/fd/{arena.fd}", os.O_RDWR)
    try:
        with pytest.raises(PermissionError):
            os.ftruncate(other, 0)
        with pytest.raises(PermissionError):
            os.ftruncate(other, 1 << 20)
    finally:
        os.close(other)
    assert arena.flat.numel() == 1 << 16
    arena.close()


def test_a_mapping_of_the_announced_size_must_fit():
    arena = Arena(4096, "cpu")
    maps = Mappings(torch.device("cpu"))
    with pytest.raises(TransportError, match="not the"):
        maps.receive([{"id": 99, "nbytes": 1 << 20, "device": "cpu"}], [os.dup(arena.fd)])
    with pytest.raises(TransportError, match="2 descriptors arrived for 1"):
        maps.receive([{"id": 98, "nbytes": 16, "device": "cpu"}], [os.dup(arena.fd), os.dup(arena.fd)])
    arena.close()


@pytest.mark.parametrize("claim,needle", [
    (None, "reported no output"),
    ({"dtype": "object", "shape": [2]}, "not allowed"),
    ({"dtype": "float32", "shape": [-1]}, "malformed"),
    ({"dtype": "float32", "shape": "2"}, "malformed"),
    ({"dtype": "float32", "shape": [2, True]}, "malformed"),  # a bool is an int to Python, not to us
])
def test_a_malformed_output_claim_is_a_message(claim, needle):
    arena = transport.output_buffer(64, "cpu")
    got = read_output(arena, claim)
    if needle is None:
        assert isinstance(got, torch.Tensor)
    else:
        assert isinstance(got, str) and needle in got
    arena.close()


def test_an_output_larger_than_the_buffer_is_judged_by_its_shape_alone():
    arena = transport.output_buffer(64, "cpu")
    got = read_output(arena, {"dtype": "float32", "shape": [1000]})
    assert isinstance(got, torch.Tensor) and got.device.type == "meta" and list(got.shape) == [1000]
    arena.close()


def test_an_output_buffer_starts_poisoned():
    arena = transport.output_buffer(64, "cpu")
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        assert torch.isnan(arena.view(0, dtype, [64 // dtype.itemsize])).all()
    arena.close()


@pytest.mark.gpu
def test_an_output_buffer_is_poisoned_before_a_worker_can_write_it():
    """The parent queues the next seed's reference on the GPU, then makes the output buffer: its NaN fill
    queues behind that work, and a worker that answered meanwhile had its output overwritten with NaN
    (the attention solution judged incorrect at B32 in 5 of 6 evaluations on an H100). The buffer must be
    poisoned, with nothing of this process left queued, by the time it is handed out."""
    # A kernel's first launch in a process loads its module, which waits for the device: the evaluator's
    # first fill (seed 0) was safe that way and every failure came at seed 1. Both kernels are loaded first.
    transport.output_buffer(1 << 20, "cuda").close()
    a = torch.randn(2048, 2048, device="cuda")
    a = a @ a * 1e-3
    torch.cuda.synchronize()
    for _ in range(400):  # ~0.1 s of GPU work queued ahead in many kernels, as the reference's is
        a = a @ a * 1e-3
    out = transport.output_buffer(1 << 20, "cuda")
    assert torch.cuda.current_stream().query(), "the fill is still queued when the buffer is handed out"
    assert bool((out.flat == 0xFF).all())
    out.close()
