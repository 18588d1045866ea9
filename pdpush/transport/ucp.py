"""Thin ctypes binding to libucp for set-up: context, worker, listener, endpoints, memory map, rkey, flush.

The per-batch path (puts, their flush, completions) is native: ``pdpush_native`` (native/). Both use the one
libucp that ``ucx_lib.load()`` chose and checked (the one pdpush_native was built against).

This module binds exactly the calls we need. Struct layouts and flag values come from UCX's ``ucp.h``; each
struct is read by UCX only as far as its ``field_mask`` says, which keeps the binding valid from UCX 1.13
(Debian's) to 1.21 (the wheel's); where a call or field is newer, it is gated by ``version()``. The unit
tests check the binding against the UCX in use.

Imported only by the transport layer, never by ``import pdpush``.
"""

from __future__ import annotations

import ctypes
import re
import socket
import struct
from ctypes import CFUNCTYPE, POINTER, byref, c_char_p, c_int, c_size_t, c_uint, c_uint8, c_uint32, c_uint64, c_void_p

UCS_OK = 0
UCS_INPROGRESS = 1
UCS_ERR_LAST = -100

# ucp_mem_map_params_t field mask and flags (ucp.h)
UCP_MEM_MAP_PARAM_FIELD_ADDRESS = 1 << 0
UCP_MEM_MAP_PARAM_FIELD_LENGTH = 1 << 1
UCP_MEM_MAP_PARAM_FIELD_FLAGS = 1 << 2
UCP_MEM_MAP_PARAM_FIELD_PROT = 1 << 3
UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE = 1 << 4
UCP_MEM_MAP_ALLOCATE = 1 << 1
UCP_MEM_MAP_PROT_LOCAL_READ = 1 << 0
UCP_MEM_MAP_PROT_LOCAL_WRITE = 1 << 1
UCP_MEM_MAP_PROT_REMOTE_READ = 1 << 8
UCP_MEM_MAP_PROT_REMOTE_WRITE = 1 << 9
# ucp_mem_attr_t field mask (ucp_def.h)
UCP_MEM_ATTR_FIELD_ADDRESS = 1 << 0
UCP_MEM_ATTR_FIELD_LENGTH = 1 << 1

# listener, endpoint, stream (ucp.h, ucp_def.h)
UCP_LISTENER_PARAM_FIELD_SOCK_ADDR = 1 << 0
UCP_LISTENER_PARAM_FIELD_CONN_HANDLER = 1 << 2
UCP_LISTENER_ATTR_FIELD_SOCKADDR = 1 << 0
UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE = 1 << 1
UCP_EP_PARAM_FIELD_ERR_HANDLER = 1 << 2
UCP_EP_PARAM_FIELD_CONN_REQUEST = 1 << 6
UCP_ERR_HANDLING_MODE_PEER = 1
UCP_EP_CLOSE_FLAG_FORCE = 1 << 0
UCP_OP_ATTR_FIELD_FLAGS = 1 << 4
UCP_STREAM_RECV_FLAG_WAITALL = 1 << 0

UCS_STATUS_NAMES = {
    -1: "NO_MESSAGE", -2: "NO_RESOURCE", -3: "IO_ERROR", -4: "NO_MEMORY",
    -5: "INVALID_PARAM", -6: "UNREACHABLE", -7: "INVALID_ADDR", -8: "NOT_IMPLEMENTED",
    -9: "MESSAGE_TRUNCATED", -10: "NO_PROGRESS", -11: "BUFFER_TOO_SMALL", -12: "NO_ELEM",
    -13: "SOME_CONNECTS_FAILED", -14: "NO_DEVICE", -15: "BUSY", -16: "CANCELED",
    -17: "SHMEM_SEGMENT", -18: "ALREADY_EXISTS", -19: "OUT_OF_RANGE", -20: "TIMED_OUT",
    -21: "EXCEEDS_LIMIT", -22: "UNSUPPORTED", -23: "REJECTED", -24: "NOT_CONNECTED",
    -25: "CONNECTION_RESET", -80: "ENDPOINT_TIMEOUT",
}


