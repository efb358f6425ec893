"""Planning the ladder (pure): the profile applied to params.yaml, the rungs validated, candidates expanded.

Worked out ONCE per `make ladder` (`resolve`), before any engine starts: every bad rung is reported at once,
naming the rung and the knob. The driver (ladder.py) only runs what the plan says. The pre-flight (`preflight`)
then asks the installed vLLM, in a child process (this file with --preflight), what it would refuse at start.
"""
from __future__ import annotations

import copy
import dataclasses
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

import common
import config
from measure import workload as wl

LADDER_YAML = config.LADDER
KNOB_SECTIONS = ("model", "engine", "env")  # what a rung's config (its knobs) sets whole
load_ladder = config.load_ladder  # ladder.yaml's shape is config's; the rung checks naming rung and knob are here


def typed(params: dict) -> config.Params:
    """A params dict `resolve` or `as_it_stands` validated, typed for the common helpers: the plan keeps the dict
    (ladder.yaml's dotted settings are laid over it; the pre-flight child gets it as JSON). Parsed again: it passes
    as it passed, with the same defaults."""
    return common.parse(params)


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


def effective_params(params: dict, lad: dict, profile: str, defaults: dict | None = None,
                     extra: dict | None = None) -> dict:
    """params.yaml with the profile (then `extra`: the user's MODEL=/WORKLOAD= choices) applied and the rung in
    force reset to the baseline (rung 0)."""
    eff = copy.deepcopy(params)
    for key, value in {**profile_overrides(lad, profile, defaults or params), **(extra or {})}.items():
        set_dotted(eff, key, value)
    for section in KNOB_SECTIONS:
        eff[section] = copy.deepcopy(eff["baseline"][section])
    return eff


def as_it_stands(params: dict, gpus: list[dict]) -> dict:
    """params.yaml as it stands (what `dvc repro` runs, whatever a profile would replace), checked as the fingerprint
    stage checks it: validated, its prompts file read, its target card against this machine's GPUs; its engine args
    and configs are the pre-flight's (`preflight`). Returns it with the defaults filled; raises ParamsError."""
    here = common.parse(params)
    wl.check(here)
    for which in ("baseline", "rung"):
        common.engine_config(here, which, gpus)
    return here.model_dump(by_alias=True)  # a dict: it goes to the pre-flight child as JSON


def _leaves(value, key: str) -> dict:
    """{dotted key: value} of every leaf under `key` (a list is a leaf)."""
    if isinstance(value, dict) and value:
        return {k: v for name, sub in value.items() for k, v in _leaves(sub, f"{key}.{name}").items()}
    return {key: value}


_ABSENT = object()  # a key one side does not hold


def _shown(v) -> str:
    return "(absent)" if v is _ABSENT else repr(v)


def _at(d: dict | None, dotted: str):
    try:
        return get_dotted(d or {}, dotted)
    except (KeyError, TypeError):
        return _ABSENT


def replaced_edits(params: dict, p: Plan, lad: dict, head: dict | None) -> list[str]:
    """The edits of params.yaml not in git HEAD's (`head`) that this ladder does not run, one line each with what runs
    instead: a key a profile sets (this profile's value, else HEAD's), a MODEL=/WORKLOAD= choice, and the rung in force
    (model, engine, env), which every ladder starts at rung 0. Said, not refused: every `dvc exp run` leaves its rung's
    params in the workspace, so after a ladder params.yaml differs from HEAD with no edit of the user's."""
    settings = lad["profiles"][p.profile]["settings"]
    profile_keys = profile_overrides(lad, p.profile, head or params)
    pairs = []  # (key, what runs instead, where that comes from)
    for key, value in p.overrides.items():
        if key == "profile":
            continue
        if key not in profile_keys or profile_keys[key] != value:
            source = "your MODEL=/QUANT_MODEL=/WORKLOAD="
        elif key in settings:
            source = f"ladder.yaml profiles.{p.profile}.settings"
        else:
            source = (f"git HEAD's params.yaml: another profile sets it; commit the edit, or set it in ladder.yaml "
                      f"profiles.{p.profile}.settings")
        pairs.append((key, value, source))
    for section in KNOB_SECTIONS:
        pairs.append((section, p.params["baseline"][section], f"rung 0's baseline.{section}: every ladder starts at "
                                                              "rung 0; edit baseline, or make the change a rung"))
    lines = []
    for key, value, source in pairs:
        mine, runs = _leaves(_at(params, key), key), _leaves(value, key)
        theirs = _leaves(_at(head, key), key) if head is not None else {}
        for leaf in dict.fromkeys([*mine, *runs]):
            got, instead = mine.get(leaf, _ABSENT), runs.get(leaf, _ABSENT)
            if got != instead and (head is None or got != theirs.get(leaf, _ABSENT)):
                lines.append(f"{leaf}: {_shown(got)} -> {_shown(instead)} ({source})")
    return lines


