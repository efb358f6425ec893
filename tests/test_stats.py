"""Interval maths, noise calls, McNemar, the knee search and the roofline: pure functions on fixture numbers."""
import json
import math
import os
import re

import numpy as np
import pytest

import config
from conftest import FIXTURES
from judgement import stats
from measure import evidence, probing, summary


def test_summary_interval_matches_students_t():
    s = summary.summarize([90.0, 100.0, 110.0])
    assert s["median"] == 100 and s["mean"] == 100 and s["sd"] == pytest.approx(10)
    half = 4.303 * 10 / math.sqrt(3)
    assert s["ci95"] == pytest.approx([100 - half, 100 + half], rel=1e-4)
    assert summary.summarize([5.0])["ci95"] is None  # one run: no interval


FLOOR = stats.Floor(0.015, engines=9, source="fixture")  # 1.5 % from 9 engines: df 8


def test_delta_calls_better_worse_within_noise_and_unknown():
    base = [100.0, 101.0, 99.0]
    assert stats.delta(base, [120.0, 121.0, 119.0], FLOOR)["verdict"] == "better"
    assert stats.delta(base, [80.0, 81.0, 79.0], FLOOR)["verdict"] == "worse"
    noisy = stats.delta(base, [98.0, 104.0, 101.0], FLOOR)
    assert noisy["verdict"] == "within noise" and noisy["ci"][0] < 0 < noisy["ci"][1]
    d = stats.delta(base, [110.0, 110.0, 110.0], FLOOR)
    assert d["rel"] == pytest.approx(0.10) and d["engines"] == [1, 1] and "df" in d["why"]


def test_no_interval_rests_on_repeats_inside_one_engine_alone():
    # the repeats agree to 0.1 %, yet a fresh engine lands 1-9 % away: without a measured floor, no call
    d = stats.delta([7103.0, 7154.0, 7112.0], [9184.0, 9183.0, 9178.0])
    assert d["verdict"] == "unknown" and d["ci"] is None and "no start-to-start SD measured" in d["why"]
    # several engines a side carry their own start-to-start spread: pooled, it is the floor
    floor = stats.pool(stats.Floor(0.0), [[7103.0, 7242.0, 7337.0]])
    assert floor.df == 2 and floor.cv == pytest.approx(0.0163, abs=1e-4)
    assert stats.delta([7103.0, 7154.0, 7112.0], [9184.0, 9183.0, 9178.0], floor)["verdict"] == "better"


def test_the_interval_takes_the_floors_degrees_of_freedom_not_the_repeats():
    # AWQ's +28.9 % on the H200 came out [-1.1, +58.9] with t from the in-engine df (~2, t 4.3) applied to a typed-in
    # 5 % floor; with a floor of known df the quantile is the floor's, and the verdict no longer hinges on which side's
    # repeats happened to be tighter
    base, awq = [7103.0, 7154.0, 7112.0], [9184.0, 9183.0, 9178.0]
    d = stats.delta(base, awq, stats.Floor(0.05, engines=9))
    assert d["verdict"] == "better" and 7 < d["df"] < 9
    tight = stats.delta([7123.0, 7123.5, 7122.5], awq, stats.Floor(0.05, engines=9))
    assert tight["verdict"] == "better" and tight["ci"] == pytest.approx(d["ci"], abs=0.01)


def test_a_base_on_both_sides_cancels_a_machine_that_drifts_under_the_rung():
    # the machine speeds up 4 % per engine: base 100, rung 104 (a placebo), base again 108
    floor = stats.Floor(0.005, engines=9)
    assert stats.delta([[100.0, 100.1]], [[104.0, 104.1]], floor)["verdict"] == "better"  # against the base before
    both = stats.delta([[100.0, 100.1], [108.0, 108.1]], [[104.0, 104.1]], floor)
    assert both["verdict"] == "within noise" and both["rel"] == pytest.approx(0.0, abs=1e-3)


def test_a_pooled_floor_counts_every_same_config_group_by_its_degrees_of_freedom():
    prior = stats.Floor(0.01, engines=5, source="make benchmark")
    pooled = stats.pool(prior, [[100.0, 102.0], [50.0, 50.0, 50.0], [7.0]])  # a lone engine adds nothing
    assert pooled.df == 4 + 1 + 2 and pooled.engines == 10
    assert pooled.cv ** 2 == pytest.approx((4 * 0.01 ** 2 + 1 * (2 ** 0.5 / 101) ** 2 + 0) / 7)
    assert "make benchmark" in pooled.source and "5 in this ladder" in pooled.source
    assert stats.pool(stats.Floor(0.0), []).df == 0


def test_a_stored_floor_is_read_at_the_upper_end_of_its_95_percent_interval():
    # gpu-shape-4090's 0.59 % on 8 engines reads 1.20 %, the cpu's 2.50 % on 24 reads 3.51 %; its df are its engines'
    read = stats.Floor.of(config.NoiseFloor(cv=0.0059, engines=8, measured_on="H200"))
    assert read.cv == 0.0059 and read.judged == pytest.approx(0.0120, abs=5e-5) and read.df == 7
    assert read.words().endswith("(df 7; H200), judged at its 95% upper end: 1.20%"), read.words()
    assert stats.Floor.of(config.NoiseFloor(cv=0.025, engines=24)).judged == pytest.approx(0.0351, abs=5e-5)
    assert stats.Floor.of(config.NoiseFloor()).judged == 0 and stats.Floor.of(None).read_at is None  # nothing to read
    # the ladder's own engines pool with the estimate, and the pool is judged at its upper end on its own df
    pooled = stats.pool(read, [[100.0, 101.0]])
    assert pooled.read_at == stats.FLOOR_LEVEL and pooled.df == 8
    assert pooled.judged == pytest.approx(stats.upper_cv(pooled.cv, 8)) and pooled.cv ** 2 == pytest.approx(
        (7 * 0.0059 ** 2 + (2 ** 0.5 / 201) ** 2) / 8)
    assert stats.pool(stats.Floor.of(config.NoiseFloor()), [[100.0, 101.0]]).read_at is None


def test_a_floor_judged_at_its_upper_end_is_taken_as_known_there():
    # a normal quantile on the judged SD, not a t on the floor's df as well: at a truth at that upper end, each way
    # CONFIDENCE's rate (brute force, 8,000 pairs of one engine a side)
    floor = stats.Floor.of(config.NoiseFloor(cv=0.0059, engines=8))
    d = stats.delta([100.0], [103.0], floor)
    assert d["normal"] and d["floor_cv"] == floor.judged and "a normal quantile" in d["why"]
    assert (d["ci"][1] - d["ci"][0]) / 2 == pytest.approx(2.4324 * floor.judged * math.hypot(100, 103) / 100, rel=1e-3)
    rng = np.random.default_rng(9)
    x = rng.normal(100.0, 100.0 * floor.judged, (8000, 2))
    better = np.mean([stats.delta([a], [b], floor)["verdict"] == "better" for a, b in x])
    assert better == pytest.approx((1 - stats.CONFIDENCE) / 2, abs=0.003), better


