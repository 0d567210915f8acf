"""``python cli.py ...`` runs started from a warm interpreter, for tests that need a separate process but not a
fresh interpreter.

A new interpreter spends about 7 CPU-seconds importing torch and Lightning on the 2-core test machine, more than
most test runs train. Here a multiprocessing forkserver imports ``app.cli`` once per pytest worker and forks a
process per run from it; the run then looks like ``python cli.py ARGS`` to everything inside it: its own pid,
working directory, environment, ``sys.argv``, ``__main__``, stdout/stderr files, default signal handlers and exit
status (``-N`` when killed by signal N, as ``subprocess`` reports it). Lightning's ddp launcher re-executes
``sys.executable cli.py ARGS`` for the other ranks, mpirun and ``ddp_spawn`` start real interpreters too.

``run`` and ``popen`` take the arguments of ``subprocess.run`` and ``subprocess.Popen``. What only a fresh
interpreter shows (import-time warnings, the console script, a user's own script) is tested with real
subprocesses in tests/test_as_users_run_it.py.
"""

import atexit
import multiprocessing
import os
import random
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import traceback
from pathlib import Path

_CONTEXT = multiprocessing.get_context("forkserver")
_CONTEXT.set_forkserver_preload(["app.cli"])
_RUNNING: set["WarmProcess"] = set()


class WarmProcess:
    """What tests use of ``subprocess.Popen``: ``pid``, ``poll``, ``wait``, ``send_signal``, ``kill``,
    ``terminate``, ``communicate`` and ``returncode``."""

    def __init__(self, args, cwd=None, env=None, stdout=None, stderr=None, text=False):
        self.args = [str(a) for a in args]
        if len(self.args) < 2 or self.args[0] != sys.executable or not self.args[1].endswith(".py"):
            raise ValueError(f"expected [sys.executable, 'script.py', ...], got {self.args[:2]}")
        self._text = text
        self._folder = Path(tempfile.mkdtemp(prefix="warm-"))
        self._pipes = {}
        out = self._target(stdout, "stdout")
        err = out if stderr == subprocess.STDOUT else self._target(stderr, "stderr")
        environ = dict(os.environ if env is None else env)
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


def popen(args, cwd=None, env=None, stdout=None, stderr=None, text=False) -> WarmProcess:
    return WarmProcess(args, cwd=cwd, env=env, stdout=stdout, stderr=stderr, text=text)


def run(args, cwd=None, env=None, capture_output=False, text=False, timeout=None) -> subprocess.CompletedProcess:
    pipe = subprocess.PIPE if capture_output else None
    process = WarmProcess(args, cwd=cwd, env=env, stdout=pipe, stderr=pipe, text=text)
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
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(environ)
    for fd, path in ((1, stdout), (2, stderr)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(target, fd)
        os.close(target)
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
