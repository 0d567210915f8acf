"""A two-node SLURM cluster for tests, on the two namespace "machines" of tests/netns.py.

``with SlurmCluster(tmp_path) as cluster:`` (or ``SlurmCluster(tmp_path, net)`` on a :class:`~tests.netns.TwoNodes`
the test made) starts, all inside the nodes' network namespaces:

- ``munged`` on node ``a``, with a key (fresh random bytes, not Debian's /etc/munge/munge.key), socket, pid, seed and
  log of its own in ``<folder>/munge``;
- ``slurmctld`` on node ``a`` and one ``slurmd`` on each of ``a`` and ``b`` (``NodeAddr`` = their veth addresses,
  ``CPUs=2`` each), all in the foreground (their pids are the processes started here), and waits until ``sinfo``
  shows both nodes idle.

Every daemon and client runs under ``nsenter --net=/run/netns/NS unshare --uts --mount sh -c 'hostname N; mount
--bind /etc/netns/NS/hosts /etc/hosts; ...'``, not ``ip netns exec``: that one mounts a fresh /sys, where slurmd fails
("No filesystem mounted on /sys/fs/cgroup ... Unable to initialize cgroup plugin"). Job steps are slurmd's children,
so they run on their node, under its host name, and resolve ``a`` and ``b`` from the nodes' hosts file.

``slurm.conf``, its ``plugstack.conf``, the controller's state, the spool folders, pid files and logs are all in
``folder``; nothing is written to /etc/slurm, /var/lib/slurm, /var/log or /run. The clients find the config through
``SLURM_CONF`` (:meth:`SlurmCluster.env`), and the daemons through ``-f``. Where the tools insist:
munged checks that every folder above its socket is searchable by all (pytest's temporary folders are 0700), so it
runs with ``--force``, which turns that refusal into a warning; it is root's socket, and only root uses it here.
The ports are SLURM's usual ones: each cluster has namespaces of its own, so two clusters (or a real SLURM on the host)
cannot collide on them.

The config is made for the tests of requeue, preemption and node loss: ``ReturnToService=2``, ``KillWait=5``,
``MessageTimeout=5``, ``SlurmdTimeout=10`` (a node whose slurmd is gone is DOWN about 15 s later, and a
``--requeue`` job on it pending again), ``JobRequeue=0`` (SLURM's default is 1: here only a job that asks, as the
shipped script's ``#SBATCH --requeue`` does, can be requeued, so the tests prove that line), ``MinJobAge=300`` (a
finished job's record stays long enough to be read, by a test that waits for its own job first), ``MpiDefault=none``
(no PMIx library here), ``SelectTypeParameters=CR_CPU`` (no memory tracking: 2 one-CPU tasks fit on each node), and
two partitions: ``main`` (the default) and ``high`` (a higher ``PriorityTier``) with
``PreemptType=preempt/partition_prio`` and ``PreemptMode=REQUEUE``: a job in ``high`` requeues the ``main`` jobs it
needs the CPUs of.

Clean-up on every path, as tests/netns.py's: leaving the ``with`` block (passed, failed, interrupted; SIGTERM becomes
KeyboardInterrupt while the nodes exist) cancels every job, stops the daemons this cluster started (by pid: SIGTERM,
then SIGKILL), kills every process left in the namespaces, and removes the namespaces and their /etc/netns folders
(its own :class:`TwoNodes`; a ``net`` passed in is the caller's to remove). A run killed with SIGKILL leaves its
namespaces, and everything in them, to the next ``TwoNodes`` (pid-named: :func:`tests.netns.remove_leftovers`).

:func:`slurm_available` says whether this host can run it, and why not.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from functools import cache
from pathlib import Path

from tests.netns import NETNS_ETC, Node, TwoNodes, netns_available

VENV_BIN = Path(sys.executable).parent  # the venv's commands (python, torchrun) come first on a job's PATH
TOOLS = (("slurmctld", "slurm-wlm"), ("slurmd", "slurm-wlm"), ("sbatch", "slurm-wlm"), ("munged", "munge"))
CPUS = 2  # per node
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL",
            "DEADLINE"}  # fmt: skip
START_TIMEOUT = 60  # s for the daemons to come up and both nodes to be idle


class SlurmError(RuntimeError):
    """A SLURM command failed, or a job or node did not get where it should."""


@cache
def slurm_available() -> tuple[bool, str]:
    """(True, "") where :class:`SlurmCluster` can run here: root, network namespaces, SLURM's daemons and clients and
    munged; else (False, why not)."""
    ok, why = netns_available()
    if not ok:
        return ok, why
    for tool, package in (*TOOLS, ("nsenter", "util-linux")):
        if shutil.which(tool) is None:
            return False, f"no `{tool}` command: install {package} (apt-get install slurm-wlm munge)"
    return True, ""


def slurm_conf(folder: Path, nodes: tuple[Node, ...], munge_socket: Path, cpus: int = CPUS, extra: str = "") -> str:
    """The cluster's slurm.conf: everything it writes under ``folder``, the controller on the first node."""
    first = nodes[0]
    names = ",".join(n.name for n in nodes)
    lines = [
        "ClusterName=tests",
        f"SlurmctldHost={first.name}({first.address})",
        "SlurmctldPort=6817",
        "SlurmdPort=6818",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={munge_socket}",
        f"StateSaveLocation={folder}/state",
        f"SlurmdSpoolDir={folder}/spool/%n",
        f"SlurmctldPidFile={folder}/run/slurmctld.pid",
        f"SlurmdPidFile={folder}/run/slurmd-%n.pid",
        f"SlurmctldLogFile={folder}/log/slurmctld.log",
        f"SlurmdLogFile={folder}/log/slurmd-%n.log",
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
        "MailProg=/bin/true",  # none here; slurmctld logs an error without one
        f"PlugStackConfig={folder}/plugstack.conf",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "SlurmdParameters=config_overrides",  # CPUs= as written, whatever the host has
        "MpiDefault=none",
        "ReturnToService=2",
        "SlurmdTimeout=10",
        "MessageTimeout=5",
        "KillWait=5",
        "MinJobAge=300",
        "JobRequeue=0",
        "InactiveLimit=0",
        "PreemptType=preempt/partition_prio",
        "PreemptMode=REQUEUE",
        *(f"NodeName={n.name} NodeAddr={n.address} CPUs={cpus} State=UNKNOWN" for n in nodes),
        f"PartitionName=main Nodes={names} Default=YES MaxTime=INFINITE State=UP PriorityTier=1 OverSubscribe=NO",
        f"PartitionName=high Nodes={names} MaxTime=INFINITE State=UP PriorityTier=2 OverSubscribe=NO",
        extra,
    ]
    return "\n".join(lines) + "\n"


