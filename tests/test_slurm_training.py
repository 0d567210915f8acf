"""A SLURM batch job that is stopped comes back and trains exactly what an unbroken job trains: on a real two-node
SLURM cluster (tests/slurm.py), with the shipped script (scripts/slurm_multinode.sbatch, its GPU lines swapped for
CPU), a model with dropout, and no flag added for the resume.

- ``scontrol requeue`` mid-epoch, a preemption by a higher-priority partition, the time-limit warning
  (``--signal=USR1@N``) and a SIGTERM at the time limit: each ends with weights bitwise equal to the unbroken job's,
  in the same run folder;
- a lost node (its slurmd and its ranks killed): the survivor saves the step in flight, requeues the job, which
  resumes once the node is back, bitwise equal to the unbroken job too, dropout included;
- ``scancel --signal=TERM`` then ``scancel``: the state is saved and no rank is left;
- a requeued job whose checkpoint is damaged says so in one line.

Each job holds at step 3 of its first start (tests/hold_at_step.py) until the stop reaches it, so every stop lands
mid-epoch whatever the machine's speed. The unbroken job runs beside the first test (each job takes one of the two
CPUs of each node).
"""

import json
import re
import signal
import subprocess
import time
from datetime import datetime
from functools import cache
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from tests.conftest import ROOT
from tests.slurm import SlurmCluster, slurm_available
from tests.trackers import mlflow_runs, wandb_segments

# one worker, one cluster; a test waits for jobs, requeues and (the lost node's) its reference job: more than 300 s
# under load
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("slurm-training"), pytest.mark.timeout(900)]

SHIPPED = ROOT / "scripts" / "slurm_multinode.sbatch"
STEPS = 16  # 2 epochs of 8 steps
RUN = (
    "--trainer.accelerator=cpu", "--trainer.precision=32-true", "--model.dropout=0.3", "--trainer.max_epochs=2",
    "--trainer.limit_train_batches=8", "--trainer.limit_val_batches=2", "--data.batch_size=8",
)  # fmt: skip


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    ok, why = slurm_available()
    if not ok:
        pytest.skip(why)
    with SlurmCluster(tmp_path_factory.mktemp("slurm")) as made:
        yield made


@pytest.fixture(autouse=True)
def no_job_left(cluster):
    """A test that failed leaves no job behind to hold the next test's CPUs (a cascade of waits, seen under load)."""
    yield
    left = cluster.client(["squeue", "-h", "-o", "%i"], check=False).stdout.split()
    if left:
        cluster.client(["scancel", *left], check=False)
        deadline = time.monotonic() + 60
        while cluster.client(["squeue", "-h", "-o", "%i"], check=False).stdout.split():
            if time.monotonic() > deadline:
                break
            time.sleep(0.5)


def cpu_script(folder: Path, drop: tuple[str, ...] = ()) -> Path:
    """The shipped script with its GPU lines swapped for CPU: one task per node (each node has 2 CPUs, and a test's
    job runs beside the unbroken one), no GPUs, the tests' tiny task for the example's recipe; ``drop``: #SBATCH
    options left out (a user's script without them)."""
    text = SHIPPED.read_text()
    text = re.sub(r"(?m)^#SBATCH --gpus-per-node=.*\n", "", text)
    for option in drop:
        text = re.sub(rf"(?m)^#SBATCH {option}\b.*\n", "", text)
    for old, new in (("--ntasks-per-node=4", "--ntasks-per-node=1"), ("--cpus-per-task=8", "--cpus-per-task=1")):
        assert old in text, f"{SHIPPED} no longer has {old}"
        text = text.replace(old, new)
    # the task's recipe (the first --config that is no multi-node preset: a fork's script names its own) becomes the
    # tests' own task
    text, swapped = re.subn(r"configs/(?!multinode)[\w.-]+\.yaml", "tests/tiny.yaml", text, count=1)
    assert swapped, f"{SHIPPED} names no recipe config"
    script = folder / "job.sbatch"
    script.write_text(text)
    return script


