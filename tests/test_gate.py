"""The quality gate on fixture items: pass/fail, reasons, flips, evidence; dummy weights are not gated."""
import gate

G = {"max_overall_drop": 0.10, "max_category_drop": 0.25, "alpha": 0.05, "min_items": 5}


def items(spec):
    """spec: {category: [correct, ...]} -> {id: item}"""
    return {f"{c}-{i}": {"id": f"{c}-{i}", "category": c, "correct": ok}
            for c, oks in spec.items() for i, ok in enumerate(oks)}


BASE = items({"math": [1, 1, 1, 1, 0, 0, 0, 0], "format": [1, 1, 0, 0, 0, 0, 0, 0], "knowledge": [1] * 7 + [0]})


def test_identical_results_pass():
    r = gate.compare(BASE, BASE, G)
    assert r["keep"] is True and r["verdict"] == "pass"
    assert r["overall"]["drop"] == 0 and r["flipped"] == {"right_to_wrong": [], "wrong_to_right": []}
    assert r["by_category"]["math"]["evidence"] == "no change"


def test_a_category_collapse_fails_the_gate_and_says_which():
    cur = dict(BASE)
    for i in range(4):  # math 4/8 -> 0/8
        cur[f"math-{i}"] = {**cur[f"math-{i}"], "correct": 0}
    r = gate.compare(BASE, cur, G)
    assert r["keep"] is False and r["verdict"] == "fail"
    assert r["regressed_categories"] == ["math"]
    assert any("category math collapsed 0.50 → 0.00" in x for x in r["reasons"])
    assert r["flipped"]["right_to_wrong"] == ["math-0", "math-1", "math-2", "math-3"]
    assert r["by_category"]["math"]["evidence"] == "not enough evidence"  # 4 flips: p = 0.125


def test_a_small_overall_drop_is_fine():
    cur = dict(BASE)
    cur["knowledge-0"] = {**cur["knowledge-0"], "correct": 0}   # one flip each way
    cur["format-7"] = {**cur["format-7"], "correct": 1}
    r = gate.compare(BASE, cur, G)
    assert r["keep"] is True
    assert r["flipped"] == {"right_to_wrong": ["knowledge-0"], "wrong_to_right": ["format-7"]}


def test_an_overall_drop_beyond_the_threshold_fails_even_without_a_collapse():
    spec = {c: [1] * 8 for c in "abcdefgh"}
    base = items(spec)
    cur = dict(base)
    for c in "abcdefgh":  # one item per category: 8/64 = 0.125 overall, 0.125 per category
        cur[f"{c}-0"] = {**cur[f"{c}-0"], "correct": 0}
    r = gate.compare(base, cur, G)
    assert r["keep"] is False and r["regressed_categories"] == []
    assert r["overall"]["evidence"] == "regressed" and r["overall"]["p_value"] < 0.01
    assert "overall accuracy fell 1.000 → 0.875" in r["reasons"][0]


def test_dummy_weights_are_not_gated_and_carry_no_accuracy():
    na = {"status": "n/a", "reason": "dummy weights (load_format: dummy): quality is not measured", "model": "shape"}
    r = gate.evaluate(na, na, lambda: 1 / 0, lambda: 1 / 0, G)  # the item files are never read
    assert r["keep"] is True and r["gated"] is False and r["verdict"] == "not gated"
    assert r["overall"] is None and "dummy weights" in r["reasons"][0]


def test_items_must_match():
    import pytest
    with pytest.raises(ValueError, match="different items"):
        gate.compare(BASE, items({"math": [1]}), G)
