"""Sans-I/O sessions: everything that decides, with no sockets, threads or clock.

``ReceiverSession`` and ``SenderSession`` take an event (a decoded message, a
completion, a tick) with ``now`` (monotonic milliseconds) and return a list of
actions for their shell to carry out: messages to send, puts to post, metrics
to count, lines to log. The daemons (``pdpush.receiver``, ``pdpush.sender``)
are the shells. Imports no zmq, UCX or torch.
"""

from __future__ import annotations

import logging
import traceback
from dataclasses import dataclass, field

from pdpush.errors import InternalError, PdpushError


@dataclass(frozen=True)
class Count:
    """Add ``n`` to the counter metric ``name`` (with ``label`` where it has one)."""

    name: str
    n: float = 1
    label: str | None = None


@dataclass(frozen=True)
class Observe:
    """One sample of the histogram metric ``name``, in seconds."""

    name: str
    seconds: float


@dataclass(frozen=True)
class Log:
    level: int
    message: str
    req_id: str | None = None
    exc_text: str | None = None


@dataclass
class Counters:
    """Counters a session keeps for ``status`` (plain ints; the shell mirrors them in Prometheus)."""

    values: dict[str, int] = field(default_factory=dict)

    def add(self, name: str, n: int = 1) -> None:
        self.values[name] = self.values.get(name, 0) + n

    def count(self, out: list, name: str, n: int = 1, metric: str | None = None, label: str | None = None) -> None:
        """Count one event once: its status counter ``name``, and the metric it feeds (a ``Count`` in ``out``)."""
        self.add(name, n)
        if metric is not None:
            out.append(Count(metric, n, label))


def internal_error(what: str, exc: BaseException, req_id: str | None) -> tuple[InternalError, Log]:
    """An unexpected exception while handling one event: a typed error for the request, a traceback for the log."""
    err = InternalError(f"internal error while handling {what}: {type(exc).__name__}: {exc}", req_id=req_id)
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return err, Log(logging.ERROR, f"internal error while handling {what}", req_id, text)


__all__ = ["Count", "Observe", "Log", "Counters", "internal_error", "PdpushError"]
