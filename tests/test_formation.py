"""A rank that fails before the process group forms (app/launch/formation.py): the others stop in seconds with one
line that names it and says why, instead of waiting for torch's 30-minute timeout.

The first tests use a real ``TCPStore`` in this process and the module's own functions; the slow ones start
``cli.py fit`` twice, as two nodes started by hand (``MASTER_ADDR``, ``MASTER_PORT``, ``NODE_RANK``), from a folder
that is not the repository, one of them with a flag its node has wrong. torchrun's two nodes are
tests/test_two_nodes.py's, and the shipped SLURM script's tests/test_slurm_docs.py's.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch.distributed as dist
from lightning.fabric.plugins.environments.lightning import find_free_network_port

from app.launch import formation
from app.launch.signals import pid_namespace
from tests.conftest import ROOT

LAUNCH_VARS = (
    "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "SLURM_JOB_ID",
    "SLURM_PROCID", "TORCHELASTIC_RUN_ID", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_SIZE", "PMIX_SIZE",
)  # fmt: skip


@pytest.fixture
def launch(monkeypatch):
    """``launch(**vars)``: this process as a rank that a launcher started with those variables (and no others of a
    launcher's), on a free port; a fresh process as far as the module knows (no mark left, no group formed)."""
    for var in LAUNCH_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(formation, "_announced", False)
    monkeypatch.setattr(formation, "_formed", False)
    monkeypatch.setattr(formation, "POST_WAIT", 5.0)
    monkeypatch.setattr(formation, "HOLD", 5.0)
    monkeypatch.setattr(formation, "POLL", 0.2)  # the watch reads the store every 0.2 s, not every second

    def set_vars(**more: str) -> int:
        port = find_free_network_port()
        for var, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), **more}.items():
            monkeypatch.setenv(var, value)
        return port

    return set_vars


def host_store(port: int):
    return dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=5), wait_for_workers=False)


def watch(port: int) -> tuple[formation.FormationWatch, list[dict]]:
    seen: list[dict] = []
    watcher = formation.FormationWatch("127.0.0.1", port, on_failure=seen.append)
    watcher.start()
    return watcher, seen


