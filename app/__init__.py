"""ResNet / Fashion-MNIST training template on PyTorch Lightning, with dp, ddp, ddp_spawn and horovod strategies."""

__version__ = "0.1.0"

import app.errors  # noqa: E402
import app.process_group  # noqa: E402
import app.quiet  # noqa: E402

app.quiet.install()
app.errors.install_warning_format()  # the template's warnings read "warning: ...", like its "error: ..." lines
app.process_group.install()  # no rank ends in SIGABRT at exit (see the module)

import app.strategies  # noqa: E402, F401  (registers "dp" and "horovod" in Lightning's StrategyRegistry)
