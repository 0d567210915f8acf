"""app/launch/launcher.py reads every launcher's variables (one place), and the self-launch's mpirun leaves ranks
unbound."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from jsonargparse import Namespace
from lightning.pytorch.utilities import rank_zero_only

from app.errors import UserError
from app.launch.launcher import first_on_node, launcher_ranks, one_gpu_per_rank, slurm_tasks_per_node
from app.run.cli import _rank_has_own_gpu
from app.strategies.horovod import HorovodStrategy
from app.strategies.launchers.mpirun import mpirun_command
from tests.conftest import ROOT

LAUNCH_VARS = (
    "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE",
    "HOROVOD_SIZE", "HOROVOD_RANK", "PMI_SIZE", "PMI_RANK", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", "PMIX_SIZE",
    "PMIX_RANK", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE", "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE",
    "SLURM_NODEID", "LOCAL_RANK", "CUDA_VISIBLE_DEVICES",
)  # fmt: skip


@pytest.fixture
def clean_env(monkeypatch):
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_open_mpi_ranks(clean_env):
    for name, value in zip(LAUNCH_VARS[:4], ("8", "5", "1", "4"), strict=True):
        clean_env.setenv(name, value)
    assert launcher_ranks() == (8, 5, 1, 4) and not first_on_node()


@pytest.mark.parametrize(
    ("slurm", "expected"),
    [
        ({"SLURM_LOCALID": "1", "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_NODEID": "1"}, (8, 5, 1, 4)),
        ({"SLURM_LOCALID": "1", "SLURM_NTASKS_PER_NODE": "4"}, (8, 5, 1, 4)),
        ({"SLURM_LOCALID": "2", "SLURM_STEP_TASKS_PER_NODE": "5,3", "SLURM_NODEID": "1"}, (8, 5, 2, 3)),
        ({}, (8, 5, 5, 8)),  # PMI alone says no more: every rank on one node
    ],
)
def test_srun_with_pmi_takes_the_local_rank_from_slurm(clean_env, slurm, expected):
    """SLURM's MpiDefault=pmi2: PMI_SIZE/PMI_RANK only; the local rank and the tasks per node come from SLURM (the
    preset's devices then match the tasks per node instead of the world size)."""
    clean_env.setenv("PMI_SIZE", "8")
    clean_env.setenv("PMI_RANK", "5")
    for name, value in slurm.items():
        clean_env.setenv(name, value)
    assert launcher_ranks() == expected


def test_no_launcher(clean_env):
    assert launcher_ranks() is None and slurm_tasks_per_node() is None and first_on_node()


