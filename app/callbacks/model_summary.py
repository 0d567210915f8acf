"""The model summary at the start of ``fit``, without spoiling ``torch.compile``.

Lightning's summary runs the model once on its ``example_input_array`` to show each layer's input and output
sizes, under a FLOP counter (a ``TorchDispatchMode``). With torch 2.11 a compiled network's first call under that
mode makes Dynamo skip the network's ``forward`` for good: every later step ran eagerly, without a single graph
compiled (issue 44: the example task compiled, at eager speed on an H200, 0 graphs; torch 2.14 compiles).
Here that one call runs with ``torch.compiler.set_stance("force_eager")``: the summary is the same, and the first
training step is the network's first compiled call.
"""

from __future__ import annotations

import contextlib

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import RichModelSummary as LightningRichModelSummary
from typing_extensions import override


def eager():
    """A context in which ``torch.compile``'d code runs eagerly and compiles nothing (torch >= 2.6)."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    return set_stance("force_eager") if set_stance is not None else contextlib.nullcontext()


class RichModelSummary(LightningRichModelSummary):
    """Lightning's rich model summary, its example forward run eagerly (on by default in ``cli.py``)."""

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        with eager():
            super().on_fit_start(trainer, pl_module)
