"""Producer: sends messages to the master brokers that publish a topic.

One pipelined connection per broker (:mod:`metaq.net._pipeline`) carries every
message for that broker, many in flight at once.  A failed attempt (broker
gone, connection reset, no reply within ``request_timeout``, a result code
other than 400/401) is retried on another partition, preferring another
broker, up to ``retries`` times within ``send_timeout``; retries triggered by
a reply are handed to the ``metaq-producer-retry`` thread so that a broker
connection's reader never blocks.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from kazoo.client import KazooClient
from kazoo.handlers.threading import KazooTimeoutError

from metaq._errors import (
    BrokerError,
    ConfigError,
    ConnectionClosedError,
    CoordinationError,
    MessageError,
    MessageTooLargeError,
    MetaqError,
    NoBrokerAvailableError,
    ProducerError,
    ProtocolError,
    SendTimeoutError,
)
from metaq._zkclient import make_client
from metaq.net import READER_PREFIX, PipelinedConnection
from metaq.producer._batch import BatchFuture, BatchResults, submit_batch
from metaq.producer._config import ProducerConfig
from metaq.producer._partitioner import make_partitioner
from metaq.producer._router import Router, TopicRoute
from metaq.producer._send import SendResult, _Send
from metaq.protocol import FLAG_HAS_ATTRIBUTE, check_topic, get_codec
from metaq.protocol import crc32 as _crc32  # ISA-L when installed (one selection point)
from zk_layout import Layout, Partition

__all__ = ["BatchFuture", "BatchResults", "Producer", "SendResult"]

log = logging.getLogger(__name__)

_MASK = 0x7FFFFFFF
#: Most bytes an attribute may take, so that payloads stay within the broker's limit.
MAX_ATTRIBUTE_BYTES = 32 * 1024
_monotonic = time.monotonic


class Producer:
    """Sends messages to a Metaq cluster found through ZooKeeper.

    ::

        with Producer("127.0.0.1:2181") as producer:
            result = producer.send("orders", b"hello")           # blocks
            future = producer.send_async("orders", {"id": 1})     # pipelined
            batch = producer.send_batch("orders", [b"a", b"b"])   # many, one future
            print(result.partition, result.offset, future.result().msg_id,
                  [r.offset for r in batch.result()])

    ``zk_connect`` is a ZooKeeper connect string (with an optional chroot) or
    a started :class:`kazoo.client.KazooClient` (left running on close).
    Options are the fields of :class:`ProducerConfig`, given either as
    ``config=`` or as keywords.
    """

    def __init__(self, zk_connect: str | KazooClient, *, config: ProducerConfig | None = None,
                 **options: Any) -> None:
        if config is not None and options:
            raise ConfigError("pass either config= or keyword options, not both")
        if config is None:
            config = ProducerConfig.from_mapping(options)
        elif not isinstance(config, ProducerConfig):
            raise ConfigError(f"config must be a ProducerConfig, not {type(config).__name__}")
        self.config = config
        self._layout = Layout(config.zk_root)
        codec = get_codec(config.codec)
        self._encode = codec.encode
        self._raw_bytes = codec.name in ("auto", "bytes")  # bytes bodies go as they are
        self._choose = make_partitioner(config.partitioner)
        self._round_robin = config.partitioner == "roundrobin"  # inlined in send_async
        self._timeout = config.send_timeout
        self._max_size = config.max_message_size
        self._conns: dict[int, PipelinedConnection] = {}
        self._conn_locks: dict[int, threading.Lock] = {}
        self._faults: dict[int, float] = {}
        self._retry_q: collections.deque[tuple[_Send, BaseException]] = collections.deque()
        self._retry_cond = threading.Condition()
        self._retrying = False
        self._closed = False
        self._stopping = False
        if isinstance(zk_connect, KazooClient):
            self._client, self._own_client = zk_connect, False
        elif isinstance(zk_connect, str) and zk_connect:
            self._client = make_client(zk_connect, timeout=config.zk_session_timeout,
                                       security=config.zk_security)
            self._own_client = True
            try:
                self._client.start(timeout=config.zk_connect_timeout)
            except KazooTimeoutError:
                self._client.close()
                raise CoordinationError(f"cannot connect to ZooKeeper at {zk_connect} within "
                                        f"{config.zk_connect_timeout:g}s") from None
        else:
            raise ConfigError(f"zk_connect must be a 'host:port[/chroot]' string or a "
                              f"KazooClient, got {zk_connect!r}")
        self._router = Router(self._client, self._layout, on_change=self._route_changed)
        self._routes = self._router.routes  # topic -> TopicRoute, read without a call
        self._retry_thread = threading.Thread(target=self._retry_loop, daemon=True,
                                              name="metaq-producer-retry")
        self._retry_thread.start()

    # -- lifecycle -----------------------------------------------------------

    def __enter__(self) -> Producer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, timeout: float | None = None) -> None:
        """Wait (up to ``timeout``, default ``close_timeout``) for every message
        in flight to be acknowledged or to fail, then stop threads and close
        connections; messages still unanswered then fail with ProducerError."""
        if self._closed:
            return
        self._closed = True
        deadline = _monotonic() + (self.config.close_timeout if timeout is None else timeout)
        while True:  # retries can move messages between connections: until all are quiet
            quiet = True
            for conn in list(self._conns.values()):
                if conn.in_flight:
                    quiet = False
                    conn.wait_idle(deadline)
            with self._retry_cond:
                while (self._retry_q or self._retrying) and _monotonic() < deadline:
                    quiet = False
                    self._retry_cond.wait(max(0.0, deadline - _monotonic()))
            if quiet or _monotonic() >= deadline:
                break
        with self._retry_cond:
            self._stopping = True
            self._retry_cond.notify_all()
        self._retry_thread.join(10.0)
        for conn in list(self._conns.values()):
            conn.close()
        self._conns.clear()
        self._router.close()
        if self._own_client:
            try:
                self._client.stop()
            finally:
                self._client.close()

    # -- sending -------------------------------------------------------------

    def send(self, topic: str, body: Any, attribute: str | None = None,
             key: Any = None) -> SendResult:
        """Send one message and wait for the broker's acknowledgement.

        Raises MessageTooLargeError / MessageError / ProtocolError for a bad
        message or topic (nothing sent), NoBrokerAvailableError when no broker
        publishes the topic, SendTimeoutError when no attempt succeeded within
        ``send_timeout``, BrokerError for a refusal a retry cannot fix.
        """
        if threading.current_thread().name.startswith(READER_PREFIX):
            raise ProducerError(
                "send() called from a send future's callback: it runs on the thread that "
                "reads the broker's replies, so it would wait for itself; use send_async()")
        fut = self._submit(topic, body, attribute, key, True)
        try:
            return fut.result(max(0.0, fut.deadline - _monotonic()) + 0.05)
        except FutureTimeout:
            raise SendTimeoutError(
                f"no acknowledgement for a message to topic {topic!r} within "
                f"{self._timeout:g}s ({fut.attempts} attempt(s)); it may or may not have "
                f"been stored") from None

    def send_async(self, topic: str, body: Any, attribute: str | None = None,
                   key: Any = None) -> Future[SendResult]:
        """Queue one message; return a future of its :class:`SendResult`.

        Many messages stay in flight on one connection per broker; this
        blocks only while a broker's in-flight window is full.  Errors about
        the message itself are raised here, before anything is sent; failures
        of the sending are set on the future.
        """
        return self._submit(topic, body, attribute, key, False)

    def send_batch(self, topic: str, bodies: Sequence[Any], *, attribute: str | None = None,
                   key: Any = None) -> BatchFuture:
        """Queue many messages to one partition; return one future of them all.

        The future's ``result()`` is a :class:`BatchResults`: a read-only
        sequence of :class:`SendResult`, one per body in the order of
        ``bodies`` (built when read; ``list()`` it for a list).  Every body
        is encoded and checked first: a bad one raises here (naming its
        index) and nothing is sent.  The whole batch goes to **one**
        partition (the partitioner is asked once, with the first body and
        ``key``; round-robin moves on per batch), written in chunks of up to
        4096 messages, each with one write, and stored there in order.
        ``attribute`` applies to every message.  Per message this costs a
        fraction of ``send_async`` (see bench/RESULTS.md).

        Each message keeps its own retries: one refused with a code a retry
        may fix, or left unanswered by a failed connection, is sent again on
        its own to another partition (so it may land after later messages of
        the batch), within ``send_timeout`` counted from when its chunk was
        written.  When some messages are not stored in the end, ``result()``
        raises :class:`~metaq.BatchSendError`: ``.errors`` maps their indexes
        to the reasons and ``.results`` holds the others' results.  Blocks
        only while the broker's in-flight window is full.
        """
        return submit_batch(self, topic, bodies, attribute, key)

    def _submit(self, topic: str, body: Any, attribute: str | None, key: Any,
                flush: bool) -> _Send:
        if self._closed:
            raise ProducerError("the producer is closed")
        try:
            route = self._routes.get(topic)
        except TypeError:  # unhashable: _load names what is wrong with it
            route = None
        if route is None:
            route = self._load(topic)
        data = body if type(body) is bytes and self._raw_bytes else self._encode(body)
        if len(data) > self._max_size:
            raise MessageTooLargeError(
                f"message body of {len(data)} bytes is over the limit of {self._max_size} "
                f"bytes (max_message_size); nothing was sent to topic {topic!r}")
        if attribute is None:
            payload, flag = data, 0
        else:
            payload, flag = self._with_attribute(data, attribute), FLAG_HAS_ATTRIBUTE
        parts = route.partitions
        deadline = _monotonic() + self._timeout
        if not parts:
            route = self._route_within(topic, deadline)
            parts = route.partitions
        send = _Send(self, topic, payload, flag, _crc32(payload) & _MASK, deadline)
        if self._round_robin:
            part = parts[next(route.counter) % len(parts)]
        else:
            part = parts[self._choose(topic, parts, data, key)]
        if self._faults:
            part = self._avoid_faulty(route, part)
        send.flush = flush
        self._dispatch(send, route, part)
        return send

    def _route_within(self, topic: str, deadline: float) -> TopicRoute:
        """No broker publishes ``topic`` right now (a broker restarting, its session
        being replaced): wait for one within the send timeout."""
        route = self._router.wait_for_partitions(topic, deadline)
        if route is None or not route.partitions:
            raise NoBrokerAvailableError(
                f"no broker publishes topic {topic!r}: no '<id>-m' node with partitions and "
                f"a live broker under {self._layout.topic_pub_dir(topic)} (waited "
                f"{self.config.send_timeout:g}s, the send timeout)")
        return route

    def partitions(self, topic: str) -> list[str]:
        """The names of ``topic``'s writable partitions, in Metaq order."""
        route = self._router.get(topic) or self._load(topic)
        return [str(p) for p in route.partitions]

    # -- internals: message ---------------------------------------------------

    def _load(self, topic: str) -> TopicRoute:
        check_topic(topic)
        if self._closed:
            raise ProducerError("the producer is closed")
        try:
            return self._router.load(topic)
        except MetaqError:
            raise
        except Exception as e:
            raise CoordinationError(f"cannot read topic {topic!r} from ZooKeeper: {e}") from e

    @staticmethod
    def _with_attribute(data: bytes, attribute: str) -> bytes:
        if not isinstance(attribute, str):
            raise MessageError(f"attribute must be a str or None, not "
                               f"{type(attribute).__name__}")
        attr = attribute.encode("utf-8")
        if len(attr) > MAX_ATTRIBUTE_BYTES:
            raise MessageTooLargeError(f"attribute of {len(attr)} bytes is over the limit of "
                                       f"{MAX_ATTRIBUTE_BYTES} bytes; nothing was sent")
        return len(attr).to_bytes(4, "big") + attr + data

    # -- internals: attempts ----------------------------------------------------

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

    def _dispatch(self, send: _Send, route: TopicRoute, part: Partition) -> None:
        """Put ``send`` on ``part``'s broker connection, moving on to other
        partitions while connections fail.  Never raises: failures go on the
        future.  Runs in a user thread or the retry thread (may block)."""
        while True:
            bid = part.broker_id
            try:
                conn = self._conns.get(bid)
                if conn is None or not conn.usable or conn.address != route.addresses.get(bid):
                    conn = self._connect(bid, route, send.deadline)
                send.part = part
                send.attempts += 1
                conn.put(send.topic, part.index, send.payload, send.flag, send.checksum, send,
                         send.deadline, send.flush)
                return
            except ConnectionClosedError as e:
                self._faults[bid] = _monotonic() + self.config.broker_backoff
                err: BaseException = e
            except (SendTimeoutError, ProtocolError) as e:
                self._finish(send, e)
                return
            nxt = self._next_attempt(send, err)
            if nxt is None:
                return
            route, part, delay = nxt
            if delay > 0 and not self._pause(delay, send.deadline):
                self._finish(send, SendTimeoutError(
                    f"sending to topic {send.topic!r} timed out after {send.attempts} "
                    f"attempt(s): {err}"), err)
                return

    def _connect(self, bid: int, route: TopicRoute, deadline: float) -> PipelinedConnection:
        lock = self._conn_locks.get(bid) or self._conn_locks.setdefault(bid, threading.Lock())
        with lock:
            addr = route.addresses.get(bid)
            conn = self._conns.get(bid)
            if conn is not None and not conn.closed and conn.address == addr:
                return conn
            if addr is None:
                raise ConnectionClosedError(f"broker {bid} has no known address")
            if self._stopping:
                raise ConnectionClosedError("the producer is closing")
            cfg = self.config
            new = PipelinedConnection(
                addr[0], addr[1], name=f"{bid}@{addr[0]}:{addr[1]}",
                connect_timeout=max(0.05, min(cfg.connect_timeout, deadline - _monotonic())),
                request_timeout=cfg.attempt_timeout,
                stale_timeout=max(cfg.send_timeout, 4 * cfg.attempt_timeout),
                max_in_flight=cfg.max_in_flight,
                max_in_flight_bytes=cfg.max_in_flight_bytes)
            self._conns[bid] = new
            self._faults.pop(bid, None)
        if conn is not None and not conn.closed:
            conn.close()  # the broker moved: what was in flight there is retried
        return new

    def _failed(self, send: _Send, err: BaseException) -> None:
        """An attempt failed (called from a connection's reader): retry elsewhere.
        Never blocks: the retry thread does the rest."""
        if isinstance(err, ConnectionClosedError) and send.part is not None:
            self._faults[send.part.broker_id] = _monotonic() + self.config.broker_backoff
        with self._retry_cond:
            if not self._stopping:
                self._retry_q.append((send, err))
                self._retry_cond.notify()
                return
        self._finish(send, ProducerError(
            f"the producer closed before a message to topic {send.topic!r} was acknowledged "
            f"({send.attempts} attempt(s); last error: {err})"), err)

    def _finish(self, send: _Send, err: BaseException, cause: BaseException | None = None) -> None:
        if cause is not None:
            err.__cause__ = cause
        send.payload = b""
        try:
            send.set_exception(err)
        except Exception:  # already completed (a late duplicate outcome)
            log.debug("ignoring a second outcome for a message to %r: %s", send.topic, err)

    def _next_attempt(self, send: _Send, err: BaseException
                      ) -> tuple[TopicRoute, Partition, float] | None:
        """The partition for the next attempt and the pause before it, or None
        after failing the future (attempts exhausted, time up, no partition)."""
        cfg = self.config
        topic = send.topic
        if isinstance(err, BrokerError) and err.code == 404:
            self._router.refresh(topic)  # the broker does not know it: our route is stale
        if send.attempts > cfg.retries:
            self._finish(send, SendTimeoutError(
                f"sending to topic {topic!r} failed after {send.attempts} attempt(s) "
                f"(retries={cfg.retries}); last error: {err}"), err)
            return None
        if self._stopping:
            self._finish(send, ProducerError(
                f"the producer closed before a message to topic {topic!r} was acknowledged "
                f"({send.attempts} attempt(s); last error: {err})"), err)
            return None
        now = _monotonic()
        if now >= send.deadline:
            self._finish(send, SendTimeoutError(
                f"sending to topic {topic!r} failed: the send timeout of "
                f"{cfg.send_timeout:g}s passed after {send.attempts} attempt(s); last error: "
                f"{err}"), err)
            return None
        route = self._router.get(topic)
        parts = route.partitions if route is not None else ()
        if not parts:  # its broker is re-registering, maybe: wait within the send timeout
            route = self._router.wait_for_partitions(topic, send.deadline)
            parts = route.partitions if route is not None else ()
        if not parts:
            self._finish(send, NoBrokerAvailableError(
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
                nxt = self._next_attempt(send, err)
                if nxt is None:
                    continue
                route, part, delay = nxt
                if delay > 0 and not self._pause(delay, send.deadline):
                    self._finish(send, SendTimeoutError(
                        f"sending to topic {send.topic!r} timed out after {send.attempts} "
                        f"attempt(s): {err}"), err)
                    continue
                self._dispatch(send, route, part)
            except BaseException as e:  # a bug: never leave the user's future hanging
                log.exception("retry of a message to %r failed", send.topic)
                self._finish(send, ProducerError(f"internal error while retrying: {e!r}"), e)

    def _route_changed(self, topic: str, old: TopicRoute | None, new: TopicRoute) -> None:
        """Router thread: a broker that moved gets a fresh connection."""
        for bid, conn in list(self._conns.items()):
            addr = new.addresses.get(bid)
            if addr is not None and conn.address != addr and not conn.closed:
                log.info("broker %d moved from %s:%d to %s:%d", bid, *conn.address, *addr)
                conn.close()
