"""Whole ladders simulated with the project's own judgement (issue "Verdicts that hold for the whole ladder").

A rung is judged alone by tests/test_rule_simulation.py; a ladder judges five in a row against one base, and what a
reader signs is the ladder: "nothing kept" must mean nothing was there. This module climbs whole ladders as
ladder.Driver climbs them (run, try_rung, remeasure, knee_again), on the noise models tests/simulate.py states,
with the decisions made by the project's own functions (stats.delta, stats.pool, stats.knee_delta, stats.verdict_rate,
stats.knee_recheck, decide.needs_knee_again, decide.needs_again, decide.decide, ladder.knee_anchor, probing.search,
probing.recheck):

- one machine: an untimed warm-up engine, then rung 0's engine and its knee search on its own server; the card's
  floor is the profile's bench.noise_floor as stored and as the rule reads it (stats.Floor.of: at the upper end of
  its 95 % interval), held whatever the truth, as a ladder holds its params, pooled with the ladder's own same-config
  engines (record.floor_of);
- each rung: a fresh engine and a knee search on a fresh server, started from its base's knee (ladder.knee_anchor);
  its tok/s against the base's engine measured last (its latest re-measure, else its bench), its knee against the
  base's own search; a knee read better or worse re-checked on a fresh server of the base, then of the rung; a
  possible gain waits for the base measured again right after it (a fresh engine), and is judged on both flanks;
- a kept rung is the next rungs' base (its engine, its search); a reverted one leaves the base and its latest
  re-measure in place, so the rungs of an all-placebo ladder all meet rung 0's one knee search and are correlated
  through it.

Tok/s: an engine's passes are the config's rate x (1 + e) x (1 + u), u ~ N(0, the profile's measured pass-to-pass
spread: sim.IN_ENGINE_OF), e what is left beside them of the floor (the SD of engine means of bench.repeats passes,
as `make benchmark` measures it: sim.profile_machine); the machine's first engine reads sim.COLD low.
Knee: tests/simulate.py's model (a wall of
exponent gamma, bursts of dispersion phi, each fresh server's knee x exp(N(0, server CV))), with the profile's own
search and SLO settings.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

import config
import ladder
import simulate as sim
from judgement import decide, stats

# Where a profile's rung 0 knee sits against its bench's offline req/s, measured: the cpu's at 9.514-11.31 req/s (its
# bracket's middle 10.4) of 12.0 (383-386 output tok/s of 32-token answers; docs/measurements.md, 2026-12-05). Rung 0's
# search starts at knee.start_fraction of the bench's req/s, so at start_fraction / this of its knee. A profile not
# here starts at sim.knee_search's 0.7 of its knee. gpu-shape-4090 with 4 API servers: 26.91-32 req/s (its middle
# 29.455) of the bench's 26.82 on an H100 (docs/measurements.md, 2026-12-06; on an H200 ~0.97 of ~30.5, 2026-12-04).
KNEE_OF_BENCH = {"cpu": 10.4 / 12.0, "gpu-shape-4090": 29.455 / 26.82}

OBJECTIVE = "knee_rps"  # ladder.yaml's objective: a rung is kept on its knee, or on tok/s with its knee not worse


@dataclass(frozen=True)
class Noise:
    """A profile's noise, as measured (params and ladder.yaml), and its own search (sim.KneeModel)."""
    profile: str
    knee: float            # the configs' true knee, req/s (a grid rate: the worst place, sim.KNEE)
    model: sim.KneeModel
    server_cv: float       # knee.server_spread knee_cv (fresh servers' knees)
    knee_floor: float      # knee.noise_floor
    floor_cv: float        # fresh engines' true start-to-start (bench.noise_floor cv as measured; upper: its upper end)
    floor_engines: int
    stored: stats.Floor    # bench.noise_floor as the rule reads it (stats.Floor.of): the prior every ladder pools
    repeats: int
    true_phi: float = 0.0  # the looks' true dispersion (0: the model's, knee.dispersion)
    upper_gamma: float = sim.GAMMA  # the wall at the upper end (see upper)
    uppers: tuple[tuple[float, float], ...] = ()  # simulate.upper_ends: (knee CV, dispersion) a measured block
    start: float = 0.7     # rung 0's search starts at this multiple of its knee (sim.knee_search's default)
    pairs: int = stats.KNEE_BETTER_ROUNDS  # knee.better_pairs: pairs of fresh servers a better knee is re-checked on

    @classmethod
    def of(cls, profile: str, knee: float, spread_from: str = "gpu-shape-4090") -> Noise:
        """The profile's measured noise. A profile with no measured server spread takes `spread_from`'s. At the
        upper end (upper()): the log share's between-server SD at its interval's upper end over simulate.upper_gamma's
        wall (a rung may change what binds: a wall fitted steep on rung 0 bounds a later rung's only where that was
        measured too), so knees that far apart, and the looks' dispersion the larger of knee.dispersion's and the
        spread fit's, for each measured block (simulate.upper_ends). The gpu profiles' (one rate, gamma fixed at
        GAMMA) come out as stored."""
        p = sim.profile_settings(profile)
        spread = p["knee"]["server_spread"]
        if not spread.get("servers"):
            spread = sim.profile_settings(spread_from)["knee"]["server_spread"]
        fl = p["bench"]["noise_floor"]
        model = sim.KneeModel.of(profile)
        gamma_up = sim.upper_gamma(spread)
        start = p["knee"]["start_fraction"] / KNEE_OF_BENCH[profile] if profile in KNEE_OF_BENCH else 0.7
        uppers = tuple(sim.upper_ends(spread, model.phi))
        return cls(profile, knee, model, spread["knee_cv"],
                   p["knee"].get("noise_floor") or 0.0, fl["cv"], fl["engines"],
                   stats.Floor.of(config.NoiseFloor(**fl)), p["bench"]["repeats"],
                   model.phi, gamma_up, uppers, start,
                   p["knee"].get("better_pairs") or stats.KNEE_BETTER_ROUNDS)

    def upper(self, block: int = 0) -> Noise:
        """Every floor at the upper end of its 95 % interval: the servers' knee spread (and the looks' dispersion) of
        the measured spread block `block` (0: rung 0's; simulate.upper_ends), the engines' start-to-start; the wall
        as of() sets it there."""
        cv, phi = self.uppers[block]
        return replace(self, server_cv=cv, floor_cv=sim.upper_cv(self.floor_cv, self.floor_engines - 1),
                       model=self.model.gentler(self.upper_gamma), true_phi=phi)

    def machine(self, rng) -> sim.Machine:
        """Fresh engines one after another on one machine; its first reads sim.COLD low."""
        return sim.profile_machine(rng, self.profile, True, self.repeats, self.floor_cv)

    def search(self, rng, knee: float, anchor: dict | None = None) -> dict:
        """A knee search on a fresh server of a config whose knee is `knee` (the knee stage's search; without an
        anchor, rung 0's, from `start` x its knee)."""
        return sim.knee_search(rng, knee, anchor, self.server_cv, self.knee_floor, self.true_phi or self.model.phi,
                               start=self.start, model=self.model)

    def recheck(self, rng, knee: float, rate: float, side: str | None) -> list[dict]:
        return sim.recheck(rng, knee, rate, side, self.server_cv, self.true_phi or self.model.phi, self.model)


