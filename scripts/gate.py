"""Stage `gate`: is this rung's quality still acceptable against rung 0 (the baseline)?

Pass/fail, not a column: the rung fails when overall accuracy falls more than gate.max_overall_drop or any
category falls more than gate.max_category_drop (a category collapse). Beside each drop, an exact McNemar
test on the items that flipped says "regressed", "improved" or "not enough evidence" (fewer than
gate.min_items items, or p >= gate.alpha), so a reader can tell a real regression from a few greedy flips.
Dummy-weight rungs have no quality: "not gated", and no accuracy is printed for them.
"""
from __future__ import annotations

import json
from pathlib import Path

import common
import stats


def read_items(path) -> dict:
    with open(path, encoding="utf-8") as f:
        return {it["id"]: it for it in map(json.loads, filter(str.strip, f))}


def compare(base: dict, cur: dict, g: dict) -> dict:
    """base/cur: {id: {"category", "correct"}}. The verdict, reasons and flips; pure, for tests."""
    missing = sorted(set(base) ^ set(cur))
    if missing:
        raise ValueError(f"baseline and rung were scored on different items: {', '.join(missing[:5])}")
    r2w = sorted(i for i in base if base[i]["correct"] and not cur[i]["correct"])
    w2r = sorted(i for i in base if not base[i]["correct"] and cur[i]["correct"])

    def block(ids):
        n = len(ids)
        b_acc = sum(base[i]["correct"] for i in ids) / n
        c_acc = sum(cur[i]["correct"] for i in ids) / n
        b, c = sum(i in r2w for i in ids), sum(i in w2r for i in ids)
        verdict, p = stats.paired_verdict(n, b, c, g["alpha"], g["min_items"])
        return {"n": n, "baseline": b_acc, "rung": c_acc, "drop": round(b_acc - c_acc, 6),
                "right_to_wrong": b, "wrong_to_right": c, "p_value": float(f"{p:.3g}"), "evidence": verdict}

    overall = block(list(base))
    cats = sorted({it["category"] for it in base.values()})
    by_cat = {c: block([i for i in base if base[i]["category"] == c]) for c in cats}
    reasons = []
    if overall["drop"] > g["max_overall_drop"]:
        reasons.append(f"overall accuracy fell {overall['baseline']:.3f} → {overall['rung']:.3f} "
                       f"(−{overall['drop']:.3f} > gate.max_overall_drop {g['max_overall_drop']}); "
                       f"McNemar: {overall['evidence']} (p={overall['p_value']})")
    for c, v in by_cat.items():
        if v["drop"] > g["max_category_drop"]:
            reasons.append(f"category {c} collapsed {v['baseline']:.2f} → {v['rung']:.2f} "
                           f"(−{v['drop']:.2f} > gate.max_category_drop {g['max_category_drop']}); "
                           f"McNemar: {v['evidence']} (p={v['p_value']}, {v['right_to_wrong']} right→wrong)")
    return {"keep": not reasons, "gated": True, "verdict": "pass" if not reasons else "fail",
            "reasons": reasons or ["no drop beyond the gate's thresholds"],
            "overall": overall, "by_category": by_cat,
            "regressed_categories": [c for c, v in by_cat.items() if v["drop"] > g["max_category_drop"]],
            "flipped": {"right_to_wrong": r2w, "wrong_to_right": w2r}}


def evaluate(base: dict, cur: dict, base_items, cur_items, g: dict) -> dict:
    """The gate for two eval.json results; *_items are callables that load the per-item files when needed."""
    if base.get("status") != "ok" or cur.get("status") != "ok":
        why = cur.get("reason") or base.get("reason") or "no accuracy measured"
        result = {"keep": True, "gated": False, "verdict": "not gated", "reasons": [f"not gated: {why}"],
                  "overall": None, "by_category": {}, "regressed_categories": [], "flipped": {}}
    else:
        result = compare(base_items(), cur_items(), g)
    method = (f"gate vs rung 0: overall drop ≤ {g['max_overall_drop']}, per-category drop ≤ {g['max_category_drop']}, "
              f"exact McNemar α={g['alpha']}")
    return {**result, "method": method, "thresholds": g, "baseline_model": base.get("model"),
            "rung_model": cur.get("model")}


def main(baseline: Path, rung: Path, out: Path):
    params = common.stage_start()
    result = evaluate(common.read_json(baseline / "eval.json"), common.read_json(rung / "eval.json"),
                      lambda: read_items(baseline / "eval_items.jsonl"),
                      lambda: read_items(rung / "eval_items.jsonl"), params["gate"])
    common.write_json(out, result)
    print(f"gate: {result['verdict']}: " + "; ".join(result["reasons"]))


if __name__ == "__main__":
    args = common.paths(__doc__.split("\n")[0], baseline="results/baseline", rung="results", gate="results/gate.json")
    common.run_stage(main, (common.ParamsError, ValueError, OSError), args.baseline, args.rung, args.gate)
