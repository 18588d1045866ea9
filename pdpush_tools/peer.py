"""The passive side of a one-sided transfer: a region allocated as the receiver's pool is, behind a listener.

``python -m pdpush_tools.peer NBYTES [HOST]`` (HOST: the address to listen on, 127.0.0.1 by default) prints one JSON line (port, address, rkey, shmid, pid) and serves
until its stdin closes. The transport conformance tests put into it and read the bytes back through
its SysV segment; the benches' raw put reference (``bench/ceiling.py``) measures against it.
``put_and_wait`` is the blocking put+flush those references use; the daemons never wait.
"""

from __future__ import annotations

import json
import os
import select
import sys
import time
from collections.abc import Sequence


def serve(nbytes: int, host: str = "127.0.0.1") -> None:
    from pdpush.transport.auto import open_transport

    w = open_transport()
    peers = []
    port = w.listen(host, 0, peers.append)
    region, shmid, _ = w.alloc_shared(nbytes)  # the same memory the receiver's pool uses
    print(json.dumps({"port": port, "address": region.address, "rkey": region.pack_rkey().hex(), "shmid": shmid,
                      "pid": os.getpid()}), flush=True)
    while True:  # progress whenever UCX has events (as the receiver's loop does), until stdin closes
        w.progress()
        ready, _, _ = select.select([sys.stdin, w.epoll_fd], [], [], 0.5 if w.arm() else 0)
        if sys.stdin in ready and os.read(sys.stdin.fileno(), 4096) == b"":
            break
    region.close()


def put_and_wait(worker, ep, ops: Sequence, timeout_s: float, spin_s: float | None = None) -> int:
    """Post ``ops`` and one flush on ``ep`` (the only endpoint of ``worker`` in flight), then wait for them.
    Returns the puts posted; raises the batch's TransferError or TransportTimeout. ``spin_s``: progress in a
    loop that long, then sleep on the worker's events between passes, as the sender does after a post (None:
    spin throughout, the fastest on a host with a core to spare; where the hosts share two cores, a spinning
    reference takes the core that moves its bytes, which the sender's wait does not)."""
    token = object()
    n = ep.post_puts(list(ops), token, time.monotonic() + timeout_s)
    # from when the post returns: on shared memory the puts are the copy itself, done in post_puts (as the sender's)
    spin_until = None if spin_s is None else time.monotonic() + spin_s
    while True:
        now = time.monotonic()
        for c in worker.poll(now):
            if c.token is not token:
                raise RuntimeError("put_and_wait: another endpoint's batch completed; use one endpoint")
            if c.error is not None:
                raise c.error
            return n
        if spin_until is not None and now > spin_until and worker.arm():
            select.select([worker.epoll_fd], [], [], 0.001)  # the batch's own deadline ends a wait that never wakes


if __name__ == "__main__":
    serve(int(sys.argv[1]), *sys.argv[2:3])
