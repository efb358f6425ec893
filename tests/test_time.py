"""Where the ladder's time goes: each stage's split (common.stage_time), a rung's split with its DVC overhead
(record.time_split), the ladder's GPU-minutes, start share and cost (record.time_totals), and the report's Time
section rendered from a synthetic ladder record."""
import json
import re

import pytest

import common
import report
from conftest import FIXTURES
from judgement import record
from records.ladder import LadderRecord
from serving import model_store, vllm_compat

EXAMPLE = common.ROOT / "report/examples/h100-check-ed2b51a/ladder.json"


def stage(wall, start, measure):
    return {"wall_s": wall, "start_s": start, "measure_s": measure, "other_s": wall - start - measure}


def rung(index, name, seconds, gpus=None, status="ok", reused=(), **stage_time):
    return {"index": index, "name": name, "role": "rung", "status": status, "seconds": seconds, "gpus": gpus,
            "reused": list(reused),
            "stage_seconds": {s: t["wall_s"] for s, t in stage_time.items()}, "stage_time": stage_time}


def ladder(*rungs, device="gpu", price=4.0):
    return {"profile": "gpu-shape", "environment": {"device": device}, "wall_seconds": 700.0,
            "settings": {"cost": {"gpu_price_per_hour": price}, "bench": {"num_prompts": 32}}, "rungs": list(rungs)}


def time_lines(lad: dict) -> list[str]:
    return report.time_lines(LadderRecord.model_validate(lad))


def test_stage_time_puts_what_is_not_start_or_measure_in_other():
    t = common.stage_time(0.0, 0.0)
    assert t["wall_s"] > 0 and t["other_s"] == t["wall_s"]  # this process has run for a while: imports at least
    big = common.stage_time(1e6, 0.0)  # a start longer than the process: other is never negative
    assert big["other_s"] == 0.0 and big["start_s"] == 1e6


def test_process_seconds_count_from_the_process_start_not_from_a_later_call():
    a = common.process_seconds()
    b = common.process_seconds()
    assert 0 < a <= b


def test_bench_timing_reads_the_lines_run_throughput_prints():
    log = ("INFO 11-30 12:00:00 [llm.py:1] loading\n[timing] engine ready at 1000.500\nWarm-up pass 1/1 (untimed): "
           "10.0 output tokens/s\n[timing] warm-up and timed passes took 12.250 s\n")
    assert vllm_compat.bench_timing(log, spawned=990.0) == {"start_s": 10.5, "measure_s": 12.25}
    assert vllm_compat.bench_timing("no timing here", spawned=990.0) == {"start_s": None, "measure_s": None}


def test_rung_split_sums_its_stages_and_the_rest_is_dvc_overhead():
    r = rung(0, "baseline", 300.0, eval=stage(40, 25, 10), bench=stage(80, 30, 45), knee=stage(120, 35, 80),
             eval_baseline=stage(40, 25, 10))
    t = record.time_split(r)
    assert (t["start_s"], t["measure_s"], t["other_s"]) == (115.0, 145.0, 20.0)
    assert t["dvc_s"] == 300.0 - 280.0 and t["gpus"] == 1 and not t["estimated"]


def test_stages_dvc_restored_cost_the_rung_nothing_but_dvc_time():
    r = rung(1, "fp8-kv", 210.0, reused=["download", "eval_baseline", "bench"], eval=stage(40, 25, 10),
             bench=stage(80, 30, 45), knee=stage(120, 35, 80))
    r["stage_seconds"]["eval_baseline"] = 40
    t = record.time_split(r)
    assert t["start_s"] == 60.0 and t["measure_s"] == 90.0 and t["dvc_s"] == 210.0 - 160.0


def test_a_rung_that_failed_is_not_split():
    t = record.time_split(rung(2, "awq", 95.0, status="failed"))
    assert t["other_s"] == 95.0 and t["start_s"] == t["measure_s"] == t["dvc_s"] == 0


