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
imported (ENV_READ_AT_IMPORT; vLLM's own knobs are read when asked, vllm.envs, and may differ).

Nothing it starts outlives the stage that asked: the child leads its own process group (the stage stops it by PID
as any engine: engine.Proc.stop), gets SIGTERM when the launcher dies (PR_SET_PDEATHSIG) and stops its group when the
stage's process is gone (it watches the stage's PID). This module imports nothing of the project (its child runs the
project's scripts as a fresh interpreter would) and vLLM only in the launcher's own process.
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
                      "TRITON_", "PYTHON", "LD_", "HF_", "TRANSFORMERS_", "TOKENIZERS_", "VLLM_LOGGING_",
                      "VLLM_CONFIGURE_LOGGING", "VLLM_TARGET_DEVICE", "NO_COLOR", "FORCE_COLOR")
STOP_GRACE_S = 10  # a child whose stage is gone, or the launcher stopping: SIGTERM, then SIGKILL after this long
PR_SET_PDEATHSIG, PR_SET_NAME = 1, 15  # linux/prctl.h


# ---------------------------------------------------------------- the stage's side
class Launched:
    """A forked command as engine.Proc uses a subprocess.Popen: pid, poll(), wait(timeout), returncode, stdout."""

    def __init__(self, cmd: list[str], conn: socket.socket, reader, pid: int, stdout):
        self.args, self.pid, self.stdout = cmd, pid, stdout
        self.returncode: int | None = None
        self._conn, self._reader, self._done = conn, reader, threading.Event()
        threading.Thread(target=self._wait_exit, daemon=True).start()

    def _wait_exit(self):
        """The launcher writes the child's exit status once it has reaped it; a launcher gone first counts as a
        kill, and the child's group is stopped (its PDEATHSIG does the same)."""
        rc = None
        with contextlib.suppress(OSError, ValueError, KeyError):
            line = self._reader.readline()
            rc = json.loads(line)["rc"] if line else None
        if rc is None:
            with contextlib.suppress(OSError):
                os.killpg(self.pid, signal.SIGKILL)
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


def env_refusal(base: dict, env: dict) -> str | None:
    """Why a child cannot get `env` in a process that imported with `base` (None: it can)."""
    differ = sorted(k for k in set(base) | set(env) if base.get(k) != env.get(k) and k.startswith(ENV_READ_AT_IMPORT))
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


def _take(lsock: socket.socket, base: dict) -> tuple[socket.socket, dict, int] | None:
    """The next request: its connection, itself and its output pipe; None where it was refused (and answered)."""
    conn, _ = lsock.accept()
    conn.settimeout(10)  # a stage that connects and sends nothing does not hold the others up
    try:
        req, out = _recv(conn)
        why = runnable(req["argv"]) or env_refusal(base, req["env"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        req, out, why = {}, None, f"a request it could not read ({type(e).__name__}: {e})"
    conn.settimeout(None)
    if why or out is None:
        _send(conn, {"refused": why or "no output pipe was passed"})
        conn.close()
        if out is not None:
            os.close(out)
        return None
    return conn, req, out


def _reap(children: dict[int, socket.socket]) -> None:
    """Each exit status to the stage that asked."""
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        if pid in children:
            conn = children.pop(pid)
            _send(conn, {"rc": os.waitstatus_to_exitcode(status)})
            conn.close()


def serve(path: str, base: dict) -> None:
    """Accept requests until SIGTERM; each is forked (the child raises _Child up to main) or refused. `base`: the
    environment the launcher imported with, before its imports changed it."""
    imported = {k: v for k, v in os.environ.items() if base.get(k) != v}  # what vLLM's imports set (env_override)
    me = os.getpid()
    lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lsock.bind(path)
    lsock.listen(16)
    children: dict[int, socket.socket] = {}
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    signal.signal(signal.SIGINT, lambda *_: stopping.append(1))
    print(f"launcher: ready ({os.getpid()}, {threading.active_count()} thread(s))", flush=True)
    while not stopping:
        ready, _, _ = select.select([lsock], [], [], 0.2)
        if ready and (got := _take(lsock, base)):
            conn, req, out = got
            sys.stdout.flush()
            sys.stderr.flush()
            led_r, led_w = os.pipe()  # the child says it leads its group before the stage learns its pid
            pid = os.fork()
            if pid == 0:
                lsock.close()
                for c in children.values():
                    c.close()
                os.close(led_r)
                # as a fresh start's imports would have set them: the request equals `base` there
                req.update(out=out, conn=conn, launcher=me, led=led_w, env={**req["env"], **imported})
                raise _Child(req)
            os.close(led_w)
            os.read(led_r, 1)  # b"" if it died first: its exit status follows anyway
            os.close(led_r)
            os.close(out)
            children[pid] = conn
            _send(conn, {"pid": pid})
        _reap(children)
    _stop_children(list(children))
    lsock.close()
    with contextlib.suppress(OSError):
        os.unlink(path)


def _stop_children(pids: list[int]) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(OSError):
                os.killpg(pid, sig)
        deadline = time.monotonic() + STOP_GRACE_S
        while pids and time.monotonic() < deadline:
            with contextlib.suppress(ChildProcessError):
                pid, _ = os.waitpid(-1, os.WNOHANG)
                if pid in pids:
                    pids.remove(pid)
                    continue
            time.sleep(0.1)


def _watch(stage: int) -> None:
    """In the child: stop this process group once the stage that asked for it is gone."""
    def watch():
        try:
            fd = os.pidfd_open(stage)
            select.select([fd], [], [])
        except (OSError, AttributeError):  # no pidfd (old kernel): poll
            while True:
                try:
                    os.kill(stage, 0)
                except ProcessLookupError:
                    break
                except PermissionError:
                    pass
                time.sleep(1)
        os.killpg(0, signal.SIGTERM)
        time.sleep(STOP_GRACE_S)
        os.killpg(0, signal.SIGKILL)
    threading.Thread(target=watch, daemon=True, name="ladder-stage-watch").start()


def _become(req: dict) -> None:
    """In the child, before the command runs: the process a fresh start would have been."""
    os.setsid()  # its own process group: the stage stops it with killpg as any engine
    os.write(req["led"], b"1")
    os.close(req["led"])
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != req["launcher"]:  # the launcher died before prctl
        os._exit(1)
    req["conn"].close()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL if sig != signal.SIGINT else signal.default_int_handler)
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
    _watch(req["watch"])


def _title(argv: list[str]) -> None:
    """The child named as a fresh start of `argv` would be (ps, /proc: its command line, and `vllm` for the CLI), so
    that what looks for a stage's engine by its command finds it."""
    with contextlib.suppress(ImportError):
        import setproctitle  # a vLLM dependency (it titles its own processes with it)
        setproctitle.setproctitle(" ".join(argv))
    name = Path(argv[0]).name
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_NAME, name.encode()[:15])


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
    except _Child as c:
        _become(c.req)
        return run(c.req["argv"])
    return 0


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
                             preexec_fn=lambda: ctypes.CDLL("libc.so.6").prctl(PR_SET_PDEATHSIG, signal.SIGTERM))
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
