"""`make benchmark` part 4 without an engine: --spread-at's rates, the order a server looks at them, each look's
front-end flag, and the knee.server_spread block written from planted looks (spread.json as part 4 writes it): gamma
fitted where looks at two adjacent grid rates exist, looks bound outside the engine left out and listed, each server's
covariates kept, the block accepted by the profile's schema (config.ServerSpread); and the profile's front end
(serve.api_server_count) on the command line of part 4's servers."""
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import benchmark_noise as bn
import config
import plan
from measure import spread
from serving import engine

ROOT = Path(__file__).resolve().parents[1]
R1, R2 = 26.91, 32.0
FP = {"gpu": "1x planted GPU", "driver": "0", "vllm": "0.26.0"}  # the block names no real machine here


def test_spread_at_takes_one_grid_rate_or_two_adjacent_ones():
    assert bn.spread_rates("11.31", 0.2) == [11.31]
    assert bn.spread_rates("26.91,32", 0.2) == bn.spread_rates("32, 26.91", 0.2) == [26.91, 32.0]
    for bad, words in (("26.91,38.05", "adjacent"), ("27", "not on the grid"), ("26.91,32,38.05", "one knee-grid"),
                       ("", "one knee-grid")):
        with pytest.raises(ValueError, match=words):
            bn.spread_rates(bad, 0.2)


def test_off_the_grid_any_one_or_two_rates_are_taken():
    # the cpu's wall sits inside one grid step: every fresh server held 9.514 req/s, none 11.31
    assert bn.spread_rates("10.4, 9.8", 0.2, off_grid=True) == [9.8, 10.4]
    assert bn.spread_rates("27", 0.2, off_grid=True) == [27.0]
    for bad in ("9.8,9.8", "0,9.8", "9,10,11", ""):
        with pytest.raises(ValueError, match="one rate or two different ones"):
            bn.spread_rates(bad, 0.2, off_grid=True)
    with pytest.raises(ValueError, match="--spread-off-grid takes any"):
        bn.spread_rates("9.8", 0.2)


def test_servers_look_at_the_two_rates_in_alternating_order():
    # a look's place on its server (the second reads worse, say) then cancels out of gamma instead of inflating it
    assert [bn.look_order([R1, R2], i) for i in range(4)] == [[R1, R2], [R2, R1], [R1, R2], [R2, R1]]


def fe(api: float, waiting: int, server_over: int, client_over: int, n: int = 2000) -> dict:
    """A look's front-end figures as measure.frontend.look leaves them (the watcher's reading)."""
    return {"counted": n, "client_over_ttft": client_over, "server_counted": n, "server_over_ttft": server_over,
            "server_reason": None, "waiting_peak": waiting, "running_peak": 30, "api_processes": 4,
            "api_thread_share": api, "client_thread_share": 0.3, "api_stall_s": 0.05, "scrapes": 40}


K = {"dispersion": {"phi": 6.9}, "max_repeats": 2}
SLO = {"percentile": 95, "ttft_ms": 500}


def test_a_look_is_judged_alone_and_flagged_where_its_latency_came_from():
    row = {"counted": 2000, "over_slo": 360, "failed": 0, "backlog": False}
    ev, bound, why = bn.judge_look({**row, "frontend": fe(0.97, 0, 8, 360)}, K, SLO)
    assert ev["verdict"] == "fail" and bound == "front end" and "CPU-saturated" in why
    ev, bound, _ = bn.judge_look({**row, "frontend": fe(0.4, 12, 350, 360)}, K, SLO)  # the engine queued: its own
    assert bound == "engine"
    ev, bound, why = bn.judge_look({**row, "over_slo": 8, "frontend": fe(0.97, 0, 8, 8)}, K, SLO)
    assert ev["verdict"] == "pass" and bound is None and why == "the look passed"
    assert bn.judge_look(row, K, SLO)[1:] == (None, "not instrumented")


