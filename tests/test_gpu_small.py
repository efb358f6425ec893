"""The gpu-small profile: the cpu profile's real SmolLM2-135M climbing on a GPU, so that every rung is gated on the
GPU's own kernels. Checked here without a GPU: it plans, vLLM's own parser takes every knob, every rung serves real
weights with the offline engine the eval (the gate) runs, and its eval is the cpu profile's. No engine."""
import subprocess
import sys

import common
import plan as planning
from conftest import ROOT
from serving import vllm_compat

PARAMS = common.read_params(ROOT / "params.yaml")
LADDER = planning.load_ladder(ROOT / "ladder.yaml")


def test_every_gpu_small_rung_serves_real_weights_the_offline_engine_runs():
    p = planning.resolve(PARAMS, LADDER, "gpu-small", PARAMS, gpus=1)
    assert [r["name"] for r in p.rungs] == ["w4a16", "fp8-kv", "spend-memory", "prefix-caching", "batched-tokens"]
    assert not any(r.get("skip") or r["when"] for r in p.rungs)  # nothing this 1-GPU profile leaves out
    base = p.params["baseline"]
    assert base["model"]["name"] == "smollm2-135m" and base["engine"]["enforce_eager"] is False
    for rung in p.rungs:  # every candidate composed on rung 0, as the driver may run it
        for change in planning.rung_changes(rung):
            knobs = {**p.baseline, **change}
            engine = {k[7:]: v for k, v in knobs.items() if k.startswith("engine.")}
            assert engine["load_format"] == "auto", rung["name"]  # real weights: accuracy is measured
            assert vllm_compat.offline_unsupported(engine) is None, rung["name"]  # the eval runs: the gate decides
            assert knobs["model.name"] in p.params["download"]["fetch"], rung["name"]
    assert planning.engine_arg_errors(p) == []


def test_gpu_small_evaluates_exactly_as_the_cpu_profile_does():
    cpu = planning.resolve(PARAMS, LADDER, "cpu", PARAMS, gpus=0).params
    gpu = planning.resolve(PARAMS, LADDER, "gpu-small", PARAMS, gpus=1).params
    assert gpu["eval"] == cpu["eval"]  # same items, max_tokens, greedy: per-item flips compare GPU with CPU
    assert gpu["download"] == cpu["download"]  # the same two folders: `make pack-models` on one, unpack on the other
    assert gpu["gate"] == cpu["gate"]
    assert gpu["slo"] != cpu["slo"] and gpu["cost"]["gpu_price_per_hour"] > 0


def test_make_check_accepts_gpu_small():
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "ladder.py"), "--profile", "gpu-small", "--check"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert ("ladder: profile gpu-small, model smollm2-135m, baseline + 5 rungs: w4a16, fp8-kv, spend-memory, "
            "prefix-caching, batched-tokens") in p.stdout
