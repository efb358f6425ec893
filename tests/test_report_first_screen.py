"""The report's first screen (issue 55): the headline, the seed's 7-column table and one line a rung, within a screen;
every figure the report held before it is still in the file; the Pareto plot of each rung at its knee."""
import copy
import json
import re

import pytest
import yaml

import report
from conftest import FIXTURES, ROOT
from judgement import decide, stats
from measure import disturbed
from records.ladder import LadderRecord

LADDERS = ["ladder_cpu.json", "ladder_cpu_7ce1c08.json", "ladder_gpu_shape.json", "ladder_h200x2_c536b45.json"]
SEED_HEADER = ["stage", "eval acc", "per-category regressions", "output tok/s", "speedup", "knee req/s @ SLO",
               "kept?"]
# Each fixture as the report rendered it before the first screen (the commit before this file): every figure in it
# must still be in the file.
BEFORE = FIXTURES / "report_before_55"
FIGURE = re.compile(r"[-+−]?\d+(?:[.,]\d+)*")


def load(name: str) -> dict:
    return json.loads((FIXTURES / name).read_text())


def first_screen(md: str) -> list[str]:
    """The lines a reader sees before the evidence: up to the first section heading after the title."""
    lines = md.split("\n")
    return lines[:next(i for i, ln in enumerate(lines) if ln.startswith("## "))]


def seed_table(lines: list[str]) -> list[list[str]]:
    rows = [ln for ln in lines if ln.startswith("|")]
    return [[c.strip() for c in ln.strip("|").split("|")] for ln in rows if not set(ln) <= set("|-")]


def figures(md: str) -> set[str]:
    return {f.replace("−", "-") for f in FIGURE.findall(md)}


@pytest.mark.parametrize("name", LADDERS)
def test_the_first_screen_is_the_headline_the_seed_table_and_one_short_line_a_rung(name, tmp_path):
    lad = load(name)
    md = report.render(lad, tmp_path)
    screen = first_screen(md)
    assert len(screen) <= 40
    assert screen[2] == report.headline(LadderRecord.model_validate(lad))
    table = seed_table(screen)
    assert table[0] == SEED_HEADER and all(len(row) == 7 for row in table)
    assert [row[0] for row in table[1:]] == [f"#{r['index']} {r['name']}" for r in lad["rungs"]]
    why = [ln for ln in screen if ln.startswith("- Rung ")]
    rungs = [r for r in lad["rungs"] if r.get("role") not in (decide.BASELINE, *decide.RE_MEASURES)]
    assert [ln.split(":")[0] for ln in why] == [f"- Rung {r['index']} {r['name']}" for r in rungs]
    assert all(len(ln) - 2 <= report.LINE_WIDTH for ln in why)


def test_the_cpu_ladder_s_first_screen_reads_as_the_seed_and_fits_a_screen(tmp_path):
    md = report.render(load("ladder_cpu.json"), tmp_path)
    screen = first_screen(md)
    assert max(len(ln) for ln in screen if ln.startswith("|")) <= 120
    row = {r[0]: r for r in seed_table(screen)}
    assert row["#3 spend-memory"] == ["#3 spend-memory", "0.425", "math −0.12", "518 [475–549]", "1.29×", "7–8",
                                      "**kept**"]
    assert row["#1 w4a16"][2] == "knowledge −0.38✗ +2"  # worst first, ✗: the gate failed on it, +2 more categories
    assert ("- Rung 3 spend-memory: kept — tok/s +25 % [+17, +33], knee 6 → 7 req/s (within noise) at acc -2.5 pts "
            "vs rung 0") in screen
    assert ("- Rung 1 w4a16: reverted — quality gate failed: knowledge 0.88 → 0.50; knee 6 → 3.5 req/s (worse), "
            "tok/s -31 % [-35, -27] (worse)") in screen
    # an older rule kept a rung on nothing getting worse: its line says so rather than reading as a gain
    assert any(ln.startswith("- Rung 2 fp8-kv: kept — tok/s +2 % [-1, +6] (within noise)")
               and ln.endswith("; kept because nothing measurably got worse") for ln in screen)


@pytest.mark.parametrize("name", LADDERS)
def test_every_figure_the_report_held_before_is_still_in_it(name, tmp_path):
    before = (BEFORE / name.replace(".json", ".md")).read_text()
    now = report.render(load(name), tmp_path)
    assert not figures(before) - figures(now)
    # the long table is the appendix, row for row as it was
    old_table = [ln for ln in before.split("\n") if ln.startswith("|")][:len(load(name)["rungs"]) + 2]
    appendix = now.split("## Appendix: the full table")[1]
    assert all(ln in appendix for ln in old_table)


