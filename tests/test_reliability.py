"""Leases, backpressure, checksums, peer death and shutdown, with real daemons and real kills."""

from __future__ import annotations

import os
import signal
import socket
import time

import numpy as np
import pytest
import zmq

from pdpush import protocol
from pdpush.client import DecodeClient, PrefillClient, status
from pdpush.errors import BrokenResourceError, ErrorCode, PdpushError, PoolExhausted, RequestTooLarge, TransportTimeout
from pdpush.layout import KVLayout, chunk_keys
from pdpush_tools.harness.ports import free_ports
from tests.helpers import kv, push, read_back, rx_opts, sock, until

LAY = KVLayout(4, 2, 64, "float16", 16)




def test_sender_killed_midway_fails_its_request_at_once_and_pages_return_through_quarantine(daemons):
    """The sender dies with a request streaming: the receiver sees its UCX endpoint close, so no write of it
    can land any more; the request fails then (not at its lease) and its pages go through quarantine."""
    rx = daemons.receiver(**rx_opts(LAY, pool_pages=16), lease_ms=20_000, quarantine_ms=700)
    tx = daemons.sender(rx)
    pc = PrefillClient(LAY, sock(tx), timeout_s=10)
    k, v = kv(LAY, 100, 1)
    h = pc.begin("doomed", list(range(100)))
    h.put_layer(0, k[0], v[0])
    h.put_layer(1, k[1], v[1])
    assert status(sock(rx))["leases_active"] == 1
    tx.kill()
    pc.close()
    t0 = time.monotonic()
    st = until(lambda: (s := status(sock(rx)))["requests_failed"] == 1 and s, 10, "the request failing")
    assert st["leases_active"] == 0 and st["leases_expired"] == 0 and st["pool_pages_unfenced"] == 0
    assert st["pool_pages_quarantined"] + st["pool_pages_free"] == 16  # 100 tokens = 7 chunks, in quarantine
    st = until(lambda: (s := status(sock(rx)))["pool_pages_free"] == 16 and s, 10, "quarantine release")
    assert st["chunks_cached"] == 0 and st["senders_fenced"] == 0
    assert time.monotonic() - t0 < 5
    # the receiver still serves a new sender
    tx2 = daemons.sender(rx)
    pc2 = PrefillClient(LAY, sock(tx2), timeout_s=10)
    dc = DecodeClient(sock(rx), timeout_s=10)
    try:
        push(pc2, "after", list(range(100)), k, v)
        k2, v2 = read_back(dc, "after", LAY, 100)
        assert np.array_equal(k2, k) and np.array_equal(v2, v)
    finally:
        pc2.close()
        dc.close()


def test_a_push_that_fails_while_its_decode_has_it_open_keeps_its_pages_until_that_decode_releases_it(daemons):
    """The sender dies while a decode has its push open: that decode may be reading the pages (it may have
    taken the push as whole from its readiness words a moment before the failure), so they stay out of use
    until it releases them. Its client, told of the failure, says so itself."""
    rx = daemons.receiver(**rx_opts(LAY, pool_pages=16), lease_ms=20_000, quarantine_ms=300)
    tx = daemons.sender(rx)
    pc = PrefillClient(LAY, sock(tx), timeout_s=10)
    dc = DecodeClient(sock(rx), timeout_s=10)
    try:
        k, v = kv(LAY, 100, 1)
        h = pc.begin("doomed", list(range(100)))
        h.put_layer(0, k[0], v[0])
        req = dc.open("doomed")
        tx.kill()
        pc.close()
        st = until(lambda: (s := status(sock(rx)))["requests_failed"] == 1 and s, 10, "the request failing")
        assert st["pool_pages_read_held"] == 7 and st["pool_pages_free"] == 9  # 7 chunks, none reused yet
        time.sleep(0.5)  # past the quarantine: still held
        assert status(sock(rx))["pool_pages_read_held"] == 7
        with pytest.raises(PdpushError) as e:
            req.wait_committed(10)
        assert e.value.code is ErrorCode.PEER_DEAD
        req.release()
        until(lambda: status(sock(rx))["pool_pages_free"] == 16, 5, "the pages back, through quarantine")
        assert status(sock(rx))["pool_pages_read_held"] == 0
        # an open whose answer came but was never taken, given up after its push failed: its Release names it
        tx2 = daemons.sender(rx)
        pc = PrefillClient(LAY, sock(tx2), timeout_s=10)
        h = pc.begin("doomed-too", list(range(100)))
        pending = dc.open_nowait("doomed-too")
        until(lambda: status(sock(rx))["requests_total"] == 2 and (dc._conn.drain() or dc._conn.mail.get(
            "doomed-too")), 5, "the open's answer")
        h.abort("gave up")
        until(lambda: status(sock(rx))["pool_pages_read_held"] == 7, 5, "the failed push held for its reader")
        pending.abandon()
        until(lambda: status(sock(rx))["pool_pages_read_held"] == 0, 5, "the abandoned open let go")
    finally:
        pc.close()
        dc.close()


