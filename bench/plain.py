"""The ceiling for our overhead: the same training as ``cli.py fit``, written as a plain PyTorch loop (no Lightning).

    python -m bench.plain --data-dir data --arch resnet_tiny --batch-size 256 --steps 40

Same network, optimizer, loss, batch, data and per-batch work as the app (uint8 images indexed a batch at a time
from a seeded permutation, converted and normalised on the device), minus everything Lightning and our callbacks
add. ``python -m bench`` runs it in a fresh process, as it runs ``cli.py fit``, so that both start from the same
state; it prints one JSON line: ``{"images_per_s": ...}`` over the timed steps (after as many warm-up steps).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from torch import nn

from app.fashion_mnist.data import MEAN, STD, FashionMNISTDataModule
from app.fashion_mnist.model import DEFAULT_SGD
from app.fashion_mnist.networks import build_resnet
from bench.cudagraphs import KERNELS, STEP_TIMES, KernelProfile, StepTimer


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train(args: argparse.Namespace, device: torch.device, images: torch.Tensor, labels: torch.Tensor) -> float:
    """Images/s over ``args.steps`` steps, after ``args.steps`` warm-up steps (the same as Lightning's first epoch)."""
    torch.manual_seed(0)
    net = build_resnet(args.arch).to(device)
    if args.channels_last:
        net = net.to(memory_format=torch.channels_last)
    if args.compile:
        net.compile(mode=args.compile_mode)
    optimizer = torch.optim.SGD(net.parameters(), **DEFAULT_SGD, **({"fused": True} if args.fused_optimizer else {}))
    criterion = nn.CrossEntropyLoss()
    autocast = args.precision == "bf16-mixed"
    b = args.batch_size
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
    pin = device.type == "cuda" and not args.data_on_device  # as the app's DataLoader does (pin_memory=True on GPUs)
    if args.data_on_device:  # as --data.on_device=true does: the set and the order on the device, batches cut there
        images, labels, order = images.to(device), labels.to(device), order.to(device)

    timer = StepTimer(device)
    kernels = KernelProfile(args.kernels) if args.kernels else None

    def step(i: int) -> None:
        timer.start()
        if args.mark_steps:
            torch.compiler.cudagraph_mark_step_begin()
        idx = order[(i * b) % (len(order) - b) :][:b]
        x, y = images[idx], labels[idx]
        if pin:
            x, y = x.pin_memory(), y.pin_memory()
        x = x.to(device, non_blocking=True).unsqueeze(1).float().div_(255).sub_(MEAN).div_(STD)
        y = y.to(device, non_blocking=True)
        if args.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = criterion(net(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        timer.end()

    for i in range(args.steps):
        step(i)
    synchronize(device)
    start = time.perf_counter()
    for i in range(args.steps, 2 * args.steps):
        if kernels and i - args.steps == 10:  # steps 10 to 40 of the timed ones, as bench.cudagraphs.StepKernels
            kernels.start()
        step(i)
        if kernels:
            kernels.step()
            if i - args.steps == 39:
                kernels.stop()
    synchronize(device)
    if kernels:
        kernels.stop()
    seconds = time.perf_counter() - start
    if args.step_times:  # bench.cudagraphs: each timed step's host and device time
        timer.write(args.step_times, skip=args.steps)
    return args.steps * b / seconds


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.plain", description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="resnet_tiny")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=40, help="timed steps (and as many warm-up)")
    parser.add_argument("--precision", default="32", choices=["32", "bf16-mixed"])
    parser.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=False)
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False)
    parser.add_argument("--compile-mode", default="default")
    parser.add_argument("--data-dir", default="data")
    parser.add_argument("--source", default="synthetic", choices=["synthetic", "fashion_mnist"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--mark-steps", action="store_true", help="cudagraph_mark_step_begin() before every step")
    parser.add_argument("--data-on-device", action="store_true", help="the training set on the device (no pinning)")
    parser.add_argument("--fused-optimizer", action="store_true", help="SGD(fused=True): one kernel per update")
    parser.add_argument("--step-times", default=os.environ.get(STEP_TIMES), help="write per-step times (JSON) here")
    parser.add_argument(
        "--kernels", nargs="?", const=os.environ.get(KERNELS, "kernels.json"), help="profile steps 10-40 (JSON) here"
    )
    args = parser.parse_args()

    data = FashionMNISTDataModule(data_dir=args.data_dir, source=args.source, batch_size=args.batch_size)
    data.prepare_data()
    data.setup("fit")
    images_per_s = train(args, torch.device(args.device), data.train_set.images, data.train_set.labels)
    print(json.dumps({"images_per_s": images_per_s}))


if __name__ == "__main__":
    main()
