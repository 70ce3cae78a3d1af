"""The one exception type for bad input: the CLI prints it and exits non-zero."""


class UserError(Exception):
    """Bad input. The message names the file, the field and the fix."""
