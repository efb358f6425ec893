"""The knee search's maths, pure functions only (unit-tested on fixture numbers): a knee probe's size and its counted
evidence (a binomial bound on the share of requests over the SLO, as MLPerf LoadGen's early stopping), the knee
search on its grid (next rate, bracket, result). Only the knee stage stands on it (the bench's summary of its
repeats is measure/summary.py; the pass minimum that params.yaml is checked by is measure/evidence.py's, a leaf
config imports); what judges their numbers (stats.py) imports it, never the other way round."""
from __future__ import annotations

import math

import numpy as np
from scipy import special

from measure.evidence import (  # noqa: F401 -- GRID_ROUNDING, SHORT_PROBE_FLAG: the knee reads them here too
    GRID_ROUNDING,
    PROBE_CONFIDENCE,
    SHORT_PROBE_FLAG,
    look_confidence,
    pass_minimum,
)
from measure.summary import fmt_g


def failed_on_evidence(row: dict) -> bool:
    """A look that did not pass for a known reason (slo_evidence 'fail', a failed request or a backlog), not merely
    for want of evidence (inconclusive after max_repeats)."""
    return not row.get("passed") and bool(row.get("evidence") in (None, "fail") or row.get("failed")
                                          or row.get("backlog"))


def conclusive_fail(rows: list[dict]) -> float | None:
    """The lowest rate that failed on evidence (failed_on_evidence): a knee only moves past a boundary that is
    known."""
    fails = [r["offered_rps"] for r in rows if failed_on_evidence(r)]
    return min(fails) if fails else None


# ---------------------------------------------------------------- knee search
def tail_requests(percentile: float, beyond: int = 3) -> int:
    """Requests a probe must complete (ramp-up excluded) for its `percentile` to rest on `beyond` requests
    above it rather than on the maximum: p99 -> 300, p95 -> 60, p90 -> 30."""
    return math.ceil(round(beyond / (1 - percentile / 100), 6))


def probe_minimum(percentile: float, ramp_fraction: float) -> int:
    """Requests a probe must send so that `tail_requests` remain once the ramp-up share is dropped."""
    return math.ceil(tail_requests(percentile) / (1 - ramp_fraction))


def _binom_le(k: float, n: float, q: float) -> float:
    """P[X <= k] for X ~ Binomial(n, q), continued to real n and k (the regularized incomplete beta)."""
    return 1.0 if k >= n else float(special.betainc(n - k, k + 1, 1 - q))


def _binom_ge(k: float, n: float, q: float) -> float:
    """P[X >= k] for X ~ Binomial(n, q), continued to real n and k."""
    return 1.0 if k <= 0 else float(special.betainc(k, n - k + 1, q)) if k <= n else 0.0


def slo_evidence(counted: int, over: int, percentile: float, confidence: float = PROBE_CONFIDENCE,
                 phi: float = 1.0) -> dict:
    """Whether the SLO holds at `percentile` from `over` of `counted` requests breaking it: with q = 1 -
    percentile/100 the share allowed over it, 'pass' when so few breaches would be that unlikely were q (or more)
    breaking it (P[X <= over | counted, q] <= 1 - confidence), 'fail' when so many would be that unlikely were at
    most q (P[X >= over] <= 1 - confidence), else 'inconclusive' (probe again). Binomial, with every count divided
    by `phi` (the requests' dispersion: a quasi-binomial test; phi 1 is the exact binomial)."""
    if not 0 <= over <= counted:
        raise ValueError(f"{over} requests over the SLO of {counted} counted")
    q, phi = round(1 - percentile / 100, 6), max(phi, 1.0)
    n, k = counted / phi, over / phi
    p_pass = _binom_le(k, n, q) if counted else 1.0
    p_fail = _binom_ge(k, n, q) if counted else 1.0
    alpha = 1 - confidence
    verdict = "pass" if p_pass <= alpha else "fail" if p_fail <= alpha else "inconclusive"
    return {"counted": counted, "over_slo": over, "allowed_share": q, "confidence": confidence, "phi": phi,
            "verdict": verdict, "p_pass": round(p_pass, 4), "p_fail": round(p_fail, 4)}


def fail_count(n: int, percentile: float, phi: float = 1.0, confidence: float = PROBE_CONFIDENCE) -> int | None:
    """The fewest requests over the SLO with which a look that sends `n` fails whatever the others show: their
    evidence is 'fail' even were all `n` counted (a fail's evidence only weakens as requests within the SLO are
    added). A look stops sending once it has that many (knee_looks.Curtail): its counts only grow, so watching them as
    they come stops a look no more often than the whole look's test would fail it. None where even `n` over would
    not fail."""
    if not n or slo_evidence(n, n, percentile, confidence, phi)["verdict"] != "fail":
        return None
    lo, hi = 0, n  # slo_evidence(n, k) fails for every k >= the answer
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if slo_evidence(n, mid, percentile, confidence, phi)["verdict"] == "fail" else (mid, hi)
    return hi


