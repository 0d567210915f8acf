"""A run rooted on a URL (docs/fork.md, "At a team's scale"): run folders, checkpoints and ``--ckpt_path last`` on
fsspec's ``memory://`` in one process, and on a real remote filesystem, an OpenSSH server reached over ``sftp://``,
from separate processes. A stop and its resume end with the weights of an unbroken run, and nothing is written
under the working directory."""

import contextlib
import csv
import getpass
import importlib.util
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from app.checkpoints.io import atomic_torch_save, safe_torch_load
from app.checkpoints.run_folders import check_writable
from app.checkpoints.storage import run_path
from app.errors import UserError
from tests.conftest import ROOT, TINY_CONFIG, run_cli

SSHD = Path(shutil.which("sshd") or "/usr/sbin/sshd")
STOP_AT = 5  # the optimizer step after which the stopped run gets SIGTERM (it stops at the next step's end)
EPOCHS = 2  # tiny.yaml: 8 batches an epoch


def stop_at(step: int) -> str:
    spec = {"class_path": "tests.signal_at_step.SignalAtStep", "init_args": {"step": step, "signal_name": "SIGTERM"}}
    return "--trainer.callbacks+=" + json.dumps(spec)


def files_under(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def weights(checkpoint: dict) -> dict:
    return checkpoint["state_dict"]


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"{len(different)} tensors differ, e.g. {different[:3]}"


def steps_logged(metrics_csv: str) -> list[int]:
    return sorted({int(row["step"]) for row in csv.DictReader(io.StringIO(metrics_csv)) if row.get("train/loss")})


# ---------------------------------------------------------------------------------------------- memory://
@pytest.mark.slow  # three runs, in this process
def test_a_run_rooted_at_memory_stops_and_resumes_there_like_an_unbroken_run(workdir, caplog):
    root = f"memory://{workdir.name}/runs"
    common = ("fit", "--config", str(TINY_CONFIG), f"--trainer.max_epochs={EPOCHS}")
    run_cli(*common, "--trainer.default_root_dir=unbroken")
    with pytest.raises(SystemExit) as stopped:
        run_cli(*common, f"--trainer.default_root_dir={root}", stop_at(STOP_AT))
    assert stopped.value.code == 143
    runs = run_path(root) / "lightning_logs"
    last = runs / "version_0" / "checkpoints" / "last.ckpt"
    held = safe_torch_load(last)["global_step"]
    assert f"saved {last}." in caplog.text
    assert 0 < held < EPOCHS * 8
    caplog.clear()
    run_cli(*common, f"--trainer.default_root_dir={root}", "--ckpt_path=last")

    assert f"resuming from {last} (step {held})" in caplog.text
    resumed = safe_torch_load(runs / "version_1" / "checkpoints" / "last.ckpt")
    unbroken = safe_torch_load(workdir / "unbroken" / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt")
    assert resumed["global_step"] == unbroken["global_step"] == EPOCHS * 8
    assert_same_weights(weights(resumed), weights(unbroken))
    assert steps_logged((runs / "version_0" / "metrics.csv").read_text())[-1] == held - 1
    assert steps_logged((runs / "version_1" / "metrics.csv").read_text())[0] == held
    assert {p.name for p in (runs / "version_0").iterdir()} >= {"config.yaml", "metrics.csv", "checkpoints"}
    assert not [p for p in files_under(workdir) if ":" in p], files_under(workdir)
    assert files_under(workdir) == [p for p in files_under(workdir) if p.startswith("unbroken")]


def test_a_url_is_a_path_that_says_where_it_is_and_a_local_one_stays_pathlib():
    """``file://`` and plain paths are pathlib's (os calls work on them); an sftp path keeps its user, host and port
    when written out, so that another process (a resume, a rank, a user reading the line) finds the same place."""
    assert run_path("file:///data/runs") == Path("/data/runs") and run_path("runs") == Path("runs")
    remote = run_path("sftp://me@storage.example:2222/data/runs") / "lightning_logs" / "version_3"
    assert str(remote) == "sftp://me@storage.example:2222/data/runs/lightning_logs/version_3"
    assert str(remote.parent) == "sftp://me@storage.example:2222/data/runs/lightning_logs"
    assert str(run_path(str(remote))) == str(remote)  # read back from a line or a config.yaml
    assert str(run_path("memory://runs") / "x") == "memory://runs/x"


def test_a_url_without_its_package_or_its_server_is_one_line():
    """Before anything is written: the package to install (fsspec's own words), or the host that did not answer
    (the root's first check, which cli.py makes before any work)."""
    if importlib.util.find_spec("s3fs") is None:  # (with s3fs installed there is nothing to refuse)
        with pytest.raises(UserError, match=r"^s3://bucket/runs: Install s3fs to access S3 \(pip install it"):
            run_path("s3://bucket/runs")
    with pytest.raises(UserError, match=r"default_root_dir=sftp://me@127.0.0.1:1/runs: cannot write there \(.*port 1"):
        check_writable("sftp://me@127.0.0.1:1/runs")  # port 1: nothing listens


def test_a_checkpoint_on_a_url_is_written_whole_and_checked_when_read():
    path = run_path("memory://atomic/ckpts/last.ckpt")
    atomic_torch_save({"global_step": 3, "state_dict": {"w": torch.ones(4)}}, path)
    assert [p.name for p in path.parent.iterdir()] == ["last.ckpt"]  # no temporary file left beside it
    assert safe_torch_load(str(path))["global_step"] == 3
    data = bytearray(path.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 64] = b"\xff" * 64
    path.write_bytes(bytes(data))
    with pytest.raises(Exception, match="damaged|truncated|not a loadable"):
        safe_torch_load(str(path))


# ---------------------------------------------------------------------------------------------- sftp://
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def sftp_server(tmp_path_factory):
    """An OpenSSH server on 127.0.0.1 that takes one key, held by an ssh-agent: what ``sftp://user@host/`` reaches, as
    with a user's own agent or ``~/.ssh``. Yields (URL prefix, the agent's environment, the server's folder of
    files)."""
    if not SSHD.exists():
        pytest.skip("no sshd (Debian's openssh-server) installed")
    here = tmp_path_factory.mktemp("sftp")
    for kind in ("host", "user"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(here / kind)], check=True)
    (here / "authorized_keys").write_text((here / "user.pub").read_text())
    port = free_port()
    (here / "sshd_config").write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {here / 'host'}\n"
        f"AuthorizedKeysFile {here / 'authorized_keys'}\n"
        "PasswordAuthentication no\nKbdInteractiveAuthentication no\nPermitRootLogin prohibit-password\nUsePAM no\n"
        f"StrictModes no\nPidFile {here / 'sshd.pid'}\nSubsystem sftp internal-sftp\n"
    )
    try:
        Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege separation folder
    except PermissionError:
        pytest.skip("sshd needs /run/sshd, which only root can make")
    server = subprocess.Popen([str(SSHD), "-D", "-e", "-f", str(here / "sshd_config")], stderr=subprocess.PIPE)
    agent = subprocess.run(["ssh-agent", "-s", "-a", str(here / "agent.sock")], capture_output=True, text=True)
    agent_pid = int(agent.stdout.split("SSH_AGENT_PID=")[1].split(";")[0])
    environ = {"SSH_AUTH_SOCK": str(here / "agent.sock")}
    subprocess.run(["ssh-add", "-q", str(here / "user")], env={**os.environ, **environ}, check=True)
    deadline = time.monotonic() + 20
    while True:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            break
        assert server.poll() is None and time.monotonic() < deadline, server.stderr.read().decode()
        time.sleep(0.1)
    files = here / "served"
    files.mkdir()
    try:
        yield f"sftp://{getpass.getuser()}@127.0.0.1:{port}{files}", environ, files
    finally:
        server.terminate()
        server.wait(timeout=10)
        os.kill(agent_pid, 15)


