"""The decode client's ``WaitPolicy`` (``DecodeRequest.wait_layer``), driven directly: its readiness words are a
stand-in that lands at a chosen time, and its receiver's mail never brings anything (a request completing on
the data path: no notice comes until the receiver next looks)."""

from __future__ import annotations

import time

import pytest

from pdpush.client.connection import WaitPolicy
from pdpush.client.decode import DecodeRequest
from pdpush.errors import TransportTimeout
from pdpush.layout import KVLayout


class _QuietReceiver:
    """A connection whose receiver sends nothing: each look at the mail waits until its deadline."""

    def __init__(self) -> None:
        self.mail: dict = {}
        self.waits: list[float] = []  # how long each look at the mail was allowed to wait

    def recv_for(self, req_id, deadline: float, grants: bool = False, life=None):
        self.waits.append(deadline - time.monotonic())
        time.sleep(max(0.0, deadline - time.monotonic()))
        raise TransportTimeout("nothing")


def _request(policy: WaitPolicy, lands_after_s: float) -> tuple[DecodeRequest, _QuietReceiver]:
    conn = _QuietReceiver()
    r = DecodeRequest.__new__(DecodeRequest)
    r.req_id, r.layout, r.ready, r._life = "r", KVLayout(2, 1, 8, "float16", 4), set(), None
    r.client = type("Client", (), {"wait": policy, "timeout_s": 5.0, "_conn": conn})()
    due = time.monotonic() + lands_after_s
    r._landed = lambda layer: time.monotonic() >= due  # the layer's words in the pool from ``due`` on
    return r, conn


@pytest.mark.parametrize("policy", [WaitPolicy(spin_s=0.5), WaitPolicy(spin_s=0.5, nap_window_s=0.5)],
                         ids=["spin-longer-than-the-nap-window", "spin-and-nap-window"])
def test_a_spin_reads_the_words_until_it_ends_and_never_waits_on_the_receiver(policy):
    """A layer landing 20 ms into a 500 ms spin is seen when it lands, not a ``slice_s`` later: within the spin
    a look at the mail never waits (a spin longer than ``nap_window_s`` was cut short at it, and the wait then
    sat in the receiver's mail for a slice with the words already in)."""
    policy = WaitPolicy(spin_s=policy.spin_s, nap_window_s=policy.nap_window_s, slice_s=2.0)
    r, conn = _request(policy, lands_after_s=0.02)
    t = time.monotonic()
    r.wait_layer(0)
    assert time.monotonic() - t < 0.5 and 0 in r.ready
    assert max(conn.waits) <= 0.0


def test_after_the_spin_the_wait_reads_the_words_each_slice():
    """Past the spin and the naps, a wait looks at the mail a ``slice_s`` at a time and re-reads the words
    between: a layer landing meanwhile is seen at the end of that slice."""
    r, conn = _request(WaitPolicy(spin_s=0.001, nap_window_s=0.001, slice_s=0.05), lands_after_s=0.06)
    t = time.monotonic()
    r.wait_layer(0)
    assert 0.06 <= time.monotonic() - t < 1.0 and any(w > 0.04 for w in conn.waits)


@pytest.mark.parametrize("pages", [[3, 4, 5], [5, 2, 7], [6], []], ids=["one-run", "scattered", "one-page", "none-new"])
def test_a_layer_has_landed_once_every_new_page_holds_the_lease_id(pages):
    """``_landed``'s reading of the words (a view and one compare where the new pages are one run, a gather
    otherwise) agrees with the rule: every new page of the layer's group holds the request's lease id."""
    import numpy as np

    r = DecodeRequest.__new__(DecodeRequest)
    r.layout, r.lease_id = KVLayout(2, 1, 8, "float16", 4), 77
    r._words = np.zeros((2, 8), dtype=np.uint64)
    r._new_pages = [np.array(pages, dtype=np.int64)]
    r._checks = r._word_checks()
    assert [r._landed(la) for la in (0, 1, 2, -1)] == [not pages, not pages, False, False]  # 2, -1: no such layer
    for i, p in enumerate(pages):
        r._words[1, p] = 77
        r._words[0, p] = 76  # an older lease's word is not ours
        assert r._landed(1) == (i == len(pages) - 1) and not r._landed(0)
    r._words[1, [p for p in range(8) if p not in pages]] = 5  # other pages' words do not matter
    assert r._landed(1)
