"""Bring your own model, traffic and engine args — the parts that start no engine: vLLM's own engine-arg
parser on rungs, the workload section and prompts files, the flags vLLM's bench parsers take, MODEL= choices,
the local source's hashes, and the hub errors of an offline Hugging Face cache."""
import copy
import json
import os
import subprocess
import sys

import pytest

import common
import config
import plan as planning
import report
from conftest import FIXTURES, ROOT
from measure import workload
from serving import model_store, vllm_compat

PARAMS = common.read_params(ROOT / "params.yaml")
LADDER = planning.load_ladder(ROOT / "ladder.yaml")
SCRIPTS = ROOT / "scripts"


def eff(profile="cpu"):
    return common.validate(planning.effective_params(PARAMS, LADDER, profile, PARAMS))  # defaults filled


def vllm_errors(*rungs, profile="cpu", params=None) -> str:
    lad = copy.deepcopy(LADDER)
    lad["profiles"][profile]["rungs"] = list(rungs)
    lad = config.Ladder.model_validate(lad).model_dump(by_alias=True)  # as load_ladder gives it
    p = params or eff(profile)
    plan = planning.Plan(profile=profile, params=p, overrides={}, rungs=planning.plan(p, lad, profile),
                         objective="knee_rps", gpus=0)
    return "\n".join(planning.engine_arg_errors(plan))


# ---------------------------------------------------------------- engine args: vLLM's own parser
def test_any_engine_arg_of_the_installed_vllm_is_a_legal_rung():
    assert vllm_errors({"name": "async", "set": {"engine.async_scheduling": True}}) == ""
    assert vllm_errors({"name": "chunk", "set": {"engine.long_prefill_token_threshold": [64, 128]}}) == ""


def test_a_mistyped_engine_arg_is_refused_with_vllms_message_naming_the_rung():
    msg = vllm_errors({"name": "seqs", "set": {"engine.max_num_seqs": "lots"}})
    assert "ladder.yaml cpu rung 1 'seqs': engine.max_num_seqs: 'lots' is refused by vllm" in msg
    assert "argument --max-num-seqs: invalid int value: 'lots'" in msg
    msg = vllm_errors({"name": "kv", "set": {"engine.kv_cache_dtype": "int3"}})
    assert "rung 1 'kv': engine.kv_cache_dtype: 'int3'" in msg and "invalid choice: 'int3'" in msg


def test_an_unknown_engine_arg_is_refused_with_a_suggestion():
    msg = vllm_errors({"name": "typo", "set": {"engine.max_num_seq": 64}})
    assert "rung 1 'typo': engine.max_num_seq: not an engine argument of vllm" in msg
    assert "unrecognized arguments: --max-num-seq" in msg and "did you mean max_num_seqs" in msg


def test_baseline_engine_args_are_checked_by_vllms_parser_too():
    p = eff()
    p["baseline"]["engine"]["enable_prefix_caching"] = "yes"
    msg = vllm_errors({"name": "fp8", "set": {"engine.kv_cache_dtype": "fp8"}}, params=p)
    assert "baseline.engine.enable_prefix_caching: 'yes' is refused by vllm" in msg


def test_ladder_check_accepts_async_scheduling_and_refuses_lots_before_any_engine_starts(tmp_path):
    def check(rung):
        lad = copy.deepcopy(LADDER)
        lad["profiles"]["cpu"]["rungs"] = [rung]
        (tmp_path / "ladder.yaml").write_text(json.dumps(lad))  # JSON is YAML
        return subprocess.run([sys.executable, str(SCRIPTS / "ladder.py"), "--profile", "cpu", "--check", "--ladder",
                               str(tmp_path / "ladder.yaml")], capture_output=True, text=True, timeout=300)
    ok = check({"name": "async", "set": {"engine.async_scheduling": True}})
    assert ok.returncode == 0, ok.stderr
    bad = check({"name": "seqs", "set": {"engine.max_num_seqs": "lots"}})
    assert bad.returncode == 2
    assert "cpu rung 1 'seqs': engine.max_num_seqs: 'lots' is refused by vllm" in bad.stderr
    assert "invalid int value: 'lots'" in bad.stderr and "nothing was run" in bad.stderr


# ---------------------------------------------------------------- workloads
def wl_errors(**w) -> str:
    p = copy.deepcopy(PARAMS)
    p["workload"] = {**p["workload"], **w}
    with pytest.raises(common.ParamsError) as e:  # as the fingerprint stage and `make check` check it
        workload.check(common.parse(p))
    return str(e.value)


