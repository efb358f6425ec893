"""The knee stage's probe loop on a synthetic server: which rates it offers, what it records, and that no two
calls re-send the same prompts (one seed for all let the prefix cache serve later probes: 66 % hits on the
H200). The probe client is a stand-in writing vLLM-shaped result JSON; the real path runs in the e2e tests."""
import json
import math
import os
import time
import types

import pytest

import config
import knee
from records.bench import BenchResult
from runner import knee_looks

# the knee section as the stage gets it: validated, the model's defaults filled (timeouts, min_rate), and the
# workload the stage adds (workload.prepare)
K = {**config.Knee.model_validate({
    "mode": "search", "start_rate": 4, "max_rate": 256, "rel_tol": 0.2, "max_probes": 10, "probe_seconds": 10,
    "min_prompts": 8, "max_prompts": 600, "backlog_ratio": 0.8,
    "busy_share": None}).model_dump(),  # the box's other work re-looks nothing here (tests/test_disturbed.py: it does)
    "workload": {"kind": "random", "input_len": 64, "output_len": 64}}
SLO = {"percentile": 99, "ttft_ms": 500, "tpot_ms": 50}
CAPACITY = 23.0  # req/s where the synthetic server's TTFT crosses the SLO


class FakeServer:
    """No server: /metrics does not answer (a look's watcher reads no queue and no histogram: nothing is bound), and
    its API-server process is this one."""
    url = "http://127.0.0.1:1"
    title_prefix = "VLLM"  # engine.Server.title_prefix: vLLM's own
    proc = types.SimpleNamespace(pid=os.getpid())

    def alive(self):
        return True

    def metrics(self, timeout: float = 10) -> str:
        raise ConnectionRefusedError("no server")


class FakeProber:
    """Writes what `vllm bench serve --save-detailed` writes: summary figures and per-request lists."""

    def __init__(self):
        self.calls = []

    def __call__(self, argv, timeout, what, watch=None):
        a = {f: argv[i + 1] for i, f in enumerate(argv[:-1]) if f.startswith("--")}  # flag -> the token after it
        rate, n = float(a["--request-rate"]), int(a["--num-prompts"])
        self.calls.append({"rate": rate, "n": n, "seed": a["--seed"], "what": what,
                           "detailed": "--save-detailed" in argv, "concurrency": a.get("--max-concurrency")})
        ttft = 0.1 * (1 + 4 * (rate / CAPACITY) ** 8)  # flat, then a wall: 500 ms at CAPACITY
        starts = [1000 + i / rate for i in range(n)]
        if watch:  # as vllm_compat.watched_serve: completions in the order they end; no arrival after a True
            for i in range(n):
                if watch({"start": starts[i], "ttft": ttft, "end": starts[i] + ttft + 63 * 0.02, "ok": True,
                          "tpot": 0.02}, 1000):
                    starts = [t for t in starts if t <= starts[i] + ttft + 63 * 0.02]
                    break
        n = len(starts)
        result = {"completed": n, "failed": 0, "request_throughput": rate * 0.97, "output_throughput": rate * 60,
                  "request_goodput": rate, "duration": n / rate,
                  "start_times": starts, "ttfts": [ttft] * n,
                  "itls": [[0.02] * 63] * n, "output_lens": [64] * n, "errors": [""] * n,
                  "generated_texts": ["x"] * n}
        for p in (50, 90, 99):
            result.update({f"p{p}_ttft_ms": ttft * 1000, f"p{p}_tpot_ms": 20.0, f"p{p}_itl_ms": 20.0,
                           f"p{p}_e2el_ms": 1400.0})
        out = a["--result-dir"] + "/" + a["--result-filename"]
        with open(out, "w") as f:
            json.dump(result, f)


