"""The official GPU timing method (kernel-track.md, Timing; docs/TIMING.md says where and why it goes
further than the spec). The graphs run inside each target's own worker (the baseline's and the submission's are
separate processes); the parent fixes the calls per replay and the replays per round, interleaves the
two workers' blocks, and bounds what each reports with its own wall clock. On a CPU the same method
runs with `EagerGraph` standing in for a CUDA graph, so every check of the official path is exercised
by the CPU test suite (the timings themselves are unofficial there).

- R distinct input sets whose total size is >= 20x the L2 (the spec's minimum is 5x; R >= 2): every
  call reads cold data, no zero-write flush leaves dirty lines to be written back during the kernel,
  and the inputs span enough pages that where they land in memory averages out.
- One CUDA graph that calls the function k times, each call on an input set of its own (k = R, so
  every call of a timed graph leaves an output that the parent reads and checks); k makes one replay
  last about 1 ms (at most 256 calls, at least the R above, within a memory cap). One sample = one
  replay between two events, divided by k. Where a launch may overlap the one ahead of it (Hopper), an event
  record node follows each call, so no call starts before the one ahead of it ends (predecessor.py).
- 1.5 s of discarded replays first, then baseline and submission sampled in alternating blocks until
  the 95% interval of each median is within +-0.5% and at least 2 s have passed (at least 50
  samples each, at most 10 s).
- A cross-check with new content in every call behind a read flush: ([fresh content, flush, call]
  graph - [fresh content, flush] graph) / k, for the submission and the baseline alike.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from pipeline.kernel import predecessor

TARGET_REPLAY_S = 1e-3
MAX_CALLS_PER_GRAPH = 256
MIN_SAMPLES = 50
BLOCK = 10
BLOCK_S = BLOCK * TARGET_REPLAY_S
MAX_BLOCK_REPLAYS = 64
MIN_CROSS_PAIRS = 3
GUARD_CYCLES = 400_000  # about 0.2 ms at the H200's 1980 MHz: far longer than queuing one replay
REL_HALF_WIDTH = 0.005
Z95 = 1.959964


def median_interval(samples: list[float]) -> tuple[float, float]:
    """Distribution-free 95% interval of the median from order statistics (binomial approximation)."""
    xs = sorted(samples)
    n = len(xs)
    if n < 3:
        return xs[0], xs[-1]
    half = Z95 * math.sqrt(n) / 2
    lo = max(0, int(math.floor(n / 2 - half)) - 1)
    hi = min(n - 1, int(math.ceil(n / 2 + half)))
    return xs[lo], xs[hi]


def converged(samples: list[float], min_samples: int = MIN_SAMPLES) -> bool:
    if len(samples) < min_samples:
        return False
    lo, hi = median_interval(samples)
    med = statistics.median(samples)
    return (hi - lo) / 2 <= REL_HALF_WIDTH * med


def summary(samples: list[float]) -> dict[str, Any]:
    xs = sorted(samples)
    n = len(xs)
    mean = statistics.fmean(xs)
    lo, hi = median_interval(xs)
    return {
        "median_us": statistics.median(xs),
        "interval_us": [lo, hi],
        "min_us": xs[0],
        "p10_us": xs[int(0.1 * (n - 1))],
        "p90_us": xs[int(0.9 * (n - 1))],
        "cv": statistics.pstdev(xs) / mean if n > 1 and mean > 0 else 0.0,
        "n": n,
    }


class Clocks:
    """NVML readings per block: SM and memory clocks, temperature, power, throttle reasons."""

    def __init__(self, device_index: int):
        self.rows: list[dict[str, Any]] = []
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(device_index)
        except Exception:  # noqa: BLE001 - no NVML: record nothing rather than fail the run
            self._nvml = None

    def sample(self) -> None:
        if self._nvml is None:
            return
        n, h = self._nvml, self._handle
        try:
            self.rows.append({
                "sm_mhz": n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM),
                "mem_mhz": n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_MEM),
                "temp_c": n.nvmlDeviceGetTemperature(h, n.NVML_TEMPERATURE_GPU),
                "power_w": n.nvmlDeviceGetPowerUsage(h) / 1000.0,
                "throttle": int(n.nvmlDeviceGetCurrentClocksThrottleReasons(h)),
            })
        except Exception:  # noqa: BLE001
            pass

    def summary(self) -> dict[str, Any] | None:
        if not self.rows:
            return None
        out: dict[str, Any] = {"blocks": len(self.rows)}
        for key in ("sm_mhz", "mem_mhz", "temp_c", "power_w"):
            vals = [r[key] for r in self.rows]
            out[key] = {"min": min(vals), "median": statistics.median(vals), "max": max(vals)}
        # Idle/power-cap bits are expected; thermal or hardware slowdown bits are worth a flag.
        out["throttle_reasons"] = sorted({r["throttle"] for r in self.rows})
        return out


@dataclass
class Graph:
    graph: Any  # torch.cuda.CUDAGraph, or EagerGraph on a CPU
    calls: int
    outputs: dict[int, Any] = field(default_factory=dict)  # set index -> output of its last call (k = R: its only one)
    fences: list = field(default_factory=list)  # what the graph's fences record (predecessor.fence), kept with it


class EagerGraph:
    """A CPU's stand-in for a CUDA graph: `replay` makes the recorded calls again, eagerly, and keeps
    each set's last output where a graph would have left it."""

    def __init__(self, fn: Callable[[dict], Any], sets: list[dict], calls: int,
                 prologue: Callable[[dict], None] | None, outputs: dict[int, Any]):
        self._fn, self._sets, self._calls, self._prologue, self._outputs = fn, sets, calls, prologue, outputs

    def replay(self) -> None:
        for j in range(self._calls):
            r = j % len(self._sets)
            if self._prologue is not None:
                self._prologue(self._sets[r])
            self._outputs[r] = self._fn(self._sets[r])


