"""The Dockerfile built and its image run with docs/docker.md's commands, podman in place of docker.

Each test types a command of docs/docker.md (``docker`` -> ``podman``), shortened to CI's time with
``--trainer.max_steps`` or ``--trainer.limit_*_batches``, on the CPU (``--trainer.accelerator=cpu`` where the command
leaves it to ``auto``). What podman needs on this machine besides the command (a base made by debootstrap, a
containers.conf, the certificate bundle for pip) is in tests/container.py. All of it runs on one pytest worker, in
this file's order: the build first (4 to 6 min cold, seconds when cached), then the runs, one container at a time.
"""

import json
import os
import time
from pathlib import Path

import pytest

from tests import container
from tests.container import IMAGE, volume
from tests.test_reliability import assert_same_weights, last_ckpt, metrics, versions

REASON = container.missing()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.xdist_group("container"),  # one build, and one container at a time on the 2 cores
    pytest.mark.timeout(2400),  # the first test builds: 4 to 6 min cold; each command below has its own limit
    pytest.mark.skipif(REASON is not None, reason=f"cannot build or run the image: {REASON}"),
]

SHM = "--shm-size=8g"  # docs/docker.md's: a tmpfs limit, nothing is allocated until written
CPU = "--trainer.accelerator=cpu"
SYSTEM_DATA = "/usr/share/datasets/fashion-mnist"


@pytest.fixture(scope="module")
def built() -> dict:
    """``podman build -t fashion-resnet .`` once for this file: the result, its seconds and the image's config."""
    started = time.monotonic()
    result = container.build()
    seconds = time.monotonic() - started
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    [inspected] = json.loads(container.podman("image", "inspect", IMAGE, check=True).stdout)
    print(f"\nbuild: {seconds:.0f} s; image {inspected['Size'] / 1e9:.2f} GB")
    return {"seconds": seconds, "image": inspected}


def owned_by(folder: Path, uid: int) -> None:
    """``folder`` and everything in it belongs to ``uid``."""
    for path in [folder, *folder.rglob("*")]:
        assert path.lstat().st_uid == uid, (path, path.lstat().st_uid)


