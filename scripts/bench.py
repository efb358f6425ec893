"""Stage `bench`: vLLM's `bench throughput` on params `workload`, `bench.repeats` timed runs.

bench.mode `engine`: vLLM's own `vllm.benchmarks.throughput.main`, its arguments parsed by its own
parser, with its `run_vllm` wrapped so that ONE engine serves the warm-up and every timed repeat (an engine
start costs more than the measurement; vllm_compat.run_throughput holds that wrapper). bench.mode `cli`: the
same code once per repeat, each its own process and engine, so the spread also holds start-to-start noise.
The prompts are drawn with workload.SEED, never the engine's seed (which vLLM's main would use).
vLLM 0.26/0.32 ignore --input-len/--output-len for the random dataset, so the --random-* flags are used and
the shape vLLM ran is checked against params. A prompts file (workload.kind file) is rendered with the model's
chat template into results/logs/bench/ and sampled by vLLM's own CustomDataset. A rung whose quality gate failed is
not measured (status n/a, no engine started) unless gate.measure_failed: it is reverted whatever its speed.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import common
from config import Bench, Params
from measure import disturbed, summary, workload
from records import upstream
from records.bench import BenchResult
from records.gate import gate_failed
from runner import throughput
from serving import engine, vllm_compat


class ShapeError(RuntimeError):
    pass


def check_shape(run: dict, num_prompts: int, input_len: int | tuple[int, int], output_len: int) -> dict:
    """Applied tokens per request, as vLLM counted them; raise if they are not the shape params asked for.
    `input_len` is a (shortest, longest) range for a prompts file."""
    applied = {"input_len": run.get("prompt_tokens", 0) / num_prompts,
               "output_len": run.get("output_tokens", 0) / num_prompts}
    lo, hi = input_len if isinstance(input_len, tuple) else (input_len, input_len)
    slack = max(1, 0.02 * hi)
    if applied["output_len"] != output_len or not lo - slack <= applied["input_len"] <= hi + slack:
        want = f"{lo}-{hi}" if lo != hi else f"{lo}"
        raise ShapeError(f"vLLM ran {applied['input_len']:g} in / {applied['output_len']:g} out tokens per request, "
                         f"params ask {want} / {output_len} (workload)")
    return applied


def method(b: Bench, mode: str) -> str:
    """How the figures were measured, in the words the report prints."""
    untimed = f" of {b.warmup_prompts} prompts" if b.warmup_prompts else ""
    timed = (f"{b.warmups} warm-up requests and {b.warmup_repeats} untimed pass(es){untimed}, then "
             f"{b.repeats} timed {'repeat' if b.repeats == 1 else 'repeats'} inside one engine (vLLM's own bench "
             "code)" if mode == "engine" else
             f"{b.repeats} runs, each its own engine start ({b.warmups} warm-up requests each)")
    timed += f", prompts drawn with seed {workload.SEED} whatever engine.seed"
    screens = ([f"run while other work held more than {b.busy_share:.0%} of the machine's cores"]
               if b.busy_share else []) + ([f"more than {b.far_share:.0%} off the median of its engine's others"]
                                           if disturbed.far_screens(b.far_share, b.repeats) else [])
    if screens and b.extra_repeats:
        timed += (f"; a repeat {' or '.join(screens)} is replaced by one more (at most {b.extra_repeats}) and kept "
                  "beside it, out of the median and interval")
    summary = ("the one repeat's figures (no interval inside one engine)" if b.repeats == 1 else
               "median with a 95 % t-interval of the repeats")
    return (f"`vllm bench throughput`, {b.num_prompts} prompts, {timed}, the prefix cache reset before each; "
            f"{summary}; each Δ counts fresh engines as the unit (the card's "
            "start-to-start floor, bench.noise_floor, pooled with the ladder's own re-measures; stats.delta)")


def screen_runs(runs: list[dict], b: Bench) -> tuple[dict, list[dict]]:
    """The timed runs screened as the worker screened them (disturbed.screen over their output tok/s, params `bench`
    `b`), and a flag for each replaced or unreplaced one: which, its value, its siblings, why; each run marked."""
    values, loads = [r["output_tps"] for r in runs], [r.get("load") for r in runs]
    s = disturbed.screen(values, b.repeats, b.far_share, b.extra_repeats, loads, b.busy_share)
    if s["more"]:  # the worker stopped before replacing it (it cannot: its rule is this one); never silently
        s = {**s, "unreplaced": disturbed.screen(values, b.repeats, b.far_share, len(values) - b.repeats, loads,
                                                 b.busy_share)["unreplaced"]}
    flags = []
    for f in s["flagged"] + ([s["unreplaced"]] if s["unreplaced"] else []):
        i, busy = f["index"], f.get("busy")
        flag = {"repeat": i + 1, "output_tps": values[i], "siblings": [values[j] for j in f["siblings"]],
                "median": None if f["median"] is None else round(f["median"], 2),
                "off": None if f["off"] is None else round(f["off"], 4), "load": runs[i].get("load"),
                "why": (f"it ran while {disturbed.busy_words(busy)}, over bench.busy_share {b.busy_share:.0%}"
                        if busy else disturbed.far_words(values[i], f["median"], f["off"], b.far_share))}
        if busy:
            flag["busy"] = True
        what = "run busy" if busy else "far off the others"
        if "replaced_by" in f:
            flag.update(replaced_by=f["replaced_by"] + 1, replacement=values[f["replaced_by"]])
            runs[i]["disturbed"] = f"{what}: replaced, not in the median"
        else:
            flag["unreplaced"] = True
            runs[i]["disturbed"] = f"{what}, no replacement left: in the median"
        flags.append(flag)
        print(f"bench: repeat {i + 1} flagged: {flag['why']}"
              + (f"; replaced by repeat {flag['replaced_by']}" if "replaced_by" in flag else
                 f"; bench.extra_repeats ({b.extra_repeats}) spent: it stays in the median"))
    return s, flags


def figures(runs: list[dict], b: Bench) -> dict:
    """The bench's figures from its timed runs (params `bench` `b`): medians and the interval over the runs the screen
    kept (screen_runs); a replaced run stays in `runs` (marked) and in `disturbed`, never in a figure."""
    screened, flags = screen_runs(runs, b)
    used = [runs[i] for i in screened["clean"]]
    summ = {key: summary.summarize([run[key] for run in used]) for key in ("output_tps", "total_tps", "requests_per_s")}
    return {"output_tps": summ["output_tps"]["median"], "total_tps": summ["total_tps"]["median"],
            "requests_per_s": summ["requests_per_s"]["median"], "output_tps_ci95": summ["output_tps"]["ci95"],
            "output_tps_runs": summ["output_tps"]["values"],  # what a Δ vs another rung is computed from
            "repeats": len(used), "timed_passes": len(runs), "far_share": b.far_share, "busy_share": b.busy_share,
            "disturbed": flags,  # each timed repeat replaced (far off the others) or left far (no replacement left)
            "summary": summ}


def write_na(out: Path, logs: Path, reason: str, label: str, params: Params, cfg: dict) -> None:
    """A bench that measured nothing, and why: the record's null figures, and logs/skipped.txt (a declared output)."""
    common.write_text(logs / "skipped.txt", reason + "\n")
    BenchResult(**{
        "status": "n/a", "reason": reason, "label": label,
        "output_tps": None, "total_tps": None, "requests_per_s": None,
        "output_tps_ci95": None, "output_tps_runs": [], "repeats": 0,
        "mode": params.bench.mode, "wall_s": 0, "time": common.stage_time(0, 0),
        "provenance": upstream.provenance(params, cfg)}).save_file(out)
    print(f"bench: n/a — {reason}")