def wait_for(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not condition():
        time.sleep(0.05)
    return condition()


def read_again(watcher: formation.FormationWatch) -> None:
    """Returns once ``watcher`` has gone once more through its read of the store (its loop began twice since the
    call), or has ended (it acted on what it read): a check that nothing happened then rests on a read that
    happened, not on a sleep."""
    for _ in range(2):
        since = time.monotonic()
        moved = wait_for(lambda since=since: watcher.last_poll > since or not watcher.is_alive(), timeout=30)
        assert moved, "the watch stopped reading the store"


def test_a_rank_that_fails_before_the_group_forms_stops_a_waiting_rank_naming_it_and_why(launch):
    """Rank 1 fails (its line: an unknown flag) while rank 0, the store's host, waits for the group: rank 0's watch
    reads the mark within a second or two, and its line names rank 1, its host and the failed rank's own reason."""
    port = launch(WORLD_SIZE="2", RANK="1")
    store = host_store(port)  # rank 0, inside init_process_group
    watcher, seen = watch(port)
    try:
        started = time.monotonic()
        formation.announce_failure("unrecognized arguments: --model.lr=-1")
        assert wait_for(lambda: seen, timeout=5), "the waiting rank did not read the mark"
        print(f"\nread {time.monotonic() - started:.2f} s after the failure")
    finally:
        watcher.stop()
    [mark] = seen
    assert (mark["rank"], mark["why"]) == ("rank 1", "unrecognized arguments: --model.lr=-1")
    line = formation.peer_failed_line(mark)
    assert line.startswith(f"error: rank 1 on {mark['host']} failed before the process group formed (unrecognized")
    assert "instead of waiting for it" in line and "\n" not in line
    assert store.add(formation.ANSWERED, 0) == 2  # the failed rank, and the one that read its mark


@pytest.mark.parametrize("world", ["WORLD_SIZE=2", "no WORLD_SIZE"])
def test_a_failed_rank_0_opens_the_store_itself_until_the_others_have_read_its_mark(world, launch):
    """Rank 0 fails before it opened the store: it opens one with its mark in it; rank 1's watch (which found no
    store at first) reads it, and rank 0 goes on to exit as soon as rank 1 has, well before its hold ends. Nodes
    started by hand may not export WORLD_SIZE (rank 0 failed before it knew the run's size): the reader says it."""
    port = launch(RANK="0", **({"WORLD_SIZE": "2"} if world == "WORLD_SIZE=2" else {"NODE_RANK": "0"}))
    seen: list[dict] = []
    watcher = formation.FormationWatch("127.0.0.1", port, world_size=2, on_failure=seen.append)  # rank 1
    watcher.start()  # nobody listens on the port yet
    try:
        read_again(watcher)  # (a try to reach the store)
        assert not seen
        started = time.monotonic()
        formation.announce_failure("no such file: data/FashionMNIST")  # returns once rank 1 has read the mark
        held = time.monotonic() - started
        assert wait_for(lambda: seen, timeout=1)
    finally:
        watcher.stop()
    assert seen[0]["rank"] == "rank 0" and seen[0]["why"] == "no such file: data/FashionMNIST"
    assert held < formation.HOLD - 1, held
    print(f"\nrank 0 kept its store open {held:.2f} s")


def test_the_stores_host_stops_only_once_every_rank_has_read_the_mark(launch):
    """Rank 0's store ends with its process: rank 0 reads the mark first (a failed rank posted it as soon as the store
    opened) but waits until the other waiting rank has read it too, or it would wait for good (seen in a SLURM job
    under load: rank 0 ended, rank 1 hung)."""
    port = launch(WORLD_SIZE="3", RANK="2")
    store = host_store(port)
    stopped: list[float] = []
    host = formation.FormationWatch("127.0.0.1", port, world_size=3, hosts_store=True, on_failure=stopped.append)
    host.start()
    formation.announce_failure("bad flag")  # rank 2: 1 of 3
    try:
        assert wait_for(lambda: store.add(formation.ANSWERED, 0) == 2, timeout=5)  # rank 0 has read it: 2 of 3
        time.sleep(0.5)
        assert not stopped, "the store's host stopped before rank 1 had read the mark"
        rank_1, seen = watch(port)
        assert wait_for(lambda: seen and stopped, timeout=5)
        rank_1.stop()
    finally:
        host.stop()
    assert store.add(formation.ANSWERED, 0) == 3


def test_the_first_failure_is_the_one_the_others_are_told(launch):
    """Two ranks fail one after the other (the second, say, because the first did): the mark keeps the first."""
    port = launch(WORLD_SIZE="3", RANK="2")
    store = host_store(port)
    formation.announce_failure("CUDA error: no CUDA-capable device is detected")
    formation._announced = False
    os.environ["RANK"] = "1"
    formation.announce_failure("something that followed")
    mark = json.loads(store.get(formation.MARK))
    assert (mark["rank"], mark["why"]) == ("rank 2", "CUDA error: no CUDA-capable device is detected")
    assert store.add(formation.ANSWERED, 0) == 2


def test_under_torchrun_a_mark_of_an_earlier_round_is_not_read_and_a_worker_with_restarts_leaves_none(launch):
    """torchrun's agent keeps its store across restarts: a mark older than this process is an earlier round's, and
    the restarted workers go on; a worker whose agent will restart it leaves no mark (the restart re-forms the group
    with every node), the last start's worker does."""
    torchrun = {"TORCHELASTIC_RUN_ID": "job", "LOCAL_WORLD_SIZE": "1", "WORLD_SIZE": "2", "RANK": "1"}
    port = launch(**torchrun, TORCHELASTIC_MAX_RESTARTS="1", TORCHELASTIC_RESTART_COUNT="0")
    store = host_store(port)  # torchrun's agent
    old = {"rank": "rank 1", "host": "b", "why": "an earlier round's", "time": formation.process_start_time() - 60}
    store.set(formation.MARK, json.dumps(old))
    watcher, seen = watch(port)
    try:
        read_again(watcher)
        read_again(watcher)  # several reads of the store, the mark there all along
        assert not seen, "an earlier round's mark was read"
        store.delete_key(formation.MARK)
        formation.announce_failure("bad flag")  # restarts left: no mark
        assert not store.check([formation.MARK])
        formation._announced = False
        os.environ["TORCHELASTIC_RESTART_COUNT"] = "1"  # the last start
        formation.announce_failure("bad flag")
        assert wait_for(lambda: seen, timeout=5)
    finally:
        watcher.stop()
    assert seen[0]["why"] == "bad flag"


def test_one_process_mpirun_and_a_formed_group_leave_no_mark(launch, monkeypatch):
    """Nothing is posted where no group forms (one process: MASTER_ADDR alone says nothing), under mpirun (which ends
    every rank itself), or once the group has formed (the RankWatchdog's part); announcing never raises."""
    port = launch()  # MASTER_ADDR and MASTER_PORT exported, one process
    assert formation.store_address() is None
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert formation.store_address() == ("127.0.0.1", port)
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "1")
    assert formation.store_address() is None
    monkeypatch.delenv("OMPI_COMM_WORLD_SIZE")
    monkeypatch.delenv("OMPI_COMM_WORLD_RANK")
    monkeypatch.setenv("RANK", "1")
    store = host_store(port)
    formation.formed()
    formation.announce_failure("after the group formed")
    assert not store.check([formation.MARK])
    monkeypatch.setattr(formation, "_formed", False)
    monkeypatch.setattr(formation, "_announced", False)
    monkeypatch.setenv("MASTER_PORT", "not a port")
    formation.announce_failure("no store to tell")  # nothing to reach, nothing raised


