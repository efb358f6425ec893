"""The judgement maths, pure functions only (unit-tested on fixture numbers): the start-to-start floor and every Δ's
interval ("within noise"), the knee verdict, the exact McNemar test and the decode roofline. Only what judges
imports it (decide, record, gate, report, ladder, capacity); the measuring maths is measure/probing.py's (its
GRID_ROUNDING is measure/evidence.py's, a leaf: the judgement stands on no knee search)."""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from scipy import stats as sps

from measure.evidence import GRID_ROUNDING, KNEE_BETTER_ROUNDS
from measure.summary import fmt_g, tq

if TYPE_CHECKING:
    from common import NoiseFloor, ServerSpread

# ---------------------------------------------------------------- intervals
# The engine is the unit of replication for output tok/s: repeats inside one engine cannot see how far a fresh
# engine of the same config lands (three fresh H200 engines: 6,639 / 7,242 / 7,337 tok/s), so every Δ's interval
# carries the start-to-start SD (`Floor`), judged at the upper end of that estimate's interval (FLOOR_LEVEL).
# One error budget for the whole ladder: a rung is kept on its knee or on its tok/s, and a ladder judges five rungs
# against one base, so a rate per test compounds (one re-check pair a side kept something in ~8 % of all-placebo
# gpu-shape-4090 ladders at the stock front end's spread, all on the knee: tests/test_ladder_simulation.py).
# LADDER_FALSE_KEEP bounds the share of ladders of LADDER_RUNGS rungs that change nothing which keep anything, both
# paths together: CONFIDENCE (tok/s on the floor judged at its upper end, FLOOR_LEVEL: up to ~2.7 % of such ladders
# where the truth sits there) and the knee's re-check pairs (KNEE_BETTER_ROUNDS, up to ~1.9 %) share it, as whole
# ladders simulated on each profile's measured noise, and at the upper end of its intervals, show.
LADDER_FALSE_KEEP, LADDER_RUNGS = 0.05, 5
CONFIDENCE = 0.985  # two-sided: each way 0.75 % where the truth sits at the stored floor's upper end (less below
                    # it; ~0.8 % where one own pair pools with an 8-engine floor and pulls the judged SD down); a true
                    # +10 % is called better in >= 90 % of rungs on a 1.5 % floor measured on 24+ engines
                    # (tests/test_rule_simulation.py: 95 % on 32, 61 % on 8)
# A measured floor (stored, pooled with the ladder's own engines) is judged at the upper end of its two-sided
# FLOOR_LEVEL interval, as if known there (a normal quantile, not a t on its df): 8 engines cannot tell 0.59 % from
# 1.20 %, and a t-interval's degrees of freedom cover that only on average over measurements. A ladder reads one
# stored floor every time; read as measured, where the truth sat at that upper end, all-placebo ladders kept
# something in 18.4 % (gpu-shape-4090: 0.59 % on 8 engines) and 10.3 % (cpu: 2.50 % on 24), budget 5 %. Judged there,
# every truth up to that upper end gets at most CONFIDENCE's rate; the t on top would count the floor's own error
# twice (tests/test_ladder_simulation.py, tests/test_rule_simulation.py).
FLOOR_LEVEL = 0.95


def upper_cv(cv: float, df: int, level: float = FLOOR_LEVEL) -> float:
    """The upper end of a CV's two-sided `level` interval estimated on `df` degrees of freedom (chi-square)."""
    return cv * _upper_factor(df, level) if df > 0 else cv


@functools.cache
def _upper_factor(df: int, level: float) -> float:  # the simulations judge floors in their inner loops
    return math.sqrt(df / sps.chi2.ppf((1 - level) / 2, df))


