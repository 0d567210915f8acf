import gzip
import warnings

import pytest
import torch

from app.fashion_mnist import synthetic
from app.fashion_mnist.augment import random_crop_flip
from app.fashion_mnist.data import FashionMNISTDataModule, TensorImageDataset, keep_batch
from app.fashion_mnist.datafiles import SPLITS
from app.fashion_mnist.idx import DataFileError, read_idx, write_idx


def test_synthetic_is_deterministic_and_seeded():
    a_images, a_labels = synthetic.generate(500, seed=3)
    b_images, b_labels = synthetic.generate(500, seed=3)
    c_images, _ = synthetic.generate(500, seed=4)
    assert a_images.dtype == torch.uint8 and a_images.shape == (500, 28, 28)
    assert torch.equal(a_images, b_images) and torch.equal(a_labels, b_labels)
    assert not torch.equal(a_images, c_images)
    assert set(a_labels.tolist()) == set(range(10))  # every class appears


def test_synthetic_files_are_the_same_bytes_for_the_same_seed(tmp_path):
    for name in ("a", "b"):
        FashionMNISTDataModule(data_dir=str(tmp_path / name), source="synthetic").prepare_data()
    for images_file, labels_file, _ in SPLITS.values():
        for f in (images_file, labels_file):
            a = (tmp_path / "a" / "FashionMNIST-synthetic" / "raw" / f).read_bytes()
            assert a == (tmp_path / "b" / "FashionMNIST-synthetic" / "raw" / f).read_bytes()


def test_synthetic_is_learnable_but_not_trivial():
    """Class means alone (a nearest-centroid classifier) do far better than chance, yet far from perfectly."""
    images, labels = synthetic.generate(4000, seed=0)
    x, y = images.flatten(1).float(), labels.long()
    centroids = torch.stack([x[:2000][y[:2000] == c].mean(0) for c in range(10)])
    acc = (torch.cdist(x[2000:], centroids).argmin(1) == y[2000:]).float().mean().item()
    assert 0.3 < acc < 0.9, acc


def _centroid_accuracy(train, evaluated) -> float:
    """Accuracy on ``evaluated`` of the nearest class mean of ``train``: a classifier that only knows the classes."""
    (x, y), (xe, ye) = [(images.flatten(1).float(), labels.long()) for images, labels in (train, evaluated)]
    centroids = torch.stack([x[y == c].mean(0) for c in range(10)])
    return (torch.cdist(xe, centroids).argmin(1) == ye).float().mean().item()


def test_synthetic_test_split_is_new_samples_of_the_training_classes(data_dir):
    """What the training split teaches scores the same on held-out training samples and on the test split."""
    dm = FashionMNISTDataModule(data_dir=str(data_dir), source="synthetic")
    train_images, train_labels = dm.load_split("train")
    test_images, test_labels = dm.load_split("test")
    fit, held_out = slice(0, 20_000), slice(50_000, 60_000)
    train_part = (train_images[fit], train_labels[fit])
    val_acc = _centroid_accuracy(train_part, (train_images[held_out], train_labels[held_out]))
    test_acc = _centroid_accuracy(train_part, (test_images, test_labels))
    assert val_acc > 0.3 and abs(test_acc - val_acc) < 0.02, (val_acc, test_acc)  # other classes: about 0.1
    assert not torch.equal(test_images[:100], train_images[:100])  # new samples, not a copy


def test_synthetic_files_of_an_older_generator_are_written_again(tmp_path, data_dir, caplog):
    """Files without the generator's stamp (what version 1 wrote) or with an older stamp are replaced, not reused."""
    import shutil

    raw = tmp_path / "FashionMNIST-synthetic" / "raw"
    shutil.copytree(data_dir / "FashionMNIST-synthetic" / "raw", raw)
    good = {p.name: p.read_bytes() for p in raw.iterdir()}
    for stamp in (None, "app.fashion_mnist.synthetic version 1, seed 0\n"):
        old_images, old_labels = synthetic.generate(10_000, seed=1)  # version 1's test split: other prototypes
        write_idx(raw / "t10k-images-idx3-ubyte", old_images)
        write_idx(raw / "t10k-labels-idx1-ubyte", old_labels)
        (raw / "GENERATOR").unlink()
        if stamp is not None:
            (raw / "GENERATOR").write_text(stamp)
        with caplog.at_level("INFO"):
            FashionMNISTDataModule(data_dir=str(tmp_path), source="synthetic").prepare_data()
        assert "older version of app/fashion_mnist/synthetic.py; writing them again" in caplog.text
        assert {p.name: p.read_bytes() for p in raw.iterdir()} == good
        caplog.clear()


