"""Engine harnesses: real vLLM engines driven from outside, for the tests and ``make bench-vllm``.

``vllm_engine`` runs inside the vLLM venv (one engine per process);
``vllm_cluster`` starts daemons and engines from pdpush's venv and talks to them;
``vllm_api_check`` checks the connector against an installed vLLM's API.
Not imported by ``import pdpush``.
"""
