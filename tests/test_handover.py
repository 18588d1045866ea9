"""The GPU path's hand-over logic, where it runs without a GPU: the pure queue (order, deadlines,
drop), D2HStager's thread and poll modes with fences the test completes, the device-side staging
order against an independent reference, and the CPU fallback (no CUDA, no torch without a driver)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import types

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdpush import kvcodec, protocol
from pdpush.client.prefill import Stopping
from pdpush.errors import HandOverTimeout, RemoteProtocolError
from pdpush.handover import HandOverQueue
from pdpush.layout import KVLayout, StagingShares, rank_heads, runs


class Fence:
    """Completes when the test says so (stands in for a CUDA event)."""

    def __init__(self) -> None:
        self.done = threading.Event()

    def query(self) -> bool:
        return self.done.is_set()

    def synchronize(self) -> None:
        self.done.wait(5)


# ---------------------------------------------------------------- the pure queue

def test_a_layer_is_handed_over_only_after_its_copy_and_never_before_an_earlier_one():
    q = HandOverQueue(timeout=10)
    f = [Fence() for _ in range(4)]
    for i in range(4):
        q.submit("a", i, f[i], now=0)
    assert q.ready() == []
    f[2].done.set()  # a later copy reports done first: nothing may overtake layer 0
    assert q.ready() == []
    f[0].done.set()
    assert [c.layer for c in q.ready()] == [0]
    f[1].done.set()
    assert [c.layer for c in q.ready()] == [1, 2]
    assert q.pending("a") == 1 and q.head().layer == 3


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 2), min_size=1, max_size=12), st.randoms(use_true_random=False))
def test_hand_overs_follow_submission_order_whatever_the_completion_order(reqs, rnd):
    q = HandOverQueue(timeout=10)
    fences, order = [], []
    for i, r in enumerate(reqs):
        fences.append(Fence())
        q.submit(r, i, fences[-1], now=0)
    completion = list(range(len(reqs)))
    rnd.shuffle(completion)
    for i in completion:
        fences[i].done.set()
        for c in q.ready():
            assert c.fence.query()
            order.append(c.layer)
    assert order == list(range(len(reqs))) and len(q) == 0


def test_deadlines_name_each_overdue_request_once():
    q = HandOverQueue(timeout=5)
    q.submit("a", 0, Fence(), now=0)
    q.submit("a", 1, Fence(), now=1)
    q.submit("b", 0, Fence(), now=3)
    assert q.overdue(4.9) == []
    assert q.overdue(5) == ["a"]
    assert q.overdue(8) == ["a", "b"]


def test_a_dropped_request_is_never_handed_over_but_its_copies_stay_until_done():
    q = HandOverQueue(timeout=5)
    fa, fb = Fence(), Fence()
    q.submit("a", 0, fa, now=0, keep="tensor-a")
    q.submit("b", 0, fb, now=0)
    assert q.drop("a") == 1 and q.pending("a") == 0 and q.pending() == 1
    assert len(q) == 2 and q.head().keep == "tensor-a"  # what the copy reads stays referenced
    assert q.overdue(100) == ["b"]
    fa.done.set()
    fb.done.set()
    assert [(c.request, c.layer) for c in q.ready()] == [("b", 0)]
    assert len(q) == 0
    q.submit("a", 0, Fence(), now=0)  # the same request id again is a new request
    assert q.pending("a") == 1


def test_a_layer_copied_twice_at_once_is_refused():
    q = HandOverQueue(timeout=5)
    q.submit("a", 0, Fence(), now=0)
    with pytest.raises(ValueError, match="already being copied"):
        q.submit("a", 0, Fence(), now=0)


def test_the_queue_names_a_copy_still_running_dropped_or_not():
    """What an Abort must wait for: a request's copies still writing staging, dropped or not."""
    q = HandOverQueue(timeout=10)
    f0, f1, g = Fence(), Fence(), Fence()
    for req, layer, f in (("a", 0, f0), ("a", 1, f1), ("b", 0, g)):
        q.submit(req, layer, f, now=0)
    assert q.running("a") is f0 and q.running("c") is None
    f0.done.set()
    assert q.running("a") is f1
    q.drop("a")
    assert q.running("a") is f1  # given up, and still writing
    f1.done.set()
    assert q.running("a") is None and q.running("b") is g


# ---------------------------------------------------------------- D2HStager on the CPU

torch = pytest.importorskip("torch")
from pdpush.integrations import device_copy as dc  # noqa: E402


