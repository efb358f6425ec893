"""report/ladder.json: the ladder record, one rung record a run the ladder made (rungs, re-measures, knee re-checks,
the confirm step's runs), each holding its stages' records whole.

Written by scripts/ladder.py (Driver.save) through `LadderRecord.save_file` only (scripts/fill_capacity.py saves
its filled copy elsewhere, never here), read by the report, `make compare` and fill_capacity through `load_file` only
(tests/test_records.py holds both). The driver builds each rung as a dict while it climbs (record.fill,
capacity.annotate, record.annotate_time fill it in place); the file is the model's: a key the model does not
declare is refused by name when the driver saves it. The keys on disk are the ones the driver set (`exclude_unset`):
a field a rung never reached is absent, as it was before the record was typed, and the report reads absent and null
alike.

Version 1: written before the record was typed (no schema_version); its rungs' stage records are upgraded by their
own models' validators (records/bench.py, eval.py, gate.py, knee.py); fields added over time read as None.
Version 2: a rung's knee.noise_floor sat inside its copy of the knee stage's record; version 3 holds it beside, as
the rung's knee_noise_floor (RungRecord._floor_beside moves it on reading), so the stage's record is held as it was.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, model_validator

import common
import config
from records.base import Closed, Record, StageTime
from records.bench import BenchResult
from records.eval import EvalResult
from records.fingerprint import Environment
from records.gate import GateResult
from records.knee import RungKnee


class Measured(Closed):
    """When and on which machine a rung's bench was measured (record.fill, from the bench's provenance); a record
    from before machines were named has no machine."""
    at: str | None = None
    host_id: str | None = None
    gpu_uuids: list[str | None] = []
    machine: str | None = None
    machine_label: str | None = None


class RungTime(Closed):
    """record.time_split: where a rung's `seconds` went, summed over the engine stages that ran."""
    seconds: float
    gpus: int
    start_s: float
    measure_s: float
    other_s: float
    dvc_s: float
    estimated: bool
    starts: int = 0


class AppliedCheck(Closed):
    """decide.applied_check (and decide.target_check with a target card): did one knob the rung changed take effect,
    as the engine's own log shows it."""
    knob: str
    requested: Any = None              # the knob's value as asked for (a target card's: its budget in words)
    observed: str | None = None        # what the engine logged, in words
    applied: bool | None = None        # None: its log cannot tell


class PerGpu(Closed):
    """capacity.per_gpu: a rung's output tok/s and knee divided by its GPUs per instance."""
    output_tps: float | None = None
    knee_rps: float | None = None
    first_fail_rps: float | None = None


class Roofline(Closed):
    """record.roofline: the batch-1 decode floor from the model's shapes and the GPU's bandwidth, against the knee
    stage's batch-1 TPOT; with a target card that gives its bandwidth, the target's floor beside it. A record from
    before these were written lacks context_tokens, tpot_measured_at and the target's."""
    gpu: str | None = None
    bandwidth_gbs: float | None = None
    weight_bits: float | None = None
    context_tokens: int | None = None
    tpot_floor_ms: float | None = None
    tpot_measured_at: str | None = None  # "batch 1", or the lowest probed rate an older knee record had
    tpot_low_load_ms: float | None = None
    pct_of_floor: float | None = None
    target_gpu: str | None = None
    target_bandwidth_gbs: float | None = None
    target_tpot_floor_ms: float | None = None


class TargetConversion(Closed):
    """common.target_engine: an emulated card's memory budget on the real one, as the engine ran it."""
    name: str
    memory_gib: float
    bandwidth_gbs: float | None = None
    gpu_memory_utilization: float      # as asked for on the target card
    budget_gib: float
    real_gpu: str
    real_total_gib: float
    fraction: float                    # the gpu_memory_utilization the engine got on the real card


