"""A user's script whose ranks leave an asynchronous gloo all-reduce unfinished when they exit (a test fixture).

Without ``app.launch.process_group``'s exit handler most runs of this end with a rank aborted by
``terminate called without an active exception``; ``app.launch.startup.install()`` must make every rank exit 0.
"""

import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from app.launch import startup

startup.install()  # at the top: each spawned rank imports this script again, and never runs its __main__


def rank_main(rank: int, world_size: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    for _ in range(10):
        dist.all_reduce(torch.ones(1000), async_op=True).wait()
    pending = [dist.all_reduce(torch.ones(10), async_op=True) for _ in range(20)]  # in gloo's hands at exit
    del pending


if __name__ == "__main__":
    world_size, port = int(sys.argv[1]), int(sys.argv[2])
    mp.start_processes(rank_main, args=(world_size, port), nprocs=world_size, start_method="spawn")
