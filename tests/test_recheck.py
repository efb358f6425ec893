"""A knee verdict re-checked on fresh servers (probing.recheck, stats.knee_recheck, decide.needs_knee_again) and the
fit of fresh servers' spread (measure.spread): pure functions on made-up looks."""
import numpy as np
import pytest

from judgement import decide, stats
from measure import probing, spread

K = {"max_repeats": 2, "rel_tol": 0.2, "dispersion": {"phi": 1.0, "probes": 0}}
SLO = {"percentile": 95, "ttft_ms": 500, "tpot_ms": 50}


def server(over_at: dict):
    """A probe of a made-up server: at each rate, `over` of 400 counted over the SLO."""
    def probe(rate, rows):
        return {"offered_rps": rate, "counted": 400, "over_slo": over_at[rate], "failed": 0, "backlog": False}
    return probe


def test_a_recheck_visits_the_rate_and_steps_once_where_the_base_does_not_read_the_other_way():
    passes_both = server({11.31: 0, 13.45: 0})
    rows = probing.recheck(passes_both, 11.31, K, SLO, "better")
    assert [r["offered_rps"] for r in rows] == [11.31, 13.45]  # passed at 11.31: judged a grid rate higher, once
    assert all(r["visit_verdict"] == "pass" for r in rows)
    unsure = server({11.31: 24, 13.45: 200})  # inconclusive at 11.31: judged a grid rate higher, where it fails
    got = probing.recheck(unsure, 11.31, K, SLO, "better")
    assert list(dict.fromkeys(r["offered_rps"] for r in got)) == [11.31, 13.45], got
    assert got[0]["visit_verdict"] == "inconclusive" and got[-1]["visit_verdict"] == "fail"
    fails = server({11.31: 200})
    assert [r["offered_rps"] for r in probing.recheck(fails, 11.31, K, SLO, "better")] == [11.31]
    assert [r["offered_rps"] for r in probing.recheck(server({9.514: 200, 8.0: 200}), 9.514, K, SLO, "worse")] == \
        [9.514, 8.0]
    assert [r["offered_rps"] for r in probing.recheck(passes_both, 11.31, K, SLO)] == [11.31]  # the rung's: no step


def delta(verdict):
    return {"rel": 0.19, "verdict": verdict, "why": "bracket 9.514–11.31 → 11.31–13.45 req/s"}


def rows(rate, verdict, over=3, counted=550):
    return [{"offered_rps": rate, "visit_verdict": verdict, "over_slo": over, "counted": counted}]


@pytest.mark.parametrize("base, rung, holds", [
    ("fail", "pass", True), ("inconclusive", "pass", False), ("pass", "pass", False), ("fail", "inconclusive", False)])
def test_better_stands_only_where_the_rung_passes_again_and_the_fresh_base_fails_on_evidence(base, rung, holds):
    d = stats.knee_recheck(delta("better"), [(rows(11.31, base), rows(11.31, rung))] * 2)
    assert d["verdict"] == ("better" if holds else "within noise") and d["first"] == "better"
    assert "again on a fresh server of each at 11.31 req/s" in d["why"]


@pytest.mark.parametrize("base, rung, holds", [
    ("pass", "fail", True), ("inconclusive", "fail", False), ("fail", "fail", False), ("pass", "inconclusive", False)])
def test_worse_stands_only_where_the_rung_fails_again_and_the_fresh_base_passes(base, rung, holds):
    d = stats.knee_recheck(delta("worse"), [(rows(9.514, base), rows(9.514, rung))])
    assert d["verdict"] == ("worse" if holds else "within noise")


def test_a_verdict_whose_recheck_could_not_be_measured_is_not_credited():
    d = stats.knee_recheck(delta("better"), [(rows(11.31, "fail"), None)])
    assert d["verdict"] == "within noise" and "not confirmed" in d["why"]
    assert stats.knee_recheck(delta("within noise"), [])["verdict"] == "within noise"


def test_the_verdict_rate_is_where_the_rung_passed_past_the_base_fail_or_where_it_failed():
    base = {"knee_rps": 9.514, "conclusive_fail_rps": 11.31, "noise_floor": 0.0}
    new = {"knee_rps": 13.45, "conclusive_fail_rps": 16.0, "noise_floor": 0.0,
           "rows": [{"offered_rps": 11.31, "passed": True}, {"offered_rps": 13.45, "passed": True}]}
    assert stats.verdict_rate(base, new, "better") == 11.31
    assert stats.verdict_rate(base, {**new, "conclusive_fail_rps": 8.0}, "worse") == 8.0
    assert stats.verdict_rate(base, {**new, "rows": [{"offered_rps": 22.62, "passed": True}]}, "better", 2.0) == 11.31


