"""The pure parts of the official timing method: the median's interval, the stopping rule, k."""

import random
import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.kernel import timing


def test_the_median_interval_covers_the_true_median_about_95_percent_of_the_time():
    rng = random.Random(7)
    hits, trials = 0, 2000
    for _ in range(trials):
        xs = [rng.lognormvariate(0, 0.05) for _ in range(60)]
        lo, hi = timing.median_interval(xs)
        hits += lo <= 1.0 <= hi  # the lognormal's median is exp(0) = 1
    assert 0.93 <= hits / trials <= 0.99, hits / trials


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(min_value=0.1, max_value=1e6, allow_nan=False), min_size=1, max_size=400))
def test_the_interval_brackets_the_sample_median(xs):
    lo, hi = timing.median_interval(xs)
    assert min(xs) <= lo <= statistics.median(xs) <= hi <= max(xs)


def test_convergence_needs_fifty_samples_and_a_tight_interval():
    tight = [100.0 + 0.01 * (i % 7) for i in range(49)]
    assert not timing.converged(tight)  # one short of the minimum
    assert timing.converged(tight + [100.0])
    rng = random.Random(1)
    noisy = [rng.gauss(100, 5) for _ in range(60)]  # a 5% spread: the +-0.5% interval is not reached yet
    assert not timing.converged(noisy)


def test_summary_reports_what_the_result_schema_names():
    s = timing.summary([float(x) for x in range(1, 101)])
    assert s["median_us"] == 50.5 and s["min_us"] == 1.0 and s["n"] == 100
    assert s["p10_us"] <= s["median_us"] <= s["p90_us"]
    assert s["interval_us"][0] < 50.5 < s["interval_us"][1]
    assert s["cv"] == pytest.approx(statistics.pstdev(range(1, 101)) / 50.5)


@pytest.mark.parametrize(
    "per_call_us,least,most,expected",
    [
        (20.0, 5, 256, 50),  # 1 ms / 20 us: one input set a call
        (1.0, 5, 256, 256),  # capped at 256 calls
        (1.0, 5, 40, 40),  # or at the sets that fit the memory cap
        (5000.0, 2, 256, 2),  # a slow call: still the sets that fill the L2 multiple, each once
        (333.0, 7, 256, 7),  # ceil(1000 / 333) = 4, but at least the L2 multiple's 7 sets
        (333.0, 1, 256, 4),
    ],
)
def test_calls_per_replay(per_call_us, least, most, expected):
    k = timing.choose_calls(per_call_us, least, most)
    assert k == expected and k <= timing.MAX_CALLS_PER_GRAPH


@pytest.mark.parametrize(
    "replay_us, expected",
    [
        (1000.0, 10),  # a replay of about 1 ms: the full block
        (200.0, 50),  # short replays: still about 10 ms a block, so the parent's overhead per block stays small
        (100.0, 64),  # but never more than MAX_BLOCK_REPLAYS
        (4000.0, 2),  # 10 ms of replays per block
        (42_000.0, 1),  # a slow kernel: one replay per block, not 0.4 s x 10
        (0.0, 64),
    ],
)
def test_replays_per_round_keep_a_block_near_10_ms(replay_us, expected):
    assert timing.replays_per_round(replay_us) == expected


def _judged(sub_us, sub_fresh, base_us, base_fresh):
    from pipeline.kernel.evaluate import _judge_fresh_content

    doc = {"status": "passed", "flags": []}
    _judge_fresh_content(doc, {"workload": "W", "median_us": sub_us, "read_flush_us": sub_fresh,
                               "baseline_median_us": base_us, "baseline_read_flush_us": base_fresh})
    return doc["status"], [f["code"] for f in doc["flags"]]


@pytest.mark.parametrize(
    "figures,expected",
    [
        # cuBLAS at M=1 on the H200: both 8% faster behind the flush than in the rotation: honest.
        ((23.8, 21.9, 23.7, 21.7), ("passed", [])),
        ((10.0, 10.2, 20.0, 20.1), ("passed", [])),
        ((10.0, 10.8, 20.0, 20.0), ("passed", [])),  # inside the noise of the cross-check (10%)
        ((10.0, 11.2, 20.0, 20.0), ("passed", ["flush_disagreement"])),
        # a device-side cache: 4 us on repeated content, 30 us on new content
        ((4.0, 30.0, 23.7, 21.7), ("needs_review", ["content_reuse"])),
        # just over the review line (1.25x the baseline's ratio) and just under it
        ((10.0, 12.6, 20.0, 20.0), ("needs_review", ["content_reuse"])),
        ((10.0, 12.4, 20.0, 20.0), ("passed", ["flush_disagreement"])),
        # faster with new content than the baseline's yardstick says: flagged, not held
        ((10.0, 8.0, 20.0, 20.0), ("passed", ["flush_disagreement"])),
        # no cross-check figure: nothing to judge
        ((10.0, None, 20.0, 20.0), ("passed", [])),
    ],
)
def test_the_fresh_content_cross_check_is_judged_against_the_baseline(figures, expected):
    assert _judged(*figures) == expected


def test_the_memory_peak_of_an_h200_and_an_h100_from_nvml_facts():
    from pipeline.kernel.evaluate import memory_peak_bytes_per_s

    assert memory_peak_bytes_per_s(6144, 3201) == pytest.approx(4.917e12, rel=1e-3)  # H200 (datasheet 4.8 TB/s)
    assert memory_peak_bytes_per_s(5120, 2619) == pytest.approx(3.352e12, rel=1e-3)  # H100 SXM (datasheet 3.35)


