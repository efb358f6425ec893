"""The records (scripts/records/): each stage's result file and the ladder record, written and read through its model
only; records an older version of the code wrote read through the model's validators."""
import ast
import json

import pytest
from pydantic import ValidationError

import bench as bench_stage
import common
import config
import download as download_stage
import eval as eval_stage
import gate as gate_stage
import knee as knee_stage
from conftest import ROOT
from measure import host, score
from records import upstream
from records.bench import BenchResult
from records.eval import EvalResult
from records.fingerprint import Fingerprint
from records.gate import GateResult, gate_failed
from records.knee import KneeResult, RungKnee
from records.ladder import LadderRecord
from records.models import ModelsManifest

# the two older ladders: records an older version of the code wrote (7ce1c08, c536b45), kept as fixtures
LADDERS = ["tests/fixtures/ladder_cpu_7ce1c08.json", "tests/fixtures/ladder_h200x2_c536b45.json",
           "tests/fixtures/ladder_cpu.json", "tests/fixtures/ladder_gpu_shape.json"]
IO = {"read_json", "write_json", "load", "loads", "dump", "dumps", "read_text", "write_text"}


def stage_of(path, stage):
    """(rung name, its `stage` record) for every rung and confirm run of a ladder fixture that holds one."""
    lad = json.loads((ROOT / path).read_text())
    return [(r["name"], r[stage]) for r in lad["rungs"] + ((lad.get("confirm") or {}).get("runs") or [])
            if r.get(stage)]


def knees_of(path):
    return stage_of(path, "knee")


# each typed result file: the names its path goes by in the scripts, and the scripts that name it otherwise (the
# stage's own writes to `out`)
TYPED = {"knee.json": (("knee.json",), {"knee.py": "out"}),
         "bench.json": (("bench.json", "bench_json"), {"bench.py": "out"}),
         "gate.json": (("gate.json", "gate_json"), {"gate.py": "out"}),
         "eval.json": (("eval.json",), {"eval.py": "out"}),
         "ladder.json": (("ladder.json", "ladder_json", "LADDER_JSON"),
                         {"ladder.py": "self.out", "report.py": "src", "compare.py": "src"}),
         "fingerprint.json": (("fingerprint.json", "fingerprint_json"), {"fingerprint.py": "out"}),
         "models.json": (("models.json", "models_json"), {"download.py": "out"})}


@pytest.mark.parametrize("name", TYPED)
def test_each_typed_result_is_written_and_read_only_through_its_model(name):
    """No script outside records/ opens a typed result file as JSON itself: its stage writes it by the model's
    save_file, every reader reads it by the model's load_file. The path is the call's first argument (a later one
    is the text written, which may name the file in words), or a variable the path was put in first
    (`fp = common.fingerprint_json()`)."""
    names, scripts = TYPED[name]
    found = []
    for f in sorted((ROOT / "scripts").rglob("*.py")):
        if f.parent.name == "records":
            continue
        src = f.read_text()
        tree = ast.parse(src)
        aliases = {t.id for node in ast.walk(tree) if isinstance(node, ast.Assign)
                   and any(n in (ast.get_source_segment(src, node.value) or "") for n in names)
                   for t in node.targets if isinstance(t, ast.Name)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) in IO:
                args = [ast.get_source_segment(src, a) or "" for a in node.args[:1]]
                if (any(n in a for a in args for n in names) or args == [scripts.get(f.name)]
                        or (args and args[0] in aliases)):
                    found.append(f"{f.relative_to(ROOT)}:{node.lineno}")
    assert not found, found


# the records a DVC stage (or `make ladder`, for report/ladder.json) declares: the one script that saves each where
# dvc.yaml names it, and the other scripts allowed to save one, each only to a folder of its own (issue 52: no side
# doors: a script writing another's declared output outside DVC makes `dvc status` lie)
WRITERS = {"ModelsManifest": {("download.py", "out"), ("benchmark_noise.py", 'BENCHMARK_LOGS / "models.json"')},
           "Fingerprint": {("fingerprint.py", "out"), ("benchmark_noise.py", 'BENCHMARK_LOGS / "fingerprint.json"')},
           "LadderRecord": {("ladder.py", "self.out"), ("fill_capacity.py", "args.out_json")}}


def test_each_declared_record_is_saved_only_by_its_stage_or_into_a_folder_of_its_own():
    found: dict[str, set] = {model: set() for model in WRITERS}
    for f in sorted((ROOT / "scripts").rglob("*.py")):
        if f.parent.name == "records":
            continue
        src = f.read_text()
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "save_file":
                receiver = ast.get_source_segment(src, node.func.value) or ""
                for model in WRITERS:
                    if receiver.startswith(model + ".") or receiver.startswith(model + "("):
                        found[model].add((f.name, ast.get_source_segment(src, node.args[0])))
    assert found == WRITERS


