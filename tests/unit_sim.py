"""Servers as the unit (issue 50, item 5, piece 4): a knee rule whose unit of replication is the fresh server, beside
today's (one search a side, then re-check pairs), on tests/simulate.py's noise model, with what each costs.

The design, per rung (`unit_verdict`, pure and typed: it could move into judgement/stats.py as it stands):

- fresh servers of the base and of the rung, started alternately (base, rung, base, rung, ...: a machine drifting
  over the rung is measured on both sides alike); each server looks at 2-3 rates of the search's grid near its
  side's expected knee (`next_look`: up a grid rate while under the SLO's share, two where none broke it, down two
  past the wall, again at a rate between) and gives a continuous knee (`server_log_knee`: the quasi-likelihood MLE
  of its log knee under the wall s = q (r / K)^gamma with gamma and phi known, and that estimate's variance);
- the sides' mean log knees are compared by a t statistic whose SD per server pools the profile's stored spread
  (its knee CV, df servers - 1, plus the servers' own estimation variance) with this rung's own servers, as
  stats.knees_delta pools them;
- sequential: from `first` server(s) a side, one more a side at a time, up to `cap`. At each stage: better where
  t >= `better`, worse where t <= -`worse` (constants over stages, Pocock-like, calibrated by simulation on the
  A/A paths at the stored spread's upper end: the multiple looks are in them); within where the `within_z`
  interval of the difference lies inside +/- `margin` (log 1.41: a knee moved less than the target either way),
  or at the cap.

The rule's better calls are set at ~0.4 % a rung at the spread's upper end (not 2.5 %): each rung's servers are
fresh on both sides, so an all-placebo ladder of five rungs keeps on its knee in ~5 x that, and the ladder's one
error budget (stats.LADDER_FALSE_KEEP, 5 %) is shared with the tok/s path (~2.5 % of such ladders).

Cost: GPU-seconds, each server's start (SERVER_START_S on an H200) plus its looks (counted / rate + sim.LOOK_S).
Today's rule is charged its rung's search and its re-check servers (its base's search serves every rung it stays
the base of, and is shown apart); the unit design its servers of both sides (a fresh base each rung).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

import ladder
import simulate as sim
from judgement import stats
from measure import probing

SERVER_START_S = 90.0  # a fresh `vllm serve` of gpu-shape-4090 to its first look on an H200
Q = round(1 - sim.KNEE_SLO["percentile"] / 100, 6)
STEPS = probing.grid_steps(sim.KNEE_SETTINGS["rel_tol"])
SATURATED = 0.5  # a look with this share or more over the SLO is past the wall: it steers, it does not estimate
ENOUGH_OVER = 20  # a server stops looking once its usable looks counted this many over the SLO (at least 2 looks)
LOOK_COUNTED_S = sim.KNEE_SETTINGS["probe_seconds"]  # a look's counted seconds (at least knee.min_prompts): it
                      # estimates, it need not pass alone; None: sized as the search's probes (a pass's minimum, 547
                      # counted at p95: 212 s a server against 170, for ~1 point of x1.41 found)
MAX_LOOKS, LOST_LOOKS = 3, 5  # looks a server takes; where none was usable yet, up to LOST_LOOKS


# ---------------------------------------------------------------- the design (pure)
Look = tuple[float, int, int]  # (offered rate, over the SLO, counted)


def server_log_knee(looks: list[Look], q: float, gamma: float, phi: float) -> tuple[float, float]:
    """One server's log knee from its looks under the wall s = q (r / K)^gamma (counts over-dispersed by phi): the
    quasi-likelihood estimate sets the over-SLO count to its expectation, sum x = q K^-gamma sum n r^gamma, so
    log K = (log(q sum n r^gamma) - log sum x) / gamma, with variance phi / (gamma^2 sum x). Looks at or past
    SATURATED are left out (the share caps at 1 there), unless all are (then the lowest); none over the SLO: half a
    request (a lower bound made finite)."""
    use = [lk for lk in looks if lk[2] and lk[1] < SATURATED * lk[2]] or [min(looks)]
    over = sum(x for _, x, _ in use) or 0.5
    terms = np.array([math.log(n) + gamma * math.log(r) for r, _, n in use])
    top = float(terms.max())
    expected = math.log(q) + top + math.log(float(np.exp(terms - top).sum()))
    return (expected - math.log(over)) / gamma, phi / (gamma ** 2 * over)


def next_look(looks: list[Look], q: float, steps: int) -> float | None:
    """The rate of a server's next look on the search's grid, or None where it has looked enough: at least two looks
    and ENOUGH_OVER over the SLO in its usable ones, or MAX_LOOKS (LOST_LOOKS while none was usable). Up one grid
    rate from a look under the share q (two where none broke the SLO), down two from one past the wall, and again
    at a rate between."""
    usable = [lk for lk in looks if lk[1] and lk[1] < SATURATED * lk[2]]
    if len(looks) >= 2 and sum(x for _, x, _ in usable) >= ENOUGH_OVER:
        return None
    if len(looks) >= (MAX_LOOKS if usable else LOST_LOOKS):
        return None
    rate, x, n = looks[-1]
    step = 2 if x == 0 else 1 if x < q * n else -2 if x >= SATURATED * n else 0
    return probing.grid_rate(probing.grid_index(rate, steps) + step, steps)


@dataclass(frozen=True)
class UnitRule:
    """The sequential design's settings (module docstring)."""
    first: int = 1          # servers a side at the first judgement (the stored spread stands in for their SD)
    cap: int = 8            # servers a side at most
    better: float = 3.13    # t constants over stages, calibrated on 60,000 A/A paths at the stored spread's upper end
    worse: float = 2.41     # (the rule told it): better 0.4 %, worse 2.5 % (calibrate: unit_paths seeds 1-3; one
                            # seed's 20,000 alone had read low). 0.4 %: five fresh rungs ~2 % of all-placebo ladders,
                            # beside the tok/s path's 2.3-2.5 % (tests/test_ladder_simulation.py), within the 5 %
    margin: float = math.log(2 ** 0.5)
    within_z: float = 1.645