def test_synthetic_files_are_readable_by_others(tmp_path):
    """A shared data folder: files get the usual permissions (umask), not mkstemp's 0600."""
    import os

    old = os.umask(0o022)
    try:
        FashionMNISTDataModule(data_dir=str(tmp_path), source="synthetic").prepare_data()
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "FashionMNIST-synthetic" / "raw").iterdir()}
    assert set(modes.values()) == {0o644}, modes


def test_idx_roundtrip_plain_and_gz(tmp_path):
    t = torch.randint(0, 256, (7, 28, 28), dtype=torch.uint8)
    for name in ("x-idx3-ubyte", "x-idx3-ubyte.gz"):
        write_idx(tmp_path / name, t)
        assert torch.equal(read_idx(tmp_path / name, ndim=3), t)
    assert not list(tmp_path.glob("*.tmp"))  # atomic writes leave no temporaries


def test_idx_rejects_truncated_file(tmp_path):
    path = tmp_path / "images-idx3-ubyte"
    write_idx(path, torch.zeros(10, 28, 28, dtype=torch.uint8))
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(DataFileError, match=r"images-idx3-ubyte: truncated"):
        read_idx(path, ndim=3)


def test_idx_rejects_wrong_magic(tmp_path):
    path = tmp_path / "labels-idx1-ubyte"
    path.write_bytes(b"\x00\x00\x0d\x01" + (3).to_bytes(4, "big") + b"\x00" * 12)  # float32 dtype code
    with pytest.raises(DataFileError, match=r"labels-idx1-ubyte: wrong magic number 0x00000d01"):
        read_idx(path, ndim=1)
    with pytest.raises(DataFileError, match="wrong magic number"):
        read_idx(tmp_path / "labels-idx1-ubyte", ndim=3)


def test_idx_rejects_a_corrupt_gzip(tmp_path):
    path = tmp_path / "x-idx1-ubyte.gz"
    path.write_bytes(b"not gzip at all")
    with pytest.raises(DataFileError, match="x-idx1-ubyte.gz: cannot decompress"):
        read_idx(path)


def _synthetic_dm(tmp_path, data_dir):
    import shutil

    shutil.copytree(data_dir, tmp_path / "d")
    return FashionMNISTDataModule(data_dir=str(tmp_path / "d"), source="synthetic")


def test_loader_rejects_out_of_range_labels(tmp_path, data_dir):
    dm = _synthetic_dm(tmp_path, data_dir)
    labels = read_idx(dm.synthetic_dir / "t10k-labels-idx1-ubyte")
    labels[5] = 10
    write_idx(dm.synthetic_dir / "t10k-labels-idx1-ubyte", labels)
    with pytest.raises(DataFileError, match=r"t10k-labels-idx1-ubyte: label 10 out of range 0..9"):
        dm.setup("test")


def test_loader_rejects_wrong_image_shape(tmp_path, data_dir):
    dm = _synthetic_dm(tmp_path, data_dir)
    write_idx(dm.synthetic_dir / "t10k-images-idx3-ubyte", torch.zeros(10_000, 32, 32, dtype=torch.uint8))
    with pytest.raises(DataFileError, match=r"t10k-images-idx3-ubyte: images are \(32, 32\), expected 28x28"):
        dm.setup("test")


def test_real_files_are_checked_against_known_md5(tmp_path):
    """A .gz in the real-data folder that is not the published file is refused, naming the file."""
    dm = FashionMNISTDataModule(data_dir=str(tmp_path), source="fashion_mnist")
    images, labels = synthetic.generate(10, seed=0)
    for images_file, labels_file, _ in SPLITS.values():
        write_idx(dm.real_dir / f"{images_file}.gz", images)
        write_idx(dm.real_dir / f"{labels_file}.gz", labels)
    dm._download = lambda: pytest.fail("files present: no download attempted")
    with pytest.raises(DataFileError, match=r"train-images-idx3-ubyte.gz: MD5 checksum mismatch"):
        dm.prepare_data()  # checked before any run folder exists
    with pytest.raises(DataFileError, match=r"train-images-idx3-ubyte.gz: MD5 checksum mismatch"):
        dm.setup("fit")  # and again on ranks that did not run prepare_data


def test_fashion_mnist_without_files_or_network_names_the_flag(tmp_path, monkeypatch):
    dm = FashionMNISTDataModule(data_dir=str(tmp_path), source="fashion_mnist")
    monkeypatch.setattr(dm, "_download", lambda: (_ for _ in ()).throw(RuntimeError("no network")))
    with pytest.raises(DataFileError, match=r"--data.source=fashion_mnist.*--data.source=synthetic"):
        dm.prepare_data()
    assert not (tmp_path / "FashionMNIST-synthetic").exists()


