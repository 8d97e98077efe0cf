"""One exception type for every user-facing problem.

Anything raised as `SpecloomError` is a bad input or an impossible setting: the CLI prints its message on one
line and exits non-zero, without a traceback. Any other exception is a bug in specloom.
"""


class SpecloomError(Exception):
    """A problem the user can fix: the message names it and, where possible, the fix."""


class DrafterMismatch(SpecloomError):
    """The drafter was made for another model (another architecture, width or vocabulary): refused from its config
    alone, before any weights load. `specloom doctor` reports it as the verdict "mismatch"."""
