"""`make ladder`: run the ladder of params.yaml as DVC experiments, keep or revert each rung, write the report.

Each rung is one `dvc exp run -n <profile>-<i>-<rung> -S ...` in the workspace, composed on the last KEPT rung,
so params.yaml is the only thing that changes and `dvc exp show` lists the rungs. After each rung the driver
reads the gate and the measurements and keeps or reverts it; a rung that fails (engine would not start,
OOM, timeout) is recorded with the engine's own error and the ladder goes on. Finished rungs are saved to
report/ladder.json as they finish; a re-run restores them from DVC's run-cache instead of re-measuring.

This module is the ladder's policy (Driver: which experiment next, keep or revert, the re-measures and re-checks,
the budget, the confirm step, the ladder record) and main(); running and reading the `dvc exp run`s is
runner/experiments.py's.

  python scripts/ladder.py [--profile cpu|gpu|gpu-small|gpu-shape|gpu-shape-4090|gpu-shape-4090-check] [--check]
                           [--rungs N] [--ladder FILE]
                           [--model NAME|FOLDER|ORG/NAME@REV] [--quant-model ...] [--workload KIND|FILE]
                           [--budget-min MINUTES]
"""
from __future__ import annotations

import argparse
import calendar
import dataclasses
import functools
import os
import sys
import time
from pathlib import Path

import common
import plan as planning
from judgement import capacity, decide, record, stats
from measure import host, score
from records.fingerprint import Fingerprint
from records.ladder import LadderRecord
from runner import experiments
from serving import launcher, vllm_compat

LADDER_JSON = common.ROOT / "report" / "ladder.json"
LOGS = common.ROOT / "results" / "logs" / "ladder"
BUDGET_EXIT = 75  # EX_TEMPFAIL: stopped before its budget ran out; `make ladder` resumes (neither failed nor done)
_STARTED = time.monotonic()  # BUDGET_MIN counts from here: the pre-flight (a minute on a GPU box) spends it too


# ---------------------------------------------------------------- running rungs
def knee_anchor(base: dict, knobs: dict, bracket: bool = False, floor: float = 0.0, last: bool = False) -> dict | None:
    """The base's knee as a rung's knee search starts from it (run.anchor): its last pass and its first fail on
    evidence, in the rung's units (an instance of twice the GPUs probes twice the rates); `bracket`: on to its own
    bracket after them (a confirm pair's runs); `floor` (knee.noise_floor): `worse`, the rate at or below which a fail
    on evidence is worse beyond it (stats.knee_delta), probed once after a fail at the base's pass. None where the
    base has no knee on evidence (not measured, or neither boundary known): the rung searches on its own. `last`: the
    last rung the ladder measures, whose knee no later rung starts from: it stops where it passed at the base's fail,
    unless a `floor` asks better for a pass beyond it (at the base's fail x (1 + floor)): then on to its own bracket,
    as any rung (a cpu ladder's last rung, max_num_seqs 4 -> 16, stopped at its first pass and read "knee +100 %,
    within noise": its search never reached the rate that could call it better)."""
    k = base.get("knee") or {}
    lo, hi = k.get("knee_rps"), k.get("conclusive_fail_rps")
    if k.get("status") == "n/a" or (lo is None and hi is None):
        return None
    scale = capacity.gpus_per_instance(knobs) / capacity.gpus_per_instance(base.get("knobs") or {})
    worse = lo and floor and float(f"{lo * scale / (1 + floor):.4g}")
    seen = latencies((base, scale))
    return {"pass": lo and float(f"{lo * scale:.4g}"), "fail": hi and float(f"{hi * scale:.4g}"),
            **({"worse": worse} if worse else {}), **({"bracket": True} if bracket else {}),
            **({"last": True} if last and not bracket and not floor else {}), **({"latency": seen} if seen else {})}


def latencies(*recs: tuple[dict, float]) -> list[list[float]]:
    """run.anchor.latency: the median end-to-end latency of each (record, rate scale)'s looks that passed, their
    window opened on a filled server and with no backlog (a queue's latency is not the server's), the longest per
    rate, in the units of the rung the anchor is for: a look at such a rate is sized by it (knee_looks.e2e_estimate)."""
    at: dict[float, float] = {}
    for rec, scale in recs:
        for r in (rec.get("knee") or {}).get("rows") or []:
            if r.get("passed") and r.get("settled", True) and not r.get("backlog") and r.get("e2e_p50_s"):
                rate = float(f"{r['offered_rps'] * scale:.4g}")
                at[rate] = max(at.get(rate, 0.0), round(r["e2e_p50_s"], 3))
    return [[rate, e] for rate, e in sorted(at.items())]


class BudgetSpent(Exception):
    """The next unit of experiments would not finish inside `make ladder BUDGET_MIN=`: the ladder stops before it,
    where everything finished is in DVC's run-cache and report/ladder.json."""


def experiment_cost(r: dict) -> float:
    """What an experiment cost when it was measured: its wall time, plus the stage seconds of the stages DVC restored
    (a resumed ladder's restored rungs cost what they did then). 0: replayed (measured on another machine). A knee
    re-check runs its knee alone: its eval, gate and bench are its experiment's, restored by design whenever it runs,
    so only a restored knee counts (a budget once took a placebo's unit at 12.9 min for the 9.2 it took, its two
    re-checks charged the base's and the rung's benches again)."""
    if r.get("seconds") is None or r.get("replayed"):
        return 0.0
    staged = r.get("stage_seconds") or {}
    runs = ("knee",) if r.get("role") == decide.KNEE_RECHECK else staged
    return r["seconds"] + sum(v or 0 for k, v in staged.items() if k in (r.get("reused") or []) and k in runs)


