# GPU image for the template. Build and run (see the README's Docker section):
#   docker build -t fashion-resnet .
#   docker run --gpus all --shm-size=8g -v "$PWD/data:/app/data" -v "$PWD/lightning_logs:/app/lightning_logs" \
#       fashion-resnet fit --trainer.strategy=ddp --trainer.devices=4
# The base image is pinned to an exact tag; it brings a CUDA build of torch and torchvision, which pip keeps when
# they satisfy setup.cfg (torchvision>=0.20 pairs with this torch 2.5.1), and replaces otherwise.
FROM pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

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
