"""The ladder record (report/ladder.json): its declared shape, and how a finished rung's record is filled
from the stages' own result files (each stage's summary copied whole, its provenance left in results/).

The report stage reads nothing else: every number, method string and verdict it prints is in this record.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import TypedDict

import common
import decide
import stats


class RungRecord(TypedDict, total=False):
    index: int
    name: str
    exp: str | None          # the DVC experiment (`dvc exp show`), None when the rung did not run
    role: str                # baseline | rung | candidate | fallback
    change: dict             # the one knob (or declared group) it changes vs `base`
    note: str
    base: str | None         # the experiment it is compared with: the last kept rung
    knobs: dict              # every knob in force, flattened
    status: str              # running | ok | failed | interrupted | skipped
    error: str
    log: str
    seconds: float           # wall time of its `dvc exp run`
    reused: list[str]        # stages DVC restored instead of measuring again
    measured: dict           # when and on which machine (host id, GPU UUIDs) its bench was measured
    model: str
    eval: dict               # results/eval.json, whole
    gate: dict               # results/gate.json, whole
    bench: dict              # results/bench.json, whole
    knee: dict               # results/knee.json, whole
    stage_seconds: dict
    applied: list[dict]      # decide.applied_check
    roofline: dict | None
    delta: dict              # output_tps: stats.delta, knee_rps: stats.knee_delta, vs `base`
    speedup: float
    kept: bool
    verdict: str             # decide.verdict: baseline | kept | reverted | not chosen | failed | interrupted | skipped
    decision: str            # why, in words


class LadderRecord(TypedDict, total=False):
    profile: str
    started: str
    finished: str | None
    complete: bool
    environment: dict        # results/fingerprint.json
    git_commit: str | None
    models: dict
    slo: dict
    objective: str
    rule: str                # decide.rule: the keep/revert rule in words
    settings: dict           # the bench, knee, eval, gate and cost params the ladder ran with
    eval_file: str
    eval_sha256: str
    eval_n: int
    final_exp: str | None
    rungs: list[RungRecord]
    engine_seconds: float
    wall_seconds: float
    cost_usd: float


def _summary(path: Path) -> dict:
    """A stage's result file, whole but for its provenance (the ladder record states that once)."""
    return {k: v for k, v in common.read_json(path).items() if k != "provenance"}


def fill(rec: RungRecord, base: RungRecord | None, baseline: RungRecord | None, params: dict) -> dict:
    """Fill a rung that ran to the end from results/; returns the download manifest's models."""
    res = common.RESULTS
    ev, bench, knee, gate = (_summary(res / f) for f in ("eval.json", "bench.json", "knee.json", "gate.json"))
    prov = common.read_json(res / "bench.json").get("provenance") or {}
    env = prov.get("environment") or {}
    rec["measured"] = {"at": prov.get("measured_at"), "host_id": env.get("host_id"),
                       "gpu_uuids": [g.get("uuid") for g in env.get("gpus") or []]}
    models = common.read_json(res / "models.json")["models"]
    rec.update(status="ok", model=ev.get("model"), eval=ev, gate=gate, bench=bench, knee=knee,
               stage_seconds={"eval": ev.get("wall_s") or 0, "bench": bench.get("wall_s") or 0,
                              "knee": knee.get("wall_s") or 0})  # knee includes the server start
    if rec["role"] == decide.BASELINE:  # rung 0 also measured the gate's reference eval
        rec["stage_seconds"]["eval_baseline"] = common.read_json(res / "baseline" / "eval.json").get("wall_s") or 0
    facts = {**(bench.get("engine") or {}), **(knee.get("applied") or {})}
    rec["applied"] = decide.applied_check(rec["change"], facts, models) if rec["change"] else []
    rec["roofline"] = roofline(params, rec, models)
    rec["delta"] = {"output_tps": stats.delta(base["bench"]["output_tps_runs"], bench["output_tps_runs"],
                                              noise_floor(base, rec)) if base else None,
                    "knee_rps": stats.knee_delta(base["knee"], knee) if base else None}
    ref = baseline or rec
    if ref["bench"].get("output_tps"):
        rec["speedup"] = bench["output_tps"] / ref["bench"]["output_tps"]
    return {n: {k: m.get(k) for k in ("id", "revision", "sha256", "path")} for n, m in models.items()}


def noise_floor(a: RungRecord, b: RungRecord) -> float:
    """The start-to-start floor two rungs' throughputs are compared with: the larger one they were measured under."""
    return max(a["bench"].get("noise_floor") or 0.0, b["bench"].get("noise_floor") or 0.0)


def roofline(params: dict, rec: RungRecord, models: dict) -> dict | None:
    """Batch-1 decode floor from the model's shapes and the GPU's bandwidth, vs the TPOT at the lowest probed rate."""
    fp = common.read_json(common.RESULTS / "fingerprint.json")
    gpu = (fp.get("gpus") or [{}])[0].get("name")
    bw = stats.bandwidth_gbs(gpu, params["roofline"]["bandwidth_gbs"])
    path = (models.get(rec.get("model")) or {}).get("path")
    if not bw or not path or not Path(path, "config.json").exists():
        return None
    cfg = json.loads(Path(path, "config.json").read_text())
    bits = stats.weight_bits(cfg.get("quantization_config"))
    kv = 1 if str(rec["knobs"].get("engine.kv_cache_dtype", "auto")).startswith("fp8") else 2
    shape = (rec.get("knee") or {}).get("shape") or {}
    context = (shape.get("input_len") or 0) + (shape.get("output_len") or 0) // 2  # mean context while decoding
    floor = stats.tpot_floor_ms(cfg, bw, weight_bits=bits, kv_bytes=kv, context_tokens=context)
    rows = sorted((rec.get("knee") or {}).get("rows") or [], key=lambda r: r["offered_rps"])
    low = rows[0]["p50_tpot_ms"] if rows else None
    return {"gpu": gpu, "bandwidth_gbs": bw, "weight_bits": round(bits, 3), "context_tokens": context,
            "tpot_floor_ms": round(floor, 2),
            "tpot_low_load_ms": low, "pct_of_floor": round(floor / low, 3) if low else None}