@dataclass(frozen=True)
class Floor:
    """The relative SD of output tok/s between fresh engines of one config, and what it rests on: `engines`
    fresh engines in `groups` same-config groups (degrees of freedom = engines - groups; 0: no measurement)."""
    cv: float
    engines: int = 0
    groups: int = 1
    source: str = "not measured"
    read_at: float | None = None  # judged at the upper end of its interval of this level (Floor.read); None: as is

    @property
    def df(self) -> int:
        return max(self.engines - self.groups, 0)

    @property
    def judged(self) -> float:
        """The SD every Δ is drawn with: the estimate's upper end where it is read there (read_at), else the
        estimate."""
        return upper_cv(self.cv, self.df, self.read_at) if self.read_at and self.df else self.cv

    @classmethod
    def of(cls, block: Floor | NoiseFloor | None) -> Floor:
        """From params `bench.noise_floor`, typed (config.NoiseFloor; `make benchmark` prints it), never its dumped
        dict: the one place that block becomes a Floor; the code reaches it only through delta and pool. A Floor is
        the judgement's estimate, not a second type of the block: it is also pooled (groups, a composed source), and
        a knee spread (knee_spread), which no one types into params.yaml."""
        if isinstance(block, Floor):
            return block
        if block is None:
            return cls(0.0)
        where = ", ".join(str(v) for v in (block.measured_on, block.vllm, block.measured) if v)
        return cls.read(float(block.cv), block.engines, where or "as typed")

    @classmethod
    def read(cls, cv: float, engines: int, source: str) -> Floor:
        """A floor measured as `cv` on `engines` fresh engines of one config, as the rule reads it: judged at the upper
        end of its two-sided FLOOR_LEVEL interval (judged), pooled as measured."""
        return cls(cv, engines, 1, source, FLOOR_LEVEL)

    def words(self) -> str:
        if not self.df:
            return "no start-to-start SD measured"
        read = (f", judged at its {self.read_at:.0%} upper end: {self.judged:.2%}" if self.read_at else "")
        return f"start-to-start CV {self.cv:.2%} from {self.engines} engines (df {self.df}; {self.source}){read}"


def pool(prior: Floor | NoiseFloor | None, groups: list[list[float]], source: str = "") -> Floor:
    """The prior floor (a Floor, or params `bench.noise_floor`, typed) pooled with the ladder's own same-config engines
    (each group: the means of fresh engines of one config, e.g. a base and its re-measures): pooled relative
    variance, weighted by degrees of freedom."""
    prior = Floor.of(prior)
    ss, df = prior.cv ** 2 * prior.df, prior.df
    engines, n_groups = (prior.engines, prior.groups) if prior.df else (0, 0)  # a prior of df 0 adds nothing
    for g in groups:
        if len(g) >= 2:
            ss += float(np.var(g, ddof=1)) / float(np.mean(g)) ** 2 * (len(g) - 1)
            df += len(g) - 1
            engines, n_groups = engines + len(g), n_groups + 1
    if not df:
        return prior
    own = sum(len(g) for g in groups if len(g) >= 2)
    words = "; ".join(x for x in (prior.source if prior.df else "", f"{own} in this ladder" if own else "", source)
                      if x)
    return Floor(math.sqrt(ss / df), engines, n_groups, words, prior.read_at if prior.df else None)


# How a Δ on output tok/s is drawn, as the report's legend and docs/method.md say it (delta below is what it
# describes).
def delta_words(judged: bool = True) -> str:
    """The legend of a Δ on output tok/s as this code draws it; `judged`: on a stored floor (pooled with the
    ladder's own re-measures) judged at its upper end, else on the ladder's own re-measures alone (no floor stored).
    A ladder writes it into its record (noise_floor.delta_words); a record from before holds none (OLD_DELTA_WORDS)."""
    how = (f"on the start-to-start floor (pooled with the ladder's own re-measures) taken at the upper end of its "
           f"{FLOOR_LEVEL:.0%} interval as known there (a normal quantile)" if judged else
           "on the start-to-start SD of the ladder's own re-measures of its bases (a t on their degrees of freedom)")
    return ("Δ vs base: the rung's fresh engine against its base's engine measured just before it and, where that "
            "could be a gain, the mean of that and one measured again just after it (a machine drifting under the "
            f"rung cancels), with a {CONFIDENCE:.1%} interval {how}, or on the engines' own repeats where they spread "
            "wider than it holds (a t, Welch-Satterthwaite over them, at most the floor's degrees of freedom); "
            "\"within noise\" where it includes zero, \"unknown\" where no floor was measured")


# how a record from before 2026-12-07 drew its Δs (its floor read as measured, every engine's repeats added to it)
OLD_DELTA_WORDS = ("Δ vs base: the rung's fresh engine against its base's engine measured just before it and, where "
                   "that could be a gain, the mean of that and one measured again just after it (a machine drifting "
                   "under the rung cancels), with a 98.5% interval whose degrees of freedom include the start-to-start "
                   "floor's (Welch-Satterthwaite over the floor and every engine's repeats, at most the floor's); "
                   "\"within noise\" where it includes zero, \"unknown\" where no floor was measured")
DELTA_WORDS = delta_words()


def engines_of(runs) -> list[list[float]]:
    """A side of a comparison as fresh engines, each a list of its in-engine repeats (a flat list: one engine)."""
    runs = [r for r in (runs or []) if r is not None]
    if runs and not isinstance(runs[0], (list, tuple)):
        return [[float(x) for x in runs]]
    return [[float(x) for x in e] for e in runs if e]