def unit_verdict(base: list[tuple[float, float]], rung: list[tuple[float, float]], prior_cv: float, prior_df: int,
                 rule: UnitRule = UnitRule()) -> dict:
    """The rung's knee against its base's, each fresh server a unit ((log knee, its estimation variance) from
    server_log_knee): 'better' / 'worse' where the t of the difference of the mean log knees passes the rule's
    constant, 'within noise' where its within_z interval lies inside +/- margin or the cap is reached, else
    'continue' (one more server a side). The SD per server pools the stored spread (prior_cv on prior_df, plus the
    servers' mean estimation variance) with these servers' own."""
    lb, lr = (np.array([t for t, _ in side]) for side in (base, rung))
    est = float(np.mean([v for _, v in base + rung]))
    ss = float(((lb - lb.mean()) ** 2).sum() + ((lr - lr.mean()) ** 2).sum())
    df = prior_df + len(lb) + len(lr) - 2
    sd = math.sqrt(((prior_cv ** 2 + est) * prior_df + ss) / df) if df else math.inf
    se = sd * math.sqrt(1 / len(lb) + 1 / len(lr))
    d = float(lr.mean() - lb.mean())
    t = d / se
    verdict = ("better" if t >= rule.better else "worse" if t <= -rule.worse
               else "within noise" if abs(d) + rule.within_z * se <= rule.margin or min(len(lb), len(lr)) >= rule.cap
               else "continue")
    return {"verdict": verdict, "rel": math.exp(d) - 1, "t": t, "sd": sd, "df": df, "servers": [len(lb), len(lr)]}


# ---------------------------------------------------------------- the simulation
@dataclass
class Server:
    log_knee: float
    var: float
    seconds: float  # its start and its looks
    looks: int


def server(rng, knee: float, start: float, server_cv: float, model: sim.KneeModel = sim.GPU4090) -> Server:
    """A fresh server of a config whose knee is `knee` (tests/simulate.py's wall, bursts and spread), looked at from
    `start` (a grid rate) as next_look steers, each look sized as the search sizes its probes (probing.probe_prompts)
    and drawn by sim.look."""
    k, slo = model.settings, model.slo
    own = sim.fresh(rng, knee, server_cv)
    looks: list[Look] = []
    seconds, rate = SERVER_START_S, start
    while rate is not None:
        counted = (probing.probe_prompts(rate, k["probe_seconds"], slo["percentile"], 0.0, k["min_prompts"],
                                         k["max_prompts"], phi=model.phi, looks=k["max_repeats"])
                   if LOOK_COUNTED_S is None else max(math.ceil(rate * LOOK_COUNTED_S), k["min_prompts"]))
        over, seen = sim.look(rng, counted, min(Q * (rate / own) ** model.gamma, 1.0), phi=model.phi)
        looks.append((rate, over, seen))
        seconds += seen / rate + sim.LOOK_S
        rate = next_look(looks, Q, STEPS)
    theta, var = server_log_knee(looks, Q, model.gamma, model.phi)
    return Server(theta, var, seconds, len(looks))


def grid_near(log_rate: float) -> float:
    return probing.grid_rate(round(log_rate / math.log(2) * STEPS), STEPS)


def unit_path(rng, knee: float, factor: float, server_cv: float, cap: int) -> tuple[list[Server], list[Server]]:
    """One rung's servers up to the cap, base and rung alternately: the base's first looks from where a search on one
    server put its knee (rung 0's), each later server from its side's mean log knee so far (the rung's first from the
    base's)."""
    base: list[Server] = []
    rung: list[Server] = []
    expected = math.log(sim.fresh(rng, knee, server_cv))
    for _ in range(cap):
        base.append(server(rng, knee, grid_near(np.mean([s.log_knee for s in base]) if base else expected),
                           server_cv))
        rung.append(server(rng, knee * factor, grid_near(np.mean([s.log_knee for s in rung or base])), server_cv))
    return base, rung