def test_the_knee_noise_floor_sits_beside_the_knee_stage_s_record_never_in_it():
    # a judgement threshold (the params judging, never the stage's): a rung holds the knee stage's record as it was
    # written, and the floor it was judged with beside it; version 2 held it inside, read so
    v2, today = (json.loads((ROOT / p).read_text()) for p in (V2, TODAY))
    for old, new, rec in zip(v2["rungs"], today["rungs"], LadderRecord.load_file(ROOT / V2).rungs):
        if old.get("knee"):
            assert "noise_floor" not in new["knee"] and new["knee_noise_floor"] == old["knee"]["noise_floor"]
            assert rec.knee_noise_floor == old["knee"]["noise_floor"] and "noise_floor" not in rec.knee.model_dump()
    assert LadderRecord.load_file(ROOT / V2).as_dict() == LadderRecord.load_file(ROOT / TODAY).as_dict()
    from judgement import decide
    rung = today["rungs"][0]
    assert decide.judged_knee(rung)["noise_floor"] == rung["knee_noise_floor"] and "noise_floor" not in rung["knee"]


@pytest.mark.parametrize("path", LADDERS)
def test_every_knee_an_older_version_wrote_reads_through_the_model(path):
    for name, k in knees_of(path):  # each as a rung of the ladder record held it (with knee.noise_floor: beside now)
        rec = RungKnee.model_validate({key: v for key, v in k.items() if key != "noise_floor"})
        assert rec.knee_rps == k["knee_rps"] and rec.status == k["status"] and len(rec.rows) == len(k["rows"]), name
        assert rec.as_rung()["schema_version"] == KneeResult.SCHEMA


def test_a_p99_only_slo_of_version_1_is_read_as_the_slo_it_was():
    name, k = knees_of("tests/fixtures/ladder_h200x2_c536b45.json")[0]
    assert "p99_ttft_ms" in k["slo"] and "schema_version" not in k
    rec = RungKnee.model_validate(k)
    assert (rec.slo.percentile, rec.slo.ttft_ms, rec.slo.tpot_ms) == (99, k["slo"]["p99_ttft_ms"],
                                                                      k["slo"]["p99_tpot_ms"])


def test_a_field_the_model_does_not_declare_is_refused_by_name(tmp_path):
    _, k = knees_of("tests/fixtures/ladder_cpu.json")[0]
    with pytest.raises(ValidationError, match="knee_rsp"):
        RungKnee.model_validate({**k, "schema_version": 2, "knee_rsp": 3.0})
    with pytest.raises(ValidationError, match="noise_floor"):  # the stage's own record never holds the judgement's
        KneeResult.model_validate({**k, "schema_version": 3, "noise_floor": 0.5})


def test_the_stage_s_own_writer_round_trips(tmp_path):
    params = common.load_params(ROOT / "params.yaml")
    out = tmp_path / "knee.json"
    knee_stage.write_na(out, tmp_path / "knee.csv", tmp_path / "logs", "why not", common.BENCH_ONLY, params,
                        common.engine_config(params))
    raw = json.loads(out.read_text())
    assert raw["schema_version"] == KneeResult.SCHEMA and raw["status"] == "n/a" and raw["label"] == common.BENCH_ONLY
    assert "noise_floor" not in raw  # a judgement threshold: the ladder record's, not the stage's
    rec = KneeResult.load_file(out)
    assert rec.reason == "why not" and rec.knee_rps is None and rec.slo.percentile == params.slo.percentile
    again = tmp_path / "again.json"
    rec.save_file(again)
    assert json.loads(again.read_text()) == raw


def keeps(old, new) -> bool:
    """Whether `new` (a record written through its model) holds every key of `old` (one written before it was typed)
    with its value, at any depth; a key `new` adds is null (a field the other code path writes) or the version."""
    if isinstance(old, dict):
        return (isinstance(new, dict) and all(k in new and keeps(v, new[k]) for k, v in old.items())
                and all(v is None or k == "schema_version" for k, v in new.items() if k not in old))
    if isinstance(old, list):
        return isinstance(new, list) and len(old) == len(new) and all(map(keeps, old, new))
    return old == new


# ---------------------------------------------------------------- results/bench.json
def params_():
    return common.load_params(ROOT / "params.yaml")


