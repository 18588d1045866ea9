"""pdpush's native data plane (``_dataplane``, C++ over libucp): see ``native/src/dataplane.cpp``.

Import ``ucxx`` (or ``pdpush.transport.ucp.lib()``) first, so that libucp is the instance ucxx loaded.
"""

from pdpush_native._dataplane import CANCELED, TIMED_OUT, Batches, Pusher, Ring, UcpError, fence, progress, put_loop

__all__ = ["CANCELED", "TIMED_OUT", "Batches", "Pusher", "Ring", "UcpError", "fence", "progress", "put_loop"]
