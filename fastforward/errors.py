"""One exception type for every user-facing mistake, so the CLI can print it without a traceback."""


class FastForwardError(Exception):
    """Bad input or an unusable model: the message says what is wrong and what to do."""
