"""Planning the ladder (pure): the profile applied to params.yaml, the rungs validated, candidates expanded.

Worked out ONCE per `make ladder` (`resolve`), before any engine starts: every bad rung is reported at once,
naming the rung and the knob. The driver (ladder.py) only runs what the plan says.
"""
from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

import common
import config

LADDER_YAML = config.LADDER
load_ladder = config.load_ladder  # ladder.yaml's shape is config's; the rung checks naming rung and knob are here


def set_dotted(d: dict, dotted: str, value) -> None:
    node = d
    *parents, last = dotted.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = copy.deepcopy(value)


def get_dotted(d: dict, dotted: str):
    for part in dotted.split("."):
        d = d[part]
    return d


def committed_params() -> dict | None:
    """params.yaml as committed: the defaults a profile's keys fall back to (the workspace may hold another's)."""
    out = subprocess.run(["git", "show", "HEAD:params.yaml"], cwd=common.ROOT, capture_output=True, text=True)
    return yaml.safe_load(out.stdout) if out.returncode == 0 else None


def profile_overrides(lad: dict, profile: str, defaults: dict) -> dict:
    """Every key any profile sets: this profile's value, else the committed default, so that switching
    profiles never leaves another profile's value behind in the workspace."""
    profiles = {name: p["settings"] for name, p in lad["profiles"].items()}
    if profile not in profiles:
        raise common.ParamsError(f"profile: {profile!r} is not defined in ladder.yaml; allowed: {', '.join(profiles)}")
    out = {"profile": profile}
    for key in dict.fromkeys(k for p in profiles.values() for k in p):
        if key in profiles[profile]:
            out[key] = profiles[profile][key]
        else:
            try:
                out[key] = get_dotted(defaults, key)
            except (KeyError, TypeError):
                raise common.ParamsError(f"ladder.yaml profiles.{profile}.settings: {key} has no default in "
                                         f"params.yaml; set it for this profile") from None
    return out


def effective_params(params: dict, lad: dict, profile: str, defaults: dict | None = None) -> dict:
    """params.yaml with the profile applied and the rung in force reset to the baseline (rung 0)."""
    eff = copy.deepcopy(params)
    for key, value in profile_overrides(lad, profile, defaults or params).items():
        set_dotted(eff, key, value)
    for section in ("model", "engine", "env"):
        eff[section] = copy.deepcopy(eff["baseline"][section])
    return eff


def candidates(change: dict) -> list[dict]:
    """A rung's `set`; a list value names candidate values of that one knob, each tried on its own."""
    lists = [k for k, v in change.items() if isinstance(v, list)]
    if not lists:
        return [dict(change)]
    key = lists[0]
    return [{**change, key: v} for v in change[key]]


def rung_changes(rung: dict) -> list[dict]:
    """The changes a rung tries: `candidates` (alternative changes, each one knob or group), else `set`."""
    if rung.get("candidates") is not None:
        return [dict(c) for c in rung["candidates"]]
    return candidates(rung["set"])


def _slug(v) -> str:
    return re.sub(r"[^a-z0-9]+", "-", str(v).lower()).strip("-")


def candidate_label(rung: dict, change: dict) -> str:
    """`batched-tokens-1024`: the rung's name and the candidate value it tries; for alternative changes
    (`candidates`), the knob too: `second-gpu-tensor-parallel-size-2`."""
    if rung.get("candidates") is not None:
        return f"{rung['name']}-" + "-".join(f"{_slug(k.split('.')[-1])}-{_slug(v)}" for k, v in change.items())
    value = next(v for k, v in change.items() if isinstance(rung["set"][k], list))
    return f"{rung['name']}-{_slug(value)}"


def check_change(where: str, change, in_force: dict, params: dict, groups: dict) -> list[str]:
    """Errors for one rung change against the knobs in force; each names the rung and the knob."""
    if not isinstance(change, dict) or not change:
        return [f"{where}: `set` must map knob names to values, got {change!r}"]
    errors = []
    fetch = params["download"]["fetch"]
    for knob, value in change.items():
        for v in (value if isinstance(value, list) else [value]):
            err = common.check_knob(knob, v)
            if err:
                errors.append(f"{where}: {err}")
            elif knob == "model.name" and v not in fetch:
                errors.append(f"{where}: model.name: {v!r} is not a model the download stage provides "
                              f"(download.fetch: {', '.join(fetch)})")
            elif v == in_force.get(knob):
                errors.append(f"{where}: {knob} is already {v!r} in force: a no-op rung changes nothing")
    if len([k for k, v in change.items() if isinstance(v, list)]) > 1:
        errors.append(f"{where}: candidates (a list of values) are allowed for one knob only")
    if len(change) > 1 and not any(set(change) <= set(members) for members in groups.values()):
        errors.append(f"{where}: changes {len(change)} knobs ({', '.join(change)}); a rung changes ONE knob, "
                      f"or several that ladder.yaml `groups` declares as one ({', '.join(groups) or 'none declared'})")
    return errors


