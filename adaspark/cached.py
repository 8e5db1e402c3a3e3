"""The one owner of what the caches hold: the token ids whose K/V sit in the target's cache (and
the drafter's, when there is one), and the invariant that ties them.

Invariant, checked after every commit: kv.length == len(ids) (== drafter.length). A failure
half-way through a prefill or a round leaves the caches undefined, so `guard()` resets all three
and the next request starts clean. The engine and the speculator change the ids only through
this object. kv is the target's own cache unless another is given: a batch slot (batch.py), one
per running sequence, whose K/V the target reads through `target.using(kv)`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any


class CachedTokens:
    def __init__(self, target: Any, drafter: Any | None = None, kv: Any | None = None) -> None:
        self.target = target
        self.drafter = drafter
        self._kv = kv
        self.ids: list[int] = []

    @property
    def kv(self) -> Any:
        """The KV cache these ids describe (the target's own unless a slot's was given)."""
        return self.target.cache if self._kv is None else self._kv

    def __len__(self) -> int:
        return len(self.ids)

    def reset(self) -> None:
        """Forget everything cached (the next request prefills from scratch)."""
        self.kv.reset()
        if self.drafter is not None:
            self.drafter.reset()
        self.ids = []

    @contextmanager
    def guard(self) -> Iterator[None]:
        """Reset on any failure inside (the caches may hold part of a prefill or a round)."""
        try:
            yield
        except BaseException:
            self.reset()
            raise

    def trusted_prefix(self) -> list[int]:
        """The ids, unless someone else moved the target's (or drafter's) cache: then none is
        trusted."""
        moved = self.drafter is not None and self.drafter.length != len(self.ids)
        if moved or self.kv.length != len(self.ids):
            self.ids = []
        return self.ids

    def keep(self, n: int) -> None:
        """Truncate the target (and the drafter) to their first n tokens."""
        self.kv.truncate(n)
        if self.drafter is not None:
            self.drafter.truncate(min(n, self.drafter.length))
        self.ids = self.ids[:n]

    def copy_prefix(self, other: CachedTokens, length: int) -> None:
        """Hold `other`'s first `length` tokens (its K/V copied); only between slots without
        drafters (a drafter's features are not copied)."""
        if self.drafter is not None or other.drafter is not None:
            raise ValueError("a slot with a drafter cannot take another slot's prefix")
        self.kv.copy_prefix(other.kv, length)
        self.ids = other.ids[:length]
        self.check()

    def prefilled(self, prompt: Iterable[int]) -> None:
        """The target's cache now holds exactly `prompt`."""
        self.ids = [int(t) for t in prompt]

    def commit(self, tokens: Iterable[int]) -> None:
        """The target (and drafter) committed these tokens' rows: record and check."""
        self.ids.extend(int(t) for t in tokens)
        self.check()

    def check(self) -> None:
        length = self.kv.length
        if len(self.ids) != length:
            raise RuntimeError(f"{len(self.ids)} cached ids, the target's cache holds {length}")
        if self.drafter is not None and self.drafter.length != length:
            raise RuntimeError(f"drafter cache holds {self.drafter.length} tokens, the target's "
                               f"{length}")
