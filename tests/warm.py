"""``python cli.py ...`` runs started from a warm interpreter, for tests that need a separate process but not a
fresh interpreter.

A new interpreter spends about 7 CPU-seconds importing torch and Lightning on the 2-core test machine, more than
most test runs train. Here a multiprocessing forkserver imports ``app.run.cli`` once per pytest worker and forks a
process per run from it; the run then looks like ``python cli.py ARGS`` to everything inside it: its own pid,
working directory, environment, ``sys.argv``, ``__main__``, stdout/stderr files, default signal handlers and exit
status (``-N`` when killed by signal N, as ``subprocess`` reports it). Lightning's ddp launcher re-executes
``sys.executable cli.py ARGS`` for the other ranks, mpirun and ``ddp_spawn`` start real interpreters too.

The other local ranks of such a run are warm too. Lightning's ddp launcher (``ddp``, ``fsdp``, ``pipeline``)
would start ``sys.executable cli.py ARGS`` for each, a fresh interpreter; in a warm run its ``subprocess.Popen``
instead asks this worker's children server, a warm process that forks the rank as ``_run_script`` does, with the
launcher's environment, working directory and stdin/stdout/stderr. The launcher gets a ``Popen`` of its own
(:class:`WarmChild`: the rank's pid, ``poll``, ``wait``, signals) and everything downstream (the rank watchdog's
``take_over_local_ranks``, Lightning's observer) works as with a real one. What differs: the rank is not rank 0's
child in ``/proc`` (its parent is the server), so the tests that read the process tree, or stop rank 0 and expect
the kernel's view of its children, start with ``real_children=True``; so do those whose point is the launcher.

``run`` and ``popen`` take the arguments of ``subprocess.run`` and ``subprocess.Popen``. What only a fresh
interpreter shows (import-time warnings, the console script, a user's own script) is tested with real
subprocesses in tests/test_as_users_run_it.py.
"""

import atexit
import contextlib
import json
import multiprocessing
import os
import random
import runpy
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

_CONTEXT = multiprocessing.get_context("forkserver")
_CONTEXT.set_forkserver_preload(["app.run.cli"])
_RUNNING: set["WarmProcess"] = set()
SERVER_VARIABLE = "TESTS_WARM_CHILDREN_SERVER"  # in a warm run's environment: where its local ranks are forked
_server: tuple[multiprocessing.Process, str] | None = None