def test_search_brackets_the_synthetic_knee_and_every_call_has_its_own_seed(tmp_path):
    prober, srv = FakeProber(), FakeServer()
    knee_looks.warm_up(prober, srv, "model", K, SLO, tmp_path)
    rows, probes = knee_looks.sweep(prober, srv, "model", K, SLO, tmp_path)
    res = knee.probing.knee_result(probes, rel_tol=K["rel_tol"])
    lo, hi = res["last_pass_rps"], res["first_fail_rps"]
    assert lo <= CAPACITY < hi and res["resolved"]
    assert len(rows) == len(probes) <= K["max_probes"]
    seeds = [c["seed"] for c in prober.calls]
    assert len(seeds) == len(set(seeds)) == len(probes) + 1  # warm-up + probes, no seed twice (repeats included)
    assert len((tmp_path / "sweep.log").read_text().splitlines()) == len(probes)  # each probe logged as it ends
    # every probe holds enough requests for a p99 (300 counted after the ramp-up and the settle), however low its rate
    assert all(c["n"] >= 334 and c["detailed"] for c in prober.calls[1:])
    assert all(r["counted"] >= 300 and r["needed"] == 300 and r["settled"] for r in rows if r["passed"])
    # an overloaded probe fails on evidence, and stops sending once enough broke the SLO to fail it
    assert all(r["evidence"] == "fail" for r in rows if not r["passed"])
    assert all(r["stopped_early"] and r["sent"] < r["num_prompts"] for r in rows if not r["passed"])
    assert all(not r["stopped_early"] and r["sent"] == r["num_prompts"] for r in rows if r["passed"])
    slim = json.loads((tmp_path / "probe-01-4rps.json").read_text())  # the per-token lists are not kept
    assert "itls" not in slim and "generated_texts" not in slim and len(slim["requests"]) == rows[0]["sent"]


def test_a_whole_overloaded_look_fails_on_evidence_also_where_its_latency_outran_its_window(tmp_path):
    class WholeLooks(FakeProber):  # a look that never stops early: it counts its second half
        def __call__(self, argv, timeout, what, watch=None):
            super().__call__(argv, timeout, what)
    rows, _ = knee_looks.sweep(WholeLooks(), FakeServer(), "model", K, SLO, tmp_path)
    assert all(r["evidence"] == "fail" for r in rows if not r["passed"])
    assert any(not r["settled"] for r in rows if not r["passed"])


def test_the_server_pass_sends_its_prompts_at_once_after_the_search_and_only_when_asked(tmp_path):
    prober, srv = FakeProber(), FakeServer()
    assert knee_looks.server_pass(prober, srv, "model", K, SLO, tmp_path) is None and not prober.calls  # 0: none
    got = knee_looks.server_pass(prober, srv, "model", {**K, "server_pass_prompts": 32}, SLO, tmp_path)
    assert prober.calls == [{"rate": float("inf"), "n": 32, "seed": "20000", "what": "vllm bench serve (server pass)",
                             "detailed": True, "concurrency": None}]
    assert got["requests"] == got["completed"] == 32 and got["output_tps"] > 0
    assert "generated_texts" not in json.loads((tmp_path / "server_pass.json").read_text())  # slimmed as a look's


def test_the_search_starts_from_the_bench_estimate_and_falls_back_to_start_rate():
    assert knee.start_rate(K, BenchResult(status="ok", requests_per_s=30.01))[0] == 15
    assert knee.start_rate(K, BenchResult(status="n/a"))[0] == 4
    assert knee.start_rate(K, None)[0] == 4
    assert knee.start_rate({**K, "max_rate": 10}, BenchResult(status="ok", requests_per_s=300))[0] == 10
    # knee.start_steps applies to a start from the bench's estimate only
    near = {**K, "start_steps": 4}
    assert knee.start_rate(near, BenchResult(status="ok", requests_per_s=30.01))[2] == 4
    assert knee.start_rate(near, None)[2] == 0
    assert knee.start_rate(K, BenchResult(status="ok", requests_per_s=30))[2] == 0


def test_the_batch1_probe_sends_one_request_at_a_time_with_its_own_seed(tmp_path):
    prober = FakeProber()
    one = knee_looks.batch1(prober, FakeServer(), "model", K, SLO, tmp_path)
    call = prober.calls[-1]
    assert one["requests"] == 3 and one["tpot_ms"] == 20.0
    assert call["n"] == 3 and call["concurrency"] == "1" and call["seed"] == "10000"
    assert knee_looks.batch1(prober, FakeServer(), "model", {**K, "batch1_requests": 0}, SLO, tmp_path) is None