def test_a_push_begun_again_while_its_aborted_tries_copies_still_write_staging_waits_for_them(daemons):
    """An engine aborts a push while a device's copies into its staging are still queued (``after_writes``: its
    Abort waits for them), and begins the id again (a preempted request's retry). The Begin waits for that Abort:
    sent first, the sender took it for the engine's word that it stopped writing the old staging, and handed it
    to other requests under the queued copies (and it refused the new push as a duplicate of the live one)."""
    import threading

    rx = daemons.receiver(**rx_opts(LAY))
    tx = daemons.sender(rx)
    pc = PrefillClient(LAY, sock(tx), timeout_s=10)
    dc = DecodeClient(sock(rx), timeout_s=10)
    try:
        k, v = kv(LAY, 50, 3)
        h = pc.begin("again", list(range(50)))
        h.put_layer(0, k[0], v[0])
        copies_end: list = []
        h.after_writes = copies_end.append  # (a device's copies still queued: the Abort goes when they end)
        h.abort("preempted")
        begun: list = []
        t = threading.Thread(target=lambda: begun.append(pc.begin("again", list(range(50)))), daemon=True)
        t.start()
        t.join(0.5)
        assert not begun and t.is_alive()  # it waits for the earlier try's copies
        copies_end[0]()  # they end: its Abort goes, then the Begin
        t.join(10)
        h2 = begun[0]
        for layer in range(LAY.layers):
            h2.put_layer(layer, k[layer], v[layer])
        h2.finish(timeout_s=30)
        k2, v2 = read_back(dc, "again", LAY, 50)
        assert np.array_equal(k2, k) and np.array_equal(v2, v)
    finally:
        pc.close()
        dc.close()


def test_receiver_killed_midway_fails_requests_fast_other_receivers_unaffected_and_reconnect(daemons):
    cport, uport = free_ports(2)
    rx1 = daemons.receiver(**rx_opts(LAY), control_port=cport, ucx_port=uport)
    rx2 = daemons.receiver(**rx_opts(LAY))
    tx = daemons.sender(rx1)
    pc = PrefillClient(LAY, sock(tx), timeout_s=10)
    k, v = kv(LAY, 60, 2)
    try:
        h1 = pc.begin("to-rx1", list(range(60)), receiver=rx1.info["control_endpoint"])
        h1.put_layer(0, k[0], v[0])
        h2 = pc.begin("to-rx2", list(range(60)), receiver=rx2.info["control_endpoint"])
        h2.put_layer(0, k[0], v[0])
        rx1.kill()
        t0 = time.monotonic()
        with pytest.raises(PdpushError) as e:
            for layer in range(1, LAY.layers):
                h1.put_layer(layer, k[layer], v[layer])
                time.sleep(0.05)  # the engine computing its next layer
            h1.finish(timeout_s=10)
        detect = time.monotonic() - t0
        assert e.value.code in (ErrorCode.PEER_DEAD, ErrorCode.TRANSFER_FAILED, ErrorCode.TIMEOUT)
        assert detect < 5.0, detect
        for layer in range(1, LAY.layers):  # the other receiver's request is unaffected
            h2.put_layer(layer, k[layer], v[layer])
        h2.finish(timeout_s=10)
        st = status(sock(tx))
        assert st["requests_failed"] == 1 and st["requests_done"] == 1 and tx.alive()
        # the receiver comes back on the same ports: the sender reconnects
        daemons.receiver(**rx_opts(LAY), control_port=cport, ucx_port=uport)
        push(pc, "after-restart", list(range(60)), k, v)
    finally:
        pc.close()
    print(f"receiver death detected by the prefill engine in {detect * 1000:.0f} ms")


