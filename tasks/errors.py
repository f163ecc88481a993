"""Typed errors shared by the pure tasks."""
from __future__ import annotations


class TokenCaptureError(ValueError):
    """Base class: bad input named precisely enough to fix it."""


class InvalidRecord(TokenCaptureError):
    """A staged record failed validation; ``reason`` is a SPEC section 4 vocabulary word."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class InvalidKey(TokenCaptureError):
    """An id or key that cannot be used to derive a staging or cut key."""
