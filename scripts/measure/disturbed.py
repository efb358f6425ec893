"""A disturbed measurement is named, not judged on: a timed bench repeat far off its engine's others is replaced by
one more (screen), and a knee look taken while other work kept the machine busy is looked at again on the same trace
(busy; CpuWatch measures that other work). The flagged value stays in the stage's result beside the one that
replaced it; the report lists every one ("Disturbed measurements").

Why a repeat can read ~3x slow inside one engine (vllm_compat.run_throughput): nothing in the engine differs between
passes on the cpu profile (no compile: enforce_eager; prefix caching off, and reset before each pass; the same
prompts; the warm-up runs before the first pass, not the second). What differs is the CPU a pass gets: vLLM runs the
forward on one torch thread ("Reducing Torch threads from 2 to 1"), unpinned where the engine core runs in-process
(the cpu profile's VLLM_ENABLE_V1_MULTIPROCESSING=0), pinned to core 0 under the multiprocessing executor
(VLLM_CPU_OMP_THREADS_BIND=auto: "core ids=[0]" on two cores). On the 2-core box a one-thread torch loop read 0.33x
with two CPU-bound processes beside it, and 0.30x pinned with two on its core: the ~52 of ~175 tok/s.
"""
from __future__ import annotations

import os
import statistics
import time

import psutil

# ---------------------------------------------------------------- bench: a repeat far off its engine's others
FAR_MIN = 3  # repeats the far screen needs: two cannot say which one is off (their median is their mean)


def far_screens(far: float | None, repeats: int) -> bool:
    """Whether an engine of `repeats` timed repeats has a far screen at `far` (bench.far_share) at all."""
    return bool(far) and repeats >= FAR_MIN


def farthest(values: list[float], idx: list[int], far: float) -> tuple[int, float, float] | None:
    """The repeat among `values[i] for i in idx` farthest from their median, (index, median, relative distance), when
    that distance exceeds `far`; None where none does or fewer than 3 are there (two repeats cannot say which one is
    off: their median is their mean)."""
    if len(idx) < FAR_MIN:
        return None
    med = statistics.median(values[i] for i in idx)
    if med <= 0:
        return None
    off = {i: (values[i] - med) / med for i in idx}
    i = max(idx, key=lambda j: abs(off[j]))  # ties: the first run
    return (i, med, off[i]) if abs(off[i]) > far else None


def screen(values: list[float], repeats: int, far: float | None, extra: int, loads: list[dict | None] | None = None,
           busy_share: float | None = None) -> dict:
    """One engine's timed repeats in the order they ran, screened: the first `repeats` are its set; while one of the
    set ran while other work held more than `busy_share` of the machine's cores (`loads`: each repeat's CpuWatch
    reading; busy), or is more than `far` (relative) off the set's median (farthest: three or more), it is flagged
    and the next value replaces it, up to `extra` replacements. A busy repeat is flagged first, the earliest: its
    cause was measured, and it is the one check a single repeat can have. `more`: a replacement is wanted and allowed
    but not yet measured (the worker runs one more pass while it is True). `clean`: the indices the engine's median
    and interval are drawn from (always `repeats` of them where enough were measured); `flagged`: each replaced repeat
    with its median, distance and siblings (median and distance None for a busy one whose set had no other), and
    `busy`: its load where that flagged it; `unreplaced`: one still off when no replacement was left (it stays in
    `clean`, and is named). A pure function of the values and loads: the stage replays what the worker decided."""
    loads = loads or []
    clean = list(range(min(repeats, len(values))))
    flagged: list[dict] = []
    nxt = len(clean)

    def off_one() -> dict | None:
        for i in clean:
            if busy(loads[i] if i < len(loads) else None, busy_share):
                others = [j for j in clean if j != i]
                med = statistics.median(values[j] for j in others) if others else None
                return {"index": i, "median": med, "off": (values[i] - med) / med if med else None,
                        "siblings": others, "busy": loads[i]}
        got = farthest(values, clean, far) if far else None
        if got is None:
            return None
        i, med, off = got
        return {"index": i, "median": med, "off": off, "siblings": [j for j in clean if j != i]}
    while far or busy_share:
        f = off_one()
        if f is None:
            break
        if nxt >= len(values):
            more = nxt - repeats < extra
            return {"clean": clean, "flagged": flagged, "more": more, "unreplaced": None if more else f}
        flagged.append({**f, "replaced_by": nxt})
        clean = [j for j in clean if j != f["index"]] + [nxt]
        nxt += 1
    clean += list(range(nxt, len(values)))  # passes run beyond what this rule asked for: ordinary repeats
    return {"clean": sorted(clean), "flagged": flagged, "more": False, "unreplaced": None}


