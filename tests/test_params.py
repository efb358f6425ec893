"""params.yaml and ladder.yaml validation: bad input is refused before any engine starts, naming the field,
the value and what is allowed. Pure logic, no engine."""
import copy
import subprocess
import sys

import pytest
import yaml

import common
import config
import plan as planning
from conftest import ROOT
from runner import experiments
from serving import engine

PARAMS = common.read_params(ROOT / "params.yaml")
LADDER = planning.load_ladder(ROOT / "ladder.yaml")


def eff(profile="cpu"):
    return planning.effective_params(PARAMS, LADDER, profile, PARAMS)


def errors_of(params) -> str:
    with pytest.raises(common.ParamsError) as e:
        common.validate(params)
    return str(e.value)


def test_the_shipped_params_and_every_profile_are_valid():
    for profile in LADDER["profiles"]:
        p = eff(profile)
        common.validate(p)
        assert planning.plan(p, LADDER, profile)


@pytest.mark.parametrize("mutate, expected", [
    (lambda p: p["engine"].update(**{"Max-Seqs": 4}), "engine.Max-Seqs: unknown knob; engine knobs are vLLM engine"),
    (lambda p: p["model"].update(name="llama-70b"),
     "model.name: 'llama-70b' is not a model the download stage provides"),
    (lambda p: p["slo"].update(ttft_ms=0),
     "slo.ttft_ms: 0 is not allowed; expected a number of milliseconds > 0"),
    (lambda p: p["slo"].update(tpot_ms=-5), "slo.tpot_ms: -5 is not allowed"),
    (lambda p: p["slo"].update(percentile=50), "slo.percentile: 50 is not allowed; expected 90, 95 or 99"),
    (lambda p: p["env"].update(HF_TOKEN="x"), "env.HF_TOKEN: unknown knob"),
    (lambda p: p["env"].update(VLLM_API_TOKEN="x"), "env.VLLM_API_TOKEN: secrets do not belong in params.yaml"),
    (lambda p: p["knee"].update(rates=[4, 2], mode="sweep"),
     "knee.rates: [4, 2] is not allowed; expected an increasing list"),
    (lambda p: p["bench"].update(repeats=0), "bench.repeats: 0 is not allowed; expected an integer > 0"),
    (lambda p: p["bench"].update(busy_share=1.5), "bench.busy_share: 1.5 is not allowed; expected a number in (0, 1]"),
    (lambda p: p["download"].update(fetch=["nope"]), "download.fetch: 'nope' is not in download.catalog"),
])
def test_bad_params_name_field_value_and_what_is_allowed(mutate, expected):
    p = copy.deepcopy(PARAMS)
    mutate(p)
    assert expected in errors_of(p)


def rungs(*rs, groups=None):
    lad = copy.deepcopy(LADDER)
    lad["profiles"]["cpu"]["rungs"] = list(rs)
    if groups is not None:
        lad["groups"] = groups
    return config.Ladder.model_validate(lad).model_dump(by_alias=True)  # as load_ladder gives it


def plan_error(lad) -> str:
    with pytest.raises(common.ParamsError) as e:
        planning.plan(eff(), lad, "cpu")
    return str(e.value)


def test_a_two_knob_rung_is_refused_naming_rung_and_knobs():
    msg = plan_error(rungs({"name": "two",
                            "set": {"engine.kv_cache_dtype": "fp8", "engine.enable_prefix_caching": True}}))
    assert "cpu rung 1 'two': changes 2 knobs (engine.kv_cache_dtype, engine.enable_prefix_caching)" in msg
    assert "nothing was run" in msg


def test_a_declared_group_counts_as_one_change():
    lad = rungs({"name": "mem", "set": {"env.VLLM_CPU_KVCACHE_SPACE": 2, "engine.max_num_seqs": 64}})
    assert [r["name"] for r in planning.plan(eff(), lad, "cpu")] == ["mem"]


def test_an_unknown_section_in_a_rung_is_refused_naming_rung_and_knob():
    msg = plan_error(rungs({"name": "magic", "set": {"turbo.mode": True}}))
    assert "cpu rung 1 'magic': turbo.mode: unknown knob" in msg


def test_a_no_op_rung_is_refused():
    msg = plan_error(rungs({"name": "same", "set": {"engine.kv_cache_dtype": "auto"}}))
    assert "'same': engine.kv_cache_dtype is already 'auto' in force: a no-op rung changes nothing" in msg
    # a rung repeating an earlier rung's change is a no-op too (composed as if the earlier one was kept)
    msg = plan_error(rungs({"name": "fp8", "set": {"engine.kv_cache_dtype": "fp8"}},
                           {"name": "fp8-again", "set": {"engine.kv_cache_dtype": "fp8"}}))
    assert "cpu rung 2 'fp8-again': engine.kv_cache_dtype is already 'fp8'" in msg


def test_a_rung_naming_a_model_the_download_stage_does_not_provide_is_refused():
    msg = plan_error(rungs({"name": "big", "set": {"model.name": "qwen2.5-7b-instruct"}}))
    assert "'big': model.name: 'qwen2.5-7b-instruct' is not a model the download stage provides" in msg


