"""Servers as the unit against today's knee rule (issue 50, item 5, piece 4), by simulation: tests/unit_sim.py states
the design (fresh servers a side, each a continuous knee from looks at 2-3 grid rates, the sides' mean log knees
compared by a t pooled with the stored spread, servers added a side until it decides) and what each rule costs;
tests/simulate.py states the noise model (a wall of exponent 13, bursts of dispersion 6.9, fresh servers' knees
spread by the profile's knee CV). Fixed seeds, 2,000 trials a case.

The spreads: the stock front end's (one API server: knees' CV 12.9 %, upper end 16.5 %, 12 servers on H200s; the gpu
profile's knee.server_spread), 7 % and 5 % with an upper end at that interval's ratio, and gpu-shape-4090's stored
one, measured with 4 API servers (9 servers on two H100s: CV 0, 2.9 % at its upper end at the model's wall). The design
is told the upper end of the spread it is given (the rule's SD a server), and is judged where the truth is the spread's
point and its upper end.

What must hold for the design (the rule's per-rung rates, tests/test_rule_simulation.py): an A/A knee called better
<= 2.5 % and worse <= 2.5 % at the stored spread, <= 5 % each way at its upper end; better in <= 1 % at both (five
rungs of fresh servers share the ladder's 5 % budget with the tok/s path); a knee moved x2 found >= 85 % either way;
x1.41 found >= 80 % either way (a strict xfail prints the numbers where it is not reached).

What it found (the table test prints it; GPU-minutes a rung: an A/A rung, then a x1.41 one): at the stored spread
(4 API servers) both rules hold the rates: today's finds x1.41 in 94 % (93 % at the upper end) for 3.5 / 13.9
GPU-min, servers as the unit in 99.7 % for 5.7 / 6.5; today's rule is kept (test below). At the one-API-server spread
today's rule finds x1.41 in 39 % (6.2 / 12.6 GPU-min, and 6.4 for its base's search once a base), servers as the unit
in 87 % (18.5 / 26.6: ~6.5 servers an A/A rung; 77 % where the truth is the upper end); at 7 %, 73 % against 96 %
(4.6 / 14.3 against 8.4 / 13.0); at 5 % both reach it, 86 % against 96 % (4.1 / 14.6 against 6.8 / 9.3). Today's
rule reaches 80 % at a knee CV of about 5.5-6 % (82 % at 5.5 %, 80 % at 6 %, 2,000 trials).
"""
import concurrent.futures
import functools
import math
import multiprocessing
import os
import time

import pytest

import simulate as sim
import unit_sim as us
from judgement import stats

TRIALS = 2000
RATIO = sim.ONE_API_CV_HI / sim.ONE_API_CV  # the one-API-server spread's upper end over its point
# each spread (point, upper end): the stock front end's (one API server, 12 servers on H200s), 7 % and 5 % with an
# upper end at its ratio (a re-measure on as many servers), and the stored one (4 API servers, 9 servers on H100s:
# knees' CV 0, 2.9 % at its upper end at the model's wall)
SPREADS = {"1 API": (sim.ONE_API_CV, sim.ONE_API_CV_HI), "7 %": (0.07, 0.07 * RATIO), "5 %": (0.05, 0.05 * RATIO),
           "stored": (sim.SERVER_CV, sim.SERVER_CV_HI)}
PRIOR_DF = {"1 API": sim.ONE_API["servers"] - 1, "7 %": sim.ONE_API["servers"] - 1,
            "5 %": sim.ONE_API["servers"] - 1, "stored": sim.SPREAD["servers"] - 1}
# the pairs of fresh servers today's rule re-checks a better knee on at each spread (knee.better_pairs): the stored
# one is gpu-shape-4090's (1); the stock front end's is the gpu profile's (2), as the hypothetical ones between
PAIRS = {"1 API": stats.KNEE_BETTER_ROUNDS, "7 %": stats.KNEE_BETTER_ROUNDS, "5 %": stats.KNEE_BETTER_ROUNDS,
         "stored": sim.PAIRS}
