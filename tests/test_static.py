"""Static checks flag the suspicious and leave honest kernels alone."""

from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from pipeline.kernel.static import scan

ROOT = Path(__file__).resolve().parent.parent
HONEST = sorted(ROOT.glob("problems/*/template.py")) + sorted(ROOT.glob("tests/calibration/*/correct_*.py"))


@pytest.mark.parametrize("path", HONEST, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_honest_kernels_raise_no_flag(path):
    assert scan(path.read_text()) == []


@pytest.mark.parametrize(
    "source,code,line",
    [
        ("import threading\n", "threads", 1),
        ("from concurrent.futures import ThreadPoolExecutor\n", "threads", 1),
        ("import subprocess\n", "subprocess", 1),
        ("import os\nos.system('ls')\n", "subprocess", 2),
        ("import socket\n", "network", 1),
        ("import ctypes\n", "ctypes", 1),
        ("import gc\n", "introspection", 1),
        ("import sys\nx = sys.modules['pipeline']\n", "introspection", 2),
        ("import inspect\n", "introspection", 1),
        ("import os\nseed = os.environ.get('SEED')\n", "environment", 2),
        ("from os import environ\n", "environment", 1),
        ("import torch\ns = torch.cuda.Stream()\n", "streams", 2),
        ("import torch\ntorch.cuda.Event.elapsed_time = lambda *a: 0.001\n", "monkeypatch", 2),
        ("import torch as T\nT.matmul = None\n", "monkeypatch", 2),
        ("import pipeline.kernel.timing as t\n", "harness", 1),
        ("import os\nos.write(4, b'x')\n", "file_descriptors", 2),
        ("def f():\n    return globals()\n", "introspection", 2),
        ("import torch\nsetattr(torch, 'mm', None)\n", "monkeypatch", 2),
        ("import operator, torch\ns = operator.attrgetter('cuda.Stream')(torch)()\n", "introspection", 2),
        ("import torch\nk = torch.load('k.pt', weights_only=False)\n", "introspection", 2),
        # the same categories under other names: the sys module reached through os, the os module under its
        # platform name, files opened through io, frames walked through traceback, getattr passed as a value
        ("import os\nm = os.sys.modules\n", "introspection", 2),
        ("import os\nf = os.sys._getframe(1)\n", "introspection", 2),
        ("import posix\nkey = posix.environ[b'KEY']\n", "environment", 2),
        ("from posix import system\nsystem('ls')\n", "subprocess", 1),
        ("import io\ntext = io.open('/etc/hostname').read()\n", "files", 2),
        ("import _io\ntext = _io.open('/etc/hostname').read()\n", "files", 2),
        ("import codecs\ntext = codecs.open('/etc/hostname').read()\n", "files", 2),
        ("import pathlib\ntext = pathlib.Path('/etc/hostname').read_text()\n", "files", 2),
        ("import traceback\nfor frame, _ in traceback.walk_stack(None):\n    pass\n", "introspection", 2),
        ("import torch\nfns = list(map(getattr, [torch] * 2, ['mm', 'bmm']))\n", "introspection", 2),
    ],
)
def test_suspicious_code_is_flagged_at_its_line(source, code, line):
    flags = scan(source)
    assert any(f.code == code and f.line == line for f in flags), flags


def test_unparseable_source_is_flagged_never_passed_in_silence():
    flags = scan("def f(:\n")
    assert [(f.code, f.line) for f in flags] == [("unparseable", 1)]
    assert "compile error" in flags[0].message


@pytest.mark.parametrize("path", HONEST[:3], ids=lambda p: f"{p.parent.name}/{p.name}")
def test_an_honest_kernel_stays_unflagged_as_bytes_with_a_bom_or_a_utf8_declaration(path):
    data = path.read_bytes()
    assert scan(data) == []
    assert scan(b"\xef\xbb\xbf" + data) == []
    assert scan(b"# -*- coding: utf-8 -*-\n" + data) == []


def test_the_flags_point_at_the_line_python_runs():
    source = b"\xef\xbb\xbf# -*- coding: latin-1 -*-\n"  # a BOM contradicting its declaration: unloadable
    assert [f.code for f in scan(source)] == ["unparseable"]
    flags = scan(b"# coding: raw_unicode_escape\nx = 1\n\\u0069mport socket\n")
    assert ("network", 3) in {(f.code, f.line) for f in flags}
    assert ("encoding", 1) in {(f.code, f.line) for f in flags}


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200) | st.text(max_size=200))
def test_the_scanner_never_raises(source):
    for flag in scan(source):
        assert flag.code and flag.message