def test_watching_stops_once_the_group_has_formed(launch):
    """The watch of a rank whose group formed ends, and a mark left after it is not read."""
    port = launch(WORLD_SIZE="2", RANK="1")
    store = host_store(port)
    watcher, seen = watch(port)
    read_again(watcher)
    watcher.stop()
    watcher.join(timeout=5)
    assert not watcher.is_alive()  # nothing reads the store any more: a mark left now cannot be seen
    store.set(formation.MARK, json.dumps({"rank": "rank 1", "why": "late", "time": time.time()}))
    assert not seen and not watcher.is_alive()


# ------------------------------------------------------------------------------ a rank killed while the group forms
def ranks(port: int, world: int, numbers, lost_after: float = 1.0) -> dict[int, tuple]:
    """Watches of ``numbers`` (global ranks of a run of ``world``) at the store on ``port``: {rank: (watch, seen)}."""
    watches = {}
    for rank in numbers:
        seen: list[dict] = []
        watcher = formation.FormationWatch(
            "127.0.0.1", port, world_size=world, on_failure=seen.append, rank=rank, lost_after=lost_after
        )
        watcher.start()
        watches[rank] = (watcher, seen)
    return watches


def test_rank_0_tells_the_others_of_a_rank_whose_count_stopped_and_answers_for_it(launch):
    """Rank 1 falls silent while ranks 0, 1 and 2 wait for the group (a stopped process, a machine gone: here its
    watch stops without the group formed): after ``lost_after`` seconds rank 0 leaves the mark of rank 1, the others
    read it, and rank 1 counts as having read it (the store's host would otherwise hold its store for it). Its last
    beat may precede its stop by up to one poll (``POLL``, 1 s): ``lost_after`` is 2 s, so that at least a second
    passes between the stop and the mark (with 1 s it came 0.95 s after the stop, under -n 2)."""
    port = launch(WORLD_SIZE="3")
    store = host_store(port)
    watches = ranks(port, 3, (0, 1, 2), lost_after=2.0)
    try:
        assert wait_for(lambda: all(store.check([f"{formation.BEAT}{r}"]) for r in range(3)), timeout=5)
        watches[1][0].stop()  # silent from now on
        silent = time.monotonic()
        assert wait_for(lambda: watches[0][1] and watches[2][1], timeout=10), "the silent rank was not told"
        told = time.monotonic() - silent
    finally:
        for watcher, _ in watches.values():
            watcher.stop()
    assert not watches[1][1]
    mark = watches[2][1][0]
    assert mark == watches[0][1][0]
    assert (mark["rank"], mark["host"]) == ("rank 1", socket.gethostname())
    assert mark["why"].startswith("it has not answered for 2 s: killed, stopped, or its machine lost?"), mark
    line = formation.peer_failed_line(mark)
    assert line.startswith(f"error: rank 1 on {socket.gethostname()} failed before the process group formed (it has")
    assert 2.0 - formation.POLL <= told < 5, told
    assert store.add(formation.ANSWERED, 0) == 3  # ranks 0 and 2, and rank 1 by rank 0
    print(f"\nrank 1 silent, the others told {told:.2f} s later")


