"""The connector's scheduler side (vLLM importable: the engine venv) against a real receiver and sender: decode
requests that end without loading the push they name withdraw it, however many end at once.

The engines' own tests (tests/test_fleet.py) show one such request, aborted in a real decode engine's queue; here
many end in one step, more than the asker's 64 questions outstanding, as when many clients hang up together."""

from __future__ import annotations

import json
import subprocess

import pytest

from pdpush import launch
from pdpush_tools.harness.vllm_cluster import ROOT, VLLM_PY
from tests.test_router import LAY, push, rx_status

pytestmark = pytest.mark.vllm

ENDED = 80  # requests ending in one step: more than MAX_QUERIES (64)

_SCRIPT = """
import json, sys, time
from types import SimpleNamespace as NS

from pdpush import kv_params
from pdpush.integrations.vllm.scheduler import MAX_QUERIES, SchedulerSide
from pdpush.integrations.vllm.settings import ConnectorSettings, Endpoints
from pdpush.layout import KVLayout

sock, n, lay = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
settings = ConnectorSettings(receiver_socket=sock)
side = SchedulerSide(settings, Endpoints.of(settings), KVLayout(**lay), "t", producer=False, consumer=True)
assert n > MAX_QUERIES
for i in range(n):  # all end in one step, never scheduled: their pushes unread
    side.request_finished(NS(request_id=f"r{i}", kv_transfer_params=kv_params.for_decode(f"p{i}"),
                             prompt_token_ids=list(range(16))))
sent_at_once = n - len(side._to_withdraw)
idle = NS(total_num_scheduled_tokens=0, num_scheduled_tokens={}, scheduled_new_reqs=[],
          scheduled_cached_reqs=NS(req_ids=[], new_block_ids=[], num_computed_tokens=[], resumed_req_ids=set()))
deadline, steps = time.monotonic() + 30, 0
while (side._to_withdraw or side.asker.inflight) and time.monotonic() < deadline:
    side.build_connector_meta(idle)  # each step sends what waits, and reads the answers that came
    steps += 1
    time.sleep(0.002)
print(json.dumps({"sent_at_once": sent_at_once, "left": len(side._to_withdraw),
                  "unanswered": len(side.asker.inflight), "steps": steps,
                  "push_unread": side.stats.totals()["push_unread"]}))
"""


def test_many_decode_requests_ending_unread_in_one_step_withdraw_every_push(tmp_path):
    rx = launch.start_receiver(tmp_path, pool_pages=2 * ENDED, **LAY)
    tx = launch.start_sender(tmp_path, staging_bytes=8 << 20)
    try:
        for i in range(ENDED):  # committed, unread
            push(tx, rx, f"p{i}", [i * 16 + k for k in range(16)])
        before = rx_status(rx)
        assert before["requests_committed"] == ENDED and before["requests_given_up"] == 0
        r = subprocess.run([str(VLLM_PY), "-c", _SCRIPT, rx.info["local_endpoint"].removeprefix("ipc://"),
                            str(ENDED), json.dumps(LAY)], capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert r.returncode == 0, r.stderr[-3000:]
        out = json.loads(r.stdout.strip().splitlines()[-1])
        assert out["left"] == 0 and out["unanswered"] == 0 and out["push_unread"] == ENDED, out
        assert out["sent_at_once"] < ENDED, out  # some had to wait for room: sent at later steps
        after = rx_status(rx)
        assert after["requests_given_up"] == ENDED, after  # each dropped at once, not kept unread for its TTL
        assert after["pool_pages_free"] + after["chunks_cached"] >= 2 * ENDED - 1, after
    finally:
        tx.stop()
        rx.stop()
