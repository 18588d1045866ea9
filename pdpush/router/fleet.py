"""The instances behind a router and their health: pure state with ``now`` (seconds) passed in.

An instance is ejected after ``eject_after`` failures in a row (health checks or requests that
could not reach it), and re-admitted by the first health check that passes. Requests in flight are
counted here; placement (placement.py) reads them. A config reload (reload.py) replaces the lists: an instance
no longer listed is retired, and forgotten once its requests in flight have ended.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdpush.index import IndexView
from pdpush.router.engine_cache import EngineCacheView


@dataclass
class Instance:
    role: str  # "prefill" | "decode"
    url: str
    receiver: str = ""  # decode: its receiver's control endpoint (the prefill pushes there)
    healthy: bool = True  # until proven otherwise: a fresh router serves at once
    failures: int = 0  # in a row
    inflight: int = 0
    ejections: int = 0
    last_error: str = ""
    index: IndexView = field(default_factory=IndexView)
    cache: EngineCacheView | None = None  # prefill: its own prefix cache, from its KV events (kv_events.py)
    pending_tokens: float = 0.0  # prefill: tokens of the legs in flight there that it has not computed yet
    legs_started: int = 0  # prefill: legs counted on it so far (one that started beside another overlapped it)

    @property
    def name(self) -> str:
        return f"{self.role}:{self.url}"


class Fleet:
    def __init__(self, prefill: list[Instance], decode: list[Instance], eject_after: int = 2) -> None:
        if not prefill or not decode:
            raise ValueError("a router needs at least one prefill and one decode instance")
        self.prefill, self.decode = prefill, decode
        self.eject_after = eject_after
        self.retired: list[Instance] = []  # no longer listed, still answering requests placed on them

    def all(self) -> list[Instance]:
        return self.prefill + self.decode

    def replace(self, prefill: list[Instance], decode: list[Instance], gone: list[Instance]) -> None:
        """New lists (a reload): ``gone`` take no new request, and are kept as retired until ``reap``."""
        if not prefill or not decode:
            raise ValueError("a router needs at least one prefill and one decode instance")
        self.prefill, self.decode = prefill, decode
        self.retired += gone

    def reap(self) -> list[Instance]:
        """The retired instances with no request in flight any more: forgotten, and returned."""
        done = [i for i in self.retired if i.inflight <= 0]
        self.retired = [i for i in self.retired if i.inflight > 0]
        return done

    def inflight_at(self, inst: Instance) -> int:
        """Requests in flight on ``inst``'s engine: its own and those of retired entries for the same URL (a reload
        that changed only how the router follows it, e.g. its KV events, retires the old entry while that one's
        legs still run there)."""
        return inst.inflight + sum(i.inflight for i in self.retired if i.url == inst.url and i.role == inst.role)

    def ok(self, inst: Instance) -> bool:
        """A passing health check or request. True if this re-admits it."""
        inst.failures = 0
        was = inst.healthy
        inst.healthy = True
        return not was

    def failed(self, inst: Instance, why: str, hard: bool = False) -> bool:
        """A failing health check or an unreachable instance (``hard``: eject at once, e.g. connection
        refused). True if this ejects it."""
        inst.failures += 1
        inst.last_error = why
        if inst.healthy and (hard or inst.failures >= self.eject_after):
            inst.healthy = False
            inst.ejections += 1
            return True
        return False