# ---------------------------------------------------------------- the user's model and traffic
HF_SPEC = re.compile(r"([\w.-]+)/([\w.-]+)@([\w./-]+)")


def _slug(text: str) -> str:
    """A catalog name from a folder or repo name: no dots, as `dvc exp run -S` would read them as nesting."""
    return re.sub(r"[^a-z0-9]+", "-", str(text).lower()).strip("-")


def model_choice(spec: str, catalog: dict, field: str = "MODEL") -> tuple[str, dict | None]:
    """MODEL=: a download.catalog name, a local model folder, or a Hugging Face repo as org/name@revision.
    Returns the model's name and the catalog entry to add (None for a catalog name); checked here, before
    any engine starts (a hub repo only by its spelling: the download stage asks the hub)."""
    spec = str(spec).strip()
    if spec in catalog:
        return spec, None
    path = Path(os.path.expanduser(spec))
    path = path if path.is_absolute() else common.ROOT / path
    hf = HF_SPEC.fullmatch(spec)
    if hf and not path.exists():
        return _slug(hf.group(2)), {"source": "hf", "repo": f"{hf.group(1)}/{hf.group(2)}", "revision": hf.group(3)}
    if re.fullmatch(r"[\w.-]+/[\w.-]+", spec) and not path.exists():
        raise common.ParamsError(f"{field}: {spec!r}: no such folder; a Hugging Face repo needs a pinned revision: "
                                 f"{field}={spec}@<commit>")
    if path.exists() or "/" in spec or spec.startswith((".", "~")):
        why = common.local_model_problem(path)
        if why:
            raise common.ParamsError(f"{field}: {spec!r}: {why}")
        return f"local-{_slug(path.resolve().name)}", {"source": "local", "path": str(path.resolve())}
    raise common.ParamsError(f"{field}: {spec!r} is not a download.catalog name ({', '.join(catalog)}), a local "
                             f"model folder, or a Hugging Face repo as org/name@revision")


def user_choices(params: dict, lad: dict, profile: str, model: str | None = None, quant_model: str | None = None,
                 workload: str | None = None) -> tuple[dict, dict]:
    """`make ladder MODEL=… QUANT_MODEL=… WORKLOAD=…`: the params keys to set, and the ladder with its model rungs
    pointed at the quantized variant (given, or made by the same `quantize` recipe from MODEL) or marked skipped."""
    extra, lad = {}, copy.deepcopy(lad)
    if quant_model and not model:
        raise common.ParamsError("QUANT_MODEL: given without MODEL; name the model it is a variant of")
    if model:
        catalog = copy.deepcopy(params["download"]["catalog"])
        name, entry = model_choice(model, catalog)
        fetch = [name]
        if entry:
            extra[f"download.catalog.{name}"] = catalog[name] = entry
        qname = None
        if quant_model:
            qname, qentry = model_choice(quant_model, catalog, "QUANT_MODEL")
            if qentry:
                extra[f"download.catalog.{qname}"] = catalog[qname] = qentry
        for rung in ((lad.get("profiles") or {}).get(profile) or {}).get("rungs") or []:
            for part in (rung.get("set"), rung.get("fallback")):
                if not isinstance(part, dict) or "model.name" not in part:
                    continue
                recipe = catalog.get(part["model.name"]) if isinstance(part["model.name"], str) else None
                if qname:
                    part["model.name"] = qname
                elif (recipe or {}).get("source") == "quantize":  # the same recipe, applied to MODEL
                    derived = f"{name}-{str(recipe.get('scheme', 'W4A16')).lower()}"
                    extra[f"download.catalog.{derived}"] = catalog[derived] = {**recipe, "from": name}
                    part["model.name"] = derived
                else:
                    rung["skip"] = (f"MODEL={model} has no quantized variant to try; give one with "
                                    f"QUANT_MODEL=<catalog name | local folder | org/name@revision>")
                if not rung.get("skip") and part["model.name"] not in fetch:
                    fetch.append(part["model.name"])
        extra.update({"baseline.model.name": name, "download.fetch": fetch})
    if workload:
        if workload in wl.KINDS and workload != "file":
            extra["workload.kind"] = workload
        else:
            extra.update({"workload.kind": "file", "workload.file": workload})
    return extra, lad


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
            elif knob == "engine.kv_cache_memory_bytes" and v is not None and params["target"]["memory_gib"]:
                errors.append(f"{where}: {knob}: {v!r} bypasses gpu_memory_utilization, so target.memory_gib "
                              f"would not bind; a rung under a target card spends memory through "
                              f"engine.gpu_memory_utilization")
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


