"""The knee's looks at a running `vllm serve`: each look a `vllm bench serve` run in this process (Prober), sized
(prompts_for, e2e_estimate), stopped once its fail is certain (Curtail), read into its row (row_from) and judged by
measure/probing.py's search, visit or re-check (sweep, recheck_looks); the warm-up before them and the batch-1 probe
after. The knee stage measures with them; `make benchmark` (benchmark_noise.py) sends the same looks.
"""
from __future__ import annotations

import contextlib
import csv
import itertools
import threading
from pathlib import Path

import common
from measure import disturbed, frontend, probing
from serving import engine, vllm_compat, watch

PCTS = (50, 90, 99)
METRICS = ("ttft", "tpot", "itl", "e2el")
COLUMNS = (["offered_rps", "num_prompts", "sent", "stopped_early", "cut", "seed", "achieved_rps", "output_tps",
            "goodput_rps", "completed", "failed",
            "counted", "needed", "over_slo", "pooled_counted", "pooled_over", "evidence", "ramp_skipped",
            "window_open_s", "window_close_s", "e2e_p50_s", "settled",
            "slo_ttft_ms", "slo_tpot_ms", "window_arrivals", "window_first_tokens",
            "window_completions", "window_allowance", "backlog", "e2e_over_window", "duration_s"]
           + [f"p{p}_{m}_ms" for m in METRICS for p in PCTS]
           + ["other_work_share", "relooked", "bound", "passed", "why"])


def prompts_for(rate: float, k: dict, slo: dict, e2e_s: float) -> int:
    return probing.probe_prompts(rate, k["probe_seconds"], slo["percentile"], k["ramp_fraction"], k["min_prompts"],
                               k["max_prompts"], e2e_s, k["settle_latencies"], k["tail_latencies"],
                               k["dispersion"]["phi"], k["max_repeats"])


def e2e_estimate(rows: list[dict], warm: float | None, rate: float,
                 known: list | None = None, upward: bool = True) -> float:
    """The end-to-end latency a probe at `rate` is sized by (its settle and tail), before it runs. Measured at
    `rate` (a look there so far, or `known`, run.anchor.latency: [[req/s, s], ...], what the base met at its passing
    rates): the longest there or below. Not measured there, it is extrapolated upward, never taken as flat: latency
    rises with the rate, steeply toward the wall, and a window sized short counts too few to pass (a second look,
    or on a profile of one look a lost pass). So it is at least the nearest latency below scaled by the rates'
    ratio (Little's law at a fixed number of tokens in flight per request; a filling batch only adds), the line
    through the two highest below where that is longer, and with nothing below the warm-up's times WARM_PAD (its
    few requests never filled the server). What each rule would have planned on the looks that came short: an H100
    rung 0 sized 19.03 req/s by its warm-up's 1.90 s and met 2.56 (x1.35: 496 counted of the ~547 planned), then
    26.91 by 19.03's 2.56 and met ~3.5 (412 counted; scaled: 3.62); a cpu rung 0 sized 9.514 by 8's 1.356, ran
    1.389 (150 counted where a pass needs 151; scaled: 1.613, ~8 requests more, ~1 s). Too long costs only a few
    more arrivals before and after the window (rate x (settle + tail) x the excess); too short, a look. Not `upward`
    (what Curtail waits before it counts): the latency seen, as before the look was sized upward, so that a look
    past the wall stops as soon as it did (on the cpu engine tests an upward wait made the knee ~10 % longer)."""
    def near(at: float) -> bool:
        return abs(at / rate - 1) <= probing.GRID_ROUNDING
    here = [r["e2e_p50_s"] for r in rows if r.get("e2e_p50_s") and near(r["offered_rps"])]
    here += [e for at, e in known or () if near(at)]
    longest = max(here + [r["e2e_p50_s"] for r in rows if r.get("e2e_p50_s") and r["offered_rps"] <= rate],
                  default=0.0)
    if here:
        return longest
    points = [(r["offered_rps"], r["e2e_p50_s"]) for r in rows
              if r.get("e2e_p50_s") and not r.get("backlog")]  # a queue's latency is not the server's
    below: dict[float, float] = {}
    for at, e in points + ([(at, e) for at, e in known or ()] if upward else []):
        if at < rate:
            below[at] = max(below.get(at, 0.0), e)
    if not below:
        return max(longest, (warm or 0.0) * (WARM_PAD if upward else 1.0))
    r2 = max(below)
    scaled = below[r2] * rate / r2 if upward else 0.0
    if len(below) < 2:
        return max(longest, scaled)
    (r1, e1), (r2, e2) = sorted(below.items())[-2:]
    return max(longest, scaled, e2 + max(e2 - e1, 0.0) / (r2 - r1) * (rate - r2))


