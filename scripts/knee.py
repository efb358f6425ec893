"""Stage `knee`: `vllm serve` with the rung's knobs, then `vllm bench serve` probes over offered request rates.

The knee is the highest offered rate whose TTFT and TPOT at the SLO's percentile (slo.percentile, ramp-up
arrivals left out, enough requests counted for that percentile) meet the SLO with no failed request and no
backlog. knee.mode `search` starts from the bench's measured req/s (× knee.start_fraction), goes up until the SLO
breaks or down until it holds, then bisects until the bracket is at most knee.rel_tol wide. Its rates lie on a fixed
grid and each (rate, repeat) has its own seed, so rungs that probe a rate send it the same arrival sequence
(probing.next_rate, probing.probe_seed). `sweep` probes the fixed knee.rates. One server serves every probe (after a
warm-up) and is stopped by PID in every outcome.
Writes results/knee.csv (one row per probe), results/knee.json; each probe's vLLM JSON and the sweep so far
stay in results/logs/knee/ even when the stage fails midway. A rung whose quality gate failed is not measured
(status n/a, no server started) unless gate.measure_failed.

Probes run `vllm bench serve`'s own code (its parser, its `main`) inside this process, imported once: on the
H200 a fresh `vllm bench serve` per probe spent ~40 s of its ~49 s starting up, for ~7 s of traffic.
"""
from __future__ import annotations

import contextlib
import csv
import itertools
import threading
import time
from pathlib import Path

import common
from config import Dispersion, Params
from measure import disturbed, evidence, frontend, probing, workload
from records.bench import BenchResult
from records.gate import gate_failed
from records.knee import KneeResult
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
                 known: list | None = None) -> float:
    """The end-to-end latency a probe at `rate` is sized by (its settle and tail), before it runs: the longest median
    of the probes at or below `rate` so far (latency rises with the rate; one above may have been overloaded), else
    the warm-up's; above the two highest rates probed below it (with no backlog: a queue's latency is not the
    server's), where the line through their medians reaches `rate` longer, that. Latency rises faster toward the
    wall, where a look must count what a pass needs: on the cpu's rung 0, 1.145 s at 5.657 req/s and 1.356 at 8
    sized 9.514 by 1.356, where it ran 1.389 (the line: 1.492). A window sized short only counts fewer requests, and
    the row says how many. `known` (run.anchor.latency: [[req/s, s], ...]): what the base measured at its passing
    rates; at `rate` it is the least the estimate takes. A rung's first look at its base's pass, sized by its warm-up
    (1.9 s) where the base had met 3.4-3.8 s there, counted 344-402 of the ~547 requests planned, short of a pass, on
    each of three H100 rungs (docs/measurements.md, 2026-12-06): a second look of ~30 s each."""
    seen = [r["e2e_p50_s"] for r in rows if r.get("e2e_p50_s") and r["offered_rps"] <= rate]
    seen += [e for at, e in known or () if abs(at / rate - 1) <= probing.GRID_ROUNDING]
    longest = max(seen, default=warm or 0.0)
    below: dict[float, float] = {}
    for r in rows:
        if r.get("e2e_p50_s") and r["offered_rps"] < rate and not r.get("backlog"):
            below[r["offered_rps"]] = max(below.get(r["offered_rps"], 0.0), r["e2e_p50_s"])
    if len(below) < 2:
        return longest
    (r1, e1), (r2, e2) = sorted(below.items())[-2:]
    return max(longest, e2 + max(e2 - e1, 0.0) / (r2 - r1) * (rate - r2))


def start_rate(k: dict, bench: BenchResult | None) -> tuple[float, str]:
    """Where the search starts: a fraction of the offline throughput the bench measured on this rung (the knee
    at an SLO sits below it), else knee.start_rate. Two significant digits: probe rates stay readable."""
    est = bench.requests_per_s if bench and bench.status == "ok" else None
    if not est:
        return k["start_rate"], f"knee.start_rate {k['start_rate']:g} req/s (no bench estimate)"
    r = min(max(float(f"{est * k['start_fraction']:.2g}"), k["min_rate"] or 0), k["max_rate"])
    return r, f"{k['start_fraction']:g} × the bench's {est:.3g} req/s"


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


def _import_quietly() -> None:
    """vLLM's bench code imported ahead; a VllmCompatError is raised again where Prober imports it."""
    with contextlib.suppress(vllm_compat.VllmCompatError):
        vllm_compat.import_bench_serve()


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
    stop = Curtail(rate, n, k, slo, visit, e2e) if curtail else None
    load, seen = disturbed.CpuWatch(), watch.LookWatch(srv.metrics, srv.proc.pid, prefix=srv.title_prefix)
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


