"""Two network namespaces joined by a veth pair: the honest one-host stand-in for two hosts.

Used by tests/test_partition.py and ``pdpush bench --scenario isolation``. Needs root
and iproute2. Every address lives only inside the namespaces made here, and
``TwoHosts.close`` removes them.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from dataclasses import dataclass

NET = "10.213.77"  # lives only inside these namespaces


class Unavailable(RuntimeError):
    """This machine cannot make network namespaces: not root, or no iproute2. As root with iproute2, a namespace
    that cannot be made is an error, not this: CI runs as root, and its partition tests must run there, not skip."""


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@dataclass
class TwoHosts:
    p: str  # prefill-side namespace
    d: str  # decode-side namespace
    vp: str  # the prefill side's end of the link
    d_addr: str

    @classmethod
    def make(cls) -> TwoHosts:
        if os.geteuid() != 0 or shutil.which("ip") is None:
            raise Unavailable("needs root and iproute2 to create network namespaces")
        tag = secrets.token_hex(3)
        h = cls(f"pdp-p-{tag}", f"pdp-d-{tag}", f"vp{tag}", f"{NET}.2")
        try:
            vd = f"vd{tag}"
            ip("netns", "add", h.p)
            ip("netns", "add", h.d)
            # made here, then moved: made inside the namespaces, both ends had the same interface index, and UCX's
            # tcp wire-up between them was REJECTED
            ip("link", "add", h.vp, "type", "veth", "peer", "name", vd)
            ip("link", "set", h.vp, "netns", h.p)
            ip("link", "set", vd, "netns", h.d)
            for ns, dev, addr in ((h.p, h.vp, f"{NET}.1/30"), (h.d, vd, f"{NET}.2/30")):
                ip("-n", ns, "addr", "add", addr, "dev", dev)
                ip("-n", ns, "link", "set", dev, "up")
                ip("-n", ns, "link", "set", "lo", "up")
        except BaseException as e:
            h.close()
            # an end not moved yet is still here (deleting one end deletes the pair)
            subprocess.run(["ip", "link", "del", h.vp], capture_output=True, timeout=30)
            subprocess.run(["ip", "link", "del", f"vd{tag}"], capture_output=True, timeout=30)
            if isinstance(e, subprocess.CalledProcessError):  # (its stderr says why; the exception alone does not)
                raise RuntimeError(f"cannot make two network namespaces as root: ip {' '.join(e.cmd[1:])}: "
                                   f"{(e.stderr or b'').decode().strip()}") from None
            raise
        return h

    def in_ns(self, ns: str) -> list[str]:
        return ["ip", "netns", "exec", ns]

    def link(self, up: bool) -> None:
        ip("-n", self.p, "link", "set", self.vp, "up" if up else "down")

    def close(self) -> None:
        for ns in (self.p, self.d):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)

    def __getitem__(self, key: str) -> str:  # the tests' dict-style access
        return getattr(self, key)
