"""Measurement-noise benchmark (`make benchmark`; prints numbers, asserts nothing).

On the rung in params.yaml (the cpu profile by default) it measures:
  1. output tok/s of N timed repeats inside one engine (bench.mode engine): spread and 95 % interval width;
  2. the same with a fresh engine per repeat after a discarded first one (the first engine on a machine reads
     slow): the start-to-start floor, printed as the `bench.noise_floor` block a profile reads;
  3. the knee found by the bracket-then-bisect search vs a fixed 10-rate sweep: probes used, knee, time;
  4. the knee's search on N fresh servers: how far apart their brackets sat, the knee.noise_floor it suggests; with
     --spread-at RATE instead: --untimed-servers fresh servers (one look each, a reading, not fitted: the first
     server on a machine may read slow), then N fresh servers one after another, --spread-looks looks at RATE each
     (sized as the stage sizes one, every server's look j on the trace of a visit's look j, none stopped early):
     the share over the SLO split into its spread between servers and within one (measure.spread), printed as the
     `knee.server_spread` block a profile stores and the rule's simulation reads;
  5. the ladder's tok/s rule on fresh engines (--compare): a warm-up engine, then the base before and after every
     change (base, change 1, base, change 2, base, ...), each change judged as a rung is (stats.delta against
     both flanks, the floor pooled with the base's own engines); placebos show its false calls, a real change its
     power.
  7. a rate's verdict as the knee stage reaches it (a visit: looks pooled while inconclusive, up to knee.max_repeats,
     each look sized and judged as the stage's), `--study-repeats` times back to back at each `--study-at` rate on
     one warm server, every visit on the same traces: how often one rate's verdict (pass / fail / inconclusive)
     changes;
  6. the knee probe's noise (--study): on `--knee-servers` fresh servers, probes at a coarse ladder of grid rates
     (up to the first that fails on evidence), one rate `--study-at` probed `--study-repeats` times back to back
     on one trace, then the grid rates around the knee twice each with fresh draws. Every probe's requests are
     kept (study.json), so a probe-noise model (share over the SLO against the rate, its spread between probes
     and servers) can be fitted to them.
Each also prints where its wall time went (starting engines, measuring, other), as the report's Time section does.
`--profile` measures a ladder.yaml profile's rung 0 (its models prepared here) instead of params.yaml's.
Writes only under results/logs/benchmark/ (with --profile its models.json and fingerprint.json too, read there).
Usage: python scripts/benchmark_noise.py [--profile P] [--repeats 5] [--knee-servers 3] [--parts 1,2,3,4]
                                         [--compare 'engine.seed=1;engine.seed=2'] [--set bench.num_prompts=512]
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import statistics
import time

import yaml

import common
import config
import plan as planning
from judgement import stats
from measure import evidence, frontend, host, probing, summary, workload
from measure import spread as server_spread_fit
from records import upstream
from records.fingerprint import Fingerprint
from records.models import ModelsManifest
from runner import knee_looks, throughput
from serving import engine, launcher, model_store, vllm_compat

BENCHMARK_LOGS = common.RESULTS / "logs" / "benchmark"   # git-ignored: everything this benchmark writes


def spread(name: str, values: list[float]) -> None:
    if len(values) < 2:  # one value has no spread (--repeats 1): said, not a crash after the engines ran
        print(f"{name}: n={len(values)} {', '.join(f'{v:.1f}' for v in values)} tok/s (a spread needs 2 or more)")
        return
    s = summary.summarize(values)
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


def repeats_count(text: str) -> int:
    """--repeats: a whole number above 0, refused by name before any engine starts."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"--repeats must be a whole number above 0, got {text!r}")
    return n


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=repeats_count, default=5)
    ap.add_argument("--fresh", action="store_true", help="start every engine and server as a new interpreter; "
                    "default: forked from a launcher that imported vLLM once, as `make ladder` starts them, so that a "
                    "floor measured here is the one the ladder's engines have")
    ap.add_argument("--engines", type=int, default=1, help="part 1: fresh engines one after another")
    ap.add_argument("--sweep-rates", default="1,2,3,4,5,6,7,8,9,10")
    ap.add_argument("--knee-servers", type=int, default=3)
    ap.add_argument("--parts", default="1,2,3,4", help="which of the measurements above to run")
    ap.add_argument("--profile", help="a ladder.yaml profile: measure its rung 0")
    ap.add_argument("--set", default="", help="';'-separated key=value settings on top (bench.num_prompts=512)")
    ap.add_argument("--compare", default="", help="part 5: ';'-separated changes, each key=value[,key=value]")
    ap.add_argument("--study-at", default="14", help="part 6: the rate probed again and again (part 7: rates, ',')")
    ap.add_argument("--study-repeats", type=int, default=5, help="part 6: how often, on one trace")
    ap.add_argument("--study-extra", default="", help="part 6: rates probed twice more on the first server, last")
    ap.add_argument("--spread-at", help="part 4: looks at this knee-grid rate on fresh servers (their spread), not "
                    "searches: the rate where rung 0's search first failed on evidence; or two adjacent grid rates "
                    "(26.91,32): looks at both on every server, and the wall's exponent gamma fitted from them")
    ap.add_argument("--spread-off-grid", action="store_true", help="part 4: --spread-at takes any one or two rates "
                    "(a wall sharper than a grid step: the cpu's, where the share rises between two grid rates)")
    ap.add_argument("--spread-looks", type=int, help="part 4 with --spread-at: looks a server at each rate (default "
                    "2 at one rate, 1 at two)")
    ap.add_argument("--untimed-servers", type=int, default=1, help="part 4 with --spread-at: servers first, one look "
                    "each, not fitted")
    ap.add_argument("--deadline-s", type=float, default=0, help="part 4 with --spread-at: start no server that "
                    "would end past this many seconds from the start (a lease that ends)")
    ap.add_argument("--study-rates", default="", help="part 6: the coarse rates (default: every 2nd grid rate "
                    "from the profile's knee.start_rate)")
    return ap.parse_args()


