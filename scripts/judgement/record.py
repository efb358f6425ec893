"""How a finished rung's record is filled from the stages' own result files (each stage's summary copied whole, its
provenance left in results/), and the judgement and time figures drawn from the rungs. The record's declared shape,
and its one writer and reader, are records/ladder.py's RungRecord and LadderRecord: the driver builds a rung as a
dict of that shape while it climbs (the functions here fill it in place), and the file is validated by the model.

The report stage reads nothing else: every number, method string and verdict it prints is in this record.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

import common
from judgement import capacity, decide, stats
from measure import summary
from records.bench import BenchResult
from records.eval import EvalResult
from records.fingerprint import Fingerprint
from records.gate import GateResult
from records.knee import KneeResult, RungKnee
from records.models import ModelsManifest


def fill(rec: dict, base: dict | None, baseline: dict | None, params: dict, floor=None,
         before: dict | None = None) -> dict:
    """Fill a rung that ran to the end from results/; returns the download manifest's models."""
    res = common.RESULTS
    ev_rec = EvalResult.load_file(res / "eval.json")
    ev = ev_rec.as_rung()
    gate = GateResult.load_file(res / "gate.json").as_rung()
    bench_rec = BenchResult.load_file(res / "bench.json")
    bench = bench_rec.as_rung()
    knee_rec = KneeResult.load_file(res / "knee.json")
    knee = RungKnee(**dict(knee_rec)).as_rung()  # the stage's record as it wrote it, less its provenance
    prov = bench_rec.provenance or {}
    env = prov.get("environment") or {}
    rec["measured"] = {"at": prov.get("measured_at"), "host_id": env.get("host_id"),
                       "gpu_uuids": [g.get("uuid") for g in env.get("gpus") or []],
                       "machine": (env.get("machine") or {}).get("id"),
                       "machine_label": (env.get("machine") or {}).get("label")}
    models = ModelsManifest.load_file(res / "models.json").entries()
    # knee.noise_floor, a judgement threshold (the params judging now, not measuring): beside the stage's record
    rec.update(status="ok", model=ev_rec.model, eval=ev, gate=gate, bench=bench, knee=knee,
               knee_noise_floor=params["knee"]["noise_floor"],
               stage_seconds={"eval": ev_rec.wall_s or 0, "bench": bench_rec.wall_s or 0,
                              "knee": knee.get("wall_s") or 0})  # knee includes the server start
    rec["stage_time"] = {s: r["time"] for s, r in (("eval", ev), ("bench", bench), ("knee", knee)) if r.get("time")}
    if rec["role"] == decide.BASELINE:  # rung 0 also measured the gate's reference eval
        ref_eval = EvalResult.load_file(res / "baseline" / "eval.json")
        rec["stage_seconds"]["eval_baseline"] = ref_eval.wall_s or 0
        if ref_eval.time:
            rec["stage_time"]["eval_baseline"] = ref_eval.time.model_dump()
    target = target_of(knee_rec, bench_rec)
    # the serving engines' evidence first; the eval engine's is the fallback (a rung the gate failed runs no other)
    facts = {**(ev_rec.engine or {}), **(bench_rec.engine or {}), **(knee.get("applied") or {}),
             "target": target}
    rec["applied"] = decide.applied_check(rec["change"], facts, models) if rec["change"] else []
    if target:  # every rung, rung 0 too: did the engine run inside the target card's memory?
        rec["target"] = target
        rec["applied"].append(decide.target_check(target, facts, kv_bytes_per_token(rec, models)))
    rec["roofline"] = roofline(params, rec, models)
    rec["delta"] = compare(base, rec, floor, before=before) if base else {"output_tps": None, "knee_rps": None}
    ref = baseline or rec
    if ref["bench"].get("output_tps") and bench_rec.output_tps and same_machine([ref, rec]):
        rec["speedup"] = bench_rec.output_tps / ref["bench"]["output_tps"]
    return {n: {k: m.get(k) for k in ("id", "revision", "sha256", "path")} for n, m in models.items()}


def target_of(knee: KneeResult, bench: BenchResult) -> dict | None:
    """The target card's conversion the engine stages ran with (common.engine_config), from their provenance:
    the knee's server, else the bench's engine."""
    for prov in (knee.provenance, bench.provenance):
        knobs = (prov or {}).get("knobs") or {}
        if knobs.get("target"):
            return knobs["target"]
    return None