def test_the_dockerfile_builds_a_lean_image_that_runs_as_uid_1000(built):
    """The build (``--pull=never``: the base is the stand-in, tests/container.py), then what is in the image: the
    venv first on PATH, the data, gcc/g++ and Python.h for torch.compile, mpirun, the user; and what is not: pip's
    cache, the build's pip.conf and certificate, the stub of the dependency layer, tests, data or logs."""
    config = built["image"]["Config"]
    assert config["User"] == "trainer"
    assert config["Entrypoint"] == ["python", "cli.py"]
    assert config["Cmd"] == ["fit", "--config", "configs/quickstart.yaml"]
    assert {"/app/data", "/app/lightning_logs"} <= set(config["Volumes"])
    env = dict(item.split("=", 1) for item in config["Env"])
    assert env["PATH"].startswith("/opt/venv/bin:") and env["HOME"] == "/tmp"
    probe = """set -e
        id -u; id -un; for tool in python mpirun gcc g++; do command -v $tool; done
        python -c 'import sysconfig, os; print(os.path.exists(sysconfig.get_paths()["include"] + "/Python.h"))'
        ls /usr/share/datasets/fashion-mnist | wc -l
        ls -A /app | tr '\\n' ' '; echo
        for p in /var/cache/pip /root/.cache /tmp/.cache /etc/pip.conf /etc/pip-ca.crt /app/tests /app/.git \
            /app/fashion_resnet_template.egg-info /var/lib/apt/lists/lock; do
            [ -f "$p" ] || [ -n "$(ls -A "$p" 2>/dev/null)" ] && echo "left: $p"; done  # a file, or a folder not empty
        true"""
    result = container.run("--entrypoint", "sh", IMAGE, "-c", probe, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[:7] == [
        "1000", "trainer", "/opt/venv/bin/python", "/opt/venv/bin/mpirun", "/usr/bin/gcc", "/usr/bin/g++", "True"
    ], lines  # fmt: skip
    assert lines[7] == "4", lines  # the four files of the real Fashion-MNIST
    assert set(lines[8].split()) == {"README.md", "app", "bench", "cli.py", "configs", "data", "examples",
                                     "lightning_logs", "pyproject.toml", "setup.cfg"}, lines[8]  # fmt: skip
    assert not [line for line in lines if line.startswith("left:")], lines


def test_the_default_command_trains_the_quickstart_on_the_real_data_in_the_image(built):
    """``docker run fashion-resnet``: the image's CMD, which is the quickstart (checked), with max_steps to fit CI."""
    cmd = built["image"]["Config"]["Cmd"]
    result = container.run(IMAGE, *cmd, "--trainer.max_steps=5", timeout=300)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    assert f"images of Fashion-MNIST in {SYSTEM_DATA} (the system copy, Debian's dataset-fashion-mnist" in out, out
    assert "`max_steps=5` reached" in out


def test_help_and_a_bad_flag_are_as_outside_the_container(built):
    shown = container.run(IMAGE, "--help", timeout=120)
    assert shown.returncode == 0 and "fit" in shown.stdout, shown.stderr
    bad = container.run(IMAGE, "fit", "--trainer.max_step=5", timeout=120)
    assert bad.returncode == 2 and bad.stdout == "", bad.stdout
    [line] = bad.stderr.splitlines()
    assert line.startswith("error: ") and "did you mean --trainer.max_steps?" in line, line


def test_ddp_trains_two_ranks_as_another_uid_on_data_and_logs_in_volumes(built, tmp_path):
    """docs/docker.md's ddp command on the CPU with the quickstart's small network (d2l's ResNet-18, the default,
    takes 16 s a step here), as ``--user 1234:1234`` (no passwd entry in the image), with the
    real files in the data volume (a user's own copy: read from there, not from the image) and the run's folder in
    the logs volume, every file of it owned by 1234."""
    data, logs = volume(tmp_path / "data", 1234), volume(tmp_path / "lightning_logs", 1234)
    raw = data / "FashionMNIST" / "raw"
    raw.mkdir(parents=True)
    copy_from_image(SYSTEM_DATA, raw)
    for path in [data, *data.rglob("*")]:
        os.chown(path, 1234, 1234)
    result = container.run(
        SHM, "-v", f"{data}:/app/data", "-v", f"{logs}:/app/lightning_logs", "--user", "1234:1234",
        IMAGE, "fit", "--config", "configs/quickstart.yaml", "--trainer.strategy=ddp", "--trainer.devices=2", CPU,
        "--trainer.max_steps=3", "--trainer.limit_val_batches=1", timeout=400,
    )  # fmt: skip
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    assert "images of Fashion-MNIST in data/FashionMNIST/raw (torchvision's layout" in out, out[-3000:]
    [run] = versions(tmp_path)
    state = last_ckpt(run)["callbacks"]["RandomState"]
    assert state == {"seed": 42, "world_size": 2}  # two ranks trained; their generators follow from the seed
    assert {"config.yaml", "metrics.csv", "checkpoints"} <= {p.name for p in run.iterdir()}
    owned_by(logs, 1234)


def test_torch_compile_builds_its_cpu_kernels_in_the_image_as_any_uid(built):
    """What the compilers kept in the image are for: inductor writes C++ for the CPU and compiles it (g++, Python.h),
    with its caches in /tmp, as a uid that has no passwd entry and no home."""
    code = "import torch; f = torch.compile(lambda x: (x.sin() + 1).sum()); print(f(torch.zeros(8)).item())"
    result = container.run("--user", "1234:1234", "--entrypoint", "python", IMAGE, "-c", code, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["8.0"], result.stdout


def copy_from_image(path: str, dest: Path) -> None:
    """The files of folder ``path`` in the image, copied to ``dest`` (``podman create`` and ``podman cp``)."""
    created = container.podman("create", IMAGE, check=True).stdout.strip()
    try:
        container.podman("cp", f"{created}:{path}/.", str(dest), check=True)
    finally:
        container.remove(created)


# ------------------------------------------------------------------------------------------------ stop and resume
# The example task on the image's real data, with augmentation (random crops and flips, drawn every step: the
# random state must come back too), the CPU test preset's small network and batch, 8 steps an epoch, 2 epochs, every
# step's loss logged; Pace (tests/container.py, mounted read-only) says each step of epoch 0 and slows it, so that
# the stop typed from outside lands inside the epoch.
STEPS = 8
PACE = {"class_path": "tests.container.Pace", "init_args": {"seconds": 1.0, "steps": STEPS}}  # 5 s after step 3
SETTINGS = ("--config", "configs/quickstart.yaml", "--model.arch=resnet_tiny", "--data.batch_size=32")
FIT = (
    "fit", *SETTINGS, "--data.augment=true", "--trainer.max_epochs=2", f"--trainer.limit_train_batches={STEPS}",
    "--trainer.limit_val_batches=1", "--trainer.log_every_n_steps=1", "--trainer.callbacks+=" + json.dumps(PACE),
)  # fmt: skip


def mounts(folder: Path, uid: int) -> list[str]:
    """docs/docker.md's volumes and ``--user``, and the test's own Pace (read-only)."""
    data, logs = volume(folder / "data", uid), volume(folder / "lightning_logs", uid)
    tests = ["-v", f"{container.ROOT / 'tests'}:/app/tests:ro"]
    return [SHM, "-v", f"{data}:/app/data", "-v", f"{logs}:/app/lightning_logs", "--user", f"{uid}:{uid}", *tests]


@pytest.fixture(scope="module")
def stopped_and_resumed(built, tmp_path_factory) -> dict:
    """An unbroken run; a run stopped with ``podman stop`` after step 3 (of 8 in epoch 0); the same command with
    ``--ckpt_path last`` in a new container: each in the image, as uid 1000, with its folders in volumes."""
    base = tmp_path_factory.mktemp("stop")
    unbroken = container.run(*mounts(base / "unbroken", 1000), IMAGE, *FIT, timeout=300)
    assert unbroken.returncode == 0, (unbroken.stdout + unbroken.stderr)[-3000:]
    folder, log = base / "stopped", base / "stopped.log"
    with container.started(*mounts(folder, 1000), IMAGE, *FIT, log=log) as (name, process):
        container.wait_for_line(log, "pace: step 3\n", process, timeout=180)
        started = time.monotonic()
        stop = container.podman("stop", name, timeout=60)  # docker's default: SIGTERM, SIGKILL 10 s later
        stop_seconds = time.monotonic() - started
        code = process.wait(timeout=60)
    resumed = container.run(*mounts(folder, 1000), IMAGE, *FIT, "--ckpt_path=last", timeout=300)
    return {
        "base": base, "stop": stop, "stop_seconds": stop_seconds, "code": code, "log": log.read_text(),
        "resumed": resumed,
    }  # fmt: skip


def test_podman_stop_saves_in_the_volume_and_a_new_container_resumes_bitwise_an_unbroken_run(stopped_and_resumed):
    """SIGTERM from ``podman stop``: the run finishes its step, writes last.ckpt into the volume and exits 143 well
    within the 10 s before SIGKILL; ``--ckpt_path last`` in a new container says it resumes from that last.ckpt at
    its step N, logs no training step before N, and ends with the unbroken run's weights (every tensor
    ``torch.equal``); each run's own losses are the unbroken run's at the same steps, augmentation included. (A
    second container that trained from step 0, or from another run's checkpoint, ends with the same weights by
    determinism: its line and its rows tell it apart.)"""
    r = stopped_and_resumed
    assert r["stop"].returncode == 0, r["stop"].stderr
    assert r["code"] == 143 and r["stop_seconds"] < 10, (r["code"], r["stop_seconds"], r["log"][-3000:])
    base = r["base"]
    first, resumed_run = versions(base / "stopped")
    step = last_ckpt(first)["global_step"]
    assert 3 <= step < STEPS, (step, r["stop_seconds"], r["log"][-3000:])  # inside epoch 0
    assert f"SIGTERM: stopped after step {step} (epoch 0)" in r["log"], r["log"][-3000:]
    said = r["resumed"].stdout + r["resumed"].stderr
    assert r["resumed"].returncode == 0, said[-3000:]
    own = f"lightning_logs/{first.name}/checkpoints/last.ckpt"  # the stopped run's, in the container's /app
    assert f"--ckpt_path last: resuming from {own} (step {step})" in said, said[-3000:]
    [expected] = versions(base / "unbroken")
    assert last_ckpt(resumed_run)["global_step"] == last_ckpt(expected)["global_step"] == 2 * STEPS
    assert_same_weights(last_ckpt(resumed_run), last_ckpt(expected))
    unbroken = metrics(expected)["train/loss"]
    assert len(unbroken) == 2 * STEPS  # a loss at every step
    assert metrics(first)["train/loss"] == {s: loss for s, loss in unbroken.items() if s < step}
    assert metrics(resumed_run)["train/loss"] == {s: loss for s, loss in unbroken.items() if s >= step}
    owned_by(base / "stopped" / "lightning_logs", 1000)


def test_test_predict_and_export_run_on_the_resumed_checkpoint(stopped_and_resumed):
    """docs/docker.md's tools in the same volumes: ``test`` and ``predict`` with ``--ckpt_path last``, ``export``
    with the checkpoint's path in the container; what they write lands in the volume, owned by uid 1000."""
    folder = stopped_and_resumed["base"] / "stopped"
    run = mounts(folder, 1000)
    tested = container.run(*run, IMAGE, "test", *SETTINGS, "--ckpt_path=last", "--trainer.limit_test_batches=4")
    assert tested.returncode == 0 and "test/acc" in tested.stdout, (tested.stdout + tested.stderr)[-3000:]
    predicted = container.run(
        *run, IMAGE, "predict", *SETTINGS, "--ckpt_path=last", "--trainer.limit_predict_batches=2"
    )
    assert predicted.returncode == 0, (predicted.stdout + predicted.stderr)[-3000:]
    resumed = versions(folder)[1].name
    ckpt = f"lightning_logs/{resumed}/checkpoints/last.ckpt"
    exported = container.run(*run, IMAGE, "export", "--ckpt_path", ckpt)
    assert exported.returncode == 0, (exported.stdout + exported.stderr)[-3000:]
    logs = folder / "lightning_logs"
    assert (logs / resumed / "model.pt2").is_file()
    [predictions] = logs.glob("version_*/predictions.csv")
    assert len(predictions.read_text().splitlines()) == 1 + 2 * 32  # a header and two batches of 32
    owned_by(logs, 1000)


def test_horovod_under_mpirun_as_the_entrypoint_trains_two_ranks(built, tmp_path):
    """docs/docker.md's ``--entrypoint mpirun ... -np N python cli.py fit --trainer.strategy=horovod`` on the CPU
    (Open MPI from PyPI, in the venv), as the image's own user."""
    logs = volume(tmp_path / "lightning_logs", 1000)
    result = container.run(
        SHM, "-v", f"{logs}:/app/lightning_logs", "--entrypoint", "mpirun", IMAGE, "-np", "2",
        "python", "cli.py", "fit", "--config", "configs/quickstart.yaml", "--trainer.strategy=horovod",
        "--trainer.devices=2", CPU, "--trainer.max_steps=3", "--trainer.limit_val_batches=1", timeout=400,
    )  # fmt: skip
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    [run] = versions(tmp_path)
    state = last_ckpt(run)["callbacks"]["RandomState"]
    assert state == {"seed": 42, "world_size": 2}
    owned_by(logs, 1000)


def test_no_container_is_left_behind():
    """Every container of this file was removed (tests/container.py removes them on every path)."""
    listed = container.podman("ps", "--all", "--format", "{{.Names}}", check=True).stdout.split()
    assert not [name for name in listed if name.startswith("fashion-resnet-test-")], listed
