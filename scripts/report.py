"""Stage `report`: render report/ladder.json (written by `make ladder`) as report/before_after.md + plots.

Pure rendering: every number comes from the ladder file, which holds each rung's measured results.
Usage: python scripts/report.py [LADDER_JSON [OUT_DIR]]   (defaults: report/ladder.json report/)
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd
from tabulate import tabulate

import common
import config
from judgement import decide, stats
from judgement.decide import change_cell
from measure import disturbed, evidence
from records.bench import BenchResult
from records.gate import GateResult
from records.knee import Look, RungKnee
from records.ladder import AppliedCheck, Change, LadderRecord, Measured, RestedOn, Roofline, RungRecord


def fmt(v, spec=".1f", none="—"):
    return none if v is None else format(v, spec)


def pct(v, none="—"):
    return none if v is None else f"{v * 100:+.1f} %"


def na_label(r: RungRecord) -> str:
    """Why a rung has no accuracy, as its eval stage recorded it."""
    ev = r.eval
    return (ev and (ev.label or ev.reason)) or "not measured"


def acc_cell(r: RungRecord):
    ev = r.eval
    if ev and ev.status == "n/a":
        return f"n/a ({ev.label or ev.reason})"
    return fmt(ev and ev.overall, ".3f")


def regress_cell(r: RungRecord):
    g = r.gate
    if g is None:
        return "—"
    if not g.gated:
        return "not gated"
    bad = [f"{c} −{v.drop:.2f} ({v.evidence})" for c, v in g.by_category.items() if v.drop > 0]
    return "; ".join(bad) if bad else "none"


def na_cell(label: str | None) -> str:
    """A bench or knee result that measured nothing (status n/a), as its stage labelled why (its label, else its
    reason)."""
    return f"not measured: {label}" if label == common.GATE_FAILED else f"n/a ({label})"


def gate_skipped(r: RungRecord) -> bool:
    """Bench and knee measured nothing on this rung: its quality gate failed (gate.measure_failed false)."""
    return all(s is not None and s.label == common.GATE_FAILED for s in (r.bench, r.knee))


def no_tps(b: BenchResult | None) -> str | None:
    """A bench cell's words where it holds no output tok/s (not measured, or none read); None where it does."""
    if b and b.status == "n/a":
        return na_cell(b.label or b.reason)
    return "—" if b is None or b.output_tps is None else None


def tps_cell(r: RungRecord):
    b = r.bench
    if b is None or b.status == "n/a" or b.output_tps is None:
        return no_tps(b)
    ci = b.output_tps_ci95
    tail = f" [{ci[0]:.0f}–{ci[1]:.0f}]" if ci else ""
    return f"{b.output_tps:.0f}{tail} (n={b.repeats})"


def delta_cell(r: RungRecord):
    d = r.delta.output_tps if r.delta else None
    if d is None or d.rel is None:
        return "—"
    ci = d.ci or d.ci95  # ci95: records made before the interval's level was stated with it
    if ci:
        lo, hi = ci
        txt = f"{d.rel * 100:+.0f} % [{lo * 100:+.0f}, {hi * 100:+.0f}]"
    else:
        txt = f"{d.rel * 100:+.0f} %"
    return txt + (" within noise" if d.verdict == "within noise" else
                  f" ({d.verdict})" if d.verdict == "unknown" else "")


FRONT_END_FLAG = "the front end's knee, not the engine's"  # knee.json frontend_words (measure/frontend.summary)


def not_the_engine_s(frontend_words: str | None) -> bool:
    """Whether the knee's boundary look was bound outside the engine (the front end or the client): its
    frontend_words open with "this knee is the ..." (records before schema 3 say nothing)."""
    return (frontend_words or "").startswith("this knee is the")


def knee_cell(r: RungRecord):
    """The knee as its bracket: midpoint ± half-width, the confirmed pass and failure, and any flag."""
    k = r.knee
    if k is None:
        return "—"
    if k.status == "n/a":
        return na_cell(k.label or k.reason)
    if k.label == common.KNEE_RECHECK:  # one visit of one rate on a fresh server, no search
        rows = [x.model_dump(exclude_unset=True) for x in k.rows]  # stats reads a look as the file holds it
        return "re-check: " + "; ".join(
            "{:g} req/s {} ({} of {} over the SLO)".format(rate, *stats.rate_verdict(rows, rate))
            for rate in dict.fromkeys(x.offered_rps for x in k.rows))
    if k.status == "below":
        return f"< {fmt(k.first_fail_rps, 'g')} (SLO never met)"
    if k.status == "open":  # no pass, the lowest rate inconclusive (e.g. a search stopped at its verdict)
        known = k.conclusive_fail_rps
        return ((f"< {known:g} (fails there on evidence, " if known else "no pass or fail on evidence (")
                + f"{fmt(k.first_fail_rps, 'g')} inconclusive, no pass; {k.probes} probes)")
    if k.status == "above":
        return f"≥ {fmt(k.knee_rps, 'g')} (SLO met at every rate probed)"
    if k.mid_rps is None:  # a record from before the bracket was reported as midpoint ± half-width
        return f"{k.knee_rps:g} (breaks at {k.first_fail_rps:g})"
    flags = [f for f, on in (("a repeat disagreed", k.non_monotonic),
                             ("wider than knee.rel_tol", not k.resolved),
                             (evidence.SHORT_PROBE_FLAG, k.short_probes),
                             (FRONT_END_FLAG, not_the_engine_s(k.frontend_words))) if on]
    # a rate left inconclusive is no boundary; a record from before conclusive_fail_rps was written names none
    known = k.conclusive_fail_rps if "conclusive_fail_rps" in k.model_fields_set else k.first_fail_rps
    on_evidence = "" if known == k.first_fail_rps else f", on evidence {fmt(known, 'g', 'at no rate')}"
    return (f"{k.mid_rps:.3g} ± {k.half_width_rps:.2g} (passes {k.knee_rps:g}, breaks "
            f"{k.first_fail_rps:g}{on_evidence}; {k.probes} probes)"
            + (f" ⚠ {', '.join(flags)}" if flags else ""))


def slo_text(slo: config.Slo) -> str:
    """The SLO as the report states it."""
    p = slo.percentile
    return f"p{p:g} TTFT ≤ {slo.ttft_ms:g} ms, p{p:g} TPOT ≤ {slo.tpot_ms:g} ms"


def slo_of(lad: LadderRecord) -> config.Slo:
    """The SLO the ladder ran with: the driver states it in every record it writes (LadderRecord.slo is None only
    in a record no ladder wrote, which the report cannot render)."""
    assert lad.slo is not None, "the ladder record states no SLO"
    return lad.slo


VERDICT_CELL: dict[str | None, str] = {  # keyed by a verdict: a rung with none (None) reads its status
    "baseline": "baseline", "kept": "**kept**", "reverted": "reverted", "not chosen": "not chosen",
    "failed": "failed → reverted", "interrupted": "interrupted → reverted", "skipped": "skipped",
    "re-measure": "its base again", "knee re-check": "knee re-check"}


def kept_cell(r: RungRecord):
    """The verdict the ladder recorded (decide.verdict), as the table shows it."""
    return VERDICT_CELL.get(r.verdict, r.verdict or r.status)


MEASURED_STAGES = {"eval", "bench", "knee"}


def measured_cell(r: RungRecord):
    """Where the row's numbers come from: this run, DVC's run-cache (an earlier run on this same machine: the
    fingerprint is a dependency, so another machine's numbers are never restored), or another machine's experiment
    (`dvc exp pull`, taken as it was: compared only with that machine's)."""
    if r.status != "ok":
        return "—"
    m = r.measured or Measured()
    on = f" on machine {m.machine}" if m.machine else ""
    if r.replayed:
        return f"another machine's experiment{on} (measured {m.at or '?'})"
    where = f"host {m.host_id}" if m.host_id else "this machine"
    restored = sorted(MEASURED_STAGES & set(r.reused))
    if {"bench", "knee"} & set(restored):  # the speed figures: what the row is about (`at`: when bench measured)
        return f"restored ({where}{on}, measured {m.at or '?'})"
    return f"this run{on}" + (f" ({', '.join(restored)} restored)" if restored else "")


def machine_lines(lad: LadderRecord) -> list[str]:
    """The machines that measured the ladder, and where it moved: each row's numbers are compared only with its own
    machine's (a base is measured again on the machine the ladder moved to)."""
    seen: dict[str, str] = {}
    moves, last = [], None  # last: (machine, experiment) of the row before
    for r in lad.rungs + (lad.confirm.runs if lad.confirm else []):
        m = r.measured
        if r.status != "ok" or m is None or not m.machine:
            continue
        seen.setdefault(m.machine, m.machine_label or m.machine)
        if last and m.machine != last[0]:
            moves.append(f"moved after {last[1]} to machine {m.machine} ({r.exp})")
        last = (m.machine, r.exp)
    if len(seen) < 2:
        return []
    return ["- **Machines**: " + "; ".join(f"{k}: {v}" for k, v in seen.items()) + ". The ladder " + ", ".join(moves)
            + "; every Δ is between measurements of one machine (its base measured again where it moved), and the "
            "headline comes from the confirm step on one machine."]


def applied_cell(r: RungRecord):
    if not r.applied:
        return "—"
    return "; ".join(f"{c.knob}: {'✓' if c.applied else '✗ not applied' if c.applied is False else '?'} "
                     f"({c.observed})" for c in r.applied)


