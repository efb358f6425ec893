"""Stage `knee`: `vllm serve` with the rung's knobs, then `vllm bench serve` probes over offered request rates.

The knee is the highest offered rate whose p99 TTFT and p99 TPOT meet the SLO with no failed request and no
backlog. knee.mode `search` doubles the rate until the SLO breaks, then bisects to knee.rel_tol; `sweep` probes
the fixed knee.rates. One server serves every probe (after a warm-up) and is stopped by PID in every outcome.
Writes results/knee.csv (one row per probe), results/knee.json; each probe's vLLM JSON and the sweep so far
stay in results/logs/knee/ even when the stage fails midway.

Probes run `vllm bench serve`'s own code (its parser, its `main`) inside this process, imported once: on the
H200 a fresh `vllm bench serve` per probe spent ~40 s of its ~49 s starting up, for ~7 s of traffic.
"""
from __future__ import annotations

import contextlib
import csv
import statistics
import threading
import time
from pathlib import Path

import common
import engine
import stats
import vllm_compat
import workload

PCTS = (50, 90, 99)
METRICS = ("ttft", "tpot", "itl", "e2el")
COLUMNS = (["offered_rps", "num_prompts", "repeats", "achieved_rps", "output_tps", "goodput_rps", "completed", "failed",
            "backlog", "duration_s"] + [f"p{p}_{m}_ms" for m in METRICS for p in PCTS] + ["passed", "why"])


def prompts_for(rate: float, k: dict) -> int:
    return int(min(max(round(rate * k["probe_seconds"]), k["min_prompts"]), k["max_prompts"]))


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
        "--goodput", f"ttft:{slo['p99_ttft_ms']}", f"tpot:{slo['p99_tpot_ms']}",
        "--save-result", "--result-dir", str(out_dir), "--result-filename", name, "--disable-tqdm"]


class Prober:
    """`vllm bench serve` in this process: vLLM's own parser and `main`, one import for all of a stage's probes.
    Each probe runs in a thread so that a hung one times out (the server is then stopped by the stage)."""

    def __init__(self, log):
        self.log = log
        self._parser, self._main = vllm_compat.bench_serve_cli()

    def __call__(self, argv: list[str], timeout: float, what: str) -> None:
        args = self._parser.parse_args(argv)
        box: dict = {}

        def probe():
            try:  # vLLM prints its result table: into the probes log, with the command it stands for
                with open(self.log, "a", encoding="utf-8") as f, contextlib.redirect_stdout(f):
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


def row_from(result: dict, rate: float, n: int, k: dict, slo: dict) -> dict:
    row = {"offered_rps": rate, "num_prompts": n, "achieved_rps": result.get("request_throughput"),
           "output_tps": result.get("output_throughput"), "goodput_rps": result.get("request_goodput"),
           "completed": result.get("completed"), "failed": result.get("failed", n - (result.get("completed") or 0)),
           "duration_s": result.get("duration")}
    for m in METRICS:
        for p in PCTS:
            row[f"p{p}_{m}_ms"] = result.get(f"p{p}_{m}_ms")
    # completions falling behind arrivals = a growing queue, whose latency is backlog, not service time.
    # A probe that keeps up still takes one request's drain (p50 E2E) after the last arrival.
    e2e = (row["p50_e2el_ms"] or 0) / 1000
    expected = n / (n / rate + e2e)
    row["backlog"] = bool(row["achieved_rps"] is not None and row["achieved_rps"] < k["backlog_ratio"] * expected)
    row["passed"], row["why"] = stats.probe_passes(row, slo)
    return row


def merge_repeats(results: list[dict]) -> dict:
    """Repeated probes at one rate: the median of each latency/throughput figure, failures summed."""
    if len(results) == 1:
        return results[0]
    out = {}
    for key in results[0]:
        vals = [r.get(key) for r in results]
        if key in ("failed", "completed"):
            out[key] = sum(v or 0 for v in vals)
        elif all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals):
            out[key] = statistics.median(vals)
    return out


