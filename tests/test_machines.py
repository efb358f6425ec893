"""Which machine measured a number, and that no Δ is formed across two (the resume issue). Pure: no engine."""
import copy

import pytest

from judgement import record, stats
from measure import host

FP = {"device": "gpu", "gpu": "1x NVIDIA H200", "driver": "580.159.04", "cuda_driver": "13.0", "host_id": "aaaa",
      "gpus": [{"index": "0", "name": "NVIDIA H200", "memory_mib": 143771, "driver": "580.159.04",
                "uuid": "GPU-07dc29a2-a294-70a1-89a2-061dddbd41c9"}],
      "cpu": {"model": "x", "cores": 16}, "vllm": "0.26.0", "torch": "2.11.0", "python": "3.12.3"}


def with_(**changes) -> dict:
    fp = copy.deepcopy(FP)
    for k, v in changes.items():
        if k == "uuid":
            fp["gpus"][0]["uuid"] = v
        else:
            fp[k] = v
    return fp


def test_a_machine_changes_with_its_gpus_driver_cuda_vllm_or_torch_not_with_its_host(monkeypatch):
    monkeypatch.delenv(host.TEST_MACHINE, raising=False)
    here = host.machine(FP)["id"]
    assert host.machine(with_(host_id="bbbb"))["id"] == here  # containers often share a host id
    assert host.machine({**FP, "python": "3.12.4"})["id"] == here
    for change in ({"uuid": "GPU-ffffffff-0000"}, {"driver": "580.160.00"}, {"cuda_driver": "13.1"},
                   {"vllm": "0.27.0"}, {"torch": "2.12.0"}):
        assert host.machine(with_(**change))["id"] != here, change
    cpu = {**FP, "gpus": [], "gpu": None, "driver": None, "cuda_driver": None}
    assert host.machine(cpu)["id"] != host.machine({**cpu, "cpu": {"model": "x", "cores": 8}})["id"]
    assert "H200" in host.machine(FP)["label"] and here in host.machine(FP)["label"]
    monkeypatch.setenv(host.TEST_MACHINE, "B")  # tests only: this box stands in for another machine
    assert host.machine(FP)["id"] != here and "test machine B" in host.machine(FP)["label"]


def rec(name, tps, machine, knee=6.0):
    return {"exp": name, "knobs": {"engine.seed": 0}, "status": "ok", "measured": {"machine": machine},
            "bench": {"output_tps_runs": tps, "status": "ok"},
            "knee": {"knee_rps": knee, "first_fail_rps": knee * 1.19, "conclusive_fail_rps": knee * 1.19}}


def test_a_delta_across_two_machines_cannot_be_formed():
    floor = stats.Floor(0.015, engines=9)
    a, b = rec("base", [400.0, 401.0], "aaaa0000"), rec("rung", [480.0, 481.0], "bbbb0000", knee=9.0)
    with pytest.raises(record.CrossMachine, match="no Δ across machines"):
        record.compare(a, b, floor)
    with pytest.raises(record.CrossMachine):  # nor with a flank measured elsewhere
        record.compare(a, rec("rung", [480.0], "aaaa0000"), floor, again=rec("again", [400.0], "bbbb0000"))
    assert record.compare(a, rec("rung", [480.0, 481.0], "aaaa0000"), floor)["output_tps"]["verdict"] == "better"
    # nor does the ladder's start-to-start floor pool one config's engines from two machines
    assert record.same_config_groups([a, rec("base", [300.0, 301.0], "bbbb0000")]) == []
    assert record.same_machine([a, {"exp": "old"}])  # a record from before machines were named: no claim


def test_gpus_saved_is_no_plan_when_rung_0_and_the_final_stack_were_measured_on_two_machines():
    from judgement import capacity
    base = {**rec("cpu-0-baseline", [400.0], "aaaa0000"), "role": "baseline"}
    final = {**rec("cpu-3-x", [480.0], "bbbb0000", knee=12.0), "role": "rung"}
    out = capacity.plan([base, final], "cpu-3-x", {"peak_rps": 20, "headroom": 0.2}, 0.0, False)
    assert out["saved"]["plan"] == capacity.NO_PLAN and "two machines" in out["saved"]["why"]
