"""The SLURM cluster for tests (tests/slurm.py): munged, slurmctld and two slurmds on the two namespace nodes ``a``
and ``b``. It comes up with both nodes idle, runs a step and a batch job across them, and leaves no daemon, job
process or namespace behind on any path: a block that passed, one that raised, a holder killed by SIGTERM or
SIGKILL. They skip, saying why, where SLURM cannot run (not root, no ``ip netns``, slurm-wlm or munge missing)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from app.launch.signals import process_alive
from tests.conftest import ROOT
from tests.netns import NETNS_ETC, namespaces, remove_leftovers
from tests.slurm import SlurmCluster, slurm_available


@pytest.fixture(autouse=True)
def _needs_slurm():
    ok, why = slurm_available()
    if not ok:
        pytest.skip(why)


def etc_slurm() -> dict[str, float]:
    """/etc/slurm's files and their modification times: the cluster must not touch them."""
    folder = Path("/etc/slurm")
    return {str(p): p.stat().st_mtime for p in folder.rglob("*")} if folder.is_dir() else {}


def assert_left_nothing(cluster: SlurmCluster, pids: list[int]) -> None:
    """No daemon of ``cluster``, no process of ``pids``, none of its namespaces or /etc/netns folders."""
    names = [node.netns for node in cluster.nodes]
    assert not [n for n, p in cluster.daemons.items() if process_alive(p.pid)], cluster.daemons
    assert not [pid for pid in pids if process_alive(pid)], pids
    assert not set(names) & set(namespaces()), subprocess.run(["ip", "netns", "list"], capture_output=True).stdout
    assert not [n for n in names if (NETNS_ETC / n).exists()]


def wait_for_lines(path: Path, count: int, timeout: float = 30) -> list[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = path.read_text().split() if path.exists() else []
        if len(lines) >= count:
            return lines
        time.sleep(0.1)
    raise AssertionError(f"{path}: {lines} after {timeout} s")


# a job that holds both nodes: each task writes its pid, then sleeps; the batch shell writes its own pid
HOLDING_JOB = """#!/bin/sh
#SBATCH --nodes=2 --ntasks-per-node=1
echo $$ >> pids
srun sh -c 'echo $$ >> pids; exec sleep 300'
"""


@pytest.mark.slow
def test_the_cluster_comes_up_with_both_nodes_idle_runs_a_step_on_each_and_leaves_nothing(tmp_path):
    before = etc_slurm()
    with SlurmCluster(tmp_path) as cluster:
        assert {n.name: cluster.node_state(n.name) for n in cluster.nodes} == {"a": "idle", "b": "idle"}
        step = cluster.srun("-N2", "-n2", "hostname")
        assert sorted(step.stdout.split()) == ["a", "b"], step.stderr
        pids = [p.pid for p in cluster.daemons.values()]
        assert all(process_alive(pid) for pid in pids) and len(pids) == 4  # munged, slurmctld, 2 slurmd
    assert_left_nothing(cluster, pids)
    assert etc_slurm() == before
    print(f"SLURM cluster: up in {cluster.timings['up']:.1f} s, down in {cluster.timings['down']:.1f} s")


@pytest.mark.slow
def test_a_batch_job_runs_a_step_across_both_nodes_and_writes_its_output_file(tmp_path):
    script = tmp_path / "hostnames.sbatch"
    script.write_text("#!/bin/sh\n#SBATCH --nodes=2 --ntasks-per-node=1\nsrun hostname\n")
    with SlurmCluster(tmp_path) as cluster:
        job = cluster.sbatch(script, "--output=out-%j.txt", cwd=tmp_path)
        info = cluster.wait(job, timeout=60)
        assert (info["ExitCode"], info["NodeList"], info["Restarts"]) == ("0:0", "a,b", "0")
        assert sorted((tmp_path / f"out-{job}.txt").read_text().split()) == ["a", "b"]


@pytest.mark.slow
def test_a_block_that_raises_with_a_job_running_on_both_nodes_leaves_no_daemon_job_or_namespace(tmp_path):
    (tmp_path / "hold.sbatch").write_text(HOLDING_JOB)
    cluster = SlurmCluster(tmp_path)
    with pytest.raises(RuntimeError, match="the test body failed"), cluster:
        job = cluster.sbatch(tmp_path / "hold.sbatch", cwd=tmp_path)
        job_pids = [int(p) for p in wait_for_lines(tmp_path / "pids", 3)]  # the batch shell and a task per node
        assert cluster.state(job)["JobState"] == "RUNNING" and all(process_alive(p) for p in job_pids)
        raise RuntimeError("the test body failed")
    assert_left_nothing(cluster, job_pids)


# a process that starts a cluster with a job on both nodes, says which pids and namespaces it has, and waits
HOLDER = """
import sys, time
from pathlib import Path
from tests.slurm import SlurmCluster
folder = Path(sys.argv[1])
with SlurmCluster(folder) as cluster:
    cluster.sbatch(folder / "hold.sbatch", cwd=folder)
    while len((folder / "pids").read_text().split() if (folder / "pids").exists() else []) < 3:
        time.sleep(0.1)
    daemons = [p.pid for p in cluster.daemons.values()]
    print(*(n.netns for n in cluster.nodes), *daemons, *(folder / "pids").read_text().split(), flush=True)
    time.sleep(120)
"""


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_killed_holder_leaves_nothing_once_the_next_cluster_starts(signum, tmp_path):
    """SIGTERM: the holder's ``with`` block cleans up (KeyboardInterrupt). SIGKILL: nothing runs, and what is left in
    the namespaces of a dead maker (daemons and job processes alike) goes when the next nodes are made
    (:func:`tests.netns.remove_leftovers`)."""
    (tmp_path / "hold.sbatch").write_text(HOLDING_JOB)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        words = holder.stdout.readline().split()
        assert len(words) == 9, holder.stderr.read()  # 2 namespaces, 4 daemons, 3 job processes
        names, pids = words[:2], [int(w) for w in words[2:]]
        assert set(names) <= set(namespaces()) and all(process_alive(p) for p in pids)
        holder.send_signal(signum)
        holder.wait(timeout=60)
        if signum == signal.SIGKILL:
            assert all(process_alive(p) for p in pids)  # left behind ...
            remove_leftovers()  # ... until the next TwoNodes (a SlurmCluster's too) starts
    except BaseException:
        holder.kill()
        holder.wait()
        remove_leftovers()
        raise
    assert not [p for p in pids if process_alive(p)], pids
    assert not set(names) & set(namespaces())
    assert not [n for n in names if (NETNS_ETC / n).exists()]
    if signum == signal.SIGTERM:
        assert "KeyboardInterrupt" in holder.stderr.read()  # raised by the SIGTERM, after the clean-up