def capture(fn: Callable[[dict], Any], sets: list[dict], calls: int, stream: Any = None,
            prologue: Callable[[dict], None] | None = None) -> Graph:
    outputs: dict[int, Any] = {}
    if stream is None:
        # Like a capture, this runs nothing yet (a cross-check's prologue rewrites the inputs).
        return Graph(EagerGraph(fn, sets, calls, prologue, outputs), calls, outputs)
    g = torch.cuda.CUDAGraph()
    fences: list = []
    fenced = predecessor.overlaps_possible(stream.device)
    with torch.cuda.graph(g, stream=stream):
        for j in range(calls):
            r = j % len(sets)
            if prologue is not None:
                prologue(sets[r])
            outputs[r] = fn(sets[r])
            # No call may start before the one ahead of it has ended (predecessor.py): as in a decode step,
            # where its inputs would not exist yet.
            if fenced:
                predecessor.fence(fences)
    return Graph(g, calls, outputs, fences)


def replays_us(graphs: list[Graph]) -> list[float]:
    """Replay the graphs back to back behind a guard, one event between each two: the per-call time
    of each replay, in order. The guard (a GPU sleep) holds the stream while the host queues every
    replay, so no sample contains the host's launch latency or an idle GPU waiting for it (with one
    synchronised replay per sample, that latency was 1-2% of a 1 ms replay and drifted with the
    host: docs/TIMING.md). On a CPU: each eager replay between two reads of the clock."""
    if not graphs:  # a request with nothing to time: its round trip is the parent's to measure (a CPU's samples)
        return []
    if isinstance(graphs[0].graph, EagerGraph):
        times = []
        for g in graphs:
            t0 = time.perf_counter()
            g.graph.replay()
            times.append((time.perf_counter() - t0) * 1e6 / g.calls)
        return times
    events = [torch.cuda.Event(enable_timing=True) for _ in range(len(graphs) + 1)]
    torch.cuda._sleep(GUARD_CYCLES)
    events[0].record()
    for g, e in zip(graphs, events[1:]):
        g.graph.replay()
        e.record()
    events[-1].synchronize()
    return [a.elapsed_time(b) * 1e3 / g.calls for g, a, b in zip(graphs, events, events[1:])]


