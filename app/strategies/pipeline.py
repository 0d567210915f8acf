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
LightningModule's only top-level submodule that holds parameters (the example's ``net``). Its layers are an
``nn.Sequential``'s children, or whatever the network's own ``pipeline_layers()`` returns (the example's ResNet
lists its stem, residual blocks, pool and head); they are dealt to the stages in order, balanced by parameter count
unless ``balance`` gives the number of layers per stage. Each process keeps only its stage's layers (the others are
freed, on the ``meta`` device), their gradients and optimizer state.

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

Rank 0 says in one line which layers went to which stage, with their parameters (:func:`stages_line`).

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
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn
from torch.distributed import default_pg_timeout
from typing_extensions import override

from app.errors import UserError
from app.strategies.dp import batch_len, combine_outputs, split_batch
from app.strategies.model_parallel import SplitModelStrategy
from app.task import spec_of

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
    float16_reason = "the stages' backward here"

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
            process_group_backend, timeout,
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
        self._pipeline: _Pipeline | None = None
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
            self._pipeline = _Pipeline(self, model)
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
        return self._pipeline.gather(_real(self.lightning_module.state_dict()))

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
        mine = {i: s for i, s in state["state"].items() if not any(_is_meta(v) for v in s.values())}
        gathered = self._pipeline.gather(mine)
        return {"state": dict(sorted(gathered.items())), "param_groups": state["param_groups"]} if gathered else {}


class _Captured(Exception):
    """Raised by the network's stand-in: the step called the network with these arguments."""

    def __init__(self, args: tuple, kwargs: dict) -> None:
        super().__init__()
        self.args, self.kwargs = args, kwargs


