"""A rung the quality gate failed is reverted before its speed is looked at, so bench and knee start no engine
for it (gate.measure_failed: false): their results say n/a and why, and every reader of the ladder record
(record, decide, stats, capacity, the report and its plots) says "not measured" instead of a number or a
"knee lost". The stages run for real here, with a failed gate.json; no engine is needed, none may start."""
import csv
import json

import pytest

import bench
import common
import knee
import report
from conftest import FIXTURES
from judgement import capacity, decide, record, stats
from records.gate import gate_failed
from runner import knee_looks
from serving import engine

FAILED = {"keep": False, "gated": True, "verdict": "fail",
          "reasons": ["category knowledge fell 0.880 → 0.500 (...); McNemar: regressed (p=0.0025)"]}


@pytest.fixture
def no_engine(monkeypatch):
    """Any engine start fails the test."""
    def refuse(*a, **k):
        raise AssertionError("an engine was started for a rung whose gate failed")
    monkeypatch.setattr(engine, "run_worker", refuse)
    monkeypatch.setattr(engine, "run", refuse)
    monkeypatch.setattr(engine, "Server", refuse)


def run_stages(tmp_path, monkeypatch, gate: dict) -> dict:
    """bench.main and knee.main as dvc.yaml runs them, on this repo's params.yaml and the given gate result."""
    monkeypatch.chdir(tmp_path)  # stage_start moves to the repo root; the test's cwd comes back afterwards
    res = tmp_path / "results"
    common.write_json(res / "gate.json", gate)
    bench.main(res / "bench.json", res / "logs/bench", res / "gate.json")
    knee.main(res / "knee.json", res / "knee.csv", res / "logs/knee", res / "bench.json", res / "gate.json")
    return {s: common.read_json(res / f"{s}.json") for s in ("bench", "knee")}


def test_a_failed_gate_writes_na_bench_and_knee_without_starting_an_engine(tmp_path, monkeypatch, no_engine):
    out = run_stages(tmp_path, monkeypatch, FAILED)
    for stage, r in out.items():
        assert r["status"] == "n/a" and r["label"] == "gate failed", stage
        assert r["reason"] == ("the quality gate failed (" + str(tmp_path / "results/gate.json") + "): performance "
                               "not measured; set gate.measure_failed: true to measure it")
        assert r["time"]["start_s"] == 0 and r["time"]["measure_s"] == 0 and r["wall_s"] == 0
        assert r["provenance"]["knobs"]  # the knobs it would have measured, as every result states them
        # its declared outputs exist: the logs folder holds only the reason
        assert [p.name for p in (tmp_path / f"results/logs/{stage}").iterdir()] == ["skipped.txt"]
    assert out["bench"]["output_tps"] is None and out["bench"]["output_tps_runs"] == []
    k = out["knee"]
    assert k["knee_rps"] is None and k["first_fail_rps"] is None and k["rows"] == [] and k["probes"] == 0
    with open(tmp_path / "results/knee.csv") as f:  # `dvc plots` reads it: the header, no rows
        assert tuple(next(csv.reader(f))) == tuple(knee_looks.COLUMNS) and not list(f)


def test_only_a_failed_gate_skips_and_the_knob_turns_it_off(tmp_path):
    params, path = common.load_params(), tmp_path / "gate.json"
    assert params.gate.measure_failed is False
    assert gate_failed(params, path) is None  # no gate result yet (a stage run by hand): measure
    for verdict, skipped in (("fail", True), ("pass", False), ("not gated", False)):
        common.write_json(path, {**FAILED, "verdict": verdict})
        assert bool(gate_failed(params, path)) is skipped, verdict
    on = params.model_copy(update={"gate": params.gate.model_copy(update={"measure_failed": True})})
    assert gate_failed(on, path) is None  # measured, though it is reverted either way


def test_a_knee_not_measured_is_unknown_never_lost():
    measured = {"status": "inside", "knee_rps": 4.0, "last_pass_rps": 4.0, "first_fail_rps": 8.0}
    na = {"status": "n/a", "label": "gate failed", "knee_rps": None, "first_fail_rps": None}
    lost = {"status": "below", "knee_rps": None, "first_fail_rps": 1.0}
    assert stats.knee_delta(measured, na) == {"rel": None, "verdict": "unknown", "why": "not measured: gate failed"}
    assert stats.knee_delta(na, measured)["verdict"] == "unknown"
    assert stats.knee_delta(measured, lost)["verdict"] == "worse"  # a measured lost knee still is worse