def cli_fit(cwd: Path, environ: dict, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, str(ROOT / "cli.py"), "fit", "--config", str(TINY_CONFIG)]
    command += [f"--trainer.max_epochs={EPOCHS}", *args]
    env = {**os.environ, **environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_a_run_rooted_on_an_sftp_server_stops_and_resumes_from_another_process_like_an_unbroken_run(
    sftp_server, tmp_path
):
    url, environ, served = sftp_server
    root = f"{url}/{tmp_path.name}"
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    unbroken = cli_fit(cwd, environ, f"--trainer.default_root_dir={tmp_path / 'unbroken'}")
    assert unbroken.returncode == 0, unbroken.stderr[-3000:]
    stopped = cli_fit(cwd, environ, f"--trainer.default_root_dir={root}", stop_at(STOP_AT))
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    resumed = cli_fit(cwd, environ, f"--trainer.default_root_dir={root}", "--ckpt_path=last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    runs = served / tmp_path.name / "lightning_logs"  # the server's files, read on its disk
    last = f"{url}/{tmp_path.name}/lightning_logs/version_0/checkpoints/last.ckpt"
    held = torch.load(runs / "version_0" / "checkpoints" / "last.ckpt", weights_only=True)["global_step"]
    assert 0 < held < EPOCHS * 8
    assert f"saved {last}." in stopped.stdout + stopped.stderr
    assert f"resuming from {last} (step {held})" in resumed.stdout + resumed.stderr
    final = torch.load(runs / "version_1" / "checkpoints" / "last.ckpt", weights_only=True)
    reference = torch.load(tmp_path / "unbroken" / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt")
    assert final["global_step"] == reference["global_step"] == EPOCHS * 8
    assert_same_weights(weights(final), weights(reference))
    assert steps_logged((runs / "version_0" / "metrics.csv").read_text())[-1] == held - 1
    assert steps_logged((runs / "version_1" / "metrics.csv").read_text())[0] == held
    assert not [p for p in files_under(runs) if p.rsplit("/", 1)[-1].startswith(".")], files_under(runs)
    assert files_under(cwd) == [], files_under(cwd)  # nothing under the working directory
    assert (runs / "version_1" / "config.yaml").is_file()
    shutil.rmtree(served / tmp_path.name)