def bench_v1_ok():
    """A measured bench as scripts/bench.py main wrote it before the record was typed (no schema_version): its dict
    literal, the figures from bench.figures on four runs (one far off, replaced), the shape and facts it copies."""
    params = params_()
    b, w = params.bench, params.workload
    busy = {"wall_s": 78.0, "cores": 2, "other_cpu_s": 101.4, "steal_s": 0.0, "ours_cpu_s": 54.6, "share": 0.65}
    runs = [{"requests_per_s": v / 32, "total_tps": 1.5 * v, "output_tps": v, "prompt_tokens": 64 * 32,
             "output_tokens": 128 * 32, "load": busy if i == 1 else None,
             "applied": {"input_len": 64.0, "output_len": 128.0}} for i, v in enumerate([175.0, 52.0, 181.0, 178.0])]
    facts = {"kernels": [], "kv_cache_tokens": 46592, "max_concurrency": 45.5, "max_concurrency_at_tokens": 1024,
             "engine_init_s": 0.42, "warmup_output_tps": [160.2], "timing": {"start_s": 12.3, "measure_s": 40.1}}
    raw = {
        "status": "ok",
        "method": bench_stage.method(b, "engine"),
        **bench_stage.figures(runs, b.model_copy(update={"repeats": 3, "far_share": 0.2, "extra_repeats": 2})),
        "mode": "engine",
        "workload": {"kind": "random", "text": "random prompts, 64 in / 128 out tokens per request", "shared_prefix":
                     "no", "shared_prefix_len": 0},
        "shape": {"num_prompts": 32, "input_len": 64, "output_len": 128, "dataset": w.kind, "ignore_eos": True,
                  "warmups": b.warmups, "warmup_repeats": b.warmup_repeats, "warmup_prompts": None},
        "warmup_output_tps": facts["warmup_output_tps"],
        "warm_up_engine": {"output_tps": 165.05, "wall_s": 53.8},
        "applied_shape": runs[0]["applied"],
        "kv_cache_tokens": 46592, "max_concurrency": 45.5, "engine_init_s": 0.42,
        "wall_s": 60.2,
        "time": common.stage_time(12.3 + 53.8, 40.1),
        "engine": facts,
        "runs": runs,
        "provenance": upstream.provenance(params, common.rung_config(params)),
    }
    return json.loads(json.dumps(raw))  # as it lay on disk


@pytest.mark.parametrize("path", LADDERS)
def test_every_bench_an_older_version_wrote_reads_through_the_model(path):
    for name, b in stage_of(path, "bench"):
        rec = BenchResult.model_validate(b)
        assert rec.output_tps == b["output_tps"] and rec.output_tps_runs == b["output_tps_runs"], name
        assert rec.status == b.get("status", "ok") and len(rec.runs) == len(b.get("runs") or []), name
        assert rec.as_rung()["schema_version"] == BenchResult.SCHEMA


def test_a_version_1_bench_keeps_every_key_and_value_on_disk(tmp_path):
    """DVC's metrics (`dvc exp show`, make compare) read bench.json by key: a version-1 record read through the model
    and written again keeps each key it had, with its value; only schema_version is new (and null for a field the
    other code path writes)."""
    raw = bench_v1_ok()
    assert "schema_version" not in raw and raw["disturbed"] and raw["runs"][1]["disturbed"]
    rec = BenchResult.model_validate(raw)
    assert rec.disturbed[0].replaced_by == 4 and rec.summary.output_tps.median == raw["output_tps"]
    rec.save_file(tmp_path / "bench.json")
    again = json.loads((tmp_path / "bench.json").read_text())
    assert keeps(raw, again) and again["schema_version"] == BenchResult.SCHEMA
    assert again["reason"] is None and again["label"] is None and again["runs"][0]["disturbed"] is None


def test_a_version_1_bench_from_before_status_is_a_measured_one_without_its_floor():
    _, b = stage_of("tests/fixtures/ladder_h200x2_c536b45.json", "bench")[0]
    assert "noise_floor" in b  # bench.noise_floor: a judgement threshold the stage wrote before 09d26e3
    assert BenchResult.model_validate(b).status == "ok"
    _, b = stage_of("tests/fixtures/ladder_cpu.json", "bench")[0]
    assert "status" not in b and BenchResult.model_validate(b).status == "ok"


