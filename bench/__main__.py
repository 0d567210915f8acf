"""Training speed, measured three ways on the same network, batch and device, in one run.

    python -m bench                                   # CPU: resnet_tiny, batch 256 (minutes on 2 cores)
    python -m bench --arch resnet18 --batch-size 256 --precision bf16-mixed --channels-last --compile   # a GPU

1. ``plain``: ``bench/plain.py``, the same training as a plain PyTorch loop (no Lightning), in a fresh process:
   the ceiling for our overhead.
2. ``cli.py fit`` with each strategy that runs on this machine (one device; on CPU also ddp with 2 processes),
   read back from the run's ``perf/images_per_s`` (training time of the last epoch, validation off).
3. the data pipeline alone: our loader (one indexing op per batch, transforms on the device) against
   torchvision's ``FashionMNIST`` + ``DataLoader`` with per-sample ``ToTensor``/``Normalize``.

``--repeats N`` runs 1 and 2 N times, interleaved (plain, then each ``cli.py fit``, then plain again ..., the order
rotated by one each repeat), and reports medians; the ratio to the plain loop is the median of the N paired
ratios, so slow drifts of a shared machine cancel. ``spread`` is (max - min) / median of a row's N values.

Prints images/s, seconds per 55k-image epoch, the ratio to the plain loop and the fraction of the FLOP ceiling
(FLOPs counted with ``torch.utils.flop_counter``; the peak from ``--peak-tflops`` or a table of known GPUs), and
writes ``bench/results/speed-<device>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

import torch
from torch.utils.flop_counter import FlopCounterMode

from app.fashion_mnist.data import MEAN, STD, FashionMNISTDataModule
from app.fashion_mnist.networks import build_resnet
from bench.plain import synchronize
from bench.report import record

ROOT = Path(__file__).resolve().parents[1]
EPOCH_IMAGES = 55_000
PEAK_TFLOPS = {  # dense, per GPU: (bf16/fp16 tensor cores, fp32 / tf32); the first name found in the device's wins
    "H200": (989.0, 494.0),
    "H100 PCIe": (756.0, 378.0),
    "H100": (989.0, 494.0),  # SXM (and NVL's per-GPU figure is close to it)
    "A100": (312.0, 156.0),
    "V100": (125.0, 15.7),
}


def flops_per_image(arch: str) -> float:
    """Training FLOPs (forward + backward) per 28x28 image, counted by torch."""
    net = build_resnet(arch)
    x = torch.randn(2, 1, 28, 28)
    with FlopCounterMode(display=False) as counter:
        net(x).sum().backward()
    return counter.get_total_flops() / 2


def peak_flops(device: torch.device, precision: str, given: float | None) -> float | None:
    if given:
        return given * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, (half, full) in PEAK_TFLOPS.items():
        if key in name:
            return (half if "16" in precision else full) * 1e12
    return None


# ------------------------------------------------------------------------------------------------ 1. plain loop
def plain_loop(args, data_dir: Path) -> float:
    """``bench/plain.py`` in a fresh process, as ``cli.py fit`` runs: both start from the same state."""
    cmd = [
        sys.executable, "-m", "bench.plain", f"--arch={args.arch}", f"--batch-size={args.batch_size}",
        f"--steps={args.steps}", f"--precision={args.precision}", f"--data-dir={data_dir}", f"--source={args.source}",
        "--channels-last" if args.channels_last else "--no-channels-last",
        "--compile" if args.compile else "--no-compile", f"--compile-mode={args.compile_mode}",
    ]  # fmt: skip
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])["images_per_s"]


# ------------------------------------------------------------------------------------------------ 2. cli.py fit
def cli_fit(args, data_dir: Path, strategy: str, devices: int) -> float:
    cmd = [
        sys.executable, str(ROOT / "cli.py"), "fit",
        f"--model.arch={args.arch}", f"--data.batch_size={args.batch_size}", f"--data.data_dir={data_dir}",
        f"--data.source={args.source}", f"--trainer.accelerator={args.accelerator}",
        f"--trainer.strategy={strategy}", f"--trainer.devices={devices}", "--trainer.max_epochs=2",
        f"--trainer.limit_train_batches={args.steps}", "--trainer.limit_val_batches=0",
        "--trainer.num_sanity_val_steps=0", "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false", "--trainer.log_every_n_steps=50",
        f"--model.channels_last={args.channels_last}", f"--model.compile={args.compile}",
        f"--model.compile_mode={args.compile_mode}",
    ]  # fmt: skip
    if args.precision != "32":
        cmd.append(f"--trainer.precision={args.precision}")
    with tempfile.TemporaryDirectory() as workdir:
        env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
        result = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, env=env)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{result.stderr[-3000:]}")
        with open(Path(workdir) / "lightning_logs" / "version_0" / "metrics.csv") as f:
            values = [float(r["perf/images_per_s"]) for r in csv.DictReader(f) if r.get("perf/images_per_s")]
    return values[-1]  # the second epoch: compiled, warmed up


# ------------------------------------------------------------------------------------------------ 3. data pipeline
def our_pipeline(args, device: torch.device, data: FashionMNISTDataModule, batches: int) -> float:
    loader = data.train_dataloader()
    synchronize(device)
    start = time.perf_counter()
    for i, (x, y) in enumerate(loader):
        x, y = data.on_after_batch_transfer((x.to(device, non_blocking=True), y.to(device, non_blocking=True)), 0)
        if i + 1 == batches:
            break
    synchronize(device)
    return batches / (time.perf_counter() - start)


def torchvision_pipeline(args, device: torch.device, raw_dir: Path, batches: int) -> float:
    from torchvision import transforms
    from torchvision.datasets import FashionMNIST

    with tempfile.TemporaryDirectory() as root:
        (Path(root) / "FashionMNIST").mkdir()
        os.symlink(raw_dir, Path(root) / "FashionMNIST" / "raw")  # torchvision's layout, our files
        transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize((MEAN,), (STD,))])
        dataset = FashionMNIST(root, train=True, download=False, transform=transform)
        loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, shuffle=True, num_workers=0)
        synchronize(device)
        start = time.perf_counter()
        for i, (x, y) in enumerate(loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            if i + 1 == batches:
                break
        synchronize(device)
        return batches / (time.perf_counter() - start)


# ------------------------------------------------------------------------------------------------ main
def bench_runs(strategies: str, compile: bool, cuda: bool) -> list[tuple[str, str, int]]:
    """``(row name, strategy, devices)`` of the cli.py runs: each strategy on one device, and on CPU ddp with 2
    processes too. Under ``--compile`` dp is left out, saying so: it rebuilds its replicas every step, so the model
    refuses to compile under it."""
    chosen = [s for s in strategies.split(",") if s]
    if compile and "dp" in chosen:
        chosen.remove("dp")
        print("--compile: dp left out (its replicas are rebuilt every step, so the model refuses compile)", flush=True)
    runs = [(f"cli.py fit {s} x1", s, 1) for s in chosen]
    if not cuda and "ddp" in chosen:
        runs.append(("cli.py fit ddp x2 (processes)", "ddp", 2))
    return runs


def main() -> None:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="resnet18" if cuda else "resnet_tiny")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=100 if cuda else 30, help="timed steps (and as many warm-up)")
    parser.add_argument("--precision", default="bf16-mixed" if cuda else "32", choices=["32", "bf16-mixed"])
    parser.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=cuda)
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False)
    parser.add_argument("--compile-mode", default="default", help="torch.compile's mode (both loops)")
    parser.add_argument("--peak-tflops", type=float, help="the device's peak for --precision (default: known GPUs)")
    parser.add_argument("--data-dir", default="data")
    parser.add_argument("--source", default="synthetic", choices=["synthetic", "fashion_mnist"])
    parser.add_argument("--strategies", default="auto,dp,ddp", help="comma-separated; dp/ddp run on 1 device")
    parser.add_argument("--repeats", type=int, default=1 if cuda else 3, help="interleaved repeats; medians reported")
    args = parser.parse_args()
    args.accelerator = "gpu" if cuda else "cpu"
    device = torch.device("cuda" if cuda else "cpu")

    data = FashionMNISTDataModule(data_dir=args.data_dir, source=args.source, batch_size=args.batch_size)
    data.prepare_data()
    data.setup("fit")
    labels = data.train_set.labels
    raw_dir = data.files.folder().resolve()  # torchvision's per-sample path below reads extracted files only

    per_image = flops_per_image(args.arch)
    peak = peak_flops(device, args.precision, args.peak_tflops)
    rows: list[dict] = []

    def add(name: str, values: list[float], plains: list[float], devices: int = 1) -> None:
        images_per_s, per_step = median(values), args.batch_size * devices  # images per optimizer step
        row = {
            "run": name,
            "images_per_s": images_per_s,
            "s_per_epoch": EPOCH_IMAGES / images_per_s,
            "vs_plain": median(v / p for v, p in zip(values, plains, strict=True)),
            "spread": (max(values) - min(values)) / images_per_s,
            "ms_per_step": 1e3 * per_step / images_per_s,
            # what each step costs beyond the plain loop's (same batch per step only): host time on a GPU
            "extra_ms_per_step": median(1e3 * per_step * (1 / v - 1 / p) for v, p in zip(values, plains, strict=True))
            if devices == 1
            else "",
            "tflops": images_per_s * per_image / 1e12,
            "of_peak": images_per_s * per_image / peak if peak else "",
        }
        rows.append(row)
        extra = f"{row['extra_ms_per_step']:+7.2f} ms/step vs plain  " if devices == 1 else " " * 26
        spread = f"(spread {row['spread']:.1%} over {len(values)})"
        print(f"{name:30s} {images_per_s:10,.0f} img/s  {row['s_per_epoch']:8.2f} s/epoch  "
              f"{row['vs_plain']:.3f} x plain  {extra}{spread}", flush=True)  # fmt: skip

    data_dir = Path(args.data_dir).resolve()
    runs = bench_runs(args.strategies, args.compile, cuda)
    plains: list[float] = []
    results: dict[str, list[float]] = {name: [] for name, _, _ in runs}
    jobs = [("plain PyTorch loop", None, 1), *runs]
    for repeat in range(args.repeats):
        # Rotated each repeat: no run always follows the same one (a 2-process run heats or throttles a shared VM).
        shift = repeat % len(jobs)
        for name, strategy, devices in jobs[shift:] + jobs[:shift]:
            value = plain_loop(args, data_dir) if strategy is None else cli_fit(args, data_dir, strategy, devices)
            (plains if strategy is None else results[name]).append(value)
            print(f"repeat {repeat + 1}/{args.repeats}: {name} {value:,.0f} img/s", flush=True)
    add("plain PyTorch loop", plains, plains)
    for name, _, devices in runs:
        add(name, results[name], plains, devices)

    batches = min(args.steps * 4, len(labels) // args.batch_size)
    ours = our_pipeline(args, device, data, batches)
    theirs = torchvision_pipeline(args, device, raw_dir, batches)
    for name, value in (("data pipeline alone: ours", ours), ("data: torchvision per-sample", theirs)):
        rows.append({"run": name, "images_per_s": value * args.batch_size, "vs_plain": ""})
    rows.append({"run": "data: ours / torchvision", "images_per_s": "", "vs_plain": ours / theirs})
    print(f"data pipeline: ours {ours:,.1f} batches/s, torchvision per-sample {theirs:,.1f} -> {ours / theirs:.1f}x")

    notes = (
        f"{args.arch}, batch {args.batch_size} per device, precision {args.precision}, channels_last "
        f"{args.channels_last}, compile {args.compile}, {args.steps} timed steps after {args.steps} warm-up, "
        f"median of {args.repeats} interleaved repeats; "
        f"{per_image / 1e9:.2f} GFLOP per training image; peak {peak / 1e12 if peak else 'unknown'} TFLOP/s. "
        "vs_plain: images/s relative to the plain loop (for the data rows: ours / torchvision); spread: (max - min) / "
        "median; extra_ms_per_step: median paired difference of step times to the plain loop."
    )
    columns = ["run", "images_per_s", "s_per_epoch", "vs_plain", "spread", "ms_per_step", "extra_ms_per_step"]
    columns += ["tflops", "of_peak"]
    name = f"speed-{args.arch}-b{args.batch_size}" + ("-compile" if args.compile else "")
    path = record(name, "bench", rows, columns, notes)
    print(path.read_text())


if __name__ == "__main__":
    main()