def main():
    args = parse_args()
    parts = {int(x) for x in args.parts.split(",")}
    params = common.stage_start().model_dump(by_alias=True)  # a dict: the profile and --set lay dotted keys over it
    if args.profile:
        params = profile_params(params, args.profile)
    for key, value in changes(args.set).items():
        planning.set_dotted(params, key, value)
    params = config.validate(params)
    cfg = servers_config(params)
    b, k = params["bench"], params["knee"]
    entry = upstream.model_entry(cfg["model"]["name"])
    logs = BENCHMARK_LOGS
    sent, _ = workload.prepare(params["workload"], entry["path"], logs)
    k = {**k, "workload": sent}
    argv = throughput.throughput_argv(entry["path"], config.Bench(**b), sent, cfg["engine"])
    print(f"rung: {cfg['model']['name']}, {b['num_prompts']} prompts, {workload.describe(sent)['text']}")
    print("engines: " + ("each a new interpreter (--fresh)" if args.fresh else
                         "forked from a launcher that imports vLLM once, as `make ladder` starts them (the first "
                         "may start fresh while it imports)"), flush=True)
    starts = contextlib.nullcontext() if args.fresh else launcher.running(logs / "launcher.log",
                                                                          vllm_compat.child_env())
    with starts:
        run_parts(args, parts, params, cfg, entry, logs, sent, k, argv)


def run_parts(args, parts: set[int], params: dict, cfg: dict, entry: dict, logs, sent: dict, k: dict,
              argv: list[str]) -> None:
    b, slo = params["bench"], params["slo"]
    if 1 in parts:
        in_one_engine(argv, b, cfg, logs, sent, args.repeats, args.engines)

    if 2 in parts:
        fresh_engines(argv, b, cfg, logs, sent, args.repeats)

    if 7 in parts:
        probe_repeats(entry["path"], cfg, k, slo, logs / "repeats", [float(x) for x in str(args.study_at).split(",")],
                      args.study_repeats)

    if 5 in parts:
        compare_rule(params, b, logs / "rule", changes_list(args.compare))

    if 6 in parts:
        coarse = [float(x) for x in args.study_rates.split(",") if x.strip()]
        probe_study(entry["path"], cfg, k, slo, logs / "study", coarse, float(args.study_at), args.study_repeats,
                    max(args.knee_servers, 1), [float(x) for x in args.study_extra.split(",") if x.strip()])

    if 4 in parts and args.spread_at:
        rates = spread_rates(args.spread_at, k["rel_tol"], args.spread_off_grid)
        looks = args.spread_looks or (2 if len(rates) == 1 else 1)
        server_spread(entry["path"], cfg, k, slo, logs / "spread", rates, args.knee_servers, looks,
                      args.untimed_servers, args.deadline_s)
        parts.discard(4)
    knee_searches(entry["path"], cfg, k, slo, logs, [float(x) for x in args.sweep_rates.split(",")], 3 in parts,
                  args.knee_servers if 4 in parts else 0)


def in_one_engine(argv: list[str], b: dict, cfg: dict, logs, sent: dict, repeats: int, engines: int) -> None:
    """Part 1 (see the module's docstring): `repeats` timed repeats in each of `engines` engines, one after another."""
    t0 = time.monotonic()
    for e in range(engines):
        runs, facts = throughput.run_in_engine(argv, repeats, logs / "in-engine" / f"engine{e}", cfg["env"],
                                               1800, b["warmup_repeats"], throughput.job_of(sent),
                                               b["warmup_prompts"])
        print(f"1. engine {e}: untimed pass(es) {facts['warmup_output_tps']} ({b['warmup_prompts'] or 'all'} "
              f"prompts), then timed {[round(r['output_tps'], 1) for r in runs]} tok/s; start "
              f"{facts['timing']['start_s']:.0f} s, engine init {facts.get('engine_init_s')} s", flush=True)
    spread(f"1. {repeats} repeats in one engine ({time.monotonic() - t0:.0f} s)",
           [r["output_tps"] for r in runs])
    split("1", time.monotonic() - t0, facts["timing"])


