"""A stray write into a receiver's pool, for the negative controls (a corrupted page must change the decode).

A decode client maps the pool read-only, as a decode engine must: the receiver commits a push on readiness words in
the pool, and every reader shares its chunks. A test that corrupts the pool on purpose writes it through
``writable_pool``, in a second mapping of the pool that may write, as a stray write would.
"""

from __future__ import annotations

import contextlib

import numpy as np

from pdpush.client import DecodeClient


@contextlib.contextmanager
def writable_pool(dc: DecodeClient):
    """A function from a view ``dc`` handed out (numpy) to a writable view of the same bytes; the mappings it made
    go at the end of the ``with``."""
    from pdpush.shm import Attached

    writers: dict[int, tuple[object, Attached]] = {}

    def alias(view: np.ndarray) -> np.ndarray:
        at = view.__array_interface__["data"][0]
        shmid, seg = next((i, a) for i, a in dc._segments._segs.items() if a.address <= at < a.address + a.nbytes)
        if shmid not in writers:
            writers[shmid] = (seg, Attached(shmid, seg.nbytes))
        seg, w = writers[shmid]
        return np.ndarray(view.shape, view.dtype, buffer=w.array, offset=at - seg.address, strides=view.strides)

    try:
        yield alias
    finally:
        for _, w in writers.values():
            w.close()
