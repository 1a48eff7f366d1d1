"""One exception type for everything a user can fix.

Every message says what was wrong, the offending value, and what to do, in one
line, so the CLI can print it as is and exit non-zero.
"""

from __future__ import annotations


class LcxError(Exception):
    """A problem the user can fix; the message names the value and the fix."""

    exit_code: int = 2


class ConflictError(LcxError):
    """Two selected methods claim the same exclusive stage."""


class UnsupportedModelError(LcxError):
    """The model family lacks something a method needs."""
