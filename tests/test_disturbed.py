"""A disturbed measurement is named, not judged on (measure/disturbed.py): a timed bench repeat far off its engine's
others is replaced by one more and kept out of the median; a knee look while other work kept the machine busy is looked
at again on its trace; the report lists both. The rules on numbers, the bench's repeat loop on vLLM's own throughput
module (its main stands in: no engine starts), the knee's look on the synthetic server of test_knee_sweep, and the CPU
watch on this machine's own /proc."""
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

import bench
import config
import report
from conftest import FIXTURES
from measure import disturbed
from records.ladder import LadderRecord
from runner import knee_looks
from serving import vllm_compat
from test_knee_sweep import SLO, FakeProber, FakeServer
from test_knee_sweep import K as KNEE

PARAMS = config.load_params()
B = PARAMS.bench  # the cpu profile's: far_share 0.2, extra_repeats 2, repeats 3
FLOOR_CV = B.noise_floor.cv


# ---------------------------------------------------------------- the far rule
def test_the_far_rule_flags_52_among_175_and_181_and_the_next_repeat_replaces_it():
    s = disturbed.screen([175.0, 52.0, 181.0], 3, B.far_share, B.extra_repeats)
    assert s["more"] and not s["flagged"]  # the worker times one more pass before anything is judged
    s = disturbed.screen([175.0, 52.0, 181.0, 178.0], 3, B.far_share, B.extra_repeats)
    assert not s["more"] and s["clean"] == [0, 2, 3] and s["unreplaced"] is None
    (f,) = s["flagged"]
    assert f["index"] == 1 and f["median"] == 175.0 and f["siblings"] == [0, 2] and f["replaced_by"] == 3
    assert f["off"] == pytest.approx(52 / 175 - 1)


def test_ordinary_spread_is_not_flagged():
    # three repeats within +-3 of the cpu floor's SDs (CV 2.50 % on this box) of each other, and the widest spreads
    # the 2-core box's own ladders read inside one engine (13 % off their median at most)
    lo, hi = 178 * (1 - 3 * FLOOR_CV), 178 * (1 + 3 * FLOOR_CV)
    for values in ([lo, 178.0, hi], [365.45, 390.1, 339.15], [278.2, 318.83, 319.02], [93.25, 102.24, 106.53]):
        s = disturbed.screen(values, 3, B.far_share, B.extra_repeats)
        assert not s["more"] and not s["flagged"] and s["clean"] == [0, 1, 2], values
    assert B.far_share > 6 * FLOOR_CV  # so no spread the floor allows (+-3 SDs about the median) is ever far


def test_two_repeats_cannot_say_which_is_off_and_the_cap_holds():
    assert not disturbed.screen([175.0, 52.0], 2, 0.2, 2)["more"]  # their median is their mean: no sibling to trust
    # a machine that stays busy: every replacement reads far too; after extra_repeats the last far one stays, named
    s = disturbed.screen([175.0, 52.0, 181.0, 60.0, 58.0], 3, 0.2, 2)
    assert not s["more"] and [f["index"] for f in s["flagged"]] == [1, 3]
    assert s["unreplaced"]["index"] == 4 and s["clean"] == [0, 2, 4]
    assert disturbed.screen([175.0, 52.0, 181.0], 3, None, 2) == {"clean": [0, 1, 2], "flagged": [], "more": False,
                                                                  "unreplaced": None}


def test_the_far_rule_false_flags_about_one_engine_in_a_hundred_at_the_boxs_own_spread():
    """Simulated (fixed seed): three repeats of one engine, normal about their mean. At the 2-core box's in-engine
    spread (robust SD 5.9 % over its two ladders' 39 repeats) 0.9 % of engines get a repeat replaced (one pass more);
    at the cpu floor's 2.50 % none do; a repeat read at 0.5x (another engine on the pinned core) or at 0.3x (the ~52 of
    ~175) is flagged every time, at 0.7x in 92 %."""
    rng = np.random.default_rng(0)

    def share(sd: float, slow: float | None = None, n: int = 20_000) -> float:
        hits = 0
        for _ in range(n):
            v = list(175 * (1 + sd * rng.standard_normal(3)))
            if slow:
                v[rng.integers(3)] *= slow
            hits += disturbed.screen(v, 3, B.far_share, B.extra_repeats)["more"]
        return hits / n
    assert share(FLOOR_CV) == 0.0
    assert 0.004 < share(0.059) < 0.015
    assert share(0.059, 0.3, 2000) == share(0.059, 0.5, 2000) == 1.0
    assert share(0.059, 0.7, 2000) > 0.85


