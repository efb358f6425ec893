"""The engine's lifecycle and the vLLM-specific code: starting, watching and stopping engines, servers and the
commands the ladder runs, so that none outlives its stage (engine), forked from a process that imported vLLM once
where `make ladder` runs one (launcher, which imports nothing of the project); what this project relies on inside
vLLM, checked against the installed version before any engine starts (vllm_compat); the model folders the engines
serve, fetched, built or found and verified (model_store), and the weightless ones that `load_format: dummy` serves
(shape_model).

May import: common.
"""