def delta(base, new, floor: Floor | NoiseFloor | None = None, confidence: float = CONFIDENCE) -> dict:
    """Relative change of `new` vs `base` output tok/s, each side one or more fresh engines (engines_of), with a
    `confidence` interval and the call it supports: 'better' / 'worse' when it excludes zero, else 'within noise';
    'unknown' when no interval can be drawn (no floor measured: repeats inside one engine are not evidence).
    The difference of the engine means has the start-to-start floor's variance on each side (cv² m² / engines, df of
    the floor): the floor is measured on engine means of the bench's repeats, so it holds their in-engine noise
    already. Where the engines' own repeats spread wider than that (s² / r / engines² summed, df r - 1 each), the
    interval takes theirs instead, its degrees of freedom by Welch-Satterthwaite over them, at most the floor's:
    never both, which counted the in-engine noise twice. A base measured just before and just after (two engines)
    cancels a machine drifting linearly under the rung."""
    floor = Floor.of(floor)
    b, n = engines_of(base), engines_of(new)
    if not b or not n:
        return {"rel": None, "ci": None, "verdict": "unknown", "why": "missing measurements"}
    mb, mn = (float(np.mean([np.mean(e) for e in side])) for side in (b, n))
    if not mb:
        return {"rel": None, "ci": None, "verdict": "unknown", "why": "missing measurements"}
    rel, sides = (mn - mb) / mb, f"{len(b)} vs {len(n)} engine(s)"
    if not floor.df:
        return {"rel": rel, "ci": None, "verdict": "unknown", "engines": [len(b), len(n)],
                "why": f"{sides}, {floor.words()}: the difference cannot be told from start-to-start noise"}
    var = floor.judged ** 2 * (mb ** 2 / len(b) + mn ** 2 / len(n))
    own = [(float(np.var(e, ddof=1)) / len(e) / len(side) ** 2, len(e) - 1) for side in (b, n) for e in side
           if len(e) >= 2]
    df: float = math.inf if floor.read_at else floor.df  # a floor judged at its upper end is taken as known there
    repeats = sum(v for v, _ in own) > var  # repeats wider than the floor holds: a disturbed engine's, not the floor's
    if repeats:
        var = sum(v for v, _ in own)
        # never more df than the floor's: tight repeats must not buy degrees of freedom (agreeing engines read df 5
        # on a df-1 floor)
        df = min(var ** 2 / sum(v ** 2 / d for v, d in own if v), floor.df)
    half = tq(confidence, df) * math.sqrt(var)
    ci = [(mn - mb - half) / mb, (mn - mb + half) / mb]
    verdict = "better" if ci[0] > 0 else "worse" if ci[1] < 0 else "within noise"
    normal = math.isinf(df)
    why = f"{sides}, {confidence:.1%} interval, {floor.words()}, " + ("a normal quantile" if normal else f"df {df:.1f}")
    out = {"rel": rel, "ci": ci, "verdict": verdict, "why": why, "engines": [len(b), len(n)],
           "confidence": confidence, "df": floor.df if normal else round(df, 2), "floor_cv": floor.judged,
           **({"normal": True} if normal else {}), **({"repeats_se": math.sqrt(var) / mb} if repeats else {})}
    if len(b) == 1 and verdict != "better":
        out["again_odds"] = round(again_odds(b[0], n, floor, confidence), 4)
    return out


# The base is measured again after a rung (a fresh engine, minutes of GPU) only where that could still make the rung
# "better": a rung that reads +0.3 % cannot become a gain unless the base's next engine reads several floors low.
AGAIN_ODDS = 0.01


def again_odds(base_engine: list[float], new, floor: Floor, confidence: float = CONFIDENCE) -> float:
    """The chance that the base measured once more (one fresh engine, right after the rung) reads low enough for the
    rung to be called better against both base engines, were that engine to differ from the first by the floor alone
    (relative SD cv x sqrt 2): the Δ against both is better where the rung's lead over their mean beats the interval of
    two base engines against the rung's (taken as if the second read like the first)."""
    both = delta([base_engine, base_engine], new, floor, confidence)
    if not floor.judged or both["ci"] is None:
        return 1.0
    half = (both["ci"][1] - both["ci"][0]) / 2
    # better iff mean(new) - b1 (1 + x / 2) > half x b1: the second engine's relative reading x must be below this
    x_max = 2 * (both["rel"] - half)
    return float(sps.norm.cdf(x_max / (floor.judged * math.sqrt(2))))


def may_gain(d: dict) -> bool:
    """Whether a Δ against one measurement of the base could still become a gain once the base is measured again
    right after the rung: it reads faster, not significantly worse, and (where a floor was measured) that re-measure
    would call it better with a chance of at least AGAIN_ODDS (again_odds)."""
    if d.get("rel") is None or d["rel"] <= 0 or d["verdict"] == "worse":
        return False
    return d["verdict"] == "better" or d.get("again_odds", 1.0) >= AGAIN_ODDS