@dataclass
class Calls:
    """A case's verdicts and what they cost."""
    trials: int
    rates: dict            # verdict -> share of trials
    gpu_s: float           # mean GPU-seconds a rung
    servers: float         # mean fresh servers a rung
    extra: dict

    def __getitem__(self, verdict: str) -> float:
        return self.rates.get(verdict, 0.0)


def tally(verdicts: list[str], gpu_s: list[float], servers: list[int], **extra) -> Calls:
    n = len(verdicts)
    return Calls(n, {v: verdicts.count(v) / n for v in ("better", "worse", "within noise", "unknown")},
                 float(np.mean(gpu_s)), float(np.mean(servers)), extra)


def unit_paths(factor: float, seed: int, server_cv: float, trials: int, cap: int, knee: float = sim.KNEE) -> list:
    rng = np.random.default_rng(seed)
    return [unit_path(rng, knee, factor, server_cv, cap) for _ in range(trials)]


def judge_path(path, prior_cv: float, prior_df: int, rule: UnitRule) -> tuple[str, float, int]:
    """A rung's verdict on its servers (unit_path's), stage by stage as the rule adds them: (verdict, GPU-seconds,
    servers)."""
    base, rung = path
    for n in range(rule.first, rule.cap + 1):
        d = unit_verdict([(s.log_knee, s.var) for s in base[:n]], [(s.log_knee, s.var) for s in rung[:n]],
                         prior_cv, prior_df, rule)
        if d["verdict"] != "continue":
            break
    return d["verdict"], sum(s.seconds for s in base[:n] + rung[:n]), 2 * n


def unit_rates(paths: list, prior_cv: float, prior_df: int, rule: UnitRule) -> Calls:
    got = [judge_path(p, prior_cv, prior_df, rule) for p in paths]
    return tally([g[0] for g in got], [g[1] for g in got], [g[2] for g in got])


def today_rates(factor: float, seed: int, server_cv: float, trials: int, knee: float = sim.KNEE,
                pairs: int = stats.KNEE_BETTER_ROUNDS) -> Calls:
    """Today's rule (tests/test_rule_simulation.py's knee_rates, the same random stream): the base's search on one
    server, the rung's from its knee, stats.knee_delta; better or worse re-checked on pairs of fresh servers
    (sim.rechecked; better on `pairs`, knee.better_pairs). Charged: the rung's search and the re-check servers; the
    base's search apart (extra)."""
    rng = np.random.default_rng(seed)
    verdicts, gpu_s, servers, base_s = [], [], [], []
    for _ in range(trials):
        base = sim.knee_search(rng, knee, server_cv=server_cv)
        anchor = ladder.knee_anchor({"knee": base}, {}, floor=0.0)
        new = sim.knee_search(rng, knee * factor, anchor, server_cv)
        d = {**stats.knee_delta(base, new), "pairs": pairs}  # the profile's knee.better_pairs
        spent = [SERVER_START_S + new["seconds"]]

        def looked(rows, spent=spent):
            spent.append(SERVER_START_S + sum(r["seconds"] for r in rows))
            return rows
        if d["verdict"] in ("better", "worse"):
            d = sim.rechecked(d, lambda rate, side: looked(sim.recheck(rng, knee, rate, side, server_cv)),
                              lambda rate: looked(sim.recheck(rng, knee * factor, rate, None, server_cv)),
                              stats.verdict_rate(base, new, d["verdict"]))
        verdicts.append(d["verdict"])
        gpu_s.append(sum(spent))
        servers.append(len(spent))
        base_s.append(SERVER_START_S + base["seconds"])
    return tally(verdicts, gpu_s, servers, base_gpu_s=float(np.mean(base_s)))


def calibrate(paths: list, prior_cv: float, prior_df: int, rule: UnitRule, side: str, target: float) -> float:
    """The t constant at which A/A `paths` are called `side` in `target` of them, the other side's left as in `rule`
    (bisection on the stage statistics: the multiple looks and the within stops are in them)."""
    free = UnitRule(rule.first, rule.cap, math.inf, math.inf, rule.margin, rule.within_z)
    stages = []
    for base, rung in paths:
        row = []
        for n in range(rule.first, rule.cap + 1):
            d = unit_verdict([(s.log_knee, s.var) for s in base[:n]], [(s.log_knee, s.var) for s in rung[:n]],
                             prior_cv, prior_df, free)
            row.append((d["t"], d["verdict"] == "within noise"))
        stages.append(row)

    def share(c: float) -> float:
        b, w = (c, rule.worse) if side == "better" else (rule.better, c)
        hits = 0
        for row in stages:
            for t, within in row:
                if t >= b or t <= -w or within:
                    hits += (t >= b) if side == "better" else (t <= -w and t < b)
                    break
        return hits / len(stages)
    lo, hi = 1.0, 6.0
    for _ in range(25):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if share(mid) > target else (lo, mid)
    return hi