def test_the_read_floor_is_below_the_truth_in_2_5_percent_of_measurements():
    # brute force on planted data: fresh engines' SD of 1 % measured on 8 (and 24) engines, 20,000 times; the upper
    # end the rule reads falls below the truth in (1 - FLOOR_LEVEL) / 2 of them
    rng = np.random.default_rng(5)
    for n in (8, 24):
        sd = np.std(rng.normal(100.0, 1.0, (20000, n)), axis=1, ddof=1) / 100.0
        below = np.mean([stats.upper_cv(float(x), n - 1) < 0.01 for x in sd])
        assert below == pytest.approx((1 - stats.FLOOR_LEVEL) / 2, abs=0.004), (n, below)


def test_mcnemar_exact():
    assert stats.mcnemar_exact(0, 0) == 1.0
    assert stats.mcnemar_exact(4, 0) == pytest.approx(0.125)
    assert stats.mcnemar_exact(6, 0) == pytest.approx(0.03125)
    assert stats.mcnemar_exact(4, 1) == pytest.approx(0.375)
    assert stats.mcnemar_exact(5, 5) == 1.0


def test_detectable_flips_is_the_fewest_one_way_flips_mcnemar_calls_a_regression():
    assert stats.detectable_flips(28, 0.05) == 6  # p = 2/2**6 = 0.031; five flips give 0.0625
    assert stats.mcnemar_exact(5, 0) >= 0.05 > stats.mcnemar_exact(6, 0)
    assert stats.detectable_flips(28, 0.01) == 8
    assert stats.detectable_flips(28, 0.05, floor=2) == 8  # two flips are noise: six more are needed
    assert stats.detectable_flips(5, 0.05) is None  # five items cannot reach p < 0.05 even if all flip
    assert stats.detectable_flips(8, 0.05, floor=3) is None


def test_detectable_drop_is_those_flips_as_a_fraction_of_the_category():
    assert stats.detectable_drop(8, 0.05) == 0.75  # the old 8-item categories: a 0.25 drop was never evidence
    assert stats.detectable_drop(24, 0.05) == 0.25 and stats.detectable_drop(28, 0.05) == pytest.approx(6 / 28)
    assert stats.detectable_drop(4, 0.05) is None


def test_paired_verdict():
    assert stats.paired_verdict(40, 8, 0, 0.05, 5) == ("regressed", pytest.approx(2 / 256))
    assert stats.paired_verdict(40, 0, 8, 0.05, 5)[0] == "improved"
    assert stats.paired_verdict(40, 2, 1, 0.05, 5)[0] == "not enough evidence"
    assert stats.paired_verdict(40, 0, 0, 0.05, 5)[0] == "no change"
    assert stats.paired_verdict(3, 3, 0, 0.05, 5)[0] == "not enough evidence"  # too few items to say


def search(true_knee, start=4.0, max_rate=256.0, tol=0.2, max_probes=10, flaky=None):
    probes = []
    while (r := probing.next_rate(probes, start, max_rate, tol, max_probes)) is not None:
        ok = r <= true_knee  # synthetic latency curve: meets the SLO up to the knee ...
        if flaky is not None and r == flaky and any(x == r for x, _ in probes):
            ok = not ok      # ... except a repeat at `flaky`, which disagrees with the first probe there
        probes.append((r, ok))
    return probes, probing.knee_result(probes, rel_tol=tol)


@pytest.mark.parametrize("true_knee", [4.5, 5.0, 9.3, 13.7, 27.0, 37.0, 50.0, 63.0])
def test_the_search_brackets_the_knee_to_20_percent_visiting_each_rate_once(true_knee):
    probes, res = search(true_knee)  # from 4 req/s: up to 16x off, as a start from a stale estimate can be
    assert len(probes) <= 10
    assert res["status"] == "inside" and res["resolved"] and not res["non_monotonic"]
    lo, hi = res["last_pass_rps"], res["first_fail_rps"]
    assert lo <= true_knee < hi
    assert (hi - lo) / ((hi + lo) / 2) <= 0.2 and res["half_width_rps"] == pytest.approx((hi - lo) / 2)
    assert res["mid_rps"] == pytest.approx((hi + lo) / 2)
    rates = [r for r, _ in probes]
    assert len(rates) == len(set(rates))  # a rate's repeats are its visit's (pooled evidence), never a later re-draw


def anchored(true_knee, anchor, max_probes=10):
    probes = []
    while (r := probing.next_rate(probes, 4.0, 256.0, 0.2, max_probes, anchor=anchor)) is not None:
        probes.append((r, r <= true_knee))
    return probes


def test_a_rung_probes_its_bases_failing_rate_first_then_its_passing_one_and_stops():
    base = {"pass": 11.31, "fail": 13.45}
    # the latency the base met at its rates (run.anchor.latency, which sizes a look) is not a rate to probe: the
    # search reads the anchor as before (the CI ladder's knee stage once raised on it)
    assert anchored(12.0, {**base, "latency": [[11.31, 1.4]]}) == anchored(12.0, base)
    assert anchored(20.0, {**base, "latency": [[11.31, 1.4]], "worse": 9.514}) == anchored(20.0, {**base,
                                                                                                  "worse": 9.514})
    # no better: it fails where the base failed; it passes where the base passed; done, in two probes
    assert anchored(12.0, base) == [(13.45, False), (11.31, True)]
    # worse: it fails at both and stops (a rung not better is not kept: no later rung starts from its knee) ...
    down = anchored(7.0, base)
    assert down == [(13.45, False), (11.31, False)]
    assert stats.knee_delta({"knee_rps": 11.31, "conclusive_fail_rps": 13.45},
                            {"knee_rps": None, "conclusive_fail_rps": 11.31})["verdict"] == "worse"
    # ... but for one visit where a fail is worse beyond knee.noise_floor (the anchor's `worse`): the grid rate at or
    # below it (11.31 / 1.5 = 7.54: 6.727), and stops whatever it found there
    floor = {**base, "worse": 7.54}
    assert anchored(7.0, floor) == [(13.45, False), (11.31, False), (6.727, True)]
    assert anchored(5.0, floor) == [(13.45, False), (11.31, False), (6.727, False)]
    assert stats.knee_delta({"knee_rps": 11.31, "conclusive_fail_rps": 13.45, "noise_floor": 0.5},
                            {"knee_rps": None, "conclusive_fail_rps": 6.727})["verdict"] == "worse"
    # better: it passes where the base failed, then searches on up for its own bracket (it may be the next base)
    up = anchored(20.0, base)
    assert up[0] == (13.45, True) and len(up) > 2
    res = probing.knee_result(up, rel_tol=0.2)
    assert res["last_pass_rps"] <= 20.0 < res["first_fail_rps"] and res["resolved"]
    # ... unless it is the last rung measured (no later rung starts from it): better, and done, in one probe
    assert anchored(20.0, {**base, "last": True}) == [(13.45, True)]
    assert anchored(12.0, {**base, "last": True}) == anchored(12.0, base)  # not better: as any rung
    assert anchored(20.0, {**base, "last": True, "bracket": True}) == up   # a confirm pair's runs search on
    # a base that passed everywhere it probed: its top pass first, then up where the rung passes too
    assert anchored(12.0, {"pass": 64.0, "fail": None}) == [(64.0, False)]
    assert anchored(100.0, {"pass": 64.0, "fail": None})[:2] == [(64.0, True), (128.0, False)]
    # no anchor, or an empty one: the plain search
    assert anchored(12.0, None) == anchored(12.0, {"pass": None, "fail": None}) == search(12.0)[0]


