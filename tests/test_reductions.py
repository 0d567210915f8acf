"""The horovod strategy's reductions (app/strategies/reductions.py) against this file's own implementation of Horovod's
rules.

tests/reduction_run.py trains a small float64 network under mpirun with each reduction and records, on every rank,
its start weights, the sample ids of its batches and its final weights. The tests here replay those batches on
one process per rank, reduce with the formulas written out below, and compare.
"""

import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from app.errors import UserError
from app.strategies import HorovodStrategy
from app.strategies.reductions import adasum, segment_index
from tests import reduction_run, warm
from tests.conftest import ROOT, TINY_CONFIG, run_cli
from tests.parity import CASES, MPI_ENV, MPIRUN, REFERENCE
from tests.parity import relative_error as relative_error_of

# float64 end to end: the strategy and the replay differ only in summation order (~1e-16).
TOLERANCE = 1e-10


def adasum_pair(a: list[torch.Tensor], b: list[torch.Tensor]) -> list[torch.Tensor]:
    """Horovod's Adasum of two ranks' tensors, one tensor at a time, written out in Python floats."""
    out = []
    for x, y in zip(a, b, strict=True):
        dot, xx, yy = float((x * y).sum()), float((x * x).sum()), float((y * y).sum())
        cx = 1.0 - dot / xx * 0.5 if xx >= 1e-8 else 1.0
        cy = 1.0 - dot / yy * 0.5 if yy >= 1e-8 else 1.0
        out.append(cx * x + cy * y)
    return out


def adasum_tree(per_rank: list[list[torch.Tensor]], wire: torch.dtype | None = None) -> list[torch.Tensor]:
    """Ranks 0+1, 2+3, ..., then the pairs' results, until one is left; with a wire dtype, inputs rounded to it."""
    level = per_rank
    while len(level) > 1:
        if wire is not None:
            level = [[t.to(wire).double() for t in tensors] for tensors in level]
        level = [adasum_pair(level[i], level[i + 1]) for i in range(0, len(level), 2)]
    return level[0]


def replay(records: list[dict], op: str, accumulate: int = 1, wire: torch.dtype | None = None) -> dict:
    """Train one copy of the network per rank on that rank's recorded batches, and reduce as ``op`` says."""
    data = reduction_run.Samples()
    nets = [reduction_run.Net().double() for _ in records]
    for net in nets:
        net.load_state_dict(records[0]["start"])
    optimizers = [torch.optim.SGD(n.parameters(), lr=reduction_run.LR, momentum=reduction_run.MOMENTUM) for n in nets]
    for step in range(reduction_run.STEPS):
        start = [p.detach().clone() for p in nets[0].parameters()]
        for net, optimizer, record in zip(nets, optimizers, records, strict=True):
            optimizer.zero_grad()
            for micro in range(accumulate):
                ids = record["batches"][step * accumulate + micro]
                loss = nn.functional.cross_entropy(net(data.x[ids]), data.y[ids]) / accumulate
                loss.backward()
        with torch.no_grad():
            if op == "average":
                for params in zip(*(n.parameters() for n in nets), strict=True):
                    mean = sum(p.grad for p in params) / len(params)
                    for p in params:
                        p.grad = mean.clone()
                for optimizer in optimizers:
                    optimizer.step()
            else:
                for optimizer in optimizers:
                    optimizer.step()
                deltas = [[p - s for p, s in zip(n.parameters(), start, strict=True)] for n in nets]
                combined = adasum_tree(deltas, wire)
                for net in nets:
                    for p, s, d in zip(net.parameters(), start, combined, strict=True):
                        p.copy_(s + d)
    return nets[0].state_dict()


def relative_error(got: dict, want: dict) -> float:
    diff = sum(((got[k] - want[k]) ** 2).sum() for k in want)
    return float((diff / sum((want[k] ** 2).sum() for k in want)).sqrt())


