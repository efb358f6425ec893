"""The preloaded launcher (serving/launcher.py): a command forked from it runs as a fresh start of it would (its
arguments, environment, working folder, output, exit status, atexit handlers, process name), under the same lifecycle
(stopped by PID with its group, gone with its stage or its launcher), and what it cannot run so is started fresh.
These launchers preload a small module, not vLLM: what is under test is the process plumbing; the engine test at the
end forks the real cpu engine from a launcher that imported vLLM."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
from serving import engine, launcher, vllm_compat  # noqa: E402

MARK = "[ladder] forked from the preloaded launcher"


@pytest.fixture
def running(tmp_path):
    """A launcher (preloading `json` only) for the test, ready before the test asks it anything."""
    log = tmp_path / "launcher.log"
    with launcher.running(log, vllm_compat.child_env(), preload=("json",)) as p:
        deadline = time.monotonic() + 30
        while "ready" not in (log.read_text() if log.exists() else ""):
            assert p.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        yield p


def gone(pid: int, timeout: float = 20) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


def test_a_forked_command_gets_its_arguments_environment_folder_and_exit_status(running, tmp_path):
    code = ("import os, sys; print('args', sys.argv[1:], os.environ['KNOB'], os.getcwd(), sys.path[0] == ''); "
            "sys.exit(3)")
    with pytest.raises(engine.EngineError, match="exit code 3"):
        engine.run([sys.executable, "-c", code, "a", "b"], tmp_path / "c.log", vllm_compat.child_env({"KNOB": 7}))
    log = (tmp_path / "c.log").read_text()
    assert MARK in log and f"args ['a', 'b'] 7 {ROOT} True" in log and "[ladder] exit code 3" in log


def test_a_script_runs_as_main_with_its_folder_first_on_the_path_and_its_atexit_handlers(running, tmp_path):
    (tmp_path / "sibling.py").write_text("WHO = 'sibling'\n")
    (tmp_path / "job.py").write_text(textwrap.dedent("""
        import atexit, sys
        import sibling
        atexit.register(lambda: print('atexit ran', flush=True))
        if __name__ == "__main__":
            print('main', sibling.WHO, sys.argv, flush=True)
    """))
    proc = engine.run([sys.executable, str(tmp_path / "job.py"), "--worker", "x"], tmp_path / "s.log",
                      vllm_compat.child_env())
    log = proc.log.read_text()
    assert MARK in log and f"main sibling ['{tmp_path / 'job.py'}', '--worker', 'x']" in log and "atexit ran" in log


def test_it_is_named_as_its_command_and_leads_its_own_group(running, tmp_path):
    script = tmp_path / "vllm"  # a `vllm`-like CLI script of this interpreter
    script.write_text(f"#!{sys.executable}\nimport time\nprint('up', flush=True)\ntime.sleep(60)\n")
    script.chmod(0o755)
    proc = engine.Proc([str(script), "serve", "m"], tmp_path / "v.log", vllm_compat.child_env())
    try:
        deadline = time.monotonic() + 20
        while "up" not in proc.log.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        p = psutil.Process(proc.pid)
        assert p.name() == "vllm" and " serve m" in " ".join(p.cmdline()) and os.getpgid(proc.pid) == proc.pid
    finally:
        proc.stop(grace=5)
    assert MARK in proc.log.read_text() and gone(proc.pid) and proc.p.returncode == -signal.SIGTERM


def test_stop_ends_the_whole_group_and_a_kill_reads_as_a_signal(running, tmp_path):
    code = ("import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']);"
            " print('child', c.pid, flush=True); time.sleep(60)")
    proc = engine.Proc([sys.executable, "-c", code], tmp_path / "g.log", vllm_compat.child_env())
    deadline = time.monotonic() + 20
    lines = []
    while not (lines := [ln for ln in proc.log.read_text().splitlines() if ln.startswith("child ")]):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    grandchild = int(lines[0].split()[1])
    proc.stop(grace=5)
    assert gone(proc.pid) and gone(grandchild)
    with pytest.raises(engine.EngineError, match="exit code -9"):
        engine.run([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"],
                   tmp_path / "k.log", vllm_compat.child_env())


def test_a_forked_command_dies_with_the_stage_that_asked_and_with_the_launcher(running, tmp_path):
    """The stage SIGKILLed (no `finally` runs): its child goes (it watches the stage). The launcher stopped: what it
    started goes too."""
    out = tmp_path / "pid"
    stage = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(ROOT / 'scripts')!r})
        from pathlib import Path
        from serving import engine, vllm_compat
        p = engine.Proc([sys.executable, '-c', 'import time; time.sleep(120)'], Path({str(tmp_path / 'w.log')!r}),
                        vllm_compat.child_env())
        Path({str(out)!r}).write_text(str(p.pid))
        time.sleep(120)
    """)
    st = subprocess.Popen([sys.executable, "-c", stage], env=os.environ)
    deadline = time.monotonic() + 30
    while not out.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    child = int(out.read_text())
    assert MARK in (tmp_path / "w.log").read_text()
    st.kill()
    st.wait()
    assert gone(child, timeout=launcher.STOP_GRACE_S + 10), "the forked command outlived its SIGKILLed stage"

    proc = engine.Proc([sys.executable, "-c", "import time; time.sleep(120)"], tmp_path / "l.log",
                       vllm_compat.child_env())
    running.terminate()
    running.wait(timeout=30)
    assert gone(proc.pid) and proc.wait(10) < 0
    proc.stop(grace=1)


