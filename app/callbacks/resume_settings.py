"""Resume settings: the optimizer and LR-scheduler settings a resumed ``fit`` was given are the ones that train.

A resumed fit builds its optimizer from the task's ``configure_optimizers`` with the settings of this run (a new
``--model.lr``, ``--model.optimizer.lr``, ``--model.lr_scheduler.init_args.T_max``, ...), and then Lightning loads the
checkpoint's optimizer and scheduler state over it, which holds the old run's settings: the run announced
``--model.lr=0.5`` and trained at the old 0.05. Putting every built value over the restored one would be as wrong the
other way: a schedule moves the lr during training (0.1 -> 0.0989), and a resume given the same settings must go on
from the moved value.

So each run records what its optimizers and schedulers were built with (their hyperparameters before any training
step), in every checkpoint. A resume compares what it built with what the checkpoint's run built: only the values
that differ, which are the settings this run changed, go over the restored state, whichever task, flag or
``configure_optimizers`` produced them. A changed lr keeps the factor a schedule had applied to the old one (the
restored lr times new/old; exactly the new lr when nothing had moved it), and becomes the schedulers' base lr. Each
change applied is named in one line. An optimizer of another class, or with other parameter groups, cannot take the
restored state: that is one error naming both.
"""

from __future__ import annotations

import math
from typing import Any

from lightning.pytorch import Callback
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from app.errors import UserError

_PLAIN = (bool, int, float, str, type(None))


def _plain(value: Any) -> bool:
    if isinstance(value, _PLAIN):
        return True
    if isinstance(value, list | tuple):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, _PLAIN) and _plain(v) for k, v in value.items())
    return False


def _settings(values: dict) -> dict:
    """The plain values of a param group or a scheduler's state (no parameters, tensors or callables)."""
    return {k: v for k, v in values.items() if k != "params" and _plain(v)}


def built_settings(trainer) -> dict:
    """What this run's optimizers and schedulers were built with, as plain data."""
    return {
        "optimizers": [
            {"class": type(o).__qualname__, "groups": [_settings(group) for group in o.param_groups]}
            for o in trainer.optimizers
        ],
        "schedulers": [
            {"class": type(c.scheduler).__qualname__, "state": _settings(c.scheduler.state_dict())}
            for c in trainer.lr_scheduler_configs
        ],
    }


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    return a == b


def _scaled_lr(restored: float, old: float, new: float) -> float:
    """A new base lr over a restored lr that a schedule may have moved: the schedule's factor is kept."""
    if restored == old or not old:
        return new
    return restored * (new / old)  # (0.0125 * (0.1 / 0.05) is 0.025; 0.0125 * 0.1 / 0.05 is 0.025000000000000005)


def _shown(value) -> str:
    """A setting as a person reads it: a float to 6 significant digits (the lr a schedule moved: 0.00625, not
    0.006250000000000001)."""
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def apply_changes(checkpoint: dict, now: dict, then: dict, ckpt_path: str) -> list[str]:
    """Put the settings that differ between ``now`` and ``then`` (:func:`built_settings` of this run and of the run
    that wrote the checkpoint) over the checkpoint's optimizer and scheduler state; returns what was changed."""
    changes: list[str] = []
    restored_optimizers = checkpoint.get("optimizer_states", [])
    for index, (built, old) in enumerate(zip(now["optimizers"], then.get("optimizers", []), strict=False)):
        groups = restored_optimizers[index]["param_groups"] if index < len(restored_optimizers) else []
        if built["class"] != old["class"] or len(built["groups"]) != len(old["groups"]):
            raise UserError(
                f"{ckpt_path} holds the state of a {old['class']} with {len(old['groups'])} parameter group(s), but "
                f"this run builds a {built['class']} with {len(built['groups'])}: fit resumes the optimizer's state, "
                "so keep the optimizer the checkpoint was trained with (its arguments may change), or start fresh"
            )
        for number, (new_group, old_group, group) in enumerate(
            zip(built["groups"], old["groups"], groups, strict=False)
        ):
            where = f" (group {number})" if len(groups) > 1 else ""
            changes += _change_group(group, new_group, old_group, where)
    restored_schedulers = checkpoint.get("lr_schedulers", [])
    for built, old, state in zip(now["schedulers"], then.get("schedulers", []), restored_schedulers, strict=False):
        if built["class"] == old["class"]:  # (a scheduler of another class is the task's to refuse)
            changes += _change_scheduler(state, built, old)
    return changes


def _change_group(group: dict, new: dict, old: dict, where: str) -> list[str]:
    """A restored parameter group with the settings that changed since ``old`` set to ``new``'s (its lr scaled as
    :func:`_scaled_lr` says); what changed."""
    changes = []
    for key, value in new.items():
        if key in old and _same(old[key], value):
            continue
        before = group.get(key)
        group[key] = _scaled_lr(before, old[key], value) if key == "lr" and key in old else value
        if key != "initial_lr":
            changes.append(f"{key}{where} {_shown(before)} -> {_shown(group[key])}")
    return changes


def _change_scheduler(state: dict, built: dict, old: dict) -> list[str]:
    """A restored scheduler's state with the settings that changed since ``old`` set to ``built``'s; what changed
    (an lr change is named with the optimizer's)."""
    changes = []
    for key, value in built["state"].items():
        if key == "_last_lr" or (key in old["state"] and _same(old["state"][key], value)):
            continue  # (_last_lr: what the scheduler last set, which its next step sets again)
        before = state.get(key)
        state[key] = value
        if key != "base_lrs":
            changes.append(f"{built['class']}.{key} {_shown(before)} -> {_shown(value)}")
    return changes


class ResumeSettings(Callback):
    """Records what each run's optimizers and schedulers were built with; a resumed fit puts the settings it changed
    over the restored state (see the module's docstring)."""

    def __init__(self) -> None:
        self._built: dict | None = None  # this run's, from on_fit_start
        self._checkpoint: dict | None = None  # a resumed fit's checkpoint, until the optimizers are built

    @override
    def on_fit_start(self, trainer, pl_module) -> None:
        # After the strategy built the optimizers, before Lightning restores their state (either order of the
        # restore of callbacks and the optimizers' set-up: a strategy may restore after its set-up)
        self._built = built_settings(trainer)
        self._apply(trainer)

    @override
    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        if trainer.state.fn == "fit":
            self._checkpoint = checkpoint
            self._apply(trainer)

    def _apply(self, trainer) -> None:
        if self._built is None or self._checkpoint is None:
            return
        checkpoint, self._checkpoint = self._checkpoint, None
        then = checkpoint.get("callbacks", {}).get(self.state_key, {}).get("built")
        ckpt_path = trainer.ckpt_path or "the checkpoint"
        if then is None:
            return  # written before the template recorded them: the restored state trains, as Lightning does
        changes = apply_changes(checkpoint, self._built, then, ckpt_path)
        if changes:
            rank_zero_info(f"Resumed with the settings given over the restored state: {', '.join(changes)}")

    @override
    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        if self._built is not None:
            checkpoint.setdefault("callbacks", {})[self.state_key] = {"built": self._built}
