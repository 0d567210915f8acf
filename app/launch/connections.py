"""This process's TCP connections to a lost peer, closed so that a collective waiting on them fails at once.

gloo waits for good on a connection whose other end went silent (a cut link, a host that hangs, a process that is
stopped): nothing closes it, and torch 2.14's ``ProcessGroup.abort()`` and ``shutdown()`` on a gloo group return
without ending a collective in flight (measured: the all-reduce still waited 20 s later, when it was killed).
``shutdown(SHUT_RDWR)`` on this process's own end of each connection to the lost peer ends it: the collective raises
gloo's "Connection closed by peer" within milliseconds, as when the peer's process dies and its kernel closes them,
and the training thread takes the same path as then (:mod:`app.callbacks.elastic.failure`).

A peer's connections are found by its addresses (:func:`local_addresses`, which every rank publishes while its group
is whole), or, for a process on this host, by the endpoints of its own sockets (``/proc/PID``).
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import sys

ESTABLISHED = "01"  # a connection's state in /proc/net/tcp


def _address(hex_address: str) -> str:
    """``0100007F:1F90`` (``/proc/net/tcp``'s form: the address in this machine's byte order) -> ``127.0.0.1:8080``;
    an IPv6 address in brackets."""
    host, port = hex_address.split(":")
    order = "<" if sys.byteorder == "little" else ">"
    if len(host) == 8:
        ip = socket.inet_ntop(socket.AF_INET, struct.pack(f"{order}I", int(host, 16)))
    else:
        words = [int(host[i : i + 8], 16) for i in range(0, 32, 8)]
        ip = socket.inet_ntop(socket.AF_INET6, struct.pack(f"{order}4I", *words)).removeprefix("::ffff:")
        ip = ip if "." in ip else f"[{ip}]"  # (an IPv4 address that an IPv6 socket carries: as IPv4)
    return f"{ip}:{int(port, 16)}"


def _connections(pid: int | str = "self") -> dict[int, tuple[str, str]]:
    """Socket inode -> (local endpoint, remote endpoint), for the established TCP connections of process ``pid``'s
    network namespace."""
    table = {}
    for name in ("tcp", "tcp6"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/net/{name}") as rows:
            next(rows, None)
            for row in rows:
                fields = row.split()
                if fields[3] == ESTABLISHED:
                    table[int(fields[9])] = (_address(fields[1]), _address(fields[2]))
    return table


def _sockets(pid: int | str = "self") -> dict[int, int]:
    """Socket inode -> file descriptor, for the open sockets of process ``pid``."""
    found = {}
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    found[int(link[8:-1])] = int(fd)
    return found


def local_addresses() -> list[str]:
    """The addresses (without ports) at this process's end of its TCP connections: where its peers reach it."""
    table = _connections()
    return sorted({table[inode][0].rpartition(":")[0] for inode in _sockets() if inode in table})


def close_connections_to(addresses: set[str] = frozenset(), pid: int = 0) -> int:
    """Shut down this process's connections to ``addresses`` (without ports), or to process ``pid`` of this host and
    network namespace (by its sockets' endpoints); returns how many."""
    table = _connections()
    theirs = {table[inode][0] for inode in _sockets(pid) if inode in table} if pid else set()
    closed = 0
    for inode, fd in _sockets().items():
        local, remote = table.get(inode, ("", ""))
        if remote and (remote in theirs or remote.rpartition(":")[0] in addresses):
            with contextlib.suppress(OSError), socket.socket(fileno=os.dup(fd)) as end:
                end.shutdown(socket.SHUT_RDWR)  # the socket itself, which the library's descriptor shares
                closed += 1
    return closed
