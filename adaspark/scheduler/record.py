"""One round's record: what the scheduler decided, measured and learned, as one typed value.

`Scheduler.learn` returns it, the driver adds the arm and the request, and `to_json()` is the
line the engine's round log gets (`adaspark serve --round-log FILE`, read by bench/rounds.py).
This module is the log's schema: a field here is a field there, under the same name.

| field            | type        | meaning                                                         |
|------------------|-------------|-----------------------------------------------------------------|
| arm              | str         | the server's --arm                                              |
| request          | str         | the chat completion's id (`id` of its response / SSE chunks)    |
| ctx              | int         | committed context length in tokens when the round starts        |
| width_offered    | list        | widths the cost model offered (empty: not chosen by price)      |
| width            | int         | the width chosen for the verify (rows it may take)              |
| rows             | int         | rows actually verified, anchor included (1 = a plain round)     |
| accepted         | int         | draft tokens accepted (committed tokens = accepted + 1)         |
| accepted_drafter | int         | of those, from nodes only the drafter proposed                  |
| accepted_ngram   | int         | of those, from nodes only the n-gram index proposed             |
| agreed           | int         | of those, from nodes both proposed                              |
| D                | float       | fixed per-round cost: drafter forward + tree build              |
| verify           | float       | the target's verify forward                                     |
| commit           | float       | accept walk + cache commits                                     |
| pred_S           | float       | expected accepted nodes at the chosen width (null: unpriced)    |
| pred_T           | float       | cost model's verify time for the chosen width (null: none)      |
| chosen_by        | str         | who set the width: a ChosenBy value                             |
| cold             | bool        | a cold-start round at a width chosen for measurement (probe)    |
| plain            | bool        | a 1-row round without drafting (width 1)                        |
| drafted          | bool        | the drafter ran (false: a plain or a gated n-gram round)        |
| gate_bucket      | int         | the draft gate's bucket (n-gram evidence at the anchor)         |
| explored         | bool        | the tree's last row was swapped for an exploration row (§3.3)   |
| fitted_prices    | bool        | the guard's choice: the fitted acceptance model priced the tree |
| ngram_widened    | bool        | the n-gram candidates moved the chooser wider (Corollary 4)     |
| labels           | int         | acceptance labels this round (0: none learned, e.g. the last)   |
| logloss_fitted   | float       | summed log loss of the fitted model on those labels (Table 2)   |
| logloss_head     | float       | summed log loss of the head-based estimate on them (Table 2)    |
| rows_drafter     | int         | verified rows held by drafter-only nodes (tree rounds only)     |
| rows_ngram       | int         | verified rows held by n-gram-only nodes                         |
| rows_agreed      | int         | verified rows held by nodes both sources proposed               |

Both log losses are scored on the round's labels before either model learns from them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from enum import Enum


def kind_of(plain: bool, drafted: bool) -> str:
    """RoundRecord.kind from a record's two flags (its round-log line's too)."""
    if plain:
        return "plain"
    return "drafted" if drafted else "ngram"


class ChosenBy(str, Enum):
    """Who set a round's width. A str, so it compares and serialises as its value."""

    CHOOSER = "chooser"      # the width chooser, by price (Eq. 7)
    PROBE = "probe"          # the cost model measuring a width (cold start)
    PINNED = "pinned"        # a fixed width (tree:N, adaspark:N)
    CHAIN = "chain"          # the spine of the drafter's picks (chain, chain3)
    PLAIN = "plain"          # one row: the anchor alone
    UNDRAFTED = "undrafted"  # the draft gate's n-gram tree, no drafter

    def __str__(self) -> str:
        return self.value


ROUND_KINDS = ("drafted", "ngram", "plain")  # RoundRecord.kind


@dataclass(frozen=True)
class RoundTimes:
    """A round's timed parts in seconds (speculative.py says what each covers)."""

    fixed_s: float   # D: drafter forward + plan
    verify_s: float  # the target's verify
    commit_s: float  # the accept walk + cache commits


@dataclass
class RoundRecord:
    """One round-log line (see the module's table)."""

    ctx: int
    width: int
    rows: int
    chosen_by: ChosenBy
    accepted: int
    D: float
    verify: float
    commit: float
    width_offered: list[int] = field(default_factory=list)
    accepted_drafter: int = 0
    accepted_ngram: int = 0
    agreed: int = 0
    pred_S: float | None = None
    pred_T: float | None = None
    drafted: bool = True
    gate_bucket: int | None = None
    explored: bool = False
    fitted_prices: bool = False
    ngram_widened: bool = False
    labels: int = 0
    logloss_fitted: float = 0.0
    logloss_head: float = 0.0
    rows_drafter: int | None = None
    rows_ngram: int | None = None
    rows_agreed: int | None = None
    arm: str | None = None
    request: str | None = None

    @property
    def cold(self) -> bool:
        return self.chosen_by is ChosenBy.PROBE

    @property
    def plain(self) -> bool:
        return self.chosen_by is ChosenBy.PLAIN

    @property
    def kind(self) -> str:
        """drafted (the drafter ran), ngram (the gate's n-gram tree alone) or plain (one row)."""
        return kind_of(self.plain, self.drafted)

    def to_json(self) -> dict:
        """The round-log line: every field, plus `cold` and `plain`; row splits only for trees.
        Built field by field (the record is flat but for one list, copied): asdict's deep copy
        was ~20 us a round, paid on every request's round wherever the server's metrics or a
        round log read it."""
        out = {name: getattr(self, name) for name in _RECORD_FIELDS}
        out["width_offered"] = list(self.width_offered)
        out["chosen_by"] = self.chosen_by.value
        out["cold"], out["plain"] = self.cold, self.plain
        for name in ("rows_drafter", "rows_ngram", "rows_agreed"):
            if out[name] is None:
                del out[name]
        return out

    @classmethod
    def from_json(cls, line: dict) -> RoundRecord:
        """The inverse of to_json() (unknown keys, e.g. `cold`, are derived and dropped)."""
        names = {f.name for f in fields(cls)}
        kept = {k: v for k, v in line.items() if k in names}
        kept["chosen_by"] = ChosenBy(kept["chosen_by"])
        return cls(**kept)


_RECORD_FIELDS = tuple(f.name for f in fields(RoundRecord))
