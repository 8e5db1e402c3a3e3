"""Arms side by side on a machine that drifts: each item (a conversation, a request) on every
arm before the next, the first arm rotating, so a speed-up or slow-down of the machine lands on
every arm alike and no arm always follows the same one (benchmarks/arms.py, and
benchmarks/concurrency.py --interleave)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

Item = TypeVar("Item")


def interleaved(items: Sequence[Item], arms: Sequence[str],
                run_one: Callable[[str, Item], list[Any]]) -> dict[str, list[Any]]:
    """run_one(arm, item) for every item and arm, the arms taking turns per item with the first
    rotating (A B C, B C A, C A B, ...). Each arm's results (run_one's lists joined), in item
    order."""
    arms = list(arms)
    results: dict[str, list[Any]] = {arm: [] for arm in arms}
    for i, item in enumerate(items):
        shift = i % len(arms)
        for arm in arms[shift:] + arms[:shift]:
            results[arm] += run_one(arm, item)
    return results
