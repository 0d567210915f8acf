"""What the template makes of a SLURM job without a cluster: SLURM's variables (app/launch/launcher.py), its numbers
against the trainer's, the line after a stop and the requeue it asks for (app/launch/slurm.py, with a stand-in
``scontrol``), and the login node's silence. The jobs themselves run on a real two-node cluster in
tests/test_slurm_training.py."""

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from jsonargparse import Namespace

from app.errors import UserError
from app.launch import slurm
from app.launch.launcher import slurm_job
from app.launch.restarts import is_restart, restarts_possible
from app.launch.slurm import after_stop, requeueable_job, take_slurm_numbers
from tests.conftest import ROOT, TINY_CONFIG

SLURM_VARS = (
    "SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID", "SLURM_RESTART_COUNT", "ENVIRONMENT",
    "SLURM_STEP_ID", "SLURM_JOB_NUM_NODES", "SLURM_NNODES", "SLURM_NTASKS", "SLURM_NTASKS_PER_NODE",
    "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NODEID", "TORCHELASTIC_RUN_ID", "LOCAL_WORLD_SIZE",
    "SLURM_PROCID", "RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK",
)  # fmt: skip


@pytest.fixture
def env(monkeypatch):
    for name in SLURM_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(slurm, "_requeued", [])
    return monkeypatch


def in_job(env, **variables: str) -> None:
    """This process as a task of a batch job's srun step: job 77, 2 nodes x 2 tasks, unless ``variables`` say else."""
    defaults = {"SLURM_JOB_ID": "77", "ENVIRONMENT": "BATCH", "SLURM_STEP_ID": "0", "SLURM_JOB_NUM_NODES": "2"}
    defaults |= {"SLURM_NTASKS": "4", "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_NODEID": "1"}
    for name, value in (defaults | variables).items():
        if value is None:
            env.delenv(name, raising=False)
        else:
            env.setenv(name, value)


def test_a_batch_jobs_task_knows_its_job_its_requeues_and_its_shape(env):
    in_job(env, SLURM_RESTART_COUNT="2")
    job = slurm_job()
    assert (job.job_id, job.restart_count, job.batch, job.in_step) == ("77", 2, True, True)
    assert (job.nodes, job.tasks, job.tasks_per_node) == (2, 4, 2)
    assert job.run_id == "slurm-77" and job.start_name == "requeue2"
    assert requeueable_job() == job and restarts_possible() and is_restart()


def test_an_array_task_is_a_job_of_its_own_and_srun_alone_is_no_batch_job(env):
    in_job(env, SLURM_ARRAY_JOB_ID="70", SLURM_ARRAY_TASK_ID="3", ENVIRONMENT=None)
    job = slurm_job()
    assert job.job_id == "70_3" and not job.batch and requeueable_job() is None
    assert not restarts_possible() and not is_restart()


def test_outside_slurm_there_is_no_job(env):
    assert slurm_job() is None and requeueable_job() is None and not restarts_possible()


def trainer_config(devices="auto", num_nodes=1, strategy="ddp") -> Namespace:
    return Namespace(devices=devices, num_nodes=num_nodes, strategy=strategy)


def test_slurms_tasks_per_node_and_nodes_are_the_devices_and_nodes_unless_the_command_line_says_else(env):
    in_job(env)
    config = trainer_config(devices=4)  # a preset's 4 GPUs per node, not given on the command line
    take_slurm_numbers(config, slurm_job(), devices_given=False)
    assert (config.devices, config.num_nodes) == (2, 2)
    with pytest.raises(UserError) as error:
        take_slurm_numbers(trainer_config(devices=4), slurm_job(), devices_given=True)
    assert str(error.value).startswith("--trainer.devices=4, but SLURM starts 2 task(s) per node (#SBATCH ")
    assert "--ntasks-per-node=2" in str(error.value)
    with pytest.raises(UserError, match=r"--trainer.num_nodes=3, but SLURM job 77 has 2 node\(s\) \(#SBATCH --nodes"):
        take_slurm_numbers(trainer_config(num_nodes=3), slurm_job(), devices_given=False)


def test_a_batch_script_that_runs_cli_py_without_srun_in_a_job_of_several_tasks_is_one_line(env):
    """Lightning takes the batch script's process for task 0 of 4 (SLURM_NTASKS is set there too) and waits for the
    other three for good."""
    in_job(env, SLURM_STEP_ID=None)
    with pytest.raises(UserError, match=r"SLURM job 77 has 4 tasks, but its batch script runs cli.py itself: .*srun"):
        take_slurm_numbers(trainer_config(), slurm_job(), devices_given=False)
    take_slurm_numbers(trainer_config(strategy="horovod"), slurm_job(), devices_given=False)  # starts its own mpirun
    in_job(env, SLURM_STEP_ID=None, SLURM_NTASKS="1")
    take_slurm_numbers(trainer_config(), slurm_job(), devices_given=False)  # one task: Lightning starts the ranks


