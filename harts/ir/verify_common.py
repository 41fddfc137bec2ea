"""What every phase verifier shares."""

from __future__ import annotations

from typing import NoReturn

from harts.errors import IRVerificationError


def fail(message: str) -> NoReturn:
    """Report a broken invariant (messages name the microbatch, round, trajectory or node at fault)."""
    raise IRVerificationError(message)
