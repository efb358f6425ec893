"""Keep/revert decisions and the applied-knob check, on fixture records: pure logic, no engine."""
from types import SimpleNamespace

import pytest
import yaml

import config
from conftest import ROOT
from judgement import decide, stats


def rec(tps, knee, bracket=1.0, gate=None, applied=None, status="ok"):
    return {"status": status, "gate": gate or {"gated": True, "keep": True, "reasons": []}, "applied": applied or [],
            "bench": {"output_tps_runs": tps, "output_tps": sorted(tps)[len(tps) // 2]},
            "knee": {"knee_rps": knee, "first_fail_rps": knee and knee + bracket}}


BASE = rec([400.0, 402.0, 398.0], 6.0)
FLOOR = stats.Floor(0.015, engines=9, source="fixture")  # start-to-start CV 1.5 % from 9 engines
# params' bench.noise_floor that the rule judges as 1.5 % (stats.Floor.read: at the upper end of its 95 % interval)
FLOOR_9 = config.NoiseFloor(cv=0.015 / stats.upper_cv(1.0, 8), engines=9)


def decided(r, objective="knee_rps"):
    r["delta"] = {"output_tps": stats.delta(BASE["bench"]["output_tps_runs"], r["bench"]["output_tps_runs"], FLOOR),
                  "knee_rps": stats.knee_delta(BASE["knee"], r["knee"])}
    return decide.decide(r, BASE, objective)


def test_a_failed_gate_reverts_whatever_the_speed():
    keep, why = decided(rec([800.0, 810.0, 790.0], 12.0,
                            gate={"gated": True, "keep": False, "reasons": ["category math collapsed"]}))
    assert keep is False and why.startswith("quality gate failed: category math collapsed")


def test_a_faster_rung_is_kept():
    keep, why = decided(rec([500.0, 505.0, 495.0], 9.0))
    assert keep is True and "knee +50.0 % (better" in why


def test_a_slower_rung_is_reverted():
    keep, why = decided(rec([300.0, 301.0, 299.0], 3.0))
    assert keep is False and "knee -50.0 % (worse" in why


def test_no_significant_change_is_reverted_the_simpler_config_stays():
    keep, why = decided(rec([390.0, 410.0, 405.0], 6.5, bracket=0.5))
    assert keep is False and "no measurable gain" in why and "within noise" in why and "simpler config stays" in why


def test_within_noise_on_the_objective_but_worse_elsewhere_is_reverted():
    keep, why = decided(rec([300.0, 301.0, 299.0], 6.0))
    assert keep is False and "output tok/s -25.0 % (worse" in why


def test_a_lost_knee_is_worse_whatever_the_throughput():
    keep, why = decided(rec([500.0, 505.0, 495.0], None))
    assert keep is False and "knee worse (knee lost" in why


def test_throughput_objective_needs_a_significant_gain_and_a_knee_not_worse():
    keep, why = decided(rec([500.0, 505.0, 495.0], 6.0), objective="output_tps")
    assert keep is True and "output tok/s +25.0 % (better" in why
    keep, why = decided(rec([500.0, 505.0, 495.0], 3.0), objective="output_tps")
    assert keep is False and "knee -50.0 % (worse" in why
    keep, why = decided(rec([400.0, 405.0, 395.0], 9.0), objective="output_tps")
    assert keep is False and "no measurable gain" in why


def test_a_change_that_did_not_take_effect_is_not_credited():
    r = rec([500.0, 505.0, 495.0], 9.0, applied=[{"knob": "engine.kv_cache_dtype", "applied": False}])
    keep, why = decided(r)
    assert keep is False and why.startswith("not applied")


def test_a_failed_rung_is_reverted_with_its_reason():
    keep, why = decide.decide({"status": "failed", "error": "ValueError: too little KV cache"}, BASE, "knee_rps")
    assert keep is False and why.startswith("failed: ValueError: too little KV cache (the pre-flight")
    assert "only a started engine can find" in why  # the pre-flight passed it: vLLM could not check it earlier


def test_not_gated_perf_only_rungs_are_decided_by_performance():
    keep, why = decided(rec([500.0, 505.0, 495.0], 9.0, gate={"gated": False, "keep": True, "reasons": ["not gated"]}))
    assert keep is True and why.startswith("not gated (no quality measured)")


FACTS = {"model_path": "/m/w4", "quantization": "compressed-tensors", "kernels": ["CPUWNA16LinearKernel"],
         "kv_cache_tokens": 93184, "max_num_batched_tokens": 1024, "tensor_parallel_size": 1,
         "received": {"max_num_seqs": 64},
         "cache_config": {"cache_dtype": "fp8", "enable_prefix_caching": "True", "gpu_memory_utilization": "0.94",
                          "kv_cache_memory_bytes": str(2 * 2**30)},
         "prefix_cache_hit_rate": 0.0}


def test_applied_check_reads_the_engines_own_evidence():
    models = {"w4": {"path": "/m/w4"}, "bf16": {"path": "/m/bf16"}}
    checks = {c["knob"]: c for c in decide.applied_check(
        {"model.name": "w4", "engine.kv_cache_dtype": "fp8", "engine.enable_prefix_caching": True,
         "engine.max_num_batched_tokens": 1024, "engine.max_num_seqs": 64, "engine.gpu_memory_utilization": 0.94,
         "env.VLLM_CPU_KVCACHE_SPACE": 2, "engine.tensor_parallel_size": 2}, FACTS, models)}
    assert all(checks[k]["applied"] for k in list(checks)[:-1])
    assert "CPUWNA16LinearKernel" in checks["model.name"]["observed"]
    assert "hit rate 0.0%" in checks["engine.enable_prefix_caching"]["observed"]
    assert checks["engine.tensor_parallel_size"]["applied"] is False  # asked 2, the engine ran 1
    assert decide.applied_check({"model.name": "bf16"}, FACTS, models)[0]["applied"] is False


def test_a_throughput_gain_with_the_knee_within_noise_is_kept_as_a_gain():
    keep, why = decided(rec([500.0, 505.0, 495.0], 6.5, bracket=1.0))
    assert keep is True and "better: output tok/s +25.0 % (better" in why and "the knee not better on evidence" in why


def candidate(name, tps, knee, bracket=1.0):
    r = rec(tps, knee, bracket)
    keep, why = decided(r)
    r.update(name=name, kept=keep, decision=why, status="ok")
    return r


def test_candidates_are_ranked_by_the_same_rule_in_like_units():
    # a point knee 0.5 req/s higher, where neither failed on a rate the other passed (9-10 vs 8.5-10): the
    # significantly higher throughput decides, not the point knee
    a, b = candidate("a", [450.0, 452.0, 448.0], 9.0), candidate("b", [520.0, 522.0, 518.0], 8.5, bracket=1.5)
    assert decide.choose([a, b], "knee_rps", FLOOR) is b
    assert a["verdict"] == "not chosen" and "b is kept instead" in a["decision"]
    # neither beats the other: the first listed stays
    c, d = candidate("c", [500.0, 505.0, 495.0], 9.0), candidate("d", [501.0, 504.0, 496.0], 9.0)
    assert decide.choose([c, d], "knee_rps", FLOOR) is c and "no other candidate beat it" in c["decision"]
    # a candidate that would not be kept on its own is never chosen
    e, f = candidate("e", [400.0, 401.0, 399.0], 6.0), candidate("f", [300.0, 301.0, 299.0], 3.0)
    assert decide.choose([e, f], "knee_rps", FLOOR) is None


def test_the_confirm_step_re_measures_stock_and_final_interleaved_fresh_and_skips_when_nothing_was_kept(monkeypatch):
    """The driver's control flow (run_exp stands in for `dvc exp run`; the real path runs in the CI ladder)."""
    import ladder
    from judgement import record

    class P:  # the plan fields the confirm step reads
        profile, overrides, objective, rungs = "cpu", {}, "knee_rps", [{"name": "a"}, {"name": "b"}]
        params = {"confirm": {"pairs": 2}, "bench": {"noise_floor": {"cv": 0.015, "engines": 9}},
                  "knee": {"server_spread": {"knee_cv": 0.13, "servers": 12}}}
        typed_params = SimpleNamespace(  # the blocks the judgement reads, typed
            bench=SimpleNamespace(noise_floor=FLOOR_9),
            knee=SimpleNamespace(server_spread=config.ServerSpread(knee_cv=0.13, servers=12)))
        baseline = {}
        experiments = 3
    drv = ladder.Driver.__new__(ladder.Driver)
    drv.plan, drv.eff, drv.confirm, drv.t0, drv.out, drv.objective = P, P.params, None, 0.0, None, P.objective
    base = {"exp": "cpu-0-baseline", "knobs": {"engine.seed": 0}, "knee": {"knee_rps": 7.0, "conclusive_fail_rps": 8.0}}
    final = {"exp": "cpu-2-b", "knobs": {"engine.seed": 0, "engine.max_num_seqs": 32},
             "knee": {"knee_rps": 11.31, "conclusive_fail_rps": 13.45}}
    drv.records, drv.final_exp = [base, final], "cpu-2-b"
    calls = []

    anchors = []

    def run_exp(index, name, cfg, role, change, b, note="", into=None, round_=0, anchor=None, replay=True):
        calls.append((index, name, cfg, role, round_))
        anchors.append(anchor)
        lo = 8.0 if name.endswith("baseline") else 12.0
        r = {"name": name, "exp": f"cpu-{index}-{name}", "status": "ok", "knobs": cfg,
             "knee": {"knee_rps": lo + round_, "conclusive_fail_rps": lo + 1.514 + round_}}
        into.append(r)
        return r
    monkeypatch.setattr(drv, "run_exp", run_exp)
    monkeypatch.setattr(drv, "save", lambda final=False: None)
    monkeypatch.setattr(drv, "progress", lambda label: None)
    judged = []

    def summary(runs, floor, objective, kept, spread):
        judged.append(spread)
        return {"summary": f"{len(runs)} runs", "delta": {}}
    monkeypatch.setattr(record, "confirm_summary", summary)
    drv.confirm_step()
    # stock, final, then final, stock: each side's mean at the same time, so a drifting machine cancels
    assert [(n, r, cfg) for _, n, cfg, _, r in calls] == [
        ("confirm-1-baseline", 1, base["knobs"]), ("confirm-1-final", 1, final["knobs"]),
        ("confirm-2-final", 2, final["knobs"]), ("confirm-2-baseline", 2, base["knobs"])]
    assert all(role == decide.CONFIRM and i == 3 for i, _, _, role, _ in calls)
    # each side starts its knee search from its own knee measured last (rung 0's, the final rung's, then the step's
    # own), each on to its own bracket: the headline and the capacity plan print them
    assert anchors == [{"pass": 7.0, "fail": 8.0, "bracket": True}, {"pass": 11.31, "fail": 13.45, "bracket": True},
                       {"pass": 13.0, "fail": 14.51, "bracket": True}, {"pass": 9.0, "fail": 10.51, "bracket": True}]
    assert judged == [P.typed_params.knee.server_spread]  # the knee judged over servers with the card's spread
    assert drv.confirm["summary"] == "4 runs" and [r["of"] for r in drv.confirm["runs"]][:2] == [base["exp"],
                                                                                                final["exp"]]
    calls.clear()
    drv.final_exp = "cpu-0-baseline"
    drv.confirm_step()
    assert not calls and "nothing was kept" in drv.confirm["why"]


def test_a_confirm_run_starts_from_its_own_sides_knee_and_the_final_stack_without_one_from_the_baseline():
    import ladder
    drv = ladder.Driver.__new__(ladder.Driver)
    base = {"exp": "e0", "knobs": {}, "knee": {"knee_rps": 7.0, "conclusive_fail_rps": 8.0}}
    final = {"exp": "e2", "knobs": {}, "knee": {"knee_rps": 11.31, "conclusive_fail_rps": 13.45}}
    drv.records = [base, final]

    def anchor(which: str, recs: list[dict]) -> dict:
        return drv.confirm_anchor(which, recs, base, final)
    assert anchor("baseline", []) is base and anchor("final", []) is final
    b1 = {"name": "confirm-1-baseline", "status": "ok", "knee": {"knee_rps": 8.0, "conclusive_fail_rps": 9.514}}
    f1 = {"name": "confirm-1-final", "status": "ok", "knee": {"knee_rps": 13.45, "conclusive_fail_rps": 16.0}}
    assert anchor("final", [b1, f1]) is f1 and anchor("baseline", [b1, f1]) is b1
    # a final rung kept on tok/s whose knee was not measured (or has no boundary on evidence): the baseline's
    final["knee"] = {"status": "n/a"}
    assert anchor("final", []) is base and anchor("final", [b1]) is b1


def test_a_knob_an_earlier_rung_added_is_removed_from_the_next_experiment():
    """Each `dvc exp run` leaves its params in the workspace: broken-rope's RoPE override must not ride along
    into the confirm step's rung-0 run, nor may a knob the next run sets, or a non-knob section, be removed."""
    import plan as planning
    from runner import experiments
    ws = {"model": {"name": "m"}, "engine": {"seed": 0, "hf_overrides": {"rope_parameters": {"rope_theta": 1.0}}},
          "env": {"VLLM_CPU_KVCACHE_SPACE": 1, "VLLM_X": 1}, "bench": {"repeats": 3}}
    sets = {"model.name": "m", "engine.seed": 0, "env.VLLM_CPU_KVCACHE_SPACE": 1, "knee.max_probes": 3}
    knobs = planning.KNOB_SECTIONS  # the sections a rung's sets hold whole
    assert experiments.stale_knobs(ws, sets, knobs) == ["engine.hf_overrides", "env.VLLM_X"]
    assert experiments.stale_knobs(ws, {**sets, "engine.hf_overrides": {}, "env.VLLM_X": 1}, knobs) == []


# ---------------------------------------------------------------- every rung between two measurements of its base
def judged(r, again_runs, objective="knee_rps"):
    """r decided as the driver does: against BASE's engines just before and just after it (None: that re-measure
    failed), the floor pooled with the base's own two engines."""
    from judgement import record
    base = {**BASE, "knobs": {"engine.seed": 0}, "status": "ok"}
    r = {**r, "knobs": {"engine.seed": 1}}
    again = None if again_runs is None else {**rec(again_runs, None), "knobs": base["knobs"], "status": "ok"}
    floor = record.floor_of(FLOOR_9, [base, r] + ([again] if again else []))
    r["delta"] = {**record.compare(base, r, floor, again), decide.AGAIN: again is not None}
    r["delta"]["knee_rps"] = stats.knee_delta(BASE["knee"], r["knee"])
    r["kept"], r["decision"] = decide.decide(r, base, objective)
    return r


def test_a_gain_against_a_base_measured_earlier_that_the_base_after_it_matches_is_reverted():
    # the CI placebo: +14 % against a base measured earlier; the base measured right after it runs as fast: the
    # machine moved, not the rung (the two base engines 14 % apart also widen the pooled floor)
    r = judged(rec([457.0, 458.0, 456.0], 6.5), [455.0, 459.0, 457.0])
    assert r["kept"] is False and "no measurable gain" in r["decision"], r["decision"]
    assert "the base measured before and after it; 2 vs 1 engine(s)" in r["decision"]
    assert "simpler config stays" in r["decision"]


def test_a_gain_over_the_base_on_both_sides_is_kept_and_says_so():
    for objective in ("knee_rps", "output_tps"):
        r = judged(rec([500.0, 505.0, 495.0], 6.5), [401.0, 399.0, 400.0], objective)
        assert r["kept"] is True and "output tok/s +25.0 % (better, the base measured before and after it" \
            in r["decision"], r["decision"]


def test_a_base_that_could_not_be_measured_again_confirms_no_gain():
    r = judged(rec([500.0, 505.0, 495.0], 6.5), None)
    assert r["kept"] is False and "reverted: not confirmed: output tok/s +25.0 %, but its base could not be " \
        "measured again" in r["decision"]
    # the re-measure's own row is never a rung, whatever became of it
    assert decide.verdict({"role": decide.RECHECK, "status": "failed"}) == decide.RECHECK


def test_only_a_rung_that_may_gain_on_tok_s_waits_for_its_base_again():
    def measured(tps, knee, objective="knee_rps"):
        r = rec(tps, knee)
        decided(r, objective)
        return decide.needs_again(r, objective)
    assert measured([457.0, 458.0, 456.0], 6.5)                    # +14 % against the base before it: maybe
    assert measured([420.0, 421.0, 419.0], 6.5)                    # +5 %, within noise, but a re-measure could tell
    assert not measured([402.0, 403.0, 401.0], 6.5)                # +0.5 %: the base's next engine would have to read
    #                                                                ~8 % low (stats.again_odds 0.0): no gain possible
    assert not measured([380.0, 381.0, 379.0], 6.5)                # slower: no gain whatever the base reads after
    assert not measured([500.0, 505.0, 495.0], 9.0)                # kept on its knee: tok/s does not decide
    assert measured([500.0, 505.0, 495.0], 9.0, "output_tps")      # ... unless tok/s is the objective
    assert not measured([500.0, 505.0, 495.0], 3.0, "output_tps")  # a knee worse reverts it anyway
    failed_gate = rec([500.0, 505.0, 495.0], 6.5, gate={"gated": True, "keep": False, "reasons": ["x"]})
    decided(failed_gate)
    assert not decide.needs_again(failed_gate, "knee_rps")
    had = rec([500.0, 505.0, 495.0], 6.5)
    decided(had)
    had["delta"][decide.AGAIN] = True
    assert not decide.needs_again(had, "knee_rps")
    assert not decide.needs_again({"status": "failed", "delta": {}}, "knee_rps")


def test_the_driver_measures_the_base_again_once_per_rung_and_decides_on_both_sides(monkeypatch):
    """The driver's control flow (run_exp stands in for `dvc exp run`; the real path runs in the CI ladder):
    two candidates that may gain share one re-measure of the base, run with its knobs and run.remeasure = when
    the last of them was measured; while it runs they are not kept; a rung kept on its knee waits for nothing."""
    import ladder
    import plan as planning
    from judgement import record
    from runner import experiments

    class P:
        profile, overrides, objective, rungs, experiments = "cpu", {}, "knee_rps", [], 1
        params = {"bench": {"noise_floor": {"cv": 0.015, "engines": 9}}, "knee": {"better_pairs": 2}}
        typed_params = SimpleNamespace(bench=SimpleNamespace(noise_floor=FLOOR_9))
    drv = ladder.Driver.__new__(ladder.Driver)
    drv.plan, drv.objective, drv.records, drv.t0, drv.eff, drv.confirm = P, "knee_rps", [], 0.0, P.params, None
    drv.dvc = experiments.Experiments(planning.KNOB_SECTIONS, ladder.LOGS)  # none of this commit's is another's
    drv.profile, drv.overrides, drv.warm_due = P.profile, P.overrides, True
    drv.warm_ups = {"cpu-0-baseline": True, "cpu-2-c": False}  # rung 0's bench warmed the machine; c's did not
    base = {**BASE, "name": "baseline", "exp": "cpu-0-baseline", "knobs": {"engine.seed": 0}, "status": "ok"}
    at = {"a": "2026-12-01T06:00:00Z", "b": "2026-12-01T06:05:00Z", "c": "2026-12-01T06:10:00Z"}
    results = {"a": rec([457.0, 458.0, 456.0], 6.5), "b": rec([520.0, 522.0, 518.0], 6.5),
               "c": rec([400.0, 401.0, 399.0], 9.0), "seqs-base-again": rec([456.0, 458.0, 457.0], None),
               "c-base-again": rec([401.0, 399.0, 400.0], None)}
    for name in ("seqs-base-again", "c-base-again"):  # a re-measure searches no knee
        results[name]["knee"] = {"status": "n/a", "label": "bench only", "knee_rps": None}
    for name, verdict in (("c-knee-base", "fail"), ("c-knee-rung", "pass"), ("c-knee-base-2", "fail"),
                          ("c-knee-rung-2", "pass")):  # c's knee re-checked on two pairs of fresh servers: it holds
        results[name] = rec([400.0, 401.0, 399.0], None)
        results[name]["knee"] = {"status": "ok", "label": "knee re-check", "knee_rps": None,
                                 "recheck": {"verdicts": {"9": verdict}},
                                 "rows": [{"offered_rps": 9.0, "visit_verdict": verdict, "over_slo": 1,
                                           "counted": 500}]}
    drv.records.append(base)
    calls, rounds = [], []

    def run_exp(index, name, cfg, role, change, b, note="", into=None, round_=0, remeasure=0, anchor=None,
                replay=True, warm_up=None):
        calls.append((name, cfg, role, remeasure))
        if role == decide.KNEE_RECHECK:
            rounds.append((round_, anchor.get("pair"), warm_up))
        if role == decide.RECHECK:  # held meanwhile: an interruption here must not leave them kept
            assert all(r["kept"] is False and r.get("verdict") is None for r in drv.records if r is not base)
        r = {**results[name], "index": index, "name": name, "exp": f"cpu-{index}-{name}", "role": role,
             "knobs": cfg, "change": change or {}, "measured": {"at": at.get(name)}}
        r["delta"] = record.compare(b, r, drv.floor()) if b else {"output_tps": None, "knee_rps": None}
        drv.records.append(r)
        return r
    monkeypatch.setattr(drv, "run_exp", run_exp)
    monkeypatch.setattr(drv, "save", lambda final=False: None)
    monkeypatch.setattr(drv, "progress", lambda label: None)
    rung = {"name": "seqs", "note": ""}
    tries = [("a", {"engine.max_num_seqs": 8}, "candidate"), ("b", {"engine.max_num_seqs": 32}, "candidate")]
    chosen = drv.try_rung(1, rung, tries, {"engine.seed": 0}, base)
    assert [c[0] for c in calls] == ["a", "b", "seqs-base-again"]
    assert calls[2][1:] == (base["knobs"], decide.RECHECK, 1796105100)  # b's bench: 2026-12-01 06:05:00 UTC
    by = {r["name"]: r for r in drv.records}
    assert by["a"]["verdict"] == "reverted" and "no measurable gain" in by["a"]["decision"]  # +14 % was the machine
    assert chosen is by["b"] and by["b"]["verdict"] == "kept" and "before and after it" in by["b"]["decision"]
    assert by["seqs-base-again"]["verdict"] == decide.RECHECK and by["seqs-base-again"]["kept"] is False
    assert "cpu-0-baseline measured again (fresh engine, bench only): output tok/s +14.2 %" in \
        by["seqs-base-again"]["decision"]
    calls.clear()
    drv.records[:] = [base]
    assert drv.try_rung(2, {"name": "c", "note": ""}, [("c", {"engine.max_num_seqs": 64}, "rung")],
                        {"engine.seed": 0}, base) is not None
    # kept on its knee: no re-measure of its tok/s, but its knee re-checked on two pairs of fresh servers, the
    # second its own knee (run.anchor.pair 2, so DVC's run-cache cannot hand it the first pair's servers); each with
    # its experiment's bench params (run.round 0, run.warm_up as that one ran), so its bench is restored, and no
    # confirm pair's run.round
    assert [c[0] for c in calls] == ["c", "c-knee-base", "c-knee-rung", "c-knee-base-2", "c-knee-rung-2"]
    assert [c[2] for c in calls[1:]] == [decide.KNEE_RECHECK] * 4 and calls[1][1] == calls[3][1] == base["knobs"]
    assert rounds == [(0, None, True), (0, None, False), (0, 2, True), (0, 2, False)]
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]  # the pair: the knee's key, not the bench's
    assert "run.anchor" in stages["knee"]["params"] and "run.anchor" not in stages["bench"]["params"]
    assert "run.round" in stages["bench"]["params"]
    by = {r["name"]: r for r in drv.records}
    assert by["c"]["verdict"] == "kept" and "holds on 3 servers a side" in by["c"]["decision"], by["c"]["decision"]
    # where the first pair does not hold, no second pair is started
    calls.clear()
    rounds.clear()
    drv.records[:] = [base]
    results["c-knee-rung"]["knee"] = {**results["c-knee-rung"]["knee"], "recheck": {"verdicts": {"9": "fail"}},
                                      "rows": [{"offered_rps": 9.0, "visit_verdict": "fail", "over_slo": 90,
                                                "counted": 500}]}
    assert drv.try_rung(2, {"name": "c", "note": ""}, [("c", {"engine.max_num_seqs": 64}, "rung")],
                        {"engine.seed": 0}, base) is None
    assert [c[0] for c in calls] == ["c", "c-knee-base", "c-knee-rung"]


def test_after_a_revert_the_next_rung_is_compared_with_its_base_as_last_measured():
    """A machine that slows down across the ladder: the base's own bench is 400, its re-measure after a reverted rung
    390, the next rung 391: against the re-measure it is no faster, and it is decided without another."""
    import ladder

    class P:
        profile, overrides, objective, rungs, experiments = "cpu", {}, "knee_rps", [], 1
        params = {"bench": {"noise_floor": {"cv": 0.015, "engines": 9}}}
        typed_params = SimpleNamespace(bench=SimpleNamespace(noise_floor=FLOOR_9))
    drv = ladder.Driver.__new__(ladder.Driver)
    drv.plan, drv.objective, drv.t0, drv.eff, drv.confirm = P, "knee_rps", 0.0, P.params, None
    base = {**BASE, "name": "baseline", "exp": "cpu-0-baseline", "knobs": {"engine.seed": 0}, "status": "ok"}
    again = {**rec([390.0, 391.0, 389.0], None), "role": decide.RECHECK, "base": base["exp"], "knobs": base["knobs"],
             "exp": "cpu-1-a-base-again", "status": "ok",
             "knee": {"status": "n/a", "label": "bench only", "knee_rps": None}}  # a re-measure searches no knee
    drv.records = [base, again]
    assert drv.latest(base) is again and drv.latest({**base, "exp": "other"})["exp"] == "other"
    from judgement import record
    r = {**rec([391.0, 392.0, 390.0], 6.5), "knobs": {"engine.seed": 2}}
    d = record.compare(base, r, drv.floor(), before=drv.latest(base))
    assert d["output_tps"]["rel"] == pytest.approx(391 / 390 - 1) and "as last measured before it" in \
        d["output_tps"]["why"]
    assert d["knee_rps"]["why"].startswith("bracket 6–7")  # the knee still from the base's own search


def test_a_re_measure_is_restored_with_the_rung_it_checks_and_never_reused_for_another():
    import ladder
    held = {"measured": {"at": "2026-12-01T06:05:00Z"}}
    # a rung restored from the run-cache carries its old measured_at: the same key restores the re-measure taken
    # after it then; a rung measured again now (or a fallback, or the next rung) gets a new key: a fresh re-measure
    assert ladder.remeasure_key([held]) == ladder.remeasure_key([dict(held)]) == 1796105100
    assert ladder.remeasure_key([{"measured": {"at": "2026-12-01T07:00:00Z"}}]) != 1796105100


def test_only_the_last_rung_the_ladder_measures_stops_its_knee_search_at_a_gain(monkeypatch):
    # no later rung starts from its knee (and a confirm pair searches its stack again): its search stops where it
    # passed at the base's fail (ladder.knee_anchor's `last`); a rung this machine skips is not that rung
    import ladder

    def rung(name, change, when=None):
        return {"name": name, "set": change, "when": when, "fallback": None, "note": "", "candidates": None}

    class P:
        profile, overrides, objective, experiments, gpus = "cpu", {}, "knee_rps", 3, 1
        baseline = {"engine.seed": 0}
        rungs = [rung("a", {"engine.seed": 1}), rung("b", {"engine.seed": 2}),
                 rung("c", {"engine.tensor_parallel_size": 2}, {"min_gpus": 2})]
    drv = ladder.Driver.__new__(ladder.Driver)
    drv.plan, drv.records, drv.confirm, drv.t0, drv.warm_due = P, [], None, 0.0, True
    monkeypatch.setattr(drv, "save", lambda final=False: None)
    monkeypatch.setattr(drv, "progress", lambda label: None)
    monkeypatch.setattr(drv, "run_exp", lambda *a, **kw: {"status": "ok", "role": decide.BASELINE, "exp": "x"})
    seen = []
    monkeypatch.setattr(drv, "try_rung", lambda i, r, tries, kept, base, last=False: seen.append((i, last)))
    assert drv.run() == 0
    assert seen == [(1, False), (2, True)]
    assert ladder.knee_anchor({"knee": {"knee_rps": 7.0, "conclusive_fail_rps": 8.0}}, {}, last=True) == \
        {"pass": 7.0, "fail": 8.0, "last": True}
    # a knee floor asks better for a pass beyond the base's fail: the last rung searches on to its own bracket
    assert "last" not in ladder.knee_anchor({"knee": {"knee_rps": 7.0, "conclusive_fail_rps": 8.0}}, {}, floor=0.5,
                                            last=True)
    assert "last" not in ladder.knee_anchor({"knee": {"knee_rps": 7.0, "conclusive_fail_rps": 8.0}}, {}, bracket=True,
                                            last=True)
    # the base's looks that passed on a filled server without a backlog carry their latency to the rung's anchor
    # (run.anchor.latency, in the rung's units: twice the GPUs, twice the rate), the longest per rate
    rows = [{"offered_rps": 3.5, "e2e_p50_s": 1.1, "passed": True, "settled": True},
            {"offered_rps": 7.0, "e2e_p50_s": 2.0, "passed": True, "settled": True},
            {"offered_rps": 7.0, "e2e_p50_s": 2.4, "passed": True, "settled": True},
            {"offered_rps": 8.0, "e2e_p50_s": 5.0, "passed": False, "settled": False},
            {"offered_rps": 5.0, "e2e_p50_s": 3.0, "passed": True, "backlog": True},
            {"offered_rps": 6.0, "e2e_p50_s": 3.0, "passed": True, "settled": False}]
    base = {"knee": {"knee_rps": 7.0, "conclusive_fail_rps": 8.0, "rows": rows}}
    assert ladder.knee_anchor(base, {})["latency"] == [[3.5, 1.1], [7.0, 2.4]]
    assert ladder.knee_anchor(base, {"engine.tensor_parallel_size": 2})["latency"] == [[7.0, 1.1], [14.0, 2.4]]
    assert ladder.latencies((base, 1.0), ({"knee": {"rows": [{**rows[0], "e2e_p50_s": 1.5}]}}, 1.0)) == \
        [[3.5, 1.5], [7.0, 2.4]]
    # run.anchor as the stages read it (params.yaml): `last` is one of its keys
    import config
    params = config.read_params()
    params["run"]["anchor"] = {"pass": 7.0, "fail": 8.0, "last": True}
    assert config.validate(params)["run"]["anchor"]["last"] is True
    params["run"]["anchor"] = {"pass": 7.0, "fail": 8.0, "latency": [[7.0, 2.4]]}
    assert list(config.validate(params)["run"]["anchor"]["latency"][0]) == [7.0, 2.4]
    params["run"]["anchor"] = {"pass": 7.0, "fail": 8.0, "latency": [[7.0, -2.4]]}
    with pytest.raises(config.ParamsError, match=r"run\.anchor\.latency.*-2\.4"):
        config.validate(params)
    from runner import experiments
    assert experiments.hydra({"pass": 7.0, "latency": [[7.0, 2.4]]}) == "{pass:7.0,latency:[[7.0,2.4]]}"


def test_a_failed_stage_s_error_keeps_the_lines_that_name_the_field():
    from runner import experiments
    lines = ["Running stage 'fingerprint':", "error: params.yaml is not valid:",
             "  run.anchor.last: unknown key; allowed: pass, fail, worse, bracket",
             "ERROR: failed to reproduce 'fingerprint': failed to run: python scripts/fingerprint.py"]
    assert experiments.error_lines(lines) == ["params.yaml is not valid: run.anchor.last: unknown key; allowed: pass, "
                                              "fail, worse, bracket"]
    # a failed experiment's record says the stage's own error; else DVC's ERROR line; else the exit code
    run = experiments.Run(1, lines, 3.0, ROOT / "x.log")
    assert run.error == experiments.error_lines(lines)[0] and run.reused == []
    assert experiments.Run(1, lines[-1:], 3.0, ROOT / "x.log").error == lines[-1]
    assert experiments.Run(2, ["Stage 'eval' didn't change, skipping"], 3.0, ROOT / "x.log").error == \
        "dvc exp run exit code 2"


def test_only_another_machines_experiment_of_this_commit_with_these_params_is_replayed(tmp_path, monkeypatch):
    """elsewhere() on a real git + DVC repo: experiments pulled from another machine (`dvc exp pull`) are found by
    name through DVC, and replayed only where they are this commit's, another machine's and ran these params."""
    import json
    import os
    import subprocess
    import sys

    import yaml

    import common
    import ladder
    import plan as planning
    from runner import experiments

    def sh(*cmd):
        subprocess.run(cmd, cwd=tmp_path, check=True, capture_output=True, env={**os.environ, "DVC_NO_ANALYTICS": "1"})

    def experiment(name, seed, machine, warm=False):  # what `dvc exp run` leaves: its params, its fingerprint
        (tmp_path / "params.yaml").write_text(yaml.safe_dump({"engine": {"seed": seed},
                                                              "run": {"anchor": None, "warm_up": warm}}))
        (tmp_path / "results" / "fingerprint.json").write_text(json.dumps({"machine": {"id": machine}}))
        sh(sys.executable, "-m", "dvc", "exp", "save", "-q", "-f", "-n", name)

    (tmp_path / "results").mkdir()
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"engine": {"seed": 0}, "run": {"anchor": None}}))
    (tmp_path / "results" / "fingerprint.json").write_text("{}")
    sh("git", "init", "-q")
    sh("git", "config", "user.email", "t@example.com")
    sh("git", "config", "user.name", "t")
    sh(sys.executable, "-m", "dvc", "init", "-q")
    sh("git", "add", "-A")
    sh("git", "commit", "-qm", "one")
    experiment("cpu-0-old-commit", 1, "B")
    sh("git", "commit", "-qm", "two", "--allow-empty")
    experiment("cpu-1-b", 1, "B")
    experiment("cpu-2-here", 1, "A")
    experiment("cpu-0-here", 1, "A", warm=True)
    monkeypatch.setattr(common, "ROOT", tmp_path)
    monkeypatch.chdir(tmp_path)
    drv = ladder.Driver.__new__(ladder.Driver)
    drv.environment = {"machine": {"id": "A"}}
    drv.dvc = experiments.Experiments(planning.KNOB_SECTIONS, tmp_path / "logs")
    sets = {"engine.seed": 1, "run.anchor": None}
    assert drv.elsewhere("cpu-1-b", sets)  # another machine's, these params: replayed
    assert drv.elsewhere("cpu-1-b", {**sets, "run.warm_up": True})  # whether it warmed its own machine: no matter
    assert drv.elsewhere("cpu-1-b", {**sets, "engine.seed": 2}) is None  # other params: measured here
    assert drv.elsewhere("cpu-2-here", sets) is None  # this machine's own: the run-cache restores it
    assert drv.elsewhere("cpu-0-old-commit", sets) is None  # another commit's
    assert drv.elsewhere("cpu-3-never-run", sets) is None
    # a resumed ladder sets run.warm_up as this machine ran the experiment before, so the run-cache restores it as it
    # was measured (and the rungs after it stay restored); one not run here before gets the run's own due warm-up
    drv.warm_due = True
    assert drv.warm_up_of("cpu-2-here", sets) is False and drv.warm_up_of("cpu-0-here", sets) is True
    assert drv.warm_up_of("cpu-2-here", {**sets, "engine.seed": 2}) is True  # other params: not restored anyway
    assert drv.warm_up_of("cpu-1-b", sets) is True and drv.warm_up_of("cpu-3-never-run", sets) is True
    drv.warm_due = False
    assert drv.warm_up_of("cpu-0-here", sets) is True and drv.warm_up_of("cpu-3-never-run", sets) is False


