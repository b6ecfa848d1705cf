"""The producer's brokers: one pipelined connection each, and which failed lately.

:class:`BrokerConnections` keeps one
:class:`~metaq.net.PipelinedConnection` per broker id, made on first use
(:meth:`~BrokerConnections.get`), replaced when it failed or the broker's
address changed, and closed when the producer closes.  A broker whose
connection failed is *faulty* for ``broker_backoff`` seconds (the send path
prefers other brokers meanwhile); a new connection to it clears that.

:attr:`~BrokerConnections.by_broker` and :attr:`~BrokerConnections.faults`
are read once per message by the send path, without a call; only this
object writes them.

An idempotent producer (``ProducerConfig.idempotent``) asks each broker's
``version`` before it makes the connection, and marks the connection
``idempotent`` when the answer lists ``+idempotent``: only then do its puts carry
the ``idem`` mark (a Java broker gets plain puts).  Every connection made here
has the attribute (False unless asked and offered).
"""

from __future__ import annotations

import logging
import threading
import time

from metaq._errors import BrokerUnavailableError, ConnectionClosedError, MetaqError
from metaq.net import BrokerConnection, PipelinedConnection
from metaq.producer._config import ProducerConfig
from metaq.producer._router import TopicRoute
from metaq.protocol import IDEMPOTENT_CAPABILITY

__all__ = ["BrokerConnections"]

log = logging.getLogger(__name__)

_monotonic = time.monotonic


class BrokerConnections:
    """One :class:`~metaq.net.PipelinedConnection` per broker, with ``config``'s
    timeouts and in-flight window."""

    def __init__(self, config: ProducerConfig) -> None:
        self._config = config
        #: broker id -> its connection (maybe failed: check ``usable`` and ``address``)
        self.by_broker: dict[int, PipelinedConnection] = {}
        #: broker id -> ``time.monotonic()`` until which it counts as faulty
        self.faults: dict[int, float] = {}
        self._locks: dict[int, threading.Lock] = {}
        self._refusing = False

    def get(self, broker_id: int, route: TopicRoute, deadline: float) -> PipelinedConnection:
        """A usable connection to ``broker_id`` at its address in ``route``: the open one or
        a new one (connecting within ``deadline``); raises ConnectionClosedError."""
        conn = self.by_broker.get(broker_id)
        if conn is None or not conn.usable or conn.address != route.addresses.get(broker_id):
            conn = self.connect(broker_id, route, deadline)
        return conn

    def connect(self, broker_id: int, route: TopicRoute, deadline: float) -> PipelinedConnection:
        """:meth:`get` when the open connection will not do: a new one, unless another
        thread just made it; the old one is closed (what was in flight there is retried)."""
        bid = broker_id
        lock = self._locks.get(bid) or self._locks.setdefault(bid, threading.Lock())
        with lock:
            addr = route.addresses.get(bid)
            conn = self.by_broker.get(bid)
            if conn is not None and not conn.closed and conn.address == addr:
                return conn
            if addr is None:
                raise ConnectionClosedError(f"broker {bid} has no known address")
            if self._refusing:
                raise ConnectionClosedError("the producer is closing")
            cfg = self._config
            offers = cfg.idempotent and self._offers_idempotence(bid, addr, deadline)
            new = PipelinedConnection(
                addr[0], addr[1], name=f"{bid}@{addr[0]}:{addr[1]}",
                connect_timeout=max(0.05, min(cfg.connect_timeout, deadline - _monotonic())),
                request_timeout=cfg.attempt_timeout,
                stale_timeout=max(cfg.send_timeout, 4 * cfg.attempt_timeout),
                max_in_flight=cfg.max_in_flight,
                max_in_flight_bytes=cfg.max_in_flight_bytes)
            #: whether puts on it may carry the idempotent producer's mark
            new.idempotent = offers  # type: ignore[attr-defined]
            self.by_broker[bid] = new
            self.faults.pop(bid, None)
        if conn is not None and not conn.closed:
            conn.close()  # the broker moved: what was in flight there is retried
        return new

    def _offers_idempotence(self, bid: int, addr: tuple[str, int], deadline: float) -> bool:
        """Whether the broker at ``addr`` lists ``+idempotent`` in its ``version`` answer
        (asked on a short connection of its own; ConnectionClosedError when it cannot
        be asked)."""
        timeout = max(0.05, min(self._config.connect_timeout, deadline - _monotonic()))
        try:
            with BrokerConnection(addr[0], addr[1], timeout=timeout) as c:
                text = c.version()
        except (BrokerUnavailableError, ConnectionClosedError) as e:
            raise ConnectionClosedError(f"cannot ask broker {bid} at {addr[0]}:{addr[1]} "
                                        f"its version: {e}") from e
        except MetaqError as e:  # answered, but not with a version: no extensions
            log.info("broker %d did not answer 'version' (%s): plain puts", bid, e)
            return False
        offers = IDEMPOTENT_CAPABILITY in text.split()
        if not offers:
            log.info("broker %d (%s) does not offer idempotent puts: plain puts, retried as "
                     "usual", bid, text.strip()[:80])
        return offers

    def broker_failed(self, broker_id: int) -> None:
        """A connection to ``broker_id`` failed: avoid it for ``broker_backoff``."""
        self.faults[broker_id] = _monotonic() + self._config.broker_backoff

    def route_changed(self, topic: str, old: TopicRoute | None, new: TopicRoute) -> None:
        """The router's ``on_change`` (its thread): a broker that moved gets a fresh
        connection (the old one is closed; what was in flight there is retried)."""
        for bid, conn in list(self.by_broker.items()):
            addr = new.addresses.get(bid)
            if addr is not None and conn.address != addr and not conn.closed:
                log.info("broker %d moved from %s:%d to %s:%d", bid, *conn.address, *addr)
                conn.close()

    def wait_idle(self, deadline: float) -> bool:
        """Wait (up to ``deadline``) for every connection's requests in flight to be
        answered or to fail; True when none had any in flight."""
        quiet = True
        for conn in list(self.by_broker.values()):
            if conn.in_flight:
                quiet = False
                conn.wait_idle(deadline)
        return quiet

    def refuse_new(self) -> None:
        """From now on :meth:`connect` refuses (the producer is closing)."""
        self._refusing = True

    def close(self) -> None:
        """Close every connection (requests still in flight fail)."""
        for conn in list(self.by_broker.values()):
            conn.close()
        self.by_broker.clear()
