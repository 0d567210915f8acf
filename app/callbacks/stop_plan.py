"""Who does what when a run stops early or loses a rank: the written handshake of the save/restart path's callbacks.

Three callbacks act then, and each needs to know what the others do:

- the rank watchdog (:class:`~app.callbacks.RankWatchdog`, role ``watchdog``) names a lost rank and ends the process.
  Under a restarting launcher it first shuts the lost rank's connections down and waits for the survivor's save;
- the survivor's save (:class:`~app.callbacks.Elastic`, role ``survivor_save``) writes the state of the last step when
  a rank is lost, and tells the watchdog when that is over (``expect_save``, ``save_over``). It also keeps the run's
  shape, which the torchrun run folder (:class:`~app.callbacks.elastic.ElasticRunFolder`) hands over as
  ``first_shape`` and records;
- preemption (:class:`~app.callbacks.Preemption`, role ``preemption``) stops every rank on a signal, with a
  checkpoint. A signal it got first changes what the watchdog's verdict says (``received``).

The launchers that restart a job read what the survivors saved from files, not from these objects: torchrun's restart
reads ``last.ckpt`` in the run folder, and the horovod launcher reads the survivors' reports
(:mod:`app.checkpoints.saved_state`).

Each callback joins its trainer's :class:`StopPlan` in its ``setup`` hook, and the others read the plan. The plan is
kept on the trainer, so it lives as long as the trainer does. A pickled trainer (``ddp_spawn``, the horovod
self-launch) carries an empty plan, and the callbacks join it again in each rank. Joining also checks :data:`ORDER`,
the order in which Lightning must call the callbacks' hooks. An order that broke it once went unnoticed: the survivor
saved nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from app.errors import UserError


class Watchdog(Protocol):
    """The rank watchdog's side of the handshake."""

    verdict: str | None  # a cut-off node's verdict, said by the survivor's save in its own line
    cut_off: Any  # not None when this node lost the network (its torchrun agent)
    closed: bool  # the verdict shut the lost rank's connections down: the collective's failure is its doing

    def expect_save(self) -> None: ...

    def save_over(self, reported: bool) -> None: ...


class SurvivorSave(Protocol):
    """The survivor's save (the Elastic callback), as the run folder sees it: the run's shape."""

    def state_dict(self) -> dict: ...


class StopSignal(Protocol):
    """Preemption, as the watchdog sees it: the stop signal received first (0 for none)."""

    received: int


# (earlier, later, why): the first role's callback must come before the second's in the trainer's callbacks.
ORDER = (
    (
        "survivor_save",
        "preemption",
        "its record of each step's state must be taken before Preemption's stop-flag all-reduce, in the same hook, "
        "can fail on a lost rank; else the survivor saves nothing",
    ),
)


@dataclass(eq=False)
class StopPlan:
    """One trainer's callbacks on the save/restart path, by role, and what they hand each other."""

    watchdog: Watchdog | None = None
    survivor_save: SurvivorSave | None = None
    preemption: StopSignal | None = None
    first_shape: dict | None = None  # the run's first shape, for a torchrun restart with no state to resume from
    before_exit: list[Callable[[], object]] = field(default_factory=list)  # run before the watchdog ends the process

    def __reduce__(self):
        # A trainer pickled into new ranks: the callbacks join again there, and the cleanups stay in this process.
        return (StopPlan, ())

    def join(self, trainer, callback) -> None:
        """``callback`` takes its role (its class's ``stop_role``) in this plan; see :func:`check_order`."""
        role = callback.stop_role
        present = getattr(self, role)
        if present is not None and present is not callback:
            raise UserError(
                f"two {type(callback).__name__} callbacks in one trainer ({type(present).__name__} already): keep one"
            )
        setattr(self, role, callback)
        check_order(trainer.callbacks)


_ATTRIBUTE = "_app_stop_plan"


def stop_plan(trainer) -> StopPlan:
    """The trainer's plan, made on first use."""
    plan = vars(trainer).get(_ATTRIBUTE)
    if plan is None:
        plan = vars(trainer)[_ATTRIBUTE] = StopPlan()
    return plan


def role_of(callback) -> str | None:
    return getattr(type(callback), "stop_role", None)


def check_order(callbacks: list) -> None:
    """One line naming two callbacks that break :data:`ORDER`, and the fix."""
    position = {}
    for index, callback in enumerate(callbacks):
        position.setdefault(role_of(callback), (index, callback))
    for earlier, later, why in ORDER:
        if earlier in position and later in position and position[earlier][0] > position[later][0]:
            first, then = type(position[earlier][1]).__name__, type(position[later][1]).__name__
            raise UserError(
                f"callbacks out of order: {first} comes after {then}, but must come before it ({why}); "
                f"put {first} before {then} in the callbacks list"
            )


def in_order(defaults: list, own: list) -> list:
    """The default callbacks, then a run's own, with a default moved after the run's own where :data:`ORDER` asks
    (a run's own Elastic, ``--trainer.callbacks+=app.callbacks.Elastic``, comes before the default Preemption)."""
    own_roles = {role_of(c) for c in own}
    later = {then for earlier, then, _ in ORDER if earlier in own_roles}
    moved = [c for c in defaults if role_of(c) in later]
    return [c for c in defaults if c not in moved] + list(own) + moved
