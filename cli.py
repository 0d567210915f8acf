"""Train a ResNet on Fashion-MNIST with the device strategy of your choice.

python cli.py fit --config configs/quickstart.yaml                       # a minute on a laptop CPU
python cli.py fit --trainer.strategy=ddp --trainer.devices=4               # one process per GPU
python cli.py fit --trainer.strategy=dp --trainer.devices=4                # one process, DataParallel
mpirun -np 4 python cli.py fit --trainer.strategy=horovod                 # Horovod programming model
python cli.py test --ckpt_path lightning_logs/version_0/checkpoints/last.ckpt
python cli.py fit --model=mypkg.MyModel --data=mypkg.MyData        # any task by class path (docs/fork.md)
python cli.py --help
"""

# The task a run trains when the command line names no class, and its own subcommands beside Lightning's and plot
# (name: its module, which has a main(argv), and what --help says of it). A fork that makes its own task the default
# changes these; nothing under app/ changes.
MODEL = "app.fashion_mnist.model.ImageClassifier"
DATA = "app.fashion_mnist.data.FashionMNISTDataModule"
TOOLS = {
    "export": (
        "app.fashion_mnist.export",
        "'cli.py export --ckpt_path CKPT --out model.pt2' writes the trained network for inference",
    ),
    "shards": (
        "app.fashion_mnist.shards",
        "'cli.py shards --out DIR' writes the training images as tar shards to stream from",
    ),
}

if __name__ == "__main__":
    from app.launch.startup import catch_slurms_warning, check_torchvision

    catch_slurms_warning()  # SLURM's time-limit warning while this still imports: acted on once training runs
    check_torchvision()  # a torch/torchvision mismatch in one line, before app.run.cli imports Lightning
    from app.run.cli import main

    main(model=MODEL, data=DATA, tools=TOOLS)
