"""The one exception type for bad user input (``cli.py`` prints it as a single line and exits with code 2), and the
template's warnings, shown as ``warning: ...`` lines."""

from __future__ import annotations

import warnings


class UserError(ValueError):
    """Bad input from the user. The message names the flag or file, and the fix."""

    latest: UserError | None = None  # jsonargparse turns an error raised while it builds a class into its own text

    def __init__(self, *args) -> None:
        super().__init__(*args)
        UserError.latest = self


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