def test_the_rule_s_words_are_printed_once(tmp_path):
    lad = load("ladder_cpu.json")
    lad["rule"] = decide.RULE
    md = report.render(lad, tmp_path)
    assert md.count(decide.RULE) == 1 and md.count(stats.KNEE_AGAIN_WORDS) == 1
    assert md.count("## What I kept and why") == 1 and "Rule: a rung is kept only when" in md
    # a record whose rule predates the knee re-check still states it, once, in its setup
    old = load("ladder_cpu_7ce1c08.json")
    assert stats.KNEE_AGAIN_WORDS not in old["rule"]
    assert report.render(old, tmp_path).count(stats.KNEE_AGAIN_WORDS) == 1


def test_a_front_end_bound_knee_and_a_disturbed_measurement_are_marked_in_the_table_with_a_footnote(tmp_path):
    lad = load("ladder_cpu.json")
    fe, dist = lad["rungs"][3], lad["rungs"][2]
    fe["knee"].update(frontend_bound_looks=2, frontend_words="this knee is the front end's, not the engine's "
                                                             "(planted); 2 of 5 looks' latency was added outside")
    dist["bench"].update(far_share=0.15, disturbed=[
        {"repeat": 2, "output_tps": 300.0, "siblings": [409.0, 410.0], "off": -0.27, "median": 409.5,
         "replaced_by": 4, "replacement": 408.0, "why": disturbed.far_words(300.0, 409.5, -0.27, 0.15)}])
    screen = first_screen(report.render(lad, tmp_path))
    row = {r[0]: r for r in seed_table(screen)}
    assert row["#3 spend-memory"][5] == "7–8†" and row["#2 fp8-kv"][3] == "409 [393–424]‡"
    assert f"- † {report.FRONT_END_FLAG} (its looks' latency was added outside the engine: What I kept and why): #3" \
        in screen
    assert "- ‡ a measurement flagged disturbed and measured again (Disturbed measurements): #2" in screen


def test_a_bench_engine_that_held_fewer_kv_tokens_than_its_server_is_marked_with_a_footnote(tmp_path):
    # one config, one card: a bench engine's KV cache smaller than its server's came from a cold compile (vLLM issue
    # 54122), and where KV binds its tok/s reads low; equal counts (every committed fixture) are not marked
    lad = load("ladder_cpu.json")
    assert not any(report.short_kv(r) for r in LadderRecord.model_validate(lad).rungs)
    cold, warm = lad["rungs"][2], lad["rungs"][3]
    cold["bench"]["kv_cache_tokens"], cold["knee"]["kv_cache_tokens"] = 104064, 118160
    warm["bench"]["kv_cache_tokens"], warm["knee"]["kv_cache_tokens"] = 117500, 118160  # within KV_SHORT
    screen = first_screen(report.render(lad, tmp_path))
    row = {r[0]: r for r in seed_table(screen)}
    assert row["#2 fp8-kv"][3].endswith("¶") and not row["#3 spend-memory"][3].endswith("¶")
    assert ("- ¶ the bench engine held fewer KV tokens than its own server (a start with no compile cache, vLLM issue "
            "54122): where KV binds its tok/s reads low: #2 (104,064 against 118,160)") in screen


def kept_on_knee(lad: dict, pairs_held: bool) -> dict:
    """ladder_cpu with spend-memory kept on its knee, read better and re-checked on one pair of fresh servers."""
    lad = copy.deepcopy(lad)
    r = lad["rungs"][3]
    first = {"rel": 0.1667, "verdict": "better", "why": "bracket 6–7 → 7–8 req/s", "past": 1.0}
    r["delta"]["knee_rps"] = stats.knee_recheck(first, [
        ([{"offered_rps": 7.0, "visit_verdict": "fail" if pairs_held else "pass", "over_slo": 9, "counted": 40}],
         [{"offered_rps": 7.0, "visit_verdict": "pass", "over_slo": 0, "counted": 40}]),
        ([{"offered_rps": 7.0, "visit_verdict": "fail", "over_slo": 9, "counted": 40}],
         [{"offered_rps": 7.0, "visit_verdict": "pass", "over_slo": 0, "counted": 40}])])
    return lad


def test_a_rung_kept_on_its_knee_names_the_knee_first_and_the_servers_it_held_on(tmp_path):
    lad = LadderRecord.model_validate(kept_on_knee(load("ladder_cpu.json"), pairs_held=True))
    line = report.why_line(lad.rungs[3], lad)
    assert line.startswith("Rung 3 spend-memory: kept — knee 6 → 7 req/s on 3 servers a side, tok/s +25 % [+17, +33] "
                           "(better)")
    lad = LadderRecord.model_validate(kept_on_knee(load("ladder_cpu.json"), pairs_held=False))
    line = report.why_line(lad.rungs[3], lad)
    assert "knee 6 → 7 req/s (read better on one server a side, not on fresh ones) (within noise)" in line


