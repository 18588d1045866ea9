"""What a router config read again changes (pure logic: no I/O, no clock): the old instance lists against the new.

``pdpush router`` reads its config file again on SIGHUP (app.py catches the signal and moves the instances). Of the
new config only the instance lists are taken, at once:

* an instance in both lists is kept, and so is all the router knows of it: its health, its requests in flight, its
  receiver's chunk-index view, its engine-cache view, what the cost model measured of it;
* a new one is added as at start-up: healthy until a check says otherwise, its feeds subscribed;
* one no longer listed takes no new request, and is dropped once its requests in flight have ended (they finish
  where they are).

An instance is its URL and what the router reaches it by: a decode instance whose receiver (or that receiver's
public key) changed, or a prefill instance whose KV-events source changed, is dropped and added again (its views
belong to the old source). Any other field that changed (ports, policy, weights, keys) is named and takes effect
at the next start. A new config the running router cannot take is refused whole, saying why, and the old lists
stay: one listing a URL twice in a role, or whose new receivers need a CURVE key pair the router started without.
A file that does not load at all (``config.reload`` raises) never gets here: app.py refuses it the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from pdpush.config import RouterConfig

# the fields that are the instance lists; every other field is read at start-up only
LISTS = ("prefill", "decode", "kv_events")


@dataclass(frozen=True)
class PrefillKey:
    url: str
    events: tuple[str, str, str] | None  # its KV-events source (endpoint, replay endpoint, topic), if any

    def __str__(self) -> str:
        return self.url


@dataclass(frozen=True)
class DecodeKey:
    url: str
    receiver: str
    receiver_public_key: str | None
    key: str | None = None  # the key it names, as read when the config was: a key file rotated in place changes it

    def __str__(self) -> str:
        return f"{self.url} (receiver {self.receiver})"


K = TypeVar("K", PrefillKey, DecodeKey)


@dataclass(frozen=True)
class Diff(Generic[K]):
    """One role's list, old against new. ``source[j]``: the index in ``old`` of the instance that new entry ``j``
    keeps, or None where it is added; ``drop``: the indices in ``old`` of the instances no longer listed."""

    old: tuple[K, ...]
    new: tuple[K, ...]
    source: tuple[int | None, ...]
    drop: tuple[int, ...]

    @property
    def added(self) -> list[K]:
        return [k for k, i in zip(self.new, self.source, strict=True) if i is None]

    @property
    def kept(self) -> list[K]:
        return [k for k, i in zip(self.new, self.source, strict=True) if i is not None]

    @property
    def dropped(self) -> list[K]:
        return [self.old[i] for i in self.drop]

    @property
    def changed(self) -> bool:
        """Anything added, dropped, or kept in another order (placement's round robin follows the order)."""
        return bool(self.drop) or self.source != tuple(range(len(self.new)))


@dataclass(frozen=True)
class Plan:
    prefill: Diff[PrefillKey]
    decode: Diff[DecodeKey]
    restart_only: tuple[str, ...] = ()  # other fields whose new value takes effect at the next start
    refused: str = ""  # why the new config is not taken (then nothing changes)

    @property
    def changed(self) -> bool:
        return not self.refused and (self.prefill.changed or self.decode.changed)

    def summary(self) -> str:
        """One line for the log: what is added, dropped and kept per role, and what waits for a restart."""
        if self.refused:
            return f"refused: {self.refused}"
        parts = []
        for role, d in (("prefill", self.prefill), ("decode", self.decode)):
            add = ", ".join(f"+{k}" for k in d.added)
            drop = ", ".join(f"-{k}" for k in d.dropped)
            parts.append(f"{role}: " + "; ".join(x for x in (add, drop, f"{len(d.kept)} kept") if x))
        line = " | ".join(parts) if self.changed else "no change in the instance lists"
        if self.restart_only:
            line += f" | changed, taking effect at the next start: {', '.join(self.restart_only)}"
        return line


def prefill_keys(cfg: RouterConfig) -> list[PrefillKey]:
    out = []
    for url in cfg.prefill:
        src = cfg.kv_events.get(url)
        out.append(PrefillKey(url.rstrip("/"), (src.endpoint, src.replay_endpoint, src.topic) if src else None))
    return out


def decode_keys(cfg: RouterConfig) -> list[DecodeKey]:
    return [DecodeKey(d.url.rstrip("/"), d.receiver, d.receiver_public_key, d._key) for d in cfg.decode]


def diff(old: Sequence[K], new: Sequence[K]) -> Diff[K]:
    """Each new entry keeps the first old instance equal to it not kept already; old ones left over are dropped."""
    free: dict[K, list[int]] = {}
    for i, k in enumerate(old):
        free.setdefault(k, []).append(i)
    source: list[int | None] = []
    for k in new:
        left = free.get(k)
        source.append(left.pop(0) if left else None)
    kept = {i for i in source if i is not None}
    return Diff(tuple(old), tuple(new), tuple(source), tuple(i for i in range(len(old)) if i not in kept))


def _twice(urls: Sequence[str]) -> str | None:
    seen: set[str] = set()
    for u in urls:
        if u in seen:
            return u
        seen.add(u)
    return None


def plan(current: RouterConfig, new: RouterConfig) -> Plan:
    """What taking ``new`` over ``current`` (the running router's config, with its instance lists as they are now)
    changes, or why it is refused."""
    pk, dk = prefill_keys(new), decode_keys(new)
    p, d = diff(prefill_keys(current), pk), diff(decode_keys(current), dk)
    others = sorted(f for f in RouterConfig.model_fields
                    if f not in LISTS and getattr(current, f) != getattr(new, f))
    refused = ""
    for role, urls in (("prefill", [k.url for k in pk]), ("decode", [k.url for k in dk])):
        if (u := _twice(urls)) is not None:
            refused = f"{role}: {u} is listed twice"
            break
    if not refused and not current.curve_secret_key_file:
        keyed = [k for k in d.added if k.receiver_public_key]
        if keyed:
            refused = (f"decode: the receiver of {keyed[0].url} has a CURVE public key, and this router started "
                       "without a key pair (curve_secret_key_file): restart it to give it one")
    return Plan(p, d, tuple(others), refused)
