"""The one exception type user-facing failures travel in, with the exit code the command should end with."""
from __future__ import annotations


class ProduceError(Exception):
    """A user-facing failure: exit code 1 for runtime errors, 2 for usage or input errors."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def input_error(message: str) -> ProduceError:
    return ProduceError(message, 2)