class _Client:
    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout
        self._conn = self
        self.slices: list[float] = []
        self._stopping = Stopping()  # (as PrefillClient's)

    def allow_posts(self, slice_s: float = 0.002) -> None:
        self.slices.append(slice_s)


class Handle:
    """A PushHandle's surface as D2HStager uses it, staging in a numpy array."""

    def __init__(self, layout: KVLayout, tokens: int, held: list[int] = (), tp: int = 1, rank: int = 0,
                 shards: int = 1, req_id: str = "r") -> None:
        self.client = _Client(layout)
        self.req_id, self.tokens, self.tp_rank = req_id, tokens, rank
        self.heads = rank_heads(layout.kv_heads, tp, rank)
        self.new_chunk_indexes = [c for c in range(layout.num_chunks(tokens)) if c not in held]
        self.new_runs = runs(self.new_chunk_indexes)
        self.shares = StagingShares(layout, tp, shards, len(self.new_chunk_indexes))
        self.staging = np.zeros((layout.layers, *self.shares.share_shape()), dtype=np.uint8)
        self.calls: list[tuple[str, list[int], str]] = []
        self.aborted = ""

    def staging_layer(self, layer: int) -> np.ndarray:
        return self.staging[layer]

    def granted(self, layer: int) -> bool:  # a staging that holds every layer: nothing waits
        return True

    def new_chunks(self, layer: int) -> list[int]:
        return self.new_chunk_indexes

    def layer_shares(self, layer: int) -> StagingShares:
        return self.shares

    def layer_segments(self, layer: int, new_only: bool = False) -> list:
        return kvcodec.segments(self.new_runs, self.tokens, self.client.layout.chunk_tokens, new_only)

    def layers_ready(self, layers):
        self.calls.append(("own", list(layers), threading.current_thread().name))

    def post_layers_ready(self, layers):
        self.calls.append(("post", list(layers), threading.current_thread().name))

    def put_layer(self, layer, *comps):
        self.calls.append(("put_layer", [layer], threading.current_thread().name))

    def abort(self, reason: str = "") -> None:
        self.aborted = reason


LAY = KVLayout(layers=4, kv_heads=4, head_dim=8, dtype="float32", chunk_tokens=16, model_id="m")


def _kv(tokens: int, heads: int = 4, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, heads, 8, generator=g), torch.randn(tokens, heads, 8, generator=g)


def _until(pred, timeout_s: float = 5.0) -> None:
    end = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < end, "condition not met in time"
        time.sleep(0.005)


def _stager(mode: str, **kw) -> tuple[dc.D2HStager, list[Fence]]:
    """A CPU stager whose copies complete only when the test sets their fences."""
    fences: list[Fence] = []

    def fence():
        fences.append(Fence())
        return fences[-1]

    return dc.D2HStager("cpu", mode=mode, fence=fence, **kw), fences


def test_a_begin_of_an_id_whose_abort_waits_for_copies_waits_driving_their_hand_over_then_fails_typed():
    from pdpush.errors import DuplicateRequest

    s = Stopping()
    s.wait("x", 0)  # nothing waits: no wait
    calls: list = []
    s.begins("x", lambda: calls.append(1) or (len(calls) == 3 and s.ends("x")))  # its third hand-over sends it
    s.begins("y", lambda: calls.append("y"))  # (another stager's: never driven for "x")
    s.wait("z", 0)  # another id's Abort: no wait
    s.wait("x", 5)
    assert calls == [1, 1, 1]
    s.begins("x")  # (thread mode: no hand-over to drive, its thread sends it)
    t = time.monotonic()
    with pytest.raises(DuplicateRequest, match="have not ended"):  # (one push of the id fails, not the connection)
        s.wait("x", 0.05)
    assert time.monotonic() - t < 1


def test_closing_waits_for_the_copies_still_writing_staging_and_sends_the_aborts_that_waited_for_them():
    """The engine closes its staging after the stager: a copy still queued would write into unmapped (or another
    engine's) memory, and an Abort waiting for it was dropped."""
    st_, fences = _stager("thread", timeout_s=30)
    h = Handle(KVLayout(layers=2, kv_heads=2, head_dim=16, dtype="bfloat16", chunk_tokens=8), 16)
    k = torch.zeros(16, 2, 16, dtype=torch.bfloat16)
    st_.put_layer(h, 0, k, k)
    st_.put_layer(h, 1, k, k)
    st_.drop(h)
    sent: list = []
    st_.after_writes(h, lambda: sent.append("abort"))
    threading.Timer(0.2, fences[0].done.set).start()  # (the completion thread waits on the first, then stopped)
    threading.Timer(0.4, fences[1].done.set).start()
    t = time.monotonic()
    st_.close(timeout_s=5)
    assert sent == ["abort"] and 0.35 < time.monotonic() - t < 4


