"""The run folder of a job that is started again (a torchrun job with restarts, a SLURM batch job that SLURM may
requeue): every start of the job writes into one run's folder."""

from __future__ import annotations

from pathlib import Path

import torch
from lightning.pytorch import Callback
from typing_extensions import override

from app.callbacks.stop_plan import stop_plan
from app.checkpoints.run_folders import MARKER, mark_run, run_shape
from app.errors import UserError
from app.launch.launcher import SlurmJob, TorchrunJob
from app.launch.restarts import agent_of


class ElasticRunFolder(Callback):
    """The run folder of a torchrun job with ``--max-restarts`` > 0 or of a SLURM batch job; the CLI adds it (it is
    not one to leave out).

    Every rank decides, before the process group exists, whether its start continues an unfinished run of the job
    (:func:`app.checkpoints.run_folders.run_of`). Rank 0 marks a new run's folder only here, once the process group
    has formed, so no rank can find the mark of its own start and take it for an earlier one. The ranks then check
    that they decided alike: a root that the nodes do not share would otherwise have them issue different collectives.
    """

    def __init__(
        self, job: TorchrunJob | SlurmJob, claimed: list[Path], continued: dict[Path, int], ckpt_path: str | None
    ):
        self.job = job
        self.claimed = list(claimed)  # rank 0's new version folders (empty elsewhere and on a continued run)
        self.continued = dict(continued)  # logger root -> the version this start goes on writing
        self.ckpt_path = ckpt_path
        self.agents = [agent_of(job)]  # the torchrun agents of the job's ranks, gathered once the process group formed
        self._shape_recorded = False

    @override
    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage != "fit":
            return
        mine = {"continues": sorted((str(root), v) for root, v in self.continued.items()), "ckpt": self.ckpt_path}
        rank0 = trainer.strategy.broadcast(mine, src=0)
        if not trainer.strategy.reduce_boolean_decision(mine == rank0, all=True):
            what = ", ".join(f"{root}/version_{v}" for root, v in rank0["continues"]) or "nothing (a new run)"
            raise UserError(
                f"{'torchrun' if isinstance(self.job, TorchrunJob) else 'SLURM job'} start: the ranks disagree on the "
                f"run they continue (rank 0 continues {what}); the runs' "
                "folder (--trainer.default_root_dir) must be one that every node sees, on a shared filesystem"
            )
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            agents = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(agents, agent_of(self.job))
            self.agents = agents
        if trainer.is_global_zero:
            for folder in self.claimed:
                mark_run(folder, self.job, agents=self.agents)  # for the restarts to find
        if self.ckpt_path is None and self.continued:
            # A restart with no state to resume from (no survivor could save one) trains the run again from its
            # start: with the first start's global batch, not the one this world size gives by itself.
            root, version = next(iter(self.continued.items()))
            shape = run_shape(root / f"version_{version}")
            if shape:  # for the Elastic callback (app/callbacks/stop_plan.py)
                stop_plan(trainer).first_shape = shape

    @override
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if self.claimed and trainer.is_global_zero and not self._shape_recorded:
            self._shape_recorded = True  # once: the first start's shape, which the Elastic callback knows by now
            elastic = stop_plan(trainer).survivor_save
            shape = None if elastic is None else elastic.state_dict()
            for folder in self.claimed:
                mark_run(folder, self.job, agents=self.agents, shape=shape)

    @override
    def on_fit_end(self, trainer, pl_module) -> None:
        if not trainer.is_global_zero:
            return
        folders = self.claimed + [root / f"version_{v}" for root, v in self.continued.items()]
        for folder in folders:
            if (folder / MARKER).is_file():
                mark_run(folder, self.job, finished=True, agents=self.agents)  # a later job starts its own run
