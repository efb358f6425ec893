"""The simulation's noise models and measuring helpers, shared by the simulation tests (tests/test_rule_simulation.py:
the per-rung rule; tests/test_confirm_simulation.py: the confirm step). Each test file states what it holds; this
module states the models, as measured, and measures with the project's own functions (probing.search, stats.pool)."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from judgement import stats
from measure import probing

TRIALS = 2000


upper_cv = stats.upper_cv  # the upper end of a CV's two-sided 95 % interval: the rule reads a stored floor there too


def profile_settings(profile: str) -> dict:
    import config
    import plan
    eff = plan.effective_params(config.read_params(), plan.load_ladder(plan.LADDER_YAML), profile,
                                plan.committed_params())
    return config.validate(eff)


# ---------------------------------------------------------------- output tok/s
# - an engine's mean output tok/s = the config's true rate x (1 + e), e ~ N(0, START_TO_START) between fresh engines;
#   each of its timed repeats x (1 + u), u ~ N(0, IN_ENGINE) (in-engine);
# - "cold base": the first engine started on a machine reads COLD low (three fresh engines on a fresh H200: 6,639,
#   then 7,242 and 7,337 tok/s);
# - the card's floor (`make benchmark --parts 2`): a discarded first engine, then 8 fresh engines of as many timed
#   repeats, on its own machine (card_floor), read as the rule reads a stored floor (stats.Floor.read).
# - a profile's measured floor is the SD of engine means of its bench.repeats passes (`make benchmark` measures it so):
#   there (Machine(of_means=True)) an engine's own e is what is left of it beside its passes' u / sqrt(repeats), u at
#   the profile's measured pass-to-pass spread (IN_ENGINE_OF; the model's IN_ENGINE where none was measured).
GPU_REPEATS = profile_settings("gpu-shape-4090")["bench"]["repeats"]
IN_ENGINE, START_TO_START, COLD = 0.005, 0.015, 0.06
# the cpu's passes: 2.77 % pooled over 9 engines x 3 (df 18) on this 2-core AMD EPYC box, d99d63b
# (docs/measurements.md); the simulations read 0.5 % there before, which flattered the three-pass rule's power
IN_ENGINE_OF = {"cpu": 0.0277}


class Machine:
    """Fresh engines started one after another on one machine; the first reads COLD low if `cold`. Each engine runs
    `repeats` timed repeats, each x (1 + u), u ~ N(0, `in_engine`). `start_to_start`: the SD between fresh engines
    (the model's, or the upper end of a floor's interval); with `of_means` it is the SD of engine means of `repeats`
    passes, as a profile's floor is measured, and an engine's own part is what is left of it beside its passes';
    `drift`: the machine's speed moves by this share per engine started (linearly)."""

    def __init__(self, rng, cold: bool, repeats: int, start_to_start: float = START_TO_START, drift: float = 0.0,
                 in_engine: float = IN_ENGINE, of_means: bool = False):
        self.rng, self.cold, self.started, self.repeats = rng, cold, 0, repeats
        self.drift, self.in_engine = drift, in_engine
        self.between = (math.sqrt(max(start_to_start ** 2 - in_engine ** 2 / repeats, 0.0)) if of_means
                        else start_to_start)

    def engine(self, rate: float, repeats: int | None = None) -> list[float]:
        first = self.started == 0
        speed = 1 + self.drift * self.started
        self.started += 1
        mean = rate * speed * (1 + self.rng.normal(0, self.between)) * (1 - COLD if first and self.cold else 1)
        return list(mean * (1 + self.rng.normal(0, self.in_engine, repeats or self.repeats)))


def profile_machine(rng, profile: str, cold: bool, repeats: int, floor_cv: float) -> Machine:
    """Fresh engines of a profile whose measured floor (or its upper end) is `floor_cv`: engine means of `repeats`
    passes that far apart, the passes at the profile's measured spread."""
    return Machine(rng, cold, repeats, floor_cv, in_engine=IN_ENGINE_OF.get(profile, IN_ENGINE), of_means=True)


