"""The ctypes binding matches the installed libucx headers (sizes, offsets, flag values)."""

from __future__ import annotations

import ctypes
import os
import subprocess

import libucx

from pdpush.transport import ucp

C_PROBE = r"""
#include <stdio.h>
#include <stddef.h>
#include <ucp/api/ucp.h>
#define F(T, m) printf("%s.%s %zu\n", #T, #m, offsetof(T, m))
int main(void) {
  printf("sizeof.ucp_mem_map_params_t %zu\n", sizeof(ucp_mem_map_params_t));
  printf("sizeof.ucp_mem_attr_t %zu\n", sizeof(ucp_mem_attr_t));
  printf("sizeof.ucp_request_param_t %zu\n", sizeof(ucp_request_param_t));
  F(ucp_mem_map_params_t, address); F(ucp_mem_map_params_t, length); F(ucp_mem_map_params_t, flags);
  F(ucp_mem_map_params_t, prot); F(ucp_mem_map_params_t, memory_type);
  F(ucp_mem_map_params_t, exported_memh_buffer);
  F(ucp_mem_attr_t, address); F(ucp_mem_attr_t, length); F(ucp_mem_attr_t, mem_type);
  F(ucp_request_param_t, flags); F(ucp_request_param_t, request); F(ucp_request_param_t, cb);
  F(ucp_request_param_t, datatype); F(ucp_request_param_t, user_data); F(ucp_request_param_t, reply_buffer);
  F(ucp_request_param_t, memory_type); F(ucp_request_param_t, recv_info); F(ucp_request_param_t, memh);
  printf("sizeof.ucp_listener_params_t %zu\n", sizeof(ucp_listener_params_t));
  printf("sizeof.ucp_listener_attr_t %zu\n", sizeof(ucp_listener_attr_t));
  printf("sizeof.ucp_ep_params_t %zu\n", sizeof(ucp_ep_params_t));
  F(ucp_listener_params_t, sockaddr); F(ucp_listener_params_t, accept_handler);
  F(ucp_listener_params_t, conn_handler); F(ucp_listener_attr_t, sockaddr);
  F(ucp_ep_params_t, address); F(ucp_ep_params_t, err_mode); F(ucp_ep_params_t, err_handler);
  F(ucp_ep_params_t, user_data); F(ucp_ep_params_t, flags); F(ucp_ep_params_t, sockaddr);
  F(ucp_ep_params_t, conn_request); F(ucp_ep_params_t, name); F(ucp_ep_params_t, local_sockaddr);
  printf("flag.UCP_LISTENER_PARAM_FIELD_SOCK_ADDR %d\n", (int)UCP_LISTENER_PARAM_FIELD_SOCK_ADDR);
  printf("flag.UCP_LISTENER_PARAM_FIELD_CONN_HANDLER %d\n", (int)UCP_LISTENER_PARAM_FIELD_CONN_HANDLER);
  printf("flag.UCP_LISTENER_ATTR_FIELD_SOCKADDR %d\n", (int)UCP_LISTENER_ATTR_FIELD_SOCKADDR);
  printf("flag.UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE %d\n", (int)UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE);
  printf("flag.UCP_EP_PARAM_FIELD_ERR_HANDLER %d\n", (int)UCP_EP_PARAM_FIELD_ERR_HANDLER);
  printf("flag.UCP_EP_PARAM_FIELD_CONN_REQUEST %d\n", (int)UCP_EP_PARAM_FIELD_CONN_REQUEST);
  printf("flag.UCP_ERR_HANDLING_MODE_PEER %d\n", (int)UCP_ERR_HANDLING_MODE_PEER);
  printf("flag.UCP_EP_CLOSE_FLAG_FORCE %d\n", (int)UCP_EP_CLOSE_FLAG_FORCE);
  printf("flag.UCP_OP_ATTR_FIELD_FLAGS %d\n", (int)UCP_OP_ATTR_FIELD_FLAGS);
  printf("flag.UCP_STREAM_RECV_FLAG_WAITALL %d\n", (int)UCP_STREAM_RECV_FLAG_WAITALL);
  printf("flag.UCP_MEM_MAP_ALLOCATE %d\n", (int)UCP_MEM_MAP_ALLOCATE);
  printf("flag.UCP_MEM_MAP_PROT_REMOTE_WRITE %d\n", (int)UCP_MEM_MAP_PROT_REMOTE_WRITE);
  printf("flag.UCP_MEM_MAP_PARAM_FIELD_PROT %d\n", (int)UCP_MEM_MAP_PARAM_FIELD_PROT);
  printf("flag.UCP_MEM_ATTR_FIELD_LENGTH %d\n", (int)UCP_MEM_ATTR_FIELD_LENGTH);
  return 0;
}
"""


