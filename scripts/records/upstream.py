"""What the engine stages (eval, bench, knee; `make benchmark`) read of the two first stages' records: the model's
folder from the download stage's manifest (records/models.py), the real GPUs a target card is converted on and the
machine from the fingerprint (records/fingerprint.py), and the provenance every measured record carries.
Here, not in common: they read those records, and common imports no record (records import common).
"""
from __future__ import annotations

import time
from pathlib import Path

import common
import config
from records.fingerprint import Fingerprint
from records.models import ModelsManifest


def model_entry(name: str) -> dict:
    """The download stage's manifest entry for a model; clear error if it is missing or its folder is gone."""
    manifest = common.models_json()
    if not manifest.exists():
        raise config.ParamsError(f"model.name: {name!r}: {manifest.relative_to(common.ROOT)} is missing; "
                                 "run the download stage first")
    models = ModelsManifest.load_file(manifest).entries()
    if name not in models:
        raise config.ParamsError(f"model.name: {name!r} is not a model the download stage provides "
                                 f"({', '.join(models)})")
    entry = models[name]
    if not Path(entry["path"], "config.json").is_file():
        raise config.ParamsError(f"model.name: {name!r}: folder {entry['path']} is missing or has no config.json; "
                                 f"run `dvc repro -f download`")
    return entry


def target_gpus(params: config.Params) -> list[dict] | None:
    """The GPUs a target card is converted on (common.engine_config): the fingerprint stage's; None (nothing read)
    where params name no target card."""
    if params.target.memory_gib is None:
        return None
    fp = common.fingerprint_json()
    if not fp.exists():
        shown = fp.relative_to(common.ROOT) if fp.is_relative_to(common.ROOT) else fp
        raise config.ParamsError(f"target.memory_gib: {shown} is missing (this GPU's memory is read there); run the "
                                 f"fingerprint stage first")
    return Fingerprint.load_file(fp).gpu_list()


def engine_config(params: config.Params, which: str = "rung") -> dict:
    """common.engine_config on the GPUs the fingerprint stage found (read only where params name a target card)."""
    return common.engine_config(params, which, target_gpus(params))


def provenance(params: config.Params, cfg: dict | None = None) -> dict:
    """Where a number came from: the machine (fingerprint stage), the model, the eval set, the params, the commit."""
    fp_path = common.fingerprint_json()
    prov = {"environment": Fingerprint.load_file(fp_path).as_environment() if fp_path.exists() else None,
            "git_commit": common.git_commit(),
            "params_hash": common.params_hash(params.model_dump(by_alias=True)),  # hashed as the file spells it
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if cfg is not None:
        prov["knobs"] = cfg
        prov["knobs_hash"] = common.params_hash(cfg)
        manifest = common.models_json()
        if manifest.exists():
            entry = ModelsManifest.load_file(manifest).entries().get(cfg["model"]["name"], {})
            prov["model"] = {k: entry.get(k) for k in ("name", "id", "revision", "sha256", "source")}
    eval_file = common.ROOT / params.eval.file
    if eval_file.exists():
        prov["eval_sha256"] = common.sha256_file(eval_file)
    return prov