def budget_stop(budget_s: float | None, elapsed_s: float, est_s: float | None, what: str) -> str | None:
    """Why the ladder stops before its next unit (`what`) under a budget of `budget_s` seconds (None: no budget),
    `elapsed_s` spent and the unit taken to need `est_s` (None: nothing to estimate it from: it starts, unless the
    budget is spent already); None: go on."""
    if budget_s is None or (elapsed_s < budget_s and (est_s is None or elapsed_s + est_s <= budget_s)):
        return None
    need = f", and {what} is taken to need {est_s / 60:.1f} (the longest such unit this run, at its measured cost)" \
        if est_s is not None else ""
    return f"stopped before {what}: {elapsed_s / 60:.1f} of BUDGET_MIN={budget_s / 60:g} min spent{need}"


def same_sets(params: dict, sets: dict) -> bool:
    """Whether an experiment's params hold these sets, run.warm_up aside: whether a bench warmed its machine first is
    the driver's choice per run (Driver.warm_up_of), not what makes two experiments the same."""
    try:
        return all(planning.get_dotted(params, k) == v for k, v in sets.items() if k != "run.warm_up")
    except (KeyError, TypeError):
        return False


def warmed_here(rec: dict) -> bool:
    """Whether an experiment's bench warmed the machine in this run: it ran (not restored from the run-cache) and
    its record holds the warm-up engine it started (bench.warm_up_engine with run.warm_up)."""
    return "bench" not in (rec.get("reused") or []) and bool((rec.get("bench") or {}).get("warm_up_engine"))


def remeasure_key(held: list[dict]) -> int:
    """run.remeasure for the re-measure of these held rungs' base: when the last of them had its bench measured
    (Unix seconds), so that a held rung and the re-measure taken after it are restored or measured together."""
    at = max((r.get("measured") or {}).get("at") or "" for r in held)
    return calendar.timegm(time.strptime(at, "%Y-%m-%dT%H:%M:%SZ")) if at else int(time.time())


def confirm_order(k: int) -> tuple[str, str]:
    """The order of confirm pair k's two runs: stock then final in odd pairs, final then stock in even ones, so that
    over two pairs each side's mean sits at the same time (a machine drifting linearly cancels; stock, final, stock,
    final would credit the final stack one run's drift: tests/test_confirm_simulation.py)."""
    return ("baseline", "final") if k % 2 else ("final", "baseline")


