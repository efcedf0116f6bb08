"""The exceptions user-facing failures travel in, each with the exit code ``produce`` ends with.

docs/cli.md ("Exit codes"): 1 runtime error (Redis unreachable, a dataset attached elsewhere, a server that does
not answer), 2 usage or input error (nothing written to Redis). The library raises these and never exits; the
command line shows the message and exits with the code in one place (producer/cli.py ``ProduceGroup``).
"""
from __future__ import annotations


class ProduceError(Exception):
    """A user-facing failure, shown as its message alone (no traceback). Exit code 1 (a runtime error) unless
    the class or the caller says otherwise."""

    exit_code: int = 1

    def __init__(self, message: str, exit_code: int | None = None) -> None:
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


class UsageError(ProduceError):
    """Bad options or input: exit 2, and nothing was written to Redis."""

    exit_code = 2
