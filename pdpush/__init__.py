"""pdpush: push LLM KV cache from prefill to decode nodes, layer by layer, over UCX.

Importing this package imports neither torch nor UCX: the CLI stays fast.
Public API (lazy): PrefillClient, DecodeClient, Sender, Receiver, KVLayout.
"""

from __future__ import annotations

__version__ = "0.1.0"

_LAZY = {
    "PrefillClient": "pdpush.client",
    "DecodeClient": "pdpush.client",
    "Sender": "pdpush.sender",
    "Receiver": "pdpush.receiver",
    "KVLayout": "pdpush.layout",
}


def __getattr__(name: str):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'pdpush' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(mod), name)


__all__ = [*_LAZY, "__version__"]