def test_the_ladder_record_and_report_say_not_measured_for_a_rung_the_gate_failed(tmp_path, monkeypatch, no_engine):
    lad = json.loads((FIXTURES / "ladder_cpu.json").read_text())
    base = lad["rungs"][0]
    rec = next(r for r in lad["rungs"] if r["name"] == "w4a16")  # the fixture's rung the gate reverted
    for key in ("bench", "knee", "delta", "speedup", "decision", "kept", "verdict", "roofline", "applied"):
        rec.pop(key, None)
    run_stages(tmp_path, monkeypatch, rec["gate"])
    res = tmp_path / "results"
    w4 = lad["models"]["smollm2-135m-w4a16"]["path"]  # its eval engine's evidence: the only engine it ran
    common.write_json(res / "eval.json", {**rec["eval"], "engine": {"model_path": w4, "quantization":
                                                                    "compressed-tensors", "kernels": ["CPUWNA16"]}})
    common.write_json(res / "models.json", {"models": lad["models"]})
    common.write_json(res / "fingerprint.json", {"gpus": []})
    monkeypatch.setattr(common, "RESULTS", res)
    record.fill(rec, base, base, common.load_params().model_dump(by_alias=True))
    assert rec["bench"]["status"] == rec["knee"]["status"] == "n/a" and "speedup" not in rec
    # the knee stage's record as it wrote it; the floor the ladder judges it with beside it, never written into it
    assert "noise_floor" not in rec["knee"] and rec["knee_noise_floor"] == common.load_params().knee.noise_floor
    assert rec["delta"]["knee_rps"] == {"rel": None, "verdict": "unknown", "why": "not measured: gate failed"}
    assert rec["delta"]["output_tps"]["verdict"] == "unknown"
    assert rec["delta"]["output_tps"]["why"] == "not measured: gate failed"
    assert rec["stage_time"]["bench"]["start_s"] == rec["stage_time"]["knee"]["start_s"] == 0
    took = next(c for c in rec["applied"] if c["knob"] == "model.name")  # "took effect?" from the eval's engine
    assert took["applied"] is True and took["observed"].startswith("served smollm2-135m-w4a16, quantization=compr")
    rec["kept"], rec["decision"] = decide.decide(rec, base, lad["objective"])
    rec["verdict"] = decide.verdict(rec)
    assert rec["kept"] is False and rec["verdict"] == "reverted"
    assert rec["decision"] == "quality gate failed: " + "; ".join(rec["gate"]["reasons"])
    # capacity: its figures are none, and a plan on its knee says why there is none
    assert capacity.per_gpu(rec, 1) == {"output_tps": None, "knee_rps": None, "first_fail_rps": None}
    plan = capacity.knee_plan(rec, 20, 0.2, 0.0, on_gpu=True)
    assert plan["plan"] == capacity.NO_PLAN and plan["why"] == "not measured: gate failed"
    # the report prints what the record says: no number, no verdict of its own
    rec["seconds"], rec["reused"] = 100.0, []
    record.annotate_time(lad)
    assert lad["rungs"][1]["time"]["start_s"] == 0  # eval's start is not in the fixture; bench and knee started none
    report.plots(lad, tmp_path)
    md = report.render(lad, tmp_path)
    row = next(x for x in md.split("## Appendix")[1].splitlines() if x.startswith("| 1 w4a16"))  # the full table
    cells = [c.strip() for c in row.split("|")]
    assert cells.count("not measured: gate failed") == 2 and "reverted" in cells  # tok/s and knee
    assert "- **w4a16** (`model.name: smollm2-135m-w4a16`): reverted — quality gate failed: " in md
    assert ("  - bench and knee: not measured — the quality gate failed (" + str(res / "gate.json") + "): "
            "performance not measured; set gate.measure_failed: true to measure it") in md
    time_row = next(x for x in md.split("## Time")[1].splitlines() if "1 w4a16" in x)
    assert "(bench, knee: not measured, gate failed)" in time_row
    for png in ("knee.png", "rungs.png"):
        assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG"