WARM_PAD = 2.0  # the warm-up's latency (knee.warm_up: a few requests at the start rate, the server never full) to
                # a first look's: x1.35 on an H100 rung 0 at 19.03 req/s (1.90 -> 2.56 s); x1.8-2.0 to 26.91. With
                # knee.start_steps the first look is at the knee: an H100's at 26.91 (7731a75), sized at x1.5 for
                # 547 counted, met ~x1.77 (its window left out 367 of 859 arrivals, not 312) and counted 492 where a
                # pass needs 497: a second look, ~45 s. Too long costs rate x (settle + tail) x the excess: ~100
                # arrivals there, ~4 s


def probe_args(url: str, model_path: str, k: dict, slo: dict, rate: float, n: int, out_dir, name: str,
               seed: int) -> list[str]:
    """The `vllm bench serve` arguments of one probe, on the workload `k["workload"]` (as workload.prepare
    made it). Each call of a stage gets its own seed: one seed for all would re-send the same random prompts,
    which the prefix cache then serves (66 % hits on the H200)."""
    w = k["workload"]
    return [
        "--base-url", url, "--model", model_path, *vllm_compat.dataset_flags(w, "serve", w.get("prompts")),
        "--num-prompts", str(n), "--request-rate", str(rate), "--seed", str(seed), "--ignore-eos", "--temperature", "0",
        "--percentile-metrics", ",".join(METRICS), "--metric-percentiles", ",".join(map(str, PCTS)),
        "--goodput", f"ttft:{slo['ttft_ms']}", f"tpot:{slo['tpot_ms']}",
        "--save-result", "--save-detailed", "--result-dir", str(out_dir), "--result-filename", name,
        "--disable-tqdm"]


class Prober:
    """`vllm bench serve` in this process: vLLM's own parser and `main`, one import for all of a stage's probes.
    Each probe runs in a thread so that a hung one times out (the server is then stopped by the stage)."""

    def __init__(self, log):
        self.log = log
        self._parser, self._main = vllm_compat.bench_serve_cli()
        self._serve = vllm_compat.import_bench_serve()

    def __call__(self, argv: list[str], timeout: float, what: str, watch=None) -> None:
        """`watch(request, t0)`: called as each request completes; arrivals stop once it returns True."""
        args = self._parser.parse_args(argv)
        box: dict = {}

        def probe():
            try:  # vLLM prints its result table: into the probes log, with the command it stands for
                with (open(self.log, "a", encoding="utf-8") as f, contextlib.redirect_stdout(f),
                      vllm_compat.watched_serve(self._serve, watch, getattr(watch, "certain_s", None))
                      if watch else contextlib.nullcontext()):
                    print(common.redact("$ vllm bench serve " + " ".join(argv)), flush=True)
                    self._main(args)
            except BaseException as e:  # noqa: BLE001 -- re-raised in the stage's thread below
                box["error"] = e

        t = threading.Thread(target=probe, name="probe", daemon=True)
        t.start()
        t.join(timeout)
        if t.is_alive():
            raise engine.EngineError(what, f"timed out after {timeout:.0f} s", self.log)
        if "error" in box:
            e = box["error"]
            raise engine.EngineError(what, f"{type(e).__name__}: {e}", self.log) from e


class Curtail:
    """A look that stops sending once enough requests broke the SLO to fail it: those over the SLO among the ones
    it sent after its ramp-up and settle (knee.ramp_fraction of its planned arrivals, knee.settle_latencies of its
    estimated end-to-end latency), counted as they complete, reach probing.fail_count over every request the visit
    could count (its earlier looks' counted and this look's n, less the earlier looks' over). The row is judged as
    any other (its window read afterwards): where that leaves it inconclusive the visit looks again. On the H200 a
    look at the wall sized for a pass (~550 counted) failed 349 of 484; stopped, a look there sent 209 to 439 of
    713."""

    def __init__(self, rate: float, n: int, k: dict, slo: dict, visit: list[dict], e2e_s: float = 0.0):
        self.need = probing.stop_count(n, visit, slo["percentile"], k["dispersion"]["phi"], k["max_repeats"])
        # requests that arrived while the server filled are not counted (probing.counted_window): nor here
        self.skip_s = max(k["ramp_fraction"] * n / rate, k["settle_latencies"] * e2e_s)
        self.slo, self.over, self.stopped = slo, 0, False

    def certain_s(self, request_func_input) -> float:
        """Seconds in flight after which a request is over the SLO whatever it does next: one that met both budgets
        would have ended by TTFT + (output tokens - 1) x TPOT (its requested output: ignore_eos generates all of
        them, and fewer end sooner), here with 10 % and 0.1 s to spare: the watch's clock starts a turn of the event
        loop before vLLM's, and a stream ends a little after its last token."""
        n = getattr(request_func_input, "output_len", None) or 1
        return (self.slo["ttft_ms"] + max(n - 1, 0) * self.slo["tpot_ms"]) / 1000 * 1.1 + 0.1

    def __call__(self, req: dict, t0: float) -> bool:
        if self.need is not None and req["start"] >= t0 + self.skip_s:
            self.over += probing.over_slo(req, self.slo)
            self.stopped = self.stopped or self.over >= self.need
        return self.stopped


