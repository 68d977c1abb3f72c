"""The bundle format is the only thing the parent reads from the child: round trips are exact, and a
hostile file is refused with a message, never unpickled, never read past its end."""

import json
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.kernel.transport import MAGIC, BundleError, fingerprint, read_bundle, write_bundle

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int8, torch.uint8,
          torch.int16, torch.int32, torch.int64, torch.bool]


@pytest.mark.parametrize("trusted", [False, True], ids=["read", "mapped"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_is_bit_exact(tmp_path, dtype, trusted):
    t = (torch.randn(3, 5, 7) * 100).to(dtype)
    values = {"t": t, "empty": torch.empty(0, 4, dtype=dtype), "scale": 0.125, "n": 3, "lens": [1, 17, 16],
              "u": torch.arange(11, dtype=torch.int32)}
    write_bundle(tmp_path / "b", values)
    back = read_bundle(tmp_path / "b", writer_trusted=trusted)
    assert torch.equal(back["u"], values["u"])
    assert torch.equal(back["t"], t) and back["t"].dtype == dtype and back["t"].shape == t.shape
    assert back["empty"].shape == (0, 4)
    assert back["scale"] == 0.125 and back["n"] == 3 and back["lens"] == [1, 17, 16]


def test_a_file_cut_short_after_its_size_was_read_is_refused(tmp_path, monkeypatch):
    """The child may truncate a file between the reader's size check and its read: the reader counts
    the bytes it got instead of trusting the size it saw."""
    write_bundle(tmp_path / "b", {"t": torch.arange(1000, dtype=torch.float32)})
    real = (tmp_path / "b").stat()
    (tmp_path / "b").write_bytes((tmp_path / "b").read_bytes()[:-100])

    class Stale:
        st_size = real.st_size

    import pipeline.kernel.transport as transport

    monkeypatch.setattr(transport.os, "fstat", lambda fd: Stale())
    with pytest.raises(BundleError, match="ends after"):
        read_bundle(tmp_path / "b")


def _forge(path, header, payload=b""):
    raw = json.dumps(header).encode()
    path.write_bytes(MAGIC + struct.pack("<Q", len(raw)) + raw + payload)


@pytest.mark.parametrize(
    "header,payload,needle",
    [
        ({"x": {"tensor": True, "dtype": "object", "shape": [1], "offset": 0, "nbytes": 8}}, b"\0" * 8, "disallowed dtype"),
        ({"x": {"tensor": True, "dtype": "float32", "shape": [1000], "offset": 0, "nbytes": 4000}}, b"\0" * 8, "does not hold"),
        ({"x": {"tensor": True, "dtype": "float32", "shape": [2], "offset": 0, "nbytes": 4}}, b"\0" * 8, "does not hold"),
        ({"x": {"tensor": True, "dtype": "float32", "shape": [-1], "offset": 0, "nbytes": 4}}, b"\0" * 8, "malformed"),
        ({"x": {"tensor": True, "dtype": "float32", "shape": [1], "offset": -4, "nbytes": 4}}, b"\0" * 8, "malformed"),
        ({"x": {"tensor": False, "value": {"__reduce__": "os.system"}}}, b"", "non-scalar"),
        ({"x": "not an entry"}, b"", "malformed"),
    ],
)
def test_hostile_bundles_are_refused(tmp_path, header, payload, needle):
    _forge(tmp_path / "b", header, payload)
    with pytest.raises(BundleError, match=needle):
        read_bundle(tmp_path / "b")


def test_a_pickle_is_not_a_bundle(tmp_path):
    import pickle

    (tmp_path / "b").write_bytes(pickle.dumps({"x": 1}))
    with pytest.raises(BundleError, match="not a tensor bundle"):
        read_bundle(tmp_path / "b")


def test_oversized_header_is_refused(tmp_path):
    (tmp_path / "b").write_bytes(MAGIC + struct.pack("<Q", 1 << 40))
    with pytest.raises(BundleError, match="too large"):
        read_bundle(tmp_path / "b")


@settings(max_examples=60, deadline=None)
@given(st.binary(min_size=0, max_size=200))
def test_random_bytes_after_the_magic_never_crash_the_reader(tmp_path_factory, junk):
    path = tmp_path_factory.mktemp("fuzz") / "b"
    path.write_bytes(MAGIC + junk)
    try:
        read_bundle(path)
    except BundleError:
        pass


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.uint8, torch.int32, torch.float64, torch.bool])
@pytest.mark.parametrize("numel", [4096, 4095])  # words where the bytes divide evenly, elements otherwise
def test_fingerprint_sees_every_bit_and_every_position(dtype, numel):
    t = (torch.randn(numel) * 50).to(dtype) if dtype != torch.bool else torch.rand(numel) > 0.5
    base = fingerprint(t)
    for at in (0, 1234, numel - 1):  # one bit of one element, first, middle and last
        flipped = t.clone()
        flipped.view(torch.uint8)[at * t.element_size()] ^= 1
        assert fingerprint(flipped) != base
    for i, j in ((10, 11), (0, 3), (4, 1000)):  # two elements swapped, inside one word and across words
        swapped = t.clone()
        swapped[[i, j]] = t[[j, i]]
        if not torch.equal(swapped, t):
            assert fingerprint(swapped) != base
    assert fingerprint(t.clone()) == base
    assert fingerprint(t[1:].clone()) != fingerprint(t[1:][:-1].clone())
    assert fingerprint(t[1:]) == fingerprint(t[1:].clone())  # an unaligned view reads the same bits
    other = torch.float32 if dtype != torch.float32 else torch.float64
    assert fingerprint(t.to(other)) != base  # dtype is part of it


def test_neither_side_writes_or_reads_through_a_link_the_other_left(tmp_path):
    """The child shares the scratch folder with the parent (root, on the runner): a link it plants at
    the name of the parent's next bundle must not turn the parent's write into an overwrite of the
    link's target, nor a read into a read of it."""
    target = tmp_path / "precious.txt"
    target.write_text("keep me")
    link = tmp_path / "inputs.bin"
    link.symlink_to(target)
    write_bundle(link, {"x": torch.arange(4)})
    assert target.read_text() == "keep me"
    assert not link.is_symlink() and torch.equal(read_bundle(link)["x"], torch.arange(4))
    other = tmp_path / "output.bin"
    write_bundle(tmp_path / "real.bin", {"y": torch.ones(2)})
    other.symlink_to(tmp_path / "real.bin")
    with pytest.raises(BundleError, match="plain file"):
        read_bundle(other)