def planted_run(seed: int = 4, servers: int = 6) -> dict:
    """spread.json as part 4 writes it at 26.91 and 32 req/s: an untimed server, then `servers` fresh ones whose knees
    spread by a CV of 9.4 % under a wall of exponent 13 (share 1 % at 26.91 on the median server, dispersion 6.9),
    one look at each rate in look_order; server 1's look at 32 was front-end bound."""
    rng = np.random.default_rng(seed)
    m = (6.9 + 1) / 2
    out = {"rate": R1, "rates": [R1, R2], "serve": {"api_server_count": 4}, "servers": []}
    for i in range(servers + 1):
        z, looks = rng.normal(), []
        for rate in (bn.look_order([R1, R2], i) if i else [R1]):
            n = 540 if rate == R1 else 640
            share = min(0.01 * math.exp(0.094 * 13 * z) * (rate / R1) ** 13, 1.0)
            over = int(min(n, rng.geometric(1 / m, rng.poisson(n * share / m)).sum()))
            bound = "front end" if (i, rate) == (1, R2) else None
            looks.append({"rate": rate, "counted": n, "over_slo": over, "bound": bound, "why": "planted"})
        out["servers"].append({"server": i, "timed": i > 0, "ready_s": 90.0 + i, "api_servers": {"asked": 4,
                               "found": 4}, "engine": {"kv_cache_tokens": 100_000 + i, "kv_cache_gib": 5.5},
                               "looks": looks})
    return out


def test_the_block_of_a_two_rate_run_fits_gamma_and_leaves_out_the_front_end_bound_look(tmp_path, capsys):
    out = bn.spread_summary(planted_run(), tmp_path / "spread.json", FP)
    block = out["block"]
    print(capsys.readouterr().out)
    print(block)
    # the front-end bound look is out of the fit and listed; the untimed server is out too
    assert block["servers"] == 6 and block["looks"] == 11 and block["frontend_bound"] == [[1, 1, *[
        (x["over_slo"], x["counted"]) for x in out["servers"][1]["looks"] if x["rate"] == R2][0]]]
    assert [len(s) for s in block["looks_per_server"]] == [1, 2, 2, 2, 2, 2]
    assert all(len(x) == 3 and x[2] in (0, 1) for s in block["looks_per_server"] for x in s)
    assert block["rates"] == [R1, R2] and block["rate"] == R1
    assert [c["server"] for c in block["covariates"]] == [1, 2, 3, 4, 5, 6]
    assert block["covariates"][0] == {"server": 1, "ready_s": 91.0, "api_servers": 4, "kv_cache_tokens": 100_001,
                                      "kv_cache_gib": 5.5}
    # gamma fitted, with an interval that holds the planted 13; the knees' CV from the joint fit
    assert block["gamma_ci"] and block["gamma_ci"][0] < 13 < block["gamma_ci"][1], block
    assert block["knee_cv_ci"][0] < block["knee_cv"] < block["knee_cv_ci"][1]
    assert "gamma fitted" in block["source"] and "1 look(s) bound outside the engine left out" in block["source"]
    assert "serve.api_server_count 4" in block["source"]
    # the profile's schema takes the block as printed
    got = config.ServerSpread(**block)
    assert got.gamma_ci == block["gamma_ci"] and got.frontend_bound == block["frontend_bound"]
    # the fitted looks are those of the block (refit from it: the same fit)
    looks = [[(x[1], x[0], block["rates"][x[2]]) for x in s] for s in block["looks_per_server"]]
    assert spread._Looks(looks).n.sum() == block["counted"]


