"""results/gate.json: the quality gate's record, and what it means for the performance stages.

Written by scripts/gate.py through `GateResult(...).save_file` only, read through `load_file` only (the ladder
record; bench and knee through `gate_failed`); tests/test_records.py holds both. Two kinds share the one model, told
apart by `gated`: a rung judged against rung 0 (`verdict` pass / fail, its blocks and flips) and one with no quality
to judge (`not gated`: dummy weights, an offline engine that cannot run it; no block, no flip).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import model_validator

import config
from records.base import Closed, Record


class Flipped(Closed):
    """The item ids whose correctness changed against rung 0, each way (empty where nothing was gated)."""
    right_to_wrong: list[str] = []
    wrong_to_right: list[str] = []


class Block(Closed):
    """gate.compare's verdict on one category or overall: accuracies, flips, the floor, McNemar's evidence, and the
    flips it would need to call a regression (stats.detectable_flips). A version-1 block from before the
    nondeterminism floor and the power check lacks those fields (they read None)."""
    n: int
    baseline: float
    rung: float
    drop: float
    right_to_wrong: int
    wrong_to_right: int
    noise_flips: int | None = None
    drop_beyond_noise: float | None = None
    p_value: float
    evidence: str
    detectable_flips: int | None = None
    detectable_drop: float | None = None
    can_detect_threshold: bool | None = None
    flipped: Flipped | None = None     # a category's own flips; None overall (the record's `flipped` holds them all)


class GateResult(Record):
    SCHEMA: ClassVar[int] = 2
    keep: bool
    gated: bool
    verdict: Literal["pass", "fail", "not gated"]
    reasons: list[str]
    overall: Block | None = None       # None: not gated
    by_category: dict[str, Block] = {}  # keyed by the eval set's categories (its data, not the code, names them)
    regressed_categories: list[str] = []
    cannot_judge: list[str] = []       # categories where a drop of the threshold is too few flips for evidence
    flipped: Flipped = Flipped()
    method: str | None = None
    thresholds: config.Gate | None = None  # params `gate` it judged with; None only in a version-1 record
    noise_floor: dict[str, int] | None = None  # {category: flips between two evals of rung 0}; None: not measured
    baseline_model: str | None = None
    rung_model: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _upgrade(cls, data: Any) -> Any:
        """Version 1 (untyped, written before this model): fields added over time are missing (thresholds,
        noise_floor, cannot_judge, the models; a block's floor and power check) and read as their defaults; a rung
        not gated wrote `flipped` as {}, read as no flips either way."""
        if not isinstance(data, dict) or data.get("schema_version", 1) >= 2:
            return data
        return {**data, "schema_version": 2}


def gate_failed(params: config.Params, gate_json: Path) -> str | None:
    """Why a performance stage measures nothing on this rung: its quality gate failed, so decide.decide reverts
    it before looking at speed (unless gate.measure_failed); None: measure. No gate result yet: measure.
    Here, not in common: it reads the gate's record, and common imports no record (records import common)."""
    if params.gate.measure_failed or not gate_json.exists() or GateResult.load_file(gate_json).verdict != "fail":
        return None
    return (f"the quality gate failed ({gate_json}): performance not measured; set gate.measure_failed: true to "
            "measure it")