def card_floor(rng, cold: bool, engines: int = 8, repeats: int = 1,
               start_to_start: float = START_TO_START) -> stats.Floor:
    """`make benchmark --parts 2` on its own machine: the first engine discarded, then `engines` fresh ones."""
    m = Machine(rng, cold, repeats, start_to_start)
    m.engine(100.0)
    means = [float(np.mean(m.engine(100.0))) for _ in range(engines)]
    return stats.Floor.read(float(np.std(means, ddof=1) / np.mean(means)), engines, "simulated card")


# ---------------------------------------------------------------- the knee
# Probe-noise model, measured with the steady-state probe on H200s (tests/fixtures/h200-probe-study.json: `make
# benchmark` part 6 on gpu-shape-4090 rung 0, p95 SLO; test_the_knee_model_rests_on_the_h200_study checks it there):
# - at offered rate r a server of knee K sends a share s = q (r / K)^GAMMA of its requests over the SLO (q = 5 %, a
#   p95 SLO); GAMMA = 13: 5.1 % of 1,849 counted at 11.31 req/s (8 probes), 81 % at 14, none of 155 at 8 or of 186
#   at 9.5. A knee is a wall, not a slope;
# - requests over the SLO come in bursts: a probe's count is a compound Poisson of clusters of mean size
#   (PHI + 1) / 2 (geometric), so it varies PHI times as much as a binomial count. PHI is the profile's
#   knee.dispersion (probing.dispersion_of on that study: 6.9); the rule's test uses the same;
# - each fresh server's knee is K x exp(N(0, SERVER_CV)): the profile's knee.server_spread (measure.spread's fit of
#   looks on fresh servers of one config: the same model, the share's between-server SD over the wall's exponent);
#   the tests hold the rule at its value and at the upper end of its 95 % interval (SERVER_CV_HI). gpu-shape-4090's
#   was measured with 4 API servers (9 servers: CV 0, its wall 61); the stock front end's (ONE_API, CV 12.9 %) is
#   kept as a case: the rule was built for it;
# - gpu-shape-4090's search (its profile's knee settings): p95, 20 % brackets (a grid of 2^(1/4)), probes sized for
#   PHI, up to knee.max_repeats (2) probes of a rate pooled while inconclusive; the base's search starts at 0.7 K
#   (the H200s' searches started at 1.0-1.2 K), the rung's at the base's knee (run.anchor); a verdict it reads
#   better or worse is re-checked on a fresh server of the base, then of the rung (probing.recheck,
#   stats.knee_recheck), better on the profile's knee.better_pairs such pairs (PAIRS: gpu-shape-4090's), as
#   ladder.Driver.knee_again does.
# - another profile's search (KneeModel.of: the cpu's p90, one look a rate, its own dispersion) on its own wall and
#   server spread where they are measured (the cpu's: 8 fresh servers at two rates, params.yaml knee.server_spread),
#   else the H200's.


P4090 = profile_settings("gpu-shape-4090")
SPREAD = P4090["knee"]["server_spread"]
GAMMA, PHI, SERVER_CV = 13.0, P4090["knee"]["dispersion"]["phi"], SPREAD["knee_cv"]
PAIRS = P4090["knee"].get("better_pairs") or stats.KNEE_BETTER_ROUNDS


def spread_blocks(spread: dict) -> list[dict]:
    """A profile's measured spread blocks: its own (rung 0's) and those on other configs of its ladder (`also`)."""
    return [spread, *(spread.get("also") or [])]


def upper_gamma(spread: dict) -> float:
    """The wall the upper end runs on. A rung may change what binds, so one config's wall does not bound another's:
    where the spread was measured on rung 0 alone, the gentler of its wall's lower end and GAMMA (the H200 study's);
    where it was measured on a later rung too (`also`, each with its wall fitted from looks at two rates), the gentlest
    of their lower ends. The cpu's: rung 0's 69.5 and the final stack's 188.8 (gamma 13 would put its knees 30.8 %
    apart at sigma's upper end, where both configs' walls read them within 0-3.9 %)."""
    blocks = spread_blocks(spread)
    if len(blocks) > 1 and all(b.get("gamma_ci") for b in blocks):
        return min(b["gamma_ci"][0] for b in blocks)
    return min((spread.get("gamma_ci") or [GAMMA])[0], GAMMA)


