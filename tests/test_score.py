"""The eval set and its scorer: pure logic, no engine."""
import json

import pytest

from conftest import ROOT
from measure import score

EVAL = ROOT / "evals" / "small_eval.jsonl"


def test_eval_set_covers_the_required_categories():
    items = score.load_items(str(EVAL))
    cats = {}
    for it in items:
        cats.setdefault(it["category"], []).append(it)
    assert len(items) >= 20
    for c in ("math", "format", "bilingual", "knowledge", "reasoning"):
        assert len(cats.get(c, [])) >= 3, c
    zh = [it for it in cats["bilingual"]
          if any("\u4e00" <= ch <= "\u9fff" for ch in it["prompt"] + json.dumps(it["answer"], ensure_ascii=False))]
    assert len(zh) >= 3, "bilingual items must include Chinese"
    assert {it["scoring"] for it in items} == set(score.SCORINGS)


def test_every_category_can_detect_the_gates_category_drop():
    """The set's power: a category drop at gate.max_category_drop is enough one-way flips for McNemar p < alpha."""
    import yaml

    from judgement import stats
    g = yaml.safe_load((ROOT / "params.yaml").read_text())["gate"]
    cats = {}
    for it in score.load_items(str(EVAL)):
        cats[it["category"]] = cats.get(it["category"], 0) + 1
    for c, n in cats.items():
        assert stats.detectable_drop(n, g["alpha"]) <= g["max_category_drop"], (c, n)


def test_flips_counts_items_whose_correctness_differs_between_two_runs():
    items = [{"id": "m1", "category": "math", "answer": "2", "scoring": "number"},
             {"id": "m2", "category": "math", "answer": "3", "scoring": "number"},
             {"id": "f1", "category": "format", "answer": "ok", "scoring": "exact"}]
    f = score.flips(items, ["2", "3", "ok"], ["2", "three", "OK."])  # m2 right→wrong; f1 right both times
    assert f == {"flips": 1, "items": ["m2"], "by_category": {"format": 0, "math": 1}}
    assert score.flips(items, ["1", "1", "no"], ["2", "3", "ok"])["flips"] == 3


def write(tmp_path, lines):
    p = tmp_path / "bad.jsonl"
    p.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(p)


GOOD = json.dumps({"id": "a", "category": "math", "prompt": "1+1?", "answer": "2", "scoring": "number"})


@pytest.mark.parametrize("bad, expected", [
    ('{"id": "b", "category": "math", "prompt": "x",', "bad.jsonl:2: not valid JSON"),
    (json.dumps({"id": "b", "categroy": "math", "prompt": "x", "answer": "1", "scoring": "exact"}),
     "bad.jsonl:2: unknown field 'categroy'"),
    (json.dumps({"id": "b", "category": "math", "prompt": "x", "scoring": "exact"}),
     "bad.jsonl:2: missing field 'answer'"),
    (json.dumps({"id": "b", "category": "math", "prompt": "x", "answer": "1", "scoring": "fuzzy"}),
     "bad.jsonl:2: field 'scoring' is 'fuzzy'; allowed: exact, contains, regex, number"),
    (json.dumps({"id": "b", "category": "math", "prompt": "x", "answer": "[", "scoring": "regex"}),
     "bad.jsonl:2: field 'answer' is not a valid regex"),
    (json.dumps({"id": "b", "category": "math", "prompt": "x", "answer": "many", "scoring": "number"}),
     "bad.jsonl:2: field 'answer' must be a number"),
    (GOOD, "bad.jsonl:2: field 'id' 'a' repeats line 1"),
])
def test_bad_eval_file_names_file_line_and_field(tmp_path, bad, expected):
    with pytest.raises(score.EvalFileError) as e:
        score.load_items(write(tmp_path, [GOOD, bad]))
    assert expected in str(e.value)


@pytest.mark.parametrize("item, text, ok", [
    ({"answer": "blue", "scoring": "exact"}, " Blue. ", True),
    ({"answer": "blue", "scoring": "exact"}, "The sky is blue", False),
    ({"answer": ["hello", "hi"], "scoring": "contains"}, "Hi there!", True),
    ({"answer": ["水"], "scoring": "contains"}, "The word is 水 (shuǐ).", True),
    ({"answer": ["pacific"], "scoring": "contains"}, "The Atlantic", False),
    ({"answer": r"^\W*YES\W*$", "scoring": "regex"}, "YES", True),
    ({"answer": r"^\W*YES\W*$", "scoring": "regex"}, "Yes, sure", False),
    ({"answer": "12", "scoring": "number"}, "7 + 5 = 12", True),
    ({"answer": "12", "scoring": "number"}, "12 is wrong, it is 13", False),
    ({"answer": "0", "scoring": "number"}, "It freezes at 0 degrees.", True),
    ({"answer": "1000", "scoring": "number"}, "1,000", True),
    ({"answer": "5", "scoring": "number"}, "no digits here", False),
])
def test_score_one(item, text, ok):
    assert score.score_one(item, text) is ok


def test_summarize_overall_and_per_category():
    items = [{"id": f"{c}{i}", "category": c, "answer": "1", "scoring": "number"} for c in ("a", "b") for i in range(2)]
    s = score.summarize(items, ["1", "2", "1", "1"])
    assert s["n"] == 4 and s["correct"] == 3 and s["overall"] == 0.75
    assert s["by_category"]["a"] == {"n": 2, "correct": 1, "acc": 0.5}
    assert s["by_category"]["b"]["acc"] == 1.0
    assert [p["correct"] for p in s["items"]] == [True, False, True, True]
    with pytest.raises(ValueError):
        score.summarize(items, ["1"])
