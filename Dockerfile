# GPU image for the template. Build and run (see the README's Docker section):
#   docker build -t fashion-resnet .
#   docker run --gpus all --shm-size=8g -v "$PWD/data:/app/data" -v "$PWD/lightning_logs:/app/lightning_logs" \
#       fashion-resnet fit --trainer.strategy=ddp --trainer.devices=4
# The base is a plain Python pinned to an exact tag, and torch comes from PyPI exactly as CI installs it (its CUDA
# wheels carry their own CUDA libraries; `--gpus all` brings the driver): the image runs the versions the test suite
# proves, not an older torch of a pytorch/pytorch tag. gcc/g++: torch.compile (inductor, Triton) needs a C compiler.
# dataset-fashion-mnist: the real Fashion-MNIST (30 MB) in /usr/share/datasets/fashion-mnist, where --data.source=auto
# finds it: the image trains on the real data with no download and no data volume.
FROM python:3.11.7-slim-bookworm

RUN apt-get update && apt-get install -y --no-install-recommends gcc g++ libc6-dev dataset-fashion-mnist \
    && rm -rf /var/lib/apt/lists/*

# Caches in /tmp: under `docker run --user "$(id -u):$(id -g)"` the uid has no passwd entry and no home, where
# inductor's default cache folder (named by getpass.getuser()) fails.
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/tmp \
    TORCHINDUCTOR_CACHE_DIR=/tmp/torchinductor \
    TRITON_CACHE_DIR=/tmp/triton \
    MPLCONFIGDIR=/tmp/matplotlib

WORKDIR /app
COPY setup.cfg pyproject.toml README.md ./
COPY app ./app
COPY cli.py ./
COPY configs ./configs
COPY bench ./bench
COPY examples ./examples
# The requirement set CI installs (setup.cfg's install_requires and the runtime extras of its `dev` extra):
# mpi brings mpi4py and Open MPI (mpirun) for the horovod strategy; tensorboard and plot for the run's pictures.
RUN python -m pip install ".[mpi,tensorboard,plot]"

RUN useradd --create-home --uid 1000 trainer && mkdir -p /app/data /app/lightning_logs \
    && chown -R trainer:trainer /app
USER trainer
VOLUME ["/app/data", "/app/lightning_logs"]

ENTRYPOINT ["python", "cli.py"]
CMD ["fit", "--config", "configs/quickstart.yaml"]