# ---------------------------------------------------------------- the busy rule: a repeat's measured other work
BUSY = {"wall_s": 8.0, "cores": 2, "other_cpu_s": 8.0, "steal_s": 0.0, "ours_cpu_s": 8.2, "share": 0.5}
QUIET = {"wall_s": 8.0, "cores": 2, "other_cpu_s": 0.8, "steal_s": 0.0, "ours_cpu_s": 8.2, "share": 0.05}


def test_one_repeat_run_busy_is_replaced_by_the_next_and_a_quiet_one_is_not():
    """A single timed repeat (bench.repeats 1) has no siblings to be far from: its own measured other work is the one
    screen it can have. Over busy_share it is flagged and one more pass replaces it; at or under, it stands."""
    assert disturbed.screen([480.0], 1, 0.2, 2, [QUIET], 0.25) == {"clean": [0], "flagged": [], "more": False,
                                                                   "unreplaced": None}
    assert disturbed.screen([480.0], 1, 0.2, 2, [{**QUIET, "share": 0.25}], 0.25)["flagged"] == []  # not over
    assert disturbed.screen([330.0], 1, 0.2, 2, [BUSY], 0.25)["more"]  # the worker times one more pass
    s = disturbed.screen([330.0, 505.0], 1, 0.2, 2, [BUSY, QUIET], 0.25)
    assert not s["more"] and s["clean"] == [1] and s["unreplaced"] is None
    (f,) = s["flagged"]
    assert f["index"] == 0 and f["replaced_by"] == 1 and f["busy"] == BUSY
    assert f["median"] is None and f["off"] is None and f["siblings"] == []
    # a machine that stays busy: after extra_repeats the last busy one stays, named
    s = disturbed.screen([330.0, 340.0, 320.0], 1, 0.2, 2, [BUSY] * 3, 0.25)
    assert not s["more"] and [f["index"] for f in s["flagged"]] == [0, 1] and s["unreplaced"]["index"] == 2
    assert s["clean"] == [2]
    # no busy_share, or no load measured (an older record): nothing is flagged for load
    assert disturbed.screen([330.0], 1, 0.2, 2, [BUSY], None)["flagged"] == []
    assert not disturbed.screen([330.0], 1, 0.2, 2, [None], 0.25)["more"]


def test_a_busy_repeat_among_three_is_replaced_though_its_siblings_are_near():
    """Three repeats near each other, one run busy: the measured cause flags it (the far rule would not); a repeat both
    far and busy is flagged once, for its load, with its distance kept."""
    s = disturbed.screen([478.0, 470.0, 481.0, 480.0], 3, 0.2, 2, [QUIET, BUSY, QUIET, QUIET], 0.25)
    assert s["clean"] == [0, 2, 3] and [f["index"] for f in s["flagged"]] == [1]
    s = disturbed.screen([175.0, 52.0, 181.0, 178.0], 3, 0.2, 2, [None, BUSY, None, None], 0.25)
    (f,) = s["flagged"]
    assert f["busy"] == BUSY and f["median"] == 178.0 and f["off"] == pytest.approx(52 / 178 - 1)


def test_the_bench_records_a_busy_single_repeat_and_judges_on_its_replacement():
    b = B.model_copy(update={"repeats": 1})
    runs = runs_of([330.0, 505.0], {0: BUSY, 1: QUIET})
    got = bench.figures(runs, b)
    assert got["output_tps_runs"] == [505.0] and got["output_tps"] == 505.0 and got["timed_passes"] == 2
    assert got["busy_share"] == 0.25 and runs[0]["disturbed"] == "run busy: replaced, not in the median"
    (f,) = got["disturbed"]
    assert f["busy"] is True and f["median"] is None and f["replacement"] == 505.0 and f["siblings"] == []
    assert f["why"] == ("it ran while other work took 50% of the machine's 2 cores over its 8 s (8.0 CPU-s), over "
                        "bench.busy_share 25%")
    assert "a repeat run while other work held more than 25% of the machine's cores is replaced" in bench.method(
        b, "engine")
    assert "off the median" not in bench.method(b, "engine")  # one repeat: no far rule to state
    assert "1 timed repeat inside one engine" in bench.method(b, "engine")
    assert "the one repeat's figures (no interval inside one engine)" in bench.method(b, "engine")
    three = bench.method(B, "engine")
    assert "3 timed repeats" in three and "95 % t-interval of the repeats" in three