def test_decode_wait_times_out_with_typed_error(daemons):
    rx = daemons.receiver(**rx_opts(LAY))
    tx = daemons.sender(rx)
    pc = PrefillClient(LAY, sock(tx), timeout_s=10)
    dc = DecodeClient(sock(rx), timeout_s=10)
    k, v = kv(LAY, 40, 3)
    try:
        h = pc.begin("partial", list(range(40)))
        h.put_layer(0, k[0], v[0])
        req = dc.open("partial")
        req.wait_layer(0, timeout_s=5)
        t0 = time.monotonic()
        with pytest.raises(TransportTimeout, match="layer 1"):
            req.wait_layer(1, timeout_s=1.0)
        assert 0.9 < time.monotonic() - t0 < 4
        with pytest.raises(PdpushError, match="not ready"):
            req.layer_runs(2, wait=False)
        # a request that never arrives: open times out too
        with pytest.raises(TransportTimeout):
            dc.open("never-sent", timeout_s=0.5)
    finally:
        pc.close()
        dc.close()


def test_decode_notices_dead_receiver(daemons):
    rx = daemons.receiver(**rx_opts(LAY))
    tx = daemons.sender(rx)
    pc = PrefillClient(LAY, sock(tx), timeout_s=10)
    dc = DecodeClient(sock(rx), timeout_s=10)
    k, v = kv(LAY, 40, 4)
    try:
        h = pc.begin("orphan", list(range(40)))
        h.put_layer(0, k[0], v[0])
        req = dc.open("orphan")
        req.wait_layer(0, timeout_s=5)
        rx.kill()
        t0 = time.monotonic()
        with pytest.raises(BrokenResourceError, match="died"):
            req.wait_layer(1, timeout_s=30)
        assert time.monotonic() - t0 < 3
        with pytest.raises(BrokenResourceError):  # not even the layer that did arrive is handed out now
            req.layer_runs(0, wait=False)
    finally:
        pc.close()
        dc.close()


def test_pool_exhausted_bounded_retry_then_clear_error_and_too_large(daemons):
    rx = daemons.receiver(**rx_opts(LAY, pool_pages=8))
    tx = daemons.sender(rx, alloc_retry_budget_ms=600)
    pc = PrefillClient(LAY, sock(tx), timeout_s=10)
    try:
        k, v = kv(LAY, 96, 5)
        h = pc.begin("hog", list(range(96)))  # 6 of 8 pages, held (not committed)
        t0 = time.monotonic()
        with pytest.raises(PoolExhausted, match="gave up after"):
            pc.begin("starved", list(range(500, 548)))  # needs 3
        assert 0.5 < time.monotonic() - t0 < 3
        assert status(sock(tx))["alloc_retries"] >= 2
        # the receiver says so too, where its pool is (the PdpushPoolExhausted alert): each refusal counted
        import urllib.request

        scraped = urllib.request.urlopen(rx.info["metrics_endpoint"], timeout=5).read().decode()
        refused = [float(line.rsplit(" ", 1)[1]) for line in scraped.splitlines()
                   if line.startswith('pdpush_failures_total{reason="pool_exhausted"}')]
        assert refused and refused[0] >= 3 and status(sock(rx))["allocs_refused"] == refused[0], scraped[-2000:]
        with pytest.raises(RequestTooLarge):
            pc.begin("whale", list(range(1000, 1000 + 16 * 9)))
        # backpressure resolves itself once the hog commits: its chunks become evictable after release
        for layer in range(LAY.layers):
            h.put_layer(layer, k[layer], v[layer])
        h.finish()
        dc = DecodeClient(sock(rx), timeout_s=10)
        read_back(dc, "hog", LAY, 96)
        dc.close()
        pc.begin("starved-2", list(range(500, 548))).abort("test done")
    finally:
        pc.close()


