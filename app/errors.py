"""How a run ends other than by finishing: bad user input (:class:`UserError`, one line and exit code 2) and the
planned stops (:class:`Preempted` by a signal, :class:`Diverged` on a non-finite loss), and the template's
warnings, shown as ``warning: ...`` lines."""

from __future__ import annotations

import warnings


class UserError(ValueError):
    """Bad input from the user. The message names the flag or file, and the fix."""

    latest: UserError | None = None  # jsonargparse turns an error raised while it builds a class into its own text

    def __init__(self, *args) -> None:
        super().__init__(*args)
        UserError.latest = self


class Preempted(SystemExit):
    """Raised on every rank after the preemption checkpoint (or at a second signal); exits with ``128 + signal``."""

    def __init__(self, signum: int, checkpointed: bool = True) -> None:
        super().__init__(128 + signum)
        self.signum, self.checkpointed = signum, checkpointed


class Diverged(SystemExit):
    """Raised on every rank when the loss stopped being finite; exits the process with code 1.

    On global rank 0 the exit code is the message, so Python prints it as the run's last line (after the progress
    bar and every other output are done) and exits 1; the other ranks exit 1 quietly.
    """

    def __init__(self, message: str, global_rank: int) -> None:
        super().__init__(f"error: {message}" if global_rank == 0 else 1)
        self.message = message


class TemplateWarning(UserWarning):
    """A warning of this template to its user. Python shows a warning as ``file:line: Category: message`` plus the
    source line that raised it; these show as ``warning: message`` (filter them like any UserWarning)."""


def install_warning_format() -> None:
    """Show :class:`TemplateWarning` as ``warning: message``; every other warning as before (Lightning's own format
    for its warnings included, which it installs the same way)."""
    previous = warnings.formatwarning
    if getattr(previous, "template_format", False):
        return

    def formatwarning(message, category, filename, lineno, line=None) -> str:
        if issubclass(category, TemplateWarning):
            return f"warning: {message}\n"
        return previous(message, category, filename, lineno, line)

    formatwarning.template_format = True
    warnings.formatwarning = formatwarning
