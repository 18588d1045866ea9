"""A prefill or decode engine process for the demo and tests: JSON lines on stdin -> stdout.

``python -m pdpush_tools.demo.worker prefill|decode --spec JSON --chunk-tokens N --socket PATH``

It builds the same seeded model as everyone else, prints ``{"ready": true}``,
then serves commands. Logs go to stderr; stdout carries only replies.
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
import threading
import time
import traceback

import torch


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.detach().float().contiguous().numpy().tobytes()).decode()


def _reply(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


class _DecodeJob:
    def __init__(self, model, client, req_id: str, timeout_s: float) -> None:
        self.model, self.client, self.req_id, self.timeout_s = model, client, req_id, timeout_s
        self.arrivals: list[float] = []
        self.error: str | None = None
        self.req = None
        self.cache = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        from pdpush.integrations.transformers import cache_from_pool

        try:
            self.req = self.client.open(self.req_id, timeout_s=self.timeout_s)
            self.cache = cache_from_pool(self.model, self.req, self.timeout_s, self.arrivals)
        except Exception as e:  # noqa: BLE001 - reported to the orchestrator as text
            self.error = f"{type(e).__name__}: {e}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["prefill", "decode"])
    ap.add_argument("--spec", required=True)
    ap.add_argument("--chunk-tokens", type=int, required=True)
    ap.add_argument("--socket", required=True)
    ap.add_argument("--receiver", default="")
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    torch.set_num_threads(1)  # every process computes with the same thread count: bit-identical math
    from pdpush.client import DecodeClient, PrefillClient
    from pdpush.integrations import transformers as tf
    from pdpush.integrations.device_copy import D2HStager
    from pdpush_tools.harness.stray_write import writable_pool

    spec = tf.ModelSpec(**json.loads(a.spec))
    model = tf.build_model(spec, a.device)
    cuda = a.device.startswith("cuda")
    if a.role == "prefill":
        client = PrefillClient(spec.layout(a.chunk_tokens), a.socket, receiver=a.receiver, timeout_s=a.timeout,
                               pin_cuda=cuda)
    else:
        client = DecodeClient(a.socket, timeout_s=a.timeout, pin_cuda=cuda)
    stagers: dict[str | None, D2HStager] = {}
    jobs: dict[str, _DecodeJob] = {}
    _reply({"ready": True})
    for line in sys.stdin:
        try:
            cmd = json.loads(line)
            op = cmd["cmd"]
            if op == "prefill":
                mode = cmd.get("handover")  # None: the device's default (thread on CUDA, sync on the CPU)
                if mode not in stagers:
                    stagers[mode] = D2HStager(a.device, mode=mode, timeout_s=a.timeout)
                st = stagers[mode]
                r = tf.prefill_and_push(model, cmd["prompt"], client, cmd["req_id"], pipelined=cmd["pipelined"],
                                        layer_compute_ms=cmd.get("layer_compute_ms", 0.0), stager=st)
                handed = [t for rid, _, t in st.handed_over if rid == cmd["req_id"]]
                _reply({"first_token": r.first_token, "logits": _b64(r.last_logits), "t_start": r.t_start,
                        "t_end": r.t_end, "t_committed": r.t_committed, "layer_end": r.layer_end,
                        "bytes_sent": r.bytes_sent, "puts": r.puts, "chunks_skipped": r.chunks_skipped,
                        "already_sent_indexes": r.already_sent_indexes, "handover_mode": st.mode,
                        "t_forward": r.t_forward,
                        "handed_over": handed})
            elif op == "forward":  # a prefill forward with no push, timed (the push's cost to the forward)
                _reply({"forward_s": tf.forward_time(model, cmd["prompt"])})
            elif op == "open":
                jobs[cmd["req_id"]] = _DecodeJob(model, client, cmd["req_id"], a.timeout)
                _reply({"ok": True})
            elif op == "decode":
                job = jobs.pop(cmd["req_id"])
                job.thread.join(a.timeout)
                if job.error or job.cache is None:
                    raise RuntimeError(job.error or "layers did not arrive in time")
                t0 = time.monotonic()
                tokens, logits = tf.greedy(model, job.cache, cmd["first_token"], 1)
                t1 = time.monotonic()  # the first decoded token exists now
                more, more_logits = tf.greedy(model, job.cache, tokens[-1], cmd["steps"] - 1)
                job.req.release()
                _reply({"tokens": tokens + more, "logits": [_b64(x) for x in logits + more_logits],
                        "arrivals": job.arrivals, "t_decode_start": t0, "first_step_ms": (t1 - t0) * 1000})
            elif op == "corrupt":  # tests only: flip bytes of a layer in the pool before decode reads it
                job = jobs[cmd["req_id"]]
                job.thread.join(a.timeout)
                run = job.req.layer_runs(cmd["layer"], wait=False)[0]
                with writable_pool(client) as writable:  # (this engine's own mapping of the pool is read-only)
                    writable(run.view("uint8"))[0, 0, :4] ^= 0xFF
                job.cache = tf.cache_from_pool(model, job.req)
                _reply({"ok": True})
            else:
                raise ValueError(f"unknown command {op!r}")
        except Exception as e:  # noqa: BLE001 - the worker reports and keeps serving
            traceback.print_exc(file=sys.stderr)
            _reply({"error": f"{type(e).__name__}: {e}"})
    for st in stagers.values():
        st.close()
    client.close()


if __name__ == "__main__":
    main()