def test_the_shipped_workloads_are_valid():
    for kind in ("random", "shared-prefix", "file"):
        p = copy.deepcopy(PARAMS)
        p["workload"]["kind"] = kind
        workload.check(common.parse(p))
    for profile in ("gpu", "gpu-shape"):  # they climb with the shared prefix by default
        assert eff(profile)["workload"]["kind"] == "shared-prefix"
    assert eff("cpu")["workload"]["kind"] == "random"


def test_bad_workload_fields_are_refused():
    assert "workload.kind: 'sharegpt' is not allowed; expected random | shared-prefix | file" in \
        wl_errors(kind="sharegpt")
    assert "workload.prefix_len: 0 is not allowed; expected an integer > 0" in \
        wl_errors(kind="shared-prefix", prefix_len=0)
    assert "workload.file: 'nope.jsonl': no such file" in wl_errors(kind="file", file="nope.jsonl")
    assert "exceed engine.max_model_len 1024" in wl_errors(kind="shared-prefix", prefix_len=1000)


@pytest.mark.parametrize("lines, expected", [
    (['{"prompt": "hi"}', '{"prompt": "a", '], ":2: not valid JSON"),
    (['{"prompt": "hi"}', "", '{"text": "x"}'], ":3: expected exactly one of `prompt` (a string) or `messages`"),
    (['{"messages": [{"role": "user", "content": 3}]}'], ":1: messages[1] must be"),
    (['{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}'],
     ":1: the last turn is the assistant's"),
    (['{"prompt": "  "}'], ":1: `prompt` must be a non-empty string"),
    (["", "  "], "holds no request"),
])
def test_a_malformed_or_empty_prompts_file_is_refused_with_its_line(tmp_path, lines, expected):
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(lines) + "\n")
    msg = wl_errors(kind="file", file=str(f))
    assert "workload.file: " in msg and expected in msg


def test_a_prompts_file_runs_in_either_bench_mode():
    # both modes run vLLM's bench code in the stage's worker, which draws a prompts file's requests itself
    for mode in ("engine", "cli"):
        p = copy.deepcopy(PARAMS)
        p["workload"]["kind"], p["bench"]["mode"] = "file", mode
        common.validate(p)


def test_the_example_prompts_file_loads_prompts_and_chat_turns():
    items = workload.load_file(ROOT / PARAMS["workload"]["file"])
    assert len(items) == 8 and all(it["messages"][-1]["role"] == "user" for it in items)
    assert any(it["messages"][0]["role"] == "system" for it in items)


def test_workload_descriptions_say_whether_a_prefix_is_shared():
    w = PARAMS["workload"]
    assert workload.describe({**w, "kind": "random"})["shared_prefix"].startswith("no:")
    sp = workload.describe({**w, "kind": "shared-prefix"})
    assert sp["shared_prefix"].startswith("yes:") and sp["shared_prefix_len"] == w["prefix_len"]
    assert "prompts file" in workload.describe({**w, "kind": "file"})["text"]


def _vllm_parser(add_cli_args):
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    p = FlexibleArgumentParser()
    add_cli_args(p)

    def error(message):
        raise AssertionError(message)
    p.error = error
    return p


def test_the_workload_flags_are_spelled_as_vllms_bench_parsers_take_them():
    from vllm.benchmarks import serve, throughput
    w = {**PARAMS["workload"], "kind": "shared-prefix", "prompts": "x.jsonl"}
    a = _vllm_parser(serve.add_cli_args).parse_args(["--model", "m"] + vllm_compat.dataset_flags(w, "serve"))
    assert (a.dataset_name, a.random_prefix_len, a.random_input_len) == ("random", w["prefix_len"], w["input_len"])
    a = _vllm_parser(throughput.add_cli_args).parse_args(["--model", "m"] + vllm_compat.dataset_flags(w, "throughput"))
    assert (a.dataset_name, a.random_prefix_len, a.random_output_len) == ("random", w["prefix_len"], w["output_len"])
    f = {**w, "kind": "file"}
    a = _vllm_parser(serve.add_cli_args).parse_args(["--model", "m"] + vllm_compat.dataset_flags(f, "serve", "x.jsonl"))
    assert (a.dataset_name, a.dataset_path, a.custom_output_len, a.skip_chat_template) == (
        "custom", "x.jsonl", w["output_len"], True)


def test_the_report_prints_the_workload_the_stages_recorded(tmp_path):
    lad = json.loads((FIXTURES / "ladder_cpu.json").read_text())
    lad["rungs"][0]["bench"]["workload"] = {"kind": "random", "text": "WORDS FROM THE STAGE",
                                            "shared_prefix": "yes: SAID BY IT"}
    md = report.render(lad, tmp_path)
    assert "- **Workload** (bench and knee alike): WORDS FROM THE STAGE" in md
    assert "- **Shared prefix?** yes: SAID BY IT" in md


