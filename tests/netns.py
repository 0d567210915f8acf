"""Two "machines" on one host, made of Linux network namespaces, for multi-node tests.

``with TwoNodes() as net:`` makes two nodes, ``net.a`` and ``net.b`` (host names ``a`` and ``b``, as in
docs/multi-node.md), each a network namespace of its own with:

- one end of a veth pair named ``eth0``, at 10.77.0.1/24 and 10.77.0.2/24, and ``lo`` up;
- a hosts file (``/etc/netns/<namespace>/hosts``, which ``ip netns exec`` mounts over ``/etc/hosts``) that maps
  both host names to their veth addresses, never to a 127.x address (gloo would then listen on loopback), and an
  ``nsswitch.conf`` that looks host names up in it only (no DNS);
- its own host name: every command runs under ``unshare --uts`` after ``hostname a`` (or ``b``).

Nothing leaves the two namespaces: they hold no route but their own /24, so traffic can only go to 10.77.0.x.

Faults: :meth:`TwoNodes.cut` / :meth:`TwoNodes.restore` take the link down and up (``ip link set eth0 down``: no
reset is sent, as when a cable is pulled); :meth:`Node.drop` / :meth:`Node.undrop` drop packets to and from the
peer with iptables (:func:`iptables_available`). ``tc netem`` is not in these kernels: ``TwoNodes(delay_ms=D)``
joins the nodes by TAP devices and a program that carries each frame D ms late (tests/wire.py) instead of a veth
pair.

Clean-up on every path: leaving the ``with`` block (a test that passed, failed or was interrupted; SIGTERM is turned
into KeyboardInterrupt while the block runs, where nothing else handles it) kills every process in both namespaces
(``ip netns pids``, whatever session or process group it made for itself, mpirun's remote daemons included) and the
process group of every command started here, then deletes the namespaces (which removes the veth pair) and their
``/etc/netns`` folders. A run killed with SIGKILL cannot clean up: the next ``TwoNodes`` removes what a dead
process left (the namespace names carry the pid that made them).

Needs root, iproute2 (``ip``) and util-linux (``unshare``); :func:`netns_available` says whether this host has them
and why not.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from app.launch.signals import process_alive

PREFIX = "tn2-"  # every namespace this module makes: tn2-<pid>-<n>-<host>
SUBNET = "10.77.0"  # the nodes' /24
INTERFACE = "eth0"  # each node's end of the veth pair, inside its namespace
NETNS_ETC = Path("/etc/netns")
_counter = itertools.count()


class NetnsError(RuntimeError):
    """A namespace command failed."""


def _ip(*args: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise NetnsError(f"ip {shlex.join(args)}: {(result.stderr or result.stdout).strip()}")
    return result


@cache
def netns_available() -> tuple[bool, str]:
    """(True, "") where two namespace nodes can be made here; else (False, why not): not Linux, not root, no
    iproute2 or unshare, or the kernel/container refuses (the probe's own error)."""
    if not sys.platform.startswith("linux"):
        return False, f"network namespaces need Linux, this is {sys.platform}"
    if os.geteuid() != 0:
        return False, "network namespaces need root (ip netns add)"
    for tool, package in (("ip", "iproute2"), ("unshare", "util-linux")):
        if shutil.which(tool) is None:
            return False, f"no `{tool}` command: install {package}"
    probe = f"{PREFIX}{os.getpid()}-probe"
    _ip("netns", "delete", probe, check=False)  # left by a killed process of the same pid
    try:
        _ip("netns", "add", probe)
        try:
            _ip("-n", probe, "link", "add", "p0", "type", "veth", "peer", "name", "p1")
            _ip("-n", probe, "link", "set", "lo", "up")
            hostname = subprocess.run(
                ["ip", "netns", "exec", probe, "unshare", "--uts", "sh", "-c", "hostname probe && hostname"],
                capture_output=True, text=True, timeout=30,
            )  # fmt: skip
            if hostname.stdout.strip() != "probe":
                return False, f"unshare --uts inside a namespace failed: {hostname.stderr.strip()}"
        finally:
            _ip("netns", "delete", probe, check=False)
    except (NetnsError, OSError, subprocess.SubprocessError) as e:
        return False, f"cannot make a network namespace here: {e}"
    return True, ""


@cache
def iptables_available() -> tuple[bool, str]:
    """(True, "") where :meth:`Node.drop` works: iptables installed and usable inside a namespace."""
    ok, why = netns_available()
    if not ok:
        return ok, why
    if shutil.which("iptables") is None:
        return False, "no `iptables` command: install iptables"
    probe = f"{PREFIX}{os.getpid()}-iptprobe"
    _ip("netns", "delete", probe, check=False)
    try:
        _ip("netns", "add", probe)
        result = subprocess.run(
            ["ip", "netns", "exec", probe, "iptables", "-A", "INPUT", "-s", f"{SUBNET}.9", "-j", "DROP"],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        if result.returncode != 0:
            return False, f"iptables does not work in a namespace here: {result.stderr.strip()}"
    except (NetnsError, OSError, subprocess.SubprocessError) as e:
        return False, f"cannot make a network namespace here: {e}"
    finally:
        _ip("netns", "delete", probe, check=False)
    return True, ""


def _netns_pids(netns: str) -> list[int]:
    result = _ip("netns", "pids", netns, check=False)
    return [int(p) for p in result.stdout.split()] if result.returncode == 0 else []


def _remove_netns(netns: str, wait: float = 10) -> list[str]:
    """Kill everything in ``netns``, delete it (and so its veth end) and its /etc/netns folder. What could not be
    removed, in words."""
    left = []
    deadline = time.monotonic() + wait
    while pids := _netns_pids(netns):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if time.monotonic() > deadline:
            left.append(f"processes {pids} in namespace {netns}")
            break
        time.sleep(0.05)
    if Path("/run/netns", netns).exists():
        result = _ip("netns", "delete", netns, check=False)
        if result.returncode != 0:
            left.append(f"namespace {netns}: {result.stderr.strip()}")
    shutil.rmtree(NETNS_ETC / netns, ignore_errors=True)
    if (NETNS_ETC / netns).exists():
        left.append(f"{NETNS_ETC / netns}")
    return left


def namespaces() -> list[str]:
    """The namespaces of this module that exist now (of any process)."""
    listed = _ip("netns", "list", check=False).stdout.split("\n")
    return [line.split()[0] for line in listed if line.startswith(PREFIX)]


def remove_leftovers() -> None:
    """Remove the namespaces and /etc/netns folders of this module whose maker is dead (a SIGKILLed test run)."""
    names = set(namespaces())
    if NETNS_ETC.is_dir():
        names |= {p.name for p in NETNS_ETC.iterdir() if p.name.startswith(PREFIX)}
    for name in names:
        try:
            pid = int(name[len(PREFIX) :].split("-")[0])
        except ValueError:
            continue
        if not process_alive(pid):
            _remove_netns(name)


def _files_only_nsswitch() -> str:
    """This host's nsswitch.conf with host names looked up in the hosts file only: no DNS query from a node (a
    reverse lookup of an IPv4-mapped IPv6 peer, as torch's c10d makes, misses the hosts file and would ask DNS)."""
    try:
        lines = Path("/etc/nsswitch.conf").read_text().splitlines()
    except OSError:
        lines = ["passwd: files", "group: files"]
    lines = [line for line in lines if not line.startswith("hosts:")]
    return "\n".join([*lines, "hosts: files", ""])


@dataclass
class Node:
    """One machine: a namespace with host name ``name`` at ``address`` on ``eth0``."""

    name: str
    netns: str
    address: str
    net: TwoNodes = field(repr=False)
    interface: str = INTERFACE

    def command(self, args: list[str]) -> list[str]:
        """``args`` as run on this node: in its namespace (and its hosts file), under its own host name."""
        return ["ip", "netns", "exec", self.netns, "unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"',
                self.name, *args]  # fmt: skip

    def popen(self, args: list[str], *, log: Path, env: dict | None = None, cwd: Path | str | None = None):
        """Start ``args`` on this node in a session of its own, stdout and stderr to the file ``log``. The process
        (and everything else in the namespace) is killed when the nodes are removed."""
        with open(log, "ab") as out:
            process = subprocess.Popen(
                self.command(args), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                env=env, cwd=cwd, start_new_session=True,
            )  # fmt: skip
        self.net.processes.append(process)
        return process

    def run(self, args: list[str], *, timeout: float = 60, **kwargs) -> subprocess.CompletedProcess:
        """Run a short command on this node and wait for it; its output captured as text."""
        return subprocess.run(self.command(args), capture_output=True, text=True, timeout=timeout, **kwargs)

    def pids(self) -> list[int]:
        """Every process now in this node's namespace."""
        return _netns_pids(self.netns)

    def link(self, up: bool) -> None:
        """Bring this node's end of the link up or down (down: the peer's carrier drops too; nothing is sent)."""
        _ip("-n", self.netns, "link", "set", self.interface, "up" if up else "down")

    def drop(self, peer: Node | None = None) -> None:
        """Drop every packet from and to ``peer`` (the other node by default) on this node, with iptables."""
        self._iptables("-I", peer)

    def undrop(self, peer: Node | None = None) -> None:
        """Undo :meth:`drop`."""
        self._iptables("-D", peer)

    def _iptables(self, action: str, peer: Node | None) -> None:
        ok, why = iptables_available()
        if not ok:
            raise NetnsError(why)
        other = (peer or self.net.other(self)).address
        for rule in (["INPUT", "-s", other], ["OUTPUT", "-d", other]):
            cmd = ["ip", "netns", "exec", self.netns, "iptables", "-w", action, *rule, "-j", "DROP"]
            result = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
            if result.returncode != 0:
                raise NetnsError(f"{shlex.join(cmd)}: {result.stderr.strip()}")

    def reaches(self, peer: Node, port: int = 9, timeout: float = 2) -> bool:
        """Whether a TCP connection from this node gets an answer from ``peer`` within ``timeout``: accepted or
        refused (a port with no listener answers with a reset) is reachable, silence is not."""
        probe = (
            "import socket, sys\n"
            f"s = socket.socket(); s.settimeout({timeout})\n"
            f"try: s.connect(({peer.address!r}, {port}))\n"
            "except ConnectionRefusedError: pass\n"
            "except OSError: sys.exit(1)\n"
        )
        return self.run([sys.executable, "-c", probe], timeout=timeout + 30).returncode == 0

    def link_bytes(self) -> dict[str, int]:
        """Bytes sent and received on this node's end of the link so far: ``{"tx": ..., "rx": ...}``."""
        [info] = json.loads(_ip("-n", self.netns, "-j", "-s", "link", "show", self.interface).stdout)
        stats = info["stats64"]
        return {"tx": stats["tx"]["bytes"], "rx": stats["rx"]["bytes"]}


class TwoNodes:
    """Two namespace nodes joined by a veth pair (module docstring); a context manager that always cleans up."""

    def __init__(self, names: tuple[str, str] = ("a", "b"), delay_ms: float = 0, wire: bool = False) -> None:
        """``delay_ms``: each packet arrives that late; the link is then tests/wire.py's, not a veth pair (also with
        ``wire=True`` and no delay: the same path, for comparisons)."""
        run = f"{PREFIX}{os.getpid()}-{next(_counter)}"
        self.delay_ms, self.wire = delay_ms, wire or delay_ms > 0
        self.processes: list[subprocess.Popen] = []
        self.a, self.b = (Node(name, f"{run}-{name}", f"{SUBNET}.{i}", self) for i, name in enumerate(names, start=1))
        self.nodes = (self.a, self.b)
        self._old_sigterm = None

    def other(self, node: Node) -> Node:
        return self.b if node is self.a else self.a

    def node(self, name: str) -> Node:
        return next(n for n in self.nodes if n.name == name)

    # ---------------------------------------------------------------- making and removing
    def __enter__(self) -> TwoNodes:
        ok, why = netns_available()
        if not ok:
            raise NetnsError(why)
        self._catch_sigterm()
        try:
            remove_leftovers()
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        left = self.close()
        if left and exc[0] is None:
            raise NetnsError("clean-up left " + "; ".join(left))

    def _make(self) -> None:
        hosts = "127.0.0.1\tlocalhost\n::1\tlocalhost\n" + "".join(f"{n.address}\t{n.name}\n" for n in self.nodes)
        nsswitch = _files_only_nsswitch()
        for node in self.nodes:
            (NETNS_ETC / node.netns).mkdir(parents=True, exist_ok=True)
            (NETNS_ETC / node.netns / "hosts").write_text(hosts)
            (NETNS_ETC / node.netns / "nsswitch.conf").write_text(nsswitch)
            _ip("netns", "add", node.netns)
        # made inside the namespaces: no name in the host's own namespace, where parallel runs could clash
        a, b = self.nodes
        if self.wire:
            self._delayed_link()
        else:
            _ip("link", "add", INTERFACE, "netns", a.netns, "type", "veth", "peer", "name", INTERFACE, "netns", b.netns)
        for node in self.nodes:
            _ip("-n", node.netns, "addr", "add", f"{node.address}/24", "dev", INTERFACE)
            _ip("-n", node.netns, "link", "set", "lo", "up")
            _ip("-n", node.netns, "link", "set", INTERFACE, "up")

    def _delayed_link(self) -> None:
        """A TAP device ``eth0`` in each namespace, joined by tests/wire.py with ``delay_ms`` each way."""
        wire = subprocess.Popen(
            [sys.executable, "-m", "tests.wire", self.a.netns, self.b.netns, str(self.delay_ms)],
            stdout=subprocess.PIPE, text=True, start_new_session=True, cwd=Path(__file__).resolve().parents[1],
        )  # fmt: skip
        self.processes.append(wire)
        if wire.stdout.readline().strip() != "ready":
            raise NetnsError(f"tests/wire.py did not start (exit {wire.wait(10)})")

    def close(self) -> list[str]:
        """Kill every process started here or living in the namespaces, remove the namespaces and their /etc/netns
        folders. Returns what could not be removed (empty: all gone). Safe to call more than once."""
        left: list[str] = []
        for process in self.processes:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)  # its session: everything it started and did not move out
        for node in self.nodes:
            left += _remove_netns(node.netns)
        for process in self.processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                left.append(f"process {process.pid} ({shlex.join(map(str, process.args[-3:]))}) did not exit")
        self._restore_sigterm()
        return left

    def _catch_sigterm(self) -> None:
        """SIGTERM -> KeyboardInterrupt while the nodes exist, so that the ``with`` block's clean-up runs; only in
        the main thread and where nobody else handles SIGTERM."""
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) in (
            signal.SIG_DFL,
            None,
        ):

            def interrupt(signum, frame):
                raise KeyboardInterrupt(f"signal {signum}")

            self._old_sigterm = signal.signal(signal.SIGTERM, interrupt)

    def _restore_sigterm(self) -> None:
        if self._old_sigterm is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._old_sigterm)
            self._old_sigterm = None

    # ---------------------------------------------------------------- faults and launchers
    def cut(self, node: Node | None = None) -> None:
        """Take the link down at ``node``'s end (``b`` by default): both carriers drop, no packet passes, no
        reset is sent."""
        (node or self.b).link(up=False)

    def restore(self, node: Node | None = None) -> None:
        """Bring the link back up (:meth:`cut`'s end). The addresses and routes come back with it."""
        (node or self.b).link(up=True)

    def rsh_agent(self, path: Path) -> Path:
        """Write an ssh stand-in for Open MPI (``mpirun --mca plm_rsh_agent PATH``): ``PATH [ssh options] HOST
        COMMAND...`` runs ``COMMAND`` on node ``HOST`` (in its namespace, under its host name)."""
        cases = "\n".join(f"    {n.name}) netns={n.netns} ;;" for n in self.nodes)
        path.write_text(
            "#!/bin/sh\n"
            "# ssh stand-in: the nodes are network namespaces on this host (tests/netns.py)\n"
            'while [ $# -gt 0 ]; do case "$1" in -*) shift ;; *) break ;; esac; done  # ssh options\n'
            'host=$1; shift\ncase "$host" in\n'
            f"{cases}\n"
            '    *) echo "rsh agent: no node $host" >&2; exit 255 ;;\nesac\n'
            'exec ip netns exec "$netns" unshare --uts sh -c \'hostname "$0" && exec sh -c "$1"\' "$host" "$*"\n'
        )
        path.chmod(0o755)
        return path
