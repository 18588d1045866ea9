"""pdpush's tooling: benchmarks (``bench/``), the demo (``demo/``), drivers of real vLLM engines for tests and
benches (``harness/``) and the reference peer of the transport tests (``peer.py``).

Not the product: ``pdpush`` never imports it, except that its CLI adds ``demo`` and ``bench`` from ``cli.py``
where this package is installed.
"""