def model_config(rec: dict, models: dict) -> dict | None:
    """The rung's model's config.json (its shapes), from the download stage's folder; None if there is none."""
    path = (models.get(rec.get("model")) or {}).get("path")
    if not path or not Path(path, "config.json").exists():
        return None
    return json.loads(Path(path, "config.json").read_text())


def kv_bytes(rec: dict) -> int:
    """Bytes per KV element the rung's engine stores: 1 for an fp8 KV cache, else 2 (16-bit)."""
    return 1 if str(rec["knobs"].get("engine.kv_cache_dtype", "auto")).startswith("fp8") else 2


def kv_bytes_per_token(rec: dict, models: dict) -> float | None:
    """KV cache bytes per token on one GPU, from the model's shapes and the rung's KV dtype (None if unknown)."""
    cfg = model_config(rec, models)
    if cfg is None:
        return None
    try:
        return stats.kv_bytes_per_token(cfg, kv_bytes(rec)) / (rec["knobs"].get("engine.tensor_parallel_size") or 1)
    except KeyError:  # a config without the usual shape keys
        return None


def engine_means(rec: dict) -> list[float]:
    """The rung's fresh engines' mean output tok/s (one engine a bench stage today); [] when its bench measured
    nothing."""
    runs = (rec.get("bench") or {}).get("output_tps_runs") or []
    return [sum(runs) / len(runs)] if runs and (rec.get("bench") or {}).get("status", "ok") == "ok" else []


def same_config_groups(recs: list[dict]) -> list[list[float]]:
    """The engine means of every config this ladder measured more than once (a base and its re-measures, the
    confirm pairs): what the ladder's own start-to-start spread is estimated from (stats.pool)."""
    groups: dict[str, list[float]] = {}
    for r in recs:  # one config on one machine: another machine's engines are no start-to-start noise
        if r.get("role") == decide.KNEE_RECHECK:  # its bench is its config's, restored: no engine of its own
            continue
        if r.get("status") == "ok" and r.get("knobs") is not None:
            groups.setdefault(json.dumps([r["knobs"], machine_of(r)], sort_keys=True), []).extend(engine_means(r))
    return [g for g in groups.values() if len(g) >= 2]


def floor_of(prior, recs: list[dict]) -> stats.Floor:
    """The floor every Δ is drawn with: the measured one (params bench.noise_floor, typed) pooled with this ladder's own
    same-config engines."""
    return stats.pool(prior, same_config_groups(recs))


class CrossMachine(ValueError):
    """A Δ asked for between measurements from two machines: never formed (their GPUs, driver or software differ)."""


def machine_of(rec: dict) -> str | None:
    return (rec.get("measured") or {}).get("machine")


def same_machine(recs: list[dict]) -> bool:
    """Whether the records were measured on one machine (records from before machines were named: assumed so)."""
    return len({m for m in map(machine_of, recs) if m}) <= 1


def compare(base: dict, rec: dict, floor=None, again: dict | None = None,
            before: dict | None = None) -> dict:
    """Deltas of rec vs base: tok/s against the base's engine measured last before rec (`before`: its latest
    re-measure, else the base's own bench) and `again`, the base measured right after rec (their mean: a machine
    drifting linearly under the rung cancels); the knee vs the base's own search."""
    flanks = [before or base] + ([again] if again and again.get("status") == "ok" else [])
    searched = before if before and (before.get("knee") or {}).get("label") != common.BENCH_ONLY else base
    return compare_sides(flanks, [rec], floor, knee_of=searched)