def not_measured(*results: dict) -> str:
    """Why stage results that measured nothing (status n/a) have no figure, in their stages' own words."""
    return "not measured: " + "; ".join(r.get("label") or r.get("reason") or "n/a" for r in results)


def _fail_at(k: dict) -> float:
    """Where a knee's search broke the SLO on evidence (records before the evidence rule: its first failure, and a
    knee lost at every rate there)."""
    if "conclusive_fail_rps" in k:
        return k["conclusive_fail_rps"] or math.inf
    return k.get("first_fail_rps") or (0.0 if k.get("knee_rps") is None else math.inf)


def knee_delta(base: dict, new: dict) -> dict:
    """Knee change vs base, on evidence only: 'better' when the new search passed on evidence at or above the rate
    where the base's failed on evidence, 'worse' when it failed on evidence at or below the rate where the base's
    passed; each boundary widened by the knee's start-to-start noise (`noise_floor`, the larger of the two
    records'). Both searches send a rate the same arrival traces (probe_seed), and a rung's search probes its base's
    two boundaries first (next_rate's anchor), so the two verdicts at one rate are a paired comparison. A rate left
    inconclusive is no boundary: no gain is credited on it. A knee not measured (status n/a: its rung's gate failed)
    is 'unknown', never a lost knee."""
    skipped = [k for k in (base, new) if k.get("status") == "n/a"]
    if skipped:
        return {"rel": None, "verdict": "unknown", "why": not_measured(*skipped)}
    kb, kn = base.get("knee_rps"), new.get("knee_rps")
    floor = max(base.get("noise_floor") or 0.0, new.get("noise_floor") or 0.0)
    if kb is None and kn is None:
        return {"rel": None, "verdict": "unknown", "why": "no knee on either side (SLO met at no probed rate)"}
    ff_b, ff_n = _fail_at(base), _fail_at(new)
    # grid rates carry 4 significant figures: a per-GPU knee halved can read a hair off the grid rate it equals
    better = kn is not None and kn >= ff_b * (1 + floor) * (1 - GRID_ROUNDING)
    worse = kb is not None and ff_n * (1 + floor) <= kb * (1 + GRID_ROUNDING)
    verdict = "within noise" if better == worse else "better" if better else "worse"
    rel = (kn - kb) / kb if kb is not None and kn is not None else None
    out = {}
    if better and ff_b:  # how far past what better needs its knee passed: a move that far is re-checked on one pair
        out["past"] = round(kn / (ff_b * (1 + floor)), 4)
    def span(lo, hi):  # a bracket with no pass on evidence says so, not "––3.364"
        return f"{'no pass' if lo is None else fmt_g(lo)}–{fmt_g(hi)}"
    why = f"bracket {span(kb, ff_b)} → {span(kn, ff_n)} req/s (last pass – first fail on evidence)"
    if kn is None and verdict == "worse":
        why = "knee lost: the SLO was met at no probed rate, and failed on evidence at or below the base's knee; " + why
    if verdict == "better":
        why += ": passed where the base failed"
    elif verdict == "worse":
        why += ": failed where the base passed"
    else:
        why += ": neither passed where the base failed nor failed where it passed"
    if floor:
        why += f", by more than the knee's start-to-start noise (knee.noise_floor {floor:.0%})" if verdict != \
            "within noise" else f" by more than the knee's start-to-start noise (knee.noise_floor {floor:.0%})"
    return {"rel": rel, "verdict": verdict, "why": why, **out}


def verdict_rate(base: dict, new: dict, side: str, scale: float = 1.0) -> float | None:
    """The rate (in the base's units) a knee verdict of knee_delta was read at: better, the lowest the new search
    passed at where the base's failed on evidence (beyond the floor); worse, where the new search failed on evidence.
    `scale`: the new instance's GPUs over the base's (its rates are that many times the base's)."""
    if side != "better":
        fail = _fail_at(new)
        return fail / scale if math.isfinite(fail) and fail else None
    floor = max(base.get("noise_floor") or 0.0, new.get("noise_floor") or 0.0)
    need = _fail_at(base) * scale * (1 + floor) * (1 - GRID_ROUNDING)
    passes = [r["offered_rps"] for r in new.get("rows") or [] if r.get("passed") and r["offered_rps"] >= need]
    if not new.get("rows") and (new.get("knee_rps") or 0) >= need:  # a record without its rows: its knee passed
        passes = [new["knee_rps"]]
    return min(passes) / scale if passes else None


def recheck_rate(rows: list[dict]) -> float | None:
    """The rate a re-check judged at: the last it visited."""
    return rows[-1]["offered_rps"] if rows else None


