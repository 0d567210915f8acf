import gzip
import warnings
from pathlib import Path

import pytest
import torch

from app.errors import TemplateWarning
from app.fashion_mnist import synthetic
from app.fashion_mnist.augment import random_crop_flip
from app.fashion_mnist.data import FashionMNISTDataModule, TensorImageDataset, keep_batch
from app.fashion_mnist.datafiles import SPLITS
from app.fashion_mnist.idx import DataFileError, read_idx, write_idx
from tests.fashion_mnist.conftest import needs_system_copy


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
    labels = read_idx(dm.files.synthetic_dir / "t10k-labels-idx1-ubyte")
    labels[5] = 10
    write_idx(dm.files.synthetic_dir / "t10k-labels-idx1-ubyte", labels)
    with pytest.raises(DataFileError, match=r"t10k-labels-idx1-ubyte: label 10 out of range 0..9"):
        dm.setup("test")


def test_loader_rejects_wrong_image_shape(tmp_path, data_dir):
    dm = _synthetic_dm(tmp_path, data_dir)
    write_idx(dm.files.synthetic_dir / "t10k-images-idx3-ubyte", torch.zeros(10_000, 32, 32, dtype=torch.uint8))
    with pytest.raises(DataFileError, match=r"t10k-images-idx3-ubyte: images are \(32, 32\), expected 28x28"):
        dm.setup("test")


def test_real_files_are_checked_against_known_md5(tmp_path):
    """A .gz in the real-data folder that is not the published file is refused, naming the file."""
    dm = FashionMNISTDataModule(data_dir=str(tmp_path), source="fashion_mnist")
    images, labels = synthetic.generate(10, seed=0)
    for images_file, labels_file, _ in SPLITS.values():
        write_idx(dm.files.real_dir / f"{images_file}.gz", images)
        write_idx(dm.files.real_dir / f"{labels_file}.gz", labels)
    dm._download = lambda: pytest.fail("files present: no download attempted")
    with pytest.raises(DataFileError, match=r"train-images-idx3-ubyte.gz: not the published Fashion-MNIST file"):
        dm.prepare_data()  # checked before any run folder exists
    with pytest.raises(DataFileError, match=r"train-images-idx3-ubyte.gz: not the published Fashion-MNIST file"):
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
    write_idx(dm.files.synthetic_dir / "train-images-idx3-ubyte", images)
    empty = torch.zeros(0, dtype=torch.uint8)
    write_idx(dm.files.synthetic_dir / "train-labels-idx1-ubyte", labels if samples else empty)
    dm = FashionMNISTDataModule(data_dir=str(tmp_path / "d"), source="synthetic", val_size=256)
    message = rf"--data.val_size=256: the training files in .* hold only {samples} samples"
    with pytest.raises(UserError, match=message):
        dm.prepare_data()  # before any run folder exists
    with pytest.raises(UserError, match=message):
        dm.setup("fit")  # and on ranks that did not prepare


# ------------------------------------------------------------------------------------------------ the real files
def _tiny_real(folder, monkeypatch, gz=True, extracted=False, level=9):
    """Tiny files in Fashion-MNIST's format (20 samples a split) that count as the published ones: their content's
    MD5 sums are patched in. ``level`` and the gzip header's mtime differ from any other copy's, as Debian's do."""
    import hashlib

    from app.fashion_mnist import datafiles

    folder.mkdir(parents=True, exist_ok=True)
    sums = {}
    for (images_file, labels_file, _), seed in zip(SPLITS.values(), (1, 2), strict=True):
        images, labels = synthetic.generate(20, seed=seed)
        for name, tensor in ((images_file, images), (labels_file, labels)):
            write_idx(folder / name, tensor)
            content = (folder / name).read_bytes()
            sums[name] = hashlib.md5(content).hexdigest()
            if gz:
                (folder / f"{name}.gz").write_bytes(gzip.compress(content, compresslevel=level, mtime=1591315200))
            if not extracted:
                (folder / name).unlink()
    monkeypatch.setattr(datafiles, "CONTENT_MD5", sums, raising=False)  # (a tree without it fails on what it does)
    return folder


