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
import threading
import time
from pathlib import Path

import common
from config import Dispersion, Params
from measure import evidence, frontend, probing, workload
from records import upstream
from records.bench import BenchResult
from records.gate import gate_failed
from records.knee import KneeResult
from runner import knee_looks
from serving import engine, vllm_compat


def start_rate(k: dict, bench: BenchResult | None) -> tuple[float, str, int]:
    """Where the search starts: a fraction of the offline throughput the bench measured on this rung (the knee
    at an SLO sits near it), else knee.start_rate; and the grid rates either side of it the search moves one at a
    time (knee.start_steps, from the bench's estimate only). Two significant digits: probe rates stay readable."""
    est = bench.requests_per_s if bench and bench.status == "ok" else None
    if not est:
        return k["start_rate"], f"knee.start_rate {k['start_rate']:g} req/s (no bench estimate)", 0
    r = min(max(float(f"{est * k['start_fraction']:.2g}"), k["min_rate"] or 0), k["max_rate"])
    near = k.get("start_steps") or 0
    return r, f"{k['start_fraction']:g} × the bench's {est:.3g} req/s" + (
        f", one grid rate at a time within {near} of it" if near else ""), near


def _import_quietly() -> None:
    """vLLM's bench code imported ahead; a VllmCompatError is raised again where knee_looks.Prober imports it."""
    with contextlib.suppress(vllm_compat.VllmCompatError):
        vllm_compat.import_bench_serve()


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
    knee_looks.write_csv(csv_out, [])
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
        "provenance": upstream.provenance(params, cfg)}).save_file(out)
    print(f"knee: n/a — {reason}")


def write_recheck(out: Path, csv_out: Path, rows: list[dict], k: dict, slo: dict, ready_s: float, wall_s: float,
                  probed_s: float, params: Params, cfg: dict, api_servers: dict | None = None) -> None:
    """A re-check's knee.json: its rows and each rate's verdict; no knee (it searched none)."""
    knee_looks.write_csv(csv_out, rows)
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
        "api_servers": api_servers, "rows": rows, "provenance": upstream.provenance(params, cfg)}).save_file(out)
    print("knee: re-check: " + ", ".join(f"{r} req/s {v}" for r, v in looks.items()) + f"; {wall_s:.0f} s")


def not_measured(params: Params, gate_json: Path) -> tuple[str, str] | None:
    """Why this rung's knee is not measured, and its label (no server started), or None where it is."""
    failed = gate_failed(params, gate_json)
    if failed:  # the rung is reverted whatever its knee: no server started for it
        return failed, common.GATE_FAILED
    if params.run.remeasure:  # a rung's base measured again right after it: its bench is all
        return "run.remeasure: this run measures a rung's base again, bench only", common.BENCH_ONLY
    return None


def search(prober: knee_looks.Prober, srv: engine.Server, model_path: str, k: dict, slo: dict, logs) -> dict:
    """The knee's search (or sweep) on the warmed server, then its batch-1 probe: their rows, probes and batch-1
    figures, and the server's metrics before and after the search (its prefix-cache hits are the search's)."""
    before = vllm_compat.scrape(srv.metrics())
    rows, probes = knee_looks.sweep(prober, srv, model_path, k, slo, logs)
    after = vllm_compat.scrape(srv.metrics())  # before the batch-1 probe: hit rates are the sweep's
    one = knee_looks.batch1(prober, srv, model_path, k, slo, logs)
    tps = knee_looks.server_pass(prober, srv, model_path, k, slo, logs)  # last: it changes no look
    if tps:
        print(f"knee: through the server: {tps['requests']} requests at once, {tps['output_tps'] or 0:.1f} output "
              f"tok/s in {tps['duration_s'] or 0:.1f} s")
    return {"before": before, "after": after, "rows": rows, "probes": probes, "batch1": one, "server_pass": tps}