def rate_verdict(rows: list[dict], rate: float) -> tuple[str | None, int, int]:
    """A re-check's verdict at `rate` and its counts (over the SLO, counted), from its rows."""
    at = [r for r in rows if r.get("offered_rps") == rate]
    if not at:
        return None, 0, 0
    over, counted = sum(r.get("over_slo") or 0 for r in at), sum(r.get("counted") or 0 for r in at)
    return at[-1].get("visit_verdict"), over, counted


# A knee read better keeps a rung (the knee objective): it is re-checked on KNEE_BETTER_ROUNDS pairs of fresh servers,
# one pair after another, and stands only where every pair holds: one pair let an all-placebo ladder of five rungs
# keep something on its knee in ~8 % (the budget above); a pair is paid for only where the pair before held. A knee
# whose own search passed WELL_PAST (three grid steps of the search's 2^(1/4) grid) beyond where better needs it to
# pass is re-checked on one pair: no placebo ladder simulated reached that far, and a second pair cost a knee moved
# 2x a finding in 20 (88.7 % found with one pair there, 84.1 % with two everywhere). Worse keeps nothing (it reverts,
# or bars a tok/s gain): one pair.
WELL_PAST = 2 ** 0.75  # the rounds, KNEE_BETTER_ROUNDS, are measure/evidence.py's: knee.better_pairs' default too
KNEE_AGAIN_OPENING = "a knee verdict (better or worse) is re-checked on a fresh server of the base"


def knee_again_words(pairs: int = KNEE_BETTER_ROUNDS) -> str:
    """The knee re-check in the rule's words: better re-checked on `pairs` pairs of fresh servers."""
    return (KNEE_AGAIN_OPENING + " and then one of the rung, started after the rung, at the rate it was read at (the "
            "same arrival traces): better stands only where the rung passes there again and the fresh base fails there "
            "on evidence (where it does not, both are judged one grid rate higher), worse only where the rung fails "
            "there on evidence again and the fresh base passes there (one grid rate lower where it does not); "
            + (f"better, which keeps a rung, is re-checked so on {pairs} such pairs of fresh servers, one after the "
               "other, and stands only where each holds (on one pair where the rung's own search passed "
               f"×{WELL_PAST:.2f} or more beyond where better needs it to)" if pairs > 1 else
               "better, which keeps a rung, is re-checked so on one such pair (knee.better_pairs 1: the servers' "
               "spread measured on the card holds the error budget with one)")
            + ": a machine that drifts between the base's search and the rung's is measured beside the rung")


KNEE_AGAIN_WORDS = knee_again_words()
BUDGET_WORDS = (f"Both ways to keep share one error budget: of ladders of {LADDER_RUNGS} rungs that change nothing, at "
                f"most {LADDER_FALSE_KEEP:.0%} keep anything (simulated on each profile's measured noise, whole "
                "ladders as they are climbed)")


def recheck_rounds(d: dict) -> int:
    """How many pairs of fresh servers a knee verdict (knee_delta) is re-checked on: for better, its `pairs` (the
    profile's knee.better_pairs, which the ladder sets on it; else KNEE_BETTER_ROUNDS), one where its search passed
    WELL_PAST beyond what better needs; one where it read worse."""
    if d["verdict"] == "better":
        return 1 if (d.get("past") or 0) >= WELL_PAST * (1 - GRID_ROUNDING) else d.get("pairs") or KNEE_BETTER_ROUNDS
    return 1 if d["verdict"] == "worse" else 0


def _pair(side: str, base_rows: list[dict], rung_rows: list[dict]) -> tuple[bool, tuple, tuple]:
    """One pair of fresh servers judged: whether it holds a knee verdict read `side`, and each side's (verdict, over
    the SLO, counted) at the rate it was judged at (the base's: where it visited last; the rung's: its one rate).
    The fresh base must read the other way on evidence: fresh servers' knees spread by ~13 % on an H200 (12
    servers), where "not pass" credited an A/A rung 3.7 % of the time (tests/test_rule_simulation.py)."""
    b, r = rate_verdict(base_rows, recheck_rate(base_rows)), rate_verdict(rung_rows, recheck_rate(rung_rows))
    holds = (b[0] == "fail" and r[0] == "pass") if side == "better" else (b[0] == "pass" and r[0] == "fail")
    return holds, b, r


def pair_holds(side: str, base_rows: list[dict] | None, rung_rows: list[dict] | None) -> bool:
    """Whether one pair of fresh servers holds a knee verdict read `side` (KNEE_AGAIN_WORDS): the fresh base reads the
    other way on evidence where the rung reads as before, at the rate the base was judged at."""
    return bool(base_rows and rung_rows) and _pair(side, base_rows, rung_rows)[0]


