"""Deciding keep / revert (pure): one place for the rule, the candidate ranking and the verdict each rung gets.

The driver (ladder.py) records what `decide` returns; the report prints it and never re-derives it.
"""
from __future__ import annotations

from judgement import capacity, stats
from records.ladder import RungRecord

# The verdicts a rung record can carry (records.ladder.RungRecord.verdict); the report prints them as they are.
BASELINE, KEPT, REVERTED, NOT_CHOSEN, FAILED, INTERRUPTED, SKIPPED, CONFIRM, RECHECK = (
    "baseline", "kept", "reverted", "not chosen", "failed", "interrupted", "skipped", "confirm", "re-measure")
KNEE_RECHECK = "knee re-check"  # a fresh server of a base or a rung, one visit at the rate its knee verdict was read at
RE_MEASURES = (RECHECK, KNEE_RECHECK)  # rows that measure a config again: never rungs, whatever became of them


_TPS = ("output tok/s is better with a {level} interval that excludes zero (the engine is the unit: the rung's fresh "
        "engine against the mean of its base's engines measured just before it and again just after it, with the "
        "start-to-start SD that make benchmark measured on the card, pooled with the ladder's own re-measures and "
        f"taken at the upper end of its {stats.FLOOR_LEVEL:.0%} interval)")
_KNEE = ("its knee (req/s at the SLO) is better: it passed on evidence at a rate where the last kept rung's failed on "
         "evidence (its search probes that rate first, on the same arrival traces), beyond knee.noise_floor")
# The confirm step (rung 0 and the final kept stack measured again, ladder.Driver.confirm_step) is judged as a rung
# against its base (gain), each engine and each server a unit (record.confirm_summary); a stack whose confirm shows no
# gain is named, not reported as a gain, and told apart from a confirm step too weak to tell (its power).
CONFIRMED, NOT_REPRODUCED, COULD_NOT_TELL = "reproduced", "did not reproduce", "could not tell"
CONFIRM_WORDS = ("The confirm step measures rung 0 and the final kept stack again, confirm.pairs pairs of fresh "
                 "engines and fresh servers, interleaved (stock then final, then final then stock: a machine drifting "
                 "linearly cancels), and judges them by the same rule, the final stack as the rung and rung 0 as its "
                 "base, each engine and each server a unit: output tok/s over the engines, the knee over the servers "
                 "(each server's bracket midpoint, their SD the servers' spread measured on the card pooled with the "
                 "step's own). Where the final stack comes out better, the kept gains reproduced; where its intervals "
                 "exclude the gains the kept rungs rested on, the report and its headline say the kept gains did not "
                 "reproduce and name the rungs they rested on; anything else, that the confirm step could not tell, "
                 "with its power for a ×" + f"{stats.CONFIRM_STACK:g}" + " stack")
# The headline's words for a confirm step that did not confirm (report.not_reproduced).
NOT_REPRODUCED_WORDS = "the kept gains did not reproduce"
COULD_NOT_TELL_WORDS = "the confirm step could not tell (power {power} for a ×{stack:g} stack)"
REPRODUCED_WORDS = "the kept gains reproduced (the confirm step's power {power} for a ×{stack:g} stack)"


def rule(objective: str, pairs: int = stats.KNEE_BETTER_ROUNDS) -> str:
    """The decision rule in words, as the ladder prints it and the report states it: a better knee re-checked on
    `pairs` pairs of fresh servers (the profile's knee.better_pairs)."""
    again = stats.knee_again_words(pairs)
    if objective == "knee_rps":
        words = ("a rung is kept only when it is significantly better than the last kept rung: " + _KNEE + ", or its "
                 "knee is not worse (it did not fail on evidence where the base passed) and " + _TPS + ". Anything "
                 "else is reverted (no measurable gain: the simpler config stays); a lost knee is worse; " + again)
    else:
        words = ("a rung is kept only when " + _TPS + " and the knee is not worse (it did not fail on evidence at a "
                 "rate where the last kept rung's passed, beyond knee.noise_floor; a lost knee is worse). Anything "
                 "else is reverted (no measurable gain: the simpler config stays); " + again)
    return (words + ". " + stats.BUDGET_WORDS + ". The quality gate and 'did the change take effect' come first; "
            "candidates of one rung are ranked against each other by the same rule. An instance with more GPUs is "
            "compared per GPU (knee and tok/s divided by its GPUs). " + CONFIRM_WORDS + ".").format(
                level=f"{stats.CONFIDENCE:.1%}")


