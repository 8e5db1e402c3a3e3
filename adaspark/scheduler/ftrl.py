"""Online-learning primitives shared by the cost model (§3.2) and the acceptance model (§3.3).

API (stable):

    FTRLProximal(prior, alpha, beta=1.0, l1=0.0, l2=0.0, gate=0.0, n_cap=400.0,
                 lower=None, upper=None)
        .weights -> np.ndarray[float64, d]    current coefficients = prior + deviation (read-only)
        .update(grad, variance=None) -> None  grad = dLoss/dcoefficient at .weights, shape [d];
                                              variance: the model's expected grad**2 (optional)
        .labels -> np.ndarray[int64, d]       updates with a non-zero gradient, per coordinate
        .state_dict() -> {"z", "n", "v", "m": lists}     JSON-able, exact round trip
        .load_state_dict(state) -> None

    AdaGradScalar(rate, band, g2_cap=inf)
        .value -> float                       clamped to [-band, band]
        .update(grad) -> None                 grad = dLoss/dvalue
        .reset() -> None                      back to 0 (per request)
        .state_dict() / .load_state_dict(state)

FTRL-Proximal (McMahan et al., 2013) with a per-coordinate rate alpha/(beta + sqrt(n)), where n is
the sum of squared gradients capped at `n_cap` (the cap is a floor on the rate, so the model
keeps tracking a drifting deployment). It learns the *deviation* w from a prior, so L1/L2 pull
toward the prior, not toward zero. `gate` adds gate*sqrt(n) to the L1 threshold: a coefficient
stays exactly at its prior while |z| <= l1 + gate*sqrt(n). Under data the prior explains, z is a
zero-mean walk whose spread is sqrt(n), so gate=3 is a 3-sigma test before leaving the prior.
For rare outcomes the realised n understates that spread until the first one happens (z drifts
by sum q while n grows by sum q**2), so a caller that knows the model's expected squared
gradient passes it as `variance`; the gate then uses sqrt(max(n, v)), v its capped sum.
`lower`/`upper` clamp the coefficient itself (the cost model keeps context slopes >= 0).
All arithmetic is float64, so state_dict/load_state_dict round-trips bit for bit through JSON.
"""

from __future__ import annotations

import math

import numpy as np

from adaspark.errors import UserError


def _vector(value, size: int, name: str) -> np.ndarray:
    arr = np.array(np.broadcast_to(np.asarray(value, dtype=np.float64), (size,)))
    if np.any(np.isnan(arr)):
        raise UserError(f"{name} must not be NaN, got {value!r}")
    return arr


class FTRLProximal:
    """Per-coordinate FTRL-Proximal on the deviation from a prior (see module docstring)."""

    def __init__(self, prior, alpha, beta: float = 1.0, l1: float = 0.0, l2: float = 0.0,
                 gate: float = 0.0, n_cap: float = 400.0, lower=None, upper=None):
        self.prior = np.array(prior, dtype=np.float64).reshape(-1)
        d = self.prior.size
        self.alpha = _vector(alpha, d, "alpha")
        if np.any(self.alpha <= 0):
            raise UserError("FTRL rate alpha must be positive")
        self.beta = float(beta)
        self.l1 = float(l1)
        self.l2 = float(l2)
        self.gate = float(gate)
        self.n_cap = float(n_cap)
        self.lower = _vector(-np.inf if lower is None else lower, d, "lower")
        self.upper = _vector(np.inf if upper is None else upper, d, "upper")
        self._bounded = bool(np.isfinite(self.lower).any() or np.isfinite(self.upper).any())
        self.z = np.zeros(d)
        self.n = np.zeros(d)
        self.v = np.zeros(d)
        self.labels = np.zeros(d, dtype=np.int64)
        self._refresh()

    @property
    def weights(self) -> np.ndarray:
        return self._weights

    def _refresh(self, sqrt_n: np.ndarray | None = None) -> None:
        """The weights from z and n; sqrt_n: sqrt(n) where the caller has it."""
        if sqrt_n is None:
            sqrt_n = np.sqrt(self.n)
        self._sqrt_n = sqrt_n
        if self.gate:
            threshold = self.l1 + self.gate * np.sqrt(np.maximum(self.n, self.v))
        else:  # l1 + 0 * sqrt(max(n, v)) is l1, bit for bit (n and v are finite)
            threshold = self.l1
        shrunk = np.sign(self.z) * np.maximum(np.abs(self.z) - threshold, 0.0)
        deviation = -shrunk / ((self.beta + sqrt_n) / self.alpha + self.l2)
        self._deviation = deviation
        w = self.prior + deviation
        if self._bounded:  # clipping at +-inf changes no (non-NaN) weight
            w = np.clip(w, self.lower, self.upper)
        w.setflags(write=False)
        self._weights = w

    def update(self, grad, variance=None) -> None:
        g = np.asarray(grad, dtype=np.float64)
        if g.shape != self.prior.shape:
            raise UserError(f"FTRL gradient has shape {g.shape}, expected {self.prior.shape}")
        if variance is not None:
            self.v = np.minimum(self.v + variance, self.n_cap)
        n_new = np.minimum(self.n + g * g, self.n_cap)
        sqrt_new = np.sqrt(n_new)
        sigma = (sqrt_new - self._sqrt_n) / self.alpha
        # The deviation actually used (after clamping) is what the proximal term centres on.
        self.z += g - sigma * (self._weights - self.prior)
        self.n = n_new
        self.labels += g != 0.0
        self._refresh(sqrt_new)

    def state_dict(self) -> dict:
        return {"z": self.z.tolist(), "n": self.n.tolist(), "v": self.v.tolist(),
                "m": self.labels.tolist()}

    def load_state_dict(self, state: dict) -> None:
        try:
            z = np.array(state["z"], dtype=np.float64)
            n = np.array(state["n"], dtype=np.float64)
            v = np.array(state.get("v", [0.0] * z.size), dtype=np.float64)
            m = np.array(state.get("m", [0] * z.size), dtype=np.int64)
        except (KeyError, TypeError, ValueError) as exc:
            raise UserError(f"FTRL state is malformed: {exc}") from None
        if not (z.shape == n.shape == v.shape == m.shape == self.prior.shape):
            raise UserError(
                f"FTRL state has {z.size} coordinates, this model has {self.prior.size}")
        self.z, self.n, self.v, self.labels = z, n, v, m
        self._refresh()


class AdaGradScalar:
    """One AdaGrad-updated scalar with a clamp band and a cap on the squared-gradient sum."""

    def __init__(self, rate: float, band: float, g2_cap: float = math.inf):
        self.rate = float(rate)
        self.band = float(band)
        self.g2_cap = float(g2_cap)
        self.value = 0.0
        self.g2 = 0.0

    def update(self, grad: float) -> None:
        g = float(grad)
        if g == 0.0:
            return
        self.g2 = min(self.g2 + g * g, self.g2_cap)
        v = self.value - self.rate * g / math.sqrt(self.g2)
        self.value = min(max(v, -self.band), self.band)

    def reset(self) -> None:
        self.value = 0.0
        self.g2 = 0.0

    def state_dict(self) -> dict:
        return {"value": self.value, "g2": self.g2}

    def load_state_dict(self, state: dict) -> None:
        try:
            self.value = float(state["value"])
            self.g2 = float(state["g2"])
        except (KeyError, TypeError, ValueError) as exc:
            raise UserError(f"AdaGrad state is malformed: {exc}") from None
