"""The pdpush exception taxonomy.

Every error that crosses a module boundary is one of these classes. The wire
code of an error is derived from its class (``type(err).code``), never passed
around separately; ``error_from_code`` is the one inverse, used where an
``Error`` message is received. Foreign exceptions (zmq, UCX, OSError,
pydantic) are mapped once, where the I/O call happens.

Imports nothing from pdpush.
"""

from __future__ import annotations

from enum import Enum


class ErrorCode(str, Enum):
    """Typed reasons carried on the wire in an ``Error`` message."""

    BAD_MESSAGE = "bad_message"  # undecodable or invalid frame
    UNEXPECTED = "unexpected"  # valid message, wrong state
    NO_SESSION = "no_session"  # a receiver has no session for the sender's connection: it must say Hello again
    INCOMPATIBLE_PEER = "incompatible_peer"  # version or layout mismatch
    FORBIDDEN = "forbidden"  # the peer's key may not do this (a reader's key pushing, say)
    POOL_EXHAUSTED = "pool_exhausted"
    TOO_LARGE = "too_large"  # request can never fit / over a cap
    UNKNOWN_REQUEST = "unknown_request"
    DUPLICATE_REQUEST = "duplicate_request"
    LEASE_EXPIRED = "lease_expired"
    ABORTED = "aborted"
    CHECKSUM_MISMATCH = "checksum_mismatch"
    TRANSFER_FAILED = "transfer_failed"
    TIMEOUT = "timeout"
    PEER_DEAD = "peer_dead"
    SHUTTING_DOWN = "shutting_down"
    INTERNAL = "internal"


class PdpushError(Exception):
    """Root of every pdpush error. ``code`` is a class attribute: the class is the reason."""

    code: ErrorCode = ErrorCode.INTERNAL

    def __init__(self, message: str, *, req_id: str | None = None, retry_after_ms: int | None = None) -> None:
        super().__init__(message)
        self.req_id = req_id  # the request it concerns, where there is one
        self.retry_after_ms = retry_after_ms  # a hint from the peer: try again after this long


class InternalError(PdpushError):
    """A bug on our side while handling one message or request; the daemon keeps serving."""

    code = ErrorCode.INTERNAL


class ConfigError(PdpushError):
    """Invalid configuration: raised at start-up, names the field."""


class ForeignUcx(ConfigError):
    """Another libucp than the one pdpush_native was built against is already in this process (an
    LD_PRELOAD, another library's UCX): two UCX instances in one process abort in the second one's
    constructor, or mix handles. Raised before pdpush loads UCX; names both libraries."""


# ---- protocol ----------------------------------------------------------------------------

class ProtocolError(PdpushError):
    code = ErrorCode.BAD_MESSAGE


class LocalProtocolError(ProtocolError):
    """We were asked to send something the protocol does not allow."""


class RemoteProtocolError(ProtocolError):
    """The peer sent something malformed (undecodable, invalid fields)."""


class FrameTooLarge(RemoteProtocolError):
    """A frame over the configured cap; refused before decoding."""

    code = ErrorCode.TOO_LARGE


class UnexpectedMessage(RemoteProtocolError):
    """A valid message that the request's or peer's state does not allow."""

    code = ErrorCode.UNEXPECTED


class NoSession(UnexpectedMessage):
    """A receiver has no session for the connection a sender's message came on: none was made (no Hello), it was
    forgotten (the least recently heard of ``MAX_SESSIONS``), or the connection is another since (ZeroMQ made it
    again after it broke, and the receiver knows it by another routing id). The sender says Hello again."""

    code = ErrorCode.NO_SESSION


class UnknownRequest(RemoteProtocolError):
    code = ErrorCode.UNKNOWN_REQUEST


class DuplicateRequest(RemoteProtocolError):
    code = ErrorCode.DUPLICATE_REQUEST


class IncompatiblePeer(ProtocolError):
    """Version or layout mismatch between the two sides."""

    code = ErrorCode.INCOMPATIBLE_PEER


# ---- transport ---------------------------------------------------------------------------

class Forbidden(ProtocolError):
    """The authenticated peer's role does not allow the message (a router's reader key sending Hello)."""

    code = ErrorCode.FORBIDDEN


class TransportError(PdpushError):
    code = ErrorCode.TRANSFER_FAILED


class TransferError(TransportError):
    """A put, flush or send failed."""

    code = ErrorCode.TRANSFER_FAILED


class ConnectError(TransportError):
    """The peer could not be reached."""

    code = ErrorCode.PEER_DEAD


class TransportTimeout(TransportError):
    """An operation or reply did not complete before its deadline."""

    code = ErrorCode.TIMEOUT


class ChecksumMismatch(TransportError):
    """The bytes that landed are not the bytes that were sent."""

    code = ErrorCode.CHECKSUM_MISMATCH


# ---- resources and request outcomes ------------------------------------------------------

class ResourceError(PdpushError):
    pass


class PoolExhausted(ResourceError):
    code = ErrorCode.POOL_EXHAUSTED


class RequestTooLarge(ResourceError):
    code = ErrorCode.TOO_LARGE


class BrokenResourceError(ResourceError):
    """The peer or the network broke it; ``__cause__`` says how."""

    code = ErrorCode.PEER_DEAD


class ShuttingDown(ResourceError):
    """The daemon is draining and takes no new work."""

    code = ErrorCode.SHUTTING_DOWN


class RequestFailed(PdpushError):
    """A request ended without delivering."""


class LeaseExpired(RequestFailed):
    code = ErrorCode.LEASE_EXPIRED


class Aborted(RequestFailed):
    code = ErrorCode.ABORTED


class HandOverTimeout(TransportTimeout):
    """A layer's device-to-host copy did not complete in time: the request is given up, never
    handed over half-copied (integrations/device_copy.py). Raised in the engine, not sent."""


# The one class built for each wire code (every code has exactly one).
_BY_CODE: dict[ErrorCode, type[PdpushError]] = {
    ErrorCode.BAD_MESSAGE: RemoteProtocolError,
    ErrorCode.UNEXPECTED: UnexpectedMessage,
    ErrorCode.NO_SESSION: NoSession,
    ErrorCode.INCOMPATIBLE_PEER: IncompatiblePeer,
    ErrorCode.FORBIDDEN: Forbidden,
    ErrorCode.POOL_EXHAUSTED: PoolExhausted,
    ErrorCode.TOO_LARGE: RequestTooLarge,
    ErrorCode.UNKNOWN_REQUEST: UnknownRequest,
    ErrorCode.DUPLICATE_REQUEST: DuplicateRequest,
    ErrorCode.LEASE_EXPIRED: LeaseExpired,
    ErrorCode.ABORTED: Aborted,
    ErrorCode.CHECKSUM_MISMATCH: ChecksumMismatch,
    ErrorCode.TRANSFER_FAILED: TransferError,
    ErrorCode.TIMEOUT: TransportTimeout,
    ErrorCode.PEER_DEAD: BrokenResourceError,
    ErrorCode.SHUTTING_DOWN: ShuttingDown,
    ErrorCode.INTERNAL: InternalError,
}


def error_class(code: ErrorCode) -> type[PdpushError]:
    return _BY_CODE[code]


def error_from_code(code: ErrorCode, message: str, req_id: str | None = None,
                    retry_after_ms: int | None = None) -> PdpushError:
    """Build the local exception for a typed error received on the wire."""
    return _BY_CODE[code](message, req_id=req_id, retry_after_ms=retry_after_ms)
