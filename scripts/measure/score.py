"""Load and score the fixed eval set.

Each line of the JSONL file is one item:
  {"id": "math-01", "category": "math", "prompt": "...", "answer": "12", "scoring": "number"}
  optional: "system" (a system message).

Scoring methods (the item names its own):
  exact    - the reply, trimmed of white space, quotes and end punctuation, equals an answer (case-insensitive)
  contains - the reply contains an answer (case-insensitive)
  regex    - re.search(answer, reply) finds a match
  number   - the last number in the reply equals the answer
"""
from __future__ import annotations

import math
import re
from collections import defaultdict

import common

SCORINGS = ("exact", "contains", "regex", "number")
REQUIRED = ("id", "category", "prompt", "answer", "scoring")
OPTIONAL = ("system",)
_NUMBER = re.compile(r"-?\d+(?:[.,]\d+)*")


class EvalFileError(ValueError):
    """A bad eval file: the message names file, line and field."""


def _answers(item: dict) -> list[str]:
    a = item["answer"]
    return [str(x) for x in a] if isinstance(a, list) else [str(a)]


def _check(item, path: str, lineno: int) -> dict:
    where = f"{path}:{lineno}"
    if not isinstance(item, dict):
        raise EvalFileError(f"{where}: expected a JSON object, got {type(item).__name__}")
    for field in item:
        if field not in REQUIRED + OPTIONAL:
            raise EvalFileError(f"{where}: unknown field '{field}' (allowed: {', '.join(REQUIRED + OPTIONAL)})")
    for field in REQUIRED:
        if field not in item or item[field] in (None, "", []):
            raise EvalFileError(f"{where}: missing field '{field}'")
    for field in ("id", "category", "prompt"):
        if not isinstance(item[field], str):
            raise EvalFileError(f"{where}: field '{field}' must be a string, got {item[field]!r}")
    if item["scoring"] not in SCORINGS:
        raise EvalFileError(f"{where}: field 'scoring' is {item['scoring']!r}; allowed: {', '.join(SCORINGS)}")
    answer = item["answer"]
    if not (isinstance(answer, (str, int, float)) or
            (isinstance(answer, list) and all(isinstance(x, (str, int, float)) for x in answer))):
        raise EvalFileError(f"{where}: field 'answer' must be a string, a number or a list of them, got {answer!r}")
    if item["scoring"] == "regex":
        for a in _answers(item):
            try:
                re.compile(a)
            except re.error as e:
                raise EvalFileError(f"{where}: field 'answer' is not a valid regex ({e}): {a!r}") from None
    if item["scoring"] == "number":
        for a in _answers(item):
            try:
                float(a)
            except ValueError:
                raise EvalFileError(
                    f"{where}: field 'answer' must be a number for scoring 'number', got {a!r}") from None
    return item


def load_items(path: str) -> list[dict]:
    """Read and validate every item; raise EvalFileError naming file, line and field on the first bad one."""
    items, seen = [], {}
    try:
        f = open(path, encoding="utf-8")
    except OSError as e:
        raise EvalFileError(f"{path}: cannot read eval file ({e.strerror})") from None
    with f:
        for lineno, item in common.json_lines(f, EvalFileError, str(path)):
            item = _check(item, path, lineno)
            if item["id"] in seen:
                raise EvalFileError(f"{path}:{lineno}: field 'id' {item['id']!r} repeats line {seen[item['id']]}")
            seen[item["id"]] = lineno
            items.append(item)
    if not items:
        raise EvalFileError(f"{path}: no items")
    return items


def _norm(s: str) -> str:
    return s.strip().strip("\"'`*").strip().rstrip(".!。！").strip().casefold()


def score_one(item: dict, text: str) -> bool:
    answers, how = _answers(item), item["scoring"]
    if how == "exact":
        return _norm(text) in {_norm(a) for a in answers}
    if how == "contains":
        t = text.casefold()
        return any(a.casefold() in t for a in answers)
    if how == "regex":
        return any(re.search(a, text) for a in answers)
    numbers = _NUMBER.findall(text)
    if not numbers:
        return False
    last = float(numbers[-1].replace(",", ""))
    return any(math.isclose(last, float(a), abs_tol=1e-6) for a in answers)


def summarize(items: list[dict], texts: list[str]) -> dict:
    """Overall accuracy, per-category accuracy and per-item correctness."""
    if len(items) != len(texts):
        raise ValueError(f"{len(items)} items but {len(texts)} replies")
    per_item, by_cat = [], defaultdict(list)
    for item, text in zip(items, texts):
        ok = score_one(item, text)
        per_item.append({"id": item["id"], "category": item["category"], "correct": ok})
        by_cat[item["category"]].append(ok)
    return {
        "n": len(items),
        "correct": sum(p["correct"] for p in per_item),
        "overall": sum(p["correct"] for p in per_item) / len(items),
        "by_category": {c: {"n": len(v), "correct": sum(v), "acc": sum(v) / len(v)} for c, v in sorted(by_cat.items())},
        "items": per_item,
    }


def flips(items: list[dict], texts: list[str], again: list[str]) -> dict:
    """Items whose correctness differs between two sets of replies to the same items: in all and per category."""
    ids = [it["id"] for it, a, b in zip(items, texts, again, strict=True) if score_one(it, a) != score_one(it, b)]
    cats = sorted({it["category"] for it in items})
    return {"flips": len(ids), "items": ids,
            "by_category": {c: sum(it["category"] == c and it["id"] in ids for it in items) for c in cats}}