def roof_cell(r: RungRecord):
    rf = r.roofline
    if rf is None or not rf.tpot_floor_ms or not rf.tpot_low_load_ms:
        return "—"
    assert rf.pct_of_floor is not None  # record.roofline writes it wherever it wrote the low-load TPOT
    # a record from before tpot_measured_at was written measured at batch 1
    at = rf.tpot_measured_at if "tpot_measured_at" in rf.model_fields_set else "batch 1"
    at = "" if at == "batch 1" else f" ({at or 'low load'})"
    return (f"{rf.tpot_floor_ms:.1f} / {rf.tpot_low_load_ms:.1f} ms{at} ({rf.pct_of_floor * 100:.0f} %)"
            + target_floor(rf))


def target_floor(rf: Roofline) -> str:
    """An emulated card's floor beside the real one: its memory was emulated, its bandwidth was not."""
    if not rf.target_tpot_floor_ms:
        return ""
    return f"; {rf.target_gpu or 'target'} floor {rf.target_tpot_floor_ms:.1f} ms"


def kv_cell(r: RungRecord):
    """KV cache capacity and max concurrency the engine logged (the knee's server, else the bench's engine), and
    with a target card whether the engine ran inside its memory (decide.target_check)."""
    k, b = r.knee, r.bench
    tokens = (k.kv_cache_tokens if k else None) or (b.kv_cache_tokens if b else None)
    conc = (k.max_concurrency if k else None) or (b.max_concurrency if b else None)
    if tokens is None:
        return "—"
    check = next((c for c in r.applied if c.knob == "target"), None)
    return f"{tokens:,} tok · {fmt(conc, '.1f')}×" + ("" if check is None else f" · target {_mark(check)}")


def _mark(check: AppliedCheck) -> str:
    return "✓" if check.applied else "✗" if check.applied is False else "?"


def target_lines(lad: LadderRecord) -> list[str]:
    """The setup lines of an emulated card: what is emulated and what is not, and each conversion the rungs ran."""
    runs = [r for r in lad.rungs if r.target]
    if not runs:
        return []
    targets = [r.target for r in runs if r.target]  # common.target_engine's conversions, as recorded: one a run
    t = targets[0]
    conv = {(c.gpu_memory_utilization, c.fraction, c.budget_gib) for c in targets}
    lines = [f"- **Emulated card**: {t.name}, {t.memory_gib:g} GiB, on this {t.real_gpu} "
             f"({t.real_total_gib:g} GiB, nvidia-smi): gpu_memory_utilization keeps its meaning on the "
             f"{t.name} and the engine gets u × {t.memory_gib:g} / {t.real_total_gib:g} of this card: "
             + ", ".join(f"{u:g} → {f:g} ({g:g} GiB)" for u, f, g in sorted(conv)) + ".",
             f"- **Emulated**: memory capacity only — weights, activations, CUDA graphs and KV cache share the "
             f"{t.name}'s budget, so KV capacity and max concurrency are the {t.name}'s. **Not emulated**: "
             f"bandwidth, compute, PCIe: absolute tok/s and latencies are this {t.real_gpu}'s; the roofline "
             f"column gives the {t.name}'s floor beside this card's"
             + (f" ({t.bandwidth_gbs:g} GB/s)." if t.bandwidth_gbs else " (no target.bandwidth_gbs given).")]
    base = next((c for r in runs if r.role == decide.BASELINE for c in r.applied if c.knob == "target"), None)
    if base:  # rung 0's check (the other rungs' are under "took effect?")
        lines.append(f"- **Inside the budget?** rung 0: {_mark(base)} ({base.observed})")
    return lines


def gpus_cell(r: RungRecord):
    return "— (CPU)" if r.gpus is None else str(r.gpus)


def per_gpu_cell(r: RungRecord):
    """tok/s and knee per GPU, as recorded (capacity.per_gpu), beside the totals."""
    pg = r.per_gpu
    if pg is None:
        return "—"
    if gate_skipped(r) and r.knee is not None:  # (gate_skipped: it has one)
        return na_cell(r.knee.label or r.knee.reason)
    knee = "—" if pg.knee_rps is None else f"{pg.knee_rps:g}–{fmt(pg.first_fail_rps, 'g', '∞')}"
    return f"{fmt(pg.output_tps, '.0f')} tok/s · knee {knee} req/s"


def not_reproduced(lad: LadderRecord, why: bool = False) -> str | None:
    """Where the confirm step did not confirm the kept gains (record.confirm_summary's `verdict`): what the report
    says of them in its `words` (decide.confirm_words: did not reproduce; could not tell, with its power), naming
    the rungs they rested on (`why`: and the rule's reading of the pair); None where it confirmed them, or where no
    confirm step judged them."""
    conf = lad.confirm
    if conf is None or not conf.delta or not conf.words:
        return None
    words = conf.words
    rested = conf.rested_on or [RestedOn(name=r.name) for r in lad.rungs if r.kept and r.role != "baseline"]
    names = ", ".join(f"{r.name}" + (f" (kept on {r.on})" if r.on else "") for r in rested)
    read = (conf.reproduced_why or "").removeprefix("no measurable gain: ").removesuffix(
        "; the simpler config stays")
    how = ("the confirm step does not show the final stack better than rung 0 by the rule, and its intervals "
           "exclude the gains the kept rungs read" if conf.reproduced is False else
           "the confirm step does not show the final stack better than rung 0 by the rule, nor do its intervals "
           "exclude the gains the kept rungs read")
    return f"{words}: {how}" + (f" ({read})" if why and read else "") + f"; they rested on {names or 'no kept rung'}"


def kept_suffix(lad: LadderRecord) -> str:
    """What a kept rung's cell adds where the confirm step did not confirm the kept gains."""
    conf = lad.confirm
    if not conf or not conf.delta or not conf.words:
        return ""
    return " (not reproduced)" if conf.reproduced is False else " (confirm: could not tell)"


def table(lad: LadderRecord) -> str:
    """The appendix: a row a rung."""
    rows = []
    unconfirmed = kept_suffix(lad)
    for r in lad.rungs:
        rows.append({"stage": f"{r.index} {r.name}", "change": change_cell(r), "eval acc": acc_cell(r),
                     "per-category regressions": regress_cell(r), "output tok/s [95 % CI]": tps_cell(r),
                     "Δ vs base": delta_cell(r),
                     "speedup vs baseline": fmt(r.speedup, ".2f") + "×" if r.speedup else "—",
                     "knee req/s @ SLO": knee_cell(r), "GPUs": gpus_cell(r), "per GPU": per_gpu_cell(r),
                     "KV cache · max concurrency": kv_cell(r), "roofline: TPOT floor / batch-1 TPOT": roof_cell(r),
                     "kept?": kept_cell(r) + (unconfirmed if r.verdict == "kept" else ""),
                     "measured": measured_cell(r)})
    return tabulate(pd.DataFrame(rows), headers="keys", tablefmt="github", showindex=False)


# ---------------------------------------------------------------- the first screen (issue 55)
# What a reviewer pastes into a design review: the seed's 7 columns and one line a rung naming the figure that
# decided it. Every figure here is also in the sections below (the appendix holds the long table), so a cell may be
# short: a doubted line is opened there, never re-derived here.
MARKS = {"front end": "†", "disturbed": "‡", "knee flag": "§", "cold KV": "¶"}
KV_SHORT = 0.01  # a bench engine's KV tokens this far under its own server's: not the start the server had
REGRESS_WIDTH = 24  # the regressions cell: as wide as its header, so the seed table fits a screen


def short_ci(lo: float, hi: float, spec: str = ".0f") -> str:
    return f"[{format(lo, spec)}–{format(hi, spec)}]"


def was_disturbed(res: BenchResult | RungKnee | None) -> bool:
    """Whether measure/disturbed flagged a bench repeat or a knee look here (and measured it again)."""
    if isinstance(res, BenchResult):
        return bool(res.disturbed)
    return res is not None and any(row.disturbed_look for row in res.rows)


def knee_flags(k: RungKnee | None) -> list[str]:
    """The knee cell's warnings other than the front end's (that one has its own mark)."""
    if k is None:
        return []
    return [f for f, on in (("a repeat disagreed", k.non_monotonic),
                            ("wider than knee.rel_tol", k.mid_rps is not None and not k.resolved),
                            (evidence.SHORT_PROBE_FLAG, k.short_probes)) if on]


def short_tps(r: RungRecord) -> str:
    b = r.bench
    if (words := no_tps(b)) is not None:
        return words
    assert b is not None and b.output_tps is not None  # no_tps has words for every bench without a tok/s
    ci = b.output_tps_ci95
    return (f"{b.output_tps:.0f}" + (f" {short_ci(ci[0], ci[1])}" if ci else "")
            + (MARKS["disturbed"] if was_disturbed(b) else "") + (MARKS["cold KV"] if short_kv(r) else ""))


