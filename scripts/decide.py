"""Deciding keep / revert (pure): one place for the rule, the candidate ranking and the verdict each rung gets.

The driver (ladder.py) records what `decide` returns; the report prints it and never re-derives it.
"""
from __future__ import annotations

# The verdicts a rung record can carry (record.RungRecord.verdict); the report prints them as they are.
BASELINE, KEPT, REVERTED, NOT_CHOSEN, FAILED, INTERRUPTED, SKIPPED = (
    "baseline", "kept", "reverted", "not chosen", "failed", "interrupted", "skipped")


def objective_value(rec: dict, objective: str):
    if objective == "knee_rps" and (rec.get("knee") or {}).get("knee_rps") is not None:
        return rec["knee"]["knee_rps"]
    return (rec.get("bench") or {}).get("output_tps")


def _says(d: dict, name: str) -> str:
    if d.get("rel") is None:
        return f"{name} {d['verdict']}"
    return f"{name} {d['rel'] * 100:+.1f} % ({d['verdict']}{', ' + d['why'] if d.get('why') else ''})"


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
    knee_first = objective == "knee_rps" and d_knee["verdict"] != "unknown"
    primary, secondary = (d_knee, d_tps) if knee_first else (d_tps, d_knee)
    pname, sname = ("knee", "output tok/s") if knee_first else ("output tok/s", "knee")
    quality = "quality gate passed" if gate.get("gated") else "not gated (no quality measured)"
    if primary["verdict"] == "worse":
        return False, f"{quality}, but {_says(primary, pname)}"
    if primary["verdict"] == "better":
        return True, f"{quality}; {_says(primary, pname)}; {_says(secondary, sname)}"
    if secondary["verdict"] == "worse":
        return False, f"{quality}; {_says(primary, pname)}, and {_says(secondary, sname)}"
    if secondary["verdict"] == "better":
        return True, f"{quality}; {_says(secondary, sname)}; {_says(primary, pname)}"
    return True, (f"{quality}; no significant change: {_says(primary, pname)}, {_says(secondary, sname)}; "
                  "kept because nothing measurably got worse")


def verdict(rec: dict) -> str:
    """The verdict of a decided record: what the report prints in its `kept?` column."""
    if rec["status"] in (FAILED, INTERRUPTED, SKIPPED):
        return rec["status"]
    if rec.get("role") == BASELINE:
        return BASELINE
    return KEPT if rec.get("kept") else REVERTED


def choose(recs: list[dict], objective: str) -> dict | None:
    """Candidates of one knob: the best on the objective among those that would be kept; the others are
    marked "not chosen" (or keep their own revert). Returns the chosen record, or None."""
    good = [r for r in recs if r.get("kept")]
    if len(recs) == 1:
        return good[0] if good else None
    best = max(good, key=lambda r: objective_value(r, objective) or 0, default=None)
    for r in good:
        if r is not best:
            r["kept"], r["verdict"] = False, NOT_CHOSEN
            r["decision"] += f"; not chosen: {best['name']} did better on {objective}"
    if best:
        best["decision"] += f"; chosen among {len(recs)} candidates by {objective}"
    return best


def applied_check(change: dict, facts: dict, models: dict) -> list[dict]:
    """Did each changed knob take effect? Evidence from the engine's own log and /metrics."""
    from pathlib import Path
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