class WarmProcess:
    """What tests use of ``subprocess.Popen``: ``pid``, ``poll``, ``wait``, ``send_signal``, ``kill``,
    ``terminate``, ``communicate`` and ``returncode``."""

    def __init__(self, args, cwd=None, env=None, stdout=None, stderr=None, text=False, real_children=False):
        self.args = [str(a) for a in args]
        if len(self.args) < 2 or self.args[0] != sys.executable or not self.args[1].endswith(".py"):
            raise ValueError(f"expected [sys.executable, 'script.py', ...], got {self.args[:2]}")
        self._text = text
        self._folder = Path(tempfile.mkdtemp(prefix="warm-"))
        self._pipes = {}
        out = self._target(stdout, "stdout")
        err = out if stderr == subprocess.STDOUT else self._target(stderr, "stderr")
        environ = dict(os.environ if env is None else env)
        environ.pop(SERVER_VARIABLE, None)
        if not real_children:
            environ[SERVER_VARIABLE] = children_server()
        cwd = os.fspath(cwd if cwd is not None else os.getcwd())
        self._process = _CONTEXT.Process(target=_run_script, args=(self.args[1:], cwd, environ, out, err))
        self._process.start()
        self.pid = self._process.pid
        _RUNNING.add(self)

    def _target(self, stream, name: str) -> str:
        if stream is None:
            return os.devnull
        if stream == subprocess.PIPE:
            self._pipes[name] = path = self._folder / name
            path.touch()
            return str(path)
        return stream.name  # an open file: the run appends to it

    @property
    def returncode(self):
        code = self._process.exitcode
        if code is not None:
            _RUNNING.discard(self)
        return code

    def poll(self):
        return self.returncode

    def wait(self, timeout=None):
        self._process.join(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def communicate(self, timeout=None):
        self.wait(timeout)
        outputs = []
        for name in ("stdout", "stderr"):
            path = self._pipes.get(name)
            data = path.read_bytes() if path else None
            outputs.append(data.decode() if data is not None and self._text else data)
        shutil.rmtree(self._folder, ignore_errors=True)
        return tuple(outputs)

    def send_signal(self, sig):
        if self.returncode is None:
            os.kill(self.pid, sig)

    def terminate(self):
        self.send_signal(signal.SIGTERM)

    def kill(self):
        self.send_signal(signal.SIGKILL)


def popen(args, cwd=None, env=None, stdout=None, stderr=None, text=False, real_children=False) -> WarmProcess:
    return WarmProcess(args, cwd=cwd, env=env, stdout=stdout, stderr=stderr, text=text, real_children=real_children)


def run(
    args, cwd=None, env=None, capture_output=False, text=False, timeout=None, real_children=False
) -> subprocess.CompletedProcess:
    pipe = subprocess.PIPE if capture_output else None
    process = WarmProcess(args, cwd=cwd, env=env, stdout=pipe, stderr=pipe, text=text, real_children=real_children)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        raise
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


@atexit.register
def _stop_leftovers():
    """A failed test may leave a run behind: kill it, or the worker waits for it at exit (multiprocessing joins
    its children)."""
    for process in list(_RUNNING):
        process.kill()


def _run_script(argv: list[str], cwd: str, environ: dict, stdout: str, stderr: str) -> None:
    """In the forked process: become ``python ARGV`` started in ``cwd`` with ``environ``, run, exit."""
    for fd, path in ((1, stdout), (2, stderr)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(target, fd)
        os.close(target)
    _become(argv, cwd, environ)


def _become(argv: list[str], cwd: str, environ: dict) -> None:
    """Run the script ``argv`` as ``python ARGV`` would in ``cwd`` with ``environ`` (file descriptors 0-2 set), and
    exit with its status. Never returns."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(environ)
    if SERVER_VARIABLE in environ:
        _launch_local_ranks_warm(environ[SERVER_VARIABLE])
    script = os.path.abspath(argv[0])
    extra = [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:0] = [os.path.dirname(script), *extra]
    sys.argv = [script, *argv[1:]]
    random.seed()  # a fresh interpreter's generators differ per process; forked ones start equal
    import torch

    torch.seed()
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            code = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        traceback.print_exc()
        code = -signal.SIGINT
    except BaseException:
        traceback.print_exc()
        code = 1
    for thread in threading.enumerate():  # as at interpreter exit: wait for the non-daemon threads, then atexit
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    if code < 0:  # an uncaught KeyboardInterrupt: Python exits killed by SIGINT
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code & 0xFF)


# ------------------------------------------------------------------------------ the local ranks of a warm run


def children_server() -> str:
    """The socket of this worker's children server, started on first use: a process forked from the forkserver
    (``app.run.cli`` imported, no thread) that forks a warm process per request."""
    global _server
    if _server is None or not _server[0].is_alive():
        path = os.path.join(tempfile.mkdtemp(prefix="warm-children-"), "socket")
        process = _CONTEXT.Process(target=_serve, args=(path,), daemon=True)
        process.start()
        deadline = time.monotonic() + 120
        while not os.path.exists(path):
            if not process.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the warm children server did not start (exit code {process.exitcode})")
            time.sleep(0.05)
        _server = (process, path)
    return _server[1]


def _serve(path: str) -> None:
    """Accept requests ``{"argv", "cwd", "env"}`` with the three standard file descriptors, fork each into
    :func:`_become`, answer its pid, then its exit status as ``subprocess`` reports it. Single-threaded."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path + ".tmp")
    listener.listen(16)
    os.rename(path + ".tmp", path)  # connectable once it exists
    waiting: dict[int, socket.socket] = {}
    while True:
        if select.select([listener], [], [], 0.05)[0]:
            connection, _ = listener.accept()
            message, fds, _, _ = socket.recv_fds(connection, 1 << 20, 3)
            request = json.loads(message)
            pid = os.fork()
            if pid == 0:
                listener.close()
                for other in (connection, *waiting.values()):
                    other.close()
                for target, fd in enumerate(fds):
                    os.dup2(fd, target)
                    os.close(fd)
                _become(request["argv"], request["cwd"], request["env"])
            for fd in fds:
                os.close(fd)
            connection.send(str(pid).encode())
            waiting[pid] = connection
        while waiting:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            connection = waiting.pop(pid, None)
            if connection is not None:
                with contextlib.suppress(OSError):
                    connection.send(str(os.waitstatus_to_exitcode(status)).encode())
                connection.close()


class WarmChild:
    """A local rank forked by the children server, as Lightning's launcher uses a ``subprocess.Popen``: ``pid``,
    ``args``, ``returncode``, ``poll``, ``wait``, ``send_signal``, ``terminate``, ``kill``."""

    def __init__(self, args: list[str], env: dict, cwd: str, server: str) -> None:
        self.args = args
        self.returncode = None
        self._lock = threading.Lock()
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._socket.connect(server)
        request = {"argv": args[1:], "cwd": cwd, "env": env}
        socket.send_fds(self._socket, [json.dumps(request).encode()], [0, 1, 2])
        self.pid = int(self._socket.recv(64))

    def wait(self, timeout=None):
        if self.returncode is None:
            poller = select.poll()
            poller.register(self._socket, select.POLLIN)
            if not poller.poll(None if timeout is None else timeout * 1000):
                raise subprocess.TimeoutExpired(self.args, timeout)
        with self._lock:  # Lightning's observer polls from its thread
            if self.returncode is None:
                answer = self._socket.recv(64)
                self.returncode = int(answer) if answer else -signal.SIGKILL  # no answer: the server is gone
        return self.returncode

    def poll(self):
        try:
            return self.wait(0)
        except subprocess.TimeoutExpired:
            return None

    def send_signal(self, sig):
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self):
        self.send_signal(signal.SIGTERM)

    def kill(self):
        self.send_signal(signal.SIGKILL)


def _launch_local_ranks_warm(server: str) -> None:
    """In a warm run: Lightning's ddp launcher starts the other local ranks as :class:`WarmChild` processes."""
    import types

    from lightning.fabric.strategies.launchers import subprocess_script as fabric_launcher
    from lightning.pytorch.strategies.launchers import subprocess_script as trainer_launcher

    def popen(args, *, env=None, cwd=None, **kwargs):
        args = [str(a) for a in args]
        if kwargs or len(args) < 2 or args[0] != sys.executable or not args[1].endswith(".py"):
            return subprocess.Popen(args, env=env, cwd=cwd, **kwargs)
        return WarmChild(args, dict(os.environ if env is None else env), os.fspath(cwd or os.getcwd()), server)

    for launcher in (fabric_launcher, trainer_launcher):
        launcher.subprocess = types.SimpleNamespace(**{**vars(subprocess), "Popen": popen})