def test_struct_layouts_match_headers(tmp_path):
    inc = os.path.join(os.path.dirname(libucx.__file__), "include")
    src = tmp_path / "probe.c"
    src.write_text(C_PROBE)
    exe = tmp_path / "probe"
    subprocess.run(["cc", "-I", inc, "-o", str(exe), str(src)], check=True, capture_output=True)
    got = dict(line.split() for line in subprocess.run([str(exe)], capture_output=True, text=True,
                                                         check=True).stdout.splitlines())
    want = {
        "sizeof.ucp_mem_map_params_t": ctypes.sizeof(ucp.MemMapParams),
        "sizeof.ucp_mem_attr_t": ctypes.sizeof(ucp.MemAttr),
        "sizeof.ucp_request_param_t": ctypes.sizeof(ucp.RequestParam),
        "flag.UCP_MEM_MAP_ALLOCATE": ucp.UCP_MEM_MAP_ALLOCATE,
        "flag.UCP_MEM_MAP_PROT_REMOTE_WRITE": ucp.UCP_MEM_MAP_PROT_REMOTE_WRITE,
        "flag.UCP_MEM_MAP_PARAM_FIELD_PROT": ucp.UCP_MEM_MAP_PARAM_FIELD_PROT,
        "flag.UCP_MEM_ATTR_FIELD_LENGTH": ucp.UCP_MEM_ATTR_FIELD_LENGTH,
        "sizeof.ucp_listener_params_t": ctypes.sizeof(ucp.ListenerParams),
        "sizeof.ucp_listener_attr_t": ctypes.sizeof(ucp.ListenerAttr),
        "sizeof.ucp_ep_params_t": ctypes.sizeof(ucp.EpParams),
        **{f"flag.{n}": getattr(ucp, n) for n in (
            "UCP_LISTENER_PARAM_FIELD_SOCK_ADDR", "UCP_LISTENER_PARAM_FIELD_CONN_HANDLER",
            "UCP_LISTENER_ATTR_FIELD_SOCKADDR", "UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE", "UCP_EP_PARAM_FIELD_ERR_HANDLER",
            "UCP_EP_PARAM_FIELD_CONN_REQUEST", "UCP_ERR_HANDLING_MODE_PEER", "UCP_EP_CLOSE_FLAG_FORCE",
            "UCP_OP_ATTR_FIELD_FLAGS", "UCP_STREAM_RECV_FLAG_WAITALL")},
    }
    names = {"ucp_mem_map_params_t": ucp.MemMapParams, "ucp_mem_attr_t": ucp.MemAttr,
             "ucp_request_param_t": ucp.RequestParam, "ucp_listener_params_t": ucp.ListenerParams,
             "ucp_listener_attr_t": ucp.ListenerAttr, "ucp_ep_params_t": ucp.EpParams}
    for key in got:
        if key.startswith("ucp_"):
            t, field = key.split(".")
            want[key] = getattr(names[t], field).offset
    assert {k: int(v) for k, v in got.items()} == want


def test_a_status_read_as_one_byte_is_signed():
    """ucs_status_t is a packed enum: a call's status read through a C int can come back as its byte (-14 as 242). It
    is read as UCX means it, so that BUSY from ucp_worker_arm is BUSY and an error is named (doctor said UCS_ERR(242))."""
    assert ucp.signed_status(242) == -14 and ucp.status_name(242) == "NO_DEVICE(-14)"
    assert ucp.signed_status(241) == ucp.UCS_ERR_BUSY and ucp.signed_status(-15) == -15
    assert ucp.signed_status(ucp.UCS_OK) == 0 and ucp.signed_status(ucp.UCS_INPROGRESS) == 1


def test_ptr_status_decoding():
    assert ucp._ptr_status(None) == (ucp.UCS_OK, None)
    assert ucp._ptr_status((1 << 64) - 25) == (-25, None)
    assert ucp._ptr_status(0x7F0000001000) == (ucp.UCS_INPROGRESS, 0x7F0000001000)


def test_alloc_is_sysv_and_attachable():
    """The region UCX allocates is SysV shm that a third party can attach zero-copy."""
    from pdpush import shm
    from pdpush.transport.ucx import UcxWorker

    w = UcxWorker()
    region, shmid, backing = w.alloc_shared(1 << 20)
    try:
        assert backing == "ucx-sysv" and shm.shmid_of(region.address) == shmid
        mine = shm.array_at(region.address, 1 << 20)
        other = shm.Attached(shmid, 1 << 20)
        mine[:8] = [1, 2, 3, 4, 5, 6, 7, 8]
        assert other.array[:8].tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
        other.array[100] = 42
        assert mine[100] == 42
        assert len(region.pack_rkey()) > 0
        other.close()
    finally:
        region.close()