RULE, RULE_TPS = rule("knee_rps"), rule("output_tps")


def _says(d: dict, name: str) -> str:
    if d.get("rel") is None:
        return f"{name} {d['verdict']}{' (' + d['why'] + ')' if d.get('why') else ''}"
    return f"{name} {d['rel'] * 100:+.1f} % ({d['verdict']}{', ' + d['why'] if d.get('why') else ''})"


def gain(d_knee: dict, d_tps: dict, objective: str) -> tuple[bool, str]:
    """The performance half of the rule, on two deltas (vs the last kept rung, or candidate vs candidate)."""
    knee, tps = _says(d_knee, "knee"), _says(d_tps, "output tok/s")
    if d_knee["verdict"] == "worse":
        return False, f"{knee}; {tps}"
    if objective == "knee_rps" and d_knee["verdict"] == "better":
        return True, f"{knee}; {tps}"
    if d_tps["verdict"] == "better":
        why = "the knee not better on evidence" if d_knee["verdict"] != "better" else "the knee is better too"
        return True, f"{tps} ({why}); {knee}"
    return False, f"no measurable gain: {knee}; {tps}; the simpler config stays"


def reproduced(d: dict, objective: str, kept_gain: dict | None = None) -> tuple[str, str]:
    """The confirm step's verdict on its deltas (the final stack vs rung 0, record.confirm_summary), and why:
    CONFIRMED where the final stack is better by the rule (gain, as a rung against its base); NOT_REPRODUCED where, on
    every measure the kept gains rested on (`kept_gain`: {output_tps or knee_rps: the relative gain the kept rungs
    read on it}; none given: no gain on either), the confirm's interval lies below that gain; else COULD_NOT_TELL:
    CONFIRM_WORDS."""
    better, why = gain(d["knee_rps"], d["output_tps"], objective)
    if better:
        return CONFIRMED, why
    why = why.removesuffix("; the simpler config stays")  # a rung's words: the confirm step reverts nothing
    gains = kept_gain or {"output_tps": 0.0, "knee_rps": 0.0}
    names = {"output_tps": "output tok/s", "knee_rps": "knee"}
    below = [f"its {names[m]} interval [{d[m]['ci'][0] * 100:+.1f}, {d[m]['ci'][1] * 100:+.1f}] % lies below the "
             f"{g * 100:+.1f} % the kept rungs read" for m, g in gains.items()
             if (d.get(m) or {}).get("ci") and d[m]["ci"][1] < g]
    if len(below) == len(gains):
        return NOT_REPRODUCED, f"{why}; " + "; ".join(below)
    return COULD_NOT_TELL, why


def _with_power(words: str, conf: dict) -> str:
    """`words` with the confirm step's power for a ×stats.CONFIRM_STACK stack filled in."""
    power = conf.get("power")
    return words.format(power="n/a" if power is None else f"{power * 100:.0f} %", stack=stats.CONFIRM_STACK)


def confirm_words(conf: dict) -> str | None:
    """What the headline says of a confirm step that did not confirm the kept gains (record.confirm_summary's
    `verdict` and `power`); None where it did, or where none judged them."""
    if conf.get("verdict") == NOT_REPRODUCED:
        return NOT_REPRODUCED_WORDS
    if conf.get("verdict") == COULD_NOT_TELL:
        return _with_power(COULD_NOT_TELL_WORDS, conf)
    return None


def reproduced_words(conf: dict) -> str | None:
    """What the headline says of a confirm step that confirmed the kept gains, with its power; None otherwise."""
    return _with_power(REPRODUCED_WORDS, conf) if conf.get("verdict") == CONFIRMED else None