class Change(BaseModel):
    """A rung's Δ vs its base on one measure: stats.delta (output tok/s) or stats.knee_delta (the knee, re-judged by
    stats.knee_recheck where fresh servers re-checked it), per GPU where the two ran on different GPU counts
    (record.compare). Its other keys (engines, df, floor_cv, again_odds, past, normal, repeats_se, ...) differ across
    the record's versions: `extra="allow"` keeps them as written (since 2026-12-07 floor_cv is the floor as judged,
    `normal` says the interval took a normal quantile on it, and df is then the floor's own). An interval from
    before its level was stated with it is `ci95`."""
    model_config = ConfigDict(extra="allow")
    rel: float | None = None
    ci: list[float] | None = None
    ci95: list[float] | None = None
    verdict: str | None = None         # better | worse | within noise | unknown
    why: str | None = None
    per_gpu: list[int | None] | None = None  # [the rung's GPUs per instance, the base's]
    first: str | None = None           # the verdict on one server a side, before the re-check
    recheck: list[dict[str, Any]] | None = None  # each pair of fresh servers: its rate and both sides' verdicts


class RungDelta(Closed):
    """record.compare: the rung vs its base, on each measure (None: not measured on one side)."""
    output_tps: Change | None = None
    knee_rps: Change | None = None
    base_again: bool | None = None     # decide.AGAIN: the base measured again right after it (False: that failed)


class RungRecord(Closed):
    """One experiment the ladder ran (or skipped), as ladder.Driver builds it and record.fill fills it."""
    index: int
    name: str
    exp: str | None = None             # the DVC experiment (`dvc exp show`), None when the rung did not run
    role: str                          # decide.BASELINE, "rung", "candidate", "fallback", decide.RECHECK (a base
                                       # measured again), decide.KNEE_RECHECK, decide.CONFIRM
    change: dict[str, Any] | None = {}  # the one knob (or declared group) it changes vs `base`
    note: str | None = None
    base: str | None = None            # the experiment it is compared with: the last kept rung
    knobs: dict[str, Any] | None = None  # every knob in force, flattened (None: a skipped rung that names none)
    status: Literal["running", "ok", "failed", "interrupted", "skipped"]
    error: str | None = None
    log: str | None = None
    seconds: float | None = None       # wall time of its `dvc exp run`
    reused: list[str] = []             # stages DVC restored instead of measuring again
    measured: Measured | None = None
    model: str | None = None
    eval: EvalResult | None = None     # results/eval.json, whole but for its provenance (EvalResult.as_rung)
    gate: GateResult | None = None     # results/gate.json, whole (GateResult.as_rung)
    bench: BenchResult | None = None   # results/bench.json, whole but for its provenance (BenchResult.as_rung)
    knee: RungKnee | None = None       # results/knee.json, whole but for its provenance, as the stage wrote it
    # knee.noise_floor the ladder judged this knee with (decide.judged_knee): a judgement threshold, the params' at
    # judging, never the stage's, so beside its record and not in it
    knee_noise_floor: float | None = None
    stage_seconds: dict[str, float] = {}
    stage_time: dict[str, StageTime] = {}  # per engine stage that ran: its result's `time` (common.stage_time)
    applied: list[AppliedCheck] = []   # decide.applied_check (+ decide.target_check with a target card)
    target: TargetConversion | None = None  # the target card's conversion the engine ran with (common.target_engine)
    roofline: Roofline | None = None   # record.roofline
    # output_tps: stats.delta, knee_rps: stats.knee_delta, vs `base` (per GPU: record.compare); decide.AGAIN: whether
    # `base` was measured again right after it (decide.needs_again)
    delta: RungDelta | None = None
    replayed: str | None = None        # measured on another machine (its label), taken as it was (Driver.replay)
    of: str | None = None              # a confirm run's or knee re-check's: the experiment it measures again
    kept: bool | None = None
    verdict: str | None = None         # decide.verdict: baseline | kept | reverted | not chosen | failed | ...
    decision: str | None = None        # why, in words
    gpus: int | None = None            # GPUs per instance (capacity.gpus_per_instance); None on a CPU box
    per_gpu: PerGpu | None = None      # capacity.per_gpu: output tok/s and knee per GPU, beside the totals
    speedup: float | None = None
    time: RungTime | None = None

    @model_validator(mode="before")
    @classmethod
    def _floor_beside(cls, data: Any) -> Any:
        """A rung of version 1 or 2 held knee.noise_floor inside its knee: read as the rung's knee_noise_floor."""
        knee = data.get("knee") if isinstance(data, dict) else None
        if not isinstance(knee, dict) or "noise_floor" not in knee:
            return data
        knee = dict(knee)
        floor = knee.pop("noise_floor")
        return {**data, "knee": knee, "knee_noise_floor": data.get("knee_noise_floor", floor)}


