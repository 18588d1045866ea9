"""Command-line entry points (typer): parse -> config -> run, nothing else.

``pdpush-receiver``, ``pdpush-sender`` and ``pdpush {status,layout,router,...}``; ``demo`` and ``bench``
come from the tooling (``pdpush_tools/cli.py``).
Keeps ``--help`` fast: torch and UCX are imported only inside commands.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from pdpush.errors import ConfigError, PdpushError

# Plain help (rich_markup_mode=None): rich's panels cut long flag names at 80 columns (--local-prefill-m…)
receiver_app = typer.Typer(add_completion=False, rich_markup_mode=None, help="pdpush decode-side receiver daemon.")
sender_app = typer.Typer(add_completion=False, rich_markup_mode=None, help="pdpush prefill-side sender daemon.")
app = typer.Typer(add_completion=False, rich_markup_mode=None, no_args_is_help=True,
                  help="pdpush: push KV cache from prefill to decode, layer by layer.")

_CONFIG = typer.Option(None, "--config", "-c", help="TOML config file.")
_BIND = typer.Option(None, "--bind", help="Address for the network-facing endpoints (overrides 'host').")
_READY = typer.Option(None, "--ready-file", help="Write a JSON file with the bound endpoints once serving.")
_LEVEL = typer.Option(None, "--log-level", help="debug, info, warning or error.")
_FMT = typer.Option(None, "--log-format", help="text or json.")
_PREFAULT = typer.Option(None, "--prefault/--no-prefault", help="Fault the shared region in at start-up.")


def _version(value: bool) -> None:
    """``--version``: the package's version, the control protocol's (between daemons) and the local one's (an engine
    and its daemon), then exit."""
    if value:
        from pdpush import __version__
        from pdpush.protocol import LOCAL_PROTOCOL_VERSION, PROTOCOL_VERSION

        typer.echo(f"pdpush {__version__} (control protocol {PROTOCOL_VERSION}, local protocol {LOCAL_PROTOCOL_VERSION})")
        raise typer.Exit()


_VERSION = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version and exit.")


@app.callback()
def _main(version: bool = _VERSION) -> None:
    """pdpush: push KV cache from prefill to decode, layer by layer."""


LEGS = {"auto": "auto", "concurrent": True, "sequential": False}  # --legs: the router's concurrent_legs


def _fail_config(e: Exception) -> None:
    typer.echo(f"pdpush: configuration error: {e}", err=True)
    raise typer.Exit(2)


@receiver_app.command()
def receiver(
    config: Optional[Path] = _CONFIG,
    bind: Optional[str] = _BIND,
    control_port: Optional[int] = typer.Option(None, help="ZMQ control port (0 = any)."),
    ucx_port: Optional[int] = typer.Option(None, help="UCX listener port (0 = any)."),
    local_socket: Optional[str] = typer.Option(None, help="Unix socket for the local decode engine."),
    layers: Optional[int] = typer.Option(None), kv_heads: Optional[int] = typer.Option(None),
    head_dim: Optional[int] = typer.Option(None), dtype: Optional[str] = typer.Option(None),
    chunk_tokens: Optional[int] = typer.Option(None), model_id: Optional[str] = typer.Option(None),
    kind: Optional[str] = typer.Option(None, help="mha (attention K/V) or mla (an MLA latent)."),
    model: Optional[str] = typer.Option(None, help="A model directory: the layout fields not set are read from its "
                                        "config.json (pdpush layout --model DIR prints them)."),
    pool_pages: Optional[int] = typer.Option(None, help="Pages in the pool."),
    prefault: Optional[bool] = _PREFAULT,
    insecure: bool = typer.Option(False, "--insecure", help="Allow a non-loopback bind without CURVE auth."),
    ready_file: Optional[str] = _READY, log_level: Optional[str] = _LEVEL, log_format: Optional[str] = _FMT,
    version: bool = _VERSION,
) -> None:
    """Run the receiver daemon."""
    from pdpush import config as cfgmod
    from pdpush import daemon

    try:
        cfg = cfgmod.load(cfgmod.ReceiverConfig, config, host=bind, control_port=control_port, ucx_port=ucx_port,
                          local_socket=local_socket, layers=layers, kv_heads=kv_heads, head_dim=head_dim,
                          dtype=dtype, chunk_tokens=chunk_tokens, model_id=model_id, kind=kind, model=model,
                          pool_pages=pool_pages,
                          prefault=prefault, insecure=True if insecure else None, ready_file=ready_file,
                          log_level=log_level, log_format=log_format)
    except ConfigError as e:
        _fail_config(e)
    daemon.setup_logging(cfg.log_level, cfg.log_format, "receiver")
    from pdpush.receiver import Receiver

    _serve(lambda: Receiver(cfg), cfg)


@sender_app.command()
def sender(
    config: Optional[Path] = _CONFIG,
    bind: Optional[str] = typer.Option(None, "--bind", hidden=True,
                                       help="Ignored: a sender opens no control port (UCX's lanes: ucx_env "
                                            "UCX_NET_DEVICES)."),
    ingress_socket: Optional[str] = typer.Option(None, help="Unix socket for the local prefill engine."),
    staging_bytes: Optional[int] = typer.Option(None, help="Shared staging memory, bytes."),
    default_receiver: Optional[str] = typer.Option(None, help="Receiver control endpoint, e.g. tcp://h:5710."),
    checksums: Optional[bool] = typer.Option(None, help="Send per-layer checksums."),
    prefault: Optional[bool] = _PREFAULT,
    ready_file: Optional[str] = _READY, log_level: Optional[str] = _LEVEL, log_format: Optional[str] = _FMT,
    version: bool = _VERSION,
) -> None:
    """Run the sender daemon."""
    from pdpush import config as cfgmod
    from pdpush import daemon

    try:
        cfg = cfgmod.load(cfgmod.SenderConfig, config, host=bind, ingress_socket=ingress_socket,
                          staging_bytes=staging_bytes, default_receiver=default_receiver, checksums=checksums,
                          prefault=prefault, ready_file=ready_file, log_level=log_level, log_format=log_format)
    except ConfigError as e:
        _fail_config(e)
    daemon.setup_logging(cfg.log_level, cfg.log_format, "sender")
    from pdpush.sender import Sender

    _serve(lambda: Sender(cfg), cfg)


def _serve(make_server, cfg) -> None:
    """Build the daemon and run it: a bad setting found there (a socket directory it cannot use, a key file, a
    missing module) exits 2 (CONFIG), a start that fails on the host (a port taken, memory) exits 3 (STARTUP), each
    with one line saying why; an error after the start exits 1 (daemon.run). A socket path too long is refused
    when the config loads (2)."""
    import logging

    from pdpush import control, daemon

    try:
        code = daemon.run(make_server(), cfg.ready_file, cfg.drain_timeout_s)
    except ConfigError as e:
        logging.getLogger("pdpush").error("%s", e)
        raise typer.Exit(int(daemon.ExitCode.CONFIG)) from None
    except ImportError as e:  # (an install without the daemons' extra, or one being replaced: restarted, as 3)
        logging.getLogger("pdpush").error("start-up failed: the daemon cannot import %s (pip install "
                                          "'pdpush[daemons]', or a broken install): %s", e.name or "a module", e)
        raise typer.Exit(int(daemon.ExitCode.STARTUP)) from None
    except (PdpushError, OSError) as e:
        logging.getLogger("pdpush").error("start-up failed: %s", e)
        raise typer.Exit(int(daemon.ExitCode.STARTUP)) from None
    finally:  # what the daemon queued for its peers as it closed (a farewell, last aborts) leaves, for 1 s at most
        if not control.shutdown():
            logging.getLogger("pdpush").warning("the control sockets did not close in time: what they queued is dropped")
    raise typer.Exit(code)


def _daemon_config(config: Path, role: Optional[str] = None):
    """The receiver's or the sender's config in CONFIG (``role``, or told by the keys only one of them has), read
    to find the daemon, not to serve: a receiver's exposure is not judged here (a daemon started with --insecure,
    or PDPUSH_INSECURE in its own environment, has a config that its status and doctor must still read)."""
    import tomllib

    from pdpush import config as cfgmod

    if role not in (None, "receiver", "sender"):
        raise ConfigError(f"--role must be receiver or sender, not {role!r}")
    if config.is_dir():
        raise ConfigError(f"{config} is a directory, not a config file")
    raw = set(tomllib.loads(config.read_text(encoding="utf-8")))
    if role is None:
        rx, tx = set(cfgmod.ReceiverConfig.model_fields), set(cfgmod.SenderConfig.model_fields)
        if raw & (tx - rx):
            role = "sender"
        elif raw & (rx - tx) or not raw:
            role = "receiver"
        else:
            raise ConfigError(f"{config}: its keys ({', '.join(sorted(raw))}) are a receiver's and a sender's "
                              "alike: pass --role receiver or --role sender")
    if role == "receiver":
        return cfgmod.read_receiver(config)
    return cfgmod.load(cfgmod.SenderConfig, config)


@app.command()
def status(
    config: Path = typer.Option(..., "--config", "-c", help="The daemon's TOML config."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
    timeout: float = typer.Option(2.0, help="Seconds to wait for the daemon (over 0, at most 3600)."),
    role: Optional[str] = typer.Option(None, help="receiver or sender (default: guessed from the config's keys)."),
) -> None:
    """Query the local daemon that CONFIG configures (receiver or sender)."""
    import tomllib

    from pdpush import client
    from pdpush import config as cfgmod

    if not 0 < timeout <= 3600:  # (nan too: every wait has a deadline)
        _fail_config(ValueError(f"--timeout {timeout}: give seconds over 0, at most 3600"))
    try:
        cfg = _daemon_config(config, role)
    except (ConfigError, OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        _fail_config(e)
    sock = cfg.ingress_socket_path() if isinstance(cfg, cfgmod.SenderConfig) else cfg.local_socket_path()
    try:
        stats = client.status(sock, timeout)
    except PdpushError as e:
        typer.echo(f"pdpush: daemon at {sock} did not answer: {e}", err=True)
        raise typer.Exit(1) from None
    if as_json:
        typer.echo(json.dumps(stats, indent=2, sort_keys=True))
        return
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"pdpush {stats.get('role', '?')} ({sock})")
    t.add_column("metric")
    t.add_column("value", justify="right")
    for k in sorted(stats):
        t.add_row(k, str(stats[k]))
    Console().print(t)


@app.command()
def doctor(
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="A daemon's TOML config: its ucx_env is "
                                          "applied, and memlock is checked against its pool or staging."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
    role: Optional[str] = typer.Option(None, help="receiver or sender (default: told by the config's keys)."),
) -> None:
    """What this host's UCX can do for pdpush: version and library, transports and devices, RDMA, memlock,
    hugepages, CUDA. Exit code 1 where a check warns."""
    import json
    import tomllib

    from pdpush import config as cfgmod
    from pdpush import doctor as doc

    env, need = None, None
    if config is not None:
        try:
            cfg = _daemon_config(config, role)
        except (ConfigError, OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            _fail_config(e)
        need = cfg.staging_bytes if isinstance(cfg, cfgmod.SenderConfig) else cfg.pool_bytes
        env = cfg.ucx_env
    try:
        facts = doc.gather(env, need)
    except (PdpushError, ImportError, OSError) as e:  # (libucp that cannot load: a missing libnuma, a partial build)
        typer.echo(f"pdpush doctor: {type(e).__name__}: {e}", err=True)
        raise typer.Exit(2) from None
    typer.echo(json.dumps(facts, indent=2) if as_json else doc.render(facts))
    raise typer.Exit(1 if facts["warnings"] else 0)


@app.command()
def layout(
    model: Path = typer.Option(..., "--model", help="A model directory (reads its config.json)."),
    chunk_tokens: Optional[int] = typer.Option(None, help="Also print chunk_tokens, this value."),
    dtype: Optional[str] = typer.Option(None, help="The dtype the engine serves (default: the config's)."),
    model_id: Optional[str] = typer.Option(None, help="Also print model_id, this value."),
) -> None:
    """Print a model's KV layout as flat TOML lines: `pdpush layout --model DIR >> receiver.toml` makes a
    shipped receiver config serve that model. chunk_tokens and model_id, which the config sets, are printed
    only when given."""
    from pdpush.model_layout import layout_of, toml_lines

    try:
        lay = layout_of(model, chunk_tokens=chunk_tokens, dtype=dtype, model_id=model_id)
        typer.echo(toml_lines(lay, chunk_tokens=chunk_tokens is not None, model_id=model_id is not None), nl=False)
    except ValueError as e:
        typer.echo(f"pdpush layout: {e}", err=True)
        raise typer.Exit(2) from None


@app.command()
def keygen(
    name: str = typer.Argument(..., help="Key name, e.g. receiver or sender-a."),
    directory: Path = typer.Option(Path("keys"), "--dir", help="Where to write NAME.key and NAME.key_secret."),
    force: bool = typer.Option(False, "--force", help="Replace an existing pair (its peers need the new public key)."),
) -> None:
    """Write a CURVE key pair: NAME.key (public, share it) and NAME.key_secret (mode 0600, keep it)."""
    from pdpush import auth

    try:
        pub, sec = auth.keygen(directory, name, force)
    except ConfigError as e:
        _fail_config(e)
    except OSError as e:  # (a directory this user cannot write, say: sudo -u pdpush before /etc/pdpush/keys is its)
        typer.echo(f"pdpush keygen: cannot write the key pair in {directory}: {e}", err=True)
        raise typer.Exit(1) from None
    public = auth.load_public_keys(str(pub))[0].decode()
    typer.echo(f"public key:  {pub}\nsecret key:  {sec}\nZ85 public:  {public}")


@app.command()
def router(
    config: Optional[Path] = _CONFIG,
    bind: Optional[str] = _BIND,
    port: Optional[int] = typer.Option(None, "--port", help="HTTP port (0 = any free port)."),
    prefill: Optional[list[str]] = typer.Option(None, "--prefill", help="Prefill vLLM instance URL (repeat)."),
    decode: Optional[list[str]] = typer.Option(
        None, "--decode", help="Decode vLLM instance and its receiver: URL=tcp://HOST:PORT (repeat)."),
    policy: Optional[str] = typer.Option(None, "--policy", help="cache_aware, round_robin or cost_model."),
    ttft_slo_ms: Optional[float] = typer.Option(None, "--ttft-slo-ms",
                                                help="cost_model: refuse (429) what is predicted over this."),
    legs: Optional[str] = typer.Option(None, "--legs", metavar="auto|concurrent|sequential",
                                       help="concurrent: the prefill and decode legs at once; sequential: the "
                                            "decode's after the prefill's answer; auto (the default): at once "
                                            "where the prefill instance has nothing in flight."),
    local_prefill_max_tokens: Optional[int] = typer.Option(
        None, "--local-prefill-max-tokens", help="Skip the prefill when the decode node holds all but this many."),
    tokenizer: Optional[str] = typer.Option(None, "--tokenizer", help="engine, or a tokenizer directory."),
    api_key_file: Optional[str] = typer.Option(None, "--api-key-file", help="Require this Bearer key."),
    ready_file: Optional[str] = _READY, log_level: Optional[str] = _LEVEL, log_format: Optional[str] = _FMT,
) -> None:
    """Cache-aware OpenAI-compatible router in front of prefill and decode vLLM instances. SIGHUP reloads the
    prefill and decode lists from --config, without a restart."""
    from pdpush import config as cfgmod
    from pdpush import daemon

    if legs is not None and legs not in LEGS:
        _fail_config(ValueError(f"--legs {legs!r}: give auto, concurrent or sequential"))
    decodes = None
    if decode:
        decodes = []
        for d in decode:
            url, sep, rcv = d.partition("=")
            if not sep:
                _fail_config(ValueError(f"--decode {d!r}: give URL=RECEIVER (http://host:8200=tcp://host:5710)"))
            decodes.append({"url": url, "receiver": rcv})
    try:
        cfg = cfgmod.load(cfgmod.RouterConfig, config, host=bind, port=port, prefill=list(prefill) if prefill else None,
                          decode=decodes, policy=policy, ttft_slo_ms=ttft_slo_ms,
                          concurrent_legs=LEGS.get(legs),
                          local_prefill_max_tokens=local_prefill_max_tokens, tokenizer=tokenizer,
                          api_key_file=api_key_file, ready_file=ready_file, log_level=log_level,
                          log_format=log_format)
    except ConfigError as e:
        _fail_config(e)
    daemon.setup_logging(cfg.log_level, cfg.log_format, "router")
    import logging

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per upstream call otherwise
    try:
        from pdpush.router.app import serve
    except ImportError as e:
        _fail_config(ValueError(f"the router needs {e.name or 'a module'} (pip install 'pdpush[router]'): {e}"))

    try:
        serve(cfg)
    except ConfigError as e:  # (a setting found wrong only at start-up: a tokenizer it cannot load, say)
        _fail_config(e)
    except OSError as e:
        typer.echo(f"pdpush router: cannot start: {e}", err=True)
        raise typer.Exit(int(daemon.ExitCode.STARTUP)) from None


@app.command()
def simulate(
    trace: Path = typer.Option(..., "--trace", help="A request trace, Mooncake FAST'25 format (JSON lines)."),
    prefill: int = typer.Option(8, "--prefill", min=1, help="Prefill instances."),
    decode: int = typer.Option(8, "--decode", min=1, help="Decode instances."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write the results here."),
    markdown: Optional[Path] = typer.Option(None, "--markdown", help="Write the table here (markdown)."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Write a plot here (PNG)."),
    policy: Optional[list[str]] = typer.Option(None, "--policy", help="Only this policy (repeat); default all."),
    limit: Optional[int] = typer.Option(None, "--limit", min=1, help="Only the first N requests."),
    block_tokens: int = typer.Option(512, help="Tokens per block of the trace's hash_ids (the receivers' chunk)."),
    pool_blocks: int = typer.Option(0, min=0, help="Blocks per receiver pool (0: --pool-share of unique blocks)."),
    pool_share: float = typer.Option(0.05, min=0.0, help="Receiver pool, as a share of the trace's unique blocks."),
    prefill_cache_blocks: int = typer.Option(0, min=0, help="Blocks per prefill instance's own cache (0: share)."),
    prefill_cache_share: float = typer.Option(0.05, min=0.0, help="Prefill cache, as a share of unique blocks."),
    prefill_tokens_per_s: float = typer.Option(20_000.0, min=1.0, help="Prefill speed of each prefill instance."),
    bandwidth_gbps: float = typer.Option(12.5, min=0.001, help="GB/s of pushes into each receiver."),
    kv_bytes_per_token: int = typer.Option(327_680, min=1, help="KV bytes per token, every layer."),
    layers: int = typer.Option(80, min=1, help="Layers streamed per request."),
    tpot_ms: float = typer.Option(30.0, min=0.0, help="Decode time per output token."),
    decode_slots: int = typer.Option(32, min=1, help="Requests each decode instance decodes at once."),
    local_tokens_per_s: float = typer.Option(0.0, min=0.0,
                                             help="A decode instance's own prefill speed (conditional; 0: off)."),
    max_imbalance: int = typer.Option(4, min=0, help="Load cap: in flight over the least loaded instance."),
    ttft_slo_ms: Optional[float] = typer.Option(None, min=1.0, help="The cost model refuses what it predicts over this."),
) -> None:
    """Replay a request trace through the router's placement code: each policy's prefix hits, bytes pushed,
    prefill tokens, TTFT, SLO attainment and imbalance, against a pooled cache of every receiver."""
    from pdpush.router import simulate as sim

    chosen = tuple(policy) if policy else sim.POLICIES
    bad = [p for p in chosen if p not in sim.POLICIES]
    if bad:
        _fail_config(ValueError(f"--policy {bad[0]!r}: policies are {', '.join(sim.POLICIES)}"))
    try:
        reqs = sim.load_trace(trace, limit)
    except (OSError, ValueError) as e:
        typer.echo(f"pdpush simulate: {e}", err=True)
        raise typer.Exit(2) from None
    if not reqs:
        typer.echo(f"pdpush simulate: {trace} holds no request", err=True)
        raise typer.Exit(2)
    cfg = sim.SimConfig(prefill=prefill, decode=decode, block_tokens=block_tokens, pool_blocks=pool_blocks,
                        pool_share=pool_share, prefill_cache_blocks=prefill_cache_blocks,
                        prefill_cache_share=prefill_cache_share, prefill_tokens_per_s=prefill_tokens_per_s,
                        bytes_per_s=bandwidth_gbps * 1e9, kv_bytes_per_token=kv_bytes_per_token, layers=layers,
                        tpot_s=tpot_ms / 1000, decode_slots=decode_slots, local_tokens_per_s=local_tokens_per_s,
                        max_imbalance=max_imbalance, ttft_slo_ms=ttft_slo_ms)
    res = sim.run(reqs, cfg, chosen)
    res["trace"] = str(trace)
    table = sim.markdown(res, f"{trace.name}: {prefill} prefill x {decode} decode")
    typer.echo(table)
    if json_out:
        json_out.write_text(json.dumps(res, indent=2) + "\n")
    if markdown:
        markdown.write_text(table)
    if plot:
        sim.plot(res, plot)


def _add_tooling() -> None:
    """``pdpush demo`` and ``pdpush bench`` live with the tooling (pdpush_tools), absent from a product-only
    install; registering them imports only its typer signatures."""
    try:
        from pdpush_tools.cli import register
    except ModuleNotFoundError as e:
        if e.name != "pdpush_tools":
            raise  # the tooling is there but broken: say so, rather than lose its commands quietly
        return
    register(app)


_add_tooling()


def receiver_main() -> None:
    receiver_app()


def sender_main() -> None:
    sender_app()


def main() -> None:
    app()


if __name__ == "__main__":
    sys.exit(main())
