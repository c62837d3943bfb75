"""The one exception type for bad input: the command line prints its message as one line.

A `UserError` says what is wrong, where (file, field, rank) and what to do about it. It is for
problems a person can fix; bugs stay ordinary exceptions with a traceback.
"""

import sys


def warn(message: str) -> None:
    """One line on stderr for something that does not stop the command."""
    print(f"ddpgpt: warning: {message}", file=sys.stderr)


class UserError(Exception):
    """Bad input, reported as one line on stderr ("ddpgpt: <label>: ...") with exit code
    `exit_code`. `quiet` errors print nothing: another rank reports the same event."""

    exit_code = 2
    label = "error"

    def __init__(self, message: str = "", quiet: bool = False):
        super().__init__(message)
        self.quiet = quiet


class DataError(UserError):
    """A dataset directory or shard that is missing, malformed or inconsistent."""
