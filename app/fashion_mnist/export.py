"""``python cli.py export``: a trained checkpoint as a file for inference, in the format ``--out``'s suffix names.

    python cli.py export --ckpt_path lightning_logs/version_0/checkpoints/last.ckpt  # -> version_0/model.pt2
    python cli.py export --ckpt_path lightning_logs/version_0/checkpoints/last.ckpt --out model.pt

``model.pt2`` is a self-contained program (``torch.export``): it runs with torch alone, without this project,
Lightning or torchvision. Its input is images as floats in [0, 1], shape ``[N, 1, 28, 28]`` for any N (what
torchvision's ``ToTensor`` gives); the normalisation is inside; its output is the ``[N, classes]`` logits::

    import json, torch
    extra = {"fashion_resnet.json": ""}
    program = torch.export.load("model.pt2", extra_files=extra)
    classes = json.loads(extra["fashion_resnet.json"])["classes"]
    predicted = program.module()(images).argmax(1)

``fashion_resnet.json``, stored in it, holds what the ``.pt`` file's keys below hold, less the weights.

``model.pt`` is a dict of plain data (it loads with ``torch.load(path, weights_only=True)``) that needs this
project's :func:`~app.fashion_mnist.networks.build_resnet` to become a network again:

- ``state_dict``: the network's weights with torchvision's names (no ``net.``/``module.`` prefixes);
- ``network``: the arguments of :func:`app.fashion_mnist.networks.build_resnet` that rebuild it (arch, num_classes,
  norm);
- ``classes``, ``normalize`` (mean, std) and ``input`` (``[1, 28, 28]``): how to feed it and read its output;
- where it came from: ``trained_on`` (the data source the run resolved: ``fashion_mnist`` or ``synthetic``),
  ``metrics`` (the checkpoint's monitored score, e.g. ``val/acc``, and the run's best), ``epoch``,
  ``global_step``, ``checkpoint`` (the absolute path exported) and ``git_commit`` (of this checkout, ``+dirty`` with
  uncommitted changes; None outside a git checkout).

To use the ``.pt`` file::

    from app.fashion_mnist.export import load_exported
    net = load_exported("model.pt")            # eval mode
    probs = net((images / 255 - 0.2860) / 0.3530).softmax(1)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn
from typing_extensions import override

from app.checkpoints.atomic import atomic_path
from app.checkpoints.storage import run_path
from app.errors import UserError
from app.fashion_mnist.data import CLASSES, MEAN, STD
from app.fashion_mnist.model import check_weights_fit, load_checkpoint, network_state_dict, saved_network
from app.fashion_mnist.networks import build_resnet

FORMAT = "fashion-resnet-export/1"
PROGRAM_FORMAT = "fashion-resnet-program/1"
SUFFIXES = {".pt2": "a torch.export program, runs with torch alone", ".pt": "weights for build_resnet"}
METADATA = "fashion_resnet.json"  # the pt2 file's extra file with the export's metadata


def default_out(ckpt_path: str | Path) -> Path:
    """``model.pt2`` in the run folder of ``ckpt_path`` (``version_0/checkpoints/last.ckpt``:
    ``version_0/model.pt2``), beside the checkpoint elsewhere: not in the folder the command runs from."""
    folder = run_path(ckpt_path).parent
    return (folder.parent if folder.name == "checkpoints" else folder) / "model.pt2"


def export(ckpt_path: str | Path, out: str | Path, overwrite: bool = False) -> Path:
    out = run_path(out)
    if out.is_dir():
        raise UserError(f"--out {out} is a folder; give a file name such as {out / 'model.pt2'}")
    if out.suffix not in SUFFIXES:
        choices = "; ".join(f"{suffix} ({what})" for suffix, what in SUFFIXES.items())
        raise UserError(f"--out {out}: the suffix names the format, one of {choices}")
    if out.exists() and not overwrite:
        raise UserError(f"--out {out} already exists; choose another path or pass --overwrite")
    checkpoint = load_checkpoint(ckpt_path)
    network = saved_network(checkpoint, ckpt_path)
    payload: dict[str, Any] = {
        "format": FORMAT,
        "network": network,
        "state_dict": network_state_dict(checkpoint),
        "classes": list(CLASSES[: network["num_classes"]]),
        "normalize": {"mean": MEAN, "std": STD},
        "input": [1, 28, 28],
        "trained_on": trained_on(checkpoint),
        "metrics": checkpoint_metrics(checkpoint),
        "epoch": checkpoint.get("epoch"),
        "global_step": checkpoint.get("global_step"),
        "checkpoint": str(run_path(ckpt_path).resolve()),
        "git_commit": git_commit(),
    }
    net = build_resnet(**network)
    check_weights_fit(payload["state_dict"], net.state_dict(), ckpt_path)  # refuse to write a broken file
    net.load_state_dict(payload["state_dict"], strict=True)
    bad = [name for name, t in payload["state_dict"].items() if t.is_floating_point() and not t.isfinite().all()]
    if bad:
        raise UserError(f"{ckpt_path}: {len(bad)} weight tensor(s) hold inf or nan (e.g. {bad[0]}): a diverged run")
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        with atomic_path(out) as partial:  # a reader never sees half a file; torch.export.save wants its suffix
            if out.suffix == ".pt2":
                metadata = {key: value for key, value in payload.items() if key != "state_dict"}
                metadata["format"] = PROGRAM_FORMAT
                torch.export.save(export_program(net), partial, extra_files={METADATA: json.dumps(metadata)})
            else:
                torch.save(payload, partial)
    except OSError as err:
        raise UserError(f"--out {out}: cannot write it ({err.strerror or err})") from None
    return out


class FromPixels(nn.Module):
    """The network with its input normalisation inside: images in [0, 1], ``[N, 1, 28, 28]`` -> logits."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net
        self.register_buffer("mean", torch.tensor(MEAN))
        self.register_buffer("std", torch.tensor(STD))

    @override
    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.net((images - self.mean) / self.std)


