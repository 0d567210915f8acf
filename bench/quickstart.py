"""A preset as a user runs it, timed and scored: ``cli.py fit --config configs/quickstart.yaml``, then
``cli.py test`` of its last checkpoint on the 10,000 test images.

    python -m bench.quickstart                      # the README's figures: time of fit, val and test accuracy
    python -m bench.quickstart --repeats 3          # three runs with the same seed (how steady the time is)
    python -m bench.quickstart --config configs/d2l.yaml -- --config configs/gpu_fast.yaml    # another preset

It runs on the data the quickstart finds (the real Fashion-MNIST where it is installed, docs/data.md) and says
which in its notes; figures on the synthetic stand-in are not the README's.
"""

from __future__ import annotations

import argparse
import csv
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

from bench.report import record

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "quickstart.yaml"


def cli(*args: str, cwd: Path) -> tuple[float, str]:
    """Run ``cli.py`` as a user does; returns its wall seconds and its output (stdout and stderr)."""
    start = time.perf_counter()
    result = subprocess.run([sys.executable, str(ROOT / "cli.py"), *args], cwd=cwd, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        sys.exit(f"cli.py {args[0]} failed:\n{result.stderr[-3000:]}")
    return seconds, result.stdout + result.stderr


def column(metrics_csv: Path, name: str) -> list[float]:
    with open(metrics_csv, newline="") as f:
        return [float(row[name]) for row in csv.DictReader(f) if row.get(name)]


def run_once(config: Path, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        workdir = Path(folder)
        fit_s, fit_out = cli("fit", "--config", str(config), *extra, cwd=workdir)
        logs = workdir / "lightning_logs"
        test_s, _ = cli(
            "test", "--config", str(config), *extra, "--ckpt_path",
            str(logs / "version_0" / "checkpoints" / "last.ckpt"), cwd=workdir,
        )  # fmt: skip
        data = re.search(r"^Data: fit on .*$", fit_out, re.MULTILINE)
        epochs = column(logs / "version_0" / "metrics.csv", "perf/epoch_seconds")
        return {
            "fit_s": fit_s,
            "train_s": sum(epochs),
            "epoch_s_median": median(epochs),
            "val_acc": ", ".join(f"{v:.4f}" for v in column(logs / "version_0" / "metrics.csv", "val/acc")),
            "test_acc": f"{column(logs / 'version_1' / 'metrics.csv', 'test/acc')[0]:.4f}",
            "test_s": test_s,
            "data": data[0] if data else "?",
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--config", type=Path, default=CONFIG, help="the preset (default configs/quickstart.yaml)")
    parser.add_argument("extra", nargs="*", help="more cli.py flags for fit and test, after --")
    args = parser.parse_args()
    args.config = args.config.resolve()  # cli.py runs in a folder of its own
    rows = []
    for repeat in range(args.repeats):
        row = {"run": repeat + 1, **run_once(args.config, args.extra)}
        print(row, flush=True)
        rows.append(row)
    data = {row.pop("data") for row in rows}
    preset = args.config.resolve().relative_to(ROOT) if args.config.resolve().is_relative_to(ROOT) else args.config
    notes = f"{preset} {' '.join(args.extra)}; fit_s and test_s: wall of each cli.py command; " + (
        f"train_s: the epochs' seconds (training and validation) from metrics.csv. {'; '.join(sorted(data))}"
    )
    name = "quickstart" if args.config == CONFIG.resolve() else f"preset-{args.config.stem}"
    import torch  # the presets' accelerator is auto: a GPU where there is one

    device = "cuda" if torch.cuda.is_available() else "cpu"
    path = record(name, "bench.quickstart", rows, list(rows[0]), notes=notes, device=device)
    print(path.read_text())


if __name__ == "__main__":
    main()
