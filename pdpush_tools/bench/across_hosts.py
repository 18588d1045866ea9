"""``pdpush bench --scenario across_hosts``: a push between two hosts over a link of 1 ms RTT, against raw UCX
put+flush between the same two hosts, in the hosts harness (``pdpush_tools.harness.hosts``; needs root).

Host ``p`` runs the sender and a prefill engine, host ``d`` the receiver and a decode engine; ``d``'s link
delays each direction by half the RTT (the harness's relay, MTU 9000). Nothing crosses but the network: UCX
finds a transport by itself (tcp here) and the bench records which. The engines are agents driven through
pipes by this process, which never touches the link, so the pipes add nothing to what is measured.

* ``one_chunk_p50_ms``: a one-chunk request (``latency``'s shape: 32 layers of 64 KiB), begun ahead (the
  allocation came back while the layers computed, as the vLLM connector's scheduler-time begin does) and
  every layer in staging, from hand-over on ``p`` to every layer visible on ``d`` (readiness words read in a
  spin). Target: at most its bytes' time at the raw put+flush rate between the hosts + 2 RTT + 0.5 ms. Each
  sample is paired with a raw put+flush of its bytes between the same hosts, alternately just before and just
  after it; the target holds when the median of (push - its raw put) is within 2 RTT + 0.5 ms
  (``one_chunk_excess_ms``).
* ``cold_p50_ms``: the same request begun at hand-over (nothing ahead: the allocation's round trip, the
  staging copy and the hand-over, to visible): what scheduling-time begin saves.
* ``goodput_gbps``: a 16 MiB request (32 layers of 512 KiB) the same way as ``one_chunk``, bytes over time,
  against the same pairing: ``ratio_goodput`` is the median of (raw time / push time), ``raw_put_gbps`` the
  paired raw puts' median rate. Target: >= 0.9x.
* ``rtt_ms``: a TCP echo's round trip between the engines' hosts (the link's delay and the relay's own).

The paired raw put posts every layer's put at once and one flush (as the sender posts a request handed over
whole) and waits as the sender does: a 2 ms spin, then its events. A reference that spins throughout (as
``raw_put_*_back_to_back`` and the ``raw`` command's do, reported beside) takes, where the two hosts share two
cores, the core the relay and the peer need: it measured 0.31-0.68 GB/s from run to run for the same bytes.

Every request's bytes are checked on ``d``. The clock: ``p`` stamps the hand-over and ``d`` the last layer
seen, both with CLOCK_REALTIME, which the harness's hosts share (one kernel; their monotonic clocks are
namespaced): between real hosts this comparison would need PTP, which is why only this bench does it.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from pdpush.layout import KVLayout

ECHO_PORT = 5799


def _now() -> float:
    return time.clock_gettime(time.CLOCK_REALTIME)


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def _ids(i: int, layout: KVLayout, chunks: int) -> list[int]:
    base = (i + 1) * 1_000_000  # no two requests share a chunk: nothing is skipped as already held
    return [base + t for t in range(chunks * layout.chunk_tokens)]


# -- the agents, one inside each host: a command per line on stdin, a JSON line on stdout per command ------

def _reply(**kw) -> None:
    print(json.dumps(kw), flush=True)


def _echo_server(srv: socket.socket) -> None:
    """Echo each byte back, one connection at a time (a thread of the d agent, which ends with it)."""
    while True:
        conn, _ = srv.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            while b := conn.recv(1):
                conn.sendall(b)


def _prefill_agent(layout: KVLayout, sock: str, chunks: int) -> None:
    from pdpush.client import PrefillClient
    from pdpush.sender import SPIN_S  # the pair waits for its flush as the sender does: a spin, then its events
    from pdpush_tools.bench import ceiling
    from pdpush_tools.bench.common import LazySource

    pc = PrefillClient(layout, sock, timeout_s=60)
    handle = None
    refs = contextlib.ExitStack()  # the paired reference's connection to d's peer, kept for the phase
    pair = None
    try:
        for line in sys.stdin:
            cmd, *args = line.split()
            if cmd == "rtt":  # a TCP round trip to d's echo, n times
                addr, n = args[0], int(args[1])
                with socket.create_connection((addr, ECHO_PORT), timeout=10) as s:
                    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    rtts = []
                    for _ in range(n):
                        t = time.perf_counter()
                        s.sendall(b"x")
                        s.recv(1)
                        rtts.append(time.perf_counter() - t)
                _reply(rtt_ms=statistics.median(rtts) * 1000)
            elif cmd == "raw":  # into d's peer: the request's bytes as one put and its flush, and each layer's
                # put+flush pipelined (native; the better of 16 and every layer in flight); the faster is the
                # reference. Back to back (each put+flush waited for) is reported too.
                info, addr = json.loads(args[0]), args[1]
                lb = layout.page_bytes * chunks
                whole = ceiling.measure_put(lb * layout.layers, 1, peer=(info, addr))
                seq = ceiling.measure_put(lb, layout.layers, peer=(info, addr))
                rate = ceiling.measure_put_rate(lb, slots=layout.layers, count=10 * layout.layers,
                                                windows=(16, layout.layers), peer=(info, addr))
                _reply(raw_put_gbps=max(whole["median_gbps"], max(rate["ops_per_s"].values()) * lb / 1e9),
                       raw_put_whole_gbps=whole["median_gbps"], raw_put_seq_gbps=seq["median_gbps"])
            elif cmd == "pair":  # the request's layers into d's peer, every put posted at once and one flush, as
                # the sender puts them, next to its push: the link's state (its TCP window after the same
                # idle) is the push's, which a reference measured back to back is not (it moved 2x between runs)
                if pair is None:
                    info, addr = json.loads(args[0]), args[1]
                    pair = refs.enter_context(ceiling.put_reference(layout.page_bytes * chunks, layout.layers,
                                                                    peer=(info, addr), batched=True, spin_s=SPIN_S))
                    pair.once()  # its first pass touches the remote pages
                _reply(raw_ms=pair.total / (pair.once() * 1e9) * 1000)  # its puts alone, as once() times them
            elif cmd == "begin":  # begun ahead and staged: what the hand-over finds in the common case
                i = int(args[0])
                src = LazySource(layout, _ids(i, layout, chunks), i)
                t = time.perf_counter()
                handle = pc.begin(f"x-{i}", src.token_ids)
                begin_s = time.perf_counter() - t
                for layer in range(layout.layers):
                    handle.stage_layer(layer, *src.layer(layer))
                _reply(begin_ms=begin_s * 1000)
            elif cmd == "go":  # hand-over; the commit waits for "finish", after the decode side saw every layer
                t0 = _now()
                handle.layers_ready(list(range(layout.layers)))
                _reply(t0=t0)
            elif cmd == "finish":
                handle.finish()
                _reply(finished=True)
            elif cmd == "cold":  # nothing ahead: begin, stage and hand over at once
                i = int(args[0])
                src = LazySource(layout, _ids(i, layout, chunks), i)
                comps = [src.layer(layer) for layer in range(layout.layers)]  # the KV exists before the clock
                t0 = _now()
                h = pc.begin(f"x-{i}", src.token_ids)
                for layer in range(layout.layers):
                    h.stage_layer(layer, *comps[layer])
                h.layers_ready(list(range(layout.layers)))
                h.finish()
                _reply(t0=t0)
            else:
                raise ValueError(f"unknown command {cmd!r}")
    finally:
        refs.close()
        pc.close()


def _decode_agent(layout: KVLayout, sock: str, chunks: int, addr: str) -> None:
    import threading

    from pdpush.client import DecodeClient
    from pdpush_tools.bench.common import OBSERVER, LazySource, verify

    threading.Thread(target=_echo_server, args=(socket.create_server((addr, ECHO_PORT)),), daemon=True).start()
    dc = DecodeClient(sock, timeout_s=60, wait=OBSERVER)  # naps of 50 us: a spin would take a core from the link
    _reply(listening=True)
    req = None
    try:
        for line in sys.stdin:
            cmd, *args = line.split()
            if cmd == "open":  # waits for the allocation if it is not there yet
                req = dc.open(f"x-{args[0]}")
                if args[1:] == ["reply"]:
                    _reply(opened=True)
            elif cmd == "wait":
                i = int(args[0])
                _reply(spinning=True)
                for layer in range(layout.layers):
                    req.wait_layer(layer)
                _reply(t1=_now())  # then the commit, and every byte checked
                req.wait_committed()
                ok = verify(req, LazySource(layout, _ids(i, layout, chunks), i), layout)
                req.release()
                _reply(verified=ok)
            else:
                raise ValueError(f"unknown command {cmd!r}")
    finally:
        dc.close()


# -- the driver ---------------------------------------------------------------------------------------------

class _Agent:
    """A process inside a host, a JSON line per reply; every read has a deadline."""

    def __init__(self, host, argv: list[str] | None = None, proc: subprocess.Popen | None = None) -> None:
        self.proc = proc or host.popen([sys.executable, "-m", "pdpush_tools.bench.across_hosts", *(argv or [])],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=Path.cwd())
        self.host = host
        self._buf = b""

    @classmethod
    def of(cls, proc: subprocess.Popen, host) -> _Agent:
        return cls(host, proc=proc)

    def send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def read(self, timeout_s: float = 120) -> dict:
        """The agent's next line (its own buffer: lines that arrive together are each returned)."""
        import select

        deadline = time.monotonic() + timeout_s
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError("an agent of the across_hosts bench said nothing in time")
            chunk = os.read(fd, 65536)
            if not chunk:
                raise RuntimeError(f"an agent of the across_hosts bench exited (rc {self.proc.wait(10)})")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def call(self, line: str) -> dict:
        self.send(line)
        return self.read()

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.host.kill(self.proc)