def _rung_errors(where: str, rung: dict, in_force: dict, params: dict, groups: dict) -> list[str]:
    if (rung.get("set") is None) == (rung.get("candidates") is None):
        return [f"{where}: give exactly one of `set` (one change, or a list of values of one knob) "
                f"and `candidates` (a list of alternative changes)"]
    if rung.get("set") is not None:
        errors = check_change(where, rung["set"], in_force, params, groups)
    else:
        cands, errors = rung["candidates"], []
        if len(cands) < 2:
            return [f"{where}: `candidates` must list at least 2 alternative changes, got {cands!r}"]
        for j, change in enumerate(cands, 1):
            if any(isinstance(v, list) for v in change.values()):
                errors.append(f"{where} candidate {j}: one value per knob (a candidate is one change)")
            else:
                errors += check_change(f"{where} candidate {j}", change, in_force, params, groups)
        if len({repr(sorted(c.items())) for c in cands}) < len(cands):
            errors.append(f"{where}: two candidates are the same change")
    if rung.get("fallback") is not None:
        errors += check_change(f"{where} fallback", rung["fallback"], in_force, params, groups)
    return errors


def engine_arg_errors(profile: str, rungs: list[dict], accepted: dict | None) -> list[str]:
    """Engine knobs the installed vLLM's EngineArgs does not have (`installed_engine_args`); [] if not known."""
    if not accepted:
        return []
    errors = []
    for i, rung in enumerate(rungs, 1):
        changes = rung_changes(rung) + ([rung["fallback"]] if rung.get("fallback") else [])
        for knob in dict.fromkeys(k for c in changes for k in c):
            if knob.startswith("engine.") and knob[7:] not in accepted["args"]:
                errors.append(f"ladder.yaml {profile} rung {i} {rung['name']!r}: {knob}: not an engine argument of "
                              f"the installed vLLM {accepted['version']} (vllm.engine.arg_utils.EngineArgs)")
    return errors


def installed_engine_args() -> dict | None:
    """{"version", "args"}: the engine arguments the installed vLLM accepts, from its own EngineArgs; None when
    vLLM cannot be imported here. A child process, so the driver never holds vLLM (or torch) itself."""
    code = ("import dataclasses, json, vllm; from vllm.engine.arg_utils import EngineArgs; "
            "print(json.dumps({'version': vllm.__version__, "
            "'args': [f.name for f in dataclasses.fields(EngineArgs)]}))")
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])


def plan(params: dict, lad: dict, profile: str) -> list[dict]:
    """Validate the profile's ladder before any engine starts; raise ParamsError naming rung and knob."""
    if profile not in lad["profiles"]:
        raise common.ParamsError(f"profile: {profile!r} is not defined in ladder.yaml; "
                                 f"allowed: {', '.join(lad['profiles'])}")
    rungs, groups = lad["profiles"][profile]["rungs"], lad["groups"]
    in_force = common.flatten_knobs(common.rung_config(params, "baseline"))
    errors, names, out = [], set(), []
    for i, rung in enumerate(rungs, 1):
        name = rung.get("name") if isinstance(rung, dict) else None
        where = f"ladder.yaml {profile} rung {i} {name!r}"
        if not name or not re.fullmatch(r"[a-z0-9][a-z0-9-]*", str(name)):
            errors.append(f"{where}: `name` must be lower-case letters, digits and dashes")
            continue
        if name in names:
            errors.append(f"{where}: the name repeats an earlier rung")
        names.add(name)
        errs = _rung_errors(where, rung, in_force, params, groups)
        errors += errs
        if not errs:
            out.append(rung)
            in_force.update(rung_changes(rung)[0])  # later rungs compose on this one, as if kept
    if errors:
        raise common.ParamsError("the ladder is not valid (nothing was run):\n  " + "\n  ".join(errors))
    return out


@dataclass
class Plan:
    """Everything `make ladder` needs to know before it starts: worked out once, passed to the driver."""
    profile: str
    params: dict                 # params.yaml with the profile applied, rung in force = rung 0
    overrides: dict              # what every `dvc exp run -S` sets besides the rung's knobs
    rungs: list[dict]
    objective: str
    gpus: int
    baseline: dict = field(init=False)  # rung 0's knobs, flattened (model.name, engine.*, env.*)

    def __post_init__(self):
        self.baseline = common.flatten_knobs(common.rung_config(self.params, "baseline"))

    @property
    def experiments(self) -> int:
        """`dvc exp run`s the ladder will make at most, fallbacks aside: rung 0 + every candidate of every rung
        this machine can run."""
        return 1 + sum(len(rung_changes(r)) for r in self.rungs
                       if (r["when"] or {}).get("min_gpus", 0) <= self.gpus)


def resolve(params: dict, lad: dict, profile: str, defaults: dict | None, gpus: int, limit: int | None = None,
            accepted: dict | None = None) -> Plan:
    """The plan for one ladder: profile applied, params validated, rungs checked (against the installed vLLM's
    engine arguments where `accepted` is given: `installed_engine_args`); raises ParamsError."""
    defaults = defaults or params
    eff = common.validate(effective_params(params, lad, profile, defaults))  # defaults filled from here on
    rungs = plan(eff, lad, profile)
    errors = engine_arg_errors(profile, rungs, accepted)
    if errors:
        raise common.ParamsError("the ladder is not valid (nothing was run):\n  " + "\n  ".join(errors))
    rungs = rungs[:limit]
    return Plan(profile=profile, params=eff, overrides=profile_overrides(lad, profile, defaults), rungs=rungs,
                objective=lad["objective"], gpus=gpus)
