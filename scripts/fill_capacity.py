"""Fill the capacity plan (and the per-GPU figures) into a copy of an existing ladder record, stating that it was
added afterwards from the knees the record holds; nothing is re-measured. Settings: `capacity` of the record's
profile, unless given.

The filled record goes to OUT_JSON, never over LADDER_JSON nor over a file dvc.yaml declares: report/ladder.json is
the ladder's own record and the report stage's dependency, so a rewrite here would change a stage's input outside
DVC (`dvc status` would then call the report stale for a reason no stage or `make ladder` wrote). Render the copy
with `python scripts/report.py OUT_JSON FOLDER`.

  python scripts/fill_capacity.py LADDER_JSON OUT_JSON [--peak-rps R] [--headroom H]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

import common
import plan as planning
from judgement import capacity
from records.ladder import LadderRecord


def declared_files() -> set[Path]:
    """Every file or folder a dvc.yaml stage declares (deps, outs, metrics, plots), resolved from the repo root."""
    stages = (yaml.safe_load((common.ROOT / "dvc.yaml").read_text()) or {}).get("stages") or {}
    paths = set()
    for stage in stages.values():
        for key in ("deps", "outs", "metrics", "plots"):
            for item in stage.get(key) or []:
                name = next(iter(item)) if isinstance(item, dict) else item
                if "${" not in name:  # a templated dep (the workload file) names no fixed path
                    paths.add((common.ROOT / name).resolve())
    return paths


def out_problem(src: Path, out: Path) -> str | None:
    """Why `out` may not take the filled record, or None: it must be a file of its own."""
    where = out.resolve()
    if where == src.resolve():
        return f"OUT_JSON: {out} is LADDER_JSON itself; write the filled record to a file of its own"
    if where in declared_files():
        return (f"OUT_JSON: {out} is a file dvc.yaml declares (a stage's input or output); only DVC and "
                f"`make ladder` write it: write the filled record elsewhere")
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description="fill the capacity plan into a copy of an existing ladder record")
    ap.add_argument("ladder_json", type=Path)
    ap.add_argument("out_json", type=Path)
    ap.add_argument("--peak-rps", type=float, default=None)
    ap.add_argument("--headroom", type=float, default=None)
    args = ap.parse_args()
    if why := out_problem(args.ladder_json, args.out_json):
        print(f"error: {why}", file=sys.stderr)
        return 2
    lad = LadderRecord.load_file(args.ladder_json).as_dict()
    params = common.read_params()
    eff = planning.effective_params(params, planning.load_ladder(), lad["profile"], planning.committed_params())
    cap = dict(eff["capacity"])
    cap.update({k: v for k, v in (("peak_rps", args.peak_rps), ("headroom", args.headroom)) if v is not None})
    capacity.annotate(lad, cap)
    lad["capacity"]["added"] = ("added after the run by scripts/fill_capacity.py from the knees this record holds; "
                                "nothing was re-measured")
    lad.setdefault("settings", {})["capacity"] = cap
    LadderRecord.model_validate(lad).save_file(args.out_json)
    print(f"capacity: plan filled into {args.out_json} (from {args.ladder_json})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