def test_a_rank_whose_process_is_gone_from_rank_0s_host_is_lost_at_once(launch):
    """A rank on rank 0's host whose process has exited (SIGKILL, the out-of-memory killer) is lost at the next read,
    not after the timeout. Here rank 1 is a real process (``sleep``), its count and pid in the store as its watch
    leaves them; it is killed."""
    port = launch(WORLD_SIZE="2")
    store = host_store(port)
    sleeper = subprocess.Popen(["sleep", "60"])
    store.set(f"{formation.WHO}1", f"{socket.gethostname()}:{pid_namespace()}:{sleeper.pid}")
    store.add(f"{formation.BEAT}1", 1)
    watches = ranks(port, 2, (0,), lost_after=60)
    try:
        read_again(watches[0][0])  # rank 0 judged rank 1 alive: its process is there
        assert not watches[0][1]
        sleeper.kill()
        sleeper.wait()
        killed = time.monotonic()
        assert wait_for(lambda: watches[0][1], timeout=5)
        told = time.monotonic() - killed
    finally:
        watches[0][0].stop()
        sleeper.kill()
    [mark] = watches[0][1]
    assert mark["why"] == f"its process (pid {sleeper.pid}) is gone: killed, or out of memory?"
    assert told < 2, told
    print(f"\nrank 1 killed, rank 0 told {told:.2f} s later")


@pytest.mark.parametrize("case", ["formed", "not arrived", "another pid namespace", "torchrun restarts left"])
def test_no_rank_is_taken_for_lost_that_formed_has_not_arrived_or_is_not_rank_0s_to_judge(case, launch):
    """Rank 0 judges only a silence that means a lost rank: not a rank whose group formed (its count stops there),
    not one that has not arrived (it may be slow to start), not the pid of another pid namespace (two containers on
    one host, each a node), and not under torchrun while its agents will restart the round."""
    torchrun = {"TORCHELASTIC_RUN_ID": "job", "LOCAL_WORLD_SIZE": "1", "TORCHELASTIC_MAX_RESTARTS": "1"}
    port = launch(WORLD_SIZE="3", **(torchrun if case == "torchrun restarts left" else {}))
    store = host_store(port)
    if case == "another pid namespace":
        store.set(f"{formation.WHO}1", f"{socket.gethostname()}:4026531836x:999999999")  # no such pid here
        store.add(f"{formation.BEAT}1", 1)
        watches = ranks(port, 2, (0,), lost_after=60)
    else:
        watches = ranks(port, 3, (0, 1) if case != "not arrived" else (0,), lost_after=0.5)
    try:
        if case in ("formed", "torchrun restarts left"):
            assert wait_for(lambda: store.check([f"{formation.BEAT}1"]), timeout=5)
            formation._formed = case == "formed"  # this process: rank 1's group formed (the fixture puts it back)
            watches[1][0].stop()
            watches[1][0].join(timeout=5)
            formation._formed = False
        time.sleep(1.5)  # three times lost_after: rank 1 silent (or absent) all along
    finally:
        for watcher, _ in watches.values():
            watcher.stop()
    assert not watches[0][1], watches[0][1]
    assert not store.check([formation.MARK])
    assert store.check([f"{formation.FORMED}1"]) == (case == "formed")


