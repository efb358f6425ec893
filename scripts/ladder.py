"""`make ladder`: run the ladder of params.yaml as DVC experiments, keep or revert each rung, write the report.

Each rung is one `dvc exp run -n <profile>-<i>-<rung> -S ...` in the workspace, composed on the last KEPT rung,
so params.yaml is the only thing that changes and `dvc exp show` lists the rungs. After each rung the driver
reads the gate and the measurements and keeps or reverts it; a rung that fails (engine would not start,
OOM, timeout) is recorded with the engine's own error and the ladder goes on. Finished rungs are saved to
report/ladder.json as they finish; a re-run restores them from DVC's run-cache instead of re-measuring.

  python scripts/ladder.py [--profile cpu|gpu|gpu-shape] [--check] [--rungs N] [--ladder FILE]
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

import common
import engine
import fingerprint
import stats

LADDER_YAML = common.ROOT / "ladder.yaml"
LADDER_JSON = common.ROOT / "report" / "ladder.json"
LOGS = common.ROOT / "results" / "logs" / "ladder"
TARGETS = ["gate", "bench", "knee"]  # everything a rung measures; `report` runs once at the end
_REUSED = re.compile(r"(?:Restored stage '(\w+)' from run-cache|Stage '(\w+)' (?:didn't change|is cached))")


def reused_stages(lines: list[str]) -> list[str]:
    """Stages DVC did not re-measure: restored from the run-cache, or already up to date in the workspace."""
    return [m.group(1) or m.group(2) for ln in lines if (m := _REUSED.match(ln.strip()))]


# ---------------------------------------------------------------- profile + plan (pure)
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
    out = subprocess.run(["git", "show", "HEAD:params.yaml"], cwd=common.ROOT, capture_output=True, text=True)
    return yaml.safe_load(out.stdout) if out.returncode == 0 else None


def load_ladder(path: Path = LADDER_YAML) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            lad = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as e:
        raise common.ParamsError(f"{path.name}: cannot read ({e})") from None
    unknown = set(lad or {}) - {"objective", "groups", "profiles"}
    if unknown:
        raise common.ParamsError(f"{path.name}: unknown section(s) {', '.join(sorted(unknown))}; "
                                 f"allowed: objective, groups, profiles")
    if lad.get("objective", "knee_rps") not in ("knee_rps", "output_tps"):
        raise common.ParamsError(f"{path.name}: objective: {lad['objective']!r}; allowed: knee_rps, output_tps")
    for name, prof in (lad.get("profiles") or {}).items():
        if not isinstance(prof, dict) or set(prof) - {"settings", "rungs"}:
            raise common.ParamsError(f"{path.name}: profiles.{name} must hold `settings` and `rungs`")
    return lad


def profile_overrides(lad: dict, profile: str, defaults: dict) -> dict:
    """Every key any profile sets: this profile's value, else the committed default, so that switching
    profiles never leaves another profile's value behind in the workspace."""
    profiles = {name: (p.get("settings") or {}) for name, p in (lad.get("profiles") or {}).items()}
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


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", str(text).lower()).strip("-")


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


def plan(params: dict, lad: dict, profile: str) -> list[dict]:
    """Validate the profile's ladder before any engine starts; raise ParamsError naming rung and knob."""
    rungs = ((lad.get("profiles") or {}).get(profile) or {}).get("rungs")
    groups = lad.get("groups") or {}
    if not isinstance(rungs, list):
        raise common.ParamsError(f"ladder.yaml profiles.{profile}.rungs: missing; expected a list of rungs")
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
        unknown = set(rung) - {"name", "set", "fallback", "note", "when"}
        if unknown:
            errors.append(f"{where}: unknown field(s) {', '.join(sorted(unknown))}; allowed: name, set, fallback, note, when")
        errs = check_change(where, rung.get("set"), in_force, params, groups)
        if rung.get("fallback") is not None:
            errs += check_change(f"{where} fallback", rung["fallback"], in_force, params, groups)
        errors += errs
        if not errs:
            out.append(rung)
            in_force.update(candidates(rung["set"])[0])  # later rungs compose on this one, as if kept
    if errors:
        raise common.ParamsError("the ladder is not valid (nothing was run):\n  " + "\n  ".join(errors))
    return out


