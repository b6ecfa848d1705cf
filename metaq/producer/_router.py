"""Where a topic can be written: partitions and broker addresses from ZooKeeper.

A producer writes to master brokers only.  For a topic it reads the children
``<id>-m`` of ``topics-pub/<topic>`` (JSON ``{"numParts":N,"broker":"<id>-m"}``)
and each broker's address from ``brokers/ids/<id>/master``; the topic's
partitions are ``<id>-0 .. <id>-(N-1)`` of every broker with a known address,
in Metaq's order (names sorted as strings), so every producer that sees the
same brokers has the same list.  Damaged nodes are logged and skipped.

Every read arms a watch.  Watch callbacks and the session listener only mark
topics dirty and notify the ``metaq-producer-zk`` thread, which re-reads them
and swaps in a new immutable :class:`TopicRoute`; it retries with backoff
while ZooKeeper is unreachable.
"""

from __future__ import annotations

import itertools
import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kazoo.client import KazooClient
from kazoo.exceptions import KazooException, NoNodeError
from kazoo.protocol.states import KazooState

from metaq._types import BrokerAddress
from zk_layout import (
    InvalidNameError,
    Layout,
    NodeDataError,
    Partition,
    decode_broker_uri,
    decode_topic_broker,
    parse_broker_child,
    sort_partitions,
)

__all__ = ["Router", "TopicRoute"]

log = logging.getLogger(__name__)

_RETRY_MIN, _RETRY_MAX = 0.2, 5.0


@dataclass(frozen=True)
class TopicRoute:
    """A topic's writable partitions (Metaq order) and its brokers' addresses."""

    topic: str
    partitions: tuple[Partition, ...] = ()
    addresses: dict[int, BrokerAddress] = field(default_factory=dict)
    #: position of each partition in ``partitions``
    positions: dict[Partition, int] = field(default_factory=dict)
    #: round-robin position (starts at a random partition, so producers spread out)
    counter: itertools.count = field(default_factory=lambda: itertools.count(
        random.randrange(1 << 16)), compare=False)

    @staticmethod
    def build(topic: str, num_parts: dict[int, int],
              addresses: dict[int, BrokerAddress]) -> TopicRoute:
        parts = sort_partitions(Partition(bid, i) for bid, n in num_parts.items()
                                if bid in addresses for i in range(n))
        used = {bid: addr for bid, addr in addresses.items() if num_parts.get(bid)}
        return TopicRoute(topic, tuple(parts), used, {p: i for i, p in enumerate(parts)})


