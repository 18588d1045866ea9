"""The passive side of a one-sided transfer: a region allocated as the receiver's pool is, behind a listener.

``python -m pdpush_tools.peer NBYTES`` prints one JSON line (port, address, rkey, shmid, pid) and serves
until its stdin closes. The transport conformance tests put into it and read the bytes back through
its SysV segment; the benches' raw put reference (``bench/ceiling.py``) measures against it.
``put_and_wait`` is the blocking put+flush those references use; the daemons never wait.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence


def serve(nbytes: int) -> None:
    from pdpush.transport.auto import open_transport

    w = open_transport()
    peers = []
    port = w.listen("127.0.0.1", 0, peers.append)
    region, shmid, _ = w.alloc_shared(nbytes)  # the same memory the receiver's pool uses
    print(json.dumps({"port": port, "address": region.address, "rkey": region.pack_rkey().hex(), "shmid": shmid,
                      "pid": os.getpid()}), flush=True)
    os.set_blocking(sys.stdin.fileno(), False)
    while True:
        w.progress()
        try:
            if sys.stdin.buffer.read() == b"":
                break
        except (BlockingIOError, TypeError):
            pass
        time.sleep(0.0005)  # passive side: one-sided puts need no receiver work beyond progress
    region.close()


def put_and_wait(worker, ep, ops: Sequence, timeout_s: float) -> int:
    """Post ``ops`` and one flush on ``ep`` (the only endpoint of ``worker`` in flight), then wait for them.
    Returns the puts posted; raises the batch's TransferError or TransportTimeout."""
    token = object()
    n = ep.post_puts(list(ops), token, time.monotonic() + timeout_s)
    while True:
        for c in worker.poll(time.monotonic()):
            if c.token is not token:
                raise RuntimeError("put_and_wait: another endpoint's batch completed; use one endpoint")
            if c.error is not None:
                raise c.error
            return n


if __name__ == "__main__":
    serve(int(sys.argv[1]))