def test_the_prefix_caching_check_follows_the_workload():
    from judgement import decide
    change = {"engine.enable_prefix_caching": True}
    on = {"cache_config": {"enable_prefix_caching": "True"}}
    shared = decide.applied_check(change, {**on, "workload_shared_prefix_len": 256, "prefix_cache_hit_rate": 0.0}, {})
    assert shared[0]["applied"] is False  # on, but nothing hit on traffic that shares a prefix
    assert decide.applied_check(change, {**on, "workload_shared_prefix_len": 256, "prefix_cache_hit_rate": 0.7},
                                {})[0]["applied"] is True
    assert decide.applied_check(change, {**on, "prefix_cache_hit_rate": 0.0}, {})[0]["applied"] is True


# ---------------------------------------------------------------- models: MODEL=, local folders, the HF cache
def model_folder(path, weights=b"w" * 64):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text('{"model_type": "llama"}')
    (path / "model.safetensors").write_bytes(weights)
    return path


def test_model_choice_takes_a_catalog_name_a_local_folder_or_a_pinned_hub_repo(tmp_path):
    catalog = PARAMS["download"]["catalog"]
    assert planning.model_choice("smollm2-135m", catalog) == ("smollm2-135m", None)
    name, entry = planning.model_choice(str(model_folder(tmp_path / "My_Finetune")), catalog)
    assert name == "local-my-finetune" and entry == {"source": "local", "path": str(tmp_path / "My_Finetune")}
    assert planning.model_choice("Org/Model-2.5-7B@abc123", catalog) == (
        "model-2-5-7b", {"source": "hf", "repo": "Org/Model-2.5-7B", "revision": "abc123"})


@pytest.mark.parametrize("make, expected", [
    (lambda d: d / "gone", "no such folder"),
    (lambda d: (d / "f.txt").write_text("x") and d / "f.txt", "not a folder"),
    (lambda d: (d / "empty").mkdir() or d / "empty", "not a model folder: no config.json"),
    (lambda d: model_folder(d / "cfg").joinpath("model.safetensors").unlink() or d / "cfg",
     "not a model folder: no weights"),
])
def test_a_bad_local_model_is_refused_naming_the_path(tmp_path, make, expected):
    path = make(tmp_path)
    with pytest.raises(common.ParamsError) as e:
        planning.model_choice(str(path), PARAMS["download"]["catalog"])
    assert f"MODEL: {str(path)!r}: {expected}" in str(e.value) and str(path) in str(e.value)


def test_an_unpinned_hub_repo_is_refused_with_how_to_pin_it():
    with pytest.raises(common.ParamsError, match=r"a Hugging Face repo needs a pinned revision: MODEL=Org/M@<commit>"):
        planning.model_choice("Org/M", PARAMS["download"]["catalog"])


def test_model_on_the_cpu_profile_quantizes_it_with_the_same_recipe(tmp_path):
    folder = model_folder(tmp_path / "ft")
    p = planning.resolve(PARAMS, LADDER, "cpu", PARAMS, 0, model=str(folder))
    assert p.params["baseline"]["model"]["name"] == "local-ft"
    assert p.overrides["download.fetch"] == ["local-ft", "local-ft-w4a16"]
    assert p.overrides["download.catalog.local-ft-w4a16"]["from"] == "local-ft"
    assert p.rungs[0]["set"] == {"model.name": "local-ft-w4a16"} and not p.rungs[0].get("skip")


def test_model_without_a_quantized_variant_skips_that_rung_and_quant_model_fills_it(tmp_path):
    p = planning.resolve(PARAMS, LADDER, "gpu", PARAMS, 1, model="Org/Base@r1")
    assert "no quantized variant" in p.rungs[0]["skip"] and p.overrides["download.fetch"] == ["base"]
    assert p.experiments == 1 + 3 + 2  # rung 0, fp8-kv, spend-memory, prefix-caching, 2 batched-tokens candidates
    p = planning.resolve(PARAMS, LADDER, "gpu", PARAMS, 1, model="Org/Base@r1", quant_model="Org/Base-AWQ@r2")
    assert p.rungs[0]["set"] == {"model.name": "base-awq"} and p.overrides["download.fetch"] == ["base", "base-awq"]
    assert LADDER["profiles"]["gpu"]["rungs"][0]["set"]["model.name"] == "qwen2.5-7b-instruct-awq"  # not mutated