@dataclass
class Config:
    """A measured config: its true rates, its engines' means (its own group for the floor), its knee search."""
    tps: float
    knee: float
    engines: list[list[float]]
    search: dict


def ladder_run(rng, nm: Noise, rungs: list[list[tuple[float, float]]]) -> list[list[str]]:
    """One ladder: rung 0, then `rungs`, each a list of candidates (tok/s factor, knee factor) against the last kept
    rung. Returns each candidate's verdict: "kept on its knee", "kept on output tok/s" or "reverted"."""
    prior = nm.stored  # params', as a ladder reads them: one measurement, held whatever the truth
    m = nm.machine(rng)
    m.engine(100.0, repeats=1)  # bench.warm_up_engine: untimed, discarded
    base = Config(100.0, nm.knee, [m.engine(100.0)], nm.search(rng, nm.knee))
    configs = [base]
    latest = base.engines[0]
    out = []
    for i, cands in enumerate(rungs):
        last = i == len(rungs) - 1

        def floor():
            return stats.pool(prior, [[float(np.mean(e)) for e in c.engines] for c in configs if len(c.engines) >= 2])
        recs, news = [], []
        for tps_f, knee_f in cands:
            anchor = ladder.knee_anchor({"knee": base.search}, {}, floor=nm.knee_floor, last=last)
            new = Config(base.tps * tps_f, base.knee * knee_f, [m.engine(base.tps * tps_f)], {})
            new.search = nm.search(rng, new.knee, anchor)
            rec = {"status": "ok", "delta": {"output_tps": stats.delta([latest], new.engines, floor()),
                                             "knee_rps": stats.knee_delta(base.search, new.search)}}
            if decide.needs_knee_again(rec, OBJECTIVE):  # ladder.Driver.knee_again
                d = {**rec["delta"]["knee_rps"], "pairs": nm.pairs}
                rate = stats.verdict_rate(base.search, new.search, d["verdict"])
                b, n = base.knee, new.knee
                rec["delta"]["knee_rps"] = stats.knee_recheck(d, []) if not rate else sim.rechecked(
                    d, lambda r, side, b=b: nm.recheck(rng, b, r, side),
                    lambda r, n=n: nm.recheck(rng, n, r, None), float(f"{rate:.4g}"))
            recs.append(rec)
            news.append(new)
        pending = [j for j, r in enumerate(recs) if decide.needs_again(r, OBJECTIVE)]
        if pending:  # the base measured again right after them (ladder.Driver.remeasure), once for all
            again = m.engine(base.tps)
            base.engines.append(again)
            for j in pending:
                recs[j]["delta"]["output_tps"] = stats.delta([latest, again], news[j].engines, floor())
                recs[j]["delta"][decide.AGAIN] = True
            latest = again
        kept = [j for j, r in enumerate(recs) if decide.decide(r, {}, OBJECTIVE)[0]]
        out.append([("kept on " + decide.rested_on(r, OBJECTIVE)) if j in kept else "reverted"
                    for j, r in enumerate(recs)])
        configs.extend(news)
        if kept:  # decide.choose ranks candidates; a ladder of one candidate a rung keeps the one
            base = news[kept[0]]
            latest = base.engines[0]
    return out


