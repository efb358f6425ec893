"""The repeats' summary, pure functions only: median, mean and a t-interval of a stage's repeated runs. The bench
stage stands on it without the knee search (probing.py), so that editing the search leaves bench's numbers as they
are (tests/test_dvc_deps.py)."""
from __future__ import annotations

import math
import statistics

from scipy import stats as sps


def tq(confidence: float, df: float) -> float:
    """The two-sided Student t quantile at `confidence`; inf below 1 df (no interval)."""
    return math.inf if df < 1 else float(sps.t.ppf((1 + confidence) / 2, df))


def fmt_g(v: float | None) -> str:
    return "–" if v is None else "∞" if math.isinf(v) else "0" if not v else f"{v:g}"


def summarize(values: list[float]) -> dict:
    """Median (what the report shows), mean and a 95 % t-interval of the mean; the interval needs n >= 2."""
    vals = [float(v) for v in values]
    n = len(vals)
    out = {"n": n, "values": vals, "median": statistics.median(vals) if vals else None,
           "mean": statistics.fmean(vals) if vals else None, "ci95": None, "rel_halfwidth": None}
    if n >= 2:
        sd = statistics.stdev(vals)
        half = tq(0.95, n - 1) * sd / math.sqrt(n)
        out.update(sd=sd, ci95=[out["mean"] - half, out["mean"] + half],
                   rel_halfwidth=half / out["mean"] if out["mean"] else None)
    return out