@pytest.fixture(scope="module", params=[2, 4], ids=["2 ranks", "4 ranks"])
def recorded(request, tmp_path_factory):
    """One mpirun launch per world size runs every variant of tests/reduction_run.py (once per worker: pytest may
    set this fixture up again when the tests of the two sizes interleave)."""
    ranks = request.param
    if ranks not in _LAUNCHED:
        out = tmp_path_factory.mktemp(f"reductions{ranks}")
        cmd = [str(MPIRUN), "-np", str(ranks), "--oversubscribe", sys.executable, str(ROOT / "tests/reduction_run.py")]
        env = {**os.environ, **MPI_ENV, "PYTHONPATH": str(ROOT)}
        result = subprocess.run([*cmd, str(out)], capture_output=True, text=True, timeout=600, env=env)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
        _LAUNCHED[ranks] = out

    def load(variant: str) -> list[dict]:
        return [torch.load(_LAUNCHED[ranks] / f"{variant}.rank{r}.pt", weights_only=True) for r in range(ranks)]

    return load


_LAUNCHED: dict[int, object] = {}


def assert_ranks_agree(records: list[dict]) -> None:
    for record in records[1:]:
        for key, value in records[0]["start"].items():
            assert torch.equal(record["start"][key], value), f"start weights differ: {key}"
        for key, value in records[0]["final"].items():
            assert torch.equal(record["final"][key], value), f"final weights differ between ranks: {key}"
    assert len({tuple(torch.cat(r["batches"]).tolist()) for r in records}) == len(records), "ranks shared batches"


@pytest.mark.slow
def test_fused_average_matches_per_rank_replay(recorded):
    records = recorded("average_fused")
    assert_ranks_agree(records)
    assert relative_error(records[0]["final"], replay(records, "average")) < TOLERANCE


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["adasum", "adasum_accumulate"])
def test_adasum_matches_the_formula_and_is_not_averaging(recorded, variant):
    records = recorded(variant)
    accumulate = reduction_run.VARIANTS[variant].get("accumulate", 1)
    assert_ranks_agree(records)
    assert relative_error(records[0]["final"], replay(records, "adasum", accumulate)) < TOLERANCE
    # the same batches averaged end elsewhere: Adasum is not a rescaled mean
    assert relative_error(records[0]["final"], replay(records, "average", accumulate)) > 1e-2


@pytest.mark.slow
def test_adasum_with_bf16_compression_rounds_what_travels(recorded):
    records = recorded("adasum_bf16")
    assert_ranks_agree(records)
    exact = replay(records, "adasum")
    rounded = replay(records, "adasum", wire=torch.bfloat16)
    # what the strategy did is the replay with bf16 on the wire, not the exact one
    assert relative_error(records[0]["final"], rounded) < TOLERANCE
    assert relative_error(records[0]["final"], exact) > 100 * TOLERANCE


def test_adasum_formula_per_tensor():
    torch.manual_seed(0)
    a, b = torch.randn(8, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    got = adasum(a, b, [3, 5])
    want = torch.cat(adasum_pair([a[:3], a[3:]], [b[:3], b[3:]]))
    torch.testing.assert_close(got, want, rtol=1e-14, atol=1e-14)
    # whole-vector Adasum is not the same thing: the coefficients are per tensor
    assert not torch.allclose(got, adasum(a, b, [8]))
    # AdasumDelta keeps the element -> tensor index of its model and passes it in: the same result
    assert torch.equal(adasum(a, b, [3, 5], segment_index([3, 5], a.device)), got)


def test_adasum_adds_orthogonal_vectors_and_keeps_equal_ones():
    x, y = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 2.0])
    assert torch.equal(adasum(x, y, [2]), torch.tensor([1.0, 2.0]))
    assert torch.equal(adasum(y, y, [2]), y)
    tiny = torch.tensor([1e-5, 0.0])  # squared norm below 1e-8: coefficient 1, no division by ~0
    assert torch.allclose(adasum(tiny, y, [2]), tiny + y)


@pytest.fixture
def group_of_one():
    """A real gloo process group of one (the tests' own unless one is already up)."""
    import torch.distributed as dist
    from lightning.fabric.plugins.environments.lightning import find_free_network_port

    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{find_free_network_port()}", rank=0, world_size=1)
    yield
    if own_group:
        dist.destroy_process_group()


