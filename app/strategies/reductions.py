"""How the horovod strategy combines the ranks' work: Horovod's reductions, over ``torch.distributed``.

- :class:`GradientAllreduce`: average or sum of the gradients, as ``hvd.DistributedOptimizer`` does it. Gradients
  are packed into fusion buckets (Horovod's Tensor Fusion, ``HOROVOD_FUSION_THRESHOLD``) in one fixed order, and a
  bucket's allreduce starts during backward as soon as all of its gradients are ready.
- :class:`AdasumDelta`: Adasum (Maleki et al. 2020, ``op=hvd.Adasum``) of the weight deltas of a local optimizer
  step, combined by recursive distance-doubling: ranks 0+1, 2+3, ..., then the pairs' results, and so on.
- Compression: what travels is cast to a 16-bit wire dtype (``fp16``, ``bf16``), and computed on in the
  gradient's own dtype.

The tests check it against their own implementation of the formulas.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor

ReduceOp = Literal["average", "sum", "adasum"]
Compression = Literal["none", "fp16", "bf16"]
WIRE_DTYPES: dict[str, torch.dtype | None] = {"none": None, "fp16": torch.float16, "bf16": torch.bfloat16}
ADASUM_MIN_NORM_SQUARED = 1e-8  # below it a vector's coefficient is 1, as in Horovod (no division by ~0)
# Bucket sizes, DDP's: 25 MiB (bucket_cap_mb), and a first bucket of 1 MiB (torch.distributed's
# _DEFAULT_FIRST_BUCKET_BYTES), so that the first allreduce starts after the last layers' few gradients instead of
# waiting for a whole bucket's worth of backward. A network smaller than one bucket (ResNet-18's 44.7 MB under
# Horovod's 64 MiB) otherwise communicates only after backward: no overlap at all.
FUSION_MB = 25.0
FIRST_BUCKET_MB = 1.0


def fusion_buckets(tensors: Sequence[Tensor], max_bytes: int, first_bytes: int | None = None) -> list[list[int]]:
    """Split ``tensors`` (in order) into runs of one dtype and device of at most ``max_bytes`` each; the first run
    of at most ``first_bytes`` (when smaller than ``max_bytes``).

    A tensor larger than its bucket's limit is a bucket of its own; ``max_bytes=0`` gives one bucket per tensor.
    """
    buckets: list[list[int]] = []
    size = 0
    for i, tensor in enumerate(tensors):
        nbytes = tensor.numel() * tensor.element_size()
        previous = tensors[buckets[-1][-1]] if buckets else None
        limit = min(max_bytes, first_bytes) if len(buckets) == 1 and first_bytes is not None else max_bytes
        if (
            previous is None
            or size + nbytes > limit
            or (previous.dtype, previous.device) != (tensor.dtype, tensor.device)
        ):
            buckets.append([])
            size = 0
        buckets[-1].append(i)
        size += nbytes
    return buckets


class _Bucket:
    """Gradients reduced together: one flat buffer, one allreduce.

    Without compression the reduced gradients are handed back as views of the buffer (as DDP's
    ``gradient_as_bucket_view``): no copy back. When they are still those views at the next step (an optimizer
    that zeroes gradients instead of dropping them), backward has accumulated into the buffer itself, and nothing
    needs packing either.
    """

    def __init__(self, params: list[Tensor], wire_dtype: torch.dtype | None) -> None:
        self.params = params
        self.sizes = [p.numel() for p in params]
        first = params[0]
        self.buffer = torch.empty(sum(self.sizes), dtype=wire_dtype or first.dtype, device=first.device)
        self.as_views = self.buffer.dtype == first.dtype
        # Each parameter's part of the buffer, with the parameter's own strides (channels_last convolutions too, as
        # DDP's bucket views): the optimizer's foreach kernels and its state then keep the parameter's layout.
        self.views = [_like(chunk, p) for p, chunk in zip(params, self.buffer.split(self.sizes), strict=True)]
        self.contiguous = all(p.is_contiguous() for p in params)  # buffer order is then the gradients' own
        self.ready = 0
        self.handle: Any = None

    def pack(self, prescale: float) -> None:
        for param in self.params:
            if param.grad is None:  # unused in this step: contributes zeros, and the optimizer gets the reduced sum
                param.grad = torch.zeros_like(param)
        if not (self.as_views and self._grads_are_views()):
            if not self.contiguous:  # each gradient into its view, in its parameter's memory order
                for param, view in zip(self.params, self.views, strict=True):
                    view.copy_(param.grad)
            elif self.as_views:
                torch.cat([param.grad.reshape(-1) for param in self.params], out=self.buffer)  # one copy in all
            else:
                self.buffer.copy_(torch.cat([param.grad.reshape(-1) for param in self.params]))  # to the wire dtype
        if prescale != 1.0:
            self.buffer.mul_(prescale)

    def unpack(self, postscale: float) -> None:
        if self.as_views:
            if postscale != 1.0:
                self.buffer.mul_(postscale)
            for param, view in zip(self.params, self.views, strict=True):
                param.grad = view
            return
        reduced = self.buffer.to(self.params[0].dtype)  # back to the gradient's dtype before scaling: one rounding
        if postscale != 1.0:
            reduced.mul_(postscale)
        for param, chunk in zip(self.params, reduced.split(self.sizes), strict=True):
            param.grad.copy_(_like(chunk, param))

    def _grads_are_views(self) -> bool:
        return all(p.grad is v for p, v in zip(self.params, self.views, strict=True))


def _like(chunk: Tensor, param: Tensor) -> Tensor:
    """``chunk`` (flat, ``param.numel()`` long) as a tensor of ``param``'s shape and, when ``param`` is dense in
    another memory order (channels_last), its strides."""
    if param.is_contiguous() or not _dense(param):
        return chunk.view(param.shape)
    return chunk.as_strided(param.shape, param.stride())


def _dense(tensor: Tensor) -> bool:
    """Whether the tensor's elements fill its memory without gaps or overlaps, in some order of its dimensions."""
    expected = 1
    for size, stride in sorted(zip(tensor.shape, tensor.stride(), strict=True), key=lambda pair: pair[1]):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


