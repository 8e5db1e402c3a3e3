"""The scheduler's learned state now, as plain JSON-able values (the server's state and dashboard).

    snapshot(scheduler, contexts=None) -> dict

Read-only: nothing here changes what the scheduler decides. Times are milliseconds, rates tokens
per second. Sections:

  arm, rounds                 the arm's name; rounds learned since this process started
  width_share                 [{rows, rounds, share}]: rounds by rows verified (1 = plain)
  cost.classes                per width class (§3.2): top, measured, level, clock, its law
                              (see below) and `price_curve` [[context, ms]] (Eq. 5 now)
  cost.fixed, cost.plain      the laws of D (drafter + plan) and of the 1-row plain step
  a law                       samples, fitted, scale_ms, `curve` [[context, ms]] (the law itself,
                              before level and clock: it is fitted to the raw samples) and
                              `bands` [{band, contexts: [lo, hi], samples: [[context, ms]],
                              law_ms: the law at the band's mean sample context}]
  acceptance                  fitted_preferred, guard {fitted, head}, coefficients {name: value},
                              `calibration` [{lo, hi, count, predicted, realised}] per bin of q
  chooser                     incumbent, held_rounds, `bands` [{band, contexts, rounds,
                              rate_tok_s}] (the achieved decode rate, §3.4), gains
  gate                        enabled, fixed_ms, `buckets` [{bucket, drafted, undrafted,
                              faster}] with {rounds, rate_tok_s} per mode

The curves are drawn over `contexts` (default: CURVE_POINTS points spanning the contexts the
laws have samples at), so a chart shows the laws where they were measured.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from adaspark.scheduler.acceptance import COEF_NAMES
from adaspark.scheduler.chooser import BandRate, RidgeGain
from adaspark.scheduler.cost import QuantileLaw, basis

CURVE_POINTS = 24


def _num(value) -> float | None:
    return None if value is None else float(value)


def band_contexts(band: int) -> list[int]:
    """The contexts [lo, hi] of a band (context_band is the bit length)."""
    return [0, 0] if band == 0 else [1 << (band - 1), (1 << band) - 1]


def _laws(scheduler) -> list[QuantileLaw]:
    cost = scheduler.cost
    return [k.law for k in cost.classes] + [cost.fixed, scheduler.plain_law]


def curve_contexts(scheduler) -> list[int]:
    seen = [c for law in _laws(scheduler) for band in law.bank.values() for c, _ in band]
    if not seen:
        return []
    lo, hi = int(min(seen)), int(max(seen))
    return sorted({int(round(c)) for c in np.linspace(lo, hi, CURVE_POINTS)})


def law_snapshot(law: QuantileLaw, contexts: Sequence[int]) -> dict[str, Any]:
    bands = []
    for band, samples in sorted(law.bank.items()):
        mean = sum(c for c, _ in samples) / len(samples)
        bands.append({"band": band, "contexts": band_contexts(band),
                      "samples": [[c, t] for c, t in samples], "law_ms": _num(law.predict(mean))})
    curve = [] if law.lowest_ms is None else [[c, float(law.predict(c))] for c in contexts]
    return {"samples": law.samples, "fitted": law.fitted, "scale_ms": _num(law.scale),
            "curve": curve, "bands": bands}


def _rate(rate: BandRate) -> dict[str, Any]:
    r = rate.rate
    return {"rounds": rate.rounds, "rate_tok_s": None if r is None else 1000.0 * r}


def _gain(gain: RidgeGain) -> list[float]:
    return [float(gain.a), float(gain.b)]


def snapshot(scheduler, contexts: Sequence[int] | None = None) -> dict[str, Any]:
    grid = curve_contexts(scheduler) if contexts is None else [int(c) for c in contexts]
    cost, acc, chooser, gate = (scheduler.cost, scheduler.acceptance, scheduler.chooser,
                                scheduler.gate)
    classes = []
    for k in cost.classes:
        priced = k.law.lowest_ms is not None
        classes.append({
            "top": k.top, "measured": k.measured, "level": float(k.level.value),
            "clock": float(k.clock), **law_snapshot(k.law, grid),
            "price_curve": [[c, float(k.price_basis(basis(c), cost.clock))] for c in grid]
            if priced else [],
        })
    total = sum(scheduler.width_rounds.values())
    count, q_sum, y_sum = acc.calibration
    calibration = [{"lo": i / count.size, "hi": (i + 1) / count.size, "count": int(count[i]),
                    "predicted": float(q_sum[i] / count[i]) if count[i] else None,
                    "realised": float(y_sum[i] / count[i]) if count[i] else None}
                   for i in range(count.size)]
    buckets = []
    for bucket, (undrafted, drafted) in sorted(gate.rates.items()):
        faster = gate.faster(bucket)
        buckets.append({"bucket": bucket, "undrafted": _rate(undrafted),
                        "drafted": _rate(drafted),
                        "faster": None if faster is None else
                        ("drafted" if faster else "undrafted")})
    return {
        "arm": scheduler.arm.name,
        "rounds": total,
        "width_share": [{"rows": rows, "rounds": n, "share": n / total}
                        for rows, n in sorted(scheduler.width_rounds.items())],
        "cost": {"clock": float(cost.clock), "reach": cost.reach, "contexts": grid,
                 "classes": classes, "fixed": law_snapshot(cost.fixed, grid),
                 "plain": law_snapshot(scheduler.plain_law, grid)},
        "acceptance": {
            "fitted_preferred": bool(acc.fitted_preferred),
            "guard": {"fitted": float(acc.guard_fitted), "head": float(acc.guard_head)},
            "calibration": calibration,
            "coefficients": dict(zip(COEF_NAMES, acc.coefficients.tolist(), strict=True)),
        },
        "chooser": {
            "incumbent": chooser.incumbent, "held_rounds": chooser.held_rounds,
            "bands": [{"band": b, "contexts": band_contexts(b), **_rate(r)}
                      for b, r in sorted(chooser.rates.items())],
            "gains": {"above": {"drafter": _gain(chooser.above[0]),
                                "ngram": _gain(chooser.above[1])},
                      "below": {"drafter": _gain(chooser.below[0]),
                                "ngram": _gain(chooser.below[1])}},
        },
        "gate": {"enabled": scheduler.arm.gate, "fixed_ms": _num(gate.fixed_ms),
                 "buckets": buckets},
    }
