"""The one exception type users see: its message is a complete, one-line explanation."""


class MlcrunError(ValueError):
    """A problem with user input or an artifact, reported without a traceback.

    A ValueError, so that callers validating input (the HTTP edge, argument parsers) can treat
    it as one.
    """