def test_a_rank_that_cannot_reach_the_groups_store_says_what_it_waits_for_once(launch, monkeypatch, capsys):
    """A node started before rank 0, or one whose MASTER_ADDR or MASTER_PORT differs, waited silently for torch's 30
    minutes (a newcomer's run: a late node, 90 s without a word). After ``UNREACHED_NOTICE`` seconds without the
    store it says once what it waits for; once the store opens it beats, and says nothing more."""
    monkeypatch.setattr(formation, "UNREACHED_NOTICE", 0.5)
    port = launch(WORLD_SIZE="2", RANK="1")
    # the port held, not listening, while the watch waits: no other process of a parallel test run can open a store
    # there, and no try to connect to it can be given it as its own port (a TCP self-connect)
    held = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    held.bind(("127.0.0.1", port))
    watcher = formation.FormationWatch("127.0.0.1", port, world_size=2, rank=1)  # a rank's own: it says
    watcher.start()
    said: list[str] = []
    try:
        # the notice once its wait is over (after the first try to connect, which takes a second, more under load);
        # then twice that try's time more, in which no second notice may come
        assert wait_for(lambda: said.append(capsys.readouterr().err) or "".join(said).strip(), timeout=15)
        time.sleep(2.0)
        before = "".join(said) + capsys.readouterr().err
        held.close()
        store = host_store(port)  # rank 0 opens it at last
        assert wait_for(lambda: store.check([f"{formation.BEAT}1"]), timeout=5)
        time.sleep(0.5)
    finally:
        held.close()
        watcher.stop()
        watcher.join(timeout=5)
    lines = [line for line in before.splitlines() if line.strip()]
    assert len(lines) == 1, (before, watcher.stalled)
    assert re.fullmatch(
        rf"\(waiting for the process group's store at 127\.0\.0\.1:{port}, which rank 0 opens: not reachable for "
        r"\d+ s\. Has rank 0 started, and do all nodes use the same MASTER_ADDR and MASTER_PORT\? torch waits up to "
        r"30 minutes\)",
        lines[0],
    ), lines
    assert capsys.readouterr().err == ""


# ------------------------------------------------------------------------------------------------ real processes
def node_command(tmp_path, node: int, *more: str, strategy: str = "ddp") -> list[str]:
    return [
        sys.executable, str(ROOT / "cli.py"), "fit", "--config", str(ROOT / "tests" / "tiny.yaml"),
        f"--trainer.strategy={strategy}", "--trainer.num_nodes=2", "--trainer.devices=1",
        f"--trainer.default_root_dir={tmp_path / 'runs'}", *more,
    ]  # fmt: skip


STOPPED_AFTER_BOUND = 9.0  # s; see the test


