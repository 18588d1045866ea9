"""Checks PdpushConnector against whichever vLLM is importable (run by tests/test_vllm.py with the
0.32 engine venv, and with the official vllm 0.33.0 wheel unpacked --no-deps on PYTHONPATH).

Prints one JSON object: the vLLM version and every problem found (empty when all is well).
"""

from __future__ import annotations

import inspect
import json
import os
import sys

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


def main() -> int:
    import vllm
    from vllm.distributed.kv_transfer.kv_connector.v1 import base

    from pdpush.integrations.vllm import PdpushConnector, PdpushConnectorMetadata

    problems: list[str] = []
    Base = base.KVConnectorBase_V1
    if not issubclass(PdpushConnector, Base):
        problems.append("PdpushConnector is not a KVConnectorBase_V1")
    if not issubclass(PdpushConnectorMetadata, base.KVConnectorMetadata):
        problems.append("PdpushConnectorMetadata is not a KVConnectorMetadata")
    missing = sorted(getattr(PdpushConnector, "__abstractmethods__", ()))
    if missing:
        problems.append(f"abstract methods not implemented: {missing}")
    checked = []
    for name, ours in vars(PdpushConnector).items():
        theirs = getattr(Base, name, None)
        if not callable(ours) or theirs is None or name.startswith("__") and name != "__init__":
            continue
        ps = [(p.name, p.kind) for p in inspect.signature(ours).parameters.values()]
        pb = [(p.name, p.kind) for p in inspect.signature(theirs).parameters.values()]
        if ps != pb:
            problems.append(f"{name}: ours {ps} != base {pb}")
        checked.append(name)
    for name, ours in vars(PdpushConnector).items():  # classmethods (build_kv_connector_stats, build_prom_metrics)
        if isinstance(ours, classmethod) and hasattr(Base, name):
            ps = [(p.name, p.kind) for p in inspect.signature(getattr(PdpushConnector, name)).parameters.values()]
            pb = [(p.name, p.kind) for p in inspect.signature(getattr(Base, name)).parameters.values()]
            if ps != pb:
                problems.append(f"{name}: ours {ps} != base {pb}")
            checked.append(name)
    problems += _check_stats(checked)
    # the factory's out-of-tree loading path: module path + class name
    from vllm.distributed.kv_transfer.kv_connector import factory

    src = inspect.getsource(factory)
    if "kv_connector_module_path" not in src:
        problems.append("factory no longer reads kv_connector_module_path")
    # the shipped --kv-transfer-config examples parse as vLLM's KVTransferConfig and as our settings
    from pathlib import Path

    from vllm.config import KVTransferConfig

    from pdpush.integrations.vllm import ConnectorSettings

    for path in sorted((Path(__file__).resolve().parents[2] / "configs" / "vllm").glob("*.json")):
        try:
            ktc = KVTransferConfig(**json.loads(path.read_text()))
            ConnectorSettings(**ktc.kv_connector_extra_config)
            checked.append(path.name)
        except Exception as e:  # report every problem, not just the first
            problems.append(f"{path.name}: {type(e).__name__}: {e}")
    print(json.dumps({"vllm": vllm.__version__, "base_file": base.__file__, "checked": sorted(checked),
                      "problems": problems}))
    return 1 if problems else 0


def _check_stats(checked: list[str]) -> list[str]:
    """The connector's stats through vLLM's own classes: both sides' objects taken, summed as the scheduler sums
    them, sent as msgspec sends them to the front-end, logged (KVConnectorLogging) and recorded in Prometheus
    (KVConnectorProm, which finds the connector class through the factory); every series of ``stats.SERIES``
    must then be on the scrape, with the values put in."""
    from types import SimpleNamespace

    import msgspec
    import prometheus_client
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorLogging,
        KVConnectorProm,
        KVConnectorStats,
    )

    from pdpush.integrations.vllm import stats as st

    problems: list[str] = []
    w = st.WorkerStats()
    w.loaded(st.LoadRoute.LAYERWISE, 47, 0.004)
    w.load_fail(st.LoadRoute.ASYNC, st.LoadFailure.TIMEOUT, 3.0, asynchronous=True)
    w.load_bytes, w.load_layers, w.push_requests = 4096, 4, 2
    w.push_fail(st.PushFailure.SENDER_DOWN)
    other = st.WorkerStats()  # another TP rank: only its bytes count
    other.lead = False
    other.loaded(st.LoadRoute.LAYERWISE, 47, 0.004)
    other.load_bytes = 4096
    s = st.SchedulerStats()
    s.recompute(st.Recompute.PUSH_ENDED)
    s.push_unread, s.withdrawals_dropped = 3, 2
    taken = [w.take(), other.take(), s.take()]
    if not all(isinstance(t, KVConnectorStats) for t in taken):
        return [f"take() did not give KVConnectorStats: {taken}"]
    if w.take() is not None or w.totals()["load_requests"] != 1 or w.totals()["load_failed:async:timeout"] != 1:
        problems.append(f"after take: {w.take()}, totals {w.totals()}")
    agg = taken[0].aggregate(taken[1]).aggregate(taken[2])  # as KVOutputAggregator, then the scheduler
    payload = msgspec.msgpack.decode(msgspec.msgpack.encode(agg.to_dict()))
    ktc = KVTransferConfig(kv_connector="PdpushConnector", kv_connector_module_path="pdpush.integrations.vllm",
                           kv_role="kv_consumer")
    logged: list[str] = []
    logging_ = KVConnectorLogging(ktc)
    logging_.observe(payload)
    logging_.log(log_fn=lambda fmt, *a: logged.append(fmt % a))
    if not logged or "pdpush loads=1" not in logged[0]:
        problems.append(f"vLLM's log line: {logged}")
    prom = KVConnectorProm(SimpleNamespace(kv_transfer_config=ktc), ["model_name", "engine"], {0: ["m", "0"]})
    if prom.prom_metrics is None:
        return problems + ["build_prom_metrics gave no metrics"]
    prom.observe(payload, 0)
    prom.observe({"n": {"load_bytes": "x"}}, 0)  # a bad payload: logged, never raised
    text = prometheus_client.generate_latest().decode()
    samples = {ln.split("{")[0].split(" ")[0] for ln in text.splitlines() if ln and not ln.startswith("#")}
    for name, kind in st.SERIES:
        if (name + "_bucket" if kind == "histogram" else name) not in samples:
            problems.append(f"{name} ({kind}) is not on the scrape")
    want = ['vllm:pdpush_loads_total{engine="0",model_name="m",path="layerwise"} 1.0',
            'vllm:pdpush_load_failures_total{engine="0",model_name="m",path="async",reason="timeout"} 1.0',
            'vllm:pdpush_recomputes_total{engine="0",model_name="m",reason="push_ended"} 1.0',
            'vllm:pdpush_load_bytes_total{engine="0",model_name="m"} 8192.0',
            'vllm:pdpush_load_layers_total{engine="0",model_name="m"} 4.0',
            'vllm:pdpush_push_failures_total{engine="0",model_name="m",reason="sender_down"} 1.0',
            'vllm:pdpush_load_wait_seconds_count{engine="0",model_name="m",path="async"} 1.0',
            'vllm:pdpush_pushes_unread_total{engine="0",model_name="m"} 3.0',
            'vllm:pdpush_withdrawals_dropped_total{engine="0",model_name="m"} 2.0']
    problems += [f"not on the scrape: {ln}" for ln in want if ln not in text]
    checked.append("stats")
    return problems


if __name__ == "__main__":
    sys.exit(main())
