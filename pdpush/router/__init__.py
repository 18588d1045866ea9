"""``pdpush router``: the cache-aware OpenAI-compatible front (app.py), its placement (pure,
placement.py), instance health (fleet.py), receivers' chunk-index feeds (feeds.py) and prompt
tokenization (tokens.py)."""
