"""``pdpush doctor``: what this host's UCX can do for pdpush, and what stands in its way.

    {"ucx": {"version", "library", "source", "components", "transports", "devices", "resources"},
     "rdma_capable", "rdma_devices", "memlock_bytes", "memlock_needed_bytes", "open_files", "hugepages", "cuda",
     "warnings", "notes"}

``library`` is the absolute path of the one libucp in use (``transport/ucx_lib.py``). ``rdma_capable``: UCX
has an RDMA transport with a device to drive now. The parsing and the judgement are pure functions
(``ucx_lib.parse_print_info``, ``judge``) that tests drive directly; ``gather`` is the thin shell that reads the host.
Loads UCX (the daemons' set-up binding) only inside ``gather``.
"""

from __future__ import annotations

import ctypes.util
import os
import re
import resource
from pathlib import Path

from pdpush.errors import TransportError
from pdpush.transport.ucx_lib import RDMA_COMPONENTS, RDMA_TRANSPORTS, parse_print_info

CUDA_TRANSPORTS = {"cuda_copy", "cuda_ipc", "gdr_copy"}
OPEN_FILES_WANTED = 65536  # the soft limit a daemon raises itself to where its hard limit allows (daemon.py; the units)
# below this a daemon warns: 4,096 engines' lifelines (lifeline.MAX_LINES), or a router's 1,024 upstream connections
# and its clients', with ZeroMQ's, UCX's and the pool's own descriptors beside them
OPEN_FILES_NEEDED = 8192


def judge(facts: dict) -> tuple[list[str], list[str]]:
    """(warnings an operator must act on, notes), from the gathered facts."""
    out, notes = [], []
    ucx = facts["ucx"]
    if not facts["rdma_capable"]:
        if facts["rdma_devices"] and not set(ucx["components"]) & RDMA_COMPONENTS:
            out.append(f"this host has RDMA devices ({', '.join(facts['rdma_devices'])}) but this UCX "
                       f"({ucx['source']}, {ucx['library']}) has no RDMA transport: rebuild pdpush_native against an "
                       "RDMA-capable UCX (PDPUSH_UCX=system; docs/operations.md, \"RDMA\")")
        elif facts["rdma_devices"]:
            out.append(f"RDMA devices ({', '.join(facts['rdma_devices'])}) and UCX's RDMA components are here, but "
                       "UCX offers no RDMA transport on them: check UCX_TLS / UCX_NET_DEVICES, the device's ports, "
                       "and memlock")
        else:
            nets = sorted({f"{t}/{d}" for t, d in ucx["resources"] if t == "tcp" and d != "lo"})
            notes.append("no RDMA device on this host (/sys/class/infiniband is empty): between hosts UCX uses "
                         f"{', '.join(nets) or 'no network transport'}")
    need, have = facts.get("memlock_needed_bytes"), facts["memlock_bytes"]
    if need and have != -1 and have < need:
        if facts["rdma_capable"] or facts["rdma_devices"]:  # (only an RDMA registration locks the memory: as daemon.py)
            out.append(f"the locked-memory limit ({have} bytes) is below the {need} bytes to register: raise it "
                       "(LimitMEMLOCK=infinity, ulimit -l unlimited, --ulimit memlock=-1, or IPC_LOCK)")
        else:
            notes.append(f"the locked-memory limit ({have} bytes) is below the {need} bytes of the pool or staging: "
                         "no matter without RDMA (nothing is registered); raise it on hosts that have RDMA")
    hard = facts.get("open_files", {}).get("hard", -1)
    if hard != -1 and hard < OPEN_FILES_NEEDED:
        out.append(f"the open-files hard limit ({hard}) is below the {OPEN_FILES_NEEDED} that a busy daemon needs (a "
                   "daemon raises its soft limit up to it): raise it (LimitNOFILE=65536, ulimit -Hn, --ulimit "
                   "nofile=65536)")
    return out, notes


def _memlock() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return -1 if soft == resource.RLIM_INFINITY else soft


def _open_files() -> dict:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    inf = resource.RLIM_INFINITY
    return {"soft": -1 if soft == inf else soft, "hard": -1 if hard == inf else hard}


