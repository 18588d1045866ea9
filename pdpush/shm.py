"""Shared-memory regions: find the SysV segment behind a UCX allocation, attach it.

UCX allocates the pool (``ucp_mem_map`` + ALLOCATE, SysV by default). The
segment is IPC_PRIVATE and already marked for removal, so nothing leaks on any
crash; another process of the same uid can still ``shmat`` it by shmid while
anyone is attached. The shmid is the inode column of the owner's
``/proc/self/maps`` line for the region (notes/ucx.md).

Imports numpy and ctypes only. An engine that copies to or from a GPU pins its own
mapping with cudaHostRegister (``Attached.pin``) where torch reports CUDA; otherwise
the mapping stays plain host memory, and torch is not imported without an NVIDIA driver.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading

import numpy as np

from pdpush.errors import ResourceError

log = logging.getLogger("pdpush.shm")

_libc = ctypes.CDLL(None, use_errno=True)
_libc.shmat.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
_libc.shmat.restype = ctypes.c_void_p
_libc.shmdt.argtypes = [ctypes.c_void_p]
_libc.shmdt.restype = ctypes.c_int
_libc.shmget.argtypes = [ctypes.c_int, ctypes.c_size_t, ctypes.c_int]
_libc.shmget.restype = ctypes.c_int
_libc.shmctl.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
_libc.shmctl.restype = ctypes.c_int
_IPC_PRIVATE, _IPC_CREAT, _IPC_RMID = 0, 0o1000, 0
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.restype = ctypes.c_int
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_libc.mincore.restype = ctypes.c_int
_MADV_POPULATE_READ = 22  # Linux 5.14
_MADV_POPULATE_WRITE = 23  # Linux 5.14
_SHM_RDONLY = 0o10000
_CUDA_HOST_REGISTER_READ_ONLY = 0x08  # cudaHostRegisterReadOnly (CUDA 11.1)
_PAGE = 4096


def shmid_of(address: int) -> int:
    """The SysV shmid backing ``address`` in this process, from /proc/self/maps."""
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= address < hi:
                if len(parts) >= 6 and parts[5].startswith("/SYSV"):
                    return int(parts[4])
                raise ResourceError(
                    f"region at {address:#x} is not SysV shared memory ({' '.join(parts[5:]) or 'anonymous'}); "
                    "set UCX_ALLOC_PRIO=md:sysv")
    raise ResourceError(f"address {address:#x} is not mapped")


class Attached:
    """A SysV segment attached in this process, exposed as a numpy uint8 array; ``readonly``: attached so that
    this process cannot write it (a decode engine's view of a receiver's pool: the receiver commits requests on
    readiness words in it, and readers of every request share its chunks)."""

    def __init__(self, shmid: int, nbytes: int, readonly: bool = False) -> None:
        self.readonly = readonly
        addr = _libc.shmat(shmid, None, _SHM_RDONLY if readonly else 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            err = ctypes.get_errno()
            raise ResourceError(f"shmat({shmid}) failed: errno {err}; is the owning daemon alive "
                                "and running as the same user?")
        # the size its daemon says is at most the segment's (the mapping's, page-rounded): views and native copies
        # past it would fault in this process, not raise
        m = mapping_of(addr)
        if m is None or nbytes > m[1] - addr:
            _libc.shmdt(ctypes.c_void_p(addr))
            raise ResourceError(f"shared memory {shmid} said to hold {nbytes} bytes maps {m[1] - addr if m else 0}: its daemon "
                                "and this client disagree (another pdpush version?)")
        self.address: int = addr
        self.nbytes = nbytes
        self.array = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(addr))

        self.pinned = False
        self._populating: Populating | None = None

    def populate_async(self) -> None:
        """Map what the owning daemon has in memory of the segment into this process on a thread (``populate``),
        so this process's first touch of each page (an engine's copy into staging, or out of the pool) does not
        fault it in. ``close`` stops it first."""
        if self._populating is None and self.address:
            self._populating = Populating(self.address, self.nbytes, write=not self.readonly)

    def populated(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for ``populate_async`` to be done; whether it is (or never began)."""
        return self._populating is None or self._populating.wait(timeout_s)

    def pin(self) -> bool:
        """Page-lock this mapping for CUDA copies in this process (``pin_if_cuda``); True if it is."""
        if self.address and not self.pinned:
            self.pinned = pin_if_cuda(self.address, self.nbytes, self.readonly)
        return self.pinned

    def close(self) -> None:
        if self._populating is not None:  # before the mapping goes (within a piece of populate)
            self._populating.stop()
            self._populating = None
        if self.address:
            # views handed out (ctypes from_address) do not keep the mapping: shmdt unmaps it under them, and a
            # later read faults. Callers detach only once nothing reads the segment (client/connection.py's user counts;
            # the vLLM worker resets its receiver link only with no load holding pages)
            self.array = None
            if self.pinned:
                unpin_cuda(self.address)
                self.pinned = False
            _libc.shmdt(self.address)
            self.address = 0


