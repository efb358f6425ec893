"""Stage `gate`: is this rung's quality still acceptable against rung 0 (the baseline)?

Pass/fail, not a column, and a fail needs evidence. Rung 0's eval measured its own noise: the baseline run twice
in one engine, the second time in reverse order (other batches, other numerics), and the items whose correctness
differed are the nondeterminism floor. Per category (and overall), the right→wrong flips beyond that floor make the
drop the gate judges: the rung fails when it exceeds gate.max_category_drop (overall: gate.max_overall_drop) and an
exact McNemar test on those flips says "regressed" (p < gate.alpha). Beside each category: how many one-way flips
the gate needs to call a regression there (stats.detectable_flips), as a drop; a category whose threshold drop is
smaller than that, within its floor or beyond its n, is "cannot judge" (it still fails on a larger, significant drop).
Dummy-weight rungs have no quality: "not gated", and no accuracy is printed for them.
"""
from __future__ import annotations

import json
from pathlib import Path

import common
from judgement import stats
from records.eval import EvalResult
from records.gate import GateResult


def read_items(path) -> dict:
    with open(path, encoding="utf-8") as f:
        return {it["id"]: it for it in map(json.loads, filter(str.strip, f))}


def fails(v: dict, threshold: float) -> bool:
    """A block's drop fails the gate: beyond noise past `threshold`, and McNemar says regressed."""
    return v["drop_beyond_noise"] > threshold and v["evidence"] == "regressed"


def drop_lines(overall: dict, by_cat: dict, g: dict) -> tuple[list[str], list[str]]:
    """Each drop beyond noise past its threshold, in words: (reasons, with evidence; notes, "not failed, no
    evidence")."""
    reasons, notes = [], []
    for name, v, key in ([("overall accuracy", overall, "max_overall_drop")]
                         + [(f"category {c}", v, "max_category_drop") for c, v in by_cat.items()]):
        if v["drop_beyond_noise"] <= g[key]:
            continue
        text = (f"{name} fell {v['baseline']:.3f} → {v['rung']:.3f} ({v['right_to_wrong']} right→wrong, "
                f"{min(v['noise_flips'], v['right_to_wrong'])} of them within the floor, "
                f"{v['wrong_to_right']} wrong→right: "
                f"−{v['drop_beyond_noise']:.3f} beyond noise > gate.{key} {g[key]}); "
                f"McNemar: {v['evidence']} (p={v['p_value']})")
        if fails(v, g[key]):
            reasons.append(text)
        else:
            notes.append(f"not failed, no evidence: {text}")
    return reasons, notes


