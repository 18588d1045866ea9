"""The tooling's commands, ``pdpush demo`` and ``pdpush bench``, added to the product CLI by ``register``.

Imports only typer and light pdpush modules here; each command imports the rest when it runs, so ``pdpush --help``
stays fast.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Optional

import typer

from pdpush import launch
from pdpush.errors import PdpushError
from pdpush_tools.bench.registry import SCENARIOS, BenchArgs

SCENARIO_NAMES = tuple(SCENARIOS)


def demo(
    layers: int = typer.Option(8), hidden: int = typer.Option(256), heads: int = typer.Option(4),
    kv_heads: int = typer.Option(2), prompt_tokens: int = typer.Option(1000), new_tokens: int = typer.Option(16),
    dtype: str = typer.Option("float32", help="float32 (exact logits) or bfloat16/float16"),
    chunk_tokens: int = typer.Option(64),
    layer_compute_ms: float = typer.Option(25.0, help="Emulated GPU compute per layer (a sleep), ms."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write results here."),
    receiver_config: Optional[Path] = typer.Option(None, help="Use a running receiver with this config."),
    sender_config: Optional[Path] = typer.Option(None, help="Use a running sender with this config."),
    device: str = typer.Option("cpu", help="Where the model runs: cpu, or cuda / cuda:N (real compute: "
                                             "give --layer-compute-ms 0)."),
    handover: Optional[str] = typer.Option(None, help="How copied layers reach the sender: thread (the CUDA "
                                                      "default), poll, or sync (the CPU default)."),
) -> None:
    """Prefill on one process, decode on another, KV pushed layer by layer; compare with colocated."""
    if (receiver_config is None) != (sender_config is None):
        typer.echo("pdpush demo: give both --receiver-config and --sender-config, or neither", err=True)
        raise typer.Exit(2)
    from pdpush_tools.demo.run import main_cli

    try:
        code = main_cli(json_path, layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads,
                        prompt_tokens=prompt_tokens, new_tokens=new_tokens, dtype=dtype, chunk_tokens=chunk_tokens,
                        layer_compute_ms=layer_compute_ms, receiver_config=receiver_config,
                        sender_config=sender_config, device=device, handover=handover)
    except PdpushError as e:
        typer.echo(f"pdpush demo: {type(e).__name__}: {e}", err=True)
        raise typer.Exit(1) from None
    raise typer.Exit(code)


def bench(
    scenario: str = typer.Option("goodput", help=f"{', '.join(SCENARIO_NAMES)} or all"),
    layers: int = typer.Option(32), kv_heads: int = typer.Option(8), head_dim: int = typer.Option(128),
    dtype: str = typer.Option("bfloat16", help="float16, bfloat16, float32, float8_e4m3fn or float8_e5m2"),
    kind: str = typer.Option("mha", help="mha (K/V per KV head) or mla (one latent of head_dim per token: "
                                         "set --kv-heads 1)"),
    tokens: int = typer.Option(4096), chunk_tokens: int = typer.Option(256),
    requests: int = typer.Option(3, help="Requests to push (after the warm-up)."),
    prefix_shared: float = typer.Option(0.5, help="Fraction of tokens a second request shares with the first."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write results here."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="With --scenario all: write the figures here (PNG)."),
    report: Optional[Path] = typer.Option(None, "--report", help="With --scenario all: write BENCHMARKS.md here."),
    receiver_config: Optional[Path] = typer.Option(None, help="goodput: use a running receiver with this config."),
    sender_config: Optional[Path] = typer.Option(None, help="goodput: use a running sender with this config."),
    compare: Optional[str] = typer.Option(None, "--compare", help="nixl: also measure NIXL's raw write."),
    prefill_ranks: int = typer.Option(1, "--prefill-ranks", min=1,
                                      help="goodput: push each request from this many TP rank processes."),
    decode_ranks: int = typer.Option(1, "--decode-ranks", min=1,
                                     help="goodput: read each request as this many TP decode ranks."),
) -> None:
    """Measure pdpush against raw UCX put+flush and memcpy, verifying every byte."""
    if compare not in (None, "nixl"):
        typer.echo(f"pdpush bench: --compare {compare!r}: only 'nixl' is supported", err=True)
        raise typer.Exit(2)
    if scenario not in (*SCENARIO_NAMES, "all"):
        typer.echo(f"pdpush bench: unknown scenario {scenario!r} (one of {', '.join(SCENARIO_NAMES)} or all)",
                   err=True)
        raise typer.Exit(2)
    if (receiver_config is None) != (sender_config is None):
        typer.echo("pdpush bench: give both --receiver-config and --sender-config, or neither", err=True)
        raise typer.Exit(2)
    from pdpush.layout import KVLayout

    shape = dict(layers=layers, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype, chunk_tokens=chunk_tokens,
                 kind=kind)
    try:
        if scenario == "all":
            from pdpush_tools.bench import report as rep

            result = rep.run_all(shape, tokens, compare_nixl=compare == "nixl")
            result["verified"] = all(result[k]["verified"] for k in SCENARIOS)
            rep.write(result, None, plot, report)
            typer.echo(rep.markdown(result, str(plot or "")))
        else:
            args = BenchArgs(KVLayout(**shape), tokens=tokens, requests=requests, prefix_shared=prefix_shared,
                             receiver_config=receiver_config, sender_config=sender_config,
                             compare_nixl=compare == "nixl", prefill_ranks=prefill_ranks, decode_ranks=decode_ranks)
            result = SCENARIOS[scenario].run(args)
            SCENARIOS[scenario].show(result)
    except PdpushError as e:
        typer.echo(f"pdpush bench: {type(e).__name__}: {e}", err=True)
        raise typer.Exit(1) from None
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=2))
    if not result["verified"]:
        raise typer.Exit(1)


def _stoppable(command):
    """``command`` run under ``launch.exit_on_signals``: a SIGTERM stops its daemons (by pid) and removes its
    scratch directories, as a normal exit does."""

    @functools.wraps(command)
    def run(*args, **kwargs):
        with launch.exit_on_signals():
            return command(*args, **kwargs)

    return run


def register(app: typer.Typer) -> None:
    """Add the tooling's commands to the product CLI."""
    app.command()(_stoppable(demo))
    app.command()(_stoppable(bench))