def test_every_experiment_s_run_params_are_exactly_its_sets_whatever_the_one_before_set(tmp_path):
    """Each `dvc exp run` leaves its params in the workspace, and Hydra's `++` merges a dict into the one there: a
    re-check's run.anchor {look, side, after} once stayed under the next rung's {pass, fail}, and that rung looked
    once at the re-check's rate instead of searching. The args the driver builds, applied in sequence by DVC's own
    override code (what `dvc exp run -S` calls): search rung -> re-check base -> re-check rung -> next rung -> a
    bench-only re-measure -> a knob dict that shrinks."""
    import shutil
    from types import SimpleNamespace

    from dvc.utils.hydra import apply_overrides

    import ladder
    import plan as planning
    from runner import experiments
    ws = tmp_path / "params.yaml"
    shutil.copy(ROOT / "params.yaml", ws)
    drv = SimpleNamespace(overrides={"knee.max_probes": 3}, warm_due=True)
    knobs = {"model.name": "m", "engine.seed": 0}
    rope = {"rope_parameters": {"rope_type": "default", "rope_theta": 1.0}}
    seq = [
        ladder.Driver.sets_of(drv, {**knobs, "engine.seed": 1}, anchor={"pass": 2.0, "fail": 2.828, "worse": 1.5}),
        ladder.Driver.sets_of(drv, knobs, anchor={"look": 1.189, "side": "worse", "after": 1764892800}),
        ladder.Driver.sets_of(drv, {**knobs, "engine.seed": 1}, anchor={"look": 1.189, "after": 1764892800}),
        ladder.Driver.sets_of(drv, {**knobs, "engine.hf_overrides": rope}, anchor={"pass": 2.0, "fail": 2.828}),
        ladder.Driver.sets_of(drv, knobs, remeasure=1764892900),
        ladder.Driver.sets_of(drv, {**knobs, "engine.hf_overrides": {"rope_parameters": {"rope_theta": 2.0}}},
                              round_=1, anchor={"pass": 2.0, "bracket": True}),
    ]
    for sets in seq:
        cmd = experiments.exp_command("cpu-1-x", sets, yaml.safe_load(ws.read_text()), planning.KNOB_SECTIONS)
        assert cmd[:5] == ["dvc", "exp", "run", "-n", "cpu-1-x"] and cmd[-len(experiments.TARGETS):] == \
            experiments.TARGETS
        apply_overrides(str(ws), [a for i, a in enumerate(cmd) if i and cmd[i - 1] == "-S"])
        got = yaml.safe_load(ws.read_text())
        assert got["run"] == {k.split(".", 1)[1]: v for k, v in sets.items() if k.startswith("run.")}, sets
        for k, v in sets.items():
            section, key = k.split(".", 1)
            assert got[section][key] == v, k
        assert ("hf_overrides" in got["engine"]) == ("engine.hf_overrides" in sets)