class RestedOn(Closed):
    """A kept rung the confirm step's verdict rests on (record.confirm_summary): what its keep rested on
    (decide.rested_on: "output tok/s" or "its knee")."""
    name: str
    exp: str | None = None
    on: str | None = None


class Confirm(Closed):
    """The confirm step (Driver.confirm_step): its pairs' runs, and record.confirm_summary of them (or why there is
    no step: `why`)."""
    pairs: int
    why: str | None = None
    runs: list[RungRecord] = []
    summary: str | None = None
    delta: dict[str, Any] | None = None
    baseline: dict[str, Any] | None = None
    final: dict[str, Any] | None = None
    speedup: float | None = None
    verdict: str | None = None
    reproduced: bool | None = None
    reproduced_why: str | None = None
    kept_gain: dict[str, float] | None = None
    power: float | None = None
    words: str | None = None
    power_by: dict[str, float | None] | None = None
    rested_on: list[RestedOn] | None = None


class PlanKnee(Closed):
    """capacity.which_knee: the rung a fleet is planned on, and its knee."""
    rung: str                          # "index name"
    exp: str | None = None
    knee_rps: float | None = None
    first_fail_rps: float | None = None
    status: str | None = None


class SidePlan(Closed):
    """capacity.knee_plan: one rung's fleet for the peak and its cost at the knee, each figure with the range its
    knee's bracket allows ([bound, planned]; the bound None where no probed rate failed); or `why` there is none."""
    knee: PlanKnee
    plan: str                          # "ok" or capacity.NO_PLAN
    why: str | None = None
    instances: int | None = None
    instances_range: list[int | None] | None = None
    gpus_per_instance: int | None = None  # None on a CPU box
    gpus: int | None = None
    gpus_range: list[int | None] | None = None
    usd_per_m_output_tokens: float | None = None
    usd_per_m_output_tokens_range: list[float | None] | None = None
    output_tps_at_knee: float | None = None
    why_no_cost: str | None = None


class Saved(Closed):
    """capacity.plan's tune-vs-scale: what the final stack saves against rung 0 at the peak, in `unit` (the side
    plans' field it compares), or `why` there is no figure."""
    plan: str
    why: str | None = None
    unit: Literal["gpus", "instances"] | None = None
    saved: int | None = None
    saved_range: list[int | None] | None = None


class CapacityPlan(Closed):
    """capacity.plan: fleets for `capacity.peak_rps` before (rung 0) and after (the final stack), and what tuning
    saved; `added` where scripts/fill_capacity.py planned it after the run (into a copy)."""
    peak_rps: float
    headroom: float
    price_per_gpu_hour: float
    unit: str                          # "GPU", or "instance (CPU machine)"
    before: SidePlan
    after: SidePlan
    method: str
    saved: Saved
    added: str | None = None


class StackMinutes(Closed):
    stock: float                       # rung 0's runs
    final: float                       # the final stack's


class ConfirmTime(Closed):
    """record.confirm_time: the confirm step's device-minutes, in all and per stack."""
    runs: int
    minutes: float
    per_stack: StackMinutes


class TimeTotals(Closed):
    """record.time_totals: the ladder's device-minutes (each rung's `time` weighted by the GPUs it held), the
    share of them each part of record.time_split took, and their cost; the confirm step's own beside them. A share
    is None where no time was measured; a record from before engine starts were counted has none."""
    unit: str                          # "GPU", or "CPU" on a CPU box
    minutes: float
    engine_starts: int | None = None
    seconds_per_start: float | None = None
    start_minutes: float
    measure_minutes: float
    other_minutes: float
    dvc_minutes: float
    start_share: float | None
    measure_share: float | None = None
    other_share: float | None = None
    dvc_share: float | None = None
    price_per_hour: float
    cost_usd: float
    estimated: bool                    # some rung's split was estimated (record._estimate)
    preflight_minutes: float | None = None  # before the first experiment, on the machine's GPUs; None: not recorded
    driver_minutes: float | None = None     # the driver's own between experiments (with preflight_minutes)
    preflight_s: float | None = None        # the same two in wall seconds (the minutes are device-minutes, rounded);
    driver_s: float | None = None           # None in a record from before they were kept: the minutes / GPUs held
    confirm: ConfirmTime | None = None