def _hugepages() -> dict:
    out: dict = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            k, _, v = line.partition(":")
            if k in ("HugePages_Total", "HugePages_Free", "Hugepagesize"):
                out[k] = int(v.split()[0]) * (1024 if k == "Hugepagesize" else 1)
    except OSError:
        pass
    try:
        thp = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
        out["transparent"] = re.search(r"\[(\w+)\]", thp).group(1)
    except (OSError, AttributeError):
        pass
    return {"total": out.get("HugePages_Total", 0), "free": out.get("HugePages_Free", 0),
            "page_bytes": out.get("Hugepagesize", 0), "transparent": out.get("transparent", "unknown")}


def host_facts(ucx_transports: list[str], memlock_needed: int | None) -> dict:
    """What the host offers beside UCX itself (no UCX call): RDMA devices, memlock, open files, hugepages, CUDA."""
    try:
        rdma_devices = sorted(os.listdir("/sys/class/infiniband"))
    except OSError:
        rdma_devices = []
    return {"rdma_devices": rdma_devices, "memlock_bytes": _memlock(), "memlock_needed_bytes": memlock_needed,
            "open_files": _open_files(), "hugepages": _hugepages(),
            "cuda": {"ucx_transports": sorted(set(ucx_transports) & CUDA_TRANSPORTS),
                     "libcuda": ctypes.util.find_library("cuda") is not None,
                     "gdrcopy": "gdr_copy" in ucx_transports or os.path.exists("/dev/gdrdrv")}}


def gather(ucx_env: dict | None = None, memlock_needed: int | None = None) -> dict:
    """Read this host and its UCX (loads libucp, with ``ucx_env`` as a daemon would apply it)."""
    from pdpush.transport import ucp, ucx_lib
    from pdpush.transport.ucx import configure_env

    configure_env(ucx_env)
    _, build = ucx_lib.load()
    try:
        ctx = ucp.Context(ucp.UCP_FEATURE_RMA | ucp.UCP_FEATURE_WAKEUP | ucp.UCP_FEATURE_STREAM)
    except ucp.UcpError as e:  # (what doctor is for: said in a line, exit 2, as the daemons would fail)
        raise TransportError(f"UCX {ucp.version_string()} from {build.library} cannot start: {e} (UCX_* settings: "
                             f"{ {k: v for k, v in os.environ.items() if k.startswith('UCX_')} })") from None
    try:
        comps, res = parse_print_info(ctx.print_info())
    finally:
        ctx.cleanup()
    transports = sorted({t for t, _ in res})
    facts = {
        "ucx": {"version": ucp.version_string(), "library": os.path.realpath(build.library), "source": build.source,
                "built_with": build.asked, "components": comps, "transports": transports,
                "devices": sorted({d for _, d in res}), "resources": [list(r) for r in res]},
        "rdma_capable": any(t in RDMA_TRANSPORTS for t in transports),
        **host_facts(transports, memlock_needed),
    }
    facts["warnings"], facts["notes"] = judge(facts)
    return facts


def render(f: dict) -> str:
    u = f["ucx"]
    lines = [f"UCX {u['version']} ({u['source']}, built with PDPUSH_UCX={u['built_with']}): {u['library']}",
             f"  components: {' '.join(u['components'])}",
             f"  transports: {' '.join(f'{t}/{d}' for t, d in u['resources'])}",
             f"RDMA: {'yes' if f['rdma_capable'] else 'no'}"
             f" (devices: {' '.join(f['rdma_devices']) or 'none'})",
             "memlock: " + ("unlimited" if f["memlock_bytes"] == -1 else f"{f['memlock_bytes']} bytes")
             + (f" (needs {f['memlock_needed_bytes']})" if f["memlock_needed_bytes"] else ""),
             "open files: soft {soft}, hard {hard} (a daemon raises its soft limit to the hard one, up to {w})".format(
                 w=OPEN_FILES_WANTED, **{k: "unlimited" if v == -1 else v for k, v in f["open_files"].items()}),
             "hugepages: {total} x {page_bytes} bytes, {free} free; transparent: {transparent}".format(**f["hugepages"]),
             f"CUDA: UCX transports {' '.join(f['cuda']['ucx_transports']) or 'none'}, "
             f"libcuda {'found' if f['cuda']['libcuda'] else 'not found'}, "
             f"gdrcopy {'yes' if f['cuda']['gdrcopy'] else 'no'}"]
    lines += [f"note: {n}" for n in f["notes"]] + [f"warning: {w}" for w in f["warnings"]]
    return "\n".join(lines)
