"""Stage `bench`: `vllm bench throughput` on the fixed decode-heavy shape, `bench.repeats` times.

vLLM's CLI starts one engine per run and has no in-engine repeat, so each repeat is a fresh engine with
`--num-warmups` requests before its timed part: the spread across repeats is the run-to-run noise a user
will see. vLLM 0.26/0.32 ignore --input-len/--output-len for the random dataset, so the --random-* flags
are used and the shape vLLM actually ran is read back from its output and checked against params.
"""
from __future__ import annotations

import re
import time

import common
import engine
import stats

_THROUGHPUT = re.compile(r"Throughput: ([\d.]+) requests/s, ([\d.]+) total tokens/s, ([\d.]+) output tokens/s")
_PROMPT_TOK = re.compile(r"Total num prompt tokens:\s+(\d+)")
_OUTPUT_TOK = re.compile(r"Total num output tokens:\s+(\d+)")


class ShapeError(RuntimeError):
    pass


def parse_output(text: str) -> dict:
    """The numbers `vllm bench throughput` prints (its --output-json lacks output tok/s)."""
    m = _THROUGHPUT.search(text)
    if not m:
        raise ShapeError("no 'Throughput:' line in vllm bench throughput output")
    out = {"requests_per_s": float(m.group(1)), "total_tps": float(m.group(2)), "output_tps": float(m.group(3))}
    if p := _PROMPT_TOK.search(text):
        out["prompt_tokens"] = int(p.group(1))
    if o := _OUTPUT_TOK.search(text):
        out["output_tokens"] = int(o.group(1))
    return out


def check_shape(run: dict, num_prompts: int, input_len: int, output_len: int) -> dict:
    """Applied tokens per request, as vLLM counted them; raise if they are not the shape params asked for."""
    applied = {"input_len": run.get("prompt_tokens", 0) / num_prompts, "output_len": run.get("output_tokens", 0) / num_prompts}
    if applied["output_len"] != output_len or abs(applied["input_len"] - input_len) > max(1, 0.02 * input_len):
        raise ShapeError(f"vLLM ran {applied['input_len']:g} in / {applied['output_len']:g} out tokens per request, "
                         f"params ask {input_len} / {output_len} (bench.input_len / bench.output_len)")
    return applied


def main():
    params = common.stage_start()
    cfg, b = common.rung_config(params), params["bench"]
    entry = common.model_entry(cfg["model"]["name"])
    logs = common.RESULTS / "logs" / "bench"
    eng = dict(cfg["engine"])
    shape = ["--dataset-name", "random", "--random-input-len", str(b["input_len"]), "--random-output-len",
             str(b["output_len"]), "--random-range-ratio", "0", "--num-prompts", str(b["num_prompts"]),
             "--num-warmups", str(b.get("warmups", 0))]
    runs, t_all = [], time.monotonic()
    for r in range(b["repeats"]):
        log = logs / f"run{r + 1}.log"
        t0 = time.monotonic()
        proc = engine.run(engine.vllm_cli() + ["bench", "throughput", "--model", entry["path"]] + shape +
                          engine.cli_flags(eng), log, engine.child_env(cfg["env"]), timeout=b.get("timeout_s", 1800),
                          what="vllm bench throughput")
        text = log.read_text(encoding="utf-8", errors="replace")
        run = parse_output(text)
        run["applied"] = check_shape(run, b["num_prompts"], b["input_len"], b["output_len"])
        run.update(wall_s=round(time.monotonic() - t0, 1), engine=engine.engine_facts(log), lines=proc.lines_seen)
        runs.append(run)
        print(f"bench: run {r + 1}/{b['repeats']}: {run['output_tps']:.1f} output tok/s ({run['wall_s']:.0f} s)")
    out = {key: stats.summarize([run[key] for run in runs]) for key in ("output_tps", "total_tps", "requests_per_s")}
    facts = runs[0]["engine"]
    common.write_json(common.RESULTS / "bench.json", {
        "output_tps": out["output_tps"]["median"],
        "total_tps": out["total_tps"]["median"],
        "requests_per_s": out["requests_per_s"]["median"],
        "output_tps_ci95": out["output_tps"]["ci95"],
        "repeats": len(runs),
        "shape": {"num_prompts": b["num_prompts"], "input_len": b["input_len"], "output_len": b["output_len"],
                  "dataset": "random", "ignore_eos": True, "warmups": b.get("warmups", 0)},
        "applied_shape": runs[0]["applied"],
        "kv_cache_tokens": facts.get("kv_cache_tokens"),
        "max_concurrency": facts.get("max_concurrency"),
        "engine_init_s": facts.get("engine_init_s"),
        "wall_s": round(time.monotonic() - t_all, 1),
        "summary": out,
        "runs": runs,
        "provenance": common.provenance(params, cfg),
    })


if __name__ == "__main__":
    try:
        main()
    except (common.ParamsError, engine.EngineError, ShapeError) as e:
        common.die(str(e), 1)
