"""results/knee.json: the knee stage's record, its looks, and the re-check a verdict gets on a fresh server.

Written by scripts/knee.py through `KneeResult(...).save_file` only, read by the ladder record through `load_file`
only (tests/test_records.py holds both). Three kinds share the one model, told apart by `mode` and `status`:
a search or sweep (`status` inside / below / open / above, a bracket), a re-check (`mode` recheck, `recheck` set,
no knee), and a knee that measured nothing (`status` n/a, `reason`, every figure null).
"""
from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, model_validator

import config
from records.base import Closed, Record, StageTime

Status = Literal["inside", "below", "open", "above", "ok", "n/a"]


class FrontEndLook(Closed):
    """Where a look's latency came from (measure/frontend.py; issue 50): the client's and the server's counts of the
    look's completed requests over the SLO's TTFT (like with like: TTFT only, every completed request, each by its
    own clock), the engine's queue peaks, the busiest thread's share of a core in the API servers and the client,
    and the flag: `bound` "front end" / "client" (the latency was added outside the engine), "engine", or None."""
    counted: int                              # the look's completed requests (the client's population)
    client_over_ttft: int
    server_counted: int | None = None         # the server's TTFT histogram count over the look (+1: the test request)
    server_over_ttft: int | None = None       # None: not read, or the SLO's TTFT is no bucket edge (server_reason)
    server_reason: str | None = None
    waiting_peak: float | None = None         # vllm:num_requests_waiting, sampled about once a second
    running_peak: float | None = None
    api_processes: int = 0
    api_thread_share: float | None = None     # the busiest API-server thread's share of one core (max over them)
    client_thread_share: float | None = None  # this process's (vllm bench serve's) busiest thread's
    api_stall_s: float | None = None          # the slowest /metrics GET during the look
    scrapes: int = 0
    bound: Literal["front end", "client", "engine"] | None = None
    why: str | None = None


class Look(BaseModel):
    """One look at one offered rate (a row of knee.csv): vLLM's own figures of the probe, the SLO's percentile over
    the requests that count, and the evidence. The look is built in steps (knee_looks.row_from, probing.judge, the visit
    and the disturbed-look check): fields those steps add are declared below; `extra="allow"` keeps a look readable
    while a step adds one that is not declared yet (the thin-stages piece gives the look one builder)."""
    model_config = ConfigDict(extra="allow")
    offered_rps: float
    num_prompts: int | None = None
    sent: int | None = None
    achieved_rps: float | None = None
    output_tps: float | None = None
    p50_tpot_ms: float | None = None   # vLLM's median TPOT over the look: what one user gets (the Pareto plot)
    goodput_rps: float | None = None
    completed: int | None = None
    failed: int | None = None
    duration_s: float | None = None
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    counted: int | None = None
    needed: int | None = None
    over_slo: int | None = None
    ramp_skipped: int | None = None
    window_open_s: float | None = None
    window_close_s: float | None = None
    e2e_p50_s: float | None = None
    settled: bool | None = None
    window_arrivals: int | None = None
    window_first_tokens: int | None = None
    window_completions: int | None = None
    window_allowance: float | None = None
    backlog: bool | None = None
    e2e_over_window: float | None = None
    seed: int | None = None
    stopped_early: bool | None = None
    cut: int | None = None             # requests cut in flight at the stop (vllm_compat.CUT): over the SLO
    busy: dict | None = None
    other_work_share: float | None = None
    busy_again: bool | None = None
    relooked: bool | None = None
    disturbed_look: DisturbedLook | None = None
    evidence: str | None = None
    pooled_counted: int | None = None
    pooled_over: int | None = None
    passed: bool | None = None
    why: str | None = None
    repeats: int | None = None
    visit_verdict: str | None = None
    frontend: FrontEndLook | None = None  # None: a look from before schema 3, or not watched


class DisturbedLook(Look):
    """A look that ran while other work kept the machine busy (knee_looks.probe): kept beside the look that replaced
    it, in its own file."""
    file: str | None = None


class Recheck(Closed):
    """A knee verdict re-checked on a fresh server (run.anchor.look): the rate, the side it re-checks, each rate's
    verdict as visited."""
    rate: float
    side: Literal["better", "worse"] | None = None
    verdicts: dict[str, str]


