"""``--compare nixl``: NIXL's raw DRAM->DRAM WRITE of the same bytes, between two processes, in the same run.

Optional: NIXL is not a dependency (``pip install --no-deps nixl-cu12==1.5.1 nixl==1.5.1``).
``python -m pdpush_tools.bench.nixl_ref NBYTES LAYERS`` is the passive side; ``measure`` the initiator.
Like the pdpush ceiling, one WRITE per layer, each waited for. NIXL's progress thread is off
(it cost 2.5-8x bandwidth here, notes/ucx.md). The target checks what landed with a checksum.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time

import numpy as np
import xxhash

from pdpush.launch import die_with_parent  # the reference process dies with the bench


def available() -> bool:
    try:
        import nixl._api  # noqa: F401
    except ImportError:
        return False
    return True


def _layer_descs(agent, arr: np.ndarray, layers: int):
    per = arr.nbytes // layers
    base = arr.ctypes.data
    return [agent.get_xfer_descs([(base + i * per, per, 0)], "DRAM") for i in range(layers)]


def _register(agent, arr: np.ndarray) -> None:
    agent.register_memory([(arr.ctypes.data, arr.nbytes, 0, "")], "DRAM")


_TAG = "PDPUSH-JSON "  # NIXL logs to stdout too: our lines carry a tag


def _say(obj: dict) -> None:
    print(_TAG + json.dumps(obj), flush=True)


def _hear(stream) -> dict:
    for line in stream:
        if line.startswith(_TAG):
            return json.loads(line[len(_TAG):])
    raise RuntimeError("NIXL target exited without answering")


def _serve(nbytes: int, layers: int) -> None:
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent("pdpush-nixl-target", nixl_agent_config(enable_prog_thread=False))
    arr = np.zeros(nbytes, dtype=np.uint8)
    _register(agent, arr)
    descs = [agent.get_serialized_descs(d).hex() for d in _layer_descs(agent, arr, layers)]
    _say({"meta": agent.get_agent_metadata().hex(), "descs": descs})
    import select

    while not select.select([sys.stdin], [], [], 0.0005)[0]:  # until the initiator closes our stdin
        agent.get_new_notifs()  # progress thread is off: wire-up needs the passive side to progress
    sys.stdin.read()
    _say({"xxh3": xxhash.xxh3_64_hexdigest(arr)})


def measure(layer_bytes: int, layers: int, reps: int = 5) -> dict:
    from nixl._api import nixl_agent, nixl_agent_config

    total = layer_bytes * layers
    proc = subprocess.Popen([sys.executable, "-m", "pdpush_tools.bench.nixl_ref", str(total), str(layers)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            preexec_fn=die_with_parent)
    try:
        info = _hear(proc.stdout)
        agent = nixl_agent("pdpush-nixl-initiator", nixl_agent_config(enable_prog_thread=False))
        src = np.frombuffer(np.random.default_rng(3).bytes(total), dtype=np.uint8).copy()
        _register(agent, src)
        remote = agent.add_remote_agent(bytes.fromhex(info["meta"]))
        rdescs = [agent.deserialize_descs(bytes.fromhex(d)) for d in info["descs"]]
        ldescs = _layer_descs(agent, src, layers)
        rates = []
        for _ in range(reps + 1):
            t = time.perf_counter()
            for i in range(layers):
                h = agent.initialize_xfer("WRITE", ldescs[i], rdescs[i], remote)
                state = agent.transfer(h)
                deadline = time.monotonic() + 30
                while state not in ("DONE", "ERR"):
                    state = agent.check_xfer_state(h)
                    if time.monotonic() > deadline:
                        raise TimeoutError("NIXL transfer did not finish in 30 s")
                agent.release_xfer_handle(h)
                if state == "ERR":
                    raise RuntimeError("NIXL transfer failed")
            rates.append(total / (time.perf_counter() - t) / 1e9)
        proc.stdin.close()
        landed = _hear(proc.stdout)["xxh3"]
        return {"median_gbps": statistics.median(rates[1:]), "samples_gbps": rates[1:],
                "verified": landed == xxhash.xxh3_64_hexdigest(src)}
    finally:
        if proc.poll() is None:
            try:
                proc.stdin.close()
            except OSError:
                pass
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


if __name__ == "__main__":
    _serve(int(sys.argv[1]), int(sys.argv[2]))