def _listing(folder):
    return sorted((str(p.relative_to(folder)), p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*"))


@pytest.mark.parametrize("source", ["auto", "fashion_mnist"])
def test_the_real_files_are_found_in_data_dir_flat_and_in_the_system_copy(tmp_path, monkeypatch, caplog, source):
    """In order: torchvision's layout in data_dir, the four files directly in data_dir, the system copy; no download
    and nothing written while any of them holds the files, and the run names the one it uses."""
    system = _tiny_real(tmp_path / "system", monkeypatch)
    monkeypatch.setenv("FASHION_MNIST_SYSTEM_DIR", str(system))
    data = tmp_path / "data"
    data.mkdir()  # (one that does not exist, with the system copy there, gets a warning: the test further down)
    for place, expected in [
        (None, system),  # only the system copy
        (data, data),  # the flat layout comes before it
        (data / "FashionMNIST" / "raw", data / "FashionMNIST" / "raw"),  # torchvision's layout before both
    ]:
        if place is not None:
            _tiny_real(place, monkeypatch)
        before = _listing(tmp_path)
        dm = FashionMNISTDataModule(data_dir=str(data), source=source, val_size=5)
        dm._download = lambda: pytest.fail("the files are there: no download")
        caplog.clear()
        with caplog.at_level("INFO"):
            dm.prepare_data()
            dm.setup("fit")
        assert dm.hparams.resolved_source == "fashion_mnist" and dm.files.folder() == expected
        assert len(dm.train_set) == 15 and len(dm.val_set) == 5
        assert _listing(tmp_path) == before  # nothing written: no synthetic files, no download
        (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Data: ")]
        assert line.startswith(f"Data: fit on 15 training and 5 validation images of Fashion-MNIST in {expected} ")
        assert "\n" not in line


def test_real_files_are_checked_by_content_whoever_compressed_them(tmp_path, monkeypatch):
    """A .gz compressed by anyone (Debian re-compressed the published files) or an extracted file, or both side by
    side, is accepted when its content is the published file's; another content is refused in one line naming the
    file, without advising to delete what may not be downloadable again."""
    raw = tmp_path / "FashionMNIST" / "raw"
    for gz, extracted, level in [(True, False, 1), (False, True, 9), (True, True, 6)]:
        _tiny_real(raw, monkeypatch, gz=gz, extracted=extracted, level=level)
        dm = FashionMNISTDataModule(data_dir=str(tmp_path), source="fashion_mnist", val_size=5)
        dm._download = lambda: pytest.fail("the files are there: no download")
        dm.prepare_data()
        dm.setup("test")
        assert len(dm.test_set) == 20
        for p in raw.iterdir():
            p.unlink()

    _tiny_real(raw, monkeypatch)
    bad = raw / "t10k-labels-idx1-ubyte.gz"
    content = bytearray(gzip.decompress(bad.read_bytes()))
    content[-1] = (content[-1] + 1) % 10  # one label changed: a valid IDX file, not the published one
    bad.write_bytes(gzip.compress(bytes(content)))
    truncated = raw / "train-images-idx3-ubyte.gz"
    dm = FashionMNISTDataModule(data_dir=str(tmp_path), source="fashion_mnist", val_size=5)
    with pytest.raises(DataFileError) as refused:
        dm.load_split("test")
    message = str(refused.value)
    assert message.startswith(f"{bad}: not the published Fashion-MNIST file (the MD5 of its content is "), message
    assert "replace it with an intact copy" in message and "delete" not in message and "\n" not in message
    truncated.write_bytes(truncated.read_bytes()[:-20])
    with pytest.raises(DataFileError, match=rf"^{truncated}: cannot decompress") as refused:
        dm.load_split("train")
    assert "delete" not in str(refused.value)


@needs_system_copy
def test_the_system_copy_is_genuine_and_accepted_wherever_it_is_copied(tmp_path, system_copy):
    """Debian's re-compressed files pass the content check: as they are, with --data.data_dir pointing at them, and
    copied into the documented layout, .gz alone or with extracted copies beside them (the issue's first attempt)."""
    import shutil

    dm = FashionMNISTDataModule(data_dir=str(system_copy), source="fashion_mnist")
    images, labels = dm.load_split("test")
    assert dm.files.folder() == system_copy and len(labels) == 10_000
    assert torch.bincount(labels).tolist() == [1000] * 10 and abs(images.float().mean().item() / 255 - 0.286) < 1e-3
    raw = tmp_path / "FashionMNIST" / "raw"
    shutil.copytree(system_copy, raw)
    (raw / "t10k-labels-idx1-ubyte").write_bytes(gzip.decompress((raw / "t10k-labels-idx1-ubyte.gz").read_bytes()))
    dm = FashionMNISTDataModule(data_dir=str(tmp_path), source="auto")
    dm._download = lambda: pytest.fail("the files are there: no download")
    assert torch.equal(dm.load_split("test")[1], labels) and dm.files.folder() == raw


def test_a_folder_that_is_not_the_templates_own_is_never_written(tmp_path, monkeypatch, data_dir):
    """A read-only data_dir (read-only for root too), the system copy's folder and anything under /usr get no file:
    the synthetic stand-in goes to the template's folder in the user's cache, and no download is tried there."""
    import shutil

    from app.fashion_mnist.datafiles import FashionMNISTFiles

    cache = tmp_path / "cache" / "fashion-resnet-template" / "FashionMNIST-synthetic" / "raw"
    read_only = tmp_path / "read-only"
    read_only.mkdir()
    (read_only / "notes.txt").write_text("the owner's")
    read_only.chmod(0o555)
    try:
        before = _listing(read_only)
        dm = FashionMNISTDataModule(data_dir=str(read_only), source="auto", val_size=100)
        dm._download = lambda: pytest.fail("no download into a read-only folder")
        with pytest.warns(UserWarning, match=rf"not downloaded: {read_only} is read-only") as caught:
            dm.prepare_data()
        assert f"Using the SYNTHETIC stand-in in {cache} instead" in str(caught[-1].message)
        dm.setup("fit")
        assert dm.hparams.resolved_source == "synthetic" and dm.files.synthetic_dir == cache
        assert _listing(read_only) == before
        FashionMNISTDataModule(data_dir=str(read_only / "new"), source="synthetic").prepare_data()
        assert _listing(read_only) == before and (cache / "GENERATOR").is_file()
    finally:
        read_only.chmod(0o755)

    system = _tiny_real(tmp_path / "system", monkeypatch)  # also what a data_dir holding the real files gets
    monkeypatch.setenv("FASHION_MNIST_SYSTEM_DIR", str(system))
    before = _listing(system)
    FashionMNISTDataModule(data_dir=str(system), source="synthetic").prepare_data()
    assert _listing(system) == before
    for folder, why in [(system, "the system copy's folder"), ("/usr/share/datasets/x", "a system folder, under /usr")]:
        files = FashionMNISTFiles(Path(folder), "synthetic")
        assert files.not_ours() == why and files.synthetic_dir == cache

    # a read-only folder that already holds this generator's stand-in is read where it is
    shutil.copytree(data_dir, tmp_path / "shipped")
    (tmp_path / "shipped").chmod(0o555)
    try:
        dm = FashionMNISTDataModule(data_dir=str(tmp_path / "shipped"), source="synthetic")
        assert dm.files.synthetic_dir == tmp_path / "shipped" / "FashionMNIST-synthetic" / "raw"
    finally:
        (tmp_path / "shipped").chmod(0o755)


# ------------------------------------------------------------------------------------------ runs, as users run them
def _cli(cwd, *args, timeout=240):
    import sys

    from tests import warm
    from tests.conftest import ROOT

    return warm.run(
        [sys.executable, str(ROOT / "cli.py"), *args], cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def synthetic_run(tmp_path_factory, data_dir):
    """``cli.py fit`` on the synthetic stand-in (two short epochs), from a folder of its own: (result, last.ckpt)."""
    from tests.conftest import CPU_TEST_CONFIG

    cwd = tmp_path_factory.mktemp("synthetic-run")
    result = _cli(
        cwd, "fit", "--config", str(CPU_TEST_CONFIG), f"--data.data_dir={data_dir}", "--trainer.limit_train_batches=2",
        "--trainer.limit_val_batches=1",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return result, cwd / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"


@pytest.mark.slow
def test_every_epoch_line_of_a_synthetic_run_says_so_and_each_run_names_its_data(synthetic_run, data_dir, tmp_path):
    """Not only one warning above the model summary: every epoch line ends with the data module's note
    (``epoch_note``, read by the machinery's RunReport); fit, validate, test and predict each name their data."""
    from tests.conftest import CPU_TEST_CONFIG

    result, ckpt = synthetic_run
    output = result.stdout + result.stderr
    epochs = [line for line in output.splitlines() if line.startswith("epoch ")]
    assert len(epochs) == 2 and all(line.endswith(" | SYNTHETIC data, not Fashion-MNIST") for line in epochs), epochs
    stand_in = f"the SYNTHETIC stand-in in {data_dir / 'FashionMNIST-synthetic' / 'raw'} (not Fashion-MNIST)"
    assert f"Data: fit on 59,744 training and 256 validation images of {stand_in}" in output
    expected = {
        "validate": f"Data: validate on the 256 validation images (held out of the training files by --data.seed=42) "
        f"of {stand_in}",
        "test": f"Data: test on the 10,000 test images of {stand_in}",
        "predict": f"Data: predict on the 10,000 test images of {stand_in}",
    }
    for stage, line in expected.items():
        run = _cli(
            tmp_path, stage, "--config", str(CPU_TEST_CONFIG), f"--data.data_dir={data_dir}", f"--ckpt_path={ckpt}"
        )
        assert run.returncode == 0, run.stderr[-3000:]
        data_lines = [x for x in (run.stdout + run.stderr).splitlines() if x.startswith("Data: ")]
        assert data_lines == [line], data_lines


@pytest.mark.slow
def test_a_checkpoint_trained_on_other_data_is_refused_unless_the_source_is_named(
    synthetic_run, data_dir, tmp_path, monkeypatch, capsys, recwarn
):
    """A checkpoint whose hyperparameters say it was trained on Fashion-MNIST, tested where ``auto`` finds only the
    stand-in: one line naming both and the way through, exit 2, no run folder; ``--data.source`` runs it anyway,
    with a warning that names both. A resumed fit follows the same rule."""
    from tests.conftest import CPU_TEST_CONFIG
    from tests.fashion_mnist.conftest import run_cli

    _, ckpt = synthetic_run
    checkpoint = torch.load(ckpt, map_location="cpu", weights_only=True)
    assert checkpoint["datamodule_hyper_parameters"]["resolved_source"] == "synthetic"
    checkpoint["datamodule_hyper_parameters"]["resolved_source"] = "fashion_mnist"  # as trained on the real data
    real = tmp_path / "real.ckpt"
    torch.save(checkpoint, real)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(FashionMNISTDataModule, "_download", lambda self: (_ for _ in ()).throw(OSError("no network")))
    common = ("--config", str(CPU_TEST_CONFIG), f"--data.data_dir={data_dir}", f"--ckpt_path={real}")
    for stage, more, verb in [("test", (), "test"), ("fit", ("--trainer.max_epochs=3",), "train")]:
        with pytest.raises(SystemExit) as exit_info:
            run_cli(stage, *common, *more, "--data.source=auto")
        assert exit_info.value.code == 2
        assert capsys.readouterr().err.strip().splitlines()[-1] == (
            f"error: {real} was trained on Fashion-MNIST, but this {stage} would run on the SYNTHETIC stand-in "
            f"({data_dir / 'FashionMNIST-synthetic' / 'raw'}); pass "
            f"--data.source=fashion_mnist to {verb} on what it was trained on, or --data.source=synthetic to {verb} "
            "on the SYNTHETIC stand-in all the same"
        )
        assert not (tmp_path / "lightning_logs").exists()
    recwarn.clear()
    run_cli("test", *common, "--data.source=synthetic")
    (warned,) = [str(w.message) for w in recwarn if "was trained on" in str(w.message)]
    assert (
        warned
        == f"{real} was trained on Fashion-MNIST; this test runs on the SYNTHETIC stand-in (--data.source=synthetic)"
    )


@needs_system_copy
@pytest.mark.slow
def test_a_synthetic_checkpoint_is_not_scored_silently_on_the_real_data(synthetic_run, tmp_path, system_copy):
    """The issue's run: trained offline on the stand-in, tested once the real files are installed."""
    from tests.conftest import CPU_TEST_CONFIG

    _, ckpt = synthetic_run
    (tmp_path / "data").mkdir()  # (one that does not exist, with the system copy there, gets a warning of its own)
    args = ("test", "--config", str(CPU_TEST_CONFIG), f"--data.data_dir={tmp_path / 'data'}", f"--ckpt_path={ckpt}")
    refused = _cli(tmp_path, *args, "--data.source=auto")
    assert refused.returncode == 2
    last = refused.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: {ckpt} was trained on the SYNTHETIC stand-in, but this test would run on ")
    assert f"Fashion-MNIST ({system_copy})" in last and "--data.source=fashion_mnist to test on Fashion-MNIST" in last
    named = _cli(tmp_path, *args, "--data.source=fashion_mnist")
    assert named.returncode == 0, named.stderr[-3000:]
    assert f"{ckpt} was trained on the SYNTHETIC stand-in; this test runs on Fashion-MNIST" in named.stderr
    assert f"Data: test on the 10,000 test images of Fashion-MNIST in {system_copy} " in named.stdout + named.stderr


@needs_system_copy
@pytest.mark.slow
def test_the_readme_train_command_from_a_fresh_folder_trains_on_the_system_copy(tmp_path, system_copy):
    """``make train`` (cli.py fit --config configs/quickstart.yaml), shortened, from a folder with nothing in it:
    the real files of the system copy, named in one line; nothing written there or into the folder's data/."""
    from tests.conftest import ROOT

    before = _listing(system_copy.parent)
    config = str(ROOT / "configs" / "quickstart.yaml")
    limits = ("--trainer.max_epochs=1", "--trainer.limit_train_batches=3", "--trainer.limit_val_batches=2")
    result = _cli(tmp_path, "fit", "--config", config, *limits)
    assert result.returncode == 0, result.stderr[-3000:]
    output = result.stdout + result.stderr
    assert (
        f"Data: fit on 55,000 training and 5,000 validation images of Fashion-MNIST in {system_copy} (the system copy, "
        "Debian's dataset-fashion-mnist; gzip'd files)"
    ) in output
    assert "SYNTHETIC" not in output and "stand-in" not in output
    assert _listing(system_copy.parent) == before and not (tmp_path / "data").exists()


@needs_system_copy
@pytest.mark.slow
def test_the_quickstart_reaches_test_accuracy_0_90_on_the_real_data(tmp_path, system_copy):
    """The README's ``make train`` whole (configs/quickstart.yaml, two epochs, 103 s here), then its
    test: at least 0.90 of the 10,000 real test images (0.9096 measured, bench/results/quickstart-cpu.md)."""
    import csv

    from tests.conftest import ROOT

    config = str(ROOT / "configs" / "quickstart.yaml")
    fit = _cli(tmp_path, "fit", "--config", config, timeout=900)
    assert fit.returncode == 0, fit.stderr[-3000:]
    logs = tmp_path / "lightning_logs"
    ckpt = logs / "version_0" / "checkpoints" / "last.ckpt"
    tested = _cli(tmp_path, "test", "--config", config, "--ckpt_path", str(ckpt))
    assert tested.returncode == 0, tested.stderr[-3000:]
    assert f"Data: test on the 10,000 test images of Fashion-MNIST in {system_copy} " in tested.stdout + tested.stderr
    with open(logs / "version_1" / "metrics.csv", newline="") as f:
        (accuracy,) = [float(row["test/acc"]) for row in csv.DictReader(f) if row.get("test/acc")]
    assert accuracy >= 0.90


def test_a_data_dir_that_does_not_exist_says_so_where_the_system_copy_is_read_instead(tmp_path, monkeypatch):
    """``--data.data_dir=my_dataa`` (a typo of one's own copy) trained on the system copy with exit 0, its data line
    naming the system folder and nothing naming the missing one. Now one warning line names the flag, the folder
    read instead and the fix, when the data module is made (before the trainer); the default folder, a folder that
    exists, the synthetic stand-in and a run without a system copy (a download goes there) say nothing."""
    system = _tiny_real(tmp_path / "system", monkeypatch)
    monkeypatch.setenv("FASHION_MNIST_SYSTEM_DIR", str(system))
    monkeypatch.chdir(tmp_path)
    for source in ("fashion_mnist", "auto"):
        with pytest.warns(TemplateWarning) as caught:
            FashionMNISTDataModule(data_dir="my_dataa", source=source)
        assert [str(w.message) for w in caught] == [
            f"--data.data_dir=my_dataa: no such folder; reading the Fashion-MNIST files of {system} "
            "($FASHION_MNIST_SYSTEM_DIR) instead. If you meant a copy of your own, fix the path"
        ]
    assert not (tmp_path / "my_dataa").exists()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        FashionMNISTDataModule()
        FashionMNISTDataModule(data_dir="my_dataa", source="synthetic")
        (tmp_path / "my_dataa").mkdir()
        FashionMNISTDataModule(data_dir="my_dataa")
        monkeypatch.setenv("FASHION_MNIST_SYSTEM_DIR", "")  # no system copy: a new folder is where a download goes
        FashionMNISTDataModule(data_dir=str(tmp_path / "new"), source="fashion_mnist")


# Where the docs repeat the quickstart's measured figures (bench/results/quickstart-cpu.md, the one source): each
# copy as a pattern that captures the fit's seconds and/or the test accuracy.
QUICKSTART_COPIES = {
    "README.md": (
        r"scores it on the test set \(fit: (?P<fit_s>\d+) s on 2 CPU cores, test acc (?P<acc>[\d.]+) ",
        r"reaches test accuracy (?P<acc>[\d.]+): (?P<fit_s>\d+) s of `cli.py fit`",
        r"configs/quickstart.yaml +# resnet_mini, 2 epochs, (?P<fit_s>\d+) s on a 2-core CPU",
    ),
    "docs/training.md": (
        r"configs/quickstart.yaml +# resnet_mini, 2 epochs, (?P<fit_s>\d+) s on a 2-core CPU",
        r"lr along a cosine per step: (?P<fit_s>\d+) s on the 2-core CPU VM, test acc (?P<acc>[\d.]+) on the real data",
    ),
    "docs/data.md": (
        r"\| cosine per step \(now\) \|.*\| \*\*(?P<acc>[\d.]+)\*\* \| (?P<fit_s>\d+) s",
        r"Of the (?P<fit_s>\d+) s, about",
    ),
    "configs/quickstart.yaml": (
        r"two full epochs of a small ResNet, (?P<fit_s>\d+) s on a 2-core CPU",
        r"test acc [\d.]+ then, (?P<acc>[\d.]+) now",
    ),
}


def test_the_quickstarts_time_and_accuracy_are_the_benchmarks_wherever_the_docs_quote_them():
    """One source (the benchmark's result file), every copy equal to it: the README said "about 105 s" and "test
    acc 0.910", data.md and training.md "103 s", another README line "about 2 minutes", quickstart.yaml "under two
    minutes"; and resnet_mini's speed-up was 2.5x in quickstart.yaml, 2.3x in training.md."""
    import re

    from tests.conftest import ROOT

    result = (ROOT / "bench/results/quickstart-cpu.md").read_text()
    rows = [line for line in result.splitlines() if re.match(r"\| \d+ \|", line)]
    _, fit_s, _, _, acc, _ = (cell.strip() for cell in rows[-1].strip("|").split("|"))
    for name, patterns in QUICKSTART_COPIES.items():
        text = (ROOT / name).read_text()
        for pattern in patterns:
            found = re.search(pattern, text)
            assert found, f"{name}: no longer quotes the quickstart as {pattern!r}"
            figures = found.groupdict()
            assert figures.get("fit_s", fit_s) == fit_s and figures.get("acc", acc) == acc, (name, found.group(0))
        said = [line for line in text.splitlines() if "quickstart" in line.lower() and "minute" in line]
        assert not said, f"{name}: a time in minutes beside the figures: {said}"
    # resnet_mini's speed-up over resnet_tiny: data.md's measured images/s of each
    tiny, mini = re.search(
        r"`resnet_tiny` .*? trains at about ([\d,]+) images/s here; `resnet_mini`.*?at about ([\d,]+) images/s",
        (ROOT / "docs/data.md").read_text(), re.S,
    ).groups()  # fmt: skip
    ratio = f"{int(mini.replace(',', '')) / int(tiny.replace(',', '')):.1f}"
    for name in ("configs/quickstart.yaml", "docs/training.md"):
        assert re.findall(r"(\d\.\d)x (?:its|the) images/s", (ROOT / name).read_text()) == [ratio], name
