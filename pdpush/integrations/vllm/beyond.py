"""Requests whose KV depends on more than their token ids, which pdpush's chunk keys do not cover.

A chunk key (``layout.chunk_keys``) is a hash chain over the layout and the prompt's token ids. vLLM's own block
hashes add "extra keys" where the KV depends on more (``kv_cache_utils.generate_block_hash_extra_keys``): the LoRA
adapter (its name and path), each multimodal item in the block (its hash and offset: two images of one size give
the same placeholder token ids), the request's ``cache_salt`` (tenant isolation), and prompt embeddings. Pushed
under token-only keys, such a request's chunks would be taken for another's with the same token ids, its prefix
found "already sent" (``already_sent_indexes``) and another request's KV loaded in its place: a wrong answer, and
another tenant's data. Until the keys carry vLLM's extra keys, the connector neither pushes nor loads such a
request: its decode computes the prompt itself.
"""

from __future__ import annotations

from typing import Any


def beyond_tokens(request: Any) -> str:
    """What besides its token ids ``request``'s KV depends on (as vLLM's block hashes count it), or "" for nothing."""
    if getattr(request, "lora_request", None) is not None:
        return "a LoRA adapter"
    if getattr(request, "mm_features", None):
        return "multimodal inputs"
    if getattr(request, "cache_salt", None):
        return "a cache_salt"
    if getattr(request, "prompt_embeds", None) is not None:
        return "prompt embeddings"
    return ""
