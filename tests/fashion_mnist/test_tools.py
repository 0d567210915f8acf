"""plot, export and predict-on-a-folder, from a real short training run."""

import csv
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from PIL import Image
from torchvision.io import decode_image, write_png

from app.fashion_mnist.data import MEAN, STD
from app.fashion_mnist.export import load_exported
from app.fashion_mnist.idx import read_idx
from app.fashion_mnist.model import ImageClassifier, load_network
from app.fashion_mnist.networks import build_resnet
from app.run.plot import epoch_metrics
from tests import warm
from tests.conftest import CPU_TEST_CONFIG, ROOT
from tests.fashion_mnist.conftest import SYSTEM_COPY, needs_system_copy, run_cli


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, data_dir):
    """One 2-epoch run of the CPU preset: lightning_logs/version_0 with metrics and checkpoints."""
    workdir = tmp_path_factory.mktemp("run")
    cwd = os.getcwd()
    os.chdir(workdir)
    try:
        run_cli("fit", "--config", str(CPU_TEST_CONFIG), "--data.data_dir", str(data_dir))
    finally:
        os.chdir(cwd)
    return workdir / "lightning_logs" / "version_0"


def cli(*args: str, cwd) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "cli.py"), *args]
    return warm.run(cmd, capture_output=True, text=True, timeout=300, cwd=cwd)


def normalized(images: torch.Tensor) -> torch.Tensor:
    return (images.unsqueeze(1).float() / 255 - MEAN) / STD