@pytest.fixture
def allreduced(monkeypatch) -> list[int]:
    """The element count of each allreduce started from now on (the hook's, through torch.distributed)."""
    import torch.distributed as dist

    sizes: list[int] = []
    all_reduce = dist.all_reduce

    def recording(tensor, *args, **kwargs):
        sizes.append(tensor.numel())
        return all_reduce(tensor, *args, **kwargs)

    monkeypatch.setattr(dist, "all_reduce", recording)
    return sizes


@pytest.mark.parametrize(("fusion_mb", "buckets"), [(25.0, "several"), (64.0, "one"), (0.0, "one per gradient")])
def test_fusion_mb_sizes_the_buckets_that_start_during_backward(group_of_one, allreduced, fusion_mb, buckets):
    """ResNet-18's 44.7 MB of gradients: at the default (DDP's 25 MiB, a small first bucket) the head's gradients go
    first and the rest of backward runs beside the allreduces (issue 35, item 10); 64 MiB is one bucket, sent after
    the last gradient; 0 sends each gradient alone. Counted on the third step: DDP builds its buckets in the order
    of the first backward."""
    import torchvision

    from app.strategies.reductions import fused_allreduce

    net = torchvision.models.resnet18(num_classes=10)
    model = fused_allreduce(net, world_size=1, fusion_mb=fusion_mb)
    for _ in range(3):
        allreduced.clear()
        model(torch.randn(2, 3, 32, 32)).sum().backward()
    params = list(net.parameters())
    assert sum(allreduced) == sum(p.numel() for p in params)
    if buckets == "one":
        assert len(allreduced) == 1
    elif buckets == "one per gradient":
        assert len(allreduced) == len(params)
    else:
        assert len(allreduced) == 3 and allreduced[0] < sum(allreduced) / 4, allreduced


def test_adasum_needs_a_power_of_two_number_of_ranks():
    from lightning.pytorch import Trainer

    with pytest.raises(UserError, match=r"op=adasum .* power-of-two .* this run has 3: use 2 or 4 ranks"):
        Trainer(accelerator="cpu", devices=3, strategy=HorovodStrategy(op="adasum"), logger=False)


@pytest.mark.parametrize(
    ("kwargs", "flag"),
    [
        ({"op": "median"}, "--trainer.strategy.op='median' must be one of average, sum, adasum"),
        ({"op": "adasum", "gradient_predivide_factor": 2.0}, "gradient_predivide_factor .* unless"),
        ({"fusion_mb": -1}, "--trainer.strategy.fusion_mb=-1 must be a finite number >= 0"),
    ],
)
def test_reduction_options_are_checked(kwargs, flag):
    with pytest.raises(UserError, match=flag):
        HorovodStrategy(**kwargs)


# ------------------------------------------------------------------------------------- DDP communication hooks
# fp16/bf16 hooks round each averaged gradient to the wire dtype once per step: a relative error of at most u (unit
# roundoff: 2^-11 for fp16, 2^-8 for bf16) per update, so after STEPS steps the weights are within STEPS * u of one
# device (updates are small next to the weights). A hook that did nothing would equal the exact ddp run instead.
@pytest.mark.slow
@pytest.mark.parametrize(("hook", "unit_roundoff"), [("fp16", 2.0**-11), ("bf16", 2.0**-8)])
def test_ddp_compression_hook_on_cpu_is_within_its_rounding(parity, hook, unit_roundoff):
    reference = parity("reference", *REFERENCE)
    exact = parity("ddp", *CASES["ddp"])
    compressed = parity(f"ddp_{hook}_comm_hook", *CASES["ddp"], "--comm-hook", hook)
    error = relative_error_of(compressed, reference)
    assert error < reference["global_step"] * unit_roundoff
    assert error > 1000 * relative_error_of(exact, reference)  # exact ddp: ~1e-17