class Driver:
    """One ladder run's climb: each rung measured as experiments (self.dvc runs them), decided against its base and
    recorded; main() builds it after the pre-flight."""
    budget_s: float | None = None  # BUDGET_MIN in seconds (__init__); None: no budget, no unit costs kept
    held_for: str | None = None  # why the unit under way would not fit BUDGET_MIN (budget), until it measures

    def __init__(self, plan: planning.Plan, out: Path = LADDER_JSON, budget_min: float | None = None):
        self.plan, self.out = plan, out
        self.dvc = experiments.Experiments(planning.KNOB_SECTIONS, LOGS)  # each rung's `dvc exp run`, run and read
        self.budget_s = budget_min * 60 if budget_min else None
        # what each unit cost this run (experiment_cost summed): a rung (its tries, re-checks and base re-measure),
        # a confirm pair. The budget is checked only between units: the experiments of one are measured back to
        # back (a rung and its base's re-measure, a re-check pair, a confirm pair), never split by a stop
        self.unit_costs: dict[str, list[float]] = {"rung 0": [], "rung": [], "pair": []}
        self.profile, self.overrides = plan.profile, plan.overrides
        self.eff, self.objective = plan.params, plan.objective
        self.records: list[dict] = []
        self.models: dict = {}
        self.t0 = time.monotonic()
        self.preflight_s = self.t0 - _STARTED  # it holds the machine too: the Time section counts it
        self.started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
        self.final_exp = None
        self.confirm: dict | None = None
        # the experiments of this run set run.warm_up (a param the bench stage declares) until one's bench started an
        # engine and warmed the machine first (runner.throughput.warm_up); a bench the run-cache restored warmed
        # nothing here, so a resumed run's first measured bench warms again
        self.warm_due = True
        self.warm_ups: dict[str, bool] = {}  # run.warm_up each experiment of this run was set with (run_exp)

    @functools.cached_property
    def environment(self) -> dict:
        """The machine and software this run measures on (the fingerprint stage writes the same into results/,
        where a replayed experiment's results bring the other machine's)."""
        return host.fingerprint()

    @property
    def machine(self) -> dict:
        return self.environment["machine"]

    def latest(self, base: dict, machine: str | None = None) -> dict:
        """The base's engine measured last (on `machine`, if named): its latest re-measure (taken after a rung that
        was then reverted, or here after the ladder moved here), else its own bench. What a rung's tok/s is compared
        with before the base is measured again after it."""
        again = [r for r in self.records if r.get("role") == decide.RECHECK and r.get("base") == base.get("exp")
                 and r.get("status") == "ok" and r.get("knobs") == base.get("knobs")
                 and (machine is None or record.machine_of(r) == machine)]
        return again[-1] if again else base

    def confirm_anchor(self, which: str, recs: list[dict], base: dict, final: dict) -> dict:
        """The record a confirm run of `which` (baseline or final) starts its knee search from: its side's run
        measured last in the step (`recs`), else its config's latest search in the ladder (`base`: rung 0's record,
        `final`: the final rung's); the final stack with no knee on evidence there (knee_anchor None: e.g. a rung
        kept on tok/s whose knee was not measured) from the baseline's measured last."""
        def last(side: str) -> dict | None:
            return next((r for r in reversed(recs) if r["name"].endswith(f"-{side}") and r["status"] == "ok"), None)
        before = last("baseline") or self.searched(base)
        if which == "baseline":
            return before
        after = last("final") or self.searched(final)
        return after if knee_anchor(after, after.get("knobs") or {}) else before

    def searched(self, base: dict) -> dict:
        """The base's latest measurement with a knee search (a re-measure here after a move, else the base)."""
        again = [r for r in self.records if r.get("role") == decide.RECHECK and r.get("base") == base.get("exp")
                 and r.get("status") == "ok" and (r.get("knee") or {}).get("label") != common.BENCH_ONLY]
        return again[-1] if again else base

    def here(self, rec: dict) -> bool:
        """Whether a record was measured on this machine (records from before machines were named: assumed so)."""
        return record.machine_of(rec) in (None, self.machine["id"])

    # -- experiments measured on another machine (pulled with `dvc exp pull`)
    @functools.cached_property
    def _earlier(self) -> dict[str, tuple[str, str | None, dict] | None]:
        return {}

    def earlier(self, exp: str) -> tuple[str, str | None, dict] | None:
        """Experiment `exp` of this commit as it finished before this run, read once: (its revision, the machine that
        measured it, its params), or None where there is none or it cannot be read."""
        if exp not in self._earlier:
            self._earlier[exp] = None
            found = self.dvc.shown(exp)
            if found:
                rev, text, got = found
                try:
                    theirs = Fingerprint.model_validate_json(text).machine_id  # the record as that experiment wrote it
                except ValueError:  # not a fingerprint: none to reuse
                    return None
                self._earlier[exp] = (rev, theirs, got)
        return self._earlier[exp]

    def elsewhere(self, exp: str, sets: dict) -> str | None:
        """The revision of experiment `exp` of this commit if another machine ran it with these very params: its
        measurements are taken as they are (replay), never compared with this machine's."""
        found = self.earlier(exp)
        if not found:
            return None
        rev, theirs, got = found
        if not theirs or theirs == self.machine["id"]:
            return None  # this machine's own: DVC's run-cache restores it
        return rev if same_sets(got, sets) else None

    def warm_up_of(self, exp: str, sets: dict) -> bool:
        """run.warm_up for experiment `exp`: as this machine ran it before with these sets (a resumed ladder: the
        run-cache restores it as it was measured, warmed or not, and the rungs after it stay restored too), else
        whether this run's warm-up is still due (Driver.warm_due)."""
        found = self.earlier(exp)
        if found and found[1] == self.machine["id"] and same_sets(found[2], sets):
            try:
                return bool(planning.get_dotted(found[2], "run.warm_up"))
            except (KeyError, TypeError):
                pass
        return self.warm_due

    def replay(self, rec: dict, base: dict | None) -> dict:
        """An experiment another machine ran: its results into the workspace (`dvc exp apply`), filled and
        compared as they were measured there (against its base as measured there)."""
        out = experiments.apply(rec["exp"])
        if out.returncode != 0:
            rec.update(status="failed", error=f"dvc exp apply {rec['exp']}: {common.redact(out.stderr)[-400:]}")
            return rec
        rec.update(seconds=0.0, reused=["eval", "bench", "knee", "gate"])
        if base is not None:
            baseline = self.records[0] if self.records and self.records[0].get("status") == "ok" else None
            there = Fingerprint.load_file(common.RESULTS / "fingerprint.json").machine_id
            self.models = record.fill(rec, base, baseline, self.eff, self.floor(), self.latest(base, there))
        else:
            self.models = record.fill(rec, None, None, self.eff, self.floor())
        rec["replayed"] = (rec.get("measured") or {}).get("machine_label")
        print(f"  replayed: measured on {rec['replayed']} (dvc exp pull), taken as it was", flush=True)
        return rec

    def rebase(self, i: int, base: dict) -> dict:
        """The base (the last kept rung), measured elsewhere, measured again here, bench and knee, before the next rung
        is measured here: every Δ stays within one machine. Its own row; the rungs after it compare with it."""
        self.progress(f"rung {i}: its base {base['exp']} on this machine")
        rec = self.run_exp(i, f"{base['name']}-here-{self.machine['id']}", base["knobs"], decide.RECHECK, None, None,
                           f"re-measures {base['exp']} on {self.machine['label']}: the ladder moved here")
        rec["base"] = base["exp"]
        rec["decision"] = (f"{base['exp']} measured again on this machine (bench and knee): the ladder moved from "
                           f"{(base.get('measured') or {}).get('machine_label')}; the rungs after it compare with this"
                           if rec["status"] == "ok" else
                           f"{base['exp']} could not be measured on this machine: {rec.get('error', 'no reason')}")
        rec["kept"] = False
        return self.finish(rec)

    @property
    def knee_floor(self) -> float:
        """knee.noise_floor: how far past its base's boundary a rung's knee must move (its search's `worse` rate)."""
        return (self.eff.get("knee") or {}).get("noise_floor") or 0.0

    @property
    def better_pairs(self) -> int:
        """knee.better_pairs: the pairs of fresh servers a better knee is re-checked on (stats.recheck_rounds)."""
        return self.eff["knee"]["better_pairs"]  # validated: always set (config.Knee's default, 1 to 4)

    def floor(self):
        """The start-to-start floor of every Δ now: the card's, pooled with this ladder's own same-config engines."""
        return record.floor_of(self.plan.typed_params.bench.noise_floor,
                               self.records + ((self.confirm or {}).get("runs") or []))

    def restores(self, exp: str, sets: dict) -> bool:
        """Whether experiment `exp` finished on this machine before this run with these very sets (run.warm_up
        aside): DVC's run-cache gives it back in seconds, whatever it cost measured."""
        found = self.earlier(exp)
        return found is not None and (not found[1] or found[1] == self.machine["id"]) and same_sets(found[2], sets)

    def budget(self, kind: str, what: str) -> None:
        """Whether the next unit of `kind` would not fit BUDGET_MIN (held_for, the words of the stop; measuring()
        stops): its estimate is the longest unit of that kind this run (a confirm pair's, while none ran: the longest
        rung's; a rung's, while none ran: rung 0's, which alone pays the reference eval and a search from nothing:
        errs long), plus the warm-up engine where this run's first bench is still to come (a resumed run pays one
        again)."""
        self.held_for = None
        if self.budget_s is None:
            return
        costs = self.unit_costs[kind] or (self.unit_costs["rung"] if kind == "pair" else []) \
            or self.unit_costs["rung 0"]
        est = max(costs) if costs and max(costs) > 0 else None
        if est is not None and self.warm_due and self.records:
            est += ((self.records[0].get("bench") or {}).get("warm_up_engine") or {}).get("wall_s") or 0
        self.held_for = budget_stop(self.budget_s, time.monotonic() - _STARTED, est, what)

    def measuring(self, exp: str, sets: dict) -> None:
        """Before experiment `exp` is measured here: stop (BudgetSpent) where its unit would not fit (budget), unless
        it comes back from the run-cache. The stop waits for the unit's first experiment that measures: one that
        comes back costs seconds (a resumed ladder on a fresh lease once stopped before a rung it had finished, taken
        at 6.5 min), and a unit cut off part-way by a lost lease is checked before what it still has to measure. An
        experiment replayed from another machine never gets here."""
        if self.held_for is not None and not self.restores(exp, sets):
            raise BudgetSpent(self.held_for)

    def unit_done(self, kind: str, recs: list[dict]) -> None:
        """A unit's cost, kept where one of its experiments searched or looked at a knee: a rung the gate failed, or
        whose engine would not start, cost little and says nothing of what the next costs (it would shrink the
        estimate: a full rung would then start with too little time left)."""
        if self.budget_s is not None and any((r.get("knee") or {}).get("status") not in (None, "n/a") for r in recs):
            self.unit_costs[kind].append(sum(experiment_cost(r) for r in recs))
        self.held_for = None  # the unit came back whole: its check is not carried to what runs after it

    # -- one experiment
    def run_exp(self, index: int, name: str, cfg_flat: dict, role: str, change: dict | None, base: dict | None,
                note: str = "", into: list | None = None, round_: int = 0, remeasure: int = 0,
                anchor: dict | None = None, replay: bool = True, warm_up: bool | None = None) -> dict:
        """`warm_up`: run.warm_up as given (a knee re-check takes the one its experiment ran with, so that DVC
        restores that experiment's bench), else Driver.warm_up_of."""
        exp = f"{self.profile}-{index}-{name}"
        sets = self.sets_of(cfg_flat, round_, remeasure, anchor)
        sets["run.warm_up"] = self.warm_up_of(exp, sets) if warm_up is None else warm_up
        self.warm_ups[exp] = sets["run.warm_up"]
        ref = replay and self.elsewhere(exp, sets)
        if not ref:
            self.measuring(exp, sets)
        rec = {"index": index, "name": name, "exp": exp, "role": role, "change": change or {}, "note": note,
               "base": base["exp"] if base else None, "knobs": cfg_flat, "status": "running"}
        (self.records if into is None else into).append(rec)
        self.save()
        what = ", ".join(f"{k}={v}" for k, v in (change or {}).items()) or note or "stock baseline"
        print(f"\n=== rung {exp}: {what}", flush=True)
        if ref:
            return self.replay(rec, base)
        ran = self.dvc.run(exp, sets)
        rec["seconds"], rec["reused"] = ran.seconds, ran.reused
        if ran.rc != 0:
            rec.update(status="failed", error=ran.error, log=str(ran.log.relative_to(common.ROOT)))
            return rec
        self.collect(rec, base)
        self.warm_due = self.warm_due and not warmed_here(rec)
        return rec

    def confirm_step(self) -> None:
        """Baseline and final kept stack re-measured (fresh engines and servers, bench and knee; `confirm.pairs`
        pairs in confirm_order), so the headline compares measurements minutes apart on one machine, not rung 0 with
        a stack measured an hour later, each engine and each server a unit (record.confirm_summary)."""
        pairs = self.eff["confirm"]["pairs"]
        final = next((r for r in self.records if r.get("exp") == self.final_exp), None)
        base = self.records[0] if self.records else None
        if not pairs or not final or not base or final is base:
            self.confirm = {"pairs": 0, "why": "no confirm step: " + (
                "confirm.pairs is 0" if not pairs else "nothing was kept, the final stack is the baseline")}
            return
        recs: list[dict] = []
        self.confirm = {"pairs": pairs, "runs": recs}
        index = len(self.plan.rungs) + 1

        def pair(k: int, replay: bool) -> list[dict]:
            # each side starts from its own knee measured last (rung 0's, the final rung's, then the step's own), on
            # to its own bracket: a search from the other side's knee overshot a gain and bisected back (the cpu
            # ladder's final stack looked 4 times a server, for the bracket 2 looks give). Each rate has its own
            # arrival traces whoever probes it
            out = []
            for which in confirm_order(k):
                src = base if which == "baseline" else final
                anchor = knee_anchor(self.confirm_anchor(which, recs, base, final), src["knobs"], bracket=True)
                self.progress(f"confirm {k}/{pairs}: {which}")
                rec = self.run_exp(index, f"confirm-{k}-{which}", src["knobs"], decide.CONFIRM, None, None,
                                   f"re-measures {src['exp']}", into=recs, round_=k, anchor=anchor, replay=replay)
                rec["of"] = src["exp"]
                out.append(rec)
                self.save()
            return out

        for k in range(1, pairs + 1):
            self.budget("pair", f"confirm pair {k}")
            n = len(recs)
            got = pair(k, replay=True)
            if not record.same_machine(got):  # another machine measured half of it: both halves here
                for r in got:
                    recs.remove(r)
                pair(k, replay=False)
            self.unit_done("pair", recs[n:])
        kept = [r for r in self.records if r.get("kept") and r.get("role") != decide.BASELINE]
        self.confirm.update(record.confirm_summary(recs, self.floor(), self.objective, kept,
                                                   self.plan.typed_params.knee.server_spread))
        self.save()
        said = self.confirm.get("words") or ("the kept gains reproduced" if self.confirm.get("reproduced") else "")
        print(f"  -> confirm: {self.confirm['summary']}" + (f"; {said}" if said else ""), flush=True)

    def collect(self, rec: dict, base: dict | None) -> None:
        baseline = self.records[0] if self.records and self.records[0].get("status") == "ok" else None
        self.models = record.fill(rec, base, baseline if base else None, self.eff, self.floor(),
                                  self.latest(base) if base else None)

    # -- the ladder
    def progress(self, label: str) -> None:
        """Where the ladder is and what is left, so a user on a rented box knows when to come back: at most the
        planned rungs, one re-measure of its base after each rung that is not skipped, and the confirm pairs. The
        estimate is the mean time of the experiments run so far (restored ones are fast, so it errs short early on)."""
        runs = self.records + ((self.confirm or {}).get("runs") or [])
        done = [r["seconds"] for r in runs if r.get("seconds") is not None]
        total = (self.plan.experiments + sum(1 for r in self.plan.rungs if not r.get("skip"))
                 + 2 * self.eff["confirm"]["pairs"])
        left = max(total - len(done), 0)
        elapsed = (time.monotonic() - self.t0) / 60
        eta = f", ~{sum(done) / len(done) * left / 60:.0f} min left at most" if done else ""
        print(f"\nladder: experiment {len(done) + 1} of at most {total} ({label}), "
              f"{elapsed:.1f} min elapsed{eta}", flush=True)

    def run(self) -> int:
        kept_flat = dict(self.plan.baseline)
        self.progress("rung 0 baseline")
        base = self.run_exp(0, "baseline", kept_flat, decide.BASELINE, None, None)
        self.unit_done("rung 0", [base])
        if base["status"] != "ok":
            base["kept"], base["decision"] = False, "the baseline failed: nothing to compare against; ladder stopped"
            self.finish(base)
            print(f"ladder: baseline failed: {base.get('error')}", file=sys.stderr)
            return 1
        base["kept"], base["decision"] = True, "rung 0: the reference"
        self.finish(base)
        self.final_exp = base["exp"]
        last = max((i for i, r in enumerate(self.plan.rungs, 1) if planning.runs_here(self.plan, r)), default=0)
        for i, rung in enumerate(self.plan.rungs, 1):
            if rung.get("skip"):
                self.finish(self.skipped(i, rung["name"], "rung", rung["set"], rung, f"skipped: {rung['skip']}"))
                continue
            cands = planning.rung_changes(rung)
            tries = [(planning.candidate_label(rung, c), c, "candidate") for c in cands] if len(cands) > 1 \
                else [(rung["name"], cands[0], "rung")]
            need = (rung["when"] or {}).get("min_gpus")
            if need and self.plan.gpus < need:
                for name, change, role in tries:  # each candidate its row: what it would have run, and why not
                    self.finish(self.skipped(i, name, role, change, rung,
                                             f"skipped: needs {need} GPUs, this machine has {self.plan.gpus}",
                                             {**kept_flat, **change}))
                continue
            self.budget("rung", f"rung {i} {rung['name']}")
            n = len(self.records)
            chosen = self.try_rung(i, rung, tries, kept_flat, base, last=i == last)
            if chosen is None and rung["fallback"]:
                self.unit_done("rung", self.records[n:])
                self.budget("rung", f"rung {i}'s fallback")
                n = len(self.records)
                chosen = self.try_rung(i, rung, [(f"{rung['name']}-fallback", rung["fallback"], "fallback")],
                                       kept_flat, base, last=i == last)
            self.unit_done("rung", self.records[n:])
            if chosen is not None:
                kept_flat = {**kept_flat, **chosen["change"]}
                base, self.final_exp = chosen, chosen["exp"]
        return 0

    @staticmethod
    def skipped(i: int, name: str, role: str, change: dict, rung: dict, why: str, knobs: dict | None = None) -> dict:
        return {"index": i, "name": name, "exp": None, "role": role, "change": change, "status": decide.SKIPPED,
                "kept": False, "note": rung["note"], "decision": why, "knobs": knobs}

    def try_rung(self, i, rung, tries, kept_flat, base, last: bool = False) -> dict | None:
        """Rung i's candidates (and its base again where one may gain), decided; the one kept, or None. `last`: no
        later rung is measured, so a better knee is not searched on to its own bracket (knee_anchor)."""
        recs = []

        def measure(name: str, change: dict, role: str, replay: bool = True) -> dict:
            """One candidate: replayed where another machine ran it (and `replay`); else measured here, after its
            base was measured here too if the ladder moved here since."""
            knobs = {**kept_flat, **change}
            anchor = knee_anchor(self.searched(base), knobs, floor=self.knee_floor, last=last)
            exp = f"{self.profile}-{i}-{name}"
            if not (replay and self.elsewhere(exp, self.sets_of(knobs, anchor=anchor))) \
                    and not self.here(self.searched(base)):
                self.rebase(i, base)
                anchor = knee_anchor(self.searched(base), knobs, floor=self.knee_floor, last=last)
            self.progress(f"rung {i} {name}")
            rec = self.run_exp(i, name, knobs, role, change, base, rung["note"], anchor=anchor, replay=replay)
            if decide.needs_knee_again(rec, self.objective):
                self.knee_again(i, base, rec)
            return rec

        for name, change, role in tries:
            if all(kept_flat.get(k) == v for k, v in change.items()):  # only after a revert: already in force
                recs.append(self.finish(self.skipped(i, name, role, change, rung,
                                                     "skipped: already in force (an earlier rung was reverted)",
                                                     kept_flat)))
                continue
            rec = measure(name, change, role)
            if not decide.needs_again(rec, self.objective):  # its speed cannot keep it: decided as it stands
                rec["kept"], rec["decision"] = decide.decide(rec, base, self.objective)
                self.finish(rec)
            recs.append(rec)
        pending = [r for r in recs if r.get("verdict") is None]
        if pending and any(r.get("replayed") for r in pending) and not self.elsewhere(
                *self.again_of(i, rung, base, pending)):
            # held on another machine that never measured their base again after them: measured again here
            for r in pending:
                self.records.remove(r)
                recs[recs.index(r)] = measure(r["name"], r["change"], r["role"], replay=False)
            pending = [r for r in recs if r.get("verdict") is None and decide.needs_again(r, self.objective)]
            for r in recs:
                if r.get("verdict") is None and r not in pending:
                    r["kept"], r["decision"] = decide.decide(r, base, self.objective)
                    self.finish(r)
        # the base's engine measured last before these rungs, on their machine (the re-measure is after)
        before = self.latest(base, record.machine_of(pending[0]) if pending else None)
        if pending:  # a possible gain: its base again right after it, so that drift cancels; decided on both
            for r in pending:  # held: not kept until then (an interruption here leaves it interrupted)
                r["kept"] = False
            name = pending[0]["name"] if len(pending) == 1 else rung["name"]
            again = self.remeasure(i, name, base, pending)
            floor = self.floor()
            for r in pending:
                r["delta"] = {**record.compare(base, r, floor, again, before), decide.AGAIN: again["status"] == "ok"}
                r["kept"], r["decision"] = decide.decide(r, base, self.objective)
                self.finish(r)
        chosen = decide.choose(recs, self.objective, self.floor())
        self.save()
        return chosen

    def sets_of(self, cfg_flat: dict, round_: int = 0, remeasure: int = 0, anchor: dict | None = None) -> dict:
        """What an experiment's `dvc exp run -S` sets: the profile, the knobs, the run bookkeeping."""
        return {**self.overrides, **cfg_flat, "run.round": round_, "run.remeasure": remeasure, "run.anchor": anchor,
                "run.warm_up": self.warm_due}

    def again_of(self, i: int, rung: dict, base: dict, held: list[dict]) -> tuple[str, dict]:
        """The experiment name and sets of the re-measure of `base` after the `held` rungs of rung i."""
        name = held[0]["name"] if len(held) == 1 else rung["name"]
        return f"{self.profile}-{i}-{name}-base-again", self.sets_of(base["knobs"], remeasure=remeasure_key(held))

    def remeasure(self, i: int, name: str, base: dict, held: list[dict]) -> dict:
        """The base (the last kept rung) measured again right after the `held` rung(s) of rung i, on a fresh engine,
        bench only: each rung is judged against its base's engines on both sides of it, so a machine that speeds up
        or slows down under the ladder is not credited to the rung (a CI run read a placebo +14.2 % against a base
        measured earlier). Its Δ vs the base's measurement before is the drift, its own row. Its run-cache key is when
        the last held rung's bench was measured: a held rung restored from the run-cache gets the re-measure taken
        after it then, a freshly measured one a fresh re-measure, never another's."""
        self.progress(f"rung {i}: its base {base['exp']} again")
        rec = self.run_exp(i, f"{name}-base-again", base["knobs"], decide.RECHECK, None, base,
                           f"re-measures {base['exp']} right after {', '.join(r['exp'] for r in held)} (bench only)",
                           remeasure=remeasure_key(held))
        rec["decision"] = (f"{base['exp']} measured again (fresh engine, bench only): output tok/s "
                           + record.drift_words(rec["delta"]["output_tps"]) + " vs its measurement before"
                           if rec["status"] == "ok" else
                           f"{base['exp']} could not be measured again: {rec.get('error', 'no reason recorded')}")
        rec["kept"] = False
        return self.finish(rec)

    def knee_again(self, i: int, base: dict, rec: dict) -> None:
        """A knee verdict read on one server a side (better or worse) re-checked on a fresh server of the base, then
        one of the rung, both started after the rung, at the rate it was read at (stats.knee_recheck): fresh servers
        of one config differ by more than one look a side can tell apart, and a machine that drifted between the
        base's search and the rung's is measured beside the rung. Better is re-checked on stats.recheck_rounds pairs,
        one after another, each only where the pair before held (the ladder's error budget). Knee only: their bench
        and eval are restored."""
        # how many pairs a better knee needs is the profile's (knee.better_pairs): the delta carries it to its record
        d = rec["delta"]["knee_rps"] = {**rec["delta"]["knee_rps"], "pairs": self.better_pairs}
        side = d["verdict"]
        gb, g = (capacity.gpus_per_instance(r.get("knobs") or {}) for r in (base, rec))
        searched = self.searched(base)
        rate = stats.verdict_rate(decide.judged_knee(searched), decide.judged_knee(rec), side, g / gb)
        rate = rate and float(f"{rate:.4g}")
        key = remeasure_key([rec])

        def look(who: str, src: dict, anchor: dict, n: int) -> dict:
            self.progress(f"rung {i}: its knee re-checked on a fresh {who} server" + (f" (pair {n})" if n > 1 else ""))
            # knee only: its bench params are its experiment's (run.round 0, run.remeasure 0, run.warm_up as that one
            # ran), so DVC restores that bench; a later pair is its own knee (run.anchor.pair), so the run-cache does
            # not hand it the first pair's server. run.round is the confirm pairs' alone: a pair's round here once
            # handed confirm pair 2 this re-check's benches, measured minutes before the confirm step
            again = self.run_exp(i, f"{rec['name']}-knee-{who}" + (f"-{n}" if n > 1 else ""), src["knobs"],
                                 decide.KNEE_RECHECK, None, None,
                                 f"re-checks {rec['exp']}'s knee ({side}) on a fresh server of {src['exp']}",
                                 anchor={**anchor, "after": key, **({"pair": n} if n > 1 else {})},
                                 warm_up=self.warm_ups.get(src["exp"]))
            again["base"], again["of"], again["kept"] = base["exp"], src["exp"], False
            verdicts = (again.get("knee") or {}).get("recheck", {}).get("verdicts", {})
            again["decision"] = (f"{src['exp']} on a fresh server: " + ", ".join(f"{r} req/s {v}" for r, v in
                                                                                 verdicts.items())
                                 if again["status"] == "ok" else
                                 f"could not be measured: {again.get('error', 'no reason recorded')}")
            return self.finish(again)
        # what the base's search and the rung's measured sizes each fresh server's look, in that server's units
        sized = {who: {"latency": seen} if (seen := latencies(*pair)) else {}
                 for who, pair in (("base", ((searched, 1.0), (rec, gb / g))),
                                   ("rung", ((rec, 1.0), (searched, g / gb))))}
        rounds: list[tuple] = []
        for n in range(1, stats.recheck_rounds(d) + 1):
            if not rate:
                break
            fresh_base = look("base", base, {"look": rate, "side": side, **sized["base"]}, n)
            if fresh_base["status"] != "ok":
                break
            base_rows = fresh_base["knee"]["rows"]
            # the rung is looked at where the fresh base was judged, in its own units
            fresh_rung = look("rung", rec, {"look": float(f"{stats.recheck_rate(base_rows) * g / gb:.4g}"),
                                            **sized["rung"]}, n)
            rounds.append((base_rows, fresh_rung["knee"]["rows"] if fresh_rung["status"] == "ok" else None))
            if not stats.pair_holds(side, *rounds[-1]):  # this pair did not hold: no pair after it
                break
        rec["delta"]["knee_rps"] = stats.knee_recheck(d, rounds)

    def finish(self, rec: dict) -> dict:
        if rec not in self.records:
            self.records.append(rec)
        rec["verdict"] = rec.get("verdict") or decide.verdict(rec)
        self.save()
        if rec.get("decision"):
            print(f"  -> {rec['verdict']}: {rec['decision']}", flush=True)
        return rec

    def save(self, final: bool = False) -> None:
        """report/ladder.json, rewritten after every rung so an interruption loses nothing finished."""
        ev_file = common.ROOT / self.eff["eval"]["file"]
        confirm_runs = (self.confirm or {}).get("runs") or []
        measured = sum(sum((r.get("stage_seconds") or {}).values()) for r in self.records + confirm_runs)
        lad = {
            "profile": self.profile, "started": self.started,
            "finished": time.strftime("%Y-%m-%d %H:%M:%S %Z") if final else None,
            "complete": final, "environment": self.environment,
            "git_commit": common.git_commit(), "models": self.models,
            "slo": self.eff["slo"], "objective": self.objective,
            "rule": decide.rule(self.objective, self.better_pairs),
            "settings": {k: self.eff[k] for k in ("workload", "bench", "knee", "serve", "eval", "gate", "cost",
                                                  "capacity")},
            "eval_file": self.eff["eval"]["file"], "eval_sha256": common.sha256_file(ev_file),
            "eval_n": sum(1 for ln in open(ev_file, encoding="utf-8") if ln.strip()),
            "final_exp": self.final_exp, "rungs": self.records, "confirm": self.confirm,
            "noise_floor": {**dataclasses.asdict(floor := self.floor()), "df": floor.df, "words": floor.words(),
                            "delta_words": stats.delta_words(bool(floor.read_at))},
            "engine_seconds": round(measured, 1), "wall_seconds": round(time.monotonic() - self.t0, 1),
            "preflight_seconds": round(self.preflight_s, 1),
        }
        lad["cost_usd"] = round(lad["engine_seconds"] / 3600 * self.eff["cost"]["gpu_price_per_hour"], 4)
        capacity.annotate(lad, self.eff["capacity"])  # GPUs per instance, per-GPU figures, the capacity plan
        record.annotate_time(lad)  # per rung: start / measure / other / DVC overhead; GPU-minutes and cost
        LadderRecord.model_validate(lad).save_file(self.out)  # a key the model does not declare is refused here


