"""A forker's package as a team writes one, put outside the repo by the tests (tests/test_fork_resume.py).

A tiny ViT (patches, LayerNorm, dropout in attention and MLP), AdamW under a warm-up + cosine schedule sized in
``configure_optimizers`` from ``self.trainer.estimated_stepping_batches`` (what Lightning's docs recommend), its own
metric names (``loss/train``, ``score/val``), dict batches (``pixels``, ``target``), and a data module that reads a
folder of PNGs (written by :func:`write_pngs`), through ``app.loader.make_loader``. ``schedule_from`` picks the
Lightning idiom that sizes the schedule: each of them builds the training loader before the checkpoint is restored.
"""

SOURCE = '''
"""vitpkg: a tiny ViT on a folder of PNGs (a fork of the template, run by class path)."""
import math
from pathlib import Path

import numpy as np
import torch
from lightning.pytorch import LightningDataModule, LightningModule
from PIL import Image
from torch import nn
from torch.utils.data import Dataset

from app.loader import make_loader
from app.task import TaskSpec


class PngFolder(Dataset):
    """``root/<class>/<name>.png``: dict samples of a grey image in [0, 1] and its class index."""

    def __init__(self, root):
        self.root = Path(root)
        self.classes = sorted(p.name for p in self.root.iterdir() if p.is_dir())
        self.files = [(f, i) for i, c in enumerate(self.classes) for f in sorted((self.root / c).glob("*.png"))]
        if not self.files:
            raise ValueError(f"--data.folder={root}: no PNG files in its class folders")

    def __len__(self):
        return len(self.files)

    def __getitem__(self, index):
        path, label = self.files[index]
        pixels = torch.from_numpy(np.asarray(Image.open(path), dtype=np.float32) / 255.0)
        return {"pixels": pixels[None], "target": label}


class PngFiles(Dataset):
    """The PNG files of one folder (``--data.predict_dir``), unlabelled, named by file."""

    def __init__(self, folder):
        self.files = sorted(Path(folder).glob("*.png"))
        if not self.files:
            raise ValueError(f"--data.predict_dir={folder}: no PNG files there")

    def __len__(self):
        return len(self.files)

    def __getitem__(self, index):
        pixels = torch.from_numpy(np.asarray(Image.open(self.files[index]), dtype=np.float32) / 255.0)
        return {"pixels": pixels[None]}


class PngData(LightningDataModule):
    def __init__(self, folder: str = "pngs", batch_size: int = 8, predict_dir: str | None = None):
        """
        Args:
            predict_dir: ``predict`` on this folder's PNG files (else on the validation images).
        """
        super().__init__()
        self.save_hyperparameters()

    def setup(self, stage):
        self.train_set = PngFolder(Path(self.hparams.folder) / "train")
        self.val_set = PngFolder(Path(self.hparams.folder) / "val")
        self.class_names = self.train_set.classes
        if stage == "predict" and self.hparams.predict_dir:
            self.predict_set = PngFiles(self.hparams.predict_dir)
            self.predict_names = [f.name for f in self.predict_set.files]  # predictions.csv's name column
        else:
            self.predict_set = self.val_set
            self.predict_names = [f.name for f, _ in self.val_set.files]

    def predict_dataloader(self):
        return make_loader(self.trainer, self.predict_set, train=False, batch_size=self.hparams.batch_size)

    def train_dataloader(self):
        return make_loader(self.trainer, self.train_set, train=True, batch_size=self.hparams.batch_size, seed=3)

    def val_dataloader(self):
        return make_loader(self.trainer, self.val_set, train=False, batch_size=self.hparams.batch_size)


class TinyViT(LightningModule):
    spec = TaskSpec(
        monitor="score/val", mode="max", network=("dim", "patch", "classes"), blocks=("TransformerEncoderLayer",)
    )

    def __init__(self, dim: int = 16, patch: int = 4, classes: int = 3, dropout: float = 0.2, lr: float = 3e-3,
                 warmup: float = 0.2, schedule_from: str = "estimated_stepping_batches"):
        """
        Args:
            schedule_from: How configure_optimizers sizes the cosine schedule: ``estimated_stepping_batches``,
                ``len_train_dataloader`` (after ``trainer.fit_loop.setup_data()``), ``num_training_batches``, or
                ``on_fit_start`` (estimated_stepping_batches read there, the schedule reading it at its first step).
        """
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Conv2d(1, dim, patch, stride=patch)
        self.position = nn.Parameter(torch.randn(1, (8 // patch) ** 2, dim) * 0.02)
        self.encoder = nn.TransformerEncoderLayer(dim, 2, 2 * dim, dropout=dropout, batch_first=True, norm_first=True)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, pixels):
        tokens = self.embed(pixels).flatten(2).transpose(1, 2) + self.position
        return self.head(self.norm(self.encoder(tokens)).mean(1))

    def training_step(self, batch, batch_idx):
        loss = nn.functional.cross_entropy(self(batch["pixels"]), batch["target"])
        self.log("loss/train", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        score = (self(batch["pixels"]).argmax(1) == batch["target"]).float().mean()
        self.log("score/val", score, sync_dist=True, batch_size=len(batch["target"]))

    def predict_step(self, batch, batch_idx):
        probs = self(batch["pixels"]).softmax(1)
        return {"preds": probs.argmax(1), "probs": probs}

    def on_fit_start(self):
        if self.hparams.schedule_from == "on_fit_start":
            self.total = self.trainer.estimated_stepping_batches

    def stepping_batches(self):
        how = self.hparams.schedule_from
        if how == "on_fit_start":
            return None  # read by the schedule at its first step, from what on_fit_start found
        if how == "estimated_stepping_batches":
            return self.trainer.estimated_stepping_batches
        self.trainer.fit_loop.setup_data()  # Lightning's answer to "the train loader is None in configure_optimizers"
        if how == "len_train_dataloader":
            return len(self.trainer.train_dataloader) * self.trainer.max_epochs
        return self.trainer.num_training_batches * self.trainer.max_epochs

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.05)
        known = self.stepping_batches()

        def factor(step):
            total = int(known or getattr(self, "total", 1))
            warmup = max(1, int(self.hparams.warmup * total))
            if step < warmup:
                return (step + 1) / warmup
            return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))

        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}
'''

