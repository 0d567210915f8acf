"""What can be checked of the Dockerfile and the multi-node launch files without a Docker engine or a cluster."""

import configparser
import re
import shlex
import subprocess

import yaml

from tests.conftest import ROOT

DOCKERFILE = (ROOT / "Dockerfile").read_text()
INSTRUCTIONS = [
    line.strip()
    for line in re.sub(r"\\\n", " ", DOCKERFILE).splitlines()
    if line.strip() and not line.lstrip().startswith("#")
]


def instruction(name: str) -> list[str]:
    return [line[len(name) + 1 :].strip() for line in INSTRUCTIONS if line.upper().startswith(name + " ")]


def test_the_base_is_debian_bookworm_slim_with_debians_python_in_a_venv_and_torch_as_ci_installs_it():
    """The base tests/fashion_mnist/test_container.py can stand in for without a registry (a debootstrapped bookworm,
    issue 61): Debian's python3 and a venv at /opt/venv, first on PATH; not a pytorch/pytorch tag, whose torch was not
    the one the suite tests: pip resolves torch from setup.cfg in the image as in CI (issue 35, item 4)."""
    (base,) = instruction("FROM")
    assert base == "debian:bookworm-slim"  # a release's name, not "latest"
    apt = next(r for r in instruction("RUN") if "apt-get install" in r)
    assert {"python3", "python3-venv"} <= set(shlex.split(apt))
    assert any(shlex.split(r) == ["python3", "-m", "venv", "/opt/venv"] for r in instruction("RUN"))
    env = dict(re.findall(r"(\w+)=(\S+)", " ".join(instruction("ENV"))))
    assert env["PATH"].startswith("/opt/venv/bin:")
    assert "torch" not in " ".join(instruction("RUN")).replace("[mpi,tensorboard,plot]", "")


def test_pip_keeps_no_cache_in_the_image_and_the_dependencies_layer_depends_on_setup_cfg_alone():
    """pip's downloads go to a build cache mount, never into a layer; the dependencies are installed before the code
    is copied, so that a change of code or docs does not install 5 GB again."""
    installs = [r for r in instruction("RUN") if "pip install" in r]
    cached = [r for r in installs if r.startswith("--mount=type=cache,target=/var/cache/pip ")]
    assert cached and all("--cache-dir=/var/cache/pip" in r for r in cached), installs
    assert all("--no-cache-dir" in r for r in installs if r not in cached), installs
    copies_before = [c for c in INSTRUCTIONS[: INSTRUCTIONS.index("RUN " + installs[0])] if c.startswith("COPY ")]
    assert copies_before == ["COPY setup.cfg pyproject.toml ./"], copies_before


def test_the_image_can_compile_and_run_under_any_uid():
    """torch.compile needs a C compiler (inductor, Triton), which runtime images lack (pytorch/pytorch#116696); a uid
    without a passwd entry (`--user "$(id -u):$(id -g)"`) breaks inductor's default cache folder."""
    apt = next(r for r in instruction("RUN") if "apt-get install" in r)
    assert {"gcc", "g++"} <= set(shlex.split(apt))
    env = dict(re.findall(r"(\w+)=(\S+)", " ".join(instruction("ENV"))))
    for name in ("HOME", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "MPLCONFIGDIR"):
        assert env[name].startswith("/tmp"), name  # writable by any uid


def test_runs_as_a_non_root_user_with_cli_py_as_entrypoint():
    users = instruction("USER")
    assert users and users[-1] not in ("root", "0")
    assert yaml.safe_load(instruction("ENTRYPOINT")[-1]) == ["python", "cli.py"]
    volumes = yaml.safe_load(instruction("VOLUME")[-1])
    assert {"/app/data", "/app/lightning_logs"} <= set(volumes)


