"""The parent's side of the worker protocol under hostile input, property-based: a worker's process is the
submission's (it can rewrite its worker and write anything on the reply pipe), so whatever a reply holds, the
parent reads it without crashing and the evaluation ends with a result that passes the schema, with the status
the reply's behaviour earns. Thousands of generated replies, lines and output claims per run."""

from __future__ import annotations

import copy
import json
import os
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from pipeline import result
from pipeline.kernel import transport
from pipeline.kernel.evaluate import (Child, ChildFailure, WORKER_STATUSES, WorkerTimeout, _finish,
                                      record_failure)

ROOT = Path(__file__).resolve().parents[1]
BASE = json.loads((ROOT / "tests/fixtures/kernel_results/runtime_error.json").read_text())
# The default tier draws a few hundred of each; the heavy tier (`-m heavy`) thousands.
FEW = settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MANY = settings(max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def both(strategies: dict, check):
    """`check` as two tests: a few hundred examples in the default tier, thousands in the heavy one."""
    return FEW(given(**strategies)(check)), pytest.mark.heavy(MANY(given(**strategies)(check)))

scalars = (st.none() | st.booleans() | st.integers(min_value=-2**70, max_value=2**70)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=40))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=16)
long_texts = st.builds(lambda c, n: c * n, st.sampled_from(["x", "\n", "\ud800", "é", "\x00"]),
                       st.integers(min_value=0, max_value=70_000))
fields = {
    "error": json_values | long_texts,
    "where": json_values | st.fixed_dictionaries({}, optional={"file": json_values, "line": json_values,
                                                                 "function": json_values, "code": json_values | long_texts}),
    "traceback": json_values | long_texts,
    "status": json_values | st.sampled_from([*WORKER_STATUSES, "passed", "incorrect"]),
    "build": json_values | st.fixed_dictionaries({}, optional={"first_error": json_values, "where": json_values,
                                                                "log_tail": json_values}),
}
replies = st.fixed_dictionaries({}, optional=fields) | json_values


def _failure_reply(reply, status, tail):
    doc = copy.deepcopy(BASE)
    record_failure(doc, status, reply, "M1", tail)
    _finish(doc)  # bounds the texts, then validates: raises if the document is not valid
    assert doc["status"] in (status, "compile_error", "runtime_error")
    assert isinstance(doc["error"]["message"], str) and doc["error"]["message"]


test_any_failure_reply_ends_in_a_valid_result, test_any_failure_reply_ends_in_a_valid_result_thoroughly = both(
    {"reply": replies, "status": st.sampled_from([*WORKER_STATUSES, "timeout", "incorrect"]),
     "tail": st.text(max_size=200) | long_texts}, _failure_reply)


def _bare_child(read_fd: int) -> Child:
    """A Child around a pipe, without a process: what `receive` reads is all that is under test."""
    child = Child.__new__(Child)
    child.deadline = float("inf")
    child.role = "submission"
    child.op = "call"
    child._resp_r = read_fd
    child._buf = b""

    class _Gone:  # the process behind the pipe, as `_death` asks it
        def wait(self, timeout=None):
            return None

    child.box = _Gone()
    return child


def _reply_line(line, newline):
    r, w = os.pipe()
    try:
        child = _bare_child(r)
        os.set_blocking(w, False)
        data = line + (b"\n" if newline else b"")
        written = 0
        try:
            written = os.write(w, data)
        except BlockingIOError:
            pass
        os.close(w)
        w = -1
        try:
            reply = child.receive(("0" * 32, time.monotonic() + 5, 1.0, "call"))
        except (ChildFailure, WorkerTimeout) as exc:
            assert getattr(exc, "role", "submission") == "submission"
            return
        assert isinstance(reply, dict) and reply.get("nonce") == "0" * 32, (data[:200], written)
    finally:
        os.close(r)
        if w != -1:
            os.close(w)


test_any_line_on_the_reply_pipe_is_a_reply_or_a_failure, test_any_line_on_the_reply_pipe_thoroughly = both(
    {"line": st.binary(max_size=300) | st.builds(lambda d: b"[" * d + b"]" * d, st.integers(0, 100_000))
     | st.builds(lambda v: json.dumps(v).encode(), json_values), "newline": st.booleans()}, _reply_line)


ARENA = transport.Arena(4096, "cpu")


def _output_claim(claim):
    got = transport.read_output(ARENA, claim)
    assert isinstance(got, str) or got.numel() * got.element_size() <= ARENA.nbytes or got.device.type == "meta"


test_any_output_claim_reads_as_a_tensor_or_a_message, test_any_output_claim_thoroughly = both(
    {"claim": json_values | st.fixed_dictionaries({}, optional={
        "dtype": json_values | st.sampled_from(["bfloat16", "float32", "int8", "bool"]),
        "shape": json_values | st.lists(st.integers(min_value=-3, max_value=1 << 41), max_size=5),
        "too_large": json_values, "error": json_values})}, _output_claim)


@pytest.mark.parametrize("shape", [[21848, 16663749, 50668182, 0], [0, 1 << 39, 1 << 39], [1 << 39, 1 << 39]])
def test_an_empty_or_huge_shape_whose_strides_overflow_is_a_message(shape):
    """Found by the heavy tier: zero elements, but sizes whose product overflows torch's stride arithmetic."""
    got = transport.read_output(ARENA, {"dtype": "bfloat16", "shape": shape})
    assert isinstance(got, str) and "larger than any tensor" in got
