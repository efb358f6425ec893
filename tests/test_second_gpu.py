"""Rung 6 "second-gpu": alternative candidates (TP=2 vs DP=2) planned and checked, skipped with its reason on a
smaller machine, refused when the installed vLLM lacks the engine arg; the offline stages say n/a for data
parallelism. Pure logic, no engine."""
import copy
import json
import shutil
import subprocess
import sys

import pytest
import yaml

import common
import gate
import ladder
import plan as planning
import report
from conftest import FIXTURES, ROOT
from judgement import capacity, decide
from records.eval import EvalResult
from records.ladder import LadderRecord
from serving import vllm_compat

PARAMS = common.read_params(ROOT / "params.yaml")
LADDER = planning.load_ladder(ROOT / "ladder.yaml")
TP2, DP2 = {"engine.tensor_parallel_size": 2}, {"engine.data_parallel_size": 2}


def second_gpu(profile):
    return next(r for r in planning.plan(planning.effective_params(PARAMS, LADDER, profile, PARAMS), LADDER, profile)
                if r["name"] == "second-gpu")


def test_the_gpu_profiles_carry_the_rung_with_tp_and_dp_candidates_for_two_gpus():
    for profile in ("gpu", "gpu-shape"):
        rung = second_gpu(profile)
        assert planning.rung_changes(rung) == [TP2, DP2] and rung["when"] == {"min_gpus": 2}
        assert [planning.candidate_label(rung, c) for c in planning.rung_changes(rung)] == [
            "second-gpu-tensor-parallel-size-2", "second-gpu-data-parallel-size-2"]
    cpu = planning.plan(planning.effective_params(PARAMS, LADDER, "cpu", PARAMS), LADDER, "cpu")
    assert "second-gpu" not in [r["name"] for r in cpu]


def plan_error(*rungs) -> str:
    lad = copy.deepcopy(LADDER)
    lad["profiles"]["cpu"]["rungs"] = list(rungs)
    with pytest.raises(common.ParamsError) as e:
        planning.plan(planning.effective_params(PARAMS, lad, "cpu", PARAMS), lad, "cpu")
    return str(e.value)


def test_alternative_candidates_are_checked_each_as_one_change():
    msg = plan_error({"name": "par", "candidates": [TP2, {"engine.data_parallel_size": 2, "engine.seed": 3}]})
    assert "cpu rung 1 'par' candidate 2: changes 2 knobs (engine.data_parallel_size, engine.seed)" in msg
    msg = plan_error({"name": "par", "candidates": [TP2, {"engine.data_parallel_size": [2, 4]}]})
    assert "'par' candidate 2: one value per knob" in msg
    msg = plan_error({"name": "par", "candidates": [TP2]})
    assert "'par': `candidates` must list at least 2 alternative changes" in msg
    msg = plan_error({"name": "par", "candidates": [TP2, dict(TP2)]})
    assert "'par': two candidates are the same change" in msg
    msg = plan_error({"name": "par", "set": TP2, "candidates": [TP2, DP2]})
    assert "'par': give exactly one of `set`" in msg
    msg = plan_error({"name": "par", "candidates": [{"engine.tensor_parallel_size": 1}, DP2]})
    assert "'par' candidate 1: engine.tensor_parallel_size is already 1 in force" in msg


def test_each_candidate_goes_through_the_installed_vllms_own_parser():
    """Both candidates of rung 6 are engine args of the installed vLLM; a mistyped candidate is refused with
    vLLM's own message, naming the rung, before anything runs."""
    p = planning.resolve(PARAMS, LADDER, "gpu-shape", PARAMS, gpus=2)
    assert planning.engine_arg_errors(p) == []
    bad = copy.deepcopy(LADDER)
    rung = next(r for r in bad["profiles"]["gpu-shape"]["rungs"] if r["name"] == "second-gpu")
    rung["candidates"] = [TP2, {"engine.data_parallel_size": "two"}]
    errors = planning.engine_arg_errors(planning.resolve(PARAMS, bad, "gpu-shape", PARAMS, gpus=2))
    assert len(errors) == 1 and "'second-gpu': engine.data_parallel_size: 'two' is refused by" in errors[0], errors
    assert "invalid int value: 'two'" in errors[0]


class BaselineOnly(ladder.Driver):
    """The driver's own logic with rung 0 taken from a finished record: every other rung must be skipped."""
    def run_exp(self, index, name, cfg_flat, role, change, base, note=""):
        assert index == 0, f"rung {name} would have run on a 1-GPU machine"
        rec = {"index": 0, "name": name, "exp": "gpu-0-baseline", "role": role, "change": {}, "knobs": cfg_flat,
               "status": "ok", "bench": {"output_tps": 100.0, "output_tps_runs": [100.0, 101.0, 99.0]},
               "knee": {"knee_rps": 4.0, "first_fail_rps": 5.0, "status": "inside", "output_tps_at_knee": 900.0}}
        self.records.append(rec)
        return rec