def test_checksums_pass_and_a_wrong_checksum_is_detected(daemons):
    rx = daemons.receiver(**rx_opts(LAY), verify_checksums=True)
    tx = daemons.sender(rx, checksums=True)
    pc = PrefillClient(LAY, sock(tx), timeout_s=10)
    dc = DecodeClient(sock(rx), timeout_s=10)
    try:
        k, v = kv(LAY, 50, 6)
        push(pc, "summed", list(range(50)), k, v)
        k2, _ = read_back(dc, "summed", LAY, 50)
        assert np.array_equal(k2, k)
    finally:
        pc.close()
        dc.close()
    # a LayerDone whose checksum does not match the pool's bytes (a torn or late write)
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(rx.info["control_endpoint"])
    try:
        def ask(m):
            s.send(protocol.encode(m))
            assert s.poll(5000)
            return protocol.decode(s.recv())

        ask(protocol.Hello(version=protocol.PROTOCOL_VERSION, fingerprint=LAY.fingerprint(), layout=protocol.LayoutSpec(**LAY.to_dict())))
        ask(protocol.AllocRequest(req_id="torn", chunk_keys=chunk_keys(list(range(900, 932)), LAY),
                                  last_chunk_tokens=16, lease_ms=5000))
        reply = ask(protocol.LayerDone(req_id="torn", layers=[0], checksums=[12345]))
        assert isinstance(reply, protocol.Error) and reply.code is ErrorCode.CHECKSUM_MISMATCH
        st = status(sock(rx))
        assert st["checksum_failures"] == 1 and st["leases_active"] == 0 and st["pool_pages_unfenced"] == 2
        # its pages wait for the sender to say its writes to them settled (sessions/receiver.py, "Fencing")
        assert isinstance(ask(protocol.Abort(req_id="torn", settled=True)), protocol.Ok)
        assert status(sock(rx))["pool_pages_quarantined"] == 2
    finally:
        s.close(0)


def test_sigterm_drains_in_flight_work_then_second_signal_forces(daemons):
    rx = daemons.receiver(**rx_opts(LAY))
    tx = daemons.sender(rx)
    pc = PrefillClient(LAY, sock(tx), timeout_s=10)
    k, v = kv(LAY, 40, 7)
    try:
        h = pc.begin("inflight", list(range(40)))
        h.put_layer(0, k[0], v[0])
        tx.proc.send_signal(signal.SIGHUP)  # no reload for a daemon: it says so, and serves on (no drain)
        until(lambda: "SIGHUP ignored" in tx.log(), 10, "the sender to log the SIGHUP")
        assert tx.proc.poll() is None and not status(sock(tx))["draining"]
        tx.proc.send_signal(signal.SIGTERM)
        until(lambda: status(sock(tx))["draining"], 10, "the sender to start draining")
        with pytest.raises(PdpushError) as e:  # draining: no new work
            pc.begin("late", list(range(100, 140)))
        assert e.value.code is ErrorCode.SHUTTING_DOWN
        for layer in range(1, LAY.layers):  # ... but the in-flight request completes
            h.put_layer(layer, k[layer], v[layer])
        h.finish()
        assert tx.proc.wait(10) == 0
    finally:
        pc.close()
    # second signal: forced exit with the named code, in-flight work aborted
    tx2 = daemons.sender(rx)
    pc2 = PrefillClient(LAY, sock(tx2), timeout_s=10)
    try:
        h = pc2.begin("stuck", list(range(200, 240)))
        tx2.proc.send_signal(signal.SIGTERM)
        until(lambda: status(sock(tx2))["draining"], 10, "the sender to start draining")
        tx2.proc.send_signal(signal.SIGTERM)
        assert tx2.proc.wait(10) == 130
        until(lambda: status(sock(rx))["leases_active"] == 0, 10, "abort of the stuck lease")
    finally:
        pc2.close()
    # one signal, and work still in flight at the drain's deadline: aborted, and the exit says so
    tx3 = daemons.sender(rx, drain_timeout_s=0.5)
    pc3 = PrefillClient(LAY, sock(tx3), timeout_s=10)
    try:
        pc3.begin("outlives-the-drain", list(range(300, 340)))
        tx3.proc.send_signal(signal.SIGTERM)
        assert tx3.proc.wait(10) == 1
        until(lambda: status(sock(rx))["leases_active"] == 0, 10, "abort of the drained-out lease")
    finally:
        pc3.close()


@pytest.mark.slow
def test_soak_short():
    """A shortened soak (make soak runs 10 minutes): zero mismatches, zero leaked pages."""
    from pdpush_tools.bench import soak

    res = soak.run(60)
    assert res["requests_ok"] > 0 and res["kills"] >= 3
    assert res["mismatches"] == 0 and res["leaked_pages"] == 0


