"""How the horovod strategy combines the ranks' work: Horovod's reductions, over ``torch.distributed``.

- :func:`horovod_allreduce_hook`: average or sum of the gradients, as ``hvd.DistributedOptimizer`` does it, as a
  communication hook on DDP's reducer: its buckets are Horovod's Tensor Fusion (``HOROVOD_FUSION_THRESHOLD``, here
  ``fusion_mb``), each allreduced during backward as soon as all of its gradients are ready, in one fixed order.
- :class:`AdasumDelta`: Adasum (Maleki et al. 2020, ``op=hvd.Adasum``) of the weight deltas of a local optimizer
  step, combined by recursive distance-doubling: ranks 0+1, 2+3, ..., then the pairs' results, and so on.
- Compression: what travels is cast to a 16-bit wire dtype (``fp16``, ``bf16``), and computed on in the
  gradient's own dtype.

The tests check it against their own implementation of the formulas.
"""

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel

ReduceOp = Literal["average", "sum", "adasum"]
Compression = Literal["none", "fp16", "bf16"]
WIRE_DTYPES: dict[str, torch.dtype | None] = {"none": None, "fp16": torch.float16, "bf16": torch.bfloat16}
ADASUM_MIN_NORM_SQUARED = 1e-8  # below it a vector's coefficient is 1, as in Horovod (no division by ~0)
FUSION_MB = 25.0  # DDP's bucket_cap_mb; at this default the first bucket is 1 MiB (DDP's)


@dataclass(frozen=True)
class HorovodAllreduce:
    """The state of :func:`horovod_allreduce_hook`: what travels, and the scaling before and after the sum."""

    wire_dtype: torch.dtype | None
    prescale: float
    postscale: float

    @classmethod
    def of(cls, world_size: int, op: ReduceOp, compression: Compression, predivide: float) -> "HorovodAllreduce":
        if op not in ("average", "sum"):
            raise ValueError(f"HorovodAllreduce reduces by average or sum, not {op!r}")
        postscale = predivide / world_size if op == "average" else 1.0
        return cls(WIRE_DTYPES[compression], 1.0 / predivide, postscale)