def fresh_engines(argv: list[str], b: dict, cfg: dict, logs, sent: dict, repeats: int) -> None:
    """Part 2 (see the module's docstring): `repeats` fresh engines after a discarded first, each its own
    process; their start-to-start floor printed as the profile's bench.noise_floor block."""
    t0 = time.monotonic()
    # the first engine is discarded: it reads slow (a fresh H200: 6,639 then 7,242 and 7,337 tok/s). It is the
    # ladder's warm-up engine (throughput.warm_up, bench.warm_up_passes), so engine 1 reads as a ladder's first timed
    first = throughput.warm_up(argv, logs / "cli" / "engine0", cfg["env"], b["timeout_s"], throughput.job_of(sent),
                               b["warm_up_passes"])
    print("2. engine 0 (discarded, the warm-up): " + (f"{first['output_tps']:.1f} output tok/s, " if
          first["output_tps"] else "started only, ") + f"start {first['start_s'] or 0:.0f} s, {first['wall_s']:.0f} s "
          "in all", flush=True)
    got = []
    for e in range(1, repeats + 1):  # each engine printed as it ends: a run cut off keeps what it measured
        got.append(engine_means(argv, b, logs / "cli" / f"engine{e}", cfg["env"], sent))
        print(f"2. engine {e}: {got[-1][0]:.1f} output tok/s (start "
              f"{got[-1][1]['start_s']:.0f} s, measure {got[-1][1]['measure_s']:.0f} s)", flush=True)
    means = [m for m, _ in got]
    spread(f"2. {repeats} fresh engines after a discarded first ({time.monotonic() - t0:.0f} s)", means)
    if len(means) < 2:
        return  # no floor from one engine
    if first["output_tps"]:
        print(f"   the first engine: {first['output_tps']:.1f} tok/s, "
              f"{(first['output_tps'] / statistics.fmean(means) - 1) * 100:+.1f} % vs the mean of the rest")
    if len(means) > 1:
        print(f"   engine 1 (the first timed) vs the mean of the others: "
              f"{(means[0] / statistics.fmean(means[1:]) - 1) * 100:+.1f} %")
    split("2", time.monotonic() - t0, {k_: sum(t[k_] for _, t in got) + (first["wall_s"] if k_ == "start_s" else 0)
                                       for k_ in ("start_s", "measure_s")})
    fp = this_machine()
    block = {"cv": round(statistics.stdev(means) / statistics.fmean(means), 4), "engines": len(means),
             "measured_on": machine(fp), "vllm": fp.get("vllm"), "measured": time.strftime("%Y-%m-%d")}
    print("   the profile's bench.noise_floor (ladder.yaml settings, or params.yaml for the cpu profile):\n"
          + yaml.safe_dump({"bench.noise_floor": block}, sort_keys=False, width=200))
    if len(means) > 1:  # what more engines buy: the rule judges the floor at the upper end of its interval
        print(f"   the rule judges it at the upper end of its {stats.FLOOR_LEVEL:.0%} interval: "
              f"{stats.upper_cv(block['cv'], len(means) - 1):.2%} on these {len(means)} engines")
    common.write_json(logs / "noise_floor.json", {**block, "engine_means": means, "first": first})


def knee_searches(model_path: str, cfg: dict, k: dict, slo: dict, logs, rates: list[float], fixed: bool,
                  servers: int) -> None:
    """Parts 3 and 4 (see the module's docstring): the search and a fixed sweep over `rates` (`fixed`), then the
    search on `servers` fresh servers, and how far apart their brackets sat."""
    searches = [("3a. search", {"mode": "search"}),
                (f"3b. fixed {len(rates)}-rate sweep", {"mode": "sweep", "rates": rates})] if fixed else []
    searches += [(f"4. search on fresh server {i + 1}", {"mode": "search", "server": i + 1})
                 for i in range(servers)]
    fresh = []
    for label, over in searches:
        kk = {**k, **over}
        out = logs / (over["mode"] + (f"-server-{over['server']}" if "server" in over else ""))
        prober = knee_looks.Prober(out / "probes.log")
        began = time.monotonic()
        with engine.Server(model_path, cfg["engine"], cfg["env"], out / "server.log", serve=cfg["serve"]) as srv:
            warming = time.monotonic()
            knee_looks.warm_up(prober, srv, model_path, kk, slo, out)
            t0 = time.monotonic()
            rows, probes = knee_looks.sweep(prober, srv, model_path, kk, slo, out)
            probed = time.monotonic()
        res = probing.knee_result(probes, rates if over["mode"] == "sweep" else None)
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


def servers_config(params: dict) -> dict:
    """The engine config every server here starts with: the knee stage's, its front end included (the profile's
    serve.api_server_count: gpu-shape-4090's 4), so that a spread or a study measured here holds for the knee."""
    return {**upstream.engine_config(common.parse(params)), "serve": params["serve"]}  # parsed again: as validated


def probe_study(model_path: str, cfg: dict, k: dict, slo: dict, logs, coarse: list[float], at: float, repeats: int,
                servers: int, extra: list[float] = ()) -> None:
    """Part 6 (see the module's docstring). Server 1: the coarse rates up to the first that fails on evidence,
    `at` `repeats` times on one seed, then the grid rates between the highest coarse pass and that fail, twice
    each with fresh seeds. Each later server: those fine rates once, and `at` twice. Writes study.json as it goes."""
    steps = probing.grid_steps(k["rel_tol"])
    if not coarse:
        i0 = probing.grid_index(k["start_rate"], steps)
        coarse = [probing.grid_rate(i0 + 2 * j, steps) for j in range(-1, 5)]
    out: dict = {"slo": slo, "knee": {x: k[x] for x in ("probe_seconds", "settle_latencies", "tail_latencies",
                                                         "ramp_fraction", "backlog_ratio")},
                 "servers": []}
    seq = 0

    def one(srv, prober, folder, rate: float, seed: int, label: str) -> dict:
        nonlocal seq
        seq += 1
        kk = {**k, "e2e_warm_s": srv_e2e[0]}
        n = knee_looks.prompts_for(rate, kk, slo, knee_looks.e2e_estimate(rows, kk["e2e_warm_s"], rate))
        name = f"probe-{seq:02d}-{rate:g}rps.json"
        t0 = time.monotonic()
        prober(knee_looks.probe_args(srv.url, model_path, kk, slo, rate, n, folder, name, seed),
               k["probe_timeout_s"], f"study probe at {rate:g} req/s")
        result, reqs = knee_looks.slim(folder / name)
        row = knee_looks.row_from(result, reqs, rate, n, kk, slo)
        ev = probing.slo_evidence(row["counted"], row["over_slo"], slo["percentile"])
        row.update(seed=seed, label=label, evidence=ev["verdict"], wall_s=round(time.monotonic() - t0, 1),
                   requests=reqs, server_seq=len(out["servers"]))
        rows.append(row)
        print(f"6. server {len(out['servers'])} {label} {rate:g} req/s x{n} seed {seed}: {row['over_slo']} of "
              f"{row['counted']} over the SLO ({ev['verdict']}); p{slo['percentile']} TTFT "
              f"{row['slo_ttft_ms'] or 0:.0f} ms, TPOT {row['slo_tpot_ms'] or 0:.1f} ms; e2e p50 "
              f"{row['e2e_p50_s'] or 0:.2f} s, window {row['window_open_s']}-{row['window_close_s']} s; backlog "
              f"{row['backlog']}; {row['wall_s']:.0f} s", flush=True)
        common.write_json(logs / "study.json", out)
        return row

    fine: list[float] = []
    for s_i in range(servers):
        folder = logs / f"server-{s_i + 1}"
        rows: list[dict] = []
        srv_e2e = [None]
        began = time.monotonic()
        with engine.Server(model_path, cfg["engine"], cfg["env"], folder / "server.log", serve=cfg["serve"]) as srv:
            out["servers"].append({"ready_s": round(srv.ready_s, 1), "rows": rows})
            print(f"6. server {s_i + 1} ready in {srv.ready_s:.0f} s", flush=True)
            prober = knee_looks.Prober(folder / "probes.log")
            srv_e2e[0] = knee_looks.warm_up(prober, srv, model_path, {**k, "start_rate": coarse[0]}, slo, folder)
            look = functools.partial(one, srv, prober, folder)
            if s_i == 0:
                fine = first_server_looks(look, coarse, at, repeats, extra, steps)
            else:
                for r in fine:
                    look(r, probing.SEED_BASE + 100 * probing.grid_index(r, steps) + 1, "fine")
                for j in range(2):
                    look(at, 90_000, f"at {at:g} #{j + 1}")
        out["servers"][-1]["wall_s"] = round(time.monotonic() - began, 1)
        common.write_json(logs / "study.json", out)
    study_dispersion(out, k, slo, logs)


