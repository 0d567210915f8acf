"""Gradient reduction cost: the horovod strategy's fused allreduce against DDP's buckets, same ranks, same steps.

    python -m bench.reductions                       # CPU: 2 processes on gloo, ResNet-18 and a many-tensor MLP
    python -m bench.reductions --ranks 2 --steps 20 --repeats 5 --fusion-mb 64 25 4 --one-size 64 25

Both mechanisms run in the same 2 processes, one after the other in rotating order per repeat, on one model
copy each with the same start weights and batches:

- ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` (25 MiB buckets, its default, overlapping backward);
- ``horovod fused (N MiB)``: :class:`app.strategies.reductions.GradientAllreduce` as the horovod strategy uses
  it, with fusion buckets of ``--fusion-mb`` (``--trainer.strategy.fusion_mb``), the first of at most 1 MiB (as
  the strategy's, and DDP's), started during backward;
- ``horovod fused (N MiB, one size)``: the same for each size of ``--one-size``, with a first bucket as large as
  the others (the strategy before its first bucket was small);
- ``horovod per tensor``: the same with ``fusion_mb=0`` (one allreduce per gradient, no fusion).

Reports the median step time (forward, backward, reduction, SGD step) of each, its ratio to ddp, and the time the
fused variants wait for their allreduces once backward is over (what the buckets did not overlap), and writes
``bench/results/reductions-cpu.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import os
import time
from statistics import median

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from app.fashion_mnist.networks import build_resnet
from app.strategies.reductions import FIRST_BUCKET_MB, GradientAllreduce
from bench.report import record


def many_tensors() -> nn.Module:
    """An MLP of 100 narrow blocks: 400 small parameter tensors (where per-tensor allreduces hurt most)."""
    blocks = [nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64), nn.ReLU()) for _ in range(100)]
    return nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 64), *blocks, nn.Linear(64, 10))


MODELS = {"resnet18": lambda: build_resnet("resnet18"), "many_tensors (MLP, 400 tensors)": many_tensors}


def _step(model: nn.Module, optimizer, x, y, sync: GradientAllreduce | None) -> float:
    """One training step; returns the seconds spent waiting for the reduction after backward (0 for DDP, which
    waits inside backward)."""
    optimizer.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(model(x), y).backward()
    waited = 0.0
    if sync is not None:
        start = time.perf_counter()
        sync.synchronize()
        waited = time.perf_counter() - start
    optimizer.step()
    return waited


def variants(fusion_mbs: list[float], one_size: list[float]) -> dict[str, tuple[float, float | None] | None]:
    """Name -> (fusion bucket size, first bucket size) in MiB (None: DDP itself; 0: one allreduce per tensor)."""
    return {
        "ddp": None,
        **{f"horovod fused ({mb:g} MiB)": (mb, FIRST_BUCKET_MB) for mb in fusion_mbs},
        **{f"horovod fused ({mb:g} MiB, one size)": (mb, None) for mb in one_size},
        "horovod per tensor": (0.0, None),
    }


def _worker(rank: int, world: int, port: int, args, out) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    rows = []
    for model_name, build in MODELS.items():
        torch.manual_seed(0)
        base = build()
        x = torch.randn(args.batch_size, 1, 28, 28, generator=torch.Generator().manual_seed(rank))
        y = torch.randint(0, 10, (args.batch_size,), generator=torch.Generator().manual_seed(rank))
        runs = {}
        names = variants(args.fusion_mb, args.one_size)
        for variant, sizes in names.items():
            model = build()
            model.load_state_dict(base.state_dict())
            params = [p for p in model.parameters() if p.requires_grad]
            if sizes is None:
                runs[variant] = (nn.parallel.DistributedDataParallel(model), None)
            else:
                fusion, first = (None if mb is None else int(mb * 2**20) for mb in sizes)
                sync = GradientAllreduce(params, world, fusion_bytes=fusion, first_bucket_bytes=first)
                runs[variant] = (model, sync)
        optimizers = {v: torch.optim.SGD(m.parameters(), lr=0.01) for v, (m, _) in runs.items()}
        times: dict[str, list[float]] = {v: [] for v in names}
        waits: dict[str, list[float]] = {v: [] for v in names}
        for repeat in range(args.repeats):
            order = list(names)[repeat % len(names) :] + list(names)[: repeat % len(names)]
            for variant in order:
                model, sync = runs[variant]
                for _ in range(args.warmup):
                    _step(model, optimizers[variant], x, y, sync)
                dist.barrier()
                start = time.perf_counter()
                waited = sum(_step(model, optimizers[variant], x, y, sync) for _ in range(args.steps))
                dist.barrier()
                times[variant].append((time.perf_counter() - start) / args.steps)
                waits[variant].append(waited / args.steps)
        tensors = sum(1 for p in base.parameters())
        for variant in names:
            ms = median(times[variant])
            ratios = [t / d for t, d in zip(times[variant], times["ddp"], strict=True)]
            rows.append(
                {
                    "model": model_name,
                    "tensors": tensors,
                    "reduction": variant,
                    "ms_per_step": 1000 * ms,
                    "vs_ddp": median(ratios),
                    "wait_after_backward_ms": "-" if names[variant] is None else 1000 * median(waits[variant]),
                    "spread": (max(times[variant]) - min(times[variant])) / ms,
                }
            )
    if rank == 0:
        out.put(rows)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16, help="per rank")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per repeat")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before each timed block")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--fusion-mb", type=float, nargs="+", default=[64.0, 25.0], help="fusion bucket sizes to time (MiB)"
    )
    parser.add_argument(
        "--one-size", type=float, nargs="*", default=[64.0], help="bucket sizes to time without a small first one"
    )
    args = parser.parse_args()
    from lightning.fabric.plugins.environments.lightning import find_free_network_port

    context = mp.get_context("spawn")
    out = context.SimpleQueue()
    mp.spawn(_worker, args=(args.ranks, find_free_network_port(), args, out), nprocs=args.ranks)
    rows = out.get()
    notes = (
        f"{args.ranks} processes on gloo, batch {args.batch_size} per rank, {args.steps} timed steps after "
        f"{args.warmup} warm-up, median of {args.repeats} repeats in rotating order; vs_ddp: median of the paired "
        "ratios to ddp's step time (below 1 is faster); wait_after_backward_ms: the time synchronize() waits for the "
        "allreduces after backward returned (communication not hidden behind backward; ddp waits inside backward); "
        "spread: (max - min) / median."
    )
    columns = ["model", "tensors", "reduction", "ms_per_step", "vs_ddp", "wait_after_backward_ms", "spread"]
    path = record("reductions", "bench.reductions", rows, columns, notes, device="cpu")  # gloo on CPU, always
    print(path.read_text())


if __name__ == "__main__":
    main()
