"""The send path: pick a partition, put the message on its broker's connection, retry.

Shared by single sends and batches (:mod:`metaq.producer._batch`):

- :meth:`SendPath.route` / :meth:`~SendPath.writable`: a topic's partitions
  (the router's, waiting within the send timeout while no broker publishes it);
- :meth:`SendPath.pick`: the partition for a new message or batch (the
  partitioner, round-robin on the route's counter, then away from brokers
  that failed lately);
- :meth:`SendPath.connection`: the connection that serves it
  (:class:`~metaq.producer._connections.BrokerConnections`);
- :meth:`SendPath.dispatch`: one message's attempts, moving on to other
  partitions while connections fail;
- :meth:`SendPath.retry_step`: the one retry rule — after a failed attempt,
  another partition (preferring an untried one on a broker that has not
  failed lately), after ``retry_backoff`` when it must reuse one, within
  ``retries`` and ``send_timeout``;
- :meth:`SendPath.attempt_failed`: where a connection's reader hands a
  failed attempt; the ``metaq-producer-retry`` thread takes it from there,
  so that a reader never blocks.

An idempotent producer (``ProducerConfig.idempotent``) dispatches with
:meth:`SendPath.dispatch_idempotent` instead: on a connection that offers it, the
first attempt takes the message's ``(pid, seq)`` for its partition
(:mod:`metaq.producer._idempotence`) and every put carries them in an ``idem``
mark; a failed attempt of such a message is retried on the *same* partition with
the same pair (the broker drops it if the first attempt was stored after all),
waiting for its broker within ``send_timeout``.  A gap refusal (409: a message
before it has not arrived yet) is retried at once and costs no attempt.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any

from metaq._errors import (
    BrokerError,
    ConnectionClosedError,
    CoordinationError,
    MetaqError,
    NoBrokerAvailableError,
    ProducerError,
    ProtocolError,
    SendTimeoutError,
)
from metaq.net import PipelinedConnection
from metaq.producer._config import ProducerConfig
from metaq.producer._connections import BrokerConnections
from metaq.producer._idempotence import Sequences
from metaq.producer._partitioner import make_partitioner
from metaq.producer._router import Router, TopicRoute
from metaq.producer._send import Send, SendResult, partition_names
from metaq.protocol import GAP_CODE, check_topic, encode_idem_mark
from zk_layout import Layout, Partition

__all__ = ["SendPath"]

log = logging.getLogger(__name__)

_monotonic = time.monotonic
#: ``encode_idem_mark(pid, seq, 1)`` for this producer's own (valid) pid and seq, formatted
#: without its checks: once per idempotent single send.
_MARK1 = b"idem %d %d 1\r\n"


class SendPath:
    """Where messages go and how they get there, for one producer: ``router``'s routes,
    ``connections`` to their brokers, ``config``'s partitioner, retries and timeouts.

    Starts the ``metaq-producer-retry`` thread; :meth:`close` stops it.
    """

    def __init__(self, config: ProducerConfig, layout: Layout, router: Router,
                 connections: BrokerConnections) -> None:
        self._config = config
        self._layout = layout
        self._router = router
        self._routes = router.routes  # topic -> TopicRoute, read without a call
        self._connections = connections
        self._conns = connections.by_broker  # read per message (dispatch)
        self._faults = connections.faults  # read per message (pick)
        self._choose = make_partitioner(config.partitioner)
        self._round_robin = config.partitioner == "roundrobin"  # inlined in pick
        #: broker id -> its partition-name cache (partition_names), read per blocking send
        self._names: dict[int, Any] = {}
        self._retry_q: collections.deque[tuple[Send, BaseException]] = collections.deque()
        self._retry_cond = threading.Condition()
        self._retrying = False
        self._stopping = False
        #: True once :meth:`close` began: topics are no longer read
        self.closed = False
        #: the idempotent producer's sequences (None when it is not idempotent)
        self.sequences: Sequences | None = None
        if config.idempotent:
            self.sequences = Sequences()
            self.dispatch = self.dispatch_idempotent  # type: ignore[method-assign]
        self._retry_thread = threading.Thread(target=self._retry_loop, daemon=True,
                                              name="metaq-producer-retry")
        self._retry_thread.start()

    # -- where ------------------------------------------------------------------

    def route(self, topic: str) -> TopicRoute:
        """``topic``'s route: the one followed, or read from ZooKeeper now (the first time)."""
        try:
            route = self._routes.get(topic)
        except TypeError:  # unhashable: load() names what is wrong with it
            route = None
        return route if route is not None else self.load(topic)

    def load(self, topic: str) -> TopicRoute:
        """``topic``'s route, read from ZooKeeper if it never was (ProtocolError for a
        bad topic name, CoordinationError when ZooKeeper cannot be read)."""
        check_topic(topic)
        if self.closed:
            raise ProducerError("the producer is closed")
        try:
            return self._router.load(topic)
        except MetaqError:
            raise
        except Exception as e:
            raise CoordinationError(f"cannot read topic {topic!r} from ZooKeeper: {e}") from e

    def writable(self, topic: str, deadline: float) -> TopicRoute:
        """No broker publishes ``topic`` right now (a broker restarting, its session
        being replaced): wait for one until ``deadline`` (the send timeout's end)."""
        route = self._router.wait_for_partitions(topic, deadline)
        if route is None or not route.partitions:
            raise NoBrokerAvailableError(
                f"no broker publishes topic {topic!r}: no '<id>-m' node with partitions and "
                f"a live broker under {self._layout.topic_pub_dir(topic)} (waited "
                f"{self._config.send_timeout:g}s, the send timeout)")
        return route

    def pick(self, topic: str, route: TopicRoute, data: bytes, key: Any) -> Partition | None:
        """The partition for a new message (or batch) with body ``data`` and ``key``;
        None when ``route`` has no partition (wait with :meth:`writable`, pick again)."""
        parts = route.partitions
        if not parts:
            return None
        if self._round_robin:
            part = parts[next(route.counter) % len(parts)]
        else:
            part = parts[self._choose(topic, parts, data, key)]
        if self._faults:
            part = self._avoid_faulty(route, part)
        return part

    def submit(self, send: Send, topic: str, route: TopicRoute, data: bytes, key: Any) -> None:
        """A new message's partition and attempts: :meth:`pick` then :meth:`dispatch`,
        in one call on the common path (round-robin, no broker avoided, a usable
        connection, not idempotent).  Raises NoBrokerAvailableError when no broker
        publishes ``topic`` within the send timeout; any other failure goes on the
        future."""
        parts = route.partitions
        if parts and self._round_robin and not self._faults and self.sequences is None:
            part = parts[next(route.counter) % len(parts)]
            bid = part.broker_id
            conn = self._conns.get(bid)
            if conn is not None and conn.usable and conn.address == route.addresses.get(bid):
                send.part = part
                send.attempts = 1
                try:
                    conn.put(topic, part.index, send.payload, send.flag, send.checksum, send,
                             send.deadline, send.flush)
                except ConnectionClosedError as e:
                    self._first_failed(send, bid, e)
                except (SendTimeoutError, ProtocolError) as e:
                    self.fail(send, e)
                return
        else:
            part = self.pick(topic, route, data, key)
            if part is None:  # no broker publishes topic right now: wait within the timeout
                route = self.writable(topic, send.deadline)
                part = self.pick(topic, route, data, key)
        self.dispatch(send, route, part)  # type: ignore[arg-type]

    def submit_sync(self, send: Send, topic: str, route: TopicRoute, data: bytes,
                    key: Any) -> SendResult | None:
        """:meth:`submit` for a blocking send (``send.flush``): when its connection has
        nothing else in flight, the whole round trip on this thread
        (:meth:`PipelinedConnection.put_wait`), returning the :class:`SendResult`;
        None when ``send`` goes (or went) the usual way -- an idempotent producer, a
        broker to connect to or avoided, a reply other than its success, another
        request in flight -- and completes as a future (wait for it)."""
        parts = route.partitions
        if parts and self.sequences is None:
            if self._round_robin:
                part = parts[next(route.counter) % len(parts)]
            else:
                part = parts[self._choose(topic, parts, data, key)]
            if self._faults:
                part = self._avoid_faulty(route, part)
            bid = part.broker_id
            conn = self._conns.get(bid)
            if conn is not None and conn.usable and conn.address == route.addresses.get(bid):
                send.part = part
                send.attempts = 1
                names = self._names.get(bid)
                if names is None:
                    names = self._names[bid] = partition_names(bid)
                r = conn.put_wait(topic, part.index, send.payload, send.flag, send.checksum,
                                  send, send.deadline, SendResult, bid, names)
                if r is not False:
                    return r
                send.attempts = 0  # not sent: dispatch counts its attempt
            self.dispatch(send, route, part)
            return None
        self.submit(send, topic, route, data, key)
        return None

    def read_reply(self, send: Send) -> None:
        """A blocking send just written (``send.flush``): read its reply on this thread
        when its connection has nothing else in flight
        (:meth:`PipelinedConnection.read_own`)."""
        part = send.part
        if part is not None:
            conn = self._conns.get(part.broker_id)
            if conn is not None:
                conn.read_own(send, send.deadline)

    def _first_failed(self, send: Send, bid: int, err: ConnectionClosedError) -> None:
        """:meth:`dispatch`'s answer to a connection failing under the put of :meth:`submit`."""
        self._connections.broker_failed(bid)
        if not send.retry_here:
            self.attempt_failed(send, err)
            return
        nxt = self.retry_step(send, err)
        if nxt is not None:
            self.dispatch(send, *nxt)

    def _avoid_faulty(self, route: TopicRoute, part: Partition) -> Partition:
        """``part``, or the next partition on a broker that has not failed lately."""
        now = _monotonic()
        until = self._faults.get(part.broker_id)
        if until is None or until <= now:
            return part
        parts = route.partitions
        start = route.positions.get(part, 0)
        for i in range(1, len(parts)):
            other = parts[(start + i) % len(parts)]
            u = self._faults.get(other.broker_id)
            if u is None or u <= now:
                return other
        return part

    def connection(self, part: Partition, route: TopicRoute,
                   deadline: float) -> PipelinedConnection:
        """The usable connection to ``part``'s broker (raises ConnectionClosedError)."""
        return self._connections.get(part.broker_id, route, deadline)

    def broker_failed(self, broker_id: int) -> None:
        """A connection to ``broker_id`` failed: first attempts avoid it for a while."""
        self._connections.broker_failed(broker_id)

    # -- attempts ---------------------------------------------------------------

    def dispatch(self, send: Send, route: TopicRoute, part: Partition) -> None:
        """Put ``send`` on ``part``'s broker connection, moving on to other
        partitions while connections fail.  Never raises: failures go on the
        future.  Runs in a user thread or the retry thread (may block)."""
        while True:
            bid = part.broker_id
            try:
                conn = self._conns.get(bid)  # connection(), inlined: once per message
                if conn is None or not conn.usable or conn.address != route.addresses.get(bid):
                    conn = self._connections.connect(bid, route, send.deadline)
                send.part = part
                send.attempts += 1
                conn.put(send.topic, part.index, send.payload, send.flag, send.checksum, send,
                         send.deadline, send.flush)
                return
            except ConnectionClosedError as e:
                self._connections.broker_failed(bid)
                if not send.retry_here:  # (an event loop's send: the retry thread pauses)
                    self.attempt_failed(send, e)
                    return
                err: BaseException = e
            except (SendTimeoutError, ProtocolError) as e:
                self.fail(send, e)
                return
            nxt = self.retry_step(send, err)
            if nxt is None:
                return
            route, part = nxt

    def dispatch_idempotent(self, send: Send, route: TopicRoute, part: Partition) -> None:
        """:meth:`dispatch` of an idempotent producer: on a connection that offers it,
        the put carries the message's ``(pid, seq)`` (taken on its first attempt)."""
        seqs = self.sequences
        assert seqs is not None
        while True:
            bid = part.broker_id
            try:
                conn = self._conns.get(bid)
                if conn is None or not conn.usable or conn.address != route.addresses.get(bid):
                    conn = self._connections.connect(bid, route, send.deadline)
                seq = getattr(send, "seq", None)
                if seq is None and not conn.idempotent:  # type: ignore[attr-defined]
                    send.part = part  # a broker without the extension: a plain put
                    send.attempts += 1
                    conn.put(send.topic, part.index, send.payload, send.flag, send.checksum,
                             send, send.deadline, send.flush)
                    return
                if seq is None:
                    sequence = seqs.of(part)
                    with sequence.lock:  # puts leave in seq order; a seq used once queued
                        send.part = part
                        send.attempts += 1
                        pid, seq = send.pid, send.seq = sequence.take()
                        try:
                            conn.put_marked(_MARK1 % (pid, seq), send.topic,
                                            part.index, send.payload, send.flag,
                                            send.checksum, send, send.deadline, send.flush)
                        except BaseException:
                            send.seq = None
                            raise
                        sequence.taken(pid, seq, 1)
                    return
                send.part = part
                send.attempts += 1
                if conn.idempotent:  # type: ignore[attr-defined]
                    conn.put_marked(encode_idem_mark(send.pid, seq, 1), send.topic, part.index,
                                    send.payload, send.flag, send.checksum, send,
                                    send.deadline, send.flush)
                else:  # the broker lost the extension (replaced by another): best effort
                    conn.put(send.topic, part.index, send.payload, send.flag, send.checksum,
                             send, send.deadline, send.flush)
                return
            except ConnectionClosedError as e:
                self._connections.broker_failed(bid)
                if not send.retry_here:  # (an event loop's send: the retry thread pauses)
                    self.attempt_failed(send, e)
                    return
                err: BaseException = e
            except (SendTimeoutError, ProtocolError) as e:
                self.fail(send, e)
                return
            nxt = self.retry_step(send, err)
            if nxt is None:
                return
            route, part = nxt

    def attempt_failed(self, send: Send, err: BaseException) -> None:
        """An attempt failed (called from a connection's reader): retry elsewhere.
        Never blocks: the retry thread does the rest."""
        if isinstance(err, ConnectionClosedError) and send.part is not None:
            self._connections.broker_failed(send.part.broker_id)
        with self._retry_cond:
            if not self._stopping:
                self._retry_q.append((send, err))
                self._retry_cond.notify()
                return
        self.fail(send, ProducerError(
            f"the producer closed before a message to topic {send.topic!r} was acknowledged "
            f"({send.attempts} attempt(s); last error: {err})"), err)

    def fail(self, send: Send, err: BaseException, cause: BaseException | None = None) -> None:
        """Complete ``send`` with ``err`` (its final outcome; a late second one is ignored)."""
        if cause is not None:
            err.__cause__ = cause
        if self.sequences is not None and getattr(send, "seq", None) is not None:
            # the broker may or may not hold it: later seqs must not wait for it
            self.sequences.restart(send.part, send.pid)  # type: ignore[arg-type]
        send.payload = b""
        try:
            send.set_exception(err)
        except Exception:  # already completed (a late duplicate outcome)
            log.debug("ignoring a second outcome for a message to %r: %s", send.topic, err)

    def retry_step(self, send: Send, err: BaseException) -> tuple[TopicRoute, Partition] | None:
        """After ``err``, the route and partition of ``send``'s next attempt, once the
        pause it needs is over; None after failing the future (attempts exhausted, time
        up, no partition left, the producer closing)."""
        nxt = self._next_attempt(send, err)
        if nxt is None:
            return None
        route, part, delay = nxt
        if delay > 0 and not self._pause(delay, send.deadline):
            self.fail(send, SendTimeoutError(
                f"sending to topic {send.topic!r} timed out after {send.attempts} "
                f"attempt(s): {err}"), err)
            return None
        return route, part

    def _next_attempt(self, send: Send, err: BaseException
                      ) -> tuple[TopicRoute, Partition, float] | None:
        """The partition for the next attempt and the pause before it, or None
        after failing the future (attempts exhausted, time up, no partition)."""
        cfg = self._config
        topic = send.topic
        moved = isinstance(err, BrokerError) and err.code == 503
        if isinstance(err, BrokerError) and err.code == 404 or moved:
            # the broker does not know it, or is no master (a replica fenced or not yet
            # leading, README "Replication"): our route is stale
            self._router.refresh(topic)
        pinned = self.sequences is not None and getattr(send, "seq", None) is not None
        gap = pinned and isinstance(err, BrokerError) and err.code == GAP_CODE
        if gap:
            send.attempts -= 1  # not stored; waiting for the messages before it
        if send.attempts > cfg.retries:
            self.fail(send, SendTimeoutError(
                f"sending to topic {topic!r} failed after {send.attempts} attempt(s) "
                f"(retries={cfg.retries}); last error: {err}"), err)
            return None
        if self._stopping:
            self.fail(send, ProducerError(
                f"the producer closed before a message to topic {topic!r} was acknowledged "
                f"({send.attempts} attempt(s); last error: {err})"), err)
            return None
        now = _monotonic()
        if now >= send.deadline:
            self.fail(send, SendTimeoutError(
                f"sending to topic {topic!r} failed: the send timeout of "
                f"{cfg.send_timeout:g}s passed after {send.attempts} attempt(s); last error: "
                f"{err}"), err)
            return None
        if pinned:
            return self._same_partition(send, gap, moved)
        route = self._router.get(topic)
        parts = route.partitions if route is not None else ()
        if not parts:  # its broker is re-registering, maybe: wait within the send timeout
            route = self._router.wait_for_partitions(topic, send.deadline)
            parts = route.partitions if route is not None else ()
        if not parts:
            self.fail(send, NoBrokerAvailableError(
                f"no broker publishes topic {topic!r} any more (after {send.attempts} "
                f"attempt(s), waiting until the send timeout; last error: {err})"), err)
            return None
        if send.tried is None:
            send.tried = set()
        last = send.part
        if last is not None:
            send.tried.add(last)
        faults = self._faults

        def healthy(p: Partition) -> bool:
            until = faults.get(p.broker_id)
            return until is None or until <= now

        start = route.positions.get(last, -1) + 1 if last is not None else 0
        order = [parts[(start + i) % len(parts)] for i in range(len(parts))]
        fresh = [p for p in order if p not in send.tried]
        for candidates, delay in (([p for p in fresh if healthy(p)], 0.0),
                                  (fresh, cfg.retry_backoff),
                                  (order, cfg.retry_backoff)):
            if candidates:
                return route, candidates[0], delay
        return None  # unreachable: parts is not empty

    def _same_partition(self, send: Send, gap: bool, moved: bool = False
                        ) -> tuple[TopicRoute, Partition, float]:
        """The next attempt of an idempotent message: its partition again, with its
        ``(pid, seq)``; at once after a gap refusal (the first in a row) or while its
        broker's connection is up, else (and after a 503: not the master now, ``moved``)
        after ``retry_backoff``."""
        part = send.part
        assert part is not None and self.sequences is not None
        delay = self._config.retry_backoff
        if gap:
            send.gaps = getattr(send, "gaps", 0) + 1
            if send.pid != self.sequences.current(part):
                # the sequence restarted after a message before it failed for good; a
                # gap refusal means this one was not stored: it takes a new place
                send.seq = None
            if send.gaps == 1:
                delay = 0.0
        else:
            send.gaps = 0
            conn = self._conns.get(part.broker_id)
            if conn is not None and conn.usable and not moved:
                delay = 0.0
        # (its broker away, restarting: connecting fails and this comes back, every
        # retry_backoff, until it is back or the send timeout is over)
        route = self._router.get(send.topic)
        if route is None or not route.partitions:
            route = self._router.wait_for_partitions(send.topic, send.deadline) or route
        if route is None:
            route = self._router.load(send.topic)
        return route, part, delay

    def _pause(self, delay: float, deadline: float) -> bool:
        """Wait ``delay`` (interrupted by close); False when it would pass ``deadline``."""
        end = _monotonic() + delay
        if end >= deadline:
            return False
        with self._retry_cond:
            while not self._stopping:
                left = end - _monotonic()
                if left <= 0:
                    break
                self._retry_cond.wait(left)
        return not self._stopping

    def _retry_loop(self) -> None:
        q = self._retry_q
        cond = self._retry_cond
        while True:
            with cond:
                self._retrying = False
                cond.notify_all()
                while not q and not self._stopping:
                    cond.wait()
                if not q:
                    return
                send, err = q.popleft()
                self._retrying = True
            try:
                nxt = self.retry_step(send, err)
                send.flush = False  # the reader thread reads its reply (see read_reply)
                if nxt is not None:
                    self.dispatch(send, *nxt)
            except BaseException as e:  # a bug: never leave the user's future hanging
                log.exception("retry of a message to %r failed", send.topic)
                self.fail(send, ProducerError(f"internal error while retrying: {e!r}"), e)

    # -- lifecycle ----------------------------------------------------------------

    def close(self, deadline: float) -> None:
        """Wait (until ``deadline``) for every message in flight to be acknowledged or
        to fail, retries included; then stop the retry thread and close the
        connections: messages still unanswered then fail with ProducerError."""
        self.closed = True
        while True:  # retries can move messages between connections: until all are quiet
            quiet = self._connections.wait_idle(deadline)
            with self._retry_cond:
                while (self._retry_q or self._retrying) and _monotonic() < deadline:
                    quiet = False
                    self._retry_cond.wait(max(0.0, deadline - _monotonic()))
            if quiet or _monotonic() >= deadline:
                break
        with self._retry_cond:
            self._stopping = True
            self._connections.refuse_new()
            self._retry_cond.notify_all()
        self._retry_thread.join(10.0)
        self._connections.close()