def far_words(value: float, median: float, off: float, far: float) -> str:
    return (f"{value:.1f} is {off:+.0%} off the median {median:.1f} of its engine's repeats, beyond bench.far_share "
            f"{far:.0%}")


# ---------------------------------------------------------------- knee: a look while the machine was busy
def busy(load: dict | None, share: float | None) -> bool:
    """Whether a look ran while other work held more than `share` of the machine's cores (CpuWatch's `share`); an
    unmeasured look (None) is not called busy."""
    return bool(load and share is not None and load.get("share") is not None and load["share"] > share)


def busy_words(load: dict) -> str:
    if load.get("share") is None:
        return f"other work was not told apart (a {load.get('wall_s') or 0:.1f}-s measurement: under {MIN_WALL_S:g} s)"
    steal = f", {load['steal_s']:.1f} s of it stolen by the hypervisor" if load.get("steal_s") else ""
    return (f"other work took {load['share']:.0%} of the machine's {load['cores']} cores over its "
            f"{load['wall_s']:.0f} s ({load['other_cpu_s']:.1f} CPU-s{steal})")


MIN_WALL_S = 1.0  # /proc/stat counts in 10-ms ticks per CPU: over a shorter look a share is mostly rounding (no call)
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _machine(cpus: set[int]) -> tuple[float, float] | None:
    """CPU-seconds the kernel counts busy (user, nice, system) and stolen, summed over `cpus`, from /proc/stat: it
    counts every process, those that came and went during a look and those of other containers, at no cost. Read by
    name, not through psutil.cpu_times(percpu=True): that list drops the cpu numbers the affinity set is given in."""
    try:
        lines = open("/proc/stat").read().splitlines()
    except OSError:
        return None
    busy_t = steal = 0
    for ln in lines:
        name, *f = ln.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            v = [int(x) for x in f] + [0] * 8
            busy_t, steal = busy_t + v[0] + v[1] + v[2], steal + v[7]
    return busy_t / _TICK, steal / _TICK


def _ours(roots: tuple[int, ...]) -> float:
    """CPU-seconds used by `roots` and their descendants (each process once), their reaped children included (a child
    that exits during a look moves into its parent's children_* counts, so it is not lost)."""
    procs: dict[int, psutil.Process] = {}
    for root in roots:
        try:
            top = psutil.Process(root)
            procs.update((p.pid, p) for p in (top, *top.children(recursive=True)))
        except psutil.Error:
            continue
    total = 0.0
    for p in procs.values():
        try:
            t = p.cpu_times()
        except psutil.Error:  # gone between the listing and the read
            continue
        total += t.user + t.system + t.children_user + t.children_system
    return total


class CpuWatch:
    """Other work's CPU over a measurement: the CPU time the kernel counts busy on the CPUs this process may run on,
    less what `root` (this process: the load client, with the server or engine it started) and its descendants used,
    and `also` (the server's process where it is not our descendant: forked from the ladder's launcher) and theirs,
    plus the time a hypervisor gave other guests (steal); `share` is that over the wall × those CPUs. Two reads of
    /proc/stat and of a few process trees: cheap, and a process that appears or vanishes mid-look is still counted."""

    def __init__(self, root: int | None = None, also: tuple[int, ...] = ()):
        self.roots = (root or os.getpid(), *also)
        self.cpus = set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count()))
        self.t0, self.m0, self.o0 = time.monotonic(), _machine(self.cpus), _ours(self.roots)

    def stop(self) -> dict | None:
        m1, o1, wall = _machine(self.cpus), _ours(self.roots), time.monotonic() - self.t0
        if self.m0 is None or m1 is None or wall <= 0:
            return None
        ours = o1 - self.o0
        other = max(m1[0] - self.m0[0] - ours, 0.0)
        steal = max(m1[1] - self.m0[1], 0.0)
        share = round((other + steal) / (wall * len(self.cpus)), 3) if wall >= MIN_WALL_S else None
        return {"wall_s": round(wall, 2), "cores": len(self.cpus), "other_cpu_s": round(other, 2),
                "steal_s": round(steal, 2), "ours_cpu_s": round(ours, 2), "share": share}


def watch() -> CpuWatch:
    """A CpuWatch started now, rooted at this process."""
    return CpuWatch()