class MemMapParams(ctypes.Structure):
    _fields_ = [
        ("field_mask", c_uint64),
        ("address", c_void_p),
        ("length", c_size_t),
        ("flags", c_uint),
        ("prot", c_uint),
        ("memory_type", c_int),
        ("exported_memh_buffer", c_void_p),
    ]


class MemAttr(ctypes.Structure):
    _fields_ = [
        ("field_mask", c_uint64),
        ("address", c_void_p),
        ("length", c_size_t),
        ("mem_type", c_int),
    ]


class RequestParam(ctypes.Structure):
    _fields_ = [
        ("op_attr_mask", c_uint32),
        ("flags", c_uint32),
        ("request", c_void_p),
        ("cb", c_void_p),
        ("datatype", c_uint64),
        ("user_data", c_void_p),
        ("reply_buffer", c_void_p),
        ("memory_type", c_int),
        ("recv_info", c_void_p),
        ("memh", c_void_p),
    ]


class SockAddr(ctypes.Structure):  # ucs_sock_addr_t
    _fields_ = [("addr", c_void_p), ("addrlen", c_uint32)]


class Handler(ctypes.Structure):  # ucp_listener_conn_handler_t, ucp_err_handler_t: {cb, arg}
    _fields_ = [("cb", c_void_p), ("arg", c_void_p)]


class ListenerParams(ctypes.Structure):
    _fields_ = [("field_mask", c_uint64), ("sockaddr", SockAddr), ("accept_handler", Handler),
                ("conn_handler", Handler)]


class ListenerAttr(ctypes.Structure):
    _fields_ = [("field_mask", c_uint64), ("sockaddr", c_uint8 * 128)]  # struct sockaddr_storage


class TransportEntry(ctypes.Structure):  # ucp_transport_entry_t
    _fields_ = [("transport_name", ctypes.c_char_p), ("device_name", ctypes.c_char_p)]


class Transports(ctypes.Structure):  # ucp_transports_t
    _fields_ = [("entries", POINTER(TransportEntry)), ("num_entries", ctypes.c_uint), ("entry_size", c_size_t)]


class EpAttr(ctypes.Structure):  # ucp_ep_attr_t (UCX >= 1.14: the TRANSPORTS field)
    _fields_ = [("field_mask", c_uint64), ("name", ctypes.c_char * 32), ("local_sockaddr", c_uint8 * 128),
                ("remote_sockaddr", c_uint8 * 128), ("transports", Transports), ("user_data", c_void_p)]


UCP_EP_ATTR_FIELD_TRANSPORTS = 1 << 3

# context, worker and client endpoints (ucp.h)
UCP_PARAM_FIELD_FEATURES = 1 << 0
UCP_FEATURE_RMA = 1 << 1
UCP_FEATURE_WAKEUP = 1 << 4
UCP_FEATURE_STREAM = 1 << 5
UCP_WORKER_PARAM_FIELD_THREAD_MODE = 1 << 0
UCS_THREAD_MODE_SINGLE = 0
UCP_EP_PARAM_FIELD_SOCK_ADDR = 1 << 4
UCP_EP_PARAM_FIELD_FLAGS = 1 << 5
UCP_EP_PARAMS_FLAGS_CLIENT_SERVER = 1 << 0
UCS_ERR_BUSY = -15


class Params(ctypes.Structure):  # ucp_params_t: only the features field is set (the rest is newer or unused)
    _fields_ = [("field_mask", c_uint64), ("features", c_uint64), ("_rest", c_uint8 * 256)]


class WorkerParams(ctypes.Structure):  # ucp_worker_params_t: only the thread mode is set
    _fields_ = [("field_mask", c_uint64), ("thread_mode", c_int), ("_rest", c_uint8 * 512)]


class EpParams(ctypes.Structure):
    _fields_ = [("field_mask", c_uint64), ("address", c_void_p), ("err_mode", c_int), ("err_handler", Handler),
                ("user_data", c_void_p), ("flags", c_uint), ("sockaddr", SockAddr), ("conn_request", c_void_p),
                ("name", c_char_p), ("local_sockaddr", SockAddr)]


