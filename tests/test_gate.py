"""The quality gate on fixture items: pass/fail needs a drop beyond the threshold, beyond the nondeterminism floor,
and McNemar evidence; per-category power ("cannot judge"); flips; dummy weights are not gated."""
import pytest

import gate
from records.eval import EvalResult

G = {"max_overall_drop": 0.10, "max_category_drop": 0.25, "alpha": 0.05, "min_items": 5}


def items(spec):
    """spec: {category: [correct, ...]} -> {id: item}"""
    return {f"{c}-{i}": {"id": f"{c}-{i}", "category": c, "correct": ok}
            for c, oks in spec.items() for i, ok in enumerate(oks)}


def flip(base, ids):
    return {i: {**it, "correct": not it["correct"]} if i in ids else it for i, it in base.items()}


# 28 items a category, as in evals/small_eval.jsonl: six one-way flips (p = 0.031) are evidence at α 0.05
BASE = items({"math": [1] * 16 + [0] * 12, "format": [1] * 10 + [0] * 18, "knowledge": [1] * 24 + [0] * 4})


def test_identical_results_pass():
    r = gate.compare(BASE, BASE, G)
    assert r["keep"] is True and r["verdict"] == "pass" and r["cannot_judge"] == []
    assert r["overall"]["drop"] == 0 and r["flipped"] == {"right_to_wrong": [], "wrong_to_right": []}
    assert r["by_category"]["math"]["evidence"] == "no change"


def test_a_category_collapse_with_evidence_fails_the_gate_and_says_which():
    cur = flip(BASE, {f"math-{i}" for i in range(8)})  # math 16/28 -> 8/28: −0.29, p = 0.008
    r = gate.compare(BASE, cur, G)
    assert r["keep"] is False and r["verdict"] == "fail"
    assert r["regressed_categories"] == ["math"]
    assert any(x.startswith("category math fell 0.571 → 0.286 (8 right→wrong") for x in r["reasons"])
    assert r["by_category"]["math"]["evidence"] == "regressed"
    assert r["by_category"]["math"]["flipped"]["right_to_wrong"] == [f"math-{i}" for i in range(8)]
    assert r["by_category"]["format"]["flipped"] == {"right_to_wrong": [], "wrong_to_right": []}


def test_a_drop_beyond_the_threshold_without_evidence_does_not_fail():
    # 11 right→wrong, 3 wrong→right: −0.29 > 0.25, but churn more than a drop: McNemar p = 0.057
    cur = flip(BASE, {f"math-{i}" for i in range(11)} | {"math-16", "math-17", "math-18"})
    r = gate.compare(BASE, cur, G)
    m = r["by_category"]["math"]
    assert m["drop_beyond_noise"] == pytest.approx(8 / 28, abs=1e-6) and m["evidence"] == "not enough evidence"
    assert m["p_value"] == pytest.approx(0.0574, abs=1e-4)
    assert r["keep"] is True and any(x.startswith("not failed, no evidence: category math") for x in r["reasons"])


def test_flips_within_the_nondeterminism_floor_are_noise():
    cur = flip(BASE, {f"math-{i}" for i in range(8)})  # 8 right→wrong; the baseline itself flips 3 of math's items
    r = gate.compare(BASE, cur, G, floor={"math": 3})
    m = r["by_category"]["math"]
    assert m["noise_flips"] == 3 and m["drop_beyond_noise"] == pytest.approx(5 / 28, abs=1e-6)
    assert r["keep"] is True and m["evidence"] == "not enough evidence"  # 5 flips beyond the floor: p = 0.0625
    assert m["detectable_flips"] == 9 and m["detectable_drop"] == pytest.approx(9 / 28, abs=1e-6)
    assert r["cannot_judge"] == ["math"] and any("cannot judge category math" in x for x in r["reasons"])
    assert r["overall"]["noise_flips"] == 3


def test_each_category_says_what_drop_it_can_detect():
    r = gate.compare(BASE, BASE, G)
    for v in r["by_category"].values():
        assert v["n"] == 28 and v["detectable_flips"] == 6 and v["detectable_drop"] == pytest.approx(6 / 28, abs=1e-6)
        assert v["can_detect_threshold"] is True
    small = items({"math": [1] * 8})  # the old 8-item categories: 6 of 8 must flip, 0.75 > 0.25
    r = gate.compare(small, flip(small, {"math-0", "math-1", "math-2"}), G)
    assert r["keep"] is True and r["cannot_judge"] == ["math"]
    assert r["by_category"]["math"]["detectable_drop"] == 0.75
    assert r["by_category"]["math"]["evidence"] == "not enough evidence"


def test_an_overall_drop_beyond_the_threshold_fails_even_without_a_collapse():
    spec = {c: [1] * 8 for c in "abcdefgh"}
    base = items(spec)
    cur = flip(base, {f"{c}-0" for c in "abcdefgh"})  # one item per category: 8/64 = 0.125 overall and per category
    r = gate.compare(base, cur, G)
    assert r["keep"] is False and r["regressed_categories"] == []
    assert r["overall"]["evidence"] == "regressed" and r["overall"]["p_value"] < 0.01
    assert r["reasons"][0].startswith("overall accuracy fell 1.000 → 0.875")


def ev(**kw) -> EvalResult:
    """An eval record as the gate reads it: only what the gate looks at (status, reason, model, rung 0's floor)."""
    return EvalResult(n=len(BASE), **kw)


def test_the_method_states_the_floor_and_the_rule():
    base_eval = ev(status="ok", model="m", nondeterminism={"flips": 2, "items": ["math-0", "math-1"],
                                                           "by_category": {"math": 2},
                                                           "method": "rung 0 evaluated twice", "recheck_s": 1.0})
    r = gate.evaluate(base_eval, ev(status="ok", model="m"), lambda: BASE, lambda: BASE, G)
    assert r["noise_floor"] == {"math": 2} and r["by_category"]["math"]["noise_flips"] == 2
    assert "floor: 2 item(s)" in r["method"] and "McNemar" in r["method"] and "cannot judge" in r["method"]
    r = gate.evaluate(ev(status="ok"), ev(status="ok"), lambda: BASE, lambda: BASE, G)  # an older baseline
    assert r["noise_floor"] is None and "floor: not measured" in r["method"]


def test_dummy_weights_are_not_gated_and_carry_no_accuracy():
    na = ev(status="n/a", reason="dummy weights (load_format: dummy): quality is not measured", model="shape")
    r = gate.evaluate(na, na, lambda: 1 / 0, lambda: 1 / 0, G)  # the item files are never read
    assert r["keep"] is True and r["gated"] is False and r["verdict"] == "not gated"
    assert r["overall"] is None and "dummy weights" in r["reasons"][0]


def test_items_must_match():
    with pytest.raises(ValueError, match="different items"):
        gate.compare(BASE, items({"math": [1]}), G)
