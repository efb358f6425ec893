"""What every stage record shares: its schema version, one writer and one reader, the stage's time split."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar, Self

from pydantic import BaseModel, ConfigDict, model_validator

import common


class Record(BaseModel):
    """A stage's result file. `SCHEMA` is the version this code writes; a file without one is version 1 (written
    before records were typed), upgraded on reading by the subclass's `model_validator(mode="before")`."""
    model_config = ConfigDict(extra="forbid", protected_namespaces=())
    SCHEMA: ClassVar[int] = 1
    schema_version: int = 1

    def save_file(self, path: Path | str) -> None:
        """The one writer: atomic (common.write_json), every field, the current schema version."""
        common.write_json(path, self.model_dump(mode="json") | {"schema_version": self.SCHEMA})

    @classmethod
    def load_file(cls, path: Path | str) -> Self:
        """The one reader: the file validated (an older schema upgraded) into the record."""
        return cls.model_validate(json.loads(Path(path).read_text(encoding="utf-8")))

    def as_rung(self) -> dict:
        """The record as a rung of the ladder record holds it: whole, but for its provenance (stated there once).
        Not `summary`: the bench record has a field of that name (its runs summarized), kept on disk as it was."""
        return self.model_dump(mode="json", exclude={"provenance"})


class KeysSinceV1(Record):
    """A record whose version 1 (untyped, written before its model) already had its keys (some added over time
    absent): reading one stamps the current version and changes nothing else."""

    @model_validator(mode="before")
    @classmethod
    def _upgrade(cls, data: Any) -> Any:
        if not isinstance(data, dict) or data.get("schema_version", 1) >= cls.SCHEMA:
            return data
        return {**data, "schema_version": cls.SCHEMA}


class Closed(BaseModel):
    """A part of a record whose keys one function of the code fixes: an undeclared key is refused by name."""
    model_config = ConfigDict(extra="forbid")


class StageTime(BaseModel):
    """common.stage_time: a stage's wall time (process start to its result file), split."""
    model_config = ConfigDict(extra="forbid")
    wall_s: float
    start_s: float
    measure_s: float
    other_s: float
