"""The protocol's fast path (fastcodec.py) against its authority, msgpack and pydantic (no sockets).

What the derived msgspec types accept must be exactly the message pydantic makes of the same frame; what they refuse
goes to pydantic. Checked on every message's frame, and on frames mutated at their edges: bounds, types, missing and
extra fields, nested layouts, duplicate keys."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdpush import protocol as P
from pdpush.errors import ErrorCode, IncompatiblePeer, PdpushError
from pdpush.layout import KVLayout
from pdpush_tools.bench import codec, report
from tests.test_protocol import KEY, SAMPLES


def _authority(frame: bytes):
    """What decoding gave before the fast path: msgpack, then pydantic. A message, or the error's class."""
    try:
        return P.decode(frame, fast=False)
    except PdpushError as e:
        return type(e)


def _same(frame: bytes) -> bool:
    """Whether the fast path took ``frame``; fails where it took it as anything but the authority's message."""
    fast = P._fast.decode(frame)
    if fast is None:
        return False
    slow = _authority(frame)
    assert isinstance(slow, P.Msg), f"fast path accepted what pydantic refuses ({slow.__name__}): {frame!r}"
    assert type(fast) is type(slow) and fast == slow and P.encode(fast) == P.encode(slow)
    return True


def test_every_message_type_is_derived():
    assert P._fast.skipped == {}


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: m.type)
def test_encode_is_byte_for_byte_the_dict_encoding_and_the_fast_path_takes_it_back(msg):
    d = msg.model_dump(mode="python")
    if isinstance(msg, P.Error) and msg.attempt == 0:  # (sparse: absent where it names no attempt)
        del d["attempt"]
    assert P.encode(msg) == msgpack.packb(d, use_bin_type=True)
    assert _same(P.encode(msg))


def test_an_error_that_names_no_attempt_reads_as_before_protocol_8():
    """An engine or sender of protocol 7 refuses unknown fields: an Error naming no attempt (every one on the local
    path, a Hello's refusal) leaves the field out, and is the frame protocol 7 wrote; one that names it carries it."""
    err = P.Error(code=ErrorCode.POOL_EXHAUSTED, message="full", req_id="r", retry_after_ms=5)
    assert P.encode(err) == msgpack.packb({"type": "error", "code": "pool_exhausted", "message": "full", "req_id": "r",
                                           "retry_after_ms": 5}, use_bin_type=True)
    assert P.decode(P.encode(err)) == err
    named = err.model_copy(update={"attempt": 7})
    assert msgpack.unpackb(P.encode(named))["attempt"] == 7 and P.decode(P.encode(named)) == named
    assert msgpack.unpackb(P.encode(P.error_reply(IncompatiblePeer("old")))).keys() == {
        "type", "code", "message", "req_id", "retry_after_ms"}


def test_a_layout_is_checked_by_its_validator_on_the_fast_path_too():
    bad = SAMPLES[0].model_dump(mode="python")
    bad["layout"] = {**bad["layout"], "kind": "mla"}  # kv_heads 2: an MLA latent is one head
    frame = msgpack.packb(bad, use_bin_type=True)
    assert P._fast.decode(frame) is None and _authority(frame) is P.RemoteProtocolError


def test_a_versioned_message_takes_the_fast_path_only_at_this_local_protocol():
    begin = next(m for m in SAMPLES if m.type == "begin").model_dump(mode="python")
    for v in (None, 0, P.LOCAL_PROTOCOL_VERSION - 1, P.LOCAL_PROTOCOL_VERSION + 1):
        obj = {k: x for k, x in begin.items() if k != "local_version"}
        if v is not None:
            obj["local_version"] = v
        frame = msgpack.packb(obj, use_bin_type=True)
        assert P._fast.decode(frame) is None
        with pytest.raises(IncompatiblePeer):
            P.decode(frame)


def test_string_bounds_count_characters_as_pydantic_does():
    for rid, ok in (("é" * 256, True), ("é" * 257, False), ("\U0001F600" * 256, True)):
        frame = msgpack.packb({"type": "finish", "req_id": rid}, use_bin_type=True)
        assert _same(frame) is ok
        assert isinstance(P.decode(frame), P.Finish) is ok if ok else True