# ------------------------------------------------------------------------------------------------ plot
def test_plot_draws_loss_accuracy_and_speed_of_a_real_run(run_dir, tmp_path):
    series = epoch_metrics(run_dir)
    for name in ("train/loss_epoch", "val/loss", "train/acc", "val/acc", "perf/images_per_s"):
        assert [epoch for epoch, _ in series[name]] == [0, 1], name
    assert all(v > 0 for _, v in series["perf/images_per_s"])

    result = cli("plot", str(run_dir), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    png = run_dir / "plot.png"
    image = decode_image(str(png))
    assert image.shape[0] in (3, 4) and image.shape[1] > 200 and image.shape[2] > 600
    assert image.float().std() > 10  # lines and text, not a blank canvas


def test_plot_reads_as_a_person_expects(run_dir):
    """Whole-epoch ticks, the per-step loss under the epoch losses, speed from 0, and the data named in the title."""
    from app.run.plot import figure, step_series

    fig = figure(run_dir, ImageClassifier)  # the default task: a run of it names no class
    loss_ax, acc_ax, speed_ax = fig.axes
    for ax in fig.axes:
        low, high = ax.get_xlim()
        ticks = [t for t in ax.get_xticks() if low <= t <= high]
        assert ticks and all(float(t).is_integer() for t in ticks), ticks
    per_step = [line for line in loss_ax.lines if "per step" in line.get_label()]
    steps = [row for row in read_rows(run_dir / "metrics.csv") if row.get("train/loss")]
    assert len(per_step) == 1 and len(per_step[0].get_xdata()) == len(steps) == len(step_series(run_dir, "train/loss"))
    assert max(per_step[0].get_xdata()) == 1.5  # epoch 1's steps end half way to epoch 2
    for ax in fig.axes:  # the epochs as the console's epoch lines and the checkpoint names number them: 0 and 1
        assert {tuple(line.get_xdata()) for line in ax.lines if "per step" not in line.get_label()} == {(0, 1)}
    assert speed_ax.get_ylim()[0] == 0
    assert "SYNTHETIC stand-in" in fig._suptitle.get_text()
    assert acc_ax.get_xlabel() == "epoch"


def test_plot_draws_the_test_score_of_a_checkpoint_of_the_run(run_dir, data_dir, tmp_path, capsys):
    """A ``cli.py test`` of the run's checkpoint is a dashed line at its score on the panel of that metric; the test
    run's own folder has no curve: ``plot`` of it is one line naming the run to plot (it drew two dots, exit 0)."""
    import shutil

    from app.run.plot import figure

    run = tmp_path / "lightning_logs" / "version_0"
    shutil.copytree(run_dir, run)
    ckpt = run / "checkpoints" / "last.ckpt"
    tested = cli("test", "--config", str(CPU_TEST_CONFIG), "--data.data_dir", str(data_dir), "--ckpt_path",
                 str(ckpt), cwd=tmp_path)  # fmt: skip
    assert tested.returncode == 0, tested.stderr[-2000:]
    (row,) = [row for row in read_rows(tmp_path / "lightning_logs" / "version_1" / "metrics.csv") if row["test/acc"]]
    loss_ax, acc_ax, _ = figure(run, ImageClassifier).axes
    for ax, metric in ((acc_ax, "test/acc"), (loss_ax, "test/loss")):
        (line,) = [line for line in ax.lines if line.get_label().startswith(metric)]
        assert line.get_linestyle() == "--" and set(line.get_ydata()) == {float(row[metric])}
        assert line.get_label() == f"{metric} {float(row[metric]):.4f} (version_1: last.ckpt)"
    code, err = exit_code_and_stderr(capsys, "plot", str(tmp_path / "lightning_logs" / "version_1"))
    assert code == 2 and err == (
        f"error: {tmp_path / 'lightning_logs' / 'version_1'} holds a `cli.py test` of {ckpt}, not a training run: "
        f"plot the run that trained it, `cli.py plot {run}` (its figure marks this score)\n"
    ), err
    assert not (tmp_path / "lightning_logs" / "version_1" / "plot.png").exists()


def test_tensorboard_opens_on_the_accuracy_and_the_loss(run_dir):
    """TensorBoard shows its groups of scalars in alphabetical order: the accuracy's and the loss's come first,
    each with its splits side by side, and no "epoch" staircase; the values are metrics.csv's."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = run_dir.glob("events.out.tfevents.*")
    accumulator = EventAccumulator(str(events))
    accumulator.Reload()
    tags = accumulator.Tags()["scalars"]
    groups = sorted({tag.partition("/")[0] for tag in tags})
    assert groups[:2] == ["acc", "loss"] and "epoch" not in tags, groups
    assert {"acc/train", "acc/val", "loss/train", "loss/train_epoch", "loss/val"} <= set(tags)
    assert groups[2:] == ["lr-SGD", "perf"], groups  # nothing else: every loss in one group
    val_acc = [float(row["val/acc"]) for row in read_rows(run_dir / "metrics.csv") if row["val/acc"]]
    assert [event.value for event in accumulator.Scalars("acc/val")] == pytest.approx(val_acc, rel=1e-6)


def read_rows(path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("case", ["binary", "text epoch", "out is a folder"])
def test_plot_of_bad_input_is_one_line_and_writes_nothing(run_dir, tmp_path, case, capsys):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    (run / "plot.png").unlink(missing_ok=True)
    args = ["plot", str(run)]
    if case == "binary":
        (run / "metrics.csv").write_bytes(bytes(range(256)) * 10)
    elif case == "text epoch":
        text = (run / "metrics.csv").read_text().splitlines()
        (run / "metrics.csv").write_text("\n".join(text[:1] + ["zero," + text[-1].split(",", 1)[1]]) + "\n")
    else:
        args += ["--out", str(tmp_path)]
    code, err = exit_code_and_stderr(capsys, *args)
    assert code == 2 and err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    assert not list(run.glob("*.png")) and not list(run.glob(".*partial*")) and not list(tmp_path.glob(".*partial*"))


def exit_code_and_stderr(capsys, *args: str) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exit_info:
        run_cli(*args)
    return exit_info.value.code, capsys.readouterr().err


def test_plot_without_matplotlib_says_how_to_install_it_into_this_python(run_dir, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    code, err = exit_code_and_stderr(capsys, "plot", str(run_dir))
    assert code == 2
    assert err.strip() == f'error: plot needs matplotlib: {sys.executable} -m pip install -e "{ROOT}[plot]"', err


def test_plot_of_a_folder_without_metrics_names_it(tmp_path, capsys):
    code, err = exit_code_and_stderr(capsys, "plot", str(tmp_path))
    assert code == 2
    assert f"error: {tmp_path / 'metrics.csv'}: not found" in err


# ------------------------------------------------------------------------------------------------ export
def test_export_rebuilds_the_network_with_identical_predictions(run_dir, tmp_path):
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    out = tmp_path / "model.pt"
    result = cli("export", "--ckpt_path", str(ckpt), "--out", str(out), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]

    payload = torch.load(out, weights_only=True)  # plain data
    assert payload["network"] == {"arch": "resnet_tiny", "num_classes": 10, "norm": "batch"}
    # Where it came from: the data, the checkpoint's scores, and this checkout's commit.
    assert payload["trained_on"] == "synthetic"
    assert set(payload["metrics"]) == {"val/acc", "best val/acc"} and 0 <= payload["metrics"]["val/acc"] <= 1
    assert payload["epoch"] == 1 and payload["global_step"] > 0 and payload["checkpoint"] == str(ckpt)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    assert payload["git_commit"].removesuffix("+dirty") == head
    assert not any(k.startswith(("net.", "module.")) for k in payload["state_dict"])
    fresh = build_resnet(**payload["network"])
    fresh.load_state_dict(payload["state_dict"], strict=True)

    module = ImageClassifier.load_from_checkpoint(ckpt, map_location="cpu", weights_only=True).eval()
    x = torch.randn(16, 1, 28, 28)
    with torch.no_grad():
        expected = module(x)
        assert torch.equal(fresh.eval()(x), expected)
        assert torch.equal(load_exported(out)(x), expected)

    again = cli("export", "--ckpt_path", str(ckpt), "--out", str(out), cwd=tmp_path)
    assert again.returncode == 2 and "already exists; choose another path or pass --overwrite" in again.stderr
    assert torch.equal(
        torch.load(out, weights_only=True)["state_dict"]["fc.weight"], payload["state_dict"]["fc.weight"]
    )


# What a user does with model.pt2 on a machine without this project: torch alone. Any import of the project, Lightning
# or torchvision fails, so a program that needed them could not score.
SCORE_WITH_TORCH_ALONE = """
import importlib.abc, json, sys

class WithoutTheProject(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {"app", "tests", "lightning", "pytorch_lightning", "torchvision", "torchmetrics"}:
            raise ImportError(f"the exported program needs {name}")

sys.meta_path.insert(0, WithoutTheProject())
import torch

extra = {"fashion_resnet.json": ""}
program = torch.export.load(sys.argv[1], extra_files=extra).module()
images, labels = torch.load(sys.argv[2], weights_only=True)
with torch.no_grad():
    logits = [program(images[i : i + 1000, None].float() / 255) for i in range(0, len(images), 1000)]
predicted = torch.cat(logits).argmax(1)
print(json.dumps({"correct": int((predicted == labels).sum()), "metadata": json.loads(extra["fashion_resnet.json"])}))
"""


def accuracy_of_test_run(version_dir) -> float:
    (acc,) = [float(row["test/acc"]) for row in read_rows(version_dir / "metrics.csv") if row.get("test/acc")]
    return acc


@pytest.mark.slow
@pytest.mark.parametrize("data", ["generated", pytest.param("real", marks=needs_system_copy)])
def test_an_exported_program_scores_the_test_set_as_its_checkpoint_with_torch_alone(data, run_dir, data_dir, request):
    """``cli.py export --out model.pt2`` gives a program that needs torch alone, and it scores the test images
    exactly as ``cli.py test`` scores its checkpoint; on the real Fashion-MNIST where it is installed."""
    workdir = run_dir.parent.parent
    if data == "real":  # a short run of its own on the real data: a checkpoint is tested on what it was trained on
        request.getfixturevalue("system_copy")
        workdir = request.getfixturevalue("tmp_path") / "real"
        workdir.mkdir()
        fit = cli("fit", "--config", str(CPU_TEST_CONFIG), "--data.source=fashion_mnist", "--data.batch_size=64",
                  "--trainer.max_epochs=1", "--trainer.limit_train_batches=40", cwd=workdir)  # fmt: skip
        assert fit.returncode == 0, fit.stderr[-2000:]
        images, labels = (
            read_idx(SYSTEM_COPY / "t10k-images-idx3-ubyte.gz"),
            read_idx(SYSTEM_COPY / "t10k-labels-idx1-ubyte.gz"),
        )
        source = ["--data.source=fashion_mnist"]
    else:
        raw = data_dir / "FashionMNIST-synthetic" / "raw"
        images, labels = read_idx(raw / "t10k-images-idx3-ubyte"), read_idx(raw / "t10k-labels-idx1-ubyte")
        source = ["--data.data_dir", str(data_dir)]
    versions = workdir / "lightning_logs"
    ckpt = versions / "version_0" / "checkpoints" / "last.ckpt"
    before = {path.name for path in versions.iterdir()}
    tested = cli("test", "--config", str(CPU_TEST_CONFIG), *source, "--trainer.limit_test_batches=1.0",
                 "--ckpt_path", str(ckpt), cwd=workdir)  # fmt: skip
    assert tested.returncode == 0, tested.stderr[-2000:]
    (version,) = {path.name for path in versions.iterdir()} - before
    checkpoint_accuracy = accuracy_of_test_run(versions / version)

    program = workdir / f"model-{data}.pt2"
    exported = cli("export", "--ckpt_path", str(ckpt), "--out", str(program), cwd=workdir)
    assert exported.returncode == 0, exported.stderr[-2000:]
    test_set = workdir / f"test-set-{data}.pt"
    torch.save((images, labels), test_set)
    elsewhere = request.getfixturevalue("tmp_path_factory").mktemp("elsewhere")
    scored = subprocess.run(
        [sys.executable, "-I", "-c", SCORE_WITH_TORCH_ALONE, str(program), str(test_set)],
        capture_output=True, text=True, timeout=300, cwd=elsewhere, env={"PATH": os.environ["PATH"]},
    )  # fmt: skip
    assert scored.returncode == 0, scored.stderr[-2000:]
    result = json.loads(scored.stdout)
    assert result["correct"] / len(labels) == pytest.approx(checkpoint_accuracy, abs=1e-6), (
        result,
        checkpoint_accuracy,
    )
    assert result["metadata"]["trained_on"] == ("fashion_mnist" if data == "real" else "synthetic")
    assert result["metadata"]["classes"][0] == "T-shirt/top" and result["metadata"]["input"] == [1, 28, 28]
    if data == "real":
        assert checkpoint_accuracy > 0.5  # trained on it: far above chance (0.1)


def test_export_without_out_writes_into_the_checkpoints_run_folder_and_a_clone_ignores_exports(
    run_dir, tmp_path, monkeypatch, capsys
):
    """README's ``export --out model.pt2``, run in the clone, left an untracked model file in its root. Now ``--out``
    defaults to ``model.pt2`` in the checkpoint's run folder, and the clone ignores exported models all the same."""
    run = tmp_path / "lightning_logs" / "version_3"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copy(run_dir / "checkpoints" / "last.ckpt", run / "checkpoints" / "last.ckpt")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    run_cli("export", "--ckpt_path", str(run / "checkpoints" / "last.ckpt"))
    err = capsys.readouterr().err
    assert err.strip().endswith(f"-> {run / 'model.pt2'}"), err
    assert (run / "model.pt2").is_file() and list(elsewhere.iterdir()) == []
    ignored = subprocess.run(["git", "check-ignore", "model.pt2", "model.pt"], cwd=ROOT, capture_output=True, text=True)
    assert ignored.stdout.split() == ["model.pt2", "model.pt"], ignored


def test_export_names_the_formats_when_the_suffix_is_none_of_them(run_dir, tmp_path, capsys):
    out = tmp_path / "model.onnx"
    code, err = exit_code_and_stderr(
        capsys, "export", "--ckpt_path", str(run_dir / "checkpoints" / "last.ckpt"), "--out", str(out)
    )
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"--out {out}: the suffix names the format" in err and ".pt2" in err and ".pt (" in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("case", ["missing", "truncated", "weights of another network"])
def test_export_of_a_bad_checkpoint_is_one_line(run_dir, tmp_path, case, capsys):
    ckpt = tmp_path / "bad.ckpt"
    if case == "truncated":
        data = (run_dir / "checkpoints" / "last.ckpt").read_bytes()
        ckpt.write_bytes(data[: len(data) // 2])
    if case == "weights of another network":  # resnet_tiny's weights under a resnet18 label
        checkpoint = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
        checkpoint["hyper_parameters"]["arch"] = "resnet18"
        torch.save(checkpoint, ckpt)
    code, err = exit_code_and_stderr(capsys, "export", "--ckpt_path", str(ckpt), "--out", str(tmp_path / "m.pt"))
    assert code == 2 and err.startswith(f"error: {ckpt}") and len(err.strip().splitlines()) == 1, err
    if case == "weights of another network":
        assert "its weights do not fit this network" in err
    assert not (tmp_path / "m.pt").exists()


# ------------------------------------------------------------------------------------------------ predict
def read_predictions(version_dir) -> list[dict]:
    with open(version_dir / "predictions.csv", newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_predict_on_a_folder_of_png_images(run_dir, data_dir, workdir, recwarn):
    """The user's own images: no Fashion-MNIST is read, fetched or generated for them."""
    images = read_idx(data_dir / "FashionMNIST-synthetic" / "raw" / "t10k-images-idx3-ubyte")[:12]
    images = torch.as_tensor(images)
    folder = workdir / "photos"
    folder.mkdir()
    for i, image in enumerate(images):
        write_png(image[None], str(folder / f"item{i:02d}.png"))
    write_png((255 - images[3])[None], str(folder / "item03_inverted.png"))  # dark on light, as a photo would be
    Image.fromarray(images[5].numpy().astype("uint16") * 257).save(folder / "item05_16bit.png")  # same, 16 bits deep
    (folder / "notes.txt").write_text("not an image, ignored")

    ckpt = run_dir / "checkpoints" / "last.ckpt"
    no_data = workdir / "no-data"
    args = ["predict", "--config", str(CPU_TEST_CONFIG), "--data.data_dir", str(no_data), "--ckpt_path", str(ckpt)]
    run_cli(*args, "--data.source=auto", "--data.predict_dir", str(folder))
    assert not no_data.exists()
    assert not [w for w in recwarn if "stand-in" in str(w.message)]
    rows = read_predictions(workdir / "lightning_logs" / "version_0")
    assert [r["name"] for r in rows] == sorted(p.name for p in folder.glob("*.png"))

    with torch.no_grad():
        expected = load_network(ckpt)(normalized(images)).argmax(1).tolist()
    by_name = {r["name"]: int(r["pred"]) for r in rows}
    assert [by_name[f"item{i:02d}.png"] for i in range(12)] == expected
    assert by_name["item03_inverted.png"] == by_name["item03.png"]  # auto-inverted back to Fashion-MNIST polarity
    assert by_name["item05_16bit.png"] == by_name["item05.png"]
    assert all(0 < float(r["prob"]) <= 1 and r["label"] == "" for r in rows)  # no label: an empty cell


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "ddp_spawn", "horovod"])
def test_predict_with_two_processes_predicts_every_image_once(run_dir, data_dir, tmp_path, strategy):
    """7 images over 2 ranks: the sampler pads to 8, yet predictions.csv has each image once, as one device predicts."""
    images = torch.as_tensor(read_idx(data_dir / "FashionMNIST-synthetic" / "raw" / "t10k-images-idx3-ubyte")[:7])
    folder = tmp_path / "photos"
    folder.mkdir()
    for i, image in enumerate(images):
        write_png(image[None], str(folder / f"item{i}.png"))
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    args = ["predict", "--config", str(CPU_TEST_CONFIG), "--data.data_dir", str(data_dir), "--ckpt_path", str(ckpt)]
    args += ["--data.predict_dir", str(folder), f"--trainer.strategy={strategy}", "--trainer.devices=2"]
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    result = warm.run(
        [sys.executable, str(ROOT / "cli.py"), *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (version,) = (tmp_path / "lightning_logs").glob("version_*")
    rows = read_predictions(version)
    assert [r["name"] for r in rows] == [f"item{i}.png" for i in range(7)]
    with torch.no_grad():
        expected = load_network(ckpt)(normalized(images)).argmax(1).tolist()
    assert [int(r["pred"]) for r in rows] == expected


@pytest.mark.slow
def test_predict_on_the_test_set_writes_true_labels(run_dir, data_dir, workdir):
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    run_cli("predict", "--config", str(CPU_TEST_CONFIG), "--data.data_dir", str(data_dir), "--ckpt_path", str(ckpt))
    rows = read_predictions(workdir / "lightning_logs" / "version_0")
    assert len(rows) == 2 * 16  # limit_predict_batches=2, batch 16
    assert [r["name"] for r in rows[:2]] == ["test[0]", "test[1]"]
    assert all(0 <= int(r["label"]) < 10 for r in rows)


def test_a_file_in_predict_dir_that_is_no_image_is_one_line_naming_it(tmp_path):
    """torchvision's own message starts with its C++ source path (/__w/vision/.../decode_image.cpp:61): left out."""
    from app.errors import UserError
    from app.fashion_mnist.image_folder import load_image_folder

    (tmp_path / "notes.png").write_text("not an image")
    with pytest.raises(UserError) as error:
        load_image_folder(tmp_path)
    message = str(error.value)
    assert message.startswith(f"{tmp_path / 'notes.png'}: not a readable image (Unsupported image file.")
    assert ".cpp" not in message and message.endswith("remove it from --data.predict_dir")


def test_predict_dir_that_does_not_exist_is_one_line_before_anything_runs(workdir, data_dir, capsys, caplog):
    """The line came after Lightning's "GPU available", "TPU available" and "Seed set to 42" (the folder was read in
    the data module's setup); now the data module checks it when it is made, before the trainer."""
    args = ["predict", "--config", str(CPU_TEST_CONFIG), "--data.data_dir", str(data_dir)]
    with caplog.at_level("INFO"):
        code, err = exit_code_and_stderr(capsys, *args, "--data.predict_dir", "no/such/folder")
    assert code == 2
    assert err.startswith("error: --data.predict_dir='no/such/folder' does not exist; give a folder of .png/.jpg ")
    assert len(err.splitlines()) == 1 and [r.getMessage() for r in caplog.records] == [], caplog.records


def test_predict_takes_one_image_or_a_glob_and_shows_a_handful_as_a_table(run_dir, data_dir, workdir, capsys):
    """A single image file was refused ("is not a folder") and the predictions went only to predictions.csv, where
    an image without a label said ``-1``. Now ``--data.predict_dir`` takes a folder, one image or a glob; a handful
    of predictions is also a table on the terminal; an image's label cell is empty."""
    images = torch.as_tensor(read_idx(data_dir / "FashionMNIST-synthetic" / "raw" / "t10k-images-idx3-ubyte")[:3])
    shots = workdir / "shots"
    (shots / "more").mkdir(parents=True)
    for i, image in enumerate(images):
        write_png(image[None], str((shots if i < 2 else shots / "more") / f"shot{i}.png"))
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    args = ["predict", "--config", str(CPU_TEST_CONFIG), "--data.data_dir", str(data_dir), "--ckpt_path", str(ckpt)]
    with torch.no_grad():
        expected = load_network(ckpt)(normalized(images)).argmax(1).tolist()
    from app.fashion_mnist.data import CLASSES

    for given, names in [
        (str(shots / "shot1.png"), ["shot1.png"]),
        (f"{shots}/**/*.png", ["more/shot2.png", "shot0.png", "shot1.png"]),  # from the pattern's first wildcard
    ]:
        capsys.readouterr()
        run_cli(*args, "--data.predict_dir", given)
        [version] = sorted((workdir / "lightning_logs").glob("version_*"), key=lambda v: int(v.name.split("_")[1]))[-1:]
        rows = read_predictions(version)
        assert [r["name"] for r in rows] == names and all(r["label"] == "" for r in rows), rows
        out = capsys.readouterr().out
        for r in rows:
            index = int(r["name"].rpartition("shot")[2][0])
            assert int(r["pred"]) == expected[index] and r["class"] == CLASSES[expected[index]]
            shown = re.search(rf"{re.escape(r['name'])}\s*│\s*(\d+)\s*│\s*(.+?)\s*│\s*([\d.]+)", out)
            assert shown and shown.groups() == (r["pred"], r["class"], r["prob"]), out
        assert "label" not in out and "Predictions (" in out, out
    for given, said in [
        (str(shots / "notes.txt"), "is not a .png/.jpg/.jpeg image"),
        (f"{shots}/*.gif", "matches no .png/.jpg/.jpeg file"),
    ]:
        (shots / "notes.txt").write_text("not an image")
        code, err = exit_code_and_stderr(capsys, *args, "--data.predict_dir", given)
        assert code == 2 and f"error: --data.predict_dir={given!r} {said}" in err, err