def upper_ends(spread: dict, phi: float) -> list[tuple[float, float]]:
    """The truth at the upper end, one per measured block (rung 0's, then `also`'s): fresh servers' knee CV, the log
    share's between-server SD at its interval's upper end over upper_gamma's wall, and the looks' dispersion, the
    larger of `phi` (knee.dispersion) and the block's fit's. Each block's pair is one noise model: with one look a
    rate on each server a fit splits the same spread between sigma and phi its own way (the cpu's rung 0: 2.46 and
    3.45; its final stack: 0 and 20.0), so the largest of each across blocks would count it twice. The spread
    measured with 4 API servers reads knees' CV 0 [0, 0.61 %] at its own wall of 61 [45, 81]: 2.9 % at GAMMA's; the
    cpu's rung 0 1.9 % [1.1, 3.9 %] on 131.8 [69.5, 187.4]: 5.8 % at 69.5, its final stack's 1.3 %."""
    g = upper_gamma(spread)
    return [(b["sigma_ci"][1] / g, max(phi, b.get("phi") or 0.0)) for b in spread_blocks(spread)]


def upper_knee_cv(spread: dict) -> float:
    """Rung 0's block's knee CV at the upper end (upper_ends' first)."""
    return upper_ends(spread, 1.0)[0][0]


SERVER_CV_HI = upper_knee_cv(SPREAD)
# The spread the stock front end (one API-server process) gave on H200s, 12 servers: knees' CV 12.9 % [5.9, 16.5]
# (the gpu profile's, a user's own card with the stock server): the front end's limit, not the engine's.
ONE_API = profile_settings("gpu")["knee"]["server_spread"]
ONE_API_CV, ONE_API_CV_HI = ONE_API["knee_cv"], ONE_API["knee_cv_ci"][1]
KNEE_SETTINGS = {**P4090["knee"], "rates": None, "min_rate": None}
KNEE_SLO = P4090["slo"]


@dataclass(frozen=True)
class KneeModel:
    """A profile's knee search as its settings run it: the knee settings, the SLO and the dispersion its probes are
    sized and judged with."""
    settings: dict
    slo: dict
    phi: float
    gamma: float = 13.0  # the wall's exponent (GAMMA, the H200 study's) ...
    gamma_lo: float = 13.0  # ... and the low end of its interval: a gentler wall, noisier looks

    @classmethod
    def of(cls, profile: str) -> KneeModel:
        """The profile's search on its own wall: gamma as its server spread fitted it where looks at two rates did
        (the cpu's capacity wall, 131.8 [69.5, 187.4] on the AMD EPYC box), else the H200 study's GAMMA."""
        p = profile_settings(profile)
        sp = p["knee"]["server_spread"]
        gamma, lo = (sp["gamma"], sp["gamma_ci"][0]) if sp.get("servers") and sp.get("gamma_ci") else (GAMMA, GAMMA)
        return cls({**p["knee"], "rates": None, "min_rate": None}, p["slo"], p["knee"]["dispersion"]["phi"],
                   gamma, lo)

    def gentler(self, gamma: float | None = None) -> KneeModel:
        """The wall at `gamma` (default: the low end of its exponent's interval)."""
        return replace(self, gamma=self.gamma_lo if gamma is None else gamma)


GPU4090 = KneeModel(KNEE_SETTINGS, KNEE_SLO, PHI)


def look(rng, n: int, share: float, need: int | None = None, phi: float = PHI) -> tuple[int, int]:
    """One look of n counted requests: (over the SLO, counted). The requests over it come in clusters (Poisson) of
    geometric size, mean (phi + 1) / 2 (variance phi x n s), each at a uniform place in the look. With `need` (the
    look stops sending once its fail is certain: knee_looks.Curtail), it ends at the request where the count reaches
    it."""
    m = (phi + 1) / 2
    clusters = rng.poisson(n * share / m)
    if not clusters:
        return 0, n
    sizes, at = rng.geometric(1 / m, clusters), np.sort(rng.uniform(0, 1, clusters))
    total = np.cumsum(sizes)
    if need is None or total[-1] < need:
        return int(min(n, total[-1])), n
    i = int(np.argmax(total >= need))
    seen = min(max(int(np.ceil(at[i] * n)), int(total[i])), n)
    return int(min(total[i], seen)), seen


