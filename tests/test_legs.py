"""The legs' policy (router/legs.py) and the kv_transfer_params model the router and the connector's
scheduler side share (kv_params.py): pure logic."""

from __future__ import annotations

from dataclasses import dataclass

from pdpush import kv_params
from pdpush.kv_params import KvParams
from pdpush.router import legs


def test_each_leg_carries_the_routers_params_and_never_the_clients():
    body = {"prompt": "x", "max_tokens": 50, "max_completion_tokens": 50, "stream": True, "min_tokens": 20,
            "stream_options": {"include_usage": True}, "n": 3, "kv_transfer_params": {"pdpush_push_id": "evil"}}
    pre = legs.prefill_body(body, "tcp://r:5710", "rt-1")
    assert pre["max_tokens"] == pre["max_completion_tokens"] == pre["n"] == 1 and pre["stream"] is False
    assert pre["min_tokens"] == 1  # vLLM refuses min_tokens above max_tokens: the leg would push nothing
    assert "stream_options" not in pre and pre["kv_transfer_params"] == {
        "do_remote_decode": True, "pdpush_receiver": "tcp://r:5710", "pdpush_push_id": "rt-1"}
    dec = legs.decode_body(body, kv_params.for_decode("rt-1"))
    assert dec["kv_transfer_params"] == {"do_remote_prefill": True, "pdpush_req_id": "rt-1"}
    assert dec["max_tokens"] == 50 and dec["min_tokens"] == 20 and body["kv_transfer_params"] == {
        "pdpush_push_id": "evil"}  # not mutated
    assert "kv_transfer_params" not in legs.decode_body(body, None)  # recompute: no params at all
    assert kv_params.for_decode("rt-2", claim=True)["pdpush_claim"] is True


def test_outcomes_and_the_retry_rule():
    assert legs.prefill_outcome(200) is legs.Outcome.PUSHED
    assert legs.prefill_outcome(400) is legs.prefill_outcome(422) is legs.Outcome.REFUSED
    assert legs.prefill_outcome(500) is legs.prefill_outcome(None) is legs.Outcome.FAILED
    assert legs.gateway_status(502) and legs.gateway_status(504)  # a gateway's: the engine may have pushed
    assert not any(legs.gateway_status(s) for s in (None, 200, 400, 500, 503))

    @dataclass
    class P:
        healthy: bool
        inflight: int

    ps = [P(True, 0), P(True, 3), P(False, 0), P(True, 1)]
    assert legs.next_prefill(ps, {0}, 0) == 3  # the least loaded healthy one not tried
    assert legs.next_prefill(ps, {0, 3}, 0) == 1
    assert legs.next_prefill(ps, {0}, 1) is None  # attempts spent: the decode recomputes
    # a leg sent at once whose decode waits already: with "auto" tried again only where the instance is idle
    assert legs.retry_beside_decode("auto", 0) and not legs.retry_beside_decode("auto", 1)
    assert legs.retry_beside_decode(True, 5)
    assert legs.next_prefill([P(True, 0), P(False, 0)], {0}, 0) is None


def test_an_unread_is_owed_only_for_a_push_that_may_exist_and_that_no_decode_took():
    assert legs.unread_owed(pushed_to=True, decode_took=False, unpushed=False)
    assert not legs.unread_owed(pushed_to=False, decode_took=False, unpushed=False)  # conditional: a claim
    assert not legs.unread_owed(pushed_to=True, decode_took=True, unpushed=False)  # its decode's to read
    assert not legs.unread_owed(pushed_to=True, decode_took=False, unpushed=True)  # none made
    assert legs.linger_s(1.5, decode_took=True) == 1.5 and legs.linger_s(1.5, decode_took=False) == 0.0