# vitpkg/export.py: the fork's own `cli.py export` (docs/fork.md, "Export and predict in a fork")
EXPORT = '''
"""python train.py export --ckpt_path CKPT [--out model.pt2]: the trained ViT as a torch.export program."""
import argparse
import json
from pathlib import Path

import torch

from app.checkpoints.io import load_checkpoint
from app.errors import UserError
from vitpkg import TinyViT


def main(argv):
    parser = argparse.ArgumentParser(prog="export")
    parser.add_argument("--ckpt_path", required=True)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    out = Path(args.out or Path(args.ckpt_path).parent.parent / "model.pt2")
    if out.exists():
        raise UserError(f"--out {out} already exists; choose another path")
    checkpoint = load_checkpoint(args.ckpt_path)  # weights_only: plain data
    network = {k: v for k, v in checkpoint["hyper_parameters"].items() if not k.startswith("_")}
    model = TinyViT(**network).eval()
    model.load_state_dict(checkpoint["state_dict"])
    program = torch.export.export(model, (torch.zeros(2, 1, 8, 8),), dynamic_shapes=({0: torch.export.Dim("n")},))
    torch.export.save(program, out, extra_files={"vit.json": json.dumps(network)})  # how it was built
    print(f"wrote {out}")
'''

# train.py: the fork's entry script, its task the default and its export a subcommand
ENTRY = """
from app.run.cli import main

if __name__ == "__main__":
    main(model="vitpkg.TinyViT", data="vitpkg.PngData", tools={"export": ("vitpkg.export", "the ViT as a .pt2")})
"""


def write_pngs(folder, per_class: int = 16, classes: int = 3, val_per_class: int = 4) -> None:
    """``folder/{train,val}/<class>/<i>.png``: 8x8 grey images, a fixed pattern per class under noise."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    patterns = rng.uniform(0, 255, (classes, 8, 8))
    for split, count in (("train", per_class), ("val", val_per_class)):
        for c in range(classes):
            (folder / split / f"c{c}").mkdir(parents=True, exist_ok=True)
            for i in range(count):
                image = np.clip(patterns[c] + rng.normal(0, 60, (8, 8)), 0, 255).astype(np.uint8)
                Image.fromarray(image).save(folder / split / f"c{c}" / f"{i:03d}.png")
