"""Two writers on one learned store: the three-way merge of the scheduler's saved state.

    merge_states(base, disk, ours) -> dict
    SharedState(scheduler, store).save()   Store.update with merge_states against what this
                                           process last read or wrote

base: the state this process last read or wrote (what `ours` grew from); disk: what is in the
store now (another process may have saved since); ours: this process's state now. Each part of
the state (cost, acceptance, chooser, plain, gate) that only one side changed since `base` is
that side's. Where both changed:
  - counts and sums add: the rounds learned from (`rounds`), the acceptance model's labelled
    nodes per bucket, and the chooser's and the gate's decode rates per band. A rate
    (chooser.BandRate: decayed tokens, decayed time, rounds) is linear in its observations, so
    our rounds since `base` are replayed exactly on top of the disk's: ours + (disk - base) *
    RATE_DECAY^k, k our rounds since base;
  - fitted things stay ours, whole (newest wins): the cost laws and their row classes, the plain
    step's law, the acceptance weights and guard, the gains, the gate's undrafted D. A fit is
    one fit: half of one and half of another would be neither, and the laws refit from their
    own sample banks as requests end.
A process keeps learning on its own state; the store holds both writers' counts, and a process
that starts reads them all. A state of another scheduler version (another build on the same
directory) is never merged: merge_states raises store.Unusable, and Store.update sets that file
aside (bounded) before writing ours.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from adaspark.errors import UserError
from adaspark.scheduler.chooser import RATE_DECAY
from adaspark.scheduler.store import Unusable, plain_json


def merge_states(base: Mapping | None, disk: Mapping | None, ours: Mapping) -> dict:
    """The state to save, from plain JSON values (store.plain_json) of all three."""
    if not disk or disk == base:
        return dict(ours)
    if disk.get("version") != ours.get("version"):  # another build's: set aside, not lost
        raise Unusable(f"the scheduler cannot read its state (version {disk.get('version')!r}"
                       f", this build writes {ours.get('version')!r})")
    base = base or {}
    merged: dict[str, Any] = {}
    for key in {*ours, *disk}:
        b, d, o = base.get(key), disk.get(key), ours.get(key)
        if o == b and d is not None:
            merged[key] = d  # we learned nothing here: theirs stands
        elif d == b or d is None:
            merged[key] = o
        else:
            merged[key] = _both_changed(key, b, d, o)
    merged["rounds"] = (_int(disk.get("rounds")) + _int(ours.get("rounds"))
                        - _int(base.get("rounds")))
    return merged


def _both_changed(key: str, base: Any, disk: Any, ours: Any) -> Any:
    if key == "chooser":
        return {**ours, "rates": _rates(_rows(base, "rates"), disk["rates"], ours["rates"], 1)}
    if key == "gate" and disk.get("unit") == ours.get("unit"):
        return {**ours, "rates": _rates(_rows(base, "rates"), disk["rates"], ours["rates"], 2)}
    if key == "acceptance":
        b = (base or {}).get("bucket_labels") or [0] * len(ours["bucket_labels"])
        d = disk.get("bucket_labels")
        if d is not None and len(b) == len(d) == len(ours["bucket_labels"]):
            return {**ours, "bucket_labels": [x + y - z for x, y, z
                                              in zip(d, ours["bucket_labels"], b, strict=True)]}
    return ours


def _int(value: Any) -> int:
    return int(value) if isinstance(value, int | float) else 0


def _rows(state: Any, key: str) -> list:
    return (state or {}).get(key) or []


def _rates(base: list, disk: list, ours: list, pairs: int) -> list:
    """Rows [band, (tokens, time, rounds) * pairs]: our rounds since base on top of disk's."""
    by_band = [{row[0]: row[1:] for row in rows} for rows in (base, disk, ours)]
    zero = [0.0, 0.0, 0] * pairs
    out = []
    for band in sorted({*by_band[1], *by_band[2]}):
        b, d, o = (side.get(band, zero) for side in by_band)
        row = [band]
        for i in range(0, 3 * pairs, 3):
            row += _rate(b[i:i + 3], d[i:i + 3], o[i:i + 3])
        out.append(row)
    return out


def _rate(base: list, disk: list, ours: list) -> list:
    k = int(ours[2]) - int(base[2])  # our observations since base
    if k < 0:  # ours restarted (the gate forgets its rates when the widths change): ours
        return list(ours)
    keep = RATE_DECAY ** k
    tokens = max(0.0, ours[0] + (disk[0] - base[0]) * keep)
    time = max(0.0, ours[1] + (disk[1] - base[1]) * keep)
    return [tokens, time, int(disk[2]) + k]


class SharedState:
    """A scheduler's learned state and the store it is saved to, which other processes may
    write too: save() merges with whatever they saved since this one last read or wrote."""

    def __init__(self, scheduler: Any, store: Any) -> None:
        self.scheduler, self.store = scheduler, store
        self.synced = plain_json(scheduler.state_dict())  # what the store held, as we know it

    def save(self) -> None:
        """Store.update with merge_states; raises what the update raised (nothing changes, and
        the store counts a failed save): the store's UserError, also for a learned state that
        is not JSON."""
        base, ours = self.synced, {}

        def merge(disk: Mapping | None) -> dict:
            try:
                ours["state"] = plain_json(self.scheduler.state_dict())
            except (TypeError, ValueError) as exc:
                raise UserError(f"learned state cannot be stored as JSON: {exc}") from None
            return merge_states(base, disk, ours["state"])

        self.store.update(merge)
        self.synced = ours["state"]
