"""The vLLM worker's load bookkeeping, with vLLM importable (the engine venv) and stand-ins for the receiver link,
the opened requests and the copies to the device: when the receiver link may be reset (closing it unmaps the pool),
and when a loaded request's pages may go back (only after every copy from them has completed: a stand-in fence
plays the CUDA event, on the CPU)."""

from __future__ import annotations

import json
import subprocess

import pytest

from pdpush_tools.harness.vllm_cluster import ROOT, VLLM_PY

pytestmark = pytest.mark.vllm

_SCRIPT = """
import json
from types import SimpleNamespace as NS

import numpy as np

from pdpush.integrations.device_copy import CopyHolds, H2DLoader
from pdpush.integrations.vllm.load import _Load
from pdpush.integrations.vllm.stats import LoadFailure, WorkerStats
from pdpush.integrations.vllm.worker import WorkerSide


class Fence:  # a copy to the device that completes when the test says
    def __init__(self):
        self.done = False

    def query(self):
        return self.done

    def synchronize(self):
        self.done = True


class Req:  # an opened request: what matters is when it is released
    def __init__(self, name):
        self.req_id, self.released, self.committed = name, 0, False

    def release(self, wait=True):
        self.released += 1

    def poll_committed(self):
        return self.committed

    def read_layer(self, layer, timeout_s=None):
        return np.zeros((1, 2, 4), np.uint8)

    geometry = NS(heads_aligned=True)


class Link:  # the receiver link: reset() closes the client, which unmaps the pool in this process
    resets = 0

    def reset(self):
        Link.resets += 1

    def flush(self):
        pass


def load(name, failed=None, asynchronous=False):
    spec = NS(req_id=name, push_id="p-" + name, start=0, end=16, asynchronous=asynchronous, claim=False, prefix_key=b"")
    return _Load(spec, Req(name), [], [], [], failed=failed, reason=LoadFailure.PUSH_FAILED if failed else None,
                 deadline=1e18)


w = WorkerSide.__new__(WorkerSide)
w.settings = NS(async_layers_per_step=4, load_timeout_s=60.0)
w.layout = NS(layers=2, state_layers=[])
w._load_order, w._layer_of, w._load_errors = [], {}, set()
w.receiver, w._holds, w._loads, w._async, w._binds = Link(), CopyHolds(), [], [], 0
w.stats = WorkerStats()
out = {}

# 1. a sync load fails while an asynchronous load still reads the pool: no reset until nothing reads it
pending = load("async", asynchronous=True)
w._async.append(pending)
w._loads.append(load("sync-failed", failed="the push was aborted"))
w.get_block_ids_with_load_errors()
out["resets_with_async_pending"] = Link.resets
pending.req.committed = True
w.poll_async_loads()
out["async_released"] = pending.req.released
w._loads.append(load("sync-failed-2", failed="the push was aborted"))
w.get_block_ids_with_load_errors()
out["resets_when_idle"] = Link.resets

# 3. a loaded request's pages go back only once the copies from them have completed
loader = H2DLoader("cpu", fence=Fence)
ld = load("copied")
ticket = loader.start(ld.req, 0)
ld.copies.append(loader.fence_of(ticket))
w._loads.append(ld)
w.get_block_ids_with_load_errors()
out["released_while_copying"] = ld.req.released
w.poll_async_loads()
out["released_still_copying"] = ld.req.released
w._loads.append(load("sync-failed-3", failed="x"))
w.get_block_ids_with_load_errors()
out["resets_while_copying"] = Link.resets
ld.copies[0].done = True
w.poll_async_loads()
out["released_after_copy"] = ld.req.released
held = Req("at-shutdown")
w._holds.release(held, [Fence()], lambda r, e: None)
w._holds.drain(lambda r, e: None)
out["released_at_shutdown"] = held.released
out["totals"] = w.stats.totals()


# 4. a layerwise load's open goes out without waiting, its answer taken at the first layer (_settle): one that no
# layer asked for is given up after the forward, one that timed out too; a refused one has nothing to give up
class Pending:
    def __init__(self, error=None):
        self.abandoned, self.error = 0, error

    def wait(self):
        raise self.error

    def abandon(self):
        self.abandoned += 1


from pdpush.errors import TransportTimeout, UnknownRequest

out["pending"] = {}
for name, error in (("unasked", None), ("late", TransportTimeout("no answer")), ("refused", UnknownRequest("gone"))):
    ld, p = load(name), Pending(error)
    ld.req, ld.pending = None, p
    if error is None:
        w._loads.append(ld)
        w.get_block_ids_with_load_errors()
    else:
        w._settle(ld)
    out["pending"][name] = [p.abandoned, ld.pending is None, ld.reason.value if ld.reason else None]

# 5. an engine and its daemon of different local protocols (separate images): a lasting condition, so the prefill
# stops asking the sender for sender_retry_s, as for a missing one, and the decode stops planned loads for
# receiver_retry_s; another refusal (a receiver of another layout, say) costs only its own request
import time

from pdpush.errors import IncompatiblePeer

skew = IncompatiblePeer("begin for 'r' is of local protocol 0 (a pdpush from before local protocol versions), "
                        "this pdpush speaks 2", req_id="r")
other = IncompatiblePeer("layout mismatch, sender vs receiver", req_id="r")
w.settings = NS(async_layers_per_step=4, load_timeout_s=60.0, sender_retry_s=30.0, receiver_retry_s=30.0)
w._prefill, w._sender_down_until, w._receiver_down_until = None, 0.0, 0.0
w.stats = WorkerStats()


def refused(e):
    raise e


w._asked(NS(req_id="r", push_id="p-r"), lambda: refused(other))
out["down_after_other"] = w._sender_down_until > time.monotonic()
w._asked(NS(req_id="r", push_id="p-r"), lambda: refused(skew))
out["down_after_skew"] = w._sender_down_until > time.monotonic() + 20
ld, p = load("skewed"), Pending(skew)
ld.req, ld.pending = None, p
w._settle(ld)
out["receiver_down_after_skew"] = w._receiver_down_until > time.monotonic() + 20
out["skew_load"] = [p.abandoned, ld.reason.value if ld.reason else None]
out["skew_totals"] = w.stats.totals()

# 6. asynchronous loads whose pushes have committed wait for the step budget behind each other as long as it takes:
# the deadline bounds the wait for the push, not this engine's copy (past it, a burst failed and recomputed)
w.settings = NS(async_layers_per_step=1, load_timeout_s=0.001)
w.layout = NS(layers=3, state_layers=[])
w._load_order, w._layer_of, w._async, w._loads = ["a", "b", "c"], {"a": 0, "b": 1, "c": 2}, [], []
w._load_layer = lambda ld, name: setattr(ld, "layers_done", ld.layers_done + 1)
waiting = load("waiting", asynchronous=True)
waiting.req.landed = lambda layer: False  # its push not in yet: the deadline holds
w._async.append(waiting)
for name in ("first", "second"):
    ld = load(name, asynchronous=True)
    ld.req.committed, ld.req.landed, ld.deadline = True, (lambda layer: True), 0.0  # landed whole, deadline past
    w._async.append(ld)
waiting.deadline = time.monotonic() + 60
steps = []
while w._async and len(steps) < 10:
    steps.append([sorted(x) for x in w.poll_async_loads()])
    waiting.deadline = 0.0 if len(steps) == 6 else waiting.deadline
out["budget_steps"] = steps

# 7. a device load prefetches the layers that have landed PREFETCH_LAYERS ahead at most, not the whole request
from pdpush.integrations.vllm import load as loadmod


class Loader:
    def start(self, req, layer, timeout_s=None):
        return layer

    def fence_of(self, ticket):
        return Fence()

    def ready(self, ticket):
        raise RuntimeError("the test stops here")


w.layout = NS(layers=40, state_layers=[])
w._loader = Loader()
ld = load("deep")
ld.req.landed = lambda layer: True  # the whole push is in
w._load_layer_staged(ld, 0, 0, None, 0)
out["prefetched"] = sorted(ld.tickets)
out["prefetch_layers"] = loadmod.PREFETCH_LAYERS

# 8. a receiver that cannot be reached (no socket, or one not reading): the first open waits out its send's deadline,
# and the loads after it are not sent for receiver_retry_s (each waited its deadline before the forward, every step)
from pdpush.errors import TransportTimeout as _Late
from pdpush.integrations.vllm.metadata import LoadSpec
from pdpush.layout import KVLayout


class NoReceiver:
    opens = 0

    def open_nowait(self, *a, **k):
        NoReceiver.opens += 1
        raise _Late("the open could not be sent within its deadline")


w.layout = KVLayout(2, 1, 64, "float32", 16, "m")
w.settings = NS(load_timeout_s=10.0, query_timeout_s=0.5, receiver_retry_s=30.0)
w.block_size, w.tp_rank, w.tp_size, w._pgroup = 16, 0, 1, [0]
w._loads, w._async, w._receiver_down_until = [], [], 0.0
w.receiver = NS(get=lambda: NoReceiver())
for i, key in enumerate((b"k" * 16, b"", b"k" * 16, b"")):  # planned from an answer, or asked about
    w._open_load(LoadSpec(f"r{i}", f"p{i}", [[1, 2, 3]], 0, 32, 40, prefix_key=key))
out["unreachable"] = {"opens": NoReceiver.opens, "failed": sum(ld.failed is not None for ld in w._loads),
                      "down": w._receiver_down_until > time.monotonic() + 20}

# 9. vLLM's finished ids of a step give up the asynchronous loads of requests it aborted, opened at an earlier step;
# a load of this step's under the same id (vLLM reuses an id aborted and sent again, where it does not randomise
# them) stays: reporting it loaded would have vLLM run it on blocks nothing wrote
w.settings = NS(async_layers_per_step=0, load_timeout_s=60.0)
w.layout = NS(layers=2, state_layers=[])
w._load_order, w._layer_of, w._holds, w._loads = ["a", "b"], {"a": 0, "b": 1}, CopyHolds(), []
w.receiver = Link()
old, new = load("r1", asynchronous=True), load("r1", asynchronous=True)
old.req.landed = new.req.landed = lambda layer: False
old.bound, new.bound, w._binds = 1, 2, 2
w._async = [old, new]
done, failed = w.poll_async_loads({"r1"})
out["aborted"] = {"done": sorted(done), "failed": sorted(failed), "left": [ld is new for ld in w._async],
                  "released": [old.req.released, new.req.released]}

# 10. the scheduler side: a request whose asynchronous load ended (vLLM's finished_recving, update_connector_output)
# no longer waits for a push: aborted then, it left none unread; one aborted while its load waits did
from pdpush.integrations.vllm.scheduler import SchedulerSide
from pdpush.integrations.vllm.settings import ConnectorSettings, Endpoints
from pdpush.layout import KVLayout

cs = ConnectorSettings(receiver_socket=str(__import__("tempfile").mkdtemp()) + "/none.sock")
side = SchedulerSide(cs, Endpoints.of(cs), KVLayout(2, 1, 64, "float32", 16), "t", producer=False, consumer=False)
side._awaiting.update({"loaded", "waiting"})
side.loads_ended({"loaded"})
for rid in ("loaded", "waiting"):
    side.request_finished(NS(request_id=rid, kv_transfer_params=None, prompt_token_ids=[1]))
out["unread"] = side.stats.totals().get("push_unread", 0)

# 11. a load whose blocks do not cover its tokens (a bug: loud, not fatal): only the blocks of the tokens it was to
# load are reported invalid, not the prefix this engine computed itself (which other running requests may share)
import logging
logging.disable(logging.ERROR)
w.layout = KVLayout(2, 1, 64, "float32", 16, "m")
w.block_size, w._pgroup, w._loads, w._async, w._load_errors = 16, [0], [], [], set()
w._open_load(LoadSpec("short", "p-short", [[1, 2, 3]], 32, 64, 65))  # tokens 32..63: blocks 3 and a 4th it lacks
out["invalid"] = sorted(w._load_errors)

# 12. a step's asynchronous loads: every open sent before any answer is waited for, so that a receiver that answers
# none holds the step one load_timeout_s, not one per load (they were sent and waited for one at a time)
events = []


class Silent:
    def open_nowait(self, push_id, **k):
        events.append(("open", push_id))
        return NS(wait=lambda: (events.append(("wait", push_id)), (_ for _ in ()).throw(_Late("no answer")))[1],
                  abandon=lambda: None)


w.settings = NS(load_timeout_s=10.0, query_timeout_s=0.5, receiver_retry_s=30.0)
w._pgroup, w._loads, w._async, w._load_errors, w._receiver_down_until = [0], [], [], set(), 0.0
w.receiver = NS(get=lambda: Silent())
w._open_loads([LoadSpec(f"a{i}", f"pa{i}", [[1, 2, 3]], 0, 32, 40, asynchronous=True) for i in range(3)])
out["async_opens"] = events
out["async_failed"] = [ld.reason.value if ld.reason else None for ld in w._async]
print(json.dumps(out))
"""


