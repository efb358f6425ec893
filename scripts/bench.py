"""Stage `bench`: vLLM's `bench throughput` on params `workload`, `bench.repeats` timed runs.

bench.mode `engine`: vLLM's own `vllm.benchmarks.throughput.main`, its arguments parsed by its own
parser, with its `run_vllm` wrapped so that ONE engine serves the warm-up and every timed repeat (an engine
start costs more than the measurement). bench.mode `cli`: `vllm bench throughput` once per repeat, each a
fresh engine, so the spread also holds start-to-start noise. vLLM 0.26/0.32 ignore --input-len/--output-len
for the random dataset, so the --random-* flags are used and the shape vLLM ran is checked against params.
A prompts file (workload.kind file) is rendered with the model's chat template into results/logs/bench/.
"""
from __future__ import annotations

import re
import sys
import time

import common
import engine
import stats
import vllm_compat
import workload

_THROUGHPUT = re.compile(r"Throughput: ([\d.]+) requests/s, ([\d.]+) total tokens/s, ([\d.]+) output tokens/s")
_PROMPT_TOK = re.compile(r"Total num prompt tokens:\s+(\d+)")
_OUTPUT_TOK = re.compile(r"Total num output tokens:\s+(\d+)")


class ShapeError(RuntimeError):
    pass


def parse_output(text: str) -> list[dict]:
    """Every result block `vllm bench throughput` printed (its --output-json lacks output tok/s)."""
    runs = []
    for m in _THROUGHPUT.finditer(text):
        run = {"requests_per_s": float(m.group(1)), "total_tps": float(m.group(2)), "output_tps": float(m.group(3))}
        rest = text[m.end():m.end() + 400]
        if p := _PROMPT_TOK.search(rest):
            run["prompt_tokens"] = int(p.group(1))
        if o := _OUTPUT_TOK.search(rest):
            run["output_tokens"] = int(o.group(1))
        runs.append(run)
    if not runs:
        raise ShapeError("no 'Throughput:' line in the vllm bench throughput output")
    return runs


def check_shape(run: dict, num_prompts: int, input_len: int | tuple[int, int], output_len: int) -> dict:
    """Applied tokens per request, as vLLM counted them; raise if they are not the shape params asked for.
    `input_len` is a (shortest, longest) range for a prompts file."""
    applied = {"input_len": run.get("prompt_tokens", 0) / num_prompts, "output_len": run.get("output_tokens", 0) / num_prompts}
    lo, hi = input_len if isinstance(input_len, tuple) else (input_len, input_len)
    slack = max(1, 0.02 * hi)
    if applied["output_len"] != output_len or not lo - slack <= applied["input_len"] <= hi + slack:
        want = f"{lo}-{hi}" if lo != hi else f"{lo}"
        raise ShapeError(f"vLLM ran {applied['input_len']:g} in / {applied['output_len']:g} out tokens per request, "
                         f"params ask {want} / {output_len} (workload)")
    return applied


def worker(job_path: str) -> None:
    """In the child: vLLM's own throughput benchmark, one engine, warm-up then `repeats` timed runs."""
    import vllm.benchmarks.throughput as T
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    job = common.read_json(job_path)
    parser = FlexibleArgumentParser()
    T.add_cli_args(parser)
    args = parser.parse_args(job["argv"])

    def run_vllm(requests, n, engine_args, do_profile, disable_detokenize=False, warmup_requests=None,
                 prequeue_requests=False):
        from vllm import LLM
        llm = LLM.from_engine_args(engine_args)
        kw = dict(n=n, disable_detokenize=disable_detokenize, do_profile=False, prequeue_requests=prequeue_requests,
                  enable_lora=engine_args.enable_lora)
        if warmup_requests:
            print(f"Warming up with {len(warmup_requests)} requests...")
            T._run_vllm_requests(llm, warmup_requests, **kw)
        for r in range(job["repeats"]):
            # Every repeat re-sends the same seeded prompts: with prefix caching on, repeat 2 would be served
            # from repeat 1's cache (seen on the H200: 14.7k -> 20.2k tok/s). Each repeat starts cold.
            llm.reset_prefix_cache()
            elapsed, outputs = T._run_vllm_requests(llm, requests, **kw)
            p = sum(len(o.prompt_token_ids or []) for o in outputs)
            o = sum(len(c.token_ids) for out in outputs for c in out.outputs if c is not None)
            print(f"[repeat {r + 1}/{job['repeats']}] Throughput: {len(requests) / elapsed:.2f} requests/s, "
                  f"{(p + o) / elapsed:.2f} total tokens/s, {o / elapsed:.2f} output tokens/s\n"
                  f"Total num prompt tokens:  {p}\nTotal num output tokens:  {o}", flush=True)
        return elapsed, outputs

    T.run_vllm = run_vllm  # the only change to vLLM's flow: the timed part runs `repeats` times
    if job.get("prompts"):  # a prompts file: vLLM's own CustomDataset samples it (throughput has no `custom`)
        T.get_requests = vllm_compat.custom_requests(job["prompts"], job["output_len"])
    T.main(args)


