"""The confirm step proved by simulation, with the project's own functions and fixed seeds: at the end of a ladder
rung 0 ("stock") and the final kept stack are measured again, `confirm.pairs` pairs of fresh engines and servers
(ladder.Driver.confirm_step), and record.confirm_summary judges them (compare_sides: stats.delta on tok/s,
stats.knee_delta on the knee; decide.reproduced). The noise models are tests/simulate.py's (the rule's own):

- tok/s: fresh engines START_TO_START (1.5 %) apart, IN_ENGINE (0.5 %) within; the floor every Δ is drawn with is
  the card's (8 fresh engines, simulated on the same machine model) pooled with the ladder's own same-config engines
  (record.floor_of: rung 0 and the final rung as the ladder measured them, and the confirm's own);
- the knee: gpu-shape-4090's search on the H200 probe model (p95, phi 6.9, two looks a rate, knee.noise_floor 0),
  each fresh server's knee x exp(N(0, 12.9 %)) (its knee.server_spread); the cpu profile's search (p90, phi 5.3, one
  look a rate, knee.noise_floor 0.5) on the same wall and spread (no cpu spread is measured: params.yaml);
- rung 0's search starts at 0.7 K; each confirm run's search starts from the knee before it, on to its own bracket
  (ladder.knee_anchor(bracket=True)), as the driver starts them;
- "at the upper end": the truth at the upper end of each floor's 95 % interval: the servers' knee CV at
  knee.server_spread's knee_cv_ci upper (16.5 %), fresh engines at START_TO_START x sqrt(df / chi2_0.025(df)) with
  the profile's bench.noise_floor df (7: 3.05 %).

A stack is "called better" where confirm_summary's `reproduced` is True. What must hold (issue 53): an A/A stack
(the final stack no faster than stock) is called better in <= 2.5 %; the power for a true x1.3 stack (tok/s and knee
both x1.3) is reported (a strict xfail below 80 %). 2,000 trials a case.
"""
import math

import numpy as np
import pytest
from scipy import stats as sps

import ladder
from judgement import record, stats
from simulate import (
    SERVER_CV,
    SERVER_CV_HI,
    START_TO_START,
    TRIALS,
    KneeModel,
    Machine,
    card_floor,
    knee_search,
    profile_settings,
)

PROFILES = {p: profile_settings(p) for p in ("gpu-shape-4090", "cpu")}
MODELS = {p: KneeModel.of(p) for p in PROFILES}
KNEES = {"gpu-shape-4090": 11.31, "cpu": 5.657}  # each on a grid rate: the worst place for a knee; the cpu's ~ its own
STOCK_TPS = 100.0


def upper_start_to_start(profile: str) -> float:
    """The fresh engines' SD at the upper end of a floor's 95 % interval, were it measured with the profile's
    bench.noise_floor degrees of freedom: sqrt(df / chi2_0.025(df)) x the model's."""
    df = stats.Floor.of(PROFILES[profile]["bench"]["noise_floor"]).df
    return START_TO_START * math.sqrt(df / sps.chi2.ppf(0.025, df))


def run(name: str, knobs: dict, engine: list[float], knee: dict) -> dict:
    return {"name": name, "exp": f"sim-{name}", "status": "ok", "knobs": knobs, "role": "confirm",
            "bench": {"status": "ok", "output_tps_runs": engine, "output_tps": float(np.median(engine))},
            "knee": knee}


STOCK, FINAL = {"engine.seed": 0}, {"engine.seed": 0, "engine.max_num_seqs": 32}


