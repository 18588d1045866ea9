"""What the codec costs on a begin's path: the four messages it encodes and decodes (Begin, AllocRequest,
AllocResponse, BeginOk), by the fast path (protocol.py's msgspec twins, fastcodec.py) and by msgpack and pydantic
alone, back to back and after the process slept (as a daemon wakes for an idle request). Reported beside the
latency scenario; no target."""

from __future__ import annotations

import statistics
import time

import msgpack

from pdpush import protocol as P
from pdpush.layout import KVLayout

KEY = bytes(range(16))


def messages(layout: KVLayout) -> dict[str, P.Msg]:
    """The messages of one request's begin, as a one-chunk request of ``layout`` has them."""
    rid = "bench-codec-0123456789"
    return {
        "begin": P.Begin(req_id=rid, receiver="tcp://127.0.0.1:5555", layout=P.LayoutSpec(**layout.to_dict()),
                         chunk_keys=[KEY], last_chunk_tokens=layout.chunk_tokens, handover_ring=True),
        "alloc": P.AllocRequest(req_id=rid, chunk_keys=[KEY], last_chunk_tokens=layout.chunk_tokens, lease_ms=30_000,
                                completion="words"),
        "alloc_ok": P.AllocResponse(req_id=rid, already_sent_indexes=[], page_runs=[(17, 1)], lease_id=1 << 40,
                                    lease_ms=30_000, completion="words"),
        "begin_ok": P.BeginOk(req_id=rid, already_sent_indexes=[], staging_shmid=3, staging_bytes=1 << 30,
                              staging_offset=4096, new_chunks=1, daemon_id="5e1d0c", handle=7, ring_offset=64,
                              ring_slots=256, idle_offset=8, doorbell="/run/pdpush/sender.bell", ring_finish=True),
    }


def _warm_us(fn, loops: int = 2000, repeats: int = 5) -> float:
    best = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(loops):
            fn()
        best.append((time.perf_counter() - t) / loops * 1e6)
    return statistics.median(best)


def _idle_us(fn, idle_s: float, samples: int) -> float:
    out = []
    for _ in range(samples):
        time.sleep(idle_s)
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1e6)
    return statistics.median(out)


def measure(layout: KVLayout, idle_s: float = 0.05, samples: int = 12) -> dict:
    """Per message: microseconds to decode and encode it, fast path and msgpack + pydantic, warm (median of 5 loops)
    and after ``idle_s`` asleep (median of ``samples``)."""
    out = {}
    for name, msg in messages(layout).items():
        frame = P.encode(msg)
        assert P.decode(frame) == msg == P.decode(frame, fast=False)
        ops = {"decode": lambda f=frame: P.decode(f), "decode_pydantic": lambda f=frame: P.decode(f, fast=False),
               "encode": lambda m=msg: P.encode(m),
               "encode_pydantic": lambda m=msg: msgpack.packb(m.model_dump(mode="python"), use_bin_type=True)}
        out[name] = {"bytes": len(frame),
                     **{f"{k}_us": _warm_us(fn) for k, fn in ops.items()},
                     **{f"{k}_idle_us": _idle_us(fn, idle_s, samples) for k, fn in ops.items()}}
    out["idle_ms"] = idle_s * 1000
    return out
