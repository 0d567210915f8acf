"""The example task: d2l's ResNet on Fashion-MNIST. This package is what a fork replaces (docs/fork.md); nothing
else under ``app/`` imports it (``cli.py`` names its two classes as the default task, by class path).

``PRIVATE_USES`` lists the private names of torch and torchvision that the task itself uses, in the form of
app/lightning_internals.py's list (tests/test_lightning_internals.py holds the task's code to it); it is plain data,
read from the syntax tree, so this package stays free of imports."""

# (file, private name) -> (where the name lives: "module:Class" or "module", why no public API serves)
PRIVATE_USES: dict[tuple[str, str], tuple[str, str]] = {
    # torchvision's ResNet builds its stages with _make_layer; resnet_tiny builds narrower ones the same way.
    ("app/fashion_mnist/networks.py", "_make_layer"): (
        "torchvision.models.resnet:ResNet",
        "a stage as ResNet builds it",
    ),
}