def horovod_allreduce_hook(state: HorovodAllreduce, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
    """A DDP communication hook: Horovod's average or sum of one fusion bucket (its Tensor Fusion is DDP's bucket).

    The bucket is cast to the wire dtype (fp16/bf16 compression), scaled by ``1/predivide``, summed over the ranks,
    cast back to the gradients' dtype (one rounding) and scaled by ``predivide/size`` (average) or 1 (sum).
    """
    buffer = bucket.buffer()
    wire = buffer if state.wire_dtype is None else buffer.to(state.wire_dtype)
    if state.prescale != 1.0:
        wire.mul_(state.prescale)

    def finish(future: torch.futures.Future[list[Tensor]]) -> Tensor:
        reduced = future.value()[0]
        if reduced is not buffer:
            buffer.copy_(reduced)
        if state.postscale != 1.0:
            buffer.mul_(state.postscale)
        return buffer

    return dist.all_reduce(wire, async_op=True).get_future().then(finish)


def fused_allreduce(
    module: torch.nn.Module,
    world_size: int,
    op: ReduceOp = "average",
    compression: Compression = "none",
    predivide: float = 1.0,
    fusion_mb: float = FUSION_MB,
    find_unused_parameters: bool = False,
) -> DistributedDataParallel:
    """``module`` in DDP, its gradients reduced by :func:`horovod_allreduce_hook` in buckets of ``fusion_mb`` MiB.

    DDP's reducer starts each bucket's hook during backward as soon as the bucket is complete, in one fixed order on
    every rank, and waits for all of them before backward returns; under ``no_sync()`` it communicates nothing.
    Buffers are not broadcast at each forward (Horovod broadcasts them once, at start).

    (No ``from __future__ import annotations`` in this module: DDP checks the hook's annotations as objects.)
    """
    device = next(module.parameters()).device
    model = DistributedDataParallel(
        module,
        device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=None if fusion_mb == FUSION_MB else fusion_mb,  # None: DDP's 25 MiB with a first of 1 MiB
        forward_sync_buffers=False,
        init_sync=False,  # the strategy has broadcast rank 0's parameters and buffers
        gradient_as_bucket_view=True,
        find_unused_parameters=find_unused_parameters,
    )
    model.register_comm_hook(HorovodAllreduce.of(world_size, op, compression, predivide), horovod_allreduce_hook)
    return model


def segment_index(sizes: Sequence[int], device: torch.device) -> Tensor:
    """For each element of a flat vector made of tensors of ``sizes`` elements, the number of its tensor (int32)."""
    return torch.repeat_interleave(
        torch.arange(len(sizes), dtype=torch.int32, device=device),
        torch.tensor(sizes, device=device),
        output_size=sum(sizes),
    )


def adasum(a: Tensor, b: Tensor, sizes: Sequence[int], segment: Tensor | None = None) -> Tensor:
    """Adasum of two flat vectors made of tensors of ``sizes`` elements, tensor by tensor.

    Adasum(a, b) = (1 - a.b / (2|a|^2)) a + (1 - a.b / (2|b|^2)) b, with the dot products and squared norms in
    float64, and a coefficient of 1 for a vector whose squared norm is below 1e-8. Orthogonal vectors add up;
    equal ones give themselves (an average). ``segment``: :func:`segment_index` of ``sizes``, if the caller keeps it.
    """
    a64, b64 = a.double(), b.double()
    if segment is None:
        segment = segment_index(sizes, a.device)

    def per_tensor(x: Tensor) -> Tensor:
        return per_tensor_sums(x, sizes, segment)

    dot, a_sq, b_sq = per_tensor(a64 * b64), per_tensor(a64 * a64), per_tensor(b64 * b64)
    one = torch.ones_like(dot)
    a_coef = torch.where(a_sq >= ADASUM_MIN_NORM_SQUARED, 1 - dot / (2 * a_sq.clamp_min(ADASUM_MIN_NORM_SQUARED)), one)
    b_coef = torch.where(b_sq >= ADASUM_MIN_NORM_SQUARED, 1 - dot / (2 * b_sq.clamp_min(ADASUM_MIN_NORM_SQUARED)), one)
    return (a_coef[segment] * a64 + b_coef[segment] * b64).to(a.dtype)


def per_tensor_sums(x: Tensor, sizes: Sequence[int], segment: Tensor) -> Tensor:
    """The sum of each tensor's elements in a flat vector made of tensors of ``sizes`` elements.

    On the CPU one ``index_add_``; on a GPU ``index_add_`` adds with atomics, in an order that changes from run to
    run, so two partners of an Adasum exchange could round differently and their replicas drift apart: there each
    tensor is summed by its own reduction, whose order is fixed."""
    if x.device.type == "cpu":
        return torch.zeros(len(sizes), dtype=x.dtype, device=x.device).index_add_(0, segment, x)
    return torch.stack([chunk.sum() for chunk in x.split(list(sizes))])


def is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def adasum_allreduce_(
    flat: Tensor, sizes: Sequence[int], wire_dtype: torch.dtype | None = None, segment: Tensor | None = None
) -> None:
    """Replace ``flat`` on every rank of the default group by the Adasum of all ranks' ``flat``, in place.

    Recursive distance-doubling: at distance d = 1, 2, 4, ... each rank swaps its vector with rank ^ d and both
    compute Adasum(lower rank's, higher rank's) with sums in a fixed order (:func:`per_tensor_sums`), so partners hold
    bitwise-equal results. With a ``wire_dtype``
    both vectors are rounded to it before each exchange (each rank rounds its own too), for the same reason.
    Horovod splits the vectors in halves at each level to save bandwidth; this sends them whole.
    """
    rank, size = dist.get_rank(), dist.get_world_size()
    if not is_power_of_two(size):
        raise ValueError(f"Adasum needs a power-of-two number of ranks, not {size}")
    distance = 1
    while distance < size:
        peer = rank ^ distance
        mine = flat.to(wire_dtype) if wire_dtype is not None else flat.clone()
        theirs = torch.empty_like(mine)
        ops = [dist.P2POp(dist.isend, mine, peer), dist.P2POp(dist.irecv, theirs, peer)]
        for request in dist.batch_isend_irecv(ops):
            request.wait()
        mine, theirs = mine.to(flat.dtype), theirs.to(flat.dtype)
        if segment is None:
            segment = segment_index(sizes, flat.device)
        flat.copy_(adasum(mine, theirs, sizes, segment) if rank < peer else adasum(theirs, mine, sizes, segment))
        distance *= 2


class AdasumDelta:
    """Horovod's ``DistributedOptimizer(op=hvd.Adasum)``: every rank steps on its own gradients, then the ranks'
    weight changes are combined by Adasum, and every rank sets ``weights = start + Adasum(deltas)``.

    Optimizer state (momentum, Adam's moments) stays each rank's own, as in Horovod. With gradient accumulation a
    rank steps once per ``accumulate_grad_batches`` batches on its accumulated gradient, and the deltas of those
    steps are combined; nothing is communicated in between.
    """

    def __init__(self, compression: Compression = "none") -> None:
        self.wire_dtype = WIRE_DTYPES[compression]
        # Each element's tensor number, made once per set of tensors (the same at every step): one int32 per
        # parameter, instead of building it again at every exchange.
        self._segments: dict[tuple, Tensor] = {}

    @contextmanager
    def step(self, optimizer: torch.optim.Optimizer) -> Iterator[None]:
        params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
        start = [p.detach().clone() for p in params]
        yield
        with torch.no_grad():
            deltas = [p - s for p, s in zip(params, start, strict=True)]
            try:
                for dtype in {d.dtype for d in deltas}:  # one flat vector per dtype; Adasum stays per tensor
                    group = [i for i, d in enumerate(deltas) if d.dtype == dtype]
                    self._combine([deltas[i] for i in group])
            except BaseException:
                # A failed exchange (a rank died) leaves the weights of the last completed step, which a survivor
                # saves for a restart; only this rank's own optimizer state has moved on by the local step.
                for param, begin in zip(params, start, strict=True):
                    param.copy_(begin)
                raise
            for param, begin, delta in zip(params, start, deltas, strict=True):
                param.copy_(begin + delta)

    def _combine(self, deltas: list[Tensor]) -> None:
        sizes = [d.numel() for d in deltas]
        flat = torch.cat([d.reshape(-1) for d in deltas])
        key = (tuple(sizes), flat.device)
        if key not in self._segments:
            self._segments[key] = segment_index(sizes, flat.device)
        adasum_allreduce_(flat, sizes, self.wire_dtype, self._segments[key])
        for delta, chunk in zip(deltas, flat.split(sizes), strict=True):
            delta.copy_(chunk.view_as(delta))
