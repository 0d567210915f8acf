# ruff: noqa: E402, E741, SIM115 (a measurement script: logs opened for the whole run, imports timed)
"""Runs one scenario: lighthouse + 2 replica groups, optional fault on replica 1, optional restart.

python runner.py NAME [--fault none|kill|stop] [--fault-at 10] [--restart-at 20]
                      [--stop-kill-after-steps 3] [--stop-cap 200]
                      [--timeout 60] [--quorum 60] [--pg 60]
                      [--hb-ms 5000] [--join-ms 60000] [--steps 40] [--sleep 0.3]
Writes logs/NAME/{lighthouse.log,r0.log,r0.err,r1.log,r1.err,r1b.log,r1b.err,events.log}
"""

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PY = sys.executable  # a Python with torchft installed (pip install torchft==0.2.0)
LH = os.path.join(os.path.dirname(sys.executable), "torchft_lighthouse")  # in the torchft wheel

ap = argparse.ArgumentParser()
ap.add_argument("name")
ap.add_argument("--fault", default="none", choices=["none", "kill", "stop"])
ap.add_argument("--fault-at", type=int, default=10)
ap.add_argument("--restart-at", type=int, default=0)
ap.add_argument("--stop-kill-after-steps", type=int, default=3)
ap.add_argument("--stop-cap", type=float, default=200)
ap.add_argument("--timeout", default="60")
ap.add_argument("--quorum", default="60")
ap.add_argument("--pg", default="60")
ap.add_argument("--hb-ms", type=int, default=5000)
ap.add_argument("--join-ms", type=int, default=60000)
ap.add_argument("--steps", type=int, default=40)
ap.add_argument("--sleep", type=float, default=0.3)
ap.add_argument("--mode", default="manual")
ap.add_argument("--kill-lighthouse-at", type=int, default=0)
ap.add_argument("--cap", type=float, default=400, help="hard wall limit for the whole run")
a = ap.parse_args()

d = os.path.join(os.environ.get("TORCHFT_LOGS", "/tmp/torchft-logs"), a.name)
shutil.rmtree(d, ignore_errors=True)
os.makedirs(d)
bar = os.path.join(d, "barrier")
ev = open(os.path.join(d, "events.log"), "a", buffering=1)


def event(ev_kind, **kw):
    kw.update(event=ev_kind, t=round(time.time(), 3))
    ev.write(json.dumps(kw) + "\n")
    print(json.dumps(kw), flush=True)


event("config", **vars(a))
lh_cmd = [
    LH,
    "--min_replicas",
    "1",
    "--bind",
    "127.0.0.1:29510",
    "--heartbeat_timeout_ms",
    str(a.hb_ms),
    "--join_timeout_ms",
    str(a.join_ms),
]
lh = subprocess.Popen(lh_cmd, stdout=open(os.path.join(d, "lighthouse.log"), "w"), stderr=subprocess.STDOUT)
event("lighthouse_start", cmd=" ".join(lh_cmd), pid=lh.pid)
time.sleep(0.5)

env = dict(os.environ, FT_MODE=a.mode, FT_TIMEOUT_S=a.timeout, FT_QUORUM_S=a.quorum, FT_PG_S=a.pg)


def start(rid, tag):
    cmd = [
        PY,
        os.path.join(HERE, "train_ft.py"),
        "--rid",
        str(rid),
        "--log",
        os.path.join(d, f"{tag}.log"),
        "--steps",
        str(a.steps),
        "--sleep",
        str(a.sleep),
        "--barrier",
        bar,
    ]
    pr = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=open(os.path.join(d, f"{tag}.err"), "w"))
    event("replica_start", tag=tag, pid=pr.pid, cmd=" ".join(cmd))
    return pr


def last_step(tag):
    try:
        txt = open(os.path.join(d, f"{tag}.log")).read()
    except FileNotFoundError:
        return -1
    s = re.findall(r"^STEP .* step=(\d+) ", txt, re.M)
    return int(s[-1]) if s else -1


r0 = start(0, "r0")
r1 = start(1, "r1")
r1b = None
t_begin = time.time()
faulted = stopped_killed = restarted = False
t_fault = None
step_at_fault = None
while True:
    time.sleep(0.02)
    s0 = last_step("r0")
    if a.fault != "none" and not faulted and s0 >= a.fault_at:
        if a.fault == "kill":
            os.kill(r1.pid, signal.SIGKILL)
        else:
            os.kill(r1.pid, signal.SIGSTOP)
        faulted, t_fault, step_at_fault = True, time.time(), s0
        event("fault", kind=a.fault, pid=r1.pid, r0_step=s0)
    if a.kill_lighthouse_at and lh.poll() is None and s0 >= a.kill_lighthouse_at:
        lh.kill()
        event("lighthouse_killed", r0_step=s0)
        faulted = True
    if (
        a.fault == "stop"
        and faulted
        and not stopped_killed
        and (s0 >= step_at_fault + a.stop_kill_after_steps or time.time() - t_fault > a.stop_cap)
    ):
        os.kill(r1.pid, signal.SIGKILL)
        stopped_killed = True
        event("kill_stopped", pid=r1.pid, r0_step=s0, after_s=round(time.time() - t_fault, 3))
    if a.restart_at and not restarted and s0 >= a.restart_at and (a.fault != "stop" or stopped_killed):
        r1.wait()
        r1b = start(1, "r1b")
        restarted = True
    if r0.poll() is not None and (r1b is None or r1b.poll() is not None) and (faulted or r1.poll() is not None):
        break
    if time.time() - t_begin > a.cap:
        event("cap_reached")
        break

for pr in (r0, r1, r1b):
    if pr is not None and pr.poll() is None:
        pr.kill()
    if pr is not None:
        pr.wait()
        event("exit", pid=pr.pid, rc=pr.returncode)
lh.send_signal(signal.SIGTERM)
lh.wait()
event("end")