def plan(params: dict, lad: dict, profile: str) -> list[dict]:
    """Validate the profile's ladder before any engine starts; raise ParamsError naming rung and knob."""
    if profile not in lad["profiles"]:
        raise common.ParamsError(f"profile: {profile!r} is not defined in ladder.yaml; "
                                 f"allowed: {', '.join(lad['profiles'])}")
    rungs, groups = lad["profiles"][profile]["rungs"], lad["groups"]
    in_force = common.flatten_knobs(common.rung_config(typed(params), "baseline"))
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
        if rung.get("skip"):  # the user's MODEL= has no variant for it: recorded as skipped, never run
            out.append(rung)
            continue
        errs = _rung_errors(where, rung, in_force, params, groups)
        errors += errs
        if not errs:
            out.append(rung)
            in_force.update(rung_changes(rung)[0])  # later rungs compose on this one, as if kept
    if errors:
        raise common.ParamsError("the ladder is not valid (nothing was run):\n  " + "\n  ".join(errors))
    return out


WAVES = 4  # bench prompts per concurrent sequence, at least


def wave_error(params: dict, rungs: list[dict]) -> str | None:
    """The bench sends `num_prompts` equal requests at once; they run in waves of max_num_seqs. With few waves a
    rung that raises max_num_seqs wins by running one wave fewer (200 prompts: two waves at 128, one at 256 was
    most of a +25 % 'gain' on the H200), so every config the ladder tries must run at least WAVES of them."""
    tried = [(params["baseline"]["engine"].get("max_num_seqs"), "rung 0")]
    for i, rung in enumerate(rungs, 1):
        if rung.get("skip"):
            continue
        for change in rung_changes(rung) + [rung.get("fallback") or {}]:
            tried.append((change.get("engine.max_num_seqs"), f"rung {i} {rung['name']!r}"))
    top, where = max(((v, w) for v, w in tried if isinstance(v, int)), default=(None, None))
    need = WAVES * top if top else 0
    if params["bench"]["num_prompts"] < need:
        return (f"bench.num_prompts: {params['bench']['num_prompts']} is below {WAVES} × the largest "
                f"engine.max_num_seqs this ladder tries ({top}, {where}) = {need}: fewer prompts run in so few waves "
                "that a rung changing max_num_seqs is judged on its wave count; raise bench.num_prompts")
    return None


@dataclass
class Plan:
    """Everything `make ladder` needs to know before it starts: worked out once, passed to the driver."""
    profile: str
    params: dict                 # params.yaml with the profile (and MODEL=/WORKLOAD=) applied, rung in force = rung 0
    overrides: dict              # what every `dvc exp run -S` sets besides the rung's knobs
    rungs: list[dict]
    objective: str
    gpus: int
    baseline: dict = field(init=False)  # rung 0's knobs, flattened (model.name, engine.*, env.*)
    typed_params: config.Params = field(init=False, repr=False)  # `params` typed: the blocks the judgement reads

    def __post_init__(self):
        self.typed_params = typed(self.params)
        self.baseline = common.flatten_knobs(common.rung_config(self.typed_params, "baseline"))

    @property
    def experiments(self) -> int:
        """`dvc exp run`s the ladder will make at most, fallbacks aside: rung 0 + every candidate of every rung
        this machine can run."""
        return 1 + sum(len(rung_changes(r)) for r in self.rungs if runs_here(self, r))


