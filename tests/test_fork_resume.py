"""A fork's run, exact and continued (issue 70): a task that sizes its schedule the way Lightning's docs say, in a
package outside the repo, stopped mid-epoch and resumed, ends with the weights of an unbroken run.

Lightning builds the training loader early when ``configure_optimizers`` reads ``trainer.estimated_stepping_batches``
(or calls ``trainer.fit_loop.setup_data()`` to read its length), before the checkpoint is restored; its fit loop then
never hands the loader its saved position, and a resumed run read batches 0, 1, 2, ... of the stopped epoch again.
"""

import csv
import re
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT
from tests.test_as_users_run_it import noise, run
from tests.vit_fork import ENTRY, EXPORT, SOURCE, write_pngs

pytestmark = pytest.mark.slow


def _package(tmp_path: Path) -> tuple[Path, Path]:
    packages, pngs = tmp_path / "site", tmp_path / "pngs"
    (packages / "vitpkg").mkdir(parents=True)
    (packages / "vitpkg" / "__init__.py").write_text(SOURCE)
    (packages / "vitpkg" / "export.py").write_text(EXPORT)
    write_pngs(pngs)
    return packages, pngs


def _fit(root: Path, pngs: Path, *args: str) -> list[str]:
    return [
        *(sys.executable, str(ROOT / "cli.py"), "fit", "--model=vitpkg.TinyViT", "--data=vitpkg.PngData"),
        *(f"--data.folder={pngs}", f"--trainer.default_root_dir={root}", "--trainer.accelerator=cpu"),
        *("--trainer.max_epochs=2", "--trainer.log_every_n_steps=1", "--trainer.enable_progress_bar=false"),
        *("--seed_everything=7", *args),
    ]


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)["state_dict"]


def _differing(a: Path, b: Path) -> list[str]:
    one, other = _weights(a), _weights(b)
    assert one.keys() == other.keys()
    return [name for name in one if not torch.equal(one[name], other[name])]


@pytest.mark.parametrize(
    ("schedule_from", "devices"),
    [
        ("estimated_stepping_batches", 1),
        ("len_train_dataloader", 2),
        ("on_fit_start", 1),
    ],
)
def test_a_fork_whose_schedule_is_sized_from_the_loader_resumes_bitwise_mid_epoch(tmp_path, schedule_from, devices):
    """48 images, 8 a step (4 on each of two ranks): 6 steps an epoch; the stop comes two batches into epoch 1."""
    packages, pngs = _package(tmp_path)
    env = {"PYTHONPATH": f"{packages}:{ROOT}"}
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    ddp = ("--trainer.strategy=ddp", "--trainer.devices=2", "--data.batch_size=4") if devices == 2 else ()
    task = (f"--model.schedule_from={schedule_from}", *ddp)

    whole = run(_fit(tmp_path / "whole", pngs, *task), cwd=elsewhere, env=env)
    assert whole.returncode == 0, whole.stderr[-3000:]
    per_epoch = 6
    stop_at = per_epoch + 1  # the signal after batch 0 of epoch 1: the run stops after the next
    signal = ("--trainer.callbacks+=tests.signal_at_step.SignalAtStep", f"--trainer.callbacks.step={stop_at}")
    stopped = run(_fit(tmp_path / "cut", pngs, *task, *signal), cwd=elsewhere, env=env, fresh=False)
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    stop = re.search(r"SIGTERM: stopped after step (\d+) \(epoch 1\)", stopped.stderr)
    assert stop and int(stop.group(1)) < 2 * per_epoch, stopped.stderr[-2000:]  # mid-epoch
    resumed = run(_fit(tmp_path / "cut", pngs, *task, "--ckpt_path", "last"), cwd=elsewhere, env=env, fresh=False)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert noise(resumed.stderr) == [], resumed.stderr[-3000:]

    a = tmp_path / "whole/lightning_logs/version_0/checkpoints/last.ckpt"
    b = tmp_path / "cut/lightning_logs/version_1/checkpoints/last.ckpt"
    assert torch.load(b, weights_only=True)["global_step"] == torch.load(a, weights_only=True)["global_step"]
    assert _differing(a, b) == []


def test_a_forks_own_export_and_a_folder_of_its_own_images_through_its_entry_script(tmp_path):
    """docs/fork.md's lines, run: the fork's entry script makes its task the default and adds its own ``export``
    (``main(tools=...)``); the exported program runs with torch alone and gives the checkpoint's logits; ``predict``
    with the data module's ``--data.predict_dir`` writes one row per PNG, named by its file, with its class name."""
    packages, pngs = _package(tmp_path)
    script, elsewhere, root = tmp_path / "fork" / "train.py", tmp_path / "cwd", tmp_path / "runs"
    script.parent.mkdir()
    script.write_text(ENTRY)
    elsewhere.mkdir()
    env = {"PYTHONPATH": f"{packages}:{ROOT}"}
    data = (f"--data.folder={pngs}", f"--trainer.default_root_dir={root}", "--trainer.accelerator=cpu")

    fitted = run([sys.executable, str(script), "fit", *data, "--trainer.max_epochs=1"], cwd=elsewhere, env=env)
    assert fitted.returncode == 0, fitted.stderr[-3000:]
    last = root / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"
    exported = run([sys.executable, str(script), "export", f"--ckpt_path={last}"], cwd=elsewhere, env=env, fresh=False)
    assert exported.returncode == 0, exported.stderr[-3000:]
    program = torch.export.load(last.parent.parent / "model.pt2").module()
    images = torch.rand(5, 1, 8, 8)
    checkpoint = torch.load(last, weights_only=True)
    sys.path.insert(0, str(packages))
    try:
        from vitpkg import TinyViT

        model = TinyViT(**{k: v for k, v in checkpoint["hyper_parameters"].items() if not k.startswith("_")}).eval()
    finally:
        sys.path.remove(str(packages))
        sys.modules.pop("vitpkg", None)
    model.load_state_dict(checkpoint["state_dict"])
    with torch.no_grad():
        assert torch.allclose(program(images), model(images), atol=1e-6)

    new = tmp_path / "new"
    new.mkdir()
    for index, file in enumerate(sorted((pngs / "val" / "c1").glob("*.png"))[:3]):
        (new / f"photo{index}.png").write_bytes(file.read_bytes())
    predict = [sys.executable, str(script), "predict", *data, f"--data.predict_dir={new}", "--ckpt_path=last"]
    predicted = run(predict, cwd=elsewhere, env=env, fresh=False)
    assert predicted.returncode == 0, predicted.stderr[-3000:]
    rows = list(csv.DictReader((root / "lightning_logs" / "version_1" / "predictions.csv").open()))
    assert [r["name"] for r in rows] == ["photo0.png", "photo1.png", "photo2.png"]
    assert all(r["class"] in ("c0", "c1", "c2") and r["class"] == f"c{r['pred']}" for r in rows), rows