def method(k: dict, slo: dict, started: str, d: Dispersion) -> str:
    """How the knee was found, in the words the report prints (`d`: params knee.dispersion, typed)."""
    p = f"p{slo['percentile']:g}"
    anchor = k.get("anchor") or {}
    how = (f"search on a grid of {probing.grid_steps(k['rel_tol'])} rates per doubling from 1 req/s, each rate and "
           f"repeat with its own seed (rungs that probe a rate send it the same arrival sequence), "
           + (f"first at its base's knee (fails {anchor.get('fail') or '–'}, passes {anchor.get('pass') or '–'} "
              + ("req/s): where it does not pass at the first, its second and stop where that is its bracket; "
                 "else on to its own bracket" if anchor.get("bracket") else
                 "req/s): where it does not pass at the first, its second and stop (the knee verdict needs no more, "
                 "and a rung not better is not kept); where it passes at the first, on to its own bracket")
              if anchor.get("pass") or anchor.get("fail") else
              f"from {started}: up until a rate fails on evidence, down a grid rate at a time while none passed")
           + f", then bisected until the bracket (last pass, first fail on evidence) is at most "
           f"{k['rel_tol'] * 100:.0f} % of its midpoint wide or no rate between them is left (at most "
           f"{k['max_probes']} probes)"
           if k["mode"] == "search" else f"a sweep over {k['rates']} req/s")
    return (f"`vllm serve` + `vllm bench serve`, Poisson arrivals; each probe counts ~{k['probe_seconds']} s of "
            f"arrivals once the server has filled ({k['settle_latencies']:g} end-to-end latencies after the first, "
            f"{k['tail_latencies']:g} before the last), at least what a {p} pass needs; a rate passes when the count "
            f"of counted requests over the SLO shows at {evidence.PROBE_CONFIDENCE:.0%} confidence (each of its up to "
            f"{k['max_repeats']} looks at {evidence.look_confidence(k['max_repeats']):.1%}) that at most "
            f"{100 - slo['percentile']:g} % break it (an exact binomial bound, as MLPerf LoadGen's early stopping, on "
            f"the counts divided by the requests' {d.words()}: they break it in bursts), fails when it shows more "
            f"do, and is probed again while neither holds (its counts pooled, at most {k['max_repeats']} probes in a "
            f"row); a probe stops sending once the requests over the SLO so far make its fail certain, whatever "
            f"the rest would show; "
            + (f"a look while other work held more than {k['busy_share']:.0%} of the machine's cores is kept aside and "
               f"looked at again once, on its trace, the second judged; " if k.get("busy_share") else "")
            + f"no failed request and no backlog (first tokens short of arrivals in the second "
            f"half of the arrival window by more than {1 - k['backlog_ratio']:.0%} of them and than their Poisson "
            f"noise); knee by {how}")


def write_na(out: Path, csv_out: Path, logs: Path, reason: str, label: str, params: Params, cfg: dict) -> None:
    """A knee that measured nothing, and why: every figure a measured knee has, null (probing.knee_result's keys
    among them), an empty knee.csv (its header only: `dvc plots` still reads it) and logs/skipped.txt."""
    common.write_text(logs / "skipped.txt", reason + "\n")
    write_csv(csv_out, [])
    KneeResult(**{
        "status": "n/a", "reason": reason, "label": label,
        **dict.fromkeys(("knee_rps", "last_pass_rps", "first_fail_rps", "bracket_rps", "mid_rps", "half_width_rps",
                         "rel_width", "range_rps", "start_rate", "goodput_at_knee_rps", "ttft_ms_at_knee",
                         "tpot_ms_at_knee", "counted_at_knee", "batch1", "output_tps_at_knee", "kv_cache_tokens",
                         "max_concurrency", "api_servers")),
        "resolved": False, "confirmed": False, "non_monotonic": False, "mixed_rates": [], "probes": 0,
        "short_probes": False, "slo": params.slo.model_dump(),
        "mode": params.knee.mode, "requests_sent": 0,
        "server_ready_s": 0, "wall_s": 0, "time": common.stage_time(0, 0), "applied": {}, "rows": [],
        "provenance": common.provenance(params, cfg)}).save_file(out)
    print(f"knee: n/a — {reason}")


