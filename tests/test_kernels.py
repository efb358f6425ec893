"""Which kernels a rung ran, read from the engine's log (vllm_compat.engine_facts) and printed per rung beside the
gate's flips (report.kernels_line), so a regression only a GPU kernel shows is attributable. The log lines are
vLLM 0.26.0's own format strings (platforms/cuda.py, flash_attn.py, compressed_tensors_wNa16.py, config/cache.py)
as its logger prints them. No engine."""
import report
from records.ladder import LadderRecord
from serving import vllm_compat

P = "(EngineCore_DP0 pid=4242) INFO 11-30 09:00:02 "
W4A16_FP8_LOG = "\n".join([
    "INFO 11-30 09:00:00 [cache.py:285] Using fp8 data type to store kv cache. It reduces the GPU memory footprint "
    "and boosts the performance. Meanwhile, it may cause accuracy drop without a proper scaling factor",
    P + "[compressed_tensors_wNa16.py:137] Using MarlinLinearKernel for CompressedTensorsWNA16",
    P + "[cuda.py:482] Using FLASH_ATTN attention backend out of potential backends: ['FLASH_ATTN', 'FLASHINFER', "
        "'TRITON_ATTN', 'FLEX_ATTENTION'].",
    P + "[flash_attn.py:776] Using FlashAttention version 3",
    P + "[mla/prefill/selector.py:137] Using FLASHINFER MLA prefill backend.",  # not the attention backend
])


def facts_of(tmp_path, text: str) -> dict:
    (tmp_path / "engine.log").write_text(text + "\n")
    return vllm_compat.engine_facts(tmp_path / "engine.log")


def test_the_0_26_lines_give_attention_backend_fa_version_weight_kernel_and_fp8_kv(tmp_path):
    facts = facts_of(tmp_path, W4A16_FP8_LOG)
    assert facts["attention_backend"] == "FLASH_ATTN" and facts["flash_attn_version"] == 3
    assert facts["kernels"] == ["MarlinLinearKernel"] and facts["kv_cache_dtype_logged"] == "fp8"
    assert report.kernels_text(facts) == "attention FLASH_ATTN (FA3), weights MarlinLinearKernel, KV fp8"


def test_an_attention_backend_asked_for_is_read_too(tmp_path):
    # cuda.py:422 logs the enum member itself when --attention-backend / VLLM_ATTENTION_BACKEND chose it
    facts = facts_of(tmp_path, P + "[cuda.py:422] Using AttentionBackendEnum.FLASHINFER backend.\n"
                     + P + "[compressed_tensors_wNa16.py:137] Using MacheteLinearKernel for CompressedTensorsWNA16")
    assert facts["attention_backend"] == "FLASHINFER" and "flash_attn_version" not in facts
    assert facts["kernels"] == ["MacheteLinearKernel"]


def test_a_log_without_these_lines_names_none(tmp_path):
    facts = facts_of(tmp_path, P + "[core.py:100] Initializing a V1 LLM engine (v0.26.0) with config: "
                     "model='m', quantization=None, kv_cache_dtype=auto, enable_prefix_caching=False")
    assert "attention_backend" not in facts and facts["kernels"] == []
    assert report.kernels_text(facts) == "attention not logged, weights unquantized, KV auto"
    assert report.kernels_text({"kernels": []}) is None  # a log naming nothing (an older record): no line, no guess


def rung(index, name, exp, base, facts, knee_facts=None):
    return {"index": index, "name": name, "exp": exp, "base": base, "role": "rung", "status": "ok",
            "eval": {"status": "ok", "n": 0, "engine": facts}, "bench": {"status": "ok", "engine": facts},
            "knee": knee(knee_facts or facts)}


def knee(facts):
    return {"status": "inside", "mode": "search", "applied": facts}


def ladder(*rungs) -> LadderRecord:
    return LadderRecord.model_validate({"profile": "test", "rungs": list(rungs)})


def test_the_report_prints_each_rungs_kernels_beside_its_flips_and_its_base_where_they_differ():
    base_facts = {"attention_backend": "FLASH_ATTN", "flash_attn_version": 3, "kernels": [], "quantization": None,
                  "kv_cache_dtype": "auto"}
    w4 = {**base_facts, "kernels": ["MarlinLinearKernel"], "quantization": "compressed-tensors"}
    fp8_knee = {**w4, "attention_backend": "FLASHINFER", "flash_attn_version": None, "kv_cache_dtype": "fp8"}
    lad = ladder(
        rung(0, "baseline", "g-0", None, base_facts),
        {**rung(1, "w4a16", "g-1", "g-0", w4), "decision": "kept",
         "gate": {"keep": True, "gated": True, "verdict": "pass", "reasons": [],
                  "flipped": {"right_to_wrong": ["m3"], "wrong_to_right": []}}},
        {**rung(2, "seed", "g-2", "g-1", w4), "decision": "reverted"},
        {**rung(3, "fp8-kv", "g-3", "g-1", {**w4, "kv_cache_dtype": "fp8"}, fp8_knee), "decision": "reverted"},
        {"index": 4, "name": "broken", "exp": "g-4", "base": "g-1", "role": "rung", "status": "failed",
         "decision": "failed"},
    )
    lines = report.kept_why(lad)
    i = next(i for i, ln in enumerate(lines) if ln.startswith("- **w4a16**"))
    assert lines[i + 1] == ("  - kernels: attention FLASH_ATTN (FA3), weights MarlinLinearKernel, KV auto "
                            "(eval, bench, knee); its base (0 baseline): attention FLASH_ATTN (FA3), weights "
                            "unquantized, KV auto (eval, bench, knee)")
    assert lines[i + 2].startswith("  - flipped right→wrong: m3")
    assert "  - kernels: attention FLASH_ATTN (FA3), weights MarlinLinearKernel, KV auto (eval, bench, knee); same " \
           "as its base (1 w4a16)" in lines
    assert ("  - kernels: eval: attention FLASH_ATTN (FA3), weights MarlinLinearKernel, KV fp8; bench: attention "
            "FLASH_ATTN (FA3), weights MarlinLinearKernel, KV fp8; knee: attention FLASHINFER, weights "
            "MarlinLinearKernel, KV fp8; its base (1 w4a16)") in "\n".join(lines)
    broken = next(i for i, ln in enumerate(lines) if ln.startswith("- **broken**"))
    assert not any(ln.startswith("  - kernels") for ln in lines[broken:])  # a failed rung ran no engine to ask


def test_a_base_that_ran_the_same_kernels_in_fewer_stages_is_the_same():
    facts = {"attention_backend": "FLASH_ATTN", "kernels": [], "quantization": None, "kv_cache_dtype": "auto"}
    base = {"index": 0, "name": "baseline", "exp": "g-0", "role": "baseline", "status": "ok",
            "knee": knee(facts)}  # eval and bench n/a there
    lad = ladder(base, rung(1, "dp2", "g-1", "g-0", facts))
    assert report.kernels_line(lad.rungs[1], lad) == [
        "  - kernels: attention FLASH_ATTN, weights unquantized, KV auto (eval, bench, knee); same as its base "
        "(0 baseline)"]
