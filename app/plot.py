"""``python cli.py plot lightning_logs/version_N``: loss, accuracy and images/s per epoch, as a PNG next to the run.

Reads the run's ``metrics.csv`` (written by the CSV logger) and writes ``plot.png`` in the same folder (``--out`` to
choose another path). Needs matplotlib: ``pip install -e ".[plot]"``.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
from collections import defaultdict
from pathlib import Path

from app.errors import UserError

PANELS = (
    ("loss", ("train/loss_epoch", "val/loss")),
    ("accuracy", ("train/acc", "val/acc")),
    ("images/s (training)", ("perf/images_per_s",)),
)


def epoch_metrics(metrics_csv: Path) -> dict[str, list[tuple[int, float]]]:
    """``{metric: [(epoch, value), ...]}`` for every per-epoch metric of a ``metrics.csv``."""
    series: dict[str, list[tuple[int, float]]] = defaultdict(list)
    with open(metrics_csv, newline="") as f:
        for row in csv.DictReader(f):
            if not row.get("epoch"):
                continue
            for _, names in PANELS:
                for name in names:
                    if row.get(name):
                        series[name].append((int(row["epoch"]), float(row[name])))
    return series


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    run_dir = Path(run_dir)
    metrics_csv = run_dir / "metrics.csv"
    if not metrics_csv.is_file():
        raise UserError(f"{metrics_csv}: not found; give a run folder such as lightning_logs/version_0")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError('plot needs matplotlib: pip install -e ".[plot]"') from None
    series = epoch_metrics(metrics_csv)
    if not series:
        raise UserError(f"{metrics_csv}: no per-epoch metrics yet (has an epoch finished?)")
    fig, axes = plt.subplots(1, len(PANELS), figsize=(5 * len(PANELS), 3.6), constrained_layout=True)
    for ax, (title, names) in zip(axes, PANELS, strict=True):
        for name in names:
            if series.get(name):
                epochs, values = zip(*series[name], strict=True)
                ax.plot(epochs, values, marker="o", label=name)
        ax.set_title(title)
        ax.set_xlabel("epoch")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend()
    fig.suptitle(str(run_dir))
    out = Path(out) if out else run_dir / "plot.png"
    partial = out.with_name(f".{out.name}.partial.png")
    fig.savefig(partial, dpi=100)
    plt.close(fig)
    os.replace(partial, out)
    return out


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="cli.py plot", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", help="a run folder, e.g. lightning_logs/version_0")
    parser.add_argument("--out", help="the PNG to write (default: RUN_DIR/plot.png)")
    args = parser.parse_args(argv)
    print(f"wrote {plot_run(args.run_dir, args.out)}", file=sys.stderr)
