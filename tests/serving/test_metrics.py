"""The level metrics against values computed by hand from records written by hand."""

from __future__ import annotations

import pytest

from pipeline.serving import metrics

S = 1_000_000_000  # ns in a second


def rec(send, chunks, status="ok", end=None, max_tokens=None, usage=None, conversation="c", turn=0):
    tokens = sum(n for _, n in chunks)
    carrying = [t for t, n in chunks if n]
    return {
        "lane": 0, "conversation": conversation, "pass": 0, "turn": turn, "canary": False,
        "max_tokens": max_tokens if max_tokens is not None else tokens,
        "send_ns": int(send * S), "first_ns": int(carrying[0] * S) if carrying else None,
        "end_ns": int((end if end is not None else carrying[-1]) * S), "status": status, "error": None,
        "chunk_ns": [int(t * S) for t, _ in chunks], "chunk_tokens": [n for _, n in chunks],
        "tokens": tokens, "tokens_streamed": tokens, "usage": usage,
    }


def document():
    facts = {"concurrency": 4, "window_start_ns": 1 * S, "window_end_ns": 3 * S}
    turns = [
        # A: sent in the warm-up, its first chunk (2 tokens) before the window, the rest inside
        rec(0.5, [(0.9, 2), (1.0, 1), (1.5, 1), (2.0, 1)],
            usage={"prompt_tokens": 100, "completion_tokens": 5, "prompt_tokens_details": {"cached_tokens": 50}}),
        # B: open when the window closed: cancelled; its chunk at exactly the end is outside [start, end)
        rec(2.5, [(2.6, 1), (2.9, 1), (3.0, 1)], status="cancelled", end=3.0, max_tokens=10),
        # C: wholly inside, one chunk of two tokens
        rec(1.2, [(1.4, 1), (1.6, 1), (1.8, 2)], usage={"prompt_tokens": 300, "prompt_tokens_details": {"cached_tokens": 0}}),
        # D: its stream broke inside the window after 2 tokens: they count in T, and u = 0
        rec(1.0, [(1.1, 1), (1.2, 1)], status="broken", end=2.2, max_tokens=8),
        # E: completed before the window opened
        rec(0.1, [(0.2, 1), (0.8, 1)]),
        # F: cancelled before the end (as a lane that stopped early would be): in T, not in I
        rec(2.7, [(2.8, 1)], status="cancelled", end=2.85, max_tokens=10),
    ]
    return {"facts": facts, "turns": turns}


def test_throughput_counts_tokens_by_their_timestamps_inside_the_window():
    doc = document()
    bounds = metrics.window(doc["facts"])
    # A: 1.0, 1.5, 2.0 -> 3; B: 2.6, 2.9 -> 2 (3.0 is the end, outside); C: 4; D: 2; E: 0; F: 1
    assert metrics.tokens_in_window(doc["turns"], bounds) == 12
    assert metrics.throughput_per_gpu(doc["turns"], bounds, gpus=2) == pytest.approx(12 / (2 * 2))
    assert metrics.throughput_per_gpu(doc["turns"], bounds, gpus=1) == pytest.approx(12 / 2)
    with pytest.raises(ValueError):
        metrics.throughput_per_gpu(doc["turns"], bounds, gpus=0)


def test_user_rate_and_interactivity():
    doc = document()
    a, b, c, d, e, f = doc["turns"]
    assert metrics.user_rate(a) == pytest.approx(5 / 1.5)  # send 0.5 -> last token 2.0
    assert metrics.user_rate(c) == pytest.approx(4 / 0.6)
    assert metrics.user_rate(d) == 0.0
    bounds = metrics.window(doc["facts"])
    assert [t is x for t, x in zip(metrics.window_turns(doc["turns"], bounds), (a, c, d))] == [True] * 3
    # seconds per token [0.15, 0.3, inf] (D failed): P90's position 1.8 reaches the failed turn, so I_c = 0
    assert metrics.interactivity(doc["turns"], bounds) == 0.0
    # without D: [0.15, 0.3], P90 at 0.9 between them, inverted
    assert metrics.interactivity([a, c], bounds) == pytest.approx(1 / (0.15 + 0.9 * 0.15))


def test_interactivity_takes_the_percentile_of_seconds_per_token_then_inverts_as_inferencex_does():
    """InferenceX's interactivity is 1 / P90(E2EL / OSL). Interpolating between rates (P10 of u) is another
    figure: on u = 10, 5, 2, 1 tokens/s it gives 1.3, while 1 / P90 of 0.1, 0.2, 0.5, 1.0 s a token is 1/0.85."""
    bounds = (0, 100 * S)
    turns = []
    for u in (10, 5, 2, 1):  # 10 tokens a turn, the last at 10/u s
        turns.append(rec(0, [(10 / u * k / 10, 1) for k in range(1, 11)]))
    assert [metrics.user_rate(t) for t in turns] == pytest.approx([10, 5, 2, 1])
    assert metrics.interactivity(turns, bounds) == pytest.approx(1 / 0.85)
    assert metrics.percentile([10, 5, 2, 1], 10) == pytest.approx(1.3)  # the other order, not the figure