def hydra(v) -> str:
    """A value in the override grammar `dvc exp run -S` passes to Hydra (strings quoted)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, list):
        return "[" + ",".join(hydra(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ",".join(f"{k}:{hydra(x)}" for k, x in v.items()) + "}"
    return "'" + str(v).replace("\\", "\\\\").replace("'", "\\'") + "'"


# ---------------------------------------------------------------- decisions (pure)
def applied_check(change: dict, facts: dict, models: dict) -> list[dict]:
    """Did each changed knob take effect? Evidence from the engine's own log and /metrics."""
    cache = facts.get("cache_config") or {}
    received = facts.get("received") or {}
    out = []
    for knob, want in change.items():
        ok, seen = None, "not checked"
        if knob == "model.name":
            path = (models.get(want) or {}).get("path")
            seen = (f"served {Path(facts['model_path']).name if facts.get('model_path') else '?'}, quantization="
                    f"{facts.get('quantization')}, kernels={','.join(facts.get('kernels') or []) or 'default'}")
            ok = facts.get("model_path") == path if facts.get("model_path") else None
        elif knob == "engine.kv_cache_dtype":
            seen = cache.get("cache_dtype") or facts.get("kv_cache_dtype")
            ok = seen is not None and (seen == want or str(seen).startswith(str(want)))
            seen = f"cache_dtype={seen}, {facts.get('kv_cache_tokens')} KV tokens"
        elif knob == "engine.enable_prefix_caching":
            got = cache.get("enable_prefix_caching", facts.get("enable_prefix_caching"))
            ok = None if got is None else str(got) == str(want)
            rate = facts.get("prefix_cache_hit_rate")
            seen = f"enable_prefix_caching={got}, hit rate {'n/a' if rate is None else f'{rate:.1%}'}"
        elif knob == "engine.max_num_batched_tokens":
            got = facts.get("max_num_batched_tokens")
            seen = f"max_num_batched_tokens={got} (scheduler log)"
            if got is None:  # vLLM logs it only when chunked prefill splits prompts; else: what it received
                got = received.get("max_num_batched_tokens")
                seen = f"max_num_batched_tokens={got} (as received)"
            ok = None if got is None else got == want
        elif knob == "engine.max_num_seqs":
            got = received.get("max_num_seqs")
            ok, seen = (None if got is None else got == want), f"max_num_seqs={got} (as received)"
        elif knob == "engine.gpu_memory_utilization":
            got = cache.get("gpu_memory_utilization")
            ok = None if got is None else abs(float(got) - want) < 1e-9
            seen = f"gpu_memory_utilization={got}, {facts.get('kv_cache_tokens')} KV tokens"
        elif knob == "env.VLLM_CPU_KVCACHE_SPACE":
            got = cache.get("kv_cache_memory_bytes")
            ok = None if got in (None, "None") else int(got) == int(want) * 2**30
            seen = f"kv_cache_memory_bytes={got}, {facts.get('kv_cache_tokens')} KV tokens"
        elif knob == "engine.tensor_parallel_size":
            got = facts.get("tensor_parallel_size")
            ok, seen = (None if got is None else got == want), f"tensor_parallel_size={got}"
        elif knob.startswith("engine.") and knob[7:] in received:  # any other engine arg: as vLLM received it
            got = received[knob[7:]]
            ok, seen = got == want, f"{knob[7:]}={got} (as received)"
        out.append({"knob": knob, "requested": want, "observed": seen, "applied": ok})
    return out


def objective_value(rec: dict, objective: str):
    if objective == "knee_rps" and (rec.get("knee") or {}).get("knee_rps") is not None:
        return rec["knee"]["knee_rps"]
    return (rec.get("bench") or {}).get("output_tps")


