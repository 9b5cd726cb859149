"""Decode time per token = fixed + per-MiB x MiB read: fitted by least squares from measured runs."""

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


def fit_cost_model(mib_per_token: list[float], s_per_token: list[float]) -> CostModel | None:
    """Least-squares line; None with fewer than 2 distinct read volumes (no spread, no slope)."""
    x, y = np.asarray(mib_per_token, float), np.asarray(s_per_token, float)
    if len(x) < 2 or np.ptp(x) == 0:
        return None
    slope, intercept = np.polyfit(x, y, 1)
    residual = y - (intercept + slope * x)
    total = ((y - y.mean()) ** 2).sum()
    r2 = 1.0 - (residual**2).sum() / total if total > 0 else 1.0
    return CostModel(float(intercept), float(slope), float(r2), len(x))