def test_a_closed_worker_gives_back_its_close_signal_pipe():
    """``UcxWorker.closed_fd`` is a pipe the error callback writes: closing the worker closes both ends, and a
    late callback's signal is dropped, not written to a reused fd."""
    from pdpush.transport.ucx import UcxWorker

    w = UcxWorker()
    r, wr = w._closed_r, w._closed_w
    inodes = {fd: os.fstat(fd).st_ino for fd in (r, wr)}
    w.close()
    assert w.closed_fd == -1
    for fd, ino in inodes.items():
        try:
            assert os.fstat(fd).st_ino != ino, f"fd {fd} still holds the worker's pipe"
        except OSError:
            pass  # closed, and not reused
    w._signal_closed()  # an endpoint's error callback after close: nothing to write to
    w.close()  # twice: nothing left to close


def _rss(address: int) -> int:
    """Bytes of this process's mapping at ``address`` in its page tables (smaps Rss)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            parts = line.split()
            if "-" in parts[0] and not parts[0].endswith(":"):
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                inside = lo <= address < hi
            elif inside and parts[0] == "Rss:":
                return int(parts[1]) * 1024
    raise AssertionError(f"{address:#x} is not mapped")


def test_populate_maps_in_only_what_the_owner_has_in_memory_and_never_past_the_mapping():
    """shm.populate (the sender's advance mapping of a receiver's pool): a piece whose pages the owner has not
    faulted in is left alone (this process must not allocate the owner's memory); resident ones are mapped
    without a byte read or written; the range is cut at the end of the mapping; ``stop`` ends it between pieces."""
    from pdpush import shm

    mib = 1 << 20
    shmid, owner = shm.create_private(16 * mib)  # the owner's mapping
    peer = shm.Attached(shmid, 16 * mib)  # another mapping of it, as UCX attaches a receiver's pool in the sender
    try:
        assert shm.populate(peer.address, 16 * mib) == 0 and _rss(peer.address) == 0  # nothing resident yet
        shm.array_at(owner, 8 * mib)[:] = 7  # the owner faults the first half in
        seen = []
        assert shm.populate(peer.address, 64 * mib, progress=seen.append) == 8 * mib  # cut at the mapping's end
        assert seen == [4 * mib, 8 * mib] and _rss(peer.address) == 8 * mib
        assert peer.array[:8 * mib].min() == 7 and peer.array[8 * mib:].max() == 0  # no byte changed
        assert shm.populate(peer.address, 16 * mib, stop=lambda: True) == 0
    finally:
        peer.close()
        shm.detach(owner)


def test_prefault_allocates_a_fresh_region_without_writing_it():
    """shm.prefault (a daemon's own pool or staging at start-up): every page allocated and mapped here, by the
    kernel (MADV_POPULATE_WRITE) rather than by writing zeros, and the region reads zero."""
    from pdpush import shm

    nbytes = 10 * (1 << 20) + 4096  # not a whole number of pieces
    shmid, addr = shm.create_private(nbytes)
    other = shm.Attached(shmid, nbytes)
    try:
        assert _rss(addr) == 0
        shm.prefault(addr, nbytes)
        assert _rss(addr) == nbytes
        assert shm.populate(other.address, nbytes) == nbytes  # resident now: another mapping maps it all
        assert other.array.max() == 0
    finally:
        other.close()
        shm.detach(addr)


def test_an_engines_attachment_maps_the_daemons_pages_in_on_a_thread_and_its_close_stops_it():
    """shm.Attached.populate_async (client/connection.py's Attachments.hold): an engine's mapping of a
    daemon's staging or pool gets the daemon's resident pages without faulting them in one by one."""
    from pdpush import shm
    from tests.helpers import until

    nbytes = 12 << 20
    shmid, owner = shm.create_private(nbytes)
    shm.prefault(owner, nbytes)  # the daemon's own prefault
    a = shm.Attached(shmid, nbytes)
    try:
        a.populate_async()
        until(lambda: _rss(a.address) == nbytes, 10, "the attachment populated")
    finally:
        a.close()
    b = shm.Attached(shmid, nbytes)
    b.populate_async()
    b.close()  # at once: the thread stops within a piece, before the mapping goes
    assert b._populating is None and b.address == 0
    shm.detach(owner)