def test_a_bench_field_the_model_does_not_declare_is_refused_by_name():
    raw = bench_v1_ok()
    with pytest.raises(ValidationError, match="output_tsp"):
        BenchResult.model_validate({**raw, "output_tsp": 3.0})
    with pytest.raises(ValidationError, match="noise_floor"):  # a version-2 record never holds the judgement's
        BenchResult.model_validate({**raw, "schema_version": 2, "noise_floor": 0.05})
    with pytest.raises(ValidationError, match="replaced"):  # the nested parts are closed too
        BenchResult.model_validate({**raw, "disturbed": [{**raw["disturbed"][0], "replaced": 4}]})


def test_the_bench_stage_s_own_writer_round_trips(tmp_path):
    params = params_()
    out = tmp_path / "bench.json"
    bench_stage.write_na(out, tmp_path / "logs", "why not", common.GATE_FAILED, params, common.engine_config(params))
    raw = json.loads(out.read_text())
    assert raw["schema_version"] == BenchResult.SCHEMA and raw["status"] == "n/a" and raw["label"] == common.GATE_FAILED
    assert raw["output_tps"] is None and raw["output_tps_runs"] == [] and raw["mode"] == params.bench.mode
    rec = BenchResult.load_file(out)
    assert rec.reason == "why not" and rec.time.wall_s >= 0 and rec.provenance["params_hash"]
    again = tmp_path / "again.json"
    rec.save_file(again)
    assert json.loads(again.read_text()) == raw


# ---------------------------------------------------------------- results/gate.json
def gate_v1(failed: bool = True, gated: bool = True):
    """A gate as scripts/gate.py main wrote it before the record was typed: gate.evaluate's dict, on two evals of
    28 items a category (math collapsing where `failed`: 8 right→wrong, p = 0.008) or on a rung not gated."""
    base = {f"{c}-{i}": {"id": f"{c}-{i}", "category": c, "correct": i < 16} for c in ("math", "format")
            for i in range(28)}
    cur = {i: {**it, "correct": False} if failed and it["category"] == "math" and int(i[5:]) < 8 else it
           for i, it in base.items()}
    ev = EvalResult(status="ok", model="m", n=56, nondeterminism={"by_category": {"math": 1, "format": 0},
                                                                  "flips": 1, "items": ["math-20"],
                                                                  "method": "twice", "recheck_s": 1.0})
    rung = ev if gated else EvalResult(status="n/a", reason="dummy weights", model="m", n=56)
    raw = gate_stage.evaluate(ev, rung, lambda: base, lambda: cur, params_().gate.model_dump())
    return json.loads(json.dumps(raw))  # as it lay on disk


@pytest.mark.parametrize("path", LADDERS)
def test_every_gate_an_older_version_wrote_reads_through_the_model(path):
    for name, g in stage_of(path, "gate"):
        rec = GateResult.model_validate(g)
        assert rec.verdict == g["verdict"] and rec.reasons == g["reasons"], name
        assert sorted(rec.by_category) == sorted(g["by_category"]), name
        assert rec.as_rung()["schema_version"] == GateResult.SCHEMA


@pytest.mark.parametrize("failed, gated", [(True, True), (False, True), (False, False)])
def test_a_version_1_gate_keeps_every_key_and_value_on_disk(tmp_path, failed, gated):
    raw = gate_v1(failed, gated)
    assert "schema_version" not in raw and raw["verdict"] == ("fail" if failed else "pass" if gated else "not gated")
    rec = GateResult.model_validate(raw)
    assert rec.keep is not failed and (rec.overall is None) is not gated
    rec.save_file(tmp_path / "gate.json")
    again = json.loads((tmp_path / "gate.json").read_text())
    if not gated:  # no flips either way: {} then, each way empty now
        assert raw["flipped"] == {} and again["flipped"] == {"right_to_wrong": [], "wrong_to_right": []}
        raw["flipped"] = again["flipped"]
    assert keeps(raw, again) and again["schema_version"] == GateResult.SCHEMA
    assert GateResult.load_file(tmp_path / "gate.json") == rec


def test_a_gate_field_the_model_does_not_declare_is_refused_by_name():
    raw = gate_v1()
    with pytest.raises(ValidationError, match="verdcit"):
        GateResult.model_validate({**raw, "verdcit": "pass"})
    with pytest.raises(ValidationError, match="p_valeu"):  # a category's block is closed too
        GateResult.model_validate({**raw, "by_category": {"math": {**raw["by_category"]["math"], "p_valeu": 0.1}}})