def test_a_strategy_that_starts_its_own_workers_under_srun_is_one_line(env):
    in_job(env)
    with pytest.raises(UserError, match=r"--trainer.strategy=ddp_spawn starts its own workers, but srun started"):
        take_slurm_numbers(trainer_config(strategy="ddp_spawn"), slurm_job(), devices_given=False)


@pytest.fixture
def scontrol(tmp_path, env):
    """A stand-in ``scontrol`` first on PATH: ``show job`` answers with the fields in ``state`` (as SLURM 22.05 has
    them while it delivers its SIGTERM, tests/test_slurm_training.py), ``requeue`` is written to ``calls`` and answers
    with ``requeue_answer`` (empty: success)."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir()
    (tmp_path / "state").write_text("JobState=RUNNING Reason=None Restarts=0")
    (tmp_path / "requeue_answer").write_text("")
    script = bin_dir / "scontrol"
    script.write_text(
        f'#!/bin/sh\necho "$*" >> {calls}\n'
        f'if [ "$1" = show ]; then echo "JobId=$4 JobName=x $(cat {tmp_path}/state)"; exit 0; fi\n'
        f'answer=$(cat {tmp_path}/requeue_answer); [ -z "$answer" ] && exit 0; echo "$answer" >&2; exit 1\n'
    )
    script.chmod(0o755)
    env.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return tmp_path


def calls(folder: Path) -> list[str]:
    return (folder / "calls").read_text().splitlines() if (folder / "calls").exists() else []


def test_the_time_limits_warning_signal_requeues_the_job_once(scontrol, env):
    in_job(env)
    said = after_stop(slurm_job(), signal.SIGUSR1)
    assert said == "Requeued SLURM job 77 (before its time limit): its next start resumes from it by itself"
    assert calls(scontrol) == ["requeue 77"]
    after_stop(slurm_job(), signal.SIGUSR1)
    assert calls(scontrol) == ["requeue 77"]  # once per process


@pytest.mark.parametrize(
    ("state", "said", "requeued"),
    [
        (
            "JobState=COMPLETING Reason=TimeLimit Restarts=0",
            "Requeued SLURM job 77 (at its time limit): its next start resumes from it by itself",
            True,
        ),
        (  # scontrol requeue, or a preemption that requeues
            "JobState=COMPLETING Reason=None Restarts=1",
            "SLURM requeues job 77: its next start resumes from it by itself",
            False,
        ),
        (  # scancel
            "JobState=COMPLETING Reason=None Restarts=0",
            "SLURM job 77 was cancelled: submit the script again with --ckpt_path last to continue",
            False,
        ),
        (  # scancel --signal=TERM: the tasks only; the job runs on
            "JobState=RUNNING Reason=None Restarts=0",
            "Continue with the same command plus --ckpt_path last",
            False,
        ),
    ],
)
def test_a_sigterm_requeues_only_at_the_time_limit_and_says_what_slurm_does(scontrol, env, state, said, requeued):
    in_job(env)
    (scontrol / "state").write_text(state)
    assert after_stop(slurm_job(), signal.SIGTERM) == said
    assert ("requeue 77" in calls(scontrol)) == requeued


def test_a_refused_requeue_says_slurms_words_and_how_to_continue(scontrol, env):
    in_job(env)
    (scontrol / "requeue_answer").write_text("Requested operation is presently disabled for job 77")
    said = after_stop(slurm_job(), signal.SIGUSR1)
    assert said == (
        "SLURM did not requeue job 77 (scontrol requeue 77: Requested operation is presently disabled for job 77): "
        "submit the script again with --ckpt_path last"
    )


def test_a_job_that_srun_started_without_sbatch_is_not_requeued_and_says_why(scontrol, env):
    in_job(env, ENVIRONMENT=None)
    said = after_stop(slurm_job(), signal.SIGUSR1)
    assert said.startswith("SLURM cannot requeue job 77 (srun started it, not sbatch): continue with the same command")
    assert calls(scontrol) == []


@pytest.mark.slow
def test_on_a_login_node_with_srun_installed_a_run_says_nothing_of_srun(tmp_path, env):
    """Lightning warns on every Trainer that `srun` is available but not used where SLURM's tools are installed: on
    a login node, every run. Outside a SLURM job the run is this machine's, and nothing is said; inside a job's batch
    script that runs cli.py without srun, it is one line and exit 2."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text("#!/bin/sh\nexit 1\n")
    (bin_dir / "srun").chmod(0o755)
    run_env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": str(ROOT)}
    fit = [sys.executable, str(ROOT / "cli.py"), "fit", "--config", str(TINY_CONFIG), "--trainer.max_steps=1"]
    fit += ["--trainer.limit_val_batches=1", f"--trainer.default_root_dir={tmp_path / 'runs'}"]
    result = subprocess.run(fit, cwd=tmp_path, env=run_env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "srun" not in result.stdout + result.stderr
    batch = {**run_env, "SLURM_JOB_ID": "77", "ENVIRONMENT": "BATCH", "SLURM_NTASKS": "4", "SLURM_NNODES": "2"}
    result = subprocess.run(fit, cwd=tmp_path, env=batch, capture_output=True, text=True, timeout=240)
    assert result.returncode == 2, result.stderr[-3000:]
    [line] = [line for line in result.stderr.splitlines() if line.strip()]
    assert line.startswith("error: SLURM job 77 has 4 tasks, but its batch script runs cli.py itself"), line


def test_under_srun_torchrun_the_first_process_is_torchruns_rank_0_whichever_task_its_agent_is(env):
    """``srun torchrun``: SLURM_PROCID numbers the agents (one task per node), and torchrun orders the nodes itself,
    so its rank 0 may run under SLURM's task 1; with no process first, no run folder was claimed."""
    from app.launch.launcher import is_first_process

    in_job(env, SLURM_PROCID="1", TORCHELASTIC_RUN_ID="77", LOCAL_WORLD_SIZE="2", WORLD_SIZE="4", RANK="0")
    assert is_first_process()
    env.setenv("RANK", "2")
    assert not is_first_process()


SHIPPED_SCRIPT = ROOT / "scripts" / "slurm_multinode.sbatch"
# the recipe the script runs when given none: the task's own (a fork's script names its own)
DEFAULT_RECIPE = ["--config", re.search(r"recipe=\(--config (\S+)\)", SHIPPED_SCRIPT.read_text())[1]]


@pytest.mark.parametrize(
    ("given", "recipe", "flags"),
    [
        ((), DEFAULT_RECIPE, []),
        (("--trainer.max_epochs=5",), DEFAULT_RECIPE, ["--trainer.max_epochs=5"]),
        (
            ("--trainer.max_epochs=5", "--config", "mine.yaml", "--config=more.yaml"),
            ["--config", "mine.yaml", "--config=more.yaml"],
            ["--trainer.max_epochs=5"],
        ),
    ],
)
def test_the_shipped_batch_script_takes_a_forks_recipe_from_its_command_line(tmp_path, given, recipe, flags):
    """``sbatch scripts/slurm_multinode.sbatch --config my_task.yaml``: the fork's recipe in place of the example's,
    under the multi-node preset, the other flags over both (a stand-in ``srun`` prints what it was given)."""
    bin_folder, submit = tmp_path / "bin", tmp_path / "submit"
    (submit / ".venv" / "bin").mkdir(parents=True)
    (submit / ".venv" / "bin" / "activate").write_text("")
    bin_folder.mkdir()
    (bin_folder / "srun").write_text('#!/bin/sh\nfor a in "$@"; do echo "$a"; done\n')
    (bin_folder / "srun").chmod(0o755)
    environ = {**os.environ, "SLURM_SUBMIT_DIR": str(submit), "PATH": f"{bin_folder}:{os.environ['PATH']}"}
    script = str(SHIPPED_SCRIPT)
    done = subprocess.run(["bash", script, *given], env=environ, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    preset = ["--config", "configs/multinode_ddp.yaml"]
    assert done.stdout.splitlines() == ["python", "cli.py", "fit", *recipe, *preset, *flags]
    missing = subprocess.run(["bash", script, "--config"], env=environ, capture_output=True, text=True, timeout=30)
    assert missing.returncode != 0 and "--config needs a file" in missing.stderr


def test_each_row_of_the_docs_table_of_slurm_events_names_a_test_that_exists():
    """docs/multi-node.md's table of what the run does on each SLURM event is proven row by row: every row names at
    least one test (``tests/FILE.py::test_name``), and each named test is defined in its file."""
    text = (ROOT / "docs" / "multi-node.md").read_text()
    start = text.index("| event | what SLURM sends |")
    rows = text[start : text.index("\n\n", start)].splitlines()[2:]
    assert len(rows) >= 8, rows
    for row in rows:
        named = re.findall(r"`(tests/[\w/]+\.py)::(test_\w+)`", row)
        assert named, f"a row of docs/multi-node.md names no test: {row[:80]}"
        for file, test in named:
            assert re.search(rf"(?m)^def {test}\(", (ROOT / file).read_text()), f"{file} has no {test}"
