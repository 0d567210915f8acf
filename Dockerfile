# GPU image for the template. Build and run (docs/docker.md):
#   docker build -t fashion-resnet .
#   docker run --gpus all --shm-size=8g -v "$PWD/data:/app/data" -v "$PWD/lightning_logs:/app/lightning_logs" \
#       fashion-resnet fit --trainer.strategy=ddp --trainer.devices=4
#
# The base is Debian's own debian:bookworm-slim with Debian's python3 (3.11) and a venv at /opt/venv, first on PATH,
# so that the image tested is the image users build: tests/fashion_mnist/test_container.py builds this file unchanged
# with podman where no image registry is reachable, on a bookworm made by debootstrap (minbase, with the slim image's
# dpkg and apt rules) and imported as debian:bookworm-slim, a stand-in for the registry's of the same release and
# packages. A
# python:3.11-slim base could not be stood in for: its Python is built from source by its maintainers.
# torch comes from PyPI exactly as CI installs it: its CUDA wheels carry their own CUDA libraries, and
# `--gpus all` brings the driver.
FROM debian:bookworm-slim

# Kept at run time, not only for the build: torch.compile's inductor compiles C++ for the CPU (g++, Python.h from
# python3-dev) and Triton a C launcher for the GPU (gcc). dataset-fashion-mnist: the real Fashion-MNIST (30 MB) in
# /usr/share/datasets/fashion-mnist, where --data.source=auto finds it: the image trains on the real data with no
# download and no data volume.
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        python3 python3-venv python3-dev gcc g++ libc6-dev dataset-fashion-mnist \
    && apt-get clean && rm -rf /var/lib/apt/lists/*

# Caches in /tmp: under `docker run --user "$(id -u):$(id -g)"` the uid has no passwd entry and no home, where
# inductor's default cache folder (named by getpass.getuser()) fails.
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/tmp \
    TORCHINDUCTOR_CACHE_DIR=/tmp/torchinductor \
    TRITON_CACHE_DIR=/tmp/triton \
    MPLCONFIGDIR=/tmp/matplotlib
RUN python3 -m venv /opt/venv

WORKDIR /app
# The requirement set CI installs (setup.cfg's install_requires and the runtime extras of its `dev` extra): mpi
# brings mpi4py and Open MPI (mpirun) for the horovod strategy; tensorboard and plot for the run's pictures.
# Installed before the code is copied, from setup.cfg alone (a stand-in app/__init__.py and README.md for its
# metadata, removed again), so that a change of code or docs rebuilds in seconds and not the 6 GB of dependencies.
# pip's downloads stay in a build cache (BuildKit's, and buildah's under podman), never in the image; the cache
# keeps what PyPI's caching headers allow.
COPY setup.cfg pyproject.toml ./
RUN --mount=type=cache,target=/var/cache/pip \
    mkdir app && echo '__version__ = "0"' > app/__init__.py && touch README.md \
    && pip install --cache-dir=/var/cache/pip ".[mpi,tensorboard,plot]" \
    && pip uninstall --yes fashion-resnet-template && rm -rf app README.md build ./*.egg-info

COPY README.md ./
COPY app ./app
COPY cli.py ./
COPY configs ./configs
COPY bench ./bench
COPY examples ./examples
# The project itself, editable as in CI (a .pth naming /app: one copy of the code), without its dependencies again
# and with the venv's setuptools (torch's dependency): no download, so a change of code rebuilds offline.
RUN pip install --no-cache-dir --no-deps --no-build-isolation -e . && rm -rf ./*.egg-info

# The user `trainer` (uid 1000) owns /app; the working folder and the two mount points also take any other uid's
# files (mode 1777, as /tmp), so that `docker run --user "$(id -u):$(id -g)"` runs too: a run first checks that it
# can write into its root folder, /app.
RUN useradd --create-home --uid 1000 trainer && mkdir -p /app/data /app/lightning_logs \
    && chown -R trainer:trainer /app && chmod 1777 /app /app/data /app/lightning_logs
USER trainer
ENV PIP_NO_CACHE_DIR=1
VOLUME ["/app/data", "/app/lightning_logs"]

ENTRYPOINT ["python", "cli.py"]
CMD ["fit", "--config", "configs/quickstart.yaml"]
