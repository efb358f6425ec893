"""The capacity plan and the per-GPU figures (capacity.py), on fixture numbers; the report prints what was recorded.
Pure logic, no engine."""
import copy
import json

import pytest

import report
from conftest import FIXTURES, ROOT
from judgement import capacity, decide, record

SETTINGS = {"peak_rps": 200, "headroom": 0.2}


def rung(index, name, knee, first_fail, tps_at_knee=None, knobs=None, runs=(400.0, 402.0, 398.0), status="ok"):
    return {"index": index, "name": name, "exp": f"gpu-{index}-{name}", "status": status,
            "role": "baseline" if index == 0 else "rung", "knobs": knobs or {"engine.tensor_parallel_size": 1},
            "bench": {"output_tps": sorted(runs)[1], "output_tps_runs": list(runs)},
            "knee": {"knee_rps": knee, "first_fail_rps": first_fail, "status": "inside" if first_fail else "above",
                     "output_tps_at_knee": tps_at_knee}}


def test_gpus_per_instance_multiplies_the_parallel_sizes():
    assert capacity.gpus_per_instance({}) == 1
    assert capacity.gpus_per_instance({"engine.tensor_parallel_size": 2}) == 2
    assert capacity.gpus_per_instance({"engine.data_parallel_size": 2, "engine.tensor_parallel_size": 2}) == 4
    assert capacity.gpus_per_instance({"engine.tensor_parallel_size": None}) == 1


@pytest.mark.parametrize("peak, knee, headroom, want", [
    (200, 40, 0.2, 7),    # 6.25 -> 7: a fraction of an instance is an instance
    (200, 40, 0.0, 5),    # exactly 5: not 6 from float noise
    (32, 40, 0.2, 1),     # exactly at 80 % of one knee
    (24, 10, 0.2, 3),     # 3.0 with 1 - 0.2 in floating point
    (200, 24, 0.2, 11),   # 10.4 -> 11
    (1, 40, 0.5, 1),
])
def test_instances_round_up_after_headroom(peak, knee, headroom, want):
    assert capacity.instances_needed(peak, knee, headroom) == want


def test_headroom_costs_instances():
    assert [capacity.instances_needed(100, 10, h) for h in (0, 0.2, 0.5)] == [10, 13, 20]


def test_a_missing_knee_is_no_plan_not_a_number():
    assert capacity.instances_needed(200, None, 0.2) is None
    p = capacity.knee_plan(rung(0, "baseline", None, 1.0), 200, 0.2, 3.5, on_gpu=True)
    assert p["plan"] == capacity.NO_PLAN and "no knee" in p["why"]
    assert "instances" not in p and "gpus" not in p and "usd_per_m_output_tokens" not in p
    plan = capacity.plan([rung(0, "baseline", None, 1.0), rung(5, "last", 40.0, 48.0, 8000.0)], "gpu-5-last",
                         SETTINGS, 3.5, on_gpu=True)
    assert plan["saved"]["plan"] == capacity.NO_PLAN and "before (0 baseline)" in plan["saved"]["why"]
    assert "saved" not in plan["saved"]
    assert plan["after"]["instances"] == 7  # the side that has a knee still gets its plan


def test_every_figure_carries_its_knee_and_bracket():
    p = capacity.knee_plan(rung(0, "baseline", 24.0, 28.0, 4800.0), 200, 0.2, 3.5, on_gpu=True)
    assert p["knee"] == {"rung": "0 baseline", "exp": "gpu-0-baseline", "knee_rps": 24.0, "first_fail_rps": 28.0,
                         "status": "inside"}
    assert p["instances"] == 11 and p["instances_range"] == [9, 11]   # 200/(28*0.8)=8.9 -> 9; 200/(24*0.8) -> 11
    assert p["gpus"] == 11 and p["gpus_range"] == [9, 11]
    usd = 3.5 / (4800.0 * 3600) * 1e6
    assert p["usd_per_m_output_tokens"] == pytest.approx(usd, abs=1e-4)
    lo, hi = p["usd_per_m_output_tokens_range"]
    assert lo == pytest.approx(usd * 24 / 28, abs=1e-4) and hi == pytest.approx(usd, abs=1e-4)
    # the SLO held at the top of the probed range: the planned count is an upper bound, no lower one is known
    top = capacity.knee_plan(rung(0, "baseline", 64.0, None, 9000.0), 200, 0.2, 3.5, on_gpu=True)
    assert top["instances"] == 4 and top["instances_range"] == [None, 4]


