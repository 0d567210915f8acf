"""``ddp`` and ``ddp_spawn``: Lightning's DDPStrategy, minus the work that changes nothing trained.

Lightning wraps the model in ``DistributedDataParallel`` on any number of devices, one included. On one GPU that
was 0.865x single-device speed eager, and 2.7x slower than one device under ``torch.compile(mode="reduce-overhead")``
(issue 44: Dynamo splits a DDP model's graph at every gradient bucket, and the all-reduce hooks run between the
pieces). The template's ``ddp`` and ``ddp_spawn`` differ from Lightning's in three ways:

- **A world of one process is not wrapped.** With nothing to reduce, the model trains as on a single device: no
  buckets, no hooks, no buffer broadcast, one compiled graph. An all-reduce over one process returns its input, so
  the training is the same as wrapped: bitwise, dropout included (checked against Lightning's own class). Against
  ``--trainer.strategy=auto`` it is bitwise the same for a task without randomness (tests/test_strategies.py); with
  dropout the masks differ, as under any ddp, because Lightning re-seeds when the process group starts. That covers
  ``--trainer.strategy=ddp --trainer.devices=1`` and an elastic restart on one surviving process; a communication
  hook (``app.callbacks.DDPCommHook``, Lightning's ``ddp_comm_hook``) has nothing to compress there either.
- ``gradient_as_bucket_view=True``: the gradients are views of the buckets, so nothing is copied in or back.
  The values are the same; an optimizer still sees ``param.grad`` (what it must not do is ``grad.detach_()``).
  Buffers are still broadcast from rank 0 before each forward, so every rank validates with rank 0's BatchNorm
  statistics (which the checkpoint holds).
- On a GPU the model is wrapped on the current CUDA stream. Lightning wraps it on a new side stream (the recipe for
  capturing a whole DDP step in one CUDA graph by hand). Under ``torch.compile(mode="reduce-overhead")`` that made
  every backward run into AccumulateGrad nodes of another stream, which torch warns "may incur unnecessary
  synchronization and break CUDA graph capture"; torch's own advice is to build DDP on the stream of the forwards
  (on an H200 at e35ee52 the warning went and the device time per step fell from 8.04 to 7.02 ms).

``static_graph`` stays off: a task whose steps use different parameters (a fork's branch, a frozen layer) would
fail with it. Lightning's own class stays available
(``--trainer.strategy.class_path=lightning.pytorch.strategies.DDPStrategy``).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

from lightning.pytorch.strategies import DDPStrategy as LightningDDPStrategy
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from app.launch import formation


class DDPStrategy(LightningDDPStrategy):
    """Lightning's DDPStrategy with ``gradient_as_bucket_view=True``, and no wrapper in a world of one process."""

    def __init__(self, *args: Any, gradient_as_bucket_view: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, gradient_as_bucket_view=gradient_as_bucket_view, **kwargs)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Take over ``ddp`` and ``ddp_spawn`` from Lightning's class, keeping its launch method for each (Lightning's
        own other ``ddp_*`` names stay its own)."""
        for name, start_method in (("ddp", "popen"), ("ddp_spawn", "spawn")):
            lightnings = dict.get(strategy_registry, name, {})  # the entry: the registry's own .get() builds one
            if lightnings.get("strategy") is not cls:
                base = lightnings.get("description", f"DDP strategy with `start_method` '{start_method}'")
                description = f"{base}; gradients as bucket views, no DDP wrapper in a world of one"
                strategy_registry.register(name, cls, description, override=True, start_method=start_method)

    @override
    def setup_environment(self) -> None:
        # A rank's first hook: ddp_spawn's ranks never run cli.py's main, so they install the template's exit hook
        # and filters here (once per process: a no-op where main or trainer_defaults already did).
        from app.launch.startup import install

        install()
        with formation_watched(self):
            super().setup_environment()

    @override
    def configure_ddp(self) -> None:
        if self.world_size == 1:  # nothing to reduce: the LightningModule trains as on one device
            return
        super().configure_ddp()

    @override
    def _setup_model(self, model: Module) -> DistributedDataParallel:
        """DDP on the current stream (Lightning's wraps it on a side stream on GPUs)."""
        return DistributedDataParallel(module=model, device_ids=self.determine_ddp_device_ids(), **self._ddp_kwargs)


def watchdog_timeout(strategy: LightningDDPStrategy) -> float:
    """The rank watchdog's timeout (``--watchdog.timeout``), where the trainer has one: a rank is lost after as long
    a silence while its group forms as after; :data:`~app.launch.formation.LOST_AFTER` without one. (The watchdog is
    found by its role in the trainer's stop plan, app/callbacks/stop_plan.py: callbacks are a layer above.)"""
    try:
        callbacks = strategy.lightning_module.trainer.callbacks
    except (AttributeError, RuntimeError):  # no module, or one not attached to a trainer (a strategy used alone)
        return formation.LOST_AFTER
    timeouts = [c.timeout for c in callbacks if getattr(type(c), "stop_role", None) == "watchdog"]
    return timeouts[0] if timeouts else formation.LOST_AFTER


@contextmanager
def formation_watched(strategy: LightningDDPStrategy):
    """While ``strategy`` forms its process group: a rank that failed or was killed before it arrived stops this one
    in seconds (app/launch/formation.py), instead of torch's 30-minute wait."""
    import torch.distributed as dist

    from app.launch.library_noise import store_warnings_off

    world_size = strategy.num_nodes * len(strategy.parallel_devices or [])
    if world_size <= 1:
        yield
        return
    environment = strategy.cluster_environment
    rank = environment.node_rank() * len(strategy.parallel_devices) + environment.local_rank()  # (before ranks are set)
    hosts_store = rank == 0 and formation.rank_zero_hosts_store()
    watch = formation.FormationWatch(
        environment.main_address,
        environment.main_port,
        world_size=world_size,
        hosts_store=hosts_store,
        say=environment.local_rank() == 0,
        rank=rank,
        lost_after=watchdog_timeout(strategy),
    )
    watch.start()
    try:
        # torch prints 16 lines of C++ frames as a warning when the store closes under a waiting rank: said in one
        # line below (errors still show)
        with store_warnings_off():
            yield
        formation.formed()
    except dist.DistNetworkError as err:
        stalled = watch.stalled_lately()  # this process was stopped (SIGSTOP, a frozen machine) that long
        if watch.mark_seen.is_set():  # a failed rank 0 closed the store it held for its mark: the watch says so
            watch.join(formation.HOLD + 5)  # and ends this process
        if hosts_store or formation.client(environment.main_address, environment.main_port, timeout=2) is not None:
            raise  # not a store that closed: another network error, torch's own words
        stalled = stalled if stalled > max(watch.lost_after, 5.0) else 0.0  # it was this rank that fell silent
        line = formation.store_lost_line(environment.main_address, environment.main_port, err, stalled)
        formation.stop_process(line if watch.say else None)
    finally:  # ended here, not left in torch's C++ to meet the interpreter's shutdown (as the rank watchdog's thread
        watch.stop()  # once did: SIGABRT at exit, docs/testing.md)
        watch.join(timeout=5)
