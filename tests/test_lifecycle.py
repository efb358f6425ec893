"""engine.py's process lifecycle with real child processes (no vLLM needed): stop by process group,
children die with the stage, free ports, error lines, secrets kept out of logs."""
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

import common
import engine
from conftest import PLANTED_TOKEN


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


def test_stop_ends_the_whole_process_group_including_grandchildren(tmp_path):
    pidfile = tmp_path / "pids"
    proc = engine.Proc(["bash", "-c", f"sleep 300 & echo $! > {pidfile}; sleep 300"], tmp_path / "x.log")
    for _ in range(50):
        if pidfile.exists() and pidfile.read_text().strip():
            break
        time.sleep(0.1)
    grandchild = int(pidfile.read_text())
    assert alive(proc.pid) and alive(grandchild)
    proc.stop(grace=5)
    assert not alive(proc.pid) and not alive(grandchild)
    assert "exit code" in (tmp_path / "x.log").read_text()


def test_a_child_that_ignores_sigterm_is_killed_after_the_grace_period(tmp_path):
    proc = engine.Proc([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                        "print('up', flush=True); time.sleep(300)"], tmp_path / "stubborn.log")
    while proc.lines_seen == 0:
        time.sleep(0.05)
    t0 = time.monotonic()
    proc.stop(grace=1)
    assert not alive(proc.pid) and time.monotonic() - t0 < 10
    assert "SIGKILL" in (tmp_path / "stubborn.log").read_text()


def test_children_die_with_the_stage_even_when_it_is_sigkilled(tmp_path):
    """A stage process killed hard (no finally runs) still takes its servers down: PR_SET_PDEATHSIG."""
    stage = textwrap.dedent(f"""
        import time
        import engine
        p = engine.Proc(["sleep", "300"], {str(tmp_path / 'c.log')!r})
        print(p.pid, flush=True)
        time.sleep(300)
    """)
    parent = subprocess.Popen([sys.executable, "-c", stage], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(common.ROOT / "scripts")})
    child = int(parent.stdout.readline())
    assert alive(child)
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 10
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(child)


def test_run_raises_with_the_engines_own_error_line(tmp_path):
    script = ("import sys\nprint('INFO starting')\nprint('Traceback (most recent call last):')\n"
              "print('  File \"x.py\", line 1')\nprint('ValueError: To serve at least one request with the models max seq len "
              "(100000), 5.49 GiB KV cache is needed, which is larger than the available KV cache memory (1.0 GiB).')\n"
              "print('RuntimeError: Engine core initialization failed. See root cause above.')\nsys.exit(1)")
    with pytest.raises(engine.EngineError) as e:
        engine.run([sys.executable, "-c", script], tmp_path / "e.log", timeout=30, what="vllm serve")
    assert "ValueError: To serve at least one request" in e.value.reason
    assert e.value.log == tmp_path / "e.log"


def test_run_times_out_and_stops_the_child(tmp_path):
    with pytest.raises(engine.EngineError, match="timed out after 1 s"):
        engine.run(["sleep", "300"], tmp_path / "t.log", timeout=1)
    assert not engine._live


def test_a_port_already_in_use_is_not_fought_over(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        srv = engine.Server("/nowhere", {}, {}, tmp_path / "unused.log", port=taken)
        assert srv.port != taken and engine.port_free(srv.port)
        assert srv.url.startswith("http://127.0.0.1:")


def test_secrets_never_reach_children_or_logs(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", PLANTED_TOKEN)
    env = engine.child_env({"VLLM_CPU_KVCACHE_SPACE": 2})
    assert "HF_TOKEN" not in env and env["VLLM_CPU_KVCACHE_SPACE"] == "2" and env["HF_HUB_OFFLINE"] == "1"
    # even a child that prints the token (given explicitly) has it blanked in the log
    engine.run(["echo", f"token={PLANTED_TOKEN}"], tmp_path / "s.log", env=env, timeout=30)
    text = (tmp_path / "s.log").read_text()
    assert PLANTED_TOKEN not in text and "token=***" in text
