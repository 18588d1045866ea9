"""An engine's client takes no answer from its local daemon that it cannot hold: a segment said to be larger than it
is, a ring or grant table placed past the staging, pages past the pool, indexes past the request. Each ends in a typed
error, with the request given back to the daemon (an Abort, a Release) and nothing left in the client's mailboxes or
segment counts; never a fault in the engine's process, which a view or a native write past a mapping would be.

The daemon here is a stand-in on a real lifeline (its answers are what the test makes them), in a child process
whose exit code says whether the engine survived: a regression faults the child, not the test run."""

from __future__ import annotations

import json
import subprocess
import sys

from pdpush_tools.harness.vllm_cluster import ROOT

_PRELUDE = r"""
import json, sys, threading, time
from pdpush import lifeline, protocol, shm
from pdpush.client import DecodeClient, PrefillClient
from pdpush.layout import KVLayout, PoolGeometry

LAY = KVLayout(layers=2, kv_heads=2, head_dim=8, dtype="float16", chunk_tokens=16)
SPEC = protocol.LayoutSpec(**LAY.to_dict())
work = sys.argv[1]
shmid, _ = shm.create_private(PoolGeometry(LAY, 4).total_bytes)  # 4 pages' worth (a page of the host's at least)
size = PoolGeometry(LAY, 4).total_bytes


class Daemon:  # a stand-in daemon on a real lifeline: ``answer(msg)`` gives its replies, each (delay_s, message)
    def __init__(self, sock, answer):
        self.lines = lifeline.Lifelines(lifeline.path_for(sock), protocol.DEFAULT_MAX_FRAME)
        self.answer, self.seen, self.stop = answer, [], False
        self.t = threading.Thread(target=self.run, daemon=True)
        self.t.start()

    def run(self):
        later = []  # in the order answered: a delayed answer holds back those after it, as one stream would
        while not self.stop:
            for ev in self.lines.service():
                if ev.kind == lifeline.FRAME:
                    m = protocol.decode(ev.payload)
                    self.seen.append(m.type)
                    later += [(time.monotonic() + d, ev.ident, r) for d, r in self.answer(m)]
            while later and later[0][0] <= time.monotonic():
                _, ident, r = later.pop(0)
                self.lines.send(ident, protocol.encode(r))
            time.sleep(0.0005)

    def close(self):
        self.stop = True
        self.t.join()
        self.lines.close()
"""

_SCRIPT = _PRELUDE + r"""
def open_ok(**kw):
    base = dict(req_id="x", shmid=shmid, pool_base=0, pool_pages=4, layout=SPEC, pages=[0], chunks=1,
                last_chunk_tokens=16, layers_ready=[], committed=False)
    return protocol.OpenOk(**{**base, **kw})


def begin_ok(**kw):
    base = dict(req_id="x", already_sent_indexes=[], staging_shmid=shmid, staging_bytes=size, staging_offset=0,
                new_chunks=1, daemon_id="d")
    return protocol.BeginOk(**{**base, **kw})


cases = {
    "pool larger than its segment": ("decode", open_ok(pool_pages=100_000, pages=[0])),
    "page past the pool": ("decode", open_ok(pages=[7])),
    "pages for more items than the request has": ("decode", open_ok(pages=[0, 1], chunks=1)),
    "chunks past any request's": ("decode", open_ok(chunks=3_000_000)),
    "staging larger than its segment": ("prefill", begin_ok(staging_bytes=1 << 30)),
    "ring past the staging": ("prefill", begin_ok(ring_slots=4, ring_offset=1 << 40, idle_offset=0)),
    "grant table past the staging": ("prefill", begin_ok(staging_offset=size)),
    "held index past the request": ("prefill", begin_ok(already_sent_indexes=[5])),
}
out = {}
for i, (name, (side, answer)) in enumerate(cases.items()):
    sock = f"{work}/d{i}.sock"
    d = Daemon(sock, lambda m, a=answer: [(0, a.model_copy(update={"req_id": m.req_id}))]
               if isinstance(m, (protocol.Open, protocol.Begin)) else [])
    c = DecodeClient(sock, timeout_s=5) if side == "decode" else PrefillClient(LAY, sock, timeout_s=5)
    try:
        try:
            c.open("r") if side == "decode" else c.begin("r", list(range(16)))
            got = "taken"
        except Exception as e:
            got = type(e).__name__
        deadline = time.monotonic() + 5
        while len(d.seen) < 2 and time.monotonic() < deadline:  # the Release or Abort that gives it back
            time.sleep(0.01)
        c._conn.drain()
        out[name] = {"raised": got, "daemon_saw": list(d.seen), "mail": sorted(map(str, c._conn.mail)),
                     "segment_users": sum(c._segments._users.values())}
    finally:
        c.close()
        d.close()
print(json.dumps(out))
"""