def short_knee(k: RungKnee | None) -> str:
    """The knee as its bracket, last pass–first fail on evidence (req/s), with a mark for each flag."""
    if k is None:
        return "—"
    if k.status == "n/a":
        return na_cell(k.label or k.reason)
    if k.label == common.KNEE_RECHECK:
        rows = [x.model_dump(exclude_unset=True) for x in k.rows]  # stats reads a look as the file holds it
        rates = dict.fromkeys(x.offered_rps for x in k.rows)
        return "re-check " + ", ".join(f"{rate:g} {stats.rate_verdict(rows, rate)[0]}" for rate in rates)
    # a record from before conclusive_fail_rps was written names the first failure as the evidence
    fail = k.conclusive_fail_rps if "conclusive_fail_rps" in k.model_fields_set else k.first_fail_rps
    if k.status == "above":
        cell = f"≥ {fmt(k.knee_rps, 'g')}"
    elif k.knee_rps is None:  # below or open: no pass; a fail on evidence bounds it, an inconclusive one not
        cell = f"< {fail:g}" if fail else "no pass"
    else:
        cell = f"{k.knee_rps:g}–{fmt(fail, 'g', '?')}"
    marks = ((MARKS["front end"] if not_the_engine_s(k.frontend_words) else "")
             + (MARKS["disturbed"] if was_disturbed(k) else "") + (MARKS["knee flag"] if knee_flags(k) else ""))
    return cell + marks


def short_regress(r: RungRecord) -> str:
    """The categories that lost accuracy against rung 0, worst first, as many as fit REGRESS_WIDTH (then "+N");
    ✗ marks one the gate found regressed on evidence."""
    g = r.gate
    if g is None or not g.gated:
        return "—" if g is None else "not gated"
    failed = set(g.regressed_categories)
    drops = sorted(((v.drop, c) for c, v in g.by_category.items() if v.drop > 0), reverse=True)
    words = [f"{c} −{d:.2f}" + ("✗" if c in failed else "") for d, c in drops]
    cell = ""
    for i, w in enumerate(words):
        more = f" +{len(words) - i - 1}" if i < len(words) - 1 else ""
        if i and len(f"{cell}, {w}{more}") > REGRESS_WIDTH:
            return f"{cell} +{len(words) - i}"
        cell = f"{cell}, {w}" if cell else w
    return cell or "none"


def glance_table(lad: LadderRecord) -> str:
    """The seed's table: stage, eval acc, per-category regressions, output tok/s, speedup, knee req/s @ SLO, kept?
    A stage reads "#N name": the appendix's long table keeps "N name" for its rows."""
    unconfirmed = kept_suffix(lad)
    rows = [{"stage": f"#{r.index} {r.name}", "eval acc": acc_cell(r),
             "per-category regressions": short_regress(r), "output tok/s": short_tps(r),
             "speedup": f"{r.speedup:.2f}×" if r.speedup else "—",
             "knee req/s @ SLO": short_knee(r.knee),
             "kept?": kept_cell(r) + (unconfirmed if r.verdict == "kept" else "")}
            for r in lad.rungs]
    return pipe_table(rows)


def short_kv(r: RungRecord) -> tuple[int, int] | None:
    """(the bench engine's KV tokens, its knee server's) where the bench's are more than KV_SHORT fewer, else None.
    The two are one config on one card, so vLLM sizes their KV caches alike, except after a start that compiled cold:
    its torch.compile scratch is charged to the profiled activation peak and the KV cache comes out smaller until a
    warm restart (vLLM issue 54122; an H100 server read 104,064 tokens cold against 118,160, docs/measurements.md
    2026-12-06). A rung's bench engine is the first start of its config, its server a later one: where KV binds,
    that tok/s reads low."""
    tb = r.bench.kv_cache_tokens if r.bench else None
    tk = r.knee.kv_cache_tokens if r.knee else None
    return (tb, tk) if tb and tk and tb < tk * (1 - KV_SHORT) else None


def pipe_table(rows: list[dict]) -> str:
    """A markdown table as narrow as its cells: tabulate pads every column by two more, 14 characters of 7 columns."""
    cols = list(rows[0]) if rows else []
    width = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in cols}

    def line(cells) -> str:
        return "| " + " | ".join(str(v).ljust(width[c]) for c, v in zip(cols, cells)) + " |"
    return "\n".join([line(cols), "|" + "|".join("-" * (width[c] + 2) for c in cols) + "|",
                      *(line([r[c] for c in cols]) for r in rows)])


def glance_notes(lad: LadderRecord) -> list[str]:
    """What the table's cells mean, and a footnote for each mark it carries, naming the rows."""
    named: dict[str, list[str]] = {key: [] for key in MARKS}
    for r in lad.rungs:
        k, who = r.knee, f"#{r.index}"
        named["front end"] += [who] if k and not_the_engine_s(k.frontend_words) else []
        named["disturbed"] += [who] if was_disturbed(r.bench) or was_disturbed(k) else []
        named["knee flag"] += [f"{who} {', '.join(knee_flags(k))}"] if knee_flags(k) else []
        named["cold KV"] += [f"{who} ({kv[0]:,} against {kv[1]:,})"] if (kv := short_kv(r)) else []
    words = {"front end": f"{FRONT_END_FLAG} (its looks' latency was added outside the engine: What I kept and why)",
             "disturbed": "a measurement flagged disturbed and measured again (Disturbed measurements)",
             "knee flag": "a knee with a warning",
             "cold KV": ("the bench engine held fewer KV tokens than its own server (a start with no compile cache, "
                         "vLLM issue 54122): where KV binds its tok/s reads low")}
    notes = [f"{MARKS[key]} {words[key]}: {', '.join(who)}" for key, who in named.items() if who]
    one = timed_passes(lad) == 1  # one timed pass an engine: no interval inside it
    return [f"Output tok/s: {'one timed pass' if one else 'median [95 % CI]'}; speedup vs rung 0; knee: last "
            f"pass–first fail on evidence at the SLO "
            f"({slo_text(slo_of(lad))}); regressions: accuracy lost per category vs rung 0 (✗ failed the gate). "
            "Each figure's evidence (Δ intervals, engines, servers, counts per look): the sections below.",
            *[f"- {n}" for n in notes]]


LINE_WIDTH = 200  # a kept-why line: one line of a design review


def clip(text: str, width: int = LINE_WIDTH) -> str:
    """Free text (an error, a gate's reason) cut to the line's width: its whole words are in the sections below."""
    return text if len(text) <= width else text[:width - 1].rstrip(" ;,") + "…"


def pct_ci(d: Change) -> str:
    """A Δ as the first screen shows it: +25 % [+17, +33]."""
    ci = d.ci or d.ci95
    assert d.rel is not None  # tps_figure: only a Δ that read one
    return f"{d.rel * 100:+.0f} %" + (f" [{ci[0] * 100:+.0f}, {ci[1] * 100:+.0f}]" if ci else "")


def tps_figure(d: Change | None) -> str | None:
    if d is None or d.rel is None:
        return None
    return f"tok/s{' per GPU' if d.per_gpu else ''} {pct_ci(d)}"


def rung_of(lad: LadderRecord, exp: str | None) -> RungRecord | None:
    return next((b for b in lad.rungs if exp and b.exp == exp), None)


def knee_point(r: RungRecord | None, per_gpu: bool) -> str:
    """A rung's knee (last pass) as the line names it; per GPU where its Δ was drawn per GPU."""
    k = None if r is None else r.per_gpu if per_gpu and r.per_gpu else r.knee
    return "no pass" if k is None or k.knee_rps is None else f"{k.knee_rps:g}"


def knee_figure(r: RungRecord, lad: LadderRecord) -> str | None:
    """The knee's move vs the base, and on how many servers a side it held where fresh servers re-checked it."""
    d = r.delta.knee_rps if r.delta else None
    if d is None or (d.rel is None and d.verdict == "unknown"):
        return None
    per = bool(d.per_gpu)
    was, now = knee_point(rung_of(lad, r.base), per), knee_point(r, per)
    txt = f"knee{' per GPU' if per else ''} " + (f"{was} → {now} req/s" if now != "no pass" else
                                                  f"{was} req/s → no pass")
    if d.recheck is not None:  # stats.knee_recheck: read `first` on one server a side, then fresh pairs
        held = d.verdict == d.first
        txt += (f" on {len(d.recheck) + 1} servers a side" if held else
                f" (read {d.first} on one server a side, not on fresh ones)")
    return txt


def verdict_of(d: Change | None) -> str | None:
    return d.verdict if d else None


def with_verdict(fig: str | None, d: Change | None) -> str | None:
    return fig and f"{fig} ({verdict_of(d)})"


def speed_words(r: RungRecord, lad: LadderRecord, cost: str = "") -> str:
    """The figure that decided a measured rung first (decide.rests_on_tps), the other after it with its verdict, then
    `cost` (quality_cost)."""
    because = ""
    dk, dt = (r.delta.knee_rps, r.delta.output_tps) if r.delta else (None, None)
    knee, tps = knee_figure(r, lad), tps_figure(dt)
    if r.kept:
        # decide reads a rung as the driver builds it, a dict; the Δ is the part it reads
        on_tps = decide.rests_on_tps(r.model_dump(include={"delta"}), lad.objective or "knee_rps") if dk else True
        first, then = (tps, with_verdict(knee, dk)) if on_tps else (knee, with_verdict(tps, dt))
        if verdict_of(dt if on_tps else dk) != "better":  # an older rule kept what got no worse: it says so
            because = (r.decision or "").partition("kept because ")[2].split(";")[0]
            first = with_verdict(first, dt if on_tps else dk)
    elif verdict_of(dk) == "worse":
        first, then = f"{knee} (worse)", with_verdict(tps, dt)
    elif verdict_of(dt) == "worse":
        first, then = f"{tps} (worse)", with_verdict(knee, dk)
    else:
        lead = "not confirmed: " if verdict_of(dt) == "better" else "no measurable gain: "
        first, then = lead + (with_verdict(tps, dt) or "tok/s not measured"), with_verdict(knee, dk)
    return ((", ".join(x for x in (first, then) if x) or "no speed measured") + cost
            + (f"; kept because {because}" if because else ""))