def test_the_gate_stage_s_own_writer_round_trips_and_the_performance_stages_read_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # stage_start moves to the repo root; the test's cwd comes back afterwards
    res = tmp_path / "results"
    for which in ("baseline", "rung"):
        d = res / "baseline" if which == "baseline" else res
        EvalResult(status="n/a", reason="dummy weights", model="m", n=56).save_file(d / "eval.json")
    gate_stage.main(res / "baseline", res, res / "gate.json")
    raw = json.loads((res / "gate.json").read_text())
    assert raw["schema_version"] == GateResult.SCHEMA and raw["verdict"] == "not gated"
    rec = GateResult.load_file(res / "gate.json")
    assert rec.thresholds.alpha == params_().gate.alpha and rec.reasons == ["not gated: dummy weights"]
    rec.save_file(tmp_path / "again.json")
    assert json.loads((tmp_path / "again.json").read_text()) == raw
    assert gate_failed(params_(), res / "gate.json") is None
    GateResult.model_validate(gate_v1()).save_file(res / "gate.json")
    assert gate_failed(params_(), res / "gate.json").startswith("the quality gate failed (")


# ---------------------------------------------------------------- results/eval.json
def eval_v1(status: str = "ok", which: str = "baseline"):
    """An eval as scripts/eval.py main wrote it before the record was typed: its dict, built as main builds it
    (score.summarize and, on rung 0, score.flips on the repo's eval set with its answers as replies; eval.inputs),
    measured or n/a (dummy weights)."""
    params = params_()
    cfg, ev = common.engine_config(params, which), params.eval
    items = score.load_items(ROOT / ev.file)
    texts = [str(it["answer"]) for it in items]
    result = {"which": which, "model": cfg["model"]["name"], "knobs": cfg, "n": len(items), "method": "140 items",
              "provenance": upstream.provenance(params, cfg)}
    if status == "n/a":
        result.update(status="n/a", reason="dummy weights (load_format: dummy): quality is not measured",
                      label="dummy weights", overall=None, by_category={}, time=common.stage_time(0, 0))
        return json.loads(json.dumps(result))
    summary = score.summarize(items, texts)
    summary.pop("items")
    entry = {"id": "HuggingFaceTB/SmolLM2-135M-Instruct", "sha256": "a" * 64}
    result.update(status="ok", model_id=entry["id"], inputs=eval_stage.inputs(cfg, ev, entry), **summary,
                  wall_s=70.0, generate_s=20.12, output_tokens=4321,
                  engine={"kernels": [], "kv_cache_tokens": 46592, "engine_init_s": 0.4},
                  time=common.stage_time(50.0, 20.12 + 19.8))
    if which == "baseline":
        result["nondeterminism"] = {**score.flips(items, texts, texts[::-1]), "method": eval_stage.RECHECK,
                                    "recheck_s": 19.8}
    return json.loads(json.dumps(result))


@pytest.mark.parametrize("path", LADDERS)
def test_every_eval_an_older_version_wrote_reads_through_the_model(path):
    for name, e in stage_of(path, "eval"):
        rec = EvalResult.model_validate(e)
        assert rec.status == e["status"] and rec.overall == e["overall"] and rec.n == e["n"], name
        assert sorted(rec.by_category) == sorted(e["by_category"]), name
        assert rec.as_rung()["schema_version"] == EvalResult.SCHEMA


@pytest.mark.parametrize("status, which", [("ok", "baseline"), ("ok", "rung"), ("n/a", "rung")])
def test_a_version_1_eval_keeps_every_key_and_value_on_disk(tmp_path, status, which):
    raw = eval_v1(status, which)
    assert "schema_version" not in raw
    rec = EvalResult.model_validate(raw)
    assert rec.status == status and (rec.nondeterminism is not None) is (status == "ok" and which == "baseline")
    rec.save_file(tmp_path / "eval.json")
    again = json.loads((tmp_path / "eval.json").read_text())
    assert keeps(raw, again) and again["schema_version"] == EvalResult.SCHEMA
    assert EvalResult.load_file(tmp_path / "eval.json") == rec


def test_an_eval_field_the_model_does_not_declare_is_refused_by_name():
    raw = eval_v1()
    with pytest.raises(ValidationError, match="overal"):
        EvalResult.model_validate({**raw, "overal": 0.5})
    with pytest.raises(ValidationError, match="acc_"):  # a category's score is closed too
        EvalResult.model_validate({**raw, "by_category": {"math": {"n": 1, "correct": 1, "acc": 1.0, "acc_": 1}}})
    with pytest.raises(ValidationError, match=r"nondeterminism\.flip\s"):  # and rung 0's noise
        EvalResult.model_validate({**raw, "nondeterminism": {**raw["nondeterminism"], "flip": 1}})