@dataclass
class Rates:
    trials: int
    kept_any: float          # ladders that kept anything
    kept_per_rung: list      # each rung's share kept
    kept_on: dict            # ladders that kept anything on its knee / on output tok/s
    kept: np.ndarray         # [trial, rung]: kept

    def found(self, rung: int) -> float:
        return self.kept_per_rung[rung]

    def both(self, a: int, b: int) -> float:
        return float((self.kept[:, a] & self.kept[:, b]).mean())

    def __repr__(self) -> str:
        return (f"Rates({self.trials} ladders: kept anything {self.kept_any:.2%} (on its knee "
                f"{self.kept_on['its knee']:.2%}, on output tok/s {self.kept_on['output tok/s']:.2%}); per rung "
                f"{[f'{x:.2%}' for x in self.kept_per_rung]})")


def ladders(nm: Noise, rungs: list[list[tuple[float, float]]], trials: int, seed: int) -> Rates:
    rng = np.random.default_rng(seed)
    runs = [ladder_run(rng, nm, rungs) for _ in range(trials)]
    kept = np.array([[any(v.startswith("kept") for v in r) for r in run] for run in runs])
    on = {w: float(np.mean([any(v == "kept on " + w for r in run for v in r) for run in runs]))
          for w in ("its knee", "output tok/s")}
    return Rates(trials, float(kept.any(axis=1).mean()), kept.mean(axis=0).round(4).tolist(), on, kept)