@pytest.mark.parametrize(
    "ceilings, expected_us",
    [
        # The attention baseline's B32 bytes at the H200's measured speeds sat on the floor (347 us);
        # at the memory's peak the floor is the time no honest kernel can beat.
        ({"copy_bytes_per_s": 4.10e12, "read_bytes_per_s": 4.17e12, "peak_bytes_per_s": 4.917e12,
          "bf16_flops_per_s": 7e14}, 1.4475e9 / 4.917e12 * 1e6),
        # No NVML: the faster of the measured bandwidths.
        ({"copy_bytes_per_s": 4.10e12, "read_bytes_per_s": 4.17e12, "peak_bytes_per_s": None,
          "bf16_flops_per_s": 7e14}, 1.4475e9 / 4.17e12 * 1e6),
        # A peak that reads lower than a measurement (a misreport) never raises the floor.
        ({"copy_bytes_per_s": 4.10e12, "read_bytes_per_s": 4.17e12, "peak_bytes_per_s": 1e12,
          "bf16_flops_per_s": 7e14}, 1.4475e9 / 4.17e12 * 1e6),
        # Compute-bound: 1e12 FLOPs at a measured 1e15 per second take 1,000 us, more than the bytes.
        ({"copy_bytes_per_s": 4.10e12, "read_bytes_per_s": 4.17e12, "peak_bytes_per_s": 4.917e12,
          "bf16_flops_per_s": 1e15}, 1000.0),
    ],
)
def test_the_floor_takes_the_fastest_bandwidth_known(ceilings, expected_us):
    from pipeline.kernel.evaluate import floor_us

    work = {"bytes": 1.4475e9, "flops": 1e12 if ceilings["bf16_flops_per_s"] == 1e15 else 2e6}
    assert floor_us(work, ceilings) == pytest.approx(expected_us)


def test_rotation_sets_fill_the_multiple_of_l2_between_two_and_the_cap():
    mib = 1 << 20
    one_mib = {"w": torch.empty(mib, dtype=torch.uint8), "eps": 1e-6}  # scalars take no memory
    assert timing.rotation_sets(one_mib, l2_bytes=mib, multiple=20) == 20
    assert timing.rotation_sets(one_mib, l2_bytes=mib, multiple=2.5) == 3  # rounded up: at least the multiple
    assert timing.rotation_sets({"w": torch.empty(16, dtype=torch.uint8)}, l2_bytes=mib, multiple=20) == timing.MAX_CALLS_PER_GRAPH
    assert timing.rotation_sets({"w": torch.empty(64 * mib, dtype=torch.uint8)}, l2_bytes=mib, multiple=20) == 2


def test_the_sets_kept_over_an_evaluation_fit_the_gpu_whatever_its_workload_count():
    """The baseline's sets of every workload are kept until its run alone: muse_prefill_layer's seven workloads of
    1.7 GB sets (1,635-1,903 MiB on the full model) took four or five sets each at 8 GiB a workload, 47 GB kept
    besides the submission's and the parent's, and an H100 ran out of memory. Over the evaluation they now stay
    within TOTAL_SET_BYTES, or at the L2's least of two a workload (26 GiB here); a workload of small sets still
    gets the calls its replay wants."""
    from pipeline.kernel.evaluate import TOTAL_SET_BYTES, sets_at_most

    prefill = 1903 << 20
    assert sets_at_most(prefill, "cuda", 7, 2, timing.MAX_CALLS_PER_GRAPH) == 2
    assert sets_at_most(prefill, "cuda", 3, 2, timing.MAX_CALLS_PER_GRAPH) == 4
    assert TOTAL_SET_BYTES["cuda"] <= 32 << 30
    assert sets_at_most(prefill, "cuda", 1, 2, timing.MAX_CALLS_PER_GRAPH) == 4  # alone: its 8 GiB
    assert sets_at_most(64 << 30, "cuda", 7, 2, timing.MAX_CALLS_PER_GRAPH) == 2  # never under the L2's least
    assert sets_at_most(1 << 20, "cuda", 7, 3, timing.MAX_CALLS_PER_GRAPH) == timing.MAX_CALLS_PER_GRAPH


def test_a_replay_fit_tells_work_in_every_replay_from_work_in_one_a_block():
    """Blocks of drawn replay counts: an honest graph's wall time grows by a replay's claimed time per replay (ratio
    near 1), one that works in the last replay only grows by almost nothing (near 0), and noise widens the upper
    bound instead of condemning an honest run. One count or too few blocks: no fit."""
    rng = random.Random(7)
    draws = [timing.drawn_replays(10, rng) for _ in range(200)]
    assert min(draws) == 3 and max(draws) == 17
    assert {timing.drawn_replays(1, rng) for _ in range(50)} == {1, 2}
    honest = [(n, 700 + 1000 * n + rng.gauss(0, 50), 1000 * n) for n in draws]
    lazy = [(n, 700 + 1000 + 5 * n + rng.gauss(0, 50), 1000 + 5 * n) for n in draws]
    noisy = [(n, 700 + 1000 * n + rng.gauss(0, 4000), 1000 * n) for n in draws[:20]]
    fit = timing.replay_fit(honest)
    assert fit["ratio"] == pytest.approx(1, abs=0.02) and fit["upper"] > 1
    fit = timing.replay_fit(lazy)
    assert fit["ratio"] < 0.1 and fit["upper"] < 0.5, fit
    assert timing.replay_fit(noisy)["upper"] > 0.9
    assert timing.replay_fit([(10, 1e4, 1e4)] * 50) is None
    assert timing.replay_fit(honest[:7]) is None