def throughput_argv(model_path: str, b: dict, w: dict, engine_knobs: dict) -> list[str]:
    """`vllm bench throughput` arguments: the workload, params `bench`, the rung's knobs unchanged."""
    return (["--model", model_path] + vllm_compat.dataset_flags(w, "throughput") +
            ["--num-prompts", str(b["num_prompts"]), "--num-warmups", str(b["warmups"])] +
            engine.cli_flags(engine_knobs))


def job_of(sent: dict) -> dict:
    """What the in-engine worker needs besides its argv: a rendered prompts file, if any."""
    return {"prompts": sent["prompts"], "output_len": sent["output_len"]} if sent.get("prompts") else {}


def run_in_engine(argv: list[str], repeats: int, logs, env_knobs: dict, timeout: float,
                  job: dict | None = None) -> tuple[list[dict], dict]:
    """`repeats` timed runs inside one engine (bench.mode engine): their results and the engine's facts."""
    proc = engine.run_worker(__file__, {"argv": argv, "repeats": repeats, **(job or {})}, logs, env_knobs, timeout,
                             "vllm bench throughput (in-engine repeats)")
    return parse_output(proc.log.read_text(encoding="utf-8", errors="replace"))[:repeats], engine.engine_facts(proc.log)


def run_cli(argv: list[str], repeats: int, logs, env_knobs: dict, timeout: float,
            job: dict | None = None) -> tuple[list[dict], dict]:
    """`vllm bench throughput` once per repeat, a fresh engine each (bench.mode cli): results and engine facts."""
    runs, facts = [], {}
    for r in range(repeats):
        log = logs / f"run{r + 1}.log"
        engine.run(engine.vllm_cli() + ["bench", "throughput"] + argv, log, engine.child_env(env_knobs),
                   timeout=timeout, what="vllm bench throughput")
        runs += parse_output(log.read_text(encoding="utf-8", errors="replace"))[:1]
        facts = facts or engine.engine_facts(log)
    return runs, facts


def main():
    params = common.stage_start()
    cfg, b, w = common.rung_config(params), params["bench"], params["workload"]
    entry = common.model_entry(cfg["model"]["name"])
    mode = b["mode"]
    runner = {"engine": run_in_engine, "cli": run_cli}[mode]
    logs = common.RESULTS / "logs" / "bench"
    t0 = time.monotonic()
    sent, input_len = workload.prepare(w, entry["path"], logs)
    runs, facts = runner(throughput_argv(entry["path"], b, sent, cfg["engine"]), b["repeats"], logs,
                         cfg["env"], b["timeout_s"], job_of(sent))
    for i, run in enumerate(runs, 1):
        run["applied"] = check_shape(run, b["num_prompts"], input_len, w["output_len"])
        print(f"bench: run {i}/{len(runs)}: {run['output_tps']:.1f} output tok/s")
    out = {key: stats.summarize([run[key] for run in runs]) for key in ("output_tps", "total_tps", "requests_per_s")}
    common.write_json(common.RESULTS / "bench.json", {
        "output_tps": out["output_tps"]["median"],
        "total_tps": out["total_tps"]["median"],
        "requests_per_s": out["requests_per_s"]["median"],
        "output_tps_ci95": out["output_tps"]["ci95"],
        "output_tps_runs": out["output_tps"]["values"],  # what a Δ vs another rung is computed from
        "repeats": len(runs),
        "mode": mode,
        "workload": workload.describe(w),
        "shape": {"num_prompts": b["num_prompts"], "input_len": input_len, "output_len": w["output_len"],
                  "dataset": w["kind"], "ignore_eos": True, "warmups": b["warmups"]},
        "applied_shape": runs[0]["applied"],
        "kv_cache_tokens": facts.get("kv_cache_tokens"),
        "max_concurrency": facts.get("max_concurrency"),
        "engine_init_s": facts.get("engine_init_s"),
        "wall_s": round(time.monotonic() - t0, 1),
        "engine": facts,
        "summary": out,
        "runs": runs,
        "provenance": common.provenance(params, cfg),
    })


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        worker(sys.argv[2])
        sys.exit(0)
    common.run_stage(main, (common.ParamsError, engine.EngineError, ShapeError, workload.WorkloadError))
