"""app/launcher.py reads every launcher's variables (one place), and the self-launch's mpirun leaves ranks unbound."""

import pytest

from app.launcher import first_on_node, launcher_ranks, slurm_tasks_per_node
from app.strategies.launch import mpirun_command

LAUNCH_VARS = (
    "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE",
    "HOROVOD_SIZE", "HOROVOD_RANK", "PMI_SIZE", "PMI_RANK", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", "PMIX_SIZE",
    "PMIX_RANK", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE", "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE",
    "SLURM_NODEID", "LOCAL_RANK",
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


def test_self_launched_ranks_are_not_bound_to_one_core():
    """Open MPI binds each rank to one core for small -np; a GPU rank's data path needs more (Horovod's guidance)."""
    cmd = " ".join(mpirun_command(2))
    assert "--bind-to none" in cmd and "--map-by slot" in cmd