class Job:
    def __init__(self, cluster: SlurmCluster, folder: Path, *sbatch: str, hold: bool | dict = True, drop=(), more=()):
        """The CPU copy of the shipped script, submitted from the repository (as its ``cd $SLURM_SUBMIT_DIR``
        expects), writing its runs and its output file into ``folder``; ``hold``: HoldAtStep's arguments besides
        its folder, or False for none."""
        self.cluster, self.folder = cluster, folder
        folder.mkdir(parents=True, exist_ok=True)
        self.output = folder / "slurm.out"
        args = [*RUN, f"--trainer.default_root_dir={folder / 'runs'}", *more]
        if hold:
            hold_args = {"folder": str(folder), **(hold if isinstance(hold, dict) else {})}
            spec = {"class_path": "tests.hold_at_step.HoldAtStep", "init_args": hold_args}
            args.append("--trainer.callbacks+=" + json.dumps(spec))
        script = cpu_script(folder, drop)
        # as a user types it: sbatch [options] script [the script's arguments: cli.py's flags]
        submit = ["sbatch", "--parsable", f"--output={self.output}", *sbatch, str(script), *args]
        self.id = cluster.client(submit, cwd=ROOT).stdout.strip().split(";")[0]

    def held(self, timeout: float = 180) -> None:
        """Wait until every rank holds at step 3 of the first start."""
        deadline = time.monotonic() + timeout
        while not (self.folder / "held").exists():
            info = self.cluster.state(self.id) or {}
            if time.monotonic() > deadline or info.get("JobState") not in ("PENDING", "RUNNING"):
                pytest.fail(f"job {self.id} did not reach step 3 ({info.get('JobState')}):\n{self.text()[-4000:]}")
            time.sleep(0.5)

    def release(self, *update: str) -> None:
        """Once SLURM holds the requeued job (PENDING, Reason=BeginTime: 2 minutes by default), start it now, with
        ``update`` (``TimeLimit=10``), once every process of its first start is gone: started while a node still
        cleans up after the first, the job is killed ("Job credential revoked", seen under load)."""
        self.cluster.wait(self.id, states=("PENDING",), timeout=240, poll=0.5)
        deadline = time.monotonic() + 60
        while job_processes(self.cluster, self.folder) and time.monotonic() < deadline:
            if not self.pending():  # its hold ran out and it started by itself: these are its second start's processes
                return
            time.sleep(0.2)
        time.sleep(1)  # slurmd's own bookkeeping after the last process
        done = self.cluster.scontrol("update", f"jobid={self.id}", *update, "StartTime=now", check=False)
        started = ("no longer pending", "already finished")  # it started by itself meanwhile, and may even have ended
        if done.returncode != 0 and not any(words in done.stderr for words in started):
            raise AssertionError(f"scontrol update of job {self.id}: {done.stderr.strip()}")

    def pending(self) -> bool:
        return (self.cluster.state(self.id) or {}).get("JobState") == "PENDING"

    def text(self) -> str:
        return self.output.read_text() if self.output.exists() else ""

    def finished(self, timeout: float = 300) -> dict:
        try:
            return self.cluster.wait(self.id, timeout=timeout)
        except Exception as err:
            raise AssertionError(f"{err}\n--- job output:\n{self.text()[-6000:]}") from None

    def run_folder(self) -> Path:
        runs = sorted((self.folder / "runs" / "lightning_logs").glob("version_*"))
        assert len(runs) == 1, (runs, self.text()[-3000:])  # a requeue goes on in the run's folder
        return runs[0]

    def last(self) -> dict:
        return torch.load(self.run_folder() / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)

    def steps(self) -> list[dict]:
        return [json.loads(line) for line in (self.folder / "steps.jsonl").read_text().splitlines()]


def unbroken_job(cluster, folder: Path, *more: str):
    """The same job, never stopped, submitted now (it runs beside a test's job); its last.ckpt once it is over."""
    job = Job(cluster, folder, hold=False, more=more)

    @cache
    def result() -> dict:
        info = job.finished()  # (SLURM forgets a job MinJobAge after its end: once)
        assert (info["JobState"], info["Restarts"]) == ("COMPLETED", "0"), job.text()[-3000:]  # never stopped
        return job.last()

    return result