def test_candidates_expand_one_knob_and_fallbacks_are_checked():
    assert planning.candidates({"engine.max_num_batched_tokens": [1024, 2048]}) == [
        {"engine.max_num_batched_tokens": 1024}, {"engine.max_num_batched_tokens": 2048}]
    msg = plan_error(rungs({"name": "kv", "set": {"engine.kv_cache_dtype": "fp8"},
                            "fallback": {"engine.kv_cache_dtype": "auto"}}))
    assert "'kv' fallback: engine.kv_cache_dtype is already 'auto' in force" in msg


def test_switching_profiles_resets_keys_of_other_profiles_to_the_committed_defaults():
    gpu = planning.profile_overrides(LADDER, "gpu", PARAMS)
    assert gpu["baseline.model.name"] == "qwen2.5-7b-instruct" and gpu["bench.num_prompts"] == 1024
    cpu = planning.profile_overrides(LADDER, "cpu", PARAMS)
    assert cpu["baseline.model.name"] == "smollm2-135m" and cpu["bench.num_prompts"] == PARAMS["bench"]["num_prompts"]
    assert set(cpu) == set(gpu) | set(planning.profile_overrides(LADDER, "gpu-shape", PARAMS))
    with pytest.raises(common.ParamsError, match="profile: 'tpu' is not defined"):
        planning.profile_overrides(LADDER, "tpu", PARAMS)


def test_baseline_pins_prefix_caching_off():
    for profile in LADDER["profiles"]:
        assert eff(profile)["baseline"]["engine"]["enable_prefix_caching"] is False


def test_hydra_values_survive_dvc_exp_run_set():
    assert experiments.hydra("fp8") == "'fp8'"
    assert experiments.hydra(True) == "true" and experiments.hydra(None) == "null"
    assert experiments.hydra(0.94) == "0.94"
    assert experiments.hydra(["a-1", "b.2"]) == "['a-1','b.2']"
    assert experiments.hydra({"rope_theta": 1.0}) == "{rope_theta:1.0}"
    assert experiments.hydra("it's") == "'it\\'s'"


def test_dvc_output_tells_which_stages_were_not_measured_again():
    lines = ["Stage 'download' didn't change, skipping", "Stage 'eval' is cached - skipping run, checking out outputs",
             "Restored stage 'bench' from run-cache", "Running stage 'knee':"]
    assert experiments.reused_stages(lines) == ["download", "eval", "bench"]


def test_engine_knobs_become_vllm_flags():
    flags = engine.cli_flags({"max_num_seqs": 16, "enable_prefix_caching": False, "enforce_eager": True,
                              "max_num_batched_tokens": None, "hf_overrides": {"a": 1}})
    assert flags == ["--max-num-seqs", "16", "--no-enable-prefix-caching", "--enforce-eager",
                     "--hf-overrides", '{"a": 1}']


def test_ladder_check_cli_refuses_a_bad_ladder_before_starting_anything(tmp_path):
    bad = copy.deepcopy(LADDER)
    bad["profiles"]["cpu"]["rungs"] = [{"name": "two", "set": {"engine.kv_cache_dtype": "fp8", "engine.seed": 1}}]
    path = tmp_path / "ladder.yaml"
    path.write_text(yaml.safe_dump(bad))
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "ladder.py"), "--profile", "cpu", "--check",
                        "--ladder", str(path)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert "cpu rung 1 'two': changes 2 knobs (engine.kv_cache_dtype, engine.seed)" in p.stderr


def test_the_plan_counts_the_experiments_it_will_run():
    lad = rungs({"name": "kv", "set": {"engine.kv_cache_dtype": "fp8"}},
                {"name": "bt", "set": {"engine.max_num_batched_tokens": [1024, 2048]}},
                {"name": "tp", "set": {"engine.tensor_parallel_size": 2}, "when": {"min_gpus": 2}})
    assert planning.resolve(PARAMS, lad, "cpu", PARAMS, gpus=0).experiments == 1 + 1 + 2
    assert planning.resolve(PARAMS, lad, "cpu", PARAMS, gpus=2).experiments == 1 + 1 + 2 + 1


def test_a_bench_too_small_for_the_ladders_largest_max_num_seqs_is_refused():
    p = copy.deepcopy(PARAMS)
    p["bench"]["num_prompts"] = 32
    rungs = [{"name": "spend-memory", "set": {"engine.max_num_seqs": 64}},
             {"name": "batched", "candidates": [{"engine.max_num_batched_tokens": 1024}]}]
    msg = planning.wave_error(p, rungs)
    assert msg.startswith("bench.num_prompts: 32 is below 4 × the largest engine.max_num_seqs this ladder tries "
                          "(64, rung 1 'spend-memory') = 256")
    p["bench"]["num_prompts"] = 256
    assert planning.wave_error(p, rungs) is None
    assert planning.wave_error({**p, "bench": {"num_prompts": 64}}, []) is None  # rung 0's 16: 64 is enough
