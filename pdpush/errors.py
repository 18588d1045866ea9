"""The pdpush exception taxonomy.

Every error that crosses a module boundary is one of these. Foreign exceptions
(zmq, ucxx, OSError, pydantic) are mapped once, where the I/O call happens.
Imports nothing from pdpush.
"""

from __future__ import annotations

from enum import Enum


class ErrorCode(str, Enum):
    """Typed reasons carried on the wire in an ``Error`` message."""

    BAD_MESSAGE = "bad_message"  # undecodable or invalid frame
    UNEXPECTED = "unexpected"  # valid message, wrong state
    INCOMPATIBLE_PEER = "incompatible_peer"  # version or layout mismatch
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
    """Root of every pdpush error."""

    code: ErrorCode = ErrorCode.INTERNAL

    def __init__(self, message: str, *, code: ErrorCode | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code


class ConfigError(PdpushError):
    """Invalid configuration: raised at start-up, names the field."""


class ProtocolError(PdpushError):
    code = ErrorCode.BAD_MESSAGE


class LocalProtocolError(ProtocolError):
    """We were asked to send something the protocol does not allow."""


class RemoteProtocolError(ProtocolError):
    """The peer sent something malformed or unexpected, or replied with an Error."""


class IncompatiblePeer(ProtocolError):
    code = ErrorCode.INCOMPATIBLE_PEER


class TransportError(PdpushError):
    code = ErrorCode.TRANSFER_FAILED


class ConnectError(TransportError):
    code = ErrorCode.PEER_DEAD


class TransferError(TransportError):
    code = ErrorCode.TRANSFER_FAILED


class TransportTimeout(TransportError):
    code = ErrorCode.TIMEOUT


class ResourceError(PdpushError):
    pass


class PoolExhausted(ResourceError):
    code = ErrorCode.POOL_EXHAUSTED

    def __init__(self, message: str, *, retry_after_ms: int = 0) -> None:
        super().__init__(message)
        self.retry_after_ms = retry_after_ms


class RequestTooLarge(ResourceError):
    code = ErrorCode.TOO_LARGE


class ClosedResourceError(ResourceError):
    """We closed it ourselves."""


class BrokenResourceError(ResourceError):
    """The peer or the network broke it; ``__cause__`` says how."""

    code = ErrorCode.PEER_DEAD


class RequestFailed(PdpushError):
    """A request failed; ``code`` carries the typed reason the peer reported."""


_BY_CODE: dict[ErrorCode, type[PdpushError]] = {
    ErrorCode.BAD_MESSAGE: RemoteProtocolError,
    ErrorCode.UNEXPECTED: RemoteProtocolError,
    ErrorCode.INCOMPATIBLE_PEER: IncompatiblePeer,
    ErrorCode.POOL_EXHAUSTED: PoolExhausted,
    ErrorCode.TOO_LARGE: RequestTooLarge,
    ErrorCode.TIMEOUT: TransportTimeout,
    ErrorCode.PEER_DEAD: BrokenResourceError,
    ErrorCode.TRANSFER_FAILED: TransferError,
}


def error_from_code(code: ErrorCode, message: str) -> PdpushError:
    """Build the local exception for a typed error received on the wire."""
    cls = _BY_CODE.get(code, RequestFailed)
    if cls is PoolExhausted:
        return PoolExhausted(message)
    err = cls(message)
    err.code = code
    return err
