"""results/bench.json: the bench stage's record, its timed runs and the repeats its screen flagged.

Written by scripts/bench.py through `BenchResult(...).save_file` only, read through `load_file` only (the ladder
record, the knee stage's start rate; tests/test_records.py holds both). Two kinds share the one model, told apart by
`status`: a measured bench (`ok`: figures, runs, the engine's facts) and one that measured nothing (`n/a`: a gate
that failed, an offline engine that cannot run the rung; `reason`, `label`, every figure null). The keys on disk are
the ones the stage wrote before it was typed: DVC's metrics (`dvc exp show`, scripts/compare.py) read them by name.
"""
from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import model_validator

from records.base import Closed, Record, StageTime


class AppliedShape(Closed):
    """Tokens per request as vLLM counted them (bench.check_shape): the shape it ran, checked against params."""
    input_len: float
    output_len: float


class Run(Closed):
    """One timed pass of `vllm bench throughput` (vllm_compat.parse_output), with what the stage adds to it."""
    requests_per_s: float
    total_tps: float
    output_tps: float
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    load: dict | None = None           # the other work on the machine during the pass (disturbed.CpuWatch.stop)
    applied: AppliedShape | None = None
    disturbed: str | None = None       # why it was flagged (bench.screen_runs); None: not flagged


class Summarized(Closed):
    """measure/summary.summarize over the runs the screen kept: `sd` only where there were two or more."""
    n: int
    values: list[float]
    median: float | None = None
    mean: float | None = None
    ci95: list[float] | None = None
    rel_halfwidth: float | None = None
    sd: float | None = None


class Summaries(Closed):
    output_tps: Summarized
    total_tps: Summarized
    requests_per_s: Summarized


class Flag(Closed):
    """A timed repeat far off its engine's others, or run while other work kept the machine busy (`busy`; its
    siblings' median and its distance from it None where it had none) (bench.screen_runs): replaced by one more
    (`replaced_by`, its `replacement`), or `unreplaced` where bench.extra_repeats was spent (it stays in the median)."""
    repeat: int
    output_tps: float
    siblings: list[float]
    median: float | None
    off: float | None
    load: dict | None = None
    busy: bool | None = None           # flagged for its load (bench.busy_share), not its distance
    why: str
    replaced_by: int | None = None
    replacement: float | None = None
    unreplaced: bool | None = None


class Workload(Closed):
    """measure/workload.describe: what was sent, in the report's words."""
    kind: str
    text: str
    shared_prefix: str
    shared_prefix_len: int = 0


class Shape(Closed):
    """The request shape and passes params asked for (the applied one is `applied_shape`); `input_len` a
    [shortest, longest] range for a prompts file. `warmup_prompts` was not written before c536b45's successors."""
    num_prompts: int
    input_len: int | list[int]
    output_len: int
    dataset: str
    ignore_eos: bool
    warmups: int
    warmup_repeats: int
    warmup_prompts: int | None = None


class WarmUpEngine(Closed):
    """The untimed engine before the first timed one of a ladder run (throughput.warm_up): kept, never compared."""
    output_tps: float | None = None
    wall_s: float
    passes: int | None = None          # its untimed passes (bench.warm_up_passes); 0: it only started; None: one
    start_s: float | None = None       # its spawn to its engine ready (imports and compile included)


class BenchResult(Record):
    SCHEMA: ClassVar[int] = 2
    status: Literal["ok", "n/a"]
    reason: str | None = None          # n/a only: why nothing was measured
    label: str | None = None           # n/a only: common.GATE_FAILED, or the offline engine's words
    method: str | None = None          # how it was measured, in the report's words
    # the figures (bench.figures): medians and the interval over the runs the screen kept
    output_tps: float | None = None
    total_tps: float | None = None
    requests_per_s: float | None = None
    output_tps_ci95: list[float] | None = None
    output_tps_runs: list[float] = []  # what a Δ vs another rung is computed from
    repeats: int = 0
    timed_passes: int | None = None    # the runs measured, replaced ones included
    far_share: float | None = None     # bench.far_share the screen ran with
    busy_share: float | None = None    # bench.busy_share the screen ran with (absent: a record from before it)
    disturbed: list[Flag] = []
    summary: Summaries | None = None
    mode: Literal["engine", "cli"] | None = None  # None only in a version-1 record that did not write it
    workload: Workload | None = None
    shape: Shape | None = None
    warmup_output_tps: list[float] | None = None  # the untimed passes: how slow a cold pass was
    warm_up_engine: WarmUpEngine | None = None
    applied_shape: AppliedShape | None = None
    kv_cache_tokens: int | None = None
    max_concurrency: float | None = None
    engine_init_s: float | None = None
    wall_s: float = 0
    time: StageTime | None = None
    # the engine's own evidence of its config, as its log has it (vllm_compat.engine_facts: its keys depend on what
    # the log holds, which differs across vLLM versions; decide.applied_check reads them), plus the stage's timing
    engine: dict[str, Any] | None = None
    runs: list[Run] = []
    provenance: dict | None = None     # records.upstream.provenance; the ladder record leaves it in results/

    @model_validator(mode="before")
    @classmethod
    def _upgrade(cls, data: Any) -> Any:
        """Version 1 (untyped, written before this model): a record from before `status` was written was a measured one
        (the ladder read it `.get("status", "ok")`); one from before 09d26e3 also held bench.noise_floor, a judgement
        threshold the stage no longer writes (the ladder record states the floor it judged with once)."""
        if not isinstance(data, dict) or data.get("schema_version", 1) >= 2:
            return data
        data = {k: v for k, v in data.items() if k != "noise_floor"}
        data.setdefault("status", "ok")
        data["schema_version"] = 2
        return data