def sent_words(row: dict) -> str:
    """A look's requests as its log line says them: all it planned, or how many of them it sent before it stopped."""
    if row.get("stopped_early"):
        cut = f"; {row['cut']} then in flight past the SLO's reach cut, counted over it" if row.get("cut") else ""
        return f"{row['sent']} of {row['num_prompts']} sent (stopped: enough over the SLO to fail it{cut})"
    return str(row["num_prompts"])


def relooked_words(row: dict) -> str:
    """What a sweep.log line adds for a look taken again because the first ran while the machine was busy."""
    d = row.get("disturbed_look")
    if not d:
        return " (busy: other work held {:.0%} of the cores; no look left)".format(row["other_work_share"]) \
            if row.get("busy_again") else ""
    return (f" (a second look on its trace: the first, {d['over_slo']} of {d['counted']} over the SLO, ran while "
            f"{disturbed.busy_words(d['busy'])}" + ("; busy again" if row.get("busy_again") else "") + ")")


def row_from(result: dict, reqs: list[dict], rate: float, n: int, k: dict, slo: dict) -> dict:
    """One probe's row: vLLM's own summary figures, and the SLO's percentile over the requests that count
    (probing.tail_stats: ramp-up left out, backlog judged inside the arrival window)."""
    cut = sum(1 for r in reqs if r.get("cut"))  # cancelled in flight, certainly over the SLO: not the server's failures
    row = {"offered_rps": rate, "num_prompts": n, "sent": len(reqs), "cut": cut,
           "achieved_rps": result.get("request_throughput"),
           "output_tps": result.get("output_throughput"), "goodput_rps": result.get("request_goodput"),
           "completed": result.get("completed"),
           "failed": result.get("failed", len(reqs) - (result.get("completed") or 0)) - cut,
           "duration_s": result.get("duration")}
    for m in METRICS:
        for p in PCTS:
            row[f"p{p}_{m}_ms"] = result.get(f"p{p}_{m}_ms")
    tail = probing.tail_stats(reqs, slo["percentile"], k["ramp_fraction"], k["backlog_ratio"], slo,
                            k["settle_latencies"], k["tail_latencies"], rate)
    row.update({"slo_ttft_ms": tail["ttft_ms"], "slo_tpot_ms": tail["tpot_ms"],
                **{x: tail[x] for x in ("counted", "needed", "over_slo", "ramp_skipped", "window_open_s",
                                        "window_close_s", "e2e_p50_s", "settled", "window_arrivals",
                                        "window_first_tokens", "window_completions", "window_allowance", "backlog",
                                        "e2e_over_window")}})
    return row


def slim(path: Path) -> tuple[dict, list[dict]]:
    """Read a probe's detailed result and rewrite it without the per-token lists and generated texts (megabytes
    per probe), keeping per request what the row was computed from."""
    result = common.read_json(path)
    reqs = vllm_compat.serve_requests(result)
    for key in ("input_lens", "output_lens", "ttfts", "itls", "start_times", "generated_texts", "errors"):
        result.pop(key, None)
    common.write_json(path, {**result, "requests": reqs})
    return result, reqs