def test_only_a_better_or_worse_knee_waits_for_a_recheck():
    rec = {"status": "ok", "delta": {"knee_rps": delta("better"), "output_tps": {"verdict": "within noise"}}}
    assert decide.needs_knee_again(rec, "knee_rps") and not decide.needs_knee_again(rec, "output_tps")
    assert decide.needs_knee_again({**rec, "delta": {"knee_rps": delta("worse")}}, "output_tps")
    assert not decide.needs_knee_again({**rec, "delta": {"knee_rps": delta("within noise")}}, "knee_rps")
    done = {**rec, "delta": {"knee_rps": {**delta("better"), "first": "better"}}}
    assert not decide.needs_knee_again(done, "knee_rps")


def test_the_spread_fit_finds_a_server_effect_it_was_given_and_none_where_there_is_none():
    rng = np.random.default_rng(5)

    def study(sigma):
        out = []
        for _ in range(8):
            share = 0.04 * np.exp(sigma * rng.normal())
            out.append([(550, int(rng.poisson(550 * share))) for _ in range(2)])
        return out
    with_effect, without = spread.fit(study(1.0), 11.31), spread.fit(study(0.0), 11.31)
    assert with_effect.sigma_ci[0] > 0.2 and with_effect.sigma_ci[0] <= 1.0 <= with_effect.sigma_ci[1], with_effect
    assert without.sigma_ci[0] == 0.0 and without.sigma < 0.3, without
    assert without.phi_ci[0] <= 1.0 + 1e-9 or without.phi < 2, without


def test_better_keeps_a_rung_only_where_every_pair_of_fresh_servers_holds():
    # better keeps a rung, so it is re-checked on stats.KNEE_BETTER_ROUNDS pairs (the ladder's error budget); worse on
    # one
    holds, misses = (rows(11.31, "fail"), rows(11.31, "pass")), (rows(11.31, "pass"), rows(11.31, "pass"))
    assert stats.recheck_rounds(delta("better")) == stats.KNEE_BETTER_ROUNDS == 2
    assert stats.recheck_rounds(delta("worse")) == 1 and stats.recheck_rounds(delta("within noise")) == 0
    both = stats.knee_recheck(delta("better"), [holds, holds])
    assert both["verdict"] == "better" and "holds on 3 servers a side" in both["why"] and len(both["recheck"]) == 2
    one = stats.knee_recheck(delta("better"), [holds])  # the second pair never measured: not credited
    assert one["verdict"] == "within noise" and "not confirmed" in one["why"], one["why"]
    second_misses = stats.knee_recheck(delta("better"), [holds, misses])
    assert second_misses["verdict"] == "within noise" and "pair 2 at 11.31 req/s" in second_misses["why"]
    assert stats.knee_recheck(delta("better"), [misses, holds])["verdict"] == "within noise"  # the first decides
    worse = stats.knee_recheck(delta("worse"), [(rows(9.514, "pass"), rows(9.514, "fail"))] * 2)
    assert worse["verdict"] == "worse" and len(worse["recheck"]) == 1  # one pair: a second is never read


def test_a_knee_whose_own_search_passed_three_grid_steps_past_the_base_fail_is_re_checked_on_one_pair():
    base = {"knee_rps": 9.514, "conclusive_fail_rps": 11.31, "noise_floor": 0.0}
    far = stats.knee_delta(base, {"knee_rps": 19.03, "conclusive_fail_rps": 22.63, "noise_floor": 0.0})
    near = stats.knee_delta(base, {"knee_rps": 16.0, "conclusive_fail_rps": 19.03, "noise_floor": 0.0})
    assert far["verdict"] == near["verdict"] == "better" and far["past"] == pytest.approx(19.03 / 11.31, abs=1e-4)
    assert stats.recheck_rounds(far) == 1 and stats.recheck_rounds(near) == 2  # 19.03 = 11.31 x 2^(3/4)
    holds = (rows(11.31, "fail"), rows(11.31, "pass"))
    assert stats.knee_recheck(far, [holds])["verdict"] == "better"
    assert stats.knee_recheck(near, [holds])["verdict"] == "within noise"
    assert "past" not in stats.knee_delta(base, {**base})  # only better says how far