CONN_CB = CFUNCTYPE(None, c_void_p, c_void_p)  # (ucp_conn_request_h, void *arg)
ERR_CB = CFUNCTYPE(None, c_void_p, c_void_p, c_int)  # (void *arg, ucp_ep_h, ucs_status_t)


def signed_status(status: int) -> int:
    """A ``ucs_status_t`` as UCX means it. The enum is packed (one byte): read through a C int, -14 came back as 242."""
    return status - 256 if 128 <= status <= 255 else status


def status_name(status: int) -> str:
    status = signed_status(status)
    return f"{UCS_STATUS_NAMES.get(status, 'UCS_ERR')}({status})"


class UcpError(Exception):
    """Raised by this binding; mapped to pdpush errors by the transport layer."""

    def __init__(self, what: str, status: int) -> None:
        super().__init__(f"{what} failed: {status_name(status)}")
        self.status = signed_status(status)


_lib: ctypes.CDLL | None = None


def lib() -> ctypes.CDLL:
    """The process's one libucp (``ucx_lib.load``: the one pdpush_native links; a second is refused)."""
    global _lib
    if _lib is not None:
        return _lib
    from pdpush.transport import ucx_lib

    L, _ = ucx_lib.load()
    L.ucp_get_version.argtypes = [POINTER(c_uint), POINTER(c_uint), POINTER(c_uint)]
    L.ucp_get_version.restype = None
    L.ucp_get_version_string.argtypes = []
    L.ucp_get_version_string.restype = c_char_p
    L.ucp_config_read.argtypes = [c_char_p, c_char_p, POINTER(c_void_p)]
    L.ucp_config_read.restype = c_int
    L.ucp_config_release.argtypes = [c_void_p]
    L.ucp_config_release.restype = None
    L.ucp_init_version.argtypes = [c_uint, c_uint, POINTER(Params), c_void_p, POINTER(c_void_p)]
    L.ucp_init_version.restype = c_int
    L.ucp_cleanup.argtypes = [c_void_p]
    L.ucp_cleanup.restype = None
    L.ucp_context_print_info.argtypes = [c_void_p, c_void_p]
    L.ucp_context_print_info.restype = None
    L.ucp_ep_print_info.argtypes = [c_void_p, c_void_p]
    L.ucp_ep_print_info.restype = None
    L.ucp_worker_create.argtypes = [c_void_p, POINTER(WorkerParams), POINTER(c_void_p)]
    L.ucp_worker_create.restype = c_int
    L.ucp_worker_destroy.argtypes = [c_void_p]
    L.ucp_worker_destroy.restype = None
    L.ucp_worker_get_efd.argtypes = [c_void_p, POINTER(c_int)]
    L.ucp_worker_get_efd.restype = c_int
    L.ucp_worker_arm.argtypes = [c_void_p]
    L.ucp_worker_arm.restype = c_int
    L.ucp_stream_send_nbx.argtypes = [c_void_p, c_void_p, c_size_t, POINTER(RequestParam)]
    L.ucp_stream_send_nbx.restype = c_void_p
    L.ucp_mem_map.argtypes = [c_void_p, POINTER(MemMapParams), POINTER(c_void_p)]
    L.ucp_mem_map.restype = c_int
    L.ucp_mem_unmap.argtypes = [c_void_p, c_void_p]
    L.ucp_mem_unmap.restype = c_int
    L.ucp_mem_query.argtypes = [c_void_p, POINTER(MemAttr)]
    L.ucp_mem_query.restype = c_int
    L.ucp_rkey_pack.argtypes = [c_void_p, c_void_p, POINTER(c_void_p), POINTER(c_size_t)]
    L.ucp_rkey_pack.restype = c_int
    L.ucp_rkey_buffer_release.argtypes = [c_void_p]
    L.ucp_rkey_buffer_release.restype = None
    L.ucp_ep_rkey_unpack.argtypes = [c_void_p, c_void_p, POINTER(c_void_p)]
    L.ucp_ep_rkey_unpack.restype = c_int
    L.ucp_rkey_destroy.argtypes = [c_void_p]
    L.ucp_rkey_destroy.restype = None
    L.ucp_rkey_ptr.argtypes = [c_void_p, c_uint64, POINTER(c_void_p)]
    L.ucp_rkey_ptr.restype = c_int
    L.ucp_ep_flush_nbx.argtypes = [c_void_p, POINTER(RequestParam)]
    L.ucp_ep_flush_nbx.restype = c_void_p
    L.ucp_request_check_status.argtypes = [c_void_p]
    L.ucp_request_check_status.restype = c_int
    L.ucp_request_free.argtypes = [c_void_p]
    L.ucp_request_free.restype = None
    L.ucp_worker_progress.argtypes = [c_void_p]
    L.ucp_worker_progress.restype = c_uint
    L.ucp_listener_create.argtypes = [c_void_p, POINTER(ListenerParams), POINTER(c_void_p)]
    L.ucp_listener_create.restype = c_int
    L.ucp_listener_query.argtypes = [c_void_p, POINTER(ListenerAttr)]
    L.ucp_listener_query.restype = c_int
    L.ucp_listener_destroy.argtypes = [c_void_p]
    L.ucp_listener_destroy.restype = None
    L.ucp_ep_create.argtypes = [c_void_p, POINTER(EpParams), POINTER(c_void_p)]
    L.ucp_ep_create.restype = c_int
    L.ucp_ep_close_nbx.argtypes = [c_void_p, POINTER(RequestParam)]
    L.ucp_ep_close_nbx.restype = c_void_p
    L.ucp_stream_recv_nbx.argtypes = [c_void_p, c_void_p, c_size_t, POINTER(c_size_t), POINTER(RequestParam)]
    L.ucp_stream_recv_nbx.restype = c_void_p
    if hasattr(L, "ucp_ep_query"):  # UCX >= 1.12
        L.ucp_ep_query.argtypes = [c_void_p, POINTER(EpAttr)]
        L.ucp_ep_query.restype = c_int
    _lib = L
    return L


