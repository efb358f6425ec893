"""Capacity (pure): GPUs per instance, per-GPU figures, and the plan that turns a measured knee into a fleet.

An instance is one serving engine (`vllm serve`) with its GPUs: tensor x pipeline x data parallel size. A knee
is known only to its bracket [last pass, first fail), so every figure here comes as the value planned on the
last passing rate (what was shown to meet the SLO) and the range the bracket allows, and names its knee.
scripts/fill_capacity.py fills it into a copy of a record made before the plan existed.
"""
from __future__ import annotations

import math

from judgement import stats

PARALLEL_KNOBS = ("engine.tensor_parallel_size", "engine.pipeline_parallel_size", "engine.data_parallel_size")
NO_PLAN = "no plan"


def gpus_per_instance(knobs: dict) -> int:
    """GPUs one engine instance holds: tensor x pipeline x data parallel size (1 where a knob is unset)."""
    n = 1
    for knob in PARALLEL_KNOBS:
        n *= int(knobs.get(knob) or 1)
    return n


def _div(v, n):
    return None if v is None else v / n


def per_gpu_knee(knee: dict, gpus: int) -> dict:
    """A knee and its bracket divided by the GPUs that served it: instances of different sizes in like units."""
    return {**knee, **{k: _div(knee.get(k), gpus) for k in ("knee_rps", "last_pass_rps", "first_fail_rps",
                                                            "conclusive_fail_rps") if k in knee}}


def per_gpu_runs(runs: list[float], gpus: int) -> list[float]:
    return [v / gpus for v in runs or []]


def per_gpu(rec: dict, gpus: int) -> dict:
    """The per-GPU figures a rung row shows beside its totals."""
    bench, knee = rec.get("bench") or {}, rec.get("knee") or {}
    return {"output_tps": _div(bench.get("output_tps"), gpus), "knee_rps": _div(knee.get("knee_rps"), gpus),
            "first_fail_rps": _div(knee.get("first_fail_rps"), gpus)}


def instances_needed(peak_rps: float, knee_rps: float | None, headroom: float) -> int | None:
    """Instances to serve `peak_rps` with each held to (1 - headroom) of its knee; None without a knee."""
    if not knee_rps:
        return None
    return math.ceil(peak_rps / (knee_rps * (1 - headroom)) - 1e-9)  # 5.0000000001 instances is 5, not 6


def which_knee(rec: dict) -> dict:
    """The knee a figure comes from: rung, experiment, bracket."""
    k = rec.get("knee") or {}
    return {"rung": f"{rec.get('index')} {rec.get('name')}", "exp": rec.get("exp"), "knee_rps": k.get("knee_rps"),
            "first_fail_rps": k.get("first_fail_rps"), "status": k.get("status")}


def knee_plan(rec: dict | None, peak_rps: float, headroom: float, price_per_gpu_hour: float, on_gpu: bool) -> dict:
    """Instances, GPUs and cost per 1 M output tokens for one rung's knee, each as [bound, planned]."""
    if rec is None or rec.get("status") != "ok":
        return {"knee": which_knee(rec or {}), "plan": NO_PLAN, "why": "the rung was not measured"}
    knee = rec.get("knee") or {}
    k, ff = knee.get("knee_rps"), knee.get("first_fail_rps")
    out = {"knee": which_knee(rec)}
    if knee.get("status") == "n/a":
        return {**out, "plan": NO_PLAN, "why": stats.not_measured(knee)}
    if k is None:
        return {**out, "plan": NO_PLAN, "why": "no knee: " + (
            "no rate passed on evidence (its lowest probed rate was left inconclusive)"
            if knee.get("status") == "open" else
            "the SLO was met at no probed rate")}
    gpus = gpus_per_instance(rec.get("knobs") or {}) if on_gpu else None
    n = instances_needed(peak_rps, k, headroom)
    # The true knee is below the first failing rate, so at least this many; none known when the SLO held
    # at the top of the probed range (then n is an upper bound only).
    n_lo = instances_needed(peak_rps, ff, headroom) if ff else None
    out.update(plan="ok", instances=n, instances_range=[n_lo, n], gpus_per_instance=gpus,
               gpus=n * gpus if gpus else None,
               gpus_range=[n_lo * gpus if gpus and n_lo else None, n * gpus] if gpus else None)
    tps = knee.get("output_tps_at_knee")
    if price_per_gpu_hour and tps:
        # cost at the knee: the instance's price per hour over the output tokens it made per hour at the knee;
        # tokens per request are fixed (ignore_eos), so at the bracket's top the tokens scale with the rate
        usd = price_per_gpu_hour * (gpus or 1) / (tps * 3600) * 1e6
        out.update(usd_per_m_output_tokens=round(usd, 4),
                   usd_per_m_output_tokens_range=[round(usd * k / ff, 4) if ff else None, round(usd, 4)],
                   output_tps_at_knee=tps)
    else:
        out.update(usd_per_m_output_tokens=None,
                   why_no_cost="no price (cost.gpu_price_per_hour is 0)" if not price_per_gpu_hour
                   else "no output tok/s recorded at the knee")
    return out


