"""Gradient reduction cost: the horovod strategy's reduction (DDP's reducer with Horovod's hook) against DDP's own.

    python -m bench.reductions                       # CPU: 2 processes on gloo, ResNet-18 and a many-tensor MLP
    python -m bench.reductions --ranks 2 --steps 20 --repeats 5 --fusion-mb 64 25 0 --compression fp16

Every variant runs in the same 2 processes, one after the other in rotating order per repeat, on one model copy
each with the same start weights and batches:

- ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` as Lightning's ddp builds it (25 MiB buckets, its
  default, the first small, overlapping backward; its built-in allreduce);
- ``horovod (N MiB)``: :func:`app.strategies.reductions.fused_allreduce` as the horovod strategy uses it, with
  ``--trainer.strategy.fusion_mb=N`` (0: one allreduce per gradient, no fusion);
- ``horovod fp16 (25 MiB)``: the same with ``--trainer.strategy.compression=fp16`` (for each ``--compression``).

Reports the median step time (forward, backward with its reduction, SGD step) of each and its ratio to ddp, and
writes ``bench/results/reductions-cpu.json`` and ``.md``.
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
from app.strategies.reductions import FUSION_MB, fused_allreduce
from bench.report import record


def many_tensors() -> nn.Module:
    """An MLP of 100 narrow blocks: 400 small parameter tensors (where per-tensor allreduces hurt most)."""
    blocks = [nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64), nn.ReLU()) for _ in range(100)]
    return nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 64), *blocks, nn.Linear(64, 10))


MODELS = {"resnet18": lambda: build_resnet("resnet18"), "many_tensors (MLP, 400 tensors)": many_tensors}


def _step(model: nn.Module, optimizer, x, y) -> None:
    optimizer.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()


def variants(fusion_mbs: list[float], compressions: list[str]) -> dict[str, dict | None]:
    """Name -> fused_allreduce's keyword arguments (None: DDP itself)."""
    return {
        "ddp": None,
        **{f"horovod ({mb:g} MiB)": {"fusion_mb": mb} for mb in fusion_mbs},
        **{f"horovod {c} ({FUSION_MB:g} MiB)": {"compression": c} for c in compressions},
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
        names = variants(args.fusion_mb, args.compression)
        for variant, kwargs in names.items():
            model = build()
            model.load_state_dict(base.state_dict())
            ddp = nn.parallel.DistributedDataParallel
            runs[variant] = ddp(model) if kwargs is None else fused_allreduce(model, world, **kwargs)
        optimizers = {v: torch.optim.SGD(m.parameters(), lr=0.01) for v, m in runs.items()}
        times: dict[str, list[float]] = {v: [] for v in names}
        for repeat in range(args.repeats):
            order = list(names)[repeat % len(names) :] + list(names)[: repeat % len(names)]
            for variant in order:
                for _ in range(args.warmup):
                    _step(runs[variant], optimizers[variant], x, y)
                dist.barrier()
                start = time.perf_counter()
                for _ in range(args.steps):
                    _step(runs[variant], optimizers[variant], x, y)
                dist.barrier()
                times[variant].append((time.perf_counter() - start) / args.steps)
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
        "--fusion-mb", type=float, nargs="+", default=[25.0, 64.0, 0.0], help="fusion bucket sizes to time (MiB)"
    )
    parser.add_argument("--compression", nargs="*", default=["fp16"], choices=["fp16", "bf16"])
    args = parser.parse_args()
    from lightning.fabric.plugins.environments.lightning import find_free_network_port

    context = mp.get_context("spawn")
    out = context.SimpleQueue()
    mp.spawn(_worker, args=(args.ranks, find_free_network_port(), args, out), nprocs=args.ranks)
    rows = out.get()
    notes = (
        f"{args.ranks} processes on gloo, batch {args.batch_size} per rank, {args.steps} timed steps after "
        f"{args.warmup} warm-up, median of {args.repeats} repeats in rotating order; vs_ddp: median of the paired "
        "ratios to ddp's step time (below 1 is faster); spread: (max - min) / median."
    )
    columns = ["model", "tensors", "reduction", "ms_per_step", "vs_ddp", "spread"]
    path = record("reductions", "bench.reductions", rows, columns, notes, device="cpu")  # gloo on CPU, always
    print(path.read_text())


if __name__ == "__main__":
    main()
