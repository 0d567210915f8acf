"""The example task streamed from WebDataset-style tar shards (app/fashion_mnist/shards.py, ``cli.py shards``):
written whole or not at all, read back as written, one seeded order per epoch, and trained through ``cli.py`` under
ddp, stopped and resumed exactly."""

import re
import sys
import tarfile

import pytest
import torch

from app.errors import UserError
from app.fashion_mnist import synthetic
from app.fashion_mnist.shards import FashionMNISTShards, TarShards, decode, write_shards
from tests.conftest import ROOT
from tests.test_as_users_run_it import noise, run

SPLIT = {"val_size": 256, "seed": 42, "source": "synthetic"}


def test_shards_hold_the_images_as_written_and_each_epoch_is_one_seeded_order(tmp_path):
    images, labels = synthetic.generate(300, seed=5)
    write_shards(tmp_path / "shards", images, labels, SPLIT, per_shard=64)
    with tarfile.open(tmp_path / "shards" / "train-000000.tar") as tar:
        assert tar.getnames()[:4] == ["000000.png", "000000.cls", "000001.png", "000001.cls"]  # WebDataset's layout
    stream = TarShards(tmp_path / "shards", seed=1, buffer=16)
    assert len(stream) == 300 and len(stream.paths) == 5
    first = list(stream)
    got_images, got_labels = decode(first)
    written = {(image.numpy().tobytes(), int(label)) for image, label in zip(images, labels, strict=True)}
    assert {
        (image.numpy().tobytes(), int(label)) for image, label in zip(got_images, got_labels, strict=True)
    } == written
    assert len(first) == 300
    assert list(stream) == first  # the same epoch, the same stream: what a resume part-way relies on
    stream.set_epoch(1)
    assert list(stream) != first  # another epoch, another order
    assert list(TarShards(tmp_path / "shards", seed=1, buffer=16)) == first  # in another process (rank) too


def test_shards_are_never_written_over_and_a_failed_write_leaves_nothing(tmp_path):
    images, labels = synthetic.generate(20, seed=5)
    out = tmp_path / "shards"
    with pytest.raises(IndexError):  # a failure part-way (here: fewer images than labels)
        write_shards(out, images[:10], labels, SPLIT, per_shard=4)
    assert list(tmp_path.iterdir()) == []  # no folder, whole or half
    write_shards(out, images, labels, SPLIT, per_shard=4)
    before = {path.name: path.read_bytes() for path in out.iterdir()}
    with pytest.raises(UserError, match=r"--out .*shards exists: the shards are never written over"):
        write_shards(out, images, labels, SPLIT, per_shard=8)
    assert {path.name: path.read_bytes() for path in out.iterdir()} == before


def test_shards_of_another_split_are_refused_in_one_line(tmp_path, data_dir):
    """Shards of the split of --data.seed=42 would hold validation images of a run with seed 7."""
    images, labels = synthetic.generate(20, seed=5)
    write_shards(tmp_path / "shards", images, labels, SPLIT, per_shard=8)
    data = FashionMNISTShards(shards=str(tmp_path / "shards"), data_dir=str(data_dir), source="synthetic", seed=7)
    with pytest.raises(UserError, match=r"holds the training images of another split .* write the shards again"):
        data.setup("fit")
    with pytest.raises(UserError, match=r"--data.shards=.*nowhere: no index.json there; write the shards with"):
        TarShards(tmp_path / "nowhere")
    with pytest.raises(UserError, match=r"--data.on_device=true cuts batches .* drop --data.on_device"):
        FashionMNISTShards(shards=str(tmp_path / "shards"), on_device=True)


@pytest.mark.slow
def test_the_example_streamed_from_shards_under_ddp_stops_mid_epoch_and_resumes_bitwise(tmp_path, data_dir):
    """The docstring's commands, from another folder: the writer, then fit on 2 ranks (8 a rank, augmented),
    one run unbroken and one stopped by SIGTERM after step 5 of 8 and resumed with ``--ckpt_path last``."""
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    source = ("--source=synthetic", f"--data_dir={data_dir}", "--val_size=256")
    wrote = run(
        [sys.executable, str(ROOT / "cli.py"), "shards", "--out", str(tmp_path / "shards"), *source], cwd=elsewhere
    )
    assert wrote.returncode == 0, wrote.stderr[-3000:]
    assert re.search(r"wrote 59,744 training images of the SYNTHETIC .* in 6 shards", wrote.stdout), wrote.stdout

    def fit(root, *more):
        command = [sys.executable, str(ROOT / "cli.py"), "fit", "--data=app.fashion_mnist.shards.FashionMNISTShards"]
        command += [f"--data.shards={tmp_path / 'shards'}", "--trainer.accelerator=cpu", "--trainer.max_epochs=2"]
        command += ["--trainer.limit_train_batches=8", "--trainer.limit_val_batches=2", "--seed_everything=42"]
        command += ["--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false"]
        command += [f"--data.data_dir={data_dir}", "--data.source=synthetic", "--data.val_size=256"]
        command += ["--data.batch_size=8", "--model.arch=resnet_tiny", "--data.augment=true"]
        command += ["--trainer.strategy=ddp", "--trainer.devices=2", f"--trainer.default_root_dir={root}", *more]
        return run(command, cwd=elsewhere, fresh=False)

    unbroken = fit(tmp_path / "unbroken")
    assert unbroken.returncode == 0, unbroken.stderr[-3000:]
    assert noise(unbroken.stderr) == [], unbroken.stderr[-3000:]
    signal = '--trainer.callbacks+={"class_path": "tests.signal_at_step.SignalAtStep", "init_args": {"step": 5}}'
    stopped = fit(tmp_path / "cut", signal)
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    step = int(re.search(r"SIGTERM: stopped after step (\d+) \(epoch 0\)", stopped.stderr)[1])
    assert 5 <= step < 8
    resumed = fit(tmp_path / "cut", "--ckpt_path=last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (
        f"resuming from {tmp_path}/cut/lightning_logs/version_0/checkpoints/last.ckpt (step {step})" in resumed.stderr
    )

    def final(root, version):
        path = root / "lightning_logs" / f"version_{version}" / "checkpoints" / "last.ckpt"
        return torch.load(path, map_location="cpu", weights_only=True)

    a, b = final(tmp_path / "unbroken", 0), final(tmp_path / "cut", 1)
    assert a["global_step"] == b["global_step"] == 16
    assert [k for k in a["state_dict"] if not torch.equal(a["state_dict"][k], b["state_dict"][k])] == []