def budget_minutes(text: str) -> float:
    """--budget-min (make ladder BUDGET_MIN=): minutes, a number above 0; refused by name before anything runs."""
    try:
        v = float(text)
    except ValueError:
        v = float("nan")
    if not v > 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"BUDGET_MIN (--budget-min) must be a number of minutes above 0, got "
                                         f"{text!r}")
    return v


def stop_held(drv: Driver, why: str) -> None:
    """Rungs held for their base's re-measure, and the experiment running, marked so: the report shows where the
    ladder stopped, and `make ladder` resumes there (DVC's run-cache restores what finished)."""
    held = [r for r in drv.records if r.get("verdict") is None]  # running, or held for its base's re-measure
    for r in held + [r for r in (drv.confirm or {}).get("runs") or [] if r["status"] == "running"]:
        r["status"], r["kept"] = decide.INTERRUPTED, False
        r["verdict"] = decide.verdict(r)  # interrupted (a base's re-measure stays what it is: never a rung)
        r["decision"] = f"{why}: re-run `make ladder` to resume here"
    drv.save()


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profile", default=os.environ.get("PROFILE") or None)
    ap.add_argument("--check", action="store_true", help="validate params and the ladder; run nothing")
    ap.add_argument("--rungs", type=int, default=None, help="run only the first N rungs after the baseline")
    ap.add_argument("--ladder", type=Path, default=planning.LADDER_YAML, help="the ladder file (default: ladder.yaml)")
    ap.add_argument("--model", help="rung 0's model: a download.catalog name, a local folder or org/name@revision")
    ap.add_argument("--quant-model", help="the quantized variant the quantization rung tries (same forms as --model)")
    ap.add_argument("--workload", help="the traffic: random, shared-prefix, or a JSONL prompts file")
    ap.add_argument("--budget-min", type=budget_minutes, default=None,
                    help="stop between rungs (or confirm pairs) before this many minutes run out (a lease that "
                         "ends): what finished is kept, `make ladder` resumes")
    return ap.parse_args()


