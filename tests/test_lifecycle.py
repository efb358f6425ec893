"""serving/engine.py's process lifecycle with real child processes (no vLLM needed): stop by process group,
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
from conftest import PLANTED_TOKEN
from serving import engine


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


def test_a_killed_group_leaves_no_shared_memory_behind(tmp_path):
    """`vllm serve` waiting on a knee probe's open connections outlives the grace and is SIGKILLed: its resource
    tracker must outlive the rest of the group long enough to unlink the /dev/shm segments (~420 MB a time)."""
    code = ("import signal, time; from multiprocessing import shared_memory; "
            "signal.signal(signal.SIGTERM, signal.SIG_IGN); m = shared_memory.SharedMemory(create=True, size=1 << 20); "
            "print('shm', m.name, flush=True); time.sleep(300)")
    proc = engine.Proc([sys.executable, "-c", code], tmp_path / "shm.log")
    while proc.lines_seen == 0:
        time.sleep(0.05)
    name = next(ln.split()[1] for ln in (tmp_path / "shm.log").read_text().splitlines() if ln.startswith("shm "))
    assert os.path.exists(f"/dev/shm/{name}")
    proc.stop(grace=1)
    assert not alive(proc.pid) and "SIGKILL" in (tmp_path / "shm.log").read_text()
    for _ in range(50):  # the tracker unlinks as it exits
        if not os.path.exists(f"/dev/shm/{name}"):
            break
        time.sleep(0.1)
    assert not os.path.exists(f"/dev/shm/{name}"), f"/dev/shm/{name} outlived its SIGKILLed group"
    assert not engine._group_members(proc.pgid)


def test_children_die_with_the_stage_even_when_it_is_sigkilled(tmp_path):
    """A stage process killed hard (no finally runs) still takes its servers down: PR_SET_PDEATHSIG."""
    stage = textwrap.dedent(f"""
        import time
        from serving import engine
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
              "print('  File \"x.py\", line 1')\n"
              "print('ValueError: To serve at least one request with the models max seq len "
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


def wait_dead(pids, timeout=60):
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def test_a_guarded_command_and_all_it_started_die_when_the_caller_is_sigkilled(tmp_path):
    """What `dvc exp run` under a SIGKILLed ladder gets: its whole group, and a descendant that left the group
    (a stage's server in its own session), are stopped by the guard; PDEATHSIG alone reaches only the direct child."""
    pidfile = tmp_path / "pids"
    caller = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(common.ROOT / 'scripts')!r})
        from serving import engine
        p = engine.guarded(["bash", "-c",
                            "setsid sleep 300 & echo $! > {pidfile}; sleep 300 & echo $! >> {pidfile}; wait"])
        print(p.pid, flush=True)
        time.sleep(300)
    """)
    parent = subprocess.Popen([sys.executable, "-c", caller], stdout=subprocess.PIPE, text=True)
    guard = int(parent.stdout.readline())
    while len(pidfile.read_text().split() if pidfile.exists() else []) < 2:
        time.sleep(0.1)
    left_the_group, in_the_group = map(int, pidfile.read_text().split())
    deadline = time.monotonic() + 30  # `setsid` leaves the group once it runs: on a loaded box, a moment after $!
    while os.getpgid(left_the_group) == guard and time.monotonic() < deadline:
        time.sleep(0.05)
    assert os.getpgid(in_the_group) == guard and os.getpgid(left_the_group) != guard
    parent.send_signal(signal.SIGKILL)  # no `finally` runs: an OOM kill, `kill -9`
    parent.wait()
    assert not wait_dead([guard, in_the_group, left_the_group]), "a guarded process outlived its killed caller"


def test_a_guarded_command_sees_ctrl_c_even_if_its_caller_ignores_sigint(tmp_path):
    """A background job of a script inherits SIGINT ignored; the guarded command gets the default disposition,
    Ctrl-C sent to the group reaches it, and its exit code is the guard's."""
    script = ("import signal, sys, time\nprint(signal.getsignal(signal.SIGINT), flush=True)\n"
              "try:\n    time.sleep(300)\nexcept KeyboardInterrupt:\n    sys.exit(130)\n")
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        p = engine.guarded([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    finally:
        signal.signal(signal.SIGINT, old)
    assert p.stdout.readline().strip() == str(signal.default_int_handler)
    os.killpg(p.pid, signal.SIGINT)
    assert p.wait(timeout=30) == 130
    assert engine.guarded(["bash", "-c", "exit 3"]).wait(timeout=30) == 3


def test_terminating_the_guard_stops_its_command(tmp_path):
    p = engine.guarded([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(300)"],
                       stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline() == "up\n"
    p.terminate()
    assert p.wait(timeout=30) == 128 + signal.SIGTERM
    assert not subprocess.run(["pgrep", "-g", str(p.pid)], capture_output=True).stdout


def test_ctrl_c_raises_even_where_sigint_was_inherited_ignored():
    code = (f"import os, signal, sys; sys.path.insert(0, {str(common.ROOT / 'scripts')!r}); import common\n"
            "common.handle_signals()\ntry:\n    os.kill(os.getpid(), signal.SIGINT); import time; time.sleep(5)\n"
            "except KeyboardInterrupt:\n    sys.exit(130)\n")
    p = subprocess.run([sys.executable, "-c", code], preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
                       timeout=30)
    assert p.returncode == 130


def test_a_worker_log_holds_only_its_own_run(tmp_path):
    """The bench stage reads its results from the worker's log: a second run must not find the first's there."""
    script = tmp_path / "w.py"
    script.write_text("import json, sys\nprint('ran', json.load(open(sys.argv[2]))['n'])\n")
    for n in (1, 2):
        proc = engine.run_worker(str(script), {"n": n}, tmp_path, {}, timeout=60, what="w")
    text = proc.log.read_text()
    assert "ran 2" in text and "ran 1" not in text


def test_checking_engine_args_leaves_the_environment_as_it_was_and_engines_log_at_info(monkeypatch):
    """The engine-arg check quiets vLLM for its own import only: a level left in os.environ reached every engine
    started later from the same process, whose INFO lines (KV capacity, config) the stages read."""
    from serving import vllm_compat
    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    vllm_compat.engine_arg_parser.cache_clear()
    assert vllm_compat.engine_arg_errors([("engine", "max_num_seqs", 8)]) == []
    assert "VLLM_LOGGING_LEVEL" not in os.environ
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "WARNING")  # a user's shell
    assert engine.child_env({})["VLLM_LOGGING_LEVEL"] == "INFO"