class SlurmCluster:
    """munged, slurmctld and two slurmds on two namespace nodes (module docstring); a context manager that always
    cleans up."""

    def __init__(self, folder: Path, net: TwoNodes | None = None, cpus: int = CPUS, extra_conf: str = "") -> None:
        """``folder``: where the config, state, spool and logs go (a test's ``tmp_path``); ``net``: nodes to run on
        (made and removed here when None); ``extra_conf``: more slurm.conf lines (``RequeueExit=...``)."""
        self.folder = Path(folder).resolve() / "slurm"
        self.own_net = net is None
        self.net = net or TwoNodes()
        self.cpus, self.extra_conf = cpus, extra_conf
        self.conf = self.folder / "slurm.conf"
        self.munge = self.folder / "munge"
        self.daemons: dict[str, subprocess.Popen] = {}  # "munged", "slurmctld", "slurmd-a", "slurmd-b"
        self.timings: dict[str, float] = {}  # seconds: "up", "down"

    @property
    def nodes(self) -> tuple[Node, ...]:
        return self.net.nodes

    # ---------------------------------------------------------------- starting and stopping
    def __enter__(self) -> SlurmCluster:
        ok, why = slurm_available()
        if not ok:
            raise SlurmError(why)
        started = time.monotonic()
        if self.own_net:
            self.net.__enter__()
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        self.timings["up"] = time.monotonic() - started
        return self

    def __exit__(self, *exc) -> None:
        left = self.close()
        if left and exc[0] is None:
            raise SlurmError("clean-up left " + "; ".join(left))

    def _start(self) -> None:
        shutil.rmtree(self.folder / "state", ignore_errors=True)  # a fresh controller: no jobs of an earlier cluster
        for sub in ("state", "run", "log", *(f"spool/{n.name}" for n in self.nodes)):
            (self.folder / sub).mkdir(parents=True, exist_ok=True)
        self.munge.mkdir(mode=0o700, exist_ok=True)
        key = self.munge / "munge.key"
        key.touch(mode=0o600)
        key.write_bytes(os.urandom(128))  # a key of its own: nothing read from /etc/munge
        (self.folder / "plugstack.conf").write_text("")  # no SPANK plugins (not /etc/slurm/plugstack.conf)
        self.conf.write_text(slurm_conf(self.folder, self.nodes, self.munge / "socket", self.cpus, self.extra_conf))
        a = self.nodes[0]
        munged = ["munged", "--foreground", "--force", f"--socket={self.munge / 'socket'}", f"--key-file={key}",
                  f"--pid-file={self.munge / 'munged.pid'}", f"--log-file={self.munge / 'munged.log'}",
                  f"--seed-file={self.munge / 'munged.seed'}"]  # fmt: skip
        self._daemon("munged", a, munged)
        self._wait_for(lambda: (self.munge / "socket").exists(), "munged's socket", 10)
        self._daemon("slurmctld", a, ["slurmctld", "-D", "-f", str(self.conf)])
        for node in self.nodes:
            self._daemon(f"slurmd-{node.name}", node, ["slurmd", "-D", "-f", str(self.conf), "-N", node.name])
        self._wait_for(self._all_idle, "both nodes idle in sinfo", START_TIMEOUT)

    def _daemon(self, name: str, node: Node, args: list[str]) -> None:
        """Start a daemon in the foreground on ``node`` (the process started is the daemon itself: nsenter, unshare
        and sh exec it), its own output to ``log/<name>.out``."""
        with open(self.folder / "log" / f"{name}.out", "ab") as out:
            self.daemons[name] = subprocess.Popen(
                self.on(node, args), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                env=self.env(), start_new_session=True,
            )  # fmt: skip

    def _all_idle(self) -> bool:
        out = self.client(["sinfo", "-h", "-N", "-o", "%N %t"], check=False)
        states = dict(line.split() for line in out.stdout.splitlines() if line.strip())
        return all(states.get(n.name) == "idle" for n in self.nodes)

    def _wait_for(self, ready, what: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            dead = [name for name, p in self.daemons.items() if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                why = f"{', '.join(dead)} exited" if dead else f"not after {timeout:g} s"
                raise SlurmError(f"waiting for {what}: {why}\n{self.logs_tail()}")
            time.sleep(0.2)

    def close(self) -> list[str]:
        """Cancel every job, stop the daemons started here (SIGTERM, then SIGKILL after 5 s), kill what is left in the
        namespaces and, if they are this cluster's, remove them. What could not be removed, in words. Safe to call
        more than once."""
        started = time.monotonic()
        left: list[str] = []
        controller = self.daemons.get("slurmctld")
        if controller is not None and controller.poll() is None:
            with contextlib.suppress(Exception):
                jobs = self.client(["squeue", "-h", "-o", "%A"], check=False, timeout=10).stdout.split()
                if jobs:
                    self.client(["scancel", *jobs], check=False, timeout=10)
                    # a few s for them to end: the controller's kill requests to slurmds already gone would hold
                    # its shutdown 3 s; a job that ignores SIGTERM is killed with the namespaces below instead
                    deadline = time.monotonic() + 3
                    while time.monotonic() < deadline and self.client(["squeue", "-h"], check=False).stdout.strip():
                        time.sleep(0.1)
        # the reverse of their start, each stage waited for: a slurmd sends the controller the end of the jobs it
        # ran (4 s of retries when the controller is gone), and every daemon needs munged for that
        for stage in ([n for n in self.daemons if n.startswith("slurmd-")], ["slurmctld"], ["munged"]):
            left += self._stop([(name, self.daemons[name]) for name in stage if name in self.daemons])
        if self.own_net:
            left += self.net.close()
        else:
            left += self._kill_jobs_left()
        self.timings["down"] = time.monotonic() - started
        return left

    @staticmethod
    def _stop(daemons: list[tuple[str, subprocess.Popen]], grace: float = 5) -> list[str]:
        """SIGTERM, and SIGKILL to those still running ``grace`` s later; the ones that would not go, in words."""
        for _, process in daemons:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    process.terminate()
        deadline = time.monotonic() + grace
        left = []
        for name, process in daemons:
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                try:
                    process.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    left.append(f"{name} (pid {process.pid}) did not exit")
        return left

    def _kill_jobs_left(self) -> list[str]:
        """On nodes passed in: kill the job steps (slurmstepd and what it started) left in the namespaces."""
        steps = [p for node in self.nodes for p in node.pids() if _comm(p) == "slurmstepd"]
        doomed = set(steps)
        for node in self.nodes:
            doomed |= {p for p in node.pids() if set(_ancestors(p)) & set(steps)}
        for pid in doomed:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_comm(p) for p in doomed):
            time.sleep(0.05)
        return [f"job process {p}" for p in doomed if _comm(p)]

    # ---------------------------------------------------------------- commands
    def on(self, node: Node, args: list[str]) -> list[str]:
        """``args`` as run on ``node``: in its network namespace, under its host name, with its hosts file."""
        etc = NETNS_ETC / node.netns
        script = (
            'hostname "$0" && mount --bind "$1/hosts" /etc/hosts && mount --bind "$1/nsswitch.conf" '
            '/etc/nsswitch.conf && shift && exec "$@"'
        )
        return ["nsenter", f"--net=/run/netns/{node.netns}", "unshare", "--uts", "--mount", "sh", "-c", script,
                node.name, str(etc), *args]  # fmt: skip

    def env(self, **more: str) -> dict:
        """The environment of a client (and so of a job it submits, as sbatch exports it all): this one's, the venv
        first on PATH, ``SLURM_CONF``, and ``more``."""
        path = f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}"
        # none of a SLURM job's variables this test run may itself be in: srun would join that job's allocation
        host = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SALLOC_", "SRUN_"))}
        return {**host, "PATH": path, "PYTHONUNBUFFERED": "1", "SLURM_CONF": str(self.conf), **more}

    def client(
        self, args: list[str], *, node: str = "a", cwd: Path | str | None = None, env: dict | None = None,
        timeout: float = 60, check: bool = True,
    ) -> subprocess.CompletedProcess:  # fmt: skip
        """Run a SLURM client command (``sinfo``, ``scontrol`` ...) on node ``node``; its output captured as text.
        ``env``: more variables for it."""
        result = subprocess.run(
            self.on(self.net.node(node), args), capture_output=True, text=True, timeout=timeout, cwd=cwd,
            env=self.env(**(env or {})), stdin=subprocess.DEVNULL,
        )  # fmt: skip
        if check and result.returncode != 0:
            raise SlurmError(
                f"{shlex.join(args)} (exit {result.returncode}): {(result.stderr or result.stdout).strip()}"
            )
        return result

    def sbatch(self, script: Path | str, *args: str, cwd: Path | str | None = None, env: dict | None = None) -> str:
        """``sbatch --parsable ARGS SCRIPT`` on node ``a``, from ``cwd`` (the job's working folder), with this
        cluster's environment plus ``env`` (sbatch passes it all to the job); the job id."""
        out = self.client(["sbatch", "--parsable", *args, str(script)], cwd=cwd, env=env)
        return out.stdout.strip().split(";")[0]

    def srun(self, *args: str, node: str = "a", timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess:
        """``srun ARGS`` on node ``node`` (a quick step: ``srun -N2 -n2 hostname``)."""
        return self.client(["srun", *args], node=node, timeout=timeout, check=check)

    def scontrol(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return self.client(["scontrol", *args], check=check)

    def state(self, job: str) -> dict[str, str] | None:
        """``scontrol show job -o JOB`` as ``{field: value}``: ``JobState``, ``Reason``, ``Restarts`` (the requeue
        count: ``SLURM_RESTART_COUNT`` of its next start), ``ExitCode``, ``EligibleTime`` ...; None once slurmctld
        has forgotten the job (``MinJobAge`` after it ended)."""
        out = self.scontrol("show", "job", "-o", str(job), check=False)
        if out.returncode != 0:
            if "Invalid job id" in out.stderr:
                return None
            raise SlurmError(f"scontrol show job {job}: {out.stderr.strip()}")
        return parse_fields(out.stdout)

    def wait(
        self, job: str, states: tuple[str, ...] = ("COMPLETED",), timeout: float = 120, poll: float = 0.5
    ) -> dict[str, str]:
        """Wait until ``job``'s JobState is one of ``states``; its fields then. Fails, with the daemons' logs, when it
        ends in another state or ``timeout`` passes."""
        deadline = time.monotonic() + timeout
        info: dict[str, str] | None = None
        while True:
            now = self.state(job)
            if now is None and info is None:
                raise SlurmError(f"no job {job}")
            info = now or info
            if info["JobState"] in states:
                return info
            if now is None or (info["JobState"] in TERMINAL and info["JobState"] not in states):
                raise SlurmError(f"job {job} is {_brief(info)}, not {'/'.join(states)}\n{self.logs_tail()}")
            if time.monotonic() > deadline:
                raise SlurmError(f"job {job} still {_brief(info)} after {timeout:g} s\n{self.logs_tail()}")
            time.sleep(poll)

    def requeue(self, job: str) -> None:
        """``scontrol requeue JOB``: SIGCONT and SIGTERM to every process of the job (SIGKILL ``KillWait`` later), then
        it is pending again, eligible 2 minutes after it ended (:meth:`release_begin_time`)."""
        self.scontrol("requeue", str(job))

    def release_begin_time(self, job: str, timeout: float = 60) -> None:
        """Once a requeued ``job`` is pending, let it start now instead of 2 minutes after it ended, as SLURM holds a
        requeued job back (Reason=BeginTime). SLURM 22.05's ``scontrol update`` calls the field ``StartTime``: it
        refuses ``BeginTime=now`` ("Update of this parameter is not supported")."""
        self.wait(job, states=("PENDING",), timeout=timeout, poll=0.2)
        self.scontrol("update", f"jobid={job}", "StartTime=now")

    def scancel(self, job: str, signal: str | None = None, *options: str) -> None:
        """``scancel [--signal=SIGNAL] [OPTIONS] JOB`` (``--batch``, ``--full``: which processes get it)."""
        self.client(["scancel", *([f"--signal={signal}"] if signal else []), *options, str(job)])

    @contextlib.contextmanager
    def configured(self, **values: str):
        """slurm.conf's ``Key=value`` lines set to ``values`` for the block (``scontrol reconfigure``), then back."""
        before = self.conf.read_text()
        text = before
        for key, value in values.items():
            text, found = re.subn(rf"(?m)^{key}=.*$", f"{key}={value}", text)
            assert found == 1, f"slurm.conf has no {key}= line"
        self.conf.write_text(text)
        self.scontrol("reconfigure")
        try:
            yield
        finally:
            self.conf.write_text(before)
            self.scontrol("reconfigure", check=False)

    def node_state(self, name: str) -> str:
        """``sinfo``'s short state of node ``name``: idle, alloc, mix, down*, ..."""
        return self.client(["sinfo", "-h", "-n", name, "-N", "-o", "%t"]).stdout.split()[0]  # a line per partition

    def kill_node(self, name: str) -> None:
        """Lose node ``name``: SIGKILL its slurmd and every job process on it (the controller and munged on ``a``
        stay). slurmctld marks it DOWN within ``SlurmdTimeout`` (~10-20 s); :meth:`start_node` brings it back."""
        node = self.net.node(name)
        keep = {p.pid for n, p in self.daemons.items() if n in ("slurmctld", "munged")}
        for pid in node.pids():
            if pid not in keep:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.daemons[f"slurmd-{name}"].wait(timeout=10)

    def start_node(self, name: str) -> None:
        """Start node ``name``'s slurmd again (``ReturnToService=2`` makes a DOWN node idle once it registers)."""
        self._daemon(f"slurmd-{name}", self.net.node(name), ["slurmd", "-D", "-f", str(self.conf), "-N", name])

    def wait_until_node_runs_steps(self, name: str, timeout: float = 90) -> int:
        """Return once node ``name`` runs a job step (``srun -w NAME true``) after :meth:`start_node`: "idle" in
        ``sinfo`` was not enough under load, where the first task its new slurmd launched died before it printed a
        line and the job's other rank waited at the rendezvous for good. The number of probes it took."""
        deadline, probes = time.monotonic() + timeout, 0
        while True:
            probes += 1
            try:
                probe = self.srun("-w", name, "-N1", "-n1", "true", timeout=20, check=False)
                if probe.returncode == 0:
                    return probes
                why = (probe.stderr or probe.stdout).strip()
            except subprocess.TimeoutExpired:
                why = "no answer within 20 s"
            if time.monotonic() > deadline:
                raise SlurmError(f"node {name} runs no job step ({why}) after {timeout:g} s\n{self.logs_tail()}")
            time.sleep(1)

    # ---------------------------------------------------------------- logs
    def log(self, name: str) -> str:
        """A daemon's log: ``slurmctld``, ``slurmd-a``, ``slurmd-b`` or ``munged`` (with what it printed itself)."""
        paths = {"munged": self.munge / "munged.log"}
        path = paths.get(name, self.folder / "log" / f"{name}.log")
        out = self.folder / "log" / f"{name}.out"
        return "".join(p.read_text(errors="replace") for p in (path, out) if p.exists())

    def logs_tail(self, chars: int = 1500) -> str:
        return "\n".join(f"--- {name}:\n{self.log(name)[-chars:]}" for name in self.daemons)


def parse_fields(text: str) -> dict[str, str]:
    """``Key=value Key2=value with spaces ...`` (``scontrol -o``) as a dict; a value runs to the next `` Key=``."""
    return dict(re.findall(r"(?:^|\s)([A-Za-z][\w/:.]*)=(.*?)(?=\s+[A-Za-z][\w/:.]*=|\s*$)", text.strip()))


def _brief(info: dict[str, str]) -> str:
    return ", ".join(f"{k}={info.get(k)}" for k in ("JobState", "Reason", "ExitCode", "Restarts"))


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _ancestors(pid: int) -> list[int]:
    chain = []
    while pid > 1:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            break
        pid = int(stat.rsplit(")", 1)[1].split()[1])
        chain.append(pid)
    return chain