def test_a_rung_stops_once_its_knee_verdict_is_settled_even_where_a_rate_is_left_inconclusive():
    base = {"pass": 11.31, "fail": 13.45}

    def nxt(probes, unsure, anchor=base):
        return probing.next_rate(probes, 4.0, 256.0, 0.2, 10, anchor=anchor, unsure=unsure)
    # neither passed nor failed on evidence at the base's pass: not worse on evidence, and not better: stop
    assert nxt([(13.45, False), (11.31, False)], {11.31}) is None
    # inconclusive at the base's fail, passes at its pass: within noise, stop
    assert nxt([(13.45, False), (11.31, True)], {13.45}) is None
    # failed on evidence at the base's pass: worse (no knee.noise_floor), stop; with one, one visit where a fail is
    # worse beyond it, not where it is left inconclusive at the base's pass
    assert nxt([(13.45, False), (11.31, False)], set()) is None
    assert nxt([(13.45, False), (11.31, False)], set(), {**base, "worse": 7.54}) == 6.727
    assert nxt([(13.45, False), (11.31, False)], {11.31}, {**base, "worse": 7.54}) is None
    # a confirm pair's final stack (bracket): on to its own bracket where the anchors are not one
    full = {**base, "bracket": True}
    assert nxt([(13.45, False), (11.31, False)], {11.31}, full) is not None
    assert nxt([(13.45, False), (11.31, True)], {13.45}, full) is not None
    assert nxt([(13.45, False), (11.31, True)], set(), full) is None  # fail on evidence, then a pass: its bracket
    # such a search's knee is open (no pass; its lowest rate inconclusive), not "the SLO never met"
    rows = [{"offered_rps": 13.45, "passed": False, "evidence": "fail"},
            {"offered_rps": 11.31, "passed": False, "evidence": "inconclusive"}]
    res = probing.knee_result([(13.45, False), (11.31, False)], rel_tol=0.2, rows=rows)
    assert res["status"] == "open" and res["knee_rps"] is None and probing.conclusive_fail(rows) == 13.45
    rows[1]["evidence"] = "fail"
    assert probing.knee_result([(13.45, False), (11.31, False)], rel_tol=0.2, rows=rows)["status"] == "below"


def test_every_rung_probes_the_same_rates_with_the_same_arrival_sequences():
    assert [probing.grid_steps(t) for t in (0.2, 0.1, 0.5)] == [4, 7, 2]
    assert probing.grid_rate(4, 4) == 2.0 and probing.grid_rate(3, 4) == 1.682 and probing.grid_rate(-4, 4) == 0.5
    assert all(probing.grid_index(probing.grid_rate(i, 7), 7) == i for i in range(-60, 80))
    # the CI's placebo and its base started from 1.88 and 1.96 req/s (half their benches' req/s): one grid rate
    assert probing.next_rate([], 1.88, 64, 0.2, 10) == probing.next_rate([], 1.96, 64, 0.2, 10) == 2.0
    assert probing.next_rate([], 49, 50, 0.2, 10) == 45.25  # never above an off-grid max_rate ...
    assert probing.next_rate([], 0.28, 64, 0.2, 10, min_rate=0.3) == 0.3536  # ... nor below min_rate
    runs = []
    for start, knee in ((1.3, 2.2), (3.1, 2.9), (0.7, 1.5)):
        probes = []
        while (r := probing.next_rate(probes, start, 64, 0.2, 10)) is not None:
            probes.append((r, r <= knee))
        runs.append(probes)
    steps = probing.grid_steps(0.2)
    rates = {r for probes in runs for r, _ in probes}
    assert all(probing.grid_rate(probing.grid_index(r, steps), steps) == r for r in rates)  # every rate on the grid
    seeds = {}
    for probes in runs:
        for i, (r, _) in enumerate(probes):
            seeds.setdefault((r, sum(1 for x, _ in probes[:i] if x == r)), set()).add(
                probing.probe_seed(r, probes[:i], steps))
    assert all(len(s) == 1 for s in seeds.values())  # one (rate, repeat): one seed, whichever search probed it
    assert len({s.pop() for s in seeds.values()}) == len(seeds)  # and a repeat is a fresh draw


def test_knee_below_and_above_the_range_are_reported_as_such():
    _, below = search(0.01)
    assert below["status"] == "below" and below["knee_rps"] is None
    _, above = search(1000.0)
    assert above["status"] == "above" and above["knee_rps"] == 256.0 and above["first_fail_rps"] is None


def test_sweep_mode_and_non_monotonic_flag():
    rates = [1, 2, 4, 8]
    probes = []
    while (r := probing.sweep_next(probes, rates)) is not None:
        probes.append((r, r in (1, 2, 8)))  # 4 fails, 8 passes again: noise
    res = probing.knee_result(probes, rates)
    assert res["knee_rps"] == 2 and res["first_fail_rps"] == 4 and res["non_monotonic"] is True
    assert res["range_rps"] == [1, 8]


