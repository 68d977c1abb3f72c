"""The serving node between blocks: what is kept of `runner health --json`, and when the node after the candidate's
blocks is not the node the first baseline block left (B2 runs right after C2: a candidate that leaves the node
slower would gain). The documents have the shape `python -m pipeline runner health --json` writes (no GPU here)."""

from __future__ import annotations

import copy

from pipeline.serving.evaluate import NODE_KERNEL_DRIFT, node_drift, node_reading


def health(kernel_ms=0.31, clock=1980, temp=41, healthy=True) -> dict:
    devices = [{"index": i, "name": "NVIDIA H200", "kernel": {"n": 2048, "median_ms": kernel_ms + 0.001 * i},
                "sm_clock_mhz": clock, "sm_clock_max_mhz": 1980, "temperature_c": temp} for i in range(8)]
    return {"healthy": healthy, "reasons": [] if healthy else ["gpu 3 processes: pid 77 holds 1 GiB"],
            "readings": {"device": "cuda", "gpu": {"source": "nvml", "devices": devices}}}


def probes(*after_candidate: dict) -> list[dict]:
    names = ["block 2/4 (candidate)", "block 3/4 (candidate)", "block 4/4 (baseline)"]
    return [node_reading("block 1/4 (baseline)", health())] + [
        node_reading(n, h) for n, h in zip(names, [*after_candidate, health()])]


def test_a_node_that_stayed_the_same_is_not_held():
    assert node_drift(probes(health(0.312, 1975, 44), health(0.309, 1980, 45))) == []
    assert node_drift(probes()[:1]) == []


def test_a_node_left_slower_hotter_or_unhealthy_by_the_candidate_is_held():
    slower = node_drift(probes(health(), health(0.31 * (1 + 2 * NODE_KERNEL_DRIFT))))
    assert len(slower) == 8 and "block 3/4 (candidate)" in slower[0] and "known kernel" in slower[0], slower
    assert any("SM clock" in why for why in node_drift(probes(health(clock=1700), health())))
    assert any("C against" in why for why in node_drift(probes(health(temp=70), health())))
    sick = node_drift(probes(health(healthy=False), health()))
    assert sick and "pid 77" in sick[0]
    unread = copy.deepcopy(probes(health(), health()))
    unread[1] = node_reading("block 2/4 (candidate)", None, "TimeoutExpired")
    assert "could not run (TimeoutExpired)" in node_drift(unread)[0]
