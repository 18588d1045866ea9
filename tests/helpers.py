"""Helpers shared by the integration tests: synthetic KV, a push, a read-back, daemon options."""

from __future__ import annotations

import resource
import time

import numpy as np

from pdpush import launch
from pdpush.client import DecodeClient, PrefillClient
from pdpush.layout import KVLayout
from pdpush_tools.harness.stray_write import writable_pool  # noqa: F401 - the tests' negative controls use it


def kv(layout: KVLayout, tokens: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    row = layout.head_dim * layout.dtype_bytes
    shape = (layout.layers, tokens, layout.kv_heads, row)
    return (rng.integers(0, 256, shape, dtype=np.uint8), rng.integers(0, 256, shape, dtype=np.uint8))


def rx_opts(layout: KVLayout, pool_pages: int = 64) -> dict:
    return dict(layers=layout.layers, kv_heads=layout.kv_heads, head_dim=layout.head_dim, dtype=layout.dtype,
                chunk_tokens=layout.chunk_tokens, pool_pages=pool_pages, kind=layout.kind, kv_scales=layout.kv_scales,
                model_id=layout.model_id)


def push(pc: PrefillClient, req_id: str, ids: list[int], k: np.ndarray, v: np.ndarray):
    h = pc.begin(req_id, ids)
    for layer in range(pc.layout.layers):
        h.put_layer(layer, k[layer], v[layer])
    return h, h.finish(timeout_s=30)


def read_back(dc: DecodeClient, req_id: str, layout: KVLayout, tokens: int, torch_check: bool = False):
    row = layout.head_dim * layout.dtype_bytes
    ks, vs = [], []
    with dc.open(req_id, timeout_s=30) as req:
        assert req.tokens == tokens
        if torch_check:  # torch views agree too, with the right dtype and shape
            import torch

            tk, _ = req.layer_kv(layout.layers - 1)
            assert tk.dtype == getattr(torch, layout.dtype)
            assert tuple(tk.shape) == (tokens, layout.kv_heads, layout.head_dim)
            ks_torch = tk.view(torch.uint8).numpy().reshape(tokens, layout.kv_heads, row).copy()
        for layer in range(layout.layers):
            k, v = req.kv_bytes(layer, wait=True, timeout_s=30)
            ks.append(k)
            vs.append(v)
    if torch_check:
        assert np.array_equal(ks_torch, ks[-1])
    return np.stack(ks), np.stack(vs)


def sock(d: launch.Daemon) -> str:
    info = d.info
    return (info.get("local_endpoint") or info["ingress_endpoint"]).removeprefix("ipc://")


def until(pred, timeout_s: float, what: str):
    """Poll ``pred`` (a daemon's status, say) until it is true; fail naming ``what`` at the deadline."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def nofile_limits(pid: int) -> tuple[int, int]:
    """(soft, hard) open-files limit of process ``pid``, from /proc (-1: unlimited)."""
    for line in open(f"/proc/{pid}/limits"):
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]
            return tuple(-1 if v == "unlimited" else int(v) for v in (soft, hard))
    raise AssertionError("no open-files line")


def low_nofile_prefix() -> tuple[list[str], int, int]:
    """A command prefix that starts a daemon with a soft open-files limit of 1,024 (a shell's, or containerd 2's
    default) under this process's own hard limit (a container's root may not raise it: no CAP_SYS_RESOURCE); that
    hard limit, and the soft limit the daemon should raise itself to."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    hard = 1 << 20 if hard == resource.RLIM_INFINITY else hard
    return ["prlimit", f"--nofile=1024:{hard}", "--"], hard, min(hard, 65536)


def round_trip(tx: launch.Daemon, rx: launch.Daemon, layout: KVLayout, req_id: str, ids: list[int],
               seed: int = 3) -> None:
    """Push ``ids``'s KV through ``tx`` to ``rx`` and read it back: byte for byte the same, or AssertionError."""
    pc, dc = PrefillClient(layout, sock(tx), timeout_s=10), DecodeClient(sock(rx), timeout_s=10)
    try:
        k, v = kv(layout, len(ids), seed=seed)
        push(pc, req_id, ids, k, v)
        got_k, got_v = read_back(dc, req_id, layout, len(ids))
        assert np.array_equal(got_k, k) and np.array_equal(got_v, v)
    finally:
        pc.close()
        dc.close()


class TcpCutter:
    """A TCP forwarder on loopback to ``target`` (host, port), whose live connections ``cut()`` closes, as a
    middlebox or a link reset would (both ends see it end; new connections are forwarded again). Threads; ``close``
    stops it and ends every connection."""

    def __init__(self, target: tuple[str, int]) -> None:
        import socket
        import threading

        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.accepted = 0
        self._pairs: list = []
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket
        import threading

        while not self._closed:
            try:
                a, _ = self.listener.accept()
                b = socket.create_connection(self.target, timeout=5)
                b.settimeout(None)  # (the connect's timeout only: a quiet link is no reason to end it)
            except OSError:
                continue
            with self._lock:
                self.accepted += 1
                self._pairs.append((a, b))
            for src, dst in ((a, b), (b, a)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    @staticmethod
    def _pump(src, dst) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):  # either end gone: the other goes too
            try:
                s.shutdown(2)
            except OSError:
                pass

    def cut(self) -> None:
        with self._lock:
            pairs, self._pairs = self._pairs, []
        for a, b in pairs:
            for s in (a, b):
                try:
                    s.shutdown(2)
                except OSError:
                    pass
                s.close()

    def close(self) -> None:
        self._closed = True
        self.listener.close()
        self.cut()
