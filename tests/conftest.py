"""Shared fixtures: real daemons as subprocesses, always stopped by pid."""

from __future__ import annotations

import os

import pytest

from pdpush import launch

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")


def pytest_sessionfinish(session, exitstatus):
    """A session that failed keeps its scratch directories (launch.scratch_dir): their daemons' logs say why."""
    if exitstatus != 0:
        os.environ["PDPUSH_KEEP_SCRATCH"] = "1"


@pytest.fixture(scope="session", autouse=True)
def _model_cache(tmp_path_factory):
    """vLLM test models are built once per size in this session (vllm_cluster.build_model)."""
    os.environ["PDPUSH_MODEL_CACHE"] = str(tmp_path_factory.mktemp("models"))
    yield
    os.environ.pop("PDPUSH_MODEL_CACHE", None)


@pytest.fixture
def daemons(tmp_path):
    """Factory: daemons.receiver(**opts) / daemons.sender(**opts); all stopped at teardown."""
    started: list[launch.Daemon] = []

    class Factory:
        workdir = tmp_path

        def receiver(self, **opts) -> launch.Daemon:
            opts.setdefault("prefault", False)
            d = launch.start_receiver(tmp_path, **opts)
            started.append(d)
            return d

        def sender(self, receiver: launch.Daemon | None = None, **opts) -> launch.Daemon:
            if receiver is not None:
                opts.setdefault("default_receiver", receiver.info["control_endpoint"])
            opts.setdefault("staging_bytes", 64 << 20)
            opts.setdefault("prefault", False)
            d = launch.start_sender(tmp_path, **opts)
            started.append(d)
            return d

    try:
        yield Factory()
    finally:
        for d in reversed(started):
            d.stop()