def prefix_cache(before: dict, after: dict, facts: dict) -> dict:
    """The search's prefix-cache queries, hits and hit rate, from the server's metrics before and after it."""
    queries = after.get("vllm:prefix_cache_queries", 0) - before.get("vllm:prefix_cache_queries", 0)
    hits = after.get("vllm:prefix_cache_hits", 0) - before.get("vllm:prefix_cache_hits", 0)
    caching = str(after.get("cache_config", {}).get("enable_prefix_caching",
                                                    facts.get("enable_prefix_caching"))) == "True"
    hit_rate = hits / queries if queries else (0.0 if not caching else None)  # caching off: nothing can hit
    return {"prefix_cache_hit_rate": hit_rate, "prefix_cache_queries": queries, "prefix_cache_hits": hits}


def write_result(out: Path, csv_out: Path, got: dict, k: dict, slo: dict, sent: dict,
                 params: Params, cfg: dict) -> tuple[dict, int, str]:
    """The searched knee's knee.csv and knee.json (`got`: what main measured on its server, search's and the
    server's facts): its figures (probing.knee_result) and its looks bound outside the engine, counted and in words."""
    rows, after, facts, api_servers = got["rows"], got["after"], got["facts"], got["api_servers"]
    desc = workload.describe(sent)
    result = probing.knee_result(got["probes"], k["rates"] if k["mode"] == "sweep" else None,
                                 k["rel_tol"] if k["mode"] == "search" else None, rows)
    result["short_probes"] = probing.short_probes(rows, result["knee_rps"])
    result["conclusive_fail_rps"] = probing.conclusive_fail(rows)
    at = next((r for r in rows if r["offered_rps"] == result["knee_rps"]), None)
    bound, bound_words = frontend.summary(rows, result["first_fail_rps"])
    knee_looks.write_csv(csv_out, rows)
    KneeResult(**{
        **result,
        "slo": slo,
        "mode": k["mode"],
        "method": method(k, slo, got["started"], params.knee.dispersion),
        "start_rate": got["first"],
        "requests_sent": sum(r["sent"] for r in rows),
        "goodput_at_knee_rps": at and at["goodput_rps"],
        "ttft_ms_at_knee": at and at["slo_ttft_ms"],
        "tpot_ms_at_knee": at and at["slo_tpot_ms"],
        "counted_at_knee": at and at["counted"],
        "batch1": got["batch1"],
        "server_pass": got.get("server_pass"),
        "output_tps_at_knee": at and at["output_tps"],
        "workload": desc,
        "shape": {"input_len": sent.get("prompt_tokens_mean", got["input_len"]), "output_len": sent["output_len"],
                  "dataset": sent["kind"],
                  "prefix_len": desc["shared_prefix_len"],
                  "arrivals": "poisson", "ignore_eos": True, "temperature": 0, "probe_seconds": k["probe_seconds"]},
        "busy_share": k["busy_share"],  # a look while other work held more of the cores was looked at again
        "frontend_bound_looks": bound,  # looks whose latency was added outside the engine (measure/frontend.py)
        "frontend_words": bound_words,
        "server_ready_s": round(got["ready_s"], 1),
        "api_servers": api_servers,  # did serve.api_server_count take effect: {asked, found} (Server.api_servers)
        "wall_s": round(got["measure_s"], 1),
        "time": common.stage_time(got["ready_s"], got["probed"]),  # start: the server's; measure: warm-up and probes
        "kv_cache_tokens": facts.get("kv_cache_tokens"),
        "max_concurrency": facts.get("max_concurrency"),
        "applied": {**facts, "received": got["received"],
                    "cache_config": after.get("cache_config", {}),
                    **prefix_cache(got["before"], after, facts),
                    "workload_shared_prefix_len": desc["shared_prefix_len"]},
        "rows": rows,
        "provenance": upstream.provenance(params, cfg),
    }).save_file(out)
    return result, bound, bound_words


def outcome_words(result: dict) -> str:
    """The knee's outcome as the stage's last line says it."""
    # only the status's own numbers exist (a sweep whose every rate passed has no first break): format that one
    return {"inside": lambda: (f"knee {result['mid_rps']:.3g} ± {result['half_width_rps']:.2g} req/s (passes at "
                               f"{result['knee_rps']:g}, breaks at {result['first_fail_rps']:g}"
                               + ("; a repeat disagreed" if result["non_monotonic"] else "")
                               + (f"; {probing.SHORT_PROBE_FLAG}" if result["short_probes"] else "") + ")"),
            "below": lambda: f"SLO broken at every rate down to {result['first_fail_rps']:g} req/s",
            "open": lambda: (f"no pass on evidence: fails on evidence at {result['conclusive_fail_rps'] or '–'} "
                             f"req/s, inconclusive at {result['first_fail_rps']:g}"),
            "above": lambda: f"SLO met at every rate probed, up to {result['last_pass_rps']:g} req/s",
            }[result["status"]]()


