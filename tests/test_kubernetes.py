"""Kubernetes' pods, as the training operator starts them, run here as podman containers of the image, each on a
namespace node of its own (tests/netns.py): ``job-master-0`` on node a (10.77.0.1), ``job-worker-0`` on node b.

What the operator gives a pod is kept: the image's own entrypoint (or ``torchrun`` as the ``command:``), the pod's
name as its host name, the master's service name in its hosts file (the cluster's DNS in Kubernetes), the
environment of docs/kubernetes.md's manifests and nothing else, and a shared host folder for the PVC on
``/app/lightning_logs``. Kubernetes itself does not run here (no cluster, no registry): docs/kubernetes.md says what
was and was not run. The task is the tests' own (tests/tiny.yaml, mounted with tests/ read-only), in float64 with
GroupNorm, so that a run at any world size computes what one process computes up to rounding.
"""

from __future__ import annotations

import json
import time
from contextlib import ExitStack
from pathlib import Path

import pytest

from tests import container
from tests.chaos import TOLERANCE
from tests.container import IMAGE, volume
from tests.netns import TwoNodes, netns_available
from tests.record_samples import read_records, step_losses
from tests.test_reliability import assert_same_weights, last_ckpt, metrics, versions

REASON = container.missing() or (None if netns_available()[0] else netns_available()[1])
pytestmark = [
    pytest.mark.slow,
    pytest.mark.xdist_group("container"),  # with test_container.py: one build, one set of containers at a time
    pytest.mark.timeout(1800),
    pytest.mark.skipif(REASON is not None, reason=f"cannot run the image on namespace nodes: {REASON}"),
]

MASTER, WORKER, PORT = "job-master-0", "job-worker-0", "23456"  # a PyTorchJob named "job": its pods and port
RESUME = "--ckpt_path=last"  # in docs/kubernetes.md's commands from the first start: every restart resumes
EPOCHS, STEPS, BATCH = 2, 4, 8  # STEPS optimizer steps an epoch, BATCH samples a rank
TASK = (
    "fit", "--config", "tests/tiny.yaml", "--trainer.strategy=ddp", "--trainer.accelerator=cpu",
    "--trainer.precision=64-true", "--model.norm=group", f"--data.batch_size={BATCH}",
    f"--trainer.max_epochs={EPOCHS}", f"--trainer.limit_train_batches={STEPS}", "--trainer.limit_val_batches=1",
)  # fmt: skip


@pytest.fixture(scope="module")
def built() -> None:
    """The image of the working tree (seconds when test_container.py built it: only the code's layers change)."""
    result = container.build()
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


@pytest.fixture
def nodes():
    with TwoNodes() as net:
        yield net


def callbacks(folder: str, pace: int = 0) -> list[str]:
    """The test's callbacks, run in the container: where each rank ran, each batch's samples and loss, and (``pace``
    steps) a second's pause after each step so that a kill lands inside an epoch."""
    where = {"class_path": "tests.container.Where", "init_args": {"folder": f"{folder}/where"}}
    record = {"class_path": "tests.record_samples.RecordSamples", "init_args": {"folder": f"{folder}/samples"}}
    extra = [{"class_path": "tests.container.Pace", "init_args": {"seconds": 1.0, "steps": pace}}] if pace else []
    return [f"--trainer.callbacks+={json.dumps(c)}" for c in (where, record, *extra)]


def pod_options(net: TwoNodes, index: int, logs: Path, records: Path, env: dict[str, str]) -> list[str]:
    """``podman run`` options that make a container pod ``index`` (0: the master) on its node: the node's network,
    the pod's name as host name, the service name of the master in its hosts file, the environment, the PVC."""
    node, name = (net.a, MASTER) if index == 0 else (net.b, WORKER)
    return [
        "--network", f"ns:/run/netns/{node.netns}", "--hostname", name,
        "--add-host", f"{MASTER}:{net.a.address}", "--add-host", f"{WORKER}:{net.b.address}",
        *(f"--env={key}={value}" for key, value in env.items()),
        "--shm-size=8g", "-v", f"{logs}:/app/lightning_logs", "-v", f"{records}:/records",
        "-v", f"{container.ROOT / 'tests'}:/app/tests:ro",
    ]  # fmt: skip


