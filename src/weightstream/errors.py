"""User-facing errors: each message names the input, what is wrong, and what to do."""


class WeightstreamError(Exception):
    """A problem with the user's input or environment; the CLI prints it as one line and exits 2."""