def test_the_choices_survive_dvc_exp_run_set(tmp_path):
    """What `make ladder MODEL=… WORKLOAD=…` passes to every `dvc exp run -S`, applied as DVC applies it."""
    from dvc.utils.hydra import apply_overrides

    from runner import experiments
    folder = model_folder(tmp_path / "My.Finetune v2")
    p = planning.resolve(PARAMS, LADDER, "cpu", PARAMS, 0, model=str(folder), workload="shared-prefix")
    (tmp_path / "params.yaml").write_text((ROOT / "params.yaml").read_text())
    apply_overrides(str(tmp_path / "params.yaml"), [f"++{k}={experiments.hydra(v)}" for k, v in p.overrides.items()])
    got = common.read_params(tmp_path / "params.yaml")
    for key, value in p.overrides.items():
        assert planning.get_dotted(got, key) == value, key
    assert got["download"]["catalog"]["local-my-finetune-v2"] == {"source": "local", "path": str(folder)}
    common.validate({**got, **{s: got["baseline"][s] for s in ("model", "engine", "env")}})


def test_workload_choice_sets_the_kind_or_the_file():
    p = planning.resolve(PARAMS, LADDER, "cpu", PARAMS, 0, workload="shared-prefix")
    assert p.params["workload"]["kind"] == "shared-prefix" and p.overrides["workload.kind"] == "shared-prefix"
    p = planning.resolve(PARAMS, LADDER, "cpu", PARAMS, 0, workload="evals/prompts_example.jsonl")
    assert (p.params["workload"]["kind"], p.params["workload"]["file"]) == ("file", "evals/prompts_example.jsonl")


def test_a_local_model_is_used_in_place_and_its_files_hashed(tmp_path):
    folder = model_folder(tmp_path / "ft")
    path, info = model_store.from_local("ft", {"source": "local", "path": str(folder)}, tmp_path / "store")
    assert path == folder and set(info["files"]) == {"config.json", "model.safetensors"}
    assert info["files"]["config.json"] == common.sha256_file(folder / "config.json")
    (folder / "model.safetensors").write_bytes(b"v" * 65)  # a changed checkpoint, same name
    _, again = model_store.from_local("ft", {"source": "local", "path": str(folder)}, tmp_path / "store")
    assert again["sha256"] != info["sha256"] and again["files"]["config.json"] == info["files"]["config.json"]
    with pytest.raises(model_store.ModelError, match=r"download.catalog.ft.path: .*no such folder"):
        model_store.from_local("ft", {"source": "local", "path": str(tmp_path / "gone")}, tmp_path / "store")


def hf_cache(root, repo: str, revision: str, folder) -> None:
    """A Hugging Face hub cache as huggingface_hub lays it out: blobs, a snapshot of symlinks, refs/main."""
    base = root / f"models--{repo.replace('/', '--')}"
    (base / "refs").mkdir(parents=True)
    (base / "refs" / "main").write_text(revision)
    (base / "blobs").mkdir()
    snap = base / "snapshots" / revision
    snap.mkdir(parents=True)
    for f in sorted(folder.iterdir()):
        if f.is_file() and not f.name.startswith("."):
            blob = base / "blobs" / common.sha256_file(f)
            if not blob.exists():
                os.link(f, blob) if f.stat().st_dev == blob.parent.stat().st_dev else blob.write_bytes(f.read_bytes())
            (snap / f.name).symlink_to(os.path.relpath(blob, snap))


REV = "0123456789abcdef0123456789abcdef01234567"


def hub(tmp_path, catalog_entry: dict) -> subprocess.CompletedProcess:
    """model_store.provide for one hf entry, offline against the test's cache (the hub setting is read at import)."""
    code = (f"import json, sys; sys.path.insert(0, {str(SCRIPTS)!r}); from serving import model_store\n"
            f"try: print(json.dumps(model_store.provide('m', {{'m': {catalog_entry!r}}}, None, {{}})))\n"
            f"except model_store.ModelError as e: print(e, file=sys.stderr); sys.exit(2)")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HOME": str(tmp_path)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


def test_an_offline_hf_cache_serves_a_pinned_revision_and_an_unknown_one_says_how_to_fix_it(tmp_path):
    hf_cache(tmp_path / "hub", "ladder-test/tiny", REV, model_folder(tmp_path / "src"))
    ok = hub(tmp_path, {"source": "hf", "repo": "ladder-test/tiny", "revision": REV})
    assert ok.returncode == 0, ok.stderr
    entry = json.loads(ok.stdout.strip().splitlines()[-1])
    assert entry["path"].endswith(f"snapshots/{REV}") and entry["revision"] == REV
    assert (tmp_path / "hub" / "models--ladder-test--tiny" / "snapshots" / REV / "config.json").exists()
    for spec in ({"repo": "ladder-test/tiny", "revision": "f" * 40}, {"repo": "ladder-test/nope", "revision": REV}):
        bad = hub(tmp_path, {"source": "hf", **spec})
        assert bad.returncode == 2
        assert f"download.catalog.m: {spec['repo']}@{spec['revision']}:" in bad.stderr
        assert "not in the Hugging Face cache" in bad.stderr and "HF_TOKEN" in bad.stderr and "log in" in bad.stderr