def knee_recheck(d: dict, rounds: list[tuple[list[dict] | None, list[dict] | None]]) -> dict:
    """A knee delta (knee_delta: better or worse on the base's and the rung's searches, one server each) re-judged
    with pairs of fresh servers, the base's then the rung's (probing.recheck's rows; None: not measured), in the
    order they ran: KNEE_AGAIN_WORDS. It stands only where recheck_rounds(d) pairs ran and each held; the first
    pair that does not hold decides (the driver runs no pair after it)."""
    side = d["verdict"]
    if side not in ("better", "worse"):
        return d
    out, seen = {**d, "first": side, "recheck": []}, []
    for base_rows, rung_rows in rounds[:recheck_rounds(d)]:
        if not base_rows or not rung_rows:
            break
        rate = recheck_rate(base_rows)  # the rung's own re-check visits one rate: this one, in its units
        holds, (vb, ob, nb), (vr, orr, nr) = _pair(side, base_rows, rung_rows)
        rates = list(dict.fromkeys(x["offered_rps"] for x in base_rows))
        n = len(out["recheck"]) + 1
        seen.append((f"again on a fresh server of each at {fmt_g(rate)} req/s" if n == 1 else
                     f"pair {n} at {fmt_g(rate)} req/s")
                    + f": the base {vb} ({ob} of {nb} over the SLO"
                    + (f"; it visited {', '.join(map(fmt_g, rates))}" if len(rates) > 1 else "")
                    + f"), the rung {vr} ({orr} of {nr})")
        out["recheck"].append({"rate": rate, "base": [vb, ob, nb], "rung": [vr, orr, nr], "base_rates": rates})
        if not holds:
            return {**out, "verdict": "within noise",
                    "why": d["why"] + f"; {'; '.join(seen)}: not {side} on the fresh servers, so within noise "
                                      "(servers of one config differ by more than one look a side can tell apart)"}
    if len(out["recheck"]) < recheck_rounds(d):
        return {**out, "verdict": "within noise",
                "why": d["why"] + ("; " + "; ".join(seen) if seen else "")
                + f"; not confirmed: its re-check on {recheck_rounds(d)} pair(s) of fresh servers could not be "
                  f"measured, so a knee read {side} on fewer servers is not credited"}
    return {**out, "why": d["why"] + f"; {'; '.join(seen)}: it holds on {len(seen) + 1} servers a side"}


# ---------------------------------------------------------------- the confirm step
# The confirm step (ladder.Driver.confirm_step) measures rung 0 and the final stack again on `confirm.pairs` pairs of
# fresh engines and fresh servers. Its tok/s is `delta` over the engines; its knee is judged over the servers, each
# server's knee a unit (knees_delta): one server a side, as a rung's search, calls an A/A stack's knee better in ~13 %
# at the H200's spread (tests/test_confirm_simulation.py).
CONFIRM_STACK = 1.3  # the stack whose power the confirm step states: tok/s or knee x1.3 (issue 53)


def server_knee(k: dict) -> float | None:
    """One server's knee as a point: the geometric midpoint of its last pass and its first fail on evidence (its
    bracket); None where its search found no bracket (no pass, or no fail on evidence)."""
    lo, hi = k.get("knee_rps"), _fail_at(k)
    return math.sqrt(lo * hi) if lo and math.isfinite(hi) and hi > lo else None


def knee_spread(block: Floor | ServerSpread | None) -> Floor:
    """The relative SD of the knee between fresh servers of one config (params `knee.server_spread`, typed
    (config.ServerSpread): knee_cv on `servers` servers; `make benchmark ARGS="--parts 4"` measures it) as a Floor
    (df servers - 1; 0: not measured)."""
    if isinstance(block, Floor):
        return block
    if block is None or not block.servers or block.knee_cv is None:
        return Floor(0.0, 0, 1, "no servers' spread measured")
    where = ", ".join(str(v) for v in (block.measured_on, block.measured) if v)
    return Floor(float(block.knee_cv), block.servers, 1, where or "as typed")