def test_the_eval_stage_s_own_writer_round_trips_a_reused_result(tmp_path):
    """eval.reuse: rung 0's result copied for a rung on its inputs, written by the stage and read back whole."""
    base_dir, out = tmp_path / "baseline", tmp_path / "out"
    common.write_text(base_dir / "eval_items.jsonl", "")
    base = EvalResult.model_validate(eval_v1())
    base.save_file(base_dir / "eval.json")
    eval_stage.reuse(base_dir, EvalResult.load_file(base_dir / "eval.json"), out)
    raw = json.loads((out / "eval.json").read_text())
    assert raw["schema_version"] == EvalResult.SCHEMA and raw["reused_from"] == "eval_baseline"
    assert raw["which"] == "rung" and raw["nondeterminism"] is None and raw["overall"] == base.overall
    rec = EvalResult.load_file(out / "eval.json")
    assert eval_stage.reusable(base.inputs.model_dump(mode="json"), base) and rec.inputs == base.inputs
    rec.save_file(tmp_path / "again.json")
    assert json.loads((tmp_path / "again.json").read_text()) == raw


# ---------------------------------------------------------------- report/ladder.json
# every ladder record committed: the older ones (no schema_version) and one of today's schema, the 7ce1c08 record as
# LadderRecord.save_file writes it (its stage records upgraded by their models)
TODAY = "tests/fixtures/ladder_cpu_7ce1c08_v3.json"
V2 = "tests/fixtures/ladder_cpu_7ce1c08_v2.json"  # as version 2 wrote it: knee.noise_floor inside each rung's knee
COMMITTED = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests" / "fixtures").glob("ladder_*.json"))


def test_the_committed_ladders_hold_one_of_today_s_schema_and_older_ones():
    versions = {p: json.loads((ROOT / p).read_text()).get("schema_version", 1) for p in COMMITTED}
    assert versions[TODAY] == LadderRecord.SCHEMA and set(LADDERS) <= set(COMMITTED)
    assert all(versions[p] == 1 for p in LADDERS)


@pytest.mark.parametrize("path", COMMITTED)
def test_every_committed_ladder_reads_through_the_model_and_renders_as_it_did(path, tmp_path):
    """An older record is rendered through the model as it was rendered from the file itself (the report reads the
    upgraded stage records as it read the old keys), and `report.py` renders it from the file."""
    import report
    raw = json.loads((ROOT / path).read_text())
    rec = LadderRecord.load_file(ROOT / path)
    assert len(rec.rungs) == len(raw["rungs"]) and rec.profile == raw["profile"]
    assert [r.name for r in rec.rungs] == [r["name"] for r in raw["rungs"]]
    assert report.render(rec.as_dict(), tmp_path) == report.render(raw, tmp_path)
    report.main(ROOT / path, tmp_path / "out")
    assert (tmp_path / "out" / "before_after.md").read_text() == report.render(raw, tmp_path)


def test_an_older_ladder_is_written_as_today_s_schema_with_the_keys_it_had(tmp_path):
    """The writer keeps the keys the driver set (no null for a field a rung never reached); an older record read and
    written again is today's committed one, which reads and writes as it is."""
    LadderRecord.load_file(ROOT / LADDERS[0]).save_file(tmp_path / "ladder.json")
    today = json.loads((ROOT / TODAY).read_text())
    assert json.loads((tmp_path / "ladder.json").read_text()) == today
    old = json.loads((ROOT / LADDERS[0]).read_text())
    # the same keys, but knee.noise_floor, which sits beside the knee now (knee_noise_floor)
    beside = [{"knee_noise_floor"} if "noise_floor" in (r.get("knee") or {}) else set() for r in old["rungs"]]
    assert [sorted(r) for r in today["rungs"]] == [sorted({*r} | b) for r, b in zip(old["rungs"], beside)]
    LadderRecord.load_file(ROOT / TODAY).save_file(tmp_path / "again.json")
    assert json.loads((tmp_path / "again.json").read_text()) == today


def test_a_rung_s_stage_records_are_the_stages_models():
    rec = LadderRecord.load_file(ROOT / "tests/fixtures/ladder_h200x2_c536b45.json")
    r = rec.rungs[0]
    assert isinstance(r.bench, BenchResult) and isinstance(r.knee, RungKnee)
    assert isinstance(r.eval, EvalResult) and isinstance(r.gate, GateResult)
    assert r.knee.slo.percentile == 99 and r.bench.status == "ok"  # upgraded by their own validators


