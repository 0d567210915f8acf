"""Destroy torch.distributed's process group before the interpreter shuts down, whichever strategy made it.

Lightning destroys the group at exit only for nccl. A gloo group still alive at exit can abort a process that has
finished its work: gloo's worker threads may still hold an asynchronous collective's work (the preemption check's
all-reduce, a gradient bucket), and releasing it while the interpreter is being torn down ends in
``terminate called without an active exception`` (SIGABRT, exit -6), which a launcher reports as a failed rank
(pytorch/pytorch#190489). Seen here on ddp_spawn ranks and torchrun workers under load; with a group left busy at
exit it happens in most runs (``tests/test_strategies.py``). Registered by :func:`app.launch.startup.install`, which
every rank calls.
"""

import atexit

import torch.distributed as dist


def destroy_process_group() -> None:
    """Destroy the default process group if there is one (a no-op when the strategy or the user already did)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def install() -> None:
    atexit.register(destroy_process_group)
