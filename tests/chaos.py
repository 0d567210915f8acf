"""Chaos: a short training job under a restarting launcher, hit by a seeded random schedule of faults, checked
against what an unbroken run trains.

    python -m tests.chaos --launcher torchrun --seed 3 --faults 4
    python -m tests.chaos --launcher horovod --seed 3 --faults 3 --epochs 3

``torchrun``: two torchrun agents on this host are two nodes (one process each, c10d rendezvous, ``--max-restarts``).
Faults: a node lost in training, inside a gradient-accumulation window, in validation, during a checkpoint save;
a node that joins; SIGTERM to every agent (the same commands then started again, as a scheduler would).
``horovod``: the strategy's own mpirun launch with ``max_restarts``, three ranks. Faults: a rank lost in training,
inside a window, in validation, during a save; SIGTERM to the launcher (the same command then run again with
``--ckpt_path last``, on all three ranks).
``ddp``: Lightning's own launcher, two ranks, which restarts nothing. Its one fault is SIGTERM to the process the user
started, then the same command with ``--ckpt_path last``. Its ranks are forked from a warm interpreter (tests/warm.py):
no launcher of ours is on trial, so it is the cheap job for checks of the check (``--perturb``).

Each fault acts at a named point after a given optimizer step, once (a file marks it done, across restarts). The
finished run must be what an unbroken one is: the same weights (float64, GroupNorm: equal up to the rounding of sums
taken in another order, whatever world sizes the faults went through) and the same loss at every optimizer step as
an unbroken run of the job; every sample of every epoch trained exactly once (by the starts that completed each
step, read from the samples each rank recorded), the configured global batch at every step, the same number of
optimizer steps and of validation rows, one ``metrics.csv`` row per step and metric, the best checkpoint by its
metric, exit 0. ``--perturb`` breaks every restore on purpose (weights moved by 0.05, optimizer state dropped:
tests.faults.PerturbRestore), which the check must catch. The script prints the schedule and the figures
docs/elastic.md quotes: faults survived, steps done again, how far from the unbroken run's weights and losses, seconds
lost per fault (against an unbroken run of the same job, with ``--baseline``).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tests.record_samples import read_records, step_losses

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = 48  # the training set
DEVICE_BATCH = 2
ACCUMULATE = 2  # as configured, at the configured number of devices
TOLERANCE = 1e-9  # float64: what sums in another order (another world size) leave; a real change is far above it
MPI_ENV = {
    "OMPI_ALLOW_RUN_AS_ROOT": "1",
    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    "OMPI_MCA_rmaps_base_oversubscribe": "1",
}
KINDS = {  # kind: (point, action); the chaos harness does the rest of "join" and "stop_*" when it sees the marker
    "lose_node": ("step", "kill_node"),
    "lose_node_mid_window": ("window", "kill_node"),
    "lose_node_in_validation": ("validation", "kill_node"),
    "lose_node_in_save": ("save", "kill_node"),
    "join": ("step", "wait_for_harness"),
    "stop_all": ("step", "wait_for_harness"),
    "lose_rank": ("step", "kill"),
    "lose_rank_mid_window": ("window", "kill"),
    "lose_rank_in_validation": ("validation", "kill"),
    "lose_rank_in_save": ("save", "kill"),
    "stop_launcher": ("step", "wait_for_harness"),
}


@dataclass
class Fault:
    kind: str
    step: int
    world: int  # the world size when it strikes
    rank: int = -1
    marker: str = ""

    def callback(self) -> dict:
        point, action = KINDS[self.kind]
        args = {"at": point, "step": self.step, "action": action, "start": -1, "once": self.marker}
        if action == "kill_node":
            args["node"] = True
        elif self.rank >= 0:
            args["rank"] = self.rank
        if point == "validation":
            args["batch"] = 1
        return {"class_path": "tests.faults.Fault", "init_args": args}


@dataclass
class Job:
    launcher: str
    seed: int
    faults: int
    epochs: int
    folder: Path
    kinds: tuple[str, ...] = tuple(KINDS)  # the kinds of fault the schedule draws from
    perturb: bool = False  # break every restore (tests.faults.PerturbRestore): the check must fail
    devices: int = field(init=False)
    schedule: list[Fault] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.devices = 3 if self.launcher == "horovod" else 2
        self.schedule = make_schedule(self)

    @property
    def global_batch(self) -> int:
        return self.devices * DEVICE_BATCH * ACCUMULATE

    @property
    def steps_per_epoch(self) -> int:
        return SAMPLES // self.global_batch

    @property
    def steps(self) -> int:
        return self.steps_per_epoch * self.epochs

    def task_args(self, folder: Path, accumulate: int = ACCUMULATE) -> list[str]:
        """The job's training, whatever launches it: its records and runs go into ``folder``."""
        record = {"class_path": "tests.record_samples.RecordSamples", "init_args": {"folder": str(folder / "rec")}}
        return [
            *(str(ROOT / "cli.py"), "fit", "--config", str(ROOT / "tests" / "tiny.yaml")),
            # float64 and GroupNorm: a step at any world size computes what one device computes, up to rounding
            *("--trainer.precision=64-true", "--model.norm=group", f"--data.train_size={SAMPLES}"),
            *(f"--data.batch_size={DEVICE_BATCH}", f"--trainer.accumulate_grad_batches={accumulate}"),
            *(
                "--trainer.limit_train_batches=null",
                "--trainer.limit_val_batches=4",
                f"--trainer.max_epochs={self.epochs}",
            ),
            *(f"--trainer.default_root_dir={folder / 'runs'}", "--watchdog.timeout=20"),
            "--trainer.callbacks+=" + json.dumps(record),
        ]

    def reference(self, timeout: float) -> Path:
        """The unbroken run of the job: one process, the same global batch (more accumulation); its folder. No
        launcher is involved: the run is forked from a warm interpreter (tests/warm.py)."""
        from tests import warm

        folder = self.folder / "unbroken"
        folder.mkdir(exist_ok=True)
        args = self.task_args(folder, accumulate=ACCUMULATE * self.devices)
        with (folder / "run.log").open("w") as log:
            run = warm.popen([sys.executable, *args], cwd=folder, env=environ(), stdout=log, stderr=log)
            try:
                code = run.wait(timeout)
            finally:
                run.kill()
        assert code == 0, (folder / "run.log").read_text()[-3000:]
        return folder

    def args(self, *more: str) -> list[str]:
        args = [
            *self.task_args(self.folder),
            *("--trainer.callbacks+=" + json.dumps(f.callback()) for f in self.schedule),
        ]
        if self.perturb:
            args.append("--trainer.callbacks+=tests.faults.PerturbRestore")
        if self.launcher == "horovod":
            losses = sum(f.kind.startswith("lose") for f in self.schedule)
            args += ["--trainer.strategy=horovod", f"--trainer.devices={self.devices}"]
            args += [f"--trainer.strategy.max_restarts={max(losses, 1)}"]
        elif self.launcher == "ddp":
            args += ["--trainer.strategy=ddp", f"--trainer.devices={self.devices}"]
        else:  # torchrun starts one process per node
            args += ["--trainer.strategy=ddp"]
        return [*args, *more]