def test_a_budget_stops_the_ladder_only_between_units_at_the_longest_unit_s_measured_cost(monkeypatch, tmp_path):
    """make ladder BUDGET_MIN=: checked before rung 0, each rung (its tries, its knee re-checks and its base's
    re-measure: measured back to back, never split) and each confirm pair; each unit taken to cost the longest of
    its kind this run, at what it cost when measured."""
    import ladder
    # an experiment's cost: its wall time plus the stages DVC restored, at what they cost when measured
    assert ladder.experiment_cost({"seconds": 200.0, "reused": ["eval"], "stage_seconds": {"eval": 40, "knee": 120}}) \
        == 240.0
    assert ladder.experiment_cost({"seconds": 0.0, "replayed": "other", "stage_seconds": {"knee": 99}}) == 0.0
    # a knee re-check's eval, gate and bench are its experiment's, restored whenever it runs: they cost it nothing;
    # its knee, restored (a resumed ladder), counts as measured (on an H200 a placebo's unit, 553 s, was taken at 774)
    recheck = {"role": decide.KNEE_RECHECK, "seconds": 148.0, "reused": ["eval_baseline", "eval", "gate", "bench"],
               "stage_seconds": {"eval": 0.0, "bench": 141.0, "knee": 127.0}}
    assert ladder.experiment_cost(recheck) == 148.0
    assert ladder.experiment_cost({**recheck, "seconds": 5.0, "reused": [*recheck["reused"], "knee"]}) == 132.0
    assert ladder.budget_stop(None, 1e9, 1e9, "rung 1") is None                 # no budget: never stops
    assert ladder.budget_stop(600.0, 10.0, None, "rung 0") is None               # nothing to estimate from: it starts
    assert ladder.budget_stop(600.0, 600.0, None, "rung 1").startswith("stopped before rung 1: 10.0 of BUDGET_MIN=10")
    assert ladder.budget_stop(1200.0, 960.0, 240.0, "rung 2") is None            # 960 + 240 fits in 1,200
    why = ladder.budget_stop(1200.0, 961.0, 240.0, "rung 2")
    assert why.startswith("stopped before rung 2: 16.0 of BUDGET_MIN=20 min spent, and rung 2 is taken to need 4.0")

    drv = ladder.Driver.__new__(ladder.Driver)
    drv.budget_s, drv.unit_costs = 1200.0, {"rung 0": [], "rung": [], "pair": []}
    rung0 = {"role": decide.BASELINE, "seconds": 600.0, "reused": [], "bench": {"warm_up_engine": {"wall_s": 30.0}},
             "knee": {"status": "inside"}}
    drv.records = [rung0]
    drv.__dict__["_earlier"] = {"x": None}  # no experiment of that name before this run
    drv.warm_due = False  # this run's first bench warmed the machine
    monkeypatch.setattr(ladder, "_STARTED", ladder.time.monotonic() - 610.0)  # ~610 s spent
    drv.unit_done("rung 0", [rung0])
    with pytest.raises(ladder.BudgetSpent, match="rung 1 x is taken to need 10.0"):  # rung 0's 600 s, errs long
        measure(drv, "rung", "rung 1 x")
    drv.unit_done("rung", [{"seconds": 20.0, "knee": {"status": "n/a"}}])  # a rung the gate failed: no estimate
    with pytest.raises(ladder.BudgetSpent, match="taken to need 10.0"):
        measure(drv, "rung", "rung 2 y")
    drv.unit_done("rung", [{"seconds": 150.0, "knee": {"status": "inside"}}, {"seconds": 60.0}])  # + re-measure
    measure(drv, "rung", "rung 2 y")  # 610 + 210 <= 1,200
    measure(drv, "pair", "confirm pair 1")  # no pair yet: the longest rung's 210 s
    drv.warm_due = True  # a resumed run's first bench pays a warm-up engine again: 30 s more
    monkeypatch.setattr(ladder, "_STARTED", ladder.time.monotonic() - 955.0)
    measure(drv, "rung", "rung 3 z")  # 955 + 210 + 30 fits
    monkeypatch.setattr(ladder, "_STARTED", ladder.time.monotonic() - 965.0)
    with pytest.raises(ladder.BudgetSpent, match="taken to need 4.0"):  # 210 + 30 s
        measure(drv, "rung", "rung 3 z")