def decide(rec: dict, base: dict, objective: str) -> tuple[bool, str]:
    """Keep or revert a finished rung against the last kept one: quality gate first, then 'did the change take
    effect', then performance judged by intervals, never by point values."""
    if rec["status"] != "ok":
        return False, f"{rec['status']}: {rec.get('error', 'no reason recorded')}"
    gate = rec.get("gate") or {}
    if gate.get("gated") and not gate.get("keep"):
        return False, "quality gate failed: " + "; ".join(gate.get("reasons", []))
    not_applied = [c["knob"] for c in rec.get("applied") or [] if c["applied"] is False]
    if not_applied:
        return False, f"not applied: the engine did not run with {', '.join(not_applied)} as asked; not credited"
    d_tps, d_knee = rec["delta"]["output_tps"], rec["delta"]["knee_rps"]
    primary, secondary = (d_knee, d_tps) if objective == "knee_rps" and d_knee["verdict"] != "unknown" else (d_tps, d_knee)
    pname = "knee" if primary is d_knee else "output tok/s"
    sname = "output tok/s" if primary is d_knee else "knee"
    quality = "quality gate passed" if gate.get("gated") else "not gated (no quality measured)"

    def says(d, name):
        return f"{name} {d['rel'] * 100:+.1f} % ({d['verdict']}{', ' + d['why'] if d.get('why') else ''})" \
            if d.get("rel") is not None else f"{name} {d['verdict']}"
    if primary["verdict"] == "worse":
        return False, f"{quality}, but {says(primary, pname)}"
    if primary["verdict"] == "better":
        return True, f"{quality}; {says(primary, pname)}; {says(secondary, sname)}"
    if secondary["verdict"] == "worse":
        return False, f"{quality}; {says(primary, pname)}, and {says(secondary, sname)}"
    if secondary["verdict"] == "better":
        return True, f"{quality}; {says(secondary, sname)}; {says(primary, pname)}"
    return True, (f"{quality}; no significant change: {says(primary, pname)}, {says(secondary, sname)}; "
                  "kept because nothing measurably got worse")