def test_watched_serve_stops_arrivals_once_watch_says_so_and_restores_vllms_module():
    import asyncio
    import types

    from serving import vllm_compat

    class Out:  # vLLM's RequestFuncOutput, as far as the watch reads it
        def __init__(self, start):
            self.start_time, self.ttft, self.itl, self.output_tokens, self.error = start, 0.6, [0.01] * 9, 10, ""

    async def request(request_func_input, session=None, pbar=None):
        return Out(time.perf_counter())

    async def get_request(input_requests, request_rate, burstiness=1.0, ramp_up_strategy=None,
                          ramp_up_start_rps=None, ramp_up_end_rps=None, self_timed=False):
        for r in input_requests:
            yield r, request_rate

    serve = types.SimpleNamespace(ASYNC_REQUEST_FUNCS={"openai": request}, get_request=get_request)

    async def benchmark():  # as vLLM's: a test request, then the run; both look their functions up when they run
        fn = serve.ASYNC_REQUEST_FUNCS["openai"]
        await fn("test")
        return [await fn(r) async for r, _ in serve.get_request(list(range(20)), 1.0)]

    seen = []

    def watch(req, t0):
        seen.append(req)
        return len(seen) >= 5
    with vllm_compat.watched_serve(serve, watch):
        outs = asyncio.run(benchmark())
    assert len(outs) == len(seen) == 5  # the test request is not the run's; nothing sent after the 5th
    assert seen[0]["ttft"] == 0.6 and seen[0]["tpot"] == pytest.approx(0.01) and seen[0]["ok"]
    assert serve.ASYNC_REQUEST_FUNCS["openai"] is request and serve.get_request is get_request




class _Out:  # vLLM's RequestFuncOutput, as far as the watch and the benchmark read it
    def __init__(self, start=0.0):
        self.start_time, self.ttft, self.itl, self.output_tokens = start, 0.05, [0.01] * 9, 10
        self.success, self.error, self.prompt_len = True, "", 0


def _serve(request):
    """vLLM's bench serve module as far as watched_serve meets it: its request functions, its arrival generator, the
    output type."""
    async def get_request(input_requests, request_rate, *a, **kw):
        for r in input_requests:
            yield r, request_rate
    return types.SimpleNamespace(ASYNC_REQUEST_FUNCS={"openai": request}, get_request=get_request,
                                 RequestFuncOutput=_Out)


def _looked(waits: list[float], reach: list[float], stop_after: int, cut: bool = True):
    """vLLM's `benchmark` as far as the watch meets it: a test request, then one asyncio task per arrival (none
    waits for another), all gathered; request i takes waits[i] s and is past the SLO's reach after reach[i] s in
    flight. The watch says stop at the `stop_after`-th completion. Returns (outputs, seconds, the waits of the
    requests cancelled inside the request function)."""
    import asyncio

    from serving import vllm_compat
    cancelled = []

    async def request(request_func_input, session=None, pbar=None):
        start = time.perf_counter()
        try:
            await asyncio.sleep(request_func_input.wait)
        except asyncio.CancelledError:
            cancelled.append(request_func_input.wait)
            raise
        return _Out(start)

    serve = _serve(request)

    async def benchmark():
        fn = serve.ASYNC_REQUEST_FUNCS["openai"]
        await fn(types.SimpleNamespace(prompt_len=1, wait=0.0, reach=0.0))
        tasks = []
        arrivals = [types.SimpleNamespace(prompt_len=3, wait=w, reach=r) for w, r in zip(waits, reach)]
        async for r, _ in serve.get_request(arrivals, 1.0):
            tasks.append(asyncio.create_task(serve.ASYNC_REQUEST_FUNCS["openai"](request_func_input=r)))
            await asyncio.sleep(0.01)
        return await asyncio.gather(*tasks)
    done = []

    def watch(req, t0):
        done.append(req)
        return len(done) >= stop_after
    t = time.perf_counter()
    with vllm_compat.watched_serve(serve, watch, (lambda inp: inp.reach) if cut else None):
        outs = asyncio.run(benchmark())
    return outs, time.perf_counter() - t, cancelled


def test_a_stopped_look_cuts_what_is_in_flight_past_the_slos_reach_and_waits_for_the_rest():
    """The third completion makes the fail certain: the request in flight past its reach (over the SLO whatever it
    does next) is cancelled at once (its connection closes: the server aborts it) and answered as a failed output
    marked CUT; the young one is waited for; the benchmark ends with it (~1 s), not after the old one's 5 s.
    Without cutting, everything finishes."""
    from serving import vllm_compat
    waits, reach = [5.0, 1.0, 0.2, 0.2, 0.2], [0.1, 100.0, 100.0, 100.0, 100.0]
    outs, took, cancelled = _looked(waits, reach, 3)
    assert 0.9 < took < 2.5 and cancelled == [5.0], (took, cancelled)
    cut = [o for o in outs if o.error == vllm_compat.CUT]
    assert len(cut) == 1 and not cut[0].success and cut[0].prompt_len == 3 and cut[0].start_time > 0
    assert len(outs) == 5 and sum(o.success for o in outs) == 4
    r = vllm_compat._request(cut[0].start_time, None, None, 0, cut[0].error)
    assert r["cut"] and not r["ok"] and knee.probing.over_slo(r, SLO)  # counted over the SLO, as it certainly is
    outs, took, cancelled = _looked(waits, reach, 3, cut=False)
    assert took >= 5.0 and not cancelled and all(o.success for o in outs)


