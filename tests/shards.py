"""The GPU suite's shares (`pytest --shard K/N`, tests/conftest.py): one a device call."""

from __future__ import annotations


def shard(items: list, k: int, n: int, seconds: dict[str, float]) -> list:
    """The k-th (1-based) of n consecutive runs of `items`, cut where the running sum of their expected
    seconds crosses k/n of the whole (a test nobody timed counts as the median of those timed, or 1 s).
    Consecutive, so a module's fixtures are built in one share only, unless it is cut."""
    known = sorted(seconds.values())
    default = known[len(known) // 2] if known else 1.0
    cost = [max(0.01, seconds.get(it.nodeid, default)) for it in items]
    total = sum(cost)
    out, run = [], 0.0
    for it, c in zip(items, cost):
        middle = run + c / 2  # a test belongs to the share its middle falls in
        if (k - 1) * total / n <= middle < k * total / n or (k == n and middle >= total):
            out.append(it)
        run += c
    return out