def first_server_looks(look, coarse: list[float], at: float, repeats: int, extra: list[float],
                       steps: int) -> list[float]:
    """Part 6's first server (`look(rate, seed, label)`: one probe on it): the coarse rates up to the first that fails
    on evidence, `at` `repeats` times on one seed, the grid rates between the highest coarse pass and that fail twice
    each with fresh seeds, then the `extra` rates twice each. Returns those fine rates."""
    passed = None
    for r in coarse:
        row = look(r, probing.SEED_BASE + 100 * probing.grid_index(r, steps), "coarse")
        if row["evidence"] == "fail" or row["backlog"]:
            top = r
            break
        passed = r
    else:
        top = coarse[-1]
    lo_i = probing.grid_index(passed or coarse[0], steps)
    fine = [probing.grid_rate(i, steps) for i in range(lo_i, probing.grid_index(top, steps) + 1)
            if i in {probing.grid_index(c, steps) for c in coarse}]
    for j in range(repeats):
        look(at, 90_000, f"at {at:g} #{j + 1}")
    for r in fine:
        look(r, probing.SEED_BASE + 100 * probing.grid_index(r, steps) + 1, "fine")
    for r in extra:
        for j in (1, 2):
            look(r, 91_000 + j, "extra")
    return fine


def study_dispersion(out: dict, k: dict, slo: dict, logs) -> None:
    """Part 6's dispersion of the count over the SLO, fitted from every probe's counted window (study.json's
    servers), written into study.json and printed with the profile's knee.dispersion block."""
    probes = []
    for row in (r for srv in out["servers"] for r in srv["rows"]):
        reqs = sorted(row["requests"], key=lambda r: r["start"])
        w = probing.counted_window(reqs, k["ramp_fraction"], k["settle_latencies"], k["tail_latencies"],
                                   row["offered_rps"])  # the window row_from counted
        probes.append({**row, "window": reqs[w["lo"]:w["hi"]]})
    d = probing.dispersion_of(probes, slo)
    out["dispersion"] = d
    common.write_json(logs / "study.json", out)
    print(f"6. dispersion of the count over the SLO: between probes of one rate {d['between']} (df {d['between_df']}), "
          f"within probes over {d['block_s']:g}-s blocks {d['within']} (df {d['within_df']}); pooled {d['phi']}")
    if d["phi"]:
        fp = this_machine()
        block = {"phi": d["phi"], "probes": d["probes"], "measured_on": machine(fp), "vllm": fp.get("vllm"),
                 "measured": time.strftime("%Y-%m-%d")}
        print("   the profile's knee.dispersion (ladder.yaml settings, or params.yaml for the cpu profile):\n"
              + yaml.safe_dump({"knee.dispersion": block}, sort_keys=False, width=200))
    print(f"6. study written: {logs / 'study.json'}")


def spread_rates(text: str, rel_tol: float, off_grid: bool = False) -> list[float]:
    """--spread-at's rates: one grid rate, or two adjacent ones (the share's rise between them measures the wall's
    exponent gamma), ascending. The rates are the knee grid's (knee.rel_tol): a look's trace (its seed) is the one
    the knee stage sends at that rate. `off_grid` (--spread-off-grid): any one or two rates, for a wall sharper than
    a grid step (the cpu's: its servers held 9.514 req/s with none over the SLO and failed 11.31 with a backlog)."""
    rates = sorted(float(x) for x in str(text).split(",") if x.strip())
    steps = probing.grid_steps(rel_tol)
    if off_grid:
        if not 1 <= len(rates) <= 2 or min(rates, default=0) <= 0 or len(set(rates)) != len(rates):
            raise ValueError(f"--spread-at takes one rate or two different ones above 0, got {text!r}")
        return rates
    off = [r for r in rates if r <= 0 or probing.grid_rate(probing.grid_index(r, steps), steps) != r]
    if off or not 1 <= len(rates) <= 2:
        raise ValueError(f"--spread-at takes one knee-grid rate or two adjacent ones, got {text!r}"
                         + (f": {', '.join(f'{r:g}' for r in off)} not on the grid of 2^(1/{steps})" if off else "")
                         + " (--spread-off-grid takes any)")
    if len(rates) == 2 and probing.grid_index(rates[1], steps) - probing.grid_index(rates[0], steps) != 1:
        raise ValueError(f"--spread-at's two rates must be adjacent on the knee grid (2^(1/{steps}) apart), got "
                         f"{text!r}")
    return rates


