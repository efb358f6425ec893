"""`make compare`: DVC's experiments (`dvc.api.exp_show`), one row per rung of the last ladder, with its verdict.

DVC knows each experiment's params and metrics; only the ladder knows which rung was kept (the gate's pass is
not the verdict: a candidate that passed the gate can still be "not chosen"). This joins the two.
Usage: python scripts/compare.py [LADDER_JSON]
"""
from __future__ import annotations

import sys
from pathlib import Path

import dvc.api
from dvc.exceptions import DvcException
from tabulate import tabulate

import common
from judgement.decide import change_cell
from records.ladder import LadderRecord

METRICS = {"results/eval.json": ["overall"], "results/bench.json": ["output_tps"],
           "results/knee.json": ["knee_rps", "first_fail_rps"]}


def experiments(shown: list[dict]) -> dict[str, dict]:
    """`dvc.api.exp_show()`'s rows (one per revision; a metric's column is `<file>:<key>`, or `<key>` alone where
    no other file has it) → {experiment name: {"metrics": {file: {key: value}}}}, for the METRICS this table shows."""
    def value(row: dict, path: str, key: str):
        v = row.get(f"{path}:{key}", row.get(key))
        return None if v in ("None", "-", "") else v  # how exp_show spells a null or a metric a revision lacks
    return {row["Experiment"]: {"metrics": {path: {key: value(row, path, key) for key in keys}
                                            for path, keys in METRICS.items()}}
            for row in shown if row.get("Experiment")}


def rows(lad: LadderRecord, exps: dict[str, dict]) -> list[dict]:
    out = []
    for r in lad.rungs:
        e = exps.get(r.exp or "")
        row = {"rung": f"{r.index} {r.name}", "experiment": r.exp or "—", "change": change_cell(r)}
        for path, keys in METRICS.items():
            for key in keys:
                row[key] = (e["metrics"].get(path) or {}).get(key) if e else None
        row["verdict"] = r.verdict or r.status
        out.append(row)
    return out


def main() -> int:
    src = Path(sys.argv[1]) if len(sys.argv) > 1 else common.ROOT / "report" / "ladder.json"
    if not src.exists():
        common.die(f"{src.name}: no ladder has run here yet; run `make ladder` first")
    lad = LadderRecord.load_file(src)
    try:
        shown = dvc.api.exp_show(repo=str(common.ROOT))
    except DvcException as e:
        common.die(f"dvc exp show failed: {e}")
    table = rows(lad, experiments(shown))
    print(tabulate(table, headers="keys", tablefmt="github", missingval="—"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