def test_an_older_record_is_split_from_the_knee_server_start_and_marked_estimated():
    r = rung(0, "baseline", 100.0)
    r["stage_seconds"] = {"knee": 90.0}
    r["knee"] = {"server_ready_s": 30.0, "wall_s": 90.0}
    t = record.time_split(r)
    assert t["estimated"] and t["start_s"] == 30.0 and t["measure_s"] == 60.0 and t["dvc_s"] == 10.0


def test_totals_weigh_each_rung_by_its_gpus_and_price_them():
    one = rung(0, "baseline", 600.0, gpus=1, knee=stage(540, 300, 200))
    two = rung(1, "tp2", 300.0, gpus=2, knee=stage(240, 60, 150))
    lad = record.annotate_time(ladder(one, two))
    tot = lad["time"]
    assert tot["unit"] == "GPU" and tot["minutes"] == (600 + 2 * 300) / 60
    assert tot["start_minutes"] == (300 + 2 * 60) / 60
    assert tot["start_share"] == pytest.approx((300 + 120) / 1200, abs=1e-3)
    assert tot["dvc_minutes"] == (60 + 2 * 60) / 60
    assert tot["cost_usd"] == pytest.approx(1200 / 3600 * 4.0, abs=0.01)
    assert one["time"]["dvc_s"] == 60.0 and two["time"]["gpus"] == 2
    assert tot["engine_starts"] == 2 and tot["seconds_per_start"] == (300 + 60) / 2  # wall s, not GPU s


def test_a_bench_that_warmed_the_machine_counts_two_engine_starts():
    r = rung(0, "baseline", 400.0, bench=stage(200, 120, 60), knee=stage(150, 50, 90))
    r["bench"] = {"status": "ok", "warm_up_engine": {"output_tps": 6790.0, "wall_s": 60.0}}
    assert record.time_split(r)["starts"] == 3
    assert "3 starts × " in "\n".join(time_lines(record.annotate_time(ladder(r))))


def test_time_section_shows_each_rung_its_split_and_the_totals():
    lad = record.annotate_time(ladder(rung(0, "baseline", 600.0, gpus=1, knee=stage(540, 300, 200)),
                                      rung(1, "tp2", 300.0, gpus=2, knee=stage(240, 60, 150)),
                                      rung(2, "awq", 90.0, gpus=1, status="failed")))
    md = "\n".join(time_lines(lad))
    assert md.startswith("**21.5 GPU-minutes** ≈ **$1.43** at $4.00 per GPU-hour; **33%** of them spent starting")
    row = {m.group(1): m.group(0) for m in re.finditer(r"^\| (\d \w+)\s*\|.*$", md, re.M)}
    assert set(row) == {"0 baseline", "1 tp2", "2 awq"}
    cells = [c.strip() for c in row["1 tp2"].split("|")]
    assert cells[2:9] == ["300 s", "2", "60 s (20%)", "150 s (50%)", "30 s (10%)", "60 s (20%)", "10.0"]
    assert "not split" in row["2 awq"] and "estimated" not in md


def test_time_section_on_a_cpu_box_counts_cpu_minutes_and_says_there_is_no_price():
    lad = record.annotate_time(ladder(rung(0, "baseline", 120.0, knee=stage(100, 20, 70)), device="cpu", price=0))
    md = "\n".join(time_lines(lad))
    assert md.startswith("**2.0 CPU-minutes** (no price: cost.gpu_price_per_hour is 0); **17%**")
    assert "CPU-minutes: wall × CPUs held" in md


def test_a_record_without_the_split_keeps_the_stage_seconds_lines(tmp_path):
    lad = json.loads((FIXTURES / "ladder_cpu.json").read_text())
    md = report.render(lad, tmp_path)
    time = md.split("## Time")[1]
    assert "measured engine time" in time and "0 baseline: " in time


def built(tmp_path):
    """A model folder the store would hold: two files and the marker finish() writes."""
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text('{"a": 1}')
    (folder / "model.safetensors").write_bytes(b"w" * 1000)
    spec = {"source": "quantize", "from": "x"}
    model_store.finish(folder, spec, {"id": "m", "revision": "r"})
    return folder, spec


