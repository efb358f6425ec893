"""The eval stage takes rung 0's result instead of starting an engine only when it would run on exactly the same
inputs: the engine config as it runs (env and target card included), the model's files, the eval set and its
sampling (eval.reusable). Anything that can change an answer starts an engine."""
import copy
import json
import shutil
import subprocess
import sys

import pytest

import common
import eval as ev_stage
from conftest import ROOT
from records.eval import EvalResult

PARAMS = common.read_params(ROOT / "params.yaml")
ENTRY = {"id": "smollm2", "sha256": "a" * 64}
H200 = [{"name": "NVIDIA H200", "memory_mib": 143771}]


def inputs(params: dict, which: str = "rung", entry: dict = ENTRY, gpus=None) -> dict:
    typed = common.parse(params)
    ev = typed.eval.model_copy(update={"file": str(ROOT / typed.eval.file)})
    return ev_stage.inputs(common.engine_config(typed, which, gpus), ev, entry)


def baseline_result(params: dict, gpus=None) -> EvalResult:
    return EvalResult(status="ok", which="baseline", n=140, inputs=inputs(params, "baseline", gpus=gpus))


def test_rung_0_reuses_the_baseline():
    assert PARAMS["engine"] == PARAMS["baseline"]["engine"] and PARAMS["model"] == PARAMS["baseline"]["model"]
    assert ev_stage.reusable(inputs(PARAMS), baseline_result(PARAMS))


def test_a_timeout_decides_no_answer():
    p = copy.deepcopy(PARAMS)
    p["eval"]["timeout_s"] = 60
    assert ev_stage.reusable(inputs(p), baseline_result(PARAMS))


@pytest.mark.parametrize("section, key, value", [
    ("engine", "max_num_seqs", 32),
    ("engine", "kv_cache_dtype", "fp8"),
    ("engine", "quantization", "fp8"),      # a knob the baseline does not set at all
    ("model", "name", "smollm2-135m-w4a16"),
    ("env", "VLLM_CPU_KVCACHE_SPACE", 2),
    ("env", "VLLM_ATTENTION_BACKEND", "TORCH_SDPA"),
])
def test_a_different_engine_knob_model_or_env_starts_an_engine(section, key, value):
    p = copy.deepcopy(PARAMS)
    p[section][key] = value
    assert not ev_stage.reusable(inputs(p), baseline_result(PARAMS))


@pytest.mark.parametrize("key, value", [("max_tokens", 32), ("seed", 1), ("temperature", 0.7)])
def test_a_different_eval_param_starts_an_engine(key, value):
    base = baseline_result(PARAMS)  # the baseline ran with the eval params it recorded
    p = copy.deepcopy(PARAMS)
    p["eval"][key] = value
    assert not ev_stage.reusable(inputs(p), base)


def test_other_eval_items_or_other_model_files_start_an_engine(tmp_path):
    other = tmp_path / "eval.jsonl"
    other.write_text((ROOT / PARAMS["eval"]["file"]).read_text() + "\n")
    typed = common.parse(PARAMS)
    mine = ev_stage.inputs(common.engine_config(typed), typed.eval.model_copy(update={"file": str(other)}), ENTRY)
    assert not ev_stage.reusable(mine, baseline_result(PARAMS))
    # the same model name over other files (a local folder edited in place)
    assert not ev_stage.reusable(inputs(PARAMS, entry={**ENTRY, "sha256": "b" * 64}), baseline_result(PARAMS))


def test_the_target_card_is_part_of_the_engine_config():
    p = copy.deepcopy(PARAMS)
    p["target"] = {"name": "RTX 4090", "memory_gib": 23.6, "bandwidth_gbs": 1008}
    assert ev_stage.reusable(inputs(p, gpus=H200), baseline_result(p, gpus=H200))
    assert not ev_stage.reusable(inputs(p, gpus=H200), baseline_result(PARAMS))  # the baseline ran on the whole card
    q = copy.deepcopy(p)
    q["target"]["memory_gib"] = 16
    assert not ev_stage.reusable(inputs(q, gpus=H200), baseline_result(p, gpus=H200))


def test_no_usable_baseline_result_starts_an_engine():
    mine = inputs(PARAMS)
    assert not ev_stage.reusable(mine, None)
    assert not ev_stage.reusable(mine, baseline_result(PARAMS).model_copy(update={"status": "n/a"}))
    assert not ev_stage.reusable(mine, EvalResult(status="ok", n=140))  # from before eval.json recorded its inputs


def test_the_stage_copies_the_baselines_result_and_starts_nothing(tmp_path):
    """`eval.py rung OUT BASELINE_DIR` on rung 0's inputs, in a copy of the repo: a model folder with no weights,
    so an engine, had one started, would fail the stage."""
    for d in ("scripts", "evals"):
        shutil.copytree(ROOT / d, tmp_path / d)
    shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    name = PARAMS["model"]["name"]
    entry = {"name": name, "path": str(tmp_path / "model"), "id": "no weights", "sha256": "c" * 64}
    common.write_json(tmp_path / "results" / "models.json", {"models": {name: entry}})
    base_dir = tmp_path / "ref"
    items = "".join(json.dumps({"id": f"m{i}", "category": "math", "correct": i % 2 == 0, "output": str(i)}) + "\n"
                    for i in range(3))
    (base_dir / "logs").mkdir(parents=True)
    (base_dir / "eval_items.jsonl").write_text(items)
    facts = {"kernels": ["CPUWNA16LinearKernel"], "kv_cache_tokens": 1234}
    base = {**baseline_result(PARAMS).model_dump(mode="json"), "model": name, "n": 3, "correct": 2,
            "overall": 2 / 3, "by_category": {}, "inputs": inputs(PARAMS, entry=entry), "engine": facts, "wall_s": 70.0,
            "time": {"wall_s": 75.0, "start_s": 50.0, "measure_s": 20.0, "other_s": 5.0},
            "nondeterminism": {"flips": 0, "by_category": {}, "items": [], "method": ev_stage.RECHECK,
                               "recheck_s": 1.0}}
    EvalResult(**base).save_file(base_dir / "eval.json")
    p = subprocess.run([sys.executable, "scripts/eval.py", "rung", "out", "ref"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "no engine started" in p.stdout
    ev = common.read_json(tmp_path / "out" / "eval.json")
    assert ev["reused_from"] == "eval_baseline" and ev["which"] == "rung" and ev["nondeterminism"] is None
    assert ev["engine"] == facts and ev["overall"] == base["overall"] and ev["inputs"] == base["inputs"]
    assert ev["time"]["start_s"] == ev["time"]["measure_s"] == 0 and ev["wall_s"] == ev["time"]["wall_s"] < 70
    assert (tmp_path / "out" / "eval_items.jsonl").read_text() == items
    assert [f.name for f in (tmp_path / "out" / "logs" / "eval").iterdir()] == ["reused.txt"]
