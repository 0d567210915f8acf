"""Run ``tests/parity_run.py`` under a strategy and compare its weights with one device's (helpers and cases)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from tests import warm
from tests.conftest import ROOT

SCRIPT = ROOT / "tests" / "parity_run.py"
MPIRUN = Path(sys.executable).parent / "mpirun"
MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
# ||theta - theta_ref|| / ||theta_ref|| over all parameters. The runs are float64 (--precision 64-true): the sums
# of one device and of two processes differ only in their order, which float64 rounding makes ~1e-16 here (measured
# 1.2e-17 for ddp), on any machine and thread count. 1e-10 is far above that and far below any real difference.
TOLERANCE = 1e-10
# float32 runs (one case, FLOAT32): reordered float32 sums drift to ~1e-5 after 4 steps (1.12e-5 seen on 2-core x86
# machines, depending on the thread count); a wrong reduction (a sum for a mean, a missing rank) is off by > 1e-2.
FLOAT32_TOLERANCE = 1e-4


def check_steps(name: str, result: dict, reference: dict) -> None:
    assert reference["global_step"] == 4
    assert result["global_step"] == 4  # saved by rank 0 where it trained, whatever the launcher


def one_process(args: tuple[str, ...]) -> bool:
    """One device, or dp (threads in one process): no launcher starts other processes. (``ddp`` on one device also
    runs one process, but it opens a process group, which the next test in this worker would find still open.)"""

    def value(flag: str, default: str) -> str:
        return args[args.index(flag) + 1] if flag in args else default

    strategy = value("--strategy", "auto")
    return (value("--devices", "1") == "1" and not strategy.startswith("ddp")) or strategy == "dp"


def run_parity(out_dir: Path, name: str, *args: str, mpirun: int = 0) -> dict:
    """Run the case once. One-process cases run in this process (the launchers are not what they test, and a new
    interpreter costs seconds of imports); every multi-process case runs as a user runs the script; the variants
    of :data:`LAUNCHES` run together, in one launch of their own."""
    out = out_dir / f"{name}.pt"
    recorded = out.with_suffix(".args")  # a name means one run: two tests that reuse it must mean the same run
    wanted = json.dumps([*args, mpirun])
    if recorded.exists() and recorded.read_text() != wanted:
        raise ValueError(f"parity run {name!r} was made with {recorded.read_text()}, now asked with {wanted}")
    launch = launch_of(name)
    if launch is not None and LAUNCHES[launch][1][name] != list(args):
        raise ValueError(f"parity run {name!r} is made in the launch {launch!r} with {LAUNCHES[launch][1][name]}")
    recorded.write_text(wanted)
    if not out.exists() and launch is not None:
        run_launch(out_dir, launch)
    elif not out.exists() and not mpirun and one_process(args):
        from tests import parity_run

        parity_run.main([str(out), *args])
    elif not out.exists():
        cmd = [sys.executable, str(SCRIPT), str(out), *args]
        if mpirun:
            cmd = [str(MPIRUN), "-np", str(mpirun), "--oversubscribe", *cmd]
        run_command(cmd)
    return torch.load(out, weights_only=True)


def run_command(cmd: list[str]) -> None:
    run = warm.run if cmd[0] == sys.executable and cmd[1].endswith(".py") else subprocess.run
    # PYTHONPATH: the runs train tests.tiny's task, which every launched process imports (as a user's own package)
    environ = {**os.environ, **MPI_ENV, "PYTHONPATH": str(ROOT)}
    result = run(cmd, capture_output=True, text=True, timeout=600, env=environ)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]


def launch_of(name: str) -> str | None:
    """The launch of :data:`LAUNCHES` that makes the run ``name``, if any (its lock, when tests ask at once)."""
    return next((launch for launch, (_, runs) in LAUNCHES.items() if name in runs), None)


def run_launch(out_dir: Path, launch: str) -> None:
    """Every run of ``launch``, one after another in the same processes (``parity_run.py --batch``)."""
    launcher, runs = LAUNCHES[launch]
    batch = out_dir / f"{launch}.json"
    batch.write_text(json.dumps([[str(out_dir / f"{n}.pt"), *a] for n, a in runs.items()]))
    script = [str(SCRIPT), "--batch", str(batch)]
    if launcher == "torchrun":
        run_command([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *script])
    elif launcher == "python":
        run_command([sys.executable, *script])
    else:
        run_command([str(MPIRUN), "-np", "2", "--oversubscribe", sys.executable, *script])


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
    "fsdp": ["--strategy", "fsdp", "--devices", "2", "--batch-size", "8"],
    "pipeline": ["--strategy", "pipeline", "--devices", "2", "--batch-size", "8"],  # 2 stages share a batch of 16
    "pipeline_2x2": ["--strategy", "pipeline", "--devices", "4", "--stages", "2", "--batch-size", "4"],  # 2 x 8
}
REFERENCE = ["--devices", "1", "--batch-size", "16"]

# Variants of a strategy (accumulation, precision, callbacks, compression) run one after another in one launch of
# 2 processes, instead of a launch each: every interpreter start costs ~5 CPU-seconds of imports, more than a
# variant's training. They run under the launchers users type themselves: torchrun for ddp, mpirun for horovod, and
# Lightning's own launcher (``python cli.py ... --trainer.devices=2``, as docs/model-parallel.md starts them) for
# fsdp and pipeline, whose second rank is then forked warm (tests/warm.py); the plain cases (CASES,
# "horovod_mpirun") keep a launch of their own through the launcher they name.
BN_WARMUP = ["--norm", "batch", "--warmup-steps", "2"]
VARIANT_CASES = {  # the strategies the variant tests are parametrized over; "horovod" runs under mpirun -np 2
    "dp": CASES["dp"],
    "ddp": CASES["ddp"],
    "ddp_spawn": CASES["ddp_spawn"],
    "horovod": CASES["horovod_self_launched"],
    "fsdp": CASES["fsdp"],
    "pipeline": CASES["pipeline"],
}
LAUNCHES = {
    "ddp_variants": (
        "torchrun",
        {
            "ddp_acc2": [*CASES["ddp"], "--accumulate", "2"],
            "ddp_float32": [*CASES["ddp"], "--precision", "32-true"],
            "ddp_bf16_mixed": [*CASES["ddp"], "--precision", "bf16-mixed"],
            "ddp_bn_sync": [*CASES["ddp"], *BN_WARMUP, "--sync-bn", "--checkpointing"],
            "ddp_bn_plain": [*CASES["ddp"], *BN_WARMUP],
            "ddp_fp16_comm_hook": [*CASES["ddp"], "--comm-hook", "fp16"],
            "ddp_bf16_comm_hook": [*CASES["ddp"], "--comm-hook", "bf16"],
        },
    ),
    "ddp_spawn_variants": (  # each fit spawns its own ranks: one launching process for all
        "python",
        {
            "ddp_spawn_bf16_mixed": [*CASES["ddp_spawn"], "--precision", "bf16-mixed"],
            "ddp_spawn_ckpt": [*CASES["ddp_spawn"], "--checkpointing"],
        },
    ),
    "fsdp_variants": (
        "python",
        {
            "fsdp_acc2": [*VARIANT_CASES["fsdp"], "--accumulate", "2"],
            "fsdp_bf16_mixed": [*VARIANT_CASES["fsdp"], "--precision", "bf16-mixed"],
            "fsdp_ckpt": [*VARIANT_CASES["fsdp"], "--checkpointing"],
            "fsdp_bn_sync": [*VARIANT_CASES["fsdp"], *BN_WARMUP, "--sync-bn", "--checkpointing"],
            "fsdp_bn_plain": [*VARIANT_CASES["fsdp"], *BN_WARMUP],
        },
    ),
    "pipeline_variants": (
        "python",
        {
            "pipeline_acc2": [*VARIANT_CASES["pipeline"], "--accumulate", "2"],
            "pipeline_bf16_mixed": [*VARIANT_CASES["pipeline"], "--precision", "bf16-mixed"],
            "pipeline_ckpt": [*VARIANT_CASES["pipeline"], "--checkpointing"],
            "pipeline_gpipe": [*VARIANT_CASES["pipeline"], "--schedule", "gpipe", "--microbatches", "8"],
        },
    ),
    "horovod_variants": (
        "mpirun",
        {
            "horovod_acc2": [*VARIANT_CASES["horovod"], "--accumulate", "2"],
            "horovod_fp16": [*VARIANT_CASES["horovod"], "--compression", "fp16"],
            "horovod_bf16_mixed": [*VARIANT_CASES["horovod"], "--precision", "bf16-mixed"],
            "horovod_ckpt": [*VARIANT_CASES["horovod"], "--checkpointing"],
            "horovod_bn_sync": [*VARIANT_CASES["horovod"], *BN_WARMUP, "--sync-bn", "--checkpointing"],
            "horovod_bn_plain": [*VARIANT_CASES["horovod"], *BN_WARMUP],
        },
    ),
}