def test_the_benchmark_cancelled_from_outside_is_not_answered_for():
    """Cancelling vLLM's benchmark itself (a timeout, Ctrl-C) propagates through the watch: no request is turned
    into a CUT output that the benchmark would go on with."""
    import asyncio

    from serving import vllm_compat

    async def request(request_func_input, session=None, pbar=None):
        await asyncio.sleep(10)

    serve = _serve(request)

    async def benchmark():
        async for r, _ in serve.get_request([types.SimpleNamespace(prompt_len=1)], 1.0):
            return await asyncio.wait_for(serve.ASYNC_REQUEST_FUNCS["openai"](request_func_input=r), 0.1)
    with vllm_compat.watched_serve(serve, lambda req, t0: True, lambda inp: 0.0), pytest.raises(TimeoutError):
        asyncio.run(benchmark())


def test_a_request_is_past_the_slos_reach_after_ttft_plus_its_tokens_at_tpot():
    stop = knee_looks.Curtail(4.0, 100, K, {**SLO, "ttft_ms": 1000, "tpot_ms": 200}, [])
    # with 10 % and 0.1 s to spare (the watch's clock starts before vLLM's; a stream ends after its last token)
    assert stop.certain_s(types.SimpleNamespace(output_len=32)) == pytest.approx((1 + 31 * 0.2) * 1.1 + 0.1)
    assert stop.certain_s(types.SimpleNamespace(output_len=1)) == pytest.approx(1.0 * 1.1 + 0.1)


def test_a_cut_look_row_counts_its_cut_requests_over_the_slo_and_not_as_failures():
    from measure import frontend
    reqs = [{"start": 1000 + i * 0.1, "ttft": 0.1, "end": 1000.5 + i * 0.1, "ok": True, "tpot": 0.01}
            for i in range(60)]
    reqs += [{"start": 1006 + i * 0.1, "ttft": None, "end": 1006 + i * 0.1, "ok": False, "tpot": None, "cut": True}
             for i in range(40)]
    row = knee_looks.row_from({"completed": 60, "failed": 40, "duration": 20.0}, reqs, 10.0, 100, K, SLO)
    assert row["cut"] == 40 and row["failed"] == 0 and row["sent"] == 100
    assert 0 < row["over_slo"] <= 40  # the ok ones met the SLO: what is over is cut
    row.update(stopped_early=True)
    assert "40 then in flight past the SLO's reach cut, counted over it" in knee_looks.sent_words(row)
    fe = frontend.look({"ttft_start": {1.0: 0, math.inf: 0}, "ttft_stop": {1.0: 90, math.inf: 100}}, reqs, 1000)
    assert fe["server_counted"] is None and "cut in flight" in fe["server_reason"]


def test_cut_requests_count_over_the_slo_but_owe_no_first_token():
    """A cut request is over the SLO for certain, but whether it had its first token is unknown: a look whose cut
    ones were decoding (TPOT bound, no queue) must not read a backlog from them, and its count holds them over."""
    from measure import probing
    slo = {"ttft_ms": 1000, "tpot_ms": 200}
    ok = [{"start": i * 0.1, "ttft": 0.1, "end": i * 0.1 + 0.5, "ok": True, "tpot": 0.01} for i in range(100)]
    cut = [{**r, "ttft": None, "ok": False, "tpot": None, "cut": True} if i % 3 == 0 and i >= 50 else r
           for i, r in enumerate(ok)]
    a, b = probing.tail_stats(ok, 90, 0.1, 0.8, slo), probing.tail_stats(cut, 90, 0.1, 0.8, slo)
    n_cut = sum(1 for r in cut if r.get("cut"))
    assert a["over_slo"] == 0 and b["over_slo"] > 0 and b["counted"] == a["counted"]
    assert not b["backlog"] and b["window_arrivals"] == a["window_arrivals"] - n_cut
    failed = [{**r, "cut": False} for r in cut]  # the same requests failed, not cut: owed their first tokens
    assert probing.tail_stats(failed, 90, 0.1, 0.8, slo)["backlog"]


