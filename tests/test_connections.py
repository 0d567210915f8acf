"""app/launch/connections.py: a collective that waits on a silent peer fails at once when this process's
connections to that peer are shut down, by the peer's pid (same host) or by its addresses (another host).

Two real gloo ranks in their own processes; rank 1 stops itself (SIGSTOP: its sockets stay open and say nothing, as
over a cut link). Without the shutdown, rank 0's all-reduce still waits (the negative control)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from app.launch.connections import _address, local_addresses
from tests.conftest import ROOT

pytestmark = pytest.mark.slow

RANK = textwrap.dedent(
    """
    import json, os, signal, sys, threading, time
    import torch, torch.distributed as dist
    from datetime import timedelta
    from app.launch.connections import close_connections_to, local_addresses

    rank, how, folder = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    dist.barrier()
    with open(os.path.join(folder, f"rank{rank}.part"), "w") as f:
        json.dump({"pid": os.getpid(), "addresses": local_addresses()}, f)
    os.replace(os.path.join(folder, f"rank{rank}.part"), os.path.join(folder, f"rank{rank}.json"))  # whole or absent
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # silent from here on, its connections open
        sys.exit(0)
    while not os.path.exists(os.path.join(folder, "rank1.json")):
        time.sleep(0.05)
    peer = json.load(open(os.path.join(folder, "rank1.json")))

    def close() -> None:
        time.sleep(2)
        if how == "pid":
            closed = close_connections_to(pid=peer["pid"])
        elif how == "addresses":
            closed = close_connections_to(set(peer["addresses"]))
        else:
            closed = 0
        print("closed", closed, flush=True)

    threading.Thread(target=close, daemon=True).start()
    started = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1000))
        print("returned", flush=True)
    except RuntimeError as err:
        print(f"raised after {time.monotonic() - started:.2f} s: {err}", flush=True)
    os._exit(0)  # (the group is broken: nothing to tear down)
    """
)


def run_pair(how: str, tmp_path, wait: float) -> str:
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    ranks = [
        subprocess.Popen(
            [sys.executable, str(script), str(rank), how, str(tmp_path)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for rank in (0, 1)
    ]
    try:
        output, _ = ranks[0].communicate(timeout=wait)
        return output
    except subprocess.TimeoutExpired:
        return "still waiting"
    finally:
        for process in ranks:
            if process.poll() is None:
                process.send_signal(signal.SIGCONT)
                process.kill()
            process.wait()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("how", ["pid", "addresses"])
def test_a_collective_waiting_on_a_silent_peer_fails_at_once_when_its_connections_are_shut_down(how, tmp_path):
    started = time.monotonic()
    output = run_pair(how, tmp_path, wait=60)
    assert "closed 0" not in output and "closed" in output, output
    assert "raised after" in output and "Connection closed by peer" in output, output
    seconds = float(output.split("raised after ")[1].split(" s")[0])
    assert 1.9 <= seconds < 5, output  # 2 s after it began, when the connections were shut down
    assert time.monotonic() - started < 60
    peer = json.loads((tmp_path / "rank1.json").read_text())
    assert peer["addresses"] and all(":" not in a or a.startswith("[") for a in peer["addresses"])


def test_without_the_shutdown_the_collective_still_waits(tmp_path):
    """The negative control: gloo waits on the silent peer (here for the 12 s the test gives it)."""
    assert run_pair("nothing", tmp_path, wait=12) == "still waiting"


def test_proc_net_tcp_addresses_read_as_people_write_them():
    order = sys.byteorder
    assert _address("0100007F:1F90" if order == "little" else "7F000001:1F90") == "127.0.0.1:8080"
    mapped = "0000000000000000FFFF00000100007F" if order == "little" else "00000000000000000000FFFF7F000001"
    assert _address(f"{mapped}:1F90") == "127.0.0.1:8080"  # IPv4 on an IPv6 socket: as IPv4
    loopback = "00000000000000000000000001000000" if order == "little" else "00000000000000000000000000000001"
    assert _address(f"{loopback}:0050") == "[::1]:80"
    assert isinstance(local_addresses(), list)