def rested_on(rec: dict, objective: str) -> str:
    """What a kept rung's keep rested on, in a word or two: its knee or its output tok/s."""
    return "output tok/s" if rests_on_tps(rec, objective) else "its knee"


def reverted_before_speed(rec: dict) -> str | None:
    """Why a rung is reverted whatever its speed (it failed, its gate failed, its change did not take effect), or
    None: its performance decides."""
    if rec["status"] == FAILED:  # the pre-flight built its engine config with vLLM's own code: what failed needs one
        return (f"failed: {rec.get('error', 'no reason recorded')} (the pre-flight, vLLM's own config checks, "
                "passed it: this is what only a started engine can find, such as the memory its profile run measures)")
    if rec["status"] != "ok":
        return f"{rec['status']}: {rec.get('error', 'no reason recorded')}"
    gate = rec.get("gate") or {}
    if gate.get("gated") and not gate.get("keep"):
        return "quality gate failed: " + "; ".join(gate.get("reasons", []))
    not_applied = [c["knob"] for c in rec.get("applied") or [] if c["applied"] is False]
    if not_applied:
        return f"not applied: the engine did not run with {', '.join(not_applied)} as asked; not credited"
    return None


def decide(rec: dict, base: dict, objective: str) -> tuple[bool, str]:
    """Keep or revert a finished rung against the last kept one: quality gate first, then 'did the change take
    effect', then the performance rule (`RULE`), judged by intervals and knee brackets, never by point values."""
    early = reverted_before_speed(rec)
    if early:
        return False, early
    gate = rec.get("gate") or {}
    quality = "quality gate passed" if gate.get("gated") else "not gated (no quality measured)"
    keep, why = gain(rec["delta"]["knee_rps"], rec["delta"]["output_tps"], objective)
    if keep and rests_on_tps(rec, objective) and rec["delta"].get(AGAIN) is False:
        gained = f"output tok/s {rec['delta']['output_tps']['rel'] * 100:+.1f} %"
        return False, (f"{quality}; reverted: not confirmed: {gained}, but its base could not be measured again right "
                       "after it; the simpler config stays")
    return keep, f"{quality}; {'better' if keep else 'reverted'}: {why}"


# rec["delta"][AGAIN]: whether the rung's base was measured again right after it (ladder.Driver.remeasure): True, its
# tok/s Δ is against the base's engines on both sides; False, that re-measure failed. A rung gets one before it is
# decided unless its speed cannot keep it (needs_again).
AGAIN = "base_again"


def rests_on_tps(rec: dict, objective: str) -> bool:
    """Whether a rung's keep rests on its output tok/s (not on a knee that moved by more than its noise)."""
    return not (objective == "knee_rps" and rec["delta"]["knee_rps"]["verdict"] == "better")


def needs_again(rec: dict, objective: str) -> bool:
    """Whether a measured rung waits for its base to be measured again right after it: unless it is reverted
    whatever its speed, decided by its knee (worse; better under the knee objective), or its tok/s against the base
    before it cannot become a gain (stats.may_gain: no faster, significantly worse, or a re-measure would call it better
    with a chance under stats.AGAIN_ODDS). Only a gain needs both sides."""
    d = rec.get("delta") or {}
    if (reverted_before_speed(rec) or AGAIN in d or (rec.get("bench") or {}).get("status", "ok") != "ok"
            or not d.get("output_tps") or not d.get("knee_rps")):
        return False
    if d["knee_rps"]["verdict"] == "worse" or not rests_on_tps(rec, objective):
        return False
    return stats.may_gain(d["output_tps"])


def needs_knee_again(rec: dict, objective: str) -> bool:
    """Whether a measured rung's knee verdict waits for a re-check on fresh servers (stats.knee_recheck): it read
    better (where that can keep it: the knee objective) or worse, on one server a side, and nothing reverts it first."""
    d = (rec.get("delta") or {}).get("knee_rps") or {}
    if reverted_before_speed(rec) or "first" in d or d.get("verdict") not in ("better", "worse"):
        return False
    return d["verdict"] == "worse" or objective == "knee_rps"