def stand_in_engine(monkeypatch, reads: list[float], shares: list[float]):
    """vLLM's own throughput module and parser with its main and the engine standing in (no engine starts): each
    timed pass reads the next of `reads` tok/s; the returned watch class reads the next of `shares` (other work)."""
    throughput = vllm_compat.import_throughput()
    tps, load = iter(reads), iter(shares)

    class Out:
        prompt_token_ids = [0] * 64
        outputs = [type("C", (), {"token_ids": [0] * 32})()]

    def passes(llm, requests, n, disable_detokenize, do_profile, prequeue_requests, enable_lora):  # vLLM's own
        # parameters (vllm_compat checks them); a pass of 10 requests x 32 tokens at the next tok/s
        return 320 / next(tps), [Out()] * 10

    class LLM:
        @classmethod
        def from_engine_args(cls, engine_args):
            return cls()

        def reset_prefix_cache(self):
            pass

    class Watch:
        def stop(self):
            return {"share": next(load), "cores": 2}

    import vllm
    monkeypatch.setattr(vllm, "LLM", LLM)
    monkeypatch.setattr(throughput, "_run_vllm_requests", passes)
    monkeypatch.setattr(throughput, "main", lambda args: throughput.run_vllm(
        list(range(10)), 1, type("EngineArgs", (), {"enable_lora": False})(), False))
    return Watch


def test_the_in_engine_loop_times_one_more_pass_for_a_busy_single_repeat(monkeypatch, capsys):
    """As the far-rule loop test below: one timed repeat, its pass read while the stand-in watch says the machine was
    busy, so the loop times one more; the second reads quiet and the loop stops."""
    Watch = stand_in_engine(monkeypatch, [330.0, 505.0, 999.0], [0.5, 0.05, 0.05])
    more = lambda done, loads: disturbed.screen(done, 1, 0.2, 2, loads, 0.25)["more"]  # noqa: E731
    vllm_compat.run_throughput(["--model", "m", "--num-prompts", "10"], 1, 0, more=more, watch=Watch)
    text = capsys.readouterr().out
    assert [r["output_tps"] for r in vllm_compat.parse_output(text)] == [330.0, 505.0]
    assert vllm_compat.pass_loads(text) == {1: {"share": 0.5, "cores": 2}, 2: {"share": 0.05, "cores": 2}}


# ---------------------------------------------------------------- the bench stage
def runs_of(values, loads=None):
    return [{"output_tps": v, "total_tps": 1.5 * v, "requests_per_s": v / 32, "load": (loads or {}).get(i)}
            for i, v in enumerate(values)]


def test_a_replaced_repeat_is_kept_in_the_results_but_not_in_the_median_or_interval():
    quiet = {"wall_s": 78.0, "cores": 2, "other_cpu_s": 15.6, "steal_s": 0.0, "ours_cpu_s": 54.6, "share": 0.1}
    runs = runs_of([175.0, 52.0, 181.0, 178.0], {1: quiet})
    got = bench.figures(runs, B)
    assert got["output_tps_runs"] == [175.0, 181.0, 178.0] and got["output_tps"] == 178.0
    assert got["output_tps_ci95"][0] > 170 and got["repeats"] == 3 and got["timed_passes"] == 4
    assert got["total_tps"] == 1.5 * 178.0
    assert [r["output_tps"] for r in runs] == [175.0, 52.0, 181.0, 178.0]  # nothing measured is lost
    assert runs[1]["disturbed"].startswith("far off the others: replaced") and "disturbed" not in runs[0]
    (f,) = got["disturbed"]
    assert f["repeat"] == 2 and f["output_tps"] == 52.0 and f["siblings"] == [175.0, 181.0]
    assert f["replaced_by"] == 4 and f["replacement"] == 178.0 and f["load"] == quiet and "busy" not in f
    assert "-70% off the median 175.0 of its engine's repeats" in f["why"] and "bench.far_share 20%" in f["why"]
    plain = bench.figures(runs_of([175.0, 178.0, 181.0]), B)
    assert plain["disturbed"] == [] and plain["output_tps_runs"] == [175.0, 178.0, 181.0]