def quality_cost(r: RungRecord) -> str:
    """What a rung cost in accuracy vs rung 0, as its gate read it."""
    g = r.gate
    if g is None or not g.gated or g.overall is None:
        return ""
    pts = (g.overall.rung - g.overall.baseline) * 100
    return " at no accuracy cost" if pts >= 0 else f" at acc {pts:+.1f} pts vs rung 0"


def gate_words(g: GateResult) -> str:
    """A failed gate in a few words: the categories (or overall) it failed on, rung 0's accuracy → the rung's."""
    cats = g.by_category
    failed = [(c, cats[c]) for c in g.regressed_categories if c in cats]
    if not failed and g.overall is not None and g.overall.evidence == "regressed":
        failed = [("overall", g.overall)]
    if not failed:
        return "quality gate failed: " + (g.reasons or ["no reason recorded"])[0].split(";")[0]
    words = [f"{c} {v.baseline:.2f} → {v.rung:.2f}" for c, v in failed[:2]]
    return "quality gate failed: " + ", ".join(words) + (f" +{len(failed) - 2}" if len(failed) > 2 else "")


def early_words(r: RungRecord) -> str | None:
    """Why a rung was reverted before its speed counted (decide.reverted_before_speed), in a few words."""
    if r.status != "ok":
        return r.error or r.decision or r.status
    g = r.gate
    if g is not None and g.gated and not g.keep:
        return gate_words(g)
    off = [c.knob for c in r.applied if c.applied is False]
    return f"not applied: {', '.join(off)}" if off else None


def why_line(r: RungRecord, lad: LadderRecord) -> str:
    """One rung in the seed's form: "Rung N name: kept — <figure> at <quality cost>", at most LINE_WIDTH."""
    verdict = kept_cell(r).replace("**", "") + (kept_suffix(lad) if r.verdict == "kept" else "")
    head = f"Rung {r.index} {r.name}: {verdict} — "
    early = early_words(r)
    measured = r.delta and (r.delta.output_tps or r.delta.knee_rps)
    if early:
        speed = f"; {speed_words(r, lad)}" if measured and not gate_skipped(r) else ""
        return clip(head + clip(early, LINE_WIDTH - len(head) - len(speed)) + speed)
    body = speed_words(r, lad, quality_cost(r))
    if r.verdict == "not chosen":
        body += "; " + (r.decision or "").rsplit("not chosen: ", 1)[-1]
    return clip(head + body)


def why_lines(lad: LadderRecord) -> list[str]:
    """The kept-why lines of the first screen: every rung but rung 0, re-measures and re-checks (they are evidence
    a rung's line rests on: the section below names them)."""
    return [f"- {why_line(r, lad)}" for r in lad.rungs
            if r.role not in (decide.BASELINE, *decide.RE_MEASURES)]


def first_screen(lad: LadderRecord) -> list[str]:
    """The seed's table, its notes, one line a rung, and where the evidence is."""
    return [glance_table(lad), "", *glance_notes(lad), "",
            "**What I kept and why**, one line a rung: the figure that decided it, at what quality cost:",
            *why_lines(lad), "",
            "Evidence for every line: [Setup](#setup) · [What I kept and why](#what-i-kept-and-why) · "
            "[Disturbed measurements](#disturbed-measurements) · [Capacity plan](#capacity-plan) · [Plots](#plots) · "
            "[Time](#time) · [the full table](#appendix-the-full-table)"]


def headline(lad: LadderRecord) -> str:
    rungs = [r for r in lad.rungs if r.status == "ok"]
    base = next((r for r in rungs if r.role == "baseline"), None)
    final = next((r for r in lad.rungs if r.exp == lad.final_exp), base)
    if not base or not final:
        return "No baseline was measured: no headline."
    kept = [r.name for r in lad.rungs if r.kept and r.role != "baseline"]
    assert base.bench and final.bench and base.eval and final.eval  # measured rungs: each stage wrote its record
    bt, ft = base.bench.output_tps, final.bench.output_tps
    conf = lad.confirm
    if conf and conf.delta:  # the confirm step measured both back to back: the headline is that pair
        # decide reads the step as record.confirm_summary builds it, a dict
        said = decide.reproduced_words(conf.model_dump(exclude_unset=True))
        tps = (f"{conf.summary} (confirm step: baseline and final re-measured on fresh engines and servers, "
               f"interleaved, {conf.pairs} pair(s)" + (f"; {said})" if said else ")"))
    elif ft is None:  # a final stack the offline bench cannot run (data parallel): its knee is the figure
        tps = f"{bt:.0f} output tok/s → n/a ({final.bench.label or final.bench.reason})"
    else:
        assert bt is not None  # rung 0's tok/s: the headline starts from it
        tps = (f"{bt:.0f} output tok/s → {ft:.0f} tok/s ({ft / bt:.2f}×; rung 0 and the final rung as the ladder "
               f"measured them: {(conf and (conf.why or conf.summary)) or 'no confirm step'})")
    be, fe = base.eval, final.eval
    if be.status == "ok" and fe.status == "ok":
        assert be.overall is not None and fe.overall is not None  # an eval that measured holds its accuracy
        acc = f"acc {be.overall:.3f} → {fe.overall:.3f} ({(fe.overall - be.overall) * 100:+.1f} pts)"
    else:
        acc = f"accuracy n/a ({na_label(final if fe.status != 'ok' else base)})"
    k = final.knee
    slo = slo_of(lad)
    p = f"p{slo.percentile:g}"
    at_knee = (f"{p} TTFT {fmt(k.ttft_ms_at_knee, '.0f')} ms / TPOT {fmt(k.tpot_ms_at_knee, '.1f')} ms "
               f"at {fmt(k.knee_rps, 'g')} req/s (SLO {slo_text(slo)})"
               if k and k.knee_rps is not None
               else f"no rate met the SLO ({slo_text(slo)})")
    tot = lad.time  # the Time section's total; a record from before it: the engine stages' time
    minutes, cost = (tot.minutes, tot.cost_usd) if tot else ((lad.engine_seconds or 0) / 60, lad.cost_usd)
    gone = not_reproduced(lad)
    return (f"**{base.model} {tps} with "
            f"{' + '.join(kept) or 'nothing kept'}; " + (f"{gone}; " if gone else "") + f"{acc}; {at_knee}; "
            f"{minutes:.1f} {'GPU' if lad.environment.device == 'gpu' else 'CPU'}-minutes"
            + (" in all (Time)" if tot else " measured")
            + (f" ≈ ${cost:.2f}" if cost else "") + ".**")


def kernels_text(facts: dict | None) -> str | None:
    """What one engine said it ran (vllm_compat.engine_facts): attention backend, weight kernels, KV cache dtype;
    None where its log named none of them."""
    facts = facts or {}
    attn = facts.get("attention_backend")
    if attn and facts.get("flash_attn_version"):
        attn += f" (FA{facts['flash_attn_version']})"
    weights = (", ".join(facts.get("kernels") or []) or
               (None if "quantization" not in facts else
                f"{facts['quantization']} (kernel not logged)" if facts["quantization"] else "unquantized"))
    kv = facts.get("kv_cache_dtype_logged") or facts.get("kv_cache_dtype")
    if not (attn or weights or kv):
        return None
    return f"attention {attn or 'not logged'}, weights {weights or 'not logged'}, KV {kv or 'not logged'}"


def stage_kernels(r: RungRecord) -> dict:
    """stage -> the kernels its engine ran (eval: the gate's flips come from it; bench; knee)."""
    per = {stage: kernels_text(facts) for stage, facts in (("eval", r.eval.engine if r.eval else None),
                                                           ("bench", r.bench.engine if r.bench else None),
                                                           ("knee", r.knee.applied if r.knee else None))}
    return {stage: text for stage, text in per.items() if text}


def kernels_cell(per: dict) -> str:
    if len(set(per.values())) == 1:
        return f"{next(iter(per.values()))} ({', '.join(per)})"
    return "; ".join(f"{stage}: {text}" for stage, text in per.items())


def kernels_line(r: RungRecord, lad: LadderRecord) -> list[str]:
    """A rung's kernels beside its flips, and its base's where they differ: a GPU-only regression is attributable."""
    mine = stage_kernels(r)
    if not mine:
        return []
    base = next((b for b in lad.rungs if b.exp and b.exp == r.base), None)
    theirs = stage_kernels(base) if base else {}
    tail = ("" if not theirs or base is None else
            f"; same as its base ({base.index} {base.name})" if set(theirs.values()) == set(mine.values()) else
            f"; its base ({base.index} {base.name}): {kernels_cell(theirs)}")
    return [f"  - kernels: {kernels_cell(mine)}{tail}"]