def test_self_launched_ranks_are_not_bound_to_one_core_and_split_torchs_threads(monkeypatch):
    """Open MPI binds each rank to one core for small -np; a GPU rank's data path needs more (Horovod's guidance).
    Each rank gets the node's cores divided by its ranks as torch threads, as Lightning's ddp launchers give them
    (every rank took every core), unless the user set OMP_NUM_THREADS."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    cmd = " ".join(mpirun_command(2))
    assert "--bind-to none" in cmd and "--map-by slot" in cmd
    assert "-x OMP_NUM_THREADS=4" in cmd and "-x OMP_NUM_THREADS=1" in " ".join(mpirun_command(16))
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert "-x OMP_NUM_THREADS=3" in " ".join(mpirun_command(2))


def reading_stdin(pid: int) -> bool:
    """Whether process ``pid`` is blocked in ``read(0, ...)``: /proc/PID/syscall names the system call a sleeping
    process is in (x86_64 and aarch64 numbers; the reaper waits there until its launcher is gone)."""
    try:
        words = Path(f"/proc/{pid}/syscall").read_text().split()
    except OSError:
        return False
    read = {"x86_64": "0", "aarch64": "63"}.get(os.uname().machine)
    return len(words) > 1 and words[0] == read and int(words[1], 16) == 0


def test_the_reaper_ends_the_ranks_and_removes_the_launch_folder_once_the_launcher_is_gone(tmp_path):
    """A SIGKILLed launcher cannot clean up: its reaper sees the pipe close, gives the ranks their grace, SIGKILLs
    what is left (here a stopped "rank", deaf to SIGTERM) and removes the folder with the pickled job; it left the
    folder until the next launch (issue 34, item 9). A process that only reuses a pid file's number is left alone."""
    import signal
    import subprocess
    import sys
    import time

    folder = tmp_path / "horovod-launch-x"
    folder.mkdir()
    (folder / "job.pkl").write_bytes(b"secret")
    rank = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)", "app.strategies.launchers._mpi_worker"]
    )
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        (folder / "rank-1.pid").write_text(str(rank.pid))
        (folder / "rank-2.pid").write_text(str(other.pid))
        rank.send_signal(signal.SIGSTOP)
        script = ROOT / "app" / "strategies" / "launchers" / "_reaper.py"
        reaper = subprocess.Popen([sys.executable, str(script), str(folder), "1"], stdin=subprocess.PIPE)
        deadline = time.monotonic() + 30
        while not reading_stdin(reaper.pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert reading_stdin(reaper.pid), "the reaper never waited on its stdin"
        assert folder.exists() and rank.poll() is None  # the launcher lives: nothing happens
        reaper.stdin.close()  # the launcher is gone
        assert reaper.wait(timeout=30) == 0
        assert rank.wait(timeout=5) == -signal.SIGKILL
        assert not folder.exists()
        assert other.poll() is None
    finally:
        for process in (rank, other):
            process.kill()


def test_leftover_ranks_are_gone_before_the_launcher_reads_what_they_wrote(tmp_path):
    """After mpirun exited, the launcher SIGKILLs the ranks left (here a stopped one, which mpirun's exit wakes in
    a real run) and reads their reports only once they are gone: a SIGKILL takes effect when the process next runs,
    so one in the middle of a rename still finished it after ``kill`` returned."""
    import signal
    import subprocess
    import sys
    import time

    from app.strategies.launchers._reaper import rank_pids, running
    from app.strategies.launchers.mpirun import end_leftover_ranks

    rank = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)", "app.strategies.launchers._mpi_worker"]
    )
    try:
        (tmp_path / "rank-1.pid").write_text(str(rank.pid))
        deadline = time.monotonic() + 30
        while not rank_pids(tmp_path) and time.monotonic() < deadline:  # until its exec: pytest's command line before
            time.sleep(0.01)
        rank.send_signal(signal.SIGSTOP)
        end_leftover_ranks(tmp_path)
        assert not running(rank.pid)  # every thread has exited (a zombie until this test reaps it)
        assert rank.wait(timeout=5) == -signal.SIGKILL
    finally:
        rank.kill()


@pytest.mark.parametrize("hangs", [True, False])
def test_an_mpirun_that_outlives_all_its_ranks_is_ended_as_a_failed_launch(hangs, tmp_path):
    """A stand-in mpirun starts one rank (a Python running ``-m app.strategies.launchers._mpi_worker JOB``: here a
    module of that name that sleeps a second), waits for it, then hangs (as prterun did in CI, "Abort is in
    progress...hit ctrl-c again") or exits 0. The hung one, and everything in its session, is ended ``outlive`` seconds
    after the rank, with the launch's code HUNG; one that exits in time is left alone. Not fooled by mpirun's own
    command line, which holds the same words."""
    import os
    import sys
    import time

    from app.launch.signals import HUNG, StopSignals
    from app.strategies.launchers._reaper import launch_running

    stand_in = tmp_path / "stand_in" / "app" / "strategies" / "launchers"
    stand_in.mkdir(parents=True)
    for init in (stand_in / "__init__.py", stand_in.parent / "__init__.py", stand_in.parents[1] / "__init__.py"):
        init.touch()
    (stand_in / "_mpi_worker.py").write_text("import time\ntime.sleep(1)\n")
    folder = tmp_path / "horovod-launch-x"
    folder.mkdir()
    job = folder / "job.pkl"
    rank = f'cd "{stand_in.parents[2]}" && "{sys.executable}" -m app.strategies.launchers._mpi_worker "{job}" r'
    after = "sleep 600" if hangs else "exit 0"
    script = f"({rank}) & wait; echo $$ > {tmp_path / 'mpirun.pid'}; {after}"
    mpirun = [
        "sh",
        "-c",
        script,
        "app.strategies.launchers._mpi_worker",
    ]  # its own command line holds the rank's words too
    env = dict(os.environ, PYTHONPATH=str(stand_in.parents[2]))
    t0 = time.monotonic()
    with StopSignals() as stops:
        code, signum = stops.run(mpirun, env, list, lambda: None, lambda: launch_running(folder), outlive=2)
    seconds = time.monotonic() - t0
    assert signum == 0
    if hangs:
        assert code == HUNG and 3 <= seconds < 20, (code, seconds)
        pid = int((tmp_path / "mpirun.pid").read_text())
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # gone, its sleep with it (the session was killed)
    else:
        assert code == 0 and seconds < 10, (code, seconds)