@pytest.fixture(scope="module")
def unbroken(cluster, tmp_path_factory):
    return unbroken_job(cluster, tmp_path_factory.mktemp("unbroken"))


def assert_bitwise(job: Job, unbroken) -> None:
    final, expected = job.last(), unbroken()
    assert final["global_step"] == expected["global_step"] == STEPS, job.text()[-3000:]
    different = [
        k for k in expected["state_dict"] if not torch.equal(final["state_dict"][k], expected["state_dict"][k])
    ]
    assert not different, f"{len(different)} tensors differ from the unbroken job's, e.g. {different[:3]}"


def resumed_at(job: Job) -> int:
    """The step the second start resumed from (its own line says it)."""
    found = re.search(
        rf"SLURM job {job.id}, start 2 \(requeued 1 time\(s\)\): resuming from \S+ \(step (\d+)\)", job.text()
    )
    assert found, job.text()[-4000:]
    return int(found[1])


def test_scontrol_requeue_mid_epoch_resumes_by_itself_in_the_same_run_bitwise_like_an_unbroken_job(
    cluster, unbroken, tmp_path
):
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"  # an MLflow run beside the run folder: one across the requeue
    MlflowClient(store).search_experiments()  # the store made first, as docs/training.md says for srun's ranks
    tracker = ("--trainer.logger+=lightning.pytorch.loggers.MLFlowLogger", f"--trainer.logger.tracking_uri={store}")
    job = Job(cluster, tmp_path / "requeued", more=tracker)
    job.held()
    requeued = time.time()
    cluster.requeue(job.id)
    job.release()  # (SLURM holds a requeued job back 2 minutes: BeginTime)
    released = time.time()
    info = job.finished()
    assert (info["JobState"], info["Restarts"]) == ("COMPLETED", "1")
    text = job.text()
    assert f"SLURM requeues job {job.id}: its next start resumes from it by itself" in text, text[-4000:]
    assert 3 <= resumed_at(job) <= 5  # the stop lands within two steps of the signal
    assert (job.run_folder() / "config.requeue1.yaml").is_file()
    assert_bitwise(job, unbroken)
    [tracked] = mlflow_runs(store, "lightning_logs")
    assert tracked["steps"] == list(range(STEPS)) and tracked["status"] == "FINISHED", tracked
    first_resumed = min(s["time"] for s in job.steps() if s["start"] == 1)
    print(
        f"\nrequeue -> first resumed step: {first_resumed - requeued:.1f} s, of which {released - requeued:.1f} s "
        f"until the job was pending and released (SLURM's own hold of 120 s skipped)"
    )


