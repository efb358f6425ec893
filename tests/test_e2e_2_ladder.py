"""`make ladder` end to end on the real engine: rungs as DVC experiments, keep/revert, a rung designed to
fail the gate, a rung whose engine cannot start, Ctrl-C and resume, run-cache reuse, the report."""
import json
import os
import signal
import subprocess
import time

import pytest
import yaml

from conftest import vllm_pids, wait_no_project_process, wait_no_vllm
from judgement import decide
from measure import host

pytestmark = pytest.mark.engine

# A short ladder for CI: one real optimization, a placebo that must come out "no measurable gain" (the seed
# cannot change greedy output or speed), one rung designed to fail the quality gate (RoPE base forced to 1:
# positions scrambled), one whose engine cannot start (no KV cache space on CPU). The knee search stops after 3
# probes (a bracket of about 2×). A verdict on it must clear the knee's start-to-start noise (knee.noise_floor):
# a CI run once read the placebo's knee 52 % worse (1.96–3.92 → 0.94–1.41 req/s) when brackets apart were a move.
CI_LADDER = {
    "objective": "knee_rps",
    "groups": {},
    "profiles": {"cpu": {"settings": {"knee.max_probes": 3, "knee.batch1_requests": 1, "bench.num_prompts": 64},
                         "rungs": [
        {"name": "fp8-kv", "set": {"engine.kv_cache_dtype": "fp8"}, "note": "KV cache in fp8"},
        {"name": "placebo-seed", "set": {"engine.seed": 1}, "note": "a placebo: greedy decoding ignores the seed"},
        {"name": "broken-rope",
         "set": {"engine.hf_overrides": {"rope_parameters": {"rope_type": "default", "rope_theta": 1.0}}},
         "note": "designed to fail the gate: RoPE base 1 scrambles positions"},
        {"name": "no-kv-space", "set": {"env.VLLM_CPU_KVCACHE_SPACE": 0}, "note": "designed not to start: no KV cache"},
    ]}},
}


def ladder_cmd(project):
    path = project.path / "ci-ladder.yaml"
    path.write_text(yaml.safe_dump(CI_LADDER, sort_keys=False))
    return ["python", "scripts/ladder.py", "--profile", "cpu", "--ladder", str(path)]


def ladder_json(project):
    return json.loads((project.path / "report/ladder.json").read_text())


def start_ladder_and_wait_for_rung_1(project) -> subprocess.Popen:
    """Start the CI ladder in its own session (as a terminal's job), return once rung 1 is running an engine.
    SIGINT's disposition is left as this test run inherited it: ignored when it runs as a script's background job,
    which the ladder must override for Ctrl-C to work."""
    proc = subprocess.Popen(ladder_cmd(project), cwd=project.path, env=project.env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        lad = ladder_json(project) if (project.path / "report/ladder.json").exists() else {}
        rungs = lad.get("rungs") or []
        if len(rungs) >= 2 and rungs[1]["status"] == "running" and vllm_pids():
            return proc
        if proc.poll() is not None:
            out = proc.stdout.read()[-3000:]
            pytest.fail(f"the ladder exited {proc.returncode} before rung 1 ran an engine:\n{out}")
        time.sleep(1)
    os.killpg(proc.pid, signal.SIGKILL)
    pytest.fail("rung 1 did not start an engine within 900 s")


def test_ctrl_c_keeps_finished_rungs_and_leaves_no_process(project):
    proc = start_ladder_and_wait_for_rung_1(project)
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: SIGINT to the foreground group
    try:
        out, _ = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"Ctrl-C did not stop the ladder within 300 s:\n{proc.communicate()[0][-3000:]}")
    assert proc.returncode == 130, out[-3000:]
    lad = ladder_json(project)
    assert [r["status"] for r in lad["rungs"]] == ["ok", "interrupted"]
    exps = project.dvc("exp", "show", "--json").stdout
    assert "cpu-0-baseline" in exps
    assert not wait_no_project_process(project.path), "Ctrl-C left a process of the ladder behind"
    assert not wait_no_vllm(), "Ctrl-C left a vLLM process behind"