def test_sender_deadline_before_the_lease_and_committed_ttl(daemons):
    """The sender aborts a stalled request before the receiver's lease would; unopened commits expire."""
    rx = daemons.receiver(**rx_opts(LAY), lease_ms=5000, committed_ttl_ms=600)
    tx = daemons.sender(rx, lease_ms=1000)
    pc = PrefillClient(LAY, sock(tx), timeout_s=10)
    dc = DecodeClient(sock(rx), timeout_s=10)
    k, v = kv(LAY, 40, 8)
    try:
        h = pc.begin("stalled", list(range(40)))
        h.put_layer(0, k[0], v[0])  # ... and the engine never hands over the rest
        t0 = time.monotonic()
        st = until(lambda: (s := status(sock(rx)))["leases_active"] == 0 and s, 10, "the sender's abort")
        assert 0.7 < time.monotonic() - t0 < 3  # ~0.9 x the sender's 1 s lease, long before the receiver's 5 s
        assert st["leases_expired"] == 0 and st["requests_failed"] == 1  # aborted by the sender, not expired
        with pytest.raises(TransportTimeout, match="lease deadline"):  # the engine is told, with a typed error
            h.finish(timeout_s=5)
        # a committed request nobody opens is dropped after committed_ttl_ms; its chunks stay cached
        push(pc, "unopened", list(range(500, 540)), k, v)
        with dc.open("unopened", timeout_s=5):
            pass  # opened and released: dropped at once
        push(pc, "never-opened", list(range(600, 640)), k, v)
        until(lambda: status(sock(rx))["requests_committed"] == 2, 5, "commit")
        time.sleep(1.0)  # past committed_ttl_ms (0.6 s)
        with pytest.raises(PdpushError, match="gone"):
            dc.open("never-opened", timeout_s=5)
        assert status(sock(rx))["chunks_cached"] == 6
    finally:
        pc.close()
        dc.close()


def test_daemons_die_with_a_crashed_launcher(tmp_path):
    """A test runner or bench that is itself SIGKILLed must not leave daemons running."""
    import subprocess
    import sys

    from pdpush.launch import pid_alive

    code = ("import sys, time; from pathlib import Path; from pdpush import launch; "
            f"d = launch.start_receiver(Path({str(tmp_path)!r}), layers=2, kv_heads=1, head_dim=8, pool_pages=2, "
            "prefault=False); print(d.pid, flush=True); time.sleep(120)")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(parent.stdout.readline())
        assert pid_alive(pid)
        parent.kill()
        parent.wait(10)
        until(lambda: not pid_alive(pid), 20, "the orphaned daemon to exit")
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(10)