def test_a_group_member_that_outlives_its_leader_is_killed_once_its_stage_is_gone(running, tmp_path):
    """The stage SIGKILLed: the launcher SIGTERMs the forked command's group, and SIGKILLs what ignores it (an engine
    core that does not stop) after launcher.STOP_GRACE_S."""
    out = tmp_path / "pids"
    stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)"
    leader = (f"import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', {stubborn!r}]); "
              "time.sleep(0.5); print('member', c.pid, flush=True); time.sleep(120)")
    stage = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(ROOT / 'scripts')!r})
        from pathlib import Path
        from serving import engine, vllm_compat
        p = engine.Proc([sys.executable, '-c', {leader!r}], Path({str(tmp_path / 'm.log')!r}), vllm_compat.child_env())
        Path({str(out)!r}).write_text(str(p.pid))
        time.sleep(120)
    """)
    st = subprocess.Popen([sys.executable, "-c", stage], env=os.environ)
    deadline = time.monotonic() + 30
    while not ((tmp_path / "m.log").exists() and "member " in (tmp_path / "m.log").read_text()):
        assert time.monotonic() < deadline and st.poll() is None
        time.sleep(0.05)
    member = int([ln for ln in (tmp_path / "m.log").read_text().splitlines() if ln.startswith("member ")][0].split()[1])
    leader_pid = int(out.read_text())
    st.kill()
    st.wait()
    assert gone(leader_pid, timeout=5), "the leader outlived its SIGKILLed stage"
    assert not gone(member, timeout=launcher.STOP_GRACE_S - 3), "the SIGTERM-ignoring member went before the grace"
    assert gone(member, timeout=10), "the SIGTERM-ignoring member outlived the grace"


def test_what_it_cannot_run_as_asked_starts_fresh(running, tmp_path):
    """A variable a library reads at import differs, or another interpreter: the command runs, not forked."""
    code = "import os; print('omp', os.environ.get('OMP_NUM_THREADS'))"
    proc = engine.run([sys.executable, "-c", code], tmp_path / "o.log", vllm_compat.child_env({"OMP_NUM_THREADS": 1}))
    log = proc.log.read_text()
    assert "omp 1" in log and MARK not in log
    other = tmp_path / "other"
    other.write_text("#!/bin/sh\necho shell\n")
    other.chmod(0o755)
    log = engine.run([str(other)], tmp_path / "sh.log", vllm_compat.child_env()).log.read_text()
    assert "shell" in log and MARK not in log
    venv = tmp_path / "venv"  # another virtual environment of the same base interpreter imports other packages
    (venv / "bin").mkdir(parents=True)
    (venv / "pyvenv.cfg").write_text("home = x\n")
    (venv / "bin" / "python").symlink_to(os.path.realpath(sys.executable))
    other.write_text(f"#!{venv / 'bin' / 'python'}\nprint('other venv')\n")
    assert "not a Python script of this interpreter" in launcher.runnable([str(other)])
    assert launcher.runnable([sys.executable, "-c", "pass"]) is None
    assert launcher.env_refusal({"VLLM_CPU_KVCACHE_SPACE": "1"}, {"VLLM_CPU_KVCACHE_SPACE": "2"}) is None
    assert launcher.env_refusal({}, {"DVC_EXP_NAME": "x"}) is None  # no library reads it
    for name in ("VLLM_LOGGING_LEVEL", "VLLM_BATCH_INVARIANT", "VLLM_SOMETHING_NEW", "OMP_NUM_THREADS"):
        assert name in launcher.env_refusal({name: "1"}, {name: "2"})
    # a value the launcher's own imports set is no difference (a stage that imported vLLM carries it too)
    set_at_import = {"TORCHINDUCTOR_COMPILE_THREADS": "1"}
    assert launcher.env_refusal({}, set_at_import, set_at_import) is None


def test_with_no_launcher_or_one_not_answering_the_command_starts_fresh(tmp_path, monkeypatch):
    monkeypatch.delenv(launcher.ENV, raising=False)
    assert launcher.start([sys.executable, "-c", "pass"], dict(os.environ), ROOT) is None
    monkeypatch.setenv(launcher.ENV, str(tmp_path / "no-socket"))
    log = engine.run([sys.executable, "-c", "print('fresh')"], tmp_path / "f.log", vllm_compat.child_env()).log
    assert "fresh" in log.read_text() and MARK not in log.read_text()


def test_what_the_imports_set_in_the_environment_a_child_gets_too(tmp_path, monkeypatch):
    """vLLM's imports set variables (vllm/env_override.py); a fresh start would have them, so a forked child does."""
    (tmp_path / "setter.py").write_text("import os\nos.environ['SET_AT_IMPORT'] = 'yes'\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    log = tmp_path / "launcher.log"
    with launcher.running(log, vllm_compat.child_env(), preload=("setter",)):
        deadline = time.monotonic() + 30
        while "ready" not in (log.read_text() if log.exists() else ""):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        code = "import os, sys; print('got', os.environ.get('SET_AT_IMPORT'), 'setter' in sys.modules)"
        out = engine.run([sys.executable, "-c", code], tmp_path / "e.log", vllm_compat.child_env()).log.read_text()
    assert MARK in out and "got yes True" in out


@pytest.mark.engine
def test_a_knob_the_ladder_varies_takes_effect_in_an_engine_forked_from_a_vllm_launcher(tmp_path):
    """The cpu ladder's spend-memory knob (env VLLM_CPU_KVCACHE_SPACE) is read by vLLM when the engine starts, not
    when it is imported: an engine forked from a launcher that imported vLLM with 1 GiB gets the 2 GiB it asks for,
    twice the KV tokens of a fresh engine at 1 GiB."""
    import common
    import config
    from runner import throughput
    cfg = common.engine_config(config.load_params())
    env = dict(os.environ, PATH=f"{ROOT / '.venv' / 'bin'}{os.pathsep}{os.environ['PATH']}")
    got = subprocess.run([sys.executable, "scripts/download.py", str(tmp_path / "models.json")], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=1200)
    assert got.returncode == 0, got.stderr[-500:]
    path = json.loads((tmp_path / "models.json").read_text())["models"][cfg["model"]["name"]]["path"]
    argv = ["--model", path, "--dataset-name", "random", "--random-input-len", "16", "--random-output-len", "4",
            "--num-prompts", "4", "--max-model-len", "512", "--max-num-seqs", "4", "--enforce-eager"]
    job = {"dataset_seed": 0}
    tokens = {}
    base = {"VLLM_CPU_KVCACHE_SPACE": 1, "VLLM_ENABLE_V1_MULTIPROCESSING": 0}
    _, fresh = throughput.run_in_engine(argv, 1, tmp_path / "fresh", base, 600, 0, job)
    tokens["fresh 1 GiB"] = fresh["kv_cache_tokens"]
    log = tmp_path / "launcher.log"
    with launcher.running(log, vllm_compat.child_env(base)):
        deadline = time.monotonic() + 120
        while "ready" not in (log.read_text() if log.exists() else ""):
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        _, forked = throughput.run_in_engine(argv, 1, tmp_path / "forked", {**base, "VLLM_CPU_KVCACHE_SPACE": 2}, 600,
                                             0, job)
    assert MARK in (tmp_path / "forked" / "engine.log").read_text()
    tokens["forked 2 GiB"] = forked["kv_cache_tokens"]
    assert tokens["forked 2 GiB"] == 2 * tokens["fresh 1 GiB"], tokens
