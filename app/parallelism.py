"""What the template's loader and callbacks read from a strategy, beyond Lightning's ranks: :class:`Parallelism`.

Lightning's strategies say how many processes there are (``world_size``) and which one this is. The template's
strategies also differ in what one process drives and holds, and the loader and callbacks need to know:

- ``devices_per_process``: ``dp`` drives all its devices from one process, which loads their batches together;
- ``stages``: a ``pipeline`` cuts the network into stages, and every stage of a replica sees each of its samples;
- ``data_parallel_size``: into how many slices each global batch is dealt (the processes, or a pipeline's
  replicas: world size / stages);
- ``sharded``: no process holds the whole model and optimizer state (``fsdp`` once it has sharded the model, a
  ``pipeline`` once it has cut it): a lost rank's part is gone, and the ranks must agree on what each one sees.

A strategy states them by implementing the four as attributes or properties (``dp``, ``fsdp`` and ``pipeline`` do);
readers ask :func:`parallelism`, which answers for any other strategy (Lightning's ``ddp``, ``ddp_spawn``, one
device, the template's ``horovod``, a user's) as plain data parallelism: one device per process, no stages, the
data split over every process, nothing sharded. A new strategy that differs implements :class:`Parallelism`; a
field it does not declare keeps its default.

Four more, which the callbacks and the run report read, have defaults that suit Lightning's strategies; a strategy
that differs declares them the same way:

- ``label``: its name on the run report's lines (default: its registered ``strategy_name``, with the start method
  of a strategy that starts its own ranks: ``ddp_spawn``);
- ``starts_own_workers``: its ranks are not the processes a launcher started (``ddp_spawn``'s spawned ranks, ``dp``'s
  threads of one process), so they cannot run under torchrun or mpirun;
- ``refusals``: the template's features it cannot serve, each with one line that says what to do instead
  (``"sync_batchnorm"``, ``"comm_hook"``); by default a strategy that is not Lightning's ``DDPStrategy`` refuses
  ``"comm_hook"`` (a DDP communication hook needs DDP's wrapper).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from lightning.pytorch.strategies import DDPStrategy

from app.lightning_internals import spawned_ranks_launcher, start_method


class Parallelism(Protocol):
    """Each an attribute or a property of the strategy (readers look it up on the class first)."""

    devices_per_process: int
    stages: int
    data_parallel_size: int
    sharded: bool
    label: str
    starts_own_workers: bool
    refusals: Mapping[str, str]


FIELDS = ("devices_per_process", "stages", "data_parallel_size", "sharded")
DEFAULTED = ("label", "starts_own_workers", "refusals")
COMM_HOOK_ELSEWHERE = "use --trainer.strategy=ddp to compress what the processes exchange"


@dataclass(frozen=True)
class DataParallel:
    """What a strategy that declares nothing is read as: plain data parallelism."""

    data_parallel_size: int
    devices_per_process: int = 1
    stages: int = 1
    sharded: bool = False
    label: str = ""
    starts_own_workers: bool = False
    refusals: Mapping[str, str] = field(default_factory=dict)


class _Declared:
    """A strategy read through :class:`Parallelism`: each field the strategy's class declares is read from the
    strategy when asked (a property runs only then), any other from the defaults."""

    __slots__ = ("_defaults", "_strategy")

    def __init__(self, strategy: Any, defaults: DataParallel) -> None:
        self._strategy, self._defaults = strategy, defaults

    def __getattr__(self, name: str) -> Any:
        if name in FIELDS + DEFAULTED and hasattr(type(self._strategy), name):
            return getattr(self._strategy, name)
        return getattr(self._defaults, name)


def parallelism(strategy) -> Parallelism:
    """``strategy`` as :class:`Parallelism`: what its class declares (looked up on the class: no property is run to
    find out), the defaults of plain data parallelism for the rest."""
    name = getattr(type(strategy), "strategy_name", None) or type(strategy).__name__.removesuffix("Strategy").lower()
    spawned = spawned_ranks_launcher(strategy) is not None
    method = start_method(strategy)
    defaults = DataParallel(
        data_parallel_size=getattr(strategy, "world_size", 1),
        label=f"{name}_{method}" if spawned and method in SPAWN_START_METHODS else name,
        starts_own_workers=spawned,
        refusals={} if isinstance(strategy, DDPStrategy) else {"comm_hook": COMM_HOOK_ELSEWHERE},
    )
    return _Declared(strategy, defaults)


SPAWN_START_METHODS = ("spawn", "fork", "forkserver")  # Lightning's multiprocessing launcher: ddp_spawn, ddp_fork, ...


def configured_to_start_own_workers(strategy) -> bool:
    """Whether ``--trainer.strategy`` as given (a registered name, or a config with ``class_path`` and ``init_args``)
    names a strategy that starts its workers itself rather than running in the process a launcher started: Lightning's
    ``ddp_spawn``, ``ddp_fork`` and ``ddp_notebook`` (a ``start_method`` its multiprocessing launcher takes), or a
    class that says so with a ``starts_own_workers`` class attribute (``dp``, whose replicas are threads of its one
    process). Read before the strategy exists, from the registry's entry for a name."""
    from lightning.pytorch.strategies import StrategyRegistry

    from app.task import import_class

    if isinstance(strategy, str):
        if strategy not in StrategyRegistry:
            return False
        entry = StrategyRegistry[strategy]
        cls, init_args = entry["strategy"], entry["init_params"]
    else:
        class_path = getattr(strategy, "class_path", None)
        try:
            cls = import_class(class_path) if class_path else type(strategy)
        except (ImportError, AttributeError, ValueError):
            return False
        init_args = (getattr(strategy, "init_args", None) or {}) if class_path else {}
    if isinstance(cls, type) and getattr(cls, "starts_own_workers", False) is True:
        return True
    start_method = init_args.get("start_method") if hasattr(init_args, "get") else None  # a dict or a Namespace
    return start_method in SPAWN_START_METHODS
