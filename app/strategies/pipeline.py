"""``strategy="pipeline"``: the network cut into stages, one process per stage, micro-batches flowing through them.

    python cli.py fit --trainer.strategy=pipeline --trainer.devices=2                       # 2 stages
    python cli.py fit --trainer.strategy=pipeline --trainer.devices=4 \\
        --trainer.strategy.stages=2 --trainer.strategy.microbatches=8 --trainer.strategy.schedule=gpipe  # 2 x 2

The seeds' model parallelism ("the first layers on one GPU, the later layers on another"), made to keep the devices
busy: each batch is split into ``microbatches``, and while stage 2 computes micro-batch 1, stage 1 already computes
micro-batch 2. A ``torch.distributed.pipelining`` schedule (``gpipe``: all forwards, then all backwards; ``1f1b``:
one forward, one backward, so at most ``stages`` micro-batches' activations are kept) runs the micro-batches and
their backward across the stage processes. With more devices than stages the pipelines are replicated: ``devices =
stages x replicas``, each replica trains on its own slice of the batch (a ``DistributedSampler`` over replicas) and
each stage's gradients are averaged over its replicas, as ddp does.

Which network, which layers: the task's ``spec.layers`` (app/task.py) names the network; by default it is the
LightningModule's only top-level submodule that holds parameters (the example's ``net``). Its layers are what the
task's ``spec.pipeline_layers`` returns: by default the network's own ``pipeline_layers()`` (a ResNet lists its stem,
residual blocks, pool and head), else an ``nn.Sequential``'s children; they are dealt to the stages in order,
balanced by parameter count unless ``balance`` gives the number of layers per stage. Each process keeps only its
stage's layers (the others are freed, on the ``meta`` device), their gradients and optimizer state.

The task's own steps run unchanged, as under ``dp``: the strategy finds the network's input by running the step
up to the network's call, runs the network through the pipeline, and then runs the step again on each micro-batch
with the network's output given (on the last stage with its gradient, which the schedule sends back through the
stages; on the other stages with the output sent to them, so every process logs the same values). So a step must
compute only: update metrics and log per micro-batch (as the example does in ``on_*_batch_end``, or with batch
sizes given), and keep state changes out of it. The first stage runs the step twice per micro-batch: the code before
the network's call twice, the rest once (every other stage: once); that code must draw no random numbers either (the
input is built from stage 0's draw, the loss from the last stage's). Running it once would mean suspending the step
at the network's call while the schedule runs every micro-batch: only a thread per micro-batch can, and grad mode,
autocast and the CUDA stream are per thread.

Rank 0 says in one line which layers went to which stage, with their parameters. The stages of each process, and
how a step runs through them, are app/strategies/pipeline_stages.py.

It trains like one device on the same global batch for a network without batch statistics (float64 parity in
tests/test_strategies.py); BatchNorm normalises each micro-batch on its own. Checkpoints hold one full state dict
(rank 0 gathers every stage's part, and the optimizer's state keyed as ``optimizer.state_dict()``), so they load
in any other strategy and a run resumes at another layout.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import default_pg_timeout
from typing_extensions import override

from app.errors import UserError
from app.strategies.model_parallel import SplitModelStrategy
from app.strategies.pipeline_stages import PipelineStages, is_meta, real

Schedule = Literal["gpipe", "1f1b"]


def check_torch_schedules() -> None:
    """The stages are fed microbatches split here (torch.chunk, as dp splits), through the ``arg_mbs`` of torch's
    schedules' ``step`` and ``eval``. Older torch has no such argument and split the list itself: the first evaluation
    failed in every stage (``TypeError: 'int' object is not iterable``, seen with torch 2.11 on a GPU machine)."""
    import inspect

    from torch.distributed.pipelining import ScheduleGPipe

    if not all("arg_mbs" in inspect.signature(getattr(ScheduleGPipe, f)).parameters for f in ("step", "eval")):
        raise UserError(
            f"--trainer.strategy=pipeline needs a torch whose pipeline schedules take split microbatches (arg_mbs); "
            f"torch {torch.__version__} has none (2.14 has): pip install --upgrade torch torchvision"
        )


class PipelineStrategy(SplitModelStrategy):
    strategy_name = "pipeline"
    refusals = {  # what app/parallelism.py's readers cannot do under a pipeline, whatever its stages
        "sync_batchnorm": "each stage holds other BatchNorm layers and normalises micro-batches; use a "
        "batch-independent norm (GroupNorm, LayerNorm) or leave it out",
        "comm_hook": "a pipeline's stages send activations, and average gradients only over replicas",
    }
    float16_reason = "the stages' backward here"

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        """``pipeline``. Defined here also because the one inherited from Lightning's DDPStrategy would register
        this class as ``ddp``."""
        if "pipeline" not in strategy_registry:
            strategy_registry.register(
                "pipeline",
                cls,
                description="the network cut into stages, one process each, micro-batches through "
                "torch.distributed.pipelining",
            )

    def __init__(
        self,
        stages: int | None = None,
        microbatches: int = 4,
        schedule: Schedule = "1f1b",
        balance: list[int] | None = None,
        accelerator=None,
        parallel_devices=None,
        cluster_environment=None,
        checkpoint_io=None,
        precision_plugin=None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        """
        Args:
            stages: How many stages the network is cut into, one process each (default: the devices of a node).
                The devices of all nodes must be a multiple: devices x nodes = stages x replicas.
            microbatches: How many micro-batches each batch is split into; the batch must be divisible by it (a
                smaller last batch of an epoch is split into as many equal parts as divide it).
            schedule: ``1f1b`` (default; needs microbatches >= stages) or ``gpipe``.
            balance: Layers per stage, in order (``[3, 5]``); default: balanced by parameter count.
            process_group_backend: ``gloo``, ``nccl`` (default: nccl on GPUs, gloo on CPU).
            timeout: The process group's timeout: a collective waiting longer for a lost peer fails.
        """
        super().__init__(
            accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin,
            process_group_backend=process_group_backend, timeout=timeout,
        )  # fmt: skip
        check_torch_schedules()
        if stages is not None and stages < 1:
            raise UserError(f"--trainer.strategy.stages={stages}: use a whole number >= 1")
        if microbatches < 1:
            raise UserError(f"--trainer.strategy.microbatches={microbatches}: use a whole number >= 1")
        if schedule not in Schedule.__args__:
            raise UserError(f"--trainer.strategy.schedule={schedule}: use one of {', '.join(Schedule.__args__)}")
        if balance is not None and (not balance or any(n < 1 for n in balance)):
            raise UserError(f"--trainer.strategy.balance={balance}: give the layers of each stage, each >= 1")
        if balance is not None and stages is not None and len(balance) != stages:
            raise UserError(
                f"--trainer.strategy.balance={balance} gives the layers of {len(balance)} stages, but "
                f"--trainer.strategy.stages={stages}; give {stages} numbers, one per stage (or leave stages out: "
                "balance then sets it)"
            )
        self._stages = stages or (len(balance) if balance else None)
        self._stages_given = stages is not None
        self.microbatches, self.schedule, self.balance = microbatches, schedule, balance
        self._pipeline: PipelineStages | None = None
        self._example_input = None  # the module's example_input_array, put back after the run

    # ---------------------------------------------------------------- the layout: stages x replicas, its Parallelism
    devices_per_process = 1  # (app/parallelism.py)

    @property
    def stages(self) -> int:
        return self._stages or self.num_processes

    @property
    def data_parallel_size(self) -> int:
        """The replicas of the pipeline: how many slices each global batch is dealt into."""
        return self.world_size // self.stages

    @property
    def stage(self) -> int:
        return self.global_rank % self.stages

    @property
    def replica(self) -> int:
        return self.global_rank // self.stages

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.data_parallel_size, "rank": self.replica}

    @property
    def sharded(self) -> bool:
        """Whether the model's layers are spread over the processes (no process holds them all)."""
        return self._pipeline is not None

    @override
    def _configure_launcher(self) -> None:  # Lightning calls it when the Trainer is made: before any launch
        world = self.num_processes * self.num_nodes
        if world % self.stages and self.balance and not self._stages_given:  # the stages are balance's entries
            devices = f"--trainer.devices={self.num_processes}"
            devices += f" x --trainer.num_nodes={self.num_nodes} ({world} devices)" if self.num_nodes > 1 else ""
            fits = [str(n) for n in range(1, world + 1) if world % n == 0]  # stage counts these devices can hold
            numbers = f"{', '.join(fits[:-1])} or {fits[-1]} numbers" if len(fits) > 1 else "1 number"
            raise UserError(
                f"--trainer.strategy.balance={self.balance} gives the layers of {len(self.balance)} stages, one "
                f"device each, but {devices} cannot hold them (devices = stages x replicas); give {numbers}, or use "
                f"a multiple of {len(self.balance)} devices"
            )
        if world % self.stages:
            raise UserError(
                f"--trainer.strategy=pipeline: {world} devices cannot hold pipelines of {self.stages} stages; use a "
                f"multiple of {self.stages} devices (stages x replicas) or --trainer.strategy.stages dividing {world}"
            )
        if self.schedule == "1f1b" and self.microbatches < self.stages:
            raise UserError(
                f"--trainer.strategy.microbatches={self.microbatches}: the 1f1b schedule needs at least as many "
                f"micro-batches as stages ({self.stages}); raise it or use --trainer.strategy.schedule=gpipe"
            )
        super()._configure_launcher()

    # ---------------------------------------------------------------- cut the network
    @override
    def setup(self, trainer) -> None:
        if not self.lightning_module.automatic_optimization:
            raise UserError(
                f"--trainer.strategy=pipeline runs the backward itself, so {type(self.lightning_module).__name__} "
                "must use automatic optimization (no self.manual_backward)"
            )
        if trainer.gradient_clip_val and trainer.gradient_clip_algorithm != "value":  # (None: by norm, too)
            raise UserError(
                f"--trainer.gradient_clip_val={trainer.gradient_clip_val} clips by the gradients' norm, which under "
                "--trainer.strategy=pipeline each stage would take over its own layers only; clip by value "
                "(--trainer.gradient_clip_algorithm=value) or train without clipping"
            )
        super().setup(trainer)

    def split(self, model: nn.Module) -> nn.Module:
        if self._pipeline is None and dist.is_available() and dist.is_initialized():
            self._pipeline = PipelineStages(self, model)
            # No process can run the cut network alone: Lightning's model summary then lists the layers without
            # their input and output sizes (it runs the example input through the model on rank 0 only).
            self._example_input, model.example_input_array = model.example_input_array, None
        return model

    @override
    def teardown(self) -> None:
        if self._pipeline is not None:
            self.lightning_module.example_input_array = self._example_input
            # (a run cut short by an exception is "interrupted" by now; one that ends well is still "running")
            self._pipeline.restore_whole_model(finished=self.lightning_module.trainer.state.status != "interrupted")
            self._pipeline = None
        super().teardown()

    # ---------------------------------------------------------------- steps: through the pipeline
    @override
    def training_step(self, *args, **kwargs):
        return self._step("training_step", self.precision_plugin.train_step_context, args, kwargs)

    @override
    def validation_step(self, *args, **kwargs):
        return self._step("validation_step", self.precision_plugin.val_step_context, args, kwargs)

    @override
    def test_step(self, *args, **kwargs):
        return self._step("test_step", self.precision_plugin.test_step_context, args, kwargs)

    @override
    def predict_step(self, *args, **kwargs):
        return self._step("predict_step", self.precision_plugin.predict_step_context, args, kwargs)

    def _step(self, hook: str, context, args: tuple, kwargs: dict):
        if self._pipeline is None:  # (before the process group: one process)
            return getattr(super(), hook)(*args, **kwargs)
        with context():
            return self._pipeline.run(hook, args, kwargs, train=hook == "training_step")

    @override
    def backward(self, closure_loss, optimizer, *args, **kwargs):
        """The schedule ran the backward inside the training step; here its gradients join the parameters' (after
        Lightning zeroed them), between the hooks that run around a backward."""
        if self._pipeline is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        self._pipeline.add_gradients()
        return self.precision_plugin.post_backward(closure_loss, self.lightning_module)

    # ---------------------------------------------------------------- one full state dict in every checkpoint
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self._pipeline is None:
            return super().lightning_module_state_dict()
        return self._pipeline.gather(real(self.lightning_module.state_dict()))

    @override
    def load_optimizer_state_dict(self, checkpoint) -> None:
        """The full state, minus the parameters of other stages (which live on the ``meta`` device here)."""
        if self._pipeline is None:
            return super().load_optimizer_state_dict(checkpoint)
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"], strict=True):
            optimizer = getattr(optimizer, "_optimizer", optimizer)
            order = [p for group in optimizer.param_groups for p in group["params"]]
            mine = {i: s for i, s in state["state"].items() if i < len(order) and not order[i].is_meta}
            optimizer.load_state_dict({**state, "state": mine})  # onto each parameter's device
        return None

    @override
    def optimizer_state(self, optimizer) -> dict[str, Any]:
        if self._pipeline is None:
            return super().optimizer_state(optimizer)
        state = getattr(optimizer, "_optimizer", optimizer).state_dict()
        mine = {i: s for i, s in state["state"].items() if not any(is_meta(v) for v in s.values())}
        gathered = self._pipeline.gather(mine)
        return {"state": dict(sorted(gathered.items())), "param_groups": state["param_groups"]} if gathered else {}
