"""The connector's scheduler side (vLLM importable: the engine venv) against a real receiver and sender: decode
requests that end without loading the push (or the claim) they name withdraw it, however many end at once.

The engines' own tests (tests/test_fleet.py) show one such request, aborted in a real decode engine's queue; here
many end in one step, more than the asker's 64 questions outstanding, as when many clients hang up together."""

from __future__ import annotations

import json
import subprocess

import pytest

from pdpush import launch
from pdpush_tools.harness.vllm_cluster import ROOT, VLLM_PY
from tests.test_router import LAY, push, rx_status

pytestmark = pytest.mark.vllm

ENDED = 80  # requests ending in one step: more than MAX_QUERIES (64)

_SCRIPT = """
import json, sys, time
from types import SimpleNamespace as NS

from pdpush import kv_params
from pdpush.integrations.vllm.scheduler import MAX_QUERIES, SchedulerSide
from pdpush.integrations.vllm.settings import ConnectorSettings, Endpoints
from pdpush.layout import KVLayout

sock, n, lay = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
settings = ConnectorSettings(receiver_socket=sock)
side = SchedulerSide(settings, Endpoints.of(settings), KVLayout(**lay), "t", producer=False, consumer=True)
assert n > MAX_QUERIES
for i in range(n):  # all end in one step, never scheduled: their pushes unread
    side.request_finished(NS(request_id=f"r{i}", kv_transfer_params=kv_params.for_decode(f"p{i}"),
                             prompt_token_ids=list(range(16))))
sent_at_once = n - len(side._to_withdraw)
idle = NS(total_num_scheduled_tokens=0, num_scheduled_tokens={}, scheduled_new_reqs=[],
          scheduled_cached_reqs=NS(req_ids=[], new_block_ids=[], num_computed_tokens=[], resumed_req_ids=set()))
deadline, steps = time.monotonic() + 30, 0
while (side._to_withdraw or side.asker.inflight) and time.monotonic() < deadline:
    side.build_connector_meta(idle)  # each step sends what waits, and reads the answers that came
    steps += 1
    time.sleep(0.002)
print(json.dumps({"sent_at_once": sent_at_once, "left": len(side._to_withdraw),
                  "unanswered": len(side.asker.inflight), "steps": steps,
                  "push_unread": side.stats.totals()["push_unread"]}))
"""