def test_the_time_limit_warning_signal_saves_requeues_and_resumes_bitwise(cluster, unbroken, tmp_path):
    """The shipped script's own ``#SBATCH --signal=USR1@90``, in a job of 2 minutes: 90 s before the time limit (up
    to 60 s earlier, as sbatch's manual says) each task gets SIGUSR1; the run stops after the step, saves, and
    requeues the job itself, which the script's ``#SBATCH --requeue`` allows (the test cluster's ``JobRequeue=0``:
    without the line, SLURM refuses)."""
    files = tmp_path / "wandb"  # a W&B run beside the run folder, offline: one across the requeue, each step once
    tracker = ("--trainer.logger+=lightning.pytorch.loggers.WandbLogger", "--trainer.logger.offline=true")
    tracker += (f"--trainer.logger.save_dir={files}",)
    # rank 0 lingers 3 s after its save, before its loggers end (a slow machine): SLURM carries the requeue out
    # meanwhile, and stops W&B's service
    job = Job(cluster, tmp_path / "limit", "--time=2", hold={"linger": 3.0}, more=tracker)
    # the warning comes 0-30 s after the start, mostly while the ranks hold at step 3 (or before: it is kept, and
    # the run stops after its first step)
    deadline, limit = time.monotonic() + 240, None
    while (info := cluster.state(job.id) or {}).get("Restarts") != "1" and time.monotonic() < deadline:
        if limit is None and info.get("JobState") == "RUNNING":  # the first start's time limit
            limit = datetime.strptime(info["EndTime"], "%Y-%m-%dT%H:%M:%S").timestamp()
        time.sleep(0.5)
    # its next start would get the warning again 100 s before its own limit: the admin gives it more time
    job.release("TimeLimit=10")
    info = job.finished()
    assert (info["JobState"], info["Restarts"]) == ("COMPLETED", "1")
    text = job.text()
    assert "received SIGUSR1 (SLURM's warning before the time limit)" in text, text[-4000:]
    assert f"Requeued SLURM job {job.id} (before its time limit): its next start resumes from it by itself" in text
    step = resumed_at(job)
    assert 1 <= step <= 5
    # SLURM sends it at 90 s before the limit or up to 60 s earlier ("due to the resolution of event handling",
    # sbatch's manual); seen here: 92 s alone, 106 s in a whole run
    signalled = json.loads((job.folder / "signalled").read_text())
    before_limit = limit - signalled["time"]
    assert signalled["signal"] == signal.SIGUSR1 and 90 - 5 <= before_limit <= 90 + 60 + 5, before_limit
    print(f"\nUSR1@90 came {before_limit:.1f} s before the time limit")
    assert_bitwise(job, unbroken)
    # the run ended its W&B run before the requeue stopped every process of the job, W&B's service too
    first, second = wandb_segments(files)
    assert first["id"] == second["id"], (first, second)
    assert first["steps"] == list(range(step)) and second["steps"] == list(range(step, STEPS)), (first, second)


def test_the_warning_signal_while_the_job_still_starts_is_kept_and_acted_on_after_the_first_step(
    cluster, unbroken, tmp_path
):
    """SIGUSR1 in the seconds a rank spends importing (``--signal=USR1@N`` on a job that started late in its time):
    its default action ended the process, and the job ended unsaved and was not requeued. cli.py keeps it from its
    first lines; the run stops after its first step, saves, requeues, and resumes bitwise."""
    job = Job(cluster, tmp_path / "early", hold=False)
    deadline = time.monotonic() + 120
    # both ranks past cli.py's first lines, which catch SIGUSR1 (their SigCgt says so), and at once into their imports
    # of Lightning (seconds)
    while len([p for p in job_processes(cluster, job.folder) if _is_rank(_cmdline(p)) and catches_usr1(p)]) < 2:
        assert time.monotonic() < deadline, job.text()[-3000:]
        time.sleep(0.02)
    assert not (job.folder / "runs").exists() or not list((job.folder / "runs").rglob("*.ckpt"))
    cluster.scancel(job.id, "USR1")  # what --signal=USR1@N sends: the job's tasks
    job.release()
    info = job.finished()
    assert (info["JobState"], info["Restarts"]) == ("COMPLETED", "1"), job.text()[-4000:]
    text = job.text()
    assert f"Requeued SLURM job {job.id} (before its time limit): its next start resumes from it by itself" in text
    # the kept signal's own words: a signal that came after the trainer's handlers were in place says no "while"
    assert text.count("received SIGUSR1 (SLURM's warning before the time limit) while starting") == 2, text[-4000:]
    assert 1 <= resumed_at(job) <= 3
    assert_bitwise(job, unbroken)


def test_a_sigterm_at_the_time_limit_saves_requeues_and_resumes_bitwise(cluster, unbroken, tmp_path):
    """A script without ``--signal``: SLURM sends SIGTERM at the limit (twice, 50 ms apart: one stop), and the job
    would end as TIMEOUT; the run saves and requeues it (Reason=TimeLimit tells the limit from scancel)."""
    job = Job(cluster, tmp_path / "sigterm-limit", "--time=1", drop=("--signal",))
    job.held()
    job.release("TimeLimit=10")
    info = job.finished()
    assert (info["JobState"], info["Restarts"]) == ("COMPLETED", "1")
    text = job.text()
    assert "second SIGTERM" not in text, text[-4000:]
    assert f"Requeued SLURM job {job.id} (at its time limit): its next start resumes from it by itself" in text
    assert_bitwise(job, unbroken)


