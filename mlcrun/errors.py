"""The one exception type users see: its message is a complete, one-line explanation."""


class MlcrunError(Exception):
    """A problem with user input or an artifact, reported without a traceback."""