def _printed(fn, handle: int) -> str:
    """What a ``ucp_*_print_info(handle, FILE *)`` call writes, as text."""
    import tempfile

    libc = ctypes.CDLL(None)
    libc.fopen.restype = c_void_p
    libc.fopen.argtypes = [c_char_p, c_char_p]
    libc.fclose.argtypes = [c_void_p]
    with tempfile.NamedTemporaryFile(mode="r") as f:
        fp = libc.fopen(f.name.encode(), b"w")
        if not fp:
            return ""
        fn(handle, fp)
        libc.fclose(fp)
        return f.read()


def version() -> tuple[int, int, int]:
    """The loaded libucp's (major, minor, release)."""
    a, b, c = c_uint(), c_uint(), c_uint()
    lib().ucp_get_version(byref(a), byref(b), byref(c))
    return a.value, b.value, c.value


def version_string() -> str:
    return (lib().ucp_get_version_string() or b"").decode()


class Context:
    """``ucp_init`` with ``features`` (UCP_FEATURE_*), UCX_* settings read from the environment."""

    def __init__(self, features: int) -> None:
        L = lib()
        cfg = c_void_p()
        _check("ucp_config_read", L.ucp_config_read(None, None, byref(cfg)))
        p = Params()
        p.field_mask = UCP_PARAM_FIELD_FEATURES
        p.features = features
        h = c_void_p()
        major, minor, _ = version()
        try:
            _check("ucp_init", L.ucp_init_version(major, minor, byref(p), cfg, byref(h)))
        finally:
            L.ucp_config_release(cfg)
        self.handle: int | None = h.value

    def print_info(self) -> str:
        """``ucp_context_print_info``: its memory domains, devices and transport resources, as text."""
        return _printed(lib().ucp_context_print_info, self.handle)

    def cleanup(self) -> None:
        if self.handle:
            lib().ucp_cleanup(self.handle)
            self.handle = None


