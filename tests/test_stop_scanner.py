"""The incremental stop-string scan (stops.py) against the plain definition it replaces: a stop
is found where it first starts among those ending in the new text, and the text held back is
the longest tail that begins some stop string; its cost per character does not grow with the
text or with the stop strings' length."""

from __future__ import annotations

import random
import sys

import pytest

from adaspark.stops import StopScanner


def naive_feed(text: str, before: int, stops: list[str]) -> int | None:
    """The engine's former scan: every stop string searched from where it could first start."""
    longest = max(len(s) for s in stops)
    window = max(0, before - longest + 1)
    hits = [i for s in stops if (i := text.find(s, window)) != -1]
    return min(hits) if hits else None


def naive_held(text: str, stops: list[str]) -> int:
    for n in range(min(len(text), max(len(s) for s in stops)), 0, -1):
        if any(s.startswith(text[-n:]) for s in stops):
            return n
    return 0


def test_matches_the_plain_definition_on_random_text():
    rng = random.Random(5)
    for _ in range(3000):
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 5)))
                 for _ in range(rng.randint(1, 4))]
        scanner, text = StopScanner(stops), ""
        for _ in range(rng.randint(1, 12)):
            piece = "".join(rng.choice("abc") for _ in range(rng.randint(0, 4)))
            before, text = len(text), text + piece
            found = scanner.feed(piece)
            assert found == naive_feed(text, before, stops), (stops, text)
            if found is not None:
                break
            assert scanner.held == naive_held(text, stops), (stops, text)


def test_the_earliest_start_wins_among_overlapping_stops():
    scanner = StopScanner(["abcd", "c", ""])
    assert scanner.feed("xab") is None and scanner.held == 2  # "ab" may begin "abcd"
    assert scanner.feed("cd") == 1  # "c" ends first, but "abcd", ending in the same piece,
    # began earlier
    scanner = StopScanner(["abcd", "c"])
    assert scanner.feed("xabcd") == 1  # both end in one piece: the earlier start wins
    assert not StopScanner(["", ""]) and StopScanner(["x"])


def lines_run(call) -> int:
    """The Python lines `call` runs in the reply (request.py) and the stop scan: their work,
    counted exactly (no clock)."""
    count = 0

    def trace(frame, event, arg):
        nonlocal count
        if frame.f_code.co_filename.endswith(("stops.py", "request.py")):
            if event == "line":
                count += 1
            return trace
        return None

    sys.settrace(trace)
    try:
        call()
    finally:
        sys.settrace(None)
    return count


@pytest.mark.slow
def test_a_tokens_stop_scan_does_not_grow_with_the_stops_length(model_path):
    # the former scan tried every tail of the text up to the longest stop string against
    # every stop, per token; now each new character moves each stop's state a bounded
    # number of times (KMP: amortised at most two comparisons), whatever the stops' length
    from adaspark.model.tokenizer import Tokenizer
    from adaspark.request import Reply

    tokenizer = Tokenizer.from_gguf(model_path)
    a = tokenizer.token_bytes.index(b"a")

    def work(length: int) -> int:
        reply = Reply(tokenizer, 10_000, ["b" * length, "ab" * (length // 2)])
        for _ in range(length):  # the text is now longer than the stops
            reply.push(a)
        work = lines_run(lambda: [reply.push(a) for _ in range(500)])
        assert not reply.done and len(reply.text) == length + 500
        return work

    short, long = work(4), work(256)
    assert long <= short * 1.05  # the same work per token at 64 times the length