def knees_delta(base: list[dict], new: list[dict], spread=None, confidence: float = CONFIDENCE) -> dict:
    """The knee of `new`'s servers vs `base`'s, each fresh server a unit: the difference of their mean log knees
    (server_knee: each bracket's midpoint), with a `confidence` interval, 'better' / 'worse' where it excludes zero.
    Its SD is the servers' spread measured on the card (`spread`: knee_spread; a server's knee also sits anywhere in
    its bracket: + width^2 / 12 on the log scale) pooled with this step's own servers of each side, by degrees of
    freedom: the knee's analogue of `delta` with its floor. 'unknown' without a spread measured and fewer than two
    servers a side, or with a side whose searches found no bracket."""
    spread = knee_spread(spread)
    sides = [[x for x in map(server_knee, side) if x] for side in (base, new)]
    counts = [len(side) for side in (base, new)]
    if not all(sides):
        return {"rel": None, "ci": None, "verdict": "unknown", "servers": counts,
                "why": "a side's searches found no bracket (no pass, or no fail on evidence)"}
    logs = [np.log(side) for side in sides]
    widths = [math.log(_fail_at(k) / k["knee_rps"]) ** 2 / 12 for side in (base, new) for k in side if server_knee(k)]
    ss = sum(float(np.sum((x - x.mean()) ** 2)) for x in logs)
    df_own = sum(len(x) - 1 for x in logs)
    prior = (spread.cv ** 2 + float(np.mean(widths))) * spread.df if spread.df else 0.0
    df = spread.df + df_own
    d = float(logs[1].mean() - logs[0].mean())
    rel = math.exp(d) - 1
    lo, hi = (math.exp(x.mean()) for x in logs)
    seen = (f"knee {fmt_g(round(lo, 3))} → {fmt_g(round(hi, 3))} req/s (each server's bracket midpoint, geometric "
            f"mean), {len(sides[0])} vs {len(sides[1])} server(s)"
            + (f" ({counts[0]} vs {counts[1]} searched)" if counts != [len(x) for x in sides] else ""))
    if not df:
        return {"rel": rel, "ci": None, "verdict": "unknown", "servers": [len(x) for x in sides],
                "why": f"{seen}, no servers' spread measured: the difference cannot be told from the servers' own"}
    # never below a server's place in its bracket (uniform: width^2 / 12): servers whose brackets coincide have no
    # spread of their own to show (a cpu confirm step, 2 servers a side, each side one bracket, read SD 0.0 %)
    sd = max(math.sqrt((prior + ss) / df), math.sqrt(float(np.mean(widths))))
    se = sd * math.sqrt(1 / len(sides[0]) + 1 / len(sides[1]))
    half = tq(confidence, df) * se
    ci = [math.exp(d - half) - 1, math.exp(d + half) - 1]
    verdict = "better" if ci[0] > 0 else "worse" if ci[1] < 0 else "within noise"
    source = (f"the servers' knee CV {spread.cv:.1%} from {spread.engines} servers ({spread.source})" if spread.df
              else "no servers' spread measured")
    why = f"{seen}, {confidence:.1%} interval, SD {sd:.1%} a server: {source}, pooled with this step's own, df {df}"
    return {"rel": rel, "ci": ci, "verdict": verdict, "why": why, "servers": [len(x) for x in sides], "df": df,
            "sd": round(sd, 4), "confidence": confidence}


def power(d: dict, gain: float = CONFIRM_STACK - 1, confidence: float = CONFIDENCE) -> float | None:
    """The chance that a Δ drawn as `d` was (delta: the engines and floor it rests on; knees_delta: the servers and
    their SD) calls a true gain of `gain` better: a noncentral t at the interval's degrees of freedom (a normal where
    the floor was judged at its upper end: the power where the truth sits at that upper end). On tok/s, the SD the
    interval was drawn with: the floor's, or the engines' own repeats' where they spread wider. None where `d` drew no
    interval."""
    if d.get("ci") is None or not d.get("df"):
        return None
    if "servers" in d:  # a knee over servers: on the log scale
        nb, nn = d["servers"]
        se, shift = d["sd"] * math.sqrt(1 / nb + 1 / nn), math.log(1 + gain)
    elif d.get("repeats_se"):  # drawn on the engines' own repeats, wider than the floor: their SE
        se, shift = d["repeats_se"], gain
    else:
        nb, nn = d["engines"]
        se, shift = d["floor_cv"] * math.sqrt(1 / nb + (1 + gain) ** 2 / nn), gain
    if not se:
        return 1.0
    if d.get("normal"):
        return float(sps.norm.sf(sps.norm.ppf((1 + confidence) / 2) - shift / se))
    return float(sps.nct.sf(tq(confidence, d["df"]), d["df"], shift / se))


