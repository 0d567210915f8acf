"""The one exception type for bad user input; ``cli.py`` prints it as a single line and exits with code 2."""


class UserError(ValueError):
    """Bad input from the user. The message names the flag or file, and the fix."""