def create_private(nbytes: int) -> tuple[int, int]:
    """A fresh IPC_PRIVATE SysV segment (mode 0600), attached here and already marked for removal,
    exactly like UCX's own sysv allocation: nothing leaks on a crash. Returns (shmid, address)."""
    shmid = _libc.shmget(_IPC_PRIVATE, nbytes, _IPC_CREAT | 0o600)
    if shmid < 0:
        raise ResourceError(f"shmget({nbytes}) failed: errno {ctypes.get_errno()} (check kernel.shmmax/shmall)")
    addr = _libc.shmat(shmid, None, 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        err = ctypes.get_errno()
        _libc.shmctl(shmid, _IPC_RMID, None)
        raise ResourceError(f"shmat({shmid}) failed: errno {err}")
    _libc.shmctl(shmid, _IPC_RMID, None)
    return shmid, addr


def detach(address: int) -> None:
    _libc.shmdt(address)


def array_at(address: int, nbytes: int) -> np.ndarray:
    """A numpy view over memory this process owns (e.g. a UCX allocation)."""
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(address))


def prefault(address: int, nbytes: int, step: int = 64 << 20, stop=None) -> None:
    """Fault every page of a fresh region in (only for memory nobody uses yet): allocated by the kernel
    without a byte written here (``populate``), or, where the kernel cannot (before Linux 5.14), by writing
    zeros. ``stop()``: looked at between pieces; once it says so, the rest is left (a daemon told to stop)."""
    if populate(address, nbytes, stop=stop, resident_only=False) >= nbytes:
        return
    a = array_at(address, nbytes)
    for off in range(0, nbytes, step):
        if stop is not None and stop():
            return
        a[off:off + step] = 0