LOOK_S = 10.0  # a look's seconds around its counted arrivals (settle, tail, drain): H200 looks of ~40 s counted, ~50


def server_probe(rng, k: dict, server: float, true_phi: float = PHI, curtail: bool = True, model: KneeModel = GPU4090):
    """A probe function (probing.search's `probe`) of one server whose knee is `server`."""
    slo, phi = model.slo, model.phi
    q = 1 - slo["percentile"] / 100

    def probe(rate, rows):
        counted = probing.probe_prompts(rate, k["probe_seconds"], slo["percentile"], 0.0, k["min_prompts"],
                                        k["max_prompts"], phi=phi, looks=k["max_repeats"])
        share = min(q * (rate / server) ** model.gamma, 1.0)
        visit = [r for r in rows if r["offered_rps"] == rate]  # the search visits a rate once
        need = probing.stop_count(counted, visit, slo["percentile"], phi, k["max_repeats"])  # as knee_looks.Curtail
        over, seen = look(rng, counted, share, need if curtail else None, true_phi)
        return {"offered_rps": rate, "counted": seen, "over_slo": over, "failed": 0, "backlog": False,
                "seconds": seen / rate + LOOK_S}
    return probe


def fresh(rng, knee: float, server_cv: float, drift: float = 1.0) -> float:
    """A fresh server's knee: the config's, times its server effect (and a machine running `drift` of its speed)."""
    return knee * drift * float(np.exp(rng.normal(0, server_cv)))


def knee_search(rng, knee: float, anchor: dict | None = None, server_cv: float = SERVER_CV, floor: float = 0.0,
                true_phi: float = PHI, start: float = 0.7, curtail: bool = True, drift: float = 1.0,
                model: KneeModel = GPU4090) -> dict:
    k = {**model.settings, "start_rate": start * knee, "anchor": anchor}
    probe = server_probe(rng, k, fresh(rng, knee, server_cv, drift), true_phi, curtail, model)
    rows, probes = probing.search(probe, k, model.slo)
    return {**probing.knee_result(probes, None, k["rel_tol"], rows),
            "conclusive_fail_rps": probing.conclusive_fail(rows), "noise_floor": floor, "probes": len(rows),
            "seconds": sum(r["seconds"] for r in rows), "rows": rows}


def recheck(rng, knee: float, rate: float, side: str | None, server_cv: float, true_phi: float = PHI,
            model: KneeModel = GPU4090) -> list[dict]:
    """probing.recheck on a fresh server of knee `knee` (the knee stage's run.anchor.look), its looks sized as the
    stage sizes them (probing.recheck_settings)."""
    probe = server_probe(rng, probing.recheck_settings(model.settings), fresh(rng, knee, server_cv), true_phi,
                         model=model)
    return probing.recheck(probe, rate, model.settings, model.slo, side)


def rechecked(d: dict, base_server, rung_server, rate: float) -> dict:
    """stats.knee_recheck as ladder.Driver.knee_again runs it: pairs of fresh servers, the base's looked at `rate`
    (`base_server(rate, side)`: its rows), the rung's where that one was judged (`rung_server(rate)`), one pair after
    another while each holds, up to stats.recheck_rounds."""
    side, rounds = d["verdict"], []
    for _ in range(stats.recheck_rounds(d)):
        b = base_server(rate, side)
        rounds.append((b, rung_server(stats.recheck_rate(b))))
        if not stats.pair_holds(side, *rounds[-1]):
            break
    return stats.knee_recheck(d, rounds)


KNEE = 11.31  # on a grid rate: the worst place for a knee (the rate at it is inconclusive half the time)