def checked_plan(args: argparse.Namespace, profile: str, gpu_list: list[dict]) -> tuple[planning.Plan, dict]:
    """The ladder's plan and its pre-flight, every bad input reported (common.die) before any engine starts."""
    gpus = len(gpu_list)
    try:  # every bad input is reported here, before any engine starts
        params, lad = common.read_params(), planning.load_ladder(args.ladder)
        # params.yaml as it stands, as `dvc repro` would run it, whatever the profile replaces: a bad value is bad input
        here = planning.as_it_stands(params, gpu_list)
        score.load_items(here["eval"]["file"])
        head = planning.committed_params()
        plan = planning.resolve(params, lad, profile, head, gpus, args.rungs, args.model, args.quant_model,
                                args.workload)
        if replaced := planning.replaced_edits(params, plan, lad, head):
            print("ladder: params.yaml's uncommitted edits that this ladder replaces (dvc repro runs them as they "
                  "stand):\n  " + "\n  ".join(replaced), file=sys.stderr)
        score.load_items(plan.params["eval"]["file"])
        planning.check_target(plan, gpu_list)  # a target card this machine cannot emulate (no GPU, too small)
        # vLLM's own parser, the models (the download stage's logic) and every engine config the ladder may start
        # (and params.yaml's as it stands), built by vLLM's own code on this machine: what vLLM would refuse at start
        # is refused now, naming the rung or the field
        pre = planning.preflight(plan, gpu_list, here)
        said = {"params.yaml is not valid:": pre["params_errors"],
                "the ladder is not valid (nothing was run):": pre["errors"]}
        if any(said.values()):
            raise common.ParamsError("\n".join(f"{title}\n  " + "\n  ".join(errs) for title, errs in said.items()
                                               if errs))
    except (common.ParamsError, score.EvalFileError) as e:
        common.die(str(e))
    return plan, pre