def mapping_of(address: int) -> tuple[int, int, str] | None:
    """This process's mapping that holds ``address`` (/proc/self/maps): its start, its end and its path ("" for an
    anonymous one); None if none does."""
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(None, 5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= address < hi:
                return lo, hi, parts[5].strip() if len(parts) > 5 else ""
    return None


def populate(address: int, nbytes: int, stop=None, progress=None, step: int = 4 << 20,
             resident_only: bool = True, write: bool = True) -> int:
    """Map the pages of ``[address, address + nbytes)`` writable in this process's page tables, without
    reading or writing a byte (``madvise(MADV_POPULATE_WRITE)``, Linux 5.14 and later). For a region another
    process owns and this one writes into (the sender's mapping of a receiver's pool): otherwise each 4 KiB
    page costs a fault on this process's first write to it.

    Only what the owner has in memory already (``resident_only``, for another process's region): a piece
    with a page not resident (``mincore``: the owner did not prefault it) is left alone, so this process
    never allocates the owner's memory (nor is charged for it). Never past the mapping that holds ``address``. In ``step`` pieces (each holds this process's
    mmap lock for a millisecond or so), stopping before the next when ``stop()`` says so; ``progress(bytes)``
    after each. Returns the bytes populated."""
    m = mapping_of(address)
    if m is None:
        return 0
    end_map = m[1]
    end = min(-(-(address + nbytes) // _PAGE) * _PAGE, end_map)
    at = address // _PAGE * _PAGE
    vec = (ctypes.c_ubyte * (step // _PAGE))()
    done = 0
    while at < end and not (stop is not None and stop()):
        n = min(step, end - at)
        if resident_only and _libc.mincore(at, n, vec) != 0:
            log.info("cannot tell which pages at %#x are in memory: %s", at, os.strerror(ctypes.get_errno()))
            break
        if not resident_only or (np.frombuffer(vec, np.uint8, count=-(-n // _PAGE)) & 1).all():
            if _libc.madvise(at, n, _MADV_POPULATE_WRITE if write else _MADV_POPULATE_READ) != 0:
                log.info("cannot populate %d bytes at %#x: %s", n, at, os.strerror(ctypes.get_errno()))
                break
            done += n
            if progress is not None:
                progress(done)
        at += n
    return done


def populate_quietly(address: int, nbytes: int, stop=None, progress=None, write: bool = True) -> int:
    """``populate`` from a thread of its own at the lowest priority (nice 19, this thread only), so that the
    process's own work (an engine's forward, a daemon's loop) goes first."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except OSError:
        pass
    return populate(address, nbytes, stop, progress, write=write)


class Populating:
    """``populate_quietly`` on a thread of its own. ``stop()`` ends it before its next piece and waits for it:
    call it before the mapping goes."""

    def __init__(self, address: int, nbytes: int, progress=None, write: bool = True) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=populate_quietly, args=(address, nbytes, self._stop.is_set, progress,
                                                                       write), name="pdpush-populate", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()  # (within one piece of populate: a millisecond or so)

    def wait(self, timeout_s: float) -> bool:
        """Wait for it to be done, up to ``timeout_s``; whether it is."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()


def pin_if_cuda(address: int, nbytes: int, readonly: bool = False) -> bool:
    """Page-lock a host mapping for this process's CUDA copies (``cudaHostRegister``; ``readonly``: a mapping this
    process cannot write, registered read-only) where CUDA exists; False otherwise. Pinning is per process: the
    engine that copies pins its own mapping."""
    import os

    if not os.path.exists("/dev/nvidiactl"):  # no NVIDIA driver: do not pay for importing torch (~1 s)
        return False
    try:
        import torch
    except ImportError:
        return False
    if not torch.cuda.is_available():
        return False
    rc = torch.cuda.cudart().cudaHostRegister(address, nbytes, _CUDA_HOST_REGISTER_READ_ONLY if readonly else 0)
    if int(rc) != 0:
        cleared = _clear_cuda_error()
        log.warning("cudaHostRegister of %d bytes failed (%s); using pageable memory%s", nbytes, rc,
                    "" if cleared else " (its error could not be cleared: the next kernel launch may raise it)")
        return False
    return True


def _clear_cuda_error() -> bool:
    """Read (and so clear) this thread's last CUDA runtime error: a failed ``cudaHostRegister`` leaves it set, and
    PyTorch's check after its next kernel launch would raise it. Through the runtime library torch loaded (found by
    name, never loaded here); whether it was found."""
    import ctypes
    import os

    import torch

    major = (torch.version.cuda or "").split(".")[0]  # torch's own first: another library may have loaded another
    for name in ([f"libcudart.so.{major}"] if major else []) + ["libcudart.so.13", "libcudart.so.12", "libcudart.so"]:
        try:
            lib = ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        except OSError:
            continue
        lib.cudaGetLastError.restype = ctypes.c_int
        lib.cudaGetLastError()
        return True
    return False


def unpin_cuda(address: int) -> None:
    """Undo ``pin_if_cuda`` (before the mapping goes away)."""
    import torch

    rc = torch.cuda.cudart().cudaHostUnregister(address)
    if int(rc) != 0:
        log.warning("cudaHostUnregister(%#x) failed (%s)", address, rc)