def test_a_job_preempted_by_a_higher_priority_partition_resumes_bitwise(cluster, unbroken, tmp_path):
    job = Job(cluster, tmp_path / "preempted")
    job.held()
    urgent = tmp_path / "urgent.sh"
    urgent.write_text("#!/bin/bash\nsleep 3\n")
    # every CPU of both nodes, in the partition that preempts (PreemptMode=REQUEUE)
    high = cluster.sbatch(urgent, "--partition=high", "--nodes=2", "--ntasks-per-node=2", f"--output={tmp_path}/u.out")
    cluster.wait(high, timeout=120)
    job.release()
    info = job.finished()
    assert (info["JobState"], info["Restarts"]) == ("COMPLETED", "1")
    assert f"SLURM requeues job {job.id}: its next start resumes from it by itself" in job.text(), job.text()[-4000:]
    assert_bitwise(job, unbroken)


def test_a_lost_node_the_survivor_saves_the_step_requeues_and_the_job_resumes_once_the_node_is_back(
    cluster, unbroken, tmp_path
):
    """Node b's slurmd and rank are killed at step 3. Rank 0's watchdog names rank 1 lost within 15 s and saves
    the step from its own thread; SLURM sees the node fail, and the job, requeued (by SLURM or by rank 0, whichever
    comes first), waits until b is back, then resumes from step 3 and ends bitwise equal to the unbroken job, dropout
    included: rank 1's generators are gone with it, and it draws at step 3 what it drew there unbroken all the same
    (app/callbacks/random_state.py seeds every rank at every batch from where the run stands)."""
    unbroken()  # over before node b is lost: it runs a rank there too
    job = Job(cluster, tmp_path / "lost-node")
    job.held()
    cluster.kill_node("b")  # its slurmd and rank 1
    try:
        cluster.wait(job.id, states=("PENDING",), timeout=120, poll=1)
        # held while b comes back: a task launched by a slurmd in its first second died at once (seen under load),
        # and rank 0 waited for it at the rendezvous
        cluster.scontrol("hold", job.id)
        text = job.text()
        assert "error: [rank 0] lost rank 1" in text, text[-4000:]
        requeued = rf"(this rank requeued SLURM job|SLURM had requeued job) {job.id}"  # whichever noticed first
        assert re.search(rf"Saved the state after step 3 to \S+; {requeued}", text), text[-4000:]
    finally:
        cluster.start_node("b")
    deadline = time.monotonic() + 60
    while cluster.node_state("b") != "idle" and time.monotonic() < deadline:
        time.sleep(0.5)
    cluster.wait_until_node_runs_steps("b")  # idle was not enough under load (tests/slurm.py)
    cluster.scontrol("release", job.id)
    job.release()
    info = job.finished()
    assert info["JobState"] == "COMPLETED"
    assert resumed_at(job) == 3
    assert_bitwise(job, unbroken)  # dropout included: rank 1's draws at step 3 do not depend on what it had drawn


