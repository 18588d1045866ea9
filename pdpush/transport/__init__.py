"""Data plane. ``ucx.py`` is the UCX implementation; ``ucp.py`` its ctypes RMA binding.

Nothing here is imported by ``import pdpush``; UCX loads only when a daemon starts.
"""