def pytorchjob_env(index: int, **more: str) -> dict[str, str]:
    """What a PyTorchJob (v1, no nprocPerNode) gives pod ``index`` of 2."""
    return {"MASTER_ADDR": MASTER, "MASTER_PORT": PORT, "WORLD_SIZE": "2", "RANK": str(index),
            "PYTHONUNBUFFERED": "1", **more}  # fmt: skip


def torchrun_env(index: int) -> dict[str, str]:
    """What a PyTorchJob with ``nprocPerNode: 2`` gives pod ``index`` of 2: torchrun's ``PET_*`` beside the rest."""
    pet = {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "2", "PET_NODE_RANK": str(index), "PET_MASTER_ADDR": MASTER,
           "PET_MASTER_PORT": PORT}  # fmt: skip
    return {**pytorchjob_env(index), **pet}


def run_pods(net: TwoNodes, folder: Path, envs: list[dict], args: list[str], entrypoint: list[str] = (),
             timeout: float = 300, kill_worker_after: str | None = None) -> dict:  # fmt: skip
    """Pods 0 and 1 started together with ``envs[i]``, their logs volume ``folder/lightning_logs`` and records
    volume ``folder/records``; their exit codes and logs. ``kill_worker_after``: once the worker's log has that
    line, SIGKILL its container (a lost node, an OOM kill) and return as soon as the master has exited too."""
    logs, records = volume(folder / "lightning_logs", 1000), volume(folder / "records", 1000)
    paths = [folder / f"pod{i}-{int(time.time() * 1000)}.log" for i in (0, 1)]
    with ExitStack() as stack:
        pods = [
            stack.enter_context(
                container.started(*pod_options(net, i, logs, records, envs[i]), *entrypoint, IMAGE, *args, log=paths[i])
            )
            for i in (0, 1)
        ]
        killed_at = None
        if kill_worker_after is not None:
            container.wait_for_line(paths[1], kill_worker_after, pods[1][1], timeout=timeout)
            container.podman("kill", "--signal", "KILL", pods[1][0], timeout=60, check=True)
            killed_at = time.monotonic()
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for _, p in pods) and time.monotonic() < deadline:
            time.sleep(0.2)
        ended_at = time.monotonic()
        codes = [p.poll() for _, p in pods]
    said = [path.read_text(errors="replace") for path in paths]
    return {"codes": codes, "logs": said, "seconds_after_kill": killed_at and ended_at - killed_at}


def tails(result: dict) -> str:
    pods = enumerate(zip(result["codes"], result["logs"], strict=True))
    return "".join(f"\n--- pod {i} (exit {code}):\n{log[-3000:]}" for i, (code, log) in pods)