@pytest.mark.slow
@pytest.mark.parametrize(
    ("failing", "strategy"),
    [(1, "ddp"), (0, "ddp"), (1, "fsdp"), (1, "pipeline")],
    ids=["node 1 fails", "node 0 fails", "node 1 fails, fsdp", "node 1 fails, pipeline"],
)
def test_two_nodes_started_by_hand_where_one_has_a_bad_flag_both_end_within_seconds(failing, strategy, tmp_path):
    """Two ``cli.py fit`` processes as two nodes of one run (``MASTER_ADDR``, ``MASTER_PORT``, ``NODE_RANK``), run
    from a folder outside the repository; one has a mistyped flag. It says so and exits 2; the other, waiting in
    ``init_process_group``, says in one line which rank failed and why, and exits 1, seconds later (torch would wait
    30 minutes). Nothing is written. The same under fsdp and pipeline, whose group forms as ddp's does."""
    port = find_free_network_port()
    base = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env = {**base, "PYTHONPATH": str(ROOT), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}  # no WORLD_SIZE
    processes, logs = {}, {}
    started = time.monotonic()
    for node in (0, 1):
        bad = ["--trainer.max_epoch=1"] if node == failing else []
        logs[node] = tmp_path / f"node{node}.log"
        with open(logs[node], "w") as log:
            processes[node] = subprocess.Popen(
                node_command(tmp_path, node, *bad, strategy=strategy), cwd=tmp_path, stdout=log,
                stderr=subprocess.STDOUT,
                env={**env, "NODE_RANK": str(node), "LOCAL_RANK": "0"},
            )  # fmt: skip
    ended, erred, waiting = {}, None, 1 - failing
    try:
        while len(ended) < 2 and time.monotonic() - started < 120:
            if erred is None and "error: " in logs[failing].read_text():
                erred = time.monotonic()  # the failing node's line: its failure, which the other is to learn of
            for node, process in processes.items():
                if node not in ended and process.poll() is not None:
                    ended[node] = time.monotonic() - started
            time.sleep(0.05)
    finally:
        for process in processes.values():
            process.kill()
    output = {node: log.read_text() for node, log in logs.items()}
    assert len(ended) == 2 and erred is not None, (ended, output)
    assert processes[failing].returncode == 2, output[failing][-3000:]
    assert processes[waiting].returncode == 1, output[waiting][-3000:]
    said = "unrecognized arguments: --trainer.max_epoch=1 (did you mean --trainer.max_epochs?)"
    assert f"error: {said}" in output[failing]
    who = "rank 0" if failing == 0 else "node 1's local rank 0"
    lines = [line for line in output[waiting].splitlines() if "failed before the process group formed" in line]
    assert len(lines) == 1 and lines[0].startswith(f"error: {who} on "), output[waiting][-3000:]
    assert said in lines[0]
    assert "Traceback" not in output[waiting]
    # the other node stops "in seconds" (docs/reliability.md): it reads the store every second, then exits; from the
    # failing node's line to the other's exit, 1.0 to 2.9 s alone on the 2-core machine (2026-11-29, 6 runs; 1.4 and
    # 2.2 s beside 2 CPU burners): bounded at 3 times that
    stopped_after = ended[waiting] - (erred - started)
    assert stopped_after < STOPPED_AFTER_BOUND, (stopped_after, ended)
    assert ended[failing] < ended[waiting] + 5, ended  # it stays only until the other has read its mark
    left = sorted(str(p.relative_to(tmp_path)) for p in (tmp_path / "runs").rglob("*"))
    assert not left, left
    print(
        f"\nthe waiting node ended {stopped_after:.1f} s after the failing node's line ({ended[waiting]:.1f} s after "
        f"the start), the failed one {ended[failing]:.1f} s after the start"
    )


