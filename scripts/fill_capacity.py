"""Fill the capacity plan (and the per-GPU figures) into an existing ladder record, stating that it was added
afterwards from the knees the record holds; nothing is re-measured. Settings: `capacity` of the record's profile,
unless given.

  python scripts/fill_capacity.py LADDER_JSON [--peak-rps R] [--headroom H]
"""
from __future__ import annotations

import argparse
import sys

import common
import plan as planning
from judgement import capacity
from records.ladder import LadderRecord


def main() -> int:
    ap = argparse.ArgumentParser(description="fill the capacity plan into an existing ladder record")
    ap.add_argument("ladder_json")
    ap.add_argument("--peak-rps", type=float, default=None)
    ap.add_argument("--headroom", type=float, default=None)
    args = ap.parse_args()
    lad = LadderRecord.load_file(args.ladder_json).as_dict()
    params = common.read_params()
    eff = planning.effective_params(params, planning.load_ladder(), lad["profile"], planning.committed_params())
    cap = dict(eff["capacity"])
    cap.update({k: v for k, v in (("peak_rps", args.peak_rps), ("headroom", args.headroom)) if v is not None})
    capacity.annotate(lad, cap)
    lad["capacity"]["added"] = ("added after the run by scripts/fill_capacity.py from the knees this record holds; "
                                "nothing was re-measured")
    lad.setdefault("settings", {})["capacity"] = cap
    LadderRecord.model_validate(lad).save_file(args.ladder_json)
    print(f"capacity: plan filled into {args.ladder_json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