@pytest.fixture
def rank_5_of_8_on_two_nodes(clean_env):
    """Open MPI's rank 5 of 8, local rank 1 of 4 per node (the rank rank_zero_only remembers is put back after)."""
    for name, value in zip(LAUNCH_VARS[:4], ("8", "5", "1", "4"), strict=True):
        clean_env.setenv(name, value)
    clean_env.setattr(rank_zero_only, "rank", rank_zero_only.rank)
    return clean_env


def _horovod_on(devices: list[torch.device]) -> HorovodStrategy:
    strategy = HorovodStrategy(parallel_devices=devices)
    strategy.num_nodes = 2
    strategy._configure_launcher()  # what the Trainer calls: the launch is checked
    return strategy


def _trainer_config(**given) -> Namespace:
    """The ``trainer`` part of cli.py's config: horovod, accelerator auto, 4 devices, unless given otherwise."""
    return Namespace(**{"strategy": "horovod", "accelerator": "auto", "devices": 4, **given})


def test_a_rank_given_a_gpu_of_its_own_trains_on_it(rank_5_of_8_on_two_nodes):
    """SLURM's --gpus-per-task=1 (or a wrapper that sets CUDA_VISIBLE_DEVICES per rank): every rank sees one GPU,
    its cuda:0. The horovod strategy accepted only --trainer.devices equal to the processes per node (4, which
    Lightning refuses with one GPU visible) and took devices[local rank]: no setting ran (issue 35, item 7). Now
    such a rank trains on its one GPU, and cli.py asks Lightning for that one. (The GPU count is mocked: this
    machine has none; tests/test_gpu.py runs it where two GPUs are.)"""
    env = rank_5_of_8_on_two_nodes
    env.setenv("CUDA_VISIBLE_DEVICES", "6")
    env.setattr(torch.cuda, "device_count", lambda: 1)
    assert one_gpu_per_rank()
    assert _horovod_on([torch.device("cuda", 0)]).root_device == torch.device("cuda", 0)
    # --trainer.devices as the user gives it (the processes per node, or nothing) becomes this rank's one GPU
    assert _rank_has_own_gpu(_trainer_config(devices=4), per_node=4, devices_given=True)
    assert _rank_has_own_gpu(_trainer_config(devices="auto"), per_node=4, devices_given=False)
    assert not _rank_has_own_gpu(_trainer_config(devices=2), per_node=4, devices_given=True)  # said otherwise
    assert not _rank_has_own_gpu(_trainer_config(accelerator="cpu"), per_node=4, devices_given=True)
    assert not _rank_has_own_gpu(_trainer_config(strategy="ddp"), per_node=4, devices_given=True)


