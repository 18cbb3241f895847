"""Non-negative least squares, fitted for relative error: the solver under the cost models.

Costs add up (a step's time is a sum of per-row, per-sequence and per-context-token terms), and a
negative term would be a kernel that gets faster with more work; unconstrained least squares
happily trades one term's sign against a collinear other's. So every coefficient is kept >= 0
by Lawson and Hanson's active-set NNLS (1974), in numpy so the coordinator can run it.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

MAX_OUTER_STEPS_PER_COLUMN = 3  # Lawson-Hanson ends in about n outer steps; 3n is a safe cap


class FitStats(NamedTuple):
    """How well a cost model fitted: mean absolute error in percent of the measured time."""

    num_train: int
    train_mae_pct: float
    num_heldout: int
    heldout_mae_pct: float | None  # None: nothing was held out


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """argmin ||a @ x - b|| over x >= 0. a: [m, n], b: [m] -> x: [n]."""
    m, n = a.shape
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)  # the columns free to move (x > 0)
    tol = 10 * np.finfo(float).eps * max(m, n) * max(np.abs(a).sum(axis=0).max(), 1.0)
    for _ in range(MAX_OUTER_STEPS_PER_COLUMN * n + 1):
        gradient = a.T @ (b - a @ x)  # descent direction; > 0 where a column would help
        if passive.all() or (gradient[~passive] <= tol).all():
            break
        passive[np.argmax(np.where(passive, -np.inf, gradient))] = True
        x, passive = _inner_loop(a, b, x, passive, tol)
    return x


def _inner_loop(
    a: np.ndarray, b: np.ndarray, x: np.ndarray, passive: np.ndarray, tol: float
) -> tuple[np.ndarray, np.ndarray]:
    """Solves on the passive columns, stepping back toward x while the solution goes negative."""
    while True:
        z = np.zeros_like(x)
        z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
        shrinking = passive & (z <= tol)
        if not shrinking.any():
            return z, passive
        # The largest step from x toward z that keeps every passive coefficient >= 0.
        alpha = np.min(x[shrinking] / (x[shrinking] - z[shrinking]))
        x = x + alpha * (z - x)
        passive = passive & (x > tol)
        x[~passive] = 0.0


def fit_relative(features: np.ndarray, seconds: np.ndarray) -> np.ndarray:
    """Non-negative coefficients minimising the squared *relative* error of features @ coef.

    Step times span 10 ms decodes to 500 ms prefills; plain least squares would fit the long
    steps and leave the short ones (most of serving) 20% off. Dividing each row by its time
    makes every step count by its percentage error, the quantity we report. Columns are scaled
    to unit size first so the solver's tolerance means the same for a count of 1 and a sum of
    a million context tokens. features: [m, n], seconds: [m] -> coefficients: [n].
    """
    if features.shape[0] == 0:
        raise ValueError("no measurements to fit")
    if (seconds <= 0).any():
        raise ValueError("every measured time must be positive")
    weighted = features / seconds[:, None]
    scale = np.abs(weighted).max(axis=0)
    scale[scale == 0] = 1.0  # a feature that is 0 everywhere keeps coefficient 0
    return nnls(weighted / scale, np.ones(len(seconds))) / scale


def mean_abs_pct(predicted: np.ndarray, seconds: np.ndarray) -> float:
    """Mean of |predicted - measured| / measured, in percent."""
    if len(seconds) == 0:
        raise ValueError("no measurements to score")
    return float(np.mean(np.abs(predicted - seconds) / seconds) * 100)
