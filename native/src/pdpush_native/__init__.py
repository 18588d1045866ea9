"""pdpush's native code: the data plane (``_dataplane``, C++ over libucp: see ``native/src/dataplane.cpp``)
and the KV codec's row copies (``_copy``: ``native/src/copy.cpp``, no UCX).

The data plane's names load on first use, so that ``pdpush_native._copy`` alone loads no libucp (an
engine's venv may have only it). Call ``pdpush.transport.ucx_lib.load()`` (``ucp.lib()`` does) before using the
data plane: it refuses a process that already holds another libucp, then loads the one this build links.
``_ucx_build`` says which UCX that is (native/CMakeLists.txt, PDPUSH_UCX).
"""

from __future__ import annotations

import importlib

__all__ = ["CANCELED", "TIMED_OUT", "Batches", "Pusher", "Ring", "UcpError", "progress", "put_loop"]


def __getattr__(name: str):
    if name in __all__:
        return getattr(importlib.import_module("pdpush_native._dataplane"), name)
    raise AttributeError(f"module 'pdpush_native' has no attribute {name!r}")