class ApiServers(Closed):
    """The `vllm serve` API-server processes asked for (serve.api_server_count; None: vLLM's default) and found
    running after the warm-up (engine.Server.api_servers)."""
    asked: int | None = None
    found: int


class KneeResult(Record):
    SCHEMA: ClassVar[int] = 3
    status: Status
    label: str | None = None           # common.KNEE_RECHECK, common.BENCH_ONLY, common.GATE_FAILED; None: a search
    reason: str | None = None          # n/a only: why nothing was measured
    mode: Literal["search", "sweep", "recheck"]
    method: str | None = None          # how it was found, in the report's words
    # the bracket (probing.knee_result): last pass and first fail, and what is known on evidence
    knee_rps: float | None = None
    last_pass_rps: float | None = None
    first_fail_rps: float | None = None
    conclusive_fail_rps: float | None = None
    bracket_rps: float | None = None
    mid_rps: float | None = None
    half_width_rps: float | None = None
    rel_width: float | None = None
    range_rps: list[float] | None = None
    resolved: bool = False
    confirmed: bool = False
    non_monotonic: bool = False
    mixed_rates: list[float] = []
    short_probes: bool = False
    probes: int = 0
    start_rate: float | None = None
    requests_sent: int = 0
    # at the knee's rate: the look that passed there
    goodput_at_knee_rps: float | None = None
    ttft_ms_at_knee: float | None = None
    tpot_ms_at_knee: float | None = None
    counted_at_knee: int | None = None
    output_tps_at_knee: float | None = None
    batch1: dict | None = None         # p50 TPOT/TTFT of requests sent one at a time (the roofline's batch-1)
    server_pass: dict | None = None    # output tok/s of knee.server_pass_prompts sent at once, through this server
    recheck: Recheck | None = None
    slo: config.Slo | None = None      # None only in a version-1 record that did not write it
    workload: dict | None = None       # workload.describe: what was sent
    shape: dict | None = None          # the request shape the knee holds for (input, output, prefix, arrivals)
    busy_share: float | None = None    # knee.busy_share the looks were checked against
    api_servers: ApiServers | None = None  # did serve.api_server_count take effect (None: no server measured)
    kv_cache_tokens: int | None = None
    max_concurrency: float | None = None
    # looks whose latency was added outside the engine (measure/frontend.summary); None: not instrumented (< 3)
    frontend_bound_looks: int | None = None
    frontend_words: str | None = None
    applied: dict[str, Any] = {}       # the server's own evidence of its config (decide.applied_check reads it)
    server_ready_s: float = 0
    wall_s: float = 0
    time: StageTime | None = None
    rows: list[Look] = []
    provenance: dict | None = None     # records.upstream.provenance; the ladder record leaves it in results/

    @model_validator(mode="before")
    @classmethod
    def _upgrade(cls, data: Any) -> Any:
        """Version 1 (untyped, before 2026-12-04): a p99-only SLO was spelled {p99_ttft_ms, p99_tpot_ms} and named
        its at-knee figures p99_*; a record from before `mode` was written was a search. Version 2: no look was
        watched (no `frontend`, no `frontend_bound_looks`: they read None)."""
        if not isinstance(data, dict) or data.get("schema_version", 1) >= 3:
            return data
        if data.get("schema_version", 1) == 2:
            return {**data, "schema_version": 3}
        data = dict(data)
        for old, new in (("p99_ttft_ms_at_knee", "ttft_ms_at_knee"), ("p99_tpot_ms_at_knee", "tpot_ms_at_knee")):
            if old in data:
                data.setdefault(new, data.pop(old))
        data.setdefault("mode", "recheck" if data.get("recheck") else "search")
        slo = data.get("slo") or {}
        if "p99_ttft_ms" in slo:  # the SLO spelled p99-only: {p99_ttft_ms, p99_tpot_ms}
            data["slo"] = {"percentile": 99, "ttft_ms": slo["p99_ttft_ms"], "tpot_ms": slo["p99_tpot_ms"]}
        data["schema_version"] = 3
        return data


class RungKnee(KneeResult):
    """The knee as a rung of the ladder record holds it (record.fill): the stage's record, less its provenance. The
    knee.noise_floor the ladder judged it with is the rung's own field beside it (RungRecord.knee_noise_floor)."""