def resolve(params: dict, lad: dict, profile: str, defaults: dict | None, gpus: int, limit: int | None = None,
            model: str | None = None, quant_model: str | None = None, workload: str | None = None) -> Plan:
    """The plan for one ladder: profile and the user's choices applied, params validated, rungs checked; raises
    ParamsError. Engine args are checked by vLLM's own parser afterwards (`engine_arg_errors`: it imports vLLM)."""
    defaults = defaults or params
    extra, lad = user_choices(params, lad, profile, model, quant_model, workload)
    typed_eff = common.parse(effective_params(params, lad, profile, defaults, extra))  # defaults filled from here on
    wl.check(typed_eff)
    eff = typed_eff.model_dump(by_alias=True)  # the plan's own checks and the driver read it by dotted key
    rungs = plan(eff, lad, profile)[:limit]
    if err := wave_error(eff, rungs):
        raise common.ParamsError(err)
    return Plan(profile=profile, params=eff, overrides={**profile_overrides(lad, profile, defaults), **extra},
                rungs=rungs, objective=lad["objective"], gpus=gpus)


def engine_arg_errors(p: Plan) -> list[str]:
    """Every engine arg of rung 0 and of every rung (candidates and fallbacks too) through vLLM's own parser,
    once per ladder, before any engine starts; each error names the rung. Where none is refused they are remembered
    as accepted (vllm_compat.ACCEPTED): the fingerprint stage of each rung then need not import vLLM to check them."""
    from serving import vllm_compat
    knobs = ladder_engine_args(p)
    errors = vllm_compat.engine_arg_errors(knobs)
    if not errors:
        vllm_compat.remember_accepted(knobs)
    return errors


def ladder_engine_args(p: Plan) -> list[tuple[str, str, object]]:
    """(where, name, value) of every engine arg the ladder may run: rung 0's, then each rung's changes."""
    knobs = common.engine_args(typed(p.params))
    for i, rung in enumerate(p.rungs, 1):
        if rung.get("skip"):
            continue
        parts = [(c, "") for c in rung_changes(rung)] + [(rung["fallback"], " fallback")]
        for part, label in parts:
            for knob, value in (part or {}).items():
                if knob.startswith("engine."):
                    for v in value if isinstance(value, list) else [value]:
                        knobs.append((f"ladder.yaml {p.profile} rung {i} {rung['name']!r}{label}: engine", knob[7:], v))
    return knobs


def check_target(p: Plan, gpus: list[dict]) -> None:
    """The target card (params `target`) against this machine's GPUs, before any engine starts: rung 0's
    gpu_memory_utilization and every one a rung sets (common.target_engine raises ParamsError naming the field)."""
    if p.params["target"]["memory_gib"] is None:
        return
    base = p.params["baseline"]["engine"]
    engines = [("baseline.engine", base)]
    for i, rung in enumerate(p.rungs, 1):
        for change in [] if rung.get("skip") else rung_changes(rung) + [rung.get("fallback") or {}]:
            if "engine.gpu_memory_utilization" in change:
                engines.append((f"ladder.yaml {p.profile} rung {i} {rung['name']!r}: engine",
                                {**base, "gpu_memory_utilization": change["engine.gpu_memory_utilization"]}))
    target = typed(p.params).target
    for where, eng in engines:
        common.target_engine(eng, target, gpus, where)


# ---------------------------------------------------------------- the pre-flight: what vLLM refuses at start
def runs_here(p: Plan, rung: dict) -> bool:
    """The driver runs this rung on this machine: not skipped (MODEL= without a variant), enough GPUs."""
    return not rung.get("skip") and ((rung["when"] or {}).get("min_gpus") or 0) <= p.gpus


def _knobs_text(change: dict) -> str:
    return ", ".join(f"{k}: {v!r}" for k, v in change.items())