def replays_per_round(replay_us: float) -> int:
    """Replays in one block of one target: about BLOCK_S of them (BLOCK replays of a 1 ms replay), at
    least one for a kernel so slow that even one call per set makes a replay much longer, at most
    MAX_BLOCK_REPLAYS for one so fast that its replays stay short: each block is a request to that
    target's worker, timed by the parent, and its overhead must stay a small part of what it times."""
    return max(1, min(MAX_BLOCK_REPLAYS, round(BLOCK_S * 1e6 / max(replay_us, 1e-3))))


def drawn_replays(nominal: int, draw: Any) -> int:
    """A block's replays, drawn uniformly within three quarters of the nominal count either side (1-2 for a
    nominal 1), so that no count is known in advance and the blocks' wall times can be fitted against them."""
    spread = max(1, 3 * nominal // 4)
    return draw.randint(max(1, nominal - spread), nominal + spread)


def replay_fit(blocks: list[tuple[int, float, float]]) -> dict[str, float] | None:
    """How a target's blocks' wall time grows with their replay count, against the time a replay is said to take.
    `blocks`: (replays, the parent's wall time of the block, the time its replays claim: the events' sum on a GPU,
    the parent's per-call sample times the calls on a CPU), in us. An honest graph does a replay's work in every
    replay, so the wall time's slope over replays is the claimed time of one (`ratio` near 1); a graph that works
    in one replay a block (the one whose outputs are read) and skips the rest grows by almost nothing per replay
    (`ratio` near 0). The slope is Theil-Sen's (the median of the pairwise slopes: a block caught in a burst of
    load moves it little) and `upper` the ratio's 95% upper bound by Sen's rank method: noise widens it, so a
    noisy honest run is not held. None with fewer than 8 blocks or a single count."""
    if len(blocks) < 8 or len({n for n, _, _ in blocks}) < 2:
        return None
    claimed = statistics.median(c / n for n, _, c in blocks)
    if not claimed > 0:
        return None
    slopes = sorted((wj - wi) / (nj - ni) for i, (ni, wi, _) in enumerate(blocks) for nj, wj, _ in blocks[i + 1:]
                    if nj != ni)
    m = len(blocks)
    ties = Counter(n for n, _, _ in blocks)
    var_s = (m * (m - 1) * (2 * m + 5) - sum(t * (t - 1) * (2 * t + 5) for t in ties.values())) / 18
    reach = 1.96 * math.sqrt(max(var_s, 0.0))
    upper = slopes[min(len(slopes) - 1, math.ceil((len(slopes) + reach) / 2))]
    slope = statistics.median(slopes)
    return {"slope_us": slope, "claimed_us": claimed, "ratio": slope / claimed, "upper": upper / claimed,
            "blocks": m}


def set_bytes(inputs: dict[str, Any]) -> int:
    return sum(v.numel() * v.element_size() for v in inputs.values() if isinstance(v, torch.Tensor))


def rotation_sets(inputs: dict[str, Any], l2_bytes: int, multiple: float, most: int = MAX_CALLS_PER_GRAPH) -> int:
    """The fewest input sets a timed graph may have: enough that together they fill `multiple` times
    the L2, at least 2, at most `most`."""
    return max(2, min(most, math.ceil(multiple * l2_bytes / max(1, set_bytes(inputs)))))


def choose_calls(per_call_us: float, least: int, most: int = MAX_CALLS_PER_GRAPH) -> int:
    """k, the calls of one timed graph and its input sets alike (one set a call): one replay lasts about
    1 ms, with at least `least` calls (the sets that fill the L2 multiple) and at most `most` (the
    graph's and the memory's cap)."""
    k = math.ceil(TARGET_REPLAY_S * 1e6 / max(per_call_us, 1e-3))
    return max(2, least, min(k, most, MAX_CALLS_PER_GRAPH))
