"""Carry a run across a change of world size, and across a lost node when the launcher restarts the job.

:class:`Elastic` is on by default and does three jobs, each only where it applies, each in a module of its own:

- :mod:`~app.callbacks.elastic.world_size`: a resume at another world size (an elastic restart, or ``--ckpt_path``
  with other ``--trainer.devices`` or nodes) lines the batches up with the re-dealt epoch and keeps the global batch;
- :mod:`~app.callbacks.elastic.failure`: a failure under a restarting launcher (torchrun ``--max-restarts`` > 0, the
  horovod launcher's restarts): each survivor writes the state after the last completed step, and the restart
  resumes from it;
- :mod:`~app.callbacks.elastic.metrics`: the restarted run keeps one ``metrics.csv``.

On every resume it first hands the training loader the position the checkpoint saved, when the task built the loader
before the restore (:func:`app.lightning_internals.apply_loader_position`).

:class:`ElasticRunFolder` (:mod:`~app.callbacks.elastic.run_folder`) keeps a torchrun job's restarts in one run folder.
"""

from app.callbacks.elastic.callback import Elastic
from app.callbacks.elastic.run_folder import ElasticRunFolder

__all__ = ["Elastic", "ElasticRunFolder"]