def engine_config_errors(p: Plan, gpus: list[dict], paths: dict, refuse) -> tuple[list[str], list[str], int]:
    """Rung 0 and every change the driver may run on this machine (candidates and fallbacks too) built into an
    engine config as vLLM builds it at start (`refuse`: vllm_compat.engine_config_error, which returns vLLM's
    reason or None), each on rung 0 and again on top of the earlier rungs that built, as the driver composes it
    if they are kept (a max_num_batched_tokens fine on rung 0 may be below a later max_num_seqs). `paths`: model
    name -> folder. Returns (errors naming rung, knobs, values and vLLM's reason; configs vLLM could not be asked
    about; distinct configs built). A rung 0 vLLM refuses stops here: every rung is built on it."""
    from serving import vllm_compat
    errors, unchecked, built = [], [], set()
    target = typed(p.params).target

    def ok(where: str, change: dict, flat: dict, on: str = "") -> bool:
        cfg = common.unflatten_knobs(flat)
        eng, _ = common.target_engine(cfg["engine"], target, gpus)  # as the stages run it
        name = cfg["model"]["name"]
        built.add(repr(sorted({**flat, **{f"engine.{k}": v for k, v in eng.items()}}.items())))
        try:
            why = refuse(paths[name], eng, cfg["env"])
        except vllm_compat.VllmCompatError as e:
            unchecked.append(f"{where}: not checked before its engine starts: {e}")
            return True
        if why:
            knobs = _knobs_text(change) or "its engine config"
            errors.append(f"{where}: {knobs}{on} would be refused when its engine starts: {why}")
        return not why

    base = p.baseline
    if not ok("baseline (rung 0)", {}, base):
        said = {f"baseline.{k}": v for k, v in base.items()
                if k.startswith(("engine.", "env.")) and vllm_compat.names_knob(errors[-1], k.partition(".")[2], v)}
        errors[-1] = errors[-1].replace("its engine config", _knobs_text(said) or "baseline.engine", 1)
        return errors, unchecked, len(built)
    in_force, kept = dict(base), []
    for i, rung in enumerate(p.rungs, 1):
        if not runs_here(p, rung):
            continue
        where, changes = f"ladder.yaml {p.profile} rung {i} {rung['name']!r}", rung_changes(rung)
        parts = [(where + (f" candidate {j}" if len(changes) > 1 else ""), c) for j, c in enumerate(changes, 1)]
        parts += [(f"{where} fallback", rung["fallback"])] if rung.get("fallback") else []
        first_ok = None
        for n, (label, change) in enumerate(parts):
            good = ok(label, change, {**base, **change})
            if good and kept and {**in_force, **change} != {**base, **change}:
                good = ok(label, change, {**in_force, **change},
                          f" on top of rung{'s' if len(kept) > 1 else ''} {', '.join(kept)} (as the ladder runs it "
                          f"if {'they are' if len(kept) > 1 else 'that one is'} kept)")
            if good and first_ok is None and n < len(changes):
                first_ok = change
        if first_ok is not None:  # later rungs compose on this one, as if kept (plan() does the same)
            in_force.update(first_ok)
            kept.append(str(i))
    return errors, unchecked, len(built)


def as_it_stands_errors(here: dict, gpus: list[dict], paths: dict, refuse) -> tuple[list[str], list[str]]:
    """params.yaml's rung 0 and rung in force as they stand (what `dvc repro` starts) built as engine_config_errors
    builds the ladder's, in the words each engine stage refuses them with (engine.check_start). A model this plan
    does not provide is not fetched for it, nor named: its stage checks it before its engine starts. Returns
    (errors, configs not checked)."""
    from serving import vllm_compat
    errors, unchecked, here_t = [], [], typed(here)
    for which, prefix in (("baseline", "baseline."), ("rung", "")):
        cfg, where = common.rung_config(here_t, which), f"{prefix}engine"
        name = cfg["model"]["name"]
        if name not in paths:  # no warning: its stage checks it before its engine starts, and on a ladder whose
            continue           # profile replaces it (params.yaml's cpu model on a gpu profile) it warned of nothing
        eng, _ = common.target_engine(cfg["engine"], here_t.target, gpus, where)
        try:
            why = refuse(paths[name], eng, cfg["env"])
        except vllm_compat.VllmCompatError as e:
            unchecked.append(f"params.yaml {where}: not checked before its engine starts: {e}")
            continue
        if why:
            errors.append(vllm_compat.refused_words(cfg, prefix, why, where))
    return errors, unchecked


def provide_models(p: Plan) -> dict:
    """Model name -> folder for every model of download.fetch, by the download stage's own logic (model_store.provide)
    with this plan's download section (MODEL= and QUANT_MODEL= included): the same store and markers, so the first
    rung's download stage finds them built and verified. vLLM builds a config from the folder's config.json."""
    from serving import model_store
    cfg = p.params["download"]
    store, done = model_store.store_path(cfg), {}
    for name in cfg["fetch"]:
        model_store.provide(name, cfg["catalog"], store, done)
    return {name: entry["path"] for name, entry in done.items()}


