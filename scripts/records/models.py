"""results/models.json: the download stage's manifest, each model it made available (serving/model_store.provide):
its folder, source, id, revision and hashes, and the store they live in.

Written by scripts/download.py (and `make benchmark --profile`, scripts/benchmark_noise.py, into its own folder)
through `ModelsManifest.save_file` only; read through `load_file` only: the engine stages' model folder and provenance
(records/upstream.py), the ladder record's models (judgement/record.py), `make pack-models` (scripts/models_pack.py;
tests/test_records.py holds both). The keys on disk are the ones the stage wrote before it was typed: an entry holds
the keys its source gives (a local model's `files`, no other's), none written as null.

Version 1: written before the record was typed (no schema_version): the same keys.
"""
from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from pydantic import BaseModel, ConfigDict

import common
from records.base import KeysSinceV1


class ModelEntry(BaseModel):
    """One model as model_store.provide made it available. A key not declared here is kept as written."""
    model_config = ConfigDict(extra="allow", protected_namespaces=())
    name: str | None = None
    source: str | None = None          # pypi-gguf | quantize | hf | shape | local
    path: str                          # its folder (a local model's: where it is, never copied)
    id: str | None = None
    revision: str | None = None
    sha256: str | None = None
    files: dict[str, str] | None = None  # a local model only: each file's sha256

    def as_dict(self) -> dict:
        """The entry as the manifest holds it: the keys its source wrote."""
        return self.model_dump(mode="json", exclude_unset=True)


class ModelsManifest(KeysSinceV1):
    """results/models.json: {store, models: {name: entry}}; `store` None in a manifest written without it."""
    SCHEMA: ClassVar[int] = 2
    store: str | None = None
    models: dict[str, ModelEntry]

    def save_file(self, path: Path | str) -> None:
        """The one writer: atomic (common.write_json), the keys set (an entry's keys as its source gave them), the
        current schema version."""
        common.write_json(path, self.model_dump(mode="json", exclude_unset=True, exclude={"schema_version"})
                          | {"schema_version": self.SCHEMA})

    def entries(self) -> dict[str, dict]:
        """{name: entry} as the manifest holds them."""
        return {n: m.as_dict() for n, m in self.models.items()}
