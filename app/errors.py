"""The one exception type for bad user input; ``cli.py`` prints it as a single line and exits with code 2."""


class UserError(ValueError):
    """Bad input from the user. The message names the flag or file, and the fix."""

    latest: "UserError | None" = None  # jsonargparse turns an error raised while it builds a class into its own text

    def __init__(self, *args) -> None:
        super().__init__(*args)
        UserError.latest = self
