"""Which libucp this process uses: exactly one, the one ``pdpush_native`` was built against.

The build chooses the UCX (``PDPUSH_UCX`` = auto | system | wheel, native/CMakeLists.txt) and records it in
``pdpush_native/_ucx_build.py``. ``load()`` refuses a process that already holds another libucp (an
``LD_PRELOAD``, a library that brought its own): a second UCX aborts in its own constructor, or mixes
handles with ours, so the daemon stops first with a typed error naming both files. Then it loads that libucp
(the ctypes set-up calls of ``ucp.py`` and the native data plane share it) and checks that the native module
resolved its calls to the same file.

Pure path logic plus one read of ``/proc/self/maps``; imports no UCX until ``load()``.
"""

from __future__ import annotations

import ctypes
import os
import re
from dataclasses import dataclass

from pdpush.errors import ConfigError, ForeignUcx

_LIBUCP = re.compile(r"/libucp\.so(\.\d+)*$")
RDMA_TRANSPORTS = {"rc", "rc_verbs", "rc_mlx5", "dc", "dc_mlx5", "ud", "ud_verbs", "ud_mlx5", "srd", "ib"}
RDMA_COMPONENTS = {"ib", "rdmacm", "mlx5", "efa", "gga"}
_RESOURCE = re.compile(r"#\s+resource \d+\s+:.*--\s+(\S+)/(\S+)")
_COMPONENT = re.compile(r"#\s+component \d+\s+:\s+(\S+)")


def parse_print_info(text: str) -> tuple[list[str], list[tuple[str, str]]]:
    """``ucp_context_print_info`` text: (components, [(transport, device)]) in its order."""
    comps = [m.group(1) for m in map(_COMPONENT.match, text.splitlines()) if m]
    res = [(m.group(1), m.group(2)) for m in map(_RESOURCE.match, text.splitlines()) if m]
    return comps, res


def no_rdma_warning(info: dict, where: str) -> str | None:
    """A daemon that talks to other hosts (``where``: its address or its peers') with no RDMA transport:
    the one warning that names what is missing. None where UCX has one."""
    if info["rdma"]:
        return None
    missing = "this UCX has no RDMA component (ib, rdmacm, mlx5, efa)" if not set(info["components"]) & \
        RDMA_COMPONENTS else "UCX finds no RDMA device to drive (/sys/class/infiniband, UCX_NET_DEVICES)"
    nets = [a for a in info["available"] if not a.endswith(("/memory", "/lo"))]
    return (f"{where} is not loopback, but UCX {info['version']} ({info['source']}, {info['library']}) can only use "
            f"{' '.join(nets) or 'no network transport'} between hosts: {missing}. KV moves over tcp; "
            "see `pdpush doctor`")


def open_tcp_warning(info: dict) -> str | None:
    """UCX's tcp lanes on a device other than loopback: any peer that reaches their ports can write anywhere in
    this daemon's memory (UCX's tcp puts and its software RMA carry raw addresses and check no rkey; no hello or
    token is needed). The warning that says so and what to pin; None where tcp listens on loopback only."""
    nets = [a for a in info["available"] if a.startswith("tcp/") and a != "tcp/lo"]
    if not nets:
        return None
    return (f"UCX's tcp lanes listen on {' '.join(nets)}: a peer that reaches their ports can write anywhere in "
            "this daemon's memory, with no hello or token (UCX checks no rkey over tcp). Pin ucx_env UCX_NET_DEVICES "
            "to the data network's device, firewall UCX_TCP_PORT_RANGE to the peer hosts (SECURITY.md)")


@dataclass(frozen=True)
class Build:
    source: str  # "wheel" | "system"
    asked: str  # PDPUSH_UCX at build time: auto | system | wheel
    version: str  # the headers' API version it was built with
    library: str  # the libucp file it links (absolute)


def build() -> Build:
    """What ``pdpush_native`` was built against (without loading it)."""
    try:
        from pdpush_native import _ucx_build as b
    except ImportError:  # a build from before the switch: the wheel's
        b = None
    source = getattr(b, "SOURCE", "wheel")
    libdir = getattr(b, "LIBDIR", "")
    if source == "wheel" or not libdir:
        try:
            import libucx
        except ImportError as e:
            raise ConfigError("pdpush_native uses the libucx wheel's UCX, but libucx is not installed "
                              "(pip install 'pdpush[daemons]')") from e
        libdir = os.path.join(os.path.dirname(libucx.__file__), "lib")
    return Build(source, getattr(b, "ASKED", "wheel"), getattr(b, "VERSION", ""),
                 os.path.join(libdir, "libucp.so.0"))


def mapped(maps_text: str) -> list[str]:
    """The libucp files mapped in a process, from its ``/proc/<pid>/maps`` text (distinct, in order)."""
    out: list[str] = []
    for line in maps_text.splitlines():
        parts = line.split(None, 5)
        if len(parts) == 6 and _LIBUCP.search(parts[5]) and parts[5] not in out:
            out.append(parts[5])
    return out


def same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def foreign(maps_text: str, want: str) -> list[str]:
    """Mapped libucp files that are not ``want``."""
    return [p for p in mapped(maps_text) if not same_file(p, want)]


def _maps() -> str:
    with open("/proc/self/maps") as f:
        return f.read()


_loaded: tuple[ctypes.CDLL, Build] | None = None


def load() -> tuple[ctypes.CDLL, Build]:
    """Load the one libucp (once per process) and return it with what the build says. Raises ForeignUcx
    where another libucp is already mapped, ConfigError where the build's libucp is missing."""
    global _loaded
    if _loaded is not None:
        return _loaded
    b = build()
    others = foreign(_maps(), b.library)
    if others:
        raise ForeignUcx(f"refusing to start UCX: this process already holds {', '.join(others)}, but pdpush_native "
                         f"was built against {b.library} ({b.source} UCX {b.version}); two UCX instances in one "
                         "process abort or mix handles. Remove the other from LD_PRELOAD/LD_LIBRARY_PATH, or rebuild "
                         "pdpush_native against it (PDPUSH_UCX=system, docs/operations.md, \"RDMA\")")
    if not os.path.exists(b.library):
        raise ConfigError(f"pdpush_native was built against {b.library}, which is gone: rebuild it (make install)")
    lib = ctypes.CDLL(b.library, mode=ctypes.RTLD_GLOBAL)
    import pdpush_native._dataplane as dp

    used = dp.libucp_path()
    if not same_file(used, b.library):
        raise ForeignUcx(f"pdpush_native's UCX calls resolved to {used}, not {b.library}: two UCX instances")
    _loaded = (lib, b)
    return _loaded