def test_a_failed_download_leaves_no_folders_behind(tmp_path, monkeypatch):
    """torchvision's real download, offline (the only mock: no address resolves): the folders it made for the
    files, up to the data_dir that did not exist, are gone again."""
    import socket

    def offline(*args, **kwargs):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", offline)
    (tmp_path / "kept").mkdir()
    dm = FashionMNISTDataModule(data_dir=str(tmp_path / "kept" / "new" / "data"), source="fashion_mnist")
    with pytest.raises(DataFileError, match=r"the download failed \(Error downloading train-images-idx3-ubyte.gz"):
        dm.prepare_data()
    assert [p.name for p in tmp_path.rglob("*")] == ["kept"]


def test_auto_falls_back_to_synthetic_loudly(tmp_path, monkeypatch):
    dm = FashionMNISTDataModule(data_dir=str(tmp_path), source="auto", val_size=100)
    monkeypatch.setattr(dm, "_download", lambda: (_ for _ in ()).throw(RuntimeError("no network")))
    with pytest.warns(UserWarning, match="SYNTHETIC stand-in") as caught:
        dm.prepare_data()
    # shown as a "warning:" line (like the "error:" lines), without Python's file:line prefix and source line
    (w,) = [w for w in caught if "stand-in" in str(w.message)]
    shown = warnings.formatwarning(w.message, w.category, w.filename, w.lineno, w.line)
    assert shown.startswith("warning: Fashion-MNIST is not in ") and "rank_zero_warn" not in shown, shown
    dm.setup("fit")
    assert dm.hparams.resolved_source == "synthetic"
    assert len(dm.train_set) == 60_000 - 100 and len(dm.val_set) == 100


def test_dataset_serves_whole_batches_with_one_indexing_op():
    images = torch.arange(10 * 28 * 28, dtype=torch.int64).reshape(10, 28, 28).to(torch.uint8)
    ds = TensorImageDataset(images, torch.arange(10))
    loader = torch.utils.data.DataLoader(ds, batch_size=4, collate_fn=keep_batch)
    x, y = next(iter(loader))
    assert x.shape == (4, 28, 28) and x.dtype == torch.uint8
    assert torch.equal(y, torch.arange(4)) and torch.equal(x, images[:4])


def test_random_crop_flip_keeps_shape_and_pixels():
    torch.manual_seed(0)
    x = torch.rand(64, 1, 28, 28)
    y = random_crop_flip(x, padding=4)
    assert y.shape == x.shape
    # Every output image is a shifted (and maybe mirrored) window of its input: its pixels come from the input.
    for i in range(4):
        assert set(y[i].unique().tolist()) <= set(x[i].unique().tolist()) | {0.0}
    assert not torch.equal(x, y)
    # Without padding only the flips remain: each image is itself or its mirror, and both kinds occur.
    z = random_crop_flip(x, padding=0, generator=torch.Generator().manual_seed(1))
    same = (z == x).flatten(1).all(1)
    mirrored = (z == x.flip(-1)).flatten(1).all(1)
    assert bool((same | mirrored).all()) and same.any() and mirrored.any()


def test_bad_datamodule_arguments_name_the_flag():
    from app.errors import UserError

    with pytest.raises(UserError, match="--data.batch_size"):
        FashionMNISTDataModule(batch_size=0)
    with pytest.raises(UserError, match="--data.val_size"):
        FashionMNISTDataModule(val_size=60_000)


def test_gz_writer_is_deterministic(tmp_path):
    t = torch.ones(3, dtype=torch.uint8)
    write_idx(tmp_path / "a.gz", t)
    assert gzip.decompress((tmp_path / "a.gz").read_bytes())[:4] == b"\x00\x00\x08\x01"


@pytest.mark.parametrize("samples", [0, 100])
def test_val_size_is_checked_against_the_samples_loaded(tmp_path, data_dir, samples):
    """A training file smaller than --data.val_size is one clear error (it used to train on nothing, exit 0)."""
    from app.errors import UserError

    dm = _synthetic_dm(tmp_path, data_dir)
    images, labels = (
        synthetic.generate(samples, seed=0) if samples else (torch.zeros(0, 28, 28, dtype=torch.uint8),) * 2
    )
    write_idx(dm.synthetic_dir / "train-images-idx3-ubyte", images)
    write_idx(dm.synthetic_dir / "train-labels-idx1-ubyte", labels if samples else torch.zeros(0, dtype=torch.uint8))
    dm = FashionMNISTDataModule(data_dir=str(tmp_path / "d"), source="synthetic", val_size=256)
    message = rf"--data.val_size=256: the training files in .* hold only {samples} samples"
    with pytest.raises(UserError, match=message):
        dm.prepare_data()  # before any run folder exists
    with pytest.raises(UserError, match=message):
        dm.setup("fit")  # and on ranks that did not prepare
