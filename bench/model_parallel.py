"""What model parallelism buys and costs: ddp, fsdp and pipeline side by side, the same task, ranks and steps.

    python -m bench.model_parallel                   # CPU: 2 processes on gloo, resnet18, batch 16 per device
    python -m bench.model_parallel --arch resnet_tiny --batch-size 32 --steps 12 --microbatches 4 8
    python -m bench.model_parallel --balance 8 7     # also resnet18's blocks split in half (by compute, not memory)

One torchrun launch of ``--ranks`` processes trains the example task (app.fashion_mnist, synthetic 28x28 images)
under each strategy in turn, through Lightning and the template's strategies as ``cli.py`` runs them:

- **memory held per rank**: bytes of parameters, gradients and optimizer state on each rank at the last step (a
  shard's own piece under fsdp; the stage's layers under pipeline), the largest rank against ddp's;
- **step time**: the median over the timed steps (forward, backward, communication, optimizer), against ddp's;
- **pipeline bubble**: the share of the schedule's time (``schedule.step``: the micro-batches' forward, backward
  and sends) a stage spends not computing (1 - the time its forward and backward chunks take / the schedule's
  time), the mean over stages (and each stage's), against the GPipe/1F1B formula (stages - 1) / (microbatches +
  stages - 1), which assumes stages of equal cost and free communication. The rest of a step (the optimizer, the
  step's own code run per micro-batch, Lightning) is in the step time, not in the bubble.

Writes ``bench/results/model-parallel-<arch>-b<batch>-<device>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

import torch

from bench.report import record

ROOT = Path(__file__).resolve().parents[1]


def held_bytes(module: torch.nn.Module, optimizers) -> dict[str, float]:
    """Bytes this rank holds of parameters, gradients and optimizer state (shards' pieces; no other stage's)."""

    def local(t: torch.Tensor) -> int:
        if t.is_meta:
            return 0
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    params = [p for p in module.parameters()]
    state = [v for opt in optimizers for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return {
        "parameters": sum(local(p) for p in params),
        "gradients": sum(local(p.grad) for p in params if p.grad is not None),
        "optimizer": sum(local(v) for v in state),
    }


def _worker(args) -> None:
    """In each of the launched processes: every strategy in turn; rank 0 writes what all ranks measured."""
    import torch.distributed as dist
    from lightning.pytorch import Callback, Trainer, seed_everything
    from torch.distributed.pipelining import schedules as pipelining_schedules
    from torch.distributed.pipelining import stage as pipelining_stage

    from app.fashion_mnist.data import FashionMNISTDataModule
    from app.fashion_mnist.model import ImageClassifier
    from app.launch import startup
    from app.strategies import PipelineStrategy, register

    startup.install()  # what cli.py's main does first: the filters, the exit hook, and the names fsdp and pipeline
    register()

    busy = {"seconds": 0.0, "schedule": 0.0}
    probes = [
        (pipelining_stage._PipelineStageBase, "forward_one_chunk", "seconds"),  # a stage's compute
        (pipelining_stage._PipelineStageBase, "backward_one_chunk", "seconds"),
        (pipelining_schedules.PipelineScheduleSingle, "step", "schedule"),  # the whole schedule, waits included
    ]
    for owner, name, counter in probes:  # timed by wrapping them: the bench's own probe
        original = getattr(owner, name)

        def timed(self, *a, _original=original, _counter=counter, **k):
            start = time.perf_counter()
            try:
                return _original(self, *a, **k)
            finally:
                busy[_counter] += time.perf_counter() - start

        setattr(owner, name, timed)

    class Probe(Callback):
        def __init__(self) -> None:
            self.steps, self.busy, self.held = [], [], {}

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self.start, busy["seconds"], busy["schedule"] = time.perf_counter(), 0.0, 0.0

        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            self.held = held_bytes(pl_module, [])  # the gradients, before the step frees nothing

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.steps.append(time.perf_counter() - self.start)
            self.busy.append((busy["seconds"], busy["schedule"]))
            self.held["optimizer"] = held_bytes(pl_module, trainer.optimizers)["optimizer"]

    layouts = [("ddp", "ddp", {}), ("fsdp", "fsdp", {})]
    for m in args.microbatches:
        layouts.append((f"pipeline ({m} micro-batches, 1f1b)", "pipeline", {"microbatches": m}))
    for m in args.microbatches if args.balance else ():
        split = "/".join(map(str, args.balance))
        options = {"microbatches": m, "balance": list(args.balance)}
        layouts.append((f"pipeline ({m} micro-batches, layers {split})", "pipeline", options))
    rows = []
    for label, kind, options in layouts:
        seed_everything(0)
        probe = Probe()
        strategy = PipelineStrategy(**options) if kind == "pipeline" else kind
        trainer = Trainer(
            accelerator="cpu", devices=args.ranks, strategy=strategy, max_steps=args.warmup + args.steps,
            limit_val_batches=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, callbacks=[probe], num_sanity_val_steps=0,
        )  # fmt: skip
        data = FashionMNISTDataModule(source="synthetic", batch_size=args.batch_size, data_dir=args.data_dir)
        trainer.fit(ImageClassifier(arch=args.arch, norm="group"), data)
        timed = probe.steps[args.warmup :]
        scheduled = [(compute, schedule) for compute, schedule in probe.busy[args.warmup :] if schedule]
        mine = {
            "step_s": median(timed),
            "schedule_s": median(schedule for _, schedule in scheduled) if scheduled else 0.0,
            "bubble": 1 - median(compute / schedule for compute, schedule in scheduled) if scheduled else 0.0,
            **probe.held,
        }
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        rows.append({"label": label, "kind": kind, "ranks": everyone, **options})
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(rows))


def summarize(rows: list[dict], ranks: int) -> list[dict]:
    ddp = next(r for r in rows if r["kind"] == "ddp")
    ddp_held = max(sum(r[k] for k in ("parameters", "gradients", "optimizer")) for r in ddp["ranks"])
    ddp_step = median(r["step_s"] for r in ddp["ranks"])
    table = []
    for row in rows:
        held = [sum(r[k] for k in ("parameters", "gradients", "optimizer")) for r in row["ranks"]]
        step = median(r["step_s"] for r in row["ranks"])
        line = {
            "strategy": row["label"],
            "params MiB/rank": max(r["parameters"] for r in row["ranks"]) / 2**20,
            "grads MiB/rank": max(r["gradients"] for r in row["ranks"]) / 2**20,
            "optimizer MiB/rank": max(r["optimizer"] for r in row["ranks"]) / 2**20,
            "held / ddp": max(held) / ddp_held,
            "step ms": 1000 * step,
            "step / ddp": step / ddp_step,
        }
        if row["kind"] == "pipeline":
            stages, m = ranks, row["microbatches"]
            line["schedule ms"] = 1000 * median(r["schedule_s"] for r in row["ranks"])
            line["bubble"] = sum(r["bubble"] for r in row["ranks"]) / len(row["ranks"])
            line["bubble per stage"] = " / ".join(f"{r['bubble']:.2f}" for r in row["ranks"])
            line["(S-1)/(M+S-1)"] = (stages - 1) / (m + stages - 1)
        table.append(line)
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="resnet18")
    parser.add_argument("--batch-size", type=int, default=16, help="per device, as --data.batch_size")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per strategy")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument(
        "--balance",
        type=int,
        nargs="*",
        help="also the pipeline with these layers per stage (resnet18: 8 7 splits "
        "its residual blocks in half, by compute; the default balances parameters)",
    )
    parser.add_argument("--data-dir", default=None, help="where the synthetic data is made (default: a temp folder)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args)
        return
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "rows.json"
        data_dir = args.data_dir or str(Path(folder) / "data")
        command = [
            *(sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.ranks}"),
            *("-m", "bench.model_parallel", "--worker", "--out", str(out), "--data-dir", data_dir),
            *sys.argv[1:],
        ]
        threads = max(1, (os.cpu_count() or 1) // args.ranks)
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT)}
        subprocess.run(command, check=True, cwd=ROOT, env=env)
        rows = json.loads(out.read_text())
    table = summarize(rows, args.ranks)
    columns = [*table[0]] + ["schedule ms", "bubble", "bubble per stage", "(S-1)/(M+S-1)"]
    notes = (
        f"{args.arch} (GroupNorm), batch {args.batch_size} per device x {args.ranks} ranks, {args.steps} timed steps "
        f"after {args.warmup}; memory: the largest rank's; pipeline: {args.ranks} stages, one replica"
    )
    path = record(f"model-parallel-{args.arch}-b{args.batch_size}", "bench.model_parallel", table, columns, notes)
    print(path.read_text())
    print(f"written: {path} and .json")


if __name__ == "__main__":
    main()
