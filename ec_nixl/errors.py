"""Exceptions of the ec-nixl core.

Every failure a caller can act on has its own class, and every message names the item, the
peer and the limit involved, so that the vLLM adapter can turn it into a request-level error
without parsing strings. ``retryable`` says whether trying the same thing later may succeed.
"""

from __future__ import annotations


class ECNixlError(Exception):
    """Base class of every error raised by ec-nixl."""

    retryable = False


class ConfigError(ECNixlError, ValueError):
    """A configuration value is missing, of the wrong type, or out of range."""


class PoolError(ECNixlError):
    """The registered pool cannot satisfy a request."""


class ItemTooLarge(PoolError):
    """The item is larger than the whole pool: it can never fit, whatever is freed."""


class PoolExhausted(PoolError):
    """Not enough free space right now; it may fit once leases end."""

    retryable = True


class ProtocolError(ECNixlError):
    """A control message or item description is malformed or violates the protocol."""


class IncompatiblePeer(ECNixlError):
    """The peer runs another protocol version, model, dtype, width or block size."""


class Unauthorized(ECNixlError):
    """The peer did not prove it holds the shared secret, or skipped the handshake."""


class UnknownPeer(ECNixlError):
    """An item names a producer this endpoint cannot reach or has no session with."""


class TransferFailed(ECNixlError):
    """A NIXL transfer reported an error, or the peer refused or lost the item."""

    def __init__(self, message: str, *, reason: str = "ERROR", retryable: bool = False):
        super().__init__(message)
        self.reason = reason
        self.retryable = retryable


class LoadFailed(ECNixlError):
    """The load barrier could not hand over every item of a step.

    ``failures`` maps each failed mm_hash to a human-readable reason. Items not listed landed,
    but the barrier hands over nothing when any item failed: partial data never reaches the
    caller.
    """

    def __init__(self, failures: dict[str, str]):
        self.failures = dict(failures)
        detail = "; ".join(f"{h}: {r}" for h, r in sorted(self.failures.items()))
        super().__init__(f"{len(self.failures)} item(s) failed to load: {detail}")
