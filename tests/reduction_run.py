"""Train a small float64 network under the horovod strategy's reductions; every rank records what it did.

    mpirun -np 4 python tests/reduction_run.py OUT_DIR

For each variant in VARIANTS, every rank saves ``OUT_DIR/{variant}.rank{r}.pt``: the weights it started from (after
rank 0's broadcast), the sample ids of each of its batches, and its final weights. tests/test_reductions.py replays
the same batches with its own implementation of the reduction and compares.
"""

import sys
from pathlib import Path

import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from torch import nn
from torch.utils.data import DataLoader, Dataset

from app.launch import startup
from app.strategies import HorovodStrategy

STEPS, BATCH, LR, MOMENTUM = 3, 4, 0.5, 0.9
VARIANTS = {
    # tiny fusion buckets: the 6 tensors go in 3 buckets, one of them holding three tensors
    "average_fused": {"op": "average", "fusion_mb": 0.001},
    "adasum": {"op": "adasum"},
    "adasum_accumulate": {"op": "adasum", "accumulate": 2},
    "adasum_bf16": {"op": "adasum", "compression": "bf16"},
}


class Samples(Dataset):
    """64 fixed samples of 6 features in 3 classes; each item carries its id."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(64, 6, generator=generator, dtype=torch.float64)
        self.y = torch.randint(0, 3, (64,), generator=generator)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i], i


class Net(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))
        self.batches: list[torch.Tensor] = []

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y, ids = batch
        self.batches.append(ids.clone())
        return nn.functional.cross_entropy(self(x), y)

    def train_dataloader(self):
        return DataLoader(Samples(), batch_size=BATCH, shuffle=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=MOMENTUM)


class Record(Callback):
    def __init__(self, out_dir: Path, name: str) -> None:
        self.out_dir, self.name = out_dir, name

    def on_train_start(self, trainer, pl_module) -> None:
        self.start = {k: v.clone() for k, v in pl_module.state_dict().items()}

    def on_train_end(self, trainer, pl_module) -> None:
        final = {k: v.clone() for k, v in pl_module.state_dict().items()}
        record = {"start": self.start, "batches": pl_module.batches, "final": final}
        torch.save(record, self.out_dir / f"{self.name}.rank{trainer.global_rank}.pt")


def main(out_dir: Path) -> None:
    startup.install()  # as cli.py's main: the filters and the exit hook that destroys the process group
    for name, variant in VARIANTS.items():
        seed_everything(1234 + len(name))  # another start for each variant
        strategy_args = {k: v for k, v in variant.items() if k != "accumulate"}
        trainer = Trainer(
            accelerator="cpu",
            devices=1,  # per process: mpirun started the ranks
            strategy=HorovodStrategy(**strategy_args),
            precision="64-true",
            max_steps=STEPS,
            accumulate_grad_batches=variant.get("accumulate", 1),
            callbacks=[Record(out_dir, name)],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(Net())


if __name__ == "__main__":
    main(Path(sys.argv[1]))