def test_a_one_gpu_machine_skips_each_candidate_with_its_reason_not_a_failure(tmp_path):
    p = planning.resolve(PARAMS, LADDER, "gpu", PARAMS, gpus=1)
    p.rungs = [r for r in p.rungs if r["name"] == "second-gpu"]
    drv = BaselineOnly(p, out=tmp_path / "ladder.json")
    assert drv.run() == 0
    skipped = drv.records[1:]
    assert [r["name"] for r in skipped] == ["second-gpu-tensor-parallel-size-2", "second-gpu-data-parallel-size-2"]
    for r, change in zip(skipped, (TP2, DP2)):
        assert r["status"] == r["verdict"] == decide.SKIPPED and r["change"] == change
        assert r["decision"] == "skipped: needs 2 GPUs, this machine has 1"
        assert r["knobs"][next(iter(change))] == 2  # the row says what the candidate would have run
    saved = common.read_json(tmp_path / "ladder.json")
    assert saved["capacity"]["before"]["knee"]["rung"] == "0 baseline"
    assert saved["final_exp"] == "gpu-0-baseline"
    # the driver saves through the ladder record's model: today's schema, the rungs' keys as the driver set them
    assert saved["schema_version"] == LadderRecord.SCHEMA
    assert [sorted(r) for r in saved["rungs"]] == [sorted(r) for r in drv.records]
    assert LadderRecord.load_file(tmp_path / "ladder.json").rungs[1].verdict == decide.SKIPPED


def test_offline_stages_say_n_a_for_data_parallelism_and_the_gate_does_not_gate_it():
    why = vllm_compat.offline_unsupported({"data_parallel_size": 2, "tensor_parallel_size": 1})
    assert why.startswith("data_parallel_size 2: vLLM's offline engine") and "knee stage" in why
    assert vllm_compat.offline_unsupported({"data_parallel_size": 1}) is None
    assert vllm_compat.offline_unsupported({"tensor_parallel_size": 2}) is None
    g = gate.evaluate(EvalResult(status="ok", n=0), EvalResult(status="n/a", reason=why, n=0), None, None,
                      {"max_overall_drop": 0.1, "max_category_drop": 0.25, "alpha": 0.05, "min_items": 5})
    assert g["keep"] and not g["gated"] and g["reasons"] == [f"not gated: {why}"]


def test_the_report_shows_a_data_parallel_rung_with_no_bench_as_n_a_and_its_gpus(tmp_path):
    lad = json.loads((FIXTURES / "ladder_gpu_shape.json").read_text())
    base = lad["rungs"][0]
    why = vllm_compat.offline_unsupported({"data_parallel_size": 2})
    dp = {**copy.deepcopy(base), "index": 6, "name": "second-gpu-data-parallel-size-2", "role": "candidate",
          "exp": "gpu-shape-6-dp", "change": DP2, "knobs": {**base["knobs"], **DP2}, "kept": True, "verdict": "kept",
          "decision": "kept", "bench": {"status": "n/a", "reason": why, "label": "offline engine cannot run it",
                                      "output_tps": None, "output_tps_runs": []}}
    dp["knee"] = {**base["knee"], "knee_rps": 2 * base["knee"]["knee_rps"]}
    lad["rungs"] = [base, dp]
    lad["final_exp"] = "gpu-shape-6-dp"
    capacity.annotate(lad, {"peak_rps": 200, "headroom": 0.2})
    md = report.render(lad, tmp_path)
    row = next(ln for ln in md.splitlines() if ln.startswith("| 6 second-gpu-data-parallel-size-2"))
    cells = [c.strip() for c in row.split("|")]
    assert "n/a (offline engine cannot run it)" in cells and "2" in cells
    assert f"— tok/s · knee {base['knee']['knee_rps']:g}–" in row  # per GPU: the same knee as one GPU
    assert f"bench and eval: n/a — {why}" in md
    assert "→ n/a (offline engine cannot run it)" in md.split("\n")[2]
    assert lad["capacity"]["after"]["gpus_per_instance"] == 2


def test_bench_and_eval_stages_record_n_a_for_data_parallelism_and_start_nothing(tmp_path):
    for d in ("scripts", "evals"):
        shutil.copytree(ROOT / d, tmp_path / d)
    params = copy.deepcopy(PARAMS)
    params["engine"]["data_parallel_size"] = 2
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    why = vllm_compat.offline_unsupported(params["engine"])
    for script, out in (("bench.py", "bench.json"), ("eval.py", "eval.json")):
        p = subprocess.run([sys.executable, str(tmp_path / "scripts" / script)], cwd=tmp_path, capture_output=True,
                           text=True, timeout=120)
        assert p.returncode == 0, p.stderr
        res = common.read_json(tmp_path / "results" / out)
        assert res["status"] == "n/a" and res["reason"] == why and f"n/a — {why}" in p.stdout
    assert common.read_json(tmp_path / "results" / "bench.json")["output_tps_runs"] == []
    assert not (tmp_path / "results" / "models.json").exists()  # no model was needed: nothing started
