"""The confirm step proved by simulation, with the project's own functions and fixed seeds: at the end of a ladder
rung 0 ("stock") and the final kept stack are measured again, `confirm.pairs` pairs of fresh engines and servers in
ladder.confirm_order (stock, final, final, stock, ...), and record.confirm_summary judges them: tok/s by stats.delta
over the engines, the knee by stats.knees_delta over the servers (the profile's knee.server_spread pooled with the
step's own), decide.reproduced, and its power for a x1.3 stack (stats.power). The noise models are
tests/simulate.py's (the rule's own):

- tok/s: fresh engines' means apart by the profile's measured floor (bench.noise_floor: gpu-shape-4090 0.59 %, the
  cpu 2.50 %), their passes at the profile's measured spread within (simulate.profile_machine: the cpu's 2.77 %;
  IN_ENGINE 0.5 % where none was measured); the floor every Δ is drawn with is the stored one as the rule reads
  it (at the upper end of its 95 % interval: 1.20 %, 3.51 %) pooled with the ladder's own same-config engines
  (record.floor_of: rung 0 and the final rung as the ladder measured them, and the confirm's own);
- the knee: gpu-shape-4090's search on the H200 probe model (p95, phi 6.9, two looks a rate) on its own wall (gamma
  61, measured with 4 API servers), each fresh server's knee x exp(N(0, its knee CV)) (its knee.server_spread, which
  the rule pools: 9 servers, CV 0); the cpu profile's search (p90,
  phi 5.3, one look a rate) on its own wall (gamma 131.8) and spread (knee CV 1.9 %, 8 servers), both as params.yaml
  stores them and the rule pools them;
- rung 0's search starts at 0.7 K, the final rung's from rung 0's knee (a rung's search); each confirm run's search
  starts from its own side's knee measured last (ladder.Driver.confirm_anchor: rung 0's, the final rung's, then the
  step's own), on to its own bracket (ladder.knee_anchor(bracket=True));
- the ladder kept a x1.3 gain (a kept rung that read +30 % on tok/s, or on its knee): where the confirm step does
  not call the stack better, it says "did not reproduce" where its interval excludes that gain, else "could not tell";
- the rule's floors are the stored ones, as a ladder reads params: its knee spread, and its tok/s floor read at the
  upper end of its 95 % interval (stats.Floor.read), held whatever the truth;
- "at the upper end": the truth at the upper end of each floor's 95 % interval: the
  servers' knee CV at its sigma's upper end over simulate.upper_gamma's wall: the gentler of its own's lower end and
  GAMMA where only rung 0's was measured (gpu-shape-4090 2.9 %), the gentlest measured where a later rung's was too
  (cpu: rung 0's 69.5 and the final stack's 188.8: 5.8 % for rung 0's block, 1.3 % for the final stack's), its looks'
  dispersion the larger of knee.dispersion and that block's fit's (cpu 5.3 and 20.0), each block a case,
  fresh engines at the floor x sqrt(df / chi2_0.025(df)) with its df (gpu-shape-4090 7: 1.20 %; the cpu 23: 3.51 %).

A stack is "called better" where confirm_summary's `reproduced` is True. What must hold (issue 53): an A/A stack is
called better in <= 2.5 %; a true x1.3 stack (tok/s and knee both x1.3) in >= 80 % at the pairs params.yaml sets
(confirm.pairs, sized here); each at the measured noise and at the upper end. 2,000 trials a case.
"""
import numpy as np
import pytest

import config
import ladder
from judgement import record, stats
from simulate import (
    SPREAD,
    TRIALS,
    KneeModel,
    knee_search,
    profile_machine,
    profile_settings,
    spread_blocks,
    upper_cv,
    upper_ends,
    upper_gamma,
)

PROFILES = {p: profile_settings(p) for p in ("gpu-shape-4090", "cpu")}
MODELS = {p: KneeModel.of(p) for p in PROFILES}
KNEES = {"gpu-shape-4090": 11.31, "cpu": 5.657}  # each on a grid rate: the worst place for a knee; the cpu's ~ its own
STOCK_TPS = 100.0