def confirm_trial(rng, profile: str, tps: float, knee: float, pairs: int, upper: bool = False) -> dict:
    """One ladder's end as the driver measures it: rung 0 and the final rung as the ladder measured them (on this
    machine, earlier), then the confirm pairs (stock, then final: fresh engine and server each, the knee search
    started from the knee before it), judged by record.confirm_summary. The final stack's true tok/s and knee are
    `tps` and `knee` times stock's."""
    p, model = PROFILES[profile], MODELS[profile]
    s2s = upper_start_to_start(profile) if upper else START_TO_START
    cv = SERVER_CV_HI if upper else SERVER_CV
    k0 = KNEES[profile]
    floor_spec = p["bench"]["noise_floor"]
    prior = card_floor(rng, False, floor_spec["engines"], p["bench"]["repeats"], s2s)
    m = Machine(rng, False, p["bench"]["repeats"], s2s)

    def search(true_knee: float, anchor: dict | None) -> dict:
        return knee_search(rng, true_knee, anchor, cv, p["knee"]["noise_floor"], model.phi, model=model)
    rung0 = run("baseline", STOCK, m.engine(STOCK_TPS), search(k0, None))
    final = run("final-rung", FINAL, m.engine(STOCK_TPS * tps), {})  # its knee: no part of the confirm's judgement
    runs, last = [], rung0
    for k in range(1, pairs + 1):
        for which, knobs, rate, kn in (("baseline", STOCK, STOCK_TPS, k0),
                                       ("final", FINAL, STOCK_TPS * tps, k0 * knee)):
            anchor = ladder.knee_anchor(last, knobs, bracket=True)
            last = run(f"confirm-{k}-{which}", knobs, m.engine(rate), search(kn, anchor))
            runs.append(last)
    floor = record.floor_of(prior, [rung0, final, *runs])
    return record.confirm_summary(runs, floor, "knee_rps", [])


def confirm_rates(profile: str, tps: float, knee: float, seed: int, pairs: int | None = None,
                  upper: bool = False) -> dict:
    """The share of TRIALS ladders whose confirm step called the final stack better (`reproduced`), and the share of
    its tok/s and knee verdicts."""
    rng = np.random.default_rng(seed)
    pairs = pairs or PROFILES[profile]["confirm"]["pairs"]
    out = [confirm_trial(rng, profile, tps, knee, pairs, upper) for _ in range(TRIALS)]
    share = {"better": np.mean([o["reproduced"] is True for o in out])}
    for m in ("output_tps", "knee_rps"):
        for v in ("better", "worse"):
            share[f"{m} {v}"] = np.mean([o["delta"][m]["verdict"] == v for o in out])
    return {k: round(float(v), 4) for k, v in share.items()}


CASES = [(p, u) for p in PROFILES for u in (False, True)]
IDS = [f"{p}{' upper end' if u else ''}" for p, u in CASES]


ONE_SERVER = pytest.mark.xfail(strict=True, reason="today's confirm step judges the knee on one server a side with no "
                               "re-check: on gpu-shape-4090 an A/A stack's knee reads better in 12.7 %, 17.1 % at the "
                               "upper end of the servers' spread (issue 53)")
AA_CASES = [pytest.param(p, u, id=i, marks=[ONE_SERVER] if p == "gpu-shape-4090" else [])
            for (p, u), i in zip(CASES, IDS)]


@pytest.mark.parametrize(("profile", "upper"), AA_CASES)
def test_an_a_a_stack_is_called_better_in_at_most_2_5_percent(profile, upper):
    r = confirm_rates(profile, 1.0, 1.0, seed=41, upper=upper)
    print(profile, "upper end" if upper else "measured", r)
    assert r["better"] <= 0.025, r


@pytest.mark.parametrize(("profile", "upper"), CASES, ids=IDS)
def test_a_true_1_3x_stack_is_called_better_in_at_least_80_percent(profile, upper):
    r = confirm_rates(profile, 1.3, 1.3, seed=42, upper=upper)
    print(profile, "upper end" if upper else "measured", r)
    assert r["better"] >= 0.80, r


@pytest.mark.xfail(strict=True, reason="a stack whose gain is its knee alone (x1.3, tok/s unchanged) is confirmed in "
                   "54.5 % on gpu-shape-4090 (one server a side) and 0.35 % on the cpu (knee.noise_floor 0.5: a knee "
                   "must move ~1.5x)")
@pytest.mark.parametrize("profile", list(PROFILES))
def test_a_stack_whose_gain_is_its_knee_alone_is_called_better_in_at_least_80_percent(profile):
    r = confirm_rates(profile, 1.0, 1.3, seed=43)
    print(profile, r)
    assert r["better"] >= 0.80, r
