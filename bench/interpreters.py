"""Count the Python interpreters a command starts (the test suite, a launcher), what each imported and its CPU time.

    python -m bench.interpreters -- python -m pytest -n 2 --dist loadgroup -p no:cacheprovider

For the command's duration a ``.pth`` hook in this venv's site-packages makes every interpreter that starts from it
write a record when it starts (its command line and parent) and when it exits (its CPU time, whether it imported
torch and Lightning, whether it was forked from a warm one, the test that ran it); the hook is removed afterwards,
also when the command fails. A process killed by a signal leaves its start record only. The tables it prints are
the ones docs/testing.md ("Where the time goes") quotes.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import sysconfig
import tempfile
from collections import Counter
from pathlib import Path

HOOK = """
import atexit, json, os, sys, time
_PID, _DIR = os.getpid(), {folder!r}


def _ancestors():
    pids, pid = [], os.getppid()
    while pid > 1:
        pids.append(pid)
        with open(f"/proc/{{pid}}/stat") as f:
            pid = int(f.read().rsplit(")", 1)[1].split()[1])
    return pids


def _write(kind):
    try:
        times = os.times()
        with open("/proc/self/cmdline", "rb") as f:
            cmdline = [a.decode(errors="replace") for a in f.read().split(b"\\0")[:8]]
        record = {{
            "kind": kind, "pid": os.getpid(), "ppid": os.getppid(), "ancestors": _ancestors(),
            "forked": os.getpid() != _PID,
            "cmdline": cmdline, "cpu": times.user + times.system, "torch": "torch" in sys.modules,
            "lightning": "lightning" in sys.modules, "test": os.environ.get("PYTEST_CURRENT_TEST", ""),
        }}
        with open(os.path.join(_DIR, f"{{os.getpid()}}-{{kind}}-{{time.time_ns()}}.json"), "w") as f:
            json.dump(record, f)
    except Exception:
        pass


_write("start")
atexit.register(_write, "exit")
"""


def report(folder: Path, root: int | None = None) -> str:
    """The tables, of the processes that descend from ``root`` (the command's pid; None: all recorded)."""
    records = [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))]
    if root is not None:  # not another command's, started from this venv meanwhile
        records = [r for r in records if r["pid"] == root or root in r.get("ancestors", ())]
    starts = {r["pid"]: r for r in records if r["kind"] == "start"}
    exits = {r["pid"]: r for r in records if r["kind"] == "exit"}

    def command(pid: int) -> str:
        return " ".join(starts[pid]["cmdline"]) if pid in starts else ""

    agents = {pid for pid in starts if "torch.distributed.run" in command(pid)}
    workers = {pid for pid in starts if "exec(eval(sys.stdin.readline()))" in command(pid)}  # pytest-xdist's
    heavy = [
        pid
        for pid in starts
        if pid not in agents | workers and (pid not in exits or exits[pid]["torch"] or exits[pid]["lightning"])
    ]
    reported = [exits[pid]["cpu"] for pid in heavy if pid in exits]
    lightning = sorted(exits[pid]["cpu"] for pid in heavy if pid in exits and exits[pid]["lightning"])
    forked = [r for r in exits.values() if r["forked"]]
    lines = [
        f"fresh interpreters importing torch: {len(heavy)} ({len(heavy) - len(reported)} left no exit record),"
        f" {sum(reported):,.0f} CPU-s for those that reported",
        f"  of them importing Lightning: {len(lightning)}, median {lightning[len(lightning) // 2]:.1f} CPU-s,"
        f" min {lightning[0]:.1f}"
        if lightning
        else "  none imported Lightning",
        f"torchrun agents: {len(agents)}, {sum(exits[p]['cpu'] for p in agents if p in exits):,.0f} CPU-s",
        f"pytest-xdist workers: {len(workers)}, {sum(exits[p]['cpu'] for p in workers if p in exits):,.0f} CPU-s",
        f"warm runs (forked): {len(forked)}, {sum(r['cpu'] for r in forked):,.0f} CPU-s",
        "fresh interpreters by their parent:",
    ]
    kinds: Counter = Counter()
    cpu: Counter = Counter()
    for pid in heavy:
        line, parent = command(pid), starts[pid]["ppid"]
        if "spawn_main" in line or "forkserver" in line:
            kind = "multiprocessing (spawn, forkserver)"
        elif parent in agents:
            kind = "a torchrun agent"
        elif parent in workers:
            kind = "a test itself (a person's first run, a user's own script, ...)"
        elif parent in starts:
            kind = "another Python process (a fresh rank 0's launcher, the torchrun script)"
        else:
            kind = "not Python (mpirun/prterun, sh, ip netns exec), or the command itself"
        kinds[kind] += 1
        cpu[kind] += exits[pid]["cpu"] if pid in exits else 0.0
    lines += [f"  {n:4d}  {cpu[kind]:8,.0f} CPU-s  {kind}" for kind, n in kinds.most_common()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", nargs="+", help="the command to run, after --")
    args = parser.parse_args(argv)
    folder = Path(tempfile.mkdtemp(prefix="interpreters-"))
    site = Path(sysconfig.get_paths()["purelib"])
    hook, pth = site / "_interpreter_census.py", site / "zz_interpreter_census.pth"
    hook.write_text(HOOK.format(folder=str(folder)))
    # one line, as a .pth takes code; quiet when the hook is removed between reading this line and importing it
    pth.write_text('import sys; exec("try:\\n import _interpreter_census\\nexcept ImportError:\\n pass")\n')
    try:
        process = subprocess.Popen(args.command)
        code = process.wait()
    finally:
        pth.unlink()
        hook.unlink()
    print(report(folder, root=process.pid))
    print(f"records in {folder}; the command exited {code}")
    sys.exit(code)


if __name__ == "__main__":
    main()
