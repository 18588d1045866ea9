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


if __name__ == "__main__":
    sys.exit(main())
