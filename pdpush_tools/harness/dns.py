"""A DNS server for the hosts harness: it answers A queries for the names it is given, each after a delay, and
every other query at once (no record, or NXDOMAIN for a name it does not know). A host whose /etc/resolv.conf
names it (``Host.etc("resolv.conf")``) resolves those names slowly, as from a DNS server under load or across a
congested link; nothing else on the machine sees it. The names are read from a JSON file at each query: rewrite it
to move a name. A name maps to its IPv4 address, or to ``{"a": IPv4, "delay_s": s}`` (its own delay), or to
``{"servfail": true}``: a server failing (SERVFAIL, which a resolver reports as a temporary failure, EAI_AGAIN).

    python -m pdpush_tools.harness.dns --bind 10.213.7.2 --names names.json --delay-s 2

Prints ``ready`` once it listens, then one JSON line per query answered.
"""

from __future__ import annotations

import argparse
import json
import socket
import struct
import sys
import threading
import time

A, AAAA, IN = 1, 28, 1
NOERROR, SERVFAIL, NXDOMAIN = 0, 2, 3


def _question(packet: bytes) -> tuple[str, int, int]:
    """(name, qtype, the question's end) of a query's first question."""
    labels, at = [], 12
    while packet[at]:
        n = packet[at]
        labels.append(packet[at + 1:at + 1 + n].decode("ascii", "replace"))
        at += 1 + n
    qtype = struct.unpack("!H", packet[at + 1:at + 3])[0]
    return ".".join(labels).lower(), qtype, at + 5


def answer(packet: bytes, names: dict[str, str | dict]) -> tuple[bytes, str, int]:
    """The response to ``packet``: an A record for a known name's A query; no record for its other types;
    SERVFAIL for a name said to fail; NXDOMAIN for any other name. Returns (response, name, qtype)."""
    name, qtype, end = _question(packet)
    entry = names.get(name.rstrip("."))
    if isinstance(entry, str):
        entry = {"a": entry}
    rcode = NXDOMAIN if entry is None else SERVFAIL if entry.get("servfail") else NOERROR
    records = b""
    if rcode == NOERROR and qtype == A:
        records = struct.pack("!HHHIH", 0xC00C, A, IN, 0, 4) + socket.inet_aton(entry["a"])
    flags = 0x8180 | rcode  # a response, recursion desired and available
    header = struct.pack("!HHHHHH", struct.unpack("!H", packet[:2])[0], flags, 1, 1 if records else 0, 0, 0)
    return header + packet[12:end] + records, name, qtype


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--bind", required=True)
    p.add_argument("--port", type=int, default=53)
    p.add_argument("--names", required=True, help="a JSON file {name: IPv4 or {a, delay_s, servfail}}, read at "
                   "each query")
    p.add_argument("--delay-s", type=float, default=0.0, help="how late the names' A queries are answered")
    a = p.parse_args()
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind((a.bind, a.port))
    lock = threading.Lock()
    print("ready", flush=True)

    def reply(packet: bytes, peer: tuple) -> None:
        try:
            with open(a.names) as f:
                names = {k.lower(): v for k, v in json.load(f).items()}
            response, name, qtype = answer(packet, names)
        except (IndexError, struct.error, OSError, ValueError, TypeError, KeyError):
            return  # not a query this server reads (or a names file it cannot)
        entry = names.get(name.rstrip("."))
        if entry is not None:
            time.sleep(entry.get("delay_s", a.delay_s) if isinstance(entry, dict) else a.delay_s)
        with lock:
            s.sendto(response, peer)
            print(json.dumps({"name": name, "type": qtype, "at": time.monotonic()}), flush=True)

    while True:
        packet, peer = s.recvfrom(4096)
        threading.Thread(target=reply, args=(packet, peer), daemon=True).start()


if __name__ == "__main__":
    sys.exit(main())