def compare(base: dict, cur: dict, g: dict, floor: dict | None = None) -> dict:
    """base/cur: {id: {"category", "correct"}}; floor: {category: flips between two evals of the baseline}
    (None: not measured, taken as 0). The verdict, reasons, flips and per-category power; pure, for tests."""
    missing = sorted(set(base) ^ set(cur))
    if missing:
        raise ValueError(f"baseline and rung were scored on different items: {', '.join(missing[:5])}")
    floor = floor or {}
    r2w = sorted(i for i in base if base[i]["correct"] and not cur[i]["correct"])
    w2r = sorted(i for i in base if not base[i]["correct"] and cur[i]["correct"])

    def block(ids, noise, threshold):
        n = len(ids)
        b_acc = sum(base[i]["correct"] for i in ids) / n
        c_acc = sum(cur[i]["correct"] for i in ids) / n
        b, c = sum(i in r2w for i in ids), sum(i in w2r for i in ids)
        beyond = max(0, b - noise)  # right→wrong flips beyond what the baseline does against itself
        verdict, p = stats.paired_verdict(n, beyond, c, g["alpha"], g["min_items"])
        k = stats.detectable_flips(n, g["alpha"], noise)
        detectable = None if k is None else round(k / n, 6)
        return {"n": n, "baseline": b_acc, "rung": c_acc, "drop": round(b_acc - c_acc, 6),
                "right_to_wrong": b, "wrong_to_right": c, "noise_flips": noise,
                "drop_beyond_noise": round((beyond - c) / n, 6), "p_value": float(f"{p:.3g}"), "evidence": verdict,
                "detectable_flips": k, "detectable_drop": detectable,
                "can_detect_threshold": detectable is not None and detectable <= threshold,
                "flipped": {"right_to_wrong": [i for i in ids if i in r2w],
                            "wrong_to_right": [i for i in ids if i in w2r]}}

    cats = sorted({it["category"] for it in base.values()})
    by_cat = {c: block([i for i in base if base[i]["category"] == c], int(floor.get(c, 0)), g["max_category_drop"])
              for c in cats}
    overall = block(list(base), sum(v["noise_flips"] for v in by_cat.values()), g["max_overall_drop"])
    overall.pop("flipped")  # the top-level `flipped` holds them all

    reasons, notes = drop_lines(overall, by_cat, g)
    blind = [c for c, v in by_cat.items() if not v["can_detect_threshold"]]
    notes += [f"cannot judge category {c} at gate.max_category_drop {g['max_category_drop']}: the gate needs "
              + (f"{by_cat[c]['detectable_flips']} of {by_cat[c]['n']} items to flip (a drop of "
                 f"{by_cat[c]['detectable_drop']:.2f}, its floor {by_cat[c]['noise_flips']} included)"
                 if by_cat[c]["detectable_flips"] else f"more than its {by_cat[c]['n']} items to flip")
              for c in blind]
    return {"keep": not reasons, "gated": True, "verdict": "pass" if not reasons else "fail",
            "reasons": reasons or ["no drop beyond the gate's thresholds and noise, with evidence"] + notes,
            "overall": overall, "by_category": by_cat,
            "regressed_categories": [c for c, v in by_cat.items() if fails(v, g["max_category_drop"])],
            "cannot_judge": blind, "flipped": {"right_to_wrong": r2w, "wrong_to_right": w2r}}


def noise_floor(base: EvalResult) -> dict | None:
    """{category: flips} from the baseline's eval.json (eval.py's second pass); None where it was not measured."""
    nd = base.nondeterminism
    return None if nd is None else dict(nd.by_category)


def evaluate(base: EvalResult, cur: EvalResult, base_items, cur_items, g: dict) -> dict:
    """The gate for two eval.json results; *_items are callables that load the per-item files when needed."""
    floor = noise_floor(base)
    if base.status != "ok" or cur.status != "ok":
        why = cur.reason or base.reason or "no accuracy measured"
        result = {"keep": True, "gated": False, "verdict": "not gated", "reasons": [f"not gated: {why}"],
                  "overall": None, "by_category": {}, "regressed_categories": [], "cannot_judge": [], "flipped": {}}
    else:
        result = compare(base_items(), cur_items(), g, floor)
    noise = (f"{sum(floor.values())} item(s) whose correctness differed between two evals of rung 0 "
             f"({base.nondeterminism.method})" if floor is not None else "not measured (taken as 0)")
    method = (f"gate vs rung 0: a rung fails when overall accuracy falls more than {g['max_overall_drop']} or a "
              f"category more than {g['max_category_drop']}, counting only right→wrong flips beyond the "
              f"nondeterminism floor, and an exact McNemar test on those flips gives p < {g['alpha']}; "
              f"floor: {noise}; a category where a drop of {g['max_category_drop']} is not enough flips for "
              f"p < {g['alpha']} beyond its floor is reported 'cannot judge'")
    return {**result, "method": method, "thresholds": g, "noise_floor": floor,
            "baseline_model": base.model, "rung_model": cur.model}


def main(baseline: Path, rung: Path, out: Path):
    params = common.stage_start()
    result = evaluate(EvalResult.load_file(baseline / "eval.json"), EvalResult.load_file(rung / "eval.json"),
                      lambda: read_items(baseline / "eval_items.jsonl"),
                      lambda: read_items(rung / "eval_items.jsonl"),
                      params.gate.model_dump())  # a dict: recorded as the result's `thresholds`
    GateResult(**result).save_file(out)
    print(f"gate: {result['verdict']}: " + "; ".join(result["reasons"]))


if __name__ == "__main__":
    args = common.paths(__doc__.split("\n")[0], baseline="results/baseline", rung="results", gate="results/gate.json")
    common.run_stage(main, (common.ParamsError, ValueError, OSError), args.baseline, args.rung, args.gate)