def _dup(*pairs) -> bytes:
    """A msgpack map that may name a key twice (a dict cannot)."""
    return bytes([0x80 | len(pairs)]) + b"".join(msgpack.packb(k) + msgpack.packb(v, use_bin_type=True)
                                                 for k, v in pairs)


@pytest.mark.parametrize("pairs", [
    (("type", "finish"), ("req_id", "a"), ("req_id", "b")),
    (("type", "finish"), ("req_id", ""), ("req_id", "b")),
    (("type", "finish"), ("req_id", "a"), ("req_id", "")),
    (("type", "finish"), ("type", "release"), ("req_id", "a")),
])
def test_a_key_named_twice_gives_the_authority_s_answer(pairs):
    frame = _dup(*pairs)
    _same(frame)
    got = P.decode(frame) if isinstance(_authority(frame), P.Msg) else None
    assert got is None or got == _authority(frame)


def test_a_batch_decodes_each_entry_and_a_bad_one_costs_only_itself():
    good = [P.encode(m) for m in SAMPLES[:5]]
    bad = msgpack.packb({"type": "finish", "req_id": ""})
    out = P.decode_batch(P.encode_batch([*good[:2], bad, b"\x05", *good[2:]]))
    assert out[:2] == SAMPLES[:2] and out[4:] == SAMPLES[2:5]
    assert isinstance(out[2], P.RemoteProtocolError) and isinstance(out[3], P.RemoteProtocolError)
    assert P._fast.entries(b"\x91" + good[0], P.MAX_BATCH) is None  # one entry is no batch
    with pytest.raises(P.RemoteProtocolError):
        P.decode_batch(b"\x91" + good[0])


# ---- frames mutated at their edges ----

EDGE_INTS = [-(1 << 63), -9, -1, 0, 1, 3, 7, 8, 255, 256, 4095, 4096, 4097, 65535, 65536, (1 << 20), (1 << 20) + 1,
             (1 << 31) - 1, 1 << 31, 3_600_000, 3_600_001, (1 << 32) - 1, 1 << 32, (1 << 63) - 1, 1 << 63,
             (1 << 64) - 1]
EDGE_TEXT = [n * c for n in (0, 1, 16, 32, 64, 65, 255, 256, 257, 512, 513, 1024, 1025, 4096, 4097) for c in "aé"]
VALUES = st.one_of(
    st.sampled_from(EDGE_INTS), st.integers(-(1 << 63), (1 << 64) - 1), st.sampled_from(EDGE_TEXT), st.text(max_size=8),
    st.sampled_from([b"", b"k" * 15, KEY, b"k" * 17, b"t" * 32, b"t" * 33]), st.binary(max_size=8),
    st.sampled_from([True, False, None, 0.0, 1.0, 1.5, -1.0, float(1 << 64)]),
    st.sampled_from(["alloc", "begin", "commit", "words", "mha", "mla", "float16", "bfloat16", "stored", "nope",
                     "pool_exhausted", "none", "static"]),
    st.lists(st.sampled_from([0, 1, 4095, 4096, (1 << 32) - 1, 1 << 32, -1, KEY, b"k", "x", [1, 2], [1, 2, 3]]),
             max_size=4),
    st.just([]), st.just({}), st.just({"a": 1}), st.just({"pages_free": 1, "pages_total": 2,
                                                          "requests_inflight": 0}),
)


def _mutate(obj: dict, draw) -> dict:
    obj = dict(obj)
    nested = [k for k, v in obj.items() if isinstance(v, dict)]
    if nested and draw(st.booleans()):
        k = draw(st.sampled_from(nested))
        obj[k] = _mutate(obj[k], draw)
        return obj
    op = draw(st.sampled_from(["set", "set", "set", "drop", "add", "item"]))
    key = draw(st.sampled_from(sorted(obj) or ["type"]))
    if op == "drop":
        obj.pop(key, None)
    elif op == "add":
        obj[draw(st.sampled_from(["x", "extra", "type2"]))] = draw(VALUES)
    elif op == "item" and isinstance(obj.get(key), list) and obj[key]:
        items = list(obj[key])
        items[draw(st.integers(0, len(items) - 1))] = draw(VALUES)
        obj[key] = items
    else:
        obj[key] = draw(VALUES)
    return obj