def compare_sides(bases: list[dict], recs: list[dict], floor=None,
                  knee_of: dict | None = None) -> dict:
    """Deltas of one config's engines (`recs`) vs another's (`bases`), each engine a unit, in like units: per GPU
    when their instances hold different numbers of GPUs, so a 2-GPU instance is never compared with a 1-GPU one as
    if they were one (the floor is relative: unchanged). The knees: the last engine of each side."""
    base, rec = bases[0], recs[-1]
    if not same_machine([*bases, *recs, *([knee_of] if knee_of else [])]):
        raise CrossMachine("no Δ across machines: " + ", ".join(
            f"{r.get('exp')} on {(r.get('measured') or {}).get('machine_label')}" for r in [*bases, *recs]))
    gb, g = (capacity.gpus_per_instance(r["knobs"]) for r in (base, rec))

    def engines(side: list[dict], gpus: int) -> list[list[float]]:
        return [e for e in (capacity.per_gpu_runs((r.get("bench") or {}).get("output_tps_runs") or [], gpus)
                            for r in side) if e]
    searched = [r for r in bases if (r.get("knee") or {}).get("label") != common.BENCH_ONLY]  # a re-measure has no knee
    knee = knee_of or (searched or bases)[-1]  # the rung whose knee the rung's is judged against
    d = {"output_tps": stats.delta(engines(bases, gb), engines(recs, g), floor),
         "knee_rps": stats.knee_delta(decide.judged_knee(knee, gb), decide.judged_knee(rec, g))}
    if len(bases) > 1 and d["output_tps"].get("ci"):
        d["output_tps"]["why"] = "the base measured before and after it; " + d["output_tps"]["why"]
    elif knee_of and bases[0] is not knee_of and d["output_tps"].get("ci"):
        d["output_tps"]["why"] = "the base as last measured before it; " + d["output_tps"]["why"]
    if g != gb:
        for v in d.values():
            v["why"] = f"per GPU, {g} vs {gb} GPUs per instance; {v['why']}"
            v["per_gpu"] = [g, gb]
    skipped = [b for b in ((r.get("bench") or {}) for r in (base, rec)) if b.get("status") == "n/a"]
    if skipped:  # a bench that measured nothing (gate failed, offline engine): say why, not "missing measurements"
        d["output_tps"]["why"] = stats.not_measured(*skipped)
    return d


def drift_words(d: dict) -> str:
    """A Δ of one config measured twice, in words: `+1.2 % [-3.0, +5.4] (within noise)`."""
    if d.get("rel") is None:
        return f"n/a ({d.get('why') or d.get('verdict')})"
    ci = d.get("ci") or d.get("ci95")
    return (f"{d['rel'] * 100:+.1f} %" + (f" [{ci[0] * 100:+.1f}, {ci[1] * 100:+.1f}]" if ci else "")
            + f" ({d['verdict']})")


def roofline(params: dict, rec: dict, models: dict) -> dict | None:
    """Batch-1 decode floor from the model's shapes and the GPU's bandwidth, vs the knee stage's batch-1 TPOT."""
    fp = Fingerprint.load_file(common.RESULTS / "fingerprint.json")
    gpu = fp.gpus[0].name if fp.gpus else None
    bw = stats.bandwidth_gbs(gpu, params["roofline"]["bandwidth_gbs"])
    cfg = model_config(rec, models) if bw else None
    if cfg is None or bw is None:  # bw is None only where cfg is: named so its type is narrowed
        return None
    bits, kv = stats.weight_bits(cfg.get("quantization_config")), kv_bytes(rec)
    shape = (rec.get("knee") or {}).get("shape") or {}
    context = (shape.get("input_len") or 0) + (shape.get("output_len") or 0) // 2  # mean context while decoding
    floor = stats.tpot_floor_ms(cfg, bw, weight_bits=bits, kv_bytes=kv, context_tokens=context)
    one = (rec.get("knee") or {}).get("batch1") or {}
    rows = sorted((rec.get("knee") or {}).get("rows") or [], key=lambda r: r["offered_rps"])
    # the batch-1 probe where there is one; else (older records) the lowest probed rate, which is not batch 1
    low, at = (one["tpot_ms"], "batch 1") if one.get("tpot_ms") else (
        (rows[0]["p50_tpot_ms"], f"p50 at {rows[0]['offered_rps']:g} req/s") if rows else (None, None))
    out = {"gpu": gpu, "bandwidth_gbs": bw, "weight_bits": round(bits, 3), "context_tokens": context,
           "tpot_floor_ms": round(floor, 2), "tpot_measured_at": at,
           "tpot_low_load_ms": low, "pct_of_floor": round(floor / low, 3) if low else None}
    target = params.get("target") or {}
    if target.get("bandwidth_gbs"):  # the emulated card's floor: its memory is emulated, its bandwidth is not
        out.update(target_gpu=target.get("name"), target_bandwidth_gbs=target["bandwidth_gbs"],
                   target_tpot_floor_ms=round(stats.tpot_floor_ms(cfg, target["bandwidth_gbs"], weight_bits=bits,
                                                                  kv_bytes=kv, context_tokens=context), 2))
    return out


