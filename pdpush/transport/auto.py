"""The one factory the daemons and tools get a transport from: where the choice of data plane lives."""

from __future__ import annotations

from collections.abc import Mapping

from pdpush.transport.base import Transport


def open_transport(env: Mapping[str, str] | None = None) -> Transport:
    """The data plane: a UCX worker (``ucx.py``) over the one libucp ``ucx_lib`` chose, whose batches are posted
    and reaped natively (``pdpush_native``, native/). ``env``: UCX_* settings for it. Loads UCX, so only when
    called."""
    from pdpush.transport.ucx import UcxWorker

    return UcxWorker(env)
