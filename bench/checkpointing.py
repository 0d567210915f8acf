"""What activation checkpointing saves and costs: memory kept for backward and step time, with and without.

    python -m bench.checkpointing                          # resnet18, batch 32 on CPU; 256 on a GPU
    python -m bench.checkpointing --batch-size 512 --steps 20 --precision bf16

Memory: on a GPU, ``torch.cuda.max_memory_allocated`` over a training step; everywhere, the bytes of tensors kept
for backward (counted with ``torch.autograd.graph.saved_tensors_hooks``, plus the inputs checkpointed blocks hold).
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

from app.callbacks.activation_checkpointing import apply_activation_checkpointing
from bench.report import record


def saved_bytes(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes kept for backward by one forward: tensors autograd saves plus the inputs of checkpointed blocks."""
    storages: dict[int, int] = {}

    def remember(t: torch.Tensor) -> None:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()

    def pack(t: torch.Tensor) -> torch.Tensor:
        remember(t)
        return t

    checkpointed = [m for m in model.modules() if type(m).__name__.startswith("Checkpointed")]
    hooks = [m.register_forward_pre_hook(lambda _, args: remember(args[0])) for m in checkpointed]
    try:
        with saved_tensors_hooks(pack, lambda t: t):
            model(x)
    finally:
        for h in hooks:
            h.remove()
    return sum(storages.values())


def measure(model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int, dtype: torch.dtype | None) -> dict:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    cuda = x.device.type == "cuda"

    def step() -> None:
        with torch.autocast(x.device.type, dtype=dtype, enabled=dtype is not None):
            loss = nn.functional.cross_entropy(model(x).float(), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(2):  # warm-up (cudnn autotuning, allocator)
        step()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    if cuda:
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / steps
    with torch.autocast(x.device.type, dtype=dtype, enabled=dtype is not None):
        kept = saved_bytes(model, x)
    return {
        "step_ms": 1000 * seconds,
        "images_per_s": len(x) / seconds,
        "saved_for_backward_mib": kept / 2**20,
        "peak_allocated_mib": torch.cuda.max_memory_allocated() / 2**20 if cuda else "",
    }


def main() -> None:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="resnet18")
    parser.add_argument("--batch-size", type=int, default=256 if cuda else 32)
    parser.add_argument("--steps", type=int, default=20 if cuda else 3)
    parser.add_argument("--precision", choices=["32", "bf16"], default="bf16" if cuda else "32")
    args = parser.parse_args()

    from app.fashion_mnist.networks import build_resnet  # the example's: tests import this module in a fork too

    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if args.precision == "bf16" else None
    torch.manual_seed(0)
    x = torch.randn(args.batch_size, 1, 28, 28, device=device)
    y = torch.randint(0, 10, (args.batch_size,), device=device)
    rows = []
    for mode in ("plain", "checkpointed"):
        torch.manual_seed(0)
        model = build_resnet(args.arch).to(device).train()
        if mode == "checkpointed":
            apply_activation_checkpointing(model, ("BasicBlock", "Bottleneck"))
        rows.append({"mode": mode, **measure(model, x, y, args.steps, dtype)})
        del model
        if cuda:
            torch.cuda.empty_cache()
    plain, ckpt = rows
    ratios = {
        "mode": "checkpointed / plain",
        "step_ms": ckpt["step_ms"] / plain["step_ms"],
        "saved_for_backward_mib": ckpt["saved_for_backward_mib"] / plain["saved_for_backward_mib"],
    }
    if cuda:
        ratios["peak_allocated_mib"] = ckpt["peak_allocated_mib"] / plain["peak_allocated_mib"]
    rows.append(ratios)
    columns = ["mode", "step_ms", "images_per_s", "saved_for_backward_mib", "peak_allocated_mib"]
    notes = f"{args.arch}, batch {args.batch_size}, precision {args.precision}, {args.steps} timed steps"
    path = record(f"checkpointing-{args.arch}-b{args.batch_size}", "bench.checkpointing", rows, columns, notes)
    print(path.read_text())
    print(f"written: {path} and .json")


if __name__ == "__main__":
    main()