def test_an_unchanged_model_folder_is_trusted_by_its_stamps_and_a_changed_file_is_hashed_again(tmp_path):
    folder, spec = built(tmp_path)
    assert model_store.verify("m", folder, spec)["id"] == "m"
    weights = folder / "model.safetensors"
    weights.write_bytes(b"x" * 1000)  # same size, new content: the mtime tells it apart
    with pytest.raises(model_store.ModelError, match="model.safetensors is corrupt"):
        model_store.verify("m", folder, spec)


def test_a_marker_from_before_the_stamps_is_hashed_once_then_stamped(tmp_path):
    folder, spec = built(tmp_path)
    marker = folder / model_store.MARKER
    info = json.loads(marker.read_text())
    del info["stamps"]
    marker.write_text(json.dumps(info))
    assert model_store.verify("m", folder, spec)["sha256"] == info["sha256"]
    assert set(json.loads(marker.read_text())["stamps"]) == {"config.json", "model.safetensors"}


def test_the_confirm_step_s_minutes_count_in_the_totals_and_per_stack():
    lad = ladder(rung(0, "baseline", 600.0, gpus=1, knee=stage(540, 300, 200)))
    runs = [{**rung(3, f"confirm-{k}-{w}", s, knee=stage(s - 60, 100, s - 200)), "knobs": {}}
            for k, w, s in ((1, "baseline", 300.0), (1, "final", 240.0), (2, "final", 240.0), (2, "baseline", 300.0))]
    lad["confirm"] = {"pairs": 2, "runs": runs}
    tot = record.annotate_time(lad)["time"]
    assert tot["minutes"] == (600 + 2 * 300 + 2 * 240) / 60 and tot["engine_starts"] == 5
    assert tot["confirm"] == {"runs": 4, "minutes": 18.0, "per_stack": {"stock": 10.0, "final": 8.0}}
    md = "\n".join(time_lines(lad))
    assert ("The confirm step: 4 runs (2 pair(s)), **18.0 GPU-minutes**: 10.0 re-measuring stock (rung 0), 8.0 the "
            "final stack.") in md
    assert re.search(r"^\| 3 confirm-2-final\s*\| 240 s", md, re.M)


def test_the_pre_flight_and_the_driver_are_counted_so_the_rows_add_up_to_the_wall_time():
    """An H100 check ladder's Time section said 23.0 GPU-minutes and a wall of 23.2 where `make ladder` took 24.3
    (a 52 s pre-flight and the driver between experiments were in no row), and its headline 21.4 (the engine stages
    alone): one total, every row in it."""
    lad = ladder(rung(0, "baseline", 400.0, gpus=1, knee=stage(300, 100, 150)),
                 rung(1, "placebo", 200.0, gpus=1, knee=stage(150, 50, 80)))
    lad.update(wall_seconds=630.0, preflight_seconds=60.0, environment={"device": "gpu", "gpus": [{"index": 0}]})
    tot = record.annotate_time(lad)["time"]
    assert tot["preflight_minutes"] == 1.0 and tot["driver_minutes"] == 0.5  # 630 - (400 + 200) s
    assert tot["minutes"] == (60 + 630) / 60 and tot["cost_usd"] == pytest.approx(690 / 3600 * 4.0, abs=0.01)
    md = "\n".join(time_lines(lad))
    walls = [int(m.group(1)) for m in re.finditer(r"^\| [^|]+\| (\d+) s\s*\|", md, re.M)]
    assert sum(walls) == 690 and len(walls) == 4, walls
    assert "ladder wall time 11.5 min (the pre-flight's 1.0 included)." in md