def kept_why(lad: LadderRecord) -> list[str]:
    gone = not_reproduced(lad, why=True)
    lines = [f"- ⚠ **Confirm step**: {gone}."] if gone else []
    for r in lad.rungs:
        if r.role == "baseline":
            continue
        change = ", ".join(f"`{k}: {v}`" for k, v in (r.change or {}).items())
        if r.role in ("re-measure", "knee re-check"):  # not a rung: evidence its rung's verdict rests on
            lines.append(f"- *{r.name}* (no change): {r.decision or r.error or ''}")
            continue
        lines.append(f"- **{r.name}** ({change}): {kept_cell(r).replace('**', '')} — {r.decision or ''}")
        if r.applied:
            lines.append(f"  - took effect? {applied_cell(r)}")
        if gate_skipped(r) and r.knee is not None:  # reverted by the gate: no engine started to measure its speed
            lines.append(f"  - bench and knee: not measured — {r.knee.reason}")
        elif r.bench and r.bench.status == "n/a":  # the offline engine (bench, eval) cannot run it
            lines.append(f"  - bench and eval: n/a — {r.bench.reason}")
        if r.knee and r.knee.frontend_bound_looks:  # where its looks' latency came from (issue 50)
            lines.append(f"  - knee: {r.knee.frontend_words}")
        lines += kernels_line(r, lad)
        lines += flip_lines(r.gate)
    return lines


def flip_lines(gate: GateResult | None) -> list[str]:
    """The items a rung flipped against rung 0, per category where the gate recorded them (older records: all)."""
    if gate is None:
        return []
    # a category's flips as written, even both empty: then the record's own are not shown instead
    cats = {c: v.flipped for c, v in gate.by_category.items() if v.flipped and v.flipped.model_fields_set}
    groups = cats or {"": gate.flipped}
    lines = []
    for c, f in groups.items():
        if f.right_to_wrong or f.wrong_to_right:
            lines.append(f"  - {c + ': ' if c else ''}flipped right→wrong: "
                         f"{', '.join(f.right_to_wrong) or 'none'}; "
                         f"wrong→right: {', '.join(f.wrong_to_right) or 'none'}")
    return lines


def gate_power_lines(lad: LadderRecord) -> list[str]:
    """What the quality gate can see, per category: the drop the eval set can detect and the eval's own noise,
    as rung 0's gate recorded them (empty for records from before the gate recorded its power)."""
    gate = next((r.gate for r in lad.rungs if r.gate and r.gate.gated), None)
    cats = {c: v for c, v in (gate.by_category if gate else {}).items() if "detectable_drop" in v.model_fields_set}
    if not cats or gate is None:
        return []
    g = gate.thresholds
    assert g is not None  # a gate that recorded its power recorded the thresholds it judged with
    floor = gate.noise_floor
    lines = ["## What the quality gate can see", "",
             f"Threshold: a category drop > {g.max_category_drop} with McNemar p < {g.alpha}; "
             + ("nondeterminism floor (rung 0 evaluated twice): "
                f"{sum(floor.values())} item(s) flipped by themselves." if floor is not None
                else "nondeterminism floor: not measured."), ""]
    for c, v in cats.items():
        base = f"rung 0 {round(v.baseline * v.n)}/{v.n} right"
        if v.detectable_flips is None:
            lines.append(f"- {c}: this set cannot detect any drop at α {g.alpha} ({v.n} items, "
                         f"floor {v.noise_flips}); {base}: **cannot judge**")
            continue
        judge = "" if v.can_detect_threshold else f": **cannot judge** a drop of {g.max_category_drop}"
        if round(v.baseline * v.n) < v.detectable_flips:  # too few right to lose: no regression can show
            judge += f" (fewer right than the {v.detectable_flips} flips a regression needs)"
        lines.append(f"- {c}: this set can detect a drop of ≥ {v.detectable_drop:.2f} "
                     f"({v.detectable_flips} of {v.n} items, floor {v.noise_flips} included); {base}{judge}")
    return lines + [""]


def workload(lad: LadderRecord) -> dict:
    """The workload as the stages recorded it (bench and knee send the same one): text and shared-prefix line."""
    for r in lad.rungs:
        if r.bench and r.bench.workload:
            return r.bench.workload.model_dump()
        if r.knee and r.knee.workload:
            return r.knee.workload
    b, k = lad.settings["bench"], lad.settings["knee"]  # the params the ladder ran with
    if "input_len" in b:  # a ladder from before the stages described their workload: its lengths only
        return {"text": f"{b['input_len']} in / {b['output_len']} out tokens per request in bench, "
                        f"{k.get('input_len')} / {k.get('output_len')} in knee", "shared_prefix": "not recorded"}
    return {"text": "not recorded (no stage finished)", "shared_prefix": "not recorded"}


def header(lad: LadderRecord) -> list[str]:
    env = lad.environment
    hw = env.gpu
    if not hw:
        assert env.cpu is not None  # the fingerprint names the CPU of a box without a GPU
        hw = f"CPU: {env.cpu.model} ({env.cpu.cores} cores, {env.cpu.memory_gib} GiB)"
    slo, w = slo_of(lad), workload(lad)
    base = next((r for r in lad.rungs if r.status == "ok"), None)  # the stages say how they measured
    ev, gate = base and base.eval, base and base.gate
    lines = [
        f"- **Machine**: {hw}"
        + (f", driver {env.driver}, CUDA {env.cuda_driver}" if env.driver else "")
        + (f"; GPU UUID {', '.join(g.uuid for g in env.gpus if g.uuid)}" if any(g.uuid for g in env.gpus) else "")
        + (f"; host id {env.host_id}" if env.host_id else ""),
        f"- **Software**: {env.vllm_package} {env.vllm}, torch {env.torch}, "
        f"transformers {env.transformers}, Python {env.python}; git {str(lad.git_commit)[:12]}",
        "- **Models**: " + "; ".join(f"{n}: {m.get('id')} @ {str(m.get('revision'))[:12]}"
                                     for n, m in lad.models.items()),
        f"- **SLO**: {slo_text(slo)}, no failed request, no backlog",
        f"- **Workload** (bench and knee alike): {w['text']}",
        f"- **Shared prefix?** {w['shared_prefix']}",
        f"- **Throughput**: {(base and base.bench and base.bench.method) or 'not recorded'}",
        *floor_lines(lad),
        *machine_lines(lad),
        f"- **Latency**: {(base and base.knee and base.knee.method) or 'not recorded'}",
        f"- **Quality**: {ev.method}; {(gate and gate.method) or 'gate not recorded'}" if ev and ev.status == "ok"
        else f"- **Quality**: n/a: {(ev and ev.reason) or 'not recorded'}; every rung is \"not gated\"",
        "- **Metrics**: TTFT = time to first token (includes queueing); TPOT = (E2E − TTFT) / (output tokens − 1), "
        "i.e. excluding the first token; ITL = gap between streamed tokens; goodput = completed requests/s that met "
        "both SLO bounds (vLLM `--goodput`); knee = highest offered rate meeting the SLO; "
        "speedup = output tok/s ÷ rung 0's",
    ]
    lines.append("- **Roofline**: batch-1 decode floor = bytes read per step (weights at their bit width + KV) ÷ the "
                 "GPU's datasheet bandwidth, vs the p50 TPOT of the knee stage's batch-1 probe (`knee.batch1_requests` "
                 "requests one at a time; older records: the lowest probed rate) (% of the floor reached); "
                 "n/a on CPU")
    return lines + target_lines(lad)


def _range(v, rng, spec="g", pre=""):
    """A planned figure with the range its knee's bracket allows: `11 (9–11)`; `≤ 11` where no rate failed."""
    if v is None:
        return "—"
    lo, hi = rng or (None, None)
    if lo is None:
        return f"{pre}{format(v, spec)} (an upper bound: the SLO held at every probed rate)"
    return f"{pre}{format(v, spec)} (bracket {pre}{format(lo, spec)}–{pre}{format(hi, spec)})"


def capacity_lines(lad: LadderRecord) -> list[str]:
    """The capacity plan the ladder recorded (capacity.plan), as it is: nothing is computed here."""
    cap = lad.capacity
    if cap is None:
        return ["No capacity plan in this record."]
    gpu = cap.unit == "GPU"
    lines = [f"Serving a peak of **{cap.peak_rps:g} req/s** of the knee workload at the SLO ({slo_text(slo_of(lad))}), "
             "each instance held to "
             f"{(1 - cap.headroom) * 100:.0f} % of its knee (headroom {cap.headroom:g})"
             + (f", at ${cap.price_per_gpu_hour:.2f} per GPU-hour." if cap.price_per_gpu_hour else
                "; no price (cost.gpu_price_per_hour is 0): instances only, no cost.")
             + (" One GPU per instance: the plan is N single-GPU instances." if gpu and all(
                 (p.gpus_per_instance or 1) == 1 for p in (cap.before, cap.after)) else ""), ""]
    rows = []
    for p, label in ((cap.before, "before (rung 0)"), (cap.after, "after (final stack)")):
        k = p.knee
        knee = (f"{k.rung} ({k.exp}): knee {fmt(k.knee_rps, 'g')} req/s, breaks at "
                f"{fmt(k.first_fail_rps, 'g', 'no probed rate')}")
        if p.plan != "ok":
            rows.append({"": label, "knee it comes from": knee, "instances": f"no plan: {p.why}"})
            continue
        row = {"": label, "knee it comes from": knee, "instances": _range(p.instances, p.instances_range)}
        if gpu:
            row.update({"GPUs per instance": p.gpus_per_instance, "GPUs": _range(p.gpus, p.gpus_range)})
        else:
            row["GPUs"] = "n/a (CPU instances)"
        row["$ per 1 M output tokens at the knee"] = (
            _range(p.usd_per_m_output_tokens, p.usd_per_m_output_tokens_range, ".3f", "$")
            if p.usd_per_m_output_tokens is not None else p.why_no_cost or "—")
        rows.append(row)
    lines += [tabulate(pd.DataFrame(rows).fillna("—"), headers="keys", tablefmt="github", showindex=False), ""]
    sv, unit = cap.saved, ("GPUs" if gpu else "instances")
    if sv.plan != "ok":
        lines.append(f"**Tune vs scale**: no plan — {sv.why}.")
    else:
        assert sv.saved_range is not None and sv.unit is not None  # a plan that is ok states both
        lo, hi = sv.saved_range
        b, a = getattr(cap.before, sv.unit), getattr(cap.after, sv.unit)  # the side plans' figure it compared
        lines.append(f"**Tune vs scale**: at {cap.peak_rps:g} req/s the ladder saves **{sv.saved} {unit}** "
                     f"({b} → {a}, planned on the knees); over the knee brackets between "
                     f"{fmt(lo, 'g', '?')} and {fmt(hi, 'g', '?')}.")
    lines += ["", f"Method: {cap.method}"] + ([f"Note: {cap.added}."] if cap.added else [])
    return lines


