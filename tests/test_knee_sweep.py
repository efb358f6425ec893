"""The knee stage's probe loop on a synthetic server: which rates it offers, what it records, and that no two
calls re-send the same prompts (one seed for all let the prefix cache serve later probes: 66 % hits on the
H200). The probe client is a stand-in writing vLLM-shaped result JSON; the real path runs in the e2e tests."""
import json

import config
import knee

# the knee section as the stage gets it: validated, the model's defaults filled (timeouts, min_rate), and the
# workload the stage adds (workload.prepare)
K = {**config.Knee.model_validate({
    "mode": "search", "start_rate": 4, "max_rate": 256, "rel_tol": 0.1, "max_probes": 7, "probe_seconds": 10,
    "min_prompts": 8, "max_prompts": 400, "backlog_ratio": 0.8}).model_dump(),
    "workload": {"kind": "random", "input_len": 64, "output_len": 64}}
SLO = {"p99_ttft_ms": 500, "p99_tpot_ms": 50}
CAPACITY = 23.0  # req/s where the synthetic server's p99 TTFT crosses the SLO


class FakeServer:
    url = "http://127.0.0.1:1"

    def alive(self):
        return True


class FakeProber:
    def __init__(self):
        self.calls = []

    def __call__(self, argv, timeout, what):
        a = {f: argv[i + 1] for i, f in enumerate(argv[:-1]) if f.startswith("--")}  # flag -> the token after it
        rate, n = float(a["--request-rate"]), int(a["--num-prompts"])
        self.calls.append({"rate": rate, "seed": a["--seed"], "what": what})
        ttft = 100 * (1 + 4 * (rate / CAPACITY) ** 8)  # flat, then a wall: 500 ms at CAPACITY
        result = {"completed": n, "failed": 0, "request_throughput": rate * 0.97, "output_throughput": rate * 60,
                  "request_goodput": rate, "duration": n / rate}
        for p in (50, 90, 99):
            result.update({f"p{p}_ttft_ms": ttft, f"p{p}_tpot_ms": 20.0, f"p{p}_itl_ms": 20.0, f"p{p}_e2el_ms": 1400.0})
        out = a["--result-dir"] + "/" + a["--result-filename"]
        with open(out, "w") as f:
            json.dump(result, f)


def test_search_brackets_the_synthetic_knee_and_every_call_has_its_own_seed(tmp_path):
    prober, srv = FakeProber(), FakeServer()
    knee.warm_up(prober, srv, "model", K, SLO, tmp_path)
    rows, probes = knee.sweep(prober, srv, "model", K, SLO, tmp_path)
    lo, hi = max(r for r, ok in probes if ok), min(r for r, ok in probes if not ok)
    assert lo <= CAPACITY < hi and (hi - lo) / lo <= K["rel_tol"]
    assert len(rows) == len(probes) <= K["max_probes"]
    seeds = [c["seed"] for c in prober.calls]
    assert len(seeds) == len(set(seeds)) == len(probes) + 1  # warm-up + probes, no seed twice
    assert len((tmp_path / "sweep.log").read_text().splitlines()) == len(probes)  # each probe logged as it ends


def test_repeated_probes_at_one_rate_use_distinct_seeds_too(tmp_path):
    prober = FakeProber()
    rows, _ = knee.sweep(prober, FakeServer(), "model", {**K, "mode": "sweep", "rates": [4, 8], "repeats": 3}, SLO,
                         tmp_path)
    assert [r["repeats"] for r in rows] == [3, 3]
    assert sorted(int(c["seed"]) for c in prober.calls) == [1, 2, 3, 4, 5, 6]