def test_the_outside_rows_give_their_wall_seconds_not_minutes_rounded_back():
    """The H100 check ladder's pre-flight took 52 s: from its device-minutes (0.9, rounded) the row read 54 s, so the
    wall column missed the wall time by seconds a row."""
    lad = ladder(rung(0, "baseline", 400.0, gpus=1, knee=stage(300, 100, 150)),
                 rung(1, "placebo", 200.0, gpus=1, knee=stage(150, 50, 80)))
    lad.update(wall_seconds=627.4, preflight_seconds=52.4, environment={"device": "gpu", "gpus": [{"index": 0}]})
    tot = record.annotate_time(lad)["time"]
    assert (tot["preflight_s"], tot["driver_s"]) == (52.4, 27.4) and tot["preflight_minutes"] == 0.9
    md = "\n".join(time_lines(lad))
    assert re.search(r"^\| pre-flight[^|]*\| 52 s\s*\|", md, re.M)
    assert re.search(r"^\| between[^|]*\| 27 s\s*\|", md, re.M)


def test_two_gpus_held_count_twice_outside_the_experiments_too():
    lad = ladder(rung(0, "baseline", 300.0, gpus=2, knee=stage(200, 100, 80)))
    lad.update(wall_seconds=330.0, preflight_seconds=30.0,
               environment={"device": "gpu", "gpus": [{"index": 0}, {"index": 1}]})
    tot = record.annotate_time(lad)["time"]
    assert tot["minutes"] == 2 * (300 + 30 + 30) / 60 and tot["preflight_minutes"] == 1.0


def test_a_record_from_before_the_pre_flight_was_counted_has_no_outside_rows():
    lad = record.annotate_time(ladder(rung(0, "baseline", 600.0, gpus=1, knee=stage(540, 300, 200))))
    assert "preflight_minutes" not in lad["time"] and "pre-flight" not in "\n".join(time_lines(lad))


def test_the_headline_gives_the_time_sections_total():
    """The H100 check ladder's report (report/examples/): its headline said 21.4 GPU-minutes (the engine stages) and
    its Time section 23.0: a reader takes one of them for the cost."""
    lad = LadderRecord.load_file(EXAMPLE)
    assert lad.time is not None
    total = f"{lad.time.minutes:.1f} GPU-minutes in all (Time) ≈ ${lad.time.cost_usd:.2f}"
    assert total in report.headline(lad)
    assert f"**{lad.time.minutes:.1f} GPU-minutes**" in "\n".join(report.time_lines(lad))


def test_output_tok_s_through_the_knee_s_server_is_set_beside_the_bench_engine_s():
    lad = LadderRecord.load_file(EXAMPLE)
    assert not report.server_pass_lines(lad)  # the check ladder at ed2b51a sent none
    rung = lad.rungs[3]
    assert rung.knee is not None and rung.bench is not None and rung.bench.output_tps
    rung.knee.server_pass = {"requests": 1024, "completed": 1024, "output_tps": rung.bench.output_tps * 0.97,
                             "duration_s": 38.0}
    (line,) = report.server_pass_lines(lad)
    assert line.startswith(f"- **Through the server** ({rung.exp}): ") and "(-3.0%; one pass each)" in line
    assert line in "\n".join(report.floor_lines(lad))


def test_a_start_only_warm_up_engine_is_named_with_its_seconds():
    """bench.warm_up_passes 0 (the gpu profiles): the warm-up engine runs no pass, so it has no tok/s to set beside
    the timed engine's; the report still says it ran and what it cost."""
    lad = LadderRecord.load_file(EXAMPLE)  # the H100 check ladder at ed2b51a: its warm-up engine only started
    bench = lad.rungs[0].bench
    assert bench is not None and bench.warm_up_engine is not None
    md = "\n".join(report.floor_lines(lad))
    assert "**Warm-up engine**" in md and "output tok/s vs the timed" not in md
    assert "started only, to fill the machine's compile cache (65 s; bench.warm_up_passes 0)" in md
    # one with a pass (the cpu profile) sets its tok/s beside the timed engine's instead
    bench.warm_up_engine = bench.warm_up_engine.model_copy(update={"output_tps": 6500.0, "passes": 1, "wall_s": 125.0})
    assert "output tok/s vs the timed" in "\n".join(report.floor_lines(lad))