EVIDENCE_MARK = {"pass": ("o", "tab:green"), "fail": ("X", "tab:red"), "inconclusive": ("d", "tab:orange")}


def probe_evidence(rows: list[Look]) -> list[dict]:
    """One point per probed rate: its visit's last probe carries the pooled counts and the verdict (a failed request
    or a backlog fails it whatever the count)."""
    last = {}
    for r in rows:
        last[r.offered_rps] = r
    out = []
    for rate, r in sorted(last.items()):
        ev = r.evidence or ("pass" if r.passed else "fail")
        if not r.passed and (r.failed or r.backlog):
            ev = "fail"
        # a look from before a visit pooled its probes: its own counts
        over = r.pooled_over if "pooled_over" in r.model_fields_set else r.over_slo
        counted = r.pooled_counted if "pooled_counted" in r.model_fields_set else r.counted
        out.append({"rate": rate, "evidence": ev, "over": over, "counted": counted})
    return out


def plots(lad: LadderRecord | dict, out: Path) -> None:
    """knee.png, rungs.png and pareto.png into `out`."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rec = as_record(lad)
    knee_plot(rec, out, plt)
    rungs_plot(rec, out, plt)
    pareto_plot(rec, out, plt)
    plt.close("all")


def knee_plot(lad: LadderRecord, out: Path, plt) -> None:
    import matplotlib
    slo = slo_of(lad)
    searched = [r for r in lad.rungs + (lad.confirm.runs if lad.confirm else []) if r.knee and r.knee.rows]
    fig, ax = plt.subplots(figsize=(11, 0.55 * len(searched) + 1.8))
    for y, r in enumerate(reversed(searched)):
        k = r.knee
        assert k is not None  # searched: rungs with knee rows
        # a record from before conclusive_fail_rps was written names the first failure as the evidence
        lo = k.knee_rps
        hi = k.conclusive_fail_rps if "conclusive_fail_rps" in k.model_fields_set else k.first_fail_rps
        if lo and hi:  # the bracket: last pass .. first fail on evidence
            ax.plot([lo, hi], [y, y], "-", color="tab:blue", lw=6, alpha=0.25, solid_capstyle="butt")
        for p in probe_evidence(k.rows):
            m, c = EVIDENCE_MARK.get(p["evidence"], ("s", "gray"))
            ax.plot(p["rate"], y, m, color=c, ms=8)
            if p["counted"]:
                ax.annotate(f"{p['over']}/{p['counted']}", (p["rate"], y), textcoords="offset points",
                            xytext=(0, 7), ha="center", fontsize=6)
    ax.set_yticks(range(len(searched)))
    ax.set_yticklabels([f"{r.index} {r.name}" + ("" if r.kept or r.role in ("baseline", "confirm") else " (not kept)")
                        for r in reversed(searched)], fontsize=8)
    ax.set_xscale("log")
    plain = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}")
    ax.xaxis.set_major_formatter(plain)
    ax.xaxis.set_minor_formatter(plain)
    ax.tick_params(axis="x", which="both", labelsize=7)
    ax.set_ylim(-0.7, len(searched) - 0.3)
    ax.set(xlabel="offered request rate (req/s)",
           title=f"Knee evidence per rung at the SLO ({slo_text(slo)}): requests over the SLO / counted at each "
                 "probed rate;\ngreen pass, red fail, orange inconclusive; blue bar: the bracket (last pass .. first "
                 "fail on evidence)")
    ax.title.set_fontsize(9)
    ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    fig.savefig(out / "knee.png", dpi=110)
    plt.close(fig)


def rungs_plot(lad: LadderRecord, out: Path, plt) -> None:
    done = [r for r in lad.rungs if r.status == "ok" and r.bench and r.bench.output_tps]
    fig, ax = plt.subplots(figsize=(max(6, len(done) * 1.2), 4.5))
    names = [f"{r.index} {r.name}" for r in done]
    benches = [r.bench for r in done if r.bench]  # one a rung of done, each with a tok/s
    tps = [b.output_tps for b in benches if b.output_tps]
    err = [[t - (b.output_tps_ci95 or [t, t])[0] for t, b in zip(tps, benches)],
           [(b.output_tps_ci95 or [t, t])[1] - t for t, b in zip(tps, benches)]]
    colors = ["tab:green" if r.kept or r.role == "baseline" else "tab:gray" for r in done]
    ax.bar(names, tps, yerr=err, color=colors, capsize=4)
    ax.set(ylabel="output tok/s (median, 95 % CI)", title="Throughput and accuracy per rung (grey: not kept)")
    ax.tick_params(axis="x", rotation=30)
    accs = [r.eval and r.eval.overall for r in done]
    if any(a is not None for a in accs):
        ax2 = ax.twinx()
        ax2.plot(names, [a if a is not None else float("nan") for a in accs], "o-", color="tab:blue")
        ax2.set(ylabel="eval accuracy", ylim=(0, 1))
    else:  # no rung measured at all (rung 0 failed): the plot says so rather than the report failing
        why = f"accuracy n/a ({na_label(done[0])})" if done else "no rung measured"
        ax.text(0.99, 0.97, why, transform=ax.transAxes, ha="right", va="top")
    fig.tight_layout()
    fig.savefig(out / "rungs.png", dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------- the Pareto plot (issue 55)
# As vLLM's `bench sweep plot_pareto` and llm-optimizer draw a config: what one user gets (output tok/s per user,
# 1 / TPOT) against what the hardware serves (output tok/s per GPU), both at one operating point: the knee's rate.
PARETO_ALT = "output tok/s per user vs per GPU at each rung's knee, the Pareto front marked"
PARETO_STYLE = {"baseline": ("s", "tab:blue", "rung 0"), "kept": ("o", "tab:green", "kept"),
                "other": ("X", "tab:gray", "not kept")}


def knee_operating_point(r: RungRecord) -> tuple[float, float] | None:
    """(output tok/s per user, output tok/s per GPU) at a rung's knee: 1000 / the median TPOT of its last probe at
    the knee's rate, and that probe's output tok/s over the rung's GPUs (one instance on a CPU); None without a
    knee (no pass, not measured) or without the probe's figures."""
    k = r.knee
    rate = k.knee_rps if k else None
    if k is None or rate is None or k.status == "n/a" or k.label == common.KNEE_RECHECK:
        return None
    at = [x for x in k.rows if x.offered_rps == rate and x.p50_tpot_ms]
    last = at[-1] if at else None
    if last is None or not last.output_tps or not last.p50_tpot_ms:  # (at holds looks with a TPOT only)
        return None
    return 1000 / last.p50_tpot_ms, last.output_tps / (r.gpus or 1)


def pareto_points(lad: LadderRecord) -> list[dict]:
    """One point per rung with a knee (a base's re-measure or a knee re-check is no rung), the front marked: no
    other point serves more per user and more per GPU."""
    pts: list[dict[str, Any]] = [{"r": r, "user": xy[0], "gpu": xy[1]} for r in lad.rungs
                                 if r.role not in decide.RE_MEASURES and r.status == "ok"
                                 and (xy := knee_operating_point(r))]
    for p in pts:
        p["front"] = not any(q["user"] >= p["user"] and q["gpu"] >= p["gpu"] and (q["user"], q["gpu"]) !=
                             (p["user"], p["gpu"]) for q in pts)
    return pts


def pareto_labels(pts: list[dict], ax) -> None:
    """Each point's rung number; points that sit on top of each other share one label, so none overlap."""
    groups: list[list[dict]] = []
    xy = ax.transData.transform([(p["user"], p["gpu"]) for p in pts]) if pts else []
    for p, (x, y) in zip(pts, xy):  # within a label's size in pixels of a group's first point: that group
        near = next((g for g in groups if abs(g[0]["px"][0] - x) < 28 and abs(g[0]["px"][1] - y) < 14), None)
        if near:
            near.append({**p, "px": (x, y)})
        else:
            groups.append([{**p, "px": (x, y)}])
    for g in groups:
        ax.annotate(", ".join(p["id"] for p in g), (g[0]["user"], g[0]["gpu"]),
                    textcoords="offset points", xytext=(7, 5), fontsize=8)


def rung_ids(lad: LadderRecord) -> dict[int, str]:
    """id(rung) -> its label on the plot: its number, with a letter where candidates share one (5a, 5b)."""
    runs = [r for r in lad.rungs if r.role not in decide.RE_MEASURES]
    count = {i: sum(r.index == i for r in runs) for i in {r.index for r in runs}}
    seen: dict[int, int] = {}
    out = {}
    for r in runs:
        n = seen[r.index] = seen.get(r.index, -1) + 1
        out[id(r)] = f"#{r.index}" + ("abcdefghijklmnopqrstuvwxyz"[n] if count[r.index] > 1 else "")
    return out


