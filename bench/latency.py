"""What network latency costs a multi-node step: docs/multi-node.md's torchrun command across two namespace nodes
whose link carries every packet D ms late, for several D.

    sudo .venv/bin/python -m bench.latency                     # D = 5, 10, 20 ms each way
    sudo .venv/bin/python -m bench.latency --delays 5 25 --steps 30

The nodes are tests/netns.py's (root, ``ip netns``); the link is tests/wire.py's for every D, 0 included (this kernel
has no ``tc netem``).
The run is the tests' tiny task on CPU, one process per node (tests/test_two_nodes.py's form of the docs' command).
For each D: the round trip measured on the link (a TCP connect), the median time per step of the last epoch (the
run's own ``ms/step``), the time added to a step against the first D, and that time over the round trip added: how
many latency-bound exchanges a step makes (gradient all-reduce, metric syncs, the store), which is what a long link
multiplies. The base is a delayed link too: on the 2-core test host a link with no delay gave bimodal step times
(216-280 ms in some runs, 600-850 ms in others, with the same run time), which a delay of a few ms does not show.
Writes ``bench/results/latency-two-nodes[-keep-window]-cpu.{json,md}``.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

from bench.report import record

ROOT = Path(__file__).resolve().parents[1]

RTT_PROBE = """
import socket, time
times = []
for _ in range(5):
    s = socket.socket(); s.settimeout(10)
    t = time.perf_counter()
    try:
        s.connect(("{address}", 9))  # nothing listens: the reset comes back after one round trip
    except ConnectionRefusedError:
        pass
    times.append(time.perf_counter() - t)
    s.close()
print(sorted(times)[len(times) // 2] * 1000)
"""


def step_ms(log: str) -> float:
    """The last epoch line's ``ms/step`` (app/callbacks/run_report.py)."""
    found = re.findall(r"\| ([\d,.]+) ms/step \|", log)
    if not found:
        raise RuntimeError(f"no epoch line with ms/step in the run's output:\n{log[-3000:]}")
    return float(found[-1].replace(",", ""))


def run(delay_ms: float, steps: int, epochs: int, slow_start_after_idle: bool = True) -> dict:
    from tests.netns import TwoNodes
    from tests.test_two_nodes import doc_commands, node_env, on_two_cpu_nodes

    with TwoNodes(delay_ms=delay_ms, wire=True) as nodes, tempfile.TemporaryDirectory() as scratch:
        if not slow_start_after_idle:  # a per-namespace setting: TCP keeps its window between steps
            for node in nodes.nodes:
                node.run(["sysctl", "-q", "-w", "net.ipv4.tcp_slow_start_after_idle=0"]).check_returncode()
        rtt = float(nodes.a.run([sys.executable, "-c", RTT_PROBE.format(address=nodes.b.address)]).stdout)
        root = Path(scratch) / "runs"
        logs, processes = {}, {}
        started = time.monotonic()
        for node, words in zip(nodes.nodes, doc_commands("**torchrun**"), strict=True):
            words = on_two_cpu_nodes(words, root)
            words += [f"--trainer.limit_train_batches={steps}", f"--trainer.max_epochs={epochs}"]
            logs[node.name] = Path(scratch) / f"{node.name}.log"
            processes[node.name] = node.popen(words, log=logs[node.name], env=node_env(), cwd=ROOT)
        for name, process in processes.items():
            if process.wait(timeout=600) != 0:
                raise RuntimeError(f"node {name} exited {process.returncode}:\n{logs[name].read_text()[-3000:]}")
        return {
            "delay ms (each way)": delay_ms,
            "round trip ms": round(rtt, 2),
            "ms per step": step_ms(logs["a"].read_text()),
            "run s": round(time.monotonic() - started, 1),
        }


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(prog="python -m bench.latency", description=__doc__.splitlines()[0])
    parser.add_argument("--delays", type=float, nargs="+", default=[5, 10, 20], help="ms each way, the base first")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per epoch")
    parser.add_argument("--epochs", type=int, default=2, help="the last epoch's median step is reported")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each delay (the median is reported)")
    parser.add_argument("--no-record", action="store_true", help="print only (no bench/results files)")
    parser.add_argument("--keep-window", action="store_true", help="net.ipv4.tcp_slow_start_after_idle=0 on both nodes")
    args = parser.parse_args(argv)
    rows = []
    for delay in args.delays:
        runs = [run(delay, args.steps, args.epochs, not args.keep_window) for _ in range(args.repeats)]
        row = {**runs[0], "ms per step": median(r["ms per step"] for r in runs)}
        row["round trip ms"] = round(median(r["round trip ms"] for r in runs), 2)
        row["ms per step"] = round(row["ms per step"], 1)
        rows.append(row)
    for row in rows[1:]:  # against the first delay: what each added round trip costs a step
        first = rows[0]
        row["added ms per step"] = round(row["ms per step"] - first["ms per step"], 1)
        added_rtt = row["round trip ms"] - first["round trip ms"]
        row["added / added round trip"] = round(row["added ms per step"] / added_rtt, 2) if added_rtt > 0 else None
    columns = list(dict.fromkeys(k for row in rows for k in row))
    notes = (
        "Two namespace nodes on one 2-core host, one process each (gloo), the tests' tiny task (width 32: 45,668"
        " parameters) through docs/multi-node.md's torchrun command. 'added / added round trip': the latency-bound"
        " exchanges a step makes (against the first delay)."
    )
    for row in rows:
        print(row)
    if not args.no_record:
        name = "latency-two-nodes" + ("-keep-window" if args.keep_window else "")
        print(record(name, "bench.latency", rows, columns, notes=notes, device="cpu"))
    return rows


if __name__ == "__main__":
    main()