def measure(drv, kind: str, what: str, exp: str = "x", sets: dict | None = None) -> None:
    """A unit of `kind` whose first experiment `exp` is measured: where it would not fit, the stop comes there."""
    drv.budget(kind, what)
    drv.measuring(exp, sets or {})


def test_a_unit_that_comes_back_from_the_run_cache_is_not_held_to_a_measured_unit_s_cost(monkeypatch):
    """A resumed ladder on a fresh lease (an H100, BUDGET_MIN=7) stopped before rung 1, which it had finished: rung 0
    came back from the run-cache costing its measured 6.5 min, and rung 1 was taken to need as much, though it too
    came back in seconds. The stop waits for the unit's first experiment that measures here: one this machine
    finished with these very sets comes back and passes; one with other sets, another machine's, or none stops; a
    unit that came back whole carries no stop to what runs after it."""
    import ladder
    drv = ladder.Driver.__new__(ladder.Driver)
    drv.budget_s, drv.unit_costs = 420.0, {"rung 0": [390.0], "rung": [], "pair": []}
    drv.records, drv.warm_due, drv.overrides = [], False, {}
    drv.__dict__["environment"] = {"machine": {"id": "machine-a"}}
    done = {"engine": {"seed": 1}, "run": {"round": 0, "anchor": {"pass": 16.0}, "warm_up": True}}
    drv.__dict__["_earlier"] = {"p-1-placebo": ("rev1", "machine-a", done), "p-1-placebo-base-again": None,
                                "p-2-awq": ("rev2", "machine-b", done)}
    sets = {"engine.seed": 1, "run.round": 0, "run.anchor": {"pass": 16.0}, "run.warm_up": False}
    monkeypatch.setattr(ladder, "_STARTED", ladder.time.monotonic() - 40.0)  # 40 s spent: 40 + 390 > 420
    drv.budget("rung", "rung 1 placebo")
    drv.measuring("p-1-placebo", sets)  # finished here with these sets (run.warm_up aside): comes back, no stop
    with pytest.raises(ladder.BudgetSpent, match="stopped before rung 1 placebo: 0.7 of BUDGET_MIN=7 min spent, "
                                                 "and rung 1 placebo is taken to need 6.5"):
        drv.measuring("p-1-placebo-base-again", {"engine.seed": 0})  # what the cut-off unit still has to measure
    with pytest.raises(ladder.BudgetSpent):  # other sets (another anchor): DVC measures it
        drv.measuring("p-1-placebo", {**sets, "run.anchor": {"pass": 19.03}})
    with pytest.raises(ladder.BudgetSpent):  # another machine's: not in this machine's run-cache
        drv.measuring("p-2-awq", sets)
    drv.unit_done("rung", [])  # the unit came back whole
    drv.measuring("p-2-awq", sets)
    drv.budget_s = None  # no budget: nothing is held
    drv.budget("rung", "rung 2 awq")
    drv.measuring("p-2-awq", sets)