def _phase(hosts, layout: KVLayout, chunks: int, samples: int, cold: bool) -> dict:
    """One shape: daemons on both hosts, the raw reference between them, then the samples."""
    from pdpush import launch
    from pdpush.client import status
    from pdpush_tools.bench.latency import wire_per_request

    p, d = hosts["p"], hosts["d"]
    req_bytes = layout.layers * chunks * layout.page_bytes
    # the pool holds 16 such requests (pool_pages counts a layer's pages), faulted in at start as in production
    rx = launch.start_receiver(d.dir, prefix=d.prefix(), host=d.addr, insecure=True,
                               local_socket=str(d.dir / "rx.sock"), pool_pages=16 * chunks,
                               committed_ttl_ms=5000, **layout.to_dict())
    tx = peer = None
    agents: list[_Agent] = []
    try:
        tx = launch.start_sender(p.dir, prefix=p.prefix(), default_receiver=rx.info["control_endpoint"],
                                 ingress_socket=str(p.dir / "tx.sock"),
                                 staging_bytes=max(64 << 20, 4 * req_bytes))
        shape = json.dumps(layout.to_dict())
        agents.append(pa := _Agent(p, ["prefill", shape, str(p.dir / "tx.sock"), str(chunks)]))
        agents.append(da := _Agent(d, ["decode", shape, str(d.dir / "rx.sock"), str(chunks), d.addr]))
        peer = d.popen([sys.executable, "-m", "pdpush_tools.peer", str(req_bytes), d.addr], stdin=subprocess.PIPE,
                       stdout=subprocess.PIPE, text=True, cwd=Path.cwd())
        info = _Agent.of(peer, d).read()  # the peer's line: its port, address and rkey
        da.read()  # {"listening": true}: d's echo server and decode client are up
        rtt = pa.call(f"rtt {d.addr} 50")["rtt_ms"]
        raw_cmd = f"raw {json.dumps(info, separators=(',', ':'))} {d.addr}"
        raws = [pa.call(raw_cmd)]  # and again after the samples: the faster of the two is the reference
        wire0 = status(p.dir / "tx.sock")
        warm = 5
        ahead, paired, cold_s, begin_ms, verified = [], [], [], [], True
        for i in range(samples + warm):
            begin_ms.append(pa.call(f"begin {i}")["begin_ms"])
            da.send(f"open {i} reply")
            da.read()
            da.call(f"wait {i}")  # {"spinning": true}
            # the paired raw put goes just before the push in one sample and just after it in the next: the
            # second of two transfers finds the link warm from the first (its TCP window, the relay's buffers)
            pair_cmd = f"pair {json.dumps(info, separators=(',', ':'))} {d.addr}"
            raw_ms = pa.call(pair_cmd)["raw_ms"] if i % 2 else None
            t0 = pa.call("go")["t0"]
            t1 = da.read()["t1"]
            if raw_ms is None:
                raw_ms = pa.call(pair_cmd)["raw_ms"]
            pa.call("finish")
            verified = da.read()["verified"] and verified
            if i >= warm:
                ahead.append(t1 - t0)
                paired.append(raw_ms / 1000)
        wire = wire_per_request(wire0, status(p.dir / "tx.sock"), samples + warm)
        if cold:
            for i in range(samples + warm, 2 * samples + warm):
                da.send(f"open {i}")  # it waits for the allocation, then spins
                pa.send(f"cold {i}")
                spinning = da.call(f"wait {i}")
                assert spinning.get("spinning"), spinning
                t0 = pa.read()["t0"]
                cold_s.append(da.read()["t1"] - t0)
                verified = da.read()["verified"] and verified
        raws.append(pa.call(raw_cmd))
        raw = {k: max(r[k] for r in raws) for k in raws[0]}
        transports = {"sender": status(p.dir / "tx.sock").get("ucx_transports"),
                      "receiver": status(d.dir / "rx.sock").get("ucx_transports")}
    finally:
        for a in agents:
            a.stop()
        if peer is not None:
            with contextlib.suppress(OSError):
                peer.stdin.close()
            try:
                peer.wait(10)
            except subprocess.TimeoutExpired:
                d.kill(peer)
        if tx is not None:
            tx.stop()
        rx.stop()
    bytes_ms = req_bytes / (raw["raw_put_gbps"] * 1e9) * 1000
    out = {"layer_bytes": chunks * layout.page_bytes, "request_bytes": req_bytes, "rtt_ms": rtt,
           "raw_put_gbps": raw["raw_put_gbps"], "raw_put_seq_gbps": raw["raw_put_seq_gbps"],
           "raw_put_whole_gbps": raw["raw_put_whole_gbps"], "bytes_ms": bytes_ms,
           "p50_ms": statistics.median(ahead) * 1000, "p99_ms": _pct(ahead, 0.99) * 1000,
           # each sample against its own raw put+flush of the same bytes, just before or just after it
           "paired_raw_p50_ms": statistics.median(paired) * 1000,
           "paired_raw_gbps": req_bytes / statistics.median(paired) / 1e9,
           "excess_p50_ms": statistics.median(a - r for a, r in zip(ahead, paired, strict=True)) * 1000,
           "ratio_paired": statistics.median(r / a for a, r in zip(ahead, paired, strict=True)),
           "begin_p50_ms": statistics.median(begin_ms[warm:]),
           "goodput_gbps": req_bytes / statistics.median(ahead) / 1e9,
           "wire_messages_per_request": wire["total"], "wire_messages_by_kind": wire["by_kind"],
           "transports": transports, "samples": len(ahead), "verified": verified}
    if cold:
        out["cold_p50_ms"] = statistics.median(cold_s) * 1000
        out["cold_p99_ms"] = _pct(cold_s, 0.99) * 1000
    return out


