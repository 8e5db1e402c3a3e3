"""Stop strings found as the reply's text grows, at a cost per new character that does not
depend on the text so far or on how long the stop strings are.

Each stop string keeps a Knuth-Morris-Pratt state: the length of the longest tail of the text
that begins it. One new character moves every state once (amortised O(1) each), so the engine
thread's scan of a token costs O(characters x stop strings), which the server's caps on the
stop list bound (server/schemas.py), instead of rescanning up to the longest stop string
against every stop string per token. The same states say how much of the text's tail may still
become a stop, which Reply holds back from the stream.
"""

from __future__ import annotations

from collections.abc import Sequence


def _failure(pattern: str) -> list[int]:
    """fail[i]: the longest proper prefix of pattern[:i + 1] that is also its suffix."""
    fail = [0] * len(pattern)
    k = 0
    for i in range(1, len(pattern)):
        while k and pattern[i] != pattern[k]:
            k = fail[k - 1]
        if pattern[i] == pattern[k]:
            k += 1
        fail[i] = k
    return fail


class StopScanner:
    """The stop strings (empty ones ignored) matched against text fed in order."""

    def __init__(self, stops: Sequence[str]):
        self._stops = [s for s in stops if s]
        self._fail = [_failure(s) for s in self._stops]
        self._state = [0] * len(self._stops)
        self._fed = 0  # characters fed so far

    def __bool__(self) -> bool:
        return bool(self._stops)

    def feed(self, text: str) -> int | None:
        """Take the text's next characters; the index (in all the text fed) where the earliest
        stop string that ends inside them starts, or None when none does."""
        earliest = None
        for j, stop in enumerate(self._stops):
            fail, k = self._fail[j], self._state[j]
            for i, ch in enumerate(text):
                while k and ch != stop[k]:
                    k = fail[k - 1]
                if ch == stop[k]:
                    k += 1
                if k == len(stop):  # a whole stop string ends at this character
                    start = self._fed + i + 1 - k
                    earliest = start if earliest is None else min(earliest, start)
                    k = fail[k - 1]
            self._state[j] = k
        self._fed += len(text)
        return earliest

    @property
    def held(self) -> int:
        """The length of the longest tail of the text fed that begins some stop string."""
        return max(self._state, default=0)