def serve_errors(p: Plan, here: dict | None, result: dict) -> None:
    """The knee's `vllm serve` arguments (params `serve`) through `vllm serve`'s own parser, into the pre-flight's
    `result`: params.yaml's as it stands, and the ladder's where its profile makes them other (said once)."""
    from serving import vllm_compat
    todo = [("params_errors", here["serve"])] if here else []
    todo += [("errors", p.params["serve"])] if not here or p.params["serve"] != here["serve"] else []
    for kind, serve in todo:
        errors, unchecked = vllm_compat.check_serve(serve)
        if unchecked:
            result["unchecked"].append(unchecked)
            return
        result[kind] += errors


def _preflight_worker(job_path: str, out_path: str) -> None:
    """The child: vLLM's parser on every engine arg, then the models, then vLLM's engine configs; a JSON result."""
    from serving import model_store, vllm_compat
    t0, job = time.monotonic(), common.read_json(job_path)
    p, here = Plan(**job["plan"]), job.get("here")
    here_args = common.engine_args(typed(here)) if here else []
    result = {"errors": engine_arg_errors(p), "params_errors": vllm_compat.engine_arg_errors(here_args),
              "unchecked": [], "configs": 0, "version": vllm_compat.installed_version()}
    if not result["params_errors"]:
        vllm_compat.remember_accepted(here_args)
    serve_errors(p, here, result)
    built, accepted = set(), set()

    def refuse(model_path: str, eng: dict, env: dict) -> str | None:
        """vLLM's reason, or None: then remembered, so that no stage builds that config again (engine.check_start)."""
        key = vllm_compat.config_key(model_path, eng, env)
        built.add(key)
        why = vllm_compat.engine_config_error(model_path, eng, env)
        if why is None:
            accepted.add(key)
        return why

    if not result["errors"] and not result["params_errors"]:  # a value the parser refuses builds no config: fix it
        try:
            paths = provide_models(p)
        except (model_store.ModelError, common.ParamsError) as e:
            result["errors"] = [str(e)]
        else:
            result["errors"], result["unchecked"], _ = engine_config_errors(p, job["gpus"], paths, refuse)
            if here:
                result["params_errors"], unchecked = as_it_stands_errors(here, job["gpus"], paths, refuse)
                result["unchecked"] += unchecked
            result["configs"] = len(built)
            vllm_compat.remember_keys(accepted)
    result["seconds"] = round(time.monotonic() - t0, 1)
    common.write_json(out_path, result)


def preflight(p: Plan, gpus: list[dict], here: dict | None = None) -> dict:
    """Before any engine starts, on this machine: every engine arg through vLLM's parser (`engine_arg_errors`), the
    models provided (`provide_models`), and every engine config the ladder may start built by vLLM's own code
    (`engine_config_errors`); `here`, params.yaml as it stands (`as_it_stands`), its engine args and configs alike
    (`as_it_stands_errors`). In a child process (this file with --preflight, under engine.guarded): vLLM's config
    code sets environment variables (the CPU platform sets LD_PRELOAD), imports torch and on a GPU may open a CUDA
    context, none of which may stay in the ladder's process, whose stages and engines inherit it. Returns the
    child's result: errors (each naming rung, knob and value), params_errors (params.yaml's as it stands, each naming
    field and value), unchecked, configs, seconds, version."""
    from serving import engine
    with tempfile.TemporaryDirectory(prefix="ladder-preflight-") as tmp:
        job, out = Path(tmp, "job.json"), Path(tmp, "result.json")
        plan_fields = {f.name: getattr(p, f.name) for f in dataclasses.fields(Plan) if f.init}
        common.write_json(job, {"plan": plan_fields, "gpus": gpus, "here": here})
        env = {**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"}  # vLLM's INFO lines are for the engines' logs
        proc = engine.guarded([sys.executable, str(Path(__file__).resolve()), "--preflight", str(job), str(out)],
                              env=env)
        try:
            rc = proc.wait()
        except BaseException:  # Ctrl-C: the child is in the guard's session, not the terminal's
            proc.terminate()
            proc.wait()
            raise
        if not out.exists():
            raise common.ParamsError(f"the pre-flight (scripts/plan.py --preflight) exited {rc} with no result; "
                                     f"its output is above")
        return common.read_json(out)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--preflight":
        _preflight_worker(sys.argv[2], sys.argv[3])
    else:
        sys.exit("usage: plan.py --preflight JOB.json OUT.json (the ladder's pre-flight child)")
