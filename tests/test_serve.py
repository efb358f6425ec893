"""params `serve`: `vllm serve`'s own arguments (no EngineArgs field), read by the knee stage's server only. The section
parses; a count below 1 is refused in our words, a value vLLM's serve parser refuses in its; the server's command
line carries --api-server-count only when set; the API-server processes are counted on a real process tree. No engine
(the entry points' refusals are test_check_params')."""
import copy
import sys
import textwrap
import time

import pytest

import common
import config
import plan as planning
from conftest import ROOT
from serving import engine, vllm_compat

RAW = config.read_params(ROOT / "params.yaml")
LADDER = planning.load_ladder(ROOT / "ladder.yaml")
NO_HTTP = ("is not allowed; expected an integer >= 1: below 1 `vllm serve` starts no API server process (headless: "
           "engines with no HTTP front end), so no knee can be measured")


def with_count(value) -> dict:
    p = copy.deepcopy(RAW)
    p["serve"] = {"api_server_count": value}
    return p


def test_the_serve_section_parses_and_defaults_to_vllms_own_choice():
    assert config.validate(RAW)["serve"] == {"api_server_count": None}  # params.yaml's: vLLM's own choice
    assert config.validate(with_count(4))["serve"] == {"api_server_count": 4}
    gone = copy.deepcopy(RAW)
    del gone["serve"]
    assert config.validate(gone)["serve"] == {"api_server_count": None}  # null: no flag, vLLM's default


@pytest.mark.parametrize("value", [0, -1])
def test_a_count_below_one_is_refused_in_our_words_naming_field_and_value(value):
    with pytest.raises(common.ParamsError) as e:
        config.validate(with_count(value))
    assert str(e.value) == f"params.yaml is not valid:\n  serve.api_server_count: {value} {NO_HTTP}"


def test_an_unknown_serve_key_is_refused_by_name():
    p = copy.deepcopy(RAW)
    p["serve"]["api_servers"] = 4
    with pytest.raises(common.ParamsError, match="serve.api_servers: unknown key; allowed: api_server_count"):
        config.validate(p)


def test_what_vllms_serve_parser_refuses_is_refused_in_its_words():
    assert config.validate(with_count("four"))["serve"]["api_server_count"] == "four"  # left to vLLM's parser
    version = vllm_compat.installed_version()
    assert vllm_compat.serve_arg_errors({"api_server_count": "four"}) == [
        f"serve.api_server_count: 'four' is refused by {version}'s `vllm serve` parser (`--api-server-count four`): "
        "argument --api-server-count/-asc: invalid int value: 'four'"]
    assert vllm_compat.serve_arg_errors({"api_server_count": "0"}) == [f"serve.api_server_count: '0' {NO_HTTP}"]
    assert vllm_compat.serve_arg_errors({"api_server_count": 4}) == []
    assert vllm_compat.serve_arg_errors({"api_server_count": None}) == []


ENGINE = {"max_num_seqs": 16, "enforce_eager": True}


def server(tmp_path, serve=None) -> engine.Server:
    srv = engine.Server("/models/m", ENGINE, {}, tmp_path / "s.log", serve=serve)
    srv.port = 8123  # whichever port was free
    return srv


def test_the_serve_command_carries_the_api_server_count_only_when_set(tmp_path):
    stock = server(tmp_path).command()
    assert stock[1:] == ["serve", "/models/m", "--host", "127.0.0.1", "--port", "8123", "--disable-uvicorn-access-log",
                         "--max-num-seqs", "16", "--enforce-eager"]
    assert server(tmp_path, {"api_server_count": None}).command() == stock
    assert server(tmp_path, {"api_server_count": 4}).command() == stock + ["--api-server-count", "4"]


def test_vllms_serve_parser_reads_the_command_as_meant(tmp_path):
    argv = server(tmp_path, {"api_server_count": 4}).command()[2:]  # after `vllm serve`
    args = vllm_compat.serve_arg_parser().parse_args(argv)
    assert (args.model_tag, args.port, args.api_server_count, args.max_num_seqs) == ("/models/m", 8123, 4, 16)


# a stand-in `vllm serve`: children titled as vLLM titles its processes (the titles are the arguments)
FAKE_SERVE = textwrap.dedent("""
    import subprocess, sys, time
    code = "import setproctitle, sys, time; setproctitle.setproctitle(sys.argv[1]); time.sleep(60)"
    kids = [subprocess.Popen([sys.executable, "-c", code, title]) for title in sys.argv[1:]]
    time.sleep(60)
""")


def fake_serve(tmp_path, *titles) -> engine.Proc:
    script = tmp_path / "fake_serve.py"
    script.write_text(FAKE_SERVE)
    return engine.Proc([sys.executable, str(script), *titles], tmp_path / "fake.log")


def titled(proc: engine.Proc, n: int) -> None:
    """Wait until the fake's `n` children have set their titles."""
    import psutil
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        kids = psutil.Process(proc.pid).children()
        if len(kids) == n and all(not k.name().startswith("python") for k in kids):
            return
        time.sleep(0.1)
    pytest.fail("the fake server's children did not set their titles")


def test_the_api_server_processes_are_counted_by_vllms_title(tmp_path):
    pytest.importorskip("setproctitle")  # a vLLM dependency: how vLLM titles its processes
    titles = ["VLLM::APIServer_0", "VLLM::APIServer_1", "VLLM::APIServer_2", "VLLM::EngineCore", "MINE::APIServer_0"]
    proc = fake_serve(tmp_path, *titles)
    try:
        titled(proc, len(titles))
        assert len(vllm_compat.api_processes(proc.pid)) == 3
        assert len(vllm_compat.api_processes(proc.pid, "MINE")) == 1  # VLLM_PROCESS_NAME_PREFIX
        srv = server(tmp_path, {"api_server_count": 3})
        srv.proc = proc
        assert srv.api_servers() == {"asked": 3, "found": 3}
    finally:
        proc.stop()
    assert srv.api_servers() == {"asked": 3, "found": 0}  # stopped: none


def test_one_api_server_is_the_serve_process_itself(tmp_path):
    pytest.importorskip("setproctitle")
    proc = fake_serve(tmp_path, "VLLM::EngineCore")  # `vllm serve --api-server-count 1`: HTTP in the serve process
    try:
        titled(proc, 1)
        srv = server(tmp_path, {"api_server_count": 1})
        srv.proc = proc
        assert srv.api_servers() == {"asked": 1, "found": 1}
    finally:
        proc.stop()


def test_a_profile_sets_the_api_server_count_as_any_other_key():
    lad = copy.deepcopy(LADDER)
    lad["profiles"]["gpu-shape-4090"]["settings"]["serve.api_server_count"] = 4
    plan = planning.resolve(RAW, lad, "gpu-shape-4090", RAW, gpus=0)
    assert plan.params["serve"]["api_server_count"] == 4
    assert plan.overrides["serve.api_server_count"] == 4  # every `dvc exp run -S` of the ladder sets it
    cpu = planning.resolve(RAW, lad, "cpu", RAW, gpus=0)  # another profile: params.yaml's committed value
    assert cpu.overrides["serve.api_server_count"] is None and cpu.params["serve"]["api_server_count"] is None
    lad["profiles"]["gpu-shape-4090"]["settings"]["serve.api_server_count"] = 0
    with pytest.raises(common.ParamsError, match=f"serve.api_server_count: 0 {NO_HTTP[:20]}"):
        planning.resolve(RAW, lad, "gpu-shape-4090", RAW, gpus=0)
