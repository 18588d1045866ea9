"""Engine adapters. Each converts its engine's KV layout to pdpush's canonical one at this edge only.

Nothing here is imported by ``import pdpush``.
"""
