"""The hand-over ring: an engine tells its sender which layers are in staging without a message.

docs/layout.md, "The hand-over ring". Each engine connection gets a ring of ``slots`` u64 words in the
sender's staging metadata (``BeginOk.ring_offset``), and the sender has one idle word for all of them
(``BeginOk.idle_offset``). A record is one word:

    bit 63 set | (layers - 1) << 46 | first layer << 32 | request handle (BeginOk.handle)

for the layers ``[first, first + layers)`` of one request, or, with bit 62 set (``FINISH``) and no layers,

    bit 63 | bit 62 | request handle

the engine's Finish of that request, after its layers' records (where ``BeginOk.ring_finish`` says the
sender takes it: the session decides it as it would the message). The engine stores it with a compare-and-swap
of a free slot (0) to the record, so it never overwrites one the sender has not taken; the sender
(native ``Ring.take``) takes records in order and writes 0 back. One aligned 8-byte word is never seen
half written. The CAS is a full barrier, so the staged bytes are visible before the record, and the
idle word is read after it: the sender sets that word and fences before it looks at the rings a last
time and sleeps, so either it sees the record or the engine sees it idle and wakes it (``Wake``).

The engine's side is here: CAS and fence through pdpush's native module (``pdpush_native._copy``:
``ring_push``, ``load_word``), or, in an engine's venv without it, through libatomic (ctypes: ~1.5 us a call
where the native one is ~0.2, and in a busy engine, its caches cold from the forward, ~15 us a hand-over).
Without either the engine sends ``LayerReady`` messages, as it does to a sender that offers no ring.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading

log = logging.getLogger("pdpush.ring")

VALID = 1 << 63
FINISH = 1 << 62
MAX_LAYERS = 1 << 14  # per record; first layer < MAX_LAYERS too
_SEQ_CST = 5


def encode(handle: int, first: int, layers: int) -> int:
    if not (0 <= handle < 1 << 32 and 0 <= first < MAX_LAYERS and 1 <= layers <= MAX_LAYERS):
        raise ValueError(f"no ring record for handle {handle}, layers [{first}, {first + layers})")
    return VALID | (layers - 1) << 46 | first << 32 | handle


def encode_finish(handle: int) -> int:
    if not 0 <= handle < 1 << 32:
        raise ValueError(f"no ring record for handle {handle}")
    return VALID | FINISH | handle


def decode(rec: int) -> tuple[int, int, int]:
    """(handle, first layer, layers), (handle, 0, 0) for a finish record: what the sender's ``Ring.take``
    returns for ``rec``."""
    if rec & FINISH:
        return rec & 0xFFFFFFFF, 0, 0
    return rec & 0xFFFFFFFF, (rec >> 32) & 0x3FFF, ((rec >> 46) & 0x3FFF) + 1


def runs(layers: list[int]) -> list[tuple[int, int]]:
    """``layers`` as (first, count) runs of consecutive layers, in the order given."""
    out: list[list[int]] = []
    for la in layers:
        if out and la == out[-1][0] + out[-1][1] and out[-1][1] < MAX_LAYERS:
            out[-1][1] += 1
        else:
            out.append([la, 1])
    return [(a, n) for a, n in out]


_lib: ctypes.CDLL | None | bool = False


def _atomics() -> ctypes.CDLL | None:
    global _lib
    if _lib is False:
        name = ctypes.util.find_library("atomic")
        try:
            lib = ctypes.CDLL(name or "libatomic.so.1")
            lib.__atomic_compare_exchange_8.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64,
                                                        ctypes.c_int, ctypes.c_int]
            lib.__atomic_compare_exchange_8.restype = ctypes.c_bool
            lib.__atomic_load_8.argtypes = [ctypes.c_void_p, ctypes.c_int]
            lib.__atomic_load_8.restype = ctypes.c_uint64
            _lib = lib
        except OSError:
            log.warning("libatomic not found: layers are handed over by message (install libatomic1)")
            _lib = None
    return _lib


def _native():
    """pdpush_native._copy where it has the ring's functions, else None (an older build, or none)."""
    global _nat
    if _nat is False:
        try:
            from pdpush_native import _copy
        except ImportError:
            _copy = None
        _nat = _copy if hasattr(_copy, "ring_push") else None
    return _nat


_nat = False


def available() -> bool:
    return _native() is not None or _atomics() is not None


class RingWriter:
    """An engine's side of one ring: ``push`` stores records into free slots, in order. Thread-safe:
    an engine's owner thread and its copy-completion thread both hand layers over."""

    def __init__(self, address: int, slots: int, idle_address: int, native: bool = True) -> None:
        self._nat = _native() if native else None
        if self._nat is None:
            lib = _atomics()
            if lib is None:
                raise RuntimeError("no libatomic")
            self._cas = getattr(lib, "__atomic_compare_exchange_8")  # noqa: B009 - a class body would mangle the name
            self._load = getattr(lib, "__atomic_load_8")  # noqa: B009
        self.address, self.slots, self.idle_address = address, slots, idle_address
        self._head = 0
        self.closed = False
        self._expected = ctypes.c_uint64(0)
        self._lock = threading.Lock()

    def push(self, records: list[int]) -> int:
        """Store as many of ``records`` as there are free slots, in order; how many were stored."""
        with self._lock:
            n = 0
            if self.closed:
                return 0
            if self._nat is not None:
                n = self._nat.ring_push(self.address, self.slots, self._head, records)
                self._head += n
                return n
            for rec in records:
                self._expected.value = 0
                if not self._cas(self.address + (self._head % self.slots) * 8, ctypes.byref(self._expected),
                                 rec, _SEQ_CST, _SEQ_CST):
                    break  # that slot still holds a record the sender has not taken: the ring is full
                self._head += 1
                n += 1
            return n

    def sender_idle(self) -> bool:
        """Whether the sender said it sleeps: a sequentially consistent load after a ``push``'s CAS, so
        that on any CPU either this sees the sender's idle word or the sender sees the record."""
        if self._nat is not None:
            return bool(self._nat.load_word(self.idle_address))
        return bool(self._load(self.idle_address, _SEQ_CST))

    def close(self) -> None:
        """Write nothing more (the connection closes: the sender may give this ring to another)."""
        with self._lock:
            self.closed = True