def write_recheck(out: Path, csv_out: Path, rows: list[dict], k: dict, slo: dict, ready_s: float, wall_s: float,
                  probed_s: float, params: Params, cfg: dict, api_servers: dict | None = None) -> None:
    """A re-check's knee.json: its rows and each rate's verdict; no knee (it searched none)."""
    write_csv(csv_out, rows)
    a = k["anchor"]
    looks = {f"{r['offered_rps']:g}": r["visit_verdict"] for r in rows}
    KneeResult(**{
        "status": "ok", "label": common.KNEE_RECHECK, "recheck": {"rate": a["look"], "side": a.get("side"),
                                                                  "verdicts": looks},
        **dict.fromkeys(("knee_rps", "last_pass_rps", "first_fail_rps", "conclusive_fail_rps", "mid_rps")),
        "probes": len(rows), "slo": slo, "mode": "recheck", "requests_sent": sum(r["sent"] for r in rows),
        "busy_share": k.get("busy_share"),
        **dict(zip(("frontend_bound_looks", "frontend_words"), frontend.summary(rows, None))),
        "method": (f"a knee verdict ({a.get('side') or 'the rung'}) re-checked on a fresh server: one visit of "
                   f"{a['look']:g} req/s on the search's traces, up to {probing.recheck_settings(k)['max_repeats']} "
                   "looks pooled" + (", one grid rate beyond where it does not read the other way on evidence"
                                     if a.get("side") else "")),
        "server_ready_s": round(ready_s, 1), "wall_s": round(wall_s, 1), "time": common.stage_time(ready_s, probed_s),
        "api_servers": api_servers, "rows": rows, "provenance": common.provenance(params, cfg)}).save_file(out)
    print("knee: re-check: " + ", ".join(f"{r} req/s {v}" for r, v in looks.items()) + f"; {wall_s:.0f} s")


