"""Recurrent state (GDN, Mamba2) as pdpush moves it (pure logic): a state layer's page of units
(layout.StateSegment), each rank's units written and read back by the KV codec at any pair of tensor
parallel sizes dividing the units, and the layout that carries it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pdpush import kvcodec as kc
from pdpush.layout import KVLayout

# Mamba2-like: conv = [x | B | C] along its channels (B, C replicated: one group), ssm split by heads
SEGS = [("conv", "float32", (3, 8), 1, False), ("conv", "float32", (3, 4), 1, True),
        ("conv", "float32", (3, 4), 1, True), ("ssm", "float32", (4, 2, 3), 0, False)]
LAY = KVLayout(1, 2, 64, "float32", 32, state_layers=2, state=SEGS, state_units=2)


def _model_state(seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"x": rng.standard_normal((3, 8)).astype("f4"), "B": rng.standard_normal((3, 4)).astype("f4"),
             "C": rng.standard_normal((3, 4)).astype("f4"), "ssm": rng.standard_normal((4, 2, 3)).astype("f4")}
            for _ in range(LAY.state_layers)]


def _rank(f: dict, tp: int, r: int) -> dict:
    """What rank r of tp holds, as vLLM's Mamba2 does: its heads of x and ssm, every group of B and C."""
    n, h = 8 // tp, 4 // tp
    return {"conv": np.concatenate([f["x"][:, r * n:(r + 1) * n], f["B"], f["C"]], 1), "ssm": f["ssm"][r * h:(r + 1) * h]}