def test_the_warm_up_engine_is_a_declared_param_of_the_bench_set_until_a_bench_of_this_run_warmed():
    # whether an untimed engine warms the machine first changes what the timed one reads: it is run.warm_up, a param
    # the bench stage declares (in the run-cache's key), never an environment variable the stage reads unseen
    import ladder
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    assert "run.warm_up" in stages["bench"]["params"] and "run" not in stages["bench"]["params"]
    assert not {"run", "run.warm_up"} & set(stages["knee"]["params"])  # the knee's server warms itself
    assert not [p for p in (ROOT / "scripts").rglob("*.py") if "LADDER_WARM_MARK" in p.read_text()]
    drv = ladder.Driver.__new__(ladder.Driver)
    drv.overrides, drv.warm_due = {}, True
    assert drv.sets_of({"engine.seed": 0})["run.warm_up"] is True
    warm = {"warm_up_engine": {"output_tps": 90.0, "wall_s": 30.0}}
    assert not ladder.warmed_here({"reused": ["bench"], "bench": warm})  # restored: it warmed nothing in this run
    assert not ladder.warmed_here({"reused": [], "bench": {"warm_up_engine": None}})  # ran, no engine (gate failed)
    assert ladder.warmed_here({"reused": ["eval"], "bench": warm})


@pytest.mark.parametrize("bad", ["0", "-5", "ten", "nan", "inf"])
def test_a_bad_budget_is_refused_by_name_before_anything_runs(bad):
    import subprocess
    import sys
    p = subprocess.run([sys.executable, "scripts/ladder.py", "--profile", "cpu", "--budget-min", bad], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and f"BUDGET_MIN (--budget-min) must be a number of minutes above 0, got '{bad}'" \
        in p.stderr, p.stderr[-2000:]
    assert "pre-flight" not in p.stdout
