"""results/eval.json (and results/baseline/eval.json): the eval stage's record, per category, with rung 0's own noise.

Written by scripts/eval.py through `EvalResult(...).save_file` only, read through `load_file` only (the gate, the
ladder record, the eval stage itself where rung 0's result is reused); tests/test_records.py holds both. Three kinds
share the one model: a measured eval (`ok`: accuracies, the engine's facts, and on rung 0 `nondeterminism`, its
second pass), one copied from rung 0's (`ok`, `reused_from`: no engine started), and one that measured nothing
(`n/a`: dummy weights, an offline engine that cannot run it; `reason`, `label`, no accuracy).
"""
from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import model_validator

from records.base import Closed, Record, StageTime


class CategoryScore(Closed):
    """measure/score.summarize for one category."""
    n: int
    correct: int
    acc: float


class Inputs(Closed):
    """What decides an eval's answers (eval.inputs): rung 0's result is reused where a rung's are the same."""
    knobs: dict[str, Any]              # common.engine_config: the engine's knobs are vLLM's (open), the target card's
    model_sha256: str | None = None
    eval_sha256: str
    temperature: float
    seed: int
    max_tokens: int


class Nondeterminism(Closed):
    """Rung 0 evaluated twice in one engine, the second time in reverse order (eval.RECHECK): the items whose
    correctness differed (measure/score.flips), the floor the gate discounts."""
    flips: int
    items: list[str]
    by_category: dict[str, int]        # keyed by the eval set's categories, as `by_category` is
    method: str
    recheck_s: float


class EvalResult(Record):
    SCHEMA: ClassVar[int] = 2
    status: Literal["ok", "n/a"]
    which: Literal["rung", "baseline"] | None = None  # None only in a version-1 record that did not write it
    reason: str | None = None          # n/a only: why nothing was measured
    label: str | None = None           # n/a only: "dummy weights", or the offline engine's words
    model: str | None = None           # the model's name (params model.name); None only in a version-1 record
    model_id: str | None = None        # where its files came from (the download stage's manifest)
    knobs: dict[str, Any] | None = None  # common.engine_config, as eval ran it
    n: int
    method: str | None = None
    correct: int | None = None
    overall: float | None = None       # None: n/a
    by_category: dict[str, CategoryScore] = {}  # keyed by the eval set's categories (its data names them)
    inputs: Inputs | None = None
    wall_s: float | None = None        # None: n/a (no engine)
    generate_s: float | None = None
    output_tokens: int | None = None
    # the engine's own evidence of its config, as its log has it (vllm_compat.engine_facts: its keys depend on what
    # the log holds; decide.applied_check reads them)
    engine: dict[str, Any] | None = None
    time: StageTime | None = None
    nondeterminism: Nondeterminism | None = None  # rung 0's own only (a reused result leaves it to rung 0's)
    reused_from: Literal["eval_baseline"] | None = None
    provenance: dict | None = None     # records.upstream.provenance; the ladder record leaves it in results/

    @model_validator(mode="before")
    @classmethod
    def _upgrade(cls, data: Any) -> Any:
        """Version 1 (untyped, written before this model): fields added over time are missing (which, model, knobs,
        inputs, the time split, the engine's facts) and read as None; an n/a from before `label` reads None too."""
        if not isinstance(data, dict) or data.get("schema_version", 1) >= 2:
            return data
        return {**data, "schema_version": 2}