def main(out: Path, logs: Path, gate_json: Path):
    params = common.stage_start()
    cfg, b, w = upstream.engine_config(params), params.bench, params.workload
    failed = gate_failed(params, gate_json)
    if failed:  # the rung is reverted whatever its speed: no engine started for it
        write_na(out, logs, failed, common.GATE_FAILED, params, cfg)
        return
    na = vllm_compat.offline_unsupported(cfg["engine"])
    if na:  # not a failure: the rung is judged by the knee, and the record says why there is no bench figure
        write_na(out, logs, na, "offline engine cannot run it", params, cfg)
        return
    entry = upstream.model_entry(cfg["model"]["name"])
    engine.check_start(params, "rung", cfg, entry["path"], logs)  # what vLLM would refuse, before any engine starts
    mode, t0 = b.mode, time.monotonic()
    sent, input_len = workload.prepare(w.model_dump(), entry["path"], logs)  # a dict: sent as the result records it
    argv = throughput.throughput_argv(entry["path"], b, sent, cfg["engine"])
    # params run.warm_up, declared by the stage: whether an untimed engine warms the machine changes what the timed
    # one reads, so it is in the run-cache's key (an environment variable was not: a cold bench could be restored
    # as a warmed one's)
    warm = (throughput.warm_up(argv, logs, cfg["env"], b.timeout_s, throughput.job_of(sent), b.warm_up_passes)
            if b.warm_up_engine and params.run.warm_up else None)
    if mode == "engine":
        runs, facts = throughput.run_in_engine(argv, b.repeats, logs, cfg["env"], b.timeout_s, b.warmup_repeats,
                                               throughput.job_of(sent, b), b.warmup_prompts)
    else:
        runs, facts = throughput.run_cli(argv, b.repeats, logs, cfg["env"], b.timeout_s, throughput.job_of(sent, b))
    for i, run in enumerate(runs, 1):
        run["applied"] = check_shape(run, b.num_prompts, input_len, w.output_len)
        print(f"bench: run {i}/{len(runs)}: {run['output_tps']:.1f} output tok/s")
    BenchResult(**{
        "status": "ok",
        "method": method(b, mode),
        **figures(runs, b),
        "mode": mode,
        "workload": workload.describe(sent),
        "shape": {"num_prompts": b.num_prompts, "input_len": input_len, "output_len": w.output_len,
                  "dataset": w.kind, "ignore_eos": True, "warmups": b.warmups,
                  "warmup_repeats": b.warmup_repeats if mode == "engine" else 0,
                  "warmup_prompts": b.warmup_prompts if mode == "engine" else None},
        "warmup_output_tps": facts.get("warmup_output_tps"),  # the untimed passes: how slow a cold pass was
        "warm_up_engine": warm,  # the untimed engine before this one (the first bench of a ladder run), or None
        "applied_shape": runs[0]["applied"],
        "kv_cache_tokens": facts.get("kv_cache_tokens"),
        "max_concurrency": facts.get("max_concurrency"),
        "engine_init_s": facts.get("engine_init_s"),
        "wall_s": round(time.monotonic() - t0, 1),
        "time": common.stage_time(facts["timing"]["start_s"] + (warm or {}).get("wall_s", 0.0),
                                  facts["timing"]["measure_s"]),  # a warm-up engine counts as starting
        "engine": facts,
        "runs": runs,
        "provenance": upstream.provenance(params, cfg),
    }).save_file(out)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        throughput.worker(sys.argv[2])
        sys.exit(0)
    args = common.paths(__doc__.split("\n")[0], bench="results/bench.json", logs="results/logs/bench",
                        gate="results/gate.json")
    common.run_stage(main, (common.ParamsError, engine.EngineError, ShapeError, vllm_compat.VllmCompatError,
                            workload.WorkloadError), args.bench, args.logs, args.gate)
