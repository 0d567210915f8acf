"""Podman as the stand-in for Docker: the Dockerfile built and its image run with docs/docker.md's commands.

What this machine needs besides the commands (each said where it is made):

- a base image: no image registry is reachable, so ``debian:bookworm-slim`` is made once with debootstrap
  (:func:`ensure_base`);
- ``CONTAINERS_CONF``: podman as root copies the host's rlimits into a container, and setting RLIMIT_NPROC is not
  permitted here ("error setting rlimit type 6"); a containers.conf with ``default_ulimits = []`` stops that. It
  also names runc as the runtime where runc is installed: Debian's podman may bring crun instead, and crun 1.8 refuses
  this machine's hybrid cgroups ("cgroups in hybrid mode not supported") (:func:`environment`);
- for the build, this machine's certificate bundle and a pip.conf naming it, beside the image's own (PyPI is
  reached through a proxy that the image's bundle does not trust): in a folder mounted over the build's /tmp, the
  Dockerfile's HOME, where pip reads ``~/.config/pip/pip.conf``. Mounted as files in /etc instead, they would leave
  their empty mount points in the image; /tmp exists already, and the image's stays empty (:func:`build`).

Every container gets a name, and is removed (with its anonymous volumes) on every path out of :func:`run` and
:func:`started`, a timeout or an error included.

The module also serves inside a container: :class:`Pace`, a callback the stop-and-resume test mounts with
``-v tests:/app/tests:ro``, so only what the image has (Lightning) is imported at its top.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from lightning.pytorch import Callback

ROOT = Path(__file__).resolve().parents[1]
IMAGE = "fashion-resnet"  # docs/docker.md's tag
BASE = "debian:bookworm-slim"  # the Dockerfile's FROM
MIRROR = "http://deb.debian.org/debian"
HOST_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
STATE = Path("/var/tmp/fashion-resnet-container")  # the conf files, and the lock of the base's making

APT_CLEAN = "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"
APT_HOOKS = ("DPkg::Post-Invoke", "APT::Update::Post-Invoke")
# What debuerreotype (which makes the registry's debian:*-slim images) adds to a minbase root: dpkg leaves out docs,
# man pages and translations; apt keeps no .deb files, no caches and no translations; the three suites of
# bookworm. Without them the stand-in is 204 MB against the registry's 75, and an image on it keeps docs it would not.
SLIM_FILES = {
    "etc/dpkg/dpkg.cfg.d/docker": """\
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/groff/*
path-exclude /usr/share/info/*
path-exclude /usr/share/linda/*
path-exclude /usr/share/lintian/overrides/*
path-exclude /usr/share/locale/*
path-include /usr/share/locale/locale.alias
path-exclude /usr/share/man/*
""",
    "etc/apt/apt.conf.d/docker-clean": "".join(f'{hook} {{ "{APT_CLEAN}"; }};\n' for hook in APT_HOOKS)
    + 'Dir::Cache::pkgcache "";\nDir::Cache::srcpkgcache "";\n',
    "etc/apt/apt.conf.d/docker-no-languages": 'Acquire::Languages "none";\n',
    "etc/apt/apt.conf.d/docker-autoremove-suggests": 'Apt::AutoRemove::SuggestsImportant "false";\n',
    "etc/apt/sources.list.d/debian.sources": f"""\
Types: deb
URIs: {MIRROR}
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: http://deb.debian.org/debian-security
Suites: bookworm-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
""",
}
SLIM_REMOVE = ("usr/share/man", "usr/share/info", "usr/share/groff", "usr/share/lintian/overrides", "var/lib/apt/lists")


def missing() -> str | None:
    """Why the image cannot be built and run here, or None."""
    if os.geteuid() != 0:
        return "not root: podman's builds and debootstrap need root here"
    for tool in ("podman", "runc", "debootstrap"):
        if shutil.which(tool) is None:
            return f"no `{tool}` command (apt-get install podman runc debootstrap)"
    return None


def environment() -> dict[str, str]:
    """The environment for every podman command: CONTAINERS_CONF with no default ulimits (the module's docstring)."""
    STATE.mkdir(parents=True, exist_ok=True)
    conf = STATE / "containers.conf"
    text = "[containers]\ndefault_ulimits = []\n"
    if shutil.which("runc"):
        text += '\n[engine]\nruntime = "runc"\n'
    if not conf.exists() or conf.read_text() != text:
        conf.write_text(text)
    return {**os.environ, "CONTAINERS_CONF": str(conf)}


def podman(*args: str, timeout: float = 120, check: bool = False) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["podman", *args], env=environment(), capture_output=True, text=True, timeout=timeout, check=check
    )


def image_id(name: str) -> str | None:
    found = podman("image", "inspect", "--format", "{{.Id}}", name)
    return found.stdout.strip() if found.returncode == 0 else None


def ensure_base() -> None:
    """``debian:bookworm-slim`` in podman's storage, made once (about 80 s): debootstrap's minbase bookworm, with the
    slim rules of the registry's image (:data:`SLIM_FILES`), imported under the Dockerfile's base name."""
    STATE.mkdir(parents=True, exist_ok=True)
    with open(STATE / "base.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one maker at a time; the others find it made
        if image_id(BASE):
            return
        with tempfile.TemporaryDirectory(dir="/var/tmp") as tmp:
            root = Path(tmp) / "root"
            subprocess.run(
                ["debootstrap", "--variant=minbase", "bookworm", str(root), MIRROR],
                capture_output=True, text=True, timeout=900, check=True,
            )  # fmt: skip
            for relative, text in SLIM_FILES.items():
                (root / relative).parent.mkdir(parents=True, exist_ok=True)
                (root / relative).write_text(text)
            (root / "etc/apt/sources.list").unlink(missing_ok=True)
            for relative in SLIM_REMOVE:
                shutil.rmtree(root / relative, ignore_errors=True)
            for path in [*(root / "usr/share/doc").rglob("*"), *(root / "usr/share/locale").rglob("*")]:
                if path.name not in ("copyright", "locale.alias") and (path.is_file() or path.is_symlink()):
                    path.unlink()  # what dpkg.cfg.d/docker keeps out of what debootstrap already installed
            (root / "var/lib/apt/lists/partial").mkdir(parents=True)
            for cache in (root / "var/cache/apt").glob("*.bin"):
                cache.unlink()
            for archive in (root / "var/cache/apt/archives").glob("*.deb"):
                archive.unlink()
            for relative in ("etc/resolv.conf", "etc/hostname"):  # the engine mounts its own at run time
                (root / relative).write_text("")
            tar = subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
            imported = subprocess.run(
                ["podman", "import", "--change", 'CMD ["bash"]', "-", BASE],
                stdin=tar.stdout, env=environment(), capture_output=True, text=True, timeout=600,
            )  # fmt: skip
            tar.stdout.close()
            tar.wait()
            if imported.returncode != 0 or tar.returncode != 0:
                raise RuntimeError(f"podman import of the base failed: {imported.stderr[-2000:]}")


def build(tag: str = IMAGE, timeout: float = 1800) -> subprocess.CompletedProcess:
    """``docker build -t fashion-resnet .`` as podman runs it here: ``--pull=never`` (no registry), and this
    machine's certificate bundle for pip (the module's docstring). The dependencies' layer is rebuilt only when
    setup.cfg or pyproject.toml change (the Dockerfile); pip's cache mount keeps no download here, as this
    machine's proxy sends no caching headers. The image the tag named before, if left without a name, is removed
    (its layers shared with the new one stay)."""
    ensure_base()
    before = image_id(tag)
    args = ["build", "--pull=never", "-t", tag]
    with tempfile.TemporaryDirectory(dir=STATE) as tmp:
        if HOST_BUNDLE.exists():
            shutil.copy(HOST_BUNDLE, Path(tmp) / "pip-ca.crt")
            (Path(tmp) / ".config" / "pip").mkdir(parents=True)
            (Path(tmp) / ".config" / "pip" / "pip.conf").write_text("[global]\ncert = /tmp/pip-ca.crt\n")
            os.chmod(tmp, 0o1777)
            args += ["--volume", f"{tmp}:/tmp"]
        result = podman(*args, str(ROOT), timeout=timeout)
    if before and result.returncode == 0 and image_id(tag) != before:
        podman("rmi", before)  # fails, harmlessly, where another tag or a container still uses it
    return result


def _name() -> str:
    return f"fashion-resnet-test-{uuid.uuid4().hex[:10]}"


def remove(name: str) -> None:
    """The container and its anonymous volumes, whatever its state; nothing if it is gone."""
    podman("rm", "--force", "--ignore", "--volumes", "--time", "0", name, timeout=60)


def run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """``podman run --rm ARGS`` (options, image and its arguments as a user types them), its output captured."""
    name = _name()
    try:
        return podman("run", "--rm", "--name", name, *args, timeout=timeout)
    finally:
        remove(name)


@contextmanager
def started(*args: str, log: Path) -> Iterator[tuple[str, subprocess.Popen]]:
    """``podman run --rm --name NAME ARGS`` in the background, its output (both streams) in ``log``: (NAME, process).
    The container is removed when the block is left, however it is left."""
    name = _name()
    with open(log, "w") as out:
        process = subprocess.Popen(
            ["podman", "run", "--rm", "--name", name, *args], env=environment(), stdout=out, stderr=subprocess.STDOUT
        )
    try:
        yield name, process
    finally:
        remove(name)
        with suppress(subprocess.TimeoutExpired):
            process.wait(timeout=30)
        if process.poll() is None:
            process.kill()
            process.wait()


def volume(folder: Path, uid: int) -> Path:
    """A host folder for ``-v``, writable by ``uid`` as docs/docker.md asks (``mkdir -p``, owned by that user)."""
    folder.mkdir(parents=True, exist_ok=True)
    os.chown(folder, uid, uid)
    return folder


def wait_for_line(log: Path, text: str, process: subprocess.Popen, timeout: float) -> None:
    """Until ``text`` is in ``log``; fails if the process ends first or the time runs out."""
    deadline = time.monotonic() + timeout
    while text not in log.read_text(errors="replace"):
        if process.poll() is not None:
            raise AssertionError(f"exited {process.returncode} before {text!r}: {log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {text!r} within {timeout} s: {log.read_text()[-3000:]}")
        time.sleep(0.1)


class Pace(Callback):
    """Test-only, run inside the container: after each of the first ``steps`` optimizer steps, prints
    ``pace: step N`` and sleeps ``seconds`` (until a stop signal comes), so that a ``podman stop`` typed from outside
    lands inside the epoch. Sleeping changes no number the run computes."""

    def __init__(self, seconds: float = 1.0, steps: int = 8) -> None:
        self.seconds, self.steps = seconds, steps

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        from app.callbacks.stop_plan import stop_plan

        preemption = stop_plan(trainer).preemption
        if trainer.global_step <= self.steps:
            print(f"pace: step {trainer.global_step}", file=sys.stderr, flush=True)
            # no slower than the run once a stop signal came: the 10 s before SIGKILL are the stop's, not the pace's
            # (paced steps of 1 s took 3 of them under load, and the container was killed after its save)
            deadline = time.monotonic() + self.seconds
            while time.monotonic() < deadline and not (preemption is not None and preemption.received):
                time.sleep(0.05)


class Where(Callback):
    """Test-only, run inside the container: each rank writes ``rank<N>.json`` into ``folder`` when training starts:
    its host name, world size and node rank."""

    def __init__(self, folder: str) -> None:
        self.folder = Path(folder)

    def on_train_start(self, trainer, pl_module) -> None:
        import json
        import socket

        self.folder.mkdir(parents=True, exist_ok=True)
        where = {"host": socket.gethostname(), "world_size": trainer.world_size, "node_rank": trainer.node_rank}
        (self.folder / f"rank{trainer.global_rank}.json").write_text(json.dumps(where))