class GradientAllreduce:
    """Horovod's DistributedOptimizer mechanism: fused asynchronous allreduces of the gradients, started in backward.

    A hook on every parameter counts the gradients that backward has finished. Buckets are started in one fixed
    order (reverse registration order, roughly the order backward produces gradients), so every rank issues the
    same collectives in the same sequence even when its gradients become ready in a different order. A bucket that
    is complete early waits for its predecessors. :meth:`synchronize` starts what is left, waits for everything and
    writes the reduced gradients back.
    """

    def __init__(
        self,
        params: list[Tensor],
        world_size: int,
        op: ReduceOp = "average",
        compression: Compression = "none",
        predivide: float = 1.0,
        fusion_bytes: int = int(FUSION_MB * 2**20),
        first_bucket_bytes: int | None = int(FIRST_BUCKET_MB * 2**20),
    ) -> None:
        if op not in ("average", "sum"):
            raise ValueError(f"GradientAllreduce reduces by average or sum, not {op!r}")
        order = list(reversed(params))
        wire_dtype = WIRE_DTYPES[compression]
        runs = fusion_buckets(order, fusion_bytes, first_bucket_bytes)
        self.buckets = [_Bucket([order[i] for i in run], wire_dtype) for run in runs]
        self._bucket_of = {id(p): b for b, bucket in enumerate(self.buckets) for p in bucket.params}
        self.prescale = 1.0 / predivide
        self.postscale = predivide / world_size if op == "average" else 1.0
        self.enabled = True
        self._next = 0
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in params]

    def _on_grad_ready(self, param: Tensor) -> None:
        if not self.enabled:
            return
        self.buckets[self._bucket_of[id(param)]].ready += 1
        while self._next < len(self.buckets) and self.buckets[self._next].ready == len(self.buckets[self._next].sizes):
            self._start(self.buckets[self._next])
            self._next += 1

    def _start(self, bucket: _Bucket) -> None:
        bucket.pack(self.prescale)
        bucket.handle = dist.all_reduce(bucket.buffer, op=dist.ReduceOp.SUM, async_op=True)

    def synchronize(self) -> None:
        for bucket in self.buckets[self._next :]:
            self._start(bucket)
        for bucket in self.buckets:
            bucket.handle.wait()
            bucket.unpack(self.postscale)
            bucket.ready, bucket.handle = 0, None
        self._next = 0

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()


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
