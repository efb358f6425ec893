"""The judgement: intervals and deltas over measured numbers (stats), the keep/revert rule and its words
(decide), the ladder's typed record (record), the capacity plan (capacity). No measuring stage imports it
(tests/test_dvc_deps.py), so editing a rule, a threshold or the report re-judges and re-renders and re-measures
nothing.

May import: common, measure, records.
"""
