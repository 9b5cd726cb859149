"""Decode time per token = fixed + per-MiB x MiB read: fitted by least squares from measured runs, neither term
below 0 (`fit_line`, the one line fit of `tune` and `bench`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np


@dataclass(slots=True)
class CostModel:
    """Seconds per token as a line in MiB read per token; r2 says how well the line explains the runs."""

    fixed_s: float
    per_mib_s: float
    r2: float
    points: int

    def predict_s_per_token(self, mib_per_token):
        """Seconds per token at `mib_per_token` read (a number or a numpy array of them)."""
        return self.fixed_s + self.per_mib_s * mib_per_token

    def to_dict(self) -> dict:
        return asdict(self)


def fit_line(x, y) -> tuple[float, float] | None:
    """(intercept, slope) of the least-squares line y = intercept + slope x with neither below 0 (a cost is not
    negative: timing noise can tilt an unconstrained fit below 0); None with fewer than 2 distinct x. Where the
    unconstrained fit makes a term negative, the best fit lies on an edge of the allowed quadrant: the line through
    the origin (intercept 0) or the flat line (slope 0), each with its other term at 0 or more; the one with the
    smaller squared error is the non-negative least-squares fit. Both of `tune`'s fits use it: bench's
    `fit_cost_model` and calibration's read line (`overlap_model.fit_read_line`)."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    if len(x) < 2 or np.ptp(x) == 0:
        return None
    slope, intercept = np.polyfit(x, y, 1)
    if slope >= 0 and intercept >= 0:
        return float(intercept), float(slope)
    edges = [(0.0, max(float(x @ y / (x @ x)), 0.0)), (max(float(y.mean()), 0.0), 0.0)]
    return min(edges, key=lambda line: float(((y - line[0] - line[1] * x) ** 2).sum()))


def fit_cost_model(mib_per_token: list[float], s_per_token: list[float]) -> CostModel | None:
    """Least-squares line, neither term below 0 (`fit_line`); None with fewer than 2 distinct read volumes (no
    spread, no slope)."""
    x, y = np.asarray(mib_per_token, float), np.asarray(s_per_token, float)
    line = fit_line(x, y)
    if line is None:
        return None
    intercept, slope = line
    residual = y - (intercept + slope * x)
    total = ((y - y.mean()) ** 2).sum()
    r2 = 1.0 - (residual**2).sum() / total if total > 0 else 1.0
    return CostModel(intercept, slope, float(r2), len(x))
