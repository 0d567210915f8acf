"""A training template on PyTorch Lightning for any task, with dp, ddp, ddp_spawn and horovod strategies.

Importing it, or any module under it, only defines: the program's entry (``cli.py``'s ``main``, or
``app.run.defaults.trainer_defaults`` from Python) installs what a run needs (:mod:`app.launch.startup`) and registers
the strategies' names (:func:`app.strategies.register`).
"""

__version__ = "0.1.0"