def confirm_summary(runs: list[dict], floor=None, objective: str = "knee_rps", kept: list[dict] | None = None,
                    knee_spread=None) -> dict:
    """The confirm step's result: baseline and final stack, each re-measured in every pair, compared in like units
    (compare_sides: tok/s over every engine; the knee over every server, stats.knees_delta with the servers' spread
    `knee_spread`, params knee.server_spread), and judged by the rule as a rung against its base (decide.reproduced:
    `verdict`, `reproduced` True / False / None where it could not tell, and why), with its `power` for a
    ×stats.CONFIRM_STACK stack (stats.power, from the floors it was drawn with, on the measures the kept gains rested
    on: either confirms it) and the `kept` rungs' records it rests on (`rested_on`: each one's name and what its keep
    rested on, decide.rested_on). This is where the headline comes from."""
    ok = [r for r in runs if r.get("status") == "ok"]
    sides = {w: [r for r in ok if r["name"].endswith(f"-{w}")] for w in ("baseline", "final")}
    if not sides["baseline"] or not sides["final"] or len(ok) < len(runs):
        bad = next((r for r in runs if r.get("status") != "ok"), None)
        return {"summary": "confirm step incomplete" + (f": {bad['name']} {bad['status']}" if bad else ""),
                "delta": None}

    def pooled(recs: list[dict]) -> dict:
        last = recs[-1]
        runs_ = [x for r in recs for x in (r["bench"].get("output_tps_runs") or [])]
        return {"knobs": last["knobs"], "knee": last["knee"], "exp": [r["exp"] for r in recs],
                "bench": {**last["bench"], "output_tps_runs": runs_,
                          "output_tps": (summary.summarize(runs_)["median"] if runs_
                                         else last["bench"].get("output_tps"))}}
    b, f = pooled(sides["baseline"]), pooled(sides["final"])
    d = compare_sides(sides["baseline"], sides["final"], floor)  # each pair's engine a unit, not its repeats
    gb, g = (capacity.gpus_per_instance(sides[w][0]["knobs"]) for w in ("baseline", "final"))
    d["knee_rps"] = stats.knees_delta([capacity.per_gpu_knee(r["knee"], gb) for r in sides["baseline"]],
                                      [capacity.per_gpu_knee(r["knee"], g) for r in sides["final"]], knee_spread)
    if g != gb:
        d["knee_rps"]["why"] = f"per GPU, {g} vs {gb} GPUs per instance; {d['knee_rps']['why']}"
    bt, ft = b["bench"].get("output_tps"), f["bench"].get("output_tps")
    tps = (f"{bt:.0f} output tok/s → {ft:.0f} tok/s ({ft / bt:.2f}×, Δ {d['output_tps']['rel'] * 100:+.1f} % "
           f"[{d['output_tps']['ci'][0] * 100:+.1f}, {d['output_tps']['ci'][1] * 100:+.1f}])"
           if bt and ft and d["output_tps"].get("ci") else "output tok/s n/a")
    on = {m: [r for r in kept or [] if (decide.rested_on(r, objective) == "output tok/s") == (m == "output_tps")]
          for m in ("output_tps", "knee_rps")}
    kept_gain = {m: _compound(rs, m) for m, rs in on.items() if rs and _compound(rs, m) is not None}
    verdict, why = decide.reproduced(d, objective, kept_gain)
    by = {m: stats.power(d[m]) for m in ("output_tps", "knee_rps")}
    if objective != "knee_rps":  # the knee keeps nothing: tok/s alone can confirm
        by["knee_rps"] = None
    counted = [p for p in (by[m] for m in (kept_gain or by)) if p is not None]
    power = 1 - float(np.prod([1 - p for p in counted])) if counted else None
    power = None if power is None else round(power, 3)
    return {"baseline": {"output_tps": bt, "output_tps_runs": b["bench"]["output_tps_runs"], "knee": _knee(b["knee"])},
            "final": {"output_tps": ft, "output_tps_runs": f["bench"]["output_tps_runs"], "knee": _knee(f["knee"])},
            "delta": d, "speedup": ft / bt if bt and ft else None, "verdict": verdict,
            "reproduced": {decide.CONFIRMED: True, decide.NOT_REPRODUCED: False}.get(verdict),
            "reproduced_why": why, "kept_gain": kept_gain,
            "power": power, "words": decide.confirm_words({"verdict": verdict, "power": power}),
            "power_by": {m: None if p is None else round(p, 3) for m, p in by.items()},
            "rested_on": [{"name": r["name"], "exp": r.get("exp"), "on": decide.rested_on(r, objective)}
                          for r in kept or []],
            "summary": f"{tps}; {d['knee_rps']['why']} ({d['knee_rps']['verdict']})"}