RULE = us.UnitRule()
FACTORS = {"A/A": 1.0, "x1.41": 2 ** 0.5, "/1.41": 2 ** -0.5, "x2": 2.0, "/2": 0.5}
SEEDS = {f: 60 + i for i, f in enumerate(FACTORS.values())}


def truth(spread: str, upper: bool) -> float:
    return SPREADS[spread][1 if upper else 0]


@functools.cache
def paths(factor: float, spread: str, upper: bool) -> list:
    """Each trial's servers up to the cap, drawn at the truth."""
    return us.unit_paths(factor, SEEDS[factor], truth(spread, upper), TRIALS, RULE.cap)


def unit(factor: float, spread: str, upper: bool) -> us.Calls:
    """The design at a spread: judged with the upper end of the spread it is given."""
    return _case(("unit", factor, spread, upper))


def today(factor: float, spread: str, upper: bool) -> us.Calls:
    return _case(("today", factor, spread, upper))


_CASES: dict[tuple, us.Calls] = {}  # (rule, factor, spread, upper) -> its calls, computed once (here or prefetch)


def _compute(key: tuple) -> us.Calls:
    rule, factor, spread, upper = key
    if rule == "unit":
        return us.unit_rates(paths(factor, spread, upper), SPREADS[spread][1], PRIOR_DF[spread], RULE)
    return us.today_rates(factor, SEEDS[factor], truth(spread, upper), TRIALS, pairs=PAIRS[spread])


def _case(key: tuple) -> us.Calls:
    if key not in _CASES:
        _CASES[key] = _compute(key)
    return _CASES[key]


def prefetch(keys: list[tuple]) -> None:
    """Compute the cases not yet computed on every core: each case draws from its own seeds (SEEDS), so a worker's
    calls are the ones a serial run gets; pytest itself runs on one core, and the table's 80 cases took 135 s of
    CI's 2-core box on it."""
    todo = [k for k in dict.fromkeys(keys) if k not in _CASES]
    workers = min(os.cpu_count() or 1, len(todo))
    if workers < 2:
        for k in todo:
            _case(k)
        return
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as ex:
        _CASES.update(zip(todo, ex.map(_compute, todo)))


def found(rates, factor: float) -> float:
    return rates["better"] if factor > 1 else rates["worse"] if factor < 1 else math.nan


def test_a_server_s_knee_is_the_rate_where_its_looks_expect_q_over_the_slo():
    # looks whose counts sit at their expectation under a knee of 11 req/s give back 11, whichever rates they were
    # taken at; a look past the wall steers only
    k, looks = 11.0, []
    for r in (9.514, 11.31, 13.45):
        n = 300
        looks.append((r, round(n * us.Q * (r / k) ** sim.GAMMA), n))
    theta, var = us.server_log_knee(looks[:2], us.Q, sim.GAMMA, sim.PHI)
    assert math.exp(theta) == pytest.approx(k, rel=0.01) and var == pytest.approx(
        sim.PHI / (sim.GAMMA ** 2 * (looks[0][1] + looks[1][1])))
    assert math.exp(us.server_log_knee(looks, us.Q, sim.GAMMA, sim.PHI)[0]) == pytest.approx(
        math.exp(theta), rel=0.01)  # 13.45: 47 % over, still below SATURATED


def test_a_server_steps_up_from_a_clean_look_and_down_from_one_past_the_wall():
    assert us.next_look([(11.31, 0, 300)], us.Q, us.STEPS) == 16.0
    assert us.next_look([(11.31, 2, 300)], us.Q, us.STEPS) == 13.45
    assert us.next_look([(11.31, 290, 300)], us.Q, us.STEPS) == 8.0
    assert us.next_look([(11.31, 40, 300)], us.Q, us.STEPS) == 11.31  # between: again, the most informative
    assert us.next_look([(11.31, 40, 300), (11.31, 35, 300)], us.Q, us.STEPS) is None


