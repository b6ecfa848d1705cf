"""The Producer facade: sends messages to the master brokers that publish a topic.

:class:`Producer` checks the caller's arguments, makes each message's payload
(:class:`~metaq.producer._message.MessageEncoder`) and hands it to the send
path (:class:`~metaq.producer._path.SendPath`: pick a partition, put the
message on that broker's pipelined connection, retry); batches go through a
:class:`~metaq.producer._batch.BatchSender` on the same path.  It owns the
ZooKeeper client (unless given one), the router that follows the topics
(:class:`~metaq.producer._router.Router`) and the broker connections
(:class:`~metaq.producer._connections.BrokerConnections`), and closes them.

One pipelined connection per broker carries every message for that broker,
many in flight at once.  A blocking :meth:`Producer.send` whose connection has
nothing else in flight does its whole round trip on its own thread, as a plain
client would (:meth:`SendPath.submit_sync`: one write, one blocking read, the
answer parsed in C); otherwise it waits for its future like any send.

A failed attempt (broker gone, connection reset, no
reply within ``request_timeout``, a result code other than 400/401) is
retried on another partition, preferring another broker, up to ``retries``
times within ``send_timeout``; retries triggered by a reply are handed to the
``metaq-producer-retry`` thread so that a broker connection's reader never
blocks.

Per message, ``send_async`` checks and encodes in Python and, with the C module,
on the common path (round-robin, not idempotent, plain :class:`Send` futures, not a
blocking ``send``) makes the future, picks the partition and puts the request on
its connection in one C call (``submit_put``); whatever that call declines (no
partition, a broker avoided, no usable connection, a full window, a busy lock)
goes on in :class:`SendPath` exactly as without it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from concurrent.futures._base import RUNNING
from typing import Any

from kazoo.client import KazooClient
from kazoo.handlers.threading import KazooTimeoutError

from metaq._errors import (
    ConfigError,
    CoordinationError,
    MessageTooLargeError,
    ProducerError,
    SendTimeoutError,
)
from metaq._zkclient import make_client
from metaq.net import READER_PREFIX, PipelinedConnection
from metaq.producer._batch import BatchFuture, BatchSender
from metaq.producer._config import ProducerConfig
from metaq.producer._connections import BrokerConnections
from metaq.producer._message import MessageEncoder
from metaq.producer._path import SendPath
from metaq.producer._router import Router
from metaq.producer._send import Send, SendResult
from metaq.producer._transaction import LocalTransaction, TxSender, XAResource
from metaq.protocol import CHECKSUM_MASK, FLAG_HAS_ATTRIBUTE
from metaq.protocol import bind_send_async as _bind_send_async
from metaq.protocol import crc32 as _crc32  # ISA-L when installed (one selection point)
from metaq.protocol import submit_put as _submit_put
from zk_layout import Layout

__all__ = ["Producer"]

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
        layout = Layout(config.zk_root)
        encoder = MessageEncoder(config.codec, config.max_message_size)
        self._closed = False
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
        self._connections = BrokerConnections(config)
        self._router = Router(self._client, layout, on_change=self._connections.route_changed)
        self._path = SendPath(config, layout, self._router, self._connections)
        self._batches = BatchSender(self._path, encoder, config)
        # Read once per message by send_async (attributes, not calls or attribute chains).
        self._routes = self._router.routes  # topic -> TopicRoute
        self._encode = encoder.encode
        self._raw_bytes = encoder.raw_bytes  # bytes bodies go as they are
        self._max_size = encoder.max_size
        self._with_attribute = encoder.with_attribute
        #: the three above that the C send_async reads, in one lookup (fixed for our life)
        self._c_send = (self._routes, self._raw_bytes, self._max_size)
        #: what transactions borrow: routes, partitioner, payload rules, idle connections
        self._tx = TxSender(self._router, self._path, encoder, config.send_timeout)
        self._timeout = config.send_timeout
        self._future_type: type[Send] = Send
        #: What the C module's ``submit_put`` needs to make a :class:`Send` and put it on its
        #: connection in one call (send_async's common path: round-robin, not idempotent,
        #: plain Send futures); None: the Python path only (no C module, or another case).
        self._fast: tuple | None = None
        if (_submit_put is not None and config.partitioner == "roundrobin"
                and not config.idempotent):
            self._fast = (Send, self._path, self._connections.by_broker,
                          self._connections.faults, PipelinedConnection,
                          float(config.send_timeout), RUNNING)

    @property
    def future_type(self) -> type[Send]:
        """The class of the futures :meth:`send_async` returns: :class:`Send` or a
        subclass taking the same arguments (:mod:`metaq.aio` completes its own into an
        event loop).  Set before the first send."""
        return self._future_type

    @future_type.setter
    def future_type(self, cls: type[Send]) -> None:
        self._future_type = cls
        if cls is not Send:  # the C path makes plain Sends only
            self._fast = None

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
        self._path.close(_monotonic() + (self.config.close_timeout if timeout is None
                                         else timeout))
        self._router.close()
        self._tx.close()
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
        # send_async's checks and payload (a copy: a call less per send), then, when the
        # connection has nothing else in flight, the round trip on this thread
        # (SendPath.submit_sync); else a future, as send_async's.
        if self._closed:
            raise ProducerError("the producer is closed")
        try:
            route = self._routes[topic]
        except (KeyError, TypeError):
            route = self._path.route(topic)
        data = body if type(body) is bytes and self._raw_bytes else self._encode(body)
        if len(data) > self._max_size:
            raise MessageTooLargeError(
                f"message body of {len(data)} bytes is over the limit of {self._max_size} "
                f"bytes (max_message_size); nothing was sent to topic {topic!r}")
        if attribute is None:
            payload, flag = data, 0
        else:
            payload, flag = self._with_attribute(data, attribute), FLAG_HAS_ATTRIBUTE
        path = self._path
        # (a plain Send, whatever future_type is: this future never leaves this call)
        fut = Send(path, topic, payload, flag, _crc32(payload) & CHECKSUM_MASK,
                   _monotonic() + self._timeout)
        fut.flush = True
        r = path.submit_sync(fut, topic, route, data, key)
        if r is not None:
            return r
        path.read_reply(fut)  # on this thread, when it is alone in flight
        # Only this thread knows the future: it waits on a bare lock (no condition).
        if fut.wait_done(max(0.0, fut.deadline - _monotonic()) + 0.05):
            return fut.result()
        raise SendTimeoutError(
            f"no acknowledgement for a message to topic {topic!r} within "
            f"{self._timeout:g}s ({fut.attempts} attempt(s)); it may or may not have "
            f"been stored")

    def send_async(self, topic: str, body: Any, attribute: str | None = None,
                   key: Any = None, _flush: bool = False) -> Future[SendResult]:
        """Queue one message; return a future of its :class:`SendResult`.

        Many messages stay in flight on one connection per broker; this
        blocks only while a broker's in-flight window is full.  Errors about
        the message itself are raised here, before anything is sent; failures
        of the sending are set on the future.

        (``_flush`` is not part of the API: :meth:`send` sets it to write the
        message from its own thread, which waits for the reply anyway.  Both
        share this body so that a message costs no call more than its work;
        it is not keyword-only because on CPython 3.11 that makes every call
        slower.)
        """
        # The hot path: per message, one pass here and SendPath.submit().
        if self._closed:
            raise ProducerError("the producer is closed")
        try:
            route = self._routes[topic]
        except (KeyError, TypeError):  # never read, or not a topic: SendPath.route says which
            route = self._path.route(topic)
        data = body if type(body) is bytes and self._raw_bytes else self._encode(body)
        if len(data) > self._max_size:
            raise MessageTooLargeError(
                f"message body of {len(data)} bytes is over the limit of {self._max_size} "
                f"bytes (max_message_size); nothing was sent to topic {topic!r}")
        if attribute is None:
            payload, flag = data, 0
        else:
            payload, flag = self._with_attribute(data, attribute), FLAG_HAS_ATTRIBUTE
        path = self._path
        fast = self._fast
        if fast is not None and not _flush:
            # The future, the round-robin pick and the put in one C call; what it could not
            # do (no partition or a broker avoided: part None; no usable connection, a full
            # window, a busy lock: attempts 0) goes on as below, from the same point.
            send = _submit_put(fast, topic, route, payload, flag)
            if send is not None:
                if not send.attempts:
                    self._go_on(send, topic, route, data, key)
                return send
        deadline = _monotonic() + self._timeout
        send = self._future_type(path, topic, payload, flag, _crc32(payload) & CHECKSUM_MASK,
                                 deadline)
        send.flush = _flush
        path.submit(send, topic, route, data, key)  # pick, dispatch (waits for a broker)
        return send

    def _go_on(self, send: Send, topic: str, route: Any, data: bytes, key: Any) -> None:
        """A send ``submit_put`` made but could not put (no partition or a broker avoided:
        ``part`` None; no usable connection, a full window, a busy lock): on from there."""
        if send.part is None:
            self._path.submit(send, topic, route, data, key)
        else:
            self._path.dispatch(send, route, send.part)

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
        if self._closed:
            raise ProducerError("the producer is closed")
        return self._batches.submit(topic, bodies, attribute, key)

    def transaction(self, *, timeout: int = 0) -> LocalTransaction:
        """A local transaction: its messages go to one broker and become visible
        together, in order, when it commits (``with producer.transaction() as tx:
        tx.send(...)`` commits at the end of the block, rolls back on an exception).
        ``timeout`` (seconds, 0: none): the broker rolls it back if it is not committed
        by then.  See :mod:`metaq.producer._transaction`."""
        if self._closed:
            raise ProducerError("the producer is closed")
        return LocalTransaction(self._tx, timeout=timeout)

    def xa_resource(self, unique_qualifier: str, *, topic: str | None = None,
                    broker_id: int | None = None) -> XAResource:
        """An XA resource on one broker (the first publishing ``topic``, or
        ``broker_id``) for a transaction manager: start / send / end / prepare /
        commit / rollback / recover / forget, as Java Metaq's XA producer.  The
        ``unique_qualifier`` names this resource's branches (RECOVER lists them)."""
        if self._closed:
            raise ProducerError("the producer is closed")
        return XAResource(self._tx, unique_qualifier, topic=topic, broker_id=broker_id)

    def ready(self, topic: str) -> bool:
        """True when :meth:`send_async` to ``topic`` would neither read ZooKeeper nor
        connect, nor wait for a broker: its route is known and has partitions, and each of
        its brokers has a usable connection or is avoided after a recent failure (while
        one is usable).  Does not look at the in-flight window.  (For :mod:`metaq.aio`,
        which sends from the event loop only what cannot block it.)"""
        route = self._routes.get(topic) if type(topic) is str else None
        if route is None or not route.partitions:
            return False
        conns = self._connections.by_broker
        faults = self._connections.faults
        now = _monotonic() if faults else 0.0
        good = skipped = False
        for bid, addr in route.addresses.items():
            conn = conns.get(bid)
            faulty = bool(faults) and faults.get(bid, 0.0) > now
            if conn is not None and conn.usable and conn.address == addr:
                good = good or not faulty
            elif faulty:  # avoided by the partition pick while another broker is good
                skipped = True
            else:  # a new connection would be made here: it may block
                return False
        return good or not skipped

    def partitions(self, topic: str) -> list[str]:
        """The names of ``topic``'s writable partitions, in Metaq order."""
        route = self._router.get(topic) or self._path.load(topic)
        return [str(p) for p in route.partitions]


#: The Python ``send_async``: the twin of the C method that stands in for it below, and
#: what that one calls for everything but its common case (tests compare the two).
py_send_async = Producer.send_async
if _bind_send_async is not None:
    # producer.send_async(topic, body) in C, with no Python frame: the checks above, the
    # route and submit_put in one call (metaq/protocol/_speedups.c, bind_send_async).
    Producer.send_async = _bind_send_async(  # type: ignore[method-assign]
        Producer, py_send_async,
        "send_async($self, topic, body, attribute=None, key=None, _flush=False)\n--\n\n"
        + (py_send_async.__doc__ or ""))
