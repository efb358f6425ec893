"""What the measuring stages run against an engine: the bench stage's throughput runs and warm-up engine
(throughput), the knee's looks through `vllm bench serve` on a running server (knee_looks). Both the stages and the
tools beside them (the ladder, `make benchmark`) run this code, so no module imports a stage script.

May import: common, config, measure, serving.
"""