def test_unit_verdict_decides_on_its_t_and_stops_within_inside_the_margin():
    same = [(math.log(11.0), 0.001)] * 4
    d = us.unit_verdict(same, same, 0.05, 11, RULE)
    assert d["verdict"] == "within noise" and d["t"] == 0
    up = [(math.log(22.0), 0.001)] * 4
    assert us.unit_verdict(same, up, 0.05, 11, RULE)["verdict"] == "better"
    assert us.unit_verdict(up, same, 0.05, 11, RULE)["verdict"] == "worse"
    wide = us.unit_verdict(same[:2], same[:2], 0.3, 11, RULE)
    assert wide["verdict"] == "continue"


CASES = [(s, u) for s in SPREADS for u in (False, True)]


def row(name: str, spread: str, upper: bool, get) -> str:
    aa = get(1.0, spread, upper)
    cells = [f"{aa['better']:6.1%} {aa['worse']:6.1%}"]
    cells += [f"{found(get(f, spread, upper), f):6.1%}" for k, f in FACTORS.items() if k != "A/A"]
    cost = [get(f, spread, upper).gpu_s / 60 for f in (1.0, 2 ** 0.5)]
    return (f"{spread:>6} {'upper' if upper else 'point'} {truth(spread, upper):5.1%}  {name:<6}" + "  ".join(cells)
            + f"  {cost[0]:5.1f} {cost[1]:5.1f}  {get(1.0, spread, upper).servers:4.1f}")


def test_the_two_rules_compared_at_each_spread():
    """The comparison table (printed): A/A better / worse, found at x1.41, /1.41, x2, /2 (better up, worse down), the
    mean GPU-minutes a rung for an A/A and a x1.41 knee, and the fresh servers an A/A rung starts. Today's is charged
    its rung's search and its re-checks; its base's search (one server, printed apart) serves every rung it is the
    base of. What it asserts: the design finds x1.41 more often than today's at every spread."""
    t0 = time.time()
    prefetch([(rule, f, s, u) for s, u in CASES for f in FACTORS.values() for rule in ("today", "unit")])
    lines = ["spread truth        rule   A/A bet  worse  x1.41  /1.41     x2     /2  GPU-min A/A x1.41  servers"]
    for spread, upper in CASES:
        lines += [row("today", spread, upper, today), row("unit", spread, upper, unit)]
        base = today(1.0, spread, upper).extra["base_gpu_s"] / 60
        lines.append(f"{'':>26}(today's base search: {base:.1f} GPU-min once a base)")
    keep = {f"{s} {'upper' if u else 'point'}": f"{1 - (1 - unit(1.0, s, u)['better']) ** 5:.1%}" for s, u in CASES}
    lines.append(f"an all-placebo ladder of 5 rungs kept on its knee by the design (fresh servers each rung): {keep}")
    print("\n" + "\n".join(lines) + f"\n({TRIALS} trials a case, {time.time() - t0:.0f} s)")
    for spread, upper in CASES:
        if spread != "stored":  # where the spread is the front end's or its guesses; the stored one: below
            assert unit(2 ** 0.5, spread, upper)["better"] > today(2 ** 0.5, spread, upper)["better"]


@pytest.mark.parametrize("upper", [False, True], ids=["stored spread", "its upper end"])
def test_at_the_stored_spread_today_s_rule_meets_the_rates_at_fewer_gpu_minutes(upper):
    """The rule kept (issue 50, item 5): at the spread measured with 4 API servers today's rule (one search a side,
    re-check pairs) holds the A/A rates and finds x1.41 in >= 80 % either way, as servers as the unit do; an A/A
    rung (most rungs) costs it fewer GPU-minutes (3.5 against 5.7), a x1.41 one more (13.9 against 6.5: its two
    re-check pairs of fresh servers): the re-check's pairs, not the design, are the cost to cut."""
    aa, up, down = (today(f, "stored", upper) for f in (1.0, 2 ** 0.5, 2 ** -0.5))
    bound = 0.05 if upper else 0.025
    assert aa["better"] <= min(bound, 0.01) and aa["worse"] <= bound, aa
    assert up["better"] >= 0.80 and down["worse"] >= 0.80, (up, down)
    assert aa.gpu_s < unit(1.0, "stored", upper).gpu_s
    assert up.gpu_s > unit(2 ** 0.5, "stored", upper).gpu_s  # what a cheaper re-check would take back