@pytest.mark.slow
@pytest.mark.parametrize("case", ["rank 1 killed", "rank 1 stopped", "rank 1 woken late", "rank 0 killed"])
def test_a_rank_killed_while_the_group_forms_stops_the_others_within_seconds(case, tmp_path):
    """Three nodes started by hand (``cli.py fit``, ``--trainer.num_nodes=3``), the third not yet started, so the
    first two wait in ``init_process_group``; then one of them is killed with no word of its own (SIGKILL), or stopped
    (SIGSTOP: a hung process, a machine that is gone without closing anything). The other says in one line which rank
    is lost and exits 1, without a traceback or torch's C++ frames: at once for a process gone from its host, after
    ``--watchdog.timeout`` seconds of silence, at once when rank 0, the store's host, is gone. Torch would wait for
    its 30 minutes (or, for rank 0, print 60 lines). The stopped rank, woken while rank 0 still holds its store,
    reads that it was taken for lost and stops too; woken after rank 0 has gone, it says it was stopped too long."""
    port = find_free_network_port()
    base = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env = {**base, "PYTHONPATH": str(ROOT), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    victim, survivor = (0, 1) if case == "rank 0 killed" else (1, 0)
    processes, logs = {}, {}
    for node in (0, 1):
        logs[node] = tmp_path / f"node{node}.log"
        with open(logs[node], "w") as log:
            command = node_command(tmp_path, node, "--watchdog.timeout=3")
            command[command.index("--trainer.num_nodes=2")] = "--trainer.num_nodes=3"
            processes[node] = subprocess.Popen(
                command, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT,
                env={**env, "NODE_RANK": str(node), "LOCAL_RANK": "0"},
            )  # fmt: skip
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120))
        deadline = time.monotonic() + 120
        while not store.check([f"{formation.BEAT}0", f"{formation.BEAT}1"]) and time.monotonic() < deadline:
            time.sleep(0.2)  # both wait for the group: their watches count
        del store
        assert all(p.poll() is None for p in processes.values()), [log.read_text()[-2000:] for log in logs.values()]
        stopped = case in ("rank 1 stopped", "rank 1 woken late")
        processes[victim].send_signal(signal.SIGSTOP if stopped else signal.SIGKILL)
        hit = time.monotonic()
        if case == "rank 1 stopped":  # once rank 0 has said so, the stopped rank wakes: it reads that it was lost
            told = lambda: "failed before the process group formed" in logs[survivor].read_text()  # noqa: E731
            assert wait_for(told, timeout=30), logs[survivor].read_text()[-3000:]
            processes[victim].send_signal(signal.SIGCONT)
            processes[victim].wait(timeout=30)
        try:
            processes[survivor].wait(timeout=60)
        except subprocess.TimeoutExpired:  # what it said, for the flakes table (seen once in a whole run)
            said = logs[survivor].read_text()[-4000:]
            pytest.fail(f"rank {survivor} still runs 60 s after rank {victim} was {case.split()[-1]}:\n{said}")
        ended = time.monotonic() - hit
        if case == "rank 1 woken late":  # rank 0 and its store are gone by now
            processes[victim].send_signal(signal.SIGCONT)
            processes[victim].wait(timeout=30)
    finally:
        for process in processes.values():
            process.kill()
    output = logs[survivor].read_text()
    assert processes[survivor].returncode == 1, output[-3000:]
    assert "Traceback" not in output and "frame #" not in output, output[-3000:]
    lines = [line for line in output.splitlines() if line.startswith("error: ")]
    if case == "rank 0 killed":
        said = f"error: rank 0 stopped before the process group formed: the store it hosts at 127.0.0.1:{port}"
        assert len(lines) == 1 and lines[0].startswith(said), output[-3000:]
        assert ended < 15, ended  # (a busy machine: 0.1 s alone, 4.8 s beside the suite)
    else:
        why = "it has not answered for 3 s" if stopped else "its process (pid "
        assert len(lines) == 1 and lines[0].startswith("error: rank 1 on "), output[-3000:]
        assert f"failed before the process group formed ({why}" in lines[0], lines[0]
        # told at once (or after the timeout), then rank 0 holds its store for node 2, which never came
        assert ended < (3 if stopped else 0) + formation.HOLD + 15, ended
        if stopped:
            woken = logs[victim].read_text()
            assert processes[victim].returncode == 1, woken[-3000:]
            said = (
                "error: rank 0 took this rank (rank 1) for lost before the process group formed (it has not"
                if case == "rank 1 stopped"
                else "error: this rank was stopped or frozen for "  # its line says why rank 0's store is gone
            )
            errors = [line for line in woken.splitlines() if line.startswith("error: ")]
            assert len(errors) == 1 and errors[0].startswith(said), woken[-3000:]
        left = [p for p in (tmp_path / "runs").rglob("*") if p.is_file()] if (tmp_path / "runs").exists() else []
        assert not left, left
    print(f"\n{case}: the other node ended {ended:.1f} s later")


def test_the_c10_log_threshold_is_raised_for_the_store_tries_and_put_back_however_they_overlap():
    """A try to reach a store that is not open yet logs a C++ error that the watch expects: its threshold (FATAL)
    holds while any such try runs, a warning-only caller's (ERROR) while only those run, and the user's own comes back
    once all are out, whatever order they leave in (the watch and the rank watchdog run in threads of their own)."""
    import contextlib

    from app.launch.library_noise import _c10_log_level, store_warnings_off

    level = _c10_log_level()
    if level is None:
        pytest.skip("c10's log threshold is not found in this torch build")
    before = level.value
    with contextlib.ExitStack() as outer:
        outer.enter_context(store_warnings_off())
        assert level.value == max(before, 2)
        errors = contextlib.ExitStack()
        errors.enter_context(store_warnings_off(errors_too=True))
        assert level.value == max(before, 3)
    assert level.value == max(before, 3)  # the warning-only caller left first: the error-hiding one still runs
    errors.close()
    assert level.value == before