def sp_of(profile: str) -> dict:
    """The profile's knee.server_spread, or gpu-shape-4090's where it has none (as ladder_sim.Noise.of takes it)."""
    sp = PROFILES[profile]["knee"]["server_spread"]
    return sp if sp.get("servers") else SPREAD


def server_cv(profile: str, upper: bool, block: int = 0) -> float:
    """Fresh servers' knee CV as the profile measured it (sp_of); at the upper end of its spread block `block` as
    the ladder's simulation takes it (simulate.upper_ends: the log share's SD at its upper end over
    simulate.upper_gamma's wall)."""
    sp = sp_of(profile)
    return upper_ends(sp, 1.0)[block][0] if upper else sp["knee_cv"]


def looks_phi(profile: str, upper: bool, block: int = 0) -> float:
    """The looks' true dispersion: knee.dispersion's; at the upper end the larger of it and spread block `block`'s."""
    sp, phi = PROFILES[profile]["knee"]["server_spread"], MODELS[profile].phi
    return upper_ends(sp, phi)[block][1] if upper and sp.get("servers") else phi


def start_to_start(profile: str, upper: bool = False) -> float:
    """The fresh engines' true SD: the profile's measured floor (bench.noise_floor: the machine it claims), or the
    upper end of its 95 % interval, sqrt(df / chi2_0.025(df)) x it. Only profiles whose floor was measured are
    simulated here."""
    fl = PROFILES[profile]["bench"]["noise_floor"]
    assert fl["engines"] >= 2, f"{profile}: bench.noise_floor not measured"
    return upper_cv(fl["cv"], fl["engines"] - 1) if upper else fl["cv"]


def run(name: str, knobs: dict, engine: list[float], knee: dict) -> dict:
    return {"name": name, "exp": f"sim-{name}", "status": "ok", "knobs": knobs, "role": "confirm",
            "bench": {"status": "ok", "output_tps_runs": engine, "output_tps": float(np.median(engine))},
            "knee": knee}


STOCK, FINAL = {"engine.seed": 0}, {"engine.seed": 0, "engine.max_num_seqs": 32}


def kept_rung(on: str, gain: float = 0.3) -> dict:
    """The kept rung the final stack rests on, as the ladder read it: a x1.3 gain on `on` (output_tps: kept on tok/s,
    its knee within noise; knee_rps: kept on its knee)."""
    return {"name": f"kept-on-{on}", "exp": "sim-kept", "kept": True,
            "delta": {"output_tps": {"rel": gain if on == "output_tps" else 0.0, "verdict": "better"},
                      "knee_rps": {"rel": gain if on == "knee_rps" else 0.0,
                                   "verdict": "better" if on == "knee_rps" else "within noise"}}}