def main(out: Path, csv_out: Path, logs: Path, bench_json: Path, gate_json: Path):
    params = common.stage_start()
    cfg, serve = common.engine_config(params), params.serve.model_dump()  # vLLM's serve args, passed on by name
    # the measuring helpers (probing) read the knee's settings, with this run's own values added below, and the SLO
    # as mappings; the SLO is recorded with the result as it is
    k, slo = params.knee.model_dump(), params.slo.model_dump()
    failed = gate_failed(params, gate_json)
    if failed:  # the rung is reverted whatever its knee: no server started for it
        write_na(out, csv_out, logs, failed, common.GATE_FAILED, params, cfg)
        return
    if params.run.remeasure:  # a rung's base measured again right after it: its bench is all
        write_na(out, csv_out, logs, "run.remeasure: this run measures a rung's base again, bench only",
                 common.BENCH_ONLY, params, cfg)
        return
    entry = common.model_entry(cfg["model"]["name"])
    # what vLLM would refuse, `vllm serve`'s own arguments included, before its server starts
    engine.check_start(params, "rung", cfg, entry["path"], logs, serve=serve)
    sent, input_len = workload.prepare(params.workload.model_dump(), entry["path"], logs)
    first, started = start_rate(k, BenchResult.load_file(bench_json) if bench_json.exists() else None)
    anchor = params.run.anchor and params.run.anchor.model_dump(by_alias=True)
    k = {**k, "workload": sent, "start_rate": first, "anchor": anchor}
    t0 = time.monotonic()
    importing = threading.Thread(target=_import_quietly, daemon=True)
    importing.start()  # the prober's imports overlap the server's start-up
    with engine.Server(entry["path"], cfg["engine"], cfg["env"], logs / "server.log",
                       start_timeout=params.knee.start_timeout_s, serve=serve) as srv:
        ready_s = srv.ready_s
        print(f"knee: vllm serve ready on {srv.url} in {ready_s:.0f} s")
        prober = Prober(logs / "probes.log")
        probed = time.monotonic()
        k["e2e_warm_s"] = warm_up(prober, srv, entry["path"], k, slo, logs)
        api_servers = srv.api_servers()  # after the warm-up: every API server process has started and titled itself
        print(f"knee: API server processes: {api_servers['found']} (asked {api_servers['asked']})")
        if (k["anchor"] or {}).get("look"):  # a verdict re-checked on a fresh server: no search, no batch-1
            rows = recheck_looks(prober, srv, entry["path"], k, slo, logs)
            write_recheck(out, csv_out, rows, k, slo, srv.ready_s, time.monotonic() - t0,
                          time.monotonic() - probed, params, cfg, api_servers)
            return
        before = vllm_compat.scrape(srv.metrics())
        rows, probes = sweep(prober, srv, entry["path"], k, slo, logs)
        after = vllm_compat.scrape(srv.metrics())  # before the batch-1 probe: hit rates are the sweep's
        one = batch1(prober, srv, entry["path"], k, slo, logs)
        probed = time.monotonic() - probed  # the sweep and the batch-1 probe
    measure_s = time.monotonic() - t0
    queries = after.get("vllm:prefix_cache_queries", 0) - before.get("vllm:prefix_cache_queries", 0)
    hits = after.get("vllm:prefix_cache_hits", 0) - before.get("vllm:prefix_cache_hits", 0)
    facts, desc = vllm_compat.engine_facts(srv.log), workload.describe(sent)
    caching = str(after.get("cache_config", {}).get("enable_prefix_caching",
                                                    facts.get("enable_prefix_caching"))) == "True"
    hit_rate = hits / queries if queries else (0.0 if not caching else None)  # caching off: nothing can hit
    result = probing.knee_result(probes, k["rates"] if k["mode"] == "sweep" else None,
                               k["rel_tol"] if k["mode"] == "search" else None, rows)
    result["short_probes"] = probing.short_probes(rows, result["knee_rps"])
    result["conclusive_fail_rps"] = probing.conclusive_fail(rows)
    at = next((r for r in rows if r["offered_rps"] == result["knee_rps"]), None)
    bound, bound_words = frontend.summary(rows, result["first_fail_rps"])
    write_csv(csv_out, rows)
    KneeResult(**{
        **result,
        "slo": slo,
        "mode": k["mode"],
        "method": method(k, slo, started, params.knee.dispersion),
        "start_rate": first,
        "requests_sent": sum(r["sent"] for r in rows),
        "goodput_at_knee_rps": at and at["goodput_rps"],
        "ttft_ms_at_knee": at and at["slo_ttft_ms"],
        "tpot_ms_at_knee": at and at["slo_tpot_ms"],
        "counted_at_knee": at and at["counted"],
        "batch1": one,
        "output_tps_at_knee": at and at["output_tps"],
        "workload": desc,
        "shape": {"input_len": sent.get("prompt_tokens_mean", input_len), "output_len": sent["output_len"],
                  "dataset": sent["kind"],
                  "prefix_len": desc["shared_prefix_len"],
                  "arrivals": "poisson", "ignore_eos": True, "temperature": 0, "probe_seconds": k["probe_seconds"]},
        "busy_share": k["busy_share"],  # a look while other work held more of the cores was looked at again
        "frontend_bound_looks": bound,  # looks whose latency was added outside the engine (measure/frontend.py)
        "frontend_words": bound_words,
        "server_ready_s": round(ready_s, 1),
        "api_servers": api_servers,  # did serve.api_server_count take effect: {asked, found} (Server.api_servers)
        "wall_s": round(measure_s, 1),
        "time": common.stage_time(ready_s, probed),  # start: the server's; measure: warm-up and probes
        "kv_cache_tokens": facts.get("kv_cache_tokens"),
        "max_concurrency": facts.get("max_concurrency"),
        "applied": {**facts, "received": vllm_compat.non_default_args(srv.log),
                    "cache_config": after.get("cache_config", {}),
                    "prefix_cache_hit_rate": hit_rate, "prefix_cache_queries": queries, "prefix_cache_hits": hits,
                    "workload_shared_prefix_len": desc["shared_prefix_len"]},
        "rows": rows,
        "provenance": common.provenance(params, cfg),
    }).save_file(out)
    # only the status's own numbers exist (a sweep whose every rate passed has no first break): format that one
    where = {"inside": lambda: (f"knee {result['mid_rps']:.3g} ± {result['half_width_rps']:.2g} req/s (passes at "
                                f"{result['knee_rps']:g}, breaks at {result['first_fail_rps']:g}"
                                + ("; a repeat disagreed" if result["non_monotonic"] else "")
                                + (f"; {probing.SHORT_PROBE_FLAG}" if result["short_probes"] else "") + ")"),
             "below": lambda: f"SLO broken at every rate down to {result['first_fail_rps']:g} req/s",
             "open": lambda: (f"no pass on evidence: fails on evidence at {result['conclusive_fail_rps'] or '–'} "
                              f"req/s, inconclusive at {result['first_fail_rps']:g}"),
             "above": lambda: f"SLO met at every rate probed, up to {result['last_pass_rps']:g} req/s",
             }[result["status"]]()
    print(f"knee: {where}; {len(rows)} probes, {measure_s:.0f} s" + (f"; {bound_words}" if bound else ""))


if __name__ == "__main__":
    # hard_exit: triton's bindings, imported by vLLM's bench code, print hundreds of "nanobind: leaked function"
    # lines at interpreter teardown. Every child is stopped and every file closed by then.
    args = common.paths(__doc__.split("\n")[0], knee="results/knee.json", csv="results/knee.csv",
                        logs="results/logs/knee", bench="results/bench.json", gate="results/gate.json")
    common.run_stage(main, (common.ParamsError, engine.EngineError, vllm_compat.VllmCompatError,
                            workload.WorkloadError), args.knee, args.csv, args.logs, args.bench, args.gate,
                     hard_exit=True)
