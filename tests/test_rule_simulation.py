"""The output tok/s rule proved by simulation, with the project's own functions (stats.delta, stats.pool) and fixed
seeds, on a stated noise model:

- an engine's mean output tok/s = the config's true rate x (1 + e), e ~ N(0, 1.5 %) between fresh engines
  (start-to-start); each of its timed repeats x (1 + u), u ~ N(0, 0.5 %) (in-engine): gpu-shape-4090's
  bench.repeats of them (one: the engine is the unit), the cpu profile's for its own test;
- "cold base": the first engine started on a machine reads 6 % low (three fresh engines on a fresh H200: 6,639,
  then 7,242 and 7,337 tok/s);
- the card's floor (`make benchmark --parts 2`): a discarded first engine, then FLOOR_ENGINES (32) fresh engines of
  as many timed repeats, on its own machine, judged as the rule judges a stored floor: at the upper end of its 95 %
  interval, taken as known there (stats.Floor.read: x 1.33 at df 31; x 2.03 at 8 engines' df 7, where a true +10 %
  was called better in 61 %, 85 % on 16, 90 % on 24, 95 % on 32: a card's floor on 8 engines holds only a floor far
  below its effects, as gpu-shape-4090's 0.59 %);
- a ladder rung (ladder.Driver): the first bench warms the machine with an untimed engine
  (bench.warm_up_engine), then base, rung, and the base again where that could still call the rung better
  (stats.may_gain: stats.again_odds), each a fresh engine; the rung is judged against the mean of the two base
  engines, the floor pooled with them.

2,000 trials a case. What must hold (issue "the instrument"): an A/A pair is called better in <= 2.5 % and worse
in <= 2.5 %, a true +10 % is called better in >= 90 %, in the warm and the cold-base case alike; a placebo on the
cpu profile (the engines its floor rests on, params.yaml) is falsely kept in <= 1 %.
"""
import numpy as np
import pytest

import ladder
from judgement import stats
from measure import probing
from simulate import (
    GAMMA,
    GPU_REPEATS,
    KNEE,
    ONE_API_CV,
    PAIRS,
    PHI,
    SERVER_CV,
    SERVER_CV_HI,
    SPREAD,
    TRIALS,
    Machine,
    card_floor,
    knee_search,
    profile_settings,
    recheck,
    rechecked,
)

FLOOR_ENGINES = 32


def rung(rng, effect: float, cold: bool, warm_up: bool = True, floor_engines: int = FLOOR_ENGINES,
         always_again: bool = False,
         engines: list | None = None, repeats: int | None = None) -> str:
    """One rung as the ladder measures and judges it (decide.needs_again): its verdict on output tok/s. The base is
    measured again after the rung unless its Δ against the base before it shows no gain (stats.may_gain), or always."""
    repeats = repeats or GPU_REPEATS
    prior = card_floor(rng, cold, floor_engines, repeats)
    m = Machine(rng, cold, repeats)
    if warm_up:
        m.engine(100.0, repeats=1)  # untimed, discarded
    before = m.engine(100.0)
    new = m.engine(100.0 * (1 + effect))
    first = stats.delta([before], [new], prior)
    if engines is not None:
        engines.append(m.started)
    if not always_again and not stats.may_gain(first):
        return first["verdict"]
    after_rung = m.engine(100.0)
    if engines is not None:
        engines[-1] = m.started
    floor = stats.pool(prior, [[float(np.mean(before)), float(np.mean(after_rung))]])
    return stats.delta([before, after_rung], [new], floor)["verdict"]


def rates(effect: float, cold: bool, seed: int, **kw) -> dict:
    rng = np.random.default_rng(seed)
    calls = [rung(rng, effect, cold, **kw) for _ in range(TRIALS)]
    return {v: calls.count(v) / TRIALS for v in ("better", "worse", "within noise", "unknown")}


@pytest.mark.parametrize("cold", [False, True], ids=["warm", "cold base"])
def test_an_a_a_pair_is_called_better_or_worse_in_at_most_2_5_percent_each_way(cold):
    r = rates(0.0, cold, seed=11)
    assert r["better"] <= 0.025 and r["worse"] <= 0.025, r