class Worker:
    """A single-threaded worker with a wake-up fd (``epoll_fd``; ``arm`` before sleeping on it)."""

    def __init__(self, context: int) -> None:
        p = WorkerParams()
        p.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE
        p.thread_mode = UCS_THREAD_MODE_SINGLE
        h = c_void_p()
        _check("ucp_worker_create", lib().ucp_worker_create(context, byref(p), byref(h)))
        self.handle: int | None = h.value
        fd = c_int()
        try:
            _check("ucp_worker_get_efd", lib().ucp_worker_get_efd(self.handle, byref(fd)))
        except UcpError:
            self.destroy()
            raise
        self.epoll_fd = fd.value

    def progress(self) -> int:
        return lib().ucp_worker_progress(self.handle)

    def arm(self) -> bool:
        """True: nothing is pending, sleep on the fd; False: events are pending, progress again."""
        st = signed_status(lib().ucp_worker_arm(self.handle))
        if st == UCS_ERR_BUSY:
            return False
        _check("ucp_worker_arm", st)
        return True

    def destroy(self) -> None:
        if self.handle:
            lib().ucp_worker_destroy(self.handle)
            self.handle = None


def _check(what: str, status: int) -> None:
    if status != UCS_OK:
        raise UcpError(what, status)


_MASK = (1 << 64) - 1


def _ptr_status(ptr: int | None) -> tuple[int, int | None]:
    """Decode a ucs_status_ptr_t: (status, request pointer or None)."""
    if not ptr:
        return UCS_OK, None
    if ptr >= (UCS_ERR_LAST & _MASK):
        return ptr - (1 << 64), None
    return UCS_INPROGRESS, ptr


class MemRegion:
    """Memory allocated (or registered) through ``ucp_mem_map``."""

    def __init__(self, context: int, length: int, address: int | None = None) -> None:
        L = lib()
        p = MemMapParams()
        p.field_mask = UCP_MEM_MAP_PARAM_FIELD_LENGTH | UCP_MEM_MAP_PARAM_FIELD_FLAGS | UCP_MEM_MAP_PARAM_FIELD_PROT
        p.length = length
        p.prot = (UCP_MEM_MAP_PROT_LOCAL_READ | UCP_MEM_MAP_PROT_LOCAL_WRITE
                  | UCP_MEM_MAP_PROT_REMOTE_READ | UCP_MEM_MAP_PROT_REMOTE_WRITE)
        if address is None:
            p.flags = UCP_MEM_MAP_ALLOCATE
        else:
            p.field_mask |= UCP_MEM_MAP_PARAM_FIELD_ADDRESS
            p.address = address
            p.flags = 0
        memh = c_void_p()
        _check("ucp_mem_map", L.ucp_mem_map(context, byref(p), byref(memh)))
        self._context = context
        self.memh = memh.value
        self.on_close = None  # set by the owner of memory we only registered
        attr = MemAttr()
        attr.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH
        _check("ucp_mem_query", L.ucp_mem_query(self.memh, byref(attr)))
        self.address: int = attr.address
        self.length: int = attr.length

    def pack_rkey(self) -> bytes:
        L = lib()
        buf = c_void_p()
        size = c_size_t()
        _check("ucp_rkey_pack", L.ucp_rkey_pack(self._context, self.memh, byref(buf), byref(size)))
        try:
            return ctypes.string_at(buf.value, size.value)
        finally:
            L.ucp_rkey_buffer_release(buf)

    def close(self) -> None:
        if self.memh:
            lib().ucp_mem_unmap(self._context, self.memh)
            self.memh = None
            if self.on_close is not None:
                self.on_close()


class RemoteKey:
    """An unpacked rkey, bound to one endpoint."""

    def __init__(self, ep: int, packed: bytes) -> None:
        rk = c_void_p()
        buf = ctypes.create_string_buffer(packed, len(packed))
        _check("ucp_ep_rkey_unpack", lib().ucp_ep_rkey_unpack(ep, buf, byref(rk)))
        self.handle: int | None = rk.value

    def local_address(self, remote: int) -> int | None:
        """Where the peer's ``remote`` address is mapped in this process: a shared-memory transport attaches the
        peer's region when the rkey is unpacked (``ucp_rkey_ptr``). None where nothing is mapped here (a network
        transport)."""
        p = c_void_p()
        if not self.handle or lib().ucp_rkey_ptr(self.handle, remote, byref(p)) != UCS_OK or not p.value:
            return None
        return p.value

    def destroy(self) -> None:
        if self.handle:
            lib().ucp_rkey_destroy(self.handle)
            self.handle = None


