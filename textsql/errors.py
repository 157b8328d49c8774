"""The one exception type for mistakes a user can fix; the CLI prints it as a paragraph, not a traceback."""


class TextsqlError(Exception):
    """A problem with the user's input or environment, with the fix in the message."""
