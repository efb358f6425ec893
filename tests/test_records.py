"""The stage records (scripts/records/): each result file written and read through its model only; records an older
version of the code wrote read through the model's validators."""
import ast
import json

import pytest
from pydantic import ValidationError

import common
import knee as knee_stage
from conftest import ROOT
from records.knee import KneeResult, RungKnee

# the two older ladders: records an older version of the code wrote (7ce1c08, c536b45), kept as fixtures
LADDERS = ["tests/fixtures/ladder_cpu_7ce1c08.json", "tests/fixtures/ladder_h200x2_c536b45.json",
           "tests/fixtures/ladder_cpu.json", "tests/fixtures/ladder_gpu_shape.json"]
IO = {"read_json", "write_json", "load", "loads", "dump", "dumps", "read_text", "write_text"}


def knees_of(path):
    lad = json.loads((ROOT / path).read_text())
    return [(r["name"], r["knee"]) for r in lad["rungs"] + ((lad.get("confirm") or {}).get("runs") or [])
            if r.get("knee")]


def test_knee_json_is_written_and_read_only_through_its_model():
    """No script outside records/ opens results/knee.json as JSON itself: the knee stage writes it by
    KneeResult.save_file, the ladder record reads it by KneeResult.load_file."""
    found = []
    for f in sorted((ROOT / "scripts").rglob("*.py")):
        if f.parent.name == "records":
            continue
        src = f.read_text()
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) in IO:
                args = [ast.get_source_segment(src, a) or "" for a in node.args]
                if any("knee.json" in a for a in args) or (f.name == "knee.py" and args[:1] == ["out"]):
                    found.append(f"{f.relative_to(ROOT)}:{node.lineno}")
    assert not found, found


@pytest.mark.parametrize("path", LADDERS)
def test_every_knee_an_older_version_wrote_reads_through_the_model(path):
    for name, k in knees_of(path):  # each as a rung of the ladder record holds it (with knee.noise_floor)
        rec = RungKnee.model_validate(k)
        assert rec.knee_rps == k["knee_rps"] and rec.status == k["status"] and len(rec.rows) == len(k["rows"]), name
        assert rec.summary()["schema_version"] == KneeResult.SCHEMA


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
    params = common.load_params(ROOT / "params.yaml", check=False)
    out = tmp_path / "knee.json"
    knee_stage.write_na(out, tmp_path / "knee.csv", tmp_path / "logs", "why not", common.BENCH_ONLY, params,
                        common.engine_config(params))
    raw = json.loads(out.read_text())
    assert raw["schema_version"] == KneeResult.SCHEMA and raw["status"] == "n/a" and raw["label"] == common.BENCH_ONLY
    assert "noise_floor" not in raw  # a judgement threshold: the ladder record's, not the stage's
    rec = KneeResult.load_file(out)
    assert rec.reason == "why not" and rec.knee_rps is None and rec.slo.percentile == params["slo"]["percentile"]
    again = tmp_path / "again.json"
    rec.save_file(again)
    assert json.loads(again.read_text()) == raw