def test_a_sigkilled_ladder_leaves_nothing_running_and_make_ladder_resumes(project):
    """The OOM killer, a `kill -9`: no handler of the ladder runs, yet `dvc exp run`, its stage and the stage's
    engine die with it, and the next run finds no live lock holder and resumes from the run-cache."""
    proc = start_ladder_and_wait_for_rung_1(project)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate()
    left = wait_no_project_process(project.path)
    assert not left, f"processes of the SIGKILLed ladder still running: {left}"
    assert not wait_no_vllm(), "a vLLM process outlived the SIGKILLed ladder"
    p = project.run(*ladder_cmd(project), "--rungs", "1", check=False, timeout=1800)
    out = p.stdout + p.stderr
    assert p.returncode == 0 and "is busy" not in out, out[-4000:]
    rungs = ladder_json(project)["rungs"]
    assert [(r["name"], r["status"]) for r in rungs if r["role"] not in decide.RE_MEASURES] == [
        ("baseline", "ok"), ("fp8-kv", "ok")], out[-4000:]
    assert {"eval", "bench", "knee"} <= set(rungs[0]["reused"]), rungs[0]["reused"]  # resumed: not re-measured


def test_make_ladder_resumes_keeps_reverts_and_reports(project):
    t0 = time.monotonic()
    p = project.run(*ladder_cmd(project), timeout=3600)
    lad = ladder_json(project)
    by = {r["name"]: r for r in lad["rungs"] if r["role"] not in decide.RE_MEASURES}
    assert set(by) == {"baseline", "fp8-kv", "placebo-seed", "broken-rope", "no-kv-space"}
    # a rung whose tok/s could be a gain was held until its base was measured again right after it: bench only, no
    # knee server started, its own row; the rung judged against the base's engines on both sides of it (which rungs
    # read faster than their base before depends on the machine's noise: the rule is unit-tested and simulated)
    agains = [r for r in lad["rungs"] if r["role"] == decide.RECHECK]
    held = [r for r in lad["rungs"] if decide.AGAIN in (r.get("delta") or {})]
    assert {r["name"] for r in held} <= {"fp8-kv", "placebo-seed"} and len(agains) == len(held), (agains, held)
    assert all("before and after it" in r["delta"]["output_tps"]["why"] for r in held), [r["delta"] for r in held]
    # the first bench of the run warmed the machine with an untimed engine first, and kept its tok/s
    assert {"bench"} <= set(by["baseline"]["reused"]) or by["baseline"]["bench"]["warm_up_engine"]["output_tps"] > 0
    for again, rung in zip(agains, held):
        assert again["status"] == "ok" and again["bench"]["status"] == "ok" and again["kept"] is False, again
        assert again["knee"]["status"] == "n/a" and again["knee"]["label"] == "bench only"
        assert again["stage_time"]["knee"]["start_s"] == 0 and again["base"] == rung["base"]
        assert again["knobs"] == next(r for r in lad["rungs"] if r["exp"] == again["base"])["knobs"]
    assert "ladder: decision rule: a rung is kept only when it is significantly better" in p.stdout
    # the placebo changes nothing measurable: reverted, the simpler config stays
    pl = by["placebo-seed"]
    assert (pl["status"] == "ok" and pl["verdict"] == "reverted"
            and "no measurable gain" in pl["decision"]), pl["decision"]
    # resumed: rung 0 came back from DVC's run-cache instead of being measured again
    assert {"eval", "bench", "knee"} <= set(by["baseline"]["reused"]) or "didn't change" in p.stdout
    # the rung designed to fail the gate is reverted, and says why
    br = by["broken-rope"]
    assert br["status"] == "ok" and br["kept"] is False and br["gate"]["keep"] is False
    assert br["decision"].startswith("quality gate failed")
    # ... and no engine was started to measure its speed (gate.measure_failed is false): bench and knee are n/a,
    # naming the gate, with nothing spent starting or measuring
    for stage in ("bench", "knee"):
        res = br[stage]
        assert res["status"] == "n/a" and res["label"] == "gate failed", res
        assert "quality gate failed (results/gate.json)" in res["reason"] and "gate.measure_failed" in res["reason"]
        assert br["stage_time"][stage]["start_s"] == 0 and br["stage_time"][stage]["measure_s"] == 0
    assert br["bench"]["output_tps"] is None and br["knee"]["knee_rps"] is None and br["knee"]["rows"] == []
    assert br["delta"]["knee_rps"]["verdict"] == "unknown"  # not measured is not "knee lost"
    # the rung whose engine cannot start is recorded as failed with the engine's own error, and the ladder went on
    nk = by["no-kv-space"]
    assert nk["status"] == "failed" and nk["kept"] is False and "memory" in nk["error"].lower()
    assert by["baseline"]["kept"] is True
    assert lad["complete"] is True and lad["final_exp"] in {"cpu-0-baseline", "cpu-1-fp8-kv"}
    # the change took effect, per the engine's own log / metrics
    fp8 = by["fp8-kv"]
    assert fp8["applied"][0]["knob"] == "engine.kv_cache_dtype" and fp8["applied"][0]["applied"] is True
    # DVC experiments: one per rung that ran to the end
    exps = project.dvc("exp", "show", "--json").stdout
    for name in ("cpu-0-baseline", "cpu-1-fp8-kv", "cpu-2-placebo-seed", "cpu-3-broken-rope"):
        assert name in exps
    # the report
    md = (project.path / "report/before_after.md").read_text()
    for row in ("| 0 baseline", "| 1 fp8-kv", "| 2 placebo-seed", "| 3 broken-rope", "| 4 no-kv-space"):
        assert row in md
    full = md.split("## Appendix")[1]  # the full table: the first screen's rows read "#3 broken-rope"
    assert "failed → reverted" in md and "reverted" in full.split("| 3 broken-rope")[1].split("\n")[0]
    assert "not measured: gate failed" in full.split("| 3 broken-rope")[1].split("\n")[0]
    assert "Rule: a rung is kept only when" in md
    # `make compare`: one row per rung, DVC's metrics beside the ladder's verdict
    cmp = project.run("python", "scripts/compare.py").stdout
    assert "| 2 placebo-seed" in cmp and "reverted" in cmp.split("| 2 placebo-seed")[1].split("\n")[0]
    assert "failed" in cmp.split("| 4 no-kv-space")[1].split("\n")[0]
    assert "## What I kept and why" in md and "quality gate failed" in md
    assert md.count("**") >= 2 and "output tok/s →" in md  # the headline
    # a kept stack is confirmed against rung 0 with exactly their knobs: nothing an earlier rung added (broken-rope's
    # RoPE override) rides along, so both pass the gate and are measured
    for r in (lad["confirm"] or {}).get("runs") or []:
        assert r["status"] == "ok" and r["gate"]["verdict"] == "pass" and r["bench"]["status"] == "ok", r["name"]
    # the capacity plan, from rung 0's knee and the final stack's, each named with its bracket
    cap = lad["capacity"]
    assert cap["before"]["knee"]["exp"] == "cpu-0-baseline" and cap["after"]["knee"]["exp"] == lad["final_exp"]
    if cap["before"]["plan"] == "ok":  # a busy CPU may meet the SLO at no rate: then "no plan", never a number
        assert cap["before"]["instances"] >= 1 and cap["before"]["gpus"] is None
    else:
        assert "no knee" in cap["before"]["why"] and "instances" not in cap["before"]
    assert "## Capacity plan" in md and "**Tune vs scale**" in md
    for png in ("knee.png", "rungs.png"):
        data = (project.path / "report" / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    assert not wait_no_vllm()
    print(f"ladder wall time {time.monotonic() - t0:.0f} s")


def test_a_budget_stops_the_ladder_between_rungs_and_the_next_run_resumes(project):
    """`make ladder BUDGET_MIN=`: a lease about to end. Over the finished ladder above, its rung 2 experiment removed
    (as if the lease had gone before it), rung 0 comes back from the run-cache in seconds, but costs what it cost when
    measured; rung 1 would not fit half a minute either, but it comes back from the run-cache too (the stop waits for
    a unit's first experiment that measures); rung 2 has to be measured, so the ladder stops before it, exit 75, the
    rest of it left to the next run (the test after this one, where rung 2 comes back from the run-cache as well: its
    entry outlives the removed experiment, and its run.warm_up is what it ran with, since every rung before it came
    back)."""
    ladder_cmd(project)  # writes ci-ladder.yaml
    project.dvc("exp", "remove", "cpu-2-placebo-seed")
    p = project.run("make", "ladder", "SYSTEM_PYTHON=1", "PROFILE=cpu", "LADDER=ci-ladder.yaml", "BUDGET_MIN=0.5",
                    check=False, timeout=900)
    out = p.stdout + p.stderr
    assert p.returncode != 0 and "Error 75" in p.stderr, out[-3000:]
    assert "ladder: stopped before rung 2 placebo-seed:" in p.stderr and "of BUDGET_MIN=0.5 min spent" in p.stderr, \
        out[-3000:]
    assert "`make ladder` resumes" in p.stderr
    lad = ladder_json(project)
    assert lad["complete"] is False and lad["rungs"][0]["status"] == "ok", lad["rungs"]
    assert not [r for r in lad["rungs"] if r["index"] >= 2], lad["rungs"]
    for r in (lad["rungs"][0], next(r for r in lad["rungs"] if r["exp"] == "cpu-1-fp8-kv")):
        assert {"eval", "bench", "knee"} <= set(r["reused"]), (r["exp"], r["reused"])
    assert not wait_no_vllm()


def test_rerunning_with_nothing_changed_reuses_every_finished_rung(project):
    t0 = time.monotonic()
    project.run(*ladder_cmd(project), timeout=1800)
    lad = ladder_json(project)
    for r in lad["rungs"]:
        if r["status"] == "ok":
            assert {"eval", "bench", "knee"} <= set(r["reused"]), (r["name"], r["reused"])
    assert not wait_no_vllm()
    print(f"re-run wall time {time.monotonic() - t0:.0f} s")


def test_a_ladder_cut_off_after_rung_2_resumes_on_another_machine(project, tmp_path):
    """The DVC way: the experiments of rungs 0-2 (the ladder as if cut off there) pushed with `dvc exp push` to a git
    remote and a DVC remote (local folders), pulled into a fresh clone, and `make ladder` run there as another
    machine (a test-only identity): rungs 0-2 keep their verdicts, taken as measured; the last kept rung is measured
    again there before rung 3; no Δ spans two machines (one would stop the run); the report names both."""
    a = ladder_json(project)
    names = project.dvc("exp", "list", "--name-only").stdout.split()
    # the cut ladder's rungs 0-2 (their re-checks included) as its record holds them: the project's experiment list
    # also holds what earlier ladders of this project ran (a knee re-check one of them read and this one did not)
    cut = sorted(r["exp"] for r in a["rungs"] if r["exp"].split("-")[1] in ("0", "1", "2"))
    assert "cpu-0-baseline" in cut and "cpu-2-placebo-seed" in cut and set(cut) <= set(names), (cut, names)
    origin, store, clone = tmp_path / "origin.git", tmp_path / "store", tmp_path / "b"
    project.run("git", "init", "-q", "--bare", str(origin))
    project.run("git", "push", "-q", str(origin), "HEAD:refs/heads/main")
    project.dvc("remote", "add", "--local", "-f", "-d", "store", str(store))
    project.dvc("exp", "push", str(origin), *cut, timeout=600)
    project.run("git", "clone", "-q", "-b", "main", str(origin), str(clone))
    b = type(project)(clone)
    b.env[host.TEST_MACHINE] = "B"
    b.dvc("remote", "add", "--local", "-d", "store", str(store))
    b.dvc("exp", "pull", str(origin), *cut, timeout=600)
    (clone / "ci-ladder.yaml").write_text((project.path / "ci-ladder.yaml").read_text())
    p = b.run("python", "scripts/ladder.py", "--profile", "cpu", "--ladder", str(clone / "ci-ladder.yaml"),
              check=False, timeout=3600)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    lad = json.loads((clone / "report/ladder.json").read_text())
    there = {r["exp"]: r for r in a["rungs"]}
    replayed = [r for r in lad["rungs"] if r.get("replayed")]
    assert sorted(r["exp"] for r in replayed) == cut
    for r in replayed:  # as measured and decided on the first machine
        assert r["verdict"] == there[r["exp"]]["verdict"], r["exp"]
        assert r["measured"]["machine"] == there[r["exp"]]["measured"]["machine"]
    b_id = lad["environment"]["machine"]["id"]
    assert b_id != there["cpu-0-baseline"]["measured"]["machine"]
    order = [r["exp"] for r in lad["rungs"]]
    moved = next(r for r in lad["rungs"] if "-here-" in (r["name"] or ""))
    assert moved["role"] == decide.RECHECK and moved["knee"]["status"] != "n/a"  # bench and knee, here
    assert order.index(moved["exp"]) < order.index("cpu-3-broken-rope")
    assert moved["knobs"] == next(r for r in a["rungs"] if r["exp"] == moved["base"])["knobs"]
    for r in lad["rungs"] + ((lad.get("confirm") or {}).get("runs") or []):
        if r.get("status") == "ok" and not r.get("replayed"):
            assert r["measured"]["machine"] == b_id, r["exp"]
    md = (clone / "report/before_after.md").read_text()
    assert "**Machines**" in md and b_id in md and there["cpu-0-baseline"]["measured"]["machine"] in md
    assert not wait_no_vllm()


# A rung whose knee reads worse on one server a side, re-checked on fresh servers, then a rung after it: the re-check's
# run.anchor {look, side, after} must not ride into the next rung's params (Hydra's `++` merges dicts), or that rung
# looks once at the re-check's rate instead of searching. Four sequences at a time (max_num_seqs 4, the base's 16)
# serve at about a quarter of the base's knee (the known-gain ladder: 2.4 against 9.5 req/s); the placebo after it
# is searched (or restored from its own search in the run-cache). One sequence at a time made this test 588 s of a
# CI run: its eval, bench and overloaded looks ran 4x slower still.
RECHECK_LADDER = {**CI_LADDER, "profiles": {"cpu": {**CI_LADDER["profiles"]["cpu"], "rungs": [
    {"name": "four-seqs", "set": {"engine.max_num_seqs": 4}, "note": "four sequences at a time: a knee well below"},
    {"name": "placebo-seed", "set": {"engine.seed": 1}, "note": "a placebo: greedy decoding ignores the seed"},
]}}}


def test_a_rung_after_a_knee_re_check_is_searched_not_re_checked(project):
    path = project.path / "recheck-ladder.yaml"
    path.write_text(yaml.safe_dump(RECHECK_LADDER, sort_keys=False))
    p = project.run("python", "scripts/ladder.py", "--profile", "cpu", "--ladder", str(path), check=False,
                    timeout=3600)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    lad = ladder_json(project)
    order = [r["name"] for r in lad["rungs"]]
    # the placebo's own knee may be re-checked too (knee.noise_floor 0): its re-checks are its own
    checks = [r for r in lad["rungs"] if r["role"] == decide.KNEE_RECHECK and r["name"].startswith("four-seqs")]
    assert [r["name"] for r in checks] == ["four-seqs-knee-base", "four-seqs-knee-rung"], (
        order, [(r["name"], (r.get("delta") or {}).get("knee_rps")) for r in lad["rungs"]])
    for r in checks:
        assert r["knee"]["mode"] == "recheck" and r["knee"]["label"] == "knee re-check", r["knee"]
        # knee only: the bench is its experiment's, restored (the base's too, whose bench warmed the machine)
        assert {"eval", "bench"} <= set(r["reused"]), (r["name"], r["reused"])
    pl = next(r for r in lad["rungs"] if r["name"] == "placebo-seed")
    assert order.index("placebo-seed") > order.index("four-seqs-knee-rung"), order
    assert pl["status"] == "ok", pl.get("error")
    k = pl["knee"]
    assert k["mode"] == "search" and k["label"] != "knee re-check" and k.get("recheck") is None, k
    assert k["knee_rps"] is not None or k["first_fail_rps"] is not None, k  # a bracket of its own
    got = project.dvc("exp", "show", "--json").stdout
    assert '"look"' not in json.dumps(project.params()["run"]), project.params()["run"]
    assert "cpu-2-placebo-seed" in got
    full = (project.path / "report/before_after.md").read_text().split("## Appendix")[1]  # the full table
    row = full.split("| 2 placebo-seed")[1].split("\n")[0]
    assert "re-check:" not in row, row
    assert not wait_no_vllm()