def test_a_node_gone_silent_mid_all_reduce_is_named_saved_and_requeued_by_rank_0_and_the_job_resumes_bitwise(
    cluster, unbroken, tmp_path
):
    """Node b's link goes down (no kill: nothing is closed, no reset is sent) while rank 1 is inside the gradient
    all-reduce of step 4: rank 0 waits before its backward (tests.lose_node.PauseAtStep), the link is cut, then rank 0
    goes into the all-reduce too, which can no longer finish. SLURM is told to wait 300 s for a silent slurmd
    (``SlurmdTimeout``), so that only rank 0 can requeue the job in this test:

    - rank 0's watchdog names rank 1 lost within ``--watchdog.timeout`` (15 s) plus 10 s;
    - its training thread leaves the all-reduce, saves the state after step 3, and it requeues the job itself: its
      line says so, not SLURM's ("SLURM had requeued job N itself" when SLURM noticed first);
    - once the link is back, the job resumes from step 3 and ends bitwise equal to the unbroken job."""
    unbroken()  # over before b goes silent: it runs a rank there too
    marks = tmp_path / "marks"
    pause = {"step": 3, "folder": str(marks), "where": "backward", "ranks": [0]}
    pause_arg = "--trainer.callbacks+=" + json.dumps({"class_path": "tests.lose_node.PauseAtStep", "init_args": pause})
    with cluster.configured(SlurmdTimeout="300"):
        job = Job(cluster, tmp_path / "silent-node", hold=False, more=(pause_arg,))
        deadline = time.monotonic() + 180
        while not ((marks / "paused-0").exists() and (marks / "passed-1").exists()):
            info = cluster.state(job.id) or {}
            if time.monotonic() > deadline or info.get("JobState") not in ("PENDING", "RUNNING"):
                pytest.fail(f"job {job.id} did not reach step 3 ({info.get('JobState')}):\n{job.text()[-4000:]}")
            time.sleep(0.2)
        time.sleep(1)  # rank 1 goes on into the all-reduce that waits for rank 0 (milliseconds away)
        cluster.net.cut()
        cut = time.monotonic()
        (marks / "go").touch()
        named = None
        try:
            deadline = cut + 90
            while "Saved the state after step" not in (text := job.text()) and time.monotonic() < deadline:
                if named is None and "error: [rank 0] lost rank 1" in text:
                    named = time.monotonic() - cut
                time.sleep(0.2)
            # the verdict first, then the save, with no error of the collective's own: it failed because the verdict
            # shut rank 1's connections down (a killed node's closed connections fail it at once, before any verdict)
            verdict = re.search(r"error: \[rank 0\] lost rank 1: .* Saving this rank's state first", text)
            requeued = f"this rank requeued SLURM job {job.id}"
            saved = re.search(rf"\[rank 0\] Saved the state after step 3 to \S+; {requeued}", text)
            assert verdict and saved and verdict.start() < saved.start(), text[-4000:]
            assert cluster.node_state("b") not in ("down", "down*"), "SLURM noticed b: the requeue may be its own"
        finally:
            cluster.net.restore()
        named = time.monotonic() - cut if named is None else named  # the line and the save came in one poll
        print(f"\nrank 0 named the silent rank {named:.1f} s after the cut")
        assert named <= 15 + 10, text[-4000:]
        job.release()
        info = job.finished()
    assert (info["JobState"], info["Restarts"]) == ("COMPLETED", "1"), job.text()[-4000:]
    assert resumed_at(job) == 3
    assert_bitwise(job, unbroken)


def rank_processes(cluster) -> list[int]:
    return [p for node in cluster.nodes for p in node.pids() if "cli.py" in _cmdline(p)]


def _is_rank(command: str) -> bool:
    words = command.split()
    return len(words) > 1 and Path(words[0]).name.startswith("python") and words[1].endswith("cli.py")


def job_processes(cluster, folder: Path) -> list[int]:
    """The processes of a job of :class:`Job` (its script and its ranks name its folder)."""
    return [p for node in cluster.nodes for p in node.pids() if str(folder) in _cmdline(p)]