def test_the_in_engine_loop_times_one_more_pass_for_a_far_one_and_prints_each_passs_load(monkeypatch, capsys):
    """vllm_compat.run_throughput's timed loop with the bench worker's hooks: vLLM's own module and parser, its main
    and the engine standing in (no engine starts); each pass's tok/s is what the stand-in engine is told to read."""
    Watch = stand_in_engine(monkeypatch, [175.0, 52.0, 181.0, 178.0, 999.0], [0.5] * 5)
    more = lambda done, loads: disturbed.screen(done, 3, 0.2, 2, loads)["more"]  # noqa: E731 -- as throughput.worker
    vllm_compat.run_throughput(["--model", "m", "--num-prompts", "10"], 3, 0, more=more, watch=Watch)
    text = capsys.readouterr().out
    assert vllm_compat.timed_passes(text) == 4  # 3, and one for the far one; never the fifth
    assert [r["output_tps"] for r in vllm_compat.parse_output(text)] == [175.0, 52.0, 181.0, 178.0]
    assert "[repeat 4/3, again: one was far off the others or ran busy] Throughput" in text
    assert vllm_compat.pass_loads(text) == {i: {"share": 0.5, "cores": 2} for i in (1, 2, 3, 4)}


# ---------------------------------------------------------------- the knee stage
def test_the_busy_rule_flags_a_look_with_other_work_above_the_threshold_and_not_below():
    share = PARAMS.knee.busy_share
    assert disturbed.busy({"share": 0.6}, share) and disturbed.busy({"share": share + 0.01}, share)
    assert not disturbed.busy({"share": 0.1}, share) and not disturbed.busy({"share": share}, share)
    assert not disturbed.busy(None, share) and not disturbed.busy({"share": 0.9}, None)


def test_a_busy_look_is_kept_aside_and_looked_at_again_on_its_trace(tmp_path, monkeypatch):
    loads = iter([0.6, 0.05])  # the first look ran while other work held 60 % of the cores; the second on a quiet box

    class Watch:
        def __init__(self, also=()):
            self.share = next(loads, 0.0)

        def stop(self):
            return {"wall_s": 40.0, "cores": 2, "other_cpu_s": 80 * self.share, "steal_s": 0.0, "ours_cpu_s": 60.0,
                    "share": self.share}
    monkeypatch.setattr(disturbed, "CpuWatch", Watch)
    prober, k = FakeProber(), {**KNEE, "busy_share": 0.25}
    rows: list[dict] = []
    row = knee_looks.probe(prober, FakeServer(), "model", k, SLO, tmp_path, 4.0, rows)
    assert [c["seed"] for c in prober.calls] == [prober.calls[0]["seed"]] * 2  # the same trace twice
    assert [c["n"] for c in prober.calls] == [prober.calls[0]["n"]] * 2
    assert row["relooked"] and row["other_work_share"] == 0.05 and not row.get("busy_again")
    d = row["disturbed_look"]
    assert d["other_work_share"] == 0.6 and d["counted"] and d["file"] == "probe-01-4rps-disturbed.json"
    assert (tmp_path / d["file"]).exists() and (tmp_path / "probe-01-4rps.json").exists()  # both kept
    # a look that runs busy again is judged anyway, and says so; a quiet one is not looked at twice
    monkeypatch.setattr(disturbed, "CpuWatch", lambda also=(): type("W", (), {"stop": lambda self: {
        "wall_s": 40.0, "cores": 2, "other_cpu_s": 60.0, "steal_s": 0.0, "ours_cpu_s": 60.0, "share": 0.75}})())
    again = knee_looks.probe(prober, FakeServer(), "model", k, SLO, tmp_path, 4.0, rows)
    assert again["busy_again"] and again["disturbed_look"]["other_work_share"] == 0.75 and len(prober.calls) == 4
    monkeypatch.setattr(disturbed, "CpuWatch", lambda also=(): type("W", (), {"stop": lambda self: None})())
    quiet = knee_looks.probe(prober, FakeServer(), "model", k, SLO, tmp_path, 4.0, rows)
    assert "disturbed_look" not in quiet and len(prober.calls) == 5


