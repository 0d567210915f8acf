"""Run ``tests/parity_run.py`` under a strategy and compare its weights with one device's (helpers and cases)."""

import os
import subprocess
import sys
from pathlib import Path

import torch

from tests.conftest import ROOT

SCRIPT = ROOT / "tests" / "parity_run.py"
MPIRUN = Path(sys.executable).parent / "mpirun"
MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
TOLERANCE = 1e-5  # ||theta - theta_ref|| / ||theta_ref|| over all parameters
# Spawn-style launches bring weights, trainer state and callback metrics back to the caller, not the loop counters;
# there, equality with the 4-step reference's weights is what shows that 4 steps were taken.
SPAWNED = {"ddp_spawn", "horovod_self_launched"}


def check_steps(name: str, result: dict, reference: dict) -> None:
    assert reference["global_step"] == 4
    if name not in SPAWNED:
        assert result["global_step"] == 4


def run_parity(out_dir: Path, data_dir: Path, name: str, *args: str, mpirun: int = 0) -> dict:
    out = out_dir / f"{name}.pt"
    if not out.exists():
        cmd = [sys.executable, str(SCRIPT), str(out), "--data-dir", str(data_dir), *args]
        if mpirun:
            cmd = [str(MPIRUN), "-np", str(mpirun), "--oversubscribe", *cmd]
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, **MPI_ENV})
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return torch.load(out, weights_only=True)


def relative_error(result: dict, reference: dict) -> float:
    ref, got = reference["state_dict"], result["state_dict"]
    keys = [k for k, v in ref.items() if v.is_floating_point()]
    diff = sum(((got[k] - ref[k]) ** 2).sum() for k in keys)
    return float((diff / sum((ref[k] ** 2).sum() for k in keys)).sqrt())


def buffer_error(result: dict, reference: dict) -> float:
    """The same relative error over the BatchNorm running statistics only."""
    ref, got = reference["state_dict"], result["state_dict"]
    keys = [k for k in ref if k.endswith(("running_mean", "running_var"))]
    diff = sum(((got[k] - ref[k]) ** 2).sum() for k in keys)
    return float((diff / sum((ref[k] ** 2).sum() for k in keys)).sqrt())


CASES = {
    "dp": ["--strategy", "dp", "--devices", "2", "--batch-size", "8"],
    "ddp": ["--strategy", "ddp", "--devices", "2", "--batch-size", "8"],
    "ddp_spawn": ["--strategy", "ddp_spawn", "--devices", "2", "--batch-size", "8"],
    "horovod_self_launched": ["--strategy", "horovod", "--devices", "2", "--batch-size", "8"],
}
REFERENCE = ["--devices", "1", "--batch-size", "16"]