def stop_count(n: int, visit: list[dict], percentile: float, phi: float = 1.0, looks: int = 1) -> int | None:
    """The requests over the SLO a look that sends `n` stops at (knee_looks.Curtail): fail_count over every request its
    visit could count (the `visit`'s earlier looks' counted and these n, each look at look_confidence(looks)),
    less the earlier looks' over; at least 1. None where no count would fail it."""
    need = fail_count(n + sum(r["counted"] for r in visit), percentile, phi, look_confidence(looks))
    return None if need is None else max(need - sum(r["over_slo"] or 0 for r in visit), 1)


def over_slo(r: dict, slo: dict) -> bool:
    """Whether one request broke the SLO: it failed, or its TTFT or TPOT is over budget."""
    return (not r["ok"] or r["ttft"] * 1000 > slo["ttft_ms"]
            or (r["tpot"] is not None and r["tpot"] * 1000 > slo["tpot_ms"]))


def dispersion_of(probes: list[dict], slo: dict, block_s: float = 4.0) -> dict:
    """How much more the count of requests over the SLO varies than a binomial count, from probes ({offered_rps,
    counted, over_slo, window: their counted requests}): between the probes of one rate (Pearson chi-square over
    each rate probed more than once, against the rate's pooled share) and within each probe, over blocks of
    `block_s` seconds of arrivals (against the probe's own share); only probes near the knee count (a share over
    0 and under a half). `phi`: the two pooled by their degrees of freedom, what knee.dispersion takes."""
    def chi(groups: list[list[tuple[int, int]]]) -> tuple[float, int]:
        x2, df = 0.0, 0
        for g in groups:
            n, o = sum(c for c, _ in g), sum(v for _, v in g)
            p = o / n if n else 0.0
            if len(g) < 2 or not 0 < p < 0.5:
                continue
            x2 += sum((v - c * p) ** 2 / (c * p * (1 - p)) for c, v in g if c)
            df += sum(1 for c, _ in g if c) - 1
        return x2, df
    by_rate: dict[float, list[tuple[int, int]]] = {}
    for pr in probes:
        by_rate.setdefault(pr["offered_rps"], []).append((pr["counted"], pr["over_slo"]))
    blocks = []
    for pr in probes:
        win = pr["window"]
        cells: dict[int, list[int]] = {}
        for r in win:
            cell = cells.setdefault(int((r["start"] - win[0]["start"]) // block_s), [0, 0])
            cell[0] += 1
            cell[1] += over_slo(r, slo)
        blocks.append([tuple(c) for c in cells.values()])
    (xb, db), (xw, dw) = chi(list(by_rate.values())), chi(blocks)
    return {"between": round(xb / db, 2) if db else None, "between_df": db,
            "within": round(xw / dw, 2) if dw else None, "within_df": dw, "block_s": block_s,
            "phi": round(max((xb + xw) / (db + dw), 1.0), 1) if db + dw else None,
            "probes": sum(len(g) for g in by_rate.values() if len(g) > 1)}


def evidence_words(e: dict) -> str:
    return (f"{e['over_slo']} of {e['counted']} counted requests over the SLO ({e['verdict']} at "
            f"{e['confidence'] * 100:.3g}% that at most {e['allowed_share']:.0%} break it)")


def pooled_evidence(rows: list[dict], rate: float, percentile: float, phi: float = 1.0,
                    confidence: float = PROBE_CONFIDENCE) -> dict:
    """The evidence of the probes of one rate in `rows` (one visit of it), their counts added (each a fresh draw on
    one server). A pass stands only on probes whose window opened once the server had filled (`settled`: a filling
    server reads low); a fail on every probe's counts or on the settled ones alone."""
    at = [r for r in rows if r.get("offered_rps") == rate and r.get("counted") is not None]
    steady = [r for r in at if r.get("settled", True)]

    def ev(group: list[dict]) -> dict:
        return slo_evidence(sum(r["counted"] for r in group), sum(r.get("over_slo") or 0 for r in group), percentile,
                            confidence, phi)
    every = ev(at)
    if len(steady) == len(at):
        return every
    settled = ev(steady)
    if every["verdict"] == "fail" or settled["verdict"] in ("pass", "fail"):
        return {**(every if every["verdict"] == "fail" else settled), "unsettled": len(at) - len(steady)}
    return {**every, "verdict": "inconclusive", "unsettled": len(at) - len(steady)}


def probe_prompts(rate: float, seconds: float, percentile: float, ramp_fraction: float, lo: int, hi: int,
                  e2e_s: float = 0.0, settle: float = 0.0, tail: float = 0.0, phi: float = 1.0,
                  looks: int = 1) -> int:
    """Requests one probe sends: `seconds` of counted arrivals at `rate`, and never fewer counted than one look's
    pass needs (pass_minimum: the dispersion `phi`, the visit's `looks`); before them `settle` end-to-end
    latencies (`e2e_s`, an estimate) of arrivals that fill the server, after them `tail` more that keep it full
    while the last counted ones finish; at least the percentile's need once the ramp-up share is dropped; within
    [lo, hi]."""
    counted = max(rate * seconds, COUNT_MARGIN * pass_minimum(percentile, phi, looks))
    n = max(counted + rate * (settle + tail) * e2e_s, (counted + rate * tail * e2e_s) / (1 - ramp_fraction))
    return int(min(max(math.ceil(n - 1e-9), probe_minimum(percentile, ramp_fraction), lo), hi))


COUNT_MARGIN = 1.1  # a probe is sized before its latency is known: 10 % more than a pass needs, so that one that
                    # ran a little slower than its estimate can still pass alone


def _pct(values: list[float], p: float) -> float | None:
    """numpy's default (linear) percentile, as `vllm bench serve` computes its own."""
    return float(np.percentile(values, p)) if len(values) else None


SETTLE_CAP = 0.5  # the window opens at the latest halfway through the arrivals: a probe short against its latency
                 # still counts its second half (a fail there stands: the fill phase reads low), but cannot pass


def counted_window(reqs: list[dict], ramp_fraction: float, settle: float = 0.0, tail: float = 0.0,
                   rate: float | None = None) -> dict:
    """Which of a probe's requests (sorted by arrival) are counted: those that arrived once the server had filled,
    and while it stayed full. A server offered a steady rate fills its batch over about one end-to-end latency (an
    H200 probe's TPOT rose 6.6 -> 9.9 ms over its first 2 s of arrivals, then held); the last arrivals meet a batch
    that drains. So the window leaves out the first `ramp_fraction` of arrivals and `settle` end-to-end latencies of
    them, and `tail` latencies of them before the last; the latency is the median of the requests that arrived in
    the second half (nearest the steady state). With the offered `rate` those latencies are counted in arrivals
    (rate x latency of them), as probe_prompts sized the look: the count is then what the sizing planned, less only
    what the latency ran over its estimate. In seconds instead (no `rate`: how looks were counted before, and the
    H200 study's were), the Poisson arrivals before and after the window swing the count by about
    sqrt(rate x (settle + tail) x latency): on the cpu ~7 of a pass's ~150, enough to leave a look that met its
    SLO one request short of a pass. Where that leaves less than half the arrivals, the window is their second half
    and `settled` is False: the server may still have been filling. Returns {lo, hi: indices; open_s, close_s:
    seconds from the first arrival; e2e_s; settled}."""
    n = len(reqs)
    if not n:
        return {"lo": 0, "hi": 0, "open_s": 0.0, "close_s": 0.0, "e2e_s": None, "settled": False}
    t0, t1 = reqs[0]["start"], reqs[-1]["start"]
    late = [r["end"] - r["start"] for r in reqs if r["ok"] and r["start"] >= (t0 + t1) / 2]
    e2e = _pct(late, 50) or 0.0
    if rate:
        skip, drop = math.ceil(rate * settle * e2e - 1e-9), math.ceil(rate * tail * e2e - 1e-9)
        lo, hi = max(int(n * ramp_fraction), skip), max(n - drop, 0)  # a negative end would slice from the back
        settled = lo <= SETTLE_CAP * hi if hi > 0 else not settle
        if not settled:
            lo, hi = n // 2, n
        close_t = reqs[hi - 1]["start"] if hi > lo else t1
    else:
        open_t, close_t = t0 + settle * e2e, t1 - tail * e2e
        settled = open_t <= t0 + SETTLE_CAP * (close_t - t0) if close_t > t0 else not settle
        if not settled:
            open_t, close_t = t0 + SETTLE_CAP * (t1 - t0), t1
        lo = int(n * ramp_fraction)
        while lo < n and reqs[lo]["start"] < open_t:
            lo += 1
        hi = lo
        while hi < n and reqs[hi]["start"] <= close_t:
            hi += 1
    return {"lo": lo, "hi": hi, "open_s": round((reqs[lo]["start"] if lo < n else t1) - t0, 2),
            "close_s": round(close_t - t0, 2), "e2e_s": round(e2e, 3), "settled": settled}


def tail_stats(reqs: list[dict], percentile: float, ramp_fraction: float, backlog_ratio: float,
               slo: dict | None = None, settle: float = 0.0, tail: float = 0.0, rate: float | None = None) -> dict:
    """A probe's SLO figures from its requests ({start, ttft, tpot, end, ok}, seconds; vllm_compat.serve_requests).

    - Counted: the requests of counted_window (the server full and steady; the settle and tail in arrivals at the
      offered `rate` where it is given): `over_slo` of them broke `slo` (a
      failed one breaks it), slo_evidence's count; the percentiles are theirs.
    - Backlog: a queue of requests waiting to be admitted. In the second half of the arrival window, a server that
      keeps up gives about as many first tokens as requests arrive; a growing queue gives fewer. Counted inside the
      window, so the drain after the last arrival does not hide it. First tokens, not completions: completions
      trail arrivals by a whole request's latency, which keeps rising while the batch fills. On 59 saved H200
      probes, on the 27 that met their own SLO, the completions' shortfall swung by SD 0.107 of the arrivals (one
      false backlog), the first tokens' by 0.028 (none).
    - What first tokens cannot see: a running batch that keeps growing with no admission queue yet. A probe short
      against its latency ends before its TPOT shows that, so `e2e_over_window` (p50 end-to-end latency / the
      half-window) is kept: a knee whose passing probes are short against their own latency is flagged
      (short_probes), not trusted."""
    reqs = sorted(reqs, key=lambda r: r["start"])
    w = counted_window(reqs, ramp_fraction, settle, tail, rate)
    window = reqs[w["lo"]:w["hi"]]
    kept = [r for r in window if r["ok"]]
    # `slo`: the requests of the counted window that broke it (a failed one breaks it): slo_evidence's count
    over = None if slo is None else sum(1 for r in window if over_slo(r, slo))
    t0, t1 = (reqs[0]["start"], reqs[-1]["start"]) if reqs else (0.0, 0.0)
    mid = (t0 + t1) / 2
    # a request cut in flight (vllm_compat.CUT: over the SLO for certain) may have had its first token or not: it is
    # neither an arrival owed one nor a first token (a server bound by TPOT would read a backlog it does not have)
    arrived = sum(1 for r in reqs if r["start"] >= mid and not r.get("cut"))
    first = sum(1 for r in reqs if r["ok"] and mid <= r["start"] + r["ttft"] <= t1)
    done = sum(1 for r in reqs if r["ok"] and mid <= r["end"] <= t1)  # reported, not judged (see above)
    e2e = _pct([r["end"] - r["start"] for r in kept], 50)
    # Even a server that keeps up gives in the window the first tokens of arrivals one TTFT earlier: the two counts
    # differ by two independent Poisson counts of ~rate x TTFT each. A shortfall is backlog only beyond that
    # noise (z = 2.33, 1 % one-sided) and beyond (1 - backlog_ratio) of the arrivals. The TTFT is a low one
    # (p10): a growing queue inflates the median, which would widen the allowance exactly when it should not.
    lat = _pct([r["ttft"] for r in kept], 10) or 0.0
    rate = arrived / (t1 - mid) if t1 > mid else 0.0
    allow = max((1 - backlog_ratio) * arrived, 2.33 * math.sqrt(2 * rate * lat))
    return {"percentile": percentile, "counted": len(window) if over is not None else len(kept),
            "over_slo": over, "ramp_skipped": w["lo"], "window_open_s": w["open_s"], "window_close_s": w["close_s"],
            "e2e_p50_s": w["e2e_s"], "settled": w["settled"], "needed": tail_requests(percentile),
            "ttft_ms": _ms(_pct([r["ttft"] for r in kept], percentile)),
            "tpot_ms": _ms(_pct([r["tpot"] for r in kept if r["tpot"] is not None], percentile)),
            "window_arrivals": arrived, "window_first_tokens": first, "window_completions": done,
            "window_allowance": round(allow, 1), "backlog": bool(arrived and arrived - first > allow),
            "e2e_over_window": round(e2e / (t1 - mid), 2) if e2e is not None and t1 > mid else None}


# A probe whose requests take longer than half its half-window to complete ends while the batch is still
# filling: a batch that would keep growing (decode overload below max_num_seqs) has not shown in its TPOT yet.
# Simulated (step-level continuous batching, this search): a decode-bound server whose end-to-end latency was
# about the probe's length read 1.8x its steady-state knee; the same with 3x longer probes, 1.06x.
SHORT_PROBE_SHARE = 0.5


def short_probes(rows: list[dict], knee_rps: float | None) -> bool:
    """Whether the probes that passed at the knee were short against their own end-to-end latency."""
    at = [r for r in rows if r.get("offered_rps") == knee_rps and r.get("passed")]
    return any((r.get("e2e_over_window") or 0) > SHORT_PROBE_SHARE for r in at)


def _ms(v: float | None) -> float | None:
    return None if v is None else v * 1000


def probe_passes(row: dict, slo: dict, evidence: dict | None = None) -> tuple[bool, str]:
    """A probe meets the SLO when nothing failed, no backlog grew, and `evidence` (slo_evidence over its rate's
    probes) says pass; rows without evidence (older records): TTFT and TPOT at the SLO's percentile within budget
    and enough requests counted for that percentile."""
    why, p = [], f"p{slo['percentile']:g}"
    if row.get("failed", 0):
        why.append(f"{row['failed']} failed requests")
    if row.get("backlog"):
        why.append("backlog (first tokens fell behind arrivals)")
    if evidence is not None:
        if evidence["verdict"] != "pass":
            why.append(evidence_words(evidence))
        return (not why), "; ".join(why)
    if row.get("counted") is not None and row.get("needed") and row["counted"] < row["needed"]:
        why.append(f"{row['counted']} requests counted, a {p} needs {row['needed']}")
    for m in ("ttft", "tpot"):
        v = row.get(f"slo_{m}_ms")
        if v is None or v > slo[f"{m}_ms"]:
            why.append(f"{p} {m.upper()} {fmt_g(v) if v is not None else None} ms > {slo[f'{m}_ms']:g} ms")
    return (not why), "; ".join(why)


def rate_verdicts(probes: list[tuple[float, bool]]) -> dict[float, bool]:
    """One verdict per probed rate: it passes only when every probe of it passed (a repeat can only fail it)."""
    out: dict[float, bool] = {}
    for r, ok in probes:
        out[r] = out.get(r, True) and ok
    return out


def mixed_rates(probes: list[tuple[float, bool]]) -> list[float]:
    """Rates probed more than once with different outcomes: the SLO boundary is noisy there."""
    seen: dict[float, set] = {}
    for r, ok in probes:
        seen.setdefault(r, set()).add(ok)
    return sorted(r for r, v in seen.items() if len(v) > 1)


def bracket(probes: list[tuple[float, bool]]) -> tuple[float | None, float | None]:
    """(last pass, first fail): the lowest failing rate and the highest passing rate below it."""
    verdicts = rate_verdicts(probes)
    fails = [r for r, ok in verdicts.items() if not ok]
    first_fail = min(fails) if fails else None
    passes = [r for r, ok in verdicts.items() if ok and (first_fail is None or r < first_fail)]
    return (max(passes) if passes else None), first_fail


def width(lo: float, hi: float) -> float:
    """A bracket's width relative to its midpoint: 0.2 = the knee known to +/- 10 %."""
    return (hi - lo) / ((hi + lo) / 2)


# The search probes a fixed geometric grid of rates (anchored at 1 req/s), and each (rate, repeat) has its own
# seed: every rung and fresh server that probes a rate sends it the same arrival sequence (common random numbers).
# A short probe is shaped by where its Poisson bursts fall: on the CPU one seed's per-request TPOTs correlated
# 0.92-0.99 across fresh servers, two seeds' at one rate 0.01-0.17. Seeds numbered by probe, and starts at half of
# each rung's bench req/s, rarely gave two rungs the same draw at a rate.
SEED_BASE = 50_000  # probe seeds: SEED_BASE + 100 x grid index + repeat (warm-up 0, batch-1 10,000)


def grid_steps(rel_tol: float) -> int:
    """Grid points per doubling: the fewest for which two neighbours are within rel_tol (20 % -> 4: 2^(1/4))."""
    return math.ceil(math.log(2) / math.log((2 + rel_tol) / (2 - rel_tol)) - 1e-9)


def grid_index(rate: float, steps: int) -> int:
    return round(math.log2(rate) * steps)


def grid_rate(i: int, steps: int) -> float:
    return float(f"{2 ** (i / steps):.4g}")


def probe_seed(rate: float, probes: list[tuple[float, bool]], steps: int) -> int:
    """The arrival sequence of a probe at `rate`: the same for every rung, a fresh one for each repeat."""
    return SEED_BASE + 100 * grid_index(rate, steps) + sum(1 for r, _ in probes if r == rate)


FAR_SHARE = 0.9  # a rate whose visit had this share of its counted requests over the SLO (or a backlog) is far above
                 # the wall: the search halves below it. Nearer, one grid step (H200, 1.24x its knee: 2-72 % over)


ANCHOR_RATES = ("pass", "fail", "worse")  # run.anchor's keys that are request rates the search may probe


def anchor_rates(anchor: dict | None, min_rate: float | None, max_rate: float) -> dict:
    """run.anchor's rates inside [min_rate, max_rate], with its `bracket` and `last` flags; the rest of run.anchor
    (latency: what sizes a look) is not a rate."""
    return {key: v for key, v in (anchor or {}).items() if key in ("bracket", "last") or
            (key in ANCHOR_RATES and v and (not min_rate or v >= min_rate) and v <= max_rate * (1 + GRID_ROUNDING))}


def anchored_rate(anchor: dict, verdicts: dict, steps: int, min_rate: float | None,
                  unsure: frozenset | set) -> tuple[bool, float | None]:
    """next_rate's step at the anchors (anchor_rates): (True, the next rate or None: stop) where they decide it,
    (False, None) where the search goes on as without them."""
    if not (anchor.get("pass") or anchor.get("fail")):
        return False, None
    first, then = (anchor["fail"], anchor.get("pass")) if anchor.get("fail") else (anchor["pass"], None)
    if first not in verdicts:
        return True, first
    if not verdicts[first]:
        if then and then not in verdicts:
            return True, then
        if not anchor.get("bracket"):
            # failed on evidence at the base's pass: worse beyond knee.noise_floor only at or below `worse`: one
            # visit there (its grid rate at or below it), then stop whatever it found
            worse = anchor.get("worse")
            if worse and then and then not in unsure and not verdicts[then]:
                below = grid_rate(math.floor(math.log2(worse) * steps + 1e-9), steps)
                if below not in verdicts and (not min_rate or below >= min_rate):
                    return True, below
            return True, None
        if first not in unsure and (not then or verdicts[then]):
            return True, None
    elif anchor.get("last") and not anchor.get("bracket"):
        return True, None
    return False, None


def bisected_rate(lo: float, hi: float, verdicts: dict, steps: int, rel_tol: float) -> float | None:
    """The unprobed grid rate nearest the middle of the bracket [lo, hi] (the higher of two), or None where it is at
    most `rel_tol` wide or none is left."""
    if width(lo, hi) <= rel_tol:
        return None
    li, hi_i = grid_index(lo, steps), grid_index(hi, steps)
    seen = {grid_index(r, steps) for r in verdicts}
    left = [i for i in range(li + 1, hi_i) if i not in seen]
    if not left:
        return None
    mid = (li + hi_i) / 2
    return grid_rate(min(left, key=lambda i: (abs(i - mid), -i)), steps)


def next_rate(probes: list[tuple[float, bool]], start: float, max_rate: float, rel_tol: float,
              max_probes: int, min_rate: float | None = None, anchor: dict | None = None,
              unsure: frozenset | set = frozenset(), far: frozenset | set = frozenset(),
              near: int = 0) -> float | None:
    """The next rate to probe, or None when done, on the grid of `grid_steps(rel_tol)` rates per doubling. `unsure`:
    rates whose evidence was left inconclusive (not passed, but not failed on evidence either); `far`: rates that
    failed far above the wall (FAR_SHARE).

    With an `anchor` (the base's knee: {pass: its last pass, fail: its first fail on evidence}; a rung's search):
    the base's fail first; where the rung does not pass there, the base's pass, and then stop: its knee verdict
    (within noise, or worse where it failed on evidence at the base's pass) needs no more, and a rung that is not
    better is not kept, so no later rung starts from its knee. With a knee.noise_floor (the anchor's `worse`: the
    base's pass / (1 + floor)), a fail at the base's pass is followed by one visit to the grid rate at or below
    `worse`, where a fail on evidence is worse beyond the floor. Where it passed at the base's fail (better: it may be
    the next base), on as below, to its own bracket, unless the anchor says `last` (no later rung starts from it, and
    a confirm pair searches its stack again): then it stops there. With `bracket` set (a confirm pair's runs, whose
    knees the headline prints) it stops after the anchors only where they are its bracket (a fail on evidence, then a
    pass). Anchors outside [min_rate, max_rate] are not probed.
    Without one (rung 0), from the grid rate nearest `start`: up (a doubling after a pass,
    one grid step after an inconclusive rate: the wall is near) until a rate fails on evidence or `max_rate` passes;
    down while nothing passed (to `min_rate`): a doubling below a rate in `far` (most of its requests over the SLO,
    or a backlog: far above the wall), else one grid step (a look that fails stops early, knee_looks.Curtail, so a fail
    costs little where a pass below the wall costs a whole look); within `near` grid rates of the first rate probed
    (knee.start_steps: a start the bench's req/s put at the knee), one grid step either way, a pass or a far fail
    alike (from a start at the knee, a doubling overshoots the bracket and bisects back to it); then bisect, on the
    grid, between the last pass and the first fail on evidence, until the bracket is at most `rel_tol` wide or no
    rate between them is left unprobed (inconclusive ones in between: the knee is there). Each rate is visited once:
    its evidence is pooled over the probes of that visit, not re-drawn later."""
    if len(probes) >= max_probes:
        return None
    steps = grid_steps(rel_tol)
    top = math.floor(math.log2(max_rate) * steps + 1e-9)
    verdicts = rate_verdicts(probes)
    anchor = anchor_rates(anchor, min_rate, max_rate)
    decided, rate = anchored_rate(anchor, verdicts, steps, min_rate, unsure)
    if decided:
        return rate
    if not probes:  # the grid rate nearest start, inside [min_rate, max_rate] where they are off the grid
        bottom = math.ceil(math.log2(min_rate) * steps - 1e-9) if min_rate else -math.inf
        return grid_rate(max(min(grid_index(start, steps), top), bottom), steps)
    min_rate = min_rate or start / 16
    bottom = math.ceil(math.log2(min_rate) * steps - 1e-9)
    fails = [r for r, ok in verdicts.items() if not ok and r not in unsure]
    hi = min(fails) if fails else None
    lo = max((r for r, ok in verdicts.items() if ok and (hi is None or r < hi)), default=None)
    first = grid_index(probes[0][0], steps)
    near = 0 if anchor.get("pass") or anchor.get("fail") else near  # rung 0's search alone starts from the bench
    if hi is None:                                  # nothing failed on evidence yet: go up
        high = max(verdicts)
        far_up = verdicts[high] and grid_index(high, steps) - first >= near
        i = min(grid_index(high, steps) + (steps if far_up else 1), top)
        return None if high >= max_rate or i <= grid_index(high, steps) else grid_rate(i, steps)
    if lo is None:                                  # nothing passed below it: go down
        low = min(verdicts)
        far_down = low in far and first - grid_index(low, steps) >= near
        i = max(grid_index(low, steps) - (steps if far_down else 1), bottom)
        return None if low <= min_rate or i >= grid_index(low, steps) else grid_rate(i, steps)
    return bisected_rate(lo, hi, verdicts, steps, rel_tol)


def judge(rows: list[dict], slo: dict, phi: float = 1.0, looks: int = 1) -> dict:
    """The newest row's rate judged on the evidence of its probes in `rows` (pooled_evidence: the search passes one
    visit, so a boundary probed again later is judged on its own draws), written into that row (evidence, pooled
    counts, passed, why); returns the evidence."""
    row = rows[-1]
    ev = pooled_evidence(rows, row["offered_rps"], slo["percentile"], phi, look_confidence(looks))
    row.update(evidence=ev["verdict"], pooled_counted=ev["counted"], pooled_over=ev["over_slo"])
    row["passed"], row["why"] = probe_passes(row, slo, ev)
    return ev


def search(probe, k: dict, slo: dict, report=None) -> tuple[list[dict], list[tuple[float, bool]]]:
    """The knee's probing, apart from how a probe is made: `probe(rate, rows)` returns one probe's row (counted,
    over_slo, failed, backlog, ...). The next rate comes from next_rate (mode search) or knee.rates (sweep); a rate
    whose evidence is inconclusive is probed again at once, its counts pooled, up to knee.max_repeats, and the
    visit's probes all take its final verdict; `report(rows, evidence)` after each. Returns every row and the
    (rate, passed) list the bracket reads."""
    rows: list[dict] = []
    probes: list[tuple[float, bool]] = []
    unsure: set[float] = set()  # rates whose visit ended without evidence either way
    far: set[float] = set()  # rates that failed far above the wall
    cap = k["max_probes"] or len(k["rates"] or []) * k["max_repeats"]
    while True:
        rate = (sweep_next(probes, k["rates"]) if k["mode"] == "sweep" else
                next_rate(probes, k["start_rate"], k["max_rate"], k["rel_tol"], k["max_probes"], k["min_rate"],
                          anchor=k.get("anchor"), unsure=unsure, far=far, near=k.get("start_steps") or 0))
        if rate is None:
            return rows, probes
        looks = visit(probe, rate, rows, k, slo, report, cap - len(probes))
        probes += [(rate, row["passed"]) for row in looks]
        last = looks[-1]
        if last["evidence"] == "inconclusive" and not (last.get("failed") or last.get("backlog")):
            unsure.add(rate)
        if last.get("backlog") or (last.get("pooled_over") or 0) >= FAR_SHARE * (last.get("pooled_counted") or 1):
            far.add(rate)


def visit(probe, rate: float, rows: list[dict], k: dict, slo: dict, report=None, cap: int | None = None) -> list[dict]:
    """One visit of `rate`: looks (`probe(rate, rows)`, appended to `rows`) while its evidence is inconclusive, their
    counts pooled, up to knee.max_repeats (and `cap`); a failed request or a backlog ends it. Every look takes the
    visit's final verdict. `report(rows, evidence)` after each. Returns the visit's rows."""
    looks: list[dict] = []
    while True:
        rows.append(probe(rate, rows))
        looks.append(rows[-1])
        ev = judge(looks, slo, k["dispersion"]["phi"], k["max_repeats"])
        if report:
            report(rows, ev)
        if (rows[-1].get("failed") or rows[-1].get("backlog") or ev["verdict"] != "inconclusive"
                or len(looks) >= k["max_repeats"] or (cap is not None and len(looks) >= cap)):
            break
    for row in looks:
        row["passed"] = looks[-1]["passed"]
    return looks


def visit_verdict(looks: list[dict]) -> str:
    """A visit's verdict as its looks took it: pass; fail (on evidence, a failed request or a backlog); or
    inconclusive."""
    last = looks[-1]
    return "pass" if last.get("passed") else "fail" if failed_on_evidence(last) else "inconclusive"


def beyond(rate: float, side: str, rel_tol: float) -> float:
    """The grid rate one step beyond `rate` in the direction a `side` verdict moves the knee: up for better."""
    steps = grid_steps(rel_tol)
    return grid_rate(grid_index(rate, steps) + (1 if side == "better" else -1), steps)


RECHECK_EXTRA_LOOKS = 1  # a re-check's visit may take one look more than the search's (each sized for it): it decides
                         # a verdict; simulated at the H200's spread, a knee moved 1.41x was found better in 83 %,
                         # 79 % without


RECHECK_STEPS = 1  # grid rates a re-check moves on where its base does not read the other way (more: each
                   # step rejudges at a rate its base chose, 22 % of placebos called better on a base that ran slow)


def recheck_settings(k: dict) -> dict:
    """The knee settings a re-check's looks are sized and judged with (RECHECK_EXTRA_LOOKS)."""
    return {**k, "max_repeats": k["max_repeats"] + RECHECK_EXTRA_LOOKS}


def recheck(probe, rate: float, k: dict, slo: dict, side: str | None = None, report=None) -> list[dict]:
    """A knee verdict re-checked on a fresh server (the knee stage's run.anchor.look): one visit of `rate` (looks on
    the traces the search sends it, each sized by recheck_settings(k), as `probe` must size them); with `side`, where
    that visit does not read the other way on evidence (better: the base did not fail there; worse: it did not
    pass), RECHECK_STEPS more visits a grid rate beyond (probing.beyond), where the verdict is re-judged instead.
    Returns the rows, each with its visit's verdict."""
    rows: list[dict] = []
    k = recheck_settings(k)
    for _ in range(1 + (RECHECK_STEPS if side else 0)):
        looks = visit(probe, rate, rows, k, slo, report)
        got = visit_verdict(looks)
        for row in looks:
            row["visit_verdict"] = got
        # an inconclusive base steps too: simulated at the H200's spread, a 2x knee was found 91 %, 75 % without
        if not side or got == {"better": "fail", "worse": "pass"}[side]:
            break
        rate = beyond(rate, side, k["rel_tol"])
    return rows


def sweep_next(probes: list[tuple[float, bool]], rates: list[float]) -> float | None:
    done = {r for r, _ in probes}
    return next((r for r in rates if r not in done), None)


def knee_result(probes: list[tuple[float, bool]], rates_tried: list[float] | None = None,
                rel_tol: float | None = None, rows: list[dict] | None = None) -> dict:
    """The knee: its bracket [last pass, first fail), midpoint +/- half-width, and whether it is trustworthy:
    `resolved` (bracket no wider than `rel_tol`), `confirmed` (both boundaries probed twice, agreeing),
    `non_monotonic` (a rate above the first failure passed, or a repeat disagreed). Status: inside (a bracket),
    above (passed up to the top), below (failed on evidence down to the lowest rate), open (no pass, the lowest
    rate left inconclusive: e.g. a rung's search that stopped at its verdict). With the search's `rows` (their
    evidence), the knee is the highest rate that passed on evidence below the first that failed on evidence: a rate
    left inconclusive below a pass is no boundary (the share over the SLO rises with the rate)."""
    lo, hi = bracket(probes)
    if rows is not None:
        known = conclusive_fail(rows) or math.inf
        verdicts = rate_verdicts(probes)
        lo = max((r for r, ok in verdicts.items() if ok and r < known), default=None)
        above = [r for r, ok in verdicts.items() if not ok and (lo is None or r > lo)]
        hi = min(above) if above else None
    tried = sorted(rates_tried or [r for r, _ in probes])
    status = "inside" if lo is not None and hi is not None else ("below" if lo is None else "above")
    if status == "below" and rows is not None and tried and tried[0] < (conclusive_fail(rows) or math.inf):
        status = "open"  # no pass, and the lowest rate probed was left inconclusive: the knee is below the fail
    mixed = mixed_rates(probes)
    noisy = bool(mixed) or (hi is not None and any(ok and r > hi for r, ok in probes))
    inside = status == "inside"
    twice = inside and all(sum(1 for x, _ in probes if x == r) >= 2 for r in (lo, hi))
    return {"knee_rps": lo, "last_pass_rps": lo, "first_fail_rps": hi, "status": status,
            "bracket_rps": (hi - lo) if inside else None,
            "mid_rps": (lo + hi) / 2 if inside else None,
            "half_width_rps": (hi - lo) / 2 if inside else None,
            "rel_width": width(lo, hi) if inside else None,
            "resolved": bool(inside and rel_tol is not None and width(lo, hi) <= rel_tol + 1e-9),
            "confirmed": bool(twice and lo not in mixed and hi not in mixed),
            "non_monotonic": noisy, "mixed_rates": mixed, "probes": len(probes),
            "range_rps": [tried[0], tried[-1]] if tried else None}


