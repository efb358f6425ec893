"""Shared glue for the stage scripts: params (load + validate), JSON I/O, provenance, signals.

Every stage script starts with `params = common.load_params()`, which validates the whole file, so a
bad value stops the stage before any engine starts and names the field, the value and what is allowed.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "results"
PARAMS = ROOT / "params.yaml"


class ParamsError(ValueError):
    """A bad params.yaml value (or ladder rung): the message names the field, the value and what is allowed."""


# ---------------------------------------------------------------- knobs
# Engine knobs are vLLM's own engine args: any the installed vLLM has is a legal rung. Their names, types and
# choices are checked by vLLM's own parser (vllm_compat.engine_arg_errors: once per ladder and in the
# fingerprint stage, as importing vLLM costs seconds); here only their spelling.
def _pos_int(v):
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


_ARG_NAME = re.compile(r"[a-z][a-z0-9_]*")
ENV_PREFIX = "VLLM_"      # env knobs are vLLM's own environment variables
SECRET_WORDS = ("TOKEN", "SECRET", "PASSWORD", "API_KEY")


def knob_error(field: str, value, allowed: str) -> str:
    return f"{field}: {value!r} is not allowed; expected {allowed}"


def check_knob(field: str, value) -> str | None:
    """Return an error message for one dotted knob (model.name is checked elsewhere), or None."""
    section, _, name = field.partition(".")
    if section == "engine":
        if not _ARG_NAME.fullmatch(name):
            return f"{field}: unknown knob; engine knobs are vLLM engine args, spelled as in EngineArgs (snake_case)"
        ok = value is None or isinstance(value, (str, int, float, bool, dict, list))
        return None if ok else knob_error(field, value, "a value vLLM's engine-arg parser takes")
    if section == "env":
        if not name.startswith(ENV_PREFIX):
            return f"{field}: unknown knob; env knobs are vLLM environment variables ({ENV_PREFIX}*)"
        if any(w in name for w in SECRET_WORDS):
            return f"{field}: secrets do not belong in params.yaml; set them in the shell"
        ok = isinstance(value, (str, int, float)) and not isinstance(value, bool)
        return None if ok else knob_error(field, value, "a string or a number")
    if field == "model.name":
        return None if isinstance(value, str) and value else knob_error(field, value, "a model name from download.fetch")
    return f"{field}: unknown knob; a rung may change model.name, engine.<vLLM engine arg> or env.VLLM_*"


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


# ---------------------------------------------------------------- validation
def _need(errors, params, dotted, check, allowed):
    node = params
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            errors.append(f"{dotted}: missing; expected {allowed}")
            return None
        node = node[part]
    if not check(node):
        errors.append(knob_error(dotted, node, allowed))
    return node


def _pos_num(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0


def validate(params: dict) -> None:
    """Raise ParamsError listing every bad field of params.yaml (ladder rungs are checked by ladder.py)."""
    errors = []
    catalog = (params.get("download") or {}).get("catalog") or {}
    fetch = _need(errors, params, "download.fetch", lambda v: isinstance(v, list) and v, "a list of model names") or []
    for name in fetch:
        if name not in catalog:
            errors.append(f"download.fetch: {name!r} is not in download.catalog ({', '.join(catalog)})")
        elif (catalog[name] or {}).get("source") == "local":
            path = (catalog[name] or {}).get("path")
            why = local_model_problem(path) if isinstance(path, str) and path else "expected a model folder"
            if why:
                errors.append(f"download.catalog.{name}.path: {path!r}: {why}")
    for which in ("baseline", ""):
        prefix = f"{which}." if which else ""
        node = params.get(which) if which else params
        if not isinstance(node, dict):
            errors.append(f"{which}: missing; expected model, engine and env sections")
            continue
        name = (node.get("model") or {}).get("name")
        if name not in fetch:
            errors.append(f"{prefix}model.name: {name!r} is not a model the download stage provides "
                          f"(download.fetch: {', '.join(map(str, fetch))})")
        for section in ("engine", "env"):
            values = node.get(section)
            if not isinstance(values, dict):
                errors.append(f"{prefix}{section}: missing; expected a mapping")
                continue
            for k, v in values.items():
                err = check_knob(f"{section}.{k}", v)
                if err:
                    errors.append(prefix + err)
    _need(errors, params, "slo.p99_ttft_ms", _pos_num, "a number of milliseconds > 0")
    _need(errors, params, "slo.p99_tpot_ms", _pos_num, "a number of milliseconds > 0")
    for key in ("num_prompts", "repeats"):
        _need(errors, params, f"bench.{key}", _pos_int, "an integer > 0")
    _need(errors, params, "bench.mode", lambda v: v in ("engine", "cli"), "engine or cli")
    _need(errors, params, "eval.max_tokens", _pos_int, "an integer > 0")
    _need(errors, params, "eval.file", lambda v: isinstance(v, str) and (ROOT / v).is_file(), "an existing eval file")
    mode = _need(errors, params, "knee.mode", lambda v: v in ("sweep", "search"), "sweep or search")
    if mode == "sweep":
        _need(errors, params, "knee.rates", lambda v: isinstance(v, list) and v and all(map(_pos_num, v))
              and v == sorted(set(v)), "an increasing list of request rates > 0")
    elif mode == "search":
        _need(errors, params, "knee.start_rate", _pos_num, "a request rate > 0")
        _need(errors, params, "knee.max_rate", _pos_num, "a request rate > 0")
        _need(errors, params, "knee.rel_tol", lambda v: _pos_num(v) and v < 1, "a number in (0, 1)")
        _need(errors, params, "knee.max_probes", _pos_int, "an integer > 0")
    for key in ("probe_seconds", "min_prompts", "max_prompts"):
        _need(errors, params, f"knee.{key}", _pos_num, "a number > 0")
    _need(errors, params, "knee.repeats", _pos_int, "an integer > 0 (runs per probed rate; medians decide)")
    for key in ("max_overall_drop", "max_category_drop"):
        _need(errors, params, f"gate.{key}", lambda v: isinstance(v, (int, float)) and 0 <= v <= 1, "a fraction in [0, 1]")
    _need(errors, params, "gate.alpha", lambda v: _pos_num(v) and v < 1, "a number in (0, 1)")
    _need(errors, params, "gate.min_items", _pos_int, "an integer > 0")
    import workload  # here: workload imports common
    errors += workload.errors(params)
    if errors:
        raise ParamsError("params.yaml is not valid:\n  " + "\n  ".join(errors))


def engine_args(params: dict) -> list[tuple[str, str, object]]:
    """(where, name, value) of every engine arg of rung 0 and of the rung in force: what vLLM's parser checks."""
    return [(f"{prefix}engine", k, v) for prefix, node in (("baseline.", params["baseline"]), ("", params))
            for k, v in (node.get("engine") or {}).items()]


