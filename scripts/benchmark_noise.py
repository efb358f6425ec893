"""Measurement-noise benchmark (`make benchmark`; prints numbers, asserts nothing).

On the rung in params.yaml (the cpu profile by default) it measures:
  1. output tok/s of N timed repeats inside one engine (bench.mode engine): spread and 95 % interval width;
  2. the same with a fresh engine per repeat (bench.mode cli): the start-to-start noise on top;
  3. the knee found by the bracket-then-bisect search vs a fixed 10-rate sweep: probes used, knee, time;
  4. the knee's search on N fresh servers: how far apart their brackets sat, the knee.noise_floor it suggests.
Each also prints where its wall time went (starting engines, measuring, other), as the report's Time section does.
Writes only under results/logs/benchmark/.
Usage: python scripts/benchmark_noise.py [--repeats 5] [--knee-servers 3] [--parts 1,2,3,4]
"""
from __future__ import annotations

import argparse
import statistics
import time

import bench
import common
import engine
import knee
import stats
import workload


def spread(name: str, values: list[float]) -> None:
    s = stats.summarize(values)
    lo, hi = s["ci95"]
    print(f"{name}: n={s['n']} median {s['median']:.1f} tok/s, min {min(values):.1f}, max {max(values):.1f}, "
          f"range {(max(values) - min(values)) / s['median'] * 100:.1f} %, "
          f"CV {statistics.stdev(values) / s['mean'] * 100:.1f} %, "
          f"95 % interval {lo:.1f}–{hi:.1f} (±{s['rel_halfwidth'] * 100:.1f} %)")


def split(name: str, wall: float, timing: dict) -> None:
    """Where `wall` seconds went, in the words of the report's Time section."""
    start, measure = timing.get("start_s") or 0.0, timing.get("measure_s") or 0.0
    other = max(wall - start - measure, 0.0)
    print(f"   time {name}: {wall:.0f} s = starting engines {start:.0f} s ({start / wall:.0%}), measuring "
          f"{measure:.0f} s ({measure / wall:.0%}), other {other:.0f} s ({other / wall:.0%})")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--sweep-rates", default="1,2,3,4,5,6,7,8,9,10")
    ap.add_argument("--knee-servers", type=int, default=3)
    ap.add_argument("--parts", default="1,2,3,4", help="which of the measurements above to run")
    args = ap.parse_args()
    parts = {int(x) for x in args.parts.split(",")}
    params = common.stage_start()
    cfg, b, k, slo = common.engine_config(params), params["bench"], params["knee"], params["slo"]
    entry = common.model_entry(cfg["model"]["name"])
    logs = common.RESULTS / "logs" / "benchmark"
    sent, _ = workload.prepare(params["workload"], entry["path"], logs)
    k = {**k, "workload": sent}
    argv = bench.throughput_argv(entry["path"], b, sent, cfg["engine"])
    print(f"rung: {cfg['model']['name']}, {b['num_prompts']} prompts, {workload.describe(sent)['text']}")

    if 1 in parts:
        t0 = time.monotonic()
        runs, facts = bench.run_in_engine(argv, args.repeats, logs / "in-engine", cfg["env"], 1800, 1,
                                          bench.job_of(sent))
        spread(f"1. {args.repeats} repeats in one engine ({time.monotonic() - t0:.0f} s)",
               [r["output_tps"] for r in runs])
        split("1", time.monotonic() - t0, facts["timing"])

    t0 = time.monotonic()
    if 2 in parts:
        runs, facts = bench.run_cli(argv, args.repeats, logs / "cli", cfg["env"], 1800, bench.job_of(sent))
        spread(f"2. {args.repeats} runs, a fresh engine each ({time.monotonic() - t0:.0f} s)",
               [r["output_tps"] for r in runs])
        split("2", time.monotonic() - t0, facts["timing"])

    rates = [float(x) for x in args.sweep_rates.split(",")]
    searches = [("3a. search", {"mode": "search"}),
                (f"3b. fixed {len(rates)}-rate sweep", {"mode": "sweep", "rates": rates})] if 3 in parts else []
    searches += [(f"4. search on fresh server {i + 1}", {"mode": "search", "server": i + 1})
                 for i in range(args.knee_servers if 4 in parts else 0)]
    fresh = []
    for label, over in searches:
        kk = {**k, **over}
        out = logs / (over["mode"] + (f"-server-{over['server']}" if "server" in over else ""))
        prober = knee.Prober(out / "probes.log")
        began = time.monotonic()
        with engine.Server(entry["path"], cfg["engine"], cfg["env"], out / "server.log") as srv:
            warming = time.monotonic()
            knee.warm_up(prober, srv, entry["path"], kk, slo, out)
            t0 = time.monotonic()
            rows, probes = knee.sweep(prober, srv, entry["path"], kk, slo, out)
            probed = time.monotonic()
        res = stats.knee_result(probes, rates if over["mode"] == "sweep" else None)
        print(f"{label}: knee {res['knee_rps']} req/s (first break {res['first_fail_rps']}), {res['probes']} probes, "
              f"{probed - t0:.0f} s of probing")
        split(label.split(".")[0], time.monotonic() - began, {"start_s": srv.ready_s, "measure_s": probed - warming})
        if "server" in over:
            fresh.append(res)
    if len(fresh) > 1:
        print(f"4. {len(fresh)} fresh servers, one config: brackets "
              + ", ".join(f"{r['knee_rps']}–{r['first_fail_rps']}" for r in fresh)
              + f"; the widest gap between two of them: {knee_gap(fresh):.0%} (knee.noise_floor is "
              f"{k['noise_floor']:.0%}: a floor below that gap lets a change of that size pass as a move)")


def knee_gap(results: list[dict]) -> float:
    """How far apart the brackets of same-config knees sat: the largest last pass over another's first fail,
    less one (0 when every pair overlaps or touches)."""
    return max([0.0] + [a["knee_rps"] / b["first_fail_rps"] - 1 for a in results for b in results
                        if a["knee_rps"] and b["first_fail_rps"]])


if __name__ == "__main__":
    main()