def confirm_trial(rng, profile: str, tps: float, knee: float, pairs: int, upper: bool = False, block: int = 0,
                  order=ladder.confirm_order, drift: float = 0.0, on: str = "output_tps") -> dict:
    """One ladder's end as the driver measures it: rung 0 and the final rung as the ladder measured them (on this
    machine, earlier), then the confirm pairs in `order` (fresh engine and server each, the knee search started from
    the knee before it, as ladder.Driver.confirm_step starts it), judged by record.confirm_summary with the profile's
    floors. The final stack's true tok/s and knee are `tps` and `knee` times stock's; `drift`: the machine's speed
    moves by this share per confirm run (tok/s and knee alike); `on`: what the kept gain (x1.3) rested on. Also
    `one server`: the knee as the confirm step judged it before, stats.knee_delta on the last server of each side."""
    p, model = PROFILES[profile], MODELS[profile]
    s2s = start_to_start(profile, upper)
    cv = server_cv(profile, upper, block)
    model = model.gentler(upper_gamma(sp_of(profile))) if upper else model
    phi = looks_phi(profile, upper, block)
    k0 = KNEES[profile]
    floor_spec = p["bench"]["noise_floor"]
    prior = stats.Floor.of(config.NoiseFloor(**floor_spec))  # as the ladder reads params: held whatever the truth
    m = profile_machine(rng, profile, False, p["bench"]["repeats"], s2s)

    def search(true_knee: float, anchor: dict | None, speed: float = 1.0) -> dict:
        return knee_search(rng, true_knee, anchor, cv, p["knee"]["noise_floor"], phi, model=model, drift=speed)
    rung0 = run("baseline", STOCK, m.engine(STOCK_TPS), search(k0, None))
    final = run("final-rung", FINAL, m.engine(STOCK_TPS * tps),  # its knee: where its confirm runs start from
                search(k0 * knee, ladder.knee_anchor(rung0, FINAL, floor=p["knee"]["noise_floor"])))
    drv = ladder.Driver.__new__(ladder.Driver)
    drv.records = [rung0, final]  # what Driver.searched reads (no re-measures here)
    runs: list[dict] = []
    m.drift, m.started = drift, 0  # the confirm's runs drift from here
    for k in range(1, pairs + 1):
        for which in order(k):
            knobs, rate, kn = ((STOCK, STOCK_TPS, k0) if which == "baseline" else
                               (FINAL, STOCK_TPS * tps, k0 * knee))
            anchor = ladder.knee_anchor(drv.confirm_anchor(which, runs, rung0, final), knobs, bracket=True)
            speed = 1 + drift * m.started
            runs.append(run(f"confirm-{k}-{which}", knobs, m.engine(rate), search(kn, anchor, speed)))
    floor = record.floor_of(prior, [rung0, final, *runs])
    out = record.confirm_summary(runs, floor, "knee_rps", [kept_rung(on)],
                                 config.ServerSpread(**p["knee"]["server_spread"]))
    sides = [[r for r in runs if r["name"].endswith(w)] for w in ("-baseline", "-final")]
    out["one server"] = stats.knee_delta(sides[0][-1]["knee"], sides[1][-1]["knee"])["verdict"]
    out["looks"] = {w: np.mean([r["knee"]["probes"] for r in side]) for w, side in zip(("baseline", "final"), sides)}
    return out


def confirm_rates(profile: str, tps: float, knee: float, seed: int, pairs: int | None = None,
                  upper: bool = False, trials: int = TRIALS, block: int = 0, **kw) -> dict:
    """The share of `trials` ladders whose confirm step called the final stack better (`reproduced`), did not reproduce
    it or could not tell; the share of its tok/s and knee verdicts (and the knee on one server a side); its mean
    stated power; the mean tok/s Δ."""
    rng = np.random.default_rng(seed)
    pairs = pairs or PROFILES[profile]["confirm"]["pairs"]
    out = [confirm_trial(rng, profile, tps, knee, pairs, upper, block, **kw) for _ in range(trials)]
    share = {"better": np.mean([o["reproduced"] is True for o in out]),
             "not reproduced": np.mean([o["reproduced"] is False for o in out]),
             "could not tell": np.mean([o["reproduced"] is None for o in out]),
             "power": np.mean([o["power"] or 0.0 for o in out])}
    for m in ("output_tps", "knee_rps"):
        for v in ("better", "worse"):
            share[f"{m} {v}"] = np.mean([o["delta"][m]["verdict"] == v for o in out])
    share["one server better"] = np.mean([o["one server"] == "better" for o in out])
    for w in ("baseline", "final"):  # what the step costs: looks a server
        share[f"looks a {w} server"] = np.mean([o["looks"][w] for o in out])
    share["output_tps rel"] = np.mean([o["delta"]["output_tps"]["rel"] for o in out])
    return {k: round(float(v), 4) for k, v in share.items()}


# each profile measured, then at the upper end of each of its spread blocks (rung 0's; knee.server_spread's `also`)
CASES = [(p, u, b) for p in PROFILES for u, blocks in ((False, [0]), (True, range(len(spread_blocks(sp_of(p))))))
         for b in blocks]
IDS = [f"{p}{' upper end' if u else ''}{f' (also {b})' if b else ''}" for p, u, b in CASES]