@settings(max_examples=3000, deadline=None)
@given(st.sampled_from(SAMPLES), st.integers(1, 3), st.data())
def test_mutated_frames_take_the_fast_path_only_as_the_authority_s_message(msg, n, data):
    obj = msg.model_dump(mode="python")
    for _ in range(n):
        obj = _mutate(obj, data.draw)
    _same(msgpack.packb(obj, use_bin_type=True))


def test_the_bench_measures_the_begin_s_messages_both_ways():
    got = codec.measure(KVLayout(4, 2, 64, "float16", 16), idle_s=0.001, samples=2)
    assert set(got) == {"begin", "alloc", "alloc_ok", "begin_ok", "idle_ms"}
    assert all(v > 0 for k in ("begin", "alloc_ok") for v in got[k].values())
    row = report._codec_row({"codec_us": got})[0]
    assert "begin " in row and "after 1 ms asleep" in row


# ---- found by review: each was a difference from the authority ----

def test_deep_nesting_is_a_remote_protocol_error_not_a_recursion_error():
    deep = b"\x81\xa1x" + b"\x91" * 1000 + b"\xc0"  # {"x": [[[...nil...]]]}: 1 KB
    with pytest.raises(P.RemoteProtocolError):
        P.decode(deep)
    first, second = P.decode_batch(b"\x92" + deep + P.encode(SAMPLES[0]))
    assert isinstance(first, P.RemoteProtocolError) and second == SAMPLES[0]


def test_a_batch_under_any_array_header_is_read():
    body = b"".join(P.encode(m) for m in SAMPLES[:3])
    for head in (b"\x93", b"\xdc\x00\x03", b"\xdd\x00\x00\x00\x03"):
        assert P.decode_batch(head + body) == SAMPLES[:3]


def test_a_layout_padded_past_the_cache_s_bound_is_validated_but_not_kept():
    from pdpush import fastcodec

    hello = SAMPLES[0].model_dump(mode="python")
    padded = msgpack.packb(hello["layout"])
    pad = b"".join(msgpack.packb("model_id") + msgpack.packb("m" * 200) for _ in range(200))  # repeated: last wins
    n = padded[0] & 0x0F
    layout = b"\xde" + (n + 200).to_bytes(2, "big") + pad + padded[1:]
    assert len(layout) > fastcodec.MAX_CACHED
    frame = msgpack.packb({k: v for k, v in hello.items() if k != "layout"}, use_bin_type=True)
    frame = bytes([frame[0] + 1]) + frame[1:] + msgpack.packb("layout") + layout
    fastcodec._validated.cache_clear()
    assert _same(frame) and fastcodec._validated.cache_info().currsize == 0


def test_a_copy_given_a_key_it_does_not_have_encodes_its_fields_alone():
    msg = next(m for m in SAMPLES if m.type == "abort")
    assert P.encode(msg.model_copy(update={"bogus": 1})) == P.encode(msg)


def test_a_model_whose_config_or_fields_the_derived_types_do_not_reproduce_keeps_pydantic_s_path():
    from enum import Enum
    from typing import Literal

    from pydantic import ConfigDict, Field

    from pdpush import fastcodec

    class Colour(str, Enum):
        RED = "red"

    class Lowered(P.Msg):
        model_config = ConfigDict(str_to_lower=True)
        type: Literal["lowered"] = "lowered"
        name: str

    class Aliased(P.Msg):
        type: Literal["aliased"] = "aliased"
        name: str = Field(alias="Name")

    class Valued(P.Msg):
        model_config = ConfigDict(use_enum_values=True)
        type: Literal["valued"] = "valued"
        colour: Colour

    codec = fastcodec.Codec([Lowered, Aliased, Valued], pinned={}, base=P.Msg)
    assert set(codec.skipped) == {"lowered", "aliased", "valued"}
    assert codec.decode(msgpack.packb({"type": "lowered", "name": "XY"})) is None