def look_order(rates: list[float], server: int) -> list[float]:
    """The order a server looks at the rates in: ascending on even servers, descending on odd ones, so that an
    effect of a look's place on its server (the second look reads worse, say) cancels out of gamma."""
    return list(rates) if server % 2 == 0 else list(reversed(rates))


def judge_look(row: dict, k: dict, slo: dict) -> tuple[dict, str | None, str]:
    """A part-4 look judged alone as the knee stage judges each look of a visit (probing.slo_evidence at the look
    confidence of knee.max_repeats looks), and where its latency came from (frontend.flag on the watcher's figures:
    "front end" or "client" where it was added outside the engine): (evidence, bound, why)."""
    phi = k["dispersion"]["phi"]
    ev = probing.slo_evidence(row["counted"], row["over_slo"], slo["percentile"],
                              evidence.look_confidence(k["max_repeats"]), phi)
    if not row.get("frontend"):
        return ev, None, "not instrumented"
    passed = ev["verdict"] == "pass" and not row.get("failed") and not row.get("backlog")
    bound, why = frontend.flag(row["frontend"], {**row, "passed": passed}, slo["percentile"], phi, k["max_repeats"])
    return ev, bound, why


def server_spread(model_path: str, cfg: dict, k: dict, slo: dict, logs, rates: list[float], servers: int,
                  looks: int, untimed: int, deadline_s: float = 0) -> dict:
    """Part 4 with --spread-at (see the module's docstring): `looks` looks at each of `rates` on every server (in
    look_order), each look j at a rate on the trace of a visit's look j there (the same on every server), none
    stopped early; beside them each server's covariates (what its start settled on, its start seconds, the API-server
    processes found) and each look's front-end figures and bound. Writes spread.json after every look; returns it."""
    t_start = time.monotonic()
    steps = probing.grid_steps(k["rel_tol"])
    out: dict = {"rate": min(rates), "rates": list(rates), "slo": slo, "looks_per_server": looks,
                 "untimed_servers": untimed, "serve": cfg.get("serve"),
                 "knee": {x: k[x] for x in ("probe_seconds", "settle_latencies", "tail_latencies", "ramp_fraction",
                                            "dispersion", "max_repeats")}, "servers": []}
    per_server: list[float] = []
    for s_i in range(untimed + servers):
        timed = s_i >= untimed
        left = deadline_s - (time.monotonic() - t_start)
        if deadline_s and per_server and left < max(per_server) * 1.05:
            print(f"4. {left:.0f} s left of --deadline-s: no more servers (one took up to {max(per_server):.0f} s)")
            break
        began = time.monotonic()
        folder = logs / f"server-{s_i}"
        with engine.Server(model_path, cfg["engine"], cfg["env"], folder / "server.log",
                           start_timeout=k["start_timeout_s"], serve=cfg["serve"]) as srv:
            facts = vllm_compat.engine_facts(srv.log)  # what its start settled on: servers may differ in KV capacity
            entry = {"server": s_i, "timed": timed, "ready_s": round(srv.ready_s, 1),
                     "engine": {x: facts.get(x) for x in SERVER_FACTS}, "looks": []}
            out["servers"].append(entry)
            print(f"4. server {s_i}{'' if timed else ' (untimed)'} ready in {srv.ready_s:.0f} s: "
                  + ", ".join(f"{x} {facts.get(x)}" for x in SERVER_FACTS), flush=True)
            prober = knee_looks.Prober(folder / "probes.log")
            kk = {**k, "e2e_warm_s": knee_looks.warm_up(prober, srv, model_path, {**k, "start_rate": min(rates)},
                                                        slo, folder)}
            entry["api_servers"] = srv.api_servers()  # did serve.api_server_count take effect (after the warm-up)
            print(f"4. server {s_i}: API server processes {entry['api_servers']['found']} (asked "
                  f"{entry['api_servers']['asked']})", flush=True)
            rows: list[dict] = []
            order = look_order(rates, s_i) if timed else [min(rates)]
            for rate in order:
                for j in range(looks if timed else 1):
                    t0 = time.monotonic()
                    seed = probing.probe_seed(rate, [(rate, False)] * j, steps)  # a visit's look j: one trace
                    row = knee_looks.probe(prober, srv, model_path, kk, slo, folder, rate, rows, seed=seed,
                                           visit=[], curtail=False)
                    rows.append(row)
                    ev, bound, why = judge_look(row, k, slo)
                    entry["looks"].append(look_entry(row, rate, seed, ev, bound, why, time.monotonic() - t0))
                    print(f"4. server {s_i} look at {rate:g} req/s #{j + 1} x{row['num_prompts']} seed {seed}: "
                          f"{row['over_slo']} of {row['counted']} counted over the SLO ({ev['verdict']}); "
                          f"p{slo['percentile']:g} TTFT {row['slo_ttft_ms'] or 0:.0f} ms; "
                          + (f"{bound} bound ({why}); " if bound else "")
                          + f"{time.monotonic() - t0:.0f} s", flush=True)
                    common.write_json(logs / "spread.json", out)
        entry["wall_s"] = round(time.monotonic() - began, 1)
        per_server.append(entry["wall_s"])
        common.write_json(logs / "spread.json", out)
    out["seconds"] = round(time.monotonic() - t_start, 1)
    return spread_summary(out, logs / "spread.json")


