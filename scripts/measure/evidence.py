"""A knee look's evidence level and the fewest counted requests with which it can pass (pure).

A leaf: it imports nothing of the project. config validates knee.max_prompts by `pass_minimum` (a probe capped
below it could never pass), and every stage validates params.yaml, so whatever this imports every stage would stand
on; measure/probing.py and measure/frontend.py judge the looks by the same numbers.
A probe's pass/fail is a test on the count of its counted requests that broke the SLO, as MLPerf LoadGen's early
stopping does: a point p95 of ~80 requests in a non-steady window swung 942 / 784 / 332 ms on one trace back to back.
Requests over the SLO come in bursts (a cluster of arrivals queues together), so their count varies `phi` times as
much as a binomial's (knee.dispersion, measured by `make benchmark` part 6): the test counts counted/phi requests.
What the judgement and the report read of the knee's measuring lives here too (GRID_ROUNDING, SHORT_PROBE_FLAG), so
the gate and report stages stand on this leaf, not on the knee search (measure/probing.py); and the pairs of fresh
servers a better knee is re-checked on (KNEE_BETTER_ROUNDS), knee.better_pairs' default and the judgement's.
"""
from __future__ import annotations

import math

GRID_ROUNDING = 1e-3  # relative: probing.grid_rate keeps 4 significant figures (at most 5e-4 off); a knee
                     # compared with a grid rate (stats.knee_delta) is taken as on it within this
SHORT_PROBE_FLAG = "probes short against latency: may read high"  # the knee's flag, as printed and reported
KNEE_BETTER_ROUNDS = 2  # pairs of fresh servers a better knee is re-checked on (stats.recheck_rounds): the default
                        # of knee.better_pairs, which a profile may set
PROBE_CONFIDENCE = 0.95  # one-sided, per visit of a rate: its up to knee.max_repeats pooled looks share the 5 %
                         # (look_confidence); at 5 % a look, three looks failed a share of exactly q in 9 % (simulated)


def look_confidence(looks: int) -> float:
    """The confidence of each look at a rate whose visit may take `looks` pooled looks (Bonferroni: the visit as a
    whole errs in at most 1 - PROBE_CONFIDENCE each way)."""
    return 1 - (1 - PROBE_CONFIDENCE) / max(looks, 1)


def pass_minimum(percentile: float, phi: float = 1.0, looks: int = 1) -> int:
    """The fewest counted requests with which one look can pass: none of them over the SLO must be that unlikely
    (P <= 1 - look_confidence(looks)) were q of all requests breaking it, counts divided by `phi`."""
    q = 1 - percentile / 100
    return math.ceil(max(phi, 1.0) * math.log(1 - look_confidence(looks)) / math.log(1 - q) - 1e-9)