def test_a_search_judges_the_clean_look_and_keeps_the_busy_one_in_its_row(tmp_path, monkeypatch):
    first = [True]

    class Watch:  # the search's first look only ran while the machine was busy
        def __init__(self, also=()):
            self.busy, first[0] = first[0], False

        def stop(self):
            return {"wall_s": 40.0, "cores": 2, "other_cpu_s": 60.0 if self.busy else 1.0, "steal_s": 0.0,
                    "ours_cpu_s": 60.0, "share": 0.75 if self.busy else 0.0125}
    monkeypatch.setattr(disturbed, "CpuWatch", Watch)
    rows, probes = knee_looks.sweep(FakeProber(), FakeServer(), "model", {**KNEE, "busy_share": 0.25}, SLO, tmp_path)
    assert len(rows) == len(probes) and rows[0]["disturbed_look"]["other_work_share"] == 0.75
    assert [r for r in rows[1:] if r.get("disturbed_look")] == []
    assert "a second look on its trace" in (tmp_path / "sweep.log").read_text().splitlines()[0]


# ---------------------------------------------------------------- the CPU watch, on this machine
def spin(seconds: float) -> float:
    """Burn this process's CPU for about `seconds` of it; returns the CPU seconds burnt."""
    t0 = time.process_time()
    while time.process_time() - t0 < seconds:
        pass
    return time.process_time() - t0


def test_the_cpu_watch_counts_another_process_tree_and_not_its_own():
    # rooted at an idle child, this process's spinning is other work; rooted at this process, it is its own. Lower
    # bounds only: the box's other work adds to both figures
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        w = disturbed.CpuWatch(idle.pid)
        burnt = spin(disturbed.MIN_WALL_S)  # CPU time never outruns the wall: the look is long enough for a share
        got = w.stop()
    finally:
        idle.kill()
        idle.wait()
    assert got["cores"] == len(os.sched_getaffinity(0))
    assert got["other_cpu_s"] >= 0.7 * burnt and got["share"] > 0
    w = disturbed.CpuWatch()
    burnt = spin(0.5)
    got = w.stop()
    assert got["ours_cpu_s"] >= 0.9 * burnt
    assert disturbed.CpuWatch().stop()["share"] is None  # too short to tell


@pytest.mark.serial  # reads CPU use: alone, not beside the unit tests
def test_the_cpu_watch_counts_a_tree_it_is_also_given_as_its_own_and_each_process_once():
    """A knee server forked from the ladder's launcher is not the stage's descendant: named in `also`, its CPU is ours,
    not other work; named and a descendant too, it is counted once."""
    spin_forever = "import time\nwhile True:\n    time.process_time()"
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    server = subprocess.Popen([sys.executable, "-c", spin_forever])
    try:
        time.sleep(0.3)  # it spins
        apart = disturbed.CpuWatch(idle.pid, also=(server.pid,))  # rooted elsewhere, the server named
        twice = disturbed.CpuWatch(also=(server.pid,))  # rooted here (the server is our child) and named again
        time.sleep(1.5)
        a, t = apart.stop(), twice.stop()
    finally:
        for p in (idle, server):
            p.kill()
            p.wait()
    assert a["ours_cpu_s"] >= 0.7 * a["wall_s"]  # one core's spinning, ours
    assert t["ours_cpu_s"] <= 1.3 * t["wall_s"]  # once, not twice


# ---------------------------------------------------------------- the report
def disturbed_lines(lad: dict) -> list[str]:
    return report.disturbed_lines(LadderRecord.model_validate(lad))