def test_gpus_count_per_instance_and_cost_scales_with_them():
    one = capacity.knee_plan(rung(5, "tp1", 40.0, 48.0, 8000.0), 200, 0.2, 3.5, on_gpu=True)
    two = capacity.knee_plan(rung(6, "tp2", 60.0, 72.0, 12000.0, {"engine.tensor_parallel_size": 2}),
                             200, 0.2, 3.5, on_gpu=True)
    assert (one["instances"], one["gpus"]) == (7, 7)
    assert (two["instances"], two["gpus_per_instance"], two["gpus"]) == (5, 2, 10)  # fewer instances, more GPUs
    assert two["usd_per_m_output_tokens"] == pytest.approx(2 * 3.5 / (12000 * 3600) * 1e6, abs=1e-4)


def test_price_zero_and_cpu_give_instances_and_no_cost():
    p = capacity.knee_plan(rung(0, "baseline", 6.0, 7.0, 330.0), 20, 0.2, 0.0, on_gpu=False)
    assert p["instances"] == 5 and p["instances_range"] == [4, 5]
    assert p["gpus"] is None and p["gpus_per_instance"] is None and p["usd_per_m_output_tokens"] is None
    assert "no price" in p["why_no_cost"]


def test_tune_vs_scale_counts_the_gpus_the_ladder_saved_with_the_bracket_range():
    rungs = [rung(0, "baseline", 24.0, 28.0, 4900.0), rung(5, "batched-tokens", 40.0, 48.0, 8300.0)]
    plan = capacity.plan(rungs, "gpu-5-batched-tokens", SETTINGS, 3.5, on_gpu=True)
    assert plan["before"]["gpus"] == 11 and plan["after"]["gpus"] == 7
    # worst case: before at its bracket's low end (9) minus after at its planned count (7); best: 11 - 6
    assert plan["saved"] == {"plan": "ok", "unit": "gpus", "saved": 4, "saved_range": [2, 5]}


def test_per_gpu_figures_sit_beside_the_totals():
    lad = {"environment": {"device": "gpu"}, "settings": {"cost": {"gpu_price_per_hour": 3.5}},
           "final_exp": "gpu-6-dp2",
           "rungs": [rung(0, "baseline", 40.0, 48.0, 8000.0, runs=(16000.0, 16100.0, 15900.0)),
                     rung(6, "dp2", 80.0, 96.0, 16000.0, {"engine.data_parallel_size": 2},
                          runs=(32000.0, 32200.0, 31800.0))]}
    capacity.annotate(lad, SETTINGS)
    base, dp = lad["rungs"]
    assert base["gpus"] == 1 and base["per_gpu"] == {"output_tps": 16000.0, "knee_rps": 40.0, "first_fail_rps": 48.0}
    assert dp["gpus"] == 2 and dp["per_gpu"] == {"output_tps": 16000.0, "knee_rps": 40.0, "first_fail_rps": 48.0}
    # same knee per GPU, but 2-GPU instances round up in steps of 2 GPUs: 4 x 2 = 8 GPUs, vs 7 single ones
    assert lad["capacity"]["after"]["gpus_per_instance"] == 2 and lad["capacity"]["after"]["gpus"] == 8
    assert lad["capacity"]["before"]["gpus"] == 7 and lad["capacity"]["saved"]["saved"] == -1
    cpu = copy.deepcopy(lad)
    cpu["environment"]["device"] = "cpu"
    capacity.annotate(cpu, SETTINGS)
    assert cpu["rungs"][1]["gpus"] is None and cpu["rungs"][1]["per_gpu"] is None
    assert cpu["capacity"]["unit"].startswith("instance") and cpu["capacity"]["saved"]["unit"] == "instances"


def test_two_gpus_are_judged_per_gpu_against_one():
    base = rung(5, "base", 40.0, 48.0, runs=(16000.0, 16100.0, 15900.0))
    # data parallel: twice the knee on twice the GPUs is no gain per GPU; the simpler 1-GPU instance stays
    dp = rung(6, "dp2", 80.0, 96.0, knobs={"engine.data_parallel_size": 2})
    dp["bench"] = {"status": "n/a", "reason": "offline engine", "output_tps": None, "output_tps_runs": []}
    dp.update(delta=record.compare(base, dp), gate={"gated": False, "keep": True}, applied=[])
    keep, why = decide.decide(dp, base, "knee_rps")
    assert keep is False and "per GPU, 2 vs 1 GPUs per instance" in why and "no measurable gain" in why
    # tensor parallel: a higher total knee that is lower per GPU is worse
    tp = rung(6, "tp2", 64.0, 72.0, knobs={"engine.tensor_parallel_size": 2}, runs=(24000.0, 24100.0, 23900.0))
    tp.update(delta=record.compare(base, tp), gate={"gated": False, "keep": True}, applied=[])
    keep, why = decide.decide(tp, base, "knee_rps")
    assert keep is False and "knee -20.0 % (worse, per GPU, 2 vs 1 GPUs per instance; bracket 40–48 → 32–36" in why
    # same GPUs per instance: totals, as before
    same = rung(6, "x", 48.0, 56.0)
    assert "per GPU" not in record.compare(base, same)["knee_rps"]["why"]