def test_params_parse_leniently_and_keep_other_connectors_fields():
    p = KvParams.parse({"do_remote_decode": True, "pdpush_receiver": "tcp://r:1", "pdpush_push_id": "a b",
                        "remote_engine_id": "nixl-x"})
    assert p.do_remote_decode and p.push_id_or("own") == "a b" and p.dump()["remote_engine_id"] == "nixl-x"
    bad = KvParams.parse({"do_remote_prefill": True, "pdpush_req_id": 7, "pdpush_claim": "maybe",
                          "pdpush_push_id": "x" * 500})
    assert bad.do_remote_prefill and bad.pdpush_req_id is None and not bad.pdpush_claim
    assert bad.push_id_or("own") == "own"
    assert KvParams.parse({"pdpush_push_id": "tab\there"}).push_id_or("own") == "own"  # not printable
    assert KvParams.parse(None) == KvParams() and KvParams.parse({}).dump() == {}
    out = kv_params.pushed("p1", 40, "tcp://r:1", "ab12")
    assert KvParams.parse(out).pdpush_tokens == 40 and out["do_remote_prefill"] is True


def test_the_prefill_s_answer_plans_the_decode_s_load_only_for_its_own_layout_and_a_prompt_that_long():
    """``KvParams.pushed_prefix``: the tokens the prefill's answer says it pushed, with the chunk key of the
    decode's prompt cut there (the open checks it against the push's); nothing from a router's decode leg, a
    claim, another layout, or an answer of more tokens than the prompt."""
    from pdpush.layout import KVLayout, chunk_keys

    lay = KVLayout(2, 2, 8, "float16", 16, "m")
    prompt = list(range(3, 60))
    answer = KvParams.parse(kv_params.pushed("p-1", 40, "tcp://r:1", lay.fingerprint()))
    assert answer.from_prefill(lay)
    assert answer.pushed_prefix(prompt, lay) == (40, chunk_keys(prompt[:40], lay)[-1])
    assert answer.pushed_prefix(prompt[:40], lay) == answer.pushed_prefix(prompt, lay)
    # the key covers the count too: 8 tokens of the third chunk are not its 16
    assert answer.pushed_prefix(prompt, lay)[1] != chunk_keys(prompt, lay)[2]
    assert answer.pushed_prefix(prompt[:39], lay) is None
    other = KVLayout(2, 2, 8, "float16", 32, "m")
    assert answer.pushed_prefix(prompt, other) is None and not answer.from_prefill(other)
    for params in (kv_params.for_decode("p-1"), kv_params.for_decode("p-1", claim=True),
                   {**kv_params.pushed("p-1", 40, "tcp://r:1", lay.fingerprint()), "pdpush_claim": True}):
        assert KvParams.parse(params).pushed_prefix(prompt, lay) is None


def test_auto_legs_go_at_once_only_where_the_prefill_instance_has_nothing_in_flight():
    at_once = legs.at_once
    assert at_once("auto", 0) and not at_once("auto", 1) and not at_once("auto", 5)
    assert at_once(True, 0) and at_once(True, 3)
    assert not at_once(False, 0) and not at_once(False, 2)


def test_a_body_the_legs_could_not_send_on_is_refused_when_parsed():
    """Strict JSON in, as the legs encode it out: a number out of range (1e400 parses as infinity), NaN or
    Infinity, a lone surrogate, a body nested past MAX_BODY_DEPTH, or no object, raise ValueError (a 400)."""
    import pytest

    ok = b'{"prompt": "caf\\u00e9 \xc3\xa9", "temperature": 0.5, "messages": [{"content": [{"type": "text"}]}]}'
    assert legs.parse_body(ok)["prompt"] == "caf\u00e9 \u00e9" and legs.parse_body(ok)["temperature"] == 0.5
    deep = legs.MAX_BODY_DEPTH - 1
    deepest = legs.parse_body(b'{"prompt": "x", "a": ' + b"[" * deep + b"]" * deep + b"}")
    assert legs.prefill_body(deepest, "tcp://r:5710", "rt-1") and legs.decode_body(deepest, None)  # (deepcopy)
    for bad in (b'{"temperature": NaN}', b'{"max_tokens": 1e400}', b'{"x": -Infinity}', b'{"prompt": "\\ud800"}',
                b'{"a": ' + b"[" * (deep + 1) + b"]" * (deep + 1) + b"}", b"[" * 5000 + b"]" * 5000,
                b'["not", "an", "object"]', b"\xff\xfe", b"{"):
        with pytest.raises(ValueError):
            legs.parse_body(bad)