def test_a_ladder_field_the_model_does_not_declare_is_refused_by_name():
    raw = json.loads((ROOT / TODAY).read_text())
    with pytest.raises(ValidationError, match="verdcit"):
        LadderRecord.model_validate({**raw, "rungs": [{**raw["rungs"][0], "verdcit": "kept"}]})
    with pytest.raises(ValidationError, match="knee_rsp"):  # a rung's stage records are closed too
        LadderRecord.model_validate({**raw, "rungs": [{**raw["rungs"][0],
                                                       "knee": {**raw["rungs"][0]["knee"], "knee_rsp": 1.0}}]})
    with pytest.raises(ValidationError, match="finsihed"):
        LadderRecord.model_validate({**raw, "finsihed": None})


# ---------------------------------------------------------------- results/fingerprint.json
@pytest.mark.parametrize("path", LADDERS)
def test_every_fingerprint_an_older_version_wrote_reads_through_the_model(path, tmp_path):
    """A ladder's environment is measure.host.fingerprint() of its version, what that version's fingerprint stage
    wrote: read and written again it keeps its keys and values (a GPU without uuid or index, no host_id, no
    machine), and the provenance and the ladder record see it as it was written."""
    old = json.loads((ROOT / path).read_text())["environment"]
    assert "schema_version" not in old
    (tmp_path / "fingerprint.json").write_text(json.dumps(old))
    rec = Fingerprint.load_file(tmp_path / "fingerprint.json")
    assert rec.schema_version == Fingerprint.SCHEMA and rec.as_environment() == old
    assert rec.machine_id == (old.get("machine") or {}).get("id") and rec.gpu_list() == old["gpus"]
    rec.save_file(tmp_path / "again.json")
    assert json.loads((tmp_path / "again.json").read_text()) == {**old, "schema_version": Fingerprint.SCHEMA}
    # an older experiment's file, as dvc.api.read returns it to the ladder's replay
    assert Fingerprint.model_validate_json(json.dumps(old)).machine_id == rec.machine_id


def test_the_fingerprint_stage_s_record_round_trips_and_the_engine_stages_read_it(tmp_path, monkeypatch):
    fp = host.fingerprint()
    fp["gpus"] = [{"index": "0", "name": "NVIDIA H200", "memory_mib": 143771, "driver": "570.1", "uuid": "GPU-1"}]
    out = tmp_path / "fingerprint.json"
    Fingerprint.model_validate(fp).save_file(out)  # as scripts/fingerprint.py main writes it
    raw = json.loads(out.read_text())
    assert list(raw) == [*fp, "schema_version"] and raw == {**fp, "schema_version": Fingerprint.SCHEMA}
    rec = Fingerprint.load_file(out)
    assert rec.machine_id == fp["machine"]["id"] and rec.gpu_list() == fp["gpus"]
    rec.save_file(tmp_path / "again.json")
    assert json.loads((tmp_path / "again.json").read_text()) == raw
    monkeypatch.setattr(common, "_SIDE", tmp_path)  # the engine stages read it where it was written
    params = params_()
    assert upstream.provenance(params)["environment"] == fp  # as written, no schema version
    assert upstream.target_gpus(params) is None  # no target card: nothing read
    with pytest.raises(ValidationError, match="gpus"):
        Fingerprint.model_validate({**fp, "gpus": "NVIDIA H200"})


# the two files as the code before their models wrote them (no schema_version): the fingerprint stage's as committed
# at 1d5f421 (results/ held it then), the download stage's as main at 6d888b3 wrote it (results/models.json was never
# committed): a workspace or an older experiment holds such files, and the engine stages must still read them
OLD_FINGERPRINT, OLD_MANIFEST = "tests/fixtures/fingerprint_1d5f421.json", "tests/fixtures/models_6d888b3.json"


def test_a_fingerprint_json_of_the_previous_format_loads(tmp_path, monkeypatch):
    old = json.loads((ROOT / OLD_FINGERPRINT).read_text())
    assert "schema_version" not in old and "machine" not in old  # written before machines were named
    rec = Fingerprint.load_file(ROOT / OLD_FINGERPRINT)
    assert rec.schema_version == Fingerprint.SCHEMA and rec.as_environment() == old
    assert rec.machine_id is None and rec.gpu_list() == [] and rec.cpu is not None and rec.cpu.cores == 2
    (tmp_path / "fingerprint.json").write_text((ROOT / OLD_FINGERPRINT).read_text())
    monkeypatch.setattr(common, "_SIDE", tmp_path)  # the engine stages read it where it lies
    assert upstream.provenance(params_())["environment"] == old