@pytest.mark.slow
def test_powersgd_reaches_the_accuracy_of_uncompressed_ddp(parity):
    """150 steps of tests/tiny.py's task, 1000 validation images: PowerSGD at rank 1 (the rank that compresses this
    small network's matrices: torch skips a matrix that rank r would shrink less than 2x) ends within 0.02 of plain
    allreduce (measured 0.967 vs 0.966). Plain allreduce over 2 ranks at batch 16 is one device at batch 32 (the
    parity tests prove it), so the reference runs in this process."""
    common = ["--steps", "150", "--lr", "0.02", "--precision", "32-true", "--val-size", "1000", "--train-size", "4800"]
    plain = parity("one_device_150_steps", "--devices", "1", "--batch-size", "32", *common)
    ddp = ["--strategy", "ddp", "--devices", "2", "--batch-size", "16", *common]
    powersgd = parity("ddp_powersgd_150_steps", *ddp, "--comm-hook", "powersgd", "--powersgd-rank", "1")
    assert plain["metrics"]["val/acc"] > 0.9  # trained far enough for the comparison to mean something
    assert abs(powersgd["metrics"]["val/acc"] - plain["metrics"]["val/acc"]) < 0.02
    assert relative_error_of(powersgd, plain) > 1e-3  # and it did compress: another trajectory


def test_ddp_comm_hook_is_refused_with_other_strategies():
    from lightning.pytorch import Trainer
    from lightning.pytorch.demos.boring_classes import BoringModel

    from app.callbacks import DDPCommHook

    trainer = Trainer(
        accelerator="cpu", devices=2, strategy="dp", callbacks=[DDPCommHook()], logger=False, max_epochs=1
    )
    with pytest.raises(UserError, match="DDPCommHook works with --trainer.strategy=ddp or ddp_spawn, not DataParallel"):
        trainer.fit(BoringModel())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"hook": "int8"}, "--trainer.callbacks.hook='int8' must be one of fp16, bf16, powersgd"),
        ({"hook": "powersgd", "powersgd_start_iter": 1}, "powersgd_start_iter=1 must be >= 2"),
    ],
)
def test_ddp_comm_hook_options_are_checked(kwargs, message):
    from app.callbacks import DDPCommHook

    with pytest.raises(UserError, match=message):
        DDPCommHook(**kwargs)


@pytest.mark.parametrize("set_to_none", [True, False], ids=["grads dropped", "grads zeroed"])
def test_reduced_gradients_are_scaled_bucket_views_either_way_an_optimizer_zeroes(group_of_one, set_to_none):
    """One rank: the reduced gradient is the local one times the post-scale (an average over "2": halved), a view of
    DDP's bucket, whether the optimizer drops gradients or zeroes them in place."""
    from app.strategies.reductions import fused_allreduce

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    params = list(net.parameters())
    model = fused_allreduce(net, world_size=2, fusion_mb=0.0001)
    optimizer = torch.optim.SGD(params, lr=0.1)
    for _ in range(3):
        x = torch.randn(5, 3)
        optimizer.zero_grad(set_to_none=set_to_none)
        expected = torch.autograd.grad(net(x).square().sum(), params)
        model(x).square().sum().backward()
        for param, grad in zip(params, expected, strict=True):
            torch.testing.assert_close(param.grad, grad / 2)
        assert all(p.grad._base is not None for p in params)  # views: no copy back
        optimizer.step()


def test_a_parameter_without_gradient_needs_find_unused_parameters(group_of_one):
    """DDP's rule, now the horovod strategy's: a parameter that gets no gradient fails the next step with a message
    naming find_unused_parameters (--trainer.strategy.find_unused_parameters=true), which lets it be."""
    from app.strategies.reductions import fused_allreduce

    def two_steps(find_unused_parameters: bool) -> None:
        heads = nn.ModuleDict({"used": nn.Linear(3, 2), "unused": nn.Linear(3, 2)})
        model = fused_allreduce(_UsesOneHead(heads), world_size=2, find_unused_parameters=find_unused_parameters)
        for _ in range(2):
            model(torch.randn(4, 3)).sum().backward()
        assert heads["used"].weight.grad is not None and heads["unused"].weight.grad is None

    two_steps(find_unused_parameters=True)
    with pytest.raises(RuntimeError, match="find_unused_parameters"):
        two_steps(find_unused_parameters=False)