def test_a_placebo_rarely_costs_a_re_measure_of_its_base():
    # a re-measure is a fresh engine: only where it could still make the rung better (stats.again_odds >= 1 %); a
    # placebo reads faster half the time, but rarely by enough (7 % of trials here, 53 % when any lead asked for one)
    engines: list[int] = []
    rates(0.0, True, seed=11, engines=engines)
    assert np.mean([e == 4 for e in engines]) <= 0.10, np.mean(engines)


@pytest.mark.parametrize("cold", [False, True], ids=["warm", "cold base"])
def test_a_true_10_percent_gain_is_called_better_in_at_least_90_percent(cold):
    r = rates(0.10, cold, seed=12)
    assert r["better"] >= 0.90, r


def test_without_the_warm_up_engine_a_cold_base_credits_placebos_twice_as_often():
    # the base before the rung is then the machine's first engine: 6 % low, so the mean of the two flanks is 3 %
    # low (the pooled floor, widened by that pair, hides part of it)
    cold, warm = rates(0.0, True, seed=13, warm_up=False), rates(0.0, True, seed=13)
    assert cold["better"] > 2 * warm["better"] and cold["worse"] <= warm["worse"], (cold, warm)  # both 0 at seed 13


def test_a_cpu_placebo_is_falsely_kept_in_at_most_1_percent():
    # the cpu profile's floor rests on the engines params.yaml's bench.noise_floor says, pooled with the ladder's own
    cpu = profile_settings("cpu")["bench"]
    r = rates(0.0, True, seed=14, floor_engines=cpu["noise_floor"]["engines"], repeats=cpu["repeats"])
    assert r["better"] <= 0.01, r


# ---------------------------------------------------------------- the knee
# The probe-noise model and gpu-shape-4090's search: tests/simulate.py.


def knee_rates(factor: float, seed: int, server_cv: float = SERVER_CV, floor: float = 0.0, knee: float = KNEE,
               true_phi: float = PHI, again: bool = True, base_drift: float = 1.0, trials: int = TRIALS,
               pairs: int = PAIRS, **search) -> dict:
    """A base's knee search on its own server, then a rung's (the base's knee times `factor`) on another, started
    from the base's knee as the ladder starts it (ladder.knee_anchor), judged by stats.knee_delta; where that reads
    better or worse (and `again`), re-checked on a fresh server of the base and then of the rung (stats.knee_recheck).
    `base_drift`: the machine ran at this share of its speed while the base's search ran (loaded by other work)."""
    rng = np.random.default_rng(seed)
    calls, probes, seconds, rechecks = [], [], [], 0
    for _ in range(trials):
        base = knee_search(rng, knee, server_cv=server_cv, floor=floor, true_phi=true_phi, drift=base_drift, **search)
        anchor = ladder.knee_anchor({"knee": base}, {}, floor=floor)
        new = knee_search(rng, knee * factor, anchor, server_cv, floor, true_phi,
                          **{key: v for key, v in search.items() if key != "start"})
        d = {**stats.knee_delta(base, new), "pairs": pairs}
        if again and d["verdict"] in ("better", "worse"):
            rechecks += 1
            d = rechecked(d, lambda rate, side: recheck(rng, knee, rate, side, server_cv, true_phi),
                          lambda rate: recheck(rng, knee * factor, rate, None, server_cv, true_phi),
                          stats.verdict_rate(base, new, d["verdict"]))
        calls.append(d["verdict"])
        probes.append((base["probes"], new["probes"]))
        seconds.append((base["seconds"], new["seconds"]))
    out = {v: calls.count(v) / trials for v in ("better", "worse", "within noise", "unknown")}
    return {**out, "probes": np.mean(probes, axis=0).round(1).tolist(), "rechecks": rechecks / trials,
            "seconds": np.mean(seconds, axis=0).round(0).tolist()}