def look_entry(row: dict, rate: float, seed: int, ev: dict, bound: str | None, why: str, wall_s: float) -> dict:
    """A part-4 look as spread.json keeps it: its counts, its verdict alone, and where its latency came from."""
    fe = row.get("frontend") or {}
    return {"rate": rate, "seed": seed, "num_prompts": row["num_prompts"], "counted": row["counted"],
            "over_slo": row["over_slo"], "evidence": ev["verdict"], "settled": row["settled"],
            "backlog": row["backlog"], "failed": row["failed"], "slo_ttft_ms": row["slo_ttft_ms"],
            "slo_tpot_ms": row["slo_tpot_ms"], "achieved_rps": row["achieved_rps"], "bound": bound, "why": why,
            "frontend": {x: fe.get(x) for x in ("counted", "client_over_ttft", "server_counted", "server_over_ttft",
                                                "waiting_peak", "api_processes", "api_thread_share",
                                                "client_thread_share", "api_stall_s")},
            "wall_s": round(wall_s, 1)}


def spread_looks(out: dict) -> tuple[list[list[tuple[int, int, float]]], list[dict], list[dict]]:
    """spread.json's looks sorted for the fit: (per timed server its looks (counted, over, rate) that measured the
    engine; the looks left out because their latency was added outside it, each with its server; the untimed
    servers' looks). A look bound by the front end or the client measured them, not the engine: pooled, it would
    read as a server effect, so it is left out of the fit and listed (frontend.OUTSIDE)."""
    fitted, outside, untimed = [], [], []
    for s in out["servers"]:
        if not s["timed"]:
            untimed += s["looks"]
            continue
        fitted.append([(x["counted"], x["over_slo"], x.get("rate", out["rate"])) for x in s["looks"]
                       if x.get("bound") not in frontend.OUTSIDE])
        outside += [{**x, "server": s["server"]} for x in s["looks"] if x.get("bound") in frontend.OUTSIDE]
    return fitted, outside, untimed


def server_covariates(s: dict) -> dict:
    """A server's covariates as the block stores them: its start seconds, the API-server processes found, and what
    its start settled on (SERVER_FACTS, as its log tells it)."""
    found = (s.get("api_servers") or {}).get("found")
    return {"server": s["server"], "ready_s": s.get("ready_s"), "api_servers": found, **(s.get("engine") or {})}


def spread_block(fit: server_spread_fit.SpreadFit, out: dict, outside: list[dict], fp: dict) -> dict:
    """The profile's knee.server_spread block (config.ServerSpread) from part 4's fit: gamma with its interval where
    looks at two rates fitted it, else fixed (gamma_ci null, the source says so); each look [over, counted] (and the
    index of its rate in `rates` where there are two); the servers' covariates; the looks left out (front-end or
    client bound)."""
    rates = out.get("rates") or [out["rate"]]
    cv, cv_lo, cv_hi = fit.knee_cv()
    timed = [s for s in out["servers"] if s["timed"]]
    kept = [[x for x in s["looks"] if x.get("bound") not in frontend.OUTSIDE] for s in timed]
    looks = [[[x["over_slo"], x["counted"]] + ([rates.index(x.get("rate", out["rate"]))] if len(rates) > 1 else [])
              for x in s] for s in kept if s]
    gamma_words = (f"gamma fitted from looks at {' and '.join(f'{r:g}' for r in rates)} req/s" if fit.gamma_ci else
                   f"gamma fixed at {fit.gamma:g} (looks at one rate cannot measure it)")
    left_out = (f"; {len(outside)} look(s) bound outside the engine left out: "
                + ", ".join(f"server {x['server']} at {x['rate']:g} req/s ({x['bound']})" for x in outside)
                if outside else "; no look bound outside the engine")
    return {"sigma": fit.sigma, "sigma_ci": list(fit.sigma_ci), "knee_cv": round(cv, 4),
            "knee_cv_ci": [round(cv_lo, 4), round(cv_hi, 4)], "gamma": fit.gamma,
            "gamma_ci": list(fit.gamma_ci) if fit.gamma_ci else None, "phi": fit.phi, "phi_ci": list(fit.phi_ci),
            "rate": fit.rate, "rates": list(rates) if len(rates) > 1 else None, "share": fit.share,
            "servers": fit.servers, "looks": fit.looks, "counted": fit.counted, "between_df": fit.between_df,
            "within_df": fit.within_df, "looks_per_server": looks,
            "covariates": [server_covariates(s) for s, k_ in zip(timed, kept) if k_],
            "frontend_bound": [[x["server"], rates.index(x.get("rate", out["rate"])), x["over_slo"], x["counted"]]
                               for x in outside],
            "measured_on": machine(fp), "vllm": fp.get("vllm"), "measured": time.strftime("%Y-%m-%d"),
            "source": f"make benchmark part 4 --spread-at {','.join(f'{r:g}' for r in rates)}, "
                      f"serve.api_server_count {(out.get('serve') or {}).get('api_server_count')}; "
                      + gamma_words + left_out}