def catches_usr1(pid: int) -> bool:
    """Whether process ``pid`` has a handler for SIGUSR1 (its SigCgt mask in /proc)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    [mask] = [line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")]
    return bool(int(mask, 16) >> (signal.SIGUSR1 - 1) & 1)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def test_scancel_with_term_first_saves_the_state_and_leaves_no_rank(cluster, tmp_path):
    """As users cancel: ``scancel --signal=TERM`` (the tasks only: they save and exit 143), then ``scancel``."""
    job = Job(cluster, tmp_path / "cancelled")
    job.held()
    cluster.scancel(job.id, "TERM")
    sent = time.monotonic()
    deadline = sent + 60
    while rank_processes(cluster) and time.monotonic() < deadline:
        time.sleep(0.2)
    gone = time.monotonic() - sent
    cluster.client(["scancel", job.id], check=False)  # already over: nothing to cancel
    assert not rank_processes(cluster), job.text()[-4000:]
    assert gone < 30, gone  # the watchdog's time (15 s) and a save
    last = job.last()
    assert 3 <= last["global_step"] <= 5
    assert f"SIGTERM: stopped after step {last['global_step']}" in job.text()
    state = cluster.wait(job.id, states=("FAILED", "CANCELLED", "COMPLETED"), timeout=60)
    print(f"\nscancel --signal=TERM: every rank gone after {gone:.1f} s; job {state['JobState']}")


def test_a_plain_scancel_mid_epoch_saves_the_step_and_a_new_job_with_ckpt_path_last_ends_bitwise(
    cluster, unbroken, tmp_path
):
    """README's "``scancel`` saves and leaves no rank": a plain ``scancel`` (SIGTERM to every process of the job,
    SIGKILL ``KillWait`` later: 5 s here, SLURM's default is 30) while the ranks hold at step 3. The job ends
    CANCELLED, its last.ckpt holds the step, the run says so and how to go on in one line; ``sbatch ... --ckpt_path
    last`` then trains to the end, bitwise equal to the unbroken job."""
    folder = tmp_path / "scancel"
    job = Job(cluster, folder)
    job.held()
    cluster.scancel(job.id)
    info = cluster.wait(job.id, states=("CANCELLED",), timeout=120)
    assert info["Restarts"] == "0" and info["ExitCode"] == "0:15", info  # over, its batch shell ended by SIGTERM
    deadline = time.monotonic() + 30
    while rank_processes(cluster) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not rank_processes(cluster), job.text()[-4000:]
    [run] = (folder / "runs" / "lightning_logs").glob("version_*")
    step = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["global_step"]
    assert 3 <= step <= 5, step
    line = (
        f"SIGTERM: stopped after step {step} (epoch 0); saved {run}/checkpoints/last.ckpt. SLURM job {job.id} was "
        "cancelled: submit the script again with --ckpt_path last to continue. Exit code 143."
    )
    assert line in job.text(), job.text()[-4000:]
    again = Job(cluster, folder, hold=False, more=("--ckpt_path", "last"))
    done = again.finished()
    assert (done["JobState"], done["Restarts"]) == ("COMPLETED", "0"), again.text()[-4000:]
    assert f"--ckpt_path last: resuming from {run}/checkpoints/last.ckpt (step {step})" in again.text()
    [resumed] = [v for v in (folder / "runs" / "lightning_logs").glob("version_*") if v != run]
    final = torch.load(resumed / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    expected = unbroken()
    assert final["global_step"] == expected["global_step"] == STEPS
    different = [
        k for k in expected["state_dict"] if not torch.equal(final["state_dict"][k], expected["state_dict"][k])
    ]
    assert not different, f"{len(different)} tensors differ from the unbroken job's, e.g. {different[:3]}"
    print(f"\nscancel: job {job.id} {info['JobState']}, ExitCode {info['ExitCode']}; saved step {step}")


def test_scancel_full_with_term_ends_the_job_unrequeued_with_a_whole_checkpoint_or_none(cluster, tmp_path):
    """docs/multi-node.md's row "``scancel --signal=TERM --full``": SIGTERM to the batch shell, ``srun`` and the tasks;
    the shell's end ends the job, and ``srun`` has its step killed, so whether the ranks' save fits before the SIGKILL
    is a race (here: killed unsaved alone; saved in a CI run). Either way the job is over, not requeued, no rank is
    left, and ``last.ckpt`` is absent or whole at the held step (written to a temporary file, then renamed)."""
    job = Job(cluster, tmp_path / "full")
    job.held()
    cluster.scancel(job.id, "TERM", "--full")
    info = cluster.wait(job.id, states=("FAILED", "CANCELLED"), timeout=120)
    assert info["Restarts"] == "0", info
    deadline = time.monotonic() + 30
    while rank_processes(cluster) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not rank_processes(cluster), job.text()[-4000:]
    saved = list((job.folder / "runs").rglob("last.ckpt"))  # (a save cut by the SIGKILL leaves a hidden .tmp file)
    if saved:  # the ranks' stop and save beat the SIGKILL
        [last] = saved
        step = torch.load(last, map_location="cpu", weights_only=True)["global_step"]  # whole: it loads
        assert 3 <= step <= 5, step
        assert f"SIGTERM: stopped after step {step} (epoch 0); saved {last}." in job.text(), job.text()[-4000:]
    print(f"\nscancel --signal=TERM --full: job {info['JobState']}, ExitCode {info['ExitCode']}, saved: {saved}")


def test_a_requeued_job_whose_checkpoint_is_damaged_says_so_in_one_line(cluster, tmp_path):
    job = Job(cluster, tmp_path / "damaged")
    job.held()
    cluster.requeue(job.id)
    cluster.wait(job.id, states=("PENDING",), timeout=120, poll=0.5)
    last = job.run_folder() / "checkpoints" / "last.ckpt"
    last.write_bytes(last.read_bytes()[:1000])  # cut short, as a full disk leaves it
    job.release()
    info = cluster.wait(job.id, states=("FAILED", "COMPLETED"), timeout=180)
    assert info["JobState"] == "FAILED"
    second = job.text().split(f"SLURM requeues job {job.id}")[-1]
    errors = {line for line in second.splitlines() if line.startswith("error:")}  # the same line from each node
    assert len(errors) == 1 and f"error: {last}: truncated or damaged" in errors.pop(), second[-3000:]
    assert last.stat().st_size == 1000  # left as it was: nothing overwritten


def test_the_batch_script_with_more_tasks_per_node_than_devices_is_one_line(cluster, tmp_path):
    job = Job(cluster, tmp_path / "tasks", "--ntasks-per-node=2", hold=False, more=("--trainer.devices=1",))
    info = cluster.wait(job.id, states=("FAILED", "COMPLETED"), timeout=180)
    assert info["JobState"] == "FAILED"
    errors = sorted({line for line in job.text().splitlines() if line.startswith("error:")})
    assert errors == [
        "error: --trainer.devices=1, but SLURM starts 2 task(s) per node (#SBATCH --ntasks-per-node=2): one task per "
        "device, so make the two equal (or drop --trainer.devices)"
    ], job.text()[-3000:]
    assert not (tmp_path / "tasks" / "runs" / "lightning_logs").exists()


def test_num_nodes_that_disagrees_with_the_allocation_is_one_line(cluster, tmp_path):
    job = Job(cluster, tmp_path / "nodes", hold=False, more=("--trainer.num_nodes=3",))
    info = cluster.wait(job.id, states=("FAILED", "COMPLETED"), timeout=180)
    assert info["JobState"] == "FAILED"
    errors = sorted({line for line in job.text().splitlines() if line.startswith("error:")})
    assert errors == [
        f"error: --trainer.num_nodes=3, but SLURM job {job.id} has 2 node(s) (#SBATCH --nodes=2): make the two "
        "equal (or drop --trainer.num_nodes)"
    ], job.text()[-3000:]


def test_srun_without_sbatch_trains_and_says_a_stop_cannot_be_requeued(cluster, tmp_path):
    """``srun`` from a login node (no batch script): SLURM cannot requeue such a job; a stop says so and how to go
    on, in one line."""
    runs = tmp_path / "runs"
    spec = {"class_path": "tests.hold_at_step.HoldAtStep", "init_args": {"folder": str(tmp_path)}}
    command = ["srun", "--nodes=2", "--ntasks-per-node=1", "python", "cli.py", "fit", "--config", "tests/tiny.yaml"]
    command += [*RUN, f"--trainer.default_root_dir={runs}", "--trainer.callbacks+=" + json.dumps(spec)]
    process = subprocess.Popen(
        cluster.on(cluster.net.node("a"), command), cwd=ROOT, env=cluster.env(), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while not (tmp_path / "held").exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        job = cluster.client(["squeue", "-h", "-o", "%i", "-n", "python"]).stdout.split()
        assert job, "no srun job"
        cluster.client(["scancel", "--signal=USR1", job[0]])
        out, _ = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    assert (
        f"SLURM cannot requeue job {job[0]} (srun started it, not sbatch): continue with the same command plus "
        "--ckpt_path last" in out
    ), out[-4000:]