@pytest.mark.parametrize("tp_in,tp_out", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_state_units_written_at_one_tp_read_back_at_another(tp_in, tp_out):
    model = _model_state(1)
    page = np.zeros((LAY.state_layers, LAY.state_units, LAY.state_unit_bytes), np.uint8)  # a slot
    k = LAY.state_units // tp_in
    for r in range(tp_in):
        kc.stage_state(page[:, r * k:(r + 1) * k], [_rank(f, tp_in, r) for f in model], LAY, tp_in, r)
    k = LAY.state_units // tp_out
    for r in range(tp_out):
        got = kc.read_state(torch.from_numpy(page[:, r * k:(r + 1) * k]), LAY, tp_out, r)
        for f, g in zip(model, got, strict=True):
            want = _rank(f, tp_out, r)
            assert np.array_equal(g["conv"].numpy(), want["conv"]) and np.array_equal(g["ssm"].numpy(), want["ssm"])


def test_a_rank_s_tensor_of_another_shape_or_a_tp_splitting_a_unit_is_refused():
    page = np.zeros((2, 2, LAY.state_unit_bytes), np.uint8)  # [state layers, units, unit bytes]
    bad = [{"conv": np.zeros((3, 12), "f4"), "ssm": np.zeros((4, 2, 3), "f4")}] * 2  # a rank of 2's conv at tp 1
    with pytest.raises(ValueError, match="conv is"):
        kc.stage_state(page, bad, LAY, 1, 0)
    with pytest.raises(ValueError, match="does not divide"):
        kc.stage_state(page, bad, LAY, 4, 0)
    assert kc.state_shapes(LAY, 2) == {"conv": (3, 12), "ssm": (2, 2, 3)}


def test_the_state_is_part_of_the_layout_s_description():
    assert LAY.state_page_bytes == 2 * LAY.state_unit_bytes and LAY.push_layers == 3 and LAY.is_state(1)
    assert LAY.state_unit_bytes == (3 * 4 + 3 * 4 * 2 + 2 * 2 * 3) * 4
    assert KVLayout(**LAY.to_dict()) == LAY
    other = KVLayout(**{**LAY.to_dict(), "state_units": 1})
    assert other.fingerprint() != LAY.fingerprint() and "state_units" in LAY.mismatch(other)
    assert KVLayout(0, 1, 1, "float32", 32, state_layers=1, state=SEGS, state_units=2).push_layers == 1  # Mamba2 alone
    with pytest.raises(ValueError):
        KVLayout(1, 2, 64, "float32", 32, state_layers=1)  # state layers without segments


def _done(w, rid: str):
    from pdpush import protocol

    return next((m for m in w.to_client if getattr(m, "req_id", None) == rid
                 and isinstance(m, (protocol.Done, protocol.Error))), None)


def test_a_push_carries_each_state_layer_in_one_put_per_rank_into_a_slot_of_its_own():
    from pdpush import protocol
    from tests.test_sessions import Wire

    w = Wire(lay=LAY)
    rx = w.rx["tcp://rx-a:1"]
    ids = list(range(100, 150))  # 2 chunks
    w.push("a", ids)
    state_puts = [op for p in w.posted for op in p.ops if any(LAY.is_state(la) for la in p.token[1])]
    base = (1 << 30) + rx.geometry.state_at(rx.reqs["a"].state_slot)
    assert [(op.dst - base, op.nbytes) for op in state_puts] == [
        (s * LAY.state_page_bytes, LAY.state_page_bytes) for s in range(LAY.state_layers)]
    w.complete()
    w.complete()
    done = _done(w, "a")
    assert isinstance(done, protocol.Done) and done.bytes_sent == 2 * LAY.page_bytes + LAY.state_slot_bytes
    assert done.layers == LAY.push_layers
    # the same prompt again: its chunks are held, its state is pushed again (a state is never shared)
    w.push("b", ids)
    w.complete()
    w.complete()
    done = _done(w, "b")
    assert done.chunks_skipped == 2 and done.bytes_sent == LAY.state_slot_bytes
    assert rx.reqs["a"].state_slot != rx.reqs["b"].state_slot
    rx.check()
    # read and released: the slots come back
    for rid in ("a", "b"):
        rx.on_local(b"d", protocol.Open(req_id=rid), w.now)
        rx.on_local(b"d", protocol.Release(req_id=rid), w.now)
    assert rx.state_pool.free_pages == rx.state_pool.num_pages
    rx.check()


def test_a_push_that_fails_before_its_state_lands_frees_its_slot_after_quarantine():
    from pdpush import protocol
    from tests.test_sessions import Wire

    w = Wire(lay=LAY)
    rx = w.rx["tcp://rx-a:1"]
    w.engine(protocol.Begin(**{**_begin(list(range(60))), "req_id": "a"}))
    w.engine(protocol.LayerReady(req_id="a", layers=[0]))
    w.complete()
    w.engine(protocol.Abort(req_id="a", reason="engine gave up mid-state"))
    assert isinstance(_done(w, "a"), protocol.Error) or "a" not in w.tx.reqs
    assert "a" not in rx.reqs and rx.state_pool.free_pages == rx.state_pool.num_pages - 1  # in quarantine
    w.tick(rx.limits.quarantine_ms + 1)
    assert rx.state_pool.free_pages == rx.state_pool.num_pages and rx.pool.free_pages == rx.pool.num_pages
    rx.check()


def _begin(ids):
    from tests.test_sessions import begin

    return dict(begin("x", ids, lay=LAY))


def test_two_prefill_ranks_each_put_their_units_of_the_state_and_it_lands_with_both():
    from pdpush import protocol
    from tests.test_sessions import RANKS, Wire, begin

    w = Wire(lay=LAY, shards=1)
    rx = w.rx["tcp://rx-a:1"]
    for r in (0, 1):
        w.engine(begin("t", list(range(40)), lay=LAY, tp_rank=r, tp_size=2), RANKS[r])
    for r in (0, 1):
        w.engine(protocol.LayerReady(req_id="t", layers=list(range(LAY.push_layers))), RANKS[r])
    share = LAY.state_page_bytes // 2
    state = [op for p in w.posted for op in p.ops if op.nbytes == share]
    base = (1 << 30) + rx.geometry.state_at(rx.reqs["t"].state_slot)
    assert sorted(op.dst - base for op in state) == sorted(  # each rank its units of each state layer: one put
        s * LAY.state_page_bytes + r * share for s in range(LAY.state_layers) for r in (0, 1))
    w.complete()
    w.complete()
    for r in (0, 1):
        w.engine(protocol.Finish(req_id="t"), RANKS[r])
    w.complete()
    assert rx.reqs["t"].state is protocol.ReqState.COMMITTED and rx.reqs["t"].layers_done == set(range(LAY.push_layers))
    rx.check()


def test_a_repeated_prompt_s_state_is_ready_to_a_decode_that_opens_after_the_commit():
    """Every chunk held: only the state moves, and an open after the commit finds every layer, its state
    layers too (nothing to wait for)."""
    from pdpush import protocol
    from tests.test_sessions import Wire

    w = Wire(lay=LAY)
    rx = w.rx["tcp://rx-a:1"]
    for rid in ("a", "b"):
        w.push(rid, list(range(100, 132)))  # 2 whole chunks
        w.complete()
        w.complete()
    ok = next(a.msg for a in rx.on_local(b"d", protocol.Open(req_id="b"), w.now) if isinstance(a.msg, protocol.OpenOk))
    assert ok.committed and set(ok.layers_ready) == set(range(LAY.push_layers))


def test_a_state_slot_taken_by_an_allocation_that_then_fails_is_free_at_once():
    """No AllocResponse went out, so nothing can write the slot late: it is not quarantined."""
    from pdpush import protocol
    from pdpush.layout import chunk_keys
    from tests.test_sessions import receiver

    rx = receiver(pages=2, lay=LAY)
    rx.on_control(b"s", protocol.Hello(version=protocol.PROTOCOL_VERSION, fingerprint=LAY.fingerprint(),
                                       layout=protocol.LayoutSpec(**LAY.to_dict())), 0)
    for i in range(5):  # 4 chunks each: the pool of 2 pages never fits, every try fails after its slot
        out = rx.on_control(b"s", protocol.AllocRequest(req_id=f"r{i}", chunk_keys=chunk_keys(list(range(100)), LAY),
                                                        last_chunk_tokens=4, lease_ms=1000), 0)
        assert out[-1].msg.code.value == "too_large"
    assert rx.state_pool.free_pages == rx.state_pool.num_pages
    rx.check()


def test_an_aborted_requests_state_slot_counts_against_its_sender_until_it_is_free():
    """A sender's ended requests count against ``max_inflight_bytes_per_sender`` while their pages wait or sit in
    quarantine, and so do their state slots (a state slot each: a model with state layers could otherwise have its
    slots held by a sender aborting request after request)."""
    from pdpush import protocol
    from pdpush.errors import ErrorCode
    from pdpush.layout import chunk_keys
    from tests.test_sessions import receiver

    page_set = LAY.layers * LAY.page_bytes
    slot = LAY.state_slot_bytes  # what one request takes beside its pages
    rx = receiver(pages=8, lay=LAY, quarantine_ms=1000, max_inflight_bytes_per_sender=3 * page_set + 2 * slot)
    rx.on_control(b"s", protocol.Hello(version=protocol.PROTOCOL_VERSION, fingerprint=LAY.fingerprint(),
                                       layout=protocol.LayoutSpec(**LAY.to_dict())), 0)

    def alloc(rid: str, first: int, now: int):
        return rx.on_control(b"s", protocol.AllocRequest(req_id=rid, chunk_keys=chunk_keys(list(range(first, first + 32)),
                                                                                         LAY),
                                                         last_chunk_tokens=32, lease_ms=1000), now)[-1].msg

    assert isinstance(alloc("a", 0, 0), protocol.AllocResponse)  # one page and a slot
    rx.on_control(b"s", protocol.Abort(req_id="a", settled=True), 1)  # its page and slot in quarantine
    assert isinstance(alloc("b", 100, 2), protocol.AllocResponse)  # a's page and slot + b's: within the cap
    err = alloc("c", 200, 3)  # a's, b's and c's slots: past it (their pages alone would not be)
    assert isinstance(err, protocol.Error) and err.code is ErrorCode.POOL_EXHAUSTED
    rx.on_tick(1002)  # a's page and slot out of quarantine
    assert isinstance(alloc("c", 200, 1003), protocol.AllocResponse)
    rx.check()


def test_an_allocation_of_a_state_slot_outside_the_pool_fails_its_request_before_any_put():
    """A state slot is a remote address too: one at or past the receiver's ``state_slots`` fails the request,
    however few it says it has (none, here: a receiver that cannot hold state)."""
    from pdpush import protocol
    from pdpush.errors import ErrorCode
    from pdpush.sessions.receiver import ToSender
    from tests.test_sessions import Wire, begin

    w = Wire(lay=LAY, shards=1)
    rx = w.rx["tcp://rx-a:1"]
    orig = rx.on_control

    def liar(ident, msg, now, *a, **k):
        fix = {protocol.AllocResponse: {"state_slot": 0}, protocol.HelloAck: {"state_slots": 0}}
        return [ToSender(b.ident, b.msg.model_copy(update=fix[type(b.msg)]))
                if isinstance(b, ToSender) and type(b.msg) in fix else b for b in orig(ident, msg, now, *a, **k)]

    rx.on_control = liar
    w.engine(begin("s", list(range(40)), lay=LAY))
    err = w.outcome("s")
    assert isinstance(err, protocol.Error) and err.code is ErrorCode.BAD_MESSAGE and "state slot" in err.message
    assert not w.handles and not w.posted and "s" not in rx.reqs