def spread_summary(out: dict, path, fp: dict | None = None) -> dict:
    """Part 4's spread fitted from its looks (spread.json's servers), printed with its block; written to `path`."""
    fitted, outside, first = spread_looks(out)
    if first:
        print("4. untimed server(s): " + ", ".join(f"{x['over_slo']} of {x['counted']}" for x in first)
              + " over the SLO (not fitted)")
    for s in out["servers"]:  # each server's share beside its covariates (the spread's suspects)
        print(f"4. server {s['server']}{'' if s['timed'] else ' (untimed)'}: "
              + "; ".join(f"{x['over_slo']} of {x['counted']} at {x.get('rate', out['rate']):g}"
                          + (f" ({x['bound']} bound: not fitted)" if x.get("bound") in frontend.OUTSIDE else "")
                          for x in s["looks"])
              + "; " + ", ".join(f"{k_} {v}" for k_, v in server_covariates(s).items() if k_ != "server"))
    if outside:
        print(f"4. {len(outside)} look(s) bound outside the engine (front end or client): their latency is not the "
              "engine's, so they are left out of the fit; a spread measured for the rule wants none (re-measure "
              "with more API servers: serve.api_server_count)")
    try:
        fit = server_spread_fit.fit(fitted, out["rate"])
    except ValueError as e:
        print(f"4. no spread: {e}")
        return out
    cv, cv_lo, cv_hi = fit.knee_cv()
    block = spread_block(fit, out, outside, fp if fp is not None else this_machine())
    out.update(fit=fit.as_dict(), moments=server_spread_fit.moments([[x[:2] for x in s] for s in fitted]),
               block=block)
    common.write_json(path, out)
    gamma_words = (f"a wall of exponent {fit.gamma:g} [{fit.gamma_ci[0]:g}, {fit.gamma_ci[1]:g}], fitted"
                   if fit.gamma_ci else f"a wall of exponent {fit.gamma:g}, fixed (one rate)")
    print(f"4. spread at {', '.join(f'{r:g}' for r in fit.rates)} req/s over {fit.servers} servers, {fit.looks} "
          f"looks ({fit.counted} counted, {fit.over_slo} over the SLO): between servers SD of the log share "
          f"{fit.sigma:g} [{fit.sigma_ci[0]:g}, {fit.sigma_ci[1]:g}] (knees' CV {cv:.1%} [{cv_lo:.1%}, {cv_hi:.1%}] at "
          f"{gamma_words}); within a look dispersion {fit.phi:g} [{fit.phi_ci[0]:g}, {fit.phi_ci[1]:g}]; by moments "
          f"{out['moments']}; {out.get('seconds') or 0:.0f} s")
    print("   the profile's knee.server_spread (ladder.yaml settings, or params.yaml for the cpu profile):\n"
          + yaml.safe_dump({"knee.server_spread": block}, sort_keys=False, width=200, default_flow_style=None))
    return out


# A server's start as its log tells it (vllm_compat.engine_facts): the spread's suspects beside each server's looks
SERVER_FACTS = ("kv_cache_tokens", "max_concurrency", "kv_cache_gib", "activation_gib", "non_torch_gib",
                "cudagraph_gib", "engine_init_s", "compile_cache_hit")


def visit_again(prober, srv, model_path: str, k: dict, slo: dict, logs, rate: float, rows: list[dict],
                visit: int) -> list[dict]:
    """Part 7's visit of `rate` (its number `visit`): the stage's looks (knee_looks.probe) and visit (probing.visit), on
    the traces every visit of part 7 sends: seed 90,000 + look. Appends its looks to `rows` and returns them."""
    first = len(rows)

    def look(rate, rows):
        t0 = time.monotonic()
        row = knee_looks.probe(prober, srv, model_path, k, slo, logs, rate, rows, seed=90_000 + len(rows) - first,
                               visit=rows[first:])
        return {**row, "wall_s": round(time.monotonic() - t0, 1), "visit": visit}

    def report(rows, ev):
        row = rows[-1]
        print(f"7. {rate:g} req/s visit {visit} look {len(rows) - first} x{knee_looks.sent_words(row)}: "
              f"{row['over_slo']} of {row['counted']} over the SLO (pooled {ev['over_slo']} of {ev['counted']}): "
              f"{ev['verdict']}; p{slo['percentile']} TTFT {row['slo_ttft_ms'] or 0:.0f} ms; {row['wall_s']:.0f} s",
              flush=True)
    return probing.visit(look, rate, rows, k, slo, report)


def probe_repeats(model_path: str, cfg: dict, k: dict, slo: dict, logs, rates: list[float], repeats: int) -> None:
    """Part 7 (see the module's docstring): each look sized as the stage sizes one (knee_looks.prompts_for) and judged
    as the stage judges a visit (probing.judge: the visit's looks pooled, each at the visit's look confidence)."""
    out: dict = {"slo": slo, "rates": {}}
    with engine.Server(model_path, cfg["engine"], cfg["env"], logs / "server.log", serve=cfg["serve"]) as srv:
        print(f"7. server ready in {srv.ready_s:.0f} s", flush=True)
        prober = knee_looks.Prober(logs / "probes.log")
        warm = knee_looks.warm_up(prober, srv, model_path, {**k, "start_rate": rates[0]}, slo, logs)
        out["api_servers"] = srv.api_servers()  # did serve.api_server_count take effect (after the warm-up)
        print(f"7. API server processes: {out['api_servers']['found']} (asked {out['api_servers']['asked']})",
              flush=True)
        kk = {**k, "e2e_warm_s": warm}
        rows: list[dict] = []
        for rate in rates:
            visits: list[str] = []
            for j in range(repeats):
                looks = visit_again(prober, srv, model_path, kk, slo, logs, rate, rows, j + 1)
                last = looks[-1]  # passed on evidence but failed a request or backlogged: a fail
                visits.append("pass" if last["passed"] else "fail" if last["evidence"] == "pass" else last["evidence"])
                out["rates"][f"{rate:g}"] = {"visits": visits, "looks": [
                    {x: r.get(x) for x in ("visit", "num_prompts", "sent", "stopped_early", "counted", "over_slo",
                                           "evidence", "slo_ttft_ms", "slo_tpot_ms", "achieved_rps", "p50_ttft_ms",
                                           "p99_ttft_ms", "p99_itl_ms", "wall_s")}
                    for r in rows if r["offered_rps"] == rate]}
                common.write_json(logs / "repeats.json", out)
            top = max(set(visits), key=visits.count)
            print(f"7. {rate:g} req/s: {', '.join(visits)}: the most common ({top}) in {visits.count(top)} of "
                  f"{len(visits)}; pass and fail both: {'pass' in visits and 'fail' in visits}", flush=True)


@functools.cache
def this_machine() -> dict:
    """The fingerprint of the machine this benchmark runs on, taken once: a block it prints names the machine that
    measured it, never a results/fingerprint.json another machine or an older checkout left in the workspace."""
    return host.fingerprint()


