"""Verify-cost curves the simulator runs on: machine time of a verify of n rows at context c.

Each curve is a JSON file in `adaspark/sim/curves/`:
  kernels          name -> [[rows, ms], ...] at zero context; piecewise linear in rows, so a
                   step is two points one row apart. Below its first point a kernel costs its
                   first point (fewer rows never take longer); above its last it does not run.
                   The engine runs the cheapest kernel at each width.
  slope_ms_per_1k  [[rows, ms per 1,000 tokens of context], ...], interpolated in rows: the
                   attention every verified row pays per token of context (Eq. 3's beta).
  fixed_ms         D, the round's fixed cost (drafter forward and tree build).
  commit_ms        moving the accepted rows into the cache.
Times are machine times: the simulator adds interference on top (`adaspark.sim.process`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources

import numpy as np

from adaspark.errors import UserError

MAX_ROWS = 64


@dataclass(frozen=True)
class CostCurve:
    name: str
    description: str
    base_ms: np.ndarray  # [MAX_ROWS + 1], index = rows; zero-context time of the best kernel
    slope_ms_per_token: np.ndarray  # [MAX_ROWS + 1], index = rows
    fixed_ms: float
    commit_ms: float

    def verify_s(self, rows: int, context: int) -> float:
        """Machine time (seconds) of a verify of `rows` rows over `context` committed tokens."""
        if not 1 <= rows <= MAX_ROWS:
            raise UserError(f"curve {self.name}: no verify time for {rows} rows (1..{MAX_ROWS})")
        return (self.base_ms[rows] + self.slope_ms_per_token[rows] * context) / 1000.0

    def step_s(self, rows: Sequence[int], contexts: Sequence[int]) -> float:
        """Machine time (seconds) of one verify call over several requests' rows (a batched
        step): the weights' part at the step's total rows, each request's attention at its own
        rows and context. Past MAX_ROWS total rows the weights' part rises at the last
        measured rise per row (the curves measure one request's tree, at most MAX_ROWS)."""
        if len(rows) != len(contexts) or not rows or min(rows) < 1 or max(rows) > MAX_ROWS:
            raise UserError(f"curve {self.name}: a step needs 1..{MAX_ROWS} rows per request")
        attention = sum(self.slope_ms_per_token[r] * c for r, c in zip(rows, contexts,
                                                                        strict=True))
        return (self.base_step_ms(sum(rows)) + attention) / 1000.0

    def base_step_ms(self, total_rows: int) -> float:
        """The weights' part (ms) of a verify call of `total_rows` rows, any number >= 1."""
        if total_rows <= MAX_ROWS:
            return float(self.base_ms[total_rows])
        half = MAX_ROWS // 2
        per_row = (self.base_ms[MAX_ROWS] - self.base_ms[half]) / (MAX_ROWS - half)
        return float(self.base_ms[MAX_ROWS] + per_row * (total_rows - MAX_ROWS))

    @property
    def fixed_s(self) -> float:
        return self.fixed_ms / 1000.0

    @property
    def commit_s(self) -> float:
        return self.commit_ms / 1000.0


def _interpolate(points: list[list[float]], rows: np.ndarray, extend: bool) -> np.ndarray:
    xs = np.array([p[0] for p in points], dtype=float)
    ys = np.array([p[1] for p in points], dtype=float)
    if np.any(np.diff(xs) <= 0):
        raise UserError("curve points must have strictly increasing row counts")
    out = np.interp(rows, xs, ys)  # flat outside the points
    if not extend:
        out = np.where(rows > xs[-1], np.inf, out)
    return out


def curve_from_dict(spec: dict) -> CostCurve:
    try:
        rows = np.arange(MAX_ROWS + 1, dtype=float)
        kernels = [_interpolate(pts, rows, extend=False) for pts in spec["kernels"].values()]
        base = np.min(np.stack(kernels), axis=0)
        if not np.all(np.isfinite(base[1:])):
            raise UserError(f"curve {spec['name']}: no kernel covers every width 1..{MAX_ROWS}")
        slope = _interpolate(spec["slope_ms_per_1k"], rows, extend=True) / 1000.0
        return CostCurve(
            name=spec["name"],
            description=spec.get("description", ""),
            base_ms=base,
            slope_ms_per_token=slope,
            fixed_ms=float(spec["fixed_ms"]),
            commit_ms=float(spec["commit_ms"]),
        )
    except (KeyError, TypeError, IndexError) as err:
        raise UserError(f"malformed cost curve: missing or bad field {err}") from None


def _curve_files() -> dict[str, object]:
    folder = resources.files("adaspark.sim") / "curves"
    return {f.name[: -len(".json")]: f for f in folder.iterdir() if f.name.endswith(".json")}


def curve_names() -> list[str]:
    return sorted(_curve_files())


def load_curve(name: str) -> CostCurve:
    """A shipped curve by name, or a curve JSON file by path."""
    files = _curve_files()
    if name in files:
        return curve_from_dict(json.loads(files[name].read_text()))
    if name.endswith(".json"):
        try:
            with open(name) as fh:
                return curve_from_dict(json.load(fh))
        except (OSError, json.JSONDecodeError) as err:
            raise UserError(f"cannot read cost curve {name}: {err}") from None
    raise UserError(f"unknown curve {name!r}; shipped curves: {', '.join(curve_names())}")


def curve_from_round_log(path: str) -> CostCurve:
    """A curve measured by a recorded run: the engine's round log, one JSON record per line
    in the schema of scheduler/record.py (rows, ctx, verify, D, commit: seconds).

    Each verified width's law is the 0.15-quantile of its times per context band (interference
    is one-sided), fitted as alpha + beta * context over the bands with beta >= 0. Widths the
    log never verified are interpolated between logged ones, and priced in proportion to rows
    past the widest logged one (an unmeasured wide verify is assumed expensive)."""
    try:
        with open(path) as fh:
            records = [json.loads(line) for line in fh if line.strip()]
        samples: dict[int, list[tuple[float, float]]] = {}
        for r in records:
            samples.setdefault(int(r["rows"]), []).append((float(r["ctx"]),
                                                          1000.0 * float(r["verify"])))
        fixed = [1000.0 * float(r["D"]) for r in records if float(r["D"]) > 0]
        commit = [1000.0 * float(r["commit"]) for r in records]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise UserError(f"cannot read round log {path}: {err!r}") from None
    laws = {rows: _low_quantile_law(pts) for rows, pts in samples.items() if len(pts) >= 3}
    if len(laws) < 2 or not fixed:
        raise UserError(f"round log {path} has too few rounds: need tree rounds at two or more "
                        "widths, three each")
    widest = max(laws)
    base = [[rows, alpha] for rows, (alpha, _) in sorted(laws.items())]
    slope = [[rows, 1000.0 * beta] for rows, (_, beta) in sorted(laws.items())]
    if widest < MAX_ROWS:
        base.append([MAX_ROWS, laws[widest][0] * MAX_ROWS / widest])
    return curve_from_dict({
        "name": f"round-log:{path}",
        "description": f"measured from {len(records)} logged rounds",
        "kernels": {"log": base}, "slope_ms_per_1k": slope,
        "fixed_ms": float(np.median(fixed)), "commit_ms": float(np.median(commit)),
    })


def _low_quantile_law(points: list[tuple[float, float]], q: float = 15.0) -> tuple[float, float]:
    """(alpha ms, beta ms per token) through each context band's low quantile."""
    bands: dict[int, list[tuple[float, float]]] = {}
    for c, t in points:
        bands.setdefault(int(c).bit_length(), []).append((c, t))
    anchors = [(float(np.median([c for c, _ in b])), float(np.percentile([t for _, t in b], q)))
               for b in bands.values() if len(b) >= 3]
    if len(anchors) < 2:
        return float(np.percentile([t for _, t in points], q)), 0.0
    cs, ts = np.array(anchors).T
    beta = max(float(np.polyfit(cs, ts, 1)[0]), 0.0)
    return float(np.mean(ts - beta * cs)), beta