def test_installs_the_same_requirement_set_as_ci():
    """CI runs `make test` = pip install -e ".[dev]"; the image installs dev's runtime extras from the same file
    (and then the project itself, without dependencies)."""
    (run,) = [r for r in instruction("RUN") if "pip install" in r and ".[" in r]
    (target,) = [a for a in shlex.split(run) if a.startswith(".[")]
    image_extras = set(target[2:-1].split(","))
    cfg = configparser.ConfigParser(interpolation=None)
    cfg.read(ROOT / "setup.cfg")
    dev = cfg["options.extras_require"]["dev"]
    ci_extras = set(re.findall(r"%\((\w+)\)s", dev))
    assert "mpi" in image_extras
    assert image_extras == ci_extras, (image_extras, ci_extras)
    assert "-r " not in run and "==" not in run  # no second, diverging requirement list


def test_every_copied_file_exists_and_dockerignore_keeps_data_out():
    for copy in instruction("COPY"):
        *sources, _ = shlex.split(copy)
        for source in sources:
            assert (ROOT / source).exists(), source
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {"data", "lightning_logs", ".venv", ".git", "tests"} <= set(ignored)


def test_slurm_script_matches_its_preset():
    script = ROOT / "scripts" / "slurm_multinode.sbatch"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    text = script.read_text()
    sbatch = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", text, re.M))
    lines = "\n".join(line for line in text.splitlines() if not line.startswith("#"))  # (comments name examples)
    for config in re.findall(r"--config (\S+\.yaml)", lines):
        assert (ROOT / config).is_file(), config
    preset = yaml.safe_load((ROOT / "configs" / "multinode_ddp.yaml").read_text())["trainer"]
    assert int(sbatch["nodes"]) == preset["num_nodes"]
    assert int(sbatch["ntasks-per-node"]) == preset["devices"] == int(sbatch["gpus-per-node"])
    assert "srun python cli.py fit" in text


def test_the_image_and_ci_bring_the_real_data():
    """Debian's dataset-fashion-mnist puts the real files where --data.source=auto finds them (/usr/share/datasets)."""
    apt = next(r for r in instruction("RUN") if "apt-get install" in r)
    assert "dataset-fashion-mnist" in shlex.split(apt)
    assert "make test" in (ROOT / ".ci" / "run").read_text()  # CI runs the README's test command


INSTALL = "make .venv/.installed-dev"


