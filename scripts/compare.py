"""`make compare`: `dvc exp show`, one row per rung of the last ladder, with the ladder's own verdict.

DVC knows each experiment's params and metrics; only the ladder knows which rung was kept (the gate's pass is
not the verdict: a candidate that passed the gate can still be "not chosen"). This joins the two.
Usage: python scripts/compare.py [LADDER_JSON]
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import common
from tabulate import tabulate

import report

METRICS = {"results/eval.json": ["overall"], "results/bench.json": ["output_tps"],
           "results/knee.json": ["knee_rps", "first_fail_rps"]}


def experiments(show: list[dict]) -> dict[str, dict]:
    """`dvc exp show --json` → {experiment name: {"params": {...}, "metrics": {...}}} (DVC 3 layout)."""
    out = {}
    for commit in show:
        for exp in commit.get("experiments") or []:
            for rev in exp.get("revs") or []:
                data = rev.get("data") or {}
                params = ((data.get("params") or {}).get("params.yaml") or {}).get("data") or {}
                metrics = {path: (m or {}).get("data") or {} for path, m in (data.get("metrics") or {}).items()}
                if rev.get("name"):
                    out[rev["name"]] = {"params": params, "metrics": metrics}
    return out


def rows(lad: dict, exps: dict[str, dict]) -> list[dict]:
    out = []
    for r in lad["rungs"]:
        e = exps.get(r.get("exp") or "")
        row = {"rung": f"{r['index']} {r['name']}", "experiment": r.get("exp") or "—",
               "change": report.change_cell(r)}
        for path, keys in METRICS.items():
            for key in keys:
                row[key] = (e["metrics"].get(path) or {}).get(key) if e else None
        row["verdict"] = r.get("verdict") or r["status"]
        out.append(row)
    return out


def main() -> int:
    src = Path(sys.argv[1]) if len(sys.argv) > 1 else common.ROOT / "report" / "ladder.json"
    if not src.exists():
        common.die(f"{src.name}: no ladder has run here yet; run `make ladder` first")
    lad = common.read_json(src)
    shown = subprocess.run(["dvc", "exp", "show", "--json"], cwd=common.ROOT, capture_output=True, text=True)
    if shown.returncode != 0:
        common.die(f"dvc exp show failed: {shown.stderr.strip()[-500:]}")
    table = rows(lad, experiments(json.loads(shown.stdout or "[]")))
    print(tabulate(table, headers="keys", tablefmt="github", missingval="—"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
