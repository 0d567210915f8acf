"""A rank whose watchdog is in the middle of a store call as the interpreter shuts down (a test fixture).

The heartbeat's store calls run in torch's C++ with the GIL released. One that comes back while the interpreter shuts
down ends the process with SIGABRT ("terminate called without an active exception"): CPython ends a daemon thread
that wants the GIL then with pthread_exit, whose unwinding cannot pass torch's C++ frames. Here every store call
takes 0.8 s inside C++ and the interpreter's shutdown takes 1.5 s, so one always does, unless the rank waits for
its heartbeat before it shuts down.

    python -m tests.watchdog_at_exit finish   # the callback's teardown finishes the heartbeat: waits for it
    python -m tests.watchdog_at_exit atexit   # no teardown (an exception past Lightning): the exit hook waits
    python -m tests.watchdog_at_exit none     # neither (the wait taken away): the negative control, SIGABRT
"""

import contextlib
import sys
import time
from datetime import timedelta

import torch.distributed as dist

from app.callbacks import heartbeat


class SlowStore:
    """The rendezvous store, each call first waiting 0.8 s in torch's C++ for a key that nobody sets."""

    def __init__(self, store) -> None:
        self.store = store

    def __getattr__(self, name: str):
        method = getattr(self.store, name)

        def slow(*args):
            with contextlib.suppress(Exception):  # the wait's timeout
                self.store.wait(["never set"], timedelta(milliseconds=800))
            return method(*args)

        return slow


class SlowShutdown:
    def __del__(self) -> None:
        time.sleep(1.5)  # the interpreter is shutting down meanwhile (module globals are cleared late)


if __name__ == "__main__":
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False, wait_for_workers=False)
    beat = heartbeat.Heartbeat(SlowStore(client), 0, 2, timeout=30.0, interval=0.05, prefix="exit")
    beat.start()
    time.sleep(1.0)  # beating: a store call is under way at any moment
    if sys.argv[1] == "finish":
        beat.finish()
    elif sys.argv[1] == "none":
        heartbeat._running.clear()  # noqa: SLF001 (the negative control: nothing to wait for at exit)
    keep = SlowShutdown()
    print("leaving", flush=True)
    sys.exit(143)
