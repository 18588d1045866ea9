"""The legs' policy (pure logic: no I/O, no clock): what each leg's request body is, what a leg's answer
means, and where a failed prefill leg is tried again. app.py moves the bytes.

* A prefill leg computes one token (``max_tokens = 1``, not streamed, one choice) and pushes the
  prompt's KV to the decode instance's receiver (``kv_params.for_prefill``).
* Its answer: 200 is done (its ``kv_transfer_params`` say what it pushed); a 4xx would be refused
  anywhere, so the decode instance recomputes (it says why); anything else, or no answer, is tried
  once more on another healthy prefill instance, the least loaded, under the same push id.
* The decode leg is the client's body with the router's ``kv_transfer_params`` in place of any the
  client sent (push ids are the router's). It goes with the prefill leg (both at once) or after its answer
  (``at_once``).
* Both legs carry the client's W3C trace context (``traceparent``, ``tracestate``), so that a trace spans
  the router and both engines, and its ``Authorization`` unless the router checks a key of its own.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Mapping, Sequence
from enum import Enum
from typing import Protocol

PREFILL_ATTEMPTS = 2
PASSED_HEADERS = ("traceparent", "tracestate")  # W3C Trace Context
MAX_PASSED_HEADER = 512  # tracestate: at most 32 members of 256 bytes is the spec; keep it short and bounded


def sendable(v: str | None) -> bool:
    """A header value the legs can carry: printable ASCII (httpx refuses anything else when it builds the request,
    and that failure was counted against the engine: two such requests ejected every prefill instance)."""
    return bool(v) and v.isascii() and v.isprintable()


def upstream_headers(incoming: Mapping[str, str], own_key: bool) -> dict[str, str]:
    """The client's headers both legs carry: its trace context, and ``Authorization`` unless the router
    checked a key of its own (that key is not passed on). ``incoming`` is case-insensitive (Starlette's);
    oversized values, and values not printable ASCII, are dropped rather than forwarded. Answers are asked for
    uncompressed: a stream is relayed as its bytes come (a gateway's gzip would reach the client undeclared)."""
    out = {k: v for k in PASSED_HEADERS if sendable(v := incoming.get(k)) and len(v) <= MAX_PASSED_HEADER}
    if not own_key and sendable(auth := incoming.get("authorization")):
        out["authorization"] = auth
    out["accept-encoding"] = "identity"
    return out


class Outcome(Enum):
    PUSHED = "pushed"  # 200
    REFUSED = "refused"  # 4xx: the same anywhere; the decode recomputes
    FAILED = "failed"  # 5xx or no answer: another instance may do it


class _Inst(Protocol):
    healthy: bool
    inflight: int


def at_once(setting: bool | str, prefill_inflight: int) -> bool:
    """Whether the decode leg goes with the prefill leg (``concurrent_legs``) rather than after its answer.

    At once, the decode instance's leg (its request, scheduling, the open of the push) runs while the prefill
    computes, and it loads each layer as it lands: docs/bench/fleet.md measured the first token about 0.76x as late.
    But its engine waits for the push to begin on the receiver, and recomputes the prompt once its connector's
    ``push_wait_s`` passed (2 s by default): a prefill leg queued behind others could miss that. ``auto`` sends
    both at once only where the prefill instance has no leg of this router in flight (``prefill_inflight``,
    this one not counted), so that the push begins as soon as the prefill engine schedules it."""
    return prefill_inflight == 0 if setting == "auto" else bool(setting)


MAX_BODY_DEPTH = 128  # OpenAI requests nest a few levels, tools' JSON schemas a few dozen: deepcopy goes deeper


def parse_body(data: bytes) -> dict:
    """A client's request body, as the legs will send it on: a JSON object that encodes back to strict JSON (no
    NaN or infinity, 1e400 included; no lone surrogate) and nests at most ``MAX_BODY_DEPTH`` levels. Anything
    else raises ValueError (a 400): such a body made the legs' encoding fail after the router had counted them
    in flight, and the counts stayed (16 such requests made a decode instance look saturated for good)."""
    def finite(text: str) -> float:
        x = float(text)
        if not math.isfinite(x):
            raise ValueError(f"number {text[:20]} out of range")
        return x

    def constant(name: str):
        raise ValueError(f"{name} is not JSON")

    try:
        body = json.loads(data, parse_float=finite, parse_constant=constant)
        json.dumps(body, allow_nan=False, ensure_ascii=False).encode()
    except RecursionError:
        raise ValueError(f"nested deeper than {MAX_BODY_DEPTH} levels") from None
    except UnicodeError as e:
        raise ValueError(f"not UTF-8 (a lone surrogate?): {e}") from None
    if not isinstance(body, dict):
        raise ValueError("the body must be a JSON object")
    level = [body]
    for _ in range(MAX_BODY_DEPTH):
        level = [v for x in level for v in (x.values() if isinstance(x, dict) else x)
                 if isinstance(v, (dict, list))]
        if not level:
            return body
    raise ValueError(f"nested deeper than {MAX_BODY_DEPTH} levels")


def prefill_body(body: dict, receiver: str, push_id: str) -> dict:
    from pdpush.kv_params import for_prefill

    b = copy.deepcopy(body)
    b["max_tokens"] = 1
    if "max_completion_tokens" in b:
        b["max_completion_tokens"] = 1
    if isinstance(b.get("min_tokens"), int) and b["min_tokens"] > 1:
        b["min_tokens"] = 1  # vLLM refuses min_tokens above max_tokens: the prefill leg would push nothing
    b["stream"] = False
    b.pop("stream_options", None)
    b["n"] = 1
    b["kv_transfer_params"] = for_prefill(receiver, push_id)
    return b


def decode_body(body: dict, params: dict | None) -> dict:
    b = copy.deepcopy(body)
    b.pop("kv_transfer_params", None)
    if params:
        b["kv_transfer_params"] = params
    return b


def prefill_outcome(status: int | None) -> Outcome:
    """A prefill leg's answer (``status`` None: it could not be reached or broke off)."""
    if status == 200:
        return Outcome.PUSHED
    if status is not None and 400 <= status < 500:
        return Outcome.REFUSED
    return Outcome.FAILED


def gateway_status(status: int | None) -> bool:
    """A 502 or 504: a gateway's answer (vLLM's server gives neither), whose engine may have taken the leg, and
    pushed, before it broke or timed out. Unsure, as a broken answer is."""
    return status in (502, 504)


def unread_owed(pushed_to: bool, decode_took: bool, unpushed: bool) -> bool:
    """Whether a request that has ended owes its receiver an ``Unread``: a prefill leg pushed (``pushed_to``: not
    conditional), no decode engine took a leg naming the push and kept it (``decode_took``: its request's first
    byte went out, and no error status or broken connection came back), and the prefill leg may have pushed
    (``unpushed``: every try surely pushed nothing)."""
    return pushed_to and not decode_took and not unpushed


def linger_s(setting_s: float, decode_took: bool) -> float:
    """How long a prefill leg sent beside its decode leg may run on after that leg's answer ended: the setting
    (``prefill_leg_linger_s``) where a decode engine took the decode leg and may still load the push; none where
    none did, since nobody will read it."""
    return setting_s if decode_took else 0.0


def next_prefill(prefills: Sequence[_Inst], tried: set[int], attempt: int) -> int | None:
    """After a failed attempt: the healthy prefill instance not tried yet with the fewest in flight, while
    attempts remain; None: the decode instance recomputes."""
    if attempt + 1 >= PREFILL_ATTEMPTS:
        return None
    others = [i for i, p in enumerate(prefills) if p.healthy and i not in tried]
    return min(others, key=lambda i: prefills[i].inflight) if others else None


def retry_beside_decode(setting: bool | str, prefill_inflight: int) -> bool:
    """Whether a prefill leg sent at once with its decode leg, which failed, is tried again on the instance
    ``next_prefill`` chose, which has ``prefill_inflight`` legs of this router in flight. The decode is waiting for
    the push already, its ``push_wait_s`` running since its first question: with ``auto``, as ``at_once``, only an
    idle instance begins it soon enough; otherwise the leg is given up and withdrawn (app.py), and the decode
    recomputes at once rather than after its wait. ``true`` tries anywhere (its push_wait_s is set above the
    prefill queues, as the docs ask)."""
    return setting != "auto" or prefill_inflight == 0