def test_the_report_words_its_bench_figures_and_screens_by_the_repeats_it_ran():
    """One timed pass an engine (the GPU profiles'): no far screen ran and no interval inside an engine exists, so the
    Disturbed section's opening and the appendix's tok/s words claim neither; three passes: both."""
    lad = LadderRecord.model_validate(json.loads((FIXTURES / "ladder_cpu.json").read_text()))
    bench_of = lad.settings["bench"]
    for repeats, far, interval in ((1, False, False), (3, True, True)):
        lad.settings["bench"] = {**bench_of, "repeats": repeats, "far_share": 0.2}
        assert ("far off its engine's others" in report.disturbed_intro(lad)) is far, repeats
        assert ("t-interval" in report.tps_words(lad)) is interval, repeats
        assert ("median [95 % CI]" in report.glance_notes(lad)[0]) is interval, repeats  # the first screen's words
    assert report.tps_words(lad).startswith("Output tok/s: median of one engine's repeats")
    lad.settings["bench"] = {**bench_of, "repeats": 1}
    assert report.tps_words(lad).startswith("Output tok/s: one engine's timed pass (no interval inside one engine")


def test_the_report_names_each_disturbed_repeat_and_look_or_says_none_were(tmp_path):
    lad = json.loads((FIXTURES / "ladder_cpu.json").read_text())
    assert disturbed_lines(lad) == ["- not screened: this record predates the screen (bench.far_share, "
                                           "knee.busy_share)"]
    lad["settings"]["bench"]["far_share"], lad["settings"]["knee"]["busy_share"] = 0.2, 0.25
    base, placebo = lad["rungs"][0], lad["rungs"][1]
    for r in lad["rungs"]:
        r.setdefault("bench", {})["far_share"] = 0.2
        r.setdefault("knee", {})["busy_share"] = 0.25
    assert disturbed_lines(lad)[0].startswith("- none: no timed bench repeat was more than 20% off")
    # only the screens that ran are claimed: at one repeat an engine the far one cannot run (the GPU profiles')
    one = {**lad, "settings": {**lad["settings"], "bench": {**lad["settings"]["bench"], "repeats": 1,
                                                             "busy_share": 0.25}}}
    assert disturbed_lines(one) == ["- none: no timed bench repeat ran while other work held more than 25% of the "
                                    "machine's cores, and no knee look ran while other work held more than 25% of "
                                    "the machine's cores"]
    busy = {"wall_s": 78.0, "cores": 2, "other_cpu_s": 101.4, "steal_s": 0.0, "ours_cpu_s": 54.6, "share": 0.65}
    placebo["bench"].update(bench.figures(runs_of([175.0, 52.0, 181.0, 178.0], {1: busy}), B))
    row = base["knee"]["rows"][0]
    row.update(over_slo=2, counted=331, slo_ttft_ms=420.0, achieved_rps=2.8)
    row.update(relooked=True, seed=20_141, disturbed_look={
        **row, "over_slo": 260, "counted": 331, "slo_ttft_ms": 63_000.0, "achieved_rps": 1.98, "busy": busy,
        "other_work_share": 0.65, "file": "probe-01-2rps-disturbed.json"})
    knee_line, bench_line = disturbed_lines(lad)  # rung by rung: the base's knee, then the placebo's bench
    assert bench_line == (f"- **1 {placebo['name']}** bench repeat 2: 52.0 output tok/s (its siblings 175.0, 181.0: "
                          "-71% off their median), run while other work took 65% of the machine's 2 cores over its 78 "
                          "s (101.4 CPU-s), over bench.busy_share 25%; replaced by repeat 4 (178.0): kept in "
                          "bench.json, out of the median and interval")
    assert knee_line == ("- **0 baseline** knee look at 2 req/s (trace seed 20141): ran while other work took 65% of "
                         "the machine's 2 cores over its 78 s (101.4 CPU-s), over knee.busy_share 25%: 260 of 331 "
                         "counted over the SLO, p99 TTFT 63000 ms, achieved 1.98 req/s (kept in knee.json, "
                         "probe-01-2rps-disturbed.json); looked at again on the same trace: 2 of 331 counted over the "
                         "SLO, p99 TTFT 420 ms, achieved 2.80 req/s, judged on that")
    md = report.render(lad, tmp_path)
    assert "## Disturbed measurements" in md and knee_line in md and bench_line in md