def test_ranks_that_share_the_gpus_of_their_node_still_take_one_each(rank_5_of_8_on_two_nodes):
    """No binding: each rank sees the node's 4 GPUs and takes the one of its local rank; --trainer.devices=1 there
    (every rank on one GPU) is refused, naming what it is for."""
    env = rank_5_of_8_on_two_nodes
    env.setattr(torch.cuda, "device_count", lambda: 4)
    assert not one_gpu_per_rank()
    assert _horovod_on([torch.device("cuda", i) for i in range(4)]).root_device == torch.device("cuda", 1)
    with pytest.raises(UserError, match=r"pass --trainer.devices=4 .*--trainer.devices=1 is for a rank given a GPU"):
        _horovod_on([torch.device("cuda", 0)])
    env.setattr(torch.cuda, "device_count", lambda: 1)  # one GPU on the node, and no binding: shared, refused
    with pytest.raises(UserError, match="CUDA_VISIBLE_DEVICES"):
        _horovod_on([torch.device("cuda", 0)])
    assert not _rank_has_own_gpu(_trainer_config(devices=4), per_node=4, devices_given=True)


@pytest.mark.parametrize(
    ("args", "endpoint"),
    [
        (["torchrun", "--rdzv-endpoint=a:29400", "cli.py", "fit"], ("a", 29400)),
        (["python", "-m", "torch.distributed.run", "--rdzv_endpoint", "node-1", "cli.py"], ("node-1", 29400)),
        (["torchrun", "--nnodes=2", "--master_addr=a", "--master_port", "1234", "cli.py"], ("a", 1234)),
        (["torchrun", "--nproc_per_node=2", "cli.py"], ("127.0.0.1", 29500)),  # torchrun's static defaults
        (["torchrun", "--rdzv-endpoint=[fd00::1]:7000", "cli.py"], ("fd00::1", 7000)),
        (["torchrun", "--rdzv-endpoint=a:port", "cli.py"], None),
    ],
)
def test_the_rendezvous_endpoint_comes_from_the_agents_command_line(args, endpoint):
    """What a cut-off node asks whether it can still reach (app/callbacks/rank_watchdog.py)."""
    from app.launch.launcher import _rendezvous_endpoint

    assert _rendezvous_endpoint(args) == endpoint


def test_a_process_that_torchrun_did_not_start_has_no_agent(monkeypatch):
    from app.launch.launcher import torchrun_agent

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert torchrun_agent() is None
    # started by torchrun, as its environment says, but no torchrun among this process's ancestors (pytest's)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert torchrun_agent() is None


@pytest.mark.slow
def test_a_quiet_worker_waits_for_its_nodes_first_process_to_exit_and_no_longer(tmp_path):
    """A worker that does not print a bad-input error (app/run/cli.py) waits for its node's local rank 0, a sibling
    under the same launcher, to exit (it prints the line) instead of a fixed 15 s; with no such sibling, not at all.
    Here this test is the launcher: local rank 0 lives 2 s, local rank 1 waits for it."""
    waiter = (
        "import time; from app.launch.launcher import wait_for_first_on_node as w; t = time.monotonic(); w(30); "
        "print(time.monotonic() - t)"
    )
    env = {k: v for k, v in os.environ.items() if k != "LOCAL_RANK" and not k.startswith(("OMPI_", "PMI", "HOROVOD_"))}
    env["PYTHONPATH"] = str(ROOT)
    first = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(2)"], env={**env, "LOCAL_RANK": "0"})
    started = time.monotonic()
    quiet = subprocess.run([sys.executable, "-c", waiter], env={**env, "LOCAL_RANK": "1"}, capture_output=True,
                           text=True, timeout=60)  # fmt: skip
    assert quiet.returncode == 0, quiet.stderr
    assert first.poll() is not None and time.monotonic() - started < 20  # it returned once the first had gone
    first.wait()
    alone = subprocess.run([sys.executable, "-c", waiter], env={**env, "LOCAL_RANK": "1"}, capture_output=True,
                           text=True, timeout=60)  # fmt: skip
    assert float(alone.stdout) < 1.0, alone.stdout  # no sibling: at once