def make_schedule(job: Job) -> list[Fault]:
    """``job.faults`` faults at increasing steps, each one that the world size at its time allows."""
    rng = random.Random(job.seed)
    world, step, faults = job.devices, 1 + rng.randrange(2), []
    per_epoch = SAMPLES // (job.devices * DEVICE_BATCH * ACCUMULATE)
    last = per_epoch * job.epochs
    for index in range(job.faults):
        if job.launcher == "torchrun":
            kinds = ["stop_all"] + (["join"] if world == 1 else [k for k in KINDS if k.startswith("lose_node")])
        elif job.launcher == "ddp":  # Lightning's launcher restarts no rank it lost
            kinds = ["stop_launcher"]
        else:
            kinds = ["stop_launcher"] + ([k for k in KINDS if k.startswith("lose_rank")] if world > 1 else [])
        kinds = [k for k in kinds if k in job.kinds]
        if not kinds:
            break
        kind = rng.choice(kinds)
        at = step
        if kind.endswith(("in_validation", "in_save")):
            at = -(-max(step, 1) // per_epoch) * per_epoch  # the next epoch end
        if at > last - (0 if kind.endswith(("in_validation", "in_save")) else 1):
            break
        fault = Fault(kind, at, world, marker=str(job.folder / f"fault-{index}-{kind}"))
        if kind.startswith("lose_rank"):
            fault.rank = rng.randrange(world)
        elif kind == "stop_launcher":
            fault.rank = 0
        faults.append(fault)
        if kind.startswith("lose"):
            world -= 1
        elif kind == "join":
            world += 1
        elif kind == "stop_launcher":
            world = job.devices  # run again on all devices
        step = at + rng.randint(2, 3)
    return faults


# ------------------------------------------------------------------------------------------------ running the job
def environ(**more: str) -> dict:
    return {**os.environ, **MPI_ENV, "PYTHONPATH": str(ROOT), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", **more}


class Torchrun:
    """Agents of one job on this host: agent 0 hosts the rendezvous; the others are the nodes faults lose."""

    def __init__(self, job: Job) -> None:
        self.job, self.agents, self.count = job, [], 0
        from lightning.fabric.plugins.environments.lightning import find_free_network_port

        self.port = find_free_network_port()

    def start(self, host: bool, delay: float = 0) -> subprocess.Popen:
        name = f"agent{self.count}"
        self.count += 1
        command = [
            *(sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc_per_node=1", "--max-restarts=9"),
            *("--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{self.port}", "--rdzv-id=chaos"),
            f"--rdzv-conf=is_host={str(host).lower()},last_call_timeout=3",
            *("--no-python", "sh", "-c", f'sleep {delay}; exec "$@"', "worker", sys.executable, *self.job.args()),
        ]
        log = open(self.job.folder / f"{name}.log", "w")  # noqa: SIM115 (kept open for the agent's life)
        process = subprocess.Popen(
            command, cwd=self.job.folder, env=environ(LOSE_THIS_NODE="0" if host else "1"), stdout=log, stderr=log
        )
        process.name = name
        self.agents.append(process)
        return process

    def run(self, timeout: float) -> int:
        host = self.start(host=True)
        self.start(host=False, delay=3)
        handled: set[str] = set()
        stopping: Fault | None = None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            time.sleep(0.3)
            for fault in self.job.schedule:
                if fault.marker in handled or not Path(fault.marker).exists():
                    continue
                handled.add(fault.marker)
                if fault.kind == "join":
                    self.start(host=False)
                elif fault.kind == "stop_all":  # a scheduler stops the whole job: SIGTERM to every agent
                    stopping = fault
                    for agent in self.agents:
                        if agent.poll() is None:
                            agent.send_signal(signal.SIGTERM)
            if stopping is not None and all(agent.poll() is not None for agent in self.agents):
                host = self.start(host=True)  # and starts the same job again
                if stopping.world == 2:
                    self.start(host=False, delay=3)
                stopping = None
            if stopping is None and host.poll() is not None:
                for agent in self.agents:
                    if agent.poll() is None:
                        agent.wait(timeout=60)
                return host.returncode
        raise TimeoutError(f"the job did not finish in {timeout} s")

    def kill(self) -> None:
        for agent in self.agents:
            if agent.poll() is None:
                agent.kill()


class SelfLaunched:
    """A run that starts its own ranks (the horovod strategy's mpirun launch, Lightning's ddp launcher), run again
    with ``--ckpt_path last`` after a SIGTERM to it."""

    def __init__(self, job: Job) -> None:
        self.job, self.process, self.runs = job, None, 0

    def start(self, *more: str) -> subprocess.Popen:
        from tests import warm

        log = open(self.job.folder / f"launch{self.runs}.log", "w")  # noqa: SIM115
        self.runs += 1
        popen = warm.popen if self.job.launcher == "ddp" else subprocess.Popen
        self.process = popen(
            [sys.executable, *self.job.args(*more)], cwd=self.job.folder, env=environ(), stdout=log, stderr=log
        )
        return self.process

    def run(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        self.start()
        handled: set[str] = set()
        while time.monotonic() < deadline:
            time.sleep(0.3)
            for fault in self.job.schedule:
                if fault.kind == "stop_launcher" and fault.marker not in handled and Path(fault.marker).exists():
                    handled.add(fault.marker)
                    self.process.send_signal(signal.SIGTERM)  # a scheduler stops the job
            code = self.process.poll()
            if code == 128 + signal.SIGTERM:
                self.start("--ckpt_path=last")  # and runs the same command again, from where it stopped
            elif code is not None:
                return code
        raise TimeoutError(f"the job did not finish in {timeout} s")

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()


# ------------------------------------------------------------------------------------------------ checking the run
def committed(records: list[dict]) -> dict[int, list[dict]]:
    """For each optimizer step, the batches of the start that completed it: the latest start that trained it (an
    earlier start that began the step and failed had its batches done again)."""
    by_step: dict[int, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for record in records:
        by_step[record["step"]][record["start"]].append(record)
    return {
        step: max(starts.values(), key=lambda batch: min(r["time"] for r in batch)) for step, starts in by_step.items()
    }


def metrics_rows(runs: Path, folders: list[Path] | None = None) -> list[dict]:
    """metrics.csv of the run folders in order (a resume with --ckpt_path last logs into a new one)."""
    rows = []
    if folders is None:
        folders = sorted((runs / "lightning_logs").glob("version_*"), key=lambda p: int(p.name.split("_")[1]))
    for folder in folders:
        if (folder / "metrics.csv").is_file():
            with (folder / "metrics.csv").open(newline="") as f:
                rows += list(csv.DictReader(f))
    return rows


def last_checkpoint(runs: Path) -> dict:
    folders = sorted((runs / "lightning_logs").glob("version_*"), key=lambda p: int(p.name.split("_")[1]))
    return torch.load(folders[-1] / "checkpoints" / "last.ckpt", weights_only=True, map_location="cpu")


def check_trained(job: Job, unbroken: Path) -> dict:
    """Assert that the run trained what the unbroken run (:meth:`Job.reference`) trained: the same loss at every
    optimizer step and the same final weights, within :data:`TOLERANCE`; returns the largest differences."""
    expected, got = step_losses(unbroken / "rec"), step_losses(job.folder / "rec")
    assert sorted(got) == sorted(expected) == list(range(job.steps)), (sorted(got), sorted(expected))
    loss = max(abs(got[step] - expected[step]) for step in expected)
    worst = max(expected, key=lambda step: abs(got[step] - expected[step]))
    assert loss <= TOLERANCE, f"step {worst}: loss {got[worst]!r}, unbroken {expected[worst]!r}"
    mine, theirs = last_checkpoint(job.folder / "runs")["state_dict"], last_checkpoint(unbroken / "runs")["state_dict"]
    assert mine.keys() == theirs.keys()
    weights = {name: (mine[name].double() - theirs[name].double()).abs().max().item() for name in theirs}
    name = max(weights, key=weights.get)
    assert weights[name] <= TOLERANCE, f"{name}: {weights[name]:.3g} away from the unbroken run's ({len(weights)})"
    return {"loss_diff": loss, "weight_diff": weights[name]}


def check(job: Job) -> dict:
    """Assert that the finished run is what an unbroken run of the job trains; returns the figures."""
    runs = job.folder / "runs" / "lightning_logs"
    folders = sorted(runs.glob("version_*"), key=lambda p: int(p.name.split("_")[1]))
    last = last_checkpoint(job.folder / "runs")
    assert last["global_step"] == job.steps, f"ended at step {last['global_step']}, an unbroken run at {job.steps}"

    records = read_records(job.folder / "rec")
    done = committed(records)
    assert sorted(done) == list(range(job.steps)), f"steps trained: {sorted(done)}"
    per_epoch: dict[int, list[int]] = defaultdict(list)
    for step, batches in done.items():
        samples = sum(len(r["ids"]) for r in batches)
        assert samples == job.global_batch, f"step {step}: {samples} samples, the global batch is {job.global_batch}"
        for record in batches:
            per_epoch[record["epoch"]] += record["ids"]
    for epoch in range(job.epochs):
        ids = per_epoch[epoch]
        assert sorted(ids) == list(range(SAMPLES)), f"epoch {epoch}: {len(ids)} samples, {len(set(ids))} distinct"

    rows = metrics_rows(job.folder / "runs")
    logged = [(int(r["step"]), k) for r in rows for k, v in r.items() if v and k not in ("step", "epoch")]
    twice = sorted({x for x in logged if logged.count(x) > 1})
    assert not twice, f"logged twice: {twice[:5]}"
    assert sorted(int(r["step"]) for r in rows if r.get("train/loss")) == list(range(job.steps)), "a step's row"
    validated = [int(r["epoch"]) for r in rows if r.get("val/acc")]
    assert validated == list(range(job.epochs)), f"validation rows of epochs {validated}"
    # The best checkpoint by val/acc: of the run folder (a resume with --ckpt_path last starts a folder, whose
    # ModelCheckpoint tracks its own epochs: Lightning does not carry the best across a change of folder).
    [state] = [v for k, v in last["callbacks"].items() if k.startswith("ModelCheckpoint")]
    best = max(float(r["val/acc"]) for r in metrics_rows(job.folder / "runs", folders[-1:]) if r.get("val/acc"))
    assert abs(float(state["best_model_score"]) - best) < 1e-6, (state["best_model_score"], best)
    assert Path(state["best_model_path"]).is_file(), state["best_model_path"]
    for folder in folders:  # one last.ckpt per run folder (not a stale one beside a last-v1.ckpt), and the top 1
        assert sorted(p.name for p in (folder / "checkpoints").glob("last*.ckpt")) == ["last.ckpt"], folder
        epochs = sorted(p.name for p in (folder / "checkpoints").glob("epoch=*.ckpt"))
        assert len(epochs) <= 1, f"{folder}: {epochs} (the tests' task keeps its best epoch only)"

    starts = {r["start"] for r in records}
    redone = sum(len({r["start"] for r in records if r["step"] == step}) - 1 for step in done)
    return {
        "faults": len([f for f in job.schedule if Path(f.marker).exists()]),
        "starts": len(starts),
        "redone": redone,
    }


def run(job: Job, timeout: float) -> tuple[int, float]:
    launcher = Torchrun(job) if job.launcher == "torchrun" else SelfLaunched(job)
    started = time.monotonic()
    try:
        code = launcher.run(timeout)
    finally:
        launcher.kill()
    return code, time.monotonic() - started


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--launcher", choices=["torchrun", "horovod", "ddp"], default="torchrun")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--faults", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--kinds", nargs="+", choices=list(KINDS), default=list(KINDS), help="the faults to draw from")
    parser.add_argument("--baseline", action="store_true", help="also time the job without faults")
    parser.add_argument("--keep", type=Path, help="a folder for the runs and logs (default: a temporary one)")
    parser.add_argument("--perturb", action="store_true", help="break every restore: the check must fail")
    args = parser.parse_args(argv)
    folder = args.keep or Path(tempfile.mkdtemp(prefix="chaos-"))
    folder.mkdir(parents=True, exist_ok=True)
    job = Job(args.launcher, args.seed, args.faults, args.epochs, folder, tuple(args.kinds), perturb=args.perturb)
    print(f"{args.launcher}, seed {args.seed}: {job.steps} steps, global batch {job.global_batch}; faults:")
    for fault in job.schedule:
        rank = f" rank {fault.rank}" if fault.rank >= 0 else ""
        print(f"  step {fault.step:3d}  world {fault.world}  {fault.kind}{rank}")
    code, seconds = run(job, args.timeout)
    assert code == 0, f"exit {code}; logs in {folder}"
    figures = check(job) | check_trained(job, job.reference(args.timeout))
    line = (
        f"ok: {figures['faults']} faults survived, {figures['starts']} starts, {figures['redone']} step(s) done again"
    )
    line += f"; weights within {figures['weight_diff']:.1e} and losses within {figures['loss_diff']:.1e} of unbroken"
    line += f", {seconds:.1f} s"
    if args.baseline:
        calm = Job(args.launcher, args.seed, 0, args.epochs, folder / "baseline")
        calm.folder.mkdir(exist_ok=True)
        calm_code, calm_seconds = run(calm, args.timeout)
        assert calm_code == 0
        lost = (seconds - calm_seconds) / max(figures["faults"], 1)
        line += f" (unbroken: {calm_seconds:.1f} s; {lost:.1f} s lost per fault)"
    print(line)


if __name__ == "__main__":
    main()
