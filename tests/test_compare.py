"""`make compare`: DVC's experiments joined with the ladder's verdicts (the gate's pass is not the verdict)."""
import compare
from records.ladder import LadderRecord

SHOW = [  # the rows of `dvc.api.exp_show()` (DVC 3), trimmed: one per revision, metrics as `<file>:<key>` columns
    {"Experiment": None, "rev": "workspace", "typ": "baseline"},
    {"Experiment": None, "rev": "main", "typ": "baseline"},
    {"Experiment": "cpu-0-baseline", "rev": "1", "typ": "branch_base", "engine.max_num_batched_tokens": 512,
     "output_tps": 420.0, "results/knee.json:knee_rps": 6.0,  # a key no other file has: no file prefix
     "results/knee.json:first_fail_rps": 7.0, "results/gate.json:keep": True},
    {"Experiment": "cpu-5-batched-tokens-2048", "rev": "2", "typ": "branch_commit",
     "results/bench.json:output_tps": 400.0, "results/knee.json:knee_rps": "None", "results/gate.json:keep": True},
]
LADDER = LadderRecord.model_validate({"profile": "cpu", "rungs": [
    {"index": 0, "name": "baseline", "exp": "cpu-0-baseline", "role": "baseline", "change": {}, "status": "ok",
     "verdict": "baseline"},
    {"index": 5, "name": "batched-tokens-2048", "exp": "cpu-5-batched-tokens-2048", "role": "candidate",
     "status": "ok", "change": {"engine.max_num_batched_tokens": 2048}, "verdict": "not chosen"},
    {"index": 6, "name": "tensor-parallel", "exp": None, "role": "rung", "status": "skipped", "change": {},
     "verdict": "skipped"},
]})


def test_one_row_per_rung_with_the_ladders_verdict_not_the_gates_pass():
    rows = compare.rows(LADDER, compare.experiments(SHOW))
    assert [r["rung"] for r in rows] == ["0 baseline", "5 batched-tokens-2048", "6 tensor-parallel"]
    assert rows[0]["output_tps"] == 420.0 and rows[0]["knee_rps"] == 6 and rows[0]["verdict"] == "baseline"
    assert rows[1]["verdict"] == "not chosen" and rows[1]["change"] == "engine.max_num_batched_tokens=2048"
    assert rows[1]["output_tps"] == 400.0 and rows[1]["knee_rps"] is None  # exp_show's "None": a null
    assert rows[2]["output_tps"] is None and rows[2]["experiment"] == "—"
    assert all("keep" not in r for r in rows)
