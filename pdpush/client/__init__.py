"""Clients used inside engines: PrefillClient (to the sender) and DecodeClient (to the receiver).

Canonical KV input/output at this API: per layer, the layout's components each shaped
``[tokens, kv_heads, head_dim]`` (token-major): K and V for attention, the latent
``[tokens, 1, D]`` for MLA. Engine layouts (HF ``[B, H, S, D]``, vLLM paged blocks) are
converted by the integrations; the bytes are placed by the KV codec (kvcodec.py).

In-page layout: ``page[H, C, chunk_tokens, head_dim]`` (see layout.py).
Zero-copy: the prefill side writes straight into the sender's staging
memory; the decode side gets views straight into the receiver's pool.

Imports numpy; torch only when a torch tensor is passed or asked for.

By role, as vLLM splits its NIXL connector: ``prefill.py`` (the sender's client), ``decode.py`` (the
receiver's client), ``connection.py`` (what both use: the daemon connection, shared memory, ``status``).
"""

from pdpush.client.connection import DEFAULT_WAIT, WaitPolicy, status
from pdpush.client.decode import DecodeClient, DecodeRequest, PendingOpen
from pdpush.client.prefill import PendingBegin, PrefillClient, PushHandle

__all__ = ["DEFAULT_WAIT", "DecodeClient", "DecodeRequest", "PendingBegin", "PendingOpen", "PrefillClient", "PushHandle",
           "WaitPolicy", "status"]