def test_an_idle_sender_notices_a_dead_receiver_without_spinning(daemons):
    """Regression: the sender's loop once progressed UCX only with puts in flight, so an idle sender never
    saw its receiver die (the endpoint stayed 'connected') and spun on UCX's readable fd."""
    import os
    import signal

    rx = daemons.receiver(**rx_opts(LAY))
    tx = daemons.sender(rx)
    pc = PrefillClient(LAY, sock(tx), timeout_s=10)
    try:
        k, v = kv(LAY, 40, 1)
        push(pc, "before", list(range(40)), k, v)
        assert status(sock(tx))["receivers_connected"] == 1
        os.kill(rx.info["pid"], signal.SIGKILL)
        until(lambda: status(sock(tx))["receivers_connected"] == 0, 10, "the sender to notice its receiver died")

        def cpu_s() -> float:
            with open(f"/proc/{tx.info['pid']}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

        before = cpu_s()
        time.sleep(2)  # measuring the idle sender's CPU time over a fixed window, not a speed
        assert cpu_s() - before < 1.0, "the idle sender is spinning"
    finally:
        pc.close()


def test_a_killed_reader_pins_no_page_and_only_its_opener_can_release_a_request(daemons):
    """A decode process that opened a request and was SIGKILLed (its lifeline closes) gives its open back, so the
    committed request is dropped and its pages can be reused; a Release from another connection, which never opened
    the request, is refused and leaves a live reader's open (and its pages) alone."""
    import subprocess
    import sys

    rx = daemons.receiver(**rx_opts(LAY))
    tx = daemons.sender(rx)
    pc = PrefillClient(LAY, sock(tx), timeout_s=10)
    k, v = kv(LAY, 40, 3)
    try:
        push(pc, "held", list(range(40)), k, v)
        push(pc, "read", list(range(100, 140)), k, v)
    finally:
        pc.close()
    code = ("import sys; from pdpush.client import DecodeClient; "
            f"dc = DecodeClient({sock(rx)!r}, timeout_s=10); r = dc.open('held'); r.wait_committed(); "
            "print('open', flush=True); sys.stdin.read()")
    reader = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    dc, stranger = DecodeClient(sock(rx), timeout_s=10), DecodeClient(sock(rx), timeout_s=10)
    try:
        assert reader.stdout.readline().strip() == "open"
        mine = dc.open("read")
        mine.wait_committed()
        with pytest.raises(PdpushError, match="no open of this connection") as e:
            stranger._conn.call(protocol.Release(req_id="read"), "read", 10)
        assert e.value.code is ErrorCode.UNKNOWN_REQUEST and status(sock(rx))["releases_refused"] == 1
        gk, gv = read_back(dc, "read", LAY, 40)  # still open here: its pages are its own
        assert np.array_equal(gk, k) and np.array_equal(gv, v)
        mine.release()
        reader.kill()
        reader.wait(10)
        until(lambda: status(sock(rx))["readers_gone"] >= 1, 10, "the receiver to see the reader die")
        with pytest.raises(PdpushError, match="is gone: committed and released"):
            dc.open("held")
    finally:
        if reader.poll() is None:
            reader.kill()
            reader.wait(10)
        dc.close()
        stranger.close()


def test_an_open_sent_without_waiting_is_taken_later_and_one_given_up_holds_no_page(daemons):
    """``open_nowait``: the decode connector sends its open before the forward and takes the answer at the first
    layer. The answer is taken by ``poll`` once it has come (bytes equal); one past its deadline is a typed timeout;
    an open given up (``abandon``), answered or still parked before its push began, holds nothing: once another
    reader releases the committed request, it is gone, also where the one that gave up was another decode TP rank's."""
    rx = daemons.receiver(**rx_opts(LAY))
    tx = daemons.sender(rx)
    pc = PrefillClient(LAY, sock(tx), timeout_s=10)
    dc, other = DecodeClient(sock(rx), timeout_s=10), DecodeClient(sock(rx), timeout_s=10)
    k, v = kv(LAY, 40, 5)
    try:
        push(pc, "a", list(range(40)), k, v)
        push(pc, "b", list(range(100, 140)), k, v)
        pending = dc.open_nowait("a")
        deadline = time.monotonic() + 10
        while (req := pending.poll()) is None:
            assert time.monotonic() < deadline, "the open's answer never came"
            time.sleep(0.001)
        with req:
            got = [req.kv_bytes(layer, wait=True, timeout_s=10) for layer in range(LAY.layers)]
        assert np.array_equal(np.stack([g[0] for g in got]), k) and np.array_equal(np.stack([g[1] for g in got]), v)

        late = dc.open_nowait("c", timeout_s=0.2)  # no push of "c" yet: parked on the receiver
        with pytest.raises(TransportTimeout):
            late.wait()  # given up by its timeout (a Release goes): neither an answer nor the receiver's word that
        with pytest.raises(TransportTimeout):  # it waited too long can answer a later open of "c"
            late.poll()
        dc.open_nowait("b").abandon()  # answered, its answer dropped, and released: its only open, so it goes
        dc.query(list(range(40)), LAY)  # one connection is served in order: both Releases are in
        with pytest.raises(PdpushError, match="is gone: committed and released"):
            other.open("b", timeout_s=10)
        push(pc, "c", list(range(200, 240)), k, v)  # the abandoned parked open was not answered: no open holds it
        other.open("c", timeout_s=10).release()
        with pytest.raises(PdpushError, match="is gone: committed and released"):
            other.open("c", timeout_s=10)

        # two decode TP ranks: rank 1 gives up its parked open before the push begins; once rank 0 has read and
        # released the request it goes, with rank 1's release counted (not kept to committed_ttl_ms)
        rank0 = other.open_nowait("d", tp_rank=0, tp_size=2)
        dc.open_nowait("d", tp_rank=1, tp_size=2).abandon()
        dc.query(list(range(40)), LAY)  # rank 1's Release is in
        push(pc, "d", list(range(300, 340)), k, v)
        with rank0.wait() as req:
            h0, h1 = req.heads  # rank 0's share of the KV heads
            assert np.array_equal(req.kv_bytes(0, wait=True, timeout_s=10)[0], k[0][:, h0:h1])
        with pytest.raises(PdpushError, match="is gone: committed and released"):
            other.open("d", timeout_s=10)
    finally:
        pc.close()
        dc.close()
        other.close()


def test_a_receiver_whose_ucx_listener_never_answers_holds_up_no_other_receivers_requests(daemons):
    """Issue 34 item 4: the sender used to connect UCX inside its loop, spinning up to control_timeout_ms per step, so
    while one receiver's listener did not answer nothing else moved. Here receiver B answers Hello on its control port
    but its UCX port is a TCP listener that never speaks: while B's connection hangs, a push to receiver A completes,
    and B's request then fails by its deadline, typed."""
    import threading

    from pdpush.client import PrefillClient

    rx_a = daemons.receiver(**rx_opts(LAY))
    tx = daemons.sender(rx_a, control_timeout_ms=4000)
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(8)  # connections queue in the backlog; nothing ever answers them
    ctx = zmq.Context.instance()
    fake = ctx.socket(zmq.ROUTER)
    fake.setsockopt(zmq.LINGER, 0)
    port_b = fake.bind_to_random_port("tcp://127.0.0.1")
    heard_hello = threading.Event()
    stop = threading.Event()

    def serve_b() -> None:  # B's control plane: a HelloAck that sends the sender to the black hole
        while not stop.is_set():
            if not fake.poll(50):
                continue
            ident, payload = fake.recv_multipart()
            msg = protocol.decode(payload, protocol.DEFAULT_MAX_FRAME)
            if isinstance(msg, protocol.Hello):
                heard_hello.set()
                fake.send_multipart([ident, protocol.encode(protocol.HelloAck(
                    version=protocol.PROTOCOL_VERSION, fingerprint=LAY.fingerprint(), layout=msg.layout, pool_base=0,
                    pool_pages=64, page_bytes=LAY.page_bytes, rkey=b"x" * 16, ready_base=0,
                    ucx_host="127.0.0.1", ucx_port=hole.getsockname()[1], ucx_token=b"t" * 32))])

    server = threading.Thread(target=serve_b, daemon=True)
    server.start()
    pc_a, pc_b = PrefillClient(LAY, sock(tx), timeout_s=20), PrefillClient(LAY, sock(tx), timeout_s=20)
    outcome: dict = {}

    def begin_b() -> None:
        try:
            pc_b.begin("to-b", list(range(40)), receiver=f"tcp://127.0.0.1:{port_b}")
            outcome["b"] = "began"
        except PdpushError as e:
            outcome["b"] = e

    b = threading.Thread(target=begin_b, daemon=True)
    try:
        b.start()
        assert heard_hello.wait(10), "the sender never said Hello to B"
        k, v = kv(LAY, 40, 4)
        _, done = push(pc_a, "to-a", list(range(40)), k, v)  # while B's UCX connection hangs
        assert done.bytes_sent > 0
        assert b.is_alive() and "b" not in outcome, "the push to A waited for B's connection to give up"
        b.join(30)
        assert isinstance(outcome.get("b"), PdpushError), outcome
        assert outcome["b"].code in (ErrorCode.TIMEOUT, ErrorCode.PEER_DEAD), outcome
    finally:
        stop.set()
        server.join(5)
        b.join(30)
        pc_a.close()
        pc_b.close()
        fake.close(0)
        hole.close()


def test_replies_a_peer_does_not_read_are_counted_not_silently_dropped_and_others_are_served(daemons):
    """Issue 34 item 6: a ROUTER reply that met its peer's high-water mark vanished without a trace. A local connection
    that sends queries and never reads the answers fills its queue: the receiver counts what it could not send, logs
    it (not each one), and keeps serving everyone else."""
    rx = daemons.receiver(**rx_opts(LAY))
    tx = daemons.sender(rx)
    pc = PrefillClient(LAY, sock(tx), timeout_s=10)
    k, v = kv(LAY, 40, 5)
    push(pc, "served", list(range(40)), k, v)
    pc.close()
    deaf = zmq.Context.instance().socket(zmq.DEALER)
    deaf.setsockopt(zmq.LINGER, 0)
    deaf.setsockopt(zmq.RCVHWM, 10)
    deaf.setsockopt(zmq.SNDHWM, 0)
    deaf.connect(f"ipc://{sock(rx)}")
    query = protocol.encode(protocol.Query(chunk_keys=chunk_keys(list(range(40)), LAY)))
    try:
        for _ in range(200):  # bounded: stop as soon as the receiver says it could not answer
            for _ in range(500):
                deaf.send(query)
            time.sleep(0.05)  # letting the receiver answer into the full queue; bounded by the loop
            if status(sock(rx))["local_dropped"] > 0:
                break
        st = status(sock(rx))
        assert st["local_dropped"] > 0, st
        assert "dropped so far" in rx.log()
        assert rx.log().count("could not send") < 40  # logged at 1, 2, 4, 8, ... not once per reply
        dc = DecodeClient(sock(rx), timeout_s=10)
        try:
            gk, gv = read_back(dc, "served", LAY, 40)  # everyone else is served
        finally:
            dc.close()
        assert np.array_equal(gk, k) and np.array_equal(gv, v)
    finally:
        deaf.close(0)


def test_a_receiver_closes_the_endpoints_of_senders_that_went(daemons):
    """Senders come and go (a restart, a kill, a fence): the receiver's UCX endpoints for them go too. Before, a failed
    endpoint was forgotten but never closed, and kept its UCX handle for the daemon's life: one per sender restart."""
    from tests.helpers import round_trip

    rx = daemons.receiver(**rx_opts(LAY))
    for i in range(4):
        tx = daemons.sender(rx)
        round_trip(tx, rx, LAY, f"went-{i}", list(range(i * 100, i * 100 + 20)), seed=i)  # (new chunks each)
        assert status(sock(rx))["ucx_endpoints"] == 1
        tx.kill() if i % 2 else tx.stop()
        until(lambda: status(sock(rx))["ucx_endpoints"] == 0, 20, f"sender {i}'s endpoint closed")


def test_a_release_without_waiting_returns_while_the_receiver_is_stopped_and_still_lands(daemons):
    """The vLLM connector releases each loaded request in its engine's step: a receiver alive but not reading
    (SIGSTOP here) held that step up to the client's timeout per request. ``release(wait=False)`` returns at once,
    and the Release is read once the receiver runs: the request is gone, its pages given back."""
    rx = daemons.receiver(**rx_opts(LAY))
    tx = daemons.sender(rx)
    pc = PrefillClient(LAY, sock(tx), timeout_s=10)
    k, v = kv(LAY, 40, 11)
    try:
        push(pc, "nowait", list(range(40)), k, v)
    finally:
        pc.close()
    dc = DecodeClient(sock(rx), timeout_s=10)
    try:
        req = dc.open("nowait")
        req.wait_committed()
        os.kill(rx.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            req.release(wait=False)
            took = time.monotonic() - t0
        finally:
            os.kill(rx.pid, signal.SIGCONT)
        assert took < 5, took  # (the waiting release would wait out the client's 10 s)
        with pytest.raises(PdpushError, match="is gone: committed and released"):
            dc.open("nowait")
    finally:
        dc.close()


def test_a_control_connection_made_again_after_it_broke_keeps_its_session(daemons):
    """The TCP connection between a sender and a receiver breaks (a middlebox's idle timeout, a link reset) and
    ZeroMQ makes it again by itself. Its routing id was ZeroMQ's, so the receiver knew the new connection by another,
    with no session: every request after was refused "alloc before hello", for good, while the sender took the
    receiver for up. The sender names its connection now (a random routing id, presented again), so the receiver
    knows it for the same one, and every request after is served, every byte checked. (A connection the receiver
    does not know, a session it forgot, is answered no_session, and the sender says Hello again:
    tests/test_sessions.py.)"""
    from pdpush.config import endpoint_host_port
    from tests.helpers import TcpCutter

    lay = KVLayout(3, 2, 64, "float16", 16)
    rx = daemons.receiver(**rx_opts(lay))
    cutter = TcpCutter(endpoint_host_port(rx.info["control_endpoint"]))
    tx = daemons.sender()
    pc = PrefillClient(lay, sock(tx), receiver=f"tcp://127.0.0.1:{cutter.port}", timeout_s=10)
    dc = DecodeClient(sock(rx), timeout_s=10)

    def round_trip(rid: str, seed: int) -> str:
        ids = list(range(seed * 1000, seed * 1000 + 40))
        k, v = kv(lay, len(ids), seed)
        try:
            push(pc, rid, ids, k, v)
        except PdpushError as e:
            return e.code.value
        got_k, got_v = read_back(dc, rid, lay, len(ids))
        assert np.array_equal(got_k, k) and np.array_equal(got_v, v)
        return "ok"

    try:
        assert round_trip("before", 1) == "ok" and cutter.accepted == 1
        cutter.cut()
        until(lambda: cutter.accepted == 2, 10, "ZeroMQ to make the connection again")
        outcomes = [round_trip(f"after-{i}", 2 + i) for i in range(3)]
        assert outcomes == ["ok", "ok", "ok"] and cutter.accepted == 2, outcomes  # the same session, no Hello
        assert status(sock(tx))["sessions_lost"] == 0
    finally:
        pc.close()
        dc.close()
        cutter.close()
