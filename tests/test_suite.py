"""The test suite itself: what a competitor with fewer test extras sees, and the GPU suite's shares."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from shards import shard

ROOT = Path(__file__).resolve().parents[1]


def test_a_missing_test_extra_skips_its_tests_with_what_to_install(tmp_path):
    """hypothesis, PyYAML, markdown-it-py and pytest-httpserver made unimportable (a module of that name that
    raises as a missing one does): their modules and fixtures skip, saying what to install; nothing errors."""
    for name in ("hypothesis", "yaml", "markdown_it", "pytest_httpserver"):
        (tmp_path / f"{name}.py").write_text(f"raise ModuleNotFoundError(\"No module named '{name}'\", name='{name}')\n")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:hypothesispytest", "-p",
         "no:pytest_httpserver", "tests/test_escape.py", "tests/test_workflows.py", "tests/test_github.py",
         "tests/test_github_flow.py::test_find_result_reads_merged_at_and_the_bench_runs_over_http"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**__import__("os").environ, "PYTHONPATH": str(tmp_path)})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "error" not in done.stdout.splitlines()[-1], done.stdout[-2000:]
    for needs in ("needs hypothesis", "need PyYAML", "needs pytest-httpserver"):
        assert needs in done.stdout, done.stdout[-3000:]


class Item:
    def __init__(self, nodeid: str) -> None:
        self.nodeid = nodeid


def test_the_gpu_suites_shares_are_consecutive_cover_everything_once_and_balance_the_known_times():
    items = [Item(f"t{i}") for i in range(10)]
    times = {"t0": 300.0, "t1": 10, "t2": 10, "t3": 10, "t4": 100, "t5": 100, "t6": 10, "t7": 10}
    shares = [shard(items, k, 3, times) for k in (1, 2, 3)]
    assert [it for s in shares for it in s] == items, "every test once, in order"
    cost = [sum(times.get(it.nodeid, 10) for it in s) for s in shares]
    assert shares[0] == items[:1] and max(cost) <= 300, cost  # the 300 s test alone; the rest split
    assert shard(items, 1, 1, {}) == items


def test_gpu_durations_folds_a_cut_shares_junit_xml_into_the_times_the_shares_are_cut_by(tmp_path):
    """benchmarks/gpu_durations.py, as its docstring runs it, on the XML a share cut by SIGINT leaves (a nameless
    testcase at the end) and a skipped test: the timed tests' node ids and seconds land in the file, nothing else."""
    xml = tmp_path / "gpu-tests-1-of-3.xml"
    xml.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.exploits.test_exploits" name="test_a[x.py]" time="5.04" />'
        '<testcase classname="tests.test_faults" name="test_b[GPU memory exhaustion]" time="251.53" />'
        '<testcase classname="tests.test_suite" name="test_c" time="1.0"><skipped message="no" /></testcase>'
        '<testcase time="0.002" /></testsuite></testsuites>')
    target = tmp_path / "durations.json"
    done = subprocess.run([sys.executable, "benchmarks/gpu_durations.py", str(xml), "--into", str(target)],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    import json

    assert json.loads(target.read_text()) == {"tests/exploits/test_exploits.py::test_a[x.py]": 5.04,
                                              "tests/test_faults.py::test_b[GPU memory exhaustion]": 251.53}


def test_the_gpu_entry_point_runs_named_tests_and_writes_their_log_and_times(tmp_path):
    """`bash benchmarks/gpu.sh tests 1/1 ID` as a device call runs it (here the GPU test is collected and skipped:
    no CUDA): pytest's log and the junit XML that gpu_durations.py folds land in $OUT; an unknown suite is exit 2."""
    test_id = "tests/test_transport.py::test_an_output_buffer_is_poisoned_before_a_worker_can_write_it"
    done = subprocess.run(["bash", "benchmarks/gpu.sh", "tests", "1/1", test_id], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**__import__("os").environ, "OUT": str(tmp_path)})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    log = (tmp_path / "gpu-tests-1-of-1.log").read_text()
    assert "1 skipped" in log and log.rstrip().splitlines()[-1].startswith("== pytest exit 0"), log[-2000:]
    assert 'name="test_an_output_buffer_is_poisoned_before_a_worker_can_write_it"' in (
        tmp_path / "gpu-tests-1-of-1.xml").read_text()
    wrong = subprocess.run(["bash", "benchmarks/gpu.sh", "everything"], cwd=ROOT, capture_output=True, text=True,
                           timeout=60, env={**__import__("os").environ, "OUT": str(tmp_path)})
    assert wrong.returncode == 2 and "unknown suite everything" in wrong.stderr, wrong.stderr
