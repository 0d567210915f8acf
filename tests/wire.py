"""A link with a delay between two namespace nodes (tests/netns.py), where the kernel has no ``tc netem``.

    python -m tests.wire NETNS_A NETNS_B DELAY_MS

Makes a TAP device named ``eth0`` in each namespace (entering them in turn with ``setns``) and carries every
Ethernet frame from one to the other ``DELAY_MS`` milliseconds after it was sent, in order, both ways: a round trip
then takes 2 x DELAY_MS more. Prints ``ready`` once both devices exist (the caller gives them addresses and brings
them up) and runs until killed; the devices go with it. A device taken down drops what is written to it, as a cut
cable does. TAP devices hand whole frames to this program (no offloads: checksums done, TCP segmented by the kernel),
so nothing is changed on the way.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import heapq
import os
import select
import struct
import sys
import time

CLONE_NEWNET = 0x40000000
TUNSETIFF = 0x400454CA
IFF_TAP, IFF_NO_PI = 0x0002, 0x1000


def tap_in(netns: str, name: str = "eth0") -> int:
    """Enter ``netns`` (this thread: the program has no other) and open a TAP device ``name`` there."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{netns}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns {netns}: {os.strerror(ctypes.get_errno())}")
    finally:
        os.close(fd)
    tap = os.open("/dev/net/tun", os.O_RDWR)
    fcntl.ioctl(tap, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TAP | IFF_NO_PI))
    return tap


def carry(a: int, b: int, delay: float) -> None:
    """Forward frames between the devices ``a`` and ``b``, each ``delay`` seconds late."""
    pending: list[tuple[float, int, int, bytes]] = []  # (due, order, to, frame)
    order = 0
    while True:
        wait = max(0.0, pending[0][0] - time.monotonic()) if pending else None
        readable, _, _ = select.select([a, b], [], [], wait)
        now = time.monotonic()
        for source in readable:
            try:
                frame = os.read(source, 65536)
            except OSError:
                continue
            heapq.heappush(pending, (now + delay, order, b if source == a else a, frame))
            order += 1
        while pending and pending[0][0] <= time.monotonic():
            _, _, to, frame = heapq.heappop(pending)
            with contextlib.suppress(OSError):  # that end is down: the frame is lost, as on a cut cable
                os.write(to, frame)


def main(argv: list[str]) -> None:
    netns_a, netns_b, delay_ms = argv[0], argv[1], float(argv[2])
    a, b = tap_in(netns_a), tap_in(netns_b)
    print("ready", flush=True)
    carry(a, b, delay_ms / 1000)


if __name__ == "__main__":
    main(sys.argv[1:])
