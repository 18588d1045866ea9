"""``pdpush demo``: PD-disaggregated generation with a real transformers model, checked against colocated.

Starts a receiver and a sender daemon (the shipped configs, with the model's
layout and private ports/sockets), a prefill engine process and a decode
engine process, and a colocated reference here. Runs one eager and one
pipelined request, then a request sharing a long prefix with the pipelined one.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from pdpush import launch
from pdpush.errors import PdpushError, TransportTimeout

ROOT_CONFIGS = Path(__file__).resolve().parents[2] / "configs"


class Worker:
    """An engine process speaking JSON lines; stopped by pid."""

    def __init__(self, role: str, spec: dict, chunk_tokens: int, sock: str, workdir: Path,
                 receiver: str = "", device: str = "cpu") -> None:
        self.role = role
        self.log_path = workdir / f"{role}-engine.log"
        self._log = open(self.log_path, "wb")
        args = [sys.executable, "-m", "pdpush_tools.demo.worker", role, "--spec", json.dumps(spec), "--chunk-tokens",
                str(chunk_tokens), "--socket", sock, "--receiver", receiver, "--device", device]
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                     env={**os.environ, "UCX_WARN_UNUSED_ENV_VARS": "n"}, text=True, bufsize=1)

    def read(self, timeout_s: float = 120.0) -> dict:
        import select

        p = select.poll()  # (poll, not select: fine past 1,024 open fds)
        p.register(self.proc.stdout, select.POLLIN)
        if not p.poll(timeout_s * 1000):
            raise TransportTimeout(f"{self.role} engine did not answer in {timeout_s}s:\n{self.log()}")
        line = self.proc.stdout.readline()
        if not line:
            raise PdpushError(f"{self.role} engine exited:\n{self.log()}")
        out = json.loads(line)
        if "error" in out:
            raise PdpushError(f"{self.role} engine: {out['error']}")
        return out

    def call(self, cmd: dict, timeout_s: float = 120.0) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self.read(timeout_s)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-5000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(10)
            except (subprocess.TimeoutExpired, OSError):
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


def _logits(b64: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(b64), dtype=np.float32)


class Cluster:
    """Daemons + one prefill and one decode engine process, all stopped on close()."""

    def __init__(self, spec, chunk_tokens: int, workdir: Path, pool_pages: int, staging_bytes: int,
                 receiver_config: Path | None = None, sender_config: Path | None = None, device: str = "cpu") -> None:
        self.spec = spec
        self.procs: list = []
        lay = spec.layout(chunk_tokens)
        try:
            if receiver_config is not None and sender_config is not None:  # daemons already running
                from pdpush import config as cfgmod

                rcfg = cfgmod.read_receiver(receiver_config)
                scfg = cfgmod.load(cfgmod.SenderConfig, sender_config)
                if rcfg.layout.fingerprint() != lay.fingerprint():
                    raise PdpushError(f"the receiver serves {rcfg.layout}, the demo model needs {lay}: "
                                      "adjust the receiver config or the demo's model flags")
                rx_sock, tx_sock, receiver = str(rcfg.local_socket_path()), str(scfg.ingress_socket_path()), ""
            else:
                rcfg_file, scfg_file = ROOT_CONFIGS / "receiver.toml", ROOT_CONFIGS / "sender.toml"
                rx_sock, tx_sock = str(workdir / "receiver.sock"), str(workdir / "sender.sock")
                self.rx = launch.start_receiver(
                    workdir, config=rcfg_file if rcfg_file.exists() else None, control_port=0, ucx_port=0,
                    local_socket=rx_sock, layers=lay.layers, kv_heads=lay.kv_heads, head_dim=lay.head_dim,
                    dtype=lay.dtype, chunk_tokens=chunk_tokens, model_id=lay.model_id, pool_pages=pool_pages,
                    prefault=True, metrics_port=0)
                self.procs.append(self.rx)
                self.tx = launch.start_sender(
                    workdir, config=scfg_file if scfg_file.exists() else None, ingress_socket=tx_sock,
                    staging_bytes=staging_bytes, default_receiver=self.rx.info["control_endpoint"], prefault=True,
                    metrics_port=0)
                self.procs.append(self.tx)
                receiver = self.rx.info["control_endpoint"]
            sd = asdict(spec)
            self.decode = Worker("decode", sd, chunk_tokens, rx_sock, workdir, device=device)
            self.procs.append(self.decode)
            self.prefill = Worker("prefill", sd, chunk_tokens, tx_sock, workdir, receiver, device=device)
            self.procs.append(self.prefill)
            self.decode.read()
            self.prefill.read()
        except BaseException:
            self.close()
            raise

    def run(self, req_id: str, prompt: list[int], new_tokens: int, pipelined: bool, layer_compute_ms: float,
            handover: str | None = None) -> dict:
        self.decode.call({"cmd": "open", "req_id": req_id})
        p = self.prefill.call({"cmd": "prefill", "req_id": req_id, "prompt": prompt, "pipelined": pipelined,
                               "layer_compute_ms": layer_compute_ms, "handover": handover})
        d = self.decode.call({"cmd": "decode", "req_id": req_id, "first_token": p["first_token"],
                              "steps": new_tokens - 1})
        t_all = d["arrivals"][-1]
        return {"prefill": p, "decode": d, "tokens": [p["first_token"], *d["tokens"]],
                "logits": [_logits(p["logits"]), *(_logits(x) for x in d["logits"])],
                "prefill_ms": (p["t_end"] - p["t_start"]) * 1000,
                "forward_ms": (p["t_end"] - p["t_forward"]) * 1000,
                "exposed_transfer_ms": max(0.0, (t_all - p["t_end"]) * 1000),
                "exposed_transfer_raw_ms": (t_all - p["t_end"]) * 1000,
                # D can decode once it holds every layer AND P's first token exists (end of prefill)
                "ttft_ms": (max(t_all, p["t_end"]) - p["t_start"]) * 1000 + d["first_step_ms"],
                "first_step_ms": d["first_step_ms"]}

    def close(self) -> None:
        for p in reversed(self.procs):
            p.stop()
        self.procs = []


def reference(spec, prompts: list[list[int]], new_tokens: int,
              device: str = "cpu") -> list[tuple[list[int], list[np.ndarray]]]:
    import torch

    from pdpush.integrations import transformers as tf

    torch.set_num_threads(1)
    model = tf.build_model(spec, device)
    out = []
    for p in prompts:
        toks, logits = tf.colocated(model, p, new_tokens)
        out.append((toks, [lg.numpy() for lg in logits]))
    return out


def compare(ref: tuple[list[int], list[np.ndarray]], got: dict) -> tuple[bool, bool]:
    tokens_match = ref[0] == got["tokens"]
    logits_match = len(ref[1]) == len(got["logits"]) and all(
        np.array_equal(a, b) for a, b in zip(ref[1], got["logits"], strict=True))
    return tokens_match, logits_match


def run_demo(*, layers: int = 8, hidden: int = 256, heads: int = 4, kv_heads: int = 2, prompt_tokens: int = 1000,
             new_tokens: int = 16, dtype: str = "float32", chunk_tokens: int = 64, layer_compute_ms: float = 25.0,
             prefix_fraction: float = 0.75, seed: int = 0, console=None, receiver_config: Path | None = None,
             sender_config: Path | None = None, device: str = "cpu", handover: str | None = None) -> dict:
    from pdpush.integrations.transformers import ModelSpec

    spec = ModelSpec(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, dtype=dtype, seed=seed)
    lay = spec.layout(chunk_tokens)
    rng = np.random.default_rng(seed + 1 if receiver_config is None else time.time_ns() % (1 << 32))
    p_eager = rng.integers(0, spec.vocab, prompt_tokens).tolist()
    p_pipe = rng.integers(0, spec.vocab, prompt_tokens).tolist()
    shared = int(prompt_tokens * prefix_fraction)
    p_second = p_pipe[:shared] + rng.integers(0, spec.vocab, prompt_tokens - shared).tolist()
    chunks = lay.num_chunks(prompt_tokens)
    workdir = launch.scratch_dir("pdpush-demo-")
    say = (lambda m: console.log(m)) if console is not None else (lambda m: None)
    say(f"model {spec.model_id}, {dtype}; KV {lay.token_bytes * prompt_tokens / 2**20:.2f} MiB per layer "
        f"for a {prompt_tokens}-token prompt ({chunks} chunks of {chunk_tokens})")
    say("using the running daemons" if receiver_config else
        "starting receiver + sender daemons and the prefill/decode engine processes")
    cluster = Cluster(spec, chunk_tokens, workdir, pool_pages=chunks * 4,
                      staging_bytes=max(4 << 20, 2 * lay.layers * chunks * lay.page_bytes),
                      receiver_config=receiver_config, sender_config=sender_config, device=device)
    try:
        say("computing the colocated reference")
        refs = reference(spec, [p_eager, p_pipe, p_second], new_tokens, device)
        say("warm-up request (not reported)")
        cluster.run("demo-warmup", rng.integers(0, spec.vocab, prompt_tokens).tolist(), 2, True, 0.0, handover)
        say(f"eager: prefill all {layers} layers, then push")
        eager = cluster.run("demo-eager", p_eager, new_tokens, False, layer_compute_ms, handover)
        say("pipelined: push each layer as it is produced")
        pipe = cluster.run("demo-pipelined", p_pipe, new_tokens, True, layer_compute_ms, handover)
        say(f"prefix reuse: a second request sharing its first {shared} tokens with the pipelined one")
        second = cluster.run("demo-second", p_second, new_tokens, True, layer_compute_ms, handover)
        layer_end = pipe["prefill"]["layer_end"]
        arrivals = pipe["decode"]["arrivals"]
    finally:
        cluster.close()
    matches = [compare(r, g) for r, g in zip(refs, [eager, pipe, second], strict=True)]
    full_bytes = lay.layers * chunks * lay.page_bytes
    return {
        "model": spec.model_id, "dtype": dtype, "device": device, "handover": pipe["prefill"]["handover_mode"],
        "prompt_tokens": prompt_tokens, "new_tokens": new_tokens,
        "chunk_tokens": chunk_tokens, "layer_compute_ms_emulated": layer_compute_ms,
        "tokens_match": all(t for t, _ in matches),
        "logits_match": all(lg for _, lg in matches),
        "per_request_match": {n: {"tokens": t, "logits": lg}
                              for n, (t, lg) in zip(["eager", "pipelined", "second"], matches, strict=True)},
        "reference_tokens": refs[1][0], "disaggregated_tokens": pipe["tokens"],
        "ttft_ms": {"eager": eager["ttft_ms"], "pipelined": pipe["ttft_ms"]},
        "prefill_ms": {"eager": eager["prefill_ms"], "pipelined": pipe["prefill_ms"]},
        "exposed_transfer_ms": {"eager": eager["exposed_transfer_ms"], "pipelined": pipe["exposed_transfer_ms"]},
        "exposed_transfer_raw_ms": {"eager": eager["exposed_transfer_raw_ms"],
                                    "pipelined": pipe["exposed_transfer_raw_ms"]},
        "layer_transfer_ms": eager["exposed_transfer_ms"] / layers,
        "first_step_ms": pipe["first_step_ms"],
        "bytes_sent": {"first": pipe["prefill"]["bytes_sent"], "second": second["prefill"]["bytes_sent"]},
        "bytes_full_request": full_bytes,
        "chunks_skipped_second": second["prefill"]["chunks_skipped"],
        # the chunks whole within the prefix it shares: held, with daemons of the demo's own (running daemons may
        # have evicted some since the first request, or hold more of an earlier run)
        "expected_chunks_skipped_second": shared // chunk_tokens if receiver_config is None else None,
        "already_sent_indexes_second": second["prefill"]["already_sent_indexes"],
        "pipelined_layer_end": layer_end, "pipelined_layer_arrival": arrivals,
        "puts_per_layer": pipe["prefill"]["puts"] / layers,
    }


def print_report(res: dict, console) -> None:
    from rich.table import Table

    ok = "[bold green]yes[/]" if res["tokens_match"] else "[bold red]NO[/]"
    console.print(f"\nreference (colocated) tokens:   {res['reference_tokens']}")
    console.print(f"disaggregated (P -> D) tokens:  {res['disaggregated_tokens']}")
    console.print(f"tokens identical to colocated: {ok}   exact logits equality: "
                  f"{'[bold green]yes[/]' if res['logits_match'] else '[bold red]NO[/]'} "
                  f"(all 3 requests, every step, {res['dtype']})")
    t = Table(title="TTFT breakdown (ms, monotonic clock shared by all processes)")
    for c in ("", "prefill compute", "exposed transfer", "first decode step", "TTFT"):
        t.add_column(c, justify="right")
    for mode in ("eager", "pipelined"):
        t.add_row(mode, f"{res['prefill_ms'][mode]:.1f}", f"{res['exposed_transfer_ms'][mode]:.2f}",
                  f"{res['first_step_ms']:.1f}", f"{res['ttft_ms'][mode]:.1f}")
    console.print(t)
    console.print(f"[yellow]Emulated GPU compute:[/] each decoder layer sleeps {res['layer_compute_ms_emulated']} ms "
                  "after computing on this CPU (a stand-in for GPU time, which costs the host no CPU), so that "
                  "pipelining is visible. Exposed transfer = decode side holding every layer minus end of prefill.")
    saved = res["bytes_full_request"] - res["bytes_sent"]["second"]
    console.print(f"prefix reuse: second request skipped {res['chunks_skipped_second']} chunks "
                  f"(already_sent_indexes), sent {res['bytes_sent']['second']:,} of {res['bytes_full_request']:,} "
                  f"bytes ({saved:,} saved)")


def failures(res: dict) -> list[str]:
    """What the run did not show, of what the demo promises: the same tokens as colocated; on CPU the same logits
    at every step too (the decode engine computes over the very bytes the prefill engine made); and the second
    request skipping the chunks it shares with the first, so that fewer bytes moved."""
    out = []
    if not res["tokens_match"]:
        out.append("the disaggregated tokens differ from the colocated ones")
    if res.get("device", "cpu") == "cpu" and not res["logits_match"]:
        out.append(f"the logits differ from the colocated ones ({res['per_request_match']})")
    want = res.get("expected_chunks_skipped_second")
    if want is not None and res["chunks_skipped_second"] != want:
        out.append(f"prefix reuse: the second request skipped {res['chunks_skipped_second']} chunks, not {want}")
    if want and res["bytes_sent"]["second"] >= res["bytes_full_request"]:
        out.append("prefix reuse: the second request moved every byte")
    return out


def main_cli(json_path: Path | None, **kw) -> int:
    from rich.console import Console

    console = Console()
    t0 = time.monotonic()
    with console.status("running the PD-disaggregated demo..."):
        res = run_demo(console=console, **kw)
    print_report(res, console)
    console.print(f"done in {time.monotonic() - t0:.1f}s")
    if json_path:
        json_path.write_text(json.dumps(res, indent=2))
    bad = failures(res)
    for why in bad:
        console.print(f"[bold red]FAILED:[/] {why}")
    return 1 if bad else 0
