"""The example task: d2l's ResNet on Fashion-MNIST. This package is what a fork replaces (docs/fork.md); nothing
else under ``app/`` imports it (``cli.py`` names its two classes as the default task, by class path)."""