def test_unscored_figures():
    lv = metrics.level(document(), gpus=2)
    u = lv["unscored"]
    # TPOT: A (2.0 - 0.9) / 4 = 275 ms, C (1.8 - 1.4) / 3 = 133.3 ms; median 204.17 ms
    assert u["tpot_rate"] == pytest.approx(1000 / ((275 + 400 / 3) / 2), abs=1e-3)
    # TTFT: A 400 ms, C 200 ms
    assert u["ttft_p50_ms"] == pytest.approx(300) and u["ttft_p90_ms"] == pytest.approx(380)
    # ITL: A 100, 500, 500; C 200, then 200 ms over a chunk of 2 -> 100, 100; p90 of six at position 4.5
    assert sorted(metrics.itls_ms(document()["turns"], (S, 3 * S))) == pytest.approx([100, 100, 100, 200, 500, 500])
    assert u["itl_p90_ms"] == pytest.approx(500)
    assert u["cache_hit_rate_untrusted"] == pytest.approx(50 / 400)
    assert lv["T"] == pytest.approx(3.0) and lv["tokens_in_window"] == 12 and lv["window_turns"] == 3
    assert lv["window_s"] == 2.0 and lv["gpus"] == 2 and lv["concurrency"] == 4


def test_usage_disagreement_is_a_diagnostic_of_the_count():
    turns = [rec(0, [(0.1, 3)], usage={"completion_tokens": 3}), rec(0, [(0.2, 3)], usage={"completion_tokens": 4}),
             rec(0, [(0.3, 2)]), rec(0, [(0.4, 1)], status="broken", usage={"completion_tokens": 9})]
    assert metrics.usage_disagreement(turns, (0, S)) == 0.5  # of the two completed turns that report usage
    assert metrics.usage_disagreement(turns[2:3], (0, S)) is None


def test_buffering_a_stream_changes_ttft_not_u():
    streamed = rec(0.0, [(0.1 + 0.05 * k, 1) for k in range(10)])
    buffered = rec(0.0, [(0.55, 1)] * 10)  # the same tokens, all sent when the last was ready
    assert metrics.user_rate(streamed) == pytest.approx(metrics.user_rate(buffered))
    facts = {"concurrency": 1, "window_start_ns": 0, "window_end_ns": S}
    a = metrics.level({"facts": facts, "turns": [streamed]}, gpus=1)
    b = metrics.level({"facts": facts, "turns": [buffered]}, gpus=1)
    assert a["I"] == pytest.approx(b["I"]) and a["T"] == b["T"]
    assert b["unscored"]["ttft_p50_ms"] == pytest.approx(550) and a["unscored"]["ttft_p50_ms"] == pytest.approx(100)


def test_validity_thresholds():
    ok = [rec(0, [(0.1, 1)], conversation=f"c{i}") for i in range(199)]
    timeout = rec(0, [], status="timeout", end=0.5, max_tokens=4)
    valid, reasons, counts = metrics.validity(ok + [timeout])  # 1 of 200 = 0.5%: not more than
    assert valid and not reasons and counts == {"ok": 199, "timeout": 1}
    valid, reasons, _ = metrics.validity(ok[:-1] + [timeout])  # 1 of 199 > 0.5%
    assert not valid and "1 of 199 turns failed" in reasons[0] and "1 timeout" in reasons[0]
    short = rec(0, [(0.1, 1), (0.2, 1)], status="short", max_tokens=5, conversation="s", turn=3)
    valid, reasons, _ = metrics.validity(ok + [short])
    assert not valid and "s turn 3: 2 tokens of 5" in reasons[0]
    cancelled = rec(0, [(0.1, 1)], status="cancelled", max_tokens=9)
    assert metrics.validity(ok + [cancelled])[0]  # open work at the window's end is no failure
    assert not metrics.validity([cancelled])[0]
    assert not metrics.validity([])[0]


def test_percentile_interpolates_linearly():
    assert metrics.percentile([4, 1, 3, 2], 10) == pytest.approx(1.3)
    assert metrics.percentile([7], 90) == 7
    assert metrics.percentile([], 50) is None
    with pytest.raises(ValueError):
        metrics.percentile([1], 101)


def test_summary_text_names_the_invalid_reasons():
    text = metrics.summary_text(metrics.level(document(), gpus=2))
    assert "c=4" in text and "INVALID" in text and "1 of 4 turns failed" in text and "1 broken" in text
