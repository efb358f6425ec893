"""The engine's lifecycle and the vLLM-specific code: starting, watching and stopping engines, servers and the
commands the ladder runs, so that none outlives its stage (engine); what this project relies on inside vLLM, checked
against the installed version before any engine starts (vllm_compat); the model folders the engines serve, fetched,
built or found and verified (model_store), and the weightless ones that `load_format: dummy` serves (shape_model).

May import: common.
"""