_NO_PARAM = RequestParam()  # op_attr_mask 0: defaults, no callback


def flush_nbx(ep: int) -> int | None:
    status, req = _ptr_status(lib().ucp_ep_flush_nbx(ep, byref(_NO_PARAM)))
    if status < 0:
        raise UcpError("ucp_ep_flush_nbx", status)
    return req


def request_status(req: int) -> int:
    return signed_status(lib().ucp_request_check_status(req))


def request_free(req: int) -> None:
    lib().ucp_request_free(req)


def worker_progress(worker: int) -> int:
    return lib().ucp_worker_progress(worker)


# ---- listener on one address, endpoints from its connection requests ----------------------

def sockaddr(host: str, port: int) -> tuple[ctypes.Array, int]:
    """A ``struct sockaddr_in``/``sockaddr_in6`` for ``host`` (resolved), as bytes UCX can read."""
    try:
        family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise UcpError(f"resolving {host!r}: {e}", -6) from None
    if family == socket.AF_INET:
        raw = struct.pack("=H", socket.AF_INET) + struct.pack("!H", port) + socket.inet_aton(addr[0]) + bytes(8)
    else:
        raw = (struct.pack("=H", socket.AF_INET6) + struct.pack("!HI", port, addr[2])
               + socket.inet_pton(socket.AF_INET6, addr[0]) + struct.pack("=I", addr[3]))
    return ctypes.create_string_buffer(raw, len(raw)), len(raw)


class Listener:
    """``ucp_listener_create`` on one address; connection requests are queued for ``accept``."""

    def __init__(self, worker: int, host: str, port: int) -> None:
        self._worker = worker
        self.requests: list[int] = []
        self._conn_cb = CONN_CB(lambda req, _arg: self.requests.append(req))  # kept alive with the listener
        buf, n = sockaddr(host, port)
        p = ListenerParams()
        p.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER
        p.sockaddr.addr = ctypes.addressof(buf)
        p.sockaddr.addrlen = n
        p.conn_handler.cb = ctypes.cast(self._conn_cb, c_void_p)
        h = c_void_p()
        _check(f"ucp_listener_create on {host}:{port}", lib().ucp_listener_create(worker, byref(p), byref(h)))
        self.handle: int | None = h.value
        attr = ListenerAttr()
        attr.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR
        _check("ucp_listener_query", lib().ucp_listener_query(self.handle, byref(attr)))
        self.port = struct.unpack("!H", bytes(attr.sockaddr[2:4]))[0]

    def destroy(self) -> None:
        if self.handle:
            lib().ucp_listener_destroy(self.handle)
            self.handle = None


def ep_from_conn_request(worker: int, conn_request: int, err_cb) -> int:
    """An endpoint for an accepted connection, error handling on (peer failures reach ``err_cb``)."""
    p = EpParams()
    p.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER
    p.conn_request = conn_request
    p.err_mode = UCP_ERR_HANDLING_MODE_PEER
    p.err_handler.cb = ctypes.cast(err_cb, c_void_p)
    ep = c_void_p()
    _check("ucp_ep_create", lib().ucp_ep_create(worker, byref(p), byref(ep)))
    return ep.value


def ep_connect(worker: int, host: str, port: int, err_cb) -> int:
    """A client endpoint to a listener at ``host:port``, error handling on (failures reach ``err_cb``). It
    wires up in the background: a flush on it completes once it is connected."""
    buf, n = sockaddr(host, port)
    p = EpParams()
    p.field_mask = (UCP_EP_PARAM_FIELD_SOCK_ADDR | UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE
                    | UCP_EP_PARAM_FIELD_ERR_HANDLER)
    p.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER
    p.sockaddr.addr = ctypes.addressof(buf)
    p.sockaddr.addrlen = n
    p.err_mode = UCP_ERR_HANDLING_MODE_PEER
    p.err_handler.cb = ctypes.cast(err_cb, c_void_p)
    ep = c_void_p()
    _check(f"ucp_ep_create to {host}:{port}", lib().ucp_ep_create(worker, byref(p), byref(ep)))
    return ep.value


