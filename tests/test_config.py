"""config.py: the typed params.yaml and ladder.yaml. Unknown keys are refused by name, each default is filled
from the one place that states it, and pydantic's own text never reaches the user. Pure logic, no engine."""
import copy

import pytest
import yaml

import common
import config
import plan as planning
from conftest import ROOT

RAW = config.read_params(ROOT / "params.yaml")
RAW_LADDER = yaml.safe_load((ROOT / "ladder.yaml").read_text())


def errors_of(params) -> str:
    with pytest.raises(common.ParamsError) as e:
        config.validate(params)
    return str(e.value)


def ladder_error(tmp_path, mutate) -> str:
    lad = copy.deepcopy(RAW_LADDER)
    mutate(lad)
    path = tmp_path / "ladder.yaml"
    path.write_text(yaml.safe_dump(lad))
    with pytest.raises(common.ParamsError) as e:
        config.load_ladder(path)
    return str(e.value)


def test_an_unknown_key_is_refused_naming_it_and_the_keys_allowed():
    p = copy.deepcopy(RAW)
    p["bench"]["nmu_prompts"] = 32
    msg = errors_of(p)
    assert msg.startswith("params.yaml is not valid:\n  ")
    assert "bench.nmu_prompts: unknown key; allowed: num_prompts, repeats, mode, warmups, warmup_repeats" in msg
    p = copy.deepcopy(RAW)
    p["gpu"] = {}
    assert "  gpu: unknown key; allowed: profile, baseline, model, engine" in errors_of(p)


def test_every_bad_field_is_reported_at_once_in_our_words():
    p = copy.deepcopy(RAW)
    p["bench"].update(mode="turbo", timeout_s=True)
    p["knee"]["ramp_fraction"] = 0.5
    p["download"]["catalog"]["smollm2-135m-w4a16"]["group_size"] = "32"
    lines = errors_of(p).splitlines()[1:]
    assert lines == ["  download.catalog.smollm2-135m-w4a16.group_size: '32' is not allowed; expected an integer > 0",
                     "  bench.mode: 'turbo' is not allowed; expected engine or cli",
                     "  bench.timeout_s: True is not allowed; expected a number of seconds > 0",
                     "  knee.ramp_fraction: 0.5 is not allowed; expected a fraction in [0, 0.5): the first arrivals "
                     "of a probe, left out of its percentiles"]
    assert not any(w in "\n".join(lines) for w in ("pydantic", "Input should", "validation error"))


def test_defaults_are_filled_from_the_model():
    p = copy.deepcopy(RAW)
    for key in ("timeout_s", "warmups", "mode"):
        del p["bench"][key]
    for key in ("timeout_s", "temperature", "seed"):
        del p["eval"][key]
    for key in ("ramp_fraction", "start_fraction", "start_timeout_s", "probe_timeout_s"):
        del p["knee"][key]
    del p["cost"], p["roofline"]
    out = config.validate(p)
    assert out["bench"]["timeout_s"] == 1800 and out["bench"]["warmups"] == 0 and out["bench"]["mode"] == "engine"
    assert out["eval"]["timeout_s"] == 1800 and out["eval"]["temperature"] == 0 and out["eval"]["seed"] == 0
    assert (out["knee"]["ramp_fraction"], out["knee"]["start_fraction"], out["knee"]["start_timeout_s"],
            out["knee"]["probe_timeout_s"]) == (0.1, 0.5, 900, 600)
    assert out["knee"]["min_rate"] is None
    assert out["cost"] == {"gpu_price_per_hour": 0.0} and out["roofline"] == {"bandwidth_gbs": {}}
    assert out["download"]["catalog"]["qwen2.5-7b-shape"]["awq"] is False
    assert "timeout_s" not in p["bench"]  # the caller's dict is left as it was


def test_a_knee_probe_too_small_for_the_slos_percentile_is_refused():
    p = copy.deepcopy(RAW)
    p["slo"]["percentile"], p["knee"]["max_prompts"] = 99, 200
    p["knee"]["dispersion"], p["knee"]["max_repeats"] = {"phi": 1.0}, 1
    assert ("knee.max_prompts: 200 is below the 333 requests a probe needs to pass at slo.percentile 99 (at least "
            "299 counted after knee.ramp_fraction 0.1, at knee.dispersion 1 and knee.max_repeats 1 looks); raise it or "
            "declare a lower slo.percentile") in errors_of(p)
    p["slo"]["percentile"] = 95
    config.validate(p)  # 59 counted, 66 sent
    p["knee"]["max_repeats"] = 3  # three pooled looks share the 5 %: 80 counted
    config.validate(p)
    p["knee"]["dispersion"] = {"phi": 4.0}  # requests over the SLO in bursts: 4 x 80 counted
    assert "knee.max_prompts: 200 is below the 356 requests a probe needs to pass at slo.percentile 95" in errors_of(p)


def test_values_keep_their_yaml_types():
    out = config.validate(copy.deepcopy(RAW))
    assert out["slo"]["ttft_ms"] == 1000 and isinstance(out["slo"]["ttft_ms"], int)
    assert out["engine"] == RAW["engine"] and out["env"] == RAW["env"]
    assert out["download"]["catalog"]["smollm2-135m-w4a16"]["from"] == "smollm2-135m"


