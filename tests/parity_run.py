"""Train K steps under one strategy and save the final weights and logged metrics (rank 0 only).

Run as a script so that every launcher works as a user would use it: Lightning's ddp re-runs this file for its
children, ddp_spawn pickles the trainer, mpirun starts it once per rank, and horovod self-launches under mpirun.

    python tests/parity_run.py OUT --strategy ddp --devices 2 --batch-size 8
    torchrun --standalone --nproc_per_node=2 tests/parity_run.py --batch RUNS.json    # several runs, one launch
"""

import argparse
import json
import sys

import torch
from lightning.pytorch import Callback, Trainer, seed_everything

from app.callbacks import ActivationCheckpointing, DDPCommHook, LRWarmup, SyncBatchNorm
from app.launch import startup
from app.strategies import register as register_strategies
from tests.tiny import TinyClassifier, TinyData


def main(argv: list[str] | None = None) -> None:
    startup.install()  # what cli.py's main does first: the filters, the exit hook, the strategy names
    register_strategies()
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--strategy", default="auto")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--compression", default=None)
    parser.add_argument("--norm", default="group")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--precision", default="64-true", help="64-true: parity independent of summation order")
    parser.add_argument("--sync-bn", action="store_true", help="add the SyncBatchNorm callback")
    parser.add_argument("--checkpointing", action="store_true", help="add the ActivationCheckpointing callback")
    parser.add_argument("--comm-hook", help="add DDPCommHook with this hook (fp16, bf16, powersgd)")
    parser.add_argument("--powersgd-rank", type=int, default=1)
    parser.add_argument("--train-size", type=int, default=512)
    parser.add_argument("--val-size", type=int, default=101)
    parser.add_argument("--stages", type=int, help="pipeline: stages (default: the devices)")
    parser.add_argument("--microbatches", type=int, default=4, help="pipeline: micro-batches per batch")
    parser.add_argument("--schedule", default="1f1b", help="pipeline: gpipe or 1f1b")
    parser.add_argument("--warmup-steps", type=int, default=0, help="add LRWarmup (linear scaling rule) if > 0")
    args = parser.parse_args(argv)

    callbacks = [SaveResult(args.out)]
    if args.sync_bn:
        callbacks.append(SyncBatchNorm())
    if args.checkpointing:
        callbacks.append(ActivationCheckpointing())
    if args.comm_hook:
        callbacks.append(DDPCommHook(hook=args.comm_hook, powersgd_rank=args.powersgd_rank, powersgd_start_iter=2))
    if args.warmup_steps:
        callbacks.append(LRWarmup(warmup_steps=args.warmup_steps, scale_lr="linear", reference_batch=8))

    seed_everything(1234)
    model = TinyClassifier(norm=args.norm, lr=args.lr)
    data = TinyData(batch_size=args.batch_size, train_size=args.train_size, val_size=args.val_size)
    strategy = args.strategy
    if args.compression:
        from app.strategies import HorovodStrategy

        strategy = HorovodStrategy(compression=args.compression)
    if strategy == "pipeline":
        from app.strategies import PipelineStrategy

        strategy = PipelineStrategy(stages=args.stages, microbatches=args.microbatches, schedule=args.schedule)
    trainer = Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_steps=args.steps,
        accumulate_grad_batches=args.accumulate,
        precision=args.precision,
        limit_val_batches=1.0,
        val_check_interval=args.steps * args.accumulate,
        num_sanity_val_steps=0,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, data)


DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


class SaveResult(Callback):
    """Rank 0 saves the trained weights where training ran: spawn-style launchers hand weights back to the parent
    process in the parent's dtype (float32), which would round away the float64 run's precision.

    Also saved: ``held``, the parameter elements each rank holds (fsdp: its shards; pipeline: its stage), and
    ``compute_dtypes``, for every rank the number of training forwards of the model's first and last layer that
    computed in each of DTYPES (row per rank): what mixed precision really did on every rank and dp replica.
    """

    def __init__(self, out: str) -> None:
        self.out = out

    def setup(self, trainer, pl_module, stage: str) -> None:
        self.counts = torch.zeros(len(DTYPES), dtype=torch.long)
        # the first layer that computes, and the last (a pipeline's first and last stage each run one of them)
        layers = [m for m in pl_module.modules() if isinstance(m, torch.nn.Conv2d | torch.nn.Linear)]

        def count(module, inputs, output) -> None:
            if module.training:
                self.counts[DTYPES.index(output.dtype)] += 1

        self.hooks = [layer.register_forward_hook(count) for layer in (layers[0], layers[-1])]

    def on_train_end(self, trainer, pl_module) -> None:  # before the strategy's teardown (pipeline: reassembles)
        held = torch.tensor([sum(local_numel(p) for p in pl_module.parameters())], device=pl_module.device)
        self.held = trainer.strategy.all_gather(held).reshape(-1).cpu()  # each rank's (fsdp: shards; pipeline: stage)
        return self.held

    def on_fit_end(self, trainer, pl_module) -> None:
        for hook in self.hooks:
            hook.remove()
        counts = trainer.strategy.all_gather(self.counts.to(pl_module.device)).reshape(-1, len(DTYPES)).cpu()
        held = self.held if hasattr(self, "held") else self.on_train_end(trainer, pl_module)  # (no training: 0 steps)
        # what a checkpoint holds, as the strategy gathers it (a collective under fsdp: every rank takes part)
        weights = trainer.strategy.lightning_module_state_dict()
        if trainer.is_global_zero:
            metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
            state = {k: v.detach().cpu() for k, v in weights.items()}
            result = {"state_dict": state, "metrics": metrics, "global_step": trainer.global_step}
            torch.save({**result, "compute_dtypes": counts, "held": held}, self.out)
            print(json.dumps(metrics))


def local_numel(parameter: torch.Tensor) -> int:
    """Elements of a parameter this rank holds: a sharded one's (a DTensor) local piece, else all of them."""
    if parameter.is_meta:  # pipeline: another stage's layer
        return 0
    return parameter.to_local().numel() if hasattr(parameter, "to_local") else parameter.numel()


def main_batch(batch: str) -> None:
    """``--batch FILE``: the runs listed in FILE (a JSON list of argument lists), one after another in these same
    processes (the process group formed by the first run serves the others)."""
    with open(batch) as f:
        runs = json.load(f)
    for argv in runs:
        main(argv)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--batch"]:
        main_batch(sys.argv[2])
    else:
        main()