def local_model_problem(path: str | Path) -> str | None:
    """Why a local folder cannot serve as a model (None if it can): it must exist, be readable and hold
    config.json and weights (*.safetensors or *.bin)."""
    folder = Path(os.path.expanduser(str(path)))
    folder = folder if folder.is_absolute() else ROOT / folder
    if not folder.exists():
        return f"no such folder ({folder})"
    if not folder.is_dir():
        return f"not a folder ({folder})"
    if not os.access(folder, os.R_OK | os.X_OK):
        return f"not readable ({folder})"
    if not (folder / "config.json").is_file():
        return f"not a model folder: no config.json in {folder}"
    if not any(folder.glob("*.safetensors")) and not any(folder.glob("*.bin")):
        return f"not a model folder: no weights (*.safetensors or *.bin) in {folder}"
    unreadable = [p.name for p in folder.iterdir() if p.is_file() and not os.access(p, os.R_OK)]
    if unreadable:
        return f"not readable: {', '.join(unreadable[:3])} in {folder}"
    return None


def load_params(path: Path | str = PARAMS, check: bool = True) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            params = yaml.safe_load(f)
    except yaml.YAMLError as e:
        raise ParamsError(f"{path}: not valid YAML ({e})") from None
    if check:
        validate(params)
    return params


def rung_config(params: dict, which: str = "rung") -> dict:
    """The knobs in force: which='rung' reads model/engine/env, which='baseline' reads baseline.*."""
    node = params["baseline"] if which == "baseline" else params
    return {"model": dict(node["model"]), "engine": dict(node["engine"]), "env": dict(node.get("env") or {})}


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


# ---------------------------------------------------------------- models
def model_entry(name: str) -> dict:
    """The download stage's manifest entry for a model; clear error if it is missing or its folder is gone."""
    manifest = RESULTS / "models.json"
    if not manifest.exists():
        raise ParamsError(f"model.name: {name!r}: {manifest.relative_to(ROOT)} is missing; run the download stage first")
    models = read_json(manifest)["models"]
    if name not in models:
        raise ParamsError(f"model.name: {name!r} is not a model the download stage provides ({', '.join(models)})")
    entry = models[name]
    if not Path(entry["path"], "config.json").is_file():
        raise ParamsError(f"model.name: {name!r}: folder {entry['path']} is missing or has no config.json; "
                          f"run `dvc repro -f download`")
    return entry


# ---------------------------------------------------------------- provenance
def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def params_hash(cfg) -> str:
    return hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode()).hexdigest()[:16]


def provenance(params: dict, cfg: dict | None = None) -> dict:
    """Where a number came from: the machine (fingerprint stage), the model, the eval set, the params, the commit."""
    fp_path = RESULTS / "fingerprint.json"
    prov = {"environment": read_json(fp_path) if fp_path.exists() else None, "git_commit": git_commit(),
            "params_hash": params_hash(params)}
    if cfg is not None:
        prov["knobs"] = cfg
        prov["knobs_hash"] = params_hash(cfg)
        manifest = RESULTS / "models.json"
        if manifest.exists():
            entry = read_json(manifest)["models"].get(cfg["model"]["name"], {})
            prov["model"] = {k: entry.get(k) for k in ("name", "id", "revision", "sha256", "source")}
    eval_file = ROOT / params["eval"]["file"]
    if eval_file.exists():
        prov["eval_sha256"] = sha256_file(eval_file)
    return prov


# ---------------------------------------------------------------- signals
class Interrupted(KeyboardInterrupt):
    pass


def handle_signals() -> None:
    """SIGTERM/SIGHUP raise like Ctrl-C does, so every `finally` (stopping servers) runs."""
    def _raise(signum, _frame):
        raise Interrupted(f"stopped by signal {signal.Signals(signum).name}")
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise)


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


def stage_start(check: bool = True) -> dict:
    """Common start of a stage script: run from the repo root, turn SIGTERM into an exception, load params."""
    os.chdir(ROOT)
    handle_signals()
    return load_params(check=check)