def test_a_one_rate_run_keeps_its_block_and_says_gamma_was_fixed(tmp_path):
    run = planted_run(seed=5)
    for s in run["servers"]:  # the looks at 26.91 alone, as part 4 took them before (no `rate` in a look, no `rates`)
        s["looks"] = [{k: v for k, v in x.items() if k != "rate"} for x in s["looks"] if x["rate"] == R1]
        s["looks"] += [dict(s["looks"][0])] if s["timed"] else []
    run.pop("rates")
    block = bn.spread_summary(run, tmp_path / "spread.json", FP)["block"]
    assert block["gamma"] == spread.GAMMA == 13.0 and block["gamma_ci"] is None and block["rates"] is None
    assert "gamma fixed at 13" in block["source"]
    assert all(len(x) == 2 for s in block["looks_per_server"] for x in s)
    assert block["knee_cv"] == pytest.approx(block["sigma"] / 13, abs=1e-4)
    assert block["knee_cv_ci"] == pytest.approx([v / 13 for v in block["sigma_ci"]], abs=1e-4)
    config.ServerSpread(**block)


def test_part_4s_servers_front_the_engine_with_the_profiles_api_servers(tmp_path):
    """gpu-shape-4090 sets serve.api_server_count 4: the servers make benchmark starts carry the profile's serve
    section to `vllm serve` (the engine's own config needs the GPU's fingerprint, so the cpu one stands in for it)."""
    eff = config.validate(plan.effective_params(config.read_params(), plan.load_ladder(plan.LADDER_YAML),
                                                "gpu-shape-4090", plan.committed_params()))
    assert eff["serve"]["api_server_count"] == 4
    cpu = config.validate(config.read_params())
    for serve, flag in ((eff["serve"], ["--api-server-count", "4"]), (cpu["serve"], [])):  # cpu: vLLM's own choice
        cfg = bn.servers_config({**cpu, "serve": serve})
        argv = engine.Server("/models/x", cfg["engine"], cfg["env"], tmp_path / "s.log", serve=cfg["serve"]).command()
        got = argv[argv.index("--api-server-count"):][:2] if "--api-server-count" in argv else []
        assert got == flag, argv


def test_a_profile_benchmark_writes_no_dvc_output(monkeypatch, tmp_path):
    # `make benchmark --profile` prepares the profile's models and this machine's fingerprint as the ladder's first
    # stages would, but in its own git-ignored folder: results/models.json and results/fingerprint.json stay the
    # DVC stages' outputs (a clone's `dvc status` stays true), and what the benchmark reads is what it wrote
    import common
    from records import upstream
    monkeypatch.setattr(bn, "BENCHMARK_LOGS", tmp_path)
    monkeypatch.setattr(common, "_SIDE", None)
    before = {p: p.stat().st_mtime_ns for p in (common.RESULTS / "models.json", common.RESULTS / "fingerprint.json")
              if p.exists()}
    params = bn.profile_params(config.load_params().model_dump(by_alias=True), "cpu")
    assert (common.models_json(), common.fingerprint_json()) == (tmp_path / "models.json",
                                                                 tmp_path / "fingerprint.json")
    assert upstream.model_entry(params["model"]["name"])["path"]
    after = {p: p.stat().st_mtime_ns for p in (common.RESULTS / "models.json", common.RESULTS / "fingerprint.json")
             if p.exists()}
    assert after == before   # neither written nor created


def test_one_engine_s_value_is_printed_without_a_spread_not_a_crash(capsys):
    # `make benchmark ARGS="--parts 2 --repeats 1"` crashed in its print after the engines had run (no interval)
    bn.spread("2. 1 fresh engines", [512.25])
    assert capsys.readouterr().out.strip() == "2. 1 fresh engines: n=1 512.2 tok/s (a spread needs 2 or more)"
    bn.spread("2. 2 fresh engines", [500.0, 510.0])
    assert "CV 1.4 %" in capsys.readouterr().out


@pytest.mark.parametrize("bad", ["0", "-2", "two"])
def test_a_bad_repeats_is_refused_by_name_before_any_engine(bad):
    p = subprocess.run([sys.executable, "scripts/benchmark_noise.py", "--repeats", bad], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and f"--repeats must be a whole number above 0, got '{bad}'" in p.stderr, p.stderr