def test_many_decode_requests_ending_unread_in_one_step_withdraw_every_push(tmp_path):
    rx = launch.start_receiver(tmp_path, pool_pages=2 * ENDED, **LAY)
    tx = launch.start_sender(tmp_path, staging_bytes=8 << 20)
    try:
        for i in range(ENDED):  # committed, unread
            push(tx, rx, f"p{i}", [i * 16 + k for k in range(16)])
        before = rx_status(rx)
        assert before["requests_committed"] == ENDED and before["requests_given_up"] == 0
        r = subprocess.run([str(VLLM_PY), "-c", _SCRIPT, rx.info["local_endpoint"].removeprefix("ipc://"),
                            str(ENDED), json.dumps(LAY)], capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert r.returncode == 0, r.stderr[-3000:]
        out = json.loads(r.stdout.strip().splitlines()[-1])
        assert out["left"] == 0 and out["unanswered"] == 0 and out["push_unread"] == ENDED, out
        assert out["sent_at_once"] < ENDED, out  # some had to wait for room: sent at later steps
        after = rx_status(rx)
        assert after["requests_given_up"] == ENDED, after  # each dropped at once, not kept unread for its TTL
        assert after["pool_pages_free"] + after["chunks_cached"] >= 2 * ENDED - 1, after
    finally:
        tx.stop()
        rx.stop()


_DROPPED = """
import json, sys
from types import SimpleNamespace as NS

from pdpush import kv_params
from pdpush.integrations.vllm.scheduler import MAX_WITHDRAWALS, SchedulerSide
from pdpush.integrations.vllm.settings import ConnectorSettings, Endpoints
from pdpush.layout import KVLayout

sock, extra, lay = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
settings = ConnectorSettings(receiver_socket=sock)
side = SchedulerSide(settings, Endpoints.of(settings), KVLayout(**lay), "t", producer=False, consumer=True)
for i in range(MAX_WITHDRAWALS + extra):  # each ends unread while the receiver is down: its withdrawal waits
    side.request_finished(NS(request_id=f"r{i}", kv_transfer_params=kv_params.for_decode(f"p{i}"),
                             prompt_token_ids=list(range(16))))
t = side.stats.totals()
print(json.dumps({"waiting": len(side._to_withdraw), "max": MAX_WITHDRAWALS, "oldest": side._to_withdraw[0][0],
                  "inflight": len(side.asker.inflight), "dropped": t["withdrawals_dropped"],
                  "push_unread": t["push_unread"]}))
"""


def test_withdrawals_beyond_the_bound_while_the_receiver_is_down_are_dropped_and_counted(tmp_path):
    """A decode engine whose receiver is down keeps its withdrawals waiting, up to MAX_WITHDRAWALS; beyond that the
    oldest is dropped (its push waits out its TTL), counted in ``withdrawals_dropped`` and logged: never silently.
    Nothing listens at the receiver's socket here (the first few go out all the same, into the socket's queue)."""
    extra = 100
    r = subprocess.run([str(VLLM_PY), "-c", _DROPPED, str(tmp_path / "no-receiver.sock"), str(extra), json.dumps(LAY)],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    dropped = extra - out["inflight"]  # the oldest of those that waited
    assert dropped > 8 and out["dropped"] == dropped and out["push_unread"] == out["max"] + extra, out
    assert out["waiting"] == out["max"] and out["oldest"] == f"p{out['inflight'] + dropped}", out
    logged = r.stderr.count("withdrawals waiting for the receiver, which is down")
    assert logged == dropped.bit_length(), r.stderr[-3000:]  # at the 1st, 2nd, 4th, ...


_RESUMED = """
import json, sys, time
from types import SimpleNamespace as NS

from pdpush import kv_params
from pdpush.integrations.vllm.scheduler import SchedulerSide
from pdpush.integrations.vllm.settings import ConnectorSettings, Endpoints
from pdpush.layout import KVLayout

sock, lay, ids = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
settings = ConnectorSettings(receiver_socket=sock)
side = SchedulerSide(settings, Endpoints.of(settings), KVLayout(**lay), "t", producer=False, consumer=True)
req = NS(request_id="rz", kv_transfer_params=kv_params.for_decode("pz"), prompt_token_ids=ids)
side.on_new_request(req)  # (after a preemption vLLM asks again, as for a new request)
deadline = time.monotonic() + 30
while (got := side.get_num_new_matched_tokens(req, 0))[0] is None and time.monotonic() < deadline:
    time.sleep(0.005)
n, asynchronous = got
side.update_state_after_alloc(req, NS(get_block_ids=lambda: ([5, 6, 7],)), n)
# vLLM's v1 model runner: a resumed request is among the cached ones, with all of its blocks anew
so = NS(total_num_scheduled_tokens=1, num_scheduled_tokens={"rz": 1}, scheduled_new_reqs=[],
        scheduled_cached_reqs=NS(req_ids=["rz"], new_block_ids=[([5, 6, 7],)], num_computed_tokens=[n],
                                 resumed_req_ids={"rz"}))
meta = side.build_connector_meta(so)
print(json.dumps({"matched": n, "asynchronous": asynchronous,
                  "loads": [[x.req_id, x.push_id, x.block_ids, x.start, x.end] for x in meta.loads]}))
"""


def test_a_load_planned_for_a_resumed_request_goes_to_the_workers(tmp_path):
    """A decode request that first ran with no load (its receiver did not answer, say), was preempted, and on
    resuming finds its push on the receiver: vLLM counts the tokens the connector matched as loaded, and its v1
    model runner lists the resumed request among the cached ones. The load must go to the workers all the same, or
    those tokens' KV is whatever the blocks held (wrong tokens, silently). It used to be sent for new requests only."""
    rx = launch.start_receiver(tmp_path, pool_pages=16, **LAY)
    tx = launch.start_sender(tmp_path, staging_bytes=8 << 20)
    try:
        ids = list(range(3, 51))  # 48 tokens: three chunks
        push(tx, rx, "pz", ids)
        r = subprocess.run([str(VLLM_PY), "-c", _RESUMED, rx.info["local_endpoint"].removeprefix("ipc://"),
                            json.dumps(LAY), json.dumps(ids)], capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert r.returncode == 0, r.stderr[-3000:]
        out = json.loads(r.stdout.strip().splitlines()[-1])
        assert out["matched"] == 47 and not out["asynchronous"], out  # all but the last prompt token, in the forward
        assert out["loads"] == [["rz", "pz", [[5, 6, 7]], 0, 47]], out
    finally:
        tx.stop()
        rx.stop()


_NAPS = """
import json, sys, time
from types import SimpleNamespace as NS

from pdpush import kv_params
from pdpush.integrations.vllm import scheduler
from pdpush.integrations.vllm.settings import ConnectorSettings, Endpoints
from pdpush.layout import KVLayout

sock, lay, n = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
settings = ConnectorSettings(receiver_socket=sock, push_wait_s=60, query_timeout_s=30)
side = scheduler.SchedulerSide(settings, Endpoints.of(settings), KVLayout(**lay), "t", producer=False, consumer=True)
reqs = [NS(request_id=f"w{i}", kv_transfer_params=kv_params.for_decode(f"none{i}"), prompt_token_ids=list(range(40)))
        for i in range(n)]
for q in reqs:
    side.on_new_request(q)  # asked at once: the answers ("not here yet") come while we wait
time.sleep(0.5)
asked, slept = [], []  # per pass: the naps asked for, and the seconds they took (a wait ends at an answer)
real_sleep, real_wait = time.sleep, side.asker.wait
scheduler.time.sleep = lambda s: (asked.append(s), slept.append(s), real_sleep(s))[-1]


def wait(s):
    t = time.perf_counter()
    real_wait(s)
    asked.append(s)
    slept.append(time.perf_counter() - t)


side.asker.wait = wait
idle = NS(total_num_scheduled_tokens=0, num_scheduled_tokens={}, scheduled_new_reqs=[],
          scheduled_cached_reqs=NS(req_ids=[], new_block_ids=[], num_computed_tokens=[], resumed_req_ids=set()))
passes = []
for _ in range(12):  # idle steps, as vLLM runs them: the connector's metadata, then a pass over the waiting
    side.build_connector_meta(idle)
    asked.clear(), slept.clear()
    got = [side.get_num_new_matched_tokens(q, 0)[0] for q in reqs]
    passes.append({"asked": sum(asked), "slept": sum(slept), "waiting": sum(g is None for g in got)})
print(json.dumps({"nap_s": scheduler.IDLE_NAP_S, "passes": passes}))
"""


def test_an_idle_step_naps_once_however_many_requests_wait_for_their_pushes(tmp_path):
    """On a step with nothing else to run, the scheduler naps (10 ms) rather than let vLLM's loop spin a core: one
    nap a step in all, whether it is spent waiting for an answer, after one, or on a request asked very recently.
    It used to nap once per request still waiting for its push to begin: 20 of them made every step 200 ms."""
    rx = launch.start_receiver(tmp_path, pool_pages=16, **LAY)
    try:
        r = subprocess.run([str(VLLM_PY), "-c", _NAPS, rx.info["local_endpoint"].removeprefix("ipc://"),
                            json.dumps(LAY), "20"], capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert r.returncode == 0, r.stderr[-3000:]
        out = json.loads(r.stdout.strip().splitlines()[-1])
        nap = out["nap_s"]
        assert all(p["waiting"] == 20 for p in out["passes"]), out  # none of their pushes has begun
        assert all(p["asked"] <= 2 * nap + 1e-6 for p in out["passes"]), out  # not one per request
        assert all(p["slept"] >= 0.9 * nap for p in out["passes"]), out  # and never none: the loop would spin
    finally:
        rx.stop()


_CLAIM = """
import json, sys, time
from types import SimpleNamespace as NS

from pdpush import kv_params
from pdpush.integrations.vllm.scheduler import SchedulerSide
from pdpush.integrations.vllm.settings import ConnectorSettings, Endpoints
from pdpush.layout import KVLayout

sock, lay, ids, answer = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4]
settings = ConnectorSettings(receiver_socket=sock)
side = SchedulerSide(settings, Endpoints.of(settings), KVLayout(**lay), "t", producer=False, consumer=True)
if answer != "came":  # lost: the receiver makes the claim, and its answer is lost on the way (a timeout here);
    from pdpush.errors import ShuttingDown, TransportTimeout  # refused: the receiver makes none (it is draining)

    link = side.receiver.get()
    made = link.claim

    def claim(*a, **k):
        if answer == "refused":
            raise ShuttingDown("receiver is draining")
        made(*a, **k)
        raise TransportTimeout("the claim's answer did not come in time")

    link.claim = claim
    side.receiver.get = lambda: link
req = NS(request_id="rc", kv_transfer_params=kv_params.for_decode("cl", claim=True), prompt_token_ids=ids)
side.on_new_request(req)
got = side.get_num_new_matched_tokens(req, 0)  # claimed; then no blocks free for it: it waits in the queue
claimed = side.reqs["rc"].claimed
side.request_finished(req)  # and its client hangs up there: it ends, its claim never loaded
idle = NS(total_num_scheduled_tokens=0, num_scheduled_tokens={}, scheduled_new_reqs=[],
          scheduled_cached_reqs=NS(req_ids=[], new_block_ids=[], num_computed_tokens=[], resumed_req_ids=set()))
deadline = time.monotonic() + 30
while (side._to_withdraw or side.asker.inflight) and time.monotonic() < deadline:
    side.build_connector_meta(idle)
    time.sleep(0.002)
print(json.dumps({"matched": got[0], "claimed": claimed, "left": len(side._to_withdraw) + len(side.asker.inflight),
                  "push_unread": side.stats.totals()["push_unread"]}))
"""


@pytest.mark.parametrize("answer", ["came", "lost", "refused"])
def test_a_claim_its_request_never_loaded_is_withdrawn_and_its_chunks_unpinned(tmp_path, answer):
    """Conditional disaggregation: a decode request claims the chunks its receiver holds, waits in its engine's
    queue for blocks, and is aborted there (its client hung up) without loading them. The claim is withdrawn when
    the request ends, so the held chunks are unpinned at once rather than for the claim's lease (30 s); a claim of
    that id again is refused. So is one whose answer was lost (the receiver made it; the connector computes the
    prompt itself); one the receiver refused made nothing, and nothing is withdrawn."""
    from pdpush.client import DecodeClient
    from pdpush.errors import Aborted
    from pdpush.layout import KVLayout

    rx = launch.start_receiver(tmp_path, pool_pages=16, **LAY)
    tx = launch.start_sender(tmp_path, staging_bytes=8 << 20)
    try:
        ids = list(range(7, 55))  # 48 tokens: three chunks, held once this push is committed
        push(tx, rx, "held", ids)
        sock = rx.info["local_endpoint"].removeprefix("ipc://")
        r = subprocess.run([str(VLLM_PY), "-c", _CLAIM, sock, json.dumps(LAY), json.dumps(ids), answer],
                           capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert r.returncode == 0, r.stderr[-3000:]
        out = json.loads(r.stdout.strip().splitlines()[-1])
        want = {"matched": 47, "claimed": 3} if answer == "came" else {"matched": 0, "claimed": 0}
        assert out == {**want, "left": 0, "push_unread": int(answer != "refused")}, out
        after = rx_status(rx)
        if answer == "refused":
            assert after["requests_claimed"] == 0 and after["requests_withdrawn"] == 0, after
            return
        assert after["requests_claimed"] == 1 and after["requests_given_up"] == 1, after
        dc = DecodeClient(sock, timeout_s=10)
        try:
            with pytest.raises(Aborted, match="withdrawn by its decode engine"):
                dc.claim("cl", ids, KVLayout(**LAY))
        finally:
            dc.close()
    finally:
        tx.stop()
        rx.stop()


_EXTRAS = """
import json, sys, time
from types import SimpleNamespace as NS

from pdpush import kv_params
from pdpush.integrations.vllm.scheduler import SchedulerSide
from pdpush.integrations.vllm.settings import ConnectorSettings, Endpoints
from pdpush.layout import KVLayout

sock, lay, kinds, cases = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]), json.loads(sys.argv[4])
# (query_timeout_s: a question that missed it on a loaded box would mark the receiver down for the cases after it)
settings = ConnectorSettings(receiver_socket=sock, receiver="tcp://127.0.0.1:5710", push_wait_s=0.3,
                             query_timeout_s=30.0)
side = SchedulerSide(settings, Endpoints.of(settings), KVLayout(**lay), "t", producer=True, consumer=True)


def attrs(kind):
    a = dict(lora_request=None, mm_features=[], cache_salt=None, prompt_embeds=None)
    for k, v in kinds[kind].items():
        a[k] = NS(**v) if k == "lora_request" else [NS(identifier=f["identifier"], mm_position=NS(**f["mm_position"]))
                                                    for f in v] if k == "mm_features" else v
    return a


out = {"decode": {}, "prefill": {}}
for name, (kind, push_id, ids, claim) in cases.items():
    base = dict(prompt_token_ids=ids, num_prompt_tokens=len(ids), **attrs(kind))
    dec = NS(request_id=f"d-{name}", kv_transfer_params=kv_params.for_decode(push_id, claim), **base)
    side.on_new_request(dec)
    got = side.get_num_new_matched_tokens(dec, 0)
    deadline = time.monotonic() + 30
    while got[0] is None and time.monotonic() < deadline:  # (asks the receiver, and waits push_wait_s for a push)
        time.sleep(0.005)
        got = side.get_num_new_matched_tokens(dec, 0)
    out["decode"][name] = got[0]
    side.update_state_after_alloc(dec, NS(get_block_ids=lambda: ([1, 2],)), 0)  # (its load not taken: it ends)
    side.request_finished(dec)
    pre = NS(request_id=f"p-{name}", kv_transfer_params=kv_params.for_prefill("tcp://127.0.0.1:5710", f"x-{name}"),
             **base)
    side.on_new_request(pre)
    side.get_num_new_matched_tokens(pre, 0)
    so = NS(total_num_scheduled_tokens=len(ids), num_scheduled_tokens={pre.request_id: len(ids)},
            scheduled_new_reqs=[NS(req_id=pre.request_id, block_ids=([1, 2],), num_computed_tokens=0)],
            scheduled_cached_reqs=NS(req_ids=[], new_block_ids=[], num_computed_tokens=[], resumed_req_ids=set()))
    out["prefill"][name] = [[p.push_id, [e.decode() for e in p.extra]] for p in side.build_connector_meta(so).pushes]
deadline = time.monotonic() + 30
while (side._to_withdraw or side.asker.inflight) and time.monotonic() < deadline:
    side.build_connector_meta(NS(total_num_scheduled_tokens=0, num_scheduled_tokens={}, scheduled_new_reqs=[],
                                 scheduled_cached_reqs=NS(req_ids=[], new_block_ids=[], num_computed_tokens=[],
                                                          resumed_req_ids=set())))
    time.sleep(0.002)
t = side.stats.totals()
out["stats"] = {k: v for k, v in t.items() if "beyond" in k or k in ("push_unread", "recomputed:push_timeout",
                                                                       "recomputed:nothing_held")}
# an engine that names images by a per-process count (extra_keys.mm_content_hashed): its image request is not pushed
hashless = SchedulerSide(settings, Endpoints.of(settings), KVLayout(**lay), "t", producer=True, consumer=False,
                         mm_hashed=False)
for kind in ("mm", "plain"):
    ids = list(range(40))
    pre = NS(request_id=f"h-{kind}", kv_transfer_params=kv_params.for_prefill("tcp://127.0.0.1:5710", f"h-{kind}"),
             prompt_token_ids=ids, num_prompt_tokens=len(ids), **attrs(kind))
    hashless.on_new_request(pre)
    hashless.get_num_new_matched_tokens(pre, 0)
    so = NS(total_num_scheduled_tokens=len(ids), num_scheduled_tokens={pre.request_id: len(ids)},
            scheduled_new_reqs=[NS(req_id=pre.request_id, block_ids=([1, 2],), num_computed_tokens=0)],
            scheduled_cached_reqs=NS(req_ids=[], new_block_ids=[], num_computed_tokens=[], resumed_req_ids=set()))
    out["hashless"] = out.get("hashless", []) + [p.push_id for p in hashless.build_connector_meta(so).pushes]
print(json.dumps(out))
"""

# what besides its tokens each kind of request's KV depends on, as vLLM's Request has it
_KINDS = {"lora": {"lora_request": {"lora_name": "tenant-a", "lora_path": "/adapters/a"}},
          "lora_b": {"lora_request": {"lora_name": "tenant-a", "lora_path": "/adapters/b"}},
          "mm": {"mm_features": [{"identifier": "img-1", "mm_position": {"offset": 18, "length": 8}}]},
          "mm_b": {"mm_features": [{"identifier": "img-2", "mm_position": {"offset": 18, "length": 8}}]},
          "salt": {"cache_salt": "tenant-a"}, "salt_b": {"cache_salt": "tenant-b"}, "plain": {},
          "embeds": {"prompt_embeds": "a tensor"}}


def _extra(kind: str) -> list[bytes]:
    from types import SimpleNamespace as NS

    from pdpush.extra_keys import chunk_extras

    k = _KINDS[kind]
    lora = NS(**k["lora_request"]) if "lora_request" in k else None
    mm = [NS(identifier=f["identifier"], mm_position=NS(**f["mm_position"])) for f in k.get("mm_features", ())]
    return chunk_extras(NS(lora_request=lora, mm_features=mm, cache_salt=k.get("cache_salt")), LAY["chunk_tokens"])


def test_requests_whose_kv_depends_on_more_than_their_tokens_are_pushed_and_loaded_under_their_own_keys(tmp_path):
    """vLLM's block hashes add the LoRA adapter, each image's hash and the cache_salt to the token ids; so do
    pdpush's chunk keys (extra_keys.py). Four pushes of the same 40 tokens, plain, with an adapter, an image and a
    salt, each hold their own chunks on the receiver (none finds another's "already sent"); each decode loads its
    own push, and one naming a push of another adapter path, image or salt (or of none: plain) finds nothing of it
    and recomputes. A prefill pushes under the keys the decode asks with. Prompt embeddings are the one thing not
    covered: neither pushed nor loaded, and the push such a decode named is withdrawn."""
    ids = list(range(500, 540))
    rx = launch.start_receiver(tmp_path, pool_pages=64, **LAY)
    tx = launch.start_sender(tmp_path, staging_bytes=8 << 20)
    try:
        held = {kind: push(tx, rx, f"q-{kind}", ids, _extra(kind)) for kind in ("plain", "lora", "mm", "salt")}
        # plain first: the others' chunks 0 (adapter, salt) and 1, 2 (the image at tokens 18-25) are their own;
        # the image's chunk 0 has no extra, so it is the plain one's
        assert held == {"plain": [], "lora": [], "mm": [0], "salt": []}, held
        for push_id, kind in (("r-lora", "lora"), ("r-mm", "mm"), ("r-salt", "salt"), ("s-salt", "salt"),
                              ("e-plain", "plain")):  # (each decode below that does not load its push withdraws it)
            push(tx, rx, push_id, ids, _extra(kind))
        cases = {"lora": ["lora", "q-lora", ids], "mm": ["mm", "q-mm", ids], "salt": ["salt", "q-salt", ids],
                 "plain": ["plain", "q-plain", ids],
                 # another adapter path, image or salt, or none: nothing of that push is its KV (the image's
                 # chunk 0, before it, is)
                 "lora_b": ["lora_b", "r-lora", ids], "mm_b": ["mm_b", "r-mm", ids], "salt_b": ["salt_b", "r-salt", ids],
                 "plain_salted": ["plain", "s-salt", ids], "embeds": ["embeds", "e-plain", ids],
                 # no push: a claim of the chunks the receiver holds under the same keys (conditional
                 # disaggregation), made under this request's own id
                 "claim_salt": ["salt", "c-salt", ids], "claim_salt_b": ["salt_b", "c-salt-b", ids]}
        cases = {name: [*case, name.startswith("claim")] for name, case in cases.items()}
        r = subprocess.run([str(VLLM_PY), "-c", _EXTRAS, rx.info["local_endpoint"].removeprefix("ipc://"),
                            json.dumps(LAY), json.dumps(_KINDS), json.dumps(cases)], capture_output=True, text=True,
                           timeout=300, cwd=ROOT)
        assert r.returncode == 0, r.stderr[-3000:]
        out = json.loads(r.stdout.strip().splitlines()[-1])
        assert out["decode"] == {"lora": 39, "mm": 39, "salt": 39, "plain": 39,  # (the last token is computed)
                                 "lora_b": 0, "mm_b": 16, "salt_b": 0, "plain_salted": 0, "embeds": 0,
                                 "claim_salt": 39, "claim_salt_b": 0}, out
        assert out["prefill"] == {name: [] if kind == "embeds" else [[f"x-{name}", [e.decode() for e in _extra(kind)]]]
                                  for name, (kind, _, _, _) in cases.items()}, out
        assert out["stats"] == {"recomputed:beyond_tokens": 1, "push_failed:beyond_tokens": 1,
                                "recomputed:push_timeout": 3, "recomputed:nothing_held": 1, "push_unread": 6}, out
        assert out["hashless"] == ["h-plain"], out
        assert r.stderr.count("besides its token ids") == 3, r.stderr[-3000:]  # each request once, however asked
        after = rx_status(rx)
        # every push named and not loaded (the loads were not taken here), and the claim made: withdrawn, not left
        # for its TTL
        assert after["requests_given_up"] == 10, after
    finally:
        tx.stop()
        rx.stop()