def test_answers_the_client_cannot_hold_end_typed_and_give_the_request_back(tmp_path):
    r = subprocess.run([sys.executable, "-c", _SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=120,
                       cwd=ROOT)
    assert r.returncode == 0, f"the engine's process ended with {r.returncode}: {r.stderr[-3000:]}"
    out = json.loads(r.stdout.strip().splitlines()[-1])
    for name, got in out.items():
        side_gives_back = "release" if got["daemon_saw"][0] == "open" else "abort"
        typed = "ResourceError" if "larger than its segment" in name else "RemoteProtocolError"
        assert got["raised"] == typed, (name, got)
        assert got["daemon_saw"][1:] == [side_gives_back], (name, got)  # the request goes back to the daemon
        assert got["mail"] == [] and got["segment_users"] == 0, (name, got)


_WAITS = _PRELUDE + r"""
from pdpush.errors import TransportTimeout

out = {}
# 1. a Query that timed out: its late answer is dropped, never taken for the next Query's (it was, and every answer
# after it was one behind)
slow = [True]


def queries(m):
    if isinstance(m, protocol.Query):
        first, slow[0] = slow[0], False
        return [(0.3 if first else 0, protocol.QueryReply(held_prefix=len(m.chunk_keys)))]
    return []


d = Daemon(f"{work}/q.sock", queries)
c = DecodeClient(f"{work}/q.sock", timeout_s=5)
try:
    try:
        c.query(list(range(16 * 5)), LAY, timeout_s=0.1)
        out["first"] = "answered"
    except TransportTimeout:
        out["first"] = "timeout"
    time.sleep(0.5)
    out["next"] = [c.query(list(range(16 * k)), LAY).held_prefix for k in (1, 2, 3)]
finally:
    c.close()
    d.close()

# 1b. the same for a call about a request not open here (a claim): its late answer, dropped, pays what it owed
slow = [True]


def claims(m):
    if isinstance(m, protocol.Claim):
        first, slow[0] = slow[0], False
        return [(0.3 if first else 0, protocol.ClaimOk(req_id=m.req_id, chunks=1 if first else 2))]
    return []


d = Daemon(f"{work}/c.sock", claims)
c = DecodeClient(f"{work}/c.sock", timeout_s=5)
try:
    try:
        c.claim("x", list(range(16)), LAY, timeout_s=0.1)
        out["first_claim"] = "answered"
    except TransportTimeout:
        out["first_claim"] = "timeout"
    time.sleep(0.5)
    c._conn.drain()
    out["next_claim"] = c.claim("x", list(range(16)), LAY, timeout_s=2)
    out["claim_mail"] = len(c._conn.mail)
finally:
    c.close()
    d.close()

# 2. the receiver restarts while requests of it wait; the connection reaches the new one (another open): the waits on
# the dead one's requests end at once, typed, not at their deadlines
def opens(m):
    if isinstance(m, protocol.Open) and m.req_id != "never":
        return [(0, protocol.OpenOk(req_id=m.req_id, shmid=shmid, pool_base=0, pool_pages=4, layout=SPEC, pages=[0],
                                    new_idx=[0], last_chunk_tokens=16, layers_ready=[], committed=False))]
    return []


sock = f"{work}/r.sock"
d1 = Daemon(sock, opens)
c = DecodeClient(sock, timeout_s=30)
try:
    req = c.open("r1")
    pend = c.open_nowait("never", timeout_s=10)
    d1.close()
    d2 = Daemon(sock, opens)
    try:
        time.sleep(0.05)
        c.open("r2")
        for name, fn in (("open", pend.wait), ("layer", lambda: req.wait_layer(0, timeout_s=10))):
            t = time.monotonic()
            try:
                fn()
                out[name] = ["returned", 0]
            except Exception as e:
                out[name] = [type(e).__name__, time.monotonic() - t]
    finally:
        d2.close()
finally:
    c.close()

# 3. the same for a Begin sent to a sender that died, the connection on a new one since
def begins(m):
    if isinstance(m, protocol.Begin) and m.req_id != "never":
        return [(0, protocol.BeginOk(req_id=m.req_id, already_sent_indexes=[], staging_shmid=shmid, staging_bytes=size,
                                     staging_offset=0, new_chunks=1, daemon_id="d"))]
    return []


sock = f"{work}/s.sock"
d1 = Daemon(sock, begins)
p = PrefillClient(LAY, sock, timeout_s=10)
try:
    pend = p.begin_nowait("never", list(range(16)))
    d1.close()
    d2 = Daemon(sock, begins)
    try:
        time.sleep(0.05)
        p.begin("other", list(range(16)))
        t = time.monotonic()
        try:
            pend.wait()
            out["begin"] = ["returned", 0]
        except Exception as e:
            out["begin"] = [type(e).__name__, time.monotonic() - t]
    finally:
        d2.close()
finally:
    p.close()
print(json.dumps(out))
"""


def test_a_late_reply_answers_no_later_call_and_a_dead_daemons_requests_end_at_once(tmp_path):
    """A call that timed out leaves its reply owed: it is dropped when it comes, not taken for the next call's (a
    late Query answer made every later answer one behind). A daemon that restarts while requests of it wait: once the
    connection reaches the new one, those waits end at once with BrokenResourceError, not at their deadlines (10 s)."""
    r = subprocess.run([sys.executable, "-c", _WAITS, str(tmp_path)], capture_output=True, text=True, timeout=120,
                       cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["first"] == "timeout" and out["next"] == [1, 2, 3], out
    assert out["first_claim"] == "timeout" and out["next_claim"] == 2 and out["claim_mail"] == 0, out
    for name in ("open", "layer", "begin"):
        assert out[name][0] == "BrokenResourceError" and out[name][1] < 3, (name, out)


_FLOOD = _PRELUDE + r"""
from pdpush.errors import TransportTimeout

GHOSTS = [protocol.encode(protocol.LayerAvailable(req_id=f"ghost-{i}", layers=[0])) for i in range(5000)]


class Flood(Daemon):  # a Query unanswered, and after it, for 3 s, notices about requests this client never had,
    def run(self):  # as fast as its lifeline takes them
        until = None
        while not self.stop:
            for ev in self.lines.service():
                if ev.kind == lifeline.FRAME and isinstance(protocol.decode(ev.payload), protocol.Query):
                    ident, until, i = ev.ident, time.monotonic() + 3, 0
            while until is not None and time.monotonic() < until and len(self.lines._named[ident].wbuf) < 1 << 18:
                self.lines.send(ident, GHOSTS[i % len(GHOSTS)])
                i += 1
            time.sleep(0.0001)


import os, signal
pid = os.fork()  # the flood in a process of its own: a thread of this one would wait on the client for the GIL
if pid == 0:
    Flood(f"{work}/f.sock", None)
    time.sleep(60)
    os._exit(0)
c = DecodeClient(f"{work}/f.sock", timeout_s=5)
out = {}
try:
    t = time.monotonic()
    try:
        c.query(list(range(16)), LAY, timeout_s=0.2)
        out["query"] = "answered"
    except TransportTimeout:
        out["query"] = "timeout"
    out["waited_s"] = time.monotonic() - t
    time.sleep(0.5)
    c._conn.drain()
    out["mailboxes"] = len(c._conn.mail)
finally:
    c.close()
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
print(json.dumps(out))
"""


def test_a_flood_of_other_mail_neither_extends_a_wait_nor_makes_mailboxes(tmp_path):
    """A wait ends at its deadline though frames keep coming (it was checked only when none was waiting: a daemon
    sending without a pause held the engine's call for as long as it sent), and mail about a request this client does
    not have open is dropped, not kept in a mailbox made for it (one was made for any id a daemon named, for good)."""
    r = subprocess.run([sys.executable, "-c", _FLOOD, str(tmp_path)], capture_output=True, text=True, timeout=120,
                       cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["query"] == "timeout" and out["waited_s"] < 1.0, out
    assert out["mailboxes"] == 0, out


_POLL = _PRELUDE + r"""
from pdpush.client.connection import Connection
from pdpush.errors import TransportTimeout


def answer(m):  # for a Release of "a": 50 notices about "b", then the answer
    if isinstance(m, protocol.Release) and m.req_id == "a":
        return [(0, protocol.Committed(req_id="b"))] * 50 + [(0, protocol.Ok(req_id="a"))]
    return []


d = Daemon(f"{work}/p.sock", answer)
c = Connection(f"{work}/p.sock")
try:
    c.begin("a")
    c.begin("b")
    c.send(protocol.Release(req_id="a"), 5)
    time.sleep(0.3)  # every answer is in the engine's socket by now
    looks = 0
    while looks < 100:
        looks += 1
        try:
            got = c.reply("a", time.monotonic(), check=False).type  # a zero-timeout look, as PendingOpen.poll's
            break
        except TransportTimeout:
            pass
    print(json.dumps({"looks": looks, "got": got, "b": len(c.mail.get("b", []))}))
finally:
    c.close()
    d.close()
"""


def test_a_zero_timeout_look_takes_an_answer_already_read_behind_other_mail(tmp_path):
    """A poll (a deadline of now) takes an answer that is in already, behind other requests' mail: the wait's
    deadline counts once nothing read is left (checked after each other frame, the answer behind 50 notices took
    51 looks, a vLLM step each)."""
    r = subprocess.run([sys.executable, "-c", _POLL, str(tmp_path)], capture_output=True, text=True, timeout=120,
                       cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out == {"looks": 1, "got": "ok", "b": 50}, out