def plan(rungs: list[dict], final_exp: str | None, settings: dict, price_per_gpu_hour: float, on_gpu: bool,
         confirm_runs: list[dict] = ()) -> dict:
    """Before (rung 0) and after (the final kept stack): fleets for the peak, cost at the knee, GPUs saved. A final
    stack kept on tok/s whose knee search stopped at its verdict (no pass of its own) is planned on its confirm
    pair's knee, measured to its bracket."""
    peak, headroom = float(settings["peak_rps"]), float(settings["headroom"])
    base = next((r for r in rungs if r.get("role") == "baseline"), None)
    final = next((r for r in rungs if final_exp and r.get("exp") == final_exp), None)
    if final is not None and (final.get("knee") or {}).get("knee_rps") is None:
        final = next((r for r in reversed(confirm_runs) if r.get("of") == final_exp and r.get("status") == "ok"
                      and (r.get("knee") or {}).get("knee_rps") is not None), final)
    before, after = (knee_plan(r, peak, headroom, price_per_gpu_hour, on_gpu) for r in (base, final))
    unit = "gpus" if on_gpu else "instances"
    out = {"peak_rps": peak, "headroom": headroom, "price_per_gpu_hour": price_per_gpu_hour,
           "unit": "GPU" if on_gpu else "instance (CPU machine)", "before": before, "after": after,
           "method": "instances = ceil(peak / (knee x (1 - headroom))), planned on the knee (last passing rate); "
                     "the range uses the first failing rate, below which the true knee lies. Cost per 1 M output "
                     "tokens = price per GPU-hour x GPUs per instance / output tokens per hour at the knee."}
    machines = {(r.get("measured") or {}).get("machine") for r in (base, final) if r} - {None}
    if len(machines) > 1:  # no Δ across machines: the confirm step measures both on one
        out["saved"] = {"plan": NO_PLAN, "why": "rung 0 and the final stack were measured on two machines (the "
                        "ladder moved); the confirm step compares them on one"}
        return out
    if before["plan"] == NO_PLAN or after["plan"] == NO_PLAN:
        out["saved"] = {"plan": NO_PLAN, "why": "a knee is missing: " + "; ".join(
            f"{side} ({p['knee']['rung']}): {p['why']}" for side, p in (("before", before), ("after", after))
            if p["plan"] == NO_PLAN)}
        return out
    (b_lo, b), (a_lo, a) = before[f"{unit}_range"], after[f"{unit}_range"]
    out["saved"] = {"plan": "ok", "unit": unit, "saved": b - a,
                    "saved_range": [b_lo - a if b_lo is not None else None, b - a_lo if a_lo is not None else None]}
    return out


def annotate(lad: dict, settings: dict | None) -> dict:
    """Fill GPUs per instance and per-GPU figures into every rung, and the capacity plan into the record
    (None settings: no plan). The ladder driver calls this on every save; old records get it in a copy via
    scripts/fill_capacity.py."""
    on_gpu = (lad.get("environment") or {}).get("device") == "gpu"
    for r in lad["rungs"]:
        if r.get("knobs") is not None or r.get("change"):
            g = gpus_per_instance({**(r.get("knobs") or {}), **(r.get("change") or {})})
            r["gpus"] = g if on_gpu else None
            if r.get("status") == "ok":
                r["per_gpu"] = per_gpu(r, g) if on_gpu else None
    if settings:
        price = float(((lad.get("settings") or {}).get("cost") or {}).get("gpu_price_per_hour") or 0)
        lad["capacity"] = plan(lad["rungs"], lad.get("final_exp"), settings, price, on_gpu,
                               (lad.get("confirm") or {}).get("runs") or [])
    return lad