def test_a_percentile_rests_on_enough_requests():
    assert [probing.tail_requests(p) for p in (99, 95, 90)] == [300, 60, 30]
    # 10 s at 5 req/s is 50 requests, but a p99 pass needs 299 counted (329 with the sizing margin) after the 10 %
    # ramp-up: 0.99^299 = 0.0495
    assert evidence.pass_minimum(99) == 299 and evidence.pass_minimum(95) == 59 and evidence.pass_minimum(90) == 29
    assert probing.probe_prompts(5, 10, 99, 0.1, 16, 1000) == 366
    assert probing.probe_prompts(50, 10, 90, 0.1, 16, 1000) == 556  # 10 s counted after the ramp-up
    assert probing.probe_prompts(5, 10, 99, 0.1, 16, 200) == 200  # capped (config refuses such a cap up front)
    # settle 3 and tail 1 end-to-end latencies of 2 s at 10 req/s: 80 more arrivals around the 329 counted
    assert probing.probe_prompts(10, 10, 99, 0.0, 16, 1000, e2e_s=2.0, settle=3, tail=1) == 409
    # three pooled looks share the 5 % (each at 1.67 %: 408 counted, 449 with the margin), and bursts count phi-fold
    assert evidence.pass_minimum(99, looks=3) == 408 and evidence.pass_minimum(95, phi=6.9, looks=3) == 551
    assert probing.probe_prompts(10, 10, 99, 0.0, 16, 1000, e2e_s=2.0, settle=3, tail=1, looks=3) == 529


def _reqs(n, rate, ttft, service, ramp_ttft=None):
    """n requests arriving every 1/rate s; each takes `service` s after its first token (`ramp_ttft` for the
    first 10 %: an empty server answers faster)."""
    out = []
    for i in range(n):
        t = ramp_ttft if ramp_ttft is not None and i < n // 10 else ttft
        out.append({"start": i / rate, "ttft": t, "tpot": 0.02, "end": i / rate + t + service, "ok": True})
    return out


def test_tail_stats_leave_out_the_ramp_up_and_read_the_percentile_of_the_rest():
    reqs = _reqs(334, 10, ttft=0.4, service=1.0, ramp_ttft=0.05)
    reqs[-1]["ttft"] = 5.0  # one slow request among 301 counted: the p99 is not the maximum
    t = probing.tail_stats(reqs, 99, 0.1, 0.8)
    assert t["ramp_skipped"] == 33 and t["counted"] == 301 and t["needed"] == 300
    assert t["ttft_ms"] == pytest.approx(400) and t["tpot_ms"] == pytest.approx(20)
    assert not t["backlog"]


def test_a_growing_admission_queue_is_backlog_even_when_p50_latency_hides_it():
    # arrivals at 10 req/s, admitted (first token) at 5 req/s: the queue grows through the whole window
    reqs = [{"start": i / 10, "ttft": i / 5 + 0.1 - i / 10, "tpot": 0.02, "end": i / 5 + 1.1, "ok": True}
            for i in range(300)]
    t = probing.tail_stats(reqs, 99, 0.1, 0.8)
    assert t["backlog"] and t["window_first_tokens"] < 0.8 * t["window_arrivals"]


def test_completions_trailing_arrivals_while_the_batch_fills_are_not_backlog():
    # a real H200 probe well inside its SLO (p95 TTFT 153 ms <= 500): completions in the window's second half fell
    # 24 short of 70 arrivals (end-to-end latency rose while the batch filled), which the old completions count
    # called backlog; first tokens kept up (69 of 70)
    data = json.loads((FIXTURES / "h200-4090-fp8kv-21.25rps.json").read_text())
    t = probing.tail_stats(data["requests"], 95, 0.1, 0.8)
    assert t["ttft_ms"] < 500 and (t["window_arrivals"], t["window_first_tokens"]) == (70, 69)
    assert not t["backlog"]


def _stalled(reqs, share):
    """`share` of the window's arrivals fewer first tokens in the window: the latest ones in it move past it."""
    t1, mid = reqs[-1]["start"], (reqs[0]["start"] + reqs[-1]["start"]) / 2
    arrived = sum(1 for r in reqs if r["start"] >= mid)
    inside = [r for r in reqs if mid <= r["start"] + r["ttft"] <= t1]
    for r in inside[len(inside) - round(share * arrived):]:
        r["ttft"], r["end"] = t1 - r["start"] + 1.0, t1 + 2.0
    return reqs


def test_backlog_allows_a_fifth_of_the_arrivals_and_no_more():
    # 150 window arrivals at 10 req/s with a 0.1-s TTFT: the Poisson term (2.33 * sqrt(2 * 10 * 0.1) = 3.3)
    # is below the floor (0.2 * 150 = 30), which decides
    ok = probing.tail_stats(_stalled(_reqs(300, 10, ttft=0.1, service=1.0), 0.15), 90, 0.1, 0.8)
    late = probing.tail_stats(_stalled(_reqs(300, 10, ttft=0.1, service=1.0), 0.25), 90, 0.1, 0.8)
    assert ok["window_allowance"] == late["window_allowance"] == 30.0
    assert not ok["backlog"] and late["backlog"]


def test_on_a_slow_small_probe_the_poisson_noise_decides():
    # 21 window arrivals in 10 s with a 3-s TTFT: the floor allows 4.2, the two counts' Poisson noise
    # 2.33 * sqrt(2 * 2.1 * 3) = 8.3: a shortfall of 6 is noise, not backlog
    t = probing.tail_stats(_stalled(_reqs(41, 2, ttft=3.0, service=1.0), 0.3), 90, 0.1, 0.8)
    assert t["window_allowance"] == pytest.approx(8.3, abs=0.05)
    assert t["window_arrivals"] - t["window_first_tokens"] > 0.2 * t["window_arrivals"] and not t["backlog"]


def test_a_knee_from_probes_short_against_their_latency_is_flagged():
    # the fixture probe: p50 end-to-end ~2 s against a 3-s half-window
    data = json.loads((FIXTURES / "h200-4090-fp8kv-21.25rps.json").read_text())
    t = probing.tail_stats(data["requests"], 95, 0.1, 0.8)
    assert t["e2e_over_window"] > probing.SHORT_PROBE_SHARE
    assert t["window_completions"] == 46  # completions trail: reported, not judged
    short = {"offered_rps": 20.0, "passed": True, "e2e_over_window": 0.6}
    long = {**short, "e2e_over_window": 0.2}
    failed = {**short, "offered_rps": 24.0, "passed": False}
    assert probing.short_probes([short, failed], 20.0)
    assert not probing.short_probes([long, failed], 20.0)
    assert not probing.short_probes([long, {**short, "passed": False}, failed], 20.0)  # only passing probes count


