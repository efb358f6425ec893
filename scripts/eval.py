"""Stage `eval` (and `eval_baseline`): the fixed eval set through `LLM.chat`, greedy, scored per category.

  python scripts/eval.py            the rung in force (model/engine/env)  -> results/eval.json, eval_items.jsonl
                                    (run on rung 0's inputs: results/baseline's result copied, no engine started)
  python scripts/eval.py baseline   rung 0 (baseline.*), the gate's reference -> results/baseline/...
                                    (twice: the second pass, in reverse order, is the noise floor)
  Arguments: [rung|baseline] [OUT_DIR] [BASELINE_DIR], as dvc.yaml passes them.

The engine runs in a child process owned by serving/engine.py (logs, timeout, clean stop); the child is this same
file with --worker. Dummy weights (load_format: dummy) have no quality to measure, and knobs vLLM's offline engine
cannot run (vllm_compat.offline_unsupported) none to measure here: the stage records n/a, why, and starts nothing.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import common
from config import Eval
from measure import score
from records import upstream
from records.eval import EvalResult
from serving import engine, vllm_compat

# The baseline's own noise, which the gate discounts: the same items again in the same engine, in reverse order, so
# that each is batched with other items (vLLM's batch composition changes the numerics a rung's knob may also
# change); two fresh engines in the same order give identical texts on CPU and would measure nothing.
# vLLM's batch-invariant mode (VLLM_BATCH_INVARIANT=1, 0.26 and 0.32) does not apply here: it swaps in Triton
# kernels for CUDA, ROCm and XPU, leaving CPU GEMMs as they are; and rungs do not run with it, so the floor is
# measured as they run.
RECHECK = "rung 0 evaluated twice in one engine, the second time in reverse item order (other batches)"


def inputs(cfg: dict, ev: Eval, entry: dict) -> dict:
    """What decides an eval's answers (greedy): the engine config as it runs (common.engine_config: env and target
    card included), the model's files, the eval set and its sampling. Recorded in eval.json; not timeout_s."""
    return {"knobs": cfg, "model_sha256": entry.get("sha256"), "eval_sha256": common.sha256_file(ev.file),
            "temperature": ev.temperature, "seed": ev.seed, "max_tokens": ev.max_tokens}


def reusable(mine: dict, base: EvalResult | None) -> bool:
    """The rung's answers are the baseline's when the baseline ran on exactly the same inputs: rung 0, whose
    eval and eval_baseline stages would otherwise each start an engine to give the same texts."""
    return (base is not None and base.status == "ok" and base.inputs is not None
            and base.inputs.model_dump(mode="json") == mine)


def reuse(base_dir: Path, base: EvalResult, out: Path) -> None:
    """This rung's result is the baseline's, copied: no engine starts, so its time is its own (imports) and its
    engine facts are those of the engine that produced the answers."""
    common.write_text(out / "eval_items.jsonl", (base_dir / "eval_items.jsonl").read_text(encoding="utf-8"))
    time_ = common.stage_time(0, 0)
    result = EvalResult(**{**base.model_dump(), "nondeterminism": None,  # the recheck is the baseline's own
                           "which": "rung", "reused_from": "eval_baseline", "time": time_,
                           "wall_s": time_["wall_s"]})  # this stage's own: the Time section counts the engine once
    common.write_text(out / "logs" / "eval" / "reused.txt",
                      f"no engine started: the same engine config, model and eval params as {base_dir}, whose "
                      f"eval.json and eval_items.jsonl this rung's are\n")  # a declared output
    result.save_file(out / "eval.json")
    print(f"eval[rung]: {result.correct}/{result.n} = {result.overall:.3f}, taken from {base_dir} "
          f"(same engine config, model and eval params): no engine started")


def conversations(items: list[dict]) -> list[list[dict]]:
    convs = []
    for it in items:
        conv = [{"role": "system", "content": it["system"]}] if it.get("system") else []
        convs.append(conv + [{"role": "user", "content": it["prompt"]}])
    return convs