def test_the_pool_stays_mapped_under_async_loads_and_pages_go_back_only_after_their_copies():
    r = subprocess.run([str(VLLM_PY), "-c", _SCRIPT], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["resets_with_async_pending"] == 0, out  # issue 34 item 1: it used to reset, unmapping the pool
    assert out["async_released"] == 1 and out["resets_when_idle"] == 1, out
    assert out["released_while_copying"] == 0 and out["released_still_copying"] == 0, out  # item 3
    assert out["resets_while_copying"] == 1, out  # the copy still reads the pool: no reset
    assert out["released_after_copy"] == 1 and out["released_at_shutdown"] == 1, out
    # the worker's stats object counted each settled load once, failures by path and reason
    t = out["totals"]
    assert t["load_failures"] == 4 and t["load_failed:layerwise:push_failed"] == 3, t
    assert t["load_failed:layerwise:incomplete"] == 1, t  # "copied" ran none of the layout's 2 layers
    assert t["load_requests"] == 1 and t["load_async"] == 1 and t["loads:async"] == 1, t
    pend = out["pending"]
    assert pend["unasked"] == [1, True, "incomplete"], pend
    assert pend["late"] == [1, True, "timeout"] and pend["refused"][:2] == [0, True], pend
    assert not out["down_after_other"] and out["down_after_skew"] and out["receiver_down_after_skew"], out
    t = out["skew_totals"]
    assert t["push_failed:refused"] == 1 and t["push_failed:sender"] == 1, t
    assert out["skew_load"] == [0, "receiver"], out  # refused before anything was opened: nothing to give back
    # one layer a step: "first" done at its third, "second" at its sixth, none timed out; the load whose push never
    # came fails at its deadline
    assert out["budget_steps"] == [[[], []], [[], []], [["first"], []], [[], []], [[], []], [["second"], []],
                                   [[], ["waiting"]]], out["budget_steps"]
    assert out["prefetched"] == list(range(1, 1 + out["prefetch_layers"])) and out["prefetch_layers"] <= 4, out
    assert out["unreachable"] == {"opens": 1, "failed": 4, "down": True}, out
    assert out["aborted"] == {"done": ["r1"], "failed": [], "left": [True], "released": [1, 0]}, out
    assert out["unread"] == 1, out
    assert out["invalid"] == [3], out
    # every open out before the first answer is waited for (then each waits from its own send: overlapped)
    assert out["async_opens"] == [["open", f"pa{i}"] for i in range(3)] + [["wait", f"pa{i}"] for i in range(3)], out
    assert out["async_failed"] == ["timeout"] * 3, out


_PUSH_SCRIPT = """
import json
from types import SimpleNamespace as NS

from pdpush.errors import BrokenResourceError, TransportTimeout
from pdpush.integrations.vllm.metadata import PushSpec
from pdpush.integrations.vllm.stats import WorkerStats
from pdpush.integrations.vllm.worker import WorkerSide


def worker(stager=None):
    w = WorkerSide.__new__(WorkerSide)
    w.layout = NS(chunk_tokens=16, state_layers=0)
    w.settings = NS(sender_retry_s=5.0, timeout_s=10.0)
    w.stats = WorkerStats()
    w._pending, w._step_layers, w._pushes, w._finishing, w._retired = [], [], [], [], []
    w._sender_down_until, w._stager, w._pgroup, w._state_before = 0.0, stager, [0], {}
    w._layer_of, w._vgroup_of, w.stage = {"l0": 0, "l1": 1}, {"l0": 0, "l1": 0}, range(2)
    w._storages = NS(get=lambda name, kv: (None, ("geo",)))
    w._gather_rows = lambda *a: None
    w._paged = NS(slots_per_block=lambda kv: 16, gather=lambda kv, b, o: ())
    return w


class Client:  # the engine's connection to its sender: close() unmaps the staging in the real one
    def __init__(self):
        self.closed = False

    def close(self):
        self.closed = True


class Handle:
    def __init__(self, client, n_new=1, finish_error=None):
        self.client, self.req_id, self.plan = client, "p-A", NS(n_new=n_new, groups=[])
        self.finish_error, self.staged_after_close, self.aborted = finish_error, [], False

    def stage_layer(self, layer, *comps, new_only=False):
        if self.client.closed:
            self.staged_after_close.append(layer)

    def layer_ready(self, layer):
        pass

    def finish_nowait(self):
        if self.finish_error:
            raise self.finish_error

    def abort(self, why=""):
        self.aborted = True


class Pending:  # a Begin sent: its answer (or its failure) at the next layer
    def __init__(self, client, handle=None, error=None):
        self.client, self.handle, self.error = client, handle, error

    def answered(self):
        return True

    def wait(self):
        if self.error:
            raise self.error
        return self.handle


class Stager:  # a side stream's copies: each handle's still writing its staging until the test says
    def __init__(self):
        self.writing, self.dropped = set(), []

    def drop(self, handle):
        self.dropped.append(handle.req_id)

    def quiesce_where(self, match, timeout_s):
        return not any(match(h) for h in self.writing)


def push(w, client, name):
    h = Handle(client)
    spec = PushSpec(name, "p-" + name, list(range(32)), [[1, 2]], "")
    p = NS(spec=spec, handle=h, src=[NS(tokens=32, addresses=lambda n: (None, None))], layers_sent=1, rows={},
           dev_addr={}, states_sent=0)
    w._pushes.append(p)
    return h


out = {}
# 1. B's Begin times out at layer 1 while A (begun at layer 0) still stages: A fails with the connection, before it
# closes, and nothing is staged into the closed connection's staging
w = worker()
w._prefill = client = Client()
a = push(w, client, "A")
w._pending = [(PushSpec("B", "p-B", list(range(32)), [[3, 4]], ""), Pending(client, error=TransportTimeout("late")))]
w.save_kv_layer("l1", None, None)
out["cpu"] = {"closed": client.closed, "staged_after_close": a.staged_after_close, "pushes": len(w._pushes),
              "totals": w.stats.totals()}

# 2. the same with device copies still writing staging: A's, and E's (a push failed before, its copy still running):
# the connection stays open until both end
w = worker(Stager())
w._prefill = client = Client()
a, e = push(w, client, "A"), Handle(client)
w._stager.writing = {a, e}
w._pending = [(PushSpec("B", "p-B", list(range(32)), [[3, 4]], ""), Pending(client, error=TransportTimeout("late")))]
w.save_kv_layer("l1", None, None)
out["device"] = {"closed_while_copying": client.closed, "dropped": w._stager.dropped}
w._stager.writing.discard(a)
w._reap_finishing()
out["device"]["closed_while_the_earlier_copies"] = client.closed
w._stager.writing.clear()
w._reap_finishing()
out["device"]["closed_after"] = client.closed

# 3. a Begin answered "every chunk held", its sender gone before the finish: counted, never out of the forward
w = worker()
w._prefill = client = Client()
h = Handle(client, n_new=0, finish_error=BrokenResourceError("the sender it began on died"))
w._pending = [(PushSpec("C", "p-C", list(range(32)), [[5, 6]], ""), Pending(client, handle=h))]
try:
    w.save_kv_layer("l0", None, None)
    out["escaped"] = None
except Exception as e:
    out["escaped"] = type(e).__name__
out["held_totals"] = w.stats.totals()

# 4. the decode scheduler's claims (a blocking round trip each): one the receiver does not answer stops the others
# for receiver_retry_s (a burst of them stalled every step by query_timeout_s each)
from pdpush.integrations.vllm.asker import Asker
from pdpush.integrations.vllm.scheduler import SchedulerSide, _Req
from pdpush.integrations.vllm.stats import SchedulerStats
from pdpush.layout import KVLayout


class Silent:
    claims = 0

    def claim(self, *a, **k):
        Silent.claims += 1
        raise TransportTimeout("no answer within 0.5 s")


s = SchedulerSide.__new__(SchedulerSide)
s.settings = NS(query_timeout_s=0.5, receiver_retry_s=30.0)
s.layout, s.load_async, s.stats = KVLayout(2, 1, 64, "float32", 16, "m"), False, SchedulerStats()
s.receiver = NS(get=lambda: Silent(), reset=lambda: None)
s.asker = Asker("ipc:///nonexistent/rx.sock", timeout_s=0.5, retry_s=30.0, max_inflight=8)
got = [s._claim(NS(request_id=f"c{i}"), _Req(), f"p-c{i}", list(range(64)), 64, 0) for i in range(3)]
out["claims"] = {"sent": Silent.claims, "got": got, "totals": s.stats.totals()}
print(json.dumps(out))
"""


def test_a_connection_given_up_mid_step_fails_its_pushes_first_and_closes_once_no_copy_writes_its_staging():
    """The prefill side: one Begin of a step times out (the sender died or hung) while another push of the step is
    staging. Closing the connection unmaps its staging: that push used to stage into it next (a fault in the
    engine). And a sender gone between a Begin's answer and its finish raised out of vLLM's forward."""
    r = subprocess.run([str(VLLM_PY), "-c", _PUSH_SCRIPT], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    cpu = out["cpu"]
    assert cpu["closed"] and cpu["staged_after_close"] == [] and cpu["pushes"] == 0, cpu
    assert cpu["totals"]["push_failed:sender"] == 2, cpu  # B's Begin, and A with the connection
    assert out["device"] == {"closed_while_copying": False, "dropped": ["p-A"],
                             "closed_while_the_earlier_copies": False, "closed_after": True}, out
    assert out["escaped"] is None and out["held_totals"]["push_failed:sender"] == 1, out  # and the sender let go
    claims = out["claims"]
    assert claims["sent"] == 1 and claims["got"] == [[0, False]] * 3, claims
    assert claims["totals"].get("recomputed:receiver_down") == 2, claims