class _UsesOneHead(nn.Module):
    def __init__(self, heads: nn.ModuleDict) -> None:
        super().__init__()
        self.heads = heads

    def forward(self, x):
        return self.heads["used"](x)


@pytest.mark.parametrize(("compression", "predivide"), [("none", 1.0), ("bf16", 1.0), ("none", 4.0)])
def test_channels_last_gradients_keep_their_parameters_strides(group_of_one, compression, predivide):
    """A channels_last convolution's reduced gradient has its parameter's strides (SGD's foreach kernels then keep
    the layout), with the right values, through a compressed wire too, and with a predivide factor (issue 35,
    item 11)."""
    from app.strategies.reductions import fused_allreduce

    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 3)).to(memory_format=torch.channels_last)
    params = list(net.parameters())
    model = fused_allreduce(net, world_size=2, compression=compression, predivide=predivide)
    x = torch.randn(2, 3, 9, 9).contiguous(memory_format=torch.channels_last)
    expected = torch.autograd.grad(net(x).square().sum(), params)
    model(x).square().sum().backward()
    tolerance = {"rtol": 1e-2, "atol": 1e-2} if compression == "bf16" else {}
    for param, grad in zip(params, expected, strict=True):
        assert param.grad.stride() == param.stride(), (param.shape, param.grad.stride(), param.stride())
        torch.testing.assert_close(param.grad, grad / 2, **tolerance)
        if compression == "bf16":  # what travelled was rounded to bf16: not the exact half
            assert not torch.equal(param.grad, grad / 2)


@pytest.mark.parametrize(
    "flags",
    [
        ["--trainer.strategy=horovod", "--trainer.strategy.fusion_mb=-1"],
        [
            "--trainer.strategy=horovod",
            "--trainer.strategy.op=adasum",
            "--trainer.strategy.gradient_predivide_factor=2",
        ],
        ["--trainer.callbacks+=app.callbacks.DDPCommHook", "--trainer.callbacks.powersgd_start_iter=1"],
    ],
    ids=["fusion_mb", "predivide with adasum", "powersgd_start_iter"],
)
def test_a_refused_option_is_one_line_through_the_cli(flags, workdir, capsys):
    """A class refusing a value while the CLI builds it: jsonargparse wraps the message in its own union error;
    the user gets ours, one line, exit 2, and no run folder."""
    with pytest.raises(SystemExit) as exit_info:
        run_cli("fit", "--config", str(TINY_CONFIG), *flags)
    assert exit_info.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and lines[0].startswith(("error: --trainer.strategy.", "error: --trainer.callbacks."))
    assert "Union" not in lines[0] and not (workdir / "lightning_logs").exists()


@pytest.mark.slow
def test_bad_input_found_in_the_self_launched_horovod_ranks_is_one_line(tmp_path):
    """DDPCommHook under horovod is refused inside the ranks (where the strategy is known): the launcher prints the
    ranks' message once, exit 2, with no traceback from any rank or from the launcher."""
    cmd = [sys.executable, str(ROOT / "cli.py"), "fit", "--config", str(TINY_CONFIG)]
    cmd += ["--trainer.strategy=horovod", "--trainer.devices=2", "--trainer.callbacks+=app.callbacks.DDPCommHook"]
    environ = {**os.environ, **MPI_ENV, "PYTHONPATH": str(ROOT)}
    result = warm.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path, env=environ)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        "error: app.callbacks.DDPCommHook works with --trainer.strategy=ddp or ddp_spawn, not HorovodStrategy; the "
        "horovod strategy compresses with --trainer.strategy.compression=fp16|bf16"
    ]


def test_per_tensor_sums_are_the_tensors_sums():
    from app.strategies.reductions import per_tensor_sums, segment_index

    torch.manual_seed(0)
    sizes = [5, 1, 300, 7]
    x = torch.randn(sum(sizes), dtype=torch.float64)
    sums = per_tensor_sums(x, sizes, segment_index(sizes, x.device))
    torch.testing.assert_close(sums, torch.stack([t.sum() for t in x.split(sizes)]), rtol=1e-12, atol=1e-12)