def one_device(folder: Path, accumulate: int) -> dict:
    """The same task in one container, one process, the global batch by gradient accumulation: its last.ckpt."""
    logs, records = volume(folder / "lightning_logs", 1000), volume(folder / "records", 1000)
    batches = f"--trainer.limit_train_batches={STEPS * accumulate}"  # (batches, not steps)
    args = [batches if a.startswith("--trainer.limit_train_batches") else a for a in TASK if "strategy" not in a]
    result = container.run(
        "--shm-size=8g", "-v", f"{logs}:/app/lightning_logs", "-v", f"{records}:/records",
        "-v", f"{container.ROOT / 'tests'}:/app/tests:ro", IMAGE, *args, *callbacks("/records"),
        f"--trainer.accumulate_grad_batches={accumulate}", timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    [run] = versions(folder)
    return last_ckpt(run)


def assert_as_one_device_trains(folder: Path, reference: Path, expected: dict) -> None:
    """The run in ``folder`` trained every step of the run, each step's loss and the final weights those of one
    process's run of the same global batch (``reference``), up to float64 rounding."""
    [run] = versions(folder)
    got = last_ckpt(run)
    assert got["global_step"] == expected["global_step"] == EPOCHS * STEPS
    far = max((got["state_dict"][k] - expected["state_dict"][k]).abs().max().item() for k in expected["state_dict"])
    assert far <= TOLERANCE, f"the final weights are {far:.3g} away from one device's run"
    mine, theirs = step_losses(folder / "records" / "samples"), step_losses(reference / "records" / "samples")
    assert sorted(mine) == sorted(theirs) == list(range(EPOCHS * STEPS))
    assert max(abs(mine[s] - theirs[s]) for s in theirs) <= TOLERANCE, (mine, theirs)


def where(folder: Path) -> list[tuple]:
    files = sorted((folder / "records" / "where").glob("rank*.json"))
    return [tuple(json.loads(f.read_text()).values()) for f in files]


@pytest.fixture(scope="module")
def unbroken(built, tmp_path_factory) -> dict:
    """Two pods of a PyTorchJob v1 (one process each, the image's entrypoint), unbroken, with ``--ckpt_path last``
    as docs/kubernetes.md's manifest has it; and one device's run of the same global batch."""
    base = tmp_path_factory.mktemp("pods")
    with TwoNodes() as net:
        result = run_pods(net, base / "pods", [pytorchjob_env(0), pytorchjob_env(1)],
                          [*TASK, *callbacks("/records"), RESUME])  # fmt: skip
    return {"base": base, "result": result, "one": one_device(base / "one", accumulate=2)}


def test_a_pytorchjobs_two_pods_one_process_each_train_one_run_as_one_device_does(unbroken):
    """(a) Both pods exit 0; one run folder, trained by 2 ranks, rank 0 on the master's pod and rank 1 on the
    worker's, each its own node; every step's loss and the final weights those of one device's run; the master says
    in one line what it took the pods for. Before, each pod trained alone and exited 0."""
    result, base = unbroken["result"], unbroken["base"]
    assert result["codes"] == [0, 0], tails(result)
    said = "WORLD_SIZE=2 and RANK=0 with no launcher (a PyTorchJob's pod): 2 node(s), one process and device each"
    assert f"{said}, meeting at {MASTER}:{PORT}" in result["logs"][0], tails(result)
    assert "--ckpt_path last: no last.ckpt under lightning_logs/ yet; starting fresh" in result["logs"][0]
    assert where(base / "pods") == [(MASTER, 2, 0), (WORKER, 2, 1)]
    [run] = versions(base / "pods")
    assert last_ckpt(run)["callbacks"]["RandomState"]["world_size"] == 2
    assert_as_one_device_trains(base / "pods", base / "one", unbroken["one"])


def test_torchrun_as_the_pods_command_with_pet_variables_trains_two_pods_of_two_processes(built, nodes, tmp_path):
    """(b) A PyTorchJob with ``nprocPerNode: 2``: the pod's command is ``torchrun``, which reads its arguments from
    the ``PET_*`` variables; 4 ranks, 2 on each pod's node, train what one device trains with the global batch."""
    envs = [torchrun_env(0), torchrun_env(1)]
    result = run_pods(nodes, tmp_path / "pods", envs, ["cli.py", *TASK, *callbacks("/records")],
                      entrypoint=["--entrypoint", "torchrun"])  # fmt: skip
    assert result["codes"] == [0, 0], tails(result)
    assert where(tmp_path / "pods") == [(MASTER, 4, 0), (MASTER, 4, 0), (WORKER, 4, 1), (WORKER, 4, 1)]
    assert_as_one_device_trains(tmp_path / "pods", tmp_path / "one", one_device(tmp_path / "one", accumulate=4))


def test_nproc_per_node_without_torchrun_runs_that_many_processes_in_each_pod(built, nodes, tmp_path):
    """The cloud platforms' form (PAI-DLC, Vertex AI): ``NPROC_PER_NODE`` beside the contract and the image's own
    entrypoint: each pod runs 2 processes (Lightning's launcher starts the second), 4 ranks in all."""
    envs = [pytorchjob_env(i, NPROC_PER_NODE="2") for i in (0, 1)]
    result = run_pods(nodes, tmp_path / "pods", envs, [*TASK, *callbacks("/records")])
    assert result["codes"] == [0, 0], tails(result)
    assert "2 node(s), 2 processes and devices each" in result["logs"][0], tails(result)
    assert where(tmp_path / "pods") == [(MASTER, 4, 0), (MASTER, 4, 0), (WORKER, 4, 1), (WORKER, 4, 1)]
    assert_as_one_device_trains(tmp_path / "pods", tmp_path / "one", one_device(tmp_path / "one", accumulate=4))


def test_a_lost_pod_restarted_as_the_operator_does_resumes_and_ends_bitwise_the_unbroken_job(unbroken, nodes, tmp_path):
    """(c) The worker's container is SIGKILLed in epoch 1 (a lost node, an OOM kill). The master's pod names the
    lost rank in one line and exits 1 (docs/kubernetes.md: with ``restartPolicy: OnFailure`` the operator restarts
    both). Both are started again with the same command, in the same volume: they resume from the last.ckpt of epoch
    0, say so, log no training step before it, and end with the unbroken job's weights, every tensor equal, each
    step's samples and loss the unbroken job's."""
    folder, envs = tmp_path / "pods", [pytorchjob_env(0), pytorchjob_env(1)]
    args = [*TASK, *callbacks("/records"), RESUME]
    paced = [*TASK, *callbacks("/records", pace=EPOCHS * STEPS), RESUME]
    lost = run_pods(nodes, folder, envs, paced, kill_worker_after=f"pace: step {STEPS + 2}\n")
    assert lost["codes"][1] == 137 and lost["codes"][0] == 1, tails(lost)
    assert "lost rank 1" in lost["logs"][0], tails(lost)
    assert lost["seconds_after_kill"] < 15 + 15, tails(lost)  # --watchdog.timeout (15 s) and a stated slack
    print(f"\nthe master's pod exited {lost['seconds_after_kill']:.1f} s after the worker's was killed")
    (folder / "records" / "samples").rename(folder / "records" / "samples-lost")
    [first] = versions(folder)
    step = last_ckpt(first)["global_step"]
    assert step == STEPS, step  # epoch 0's
    again = run_pods(nodes, folder, envs, args)
    assert again["codes"] == [0, 0], tails(again)
    own = f"lightning_logs/{first.name}/checkpoints/last.ckpt"
    assert f"--ckpt_path last: resuming from {own} (step {step})" in again["logs"][0], tails(again)
    first_run, resumed = versions(folder)
    expected = last_ckpt(versions(unbroken["base"] / "pods")[0])
    assert_same_weights(last_ckpt(resumed), expected)
    unbroken_losses = metrics(versions(unbroken["base"] / "pods")[0])["train/loss"]
    assert metrics(resumed)["train/loss"] == {s: v for s, v in unbroken_losses.items() if s >= step}
    before_loss = metrics(first_run)["train/loss"]  # the lost start's rows: up to the kill, each the unbroken's
    assert set(range(step)) <= set(before_loss) and before_loss == {s: unbroken_losses[s] for s in before_loss}

    def samples(records: list[dict]) -> dict[int, list[int]]:
        by_step: dict[int, list[int]] = {}
        for r in records:
            by_step.setdefault(r["step"], []).extend(r["ids"])
        return {s: sorted(ids) for s, ids in by_step.items()}

    want = samples(read_records(unbroken["base"] / "pods" / "records" / "samples"))
    got = samples(read_records(folder / "records" / "samples"))
    assert got == {s: ids for s, ids in want.items() if s >= step}
    before = samples(read_records(folder / "records" / "samples-lost"))
    assert {s: ids for s, ids in before.items() if s < step} == {s: ids for s, ids in want.items() if s < step}


@pytest.mark.parametrize(
    ("envs", "line"),
    [
        ([pytorchjob_env(0), pytorchjob_env(2)], "RANK=2, WORLD_SIZE=2: RANK must be the pod's index"),
        (
            [pytorchjob_env(i, MASTER_ADDR="job-mastr-0") for i in (0, 1)],
            "MASTER_ADDR=job-mastr-0 does not resolve",
        ),
    ],
    ids=["rank-out-of-range", "unknown-master"],
)
def test_a_contract_that_contradicts_itself_is_one_line_and_a_non_zero_exit_on_every_pod(built, nodes, tmp_path,
                                                                                          envs, line):  # fmt: skip
    """(d) Every pod exits non-zero within seconds (bounded) and none hangs; the pod whose variables are wrong says
    why in one line naming the variable (an unknown name: each pod, after the 20 s that DNS gets)."""
    started = time.monotonic()
    result = run_pods(nodes, tmp_path / "pods", envs, [*TASK], timeout=120)
    seconds = time.monotonic() - started
    assert all(code not in (0, None) for code in result["codes"]), tails(result)
    assert seconds < 90, (seconds, tails(result))
    errors = [[x for x in log.splitlines() if x.startswith("error: ")] for log in result["logs"]]
    assert any(len(e) == 1 and line in e[0] for e in errors), tails(result)
    assert all(len(e) == 1 for e in errors), errors
    print(f"\n{seconds:.1f} s to every pod's exit")
