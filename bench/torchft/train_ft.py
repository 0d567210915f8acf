# ruff: noqa: E402, E741, SIM115 (a measurement script: logs opened for the whole run, imports timed)
"""Tiny torchft training script: one process = one replica group (group world size 1), gloo on CPU.

Usage: train_ft.py --rid 0 --log logs/x/r0.log [--steps 40] [--sleep 0.3]
Timeouts come from the environment (so the runner can vary them):
  FT_TIMEOUT_S   Manager(timeout=...)         default 60 (torchft default)
  FT_QUORUM_S    Manager(quorum_timeout=...)  default 60 (torchft default)
  FT_PG_S        ProcessGroupGloo(timeout=...) default 60 (torchft default)
  FT_LIGHTHOUSE  lighthouse address, default http://127.0.0.1:29510
Lines marked '# FT' are the torchft-specific ones.
"""

import time

T_START = time.time()
import argparse
import logging
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo  # FT

p = argparse.ArgumentParser()
p.add_argument("--rid", type=int, required=True)
p.add_argument("--log", required=True)
p.add_argument("--steps", type=int, default=40)
p.add_argument("--sleep", type=float, default=0.3)
p.add_argument("--barrier", default="", help="dir: wait until N ready files exist before starting the Manager")
p.add_argument("--nbarrier", type=int, default=2)
p.add_argument(
    "--mode",
    default=os.environ.get("FT_MODE", "manual"),
    choices=["ddp", "manual"],
    help="ddp: torchft.DistributedDataParallel; manual: manager.allreduce() on every grad",
)
args = p.parse_args()

logging.basicConfig(
    level=logging.INFO,
    stream=sys.stderr,
    format="%(asctime)s.%(msecs)03d %(levelname)s %(name)s: %(message)s",
    datefmt="%H:%M:%S",
)
torch.set_num_threads(1)
logf = open(args.log, "a", buffering=1)


def log(msg):
    logf.write(msg + "\n")


log(f"START t={T_START:.3f} pid={os.getpid()} rid={args.rid} torch={torch.__version__} mode={args.mode}")

# model: 2-layer MLP, identical init on every replica (seed 0)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
inner_opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def state_dict():  # FT
    return {"model": model.state_dict(), "optim": inner_opt.state_dict()}  # FT


def load_state_dict(sd):  # FT
    model.load_state_dict(sd["model"])  # FT
    inner_opt.load_state_dict(sd["optim"])  # FT
    log(f"LOADED_STATE t={time.time():.3f}")


if args.barrier:
    os.makedirs(args.barrier, exist_ok=True)
    open(os.path.join(args.barrier, f"ready{args.rid}"), "w").close()
    while len(os.listdir(args.barrier)) < args.nbarrier:
        time.sleep(0.05)

# the replica group's own TCPStore (torchrun would normally host it)
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # FT
env = os.environ.get
pg = ProcessGroupGloo(timeout=timedelta(seconds=float(env("FT_PG_S", "60"))))  # FT
manager = Manager(  # FT
    pg=pg,  # FT
    load_state_dict=load_state_dict,  # FT
    state_dict=state_dict,  # FT
    min_replica_size=1,  # FT
    timeout=timedelta(seconds=float(env("FT_TIMEOUT_S", "60"))),  # FT
    quorum_timeout=timedelta(seconds=float(env("FT_QUORUM_S", "60"))),  # FT
    rank=0,
    world_size=1,  # FT
    store_addr="127.0.0.1",
    store_port=store.port,  # FT
    lighthouse_addr=env("FT_LIGHTHOUSE", "http://127.0.0.1:29510"),  # FT
    replica_id=f"replica_{args.rid}",  # FT
    hostname="127.0.0.1",  # FT
)  # FT
ddp = DistributedDataParallel(manager, model) if args.mode == "ddp" else model  # FT
opt = Optimizer(manager, inner_opt)  # FT
lossf = nn.MSELoss()
log(f"MANAGER_READY t={time.time():.3f}")


def checksum():
    with torch.no_grad():
        return float(sum(p.double().sum() for p in model.parameters()))


attempt = 0
while manager.current_step() < args.steps:
    attempt += 1
    t0 = time.time()
    opt.zero_grad()  # starts the (async) quorum  # FT (wrapped optimizer)
    step_before = manager.current_step()
    g = torch.Generator().manual_seed(1000 * args.rid + step_before)
    x = torch.randn(64, 32, generator=g)
    y = torch.randn(64, 10, generator=g)
    time.sleep(args.sleep)  # stand-in for compute, keeps timing readable
    loss = lossf(ddp(x), y)
    loss.backward()  # mode ddp: gradient allreduce inside backward (comm hook)
    if args.mode == "manual":
        works = [manager.allreduce(p.grad) for p in model.parameters()]  # FT (averages over participants)
        for w in works:  # FT
            w.wait()  # FT (errors are caught and reported to the manager; returns False)
    opt.step()  # commits only if should_commit()
    committed = manager.current_step() > step_before
    log(
        f"STEP t={time.time():.3f} rid={args.rid} step={manager.current_step()} "
        f"participants={manager.num_participants()} committed={int(committed)} "
        f"checksum={checksum():.10f} loss={loss.item():.6f} dur={time.time() - t0:.3f} "
        f"attempt={attempt} participating={int(manager.is_participating())} "
        f"errored={'1' if manager.errored() else '0'}"
    )

log(f"DONE t={time.time():.3f} step={manager.current_step()}")
manager.shutdown(wait=False)
os._exit(0)