def main(out: Path, csv_out: Path, logs: Path, bench_json: Path, gate_json: Path):
    params = common.stage_start()
    cfg, serve = upstream.engine_config(params), params.serve.model_dump()  # vLLM's serve args, passed on by name
    # the measuring helpers (probing) read the knee's settings, with this run's own values added below, and the SLO
    # as mappings; the SLO is recorded with the result as it is
    k, slo = params.knee.model_dump(), params.slo.model_dump()
    skipped = not_measured(params, gate_json)
    if skipped:
        write_na(out, csv_out, logs, *skipped, params, cfg)
        return
    entry = upstream.model_entry(cfg["model"]["name"])
    # what vLLM would refuse, `vllm serve`'s own arguments included, before its server starts
    engine.check_start(params, "rung", cfg, entry["path"], logs, serve=serve)
    sent, input_len = workload.prepare(params.workload.model_dump(), entry["path"], logs)
    first, started, near = start_rate(k, BenchResult.load_file(bench_json) if bench_json.exists() else None)
    anchor = params.run.anchor and params.run.anchor.model_dump(by_alias=True)
    k = {**k, "workload": sent, "start_rate": first, "start_steps": near, "anchor": anchor}
    t0 = time.monotonic()
    importing = threading.Thread(target=_import_quietly, daemon=True)
    importing.start()  # the prober's imports overlap the server's start-up
    with engine.Server(entry["path"], cfg["engine"], cfg["env"], logs / "server.log",
                       start_timeout=params.knee.start_timeout_s, serve=serve) as srv:
        ready_s = srv.ready_s
        print(f"knee: vllm serve ready on {srv.url} in {ready_s:.0f} s")
        prober = knee_looks.Prober(logs / "probes.log")
        probed = time.monotonic()
        k["e2e_warm_s"] = knee_looks.warm_up(prober, srv, entry["path"], k, slo, logs)
        api_servers = srv.api_servers()  # after the warm-up: every API server process has started and titled itself
        print(f"knee: API server processes: {api_servers['found']} (asked {api_servers['asked']})")
        if (k["anchor"] or {}).get("look"):  # a verdict re-checked on a fresh server: no search, no batch-1
            rows = knee_looks.recheck_looks(prober, srv, entry["path"], k, slo, logs)
            write_recheck(out, csv_out, rows, k, slo, srv.ready_s, time.monotonic() - t0,
                          time.monotonic() - probed, params, cfg, api_servers)
            return
        got = search(prober, srv, entry["path"], k, slo, logs)
        probed = time.monotonic() - probed  # the sweep and the batch-1 probe
    measure_s = time.monotonic() - t0
    got.update(facts=vllm_compat.engine_facts(srv.log), received=vllm_compat.non_default_args(srv.log),
               started=started, first=first, input_len=input_len, ready_s=ready_s, api_servers=api_servers,
               measure_s=measure_s, probed=probed)
    result, bound, bound_words = write_result(out, csv_out, got, k, slo, sent, params, cfg)
    print(f"knee: {outcome_words(result)}; {len(got['rows'])} probes, {measure_s:.0f} s"
          + (f"; {bound_words}" if bound else ""))


if __name__ == "__main__":
    # hard_exit: triton's bindings, imported by vLLM's bench code, print hundreds of "nanobind: leaked function"
    # lines at interpreter teardown. Every child is stopped and every file closed by then.
    args = common.paths(__doc__.split("\n")[0], knee="results/knee.json", csv="results/knee.csv",
                        logs="results/logs/knee", bench="results/bench.json", gate="results/gate.json")
    common.run_stage(main, (common.ParamsError, engine.EngineError, vllm_compat.VllmCompatError,
                            workload.WorkloadError), args.knee, args.csv, args.logs, args.bench, args.gate,
                     hard_exit=True)