def main() -> int:
    args = parse_args()
    os.chdir(common.ROOT)
    gpu_list = host.gpus()
    profile = args.profile or ("gpu" if gpu_list else "cpu")
    plan, pre = checked_plan(args, profile, gpu_list)
    for line in pre["unchecked"]:
        print(f"ladder: warning: {line}", file=sys.stderr)
    print(f"ladder: profile {profile}, model {plan.params['baseline']['model']['name']}, baseline + {len(plan.rungs)} "
          f"rungs: " + ", ".join(r["name"] + (" (skipped)" if r.get("skip") else "") for r in plan.rungs))
    w = plan.params["workload"]
    print(f"ladder: workload {w['kind']}" + (f" ({w['file']})" if w["kind"] == "file" else ""))
    print(f"ladder: decision rule: {decide.rule(plan.objective, plan.params['knee']['better_pairs'])}")
    print(f"ladder: pre-flight: {pre['configs']} engine configs built by {pre['version']}'s own code, none refused "
          f"({pre['seconds']:.0f} s); what only a started engine knows (the memory its profile run measures) is "
          f"checked when it starts")
    if args.check:
        return 0
    drv = Driver(plan, budget_min=args.budget_min)
    common.handle_signals()
    # one process imports vLLM once; the stages' engines are forked from it (serving/launcher.py), their imports paid
    # once a ladder rather than once an engine
    with launcher.running(common.ROOT / "results" / "logs" / "ladder" / "launcher.log", vllm_compat.child_env()):
        return drive(drv)


def drive(drv: Driver) -> int:
    """The ladder's rungs, its confirm step, the report; what an interruption or BUDGET_MIN leaves is kept."""
    try:
        rc = drv.run()
        if rc == 0:
            drv.confirm_step()
    except KeyboardInterrupt:
        drv.dvc.interrupt()
        stop_held(drv, "interrupted")
        print("\nladder: interrupted; finished rungs are kept (dvc exp show); `make ladder` resumes", file=sys.stderr)
        return 130
    except BudgetSpent as e:
        stop_held(drv, "stopped: BUDGET_MIN")
        print(f"\nladder: {e}; finished rungs are kept (dvc exp show); `make ladder` resumes", file=sys.stderr)
        return BUDGET_EXIT
    # leave the workspace at the final kept stack, then write the complete ladder and render it
    if drv.final_exp:
        experiments.apply(drv.final_exp, capture=False)
    drv.save(final=True)
    experiments.repro("report")
    print(f"ladder: done in {(time.monotonic() - drv.t0) / 60:.1f} min; report/before_after.md")
    return rc


if __name__ == "__main__":
    sys.exit(main())
