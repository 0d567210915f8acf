"""tests/warm.py starts runs as ``subprocess`` would: the tests that use it read exit codes, files and signals."""

import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

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


LAUNCHES_A_RANK = """
import json, os, signal, sys, time
from lightning.pytorch.strategies.launchers import subprocess_script as launcher

if os.environ.get("RANK_OF_TEST"):
    print(json.dumps({"warm": "app.run.cli" in sys.modules, "cwd": os.getcwd(), "argv": sys.argv}), flush=True)
    if sys.argv[1] == "sleep":
        open("started", "w").close()
        signal.pause()
    sys.exit(int(sys.argv[1]))
env = {**os.environ, "RANK_OF_TEST": "1"}
rank = launcher.subprocess.Popen([sys.executable, os.path.abspath(__file__), sys.argv[1]], env=env, cwd=sys.argv[2])
if sys.argv[1] == "sleep":
    while rank.poll() is None and not os.path.exists(os.path.join(sys.argv[2], "started")):
        time.sleep(0.05)
    rank.send_signal(signal.SIGTERM)
print("rank exit", rank.wait(), flush=True)
"""


def launch_a_rank(tmp_path, how: str, real_children: bool = False) -> tuple[list[str], Path]:
    script = tmp_path / "launch.py"
    script.write_text(textwrap.dedent(LAUNCHES_A_RANK))
    (tmp_path / "rank").mkdir()
    result = warm.run(
        [sys.executable, str(script), how, str(tmp_path / "rank")],
        capture_output=True,
        text=True,
        timeout=120,
        real_children=real_children,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines(), script


@pytest.mark.slow
@pytest.mark.parametrize("real_children", [False, True])
def test_the_ranks_lightnings_launcher_starts_in_a_warm_run_are_warm_unless_asked(real_children, tmp_path):
    """Lightning's ddp launcher starts ``sys.executable script ARGS`` with ``subprocess.Popen``: in a warm run the
    rank is forked warm (``app.run.cli`` already imported) into the folder, arguments and exit status it was given."""
    (seen, ended), script = launch_a_rank(tmp_path, "4", real_children)
    assert json.loads(seen) == {"warm": not real_children, "cwd": str(tmp_path / "rank"), "argv": [str(script), "4"]}
    assert ended == "rank exit 4"


def test_a_warm_rank_stopped_by_a_signal_reports_minus_the_signal(tmp_path):
    lines, _ = launch_a_rank(tmp_path, "sleep")
    assert json.loads(lines[0])["warm"] and lines[-1] == f"rank exit {-signal.SIGTERM}"