def test_the_stored_spread_is_measured_and_fits_its_own_looks():
    """gpu-shape-4090's knee.server_spread is a measurement (servers, looks at two or more rates, none bound outside
    the engine), and measure.spread's fit of the looks it stores gives its numbers: with 4 API servers nine fresh
    servers on two H100s, knees' CV 0 [0, 0.61 %] at a wall of 61 [45, 81] (docs/measurements.md, 2026-12-06)."""
    from measure import spread
    assert SPREAD["servers"] >= 6 and SPREAD["looks"] >= 12 and SPREAD["measured"], SPREAD
    assert SPREAD["frontend_bound"] == [] and all(c["api_servers"] == 4 for c in SPREAD["covariates"])
    rates_ = SPREAD["rates"]
    fit = spread.fit([[(n, over, rates_[i]) for over, n, i in s] for s in SPREAD["looks_per_server"]], SPREAD["rate"])
    assert (fit.servers, fit.looks, fit.counted) == (SPREAD["servers"], SPREAD["looks"], SPREAD["counted"])
    assert (fit.sigma, fit.gamma, fit.phi) == pytest.approx((SPREAD["sigma"], SPREAD["gamma"], SPREAD["phi"]), abs=0.02)
    assert fit.knee_cv()[2] == pytest.approx(SPREAD["knee_cv_ci"][1], abs=0.0005)
    # the simulation's upper end: that spread's upper end in log share over the gentler wall (GAMMA) it runs at
    assert SERVER_CV == 0.0 and SERVER_CV_HI == pytest.approx(SPREAD["sigma_ci"][1] / GAMMA)


@pytest.mark.parametrize("knee", [KNEE, 11.0], ids=["knee on a grid rate", "knee between grid rates"])
def test_an_a_a_knee_is_called_better_or_worse_in_at_most_2_5_percent_each_way(knee):
    r = knee_rates(1.0, seed=21, knee=knee)
    assert r["better"] <= 0.025 and r["worse"] <= 0.025, r


def test_bursts_half_again_as_dispersed_as_measured_still_hold_the_a_a_rate():
    # knee.dispersion 6.9 rests on 44 degrees of freedom (95 % interval about 4.7-11): the truth at 10
    r = knee_rates(1.0, seed=26, true_phi=10.0)
    assert r["better"] <= 0.025 and r["worse"] <= 0.025, r


def test_a_knee_moved_1_41x_is_found_in_at_least_80_percent_either_way():
    # at the stock front end's spread (one API server: knees' CV 12.9 %) the rule found it in ~37 % (tests/
    # test_unit_simulation.py): that spread was the front end's; with 4 API servers the fresh servers' knees do not
    # spread, and at the upper end of that (2.9 % at the model's wall) it is found as well
    up, down = knee_rates(2 ** 0.5, seed=22), knee_rates(2 ** -0.5, seed=23)
    hi_up, hi_down = knee_rates(2 ** 0.5, seed=22, server_cv=SERVER_CV_HI), knee_rates(2 ** -0.5, seed=23,
                                                                                      server_cv=SERVER_CV_HI)
    print("x1.41", up, down, "upper end", SERVER_CV_HI, hi_up, hi_down)
    assert up["worse"] == down["better"] == 0.0
    assert up["better"] >= 0.80 and down["worse"] >= 0.80, (up, down)
    assert hi_up["better"] >= 0.80 and hi_down["worse"] >= 0.80, (hi_up, hi_down)


def test_a_knee_moved_2x_is_found_in_at_least_85_percent_either_way():
    up, down = knee_rates(2.0, seed=32), knee_rates(0.5, seed=33)
    assert up["better"] >= 0.85 and down["worse"] >= 0.85, (up, down)
    assert up["worse"] == down["better"] == 0.0


def test_one_server_a_side_does_not_hold_the_a_a_rate_at_the_stock_front_end_s_spread():
    # why the re-check exists: the rule before it, one look on the base's server against one on the rung's, at the
    # spread the stock front end gave (one API server; the H200 check ladder kept a placebo so: 62 vs 1 of ~550 over
    # the SLO at 11.31 req/s); at the spread measured with 4 API servers, printed beside it
    r = knee_rates(1.0, seed=24, again=False, server_cv=ONE_API_CV)
    print("one server a side, one API server's spread", r, "4 API servers'", knee_rates(1.0, seed=24, again=False))
    assert r["better"] > 0.025 and r["worse"] > 0.025, r


def test_a_placebo_costs_a_re_check_only_where_it_reads_better_or_worse():
    # one server a side read an A/A knee better or worse ~28 % of the time at the stock front end's spread, ~0.1 %
    # at the one measured with 4 API servers: those pay two servers more, the rest nothing
    r = knee_rates(1.0, seed=21)
    assert r["rechecks"] <= 0.32, r