def run(layout: KVLayout, rtt_ms: float = 1.0, samples: int = 40, big_chunks: int = 8) -> dict:
    """``layout``'s layers and heads, one 16-token chunk per layer (and ``big_chunks`` for goodput), over a link
    of ``rtt_ms`` round trip (the relay's own ~0.2 ms comes on top: ``rtt_ms`` in the result is measured)."""
    from pdpush import launch
    from pdpush_tools.harness.hosts import Hosts, HostSpec, LinkSpec

    one = KVLayout(layout.layers, layout.kv_heads, layout.head_dim, layout.dtype, 16, kind=layout.kind)
    wd = launch.scratch_dir("pdpush-bench-hosts-")
    with Hosts.make(wd / "rtt", {"p": HostSpec(), "d": HostSpec(link=LinkSpec(delay_ms=rtt_ms / 2))},
                    mtu=9000) as hosts:
        small = _phase(hosts, one, 1, samples, cold=True)
        big = _phase(hosts, one, big_chunks, max(5, samples // 4), cold=False)
    # the same on a plain veth link (kernel speed, no relay): what pdpush itself costs over tcp when the link
    # does not bound it (reported; the targets are the 1 ms link's)
    with Hosts.make(wd / "plain", ["p", "d"], mtu=9000) as hosts:
        plain_small = _phase(hosts, one, 1, samples, cold=False)
        plain_big = _phase(hosts, one, big_chunks, max(5, samples // 4), cold=False)
    # the target: at most the request's bytes' time + 2 RTT + 0.5 ms. Each sample is set against a raw put+flush
    # of its bytes made next to it (the median of the differences); the reference measured back to back,
    # before and after the samples, is reported beside it
    allowance = 2 * small["rtt_ms"] + 0.5
    return {"scenario": "across_hosts", "layout": one.to_dict(), "link_delay_ms_each_way": rtt_ms / 2,
            "rtt_ms": small["rtt_ms"],
            "one_chunk_p50_ms": small["p50_ms"], "one_chunk_p99_ms": small["p99_ms"],
            "one_chunk_excess_ms": small["excess_p50_ms"],
            "one_chunk_allowance_ms": allowance, "one_chunk_target_met": small["excess_p50_ms"] <= allowance,
            "one_chunk_limit_ms_back_to_back": small["bytes_ms"] + allowance,
            "cold_p50_ms": small["cold_p50_ms"], "cold_p99_ms": small["cold_p99_ms"],
            "begin_p50_ms": small["begin_p50_ms"],
            "raw_put_gbps_one_chunk": small["raw_put_gbps"], "bytes_ms_one_chunk": small["bytes_ms"],
            # goodput against each sample's paired raw put (the median of the ratios); the back-to-back one beside
            "goodput_gbps": big["goodput_gbps"], "raw_put_gbps": big["paired_raw_gbps"],
            "ratio_goodput": big["ratio_paired"], "goodput_target_met": big["ratio_paired"] >= 0.9,
            "raw_put_gbps_back_to_back": big["raw_put_gbps"],
            "ratio_goodput_back_to_back": big["goodput_gbps"] / big["raw_put_gbps"],
            "wire_messages_per_request": small["wire_messages_per_request"],
            "wire_messages_by_kind": small["wire_messages_by_kind"],
            "plain_link": {"one_chunk_p50_ms": plain_small["p50_ms"], "one_chunk_bytes_ms": plain_small["bytes_ms"],
                           "goodput_gbps": plain_big["goodput_gbps"], "raw_put_gbps": plain_big["paired_raw_gbps"],
                           "ratio_goodput": plain_big["ratio_paired"],
                           "one_chunk_excess_ms": plain_small["excess_p50_ms"],
                           "rtt_ms": plain_small["rtt_ms"], "begin_p50_ms": plain_small["begin_p50_ms"]},
            "one_chunk": small, "big": big, "plain_one_chunk": plain_small, "plain_big": plain_big,
            "verified": all(x["verified"] for x in (small, big, plain_small, plain_big))}


if __name__ == "__main__":
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR1)  # a stuck agent says where: kill -USR1 <pid>
    role, shape, sock, chunks = sys.argv[1], KVLayout(**json.loads(sys.argv[2])), sys.argv[3], int(sys.argv[4])
    if role == "prefill":
        _prefill_agent(shape, sock, chunks)
    else:
        _decode_agent(shape, sock, chunks, sys.argv[5])
