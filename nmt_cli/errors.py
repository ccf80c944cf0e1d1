"""The one error type the CLI turns into a one-line message and exit code 2."""


class NmtError(Exception):
    """A problem with the user's input: printed as one line, exit code 2, no traceback."""
