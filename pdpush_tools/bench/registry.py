"""The benchmark scenarios, one registry: ``pdpush bench --scenario NAME`` runs one, ``make bench`` all.

Each scenario says how it runs alone (``run``, with the command's options) and how it runs in the
suite behind BENCHMARKS.md (``suite``, at the shapes the report's targets are stated for). Adding a
scenario is one entry here; the command's choices, ``--scenario all`` and the report follow it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # importing the registry stays cheap: the CLI reads its names to build --help
    from pdpush.layout import KVLayout


@dataclass(frozen=True)
class BenchArgs:
    """What ``pdpush bench`` was given."""

    layout: KVLayout
    tokens: int = 4096
    requests: int = 3
    prefix_shared: float = 0.5
    receiver_config: Path | None = None
    sender_config: Path | None = None
    compare_nixl: bool = False
    prefill_ranks: int = 1
    decode_ranks: int = 1

    @property
    def shape(self) -> dict:
        lay = self.layout
        return dict(layers=lay.layers, kv_heads=lay.kv_heads, head_dim=lay.head_dim, dtype=lay.dtype,
                    chunk_tokens=lay.chunk_tokens, kind=lay.kind)


def _print_json(result: dict) -> None:
    print(json.dumps({k: v for k, v in result.items() if k not in ("curve", "rows")}, indent=2))


@dataclass(frozen=True)
class Scenario:
    name: str
    run: Callable[[BenchArgs], dict]
    suite: Callable[[BenchArgs], dict]  # {report key: result}: what it adds to ``make bench``'s results
    show: Callable[[dict], None] = field(default=_print_json)


def _goodput(a: BenchArgs) -> dict:
    if a.prefill_ranks > 1 or a.decode_ranks > 1:
        from pdpush_tools.bench import tp

        return tp.run(a.layout, a.tokens, a.requests, a.prefill_ranks, a.decode_ranks)
    from pdpush_tools.bench import goodput

    return goodput.run(**a.shape, tokens=a.tokens, requests=a.requests, prefix_shared=a.prefix_shared,
                       receiver_config=a.receiver_config, sender_config=a.sender_config,
                       compare_nixl=a.compare_nixl)


def _goodput_suite(a: BenchArgs) -> dict:
    """Goodput at the default shape, and over layer sizes (tokens per request), each against its own ceiling."""
    from pdpush_tools.bench import goodput

    main = goodput.run(**a.shape, tokens=a.tokens, requests=5, prefix_shared=0.5, compare_nixl=a.compare_nixl)
    keys = ("layer_bytes", "goodput_gbps", "ceiling_gbps", "memcpy_gbps", "ratio", "transport_goodput_gbps",
            "ratio_transport", "ratio_transport_hot", "footprint_put_gbps", "strict_put_gbps", "ratio_transport_strict",
            "transport_observed_gbps", "ratio_transport_observed", "two_copy_gbps", "ratio_two_copy", "staging_copy_gbps", "staging_memcpy_gbps", "ratio_staging_copy",
            "staging_copy_cached_gbps", "ratio_staging_copy_cached", "two_copy_hot_gbps", "ratio_two_copy_hot",
            "begin_ms_p50", "begun_goodput_gbps", "ratio_two_copy_begun", "verified")
    sweep = []
    small = {**a.shape, "chunk_tokens": a.shape["chunk_tokens"] // 4}  # one chunk of a quarter: 256 KiB a layer
    for shape, t in ((small, small["chunk_tokens"]), (a.shape, a.tokens // 16), (a.shape, a.tokens // 4)):
        r = goodput.run(**shape, tokens=t, requests=5, prefix_shared=0.5)
        sweep.append({k: r[k] for k in keys})
    sweep.append({k: main[k] for k in keys})
    from pdpush_tools.bench import tp

    ranks = tp.run(a.layout, 1024, 3, 8, 1)  # 8 prefill ranks into 8 pool shards through one sender
    return {"goodput": main, "goodput_sweep": sweep, "goodput_tp8": ranks}


def _show_goodput(result: dict) -> None:
    if "ratio_ranks_to_one" in result:  # the tensor-parallel form
        print(json.dumps(result, indent=2))
        return
    from pdpush_tools.bench import goodput

    goodput.print_table(result)


def _latency(a: BenchArgs) -> dict:
    from pdpush_tools.bench import latency

    return latency.compare(a.layout)


def _one_chunk(a: BenchArgs) -> BenchArgs:
    """The shape with one 16-token chunk per layer (64 KiB in the default shape): the fixed costs."""
    from pdpush.layout import KVLayout

    lay = a.layout
    return BenchArgs(KVLayout(lay.layers, lay.kv_heads, lay.head_dim, lay.dtype, 16, kind=lay.kind))


def _latency_suite(a: BenchArgs) -> dict:
    """The fixed cost per layer (one-chunk layers), and the sender's capacity at the default chunk's layers
    (1 MiB in the default shape; a smaller pool and fewer samples: each request is 32 MiB)."""
    from pdpush_tools.bench import latency

    return {"latency": _latency(_one_chunk(a)),
            "latency_big": latency.run(a.layout, samples=40, per_engine=60, pool_pages=48)}


def _of_scenarios(name: str, suite_tokens: Callable[[int], int] | None) -> Scenario:
    """A scenario of scenarios.py: ``fn(layout, tokens)``, or ``fn(layout)`` where it takes no tokens
    (``suite_tokens`` None); in the suite at ``suite_tokens(tokens)``."""

    def call(a: BenchArgs, tokens: int) -> dict:
        from pdpush_tools.bench import scenarios

        fn = getattr(scenarios, name)
        return fn(a.layout) if suite_tokens is None else fn(a.layout, tokens)

    return Scenario(name, lambda a: call(a, a.tokens),
                    lambda a: {name: call(a, suite_tokens(a.tokens) if suite_tokens else 0)})


def _isolation(a: BenchArgs) -> dict:
    from pdpush_tools.bench import isolation

    return isolation.run(a.layout)


def _isolation_suite(a: BenchArgs) -> dict:
    from pdpush.layout import KVLayout
    from pdpush_tools.bench import netns

    lay = a.layout
    try:
        return {"isolation": _isolation(BenchArgs(KVLayout(8, lay.kv_heads, lay.head_dim, lay.dtype, 64,
                                                           kind=lay.kind)))}
    except netns.Unavailable as e:
        # not run is not verified: the suite says so (cli: "verified" false), and the report says why
        return {"isolation": {"scenario": "isolation", "skipped": str(e), "verified": False}}


def _across_hosts(a: BenchArgs) -> dict:
    from pdpush_tools.bench import across_hosts

    return across_hosts.run(a.layout)


def _across_hosts_suite(a: BenchArgs) -> dict:
    from pdpush_tools.harness.hosts import HostsError

    try:
        return {"across_hosts": _across_hosts(a)}
    except HostsError as e:  # not root, or no namespaces here: not run is not verified, and the report says why
        return {"across_hosts": {"scenario": "across_hosts", "skipped": str(e), "verified": False}}


def _decode_wait(a: BenchArgs) -> dict:
    from pdpush_tools.bench import decode_wait

    return decode_wait.run(a.layout)


def _decode_wait_suite(a: BenchArgs) -> dict:
    """One chunk per layer, as the latency scenario: the wake-up, not the bytes."""
    return {"decode_wait": _decode_wait(_one_chunk(a))}


def _show_decode_wait(result: dict) -> None:
    from pdpush_tools.bench import decode_wait

    decode_wait.print_table(result)


SCENARIOS: dict[str, Scenario] = {s.name: s for s in (
    Scenario("goodput", _goodput, _goodput_suite, _show_goodput),
    Scenario("latency", _latency, _latency_suite),
    _of_scenarios("pipeline", lambda t: min(t, 2048)),
    _of_scenarios("incremental", lambda t: min(t, 2048)),
    _of_scenarios("concurrency", lambda t: 256),
    _of_scenarios("control", None),
    Scenario("isolation", _isolation, _isolation_suite),
    Scenario("across_hosts", _across_hosts, _across_hosts_suite),
    Scenario("decode_wait", _decode_wait, _decode_wait_suite, _show_decode_wait),
)}
