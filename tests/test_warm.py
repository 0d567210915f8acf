"""tests/warm.py starts runs as ``subprocess`` would: the tests that use it read exit codes, files and signals."""

import json
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tests import warm

SCRIPT = """
import json, os, sys, time
print(json.dumps({"cwd": os.getcwd(), "argv": sys.argv, "name": __name__, "x": os.environ.get("X"),
                  "path0": sys.path[0], "pid": os.getpid()}))
print("to stderr", file=sys.stderr)
if sys.argv[1] == "sleep":
    time.sleep(60)
if sys.argv[1] == "raise":
    raise RuntimeError("boom")
sys.exit(int(sys.argv[1]))
"""


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "bin" / "script.py"
    path.parent.mkdir()
    path.write_text(textwrap.dedent(SCRIPT))
    return path


def test_a_run_sees_its_own_folder_arguments_environment_and_exit_code(script, tmp_path):
    result = warm.run([sys.executable, str(script), "3"], cwd=tmp_path, env={"X": "1"}, capture_output=True, text=True)
    seen = json.loads(result.stdout)
    assert result.returncode == 3 and result.stderr == "to stderr\n"
    assert seen["cwd"] == str(tmp_path) and seen["argv"] == [str(script), "3"] and seen["name"] == "__main__"
    assert seen["x"] == "1" and seen["path0"] == str(script.parent)


def test_an_uncaught_exception_exits_1_with_its_traceback(script, tmp_path):
    result = warm.run([sys.executable, str(script), "raise"], cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 1 and "RuntimeError: boom" in result.stderr


def test_a_signalled_run_reports_minus_the_signal_like_popen(script, tmp_path):
    log = tmp_path / "run.log"
    with open(log, "w") as out:
        process = warm.popen([sys.executable, str(script), "sleep"], cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while not log.read_text() and time.monotonic() < deadline:  # started: it has printed
        with pytest.raises(subprocess.TimeoutExpired):
            process.wait(timeout=0.1)
    assert process.poll() is None
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=10) == -signal.SIGTERM
    assert json.loads(log.read_text().splitlines()[0])["pid"] == process.pid