class Router:
    """Keeps a :class:`TopicRoute` per topic, following ZooKeeper changes.

    ``on_change(topic, old, new)`` runs in the router thread after a route
    changed (``old`` is ``None`` for a first load).
    """

    def __init__(self, client: KazooClient, layout: Layout, *,
                 on_change: Callable[[str, TopicRoute | None, TopicRoute], None] | None = None,
                 max_parts_per_broker: int = 65536) -> None:
        self._client = client
        self._layout = layout
        self._on_change = on_change
        self._max_parts = max_parts_per_broker
        self._routes: dict[str, TopicRoute] = {}
        #: the live topic -> route map (read-only for others; entries are replaced whole)
        self.routes = self._routes
        self._watchers: dict[str, Callable[..., None]] = {}
        self._broker_watchers: dict[int, Callable[..., None]] = {}
        self._load_locks: dict[str, threading.Lock] = {}
        self._cond = threading.Condition()
        self._changed = threading.Condition()  # notified when a route is stored
        self._dirty: set[str] = set()
        self._stopped = False
        self.refreshes = 0  # completed background re-reads, for tests and stats
        client.add_listener(self._on_state)
        self._thread = threading.Thread(target=self._run, name="metaq-producer-zk", daemon=True)
        self._thread.start()

    # -- public --------------------------------------------------------------

    def get(self, topic: str) -> TopicRoute | None:
        """The current route of ``topic`` or ``None`` if never loaded."""
        return self._routes.get(topic)

    def load(self, topic: str) -> TopicRoute:
        """The route of ``topic``, read now (in the caller's thread) the first time."""
        route = self._routes.get(topic)
        if route is not None:
            return route
        lock = self._load_locks.setdefault(topic, threading.Lock())
        with lock:
            route = self._routes.get(topic)
            if route is None:
                route = self._read(topic)
                self._store(topic, route)
        return route

    def wait_for_partitions(self, topic: str, deadline: float) -> TopicRoute | None:
        """Wait (until ``deadline``, time.monotonic) for ``topic`` to have a writable
        partition, e.g. while a restarted broker registers again; the route then, or
        None.  The watches re-read the topic the moment its publishers change."""
        self.refresh(topic)
        with self._changed:
            while True:
                route = self._routes.get(topic)
                if route is not None and route.partitions:
                    return route
                left = deadline - time.monotonic()
                if left <= 0 or self._stopped:
                    return route
                self._changed.wait(min(left, 0.5))  # (re-asks ZooKeeper meanwhile)
                self.refresh(topic)

    def refresh(self, topic: str | None = None) -> None:
        """Ask the router thread to re-read ``topic`` (every topic when None)."""
        with self._cond:
            if topic is None:
                self._dirty.update(self._routes)
            else:
                self._dirty.add(topic)
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._client.remove_listener(self._on_state)
        if self._thread is not threading.current_thread():
            self._thread.join(10.0)

    # -- watches (never block) -------------------------------------------------

    def _on_state(self, state: KazooState) -> None:
        if state == KazooState.CONNECTED:
            self.refresh()  # a new or resumed session: re-read, re-arm watches

    def _topic_watcher(self, topic: str) -> Callable[..., None]:
        w = self._watchers.get(topic)
        if w is None:
            def w(event: object = None, _topic: str = topic) -> None:
                self.refresh(_topic)
            w = self._watchers.setdefault(topic, w)
        return w

    def _broker_watcher(self, broker_id: int) -> Callable[..., None]:
        w = self._broker_watchers.get(broker_id)
        if w is None:
            def w(event: object = None) -> None:
                self.refresh()  # any topic may live on this broker
            w = self._broker_watchers.setdefault(broker_id, w)
        return w

    # -- reading -------------------------------------------------------------

    def _children(self, path: str, watch: Callable[..., None]) -> list[str]:
        client = self._client
        try:
            return client.get_children(path, watch=watch)
        except NoNodeError:
            if client.exists(path, watch=watch) is None:
                return []
            try:
                return client.get_children(path, watch=watch)
            except NoNodeError:
                return []

    def _read(self, topic: str) -> TopicRoute:
        """Read ``topic``'s route from ZooKeeper, arming watches; kazoo errors propagate."""
        layout = self._layout
        client = self._client
        pub_dir = layout.topic_pub_dir(topic)
        watch = self._topic_watcher(topic)
        num_parts: dict[int, int] = {}
        for name in self._children(pub_dir, watch):
            try:
                child = parse_broker_child(name)
            except InvalidNameError:
                log.warning("skipping %r under %s: not '<id>-m' or '<id>-s<N>'", name, pub_dir)
                continue
            if not child.is_master:
                continue  # producers write to masters only
            path = layout.topic_pub(topic, child.broker_id)
            if path.rsplit("/", 1)[1] != name:
                log.warning("skipping %r under %s: not a canonical broker node name",
                            name, pub_dir)
                continue
            try:
                data, _ = client.get(path, watch=watch)
            except NoNodeError:
                continue  # went away while we read
            try:
                value = decode_topic_broker(data, path)
                if value.broker_id != child.broker_id or not value.is_master:
                    raise NodeDataError(path, data, f"broker field {value.broker!r} does not "
                                                    f"match the node name {name!r}")
                if value.num_parts > self._max_parts:
                    raise NodeDataError(path, data, f"numParts {value.num_parts} is over "
                                                    f"{self._max_parts}")
            except NodeDataError as e:
                log.warning("skipping damaged node: %s", e)
                continue
            num_parts[child.broker_id] = value.num_parts
        addresses: dict[int, BrokerAddress] = {}
        for bid in sorted(num_parts):
            addr = self._address(bid)
            if addr is not None:
                addresses[bid] = addr
            else:
                log.info("broker %d publishes topic %r but has no master address; "
                         "its partitions are skipped", bid, topic)
        return TopicRoute.build(topic, num_parts, addresses)

    def address(self, broker_id: int) -> BrokerAddress | None:
        """Broker ``broker_id``'s address as registered now (None when it is not)."""
        return self._address(broker_id)

    def _address(self, broker_id: int) -> BrokerAddress | None:
        client = self._client
        path = self._layout.broker_master(broker_id)
        watch = self._broker_watcher(broker_id)
        try:
            data, _ = client.get(path, watch=watch)
        except NoNodeError:
            if client.exists(path, watch=watch) is None:
                return None
            try:
                data, _ = client.get(path, watch=watch)
            except NoNodeError:
                return None
        try:
            return BrokerAddress(*decode_broker_uri(data, path).address)
        except NodeDataError as e:
            log.warning("skipping damaged node: %s", e)
            return None

    def _store(self, topic: str, route: TopicRoute) -> None:
        old = self._routes.get(topic)
        if old == route:
            return  # unchanged: keep the old object (and its round-robin position)
        self._routes[topic] = route
        with self._changed:
            self._changed.notify_all()
        log.info("topic %r: %d partition(s) on broker(s) %s", topic, len(route.partitions),
                 ", ".join(f"{b}@{h}:{p}" for b, (h, p) in sorted(route.addresses.items()))
                 or "none")
        if self._on_change is not None:
            try:
                self._on_change(topic, old, route)
            except Exception:
                log.exception("route change handler failed for topic %r", topic)

    # -- thread --------------------------------------------------------------

    def _run(self) -> None:
        delay = _RETRY_MIN
        while True:
            with self._cond:
                while not self._dirty and not self._stopped:
                    self._cond.wait()
                if self._stopped:
                    return
                topics, self._dirty = self._dirty, set()
            failed = set()
            for topic in sorted(topics):
                try:
                    lock = self._load_locks.setdefault(topic, threading.Lock())
                    with lock:
                        self._store(topic, self._read(topic))
                    self.refreshes += 1
                except KazooException as e:
                    failed.add(topic)
                    log.info("re-reading topic %r from ZooKeeper failed (%s); retrying",
                             topic, e)
                except Exception:
                    failed.add(topic)
                    log.exception("re-reading topic %r failed; retrying", topic)
            if failed:
                with self._cond:
                    self._dirty |= failed
                    self._cond.wait(delay)  # back off, unless stopped or new events
                delay = min(delay * 2, _RETRY_MAX)
            else:
                delay = _RETRY_MIN