class NoiseFloor(Closed):
    """stats.Floor the ladder drew every Δ with (Driver.save), its degrees of freedom and its words."""
    cv: float
    engines: int = 0
    groups: int = 1
    source: str | None = None
    df: int | None = None
    words: str
    read_at: float | None = None  # the level at whose upper end a stored floor was judged; None: none was stored
                                  # (the ladder's own re-measures alone), or a ladder from before 2026-12-07
    delta_words: str | None = None  # how its Δs on tok/s were drawn (stats.delta_words); None: a ladder from before


class LadderRecord(Record):
    """report/ladder.json: the ladder's settings, its rungs and confirm step, and what it cost. The report reads
    nothing else."""
    SCHEMA: ClassVar[int] = 3
    profile: str
    started: str | None = None
    finished: str | None = None
    complete: bool = False
    environment: Environment = Environment()  # measure.host.fingerprint(): the machine and software (the
                                              # fingerprint stage's record holds the same: records/fingerprint.py)
    git_commit: str | None = None
    models: dict[str, Any] = {}        # the download manifest's models (record.fill)
    slo: config.Slo | None = None      # params `slo`, as the ladder ran; a p99-only one spelled p99_* upgraded
    objective: str | None = None
    rule: str | None = None            # decide.rule: the keep/revert rule in words
    settings: dict[str, Any] = {}      # the workload, bench, knee, serve, eval, gate, cost, capacity params it ran with
    eval_file: str | None = None
    eval_sha256: str | None = None
    eval_n: int | None = None
    final_exp: str | None = None
    rungs: list[RungRecord] = []
    confirm: Confirm | None = None
    noise_floor: NoiseFloor | None = None  # stats.Floor every Δ was drawn with, its df and words
    engine_seconds: float | None = None
    wall_seconds: float | None = None   # from the first experiment to the last save
    preflight_seconds: float | None = None  # before it: imports, the plan, the models, the pre-flight
    cost_usd: float | None = None
    capacity: CapacityPlan | None = None  # capacity.plan: fleets for `capacity.peak_rps`, cost per 1 M tokens
    time: TimeTotals | None = None     # record.time_totals: device-minutes, the share spent starting engines

    @model_validator(mode="before")
    @classmethod
    def _upgrade(cls, data: Any) -> Any:
        """Version 1 (untyped, written before this model): the same keys; its rungs' stage records are upgraded by
        their own validators, and fields added over time (rule, confirm, noise_floor, capacity, time; a rung's
        measured, gpus, per_gpu, stage_time, time) are absent. An SLO spelled p99-only ({p99_ttft_ms, p99_tpot_ms},
        before slo.percentile) is read as its percentile form in any version: version 2 held the SLO as written."""
        if not isinstance(data, dict):
            return data
        slo = data.get("slo") or {}
        if "p99_ttft_ms" in slo:  # the SLO spelled p99-only (before slo.percentile), as KneeResult's version 1
            data = {**data, "slo": {"percentile": 99, "ttft_ms": slo["p99_ttft_ms"], "tpot_ms": slo["p99_tpot_ms"]}}
        return data if data.get("schema_version", 1) >= 2 else {**data, "schema_version": 2}

    def save_file(self, path: Path | str) -> None:
        """The one writer: atomic (common.write_json), the keys the driver set (a field no code path reached is not
        written as null), the current schema version. The open parts (a Δ, the capacity plan, the settings) are
        written by common.write_json as before the record was typed: a value JSON has no type for (a numpy scalar
        a statistic returned) as its string, never a failed save that would lose the rungs measured so far."""
        common.write_json(path, self.as_dict(mode="python"))

    def as_dict(self, mode: str = "json") -> dict:
        """The record as its file holds it (an older one upgraded, the current schema version): what the report
        renders."""
        return self.model_dump(mode=mode, exclude_unset=True) | {"schema_version": self.SCHEMA}