def test_at_the_upper_end_of_the_spread_an_a_a_knee_is_called_better_or_worse_in_at_most_5_percent():
    r = knee_rates(1.0, seed=29, server_cv=SERVER_CV_HI)
    print("upper end", SERVER_CV_HI, r, knee_rates(2 ** 0.5, seed=30, server_cv=SERVER_CV_HI))
    assert r["better"] <= 0.05 and r["worse"] <= 0.05, r


def test_a_base_searched_while_the_machine_was_loaded_does_not_credit_a_placebo():
    # the 2-core case: rung 0's search ran while other work loaded the box (here at 60 % of its speed), the placebo's
    # on a quiet box: one server a side credits it nearly always; the base's fresh server, started after the rung,
    # passes where the loaded one failed (about 3 % slip through: a base that does not fail there is judged a grid
    # rate higher)
    loaded = dict(base_drift=0.6)
    assert knee_rates(1.0, seed=31, again=False, **loaded)["better"] > 0.9
    r = knee_rates(1.0, seed=31, **loaded)
    assert r["better"] <= 0.05, r


def test_the_knee_model_rests_on_the_h200_study():
    """The model's constants against the study they were read from: the share over the SLO at the rate probed most
    (11.31 req/s, near 5 %: that server's knee), the dispersion of its counts between probes, and the wall above."""
    import json

    from conftest import FIXTURES
    study = json.loads((FIXTURES / "h200-probe-study.json").read_text())
    rows = [r for s in study["servers"] for r in s["rows"]]
    at = [r for r in rows if r["offered_rps"] == 11.31]
    share = sum(r["over_slo"] for r in at) / sum(r["counted"] for r in at)
    assert len(at) == 8 and 0.04 < share < 0.06, share
    k = study["knee"]
    probes = []
    for r in rows:
        reqs = sorted((dict(zip(study["request_fields"], x)) for x in r["requests"]), key=lambda x: x["start"])
        w = probing.counted_window(reqs, k["ramp_fraction"], k["settle_latencies"], k["tail_latencies"])
        probes.append({**r, "window": reqs[w["lo"]:w["hi"]]})
        assert w["hi"] - w["lo"] == r["counted"]  # today's window is the study's
    d = probing.dispersion_of(probes, study["slo"])
    assert (d["between"], d["within"], d["phi"], d["probes"]) == (4.66, 7.34, PHI, 8), d
    low = [r for r in rows if r["offered_rps"] in (8.0, 9.514)]
    assert sum(r["over_slo"] for r in low) == 0 and sum(r["counted"] for r in low) == 341
    wall = next(r for r in rows if r["offered_rps"] == 14)
    assert wall["over_slo"] / wall["counted"] > 0.8  # q (14 / 11.31)^13 = 0.8
    assert 0.05 * (14 / 11.31) ** GAMMA == pytest.approx(0.8, abs=0.05)


def test_a_look_that_stops_once_its_fail_is_certain_keeps_the_rule_and_probes_less():
    # a stopped look's fail was certain; what changes is the path after it (a stopped look reads a higher share
    # over the SLO, probing.FAR_SHARE)
    for factor, seed in ((1.0, 21), (0.5, 33)):
        whole = knee_rates(factor, seed=seed, start=1.19, curtail=False)
        cut = knee_rates(factor, seed=seed, start=1.19, curtail=True)
        if factor == 1.0:
            assert cut["better"] <= 0.025 and cut["worse"] <= 0.025, cut
        else:
            assert cut["worse"] >= 0.85, cut
        assert cut["seconds"][0] < whole["seconds"][0] and cut["seconds"][1] < whole["seconds"][1], (cut, whole)


@pytest.mark.parametrize("start", [1.19, 4.0], ids=["from 1.19x the knee", "from 4x the knee"])
def test_a_base_search_that_starts_above_the_knee_keeps_the_rule(start):
    # one grid rate down after a fail near the wall, a halving after one far above it (probing.FAR_SHARE): the
    # H200's searches began at 1.19x, where the base's search probed ~240 s here, ~330 when it always halved
    # worse reads ~1.6-2.1 % here (6,000 trials, two seeds), near the bound: 2,000 trials (SE 0.35 points) crossed
    # it by one trial in twenty when the second re-check pair for better changed the random stream
    aa, down = knee_rates(1.0, seed=27, start=start, trials=6000), knee_rates(0.5, seed=28, start=start)
    assert aa["better"] <= 0.025 and aa["worse"] <= 0.025, aa
    assert down["worse"] >= 0.85, down