def verdict(rec: dict) -> str:
    """The verdict of a decided record: what the report prints in its `kept?` column."""
    if rec.get("role") in RE_MEASURES:  # never a rung, whatever became of it: its decision says
        return rec["role"]
    if rec["status"] in (FAILED, INTERRUPTED, SKIPPED):
        return rec["status"]
    if rec.get("role") == BASELINE:
        return BASELINE
    return KEPT if rec.get("kept") else REVERTED


def change_cell(r: RungRecord) -> str:
    """What a row changed vs its base (a base's re-measure changes nothing: it says what it re-measures)."""
    return ", ".join(f"{k}={v}" for k, v in (r.change or {}).items()) or (
        f"none: re-measures {r.base}" if r.role == RECHECK else
        f"none: {r.of} on a fresh server" if r.role == KNEE_RECHECK else "stock")


def judged_knee(rung: dict, gpus: int = 1) -> dict:
    """A rung's knee as stats.knee_delta and verdict_rate judge it: per GPU (capacity.per_gpu_knee), with the
    knee.noise_floor the rung holds beside its knee record (a new dict: the record is left as the stage wrote it)."""
    return {**capacity.per_gpu_knee(rung.get("knee") or {}, gpus), "noise_floor": rung.get("knee_noise_floor")}


def beats(a: dict, b: dict, objective: str, floor) -> tuple[bool, str]:
    """Candidate a vs candidate b, in like units (per GPU) and by the same rule as a rung vs its base."""
    ga, gb = (capacity.gpus_per_instance(r.get("knobs") or {}) for r in (a, b))
    return gain(stats.knee_delta(judged_knee(b, gb), judged_knee(a, ga)),
                stats.delta(capacity.per_gpu_runs(b["bench"].get("output_tps_runs"), gb),
                            capacity.per_gpu_runs(a["bench"].get("output_tps_runs"), ga), floor), objective)


def choose(recs: list[dict], objective: str, floor) -> dict | None:
    """Candidates of one knob: of those that would be kept, the one no other beats by the rule (ties: the first
    listed stays); the others are marked "not chosen". Returns the chosen record, or None."""
    good = [r for r in recs if r.get("kept")]
    if len(recs) == 1 or not good:
        return good[0] if good else None
    best, why = good[0], "no other candidate beat it"
    for r in good[1:]:
        better, how = beats(r, best, objective, floor)
        if better:
            best, why = r, how
    for r in good:
        if r is not best:
            r["kept"], r["verdict"] = False, NOT_CHOSEN
            r["decision"] += f"; not chosen: {best['name']} is kept instead"
    best["decision"] += f"; chosen among {len(recs)} candidates ({why})"
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
            rate, shared = facts.get("prefix_cache_hit_rate"), facts.get("workload_shared_prefix_len") or 0
            if ok and want is True and shared:  # the workload shares a prefix: caching that never hits did nothing
                ok = None if rate is None else rate > 0
            seen = (f"enable_prefix_caching={got}, hit rate {'n/a' if rate is None else f'{rate:.1%}'}"
                    + (f" on a {shared}-token shared prefix" if shared else
                       " (a workload with no declared shared prefix)"))
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
            got, target = cache.get("gpu_memory_utilization"), facts.get("target")
            real = target["fraction"] if target and target["gpu_memory_utilization"] == want else want
            ok = None if got is None else abs(float(got) - real) < 1e-9
            of = f" ({want:g} of the {target['name']}'s memory)" if target else ""
            seen = f"gpu_memory_utilization={got}{of}, {facts.get('kv_cache_tokens')} KV tokens"
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