def write_csv(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        for r in sorted(rows, key=lambda r: r["offered_rps"]):
            w.writerow({c: (round(v, 3) if isinstance(v, float) else v) for c, v in r.items() if c in COLUMNS})
    tmp.replace(path)


def _import_quietly() -> None:
    """vLLM's bench code imported ahead; a VllmCompatError is raised again where Prober imports it."""
    with contextlib.suppress(vllm_compat.VllmCompatError):
        vllm_compat.import_bench_serve()


def warm_up(prober: Prober, srv: engine.Server, model_path: str, k: dict, slo: dict, logs) -> None:
    """A short burst before any timed probe, so first-request costs are not read as latency."""
    rate = k["start_rate"] or 1  # sweep mode may set no start rate
    prober(probe_args(srv.url, model_path, k, slo, rate, max(4, k["min_prompts"] // 2), logs, "warmup.json", seed=0),
           k["probe_timeout_s"], "vllm bench serve (warm-up)")


def sweep(prober: Prober, srv: engine.Server, model_path: str, k: dict, slo: dict,
          logs) -> tuple[list[dict], list[tuple[float, bool]]]:
    """Probe rates (search or fixed sweep) against a running server; every probe is logged as it finishes."""
    rows: list[dict] = []
    probes: list[tuple[float, bool]] = []
    while True:
        if k["mode"] == "sweep":
            rate = stats.sweep_next(probes, k["rates"])
        else:
            rate = stats.next_rate(probes, k["start_rate"], k["max_rate"], k["rel_tol"], k["max_probes"], k["min_rate"])
        if rate is None:
            return rows, probes
        n, repeats, results = prompts_for(rate, k), k["repeats"], []
        for rep in range(repeats):
            name = f"probe-{len(probes) + 1:02d}-{rate:g}rps" + (f"-r{rep + 1}" if repeats > 1 else "") + ".json"
            try:
                seed = sum(r["repeats"] for r in rows) + rep + 1  # 0 was the warm-up's
                prober(probe_args(srv.url, model_path, k, slo, rate, n, logs, name, seed), k["probe_timeout_s"],
                       f"vllm bench serve at {rate:g} req/s")
            finally:  # `vllm bench serve` exits 0 with every request failed when the server is gone: ask it
                if not srv.alive():
                    raise engine.EngineError("vllm serve", f"died during the knee sweep at {rate:g} req/s after "
                                             f"{len(rows)} probes: {srv.proc.error_line()}", srv.log)
            results.append(common.read_json(logs / name))
        row = row_from(merge_repeats(results), rate, n, k, slo)
        row["repeats"] = repeats
        rows.append(row)
        probes.append((rate, row["passed"]))
        with open(logs / "sweep.log", "a") as f:  # the sweep so far survives a failure later in the stage
            f.write(f"{rate:g} req/s x{n}: p99 TTFT {row['p99_ttft_ms']:.0f} ms, p99 TPOT {row['p99_tpot_ms']:.1f} ms, "
                    f"achieved {row['achieved_rps']:.2f} req/s, failed {row['failed']} -> "
                    f"{'pass' if row['passed'] else 'FAIL: ' + row['why']}\n")
        write_csv(logs / "partial.csv", rows)
        print(f"knee: {rate:g} req/s -> {'pass' if row['passed'] else 'fail'} "
              f"(p99 TTFT {row['p99_ttft_ms']:.0f} ms, p99 TPOT {row['p99_tpot_ms']:.1f} ms)")


def method(k: dict) -> str:
    """How the knee was found, in the words the report prints."""
    how = (f"double from {k['start_rate']} req/s until the SLO breaks, then bisect to {k['rel_tol'] * 100:.0f} % "
           f"(at most {k['max_probes']} probes)" if k["mode"] == "search" else f"a sweep over {k['rates']} req/s")
    return (f"`vllm serve` + `vllm bench serve`, Poisson arrivals, ~{k['probe_seconds']} s of traffic per probe "
            f"({k['repeats']} run(s) per rate), knee by {how}; each probe its own seed: a fresh draw of the workload")


def main(out: Path, csv_out: Path, logs: Path):
    params = common.stage_start()
    cfg, k, slo = common.rung_config(params), params["knee"], params["slo"]
    entry = common.model_entry(cfg["model"]["name"])
    sent, input_len = workload.prepare(params["workload"], entry["path"], logs)
    k = {**k, "workload": sent}
    t0 = time.monotonic()
    importing = threading.Thread(target=_import_quietly, daemon=True)
    importing.start()  # the prober's imports overlap the server's start-up
    with engine.Server(entry["path"], cfg["engine"], cfg["env"], logs / "server.log",
                       start_timeout=k["start_timeout_s"]) as srv:
        ready_s = srv.ready_s
        print(f"knee: vllm serve ready on {srv.url} in {ready_s:.0f} s")
        prober = Prober(logs / "probes.log")
        probing = time.monotonic()
        warm_up(prober, srv, entry["path"], k, slo, logs)
        before = vllm_compat.scrape(srv.metrics())
        rows, probes = sweep(prober, srv, entry["path"], k, slo, logs)
        after = vllm_compat.scrape(srv.metrics())
        probing = time.monotonic() - probing
    measure_s = time.monotonic() - t0
    queries = after.get("vllm:prefix_cache_queries", 0) - before.get("vllm:prefix_cache_queries", 0)
    hits = after.get("vllm:prefix_cache_hits", 0) - before.get("vllm:prefix_cache_hits", 0)
    facts, desc = vllm_compat.engine_facts(srv.log), workload.describe(sent)
    caching = str(after.get("cache_config", {}).get("enable_prefix_caching",
                                                    facts.get("enable_prefix_caching"))) == "True"
    hit_rate = hits / queries if queries else (0.0 if not caching else None)  # caching off: nothing can hit
    result = stats.knee_result(probes, k["rates"] if k["mode"] == "sweep" else None)
    at = next((r for r in rows if r["offered_rps"] == result["knee_rps"]), None)
    write_csv(csv_out, rows)
    common.write_json(out, {
        **result,
        "slo": slo,
        "mode": k["mode"],
        "method": method(k),
        "goodput_at_knee_rps": at and at["goodput_rps"],
        "p99_ttft_ms_at_knee": at and at["p99_ttft_ms"],
        "p99_tpot_ms_at_knee": at and at["p99_tpot_ms"],
        "output_tps_at_knee": at and at["output_tps"],
        "workload": desc,
        "shape": {"input_len": sent.get("prompt_tokens_mean", input_len), "output_len": sent["output_len"],
                  "dataset": sent["kind"],
                  "prefix_len": desc["shared_prefix_len"],
                  "arrivals": "poisson", "ignore_eos": True, "temperature": 0, "probe_seconds": k["probe_seconds"]},
        "server_ready_s": round(ready_s, 1),
        "wall_s": round(measure_s, 1),
        "time": common.stage_time(ready_s, probing),  # start: the server's; measure: warm-up and probes
        "kv_cache_tokens": facts.get("kv_cache_tokens"),
        "max_concurrency": facts.get("max_concurrency"),
        "applied": {**facts, "received": vllm_compat.non_default_args(srv.log),
                    "cache_config": after.get("cache_config", {}),
                    "prefix_cache_hit_rate": hit_rate, "prefix_cache_queries": queries, "prefix_cache_hits": hits,
                    "workload_shared_prefix_len": desc["shared_prefix_len"]},
        "rows": rows,
        "provenance": common.provenance(params, cfg),
    })
    # only the status's own numbers exist (a sweep whose every rate passed has no first break): format that one
    where = {"inside": lambda: f"knee {result['knee_rps']:g} req/s (first break {result['first_fail_rps']:g})",
             "below": lambda: f"SLO broken at every rate down to {result['first_fail_rps']:g} req/s",
             "above": lambda: f"SLO met up to {result['last_pass_rps']:g} req/s, the top of the range",
             }[result["status"]]()
    print(f"knee: {where}; {len(rows)} probes, {measure_s:.0f} s")


if __name__ == "__main__":
    # hard_exit: triton's bindings, imported by vLLM's bench code, print hundreds of "nanobind: leaked function"
    # lines at interpreter teardown. Every child is stopped and every file closed by then.
    args = common.paths(__doc__.split("\n")[0], knee="results/knee.json", csv="results/knee.csv",
                        logs="results/logs/knee")
    common.run_stage(main, (common.ParamsError, engine.EngineError, vllm_compat.VllmCompatError,
                            workload.WorkloadError), args.knee, args.csv, args.logs, hard_exit=True)
