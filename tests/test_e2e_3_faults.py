"""Faults on the real engine and real files: a server that dies mid-sweep, broken or missing model folders,
secrets. Each leaves nothing running and loses nothing already measured."""
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import PLANTED_TOKEN, wait_no_vllm

pytestmark = pytest.mark.engine


def serve_pid():
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if ((d / "comm").read_text().strip() == "vllm"
                        and b" serve " in (d / "cmdline").read_bytes().replace(b"\0", b" ")):
                    return int(d.name)
            except OSError:
                continue
    return None


def test_a_stage_killed_midway_stops_its_server(project):
    log = project.path / "results/logs/knee/probes.log"  # the warm-up probe writes it first
    log.unlink(missing_ok=True)
    proc = subprocess.Popen(["python", "scripts/knee.py"], cwd=project.path, env=project.env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and not log.exists():  # the server is up and being warmed
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.5)
    assert serve_pid(), "no vllm serve found"
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "interrupted: stopped by signal SIGTERM" in out
    assert not wait_no_vllm(), "the server outlived its killed stage"


def test_a_server_that_dies_mid_sweep_fails_the_stage_cleanly_and_only_that_stage_reruns(project):
    sweep = project.path / "results/logs/knee/sweep.log"
    sweep.unlink(missing_ok=True)  # so that only this run's first probe can make it appear
    proc = subprocess.Popen(["dvc", "repro", "-f", "-s", "knee"], cwd=project.path, env=project.env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and not (sweep.exists() and sweep.read_text().strip()):
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.5)
    pid = serve_pid()
    assert pid, "no vllm serve found during the sweep"
    os.kill(pid, signal.SIGKILL)  # a crash, not a clean stop
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode != 0
    assert "vllm serve: died during the knee sweep" in out
    assert len(sweep.read_text().strip().splitlines()) >= 1  # the partial sweep is kept
    assert not wait_no_vllm(), "the dead server's engine outlived the stage"
    # the next run touches only the knee (re-measured, or its last good measurement of this very config
    # restored from DVC's run-cache); everything else is still valid and is not run again
    p = project.dvc("repro", "gate", "bench", "knee")
    assert "Running stage 'knee'" in p.stdout or "Stage 'knee' is cached" in p.stdout
    for stage in ("eval", "bench", "gate"):
        assert f"Stage '{stage}' didn't change, skipping" in p.stdout
    assert project.read_json("results/knee.json")["probes"] >= 2


def test_a_corrupt_model_file_is_a_clear_download_error(project, tmp_path):
    models = json.loads((project.path / "results/models.json").read_text())["models"]
    store = tmp_path / "store"
    shutil.copytree(models["smollm2-135m"]["path"], store / "smollm2-135m")
    original = (project.path / "params.yaml").read_text()
    try:
        project.set_params(download__store=str(store), download__fetch=["smollm2-135m"])
        ok = project.run("python", "scripts/download.py")
        assert "smollm2-135m ready" in ok.stdout  # verified against its recorded hashes, not rebuilt
        weights = store / "smollm2-135m" / "model.safetensors"
        data = bytearray(weights.read_bytes())
        data[-100] ^= 0xFF
        weights.write_bytes(bytes(data))
        bad = project.run("python", "scripts/download.py", check=False)
        assert bad.returncode == 1  # a stage error (common.run_stage)
        assert f"file {weights} is corrupt (sha256" in bad.stderr and "delete" in bad.stderr
        project.set_params(**{"download__catalog__smollm2-135m__gguf_sha256": "0" * 64})
        shutil.rmtree(store / "smollm2-135m")
        bad = project.run("python", "scripts/download.py", check=False)
        assert "download.catalog.smollm2-135m.gguf_sha256:" in bad.stderr and "expected " + "0" * 64 in bad.stderr
    finally:
        (project.path / "params.yaml").write_text(original)
        project.run("python", "scripts/download.py")  # manifest back to the shared store


def test_a_missing_model_folder_is_a_clear_error_before_any_engine_starts(project, tmp_path):
    manifest = project.path / "results/models.json"
    good = manifest.read_text()
    data = json.loads(good)
    data["models"]["smollm2-135m"]["path"] = str(tmp_path / "gone")
    try:
        manifest.write_text(json.dumps(data))
        p = project.run("python", "scripts/eval.py", check=False)
        assert p.returncode == 1
        assert f"model.name: 'smollm2-135m': folder {tmp_path / 'gone'} is missing" in p.stderr
        assert "dvc repro -f download" in p.stderr and not wait_no_vllm(5)
    finally:
        manifest.write_text(good)


def test_the_planted_hf_token_never_reaches_results_logs_or_reports(project):
    """Every engine test above ran with HF_TOKEN set in the environment."""
    hits = []
    for folder in ("results", "report", ".dvc/cache"):
        for f in (project.path / folder).rglob("*"):
            if f.is_file() and PLANTED_TOKEN.encode() in f.read_bytes():
                hits.append(str(f.relative_to(project.path)))
    assert not hits, hits
    assert (project.path / "results/logs").exists()  # there were logs to look in