def write_csv(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        for r in sorted(rows, key=lambda r: r["offered_rps"]):
            r = {**r, "bound": (r.get("frontend") or {}).get("bound")}  # where its latency came from, flat
            # rates stay as the grid spells them (4 significant figures: 0.4204, not 0.42)
            w.writerow({c: (round(v, 3) if isinstance(v, float) and c != "offered_rps" else v)
                        for c, v in r.items() if c in COLUMNS})
    tmp.replace(path)


def warm_up(prober: Prober, srv: engine.Server, model_path: str, k: dict, slo: dict, logs) -> float | None:
    """A short burst before any timed probe, so first-request costs are not read as latency. Returns its median
    end-to-end latency (s): the first probe's settle and tail are sized by it (e2e_estimate)."""
    rate = k["start_rate"] or 1  # sweep mode may set no start rate
    prober(probe_args(srv.url, model_path, k, slo, rate, max(4, int(k["min_prompts"]) // 2), logs, "warmup.json",
                      seed=0),
           k["probe_timeout_s"], "vllm bench serve (warm-up)")
    got = common.read_json(logs / "warmup.json")
    e2e = got.get("median_e2el_ms") or got.get("p50_e2el_ms")
    return e2e / 1000 if e2e else None


def sweep(prober: Prober, srv: engine.Server, model_path: str, k: dict, slo: dict,
          logs) -> tuple[list[dict], list[tuple[float, bool]]]:
    """Probe rates (search or fixed sweep) against a running server; every probe is logged as it finishes.
    Each probe draws its own workload, the one every rung draws at that rate: search, probing.probe_seed (one per
    grid rate and repeat); sweep, its place in knee.rates. Seed 0 was the warm-up's."""
    def report(rows: list[dict], ev: dict) -> None:
        row, p = rows[-1], f"p{slo['percentile']:g}"
        line = (f"{row['offered_rps']:g} req/s x{sent_words(row)} ({row['counted']} counted, {row['over_slo']} over "
                f"the SLO; pooled {ev['over_slo']}/{ev['counted']}: {ev['verdict']}): {p} TTFT "
                f"{row['slo_ttft_ms'] or 0:.0f} ms, {p} TPOT {row['slo_tpot_ms'] or 0:.1f} ms, achieved "
                f"{row['achieved_rps'] or 0:.2f} req/s, failed {row['failed']} -> "
                f"{'pass' if row['passed'] else 'FAIL: ' + row['why']}" + relooked_words(row))
        with open(logs / "sweep.log", "a") as f:  # the sweep so far survives a failure later in the stage
            f.write(line + "\n")
        write_csv(logs / "partial.csv", rows)
        print(f"knee: {line}")
    rows, probes = probing.search(lambda rate, rows: probe(prober, srv, model_path, k, slo, logs, rate, rows), k, slo,
                                  report)
    return mark_bound(rows, k, slo, logs), probes


def mark_bound(rows: list[dict], k: dict, slo: dict, logs) -> list[dict]:
    """Each look's `frontend.bound` once its visit's verdict is final (frontend.mark: a look that passed is never
    bound), each bound look said in sweep.log; the rows."""
    for row in frontend.mark(rows, slo["percentile"], k["dispersion"]["phi"], k["max_repeats"]):
        fe = row["frontend"]
        if fe["bound"]:
            line = (f"the look at {row['offered_rps']:g} req/s (seed {row.get('seed')}) is {fe['bound']} bound: "
                    f"{fe['why']}")
            with open(logs / "sweep.log", "a") as f:
                f.write(line + "\n")
            print(f"knee: {line}")
    return rows


def probe(prober: Prober, srv: engine.Server, model_path: str, k: dict, slo: dict, logs, rate: float,
          rows: list[dict], seed: int | None = None, visit: list[dict] | None = None, curtail: bool = True,
          relook: bool = True) -> dict:
    """One look at `rate`: its row, not yet judged (probing.visit judges it). Its seed from the `rows` so far unless
    given. It stops sending once enough requests broke the SLO to fail it (Curtail), counting the `visit`'s earlier
    looks (by default the rows before it at `rate`: the search visits a rate once); not with `curtail` False (a
    look that measures the share itself, `make benchmark` part 4). The machine's other work during it is measured
    (disturbed.CpuWatch); a look while it held more than knee.busy_share of the cores is kept in the row that replaces
    it (`disturbed_look`, its file renamed *-disturbed.json) and looked at again once, on the same trace: the search
    judges the second (flagged `busy_again` where it was busy too)."""
    e2e = e2e_estimate(rows, k.get("e2e_warm_s"), rate, (k.get("anchor") or {}).get("latency"))
    n = prompts_for(rate, k, slo, e2e)
    if seed is None:
        at_rate = [(x["offered_rps"], x["passed"]) for x in rows]
        seed = (len(rows) + 1 if k["mode"] == "sweep" else
                probing.probe_seed(rate, at_rate, probing.grid_steps(k["rel_tol"])))
    name = f"probe-{len(rows) + 1:02d}-{rate:g}rps.json"
    if visit is None:
        visit = list(itertools.takewhile(lambda r: r["offered_rps"] == rate, reversed(rows)))
    seen = e2e_estimate(rows, k.get("e2e_warm_s"), rate, (k.get("anchor") or {}).get("latency"), upward=False)
    stop = Curtail(rate, n, k, slo, visit, seen) if curtail else None
    # the server's CPU is ours too where it is not our descendant (forked from the ladder's launcher)
    load = disturbed.CpuWatch(also=(srv.proc.pid,))
    seen = watch.LookWatch(srv.metrics, srv.proc.pid, prefix=srv.title_prefix)
    try:
        prober(probe_args(srv.url, model_path, k, slo, rate, n, logs, name, seed), k["probe_timeout_s"],
               f"vllm bench serve at {rate:g} req/s", watch=stop)
    finally:  # `vllm bench serve` exits 0 with every request failed when the server is gone: ask it
        fe = seen.stop()
        if not srv.alive():
            raise engine.EngineError("vllm serve", f"died during the knee sweep at {rate:g} req/s after "
                                     f"{len(rows)} probes: {srv.proc.error_line()}", srv.log)
    busy = load.stop()
    result, reqs = slim(logs / name)
    row = row_from(result, reqs, rate, n, k, slo)
    row.update(seed=seed, stopped_early=bool(stop and stop.stopped), busy=busy,
               other_work_share=busy and busy["share"], frontend=frontend.look(fe, reqs, slo["ttft_ms"]))
    if not disturbed.busy(busy, k.get("busy_share")):
        return row
    if not relook:
        return {**row, "busy_again": True}
    (logs / name).replace(logs / name.replace(".json", "-disturbed.json"))
    print(f"knee: the look at {rate:g} req/s ran while {disturbed.busy_words(busy)}, over knee.busy_share "
          f"{k['busy_share']:.0%}: kept aside, looked at again on its trace (seed {seed})")
    again = probe(prober, srv, model_path, k, slo, logs, rate, rows, seed, visit, curtail, relook=False)
    return {**again, "relooked": True, "disturbed_look": {**row, "file": name.replace(".json", "-disturbed.json")}}


def batch1(prober: Prober, srv: engine.Server, model_path: str, k: dict, slo: dict, logs) -> dict | None:
    """A true batch-1 decode for the roofline: `knee.batch1_requests` requests one at a time (--max-concurrency 1),
    after the sweep, so its TPOT is one sequence's, not that of the ~20-30 a low-rate probe keeps in flight."""
    n = k["batch1_requests"]
    if not n:
        return None
    argv = probe_args(srv.url, model_path, k, slo, float("inf"), n, logs, "batch1.json", seed=10_000)
    prober(argv + ["--max-concurrency", "1"], k["probe_timeout_s"], "vllm bench serve (batch 1)")
    result, _ = slim(logs / "batch1.json")
    return {"requests": n, "tpot_ms": result.get("p50_tpot_ms"), "ttft_ms": result.get("p50_ttft_ms")}


def server_pass(prober: Prober, srv: engine.Server, model_path: str, k: dict, slo: dict, logs) -> dict | None:
    """`knee.server_pass_prompts` requests sent at once to the rung's server after its search: output tok/s read
    through `vllm serve` (its API servers, HTTP and detokenizing included) on the bench's shape, beside the bench
    engine's, to show where one server a rung could measure both (issue: a ladder that fits)."""
    n = k.get("server_pass_prompts") or 0
    if not n:
        return None
    argv = probe_args(srv.url, model_path, k, slo, float("inf"), n, logs, "server_pass.json", seed=20_000)
    prober(argv, k["probe_timeout_s"], "vllm bench serve (server pass)")
    result, _ = slim(logs / "server_pass.json")
    return {"requests": n, "completed": result.get("completed"), "output_tps": result.get("output_throughput"),
            "duration_s": result.get("duration")}


def recheck_looks(prober: Prober, srv: engine.Server, model_path: str, k: dict, slo: dict, logs) -> list[dict]:
    """A knee verdict re-checked on this fresh server (run.anchor.look): probing.recheck, each look sized by
    probing.recheck_settings and sent the trace the search sends that rate."""
    a, kk = k["anchor"], probing.recheck_settings(k)

    def report(rows: list[dict], ev: dict) -> None:
        row = rows[-1]
        line = (f"re-check at {row['offered_rps']:g} req/s x{sent_words(row)}: {row['over_slo']} of {row['counted']} "
                f"counted over the SLO (pooled {ev['over_slo']}/{ev['counted']}: {ev['verdict']})"
                + relooked_words(row))
        with open(logs / "sweep.log", "a") as f:
            f.write(line + "\n")
        print(f"knee: {line}")
    rows = probing.recheck(lambda rate, rows: probe(prober, srv, model_path, kk, slo, logs, rate, rows), a["look"], k,
                           slo, a.get("side"), report)
    return mark_bound(rows, kk, slo, logs)
