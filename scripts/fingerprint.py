"""Stage `fingerprint`: the machine and software that numbers are measured on, plus a preflight check.

DVC runs it every time (always_changed); eval, bench and knee depend on its output, so the run-cache never
restores a measurement taken on another GPU, driver, vLLM or torch. It also validates params.yaml and the
eval file first (engine args with vLLM's own parser), so bad input stops the pipeline before any stage
deletes a good result.
"""
from __future__ import annotations

import sys
from pathlib import Path

import common
from measure import host, score, workload
from records.fingerprint import Fingerprint
from serving import vllm_compat


def check_engine_args(params: common.Params) -> None:
    """Every engine arg through vLLM's own parser, and the knee's `vllm serve` arguments (params `serve`) through
    `vllm serve`'s, before `dvc repro` starts any engine. Importing vLLM costs seconds (~15 s on 2 cores, once per
    rung), so an arg this very vLLM already accepted, here or in `make ladder`'s pre-flight, is not checked again."""
    args = common.engine_args(params)
    accepted = vllm_compat.accepted_args()
    todo = [a for a in args if vllm_compat.arg_key(a[1], a[2]) not in accepted]
    serve = {k: v for k, v in params.serve.model_dump().items() if vllm_compat.serve_key(k, v) not in accepted}
    errors, unchecked = vllm_compat.check_serve(serve) if serve else ([], None)
    if unchecked:
        print(f"warning: {unchecked}", file=sys.stderr)
    errors += vllm_compat.engine_arg_errors(todo) if todo else []
    if errors:
        raise common.ParamsError("params.yaml is not valid:\n  " + "\n  ".join(errors))
    if todo:
        vllm_compat.remember_accepted(todo)


def main(out: Path):
    params = common.stage_start()
    score.load_items(params.eval.file)
    workload.check(params)
    check_engine_args(params)
    fp = host.fingerprint()
    for which in ("baseline", "rung"):  # a target card this machine cannot emulate stops here, before any engine
        common.engine_config(params, which, fp["gpus"])
    Fingerprint.model_validate(fp).save_file(out)


if __name__ == "__main__":
    args = common.paths(__doc__.split("\n")[0], fingerprint="results/fingerprint.json")
    common.run_stage(main, (common.ParamsError, score.EvalFileError, workload.WorkloadError), args.fingerprint)