def export_program(net: nn.Module) -> torch.export.ExportedProgram:
    """``net`` in eval mode as a ``torch.export`` program of any batch size."""
    batch = torch.export.Dim("batch", min=1)
    example = torch.zeros(2, 1, 28, 28)
    return torch.export.export(FromPixels(net).eval(), (example,), dynamic_shapes=({0: batch},))


def trained_on(checkpoint: dict) -> str:
    """The data source the run resolved (``auto`` becomes ``fashion_mnist`` or ``synthetic``)."""
    for key in ("datamodule_hyper_parameters", "hyper_parameters"):
        source = (checkpoint.get(key) or {}).get("resolved_source")
        if source:
            return str(source)
    return "unknown"


def checkpoint_metrics(checkpoint: dict) -> dict[str, float]:
    """The monitored score when the checkpoint was written, and the best of the run so far (ModelCheckpoint's)."""
    metrics: dict[str, float] = {}
    for state in (checkpoint.get("callbacks") or {}).values():
        monitor = state.get("monitor") if isinstance(state, dict) else None
        if not monitor:
            continue
        if state.get("current_score") is not None:
            metrics[monitor] = float(state["current_score"])
        if state.get("best_model_score") is not None:
            metrics[f"best {monitor}"] = float(state["best_model_score"])
    return metrics


def git_commit() -> str | None:
    """This checkout's commit (``+dirty`` with uncommitted changes), or None outside a git checkout."""
    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return None
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):  # no git installed
        return None
    return head.stdout.strip() + ("+dirty" if status.stdout.strip() else "")


def load_exported(path: str | Path) -> nn.Module:
    """Rebuild the exported network and load its weights (``weights_only``, strict); returns it in eval mode."""
    payload = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise UserError(f"{path}: not a file written by `python cli.py export`")
    net = build_resnet(**payload["network"])
    net.load_state_dict(payload["state_dict"], strict=True)
    return net.eval()


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="cli.py export", description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt_path", required=True, help="a checkpoint written by `cli.py fit`")
    parser.add_argument(
        "--out",
        help="the file to write: model.pt2 (a torch.export program that runs with torch alone) or model.pt "
        "(weights that this project's build_resnet turns back into a network); default: model.pt2 in the "
        "checkpoint's run folder",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    args = parser.parse_args(argv)
    path = export(args.ckpt_path, args.out or default_out(args.ckpt_path), args.overwrite)
    print(f"exported {args.ckpt_path} -> {path}", file=sys.stderr)