def test_load_params_fills_and_read_params_reads_as_is(tmp_path):
    p = copy.deepcopy(RAW)
    del p["bench"]["timeout_s"]
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(p))
    assert config.load_params(path).bench.timeout_s == 1800
    assert "timeout_s" not in config.read_params(path)["bench"]
    assert common.load_params(path).bench.timeout_s == 1800


def test_the_mode_decides_which_knee_keys_are_required():
    p = copy.deepcopy(RAW)
    del p["knee"]["max_rate"]
    assert "knee.max_rate: missing; expected a request rate > 0" in errors_of(p)
    p["knee"]["mode"] = "sweep"  # a sweep needs rates, not a search bracket
    config.validate(p)
    del p["knee"]["rates"]
    assert "knee.rates: missing; expected an increasing list of request rates > 0" in errors_of(p)


def test_catalog_sources_are_checked_and_a_quantize_source_must_exist():
    p = copy.deepcopy(RAW)
    p["download"]["catalog"]["smollm2-135m"]["source"] = "s3"
    assert "download.catalog.smollm2-135m.source: 's3' is not allowed; expected one of pypi-gguf, quantize, hf, shape" \
        in errors_of(p)
    p = copy.deepcopy(RAW)
    p["download"]["catalog"]["smollm2-135m-w4a16"]["from"] = "nope"
    assert "download.catalog.smollm2-135m-w4a16.from: 'nope' is not in download.catalog" in errors_of(p)


def test_a_stage_can_validate_its_own_section():
    assert config.section(RAW, "download")["catalog"]["qwen2.5-7b-shape"]["awq"] is False
    bad = copy.deepcopy(RAW)
    bad["download"]["store"] = 5
    with pytest.raises(common.ParamsError, match="download.store: 5 is not allowed; expected a folder"):
        config.section(bad, "download")


def test_every_key_a_ladder_profile_sets_is_a_params_key():
    lad = config.load_ladder(ROOT / "ladder.yaml")
    for profile in lad["profiles"]:
        eff = planning.effective_params(RAW, lad, profile, RAW)
        out = config.validate(eff)
        for key, value in lad["profiles"][profile]["settings"].items():
            assert planning.get_dotted(out, key) == value, (profile, key)


def test_the_shipped_ladder_validates_with_its_defaults_filled():
    lad = config.load_ladder(ROOT / "ladder.yaml")
    assert lad["objective"] == "knee_rps"
    assert set(lad["profiles"]) == {"cpu", "gpu", "gpu-small", "gpu-shape", "gpu-shape-4090", "gpu-shape-4090-check"}
    rung = lad["profiles"]["cpu"]["rungs"][0]
    assert rung["fallback"] is None and rung["when"] is None and rung["note"]
    two = next(r for r in lad["profiles"]["gpu"]["rungs"] if r["name"] == "second-gpu")
    assert two["when"] == {"min_gpus": 2} and two["set"] is None and len(two["candidates"]) == 2


def test_an_objective_defaults_to_the_knee(tmp_path):
    lad = copy.deepcopy(RAW_LADDER)
    del lad["objective"]
    path = tmp_path / "ladder.yaml"
    path.write_text(yaml.safe_dump(lad))
    assert config.load_ladder(path)["objective"] == "knee_rps"


def test_a_bad_ladder_is_refused_with_a_clear_message(tmp_path):
    assert ladder_error(tmp_path, lambda lad: lad.update(rungz=[])) == \
        "ladder.yaml: unknown section(s) rungz; allowed: objective, groups, profiles"
    assert ladder_error(tmp_path, lambda lad: lad.update(objective="speed")) == \
        "ladder.yaml: objective: 'speed'; allowed: knee_rps, output_tps"
    assert "profiles.cpu must hold `settings` and `rungs`" in \
        ladder_error(tmp_path, lambda lad: lad["profiles"]["cpu"].update(setings={}))
    msg = ladder_error(tmp_path, lambda lad: lad["profiles"]["cpu"]["rungs"][1].update(note=5, when={"min_gpus": "2"}))
    assert msg.splitlines() == ["ladder.yaml is not valid:",
                                "  profiles.cpu.rungs[2].note: 5 is not allowed; expected a text",
                                "  profiles.cpu.rungs[2].when.min_gpus: '2' is not allowed; expected an integer > 0"]
    assert ladder_error(tmp_path, lambda lad: lad["profiles"]["gpu"]["rungs"][0].update(set="fp8")) == \
        "ladder.yaml: profiles.gpu.rungs[1].set: 'fp8' is not allowed; expected a mapping of knob names to values"
    assert "profiles.cpu.rungs[1].sett: unknown key; allowed: name, set, candidates, fallback, note, when" in \
        ladder_error(tmp_path, lambda lad: lad["profiles"]["cpu"]["rungs"][0].update(sett={}))


def test_gate_measure_failed_is_a_bool_off_by_default():
    p = copy.deepcopy(RAW)
    del p["gate"]["measure_failed"]
    assert config.validate(p)["gate"]["measure_failed"] is False  # a failed rung's speed is not measured
    p["gate"]["measure_failed"] = "yes"
    assert errors_of(p).splitlines()[1:] == [
        "  gate.measure_failed: 'yes' is not allowed; expected true or false: whether bench and knee still measure "
        "a rung whose gate failed (it is reverted either way)"]
