"""``kv_transfer_params``: what the router tells each leg and what the prefill answers, one typed model
shared by the router (router/legs.py) and the vLLM connector's scheduler side
(integrations/vllm/scheduler.py). Pure: imports neither vLLM nor the router.

* The prefill leg carries ``do_remote_decode``, the receiver to push to (``pdpush_receiver``) and the
  router's push id (``pdpush_push_id``).
* The decode leg carries ``do_remote_prefill`` and the push to load (``pdpush_req_id``), or with
  ``pdpush_claim`` the held chunks to claim (conditional disaggregation: no prefill leg).
* The prefill's answer (``request_finished``) carries what it pushed: ``pdpush_req_id``,
  ``pdpush_tokens``, ``pdpush_receiver``, ``pdpush_layout`` (its layout's fingerprint).

``parse`` reads a request's dict leniently: the fields of other connectors pass through, and a pdpush
field of the wrong kind is dropped with a warning, never a failed request.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pdpush.layout import KVLayout, chunk_keys

log = logging.getLogger("pdpush.kv_params")

PushId = str


MAX_ID = 256  # the control protocol's request id (protocol.ReqId)


def valid_push_id(v: Any) -> bool:
    return isinstance(v, str) and 0 < len(v) <= MAX_ID and v.isprintable()


class KvParams(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    pdpush_receiver: str | None = Field(None, max_length=1024)
    pdpush_push_id: PushId | None = Field(None, max_length=MAX_ID)
    pdpush_req_id: PushId | None = Field(None, max_length=MAX_ID)
    pdpush_claim: bool = False
    pdpush_tokens: int | None = Field(None, ge=0)
    pdpush_layout: str | None = Field(None, max_length=64)

    @classmethod
    def parse(cls, params: dict | None) -> KvParams:
        """A request's ``kv_transfer_params`` (None: none); pdpush fields of the wrong kind are dropped."""
        if not params:
            return cls()
        try:
            return cls.model_validate(params)
        except ValidationError as e:
            bad = {str(err["loc"][0]) for err in e.errors() if err.get("loc")}
            log.warning("pdpush: ignoring invalid kv_transfer_params fields %s", sorted(bad))
            return cls.model_validate({k: v for k, v in params.items() if k not in bad})

    def push_id_or(self, default: str) -> str:
        """The push id a router chose, else ``default`` (this engine's own)."""
        if self.pdpush_push_id is not None and valid_push_id(self.pdpush_push_id):
            return self.pdpush_push_id
        if self.pdpush_push_id is not None:
            log.warning("pdpush: ignoring an invalid pdpush_push_id %r", self.pdpush_push_id)
        return default

    def from_prefill(self, layout: KVLayout) -> bool:
        """This is the prefill's answer (``pushed``) for ``layout``: it says how many tokens it pushed, so the
        decode can plan its load without asking the receiver (``pushed_prefix``)."""
        return bool(self.pdpush_req_id and not self.pdpush_claim and self.pdpush_tokens
                    and self.pdpush_layout == layout.fingerprint())

    def pushed_prefix(self, prompt: list[int], layout: KVLayout,
                      extra: Sequence[bytes] = ()) -> tuple[int, bytes] | None:
        """What the prefill's answer says it pushed of ``prompt``: (tokens, the chunk key of ``prompt[:tokens]``).
        The decode plans its load from it with no round trip to the receiver, as vLLM's NixlConnector plans from
        its ``kv_transfer_params``; the key is what makes that safe: it covers every token of that prefix
        (``chunk_keys``), and the receiver's answer to the load's open carries the pushed request's own
        (``OpenOk.last_key``): another prompt, or another count of tokens, fails the load, recomputed. None where
        the answer says nothing (a router's decode leg, a claim), is of another layout, or of more tokens than
        the prompt has. ``extra``: the prompt's chunks' extra keys (``chunk_keys``)."""
        n = self.pdpush_tokens
        if not self.from_prefill(layout) or n is None or n > len(prompt):
            return None
        return n, chunk_keys(prompt[:n], layout, extra)[-1]

    def dump(self) -> dict[str, Any]:
        """As a ``kv_transfer_params`` dict: the fields set, and the others' as they came."""
        return self.model_dump(exclude_defaults=True)


def for_prefill(receiver: str, push_id: str) -> dict[str, Any]:
    """The prefill leg's: compute the prompt and push it to ``receiver`` under ``push_id``."""
    return KvParams(do_remote_decode=True, pdpush_receiver=receiver, pdpush_push_id=push_id).dump()


def for_decode(push_id: str, claim: bool = False) -> dict[str, Any]:
    """The decode leg's: load push ``push_id`` (``claim``: claim the held chunks, no prefill leg)."""
    return KvParams(do_remote_prefill=True, pdpush_req_id=push_id, pdpush_claim=claim).dump()


def pushed(push_id: str, tokens: int, receiver: str, layout: str) -> dict[str, Any]:
    """The prefill's answer: what it pushed, for the decode leg (built unchecked: it runs inside the engine's
    scheduler, where a raise would end the engine, and every field was checked on the way in)."""
    return KvParams.model_construct(do_remote_prefill=True, pdpush_req_id=push_id, pdpush_tokens=tokens,
                                    pdpush_receiver=receiver, pdpush_layout=layout).dump()
