"""The stages of ``strategy="pipeline"`` in one process (app/strategies/pipeline.py holds the strategy): which
layers this process keeps, its process groups and ``torch.distributed.pipelining`` schedules, and how a task's own
step runs through them: its input captured at the network's call, the micro-batches through the schedule, the step
run again on each micro-batch with the network's output given.

:func:`layers_of` finds the layers a network is cut into, :func:`balanced` deals them to the stages by parameter
count, and :func:`stages_line` is rank 0's line that says which went where.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn

from app.errors import UserError
from app.strategies.dp import batch_len, combine_outputs, split_batch
from app.task import layers_in_order, spec_of

if TYPE_CHECKING:
    from app.strategies.pipeline import PipelineStrategy


class _Captured(Exception):
    """Raised by the network's stand-in: the step called the network with these arguments."""

    def __init__(self, args: tuple, kwargs: dict) -> None:
        super().__init__()
        self.args, self.kwargs = args, kwargs


class PipelineStages:
    """The stages of one process: its layers, its process groups, its schedules, and the steps run through them."""

    def __init__(self, strategy: PipelineStrategy, model: nn.Module) -> None:
        self.strategy, self.model = strategy, model
        self.net = network_of(model)
        layers = layers_of(self.net, model)
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
            dist.all_gather_object(everyone, _to(real(self.model.state_dict()), "cpu"))
        for layer in layers_of(self.net, self.model):
            if any(t.is_meta for t in [*layer.parameters(), *layer.buffers()]):
                layer.to_empty(device=self.strategy.root_device)
        if finished:
            whole = {k: v for part in everyone for k, v in part.items()}
            self.model.load_state_dict(whole, strict=False)
        for optimizer in self.strategy.optimizers:
            for parameter in list(optimizer.state):
                if any(is_meta(v) for v in optimizer.state[parameter].values()):
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


def layers_of(net: nn.Module, model: nn.Module | None = None) -> list[nn.Module]:
    """The network's layers in the order its forward runs them (their composition is the forward), as the task's
    spec says (``TaskSpec.pipeline_layers``)."""
    layers = layers_in_order(model, net)
    if layers is None:
        raise UserError(
            f"--trainer.strategy=pipeline: {type(net).__name__} is not an nn.Sequential, so its layers are unknown; "
            "give it a pipeline_layers() method, or the task TaskSpec(pipeline_layers=...), that returns them in the "
            "order its forward runs them"
        )
    return layers


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


def is_meta(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_meta


def real(state: dict) -> dict:
    return {k: v for k, v in state.items() if not is_meta(v)}


class _no_logging:
    """``self.log`` does nothing inside: the step run only to find the network's input logs nothing."""

    def __init__(self, module) -> None:
        self.module = module

    def __enter__(self):
        self.module.log = self.module.log_dict = lambda *a, **k: None

    def __exit__(self, *exc):
        del self.module.log, self.module.log_dict
