"""The address a node of a multi-node CPU run offers the others, checked before ``init_process_group``.

Gloo (the CPU backend) listens on the address this machine's host name resolves to, unless ``GLOO_SOCKET_IFNAME``
names an interface. When the host name resolves to loopback only (Debian's usual ``127.0.1.1 <hostname>`` line in
/etc/hosts) or to nothing (no hosts entry, no DNS), Gloo falls back to 127.0.0.1: the other nodes' connections are
refused and this rank waits in ``init_process_group`` forever, without a word. :func:`check_reachable` turns that
into one line naming the interface to pick. GPU runs are not affected: NCCL chooses its interface itself, avoiding
loopback (``NCCL_SOCKET_IFNAME`` overrides it).
"""

from __future__ import annotations

import ipaddress
import os
import socket

from app.errors import UserError
from app.launch.launcher import launcher_ranks, torchrun_job


def resolved_addresses(host: str) -> list[str]:
    """The addresses ``host`` resolves to (the system's resolver: /etc/hosts, then DNS); [] when it does not."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return []
    return list(dict.fromkeys(info[4][0] for info in infos))


def interface_addresses() -> dict[str, str]:
    """``{interface: IPv4 address}`` of this machine's interfaces that have one (Linux), loopback left out."""
    import fcntl
    import struct

    found = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                request = struct.pack("256s", name.encode()[:15])
                address = socket.inet_ntoa(fcntl.ioctl(probe.fileno(), 0x8915, request)[20:24])  # SIOCGIFADDR
            except OSError:  # no IPv4 address
                continue
            if not ipaddress.ip_address(address).is_loopback:
                found[name] = address
    return found


def route_to(address: str) -> str | None:
    """The local address this machine reaches ``address`` from (no packet is sent), or None without a route."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((address, 9))
            return probe.getsockname()[0]
    except OSError:
        return None


def _loopback(address: str) -> bool:
    return ipaddress.ip_address(address.split("%")[0]).is_loopback


def nodes_launched(num_nodes: int) -> int:
    """The nodes the run spans: what torchrun or an MPI launcher started, else ``--trainer.num_nodes``."""
    job = torchrun_job()
    if job is not None:
        return job.nodes
    ranks = launcher_ranks()
    if ranks is not None:
        world, _, _, local = ranks
        return max(world // max(local, 1), 1)
    return num_nodes


def check_reachable(num_nodes: int, accelerator: str) -> None:
    """One line instead of a silent hang: a multi-node CPU run whose host name offers the other nodes loopback."""
    if nodes_launched(num_nodes) <= 1 or os.environ.get("GLOO_SOCKET_IFNAME") or accelerator not in ("cpu", "auto"):
        return
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")  # Lightning's default
    if master in ("127.0.0.1", "localhost", "::1"):
        return  # the nodes are processes of this machine (a test of a multi-node set-up): loopback reaches them
    if accelerator == "auto":
        import torch

        if torch.cuda.is_available():  # NCCL
            return
    host = socket.gethostname()
    addresses = resolved_addresses(host)
    if addresses and not all(_loopback(a) for a in addresses):
        return
    interfaces = interface_addresses()
    local = route_to(resolved_addresses(master)[0]) if resolved_addresses(master) else None
    picked = [name for name, address in interfaces.items() if address == local]
    if picked:
        fix = f"GLOO_SOCKET_IFNAME={picked[0]} (its address {local} is the way to MASTER_ADDR={master})"
    elif interfaces:
        fix = "GLOO_SOCKET_IFNAME to the interface on the nodes' network, one of " + ", ".join(
            f"{name} ({address})" for name, address in interfaces.items()
        )
    else:
        fix = "GLOO_SOCKET_IFNAME to the interface on the nodes' network (this machine shows none with an address)"
    resolves = f"resolves to {', '.join(addresses)}, loopback only" if addresses else "resolves to no address"
    raise UserError(
        f"this node's host name {host!r} {resolves}, so Gloo would listen on 127.0.0.1, where the other nodes of "
        "this multi-node run cannot reach it (they would fail with 'Connection refused' and this rank would wait "
        f"in init_process_group forever); set {fix}, or map {host!r} to that address in /etc/hosts"
    )


def answers(host: str, port: int, timeout: float = 3.0) -> bool:
    """Whether a TCP connection to ``host:port`` opens within ``timeout`` seconds."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def resolves(address: str) -> bool:
    """Whether ``address`` (a name or an IP address) resolves now."""
    try:
        socket.getaddrinfo(address, None)
        return True
    except socket.gaierror:
        return False