# ---------------------------------------------------------------- running rungs
class Driver:
    def __init__(self, params: dict, lad: dict, profile: str, out: Path = LADDER_JSON):
        self.params, self.lad, self.profile, self.out = params, lad, profile, out
        defaults = committed_params() or params
        self.overrides = profile_overrides(lad, profile, defaults)
        self.eff = effective_params(params, lad, profile, defaults)
        self.objective = lad.get("objective", "knee_rps")
        self.records: list[dict] = []
        self.t0 = time.monotonic()
        self.started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
        self.final_exp = None
        self.dvc: subprocess.Popen | None = None

    # -- one experiment
    def run_exp(self, index: int, name: str, cfg_flat: dict, role: str, change: dict | None, base: dict | None,
                note: str = "") -> dict:
        exp = f"{self.profile}-{index}-{name}"
        sets = {**self.overrides, **cfg_flat}
        # `++key=value`: Hydra's set-or-add, so a knob params.yaml does not list yet (hf_overrides, say) works too
        cmd = ["dvc", "exp", "run", "-n", exp] + [a for k, v in sets.items() for a in ("-S", f"++{k}={hydra(v)}")] + TARGETS
        rec = {"index": index, "name": name, "exp": exp, "role": role, "change": change or {}, "note": note,
               "base": base["exp"] if base else None, "knobs": cfg_flat, "status": "running"}
        self.records.append(rec)
        self.save()
        LOGS.mkdir(parents=True, exist_ok=True)
        log = LOGS / f"{exp}.log"
        print(f"\n=== rung {exp}: {', '.join(f'{k}={v}' for k, v in (change or {}).items()) or 'stock baseline'}", flush=True)
        subprocess.run(["dvc", "exp", "remove", exp], cwd=common.ROOT, capture_output=True)  # re-run: run-cache restores
        t0 = time.monotonic()
        with open(log, "w") as f:
            # guarded: dvc, its stages and their servers die with the ladder, even if it is SIGKILLed
            self.dvc = engine.guarded(cmd, cwd=common.ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            lines = []
            for line in self.dvc.stdout:
                line = common.redact(line)
                f.write(line)
                lines.append(line.rstrip())
                if re.match(r"^(Running stage|Restored stage|Stage '|error:|ERROR|eval|bench|knee|gate)", line):
                    print("  " + line.rstrip(), flush=True)
            rc = self.dvc.wait()
            self.dvc = None
        rec["seconds"] = round(time.monotonic() - t0, 1)
        rec["reused"] = reused_stages(lines)
        if rc != 0:
            errs = [ln[len("error: "):] for ln in lines if ln.startswith("error: ")]
            dvc_errs = [ln for ln in lines if ln.startswith("ERROR")]
            rec.update(status="failed", error=(errs or dvc_errs or [f"dvc exp run exit code {rc}"])[-1][:600],
                       log=str(log.relative_to(common.ROOT)))
            return rec
        self.collect(rec, base)
        return rec

    def collect(self, rec: dict, base: dict | None) -> None:
        R = common.RESULTS
        ev, bench, knee, gate = (common.read_json(R / f) for f in ("eval.json", "bench.json", "knee.json", "gate.json"))
        models = common.read_json(R / "models.json")["models"]
        rec.update(status="ok", model=ev.get("model"),
                   eval={k: ev.get(k) for k in ("status", "reason", "overall", "by_category", "n", "correct", "model_id")},
                   gate={k: gate.get(k) for k in ("keep", "gated", "verdict", "reasons", "overall", "by_category",
                                                  "regressed_categories", "flipped")},
                   bench={k: bench.get(k) for k in ("output_tps", "total_tps", "requests_per_s", "output_tps_ci95",
                                                    "repeats", "applied_shape", "kv_cache_tokens", "max_concurrency",
                                                    "engine_init_s", "wall_s")} | {
                       "output_tps_runs": bench["summary"]["output_tps"]["values"]},
                   knee={k: knee.get(k) for k in ("knee_rps", "first_fail_rps", "last_pass_rps", "status", "bracket_rps",
                                                  "probes", "goodput_at_knee_rps", "p99_ttft_ms_at_knee",
                                                  "p99_tpot_ms_at_knee", "output_tps_at_knee", "server_ready_s",
                                                  "wall_s", "non_monotonic", "rows")},
                   stage_seconds={"eval": ev.get("wall_s") or 0, "bench": bench.get("wall_s") or 0,
                                  "knee": knee.get("wall_s") or 0})  # includes the server start
        if rec["role"] == "baseline":  # rung 0 also measured the gate's reference eval
            rec["stage_seconds"]["eval_baseline"] = common.read_json(R / "baseline" / "eval.json").get("wall_s") or 0
        facts = {**(bench.get("engine") or {}), **(knee.get("applied") or {})}
        rec["applied"] = applied_check(rec["change"], facts, models) if rec["change"] else []
        rec["roofline"] = roofline(self.eff, rec, models)
        self.models = {n: {k: m.get(k) for k in ("id", "revision", "sha256", "path")} for n, m in models.items()}
        rec["delta"] = {"output_tps": stats.delta(base["bench"]["output_tps_runs"], rec["bench"]["output_tps_runs"])
                        if base else None,
                        "knee_rps": stats.knee_delta(base["knee"], rec["knee"]) if base else None}
        baseline = self.records[0] if self.records and self.records[0].get("status") == "ok" else (rec if not base else None)
        if baseline and baseline["bench"].get("output_tps"):
            rec["speedup"] = rec["bench"]["output_tps"] / baseline["bench"]["output_tps"]

    # -- the ladder
    def run(self, limit: int | None = None) -> int:
        rungs = plan(self.eff, self.lad, self.profile)[:limit]
        gpus = len(fingerprint.gpus())
        kept_flat = common.flatten_knobs(common.rung_config(self.eff, "baseline"))
        base = self.finish(self.run_exp(0, "baseline", kept_flat, "baseline", None, None))
        if base["status"] != "ok":
            base["kept"], base["decision"] = False, "the baseline failed: nothing to compare against; ladder stopped"
            self.save()
            print(f"ladder: baseline failed: {base.get('error')}", file=sys.stderr)
            return 1
        base["kept"], base["decision"] = True, "rung 0: the reference"
        self.final_exp = base["exp"]
        for i, rung in enumerate(rungs, 1):
            need = (rung.get("when") or {}).get("min_gpus")
            if need and gpus < need:
                self.finish({"index": i, "name": rung["name"], "exp": None, "role": "rung", "change": rung["set"],
                             "status": "skipped", "kept": False, "note": rung.get("note", ""),
                             "decision": f"skipped: needs {need} GPUs, this machine has {gpus}"})
                continue
            tries = [(rung["name"], c, "rung" if len(candidates(rung["set"])) == 1 else "candidate")
                     for c in candidates(rung["set"])]
            chosen = self.try_rung(i, rung, tries, kept_flat, base)
            if chosen is None and rung.get("fallback"):
                chosen = self.try_rung(i, rung, [(f"{rung['name']}-fallback", rung["fallback"], "fallback")],
                                       kept_flat, base)
            if chosen is not None:
                kept_flat = {**kept_flat, **chosen["change"]}
                base, self.final_exp = chosen, chosen["exp"]
        return 0

    def try_rung(self, i, rung, tries, kept_flat, base) -> dict | None:
        recs = []
        for name, change, role in tries:
            if role == "candidate":
                name = f"{name}-{_slug(next(v for k, v in change.items() if isinstance(rung['set'][k], list)))}"
            noop = {k: v for k, v in change.items() if kept_flat.get(k) == v}
            if noop == change:  # possible only after a revert: the value is already in force
                recs.append(self.finish({"index": i, "name": name, "exp": None, "role": role, "change": change,
                                         "status": "skipped", "kept": False, "note": rung.get("note", ""),
                                         "decision": "skipped: already in force (an earlier rung was reverted)"}))
                continue
            rec = self.run_exp(i, name, {**kept_flat, **change}, role, change, base, rung.get("note", ""))
            rec["kept"], rec["decision"] = decide(rec, base, self.objective)
            recs.append(self.finish(rec))
        good = [r for r in recs if r.get("kept")]
        if len(recs) > 1:  # candidates: the best objective among those that would be kept
            best = max(good, key=lambda r: objective_value(r, self.objective) or 0, default=None)
            for r in recs:
                if r is not best and r.get("kept"):
                    r["kept"], r["chosen"] = False, False
                    r["decision"] += f"; not chosen: {best['name']} did better on {self.objective}"
            if best:
                best["decision"] += f"; chosen among {len(recs)} candidates by {self.objective}"
            self.save()
            return best
        return good[0] if good else None

    def finish(self, rec: dict) -> dict:
        if rec not in self.records:
            self.records.append(rec)
        self.save()
        verdict = "kept" if rec.get("kept") else rec["status"] if rec["status"] != "ok" else "reverted"
        if rec.get("decision"):
            print(f"  -> {verdict}: {rec['decision']}", flush=True)
        return rec

    def save(self, final: bool = False) -> None:
        """report/ladder.json, rewritten after every rung so an interruption loses nothing finished."""
        fp = common.RESULTS / "fingerprint.json"
        ev_file = common.ROOT / self.eff["eval"]["file"]
        measured = sum(sum((r.get("stage_seconds") or {}).values()) for r in self.records)
        lad = {
            "profile": self.profile, "started": self.started, "finished": time.strftime("%Y-%m-%d %H:%M:%S %Z") if final else None,
            "complete": final, "environment": common.read_json(fp) if fp.exists() else {},
            "git_commit": common.git_commit(), "models": getattr(self, "models", {}),
            "slo": self.eff["slo"], "objective": self.objective,
            "settings": {k: self.eff[k] for k in ("bench", "knee", "eval", "gate", "cost")},
            "eval_file": self.eff["eval"]["file"], "eval_sha256": common.sha256_file(ev_file),
            "eval_n": sum(1 for ln in open(ev_file, encoding="utf-8") if ln.strip()),
            "final_exp": self.final_exp, "rungs": self.records,
            "engine_seconds": round(measured, 1), "wall_seconds": round(time.monotonic() - self.t0, 1),
        }
        lad["cost_usd"] = round(lad["engine_seconds"] / 3600 * float(self.eff["cost"].get("gpu_price_per_hour") or 0), 4)
        common.write_json(self.out, lad)

    def interrupt(self) -> None:
        """Ctrl-C: pass it to the running `dvc exp run` (and its stage), which stops its servers by PID; if that
        does not end it, its guard stops the whole group (SIGTERM, SIGKILL after its grace)."""
        if self.dvc and self.dvc.poll() is None:
            try:
                os.killpg(self.dvc.pid, signal.SIGINT)
                self.dvc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.dvc.terminate()
                self.dvc.wait(timeout=engine.GUARD_GRACE_S + 30)
            except ProcessLookupError:
                pass


def roofline(eff: dict, rec: dict, models: dict) -> dict | None:
    """Batch-1 decode floor from the model's shapes and the GPU's bandwidth, vs the TPOT at the lowest probed rate."""
    fp = common.read_json(common.RESULTS / "fingerprint.json")
    gpu = (fp.get("gpus") or [{}])[0].get("name")
    bw = stats.bandwidth_gbs(gpu, (eff.get("roofline") or {}).get("bandwidth_gbs"))
    path = (models.get(rec.get("model")) or {}).get("path")
    if not bw or not path or not Path(path, "config.json").exists():
        return None
    cfg = json.loads(Path(path, "config.json").read_text())
    bits = (cfg.get("quantization_config") or {}).get("bits") or 16
    kv = 1 if str(rec["knobs"].get("engine.kv_cache_dtype", "auto")).startswith("fp8") else 2
    floor = stats.tpot_floor_ms(cfg, bw, weight_bits=bits, kv_bytes=kv)
    rows = sorted((rec.get("knee") or {}).get("rows") or [], key=lambda r: r["offered_rps"])
    low = rows[0]["p50_tpot_ms"] if rows else None
    return {"gpu": gpu, "bandwidth_gbs": bw, "weight_bits": bits, "tpot_floor_ms": round(floor, 2),
            "tpot_low_load_ms": low, "pct_of_floor": round(floor / low, 3) if low else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profile", default=os.environ.get("PROFILE") or None)
    ap.add_argument("--check", action="store_true", help="validate params and the ladder; run nothing")
    ap.add_argument("--rungs", type=int, default=None, help="run only the first N rungs after the baseline")
    ap.add_argument("--ladder", type=Path, default=LADDER_YAML, help="the ladder file (default: ladder.yaml)")
    args = ap.parse_args()
    os.chdir(common.ROOT)
    profile = args.profile or ("gpu" if fingerprint.gpus() else "cpu")
    sys.path.insert(0, str(common.ROOT / "evals"))
    import score
    try:  # every bad input is reported here, before any engine starts
        params, lad = common.load_params(check=False), load_ladder(args.ladder)
        eff = effective_params(params, lad, profile, committed_params())
        common.validate(eff)
        rungs = plan(eff, lad, profile)
        score.load_items(eff["eval"]["file"])
    except (common.ParamsError, score.EvalFileError) as e:
        common.die(str(e))
    print(f"ladder: profile {profile}, baseline + {len(rungs[:args.rungs])} rungs: "
          + ", ".join(r["name"] for r in rungs[:args.rungs]))
    if args.check:
        return 0
    drv = Driver(params, lad, profile)
    common.handle_signals()
    try:
        rc = drv.run(args.rungs)
    except KeyboardInterrupt:
        drv.interrupt()
        for r in drv.records:
            if r["status"] == "running":
                r["status"], r["decision"] = "interrupted", "interrupted: re-run `make ladder` to resume here"
        drv.save()
        print("\nladder: interrupted; finished rungs are kept (dvc exp show); `make ladder` resumes", file=sys.stderr)
        return 130
    # leave the workspace at the final kept stack, then write the complete ladder and render it
    if drv.final_exp:
        subprocess.run(["dvc", "exp", "apply", drv.final_exp], cwd=common.ROOT, check=False)
    drv.save(final=True)
    subprocess.run(["dvc", "repro", "report"], cwd=common.ROOT, check=True)
    print(f"ladder: done in {(time.monotonic() - drv.t0) / 60:.1f} min; report/before_after.md")
    return rc


if __name__ == "__main__":
    sys.exit(main())