def worker(job_path: str) -> None:
    """Runs in the child: one engine, one batched greedy `LLM.chat`, texts to a JSON file."""
    from vllm import LLM, SamplingParams
    job = common.read_json(job_path)
    llm = LLM(model=job["model"], **job["engine"])
    ready_at = time.time()  # wall clock: the stage splits its wall time at the worker's engine ready
    sp = SamplingParams(temperature=job["temperature"], seed=job["seed"], max_tokens=job["max_tokens"])
    t0 = time.monotonic()
    outs = llm.chat(job["conversations"], sp, use_tqdm=False)
    gen_s = time.monotonic() - t0
    result = {"texts": [o.outputs[0].text for o in outs], "generate_s": gen_s, "ready_at": ready_at,
              "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs)}
    if job.get("recheck"):  # the same items again in reverse order: other batches, the texts back in item order
        t0 = time.monotonic()
        again = llm.chat(job["conversations"][::-1], sp, use_tqdm=False)
        result.update(recheck_texts=[o.outputs[0].text for o in again][::-1], recheck_s=time.monotonic() - t0)
    common.write_json(job["out"], result)


def main(which: str, out: Path, base_dir: Path) -> None:
    params = common.stage_start()
    cfg = upstream.engine_config(params, which)  # the target card applied, if any
    ev = params.eval
    items = score.load_items(ev.file)
    result = {"which": which, "model": cfg["model"]["name"], "knobs": cfg, "n": len(items),
              "method": (f"{len(items)} items ({ev.file}, sha256 {common.sha256_file(ev.file)[:12]}), "
                         "`LLM.chat`, "
                         f"temperature {ev.temperature}, seed {ev.seed}, max_tokens {ev.max_tokens}"),
              "provenance": upstream.provenance(params, cfg)}
    dummy = cfg["engine"].get("load_format") == "dummy"
    na = ("dummy weights (load_format: dummy): quality is not measured" if dummy
          else vllm_compat.offline_unsupported(cfg["engine"]))
    if na:
        result.update(status="n/a", reason=na, label="dummy weights" if dummy else "offline engine cannot run it",
                      overall=None, by_category={}, time=common.stage_time(0, 0))
        common.write_text(out / "eval_items.jsonl", "")
        common.write_text(out / "logs" / "eval" / "skipped.txt", result["reason"] + "\n")  # a declared output
        EvalResult(**result).save_file(out / "eval.json")
        print(f"eval[{which}]: n/a — {result['reason']}")
        return
    entry = upstream.model_entry(cfg["model"]["name"])
    mine = inputs(cfg, ev, entry)
    base = (EvalResult.load_file(base_dir / "eval.json") if which == "rung" and (base_dir / "eval.json").exists()
            and (base_dir / "eval_items.jsonl").exists() else None)
    if reusable(mine, base):
        reuse(base_dir, base, out)
        return
    logs = out / "logs" / "eval"
    engine.check_start(params, which, cfg, entry["path"], logs)  # what vLLM would refuse, before its engine starts
    job = {"model": entry["path"], "engine": engine.llm_kwargs(cfg["engine"]), "conversations": conversations(items),
           "temperature": ev.temperature, "seed": ev.seed, "max_tokens": ev.max_tokens,
           "out": str(logs / "texts.json"), "recheck": which == "baseline"}
    t0, spawned = time.monotonic(), time.time()
    engine.run_worker(__file__, job, logs, cfg["env"], ev.timeout_s, f"eval[{which}] engine")
    wall = time.monotonic() - t0
    gen = common.read_json(logs / "texts.json")
    summary = score.summarize(items, gen["texts"])
    facts = vllm_compat.engine_facts(logs / "engine.log")
    lines = [json.dumps({**s, "prompt": it["prompt"], "answer": it["answer"], "scoring": it["scoring"], "output": t},
                        ensure_ascii=False) for s, it, t in zip(summary.pop("items"), items, gen["texts"])]
    common.write_text(out / "eval_items.jsonl", "\n".join(lines) + "\n")
    result.update(status="ok", model_id=entry["id"], inputs=mine, **summary, wall_s=round(wall, 1),
                  generate_s=round(gen["generate_s"], 2), output_tokens=gen["output_tokens"], engine=facts,
                  time=common.stage_time(gen["ready_at"] - spawned, gen["generate_s"] + gen.get("recheck_s", 0)))
    if "recheck_texts" in gen:
        result["nondeterminism"] = {**score.flips(items, gen["texts"], gen["recheck_texts"]), "method": RECHECK,
                                    "recheck_s": round(gen["recheck_s"], 2)}
    EvalResult(**result).save_file(out / "eval.json")
    cats = ", ".join(f"{c} {v['correct']}/{v['n']}" for c, v in result["by_category"].items())
    noise = (f"; nondeterminism floor {result['nondeterminism']['flips']} item(s)"
             if "nondeterminism" in result else "")
    print(f"eval[{which}]: {result['correct']}/{result['n']} = {result['overall']:.3f} ({cats}); {wall:.0f} s{noise}")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        worker(sys.argv[2])
        sys.exit(0)
    args = common.paths(__doc__.split("\n")[0], which="rung", out="results", baseline="results/baseline")
    if args.which not in ("rung", "baseline"):
        common.die(f"usage: eval.py [rung|baseline] [OUT_DIR] [BASELINE_DIR], got {args.which!r}")
    common.run_stage(main, (common.ParamsError, score.EvalFileError, engine.EngineError), args.which, args.out,
                     args.baseline)
