"""Lightning callbacks of the template; each can be added with ``--trainer.callbacks+=app.callbacks.NAME``."""

from app.callbacks.activation_checkpointing import ActivationCheckpointing
from app.callbacks.checkpoint import ModelCheckpoint
from app.callbacks.ddp_comm_hook import DDPCommHook
from app.callbacks.divergence import StopOnNonFinite
from app.callbacks.elastic import Elastic
from app.callbacks.lr_monitor import LearningRateMonitor
from app.callbacks.model_summary import RichModelSummary
from app.callbacks.prediction_writer import PredictionWriter
from app.callbacks.preemption import Preemption
from app.callbacks.progress import ProgressBar
from app.callbacks.random_state import RandomState
from app.callbacks.rank_watchdog import RankWatchdog
from app.callbacks.resume_settings import ResumeSettings
from app.callbacks.run_report import RunReport
from app.callbacks.sync_batchnorm import AllReduceBatchNorm, SyncBatchNorm
from app.callbacks.tracker_runs import TrackerRuns
from app.callbacks.warmup import LRWarmup
from app.errors import Diverged, Preempted

__all__ = [
    "ActivationCheckpointing",
    "AllReduceBatchNorm",
    "DDPCommHook",
    "Diverged",
    "Elastic",
    "LRWarmup",
    "LearningRateMonitor",
    "ModelCheckpoint",
    "Preempted",
    "Preemption",
    "PredictionWriter",
    "ProgressBar",
    "RandomState",
    "ResumeSettings",
    "RankWatchdog",
    "RichModelSummary",
    "RunReport",
    "StopOnNonFinite",
    "SyncBatchNorm",
    "TrackerRuns",
]