def test_probe_passes_checks_slo_failures_backlog_and_enough_requests():
    slo = {"percentile": 99, "ttft_ms": 500, "tpot_ms": 50}
    row = {"slo_ttft_ms": 400, "slo_tpot_ms": 40, "failed": 0, "backlog": False, "counted": 301, "needed": 300}
    assert probing.probe_passes(row, slo) == (True, "")
    assert "p99 TTFT 501 ms > 500 ms" in probing.probe_passes({**row, "slo_ttft_ms": 501}, slo)[1]
    assert "failed" in probing.probe_passes({**row, "failed": 2}, slo)[1]
    assert "backlog" in probing.probe_passes({**row, "backlog": True}, slo)[1]
    assert "120 requests counted, a p99 needs 300" in probing.probe_passes({**row, "counted": 120}, slo)[1]


def test_a_knee_moves_only_where_one_side_passed_on_a_rate_the_other_failed():
    base = {"knee_rps": 6, "first_fail_rps": 7}
    assert stats.knee_delta(base, {"knee_rps": 6.5, "first_fail_rps": 7})["verdict"] == "within noise"
    # passing at the rate where the base failed, on the same traces (probe_seed), is a gain; failing where it passed
    # a loss: two verdicts at one rate, each on evidence
    assert stats.knee_delta(base, {"knee_rps": 7, "first_fail_rps": 8})["verdict"] == "better"
    assert stats.knee_delta(base, {"knee_rps": 5, "first_fail_rps": 6})["verdict"] == "worse"
    assert stats.knee_delta(base, {"knee_rps": 8, "first_fail_rps": 10})["verdict"] == "better"
    assert stats.knee_delta(base, {"knee_rps": 4, "first_fail_rps": 5})["verdict"] == "worse"
    assert stats.knee_delta({"knee_rps": 64, "first_fail_rps": None}, {"knee_rps": 64})["verdict"] == "within noise"
    assert stats.knee_delta(base, {"knee_rps": None})["verdict"] == "worse"  # a lost knee
    assert stats.knee_delta({"knee_rps": None}, base)["verdict"] == "better"
    assert stats.knee_delta({"knee_rps": None}, {"knee_rps": None})["verdict"] == "unknown"


def test_a_knee_moves_only_beyond_its_start_to_start_noise():
    # the CI run that called a placebo 52 % worse: its bracket sat apart from its base's, by less than the
    # spread of fresh servers of one config on that CPU
    base = {"knee_rps": 1.96, "first_fail_rps": 3.92, "noise_floor": 0.5}
    placebo = {"knee_rps": 0.94, "first_fail_rps": 1.41, "noise_floor": 0.5}
    d = stats.knee_delta(base, placebo)
    assert d["verdict"] == "within noise" and round(d["rel"], 2) == -0.52
    assert "by more than the knee's start-to-start noise (knee.noise_floor 50%)" in d["why"]
    assert stats.knee_delta(placebo, base)["verdict"] == "within noise"
    # beyond it: moved, and said so; the larger of the two records' floors applies
    assert stats.knee_delta(base, {"knee_rps": 0.6, "first_fail_rps": 1.2})["verdict"] == "worse"  # 1.2 x 1.5 < 1.96
    assert stats.knee_delta(base, {"knee_rps": 0.6, "first_fail_rps": 1.4})["verdict"] == "within noise"
    assert stats.knee_delta(placebo, {"knee_rps": 2.2, "first_fail_rps": 2.5})["verdict"] == "better"  # > 1.41 x 1.5
    assert "more than the knee's start-to-start noise" in stats.knee_delta(placebo, {"knee_rps": 2.2})["why"]
    assert stats.knee_delta(base, {"knee_rps": None})["verdict"] == "worse"  # a lost knee is lost whatever the floor


QWEN = json.loads((FIXTURES / "qwen2.5-7b-config.json").read_text())


def test_roofline_qwen25_7b_bf16():
    rtx = stats.tpot_floor_ms(QWEN, stats.bandwidth_gbs("NVIDIA GeForce RTX 4090"))
    h200 = stats.tpot_floor_ms(QWEN, stats.bandwidth_gbs("NVIDIA H200"))
    assert rtx == pytest.approx(14.0, abs=0.5)
    assert h200 == pytest.approx(2.9, abs=0.1)
    # 4-bit weights read about a third of the bytes (the LM head stays 16-bit)
    awq = stats.tpot_floor_ms(QWEN, 1008, weight_bits=4)
    assert 0.25 < awq / rtx < 0.40
    # KV bytes grow the floor with batch x context; fp8 KV halves that part
    kv16 = stats.tpot_floor_ms(QWEN, 1008, context_tokens=1000, batch=8) - rtx
    kv8 = stats.tpot_floor_ms(QWEN, 1008, kv_bytes=1, context_tokens=1000, batch=8) - rtx
    assert kv8 == pytest.approx(kv16 / 2)


def test_bandwidth_table_matches_exact_names_and_overrides():
    assert stats.bandwidth_gbs("NVIDIA H100 PCIe") == 2000
    assert stats.bandwidth_gbs("NVIDIA H100 80GB HBM3") == 3350
    assert stats.bandwidth_gbs("NVIDIA GeForce RTX 4090") == 1008
    assert stats.bandwidth_gbs("NVIDIA A100-SXM4-80GB") == 2039 and stats.bandwidth_gbs("NVIDIA A10") == 600
    assert stats.bandwidth_gbs("NVIDIA L40") is None  # not "L4"; nor is an A100 variant the table lacks an "A10"
    assert stats.bandwidth_gbs("NVIDIA A100-PCIE-40GB") is None
    assert stats.bandwidth_gbs("Mystery GPU") is None
    assert stats.bandwidth_gbs("Mystery GPU", {"Mystery GPU": 123}) == 123