def _compound(recs: list[dict], measure: str) -> float | None:
    """The gain kept rungs read on one measure, compounded over them (each vs its base); None: none read one."""
    read = [((r.get("delta") or {}).get(measure) or {}).get("rel") for r in recs]
    rels = [x for x in read if x is not None]
    return float(np.prod([1 + x for x in rels]) - 1) if rels else None


def _knee(k: dict) -> dict:
    return {x: k.get(x) for x in ("knee_rps", "first_fail_rps", "mid_rps", "half_width_rps", "status", "probes",
                                  "non_monotonic", "confirmed", "short_probes")}


# ---------------------------------------------------------------- where the time went
SPLIT = ("start_s", "measure_s", "other_s", "dvc_s")


def _estimate(stage: str, rec: dict, wall: float, num_prompts: int | None = None) -> dict:
    """A stage's split from the fields records had before stages wrote `time`: the knee's server start, eval's
    generation, bench's passes (output tokens ÷ tok/s of each timed repeat and warm-up pass; `num_prompts` from the
    settings where the record has no runs); the rest of its wall counted as start (imports and engine construction
    dominate it). A stage none of these fields says more of (eval_baseline): all of it other."""
    r = rec.get(stage) or {}
    out_len = (r.get("applied_shape") or {}).get("output_len")
    if stage == "knee" and r.get("server_ready_s") is not None:
        start = r["server_ready_s"]
        return {"wall_s": wall, "start_s": start, "measure_s": max(wall - start, 0.0), "other_s": 0.0}
    if stage == "eval" and r.get("generate_s") is not None:
        measure = r["generate_s"]
    elif stage == "bench" and r.get("runs"):
        shape = r.get("shape") or {}
        per_pass = (shape.get("num_prompts") or 0) * (shape.get("output_len") or 0)
        measure = (sum(x.get("output_tokens", 0) / x["output_tps"] for x in r["runs"] if x.get("output_tps"))
                   + sum(per_pass / t for t in r.get("warmup_output_tps") or [] if t))
    elif stage == "bench" and r.get("output_tps_runs") and num_prompts and out_len:
        measure = sum(num_prompts * out_len / t for t in r["output_tps_runs"] if t)
    else:
        return {"wall_s": wall, "start_s": 0.0, "measure_s": 0.0, "other_s": wall}
    measure = min(measure, wall)
    return {"wall_s": wall, "start_s": wall - measure, "measure_s": measure, "other_s": 0.0}


def time_split(rec: dict, num_prompts: int | None = None) -> dict:
    """Where a rung's experiment wall time (`seconds`, its `dvc exp run`) went: summed over the engine stages
    that ran (not those DVC restored), `start_s` starting engines, `measure_s` timed traffic and generation,
    `other_s` the stages' imports and teardown; `dvc_s` the rest: DVC itself and the small stages (fingerprint,
    download, gate). `estimated`: some stage predates the stages' own split (_estimate). A rung that did not run
    to the end has no split: all of its time is `other_s`."""
    seconds = rec.get("seconds") or 0.0
    out = {"seconds": seconds, "gpus": rec.get("gpus") or 1, **dict.fromkeys(SPLIT, 0.0), "estimated": False,
           "starts": 0}
    if rec.get("status") != "ok":
        out["other_s"] = seconds
        return out
    reused, recorded = set(rec.get("reused") or []), rec.get("stage_time") or {}
    ran = 0.0
    for stage, wall in (rec.get("stage_seconds") or {}).items():
        if stage in reused:  # restored from the run-cache: it cost this experiment nothing but DVC's time
            continue
        t = recorded.get(stage)
        if not t:
            t, out["estimated"] = _estimate(stage, rec, wall, num_prompts), True
        for k in ("start_s", "measure_s", "other_s"):
            out[k] += t[k]
        ran += t["wall_s"]
        if t["start_s"]:  # an engine was started (two where the bench warmed the machine first)
            out["starts"] += 1 + bool((rec.get(stage) or {}).get("warm_up_engine"))
    out["dvc_s"] = max(seconds - ran, 0.0)
    return {k: round(v, 1) if isinstance(v, float) else v for k, v in out.items()}