def stream_send_nbx(ep: int, address: int, nbytes: int) -> int | None:
    """Send ``nbytes`` at ``address`` on the endpoint's stream; a request to wait for, or None if done."""
    status, req = _ptr_status(lib().ucp_stream_send_nbx(ep, address, nbytes, byref(_NO_PARAM)))
    if status < 0:
        raise UcpError("ucp_stream_send_nbx", status)
    return req


_WAITALL = RequestParam()
_WAITALL.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS
_WAITALL.flags = UCP_STREAM_RECV_FLAG_WAITALL
_FORCE = RequestParam()
_FORCE.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS
_FORCE.flags = UCP_EP_CLOSE_FLAG_FORCE


def stream_recv_nbx(ep: int, address: int, nbytes: int) -> tuple[int, int | None]:
    """Post a receive of exactly ``nbytes``: (status, request or None if it completed at once)."""
    length = c_size_t()
    return _ptr_status(lib().ucp_stream_recv_nbx(ep, address, nbytes, byref(length), byref(_WAITALL)))


def ep_close_nbx(ep: int) -> int | None:
    """Close an endpoint at once (in-flight operations are canceled); a request to free when done."""
    status, req = _ptr_status(lib().ucp_ep_close_nbx(ep, byref(_FORCE)))
    return req


UCP_EP_ATTR_FIELD_REMOTE_SOCKADDR = 1 << 2
_LANE = re.compile(r"#\s+lane\[\d+\]:\s+\d+:(\w+)/([\w:.-]+?)(?:\.\d+)?\s")


def ep_lanes(text: str) -> list[tuple[str, str]]:
    """(transport, device) of each lane in ``ucp_ep_print_info`` text (UCX < 1.14, which cannot be queried)."""
    out: list[tuple[str, str]] = []
    for m in map(_LANE.match, text.splitlines()):
        if m and (m.group(1), m.group(2)) not in out:
            out.append((m.group(1), m.group(2)))
    return out


def ep_remote(ep: int) -> str:
    """The address an endpoint is connected to (``ip:port``), or "" where UCX cannot say."""
    if not hasattr(lib(), "ucp_ep_query"):
        return ""
    a = EpAttr()
    a.field_mask = UCP_EP_ATTR_FIELD_REMOTE_SOCKADDR
    if lib().ucp_ep_query(ep, byref(a)) != UCS_OK:
        return ""
    raw = bytes(a.remote_sockaddr)
    family = struct.unpack("=H", raw[:2])[0]
    port = struct.unpack("!H", raw[2:4])[0]
    if family == socket.AF_INET:
        return f"{socket.inet_ntoa(raw[4:8])}:{port}"
    if family == socket.AF_INET6:
        return f"[{socket.inet_ntop(socket.AF_INET6, raw[8:24])}]:{port}"
    return ""


def ep_transports(ep: int) -> list[tuple[str, str]]:
    """The (transport, device) pairs an endpoint's lanes use, as UCX chose them: ``[("tcp", "eth0")]``
    between hosts, ``[("sysv", "memory"), ...]`` on one. Empty where UCX cannot say."""
    if version() < (1, 14) or not hasattr(lib(), "ucp_ep_query"):  # no TRANSPORTS field before 1.14
        return ep_lanes(_printed(lib().ucp_ep_print_info, ep))
    entries = (TransportEntry * 16)()
    a = EpAttr()
    a.field_mask = UCP_EP_ATTR_FIELD_TRANSPORTS
    a.transports.entries = ctypes.cast(entries, POINTER(TransportEntry))
    a.transports.num_entries = 16
    a.transports.entry_size = ctypes.sizeof(TransportEntry)
    if lib().ucp_ep_query(ep, byref(a)) != UCS_OK:
        return []
    out = []
    for e in entries[:min(a.transports.num_entries, 16)]:
        pair = ((e.transport_name or b"").decode(errors="replace"), (e.device_name or b"").decode(errors="replace"))
        if pair[1] and pair not in out:  # (an entry without a device is the connection manager's)
            out.append(pair)
    return out