def test_weight_bits_count_scales_and_zero_points_for_every_quantization_format():
    assert stats.weight_bits(None) == 16
    awq = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
    assert stats.weight_bits(awq) == pytest.approx(4 + (16 + 4) / 128)
    assert stats.weight_bits({"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True}) == 4 + 16 / 128
    ct = {"quant_method": "compressed-tensors", "config_groups": {"group_0": {
        "weights": {"num_bits": 4, "group_size": 32, "symmetric": False, "type": "int"}}}}
    assert stats.weight_bits(ct) == pytest.approx(4 + 20 / 32)
    assert stats.weight_bits({"quant_method": "fp8"}) == 8


def test_the_fingerprint_tells_machines_apart_without_exposing_their_ids():
    from measure import host
    fp = host.fingerprint()
    assert re.fullmatch(r"[0-9a-f]{12}", fp["host_id"]) and fp["host_id"] == host.host_id()
    raw = open("/etc/machine-id").read().strip() if os.path.exists("/etc/machine-id") else ""
    assert not raw or raw not in json.dumps(fp)


def test_the_fingerprint_sees_only_the_gpus_cuda_visible_devices_allows():
    from measure import host
    two = [{"index": "0", "name": "NVIDIA H200", "uuid": "GPU-d544f0c0-aaaa"},
           {"index": "1", "name": "NVIDIA H200", "uuid": "GPU-42077730-bbbb"}]
    assert host.visible(two, None) == two
    assert host.visible(two, "1") == [two[1]]            # a ladder pinned to the second GPU records it alone
    assert host.visible(two, "GPU-d544f0c0") == [two[0]]  # UUID prefixes, as CUDA accepts them
    assert host.visible(two, "1,0") == [two[1], two[0]]
    assert host.visible(two, "") == [] and host.visible(two, "0,7,1") == [two[0]]


# ---------------------------------------------------------------- a probe's verdict on counted evidence
def test_slo_evidence_is_the_exact_binomial_bound_on_the_share_over_the_slo():
    from scipy import stats as sps
    assert probing.slo_evidence(59, 0, 95)["verdict"] == "pass"       # 0.95^59 = 0.048: fewest for a p95 pass
    assert probing.slo_evidence(58, 0, 95)["verdict"] == "inconclusive"
    assert probing.slo_evidence(29, 0, 90)["verdict"] == "pass"
    assert probing.slo_evidence(299, 0, 99)["verdict"] == "pass"
    e = probing.slo_evidence(100, 2, 95)  # 2 % over a 5 % allowance: not yet evidence either way
    assert e["verdict"] == "inconclusive" and e["p_pass"] == pytest.approx(sps.binom.cdf(2, 100, 0.05), abs=1e-4)
    assert probing.slo_evidence(300, 5, 95)["verdict"] == "pass"
    assert probing.slo_evidence(100, 11, 95)["verdict"] == "fail"     # P[X >= 11 | 100, 5 %] = 0.011
    assert probing.slo_evidence(0, 0, 95)["verdict"] == "inconclusive"


def test_a_probe_passes_on_evidence_and_says_the_count_when_it_does_not():
    slo, row = {"percentile": 95, "ttft_ms": 500, "tpot_ms": 50}, {"failed": 0, "backlog": False}
    assert probing.probe_passes(row, slo, probing.slo_evidence(116, 0, 95)) == (True, "")
    ok, why = probing.probe_passes(row, slo, probing.slo_evidence(76, 3, 95))
    assert not ok and why == "3 of 76 counted requests over the SLO (inconclusive at 95% that at most 5% break it)"
    assert "failed" in probing.probe_passes({**row, "failed": 1}, slo, probing.slo_evidence(116, 0, 95))[1]


def test_tail_stats_count_the_requests_over_the_slo_in_the_counted_window():
    data = json.loads((FIXTURES / "h200-4090-fp8kv-21.25rps.json").read_text())  # a saved H200 probe
    t = probing.tail_stats(data["requests"], 95, 0.1, 0.8, {"ttft_ms": 500, "tpot_ms": 50})
    assert t["counted"] == 116 and t["over_slo"] == 0
    tight = probing.tail_stats(data["requests"], 95, 0.1, 0.8, {"ttft_ms": 100, "tpot_ms": 50})
    slow = [r for r in sorted(data["requests"], key=lambda r: r["start"])[12:] if r["ttft"] > 0.1]
    assert tight["over_slo"] == len(slow) > 0


def test_an_inconclusive_rate_is_probed_again_with_its_counts_pooled_up_to_the_cap():
    k = {"mode": "sweep", "rates": [1.0, 2.0], "max_probes": None, "max_repeats": 3, "dispersion": {"phi": 1.0}}
    slo = {"percentile": 95, "ttft_ms": 500, "tpot_ms": 50}
    draws = {1.0: [(40, 0), (40, 0)], 2.0: [(60, 4), (60, 5), (60, 4)]}  # 1: 0/80 passes; 2: 13/180 stays unsure

    def probe(rate, rows):
        counted, over = draws[rate][sum(1 for r in rows if r["offered_rps"] == rate)]
        return {"offered_rps": rate, "counted": counted, "over_slo": over, "failed": 0, "backlog": False}
    rows, probes = probing.search(probe, k, slo)
    assert [r["offered_rps"] for r in rows] == [1.0, 1.0, 2.0, 2.0, 2.0]
    assert probes == [(1.0, True), (1.0, True), (2.0, False), (2.0, False), (2.0, False)]
    assert rows[1]["pooled_counted"] == 80 and rows[-1]["evidence"] == "inconclusive"
    assert probing.conclusive_fail(rows) is None  # 2 req/s failed for want of evidence, not on it


def test_a_knee_moves_only_past_a_boundary_known_on_evidence():
    base = {"knee_rps": 6, "first_fail_rps": 7, "conclusive_fail_rps": 7}
    assert stats.knee_delta(base, {"knee_rps": 8, "first_fail_rps": 10, "conclusive_fail_rps": 10})["verdict"] \
        == "better"
    unsure = {"knee_rps": 6, "first_fail_rps": 7, "conclusive_fail_rps": None}  # 7 was inconclusive, not failed
    d = stats.knee_delta(unsure, {"knee_rps": 8, "first_fail_rps": 10, "conclusive_fail_rps": 10})
    assert d["verdict"] == "within noise" and "6–∞ → 8–10" in d["why"]
    lost = {"knee_rps": None, "first_fail_rps": 4, "conclusive_fail_rps": None}  # nothing passed, nothing failed
    d = stats.knee_delta(base, lost)
    assert d["verdict"] == "within noise" and "neither passed where the base failed nor failed where it passed" \
        in d["why"]
    assert stats.knee_delta(base, {**lost, "conclusive_fail_rps": 4})["verdict"] == "worse"
    assert stats.knee_delta(base, {"knee_rps": None, "first_fail_rps": 4})["verdict"] == "worse"  # an older record


def test_repeats_inside_engines_never_buy_more_degrees_of_freedom_than_the_floor_has():
    # two base engines that happened to agree (df 1): their tight repeats once read df 5 and called +3 % better
    floor = stats.pool(stats.Floor(0.0), [[100.0, 100.2]])
    d = stats.delta([[99.9, 100.1], [100.1, 100.3]], [[103.0, 103.1]], floor)
    assert floor.df == 1 and d["df"] <= 1 and d["verdict"] == "within noise"
    # a prior with no degrees of freedom adds neither its spread nor its engines
    assert stats.pool(stats.Floor(0.05, engines=1), [[100.0, 101.0]]).df == 1


def test_a_knee_per_gpu_passing_where_the_base_failed_is_a_gain_whichever_way_the_grid_rounds():
    from judgement import capacity
    base = {"knee_rps": 8.0, "first_fail_rps": 9.514, "conclusive_fail_rps": 9.514}
    # a 2-GPU instance passing 19.03 req/s passes 9.515 per GPU, where one GPU failed 9.514: the grid's 4 figures
    tp2 = capacity.per_gpu_knee({"knee_rps": 19.03, "first_fail_rps": 22.63, "conclusive_fail_rps": 22.63}, 2)
    assert stats.knee_delta(base, tp2)["verdict"] == "better"
    below = {"knee_rps": 9.513, "first_fail_rps": 11.31, "conclusive_fail_rps": 11.31}  # a hair below it
    assert stats.knee_delta(base, below)["verdict"] == "better"
    assert stats.knee_delta(base, {**below, "knee_rps": 9.4})["verdict"] == "within noise"


def test_the_knee_is_the_highest_rate_passed_on_evidence_below_the_first_failed_on_evidence():
    # the cpu example's spend-memory: 9.514 inconclusive, 11.31 passed (0 of 166), 13.45 and 16 inconclusive, 19.03
    # failed: a rate left inconclusive below a pass is no boundary
    verdicts = {8.0: "pass", 9.514: "inconclusive", 11.31: "pass", 13.45: "inconclusive", 16.0: "inconclusive",
                19.03: "fail"}
    rows = [{"offered_rps": r, "evidence": e, "passed": e == "pass"} for r, e in verdicts.items()]
    probes = [(r["offered_rps"], r["passed"]) for r in rows]
    assert probing.knee_result(probes)["knee_rps"] == 8.0  # without the evidence: the last pass below the first miss
    res = probing.knee_result(probes, rel_tol=0.2, rows=rows)
    assert (res["knee_rps"], res["first_fail_rps"]) == (11.31, 13.45) and probing.conclusive_fail(rows) == 19.03
    rows[-1]["evidence"] = "inconclusive"  # no fail on evidence anywhere: the highest pass
    assert probing.knee_result(probes, rows=rows)["knee_rps"] == 11.31


def test_a_search_above_the_wall_steps_down_one_grid_rate_and_halves_below_a_rate_far_above_it():
    assert probing.next_rate([(13.45, False)], 13.45, 128, 0.2, 10) == 11.31
    assert probing.next_rate([(13.45, False)], 13.45, 128, 0.2, 10, far={13.45}) == 6.727
    assert probing.next_rate([(13.45, False), (11.31, False)], 13.45, 128, 0.2, 10) == 9.514


def test_a_search_started_at_the_bench_s_knee_moves_one_grid_rate_either_way_within_start_steps():
    """knee.start_steps: the check ladder's rung 0 on an H100 (bracket 26.91-32) looked at 19.03, 38.05, 26.91 and
    32 from 0.75 of the bench's req/s; from its knee, a doubling after the pass overshoots to 53.82 and bisects back,
    and a halving below a far fail (an H200 starting at 32) bisects up from 16."""
    def path(start, knee, near, anchor=None):
        probes = []
        while (r := probing.next_rate(probes, start, 128, 0.2, 10, anchor=anchor, near=near,
                                      far={r for r, ok in probes if not ok})) is not None:
            probes.append((r, r < knee))
        return [r for r, _ in probes]
    assert path(26.91, 29.5, 4) == [26.91, 32.0]           # an H100: pass, then one grid rate up
    assert path(26.91, 29.5, 0) == [26.91, 53.82, 38.05, 32.0]
    assert path(32.0, 29.5, 4) == [32.0, 26.91]            # an H200: a far fail, then one grid rate down
    assert path(32.0, 29.5, 0) == [32.0, 16.0, 22.63, 26.91]
    # a start a doubling or more off its knee: one grid rate at a time within the band, then as before
    assert path(13.45, 40.0, 4) == [13.45, 16.0, 19.03, 22.63, 26.91, 53.82, 38.05, 45.25]
    assert path(64.0, 20.0, 4) == [64.0, 53.82, 45.25, 38.05, 32.0, 16.0, 22.63, 19.03]
    # a rung's search starts at its base's knee (run.anchor), not from the bench: start_steps does not apply
    assert path(26.91, 40.0, 4, {"fail": 32.0, "pass": 26.91}) == path(26.91, 40.0, 0, {"fail": 32.0, "pass": 26.91})


def test_a_look_fails_for_certain_at_the_fewest_requests_over_that_fail_it_were_all_counted():
    need = probing.fail_count(600, 95, 6.9, 0.975)
    assert probing.slo_evidence(600, need, 95, 0.975, 6.9)["verdict"] == "fail"
    assert probing.slo_evidence(600, need - 1, 95, 0.975, 6.9)["verdict"] != "fail"
    assert need == 64
    # fewer requests over than that, with only some counted, may already fail: the look stops later than it could
    assert probing.slo_evidence(200, need - 10, 95, 0.975, 6.9)["verdict"] == "fail"
    assert probing.fail_count(3, 95, 6.9) is None  # too few to fail at all


def test_a_knee_bracket_with_no_pass_says_so():
    d = stats.knee_delta({"knee_rps": 3.364, "conclusive_fail_rps": 4.757, "noise_floor": 0.5},
                         {"knee_rps": None, "conclusive_fail_rps": 3.364, "noise_floor": 0.5})
    assert "bracket 3.364–4.757 → no pass–3.364 req/s" in d["why"], d


def test_the_knee_over_servers_is_the_ratio_of_their_geometric_mean_midpoints_with_the_cards_spread():
    def k(lo, hi):
        return {"knee_rps": lo, "conclusive_fail_rps": hi}
    base, new = [k(9.514, 11.31), k(11.31, 13.45)], [k(19.03, 22.63), k(22.63, 26.91)]  # ~2x
    spread = config.ServerSpread(knee_cv=0.1292, servers=12, measured_on="H200")
    d = stats.knees_delta(base, new, spread)
    brackets = ((9.514, 11.31), (11.31, 13.45), (19.03, 22.63), (22.63, 26.91))
    mid = [math.sqrt(a * b) for a, b in brackets]
    assert d["rel"] == pytest.approx(math.sqrt(mid[2] * mid[3] / (mid[0] * mid[1])) - 1, rel=1e-9)
    # the SD: the card's (knee_cv^2 + each bracket's width^2 / 12, df 11) pooled with each side's own (df 1 + 1)
    w = np.mean([math.log(b / a) ** 2 / 12 for a, b in brackets])
    own = sum(float(np.var(np.log(x), ddof=0)) * 2 for x in (mid[:2], mid[2:]))
    assert d["df"] == 13 and d["sd"] == pytest.approx(math.sqrt((11 * (0.1292 ** 2 + w) + own) / 13), abs=1e-4)
    assert d["verdict"] == "better" and d["servers"] == [2, 2]
    assert stats.knees_delta(base, base, spread)["verdict"] == "within noise"
    # one server of two moved ~2x: within noise
    assert stats.knees_delta(base, new[:1] + base[1:], spread)["verdict"] == "within noise"
    # no spread measured and one server a side: nothing to judge by
    assert stats.knees_delta(base[:1], new[:1], config.ServerSpread())["verdict"] == "unknown"
    assert stats.knees_delta([k(None, 9.514)], new, spread)["verdict"] == "unknown"  # a side with no bracket


def test_servers_whose_brackets_coincide_are_not_read_as_no_spread():
    # a cpu confirm step (no servers' spread measured): 2 servers a side, each side one bracket; their own SD is 0,
    # but each server's knee sits anywhere in its bracket: the SD is at least a uniform's across it
    def k(lo, hi):
        return {"knee_rps": lo, "conclusive_fail_rps": hi}
    base, new = [k(8.0, 9.514)] * 2, [k(9.514, 11.31)] * 2  # one grid step apart
    d = stats.knees_delta(base, new, config.ServerSpread())
    assert d["sd"] == pytest.approx(math.log(9.514 / 8.0) / math.sqrt(12), abs=1e-4)
    assert d["verdict"] == "within noise", d  # one grid step on 2 servers a side is no evidence
    far = stats.knees_delta([k(1.682, 3.364)] * 2, [k(8.0, 9.514)] * 2, config.ServerSpread())
    assert far["verdict"] == "better" and far["ci"][0] > 0.1, far  # the known-gain ladder's confirm step: x4


def test_the_power_at_the_true_floor_is_the_rate_a_planted_gain_is_called_better():
    # brute force: a floor measured on 8 engines (its cv drawn as measured), 2 engines a side, a true +3 % gain; the
    # power a confirm step states is this function at its measured floor (a plug-in: it errs high as often as low)
    rng = np.random.default_rng(5)
    calls = []
    for _ in range(3000):
        cv = 0.015 * math.sqrt(rng.chisquare(7) / 7)
        b = [[100 * (1 + rng.normal(0, 0.015))] for _ in range(2)]
        n = [[103 * (1 + rng.normal(0, 0.015))] for _ in range(2)]
        calls.append(stats.delta(b, n, stats.Floor(cv, 8))["verdict"] == "better")
    at_truth = stats.power({"ci": [0.0, 0.0], "df": 7, "engines": [2, 2], "floor_cv": 0.015}, gain=0.03)
    assert np.mean(calls) == pytest.approx(at_truth, abs=0.02), (np.mean(calls), at_truth)


def test_the_power_on_a_judged_floor_is_the_rate_where_the_truth_sits_at_its_upper_end():
    # brute force: params' floor of 0.59 % on 8 engines, judged 1.20 %; engines that far apart, 2 a side, +2 %: the
    # power a confirm step states (a normal quantile on the judged floor) is the rate it is called better there
    floor = stats.Floor.of(config.NoiseFloor(cv=0.0059, engines=8))
    rng = np.random.default_rng(6)
    calls, stated = [], None
    for _ in range(3000):
        b = [[100 * (1 + rng.normal(0, floor.judged))] for _ in range(2)]
        n = [[102 * (1 + rng.normal(0, floor.judged))] for _ in range(2)]
        d = stats.delta(b, n, floor)
        calls.append(d["verdict"] == "better")
        stated = stats.power(d, gain=0.02)
    assert np.mean(calls) == pytest.approx(stated, abs=0.02), (np.mean(calls), stated)


def test_a_look_counts_the_requests_it_was_sized_for_where_seconds_of_poisson_arrivals_left_it_short():
    # planted looks: Poisson arrivals at the offered rate, every request the latency the look was sized by; the
    # cpu's rung-0 look near its wall (9.514 req/s, e2e 1.389 s, p90 at dispersion 5.3: a pass needs 151 counted)
    rng = np.random.default_rng(5)
    rate, e2e, phi = 9.514, 1.389, 5.3
    need = evidence.pass_minimum(90, phi, 1)
    n = probing.probe_prompts(rate, 10, 90, 0.1, 16, 4096, e2e, 3, 1, phi)
    by_time, by_arrivals = [], []
    for _ in range(2000):
        starts = np.cumsum(rng.exponential(1 / rate, n))
        reqs = [{"start": s, "end": s + e2e, "ok": True} for s in starts]
        w, v = probing.counted_window(reqs, 0.1, 3, 1), probing.counted_window(reqs, 0.1, 3, 1, rate)
        by_time.append(w["hi"] - w["lo"])
        by_arrivals.append(v["hi"] - v["lo"])
        lo = max(int(n * 0.1), int(np.sum(starts < starts[0] + 3 * e2e)))  # the window in seconds, counted by hand
        assert by_time[-1] == int(np.sum(starts <= starts[-1] - e2e)) - lo
    planned = n - math.ceil(rate * 3 * e2e) - math.ceil(rate * e2e)
    assert set(by_arrivals) == {planned} and planned >= need
    # in seconds the count swings by ~sqrt(rate x 4 x e2e) = 7.3
    assert 6 < np.std(by_time) < 9 and abs(np.mean(by_time) - planned) < 2
    short = np.mean(np.array(by_time) < need)
    assert 0.005 < short < 0.05, short  # 10 % over a pass (COUNT_MARGIN) is ~2 SD: a look in 50 or so came short
    # a tail longer than the look leaves nothing to count, in arrivals as in seconds
    reqs = [{"start": i / rate, "end": i / rate + 7.0, "ok": True} for i in range(50)]  # 67 arrivals of tail
    for r in (None, rate):
        w = probing.counted_window(reqs, 0.0, 0, 1, r)
        assert w["hi"] - w["lo"] <= 0 and reqs[w["lo"]:w["hi"]] == [], (r, w)


def test_the_power_of_a_delta_drawn_on_wider_repeats_uses_their_spread():
    # a disturbed base engine whose passes spread wider than the floor holds: the interval is theirs, and so is the
    # power it states (on the floor's SD it read 57 % where the interval drawn gave 24 %)
    floor = stats.Floor.of(config.NoiseFloor(cv=0.025, engines=24))
    d = stats.delta([[100.0, 80.0, 120.0], [100.0, 101.0, 99.0]], [[130.0, 131.0, 129.0], [130.0, 129.0, 131.0]],
                    floor)
    assert "repeats_se" in d and not d.get("normal")
    on_floor = stats.power({**d, "repeats_se": None, "normal": True})
    assert stats.power(d) < on_floor