def time_totals(rungs: list[dict], price_per_hour: float, unit: str = "GPU", preflight_s: float | None = None,
                wall_s: float | None = None, held: int = 1) -> dict:
    """The ladder's time, each rung's weighted by the GPUs it held (`gpus`, 1 on a CPU box): device-minutes, the
    share of them each part of time_split took (`start` is the time spent starting engines), and their cost. The
    time outside the experiments holds the machine too (`held`: its GPUs, 1 on a CPU box), so it is counted in the
    total: the pre-flight before the first experiment (`preflight_s`: imports, the plan, the models, every engine
    config built by vLLM's code) and the driver's own between them (`wall_s`, the driver's wall time, less the
    experiments': `dvc exp apply`, replaying finished rungs, saving the record). The rows then add up to the wall
    time `make ladder` took, less the report stage that renders them."""
    splits = [r["time"] for r in rungs if r.get("time")]
    outside = ({} if preflight_s is None else  # a record from before they were counted: the experiments only
               {"preflight_s": preflight_s, "driver_s": max((wall_s or 0.0) - sum(t["seconds"] for t in splits), 0.0)})
    total = sum(t["seconds"] * t["gpus"] for t in splits) + sum(outside.values()) * held
    sums = {k: sum(t[k] * t["gpus"] for t in splits) for k in SPLIT}
    starts = sum(t.get("starts") or 0 for t in splits)
    return {"unit": unit, "minutes": round(total / 60, 1), "engine_starts": starts,
            "seconds_per_start": round(sum(t["start_s"] for t in splits) / starts, 1) if starts else None,
            **{f"{k[:-2]}_minutes": round(v / 60, 1) for k, v in sums.items()},
            **{f"{k[:-2]}_share": round(v / total, 3) if total else None for k, v in sums.items()},
            **{f"{k[:-2]}_minutes": round(v * held / 60, 1) for k, v in outside.items()},
            **{k: round(v, 1) for k, v in outside.items()},  # their wall seconds: the Time table's wall column
            "price_per_hour": price_per_hour, "cost_usd": round(total / 3600 * price_per_hour, 2),
            "estimated": any(t["estimated"] for t in splits)}


def confirm_time(runs: list[dict]) -> dict:
    """The confirm step's device-minutes (each run's `time`, weighted by its GPUs): in all and per stack (rung 0's
    runs, the final stack's)."""
    def minutes(side: str | None) -> float:
        return round(sum(r["time"]["seconds"] * r["time"]["gpus"] for r in runs if r.get("time")
                         and (side is None or r["name"].endswith(f"-{side}"))) / 60, 1)
    return {"runs": len(runs), "minutes": minutes(None),
            "per_stack": {"stock": minutes("baseline"), "final": minutes("final")}}


def annotate_time(lad: dict) -> dict:
    """Fill time_split into every rung and confirm run that ran, and time_totals into the record (after
    capacity.annotate, which sets each rung's GPUs; a confirm run's are its knobs'), with the confirm step's own
    minutes (confirm_time). The ladder driver calls it on every save."""
    num_prompts = (((lad.get("settings") or {}).get("bench")) or {}).get("num_prompts")
    on_gpu = (lad.get("environment") or {}).get("device") == "gpu"
    confirm = ((lad.get("confirm") or {}).get("runs")) or []
    for r in confirm:
        r["gpus"] = capacity.gpus_per_instance(r.get("knobs") or {}) if on_gpu else None
    for r in lad["rungs"] + confirm:
        if r.get("seconds") is not None:
            r["time"] = time_split(r, num_prompts)
    price = float(((lad.get("settings") or {}).get("cost") or {}).get("gpu_price_per_hour") or 0)
    unit = "GPU" if on_gpu else "CPU"
    held = len((lad.get("environment") or {}).get("gpus") or []) if on_gpu else 1
    lad["time"] = time_totals(lad["rungs"] + confirm, price, unit, lad.get("preflight_seconds"),
                              lad.get("wall_seconds"), max(held, 1))
    if confirm:
        lad["time"]["confirm"] = confirm_time(confirm)
    return lad
