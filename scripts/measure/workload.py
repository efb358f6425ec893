"""The traffic bench and knee send: params `workload`, one section for both stages.

  random         unrelated prompts of a fixed shape (input_len in / output_len out tokens)
  shared-prefix  every request starts with the same prefix_len-token system prompt, then input_len tokens of
                 its own: the traffic prefix caching can help
  file           the user's own prompts, a JSONL file, one request a line:
                   {"prompt": "..."}                               one user turn
                   {"messages": [{"role": "system", "content": "..."}, {"role": "user", "content": "..."}]}
                 each rendered with the model's chat template; every request generates output_len tokens

Each stage records `describe()` in its result, and the report prints that description as it is: the report
never knows workload names. The vLLM flags that spell a workload live in vllm_compat.
"""
from __future__ import annotations

import json
from pathlib import Path

import common

KINDS = ("random", "shared-prefix", "file")
SEED = 0  # the bench's prompts are drawn with this seed, whatever engine.seed (the knee's: probing.probe_seed)
ROLES = ("system", "user", "assistant")


class WorkloadError(ValueError):
    """A bad workload or prompts file: the message names the field or the file and line."""


def file_path(w: dict) -> Path:
    p = Path(str(w["file"])).expanduser()
    return p if p.is_absolute() else common.ROOT / p


def _item(obj, where: str) -> dict:
    if not isinstance(obj, dict):
        raise WorkloadError(f"{where}: expected a JSON object with `prompt` or `messages`, got {type(obj).__name__}")
    keys = set(obj) & {"prompt", "messages"}
    if len(keys) != 1:
        raise WorkloadError(f"{where}: expected exactly one of `prompt` (a string) or `messages` (chat turns), "
                            f"got fields {', '.join(sorted(obj)) or 'none'}")
    if "prompt" in obj:
        if not isinstance(obj["prompt"], str) or not obj["prompt"].strip():
            raise WorkloadError(f"{where}: `prompt` must be a non-empty string, got {obj['prompt']!r}")
        return {"messages": [{"role": "user", "content": obj["prompt"]}]}
    turns = obj["messages"]
    if not isinstance(turns, list) or not turns:
        raise WorkloadError(f"{where}: `messages` must be a non-empty list of {{role, content}} turns")
    for i, t in enumerate(turns, 1):
        if not (isinstance(t, dict) and t.get("role") in ROLES and isinstance(t.get("content"), str)):
            raise WorkloadError(f"{where}: messages[{i}] must be {{\"role\": {' | '.join(ROLES)}, "
                                f"\"content\": a string}}, got {t!r}")
    if turns[-1]["role"] == "assistant":
        raise WorkloadError(f"{where}: the last turn is the assistant's; the model answers the last user turn")
    return {"messages": turns}


def load_file(path: Path | str) -> list[dict]:
    """Every request of a prompts file as chat turns; WorkloadError naming the line of the first bad one."""
    path = Path(path)
    rel = path.relative_to(common.ROOT) if path.is_relative_to(common.ROOT) else path
    if not path.is_file():
        raise WorkloadError(f"workload.file: {str(rel)!r}: no such file")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise WorkloadError(f"workload.file: cannot read {rel} ({e})") from None
    items = []
    for n, obj in common.json_lines(lines, WorkloadError, f"workload.file: {rel}"):
        items.append(_item(obj, f"workload.file: {rel}:{n}"))
    if not items:
        raise WorkloadError(f"workload.file: {rel} holds no request (one JSON object a line)")
    return items


def check(params: common.Params) -> None:
    """A prompts file's lines (kind file), before any engine starts: common.ParamsError naming the line."""
    if params.workload.kind == "file":
        try:
            load_file(file_path(params.workload.model_dump()))  # file_path also reads recorded workloads
        except WorkloadError as e:
            raise common.ParamsError(f"params.yaml is not valid:\n  {e}") from None


def describe(w: dict) -> dict:
    """The workload in words, as the stages record it and the report prints it."""
    kind, out = w["kind"], w["output_len"]
    if kind == "random":
        text = f"random prompts, {w['input_len']} in / {out} out tokens per request"
        shared = "no: random prompts share no prefix, so prefix caching can only show its overhead here"
    elif kind == "shared-prefix":
        text = (f"shared prefix: the same {w['prefix_len']}-token system prompt (one per run; each knee probe draws "
                f"its own), then {w['input_len']} random tokens of each request's own "
                f"({w['prefix_len'] + w['input_len']} in) / {out} out tokens per request")
        shared = (f"yes: every request starts with the same {w['prefix_len']} tokens "
                  f"({w['prefix_len'] / (w['prefix_len'] + w['input_len']):.0%} of its prompt), so prefix caching "
                  f"can skip their prefill")
    else:
        text = (f"the prompts file {w['file']} ({len(load_file(file_path(w)))} requests, chat template applied) / "
                f"{out} out tokens per request")
        shared = "as the prompts file has it: the prefix-cache hit rate measured by the knee stage tells"
    return {"kind": kind, "text": text + " (ignore_eos: every request generates all of them)", "shared_prefix": shared,
            "shared_prefix_len": w.get("prefix_len", 0) if kind == "shared-prefix" else 0}


def render(w: dict, model_path: str, out: Path) -> list[int]:
    """kind file: the requests rendered with the model's chat template into `out` (vLLM's custom dataset format,
    {"prompt": text} a line; sent with --skip-chat-template). Returns each prompt's length in tokens."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_path)
    texts = []
    for item in load_file(file_path(w)):
        if tok.chat_template:
            texts.append(tok.apply_chat_template(item["messages"], add_generation_prompt=True, tokenize=False))
        elif len(item["messages"]) == 1:
            texts.append(item["messages"][0]["content"])  # a base model: the prompt as it is
        else:
            raise WorkloadError(f"workload.file: chat turns need a chat template; {model_path} has none")
    common.write_text(out, "".join(json.dumps({"prompt": t}, ensure_ascii=False) + "\n" for t in texts))
    return [len(tok(t).input_ids) for t in texts]


def prepare(w: dict, model_path: str, logs: Path) -> tuple[dict, int | tuple[int, int]]:
    """The workload as a stage sends it: kind file rendered into logs/prompts.jsonl (its path under "prompts",
    its mean prompt length under "prompt_tokens_mean"). Also the prompt tokens each request should have: an
    int, or (shortest, longest) for a prompts file."""
    if w["kind"] == "file":
        lens = render(w, model_path, Path(logs) / "prompts.jsonl")
        return ({**w, "prompts": str(Path(logs) / "prompts.jsonl"), "prompt_tokens_mean": sum(lens) / len(lens)},
                (min(lens), max(lens)))
    return dict(w), w["input_len"] + (w["prefix_len"] if w["kind"] == "shared-prefix" else 0)