class _Pipeline:
    """The stages of one process: its layers, its process groups, its schedules, and the steps run through them."""

    def __init__(self, strategy: PipelineStrategy, model: nn.Module) -> None:
        self.strategy, self.model = strategy, model
        self.net = network_of(model)
        layers = layers_of(self.net)
        stages = strategy.stages
        if stages > len(layers):
            raise UserError(
                f"--trainer.strategy=pipeline: {stages} stages, but the network has {len(layers)} layers to deal out; "
                f"use --trainer.strategy.stages <= {len(layers)} (or more devices as replicas)"
            )
        counts = strategy.balance or balanced(layers, stages)
        if sum(counts) != len(layers) or len(counts) != stages:
            raise UserError(
                f"--trainer.strategy.balance={counts}: give {stages} numbers of layers (one per stage) that add up "
                f"to the network's {len(layers)} layers"
            )
        rank_zero_info(stages_line(self.net, layers, counts, strategy.world_size // stages))
        start = sum(counts[: strategy.stage])
        self.layers = layers[start : start + counts[strategy.stage]]
        self.module = nn.Sequential(*self.layers)  # this stage's layers: the same modules, not copies
        for layer in layers:
            if not any(layer is own for own in self.layers):
                layer.to("meta")  # another stage's: freed here
        # every rank creates every group, in the same order
        size, world = stages, strategy.world_size
        self.pipe_ranks = [list(range(r * size, (r + 1) * size)) for r in range(world // size)]
        self.replica_ranks = [list(range(s, world, size)) for s in range(size)]
        groups = [dist.new_group(ranks) for ranks in self.pipe_ranks]
        replicas = [dist.new_group(ranks) for ranks in self.replica_ranks]
        self.group = groups[strategy.replica]
        self.replicas = replicas[strategy.stage] if world // size > 1 else None
        self.first, self.last = strategy.stage == 0, strategy.stage == size - 1
        self.last_rank = self.pipe_ranks[strategy.replica][-1]
        if self.replicas is not None:  # the replicas of a stage start from the same weights, as ddp's do
            for tensor in [*self.module.parameters(), *self.module.buffers()]:
                dist.broadcast(tensor.data, src=self.replica_ranks[strategy.stage][0], group=self.replicas)
        self._schedules: dict[tuple, Any] = {}
        self._loss = None  # this step's loss function (the last stage's), which the schedules call
        self.pending: list = []  # (parameter, gradient) of the last training step, for backward() to add
        self._checked = False

    # ---------------------------------------------------------------- one step
    def run(self, hook: str, args: tuple, kwargs: dict, train: bool) -> Any:
        module, batch = self.strategy.lightning_module, args[0]
        size = batch_len(batch)
        count = self._microbatches(size, train)
        parts = split_batch(batch, count)
        step = getattr(module, hook)
        inputs = None
        if self.first:  # the network's input, as the step builds it
            inputs = [self._capture(step, (part, *args[1:]), kwargs) for part in parts]
        schedule = self._schedule(count, size // count, train)
        results: list[Any] = [None] * count
        scale = 1 / module.trainer.accumulate_grad_batches

        targets = [torch.tensor(i) for i in range(count)]  # micro-batch numbers, as the schedule wants tensors

        def loss_fn(output, target):  # the last stage: the step on micro-batch ``target`` with the network's output
            if not any(target is t for t in targets):  # the stage's first call: it learns the gradients' shapes
                return sum(o.sum() for o in _tensors(output))
            index = int(target)
            results[index] = self._given(step, output, (parts[index], *args[1:]), kwargs)
            loss = _loss_of(results[index])
            results[index] = _detached(results[index])
            return loss * (batch_len(parts[index]) / size) * scale

        arg_mbs = [tuple(a for a in captured[0]) for captured in inputs] if inputs else [() for _ in parts]
        kwarg_mbs = [captured[1] for captured in inputs] if inputs else [{} for _ in parts]
        if train:
            # Lightning zeroes the gradients between the step and its backward: the schedule's (backward included)
            # are kept aside until then, and added in backward(); the ones accumulated so far stay
            parameters = list(self.module.parameters())
            kept = [p.grad for p in parameters]
            for parameter in parameters:
                parameter.grad = None
            self._loss = loss_fn
            try:
                output = schedule.step(arg_mbs=arg_mbs, kwarg_mbs=kwarg_mbs, target_mbs=targets)
            finally:
                self._loss = None
                self.pending = [(p, p.grad) for p in parameters]
                for parameter, grad in zip(parameters, kept, strict=True):
                    parameter.grad = grad
        else:
            with torch.no_grad():
                output = schedule.eval(arg_mbs=arg_mbs, kwarg_mbs=kwarg_mbs)
        # every stage runs the step on the network's output, so every process logs what the last stage computed
        output = self._from_last_stage(output)
        if not (train and self.last):
            chunks = _split_output(output, count)
            with torch.no_grad():
                results = [self._given(step, chunks[i], (parts[i], *args[1:]), kwargs) for i in range(count)]
        return combine_outputs(results, [batch_len(p) for p in parts], self.strategy.root_device)

    def _microbatches(self, size: int, train: bool) -> int:
        wanted = self.strategy.microbatches if train else 1
        if train and not self._checked:
            self._checked = True
            if size % wanted:
                stages = self.strategy.stages
                raise UserError(
                    f"--trainer.strategy.microbatches={wanted} does not divide a pipeline's batch of {size} samples "
                    f"(--data.batch_size={size // stages} per device x {stages} stages); give microbatches that "
                    f"divide {size}, or a batch size that makes it a multiple of {wanted}"
                )
        return max(n for n in range(1, min(wanted, size) + 1) if size % n == 0)

    def _schedule(self, count: int, part: int, train: bool):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        key = (count, part, train)
        if key not in self._schedules:
            stage = PipelineStage(
                self.module, self.strategy.stage, self.strategy.stages, self.strategy.root_device, group=self.group
            )
            use_1f1b = train and self.strategy.schedule == "1f1b" and count >= self.strategy.stages
            kind = Schedule1F1B if use_1f1b else ScheduleGPipe
            loss_fn = (lambda output, index: self._loss(output, index)) if train else None
            self._schedules[key] = kind(stage, count, loss_fn=loss_fn, scale_grads=False)
        return self._schedules[key]

    def _capture(self, step, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        def stand_in(*a, **k):
            raise _Captured(a, k)

        self.net.forward = stand_in
        try:
            with _no_logging(self.strategy.lightning_module):
                step(*args, **kwargs)
        except _Captured as captured:
            return captured.args, captured.kwargs
        finally:
            del self.net.forward
        raise UserError(
            f"--trainer.strategy=pipeline: {type(self.strategy.lightning_module).__name__}'s step never called its "
            f"network ({type(self.net).__name__}); name the network the step calls with TaskSpec(layers=...)"
        )

    def _given(self, step, output, args: tuple, kwargs: dict) -> Any:
        self.net.forward = lambda *a, **k: output
        try:
            return step(*args, **kwargs)
        finally:
            del self.net.forward

    def _from_last_stage(self, output):
        if len(self.pipe_ranks[0]) == 1:
            return output
        box = [_to(output, "cpu") if self.last else None]
        dist.broadcast_object_list(box, src=self.last_rank, group=self.group)
        return _to(box[0], self.strategy.root_device)

    def add_gradients(self) -> None:
        """The last step's gradients (averaged over the stage's replicas) onto the parameters' own."""
        replicas = len(self.replica_ranks[0])
        for parameter, grad in self.pending:
            if grad is None:
                continue
            if self.replicas is not None:
                dist.all_reduce(grad, group=self.replicas)
                grad /= replicas
            parameter.grad = grad if parameter.grad is None else parameter.grad + grad
        self.pending = []

    # ---------------------------------------------------------------- checkpoints
    def gather(self, mine: dict) -> dict:
        """Rank 0: the union of the first replica's stages' entries; the other ranks: {}."""
        first_replica = self.strategy.replica == 0
        everyone: list = [None] * self.strategy.world_size
        dist.all_gather_object(everyone, _to(mine, "cpu") if first_replica else {})
        if not self.strategy.is_global_zero:
            return {}
        merged: dict = {}
        for part in everyone:
            merged.update(part)
        return merged

    def restore_whole_model(self, finished: bool) -> None:
        """After the run: every process gets the whole trained network back (when the run finished; otherwise the
        other stages' layers come back uninitialized: the checkpoint holds the state)."""
        everyone: list = [None] * self.strategy.world_size
        if finished:
            dist.all_gather_object(everyone, _to(_real(self.model.state_dict()), "cpu"))
        for layer in layers_of(self.net):
            if any(t.is_meta for t in [*layer.parameters(), *layer.buffers()]):
                layer.to_empty(device=self.strategy.root_device)
        if finished:
            whole = {k: v for part in everyone for k, v in part.items()}
            self.model.load_state_dict(whole, strict=False)
        for optimizer in self.strategy.optimizers:
            for parameter in list(optimizer.state):
                if any(_is_meta(v) for v in optimizer.state[parameter].values()):
                    del optimizer.state[parameter]


# -------------------------------------------------------------------- the network and its layers
def network_of(model: nn.Module) -> nn.Module:
    """The module the pipeline cuts: ``spec.layers`` names it, else the only top-level child holding parameters."""
    path = spec_of(model).layers
    if path:
        try:
            return model.get_submodule(path)
        except AttributeError:
            raise UserError(f"{type(model).__name__}.spec.layers={path!r} names no submodule") from None
    own = [name for name, _ in model.named_parameters(recurse=False)]
    holders = [name for name, child in model.named_children() if any(True for _ in child.parameters())]
    if own or len(holders) != 1:
        raise UserError(
            f"--trainer.strategy=pipeline cuts one network into stages, but {type(model).__name__} holds parameters "
            f"in {', '.join(own + holders) or 'none of its submodules'}; name the network with TaskSpec(layers=...)"
        )
    return model.get_submodule(holders[0])


def layers_of(net: nn.Module) -> list[nn.Module]:
    """The network's layers in the order its forward runs them (their composition is the forward)."""
    if hasattr(net, "pipeline_layers"):
        return list(net.pipeline_layers())
    if isinstance(net, nn.Sequential):
        return list(net)
    raise UserError(
        f"--trainer.strategy=pipeline: {type(net).__name__} is not an nn.Sequential, so its layers are unknown; give "
        "it a pipeline_layers() method that returns them in the order its forward runs them"
    )


def stages_line(net: nn.Module, layers: list[nn.Module], counts: list[int], replicas: int = 1) -> str:
    """Which layers went to which stage, by their names in the network (``pipeline: stage 0: conv1, ... | stage 1:
    ...``), and the parameters each stage holds: the default split balances those."""
    names = {id(module): name for name, module in net.named_modules() if name}
    parts, start = [], 0
    for stage, count in enumerate(counts):
        held = layers[start : start + count]
        label = ", ".join(names.get(id(layer)) or type(layer).__name__.lower() for layer in held)  # (the Flatten)
        parameters = sum(p.numel() for layer in held for p in layer.parameters())
        parts.append(f"stage {stage}: {label} ({parameters:,} parameters)")
        start += count
    layout = f" ({len(counts)} stages x {replicas} replicas)" if replicas > 1 else ""
    return f"pipeline{layout}: {' | '.join(parts)}"


def balanced(layers: list[nn.Module], stages: int) -> list[int]:
    """Layers per stage, in order, so that each stage's parameters come close to an equal share."""
    sizes = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    total, counts, start = sum(sizes), [], 0
    for stage in range(stages):
        left = stages - stage - 1  # stages after this one, each needing a layer
        end, held = start + 1, sizes[start]
        target = total * (stage + 1) / stages
        while end < len(layers) - left and sum(sizes[:end]) + sizes[end] / 2 <= target:
            held += sizes[end]
            end += 1
        if stage == stages - 1:
            end = len(layers)
        counts.append(end - start)
        start = end
    return counts


# -------------------------------------------------------------------- helpers
def _loss_of(result: Any) -> torch.Tensor:
    loss = result["loss"] if isinstance(result, dict) else result
    if not isinstance(loss, torch.Tensor):
        raise UserError("--trainer.strategy=pipeline: training_step must return the loss (a tensor, or a dict with it)")
    return loss


def _detached(result: Any) -> Any:
    return apply_to_collection(result, torch.Tensor, torch.Tensor.detach)


def _split_output(output: Any, count: int) -> list[Any]:
    if isinstance(output, torch.Tensor):
        return list(output.chunk(count))
    if isinstance(output, list | tuple):
        columns = [_split_output(o, count) for o in output]
        return [type(output)(c[i] for c in columns) for i in range(count)]
    return [output] * count


def _to(value: Any, device) -> Any:
    return apply_to_collection(value, torch.Tensor, lambda t: t.detach().to(device))


def _tensors(value: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    apply_to_collection(value, torch.Tensor, found.append)
    return found


def _is_meta(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_meta


def _real(state: dict) -> dict:
    return {k: v for k, v in state.items() if not _is_meta(v)}


class _no_logging:
    """``self.log`` does nothing inside: the step run only to find the network's input logs nothing."""

    def __init__(self, module) -> None:
        self.module = module

    def __enter__(self):
        self.module.log = self.module.log_dict = lambda *a, **k: None

    def __exit__(self, *exc):
        del self.module.log, self.module.log_dict
