"""What besides its token ids a request's KV depends on, as chunk-key extras (``layout.chunk_keys``).

A chunk key is a hash chain over the layout and the prompt's token ids. vLLM's own block hashes add "extra keys"
where the KV depends on more (``kv_cache_utils.generate_block_hash_extra_keys``): the LoRA adapter (its name and
path), each multimodal item in the block (its hash and its offset in the block: two images of one size give the
same placeholder token ids), the request's ``cache_salt`` (tenant isolation, in the first block only: the chain
carries it) and prompt embeddings. Pushed under token-only keys, such a request's chunks would be taken for
another's with the same token ids, its prefix found "already sent" (``already_sent_indexes``) and another request's
KV loaded in its place: a wrong answer, and another tenant's data.

``chunk_extras`` gives each chunk the same extra keys vLLM gives a block (with the LoRA adapter and the salt in the
first chunk, which the chain carries into every key after it), so that the prefill, its decode and the receiver's
index all tell such a request's chunks from another's: the prefill pushes under those keys and the decode asks,
claims and checks its load's open under them. Both engines must serve the same adapter under one name and path,
as they must serve one model, and clear the receiver's pool when an adapter's files change under the same name and
path (its chunks outlive the engines). An item's identifier is vLLM's hash of its content, or the client's
``multi_modal_uuids`` or a separate renderer's hashes word for word (vLLM's own cache trusts those too; across
engines sharing a receiver, so does pdpush); an engine that hashes no content names items by a per-process count, and its multimodal requests are
beyond the keys (``mm_content_hashed``). The router keys a request's ``cache_salt`` the same way (``extras``), and knows
neither adapters nor images. Prompt embeddings are the one thing not covered (``beyond_tokens``): such a request
is neither pushed nor loaded, and its decode computes the prompt.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any


def beyond_tokens(request: Any, mm_hashed: bool = True) -> str:
    """What ``request``'s KV depends on that chunk keys cannot cover, or "" for nothing. ``mm_hashed``: the engine
    names each multimodal item by a hash of its content (``mm_content_hashed``); where it does not, an item's name
    is a count that starts again in every engine process, and two images would share it."""
    if getattr(request, "prompt_embeds", None) is not None:
        return "prompt embeddings"
    mm = getattr(request, "mm_features", None) or ()
    if mm and not mm_hashed:
        return "multimodal inputs its engine names without a content hash"
    if any(getattr(f, "identifier", None) is None for f in mm):
        return "a multimodal input with no hash"
    return ""


def mm_content_hashed(vllm_config: Any) -> bool:
    """Whether an engine of ``vllm_config`` names each multimodal item by a hash of its content. vLLM 0.32 skips the
    hashing where both its caches that need it are off (``mm_processor_cache_gb == 0`` and no prefix caching:
    ``renderers/base.py: _process_mm_uuids``) and names an item ``renderer<rank>-mm-<count>-<modality>-<i>``,
    counted from 1 in every process: the first image of every engine, and of every restart, has the same name. A
    multimodal model whose config lacks either setting (another vLLM) is taken as hashing nothing."""
    mm = getattr(getattr(vllm_config, "model_config", None), "multimodal_config", None)
    if mm is None:
        return True
    gb = getattr(mm, "mm_processor_cache_gb", None)
    prefix = getattr(getattr(vllm_config, "cache_config", None), "enable_prefix_caching", None)
    if gb is None or prefix is None:
        return False
    return not (gb == 0 and not prefix)


def chunk_extras(request: Any, chunk_tokens: int) -> list[bytes]:
    """Each chunk's extra keys for a vLLM request (its ``lora_request``, ``mm_features`` and ``cache_salt``), as
    ``chunk_keys`` takes them: ``extras`` of those."""
    return extras(chunk_tokens, lora=getattr(request, "lora_request", None),
                  mm=getattr(request, "mm_features", None) or (), salt=getattr(request, "cache_salt", None))


def extras(chunk_tokens: int, *, lora: Any = None, mm: Iterable[Any] = (), salt: str | None = None) -> list[bytes]:
    """Each chunk's extra keys (``[]`` for a request whose KV depends on its tokens alone; trailing chunks with none
    are left out): ``lora`` (its ``lora_name`` and ``lora_path``) and ``salt`` in the first chunk, each multimodal
    item (its ``identifier`` and ``mm_position``) in every chunk it overlaps, with its offset from that chunk's
    start. Chunk i holds tokens ``[i * chunk_tokens, (i + 1) * chunk_tokens)``; what it holds depends on that range
    alone, not on how many tokens the prompt has, so that a prompt cut short (a model with state pushes N - 1
    tokens) keeps its keys."""
    per: dict[int, list[list]] = {}
    if lora is not None:
        per.setdefault(0, []).append(["lora", str(lora.lora_name), str(getattr(lora, "lora_path", "") or "")])
    for f in mm:
        offset, length = int(f.mm_position.offset), int(f.mm_position.length)
        for i in range(offset // chunk_tokens, (offset + max(length, 1) - 1) // chunk_tokens + 1):
            per.setdefault(i, []).append(["mm", str(f.identifier), offset - i * chunk_tokens])
    if salt:
        per.setdefault(0, []).append(["cache_salt", str(salt)])
    if not per:
        return []
    out = [b""] * (max(per) + 1)
    for i, keys in per.items():
        out[i] = json.dumps(keys, separators=(",", ":")).encode()
    return out
