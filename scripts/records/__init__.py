"""Each stage's result file as a typed record, written and read here only (one `save_file` / `load_file` a record,
as GuideLLM's report and AIPerf's metric results are): a field a stage adds is declared once, and a record written
by an older version of the code is read through its model's validators, not by `.get` chains at each reader.

May import: common, config.
"""