# The target card's memory budget (params `target`), checked on every rung against what the engine logged. Where
# vLLM 0.26's worker logs its own accounting (the budget it asked for, weights, activation peak, non-torch memory,
# CUDA graphs, KV cache), the engine must have asked for the target's budget (within TARGET_OVER: the conversion
# rounds down and reads nvidia-smi's total, a little above CUDA's) and all it used must fit the target card. Where
# only the weights, the CUDA graph estimate and the KV cache are logged, the check is what those can verify: what
# was logged fits the budget (within TARGET_OVER: the logs round to 0.01 GiB) and the unlogged rest is at most
# TARGET_REST of the budget (a 7B's activation peak at 8k batched tokens is 1-3 GiB of a 4090's ~21). An engine
# that ignored the target would log the whole real card (six 4090s on an H200); one handed too small a fraction,
# a KV cache near zero: both fail.
TARGET_OVER, TARGET_REST = 0.02, 0.20


def ran_ok(ran, t: dict) -> bool:
    """The engine ran the converted fraction (or did not say)."""
    return ran is None or abs(float(ran) - t["fraction"]) < 1e-6


def target_check(target: dict | None, facts: dict, kv_bytes_per_token: float | None = None) -> dict | None:
    """Did the engine run inside the target card's memory? An applied_check entry (knob `target`), or None
    without a target. `kv_bytes_per_token` (per GPU): the KV tokens the logged KV memory holds, shown beside
    the tokens the engine logged."""
    if not target:
        return None
    budget, t = target["budget_gib"], target
    requested = (f"{t['name']}: {t['gpu_memory_utilization']:g} x {t['memory_gib']:g} GiB = {budget:g} GiB = "
                 f"gpu_memory_utilization {t['fraction']:g} of {t['real_gpu']} ({t['real_total_gib']:g} GiB)")
    cache, received = facts.get("cache_config") or {}, facts.get("received") or {}
    ran = cache.get("gpu_memory_utilization", received.get("gpu_memory_utilization"))
    weights, graphs, kv = (facts.get(k) for k in ("weights_gib", "cudagraph_gib", "kv_cache_gib"))
    if weights is None or kv is None:
        return {"knob": "target", "requested": requested, "applied": None,
                "observed": f"the engine logged no weights or KV cache memory; ran gpu_memory_utilization={ran}"}
    tokens = facts.get("kv_cache_tokens")
    held = (f" ({tokens:,} KV tokens logged, {kv * 2**30 / kv_bytes_per_token:,.0f} expected from {kv:g} GiB)"
            if tokens and kv_bytes_per_token else f" ({tokens:,} KV tokens)" if tokens else "")
    if facts.get("requested_gib") is not None:  # vLLM's own accounting (0.26's worker summary): nothing left out
        asked, parts = facts["requested_gib"], [("weights", weights), ("activation peak", facts["activation_gib"]),
                                                ("non-torch", facts["non_torch_gib"]), ("CUDA graphs", graphs or 0),
                                                ("KV cache", kv)]
        used = sum(v for _, v in parts)
        ok = ran_ok(ran, t) and abs(asked - budget) <= TARGET_OVER * budget and used <= t["memory_gib"]
        seen = (f"vLLM's budget {asked:g} GiB (the target's {budget:.2f}); it used "
                + " + ".join(f"{n} {v:g}" for n, v in parts) + f" GiB{held} = {used:.2f} GiB of the "
                f"{t['name']}'s {t['memory_gib']:g} GiB (vLLM sizes the KV cache before capturing CUDA graphs, "
                f"as it would on the {t['name']}); ran gpu_memory_utilization={ran}")
        return {"knob": "target", "requested": requested, "observed": seen, "applied": ok}
    logged = weights + (graphs or 0) + kv
    rest = budget - logged
    ok = ran_ok(ran, t) and logged <= budget * (1 + TARGET_OVER) and rest <= TARGET_REST * budget
    seen = (f"weights {weights:g} + CUDA graphs {graphs or 0:g} + KV cache {kv:g} GiB{held} = {logged:.2f} of "
            f"{budget:.2f} GiB, {rest:.2f} GiB left for activations and non-torch memory (allowed: "
            f"{-TARGET_OVER * budget:.2f} to {TARGET_REST * budget:.2f}); ran gpu_memory_utilization={ran}")
    return {"knob": "target", "requested": requested, "observed": seen, "applied": ok}