def pareto_plot(lad: LadderRecord, out: Path, plt) -> None:
    ids = rung_ids(lad)
    pts = [{**p, "id": ids[id(p["r"])]} for p in pareto_points(lad)]
    final = lad.final_exp
    fig, ax = plt.subplots(figsize=(10, max(5.5, 0.17 * len(ids) + 3.5)))
    for key, (m, c, label) in PARETO_STYLE.items():
        mine = [p for p in pts if (p["r"].role == "baseline") == (key == "baseline")
                and (key != "kept" or p["r"].kept) and (key != "other" or not p["r"].kept)]
        if mine:  # a legend entry only for what is drawn
            ax.scatter([p["user"] for p in mine], [p["gpu"] for p in mine], marker=m, s=60, color=c, label=label,
                       zorder=3)
    front = sorted((p for p in pts if p["front"]), key=lambda p: p["user"])
    if front:
        # the boundary of what the front's points serve: no config beyond it on both axes was measured
        ax.step([p["user"] for p in front], [p["gpu"] for p in front], "--", where="pre", color="tab:orange",
                lw=1.5, label="Pareto front", zorder=2)
    top = [p for p in pts if final and p["r"].exp == final]
    if top:
        ax.scatter([top[0]["user"]], [top[0]["gpu"]], marker="*", s=320, facecolor="none", edgecolor="black",
                   linewidth=1.4, label="final stack", zorder=4)
    ax.margins(0.15)
    fig.canvas.draw()  # the labels group by where the points land on screen
    pareto_labels(pts, ax)
    unit = "GPU" if lad.environment.device == "gpu" else "instance (CPU)"  # old records: no `gpus`
    ax.set(xlabel="output tok/s per user (1 / median TPOT at the knee's rate)",
           ylabel=f"output tok/s per {unit} at the knee's rate",
           title=f"Output tok/s per user vs per {unit.split()[0]}, each rung at its knee's rate (SLO "
                 f"{slo_text(slo_of(lad))})")
    ax.title.set_fontsize(10)
    ax.grid(alpha=0.3)
    key = "\n".join(f"{ids[id(r)]:<4} {r.name}" + ("" if any(p["r"] is r for p in pts) else " (no knee)")
                    for r in lad.rungs if id(r) in ids)
    ax.text(1.02, 1.0, key, transform=ax.transAxes, va="top", fontsize=8, family="monospace")
    if not pts:  # rung 0 failed, or no rung met the SLO anywhere: the plot says so rather than the report failing
        ax.text(0.5, 0.5, "no rung has a knee: nothing to place", transform=ax.transAxes, ha="center")
        ax.set(xticks=[], yticks=[])
    else:  # outside the axes, under the key: it never hides a point
        ax.legend(loc="lower left", bbox_to_anchor=(1.02, 0.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "pareto.png", dpi=110)
    plt.close(fig)


def disturbed_lines(lad: LadderRecord) -> list[str]:
    """Every measurement a stage flagged as disturbed and measured again (measure/disturbed): a timed bench repeat far
    off its engine's others (bench.json `disturbed`), a knee look while other work kept the machine busy (a knee row's
    `disturbed_look`); or a line saying none were, or that the record predates the screen."""
    lines, screened = [], False
    p = f"p{slo_of(lad).percentile:g}"

    def read(x: Look) -> str:
        return (f"{x.over_slo} of {x.counted} counted over the SLO, {p} TTFT "
                f"{x.slo_ttft_ms or 0:.0f} ms, achieved {x.achieved_rps or 0:.2f} req/s")
    for r in lad.rungs + (lad.confirm.runs if lad.confirm else []):
        who = f"{r.index} {r.name}".strip()
        b, k = r.bench, r.knee
        # a record from before the screen has neither threshold
        screened = (screened or (b is not None and "far_share" in b.model_fields_set)
                    or (k is not None and "busy_share" in k.model_fields_set))
        far_share, busy_share = (b.far_share if b else None) or 0, (k.busy_share if k else None) or 0
        bench_busy = (b.busy_share if b else None) or 0
        for f in b.disturbed if b else []:
            sibs = ", ".join(f"{v:.1f}" for v in f.siblings)
            fate = (f"replaced by repeat {f.replaced_by} ({f.replacement:.1f}): kept in bench.json, out of the "
                    "median and interval" if f.replaced_by else
                    "no extra repeat left (bench.extra_repeats): it stays in the median and interval")
            if f.busy:  # flagged for the other work it ran beside: its distance, where it had siblings, is evidence
                near = (f" (its siblings {sibs}: {f.off:+.0%} off their median)"
                        if f.siblings and f.off is not None else "")
                lines.append(f"- **{who}** bench repeat {f.repeat}: {f.output_tps:.1f} output tok/s{near}, run while "
                             f"{disturbed.busy_words(f.load or {})}, over bench.busy_share {bench_busy:.0%}; "
                             f"{fate}")
                continue
            load = f"; meanwhile {disturbed.busy_words(f.load)}" if f.load else ""
            lines.append(f"- **{who}** bench repeat {f.repeat}: {f.output_tps:.1f} output tok/s against its "
                         f"siblings {sibs} ({f.off:+.0%} off its engine's median {f.median:.1f}, beyond "
                         f"bench.far_share {far_share:.0%}){load}; {fate}")
        for row in k.rows if k else []:
            d = row.disturbed_look
            if not d:
                continue
            assert d.busy is not None  # what flagged it: the other work's share of the machine
            lines.append(f"- **{who}** knee look at {row.offered_rps:g} req/s (trace seed {row.seed}): ran "
                         f"while {disturbed.busy_words(d.busy)}, over knee.busy_share {busy_share:.0%}: "
                         f"{read(d)} (kept in knee.json, {d.file}); looked at again on the same trace: "
                         f"{read(row)}, judged on that"
                         + (f" (it ran busy too, {row.other_work_share:.0%}: no look left)"
                            if row.busy_again else ""))
    if lines:
        return lines
    if not screened:
        return ["- not screened: this record predates the screen (bench.far_share, knee.busy_share)"]
    s = lad.settings  # the params it ran with: open (config.Params as dumped)
    bs, busy = s.get("bench") or {}, (s.get("knee") or {}).get("busy_share")
    # only the screens that ran: the far one needs enough repeats (disturbed.far_screens), the busy one a share
    checks = ([f"was more than {bs['far_share']:.0%} off its engine's others"]
              if far_screened(lad) else []) + \
             ([f"ran while other work held more than {bs['busy_share']:.0%} of the machine's cores"]
              if bs.get("busy_share") else [])
    return ["- none: " + (f"no timed bench repeat {' or '.join(checks)}, and " if checks else "")
            + "no knee look ran while other work held more than "
            + (f"{busy:.0%}" if busy else "knee.busy_share") + " of the machine's cores"]


def floor_lines(lad: LadderRecord) -> list[str]:
    """The start-to-start floor the ladder's Δs were drawn with, and the warm-up engine's reading beside the timed
    engine that followed it (the first engine on a machine reads slow)."""
    out = []
    if lad.noise_floor:
        out.append("- **Start-to-start floor** (output tok/s, fresh engines of one config): "
                   + lad.noise_floor.words)
    sp = (lad.settings.get("knee") or {}).get("server_spread") or {}  # params knee.server_spread, as it ran
    again = ("in the rule's words (What I kept and why)" if stats.KNEE_AGAIN_OPENING in (lad.rule or "")
             else stats.knee_again_words((lad.settings.get("knee") or {}).get("better_pairs") or
                                         stats.KNEE_BETTER_ROUNDS))  # printed once: a record whose rule predates
    #                                                                   them still states them here
    out.append("- **Knee verdicts**: " + again + "; fresh servers' spread at one rate: " + (
        f"the share over the SLO's between-server SD {sp['sigma']:g} [{sp['sigma_ci'][0]:g}, {sp['sigma_ci'][1]:g}] "
        f"(knees' CV {sp['knee_cv']:.1%}), within a look dispersion {sp['phi']:g}, from {sp['servers']} servers and "
        f"{sp['looks']} looks at {sp['rate']:g} req/s ({sp.get('measured_on')}, {sp.get('measured')})"
        if sp.get("servers") else "not measured for this profile (`make benchmark ARGS=\"--parts 4 --spread-at R\"`)"))
    for r in lad.rungs:
        b = r.bench
        warm = b.warm_up_engine if b else None
        if b and warm and warm.output_tps and b.output_tps:
            gap = warm.output_tps / b.output_tps - 1
            out.append(f"- **Warm-up engine** (untimed, before {r.exp}'s timed engine): {warm.output_tps:.0f} "
                       f"output tok/s vs the timed {b.output_tps:.0f} ({gap:+.1%})")
        elif b and warm and warm.passes == 0:
            out.append(f"- **Warm-up engine** (untimed, before {r.exp}'s timed engine): started only, to fill the "
                       f"machine's compile cache ({warm.wall_s:.0f} s; bench.warm_up_passes 0)")
    out += server_pass_lines(lad)
    return out


def server_pass_lines(lad: LadderRecord) -> list[str]:
    """Output tok/s read through each rung's knee server (knee.server_pass_prompts sent at once after its search)
    beside its bench engine's: how far `vllm serve` reads from `vllm bench throughput` on one rung config."""
    out = []
    for r in lad.rungs:
        sp, b = (r.knee.server_pass if r.knee else None) or {}, r.bench
        if sp.get("output_tps") and b and b.output_tps:
            out.append(f"- **Through the server** ({r.exp}): {sp['output_tps']:.0f} output tok/s of "
                       f"{sp['requests']} requests sent at once to its knee's `vllm serve` after the search, vs its "
                       f"bench engine's {b.output_tps:.0f} ({sp['output_tps'] / b.output_tps - 1:+.1%}; one pass each)")
    return out


def wall_minutes(lad: LadderRecord) -> float:
    """`make ladder`'s wall time as the record has it: the pre-flight and the experiments (the report stage that
    renders the record is after its last save)."""
    return ((lad.preflight_seconds or 0) + (lad.wall_seconds or 0)) / 60


def outside_rows(lad: LadderRecord, unit: str) -> list[dict]:
    """The Time table's rows for the machine's time outside the experiments (record.time_totals), so its wall column
    adds up to the ladder's wall time; none in a record from before they were counted."""
    tot = lad.time
    if tot is None or tot.preflight_minutes is None:
        return []
    held = len(lad.environment.gpus) if lad.environment.device == "gpu" else 1
    rows = []
    for what, minutes, seconds in (("pre-flight (imports, plan, models, engine configs)", tot.preflight_minutes,
                                    tot.preflight_s),
                                   ("between experiments (the driver)", tot.driver_minutes or 0.0, tot.driver_s)):
        wall = seconds if seconds is not None else minutes * 60 / max(held, 1)
        rows.append({"rung": what, "wall": f"{wall:.0f} s", f"{unit}s": max(held, 1),
                     **dict.fromkeys(("starting engines", "measuring", "other (imports, teardown)", "DVC overhead"),
                                     "—"),
                     f"{unit}-minutes": f"{minutes:.1f}"})
    return rows


def time_lines(lad: LadderRecord) -> list[str]:
    """Where the ladder's time went, as the record has it (record.annotate_time): per rung starting engines,
    measuring, the stages' other time, DVC overhead; in total device-minutes, the share spent starting, cost."""
    tot = lad.time
    if tot is None:  # a record from before the split: the stages' wall times only
        return ["- measured engine time (eval + bench + knee stages): "
                f"{(lad.engine_seconds or 0) / 60:.1f} min; "
                f"ladder wall time {(lad.wall_seconds or 0) / 60:.1f} min",
                *[f"- {r.index} {r.name}: " + ", ".join(f"{s} {v:.0f} s" for s, v in r.stage_seconds.items())
                  for r in lad.rungs if r.stage_seconds]]
    unit = tot.unit
    rows = []
    for r in lad.rungs + (lad.confirm.runs if lad.confirm else []):
        t = r.time
        if not t:
            continue
        split = r.status == "ok" and t.seconds
        parts = {"start_s": t.start_s, "measure_s": t.measure_s, "other_s": t.other_s, "dvc_s": t.dvc_s}
        cells = {k: f"{v:.0f} s ({v / t.seconds:.0%})" if split else "—" for k, v in parts.items()}
        skipped = " (bench, knee: not measured, gate failed)" if gate_skipped(r) else ""
        rows.append({"rung": f"{r.index} {r.name}{skipped}", "wall": f"{t.seconds:.0f} s",
                     f"{unit}s": t.gpus,
                     "starting engines": cells["start_s"], "measuring": cells["measure_s"],
                     "other (imports, teardown)": cells["other_s"], "DVC overhead": cells["dvc_s"],
                     f"{unit}-minutes": f"{t.seconds * t.gpus / 60:.1f}"
                     + ("" if split else f" ({r.status}: not split)")})
    rows += outside_rows(lad, unit)
    cost = (f" ≈ **${tot.cost_usd:.2f}** at ${tot.price_per_hour:.2f} per {unit}-hour" if tot.price_per_hour
            else " (no price: cost.gpu_price_per_hour is 0)")
    share = f"{tot.start_share:.0%}" if tot.start_share is not None else "—"
    starts = f": {tot.engine_starts} starts × {tot.seconds_per_start:.0f} s" if tot.engine_starts else ""
    lines = [f"**{tot.minutes:.1f} {unit}-minutes**{cost}; **{share}** of them spent starting engines "
             f"({tot.start_minutes:.1f} min{starts}), {tot.measure_minutes:.1f} min measuring, "
             f"{tot.other_minutes:.1f} min in the stages' imports and teardown, "
             f"{tot.dvc_minutes:.1f} min of DVC overhead; "
             f"ladder wall time {wall_minutes(lad):.1f} min"
             + (f" (the pre-flight's {(lad.preflight_seconds or 0) / 60:.1f} included)."
                if lad.preflight_seconds is not None else "."),
             ""]
    conf = tot.confirm
    if conf:  # what confirming the kept gains cost: record.confirm_time
        lines[-1:-1] = ["", f"The confirm step: {conf.runs} runs ({lad.confirm.pairs if lad.confirm else None} "
                            f"pair(s)), **{conf.minutes:.1f} {unit}-minutes**: {conf.per_stack.stock:.1f} "
                            f"re-measuring stock (rung 0), {conf.per_stack.final:.1f} the final stack."]
    if rows:
        lines += [tabulate(pd.DataFrame(rows), headers="keys", tablefmt="github", showindex=False), ""]
    lines.append(f"Starting engines: process start to engine ready (bench and eval: the engine's process with its "
                 f"imports; knee: `vllm serve` until healthy); measuring: warm-up passes, timed repeats, knee probes, "
                 f"eval generation; DVC overhead: the rung's `dvc exp run` minus its engine stages (DVC, fingerprint, "
                 f"download, gate); stages DVC restored cost nothing. {unit}-minutes: wall × {unit}s held."
                 + (" Some splits are estimated from a record older than the stages' own split." if tot.estimated
                    else ""))
    return lines


def as_record(lad: LadderRecord | dict) -> LadderRecord:
    """`lad` the record, or a dict of its shape (validated here: an older one upgraded, a key the record does not
    declare refused)."""
    return lad if isinstance(lad, LadderRecord) else LadderRecord.model_validate(lad)


def timed_passes(lad: LadderRecord) -> int:
    """The timed passes an engine the ladder ran (bench.repeats as it ran; 0 where an older record does not say)."""
    return (lad.settings.get("bench") or {}).get("repeats") or 0


def far_screened(lad: LadderRecord) -> bool:
    """Whether the ladder's benches ran the far screen: bench.far_share set and enough timed repeats an engine
    (disturbed.far_screens); one pass an engine (the GPU profiles') is screened for other work alone."""
    return disturbed.far_screens((lad.settings.get("bench") or {}).get("far_share"), timed_passes(lad))


def disturbed_intro(lad: LadderRecord) -> str:
    """What the screens do, naming only those the ladder's settings ran (far_screened)."""
    return (("A bench repeat far off its engine's others, or run" if far_screened(lad) else "A timed bench pass run")
            + " while other work kept the machine busy is replaced by one more pass (up to bench.extra_repeats), a "
            "knee look while other work kept the machine busy is looked at again on its trace (once); the flagged "
            "one is kept beside what replaced it and judged on by nothing:")


def tps_words(lad: LadderRecord) -> str:
    """What the table's output tok/s is: a median and interval of an engine's repeats, or its one timed pass."""
    return ("Output tok/s: one engine's timed pass (no interval inside one engine; each Δ's interval rests on fresh "
            "engines and the start-to-start floor)." if timed_passes(lad) == 1 else
            "Output tok/s: median of one engine's repeats with their 95 % t-interval.")


def render(lad: LadderRecord | dict, out: Path) -> str:
    """The first screen (headline, the seed's table, one line a rung: `first_screen`), then the evidence every line
    rests on, the rule's words once, and the long table as an appendix. `lad` the record, or a dict of its shape
    (as_record)."""
    rec = as_record(lad)
    md = [f"# Before → after: vLLM serving ladder ({rec.profile} profile)", "",
          headline(rec), "", *first_screen(rec), "",
          "## Setup", *header(rec), "",
          "## What I kept and why", *([f"Rule: {rec.rule}", ""] if rec.rule else []), *kept_why(rec), "",
          *gate_power_lines(rec),
          "## Disturbed measurements", disturbed_intro(rec), *disturbed_lines(rec), "",
          "## Capacity plan", *capacity_lines(rec), "",
          "## Plots", "![knee evidence per rung](knee.png)", "", "![throughput and accuracy](rungs.png)", "",
          f"![{PARETO_ALT}](pareto.png)", "",
          "## Time", *time_lines(rec), "",
          f"## Appendix: the full table ({len(rec.rungs)} runs)", "", table(rec), "",
          tps_words(rec) + " " + ((rec.noise_floor.delta_words if rec.noise_floor else None) or stats.OLD_DELTA_WORDS)
          + ". Knee: highest offered rate meeting the SLO, with the first rate that broke it.", ""]
    return "\n".join(md)


def main(src: Path, out: Path):
    rec = LadderRecord.load_file(src)  # an older record upgraded, as the report reads it
    out.mkdir(parents=True, exist_ok=True)
    plots(rec, out)
    common.write_text(out / "before_after.md", render(rec, out))
    print(f"report: {out / 'before_after.md'}")


if __name__ == "__main__":
    args = common.paths(__doc__.split("\n")[0], ladder="report/ladder.json", out="report")
    common.run_stage(main, (OSError, ValueError, KeyError), args.ladder, args.out)