@pytest.fixture(autouse=True, scope="module")
def pure_functions_remembered():
    """probing.fail_count (every look) and the t quantile (every interval) are pure functions of their arguments:
    remembered, the simulation runs in about half the time and measures the same."""
    import functools

    from measure import probing, summary
    plain = probing.fail_count, summary.tq
    probing.fail_count = functools.lru_cache(maxsize=None)(plain[0])
    summary.tq = stats.tq = functools.lru_cache(maxsize=None)(plain[1])
    yield
    probing.fail_count, (summary.tq, stats.tq) = plain[0], (plain[1], plain[1])


def test_the_pairs_are_sized_for_a_1_3x_stack_and_cancel_a_drifting_machine():
    # confirm.pairs 2: the fewest in stock, final, final, stock (ladder.confirm_order) order, so that each side's
    # runs sit at the same mean time; two engines and two servers a side
    assert {p["confirm"]["pairs"] for p in PROFILES.values()} == {2}
    assert [ladder.confirm_order(k) for k in (1, 2)] == [("baseline", "final"), ("final", "baseline")]


@pytest.mark.parametrize(("profile", "upper", "block"), CASES, ids=IDS)
def test_an_a_a_stack_is_called_better_in_at_most_2_5_percent(profile, upper, block):
    r = confirm_rates(profile, 1.0, 1.0, seed=41, upper=upper, block=block)
    print(profile, "upper end" if upper else "measured", r)
    assert r["better"] <= 0.025, r
    # the A/A stack the ladder read x1.3 on tok/s: the confirm's interval excludes that gain
    assert r["not reproduced"] >= 0.95, r
    # the knee on one server a side, as the confirm step judged it before, called an A/A stack better in > 8 % at
    # the stock front end's spread (knees' CV 12.9 %); at the spread measured with 4 API servers in ~0 % (printed)


@pytest.mark.parametrize(("profile", "upper", "block"), CASES, ids=IDS)
def test_a_true_1_3x_stack_is_called_better_in_at_least_80_percent(profile, upper, block):
    r = confirm_rates(profile, 1.3, 1.3, seed=42, upper=upper, block=block)
    print(profile, "upper end" if upper else "measured", r)
    assert r["better"] >= 0.80 and r["power"] >= 0.80, r
    if not upper:  # each side's search starts from its own knee: ~2 looks a server (4 from the baseline's knee)
        assert r["looks a final server"] <= 2.5 and r["looks a baseline server"] <= 2.5, r


@pytest.mark.xfail(strict=True, reason="a stack kept on its knee alone (x1.3, tok/s unchanged) is confirmed in 99.95 % "
                   "at two pairs at the spread measured with 4 API servers, but the step states its power as 65 %: "
                   "stats.power's plug-in pools the spread's upper end over few degrees of freedom and errs low here "
                   "(at the stock front end's spread, 12.9 %, it was found in 11.9 % at a stated 17 %)")
def test_a_stack_kept_on_its_knee_alone_is_called_better_in_at_least_80_percent():
    r = confirm_rates("gpu-shape-4090", 1.0, 1.3, seed=43, on="knee_rps")
    print(r)
    # it says so: could not tell, not "did not reproduce", with a power that is the power it has (within 10 points)
    assert r["not reproduced"] <= 0.025 and abs(r["power"] - r["better"]) <= 0.10, r
    assert r["better"] >= 0.80, r


def test_a_machine_drifting_under_the_step_cancels_where_stock_final_stock_final_credits_the_final_stack():
    # the machine 1 % faster every run: stock, final, stock, final credits the final stack a run's drift (+1 %), the
    # interleaving none; 500 trials (a mean's SD here is ~0.09 %)
    straight = confirm_rates("gpu-shape-4090", 1.0, 1.0, seed=45, pairs=2, drift=0.01, trials=500,
                             order=lambda k: ("baseline", "final"))
    interleaved = confirm_rates("gpu-shape-4090", 1.0, 1.0, seed=45, pairs=2, drift=0.01, trials=500)
    print(straight, interleaved)
    assert abs(interleaved["output_tps rel"]) < 0.002 and straight["output_tps rel"] > 0.008, (straight, interleaved)
    assert interleaved["better"] <= 0.025 and interleaved["output_tps better"] <= straight["output_tps better"]
