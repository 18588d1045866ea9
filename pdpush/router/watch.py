"""What the router follows of each instance besides its health, on asyncio: a decode instance's receiver index feed
(feeds.py) and a prefill instance's own KV events (kv_events.py), started and stopped one instance at a time, as the
router starts and as a reload (reload.py) adds and drops instances. The views they fill live on the instances
(fleet.py); this only runs the subscriptions. Imports no HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from pdpush.errors import ConfigError
from pdpush.router.feeds import Feed
from pdpush.router.fleet import Instance
from pdpush.router.kv_events import EngineEvents, Moved, Source, Unresolved
from pdpush.router.reload import DecodeKey, PrefillKey

log = logging.getLogger("pdpush.router")


class Watches:
    def __init__(self, silence_s: float, on_feed: Callable[[Instance, str], None],
                 on_withdrawn: Callable[[Instance, str], None] = lambda d, push_id: None,
                 recheck_s: float = 30.0) -> None:
        self.silence_s = silence_s
        self.recheck_s = recheck_s  # a named receiver's or publisher's name, looked up again this often
        self._on_feed = on_feed
        self._on_withdrawn = on_withdrawn  # a receiver acknowledged a withdrawal (feeds.py)
        self._tasks: dict[int, asyncio.Task] = {}  # by id(instance), while it is listed
        self._feeds: dict[int, Feed] = {}
        self._sends: set[asyncio.Task] = set()  # withdrawals on their way
        self.curve = None  # the router's CURVE key pair (auth.KeyPair), for receivers exposed with CURVE

    def load_keypair(self, path: str) -> None:
        from pdpush import auth

        self.curve = auth.load_keypair(path)

    def configure(self, key: DecodeKey) -> Callable | None:
        """How a feed's socket is set up for its receiver (None: plain). Raises ConfigError where the receiver's
        public key cannot be read: a new receiver's is read before a reload changes anything."""
        if not key.receiver_public_key:
            return None
        from pdpush import auth

        found = auth.load_public_keys(key.receiver_public_key)
        if not found:
            raise ConfigError(f"receiver_public_key of {key.url}: no key in {key.receiver_public_key}")
        keys, server = self.curve, found[0]

        def configure(sock) -> None:
            auth.make_client(sock, keys, server)
        return configure

    def watching(self, inst: Instance) -> bool:
        return id(inst) in self._tasks

    def start(self, inst: Instance, key: PrefillKey | DecodeKey, configure: Callable | None = None) -> None:
        if isinstance(key, DecodeKey):
            feed = Feed(key.receiver, inst.index, self.silence_s, configure,
                        on_change=lambda kind, d=inst: self._on_feed(d, kind),
                        on_withdrawn=lambda push_id, d=inst: self._on_withdrawn(d, push_id),
                        recheck_s=self.recheck_s)
            task = asyncio.create_task(feed.run(), name=f"feed {key.receiver}")
            task.add_done_callback(lambda t, feed=feed: feed.close())  # the socket closes once the task has ended
            self._feeds[id(inst)] = feed
        elif key.events is not None:
            task = asyncio.create_task(self._follow(inst, Source(*key.events), self.recheck_s),
                                       name=f"kv events {inst.url}")
        else:
            return
        self._tasks[id(inst)] = task

    def withdraw(self, inst: Instance, push_id: str, reason: str, done: Callable[[bool], None],
                 unread: bool = False) -> None:
        """Tell decode instance ``inst``'s receiver that push ``push_id`` will not come, or, ``unread``, will not be
        read (feeds.py); ``done`` gets whether it was sent (queued to the receiver: its acknowledgement comes to
        ``on_withdrawn``). Nothing is sent where its feed is not running (a reload dropped it)."""
        feed = self._feeds.get(id(inst))
        if feed is None:
            done(False)
            return
        task = asyncio.get_running_loop().create_task(feed.withdraw(push_id, reason, unread),
                                                      name=f"withdraw {push_id}")
        self._sends.add(task)

        def sent(t: asyncio.Task) -> None:
            self._sends.discard(t)
            if not t.cancelled():  # (cancelled: the router stops)
                done(t.exception() is None and t.result())

        task.add_done_callback(sent)

    def stop(self, inst: Instance) -> None:
        """An instance no longer listed: its subscription ends (its views are no longer read)."""
        task = self._tasks.pop(id(inst), None)
        self._feeds.pop(id(inst), None)
        if task is not None:
            task.cancel()

    async def close(self) -> None:
        for t in list(self._sends):
            t.cancel()
        tasks = list(self._tasks.values())
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        for f in self._feeds.values():
            f.close()
        self._tasks.clear()
        self._feeds.clear()

    @staticmethod
    async def _follow(p: Instance, source: Source, recheck_s: float) -> None:
        """Follow a prefill engine's KV events while it is listed; a broken subscription starts again."""
        unresolved = None  # the last lookup failure logged
        moved_to = None  # the address its name was just seen to have moved to
        last = None  # the address its name gave last (kept where a lookup fails)
        while True:
            ev = EngineEvents(source, p.cache, recheck_s=recheck_s, address=moved_to, last=last)
            moved_to = None
            try:
                await ev.run()
            except asyncio.CancelledError:
                raise
            except Unresolved as e:  # nothing was subscribed: nothing to clear; logged once per reason
                if str(e) != unresolved:
                    log.warning("KV events of %s: %s; trying again", p.url, e)
                unresolved = str(e)
                await asyncio.sleep(1.0)
            except Moved as e:
                log.warning("KV events of %s: %s: subscribing there", p.url, e)
                p.cache.clear("moved")
                unresolved, moved_to = None, e.address
            except Exception as e:  # noqa: BLE001 - a subscription's failure must not end the router
                log.warning("KV events of %s: %s; subscribing again", p.url, e)
                p.cache.clear("subscription_failed")
                unresolved = None
                await asyncio.sleep(1.0)
            finally:
                last = ev.reached or last
                ev.close()