# ---------------------------------------------------------------- results/models.json
def manifest_v1(tmp_path):
    """A manifest as scripts/download.py main wrote it before the record was typed: each entry as
    model_store.provide gave it (a local model's `files`, no other's)."""
    folder = tmp_path / "built"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text("{}")
    return {"store": str(tmp_path), "models": {
        "built": {"name": "built", "source": "pypi-gguf", "path": str(folder), "id": "pkg==1:m.gguf",
                  "revision": "b" * 64, "sha256": "c" * 64},
        "shape": {"name": "shape", "source": "shape", "path": str(tmp_path / "shape"), "id": "shape of x",
                  "revision": None, "sha256": "d" * 64},
        "mine": {"name": "mine", "source": "local", "path": str(tmp_path / "mine"), "id": "local:mine",
                 "revision": "e" * 12, "sha256": "e" * 64, "files": {"config.json": "f" * 64}}}}


def test_a_version_1_manifest_keeps_every_key_and_value_on_disk(tmp_path, monkeypatch):
    old = manifest_v1(tmp_path)
    (tmp_path / "models.json").write_text(json.dumps(old))
    rec = ModelsManifest.load_file(tmp_path / "models.json")
    assert rec.schema_version == ModelsManifest.SCHEMA and rec.entries() == old["models"]
    rec.save_file(tmp_path / "again.json")
    assert json.loads((tmp_path / "again.json").read_text()) == {**old, "schema_version": ModelsManifest.SCHEMA}
    bare = {"models": {"built": old["models"]["built"]}}  # one written without its store (tests, older code)
    (tmp_path / "models.json").write_text(json.dumps(bare))
    assert ModelsManifest.load_file(tmp_path / "models.json").store is None
    monkeypatch.setattr(common, "_SIDE", tmp_path)  # the engine stages read it where it was written
    assert upstream.model_entry("built") == old["models"]["built"]
    with pytest.raises(common.ParamsError, match="not a model the download stage provides"):
        upstream.model_entry("other")
    with pytest.raises(ValidationError, match="path"):
        ModelsManifest.model_validate({"models": {"x": {"name": "x"}}})


def test_the_download_stage_s_own_writer_round_trips(tmp_path, monkeypatch):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"weights")
    raw_params = config.read_params(ROOT / "params.yaml")
    raw_params["download"] = {**raw_params["download"], "store": str(tmp_path / "store"), "fetch": ["mine"],
                              "catalog": {"mine": {"source": "local", "path": str(folder)}}}
    monkeypatch.setattr(common, "stage_setup", lambda: None)  # no chdir, no signal handlers in the test process
    monkeypatch.setattr(common, "read_params", lambda: raw_params)
    out = tmp_path / "models.json"
    download_stage.main(out)
    raw = json.loads(out.read_text())
    assert list(raw) == ["store", "models", "schema_version"] and raw["schema_version"] == ModelsManifest.SCHEMA
    entry = raw["models"]["mine"]
    assert list(entry) == ["name", "source", "path", "id", "revision", "sha256", "files"]
    assert entry["path"] == str(folder) and set(entry["files"]) == {"config.json", "model.safetensors"}
    rec = ModelsManifest.load_file(out)
    rec.save_file(tmp_path / "again.json")
    assert json.loads((tmp_path / "again.json").read_text()) == raw
    monkeypatch.setattr(common, "_SIDE", tmp_path)
    prov = upstream.provenance(params_(), {"model": {"name": "mine"}})
    assert prov["model"] == {k: entry[k] for k in ("name", "id", "revision", "sha256", "source")}


def test_a_models_json_of_the_previous_format_loads(tmp_path, monkeypatch):
    old = json.loads((ROOT / OLD_MANIFEST).read_text())
    assert "schema_version" not in old
    rec = ModelsManifest.load_file(ROOT / OLD_MANIFEST)
    assert rec.schema_version == ModelsManifest.SCHEMA and rec.store == old["store"]
    assert rec.entries() == old["models"] and list(rec.entries()["mine"]) == list(old["models"]["mine"])
    rec.save_file(tmp_path / "models.json")
    assert json.loads((tmp_path / "models.json").read_text()) == {**old, "schema_version": ModelsManifest.SCHEMA}
    monkeypatch.setattr(common, "_SIDE", tmp_path)  # the engine stages read it where it lies
    shape = old["models"]["qwen2.5-7b-shape"]
    prov = upstream.provenance(params_(), {"model": {"name": "qwen2.5-7b-shape"}})
    assert prov["model"] == {k: shape[k] for k in ("name", "id", "revision", "sha256", "source")}
