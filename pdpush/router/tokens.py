"""The prompt's token ids as the engine will see them (chat template included), for chunk keys.

Two ways, chosen by the router's ``tokenizer`` setting:
  * ``EngineTokens`` asks a vLLM instance's ``/tokenize`` (exact by construction: the engine's own
    tokenizer and template); one local HTTP round trip per request.
  * ``LocalTokens`` loads the same tokenizer here (transformers) and runs it on a thread.
``docs/bench/fleet.md`` has both measured. A prompt that cannot be tokenized is routed by load
alone (no keys), never refused for that.
"""

from __future__ import annotations

import asyncio
import os

import httpx

from pdpush.errors import ConfigError
from pdpush.extra_keys import extras


class PromptError(ValueError):
    """The request's prompt is malformed (a 400 for the client)."""


def prompt_ids_given(path: str, body: dict) -> list[int] | None:
    """Token ids given directly (``prompt`` as a list of ints), else None."""
    if path.endswith("/completions") and "chat" not in path:
        p = body.get("prompt")
        if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            return p
    return None


def check_prompt(path: str, body: dict) -> None:
    if "chat" in path:
        m = body.get("messages")
        if not isinstance(m, list) or not m or not all(isinstance(x, dict) for x in m):
            raise PromptError("'messages' must be a non-empty list of message objects")
    else:
        p = body.get("prompt")
        if isinstance(p, str) or (isinstance(p, list) and p and (
                _token_ids(p) or all(isinstance(t, str) for t in p)
                or all(isinstance(t, list) and _token_ids(t) for t in p))):
            return
        raise PromptError("'prompt' must be a string, a list of token ids (integers from 0 below 2**63), or a list "
                          "of them")


def prompt_extras(path: str, body: dict, chunk_tokens: int) -> list[bytes] | None:
    """What besides its tokens the prompt's chunk keys hash (``pdpush.extra_keys``), as far as the router can tell:
    its ``cache_salt``. None where it cannot tell: an image, audio or video part in a chat message, or prompt
    embeddings (the engine hashes what only it knows), or a salt that is not a string (the engine refuses it). Such
    a prompt is placed by load, with no hits counted. A LoRA adapter is not told either (``docs/operations.md``)."""
    if body.get("prompt_embeds") is not None:
        return None
    if "chat" in path:
        for m in body.get("messages") or ():
            c = m.get("content") if isinstance(m, dict) else None
            if isinstance(c, list) and any(not isinstance(p, dict) or p.get("type") != "text" for p in c):
                return None
    salt = body.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        return None
    return extras(chunk_tokens, salt=salt)


def _token_ids(p: list) -> bool:
    return all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 1 << 63 for t in p)


# an engine's /tokenize answers within this or the request is routed by load alone (an engine that accepts connections
# but has stopped answering kept every request from being placed for upstream_timeout_s, 300 s by default)
TOKENIZE_TIMEOUT_S = 10.0

_CHAT_KEYS = ("add_generation_prompt", "continue_final_message", "chat_template", "chat_template_kwargs",
              "add_special_tokens", "tools", "documents")
# chat_template_kwargs the local tokenizer sets itself (or that would change what it returns): the client's are dropped
_OWN_KWARGS = frozenset({"conversation", "tokenize", "return_dict", "return_tensors", "padding", "truncation",
                         "max_length", "add_generation_prompt", "continue_final_message", "chat_template", "tools",
                         "documents", "return_assistant_tokens_mask", "tokenizer_kwargs"})


class EngineTokens:
    name = "engine"

    async def ids(self, client: httpx.AsyncClient, base_url: str, path: str, body: dict) -> list[int] | None:
        given = prompt_ids_given(path, body)
        if given is not None:
            return given
        if "chat" in path:
            req = {"model": body.get("model"), "messages": body["messages"],
                   **{k: body[k] for k in _CHAT_KEYS if k in body}}
        elif isinstance(body.get("prompt"), str):
            req = {"model": body.get("model"), "prompt": body["prompt"],
                   "add_special_tokens": body.get("add_special_tokens", True)}
        else:
            return None  # a batch of prompts: routed by load
        t = client.timeout  # (its connect and pool deadlines kept: the router's connect_timeout_s)
        r = await client.post(base_url + "/tokenize", json=req, timeout=httpx.Timeout(
            connect=t.connect, read=TOKENIZE_TIMEOUT_S, write=TOKENIZE_TIMEOUT_S, pool=t.pool))
        if r.status_code == 400:
            raise PromptError(r.json().get("error", {}).get("message", r.text[:500]))
        r.raise_for_status()
        return list(r.json()["tokens"])


class LocalTokens:
    name = "local"

    def __init__(self, path: str) -> None:
        from concurrent.futures import ThreadPoolExecutor

        if not os.path.isdir(path):  # (transformers took any other name for a model hub's, and went to the internet)
            raise ConfigError(f"tokenizer = {path!r}: no such directory (give the directory of the served model's "
                              f"tokenizer files, or tokenizer = \"engine\")")
        try:
            from transformers import AutoTokenizer  # only where configured: a heavy import
        except ImportError as e:
            raise ConfigError(f"tokenizer = {path!r} needs transformers in the router's Python (pip install "
                              f"'pdpush[router,demo]', or transformers alone), or tokenizer = \"engine\": {e}") from None

        try:
            self.tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as e:
            raise ConfigError(f"tokenizer = {path!r}: no tokenizer there: {e}") from None
        # threads of its own: the loop's default executor also resolves upstream host names (httpx), and a slow
        # DNS server must not queue tokenizing, and so every routing decision, behind its lookups
        self._pool = ThreadPoolExecutor(min(32, (os.cpu_count() or 1) + 4), thread_name_prefix="pdpush-tokens")

    def _ids(self, path: str, body: dict) -> list[int] | None:
        given = prompt_ids_given(path, body)
        if given is not None:
            return given
        if "chat" in path:
            kwargs = body.get("chat_template_kwargs") or {}
            if not isinstance(kwargs, dict):
                raise PromptError("'chat_template_kwargs' must be an object")
            if body.get("chat_template") is not None or kwargs.get("chat_template") is not None:
                # a template of the client's own is not run here: a template is a program (a loop of 10^10 steps
                # held a tokenizer thread each; six such requests stopped every request's routing). Its engine
                # renders it, or refuses it (vLLM's --trust-request-chat-template); this one is routed by load
                return None
            out = self.tok.apply_chat_template(
                body["messages"], tools=body.get("tools"), documents=body.get("documents"), tokenize=True,
                add_generation_prompt=body.get("add_generation_prompt", True),
                continue_final_message=body.get("continue_final_message", False),
                **{k: v for k, v in kwargs.items() if k not in _OWN_KWARGS})
            ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
            return [int(t) for t in ids]
        if isinstance(body.get("prompt"), str):
            return list(self.tok(body["prompt"], add_special_tokens=body.get("add_special_tokens", True))["input_ids"])
        return None

    async def ids(self, client: httpx.AsyncClient, base_url: str, path: str, body: dict) -> list[int] | None:
        """The ids, within TOKENIZE_TIMEOUT_S (TimeoutError past it); a template or tokenizer that fails on the prompt
        raises as it does (the router routes it by load, and its engine answers it: vLLM takes content given as a
        list of parts, say, which a template written for strings cannot join)."""
        return await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(self._pool, self._ids, path, body),
                                      TOKENIZE_TIMEOUT_S)