def test_closing_after_a_cuda_error_stops_all_the_same():
    """A CUDA error poisons every event: waiting for the copies at close raises, and the engine's shutdown must
    still stop the stager (and go on closing its connections)."""
    class Poisoned:
        def query(self) -> bool:
            raise RuntimeError("CUDA error: device-side assert triggered")

        synchronize = query

    st_ = dc.D2HStager("cpu", mode="thread", fence=Poisoned, timeout_s=30)
    h = Handle(KVLayout(layers=2, kv_heads=2, head_dim=16, dtype="bfloat16", chunk_tokens=8), 16)
    k = torch.zeros(16, 2, 16, dtype=torch.bfloat16)
    st_.put_layer(h, 0, k, k)
    st_.close(timeout_s=2)
    assert not st_._thread.is_alive()


def test_a_failed_page_lock_clears_its_cuda_error_where_it_can(monkeypatch):
    """cudaHostRegister's failure stays as the thread's last CUDA error, which PyTorch's next kernel launch check
    raises: the fallback to pageable memory would have crashed the forward."""
    from pdpush import shm

    cleared: list = []
    monkeypatch.setattr(shm, "_clear_cuda_error", lambda: cleared.append(1) or True)
    monkeypatch.setattr("os.path.exists", lambda p: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: types.SimpleNamespace(cudaHostRegister=lambda *a: 1))
    assert shm.pin_if_cuda(4096, 4096) is False and cleared == [1]
    monkeypatch.undo()
    found = shm._clear_cuda_error()  # (nothing raised, whatever torch this is)
    assert found is False or torch.version.cuda is not None  # a CPU torch loads no CUDA runtime


def test_thread_mode_hands_layers_over_from_its_thread_in_copy_order():
    st_, fences = _stager("thread")
    h = Handle(LAY, 40)
    k, v = _kv(40)
    try:
        for layer in range(4):
            st_.put_layer(h, layer, k, v)
        assert h.client.slices == [0.002]  # the socket's waits were shortened for posts
        time.sleep(0.05)
        assert h.calls == []  # no copy has completed: nothing handed over
        fences[1].done.set()
        time.sleep(0.05)
        assert h.calls == []  # layer 1 may not overtake layer 0
        fences[0].done.set()
        _until(lambda: sum(len(c[1]) for c in h.calls) == 2)
        assert [la for c in h.calls for la in c[1]] == [0, 1]
        assert all(kind == "post" and name == "pdpush-d2h" for kind, _, name in h.calls)
        fences[2].done.set()
        fences[3].done.set()
        st_.wait(h, timeout_s=5)
        assert [la for c in h.calls for la in c[1]] == [0, 1, 2, 3] and st_.pending() == 0
    finally:
        st_.close()


def test_poll_mode_hands_over_on_the_engines_thread_when_it_stages_or_waits():
    st_, fences = _stager("poll")
    h = Handle(LAY, 40)
    k, v = _kv(40)
    st_.put_layer(h, 0, k, v)
    fences[0].done.set()
    st_.put_layer(h, 1, k, v)  # staging layer 1 hands layer 0 over
    assert h.calls == [("own", [0], threading.current_thread().name)]
    fences[1].done.set()
    st_.wait(h, timeout_s=5)
    assert [la for c in h.calls for la in c[1]] == [0, 1]
    assert h.client.slices == []  # no other thread posts


@pytest.mark.parametrize("mode", ["thread", "poll"])
def test_a_copy_that_never_completes_fails_the_request_at_its_deadline(mode):
    st_, fences = _stager(mode, timeout_s=30)
    h = Handle(LAY, 40)
    k, v = _kv(40)
    try:
        st_.put_layer(h, 0, k, v)
        t0 = time.monotonic()
        with pytest.raises(HandOverTimeout, match="did not complete"):
            st_.wait(h, timeout_s=0.2)
        assert time.monotonic() - t0 < 5
        assert h.aborted and st_.pending(h) == 0
        fences[0].done.set()  # completing late hands nothing over
        time.sleep(0.05)
        if mode == "poll":
            st_._hand_over(post=False)
        assert h.calls == []
    finally:
        st_.close()