def test_the_report_prints_the_recorded_plan_and_says_so_when_there_is_none(tmp_path):
    lad = json.loads((FIXTURES / "ladder_cpu.json").read_text())
    assert "No capacity plan in this record." in report.render(lad, tmp_path)
    lad["environment"]["device"] = "cpu"
    capacity.annotate(lad, {"peak_rps": 20, "headroom": 0.2})
    md = report.render(lad, tmp_path)
    section = md[md.index("## Capacity plan"):md.index("## Plots")]
    cap = lad["capacity"]
    assert f"{cap['before']['instances']} (bracket" in section and "n/a (CPU instances)" in section
    assert "no price" in section and "**Tune vs scale**" in section
    assert f"0 baseline ({lad['rungs'][0]['exp']}): knee" in section


def test_the_older_ladders_hold_a_capacity_plan_from_their_recorded_knees():
    for name, unit in (("ladder_h200x2_c536b45", "gpus"), ("ladder_cpu_7ce1c08", "instances")):
        lad = json.loads((ROOT / "tests" / "fixtures" / f"{name}.json").read_text())
        cap = lad["capacity"]
        assert cap["saved"]["unit"] == unit
        again = capacity.plan(lad["rungs"], lad["final_exp"], lad["settings"]["capacity"],
                              lad["settings"]["cost"]["gpu_price_per_hour"], unit == "gpus")
        assert again["saved"] == cap["saved"] and again["after"] == cap["after"]


def test_fill_capacity_plans_a_copy_of_an_older_record_from_its_knees_and_says_so(tmp_path):
    import subprocess
    import sys
    lad = json.loads((ROOT / "tests" / "fixtures" / "ladder_cpu_7ce1c08.json").read_text())
    lad.pop("capacity")
    older, filled = tmp_path / "ladder.json", tmp_path / "filled.json"
    older.write_text(json.dumps(lad))
    before = older.read_text()
    p = subprocess.run([sys.executable, "scripts/fill_capacity.py", str(older), str(filled), "--peak-rps", "40"],
                       cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    cap = json.loads(filled.read_text())["capacity"]
    assert "added after the run" in cap["added"] and cap["before"]["knee"]["exp"] == "cpu-0-baseline"
    assert json.loads(filled.read_text())["settings"]["capacity"]["peak_rps"] == 40
    assert older.read_text() == before  # the record it read is left as it was


def test_fill_capacity_never_writes_over_its_input_or_a_file_dvc_declares(tmp_path):
    # report/ladder.json is the report stage's declared input: rewritten outside DVC, `dvc status` would call the
    # report stale for a change no stage made (issue 52: no side doors)
    import fill_capacity
    older = tmp_path / "ladder.json"
    assert "is LADDER_JSON itself" in fill_capacity.out_problem(older, older)
    for declared in ("report/ladder.json", "results/models.json", "results/bench.json", "report/before_after.md"):
        why = fill_capacity.out_problem(older, ROOT / declared)
        assert why and why.startswith(f"OUT_JSON: {ROOT / declared} is a file dvc.yaml declares"), declared
    assert fill_capacity.out_problem(older, tmp_path / "filled.json") is None


def test_capacity_settings_are_validated_naming_the_field():
    import config
    params = config.read_params(ROOT / "params.yaml")
    params["capacity"] = {"peak_rps": 0, "headroom": 1}
    with pytest.raises(config.ParamsError) as e:
        config.validate(params)
    assert "capacity.peak_rps: 0 is not allowed; expected a request rate > 0" in str(e.value)
    assert "capacity.headroom: 1 is not allowed; expected a fraction in [0, 1)" in str(e.value)
    params["capacity"] = {"peak_rps": 50}
    assert config.validate(params)["capacity"] == {"peak_rps": 50, "headroom": 0.2}