# ---------------------------------------------------------------- paired quality test
def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value: b items flipped right->wrong, c wrong->right (binomial, p = 1/2)."""
    return float(sps.binomtest(b, b + c, 0.5).pvalue) if b + c else 1.0


def detectable_flips(n_items: int, alpha: float, floor: int = 0) -> int | None:
    """The fewest right->wrong flips (none the other way) among n_items that the gate can call a regression:
    `floor` of them are discounted as the eval's own noise, and the exact McNemar p of the rest must be < alpha.
    None when even all n_items flipping would not do. One-way p is 2 / 2**k, so at alpha 0.05 k is 6."""
    for total in range(floor + 1, n_items + 1):
        if mcnemar_exact(total - floor, 0) < alpha:
            return total
    return None


def detectable_drop(n_items: int, alpha: float, floor: int = 0) -> float | None:
    """The smallest accuracy drop (a fraction of n_items) the gate can tell from noise at alpha; None: none."""
    k = detectable_flips(n_items, alpha, floor)
    return None if k is None else k / n_items


def paired_verdict(n_items: int, b: int, c: int, alpha: float, min_items: int) -> tuple[str, float]:
    p = mcnemar_exact(b, c)
    if n_items < min_items:
        return "not enough evidence", p
    if p < alpha:
        return ("regressed" if b > c else "improved"), p
    return ("no change" if b == c == 0 else "not enough evidence"), p


# ---------------------------------------------------------------- roofline
# Peak memory bandwidth, GB/s (vendor datasheets), by the name nvidia-smi reports (without "NVIDIA"/"GeForce").
# Matched exactly: "A10" must not match "A100", nor "L4" "L40S". Override or extend with `roofline.bandwidth_gbs`.
GPU_BANDWIDTH_GBS = {
    "RTX 4090": 1008, "RTX 3090": 936, "L4": 300, "L40S": 864, "A10": 600, "A100-SXM4-40GB": 1555,
    "A100-SXM4-80GB": 2039, "A100 80GB PCIe": 1935, "H100 80GB HBM3": 3350, "H100 PCIe": 2000, "H200": 4800,
    "B200": 8000,
}


def _gpu_key(name: str) -> str:
    words = [w for w in name.replace("_", " ").split() if w.lower() not in ("nvidia", "geforce")]
    return " ".join(words).lower()


def bandwidth_gbs(gpu_name: str | None, overrides: dict | None = None) -> float | None:
    if not gpu_name:
        return None
    table = {_gpu_key(k): float(v) for k, v in {**GPU_BANDWIDTH_GBS, **(overrides or {})}.items()}
    return table.get(_gpu_key(gpu_name))


def weight_bits(quant: dict | None) -> float:
    """Bits read per weight of the quantized linear layers, scales and zero points included (a group of
    `group_size` weights carries one 16-bit scale, and one zero point of the weight width when asymmetric).
    Reads AWQ/GPTQ-style configs (bits, group_size, zero_point/sym), compressed-tensors (config_groups ...
    weights: num_bits, group_size, symmetric) and fp8 (8 bits, per-channel scales: negligible)."""
    if not quant:
        return 16.0
    method = str(quant.get("quant_method") or "").lower()
    if method in ("fp8", "fbgemm_fp8", "modelopt"):
        return 8.0
    if method == "compressed-tensors":
        groups = list((quant.get("config_groups") or {}).values())
        w = (groups[0].get("weights") or {}) if groups else {}
        bits, group, asym = w.get("num_bits") or 16, w.get("group_size"), w.get("symmetric") is False
        if w.get("type") == "float":
            return float(bits)
    else:
        bits = quant.get("bits") or quant.get("w_bit") or 16
        group = quant.get("group_size") or quant.get("q_group_size")
        asym = bool(quant.get("zero_point")) or quant.get("sym") is False
    if bits >= 16 or not group or group <= 0:
        return float(bits)
    return bits + (16 + (bits if asym else 0)) / group


def weight_bytes(cfg: dict, weight_bits: float) -> float:
    """Bytes of weights read per decode step: every linear layer once, plus the LM head (embeddings are a
    gather, not a full read). 16-bit norms and biases are negligible and left out."""
    h, i, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    d = cfg.get("head_dim") or h // heads
    per_layer = h * heads * d + 2 * h * kv * d + heads * d * h + 3 * h * i
    lm_head = h * cfg["vocab_size"]
    return (L * per_layer) * weight_bits / 8 + lm_head * 2  # LM head stays 16-bit in AWQ/W4A16 checkpoints


def kv_bytes_per_token(cfg: dict, kv_bytes: float) -> float:
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    d = cfg.get("head_dim") or cfg["hidden_size"] // heads
    return 2 * cfg["num_hidden_layers"] * kv * d * kv_bytes


def tpot_floor_ms(cfg: dict, bandwidth: float, weight_bits: float = 16, kv_bytes: float = 2,
                  context_tokens: int = 0, batch: int = 1) -> float:
    """Memory-bound lower bound on time per output token: bytes read per decode step / bandwidth (GB/s)."""
    step_bytes = weight_bytes(cfg, weight_bits) + batch * context_tokens * kv_bytes_per_token(cfg, kv_bytes)
    return step_bytes / (bandwidth * 1e9) * 1e3