def machine(fp: dict) -> str:
    """The machine a measurement block names: its GPUs and driver, else its CPU model and cores."""
    if fp.get("gpu"):
        return fp["gpu"] + (f", driver {fp['driver']}" if fp.get("driver") else "")
    cpu = fp.get("cpu") or {}
    return f"{cpu.get('model')}, {cpu.get('cores')} cores"


def changes(text: str) -> dict:
    """'a.b=1,c.d=x' -> {'a.b': 1, 'c.d': 'x'} (values read as YAML)."""
    out = {}
    for part in filter(None, (p.strip() for p in text.replace(";", ",").split(","))):
        key, _, value = part.partition("=")
        out[key.strip()] = yaml.safe_load(value)
    return out


def changes_list(text: str) -> list[dict]:
    return [changes(c) for c in text.split(";") if c.strip()]


def profile_params(params: dict, profile: str) -> dict:
    """A ladder.yaml profile's effective params (rung 0 in force), with its models prepared by the download stage's
    own code and this machine's fingerprint written, as the ladder's first stages would."""
    eff = planning.effective_params(params, planning.load_ladder(planning.LADDER_YAML), profile,
                                    planning.committed_params())
    dl = config.section(eff, "download")
    store, done = model_store.store_path(dl), {}
    for name in dl["fetch"]:
        model_store.provide(name, dl["catalog"], store, done)
    # written in its own folder by name, never through common.models_json() (the download stage's output where
    # side_results is unset), and read there by the engine code it runs
    ModelsManifest.model_validate({"store": str(store), "models": done}).save_file(BENCHMARK_LOGS / "models.json")
    Fingerprint.model_validate(this_machine()).save_file(BENCHMARK_LOGS / "fingerprint.json")
    common.side_results(BENCHMARK_LOGS)
    return eff


def engine_means(argv: list[str], b: dict, logs, env: dict, sent: dict) -> tuple[float, dict]:
    """One fresh engine (its own process) of `b["repeats"]` timed repeats: their mean and its timing."""
    runs, facts = throughput.run_in_engine(argv, b["repeats"], logs, env, b["timeout_s"], b["warmup_repeats"],
                                           throughput.job_of(sent), b["warmup_prompts"])
    return statistics.fmean(r["output_tps"] for r in runs), {**facts["timing"], "runs": [r["output_tps"] for r in runs]}


def compare_rule(params: dict, b: dict, logs, cands: list[dict]) -> None:
    """Part 5: the ladder's tok/s rule on fresh engines, interleaved: warm-up, base, c1, base, c2, base, ... Each
    change is judged against the base engines just before and after it, the floor pooled with every base engine so
    far (as ladder.Driver does with its re-measures). Printed, and written to rule.json."""
    t0 = time.monotonic()

    def measure(change: dict, name: str) -> dict:
        p, folder = copy_params(params, change), logs / f"engine-{len(seq) + len(bases) + 1:02d}"
        cfg = upstream.engine_config(common.parse(p))  # the change laid over validated params, checked as a rung
        entry = upstream.model_entry(cfg["model"]["name"])
        sent, _ = workload.prepare(p["workload"], entry["path"], folder)
        argv = throughput.throughput_argv(entry["path"], config.Bench(**b), sent, cfg["engine"])
        mean, timing = engine_means(argv, b, folder, cfg["env"], sent)
        print(f"5. {name}: {mean:.1f} output tok/s (repeats {', '.join(f'{x:.0f}' for x in timing['runs'])}; "
              f"start {timing['start_s']:.0f} s, measure {timing['measure_s']:.0f} s)", flush=True)
        return {"name": name, "change": change, "mean": mean, **timing}
    seq: list[dict] = []
    bases: list[dict] = []
    seq.append(measure({}, "warm-up (untimed)"))
    bases.append(measure({}, "base 1"))
    verdicts = []
    for i, change in enumerate(cands, 1):
        got = measure(change, f"change {i} " + ",".join(f"{k}={v}" for k, v in change.items()))
        bases.append(measure({}, f"base {len(bases) + 1}"))
        floor = stats.pool(config.NoiseFloor(**b["noise_floor"]), [[x["mean"] for x in bases]])
        d = stats.delta([bases[-2]["runs"], bases[-1]["runs"]], [got["runs"]], floor)
        verdicts.append({"change": change, "delta": d, "engine": got})
        seq += [got, bases[-1]]
        print(f"   -> {got['name']}: {d['rel'] * 100:+.1f} % "
              + (f"[{d['ci'][0] * 100:+.1f}, {d['ci'][1] * 100:+.1f}] " if d.get("ci") else "")
              + f"{d['verdict']} ({d['why']})", flush=True)
    first = seq[0]["mean"] / statistics.fmean(x["mean"] for x in bases) - 1
    print(f"5. warm-up engine vs the base engines after it: {first * 100:+.1f} %; base engines: "
          + ", ".join(f"{x['mean']:.0f}" for x in bases) + f"; {time.monotonic() - t0:.0f} s in all")
    common.write_json(logs / "rule.json", {"settings": {"bench": b, "workload": params["workload"]},
                                          "engines": [*seq[:1], bases[0], *seq[1:]], "verdicts": verdicts,
                                          "bases": bases, "warm_up_vs_bases": first,
                                          "seconds": round(time.monotonic() - t0, 1)})


def copy_params(params: dict, change: dict) -> dict:
    p = copy.deepcopy(params)
    for key, value in change.items():
        planning.set_dotted(p, key, value)
    return p


def knee_gap(results: list[dict]) -> float:
    """How far apart the brackets of same-config knees sat: the largest last pass over another's first fail,
    less one (0 when every pair overlaps or touches)."""
    return max([0.0] + [a["knee_rps"] / b["first_fail_rps"] - 1 for a in results for b in results
                        if a["knee_rps"] and b["first_fail_rps"]])


if __name__ == "__main__":
    main()
