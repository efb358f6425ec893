"""The bench stage's throughput runs: vLLM's `bench throughput` inside one engine (run_in_engine, the child's side
in `worker`) or once per engine (run_cli), and the untimed warm-up engine a ladder run starts first (warm_up). The
bench stage measures with them; `make benchmark` (benchmark_noise.py) runs the same code; the ladder says which
bench warms the machine first (params run.warm_up, a param the bench stage declares).
"""
from __future__ import annotations

import time
from pathlib import Path

import common
from config import Bench
from measure import disturbed, workload
from serving import engine, vllm_compat

# The child process run_in_engine starts (engine.run_worker: `python <script> --worker job.json`): the bench stage's
# script, whose `--worker` runs `worker` below. A file run, never imported: no module imports a stage script.
WORKER_SCRIPT = str(Path(__file__).resolve().parents[1] / "bench.py")


def worker(job_path: str) -> None:
    """In the child: vLLM's own throughput benchmark, one engine, warm-up then `repeats` timed runs, and one more for
    each that is far off the others or ran while other work kept the machine busy (disturbed.screen, up to
    bench.extra_repeats); each pass's other work measured."""
    job = common.read_json(job_path)
    far, busy, extra = job.get("far_share"), job.get("busy_share"), job.get("extra_repeats") or 0
    more = ((lambda done, loads: disturbed.screen(done, job["repeats"], far, extra, loads, busy)["more"])
            if (far or busy) and extra else None)
    vllm_compat.run_throughput(job["argv"], job["repeats"], job["warmup_repeats"], job.get("prompts"),
                               job.get("output_len"), job["dataset_seed"], job.get("warmup_prompts"), more=more,
                               watch=disturbed.watch)


def throughput_argv(model_path: str, b: Bench, w: dict, engine_knobs: dict) -> list[str]:
    """`vllm bench throughput` arguments: the workload (as workload.prepare made it), params `bench`, the rung's
    knobs unchanged."""
    return (["--model", model_path] + vllm_compat.dataset_flags(w, "throughput") +
            ["--num-prompts", str(b.num_prompts), "--num-warmups", str(b.warmups)] +
            engine.cli_flags(engine_knobs))


def job_of(sent: dict, b: Bench | None = None) -> dict:
    """What the worker needs besides its argv: the seed its prompts are drawn with (never the engine's: a rung
    that changes engine.seed must not change the traffic), a rendered prompts file, if any, and (params `bench`
    `b`) how a repeat far off the others is replaced (disturbed.screen)."""
    return {"dataset_seed": workload.SEED,
            **({"prompts": sent["prompts"], "output_len": sent["output_len"]} if sent.get("prompts") else {}),
            **({"far_share": b.far_share, "busy_share": b.busy_share, "extra_repeats": b.extra_repeats} if b else {})}


def run_in_engine(argv: list[str], repeats: int, logs, env_knobs: dict, timeout: float, warmup_repeats: int,
                  job: dict, warmup_prompts: int | None = None) -> tuple[list[dict], dict]:
    """`repeats` timed runs inside one engine (bench.mode engine), after `warmup_repeats` untimed ones: their
    results and the engine's facts (with the warm-up passes' tok/s and the `timing` split of the worker's wall).
    `job`: job_of(the workload sent)."""
    spawned = time.time()
    proc = engine.run_worker(WORKER_SCRIPT, {"argv": argv, "repeats": repeats, "warmup_repeats": warmup_repeats,
                                             "warmup_prompts": warmup_prompts, **job}, logs, env_knobs, timeout,
                             "vllm bench throughput (in-engine repeats)")
    text = proc.log.read_text(encoding="utf-8", errors="replace")
    runs = vllm_compat.parse_output(text)[:vllm_compat.timed_passes(text) or repeats] if repeats else []
    loads = vllm_compat.pass_loads(text)
    for i, run in enumerate(runs, 1):
        run["load"] = loads.get(i)  # the other work on the machine during the pass (disturbed.CpuWatch)
    return (runs, {**vllm_compat.engine_facts(proc.log), "warmup_output_tps": vllm_compat.warmup_passes(text),
                   "timing": vllm_compat.bench_timing(text, spawned)})


def run_cli(argv: list[str], repeats: int, logs, env_knobs: dict, timeout: float, job: dict) -> tuple[list[dict], dict]:
    """vLLM's bench throughput once per repeat, each its own process and engine (bench.mode cli), so the spread
    holds the start-to-start noise: results and the first engine's facts, `timing` summed over the runs. A run far off
    the others, or run while other work kept the machine busy, is replaced by one more engine (disturbed.screen, job's
    far_share, busy_share and extra_repeats)."""
    runs, facts, timing = [], {}, {"start_s": 0.0, "measure_s": 0.0}
    one = {k: v for k, v in job.items() if k not in ("far_share", "busy_share", "extra_repeats")}  # nothing inside
    while len(runs) < repeats or disturbed.screen([x["output_tps"] for x in runs], repeats, job.get("far_share"),
                                                  job.get("extra_repeats") or 0, [x.get("load") for x in runs],
                                                  job.get("busy_share"))["more"]:
        r = len(runs)
        got, f = run_in_engine(argv, 1, Path(logs) / f"run{r + 1}", env_knobs, timeout, 0, one)
        runs += got
        facts = facts or f
        for k in timing:
            timing[k] += f["timing"][k] or 0.0
    return runs, {**facts, "timing": {k: round(v, 2) for k, v in timing.items()}}


def warm_up(argv: list[str], logs: Path, env_knobs: dict, timeout: float, job: dict, passes: int = 1) -> dict:
    """An untimed engine before the first timed one of a ladder run (bench.warm_up_engine, where run.warm_up says
    this bench is the run's first): whatever runs first on a machine reads slow. `passes` (bench.warm_up_passes)
    whole passes of the bench's prompts, or none: the engine only starts (its compile fills the machine's cache).
    The first pass's tok/s is kept (the first engine vs the timed one), never compared."""
    t0 = time.monotonic()
    runs, facts = run_in_engine(argv, passes, logs / "warm-up", env_knobs, timeout, 0, job)
    out = {"output_tps": runs[0]["output_tps"] if runs else None, "wall_s": round(time.monotonic() - t0, 1),
           "passes": passes, "start_s": facts["timing"]["start_s"]}
    print("bench: warm-up engine (untimed): " + (f"{out['output_tps'] or 0:.1f} output tok/s" if passes else
                                                  f"started only ({out['start_s'] or 0:.0f} s)")
          + f" in {out['wall_s']:.0f} s")
    return out