@pytest.mark.parametrize("upper", [False, True], ids=["stored spread", "its upper end"])
def test_an_a_a_knee_is_called_better_or_worse_by_servers_as_the_unit_within_the_rule_s_rates(upper):
    r = unit(1.0, "1 API", upper)
    bound = 0.05 if upper else 0.025
    assert r["better"] <= min(bound, 0.01) and r["worse"] <= bound, r


@pytest.mark.parametrize("spread", ["7 %", "5 %"])
def test_at_a_smaller_spread_the_design_holds_its_a_a_rates_and_costs_less(spread):
    for upper in (False, True):
        r = unit(1.0, spread, upper)
        assert r["better"] <= 0.01 and r["worse"] <= 0.025, (spread, upper, r)
    assert unit(1.0, spread, False).gpu_s < unit(1.0, "1 API", False).gpu_s


def test_a_knee_moved_2x_is_found_by_servers_as_the_unit_in_at_least_85_percent_either_way():
    up, down = unit(2.0, "1 API", False), unit(0.5, "1 API", False)
    assert up["better"] >= 0.85 and down["worse"] >= 0.85, (up, down)
    assert up["worse"] == down["better"] == 0.0


@pytest.mark.parametrize("spread", list(SPREADS))
def test_a_knee_moved_1_41x_is_found_by_servers_as_the_unit_in_at_least_80_percent_either_way(spread):
    up, down = unit(2 ** 0.5, spread, False), unit(2 ** -0.5, spread, False)
    print(spread, f"x1.41 better {up['better']:.1%}, /1.41 worse {down['worse']:.1%}")
    assert up["better"] >= 0.80 and down["worse"] >= 0.80, (up, down)


def test_the_rule_s_constants_are_its_a_a_paths_calibration():
    # set on 60,000 A/A paths at the stored spread's upper end (seeds 1-3: better 0.4 %, worse 2.5 %, the multiple
    # looks and the within stops in them); these 2,000 give them again within their sampling error
    aa, told = paths(1.0, "1 API", True), SPREADS["1 API"][1]
    assert us.calibrate(aa, told, PRIOR_DF["1 API"], RULE, "better", 0.004) == pytest.approx(RULE.better, abs=0.35)
    assert us.calibrate(aa, told, PRIOR_DF["1 API"], RULE, "worse", 0.025) == pytest.approx(RULE.worse, abs=0.2)


def test_at_a_5_percent_spread_today_s_rule_finds_a_knee_moved_1_41x_in_at_least_80_percent():
    # were the re-measure (4 API servers) to give 5 %, one search a side and its re-checks reach the target at about
    # half the design's GPU-minutes (the table above)
    up, down = today(2 ** 0.5, "5 %", False), today(2 ** -0.5, "5 %", False)
    assert up["better"] >= 0.80 and down["worse"] >= 0.80, (up, down)


@pytest.mark.xfail(strict=True, reason="today's rule (one search a side, re-check pairs) finds a knee moved 1.41x in "
                   "~39 % at the one-API-server spread (12.9 %) and ~73 % at 7 %: its one server a side decides "
                   "whether to re-check; servers as the unit find it in ~87 % and ~96 % (tests/unit_sim.py)")
@pytest.mark.parametrize("spread", ["1 API", "7 %"])
def test_today_s_rule_finds_a_knee_moved_1_41x_in_at_least_80_percent(spread):
    up, down = today(2 ** 0.5, spread, False), today(2 ** -0.5, spread, False)
    print(spread, f"today: x1.41 better {up['better']:.1%}, /1.41 worse {down['worse']:.1%}; servers as the unit: "
          f"{unit(2 ** 0.5, spread, False)['better']:.1%}, {unit(2 ** -0.5, spread, False)['worse']:.1%}")
    assert up["better"] >= 0.80 and down["worse"] >= 0.80, (up, down)