def test_a_failed_hand_over_surfaces_on_the_engines_next_call():
    class Broken(Handle):
        def post_layers_ready(self, layers):
            raise RemoteProtocolError("request ended on the sender")

    st_ = dc.D2HStager("cpu", mode="thread")
    h = Broken(LAY, 40)
    k, v = _kv(40)
    try:
        st_.put_layer(h, 0, k, v)
        with pytest.raises(RemoteProtocolError, match="ended on the sender"):
            st_.wait(h, timeout_s=5)
    finally:
        st_.close()


def test_cpu_default_is_the_synchronous_host_path():
    st_ = dc.D2HStager("cpu")
    assert st_.mode == "sync" and st_._stream is None and st_._thread is None
    h = Handle(LAY, 40)
    st_.put_layer(h, 2, *_kv(40))
    st_.wait(h)
    assert h.calls == [("put_layer", [2], threading.current_thread().name)]
    with pytest.raises(Exception, match="hand-over mode"):
        dc.D2HStager("cpu", mode="sometimes")


def _reference_staging(k, v, h: Handle) -> np.ndarray:
    """Staging's order, element by element (layout.StagingShares): the rank's head h0 + u*hu + j."""
    sh = h.shares
    out = np.zeros((sh.units // sh.tp, sh.n_new, LAY.kv_heads // sh.units, *LAY.page_shape[1:]), dtype=np.float32)
    units, _, hu, _, T, _ = out.shape
    h0 = h.heads[0]
    for j, c in enumerate(h.new_chunk_indexes):
        for t in range(T):
            tok = c * T + t
            if tok >= h.tokens:
                break
            for u in range(units):
                for hh in range(hu):
                    head = h0 + u * hu + hh
                    out[u, j, hh, 0, t] = k[tok, head].numpy()
                    out[u, j, hh, 1, t] = v[tok, head].numpy()
    return out


@pytest.mark.parametrize("tokens,held,tp,rank,shards", [
    (40, [], 1, 0, 1),        # a partial last chunk
    (64, [0, 2], 1, 0, 1),    # chunks already held: a gap in the new chunks
    (50, [1], 2, 1, 1),       # rank 1 of 2 takes heads 2..3 from all the model's heads
    (48, [], 1, 0, 2),        # two pool shards: two head units
    (37, [0], 2, 0, 2),
])
def test_device_side_staging_order_matches_the_layout(tokens, held, tp, rank, shards):
    h = Handle(LAY, tokens, held=held, tp=tp, rank=rank, shards=shards)
    k, v = _kv(tokens, seed=tokens)
    st_ = dc.D2HStager("cpu", mode="poll")
    st_.put_layer(h, 1, k, v)  # all the model's heads: the stager takes this rank's
    st_.wait(h)
    want = _reference_staging(k, v, h)
    got = h.staging[1].view(np.float32).reshape(want.shape)
    T = LAY.chunk_tokens
    last = h.new_chunk_indexes[-1] if h.new_chunk_indexes else None
    for j, c in enumerate(h.new_chunk_indexes):  # only tokens of the prompt are defined
        n = min(T, tokens - c * T) if c == last else T
        np.testing.assert_array_equal(got[:, j, :, :, :n], want[:, j, :, :, :n])
    assert not h.staging[0].any() and not h.staging[2].any()  # other layers untouched


def test_the_cpu_fallback_imports_no_torch_without_an_nvidia_driver(tmp_path):
    code = ("import sys, ctypes\nfrom pdpush import shm\nbuf = ctypes.create_string_buffer(1 << 16)\n"
            "print(shm.pin_if_cuda(ctypes.addressof(buf), 1 << 16), 'torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    import os
    if os.path.exists("/dev/nvidiactl"):
        pytest.skip("this host has an NVIDIA driver")  # the CPU-only claim cannot be checked here
    assert out.stdout.split() == ["False", "False"], out.stderr


# ---------------------------------------------------------------- real daemons

@pytest.mark.parametrize("ring_slots", [0, 256], ids=["messages", "ring"])
def test_posts_from_another_thread_while_the_socket_is_held_arrive_before_the_finish(daemons, ring_slots):
    """A completion thread never waits for the socket. By message (no ring), what it posts while the
    engine holds the socket is sent by the engine, ahead of the engine's own next message (the finish
    here); through the ring, its records are taken before that finish. Bytes checked."""
    from pdpush.client import DecodeClient, PrefillClient
    from tests.helpers import kv, read_back, rx_opts, sock

    lay = KVLayout(layers=4, kv_heads=2, head_dim=16, dtype="float16", chunk_tokens=8, model_id="default")
    rx = daemons.receiver(**rx_opts(lay))
    tx = daemons.sender(rx, handover_ring_slots=ring_slots)
    pc, rc = PrefillClient(lay, sock(tx), timeout_s=30), DecodeClient(sock(rx), timeout_s=30)
    try:
        k, v = kv(lay, 30, seed=5)
        h = pc.begin("posted", list(range(30)))
        for layer in range(4):
            h.stage_layer(layer, k[layer], v[layer])
        h.layers_ready([0])
        conn = pc._conn
        conn.allow_posts()
        with conn.lock:  # the engine is inside a call: posts must queue, not wait
            t = threading.Thread(target=h.post_layers_ready, args=([1, 2],))
            t.start()
            t.join(5)
            assert not t.is_alive() and (h._ring is None) == (not ring_slots)
            queued = [protocol.decode(f[0][4:]).type for f in conn._outbox]  # [frame, its number]
            assert queued == ["layer_ready"] if not ring_slots else queued in ([], ["wake"])  # ring: at most a wake
        t = threading.Thread(target=h.post_layers_ready, args=([3],))  # the socket is free: sent at once
        t.start()
        t.join(5)
        # (a wake queued under the lock leaves with the next frame; one through the ring needs none)
        assert [protocol.decode(f[0][4:]).type for f in conn._outbox] in ([], ["wake"] if ring_slots else [])
        done = h.finish(timeout_s=30)
        assert done.bytes_sent > 0
        gk, gv = read_back(rc, "posted", lay, 30)
        assert np.array_equal(gk, k) and np.array_equal(gv, v)
    finally:
        pc.close()
        rc.close()


@pytest.mark.parametrize("mode", ["thread", "poll"])
def test_stager_pushes_the_right_bytes_through_real_daemons(daemons, mode):
    """D2HStager's own path (device-side staging order, hand-over as copies complete) on the CPU,
    through a real sender and receiver; a second request sharing a prefix skips held chunks."""
    from pdpush.client import DecodeClient, PrefillClient
    from tests.helpers import read_back, rx_opts, sock

    lay = KVLayout(layers=3, kv_heads=2, head_dim=16, dtype="bfloat16", chunk_tokens=8, model_id="default")
    rx = daemons.receiver(**rx_opts(lay))
    tx = daemons.sender(rx)
    pc, rc = PrefillClient(lay, sock(tx), timeout_s=30), DecodeClient(sock(rx), timeout_s=30)
    st_ = dc.D2HStager("cpu", mode=mode, timeout_s=30)
    try:
        g = torch.Generator().manual_seed(1)
        ids = list(range(1, 45))
        for name, prompt in (("one", ids), ("two", ids[:32] + [7] * 9)):
            k = torch.randn(lay.layers, len(prompt), 2, 16, generator=g).to(torch.bfloat16)
            v = torch.randn(lay.layers, len(prompt), 2, 16, generator=g).to(torch.bfloat16)
            h = pc.begin(name, prompt)
            for layer in range(lay.layers):
                st_.put_layer(h, layer, k[layer], v[layer])
            st_.wait(h, timeout_s=30)
            done = h.finish(timeout_s=30)
            gk, gv = read_back(rc, name, lay, len(prompt))
            want = [x.view(torch.uint8).reshape(lay.layers, len(prompt), 2, 32).numpy() for x in (k, v)]
            if name == "one":
                assert done.chunks_skipped == 0
                assert np.array_equal(gk, want[0]) and np.array_equal(gv, want[1])
            else:  # the held chunks are the first request's bytes; the new ones this request's
                assert done.chunks_skipped == 4 and h.already_sent_indexes == [0, 1, 2, 3]
                assert np.array_equal(gk[:, 32:], want[0][:, 32:]) and np.array_equal(gv[:, 32:], want[1][:, 32:])
    finally:
        st_.close()
        pc.close()
        rc.close()


def test_poll_mode_hands_queued_copies_over_before_waiting_for_staging(daemons):
    """Poll mode hands copies over on the engine's thread, so before that thread waits for a staging
    block it must hand over the layers already copied: their blocks are what it waits for. A request of
    six times the sender's staging, with copies that complete a few milliseconds after they are queued."""
    from pdpush.client import DecodeClient, PrefillClient
    from tests.helpers import read_back, rx_opts, sock

    class Later:  # a copy that completes 3 ms after it was queued
        def __init__(self) -> None:
            self.at = time.monotonic() + 0.003

        def query(self) -> bool:
            return time.monotonic() >= self.at

    lay = KVLayout(layers=16, kv_heads=8, head_dim=128, dtype="float16", chunk_tokens=64)  # 768 KiB a layer
    rx = daemons.receiver(**rx_opts(lay, pool_pages=16))
    tx = daemons.sender(rx, staging_bytes=2 << 20)
    pc, rc = PrefillClient(lay, sock(tx), timeout_s=10), DecodeClient(sock(rx), timeout_s=30)
    st_ = dc.D2HStager("cpu", mode="poll", timeout_s=10, fence=Later)
    try:
        g = torch.Generator().manual_seed(2)
        k, v = (torch.randn(lay.layers, 192, 8, 128, generator=g).to(torch.float16) for _ in range(2))
        h = pc.begin("big", list(range(192)))
        for layer in range(lay.layers):
            st_.put_layer(h, layer, lambda layer=layer: (k[layer], v[layer]))
        st_.wait(h, timeout_s=10)
        assert h.finish(timeout_s=30).layers == lay.layers
        gk, gv = read_back(rc, "big", lay, 192)
        assert np.array_equal(gk, k.view(torch.uint8).reshape(lay.layers, 192, 8, 256).numpy())
        assert np.array_equal(gv, v.view(torch.uint8).reshape(lay.layers, 192, 8, 256).numpy())
    finally:
        st_.close()
        pc.close()
        rc.close()


@pytest.mark.parametrize("completes", [True, False], ids=["copies-end", "copies-stuck"])
@pytest.mark.parametrize("mode", ["thread", "poll"])
def test_an_abort_waits_for_the_copies_still_writing_its_staging(daemons, monkeypatch, mode, completes):
    """A request given up while its layers' copies are still queued on the side stream: its Abort tells the sender
    that this engine has stopped writing its staging, and the sender grants those blocks to other requests at once,
    where the late copies would land. So the Abort goes once those copies are done: in thread mode from the
    completion thread, the engine's thread going on at once; in poll mode this thread waits, up to QUIESCE_S.
    Copies that do not end send none, and the sender keeps the request (and its blocks) until its lease runs out."""
    from pdpush.client import PrefillClient, status
    from tests.helpers import rx_opts, sock, until

    monkeypatch.setattr(dc, "QUIESCE_S", 0.5)
    lay = KVLayout(layers=3, kv_heads=2, head_dim=16, dtype="bfloat16", chunk_tokens=8, model_id="default")
    rx = daemons.receiver(**rx_opts(lay))
    tx = daemons.sender(rx)
    pc = PrefillClient(lay, sock(tx), timeout_s=30)
    st_, fences = _stager(mode, timeout_s=30)
    try:
        h = pc.begin("gone", list(range(1, 25)))
        k = torch.zeros(24, 2, 16, dtype=torch.bfloat16)
        st_.put_layer(h, 0, k, k)
        st_.put_layer(h, 1, k, k)
        st_.drop(h)  # as the connector's _fail_push does, then the abort
        if completes and mode == "poll":
            threading.Timer(0.2, lambda: [f.done.set() for f in fences]).start()
        t = time.monotonic()
        h.abort("the forward failed")
        waited = time.monotonic() - t
        assert (waited < 0.1) if mode == "thread" else (waited > (0.15 if completes else 0.4)), waited
        if mode == "thread":  # the engine went on; the sender has heard nothing while the copies run
            time.sleep(0.3)
            assert status(sock(tx))["requests_inflight"] == 1
            if completes:
                for f in fences:
                    f.done.set()
        if completes:
            until(lambda: status(sock(tx))["requests_inflight"] == 0, 10, "the sender's abort")
        else:
            time.sleep(0.3)
            assert status(sock(tx))["requests_inflight"] == 1  # no Abort: kept until its lease runs out
            if mode == "poll":  # they end later: a later hand-over sends it, here a Begin of the id again's, first
                for f in fences:
                    f.done.set()
                h2 = pc.begin("gone", list(range(1, 25)))
                st = status(sock(tx))
                assert h2.req_id == "gone" and st["requests_failed"] == 1 and st["requests_inflight"] == 1
                h2.abort("done")
    finally:
        for f in fences:
            f.done.set()
        st_.close()
        pc.close()