def test_a_failed_rung_s_line_is_cut_to_the_width_and_its_words_stay_in_the_evidence(tmp_path):
    lad = load("ladder_gpu_shape.json")
    r = lad["rungs"][1]
    r["error"] = "knee: vllm serve did not start: " + "; ".join(f"CUDA out of memory on try {i}" for i in range(9))
    r.update(status="failed", verdict="failed", decision=decide.reverted_before_speed(r))
    md = report.render(lad, tmp_path)
    line = next(ln for ln in first_screen(md) if ln.startswith("- Rung 1 "))
    assert len(line) - 2 == report.LINE_WIDTH and line.endswith("…")
    assert line.startswith("- Rung 1 awq-int4: failed → reverted — knee: vllm serve did not start: CUDA out of")
    assert r["error"] in md.split("## What I kept and why")[1]


def test_the_pareto_plot_places_each_rung_at_its_knee_and_marks_the_front(tmp_path):
    lad = load("ladder_cpu.json")
    pts = {p["r"].name: p for p in report.pareto_points(LadderRecord.model_validate(lad))}
    assert set(pts) == {r["name"] for r in lad["rungs"]}  # every rung of this ladder met the SLO somewhere
    base = lad["rungs"][0]
    at = [x for x in base["knee"]["rows"] if x["offered_rps"] == base["knee"]["knee_rps"]][-1]
    assert pts["baseline"]["user"] == pytest.approx(1000 / at["p50_tpot_ms"])
    assert pts["baseline"]["gpu"] == pytest.approx(at["output_tps"])  # a CPU instance: no GPUs to divide by
    assert {n for n, p in pts.items() if p["front"]} == {"batched-tokens-1024", "batched-tokens-2048"}
    for n, p in pts.items():  # the front: nothing serves more on both axes
        dominated = any(q["user"] > p["user"] and q["gpu"] > p["gpu"] for q in pts.values())
        assert p["front"] != dominated, n
    # per GPU on a GPU ladder; a rung with no pass has no point; candidates sharing a number are told apart
    gpu = LadderRecord.model_validate(load("ladder_h200x2_c536b45.json"))
    tp = next(p for p in report.pareto_points(gpu) if p["r"].gpus == 2)
    row = [x for x in tp["r"].knee.rows if x.offered_rps == tp["r"].knee.knee_rps][-1]
    assert tp["gpu"] == pytest.approx(row.output_tps / 2)
    assert sorted(report.rung_ids(gpu).values()) == ["#0", "#1a", "#1b"]
    old = LadderRecord.model_validate(load("ladder_cpu_7ce1c08.json"))
    assert {p["r"].name for p in report.pareto_points(old)} == {"baseline", "spend-memory", "batched-tokens"}
    for name in ("ladder_cpu.json", "ladder_gpu_shape.json"):
        report.plots(load(name), tmp_path)
        assert (tmp_path / "pareto.png").read_bytes()[:4] == b"\x89PNG"


def test_every_plot_the_report_draws_is_an_output_of_its_stage_and_a_dvc_plot(tmp_path):
    report.plots(load("ladder_cpu.json"), tmp_path)
    drawn = {f"report/{p.name}" for p in tmp_path.glob("*.png")}
    assert drawn == {"report/knee.png", "report/rungs.png", "report/pareto.png"}
    dvc = yaml.safe_load((ROOT / "dvc.yaml").read_text())
    outs = {next(iter(o)) if isinstance(o, dict) else o for o in dvc["stages"]["report"]["outs"]}
    plots = {next(iter(p)) if isinstance(p, dict) else p for p in dvc["plots"]}
    assert drawn <= outs and drawn <= plots
    md = report.render(load("ladder_cpu.json"), tmp_path)
    assert all(f"]({p.removeprefix('report/')})" in md for p in drawn)


def test_the_readme_s_kept_why_example_is_the_cpu_fixture_s_line(tmp_path):
    readme = " ".join((ROOT / "README.md").read_text().split())
    quoted = re.search(r'"Rung N: kept — <the figure that decided it> at <quality cost>", e\.g\. `([^`]+)`', readme)
    assert quoted and f"- Rung 3 spend-memory: {quoted.group(1)}" in report.render(load("ladder_cpu.json"), tmp_path)