def test_a_look_above_the_rates_probed_is_sized_on_its_latency_rising_toward_the_wall():
    # the cpu's rung 0 (one search): 5.657 req/s ran 1.145 s, 8 ran 1.356, 11.31 failed with a backlog at 2.855
    rows = [{"offered_rps": 5.657, "e2e_p50_s": 1.145}, {"offered_rps": 11.31, "e2e_p50_s": 2.855, "backlog": True},
            {"offered_rps": 8.0, "e2e_p50_s": 1.356}]
    # above the rates probed, scaled by the rates' ratio (1.613; the line through 5.657 and 8 gives 1.492): it ran
    # 1.389, and sized on 8's 1.356 alone it counted 150 where a pass needed 151
    scaled = 1.356 * 9.514 / 8.0
    assert knee_looks.e2e_estimate(rows, 1.131, 9.514) == pytest.approx(scaled) and scaled > 1.389
    assert knee_looks.e2e_estimate(rows, 1.131, 8.0) == 1.356  # measured there: the longest at or below
    assert knee_looks.e2e_estimate(rows[:1], 1.131, 8.0) == pytest.approx(1.145 * 8.0 / 5.657)  # ran 1.356
    # none: the warm-up's, padded
    assert knee_looks.e2e_estimate([], 1.131, 11.31) == pytest.approx(1.131 * knee_looks.WARM_PAD)
    # a queue's latency is neither scaled nor draws a line (11.31's backlog): but it is the longest seen below 13.45
    assert knee_looks.e2e_estimate(rows, 1.131, 13.45) == 2.855
    # latency that fell gives no slope below zero, and the nearest below is scaled
    assert knee_looks.e2e_estimate([{"offered_rps": 4.0, "e2e_p50_s": 1.2}, {"offered_rps": 5.657, "e2e_p50_s": 1.1}],
                                   None, 8.0) == pytest.approx(1.1 * 8.0 / 5.657)
    # the H100 check ladder's rung 0 (6d888b3): its warm-up met 1.90 s, 19.03 req/s 2.56 (496 counted of ~547
    # planned), 26.91 ~3.5 (412 counted, sized by 19.03's 2.56): each estimate now at least what the look met
    assert knee_looks.e2e_estimate([], 1.90, 19.03) >= 2.56
    h100 = [{"offered_rps": 19.03, "e2e_p50_s": 2.56}, {"offered_rps": 19.03, "e2e_p50_s": 2.431},
            {"offered_rps": 38.05, "e2e_p50_s": 7.759, "backlog": True}]
    scaled = 2.56 * 26.91 / 19.03
    assert knee_looks.e2e_estimate(h100, 1.90, 26.91) == pytest.approx(scaled) and scaled > 3.5
    # the base's latency at a rate (run.anchor.latency) sizes a rung's look there: the H100 rungs' first look at
    # their base's pass, sized by the warm-up's 1.9 s where the base had met 3.4-3.8 s, counted too few to pass
    known = [[26.91, 3.775], [13.45, 2.074]]
    assert knee_looks.e2e_estimate([], 1.9, 26.91, known) == 3.775
    assert knee_looks.e2e_estimate([], 1.9, 26.9100001, known) == 3.775  # the grid's rounding
    # a rate the base did not pass (its first fail, 32, where a rung looks first): its latency below, scaled
    assert knee_looks.e2e_estimate([], 1.9, 32.0, known) == pytest.approx(3.775 * 32.0 / 26.91)
    assert knee_looks.e2e_estimate([{"offered_rps": 26.91, "e2e_p50_s": 4.1}], 1.9, 26.91, known) == 4.1  # the longest
    # what a stopped look waits before it counts its fail (Curtail): the latency seen, never extrapolated upward
    assert knee_looks.e2e_estimate(h100, 1.90, 26.91, upward=False) == 2.56
    assert knee_looks.e2e_estimate([], 1.9, 32.0, known, upward=False) == 1.9
    assert knee_looks.e2e_estimate(rows, 1.131, 9.514, upward=False) == pytest.approx(1.356 + 0.211 / 2.343 * 1.514)
    # sized on the known latency, the first look plans the ~547 counted a pass needs (it counted 344-402 on 1.9 s)
    k = {"probe_seconds": 20, "ramp_fraction": 0.1, "min_prompts": 16, "max_prompts": 2000, "settle_latencies": 3,
         "tail_latencies": 1, "dispersion": {"phi": 6.9}, "max_repeats": 2}
    short, right = (knee_looks.prompts_for(26.91, k, {"percentile": 95}, e) for e in (1.9, 3.775))
    assert right - short == pytest.approx(26.91 * 4 * (3.775 - 1.9), abs=1.5)
    assert (right - 26.91 * 4 * 3.4) >= 497  # met at 3.4 s, the window still counts what a pass needs (phi 6.9)