def _ci_run(
    tmp_path,
    uid: int,
    apt: int | None,
    installed: bool = False,
    make: int = 0,
    install_fails: int = 0,
    container_tools: bool = True,
):
    """.ci/run with stand-ins for id, apt-get (None: not installed) and make, which record how they were called
    (``make test`` exits ``make``; the first ``install_fails`` installs fail, as a download that breaks off);
    ``container_tools``: podman, runc and debootstrap there."""
    import os
    import shutil

    repo, bin_dir, log = tmp_path / "repo", tmp_path / "bin", tmp_path / "calls.log"
    (repo / ".ci").mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / ".ci" / "run", repo / ".ci" / "run")
    shutil.rmtree(bin_dir, ignore_errors=True)
    bin_dir.mkdir()
    log.write_text("")
    make_stub = (
        f'echo "make $*" >> {log}; [ "$1" = test ] && exit {make}; '
        f'[ "$(grep -c "^{INSTALL}$" {log})" -le {install_fails} ] && exit 1; exit 0'
    )
    stubs = {"id": f'[ "$1" = -u ] && echo {uid}', "make": make_stub}
    stubs |= {"ip": "exit 0", "iptables": "exit 0"}  # there: the two-node tests' install step has nothing to do
    stubs |= {"slurmctld": "exit 0", "munged": "exit 0"}  # there: nor has the SLURM tests'
    stubs |= {"sshd": "exit 0"}  # nor the remote run root's (tests/test_storage.py)
    if container_tools:  # nor the container tests'
        stubs |= {"podman": "exit 0", "runc": "exit 0", "debootstrap": "exit 0"}
    if apt is not None:
        stubs["apt-get"] = f'echo "apt-get $*" >> {log}; exit {apt}'
    for name, body in stubs.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    for tool in ("dirname", "grep"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    system = tmp_path / "system"
    system.mkdir(exist_ok=True)
    if installed:
        (system / "train-images-idx3-ubyte.gz").touch()
    env = {"PATH": str(bin_dir), "FASHION_MNIST_SYSTEM_DIR": str(system), "HOME": os.environ.get("HOME", "/tmp")}
    result = subprocess.run(
        [shutil.which("bash"), str(repo / ".ci" / "run")], env=env, capture_output=True, text=True, timeout=60
    )
    return result, log.read_text().splitlines()


def test_ci_installs_the_real_data_only_as_root_with_apt_and_stops_when_it_cannot(tmp_path):
    """As root with apt-get, an install that fails twice (no network, no such package) stops CI in one line before
    the suite: the tests on the real data would skip unseen otherwise. Elsewhere nothing is installed."""
    install = "apt-get install -y -qq dataset-fashion-mnist"
    result, calls = _ci_run(tmp_path, uid=0, apt=0)
    assert result.returncode == 0 and calls == ["apt-get update -qq", install, INSTALL, "make test"], calls
    result, calls = _ci_run(tmp_path, uid=0, apt=100)
    assert result.returncode == 1 and calls == ["apt-get update -qq"] * 2, calls  # tried twice, no suite
    errors = [line for line in result.stderr.splitlines() if line.startswith("error")]
    assert errors == ["error: .ci/run: apt-get could not install dataset-fashion-mnist (tried twice); CI stops here"]
    for uid, apt, installed in [(1000, 0, False), (0, None, False), (0, 0, True)]:  # not root; no apt-get; there
        result, calls = _ci_run(tmp_path, uid=uid, apt=apt, installed=installed)
        assert result.returncode == 0 and calls == [INSTALL, "make test"], (uid, apt, installed, calls)
    result, calls = _ci_run(tmp_path, uid=1000, apt=0, make=2)
    assert result.returncode == 2 and calls == [INSTALL, "make test"]  # the suite's failure is CI's


def test_ci_tries_the_install_once_more_when_a_download_breaks_off(tmp_path):
    result, calls = _ci_run(tmp_path, uid=1000, apt=0, install_fails=1)
    assert result.returncode == 0 and calls == [INSTALL, INSTALL, "make test"], (calls, result.stderr)
    result, calls = _ci_run(tmp_path, uid=1000, apt=0, install_fails=2)  # twice: CI fails, no suite on half a venv
    assert result.returncode != 0 and calls == [INSTALL, INSTALL], calls


def test_ci_installs_podman_runc_and_debootstrap_as_root_when_missing_and_stops_when_it_cannot(tmp_path):
    """The container tests' tools (tests/fashion_mnist/test_container.py): as root with apt-get, installed, or CI stops
    in one line; where nothing can be installed (not root), the suite is told to expect those tests' skip, whose
    reason starts "cannot build or run the image", and may lack the container group (tests/budget.py)."""
    install = "apt-get install -y -qq podman runc debootstrap"
    result, calls = _ci_run(tmp_path, uid=0, apt=0, installed=True, container_tools=False)
    assert result.returncode == 0 and calls == ["apt-get update -qq", install, INSTALL, "make test"], calls
    result, calls = _ci_run(tmp_path, uid=0, apt=100, installed=True, container_tools=False)
    assert result.returncode == 1 and calls == ["apt-get update -qq"] * 2, calls
    assert "error: .ci/run: apt-get could not install podman runc debootstrap (tried twice)" in result.stderr
    result, calls = _ci_run(tmp_path, uid=1000, apt=0, installed=True, container_tools=False)  # not root
    assert result.returncode == 0 and calls == [INSTALL, "make test"], calls
    assert "expect these skips: cannot build or run the image" in result.stderr
