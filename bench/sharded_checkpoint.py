"""What an fsdp checkpoint costs each rank: the full state dict (gathered on rank 0) against the sharded one (each
rank its own pieces, torch.distributed.checkpoint), written at once or in the background (``async_save``).

    python -m bench.sharded_checkpoint                     # CPU: fsdp x2 on gloo, an MLP of 8 x 2048^2 (134 MB)
    python -m bench.sharded_checkpoint --width 4096 --layers 8

Each mode trains the same model for 2 steps (SGD with momentum: the optimizer's state is as big as the weights),
then saves one checkpoint through ``trainer.save_checkpoint``, as ModelCheckpoint does. Each rank reports the peak
of its resident memory (``ru_maxrss``) before the save and after it: what the save added to the peak, the seconds
the training thread was held by the save, the seconds until the checkpoint was in place (the same, but for a
background save), and the bytes on disk. Writes ``bench/results/sharded-checkpoint-cpu.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

RESULTS = Path(__file__).resolve().parent / "results"


class MLP(LightningModule):
    def __init__(self, width: int = 2048, layers: int = 8) -> None:
        super().__init__()
        self.net = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
        self.width = width

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self.net(x).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3, momentum=0.9)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(64, self.width)), batch_size=8)


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rank_run(mode: str, width: int, layers: int, out: Path) -> None:
    """One rank (Lightning's launcher re-runs this script for rank 1): train, save, report."""
    from app.strategies import FSDPStrategy

    torch.manual_seed(0)
    model = MLP(width, layers)
    checkpoint, _, background = mode.partition("+")
    strategy = FSDPStrategy(checkpoint=checkpoint, async_save=bool(background))
    trainer = Trainer(
        strategy=strategy, accelerator="cpu", devices=2, max_steps=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model)
    before = peak_mib()
    start = time.perf_counter()
    trainer.save_checkpoint(out / "checkpoint.ckpt")
    seconds = time.perf_counter() - start
    if trainer.strategy.background is not None:
        trainer.strategy.background.settle(wait=True)  # written and in place
    in_place = time.perf_counter() - start
    after = peak_mib()
    report = {"rank": trainer.global_rank, "peak_before_mib": before, "peak_after_mib": after, "seconds": seconds}
    report["in_place_seconds"] = in_place
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(report))


def measure(mode: str, width: int, layers: int) -> dict:
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch)
        command = [sys.executable, "-m", "bench.sharded_checkpoint", "--rank-run", mode, str(out)]
        command += ["--width", str(width), "--layers", str(layers)]
        subprocess.run(command, check=True, cwd=Path(__file__).resolve().parents[1], capture_output=True)
        ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
        saved = out / "checkpoint.ckpt"
        files = [saved] if saved.is_file() else sorted(saved.rglob("*"))
        sizes = {str(f.relative_to(out)): f.stat().st_size for f in files if f.is_file()}
        shutil.rmtree(out, ignore_errors=True)
    return {"mode": mode, "ranks": ranks, "files": sizes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rank-run", nargs=2, metavar=("MODE", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_run:
        return rank_run(args.rank_run[0], args.width, args.layers, Path(args.rank_run[1]))
    weights_mb = args.layers * (args.width**2 + args.width) * 4 / 1e6
    results = [measure(mode, args.width, args.layers) for mode in ("full", "sharded", "sharded+async")]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    lines = [
        f"# fsdp x2 checkpoint memory, MLP {args.layers} x {args.width}^2 ({weights_mb:.0f} MB of float32 weights, "
        f"as much again of momentum), CPU, gloo",
        "",
        f"`python -m bench.sharded_checkpoint --width {args.width} --layers {args.layers}`, commit {commit}, "
        f"{time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs",
        "",
        "| checkpoint | rank | peak RSS before the save (MiB) | after (MiB) | the save added (MiB) "
        "| training held s | in place s | largest file (MB) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for result in results:
        largest = max(result["files"].values()) / 1e6
        for rank in result["ranks"]:
            added = rank["peak_after_mib"] - rank["peak_before_mib"]
            lines.append(
                f"| {result['mode']} | {rank['rank']} | {rank['peak_before_mib']:.0f} | {rank['peak_after_mib']:.0f} "
                f"| {added:.0f} | {rank['seconds']:.2f} | {rank['in_place_seconds']:.2f} | {largest:.0f} |"
            )
    text = "\n".join(lines) + "\n"
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "sharded-checkpoint-cpu.md").write_text(text)
    (RESULTS / "sharded-checkpoint-cpu.json").write_text(json.dumps({"commit": commit, "results": results}, indent=1))


if __name__ == "__main__":
    main()
