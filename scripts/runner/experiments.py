"""The ladder's DVC side: each experiment's `dvc exp run` built (exp_command: the `-S` overrides in the grammar DVC
hands to Hydra), run under the engine guard with its output logged, its stage lines printed and read back (Run: the
stages DVC restored, the stage's own error), the experiments this commit already holds read (another machine's,
pulled with `dvc exp pull`), applied to the workspace, and the running one stopped on Ctrl-C (Experiments).
scripts/ladder.py is its caller: its Driver decides what to run and what the results mean; nothing here judges.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import dvc.api
import yaml
from dvc.exceptions import DvcException

import common
from serving import engine

TARGETS = ["gate", "bench", "knee"]  # everything a rung measures; `report` runs once at the end
_REUSED = re.compile(r"(?:Restored stage '(\w+)' from run-cache|Stage '(\w+)' (?:didn't change|is cached))")
# the lines of a running experiment echoed to the terminal (all of them go to its log)
_ECHOED = re.compile(r"^(Running stage|Restored stage|Stage '|error:|ERROR|eval|bench|knee|gate)")


def reused_stages(lines: list[str]) -> list[str]:
    """Stages DVC did not re-measure: restored from the run-cache, or already up to date in the workspace."""
    return [m.group(1) or m.group(2) for ln in lines if (m := _REUSED.match(ln.strip()))]


def error_lines(lines: list[str]) -> list[str]:
    """The stage's `error: ...` messages, each with the indented lines that continue it (a bad params.yaml names its
    fields there: `params.yaml is not valid:` alone says nothing)."""
    errs: list[str] = []
    for ln in lines:
        if ln.startswith("error: "):
            errs.append(ln[len("error: "):])
        elif errs and ln.startswith("  ") and not ln.lstrip().startswith(("Running stage", "ERROR")):
            errs[-1] += " " + ln.strip()
    return errs


def hydra(v) -> str:
    """A value in the override grammar `dvc exp run -S` passes to Hydra (strings quoted)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, list):
        return "[" + ",".join(hydra(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ",".join(f"{k}:{hydra(x)}" for k, x in v.items()) + "}"
    return "'" + str(v).replace("\\", "\\\\").replace("'", "\\'") + "'"


def stale_knobs(workspace: dict, sets: dict, whole: tuple[str, ...]) -> list[str]:
    """The keys of the `whole` sections (those the sets hold whole: a rung's knobs, plan.KNOB_SECTIONS) in the
    workspace's params.yaml that this experiment's sets do not set: left there by an earlier rung (each `dvc exp run`
    leaves its params in the workspace), they would ride along unseen (the CI ladder's confirm step once ran rung 0
    with broken-rope's RoPE override)."""
    return [f"{s}.{k}" for s in whole for k in (workspace.get(s) or {}) if f"{s}.{k}" not in sets]


def set_args(sets: dict, workspace: dict, whole: tuple[str, ...]) -> list[str]:
    """The `-S` overrides that leave params.yaml holding exactly `sets`, whatever an earlier experiment left in the
    workspace (each `dvc exp run` leaves its params there). `++key=value` is Hydra's set-or-add, so a knob params.yaml
    does not list yet (hf_overrides, say) works too; but on a dict it MERGES: a re-check's run.anchor {look, side}
    stayed under the next rung's {pass, fail}, which then looked instead of searching. So a dict is nulled first
    (`++key=null`, then the dict: exactly its keys). `~key`: a knob an earlier rung added is removed."""
    args = []
    for k, v in sets.items():
        args += (["-S", f"++{k}=null"] if isinstance(v, dict) else []) + ["-S", f"++{k}={hydra(v)}"]
    return args + [a for k in stale_knobs(workspace, sets, whole) for a in ("-S", f"~{k}")]


def exp_command(exp: str, sets: dict, workspace: dict, whole: tuple[str, ...]) -> list[str]:
    """The `dvc exp run` of experiment `exp` with these sets, on the workspace's params.yaml as it stands."""
    return ["dvc", "exp", "run", "-n", exp, *set_args(sets, workspace, whole), *TARGETS]


def apply(exp: str, capture: bool = True) -> subprocess.CompletedProcess:
    """`dvc exp apply`: experiment `exp`'s params and results into the workspace (its output returned where
    `capture`, else on the terminal); the caller reads the exit code."""
    return subprocess.run(["dvc", "exp", "apply", exp], cwd=common.ROOT, capture_output=capture, text=True,
                          check=False)


def repro(*targets: str) -> None:
    """`dvc repro` of these stages in the workspace; a failure raises (CalledProcessError)."""
    subprocess.run(["dvc", "repro", *targets], cwd=common.ROOT, check=True)


@dataclasses.dataclass
class Run:
    """One `dvc exp run` as it ended: its exit code, its output lines (secrets redacted), its wall time, its log."""
    rc: int
    lines: list[str]
    seconds: float
    log: Path

    @property
    def reused(self) -> list[str]:
        return reused_stages(self.lines)

    @property
    def error(self) -> str:
        """Why it failed: the stage's own last error, else DVC's last ERROR line, else the exit code (600 chars)."""
        dvc_errs = [ln for ln in self.lines if ln.startswith("ERROR")]
        return (error_lines(self.lines) or dvc_errs or [f"dvc exp run exit code {self.rc}"])[-1][:600]


class Experiments:
    """The DVC experiments of one ladder run: run one (`run`), read those this commit held before the run
    (`finished`, `shown`), stop the one running (`interrupt`). `whole`: the params.yaml sections an experiment's sets
    hold whole (stale_knobs); `logs`: the folder of each experiment's log."""

    def __init__(self, whole: tuple[str, ...], logs: Path):
        self.whole, self.logs = whole, logs
        self.proc: subprocess.Popen | None = None  # the `dvc exp run` running now (interrupt stops it)

    @functools.cached_property
    def finished(self) -> dict[str, str]:
        """This commit's finished experiments by name, {name: rev} (`dvc exp show`). Read once: another machine's
        were pulled before the ladder started, and the ones this run adds are this machine's."""
        try:
            shown = dvc.api.exp_show(repo=str(common.ROOT))
        except DvcException:
            return {}
        return {r["Experiment"]: r["rev"] for r in shown
                if r.get("Experiment") and r.get("rev") and r.get("State") in (None, "Success")}

    def shown(self, exp: str) -> tuple[str, str, dict] | None:
        """Finished experiment `exp` of this commit: its revision, its results/fingerprint.json as it wrote it (text)
        and its params; None where there is none, or they cannot be read."""
        rev = self.finished.get(exp)
        if not rev:
            return None
        try:
            text = dvc.api.read("results/fingerprint.json", repo=str(common.ROOT), rev=rev)
            got = dvc.api.params_show("params.yaml", repo=str(common.ROOT), rev=rev)
        except (DvcException, OSError, ValueError):  # not there, or not readable
            return None
        return rev, text, got

    def run(self, exp: str, sets: dict) -> Run:
        """`dvc exp run` of experiment `exp` with these sets on params.yaml as it stands, its output into
        <logs>/<exp>.log and its stage lines echoed as they come. An experiment of that name is removed first: a
        re-run is restored from the run-cache."""
        cmd = exp_command(exp, sets, yaml.safe_load((common.ROOT / "params.yaml").read_text()) or {}, self.whole)
        self.logs.mkdir(parents=True, exist_ok=True)
        log = self.logs / f"{exp}.log"
        subprocess.run(["dvc", "exp", "remove", exp], cwd=common.ROOT, capture_output=True)
        t0 = time.monotonic()
        with open(log, "w") as f:
            # guarded: dvc, its stages and their servers die with the ladder, even if it is SIGKILLed
            self.proc = engine.guarded(cmd, cwd=common.ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       text=True)
            lines = []
            for line in self.proc.stdout:
                line = common.redact(line)
                f.write(line)
                lines.append(line.rstrip())
                if _ECHOED.match(line):
                    print("  " + line.rstrip(), flush=True)
            rc = self.proc.wait()
            self.proc = None
        return Run(rc, lines, round(time.monotonic() - t0, 1), log)

    def interrupt(self) -> None:
        """Ctrl-C: pass it to the running `dvc exp run` (and its stage), which stops its servers by PID; if that
        does not end it, its guard stops the whole group (SIGTERM, SIGKILL after its grace)."""
        if self.proc and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGINT)
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.terminate()
                self.proc.wait(timeout=engine.GUARD_GRACE_S + 30)
            except ProcessLookupError:
                pass
