"""bench/interpreters.py counts the interpreters a command starts, by what they import and who started them."""

import json
import subprocess
import sys
import sysconfig
from pathlib import Path

from bench.interpreters import report
from tests.conftest import ROOT

CHILD = "import subprocess, sys; subprocess.run([sys.executable, '-c', 'import json'], check=True)"


def test_a_real_command_is_counted_and_the_hook_is_gone_afterwards():
    result = subprocess.run(
        [sys.executable, "-m", "bench.interpreters", "--", sys.executable, "-c", CHILD],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert "fresh interpreters importing torch: 0 (0 left no exit record)" in result.stdout, result.stdout
    folder = Path(result.stdout.split("records in ")[1].split(";")[0])
    records = [json.loads(p.read_text()) for p in folder.glob("*.json")]
    commands = [" ".join(r["cmdline"]) for r in records if r["kind"] == "start"]
    assert sum("import json" in c for c in commands) == 2, commands  # the command and the child it started
    mine = [r for r in records if "import json" in " ".join(r["cmdline"])]  # others may start meanwhile
    assert sorted(r["kind"] for r in mine) == ["exit", "exit", "start", "start"]
    [parent] = {r["pid"] for r in mine if "subprocess" in " ".join(r["cmdline"])}
    assert all(parent in r["ancestors"] for r in mine if r["pid"] != parent)
    site = Path(sysconfig.get_paths()["purelib"])
    assert not list(site.glob("*interpreter_census*")), "the hook was left in the venv"


def record(folder: Path, kind: str, pid: int, ppid: int, cmdline: list[str], **more) -> None:
    data = {"kind": kind, "pid": pid, "ppid": ppid, "cmdline": cmdline, "forked": False, "cpu": 0.0}
    data |= {"torch": False, "lightning": False, "test": ""} | more
    (folder / f"{pid}-{kind}.json").write_text(json.dumps(data))


def test_the_report_sorts_fresh_interpreters_by_their_parent(tmp_path):
    worker = ["python", "-c", "import sys;exec(eval(sys.stdin.readline()))"]
    record(tmp_path, "start", 10, 1, worker)
    record(tmp_path, "exit", 10, 1, worker, torch=True, lightning=True, cpu=50.0)
    record(tmp_path, "start", 11, 10, ["python", "cli.py", "fit"])  # a test's first run
    record(tmp_path, "exit", 11, 10, ["python", "cli.py", "fit"], torch=True, lightning=True, cpu=7.0)
    record(
        tmp_path, "start", 12, 999, ["python", "-m", "app.strategies.launchers._mpi_worker"]
    )  # killed: no exit record
    record(tmp_path, "start", 13, 1, ["python", "-m", "torch.distributed.run", "cli.py"])
    record(tmp_path, "exit", 13, 1, ["python", "-m", "torch.distributed.run"], torch=True, cpu=3.0)
    record(tmp_path, "start", 14, 13, ["python", "cli.py", "fit"])
    record(tmp_path, "exit", 14, 13, ["python", "cli.py", "fit"], torch=True, lightning=True, cpu=6.0)
    record(tmp_path, "exit", 15, 11, ["python", "cli.py", "fit"], torch=True, lightning=True, cpu=1.0, forked=True)
    text = report(tmp_path)
    assert "fresh interpreters importing torch: 3 (1 left no exit record), 13 CPU-s" in text
    assert "of them importing Lightning: 2, median 7.0 CPU-s, min 6.0" in text
    assert "torchrun agents: 1, 3 CPU-s" in text and "pytest-xdist workers: 1, 50 CPU-s" in text
    assert "warm runs (forked): 1, 1 CPU-s" in text
    assert "1         7 CPU-s  a test itself" in text
    assert "1         6 CPU-s  a torchrun agent" in text
    assert "1         0 CPU-s  not Python" in text
