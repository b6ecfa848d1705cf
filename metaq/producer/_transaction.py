"""Transactional sends: Metaq's local transactions and XA branches, from a
:class:`~metaq.Producer`.

A **local transaction** (:meth:`Producer.transaction`) sends its messages to one
broker (Metaq's rule: a local transaction is one broker's) and makes them visible
together, in order, when it commits::

    with producer.transaction(timeout=30) as tx:
        tx.send("orders", b"created")
        tx.send("audit", b"order 7 created")
    # committed here; an exception in the block rolls it back instead

The first :meth:`LocalTransaction.send` picks the partition (the producer's
partitioner) and so the broker; later ones are kept on that broker (the
partitioner's choice when it is there, else the topic's partitions on that
broker, round-robin).  Puts are pipelined: :meth:`~LocalTransaction.send` does not
wait; :meth:`~LocalTransaction.commit` reads every put's answer, and if any was
refused rolls the transaction back and raises TransactionError.  Against a broker
that offers ``+txpipe`` (metaq-py's) BEGIN is not waited for either, and COMMIT is
written right after the puts, saying how many there were: the whole transaction is
one round trip, and the broker refuses (rolling back) a commit one of whose puts
it refused.  Against Java Metaq, BEGIN and COMMIT each wait for their answer.

An **XA resource** (:meth:`Producer.xa_resource`) is what a transaction manager
drives for a two-phase commit: ``start(xid)``, :meth:`XAResource.send`,
``end(xid)``, ``prepare(xid)`` (durable on the broker: it survives a crash),
``commit(xid)`` / ``rollback(xid)``, ``recover()`` (the prepared branches of this
resource's unique qualifier, after a crash) and ``forget(xid)``.  The wire
requests are exactly Java Metaq's (:mod:`metaq.protocol._transaction`), so a
branch prepared by Java's ``XAMessageProducer`` can be recovered here and the
other way round, given the same unique qualifier.
"""

from __future__ import annotations

import functools
import itertools
import operator
import os
import re
import socket
import threading
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from metaq._errors import (
    BrokerError,
    BrokerUnavailableError,
    ProducerError,
    TransactionError,
    XAError,
)
from metaq._types import BrokerAddress
from metaq.net import BrokerConnection
from metaq.producer._send import SendResult
from metaq.protocol import (
    CHECKSUM_MASK,
    FLAG_HAS_ATTRIBUTE,
    TXPIPE_CAPABILITY,
    ack_result,
    check_topic,
    crc32,
    local_key,
    parse_transaction_key,
    xa_key,
)
from zk_layout import Partition

if TYPE_CHECKING:
    from metaq.producer._message import MessageEncoder
    from metaq.producer._path import SendPath
    from metaq.producer._router import Router

__all__ = ["LocalTransaction", "XAResource", "Xid", "TxSender"]

_XA_ERROR = re.compile(r"XAException:code=(-?\d+),msg=(.*)", re.S)
_sessions = itertools.count(1)
_opaque_of = operator.itemgetter(0)
_part_of = operator.itemgetter(1)


@functools.lru_cache(maxsize=4)
def _session_prefix(pid: int) -> str:
    host = re.sub(r"[^A-Za-z0-9.-]", "-", socket.gethostname())[:40] or "host"
    return f"{host}-{pid}-"


def new_session_id() -> str:
    """A session id unique to this process's transactions (no ':' nor spaces)."""
    return f"{_session_prefix(os.getpid())}{next(_sessions)}"


class Xid(NamedTuple):
    """An XA transaction branch id (``javax.transaction.xa.Xid``)."""

    format_id: int
    gtrid: bytes
    bqual: bytes


def _failure(e: BrokerError, what: str) -> TransactionError:
    m = _XA_ERROR.match(e.detail)
    if m is not None:
        return XAError(f"{what}: {m.group(2)} (XAException code {m.group(1)})",
                       code=int(m.group(1)))
    return TransactionError(f"{what}: {e}")


#: idle connections kept per broker address for a producer's next transactions
_IDLE_MAX = 4
#: payload bytes of a run of puts kept before they are encoded and queued
_RUN_MAX = 256 * 1024


@dataclass
class TxSender:
    """What a producer lends its transactions: its routes and partitioner (``router``,
    ``path``), its payload rules (``encoder``), and the connections of finished
    transactions kept for the next ones (``idle``, per broker address, under ``lock``)."""

    router: Router
    path: SendPath
    encoder: MessageEncoder
    send_timeout: float
    idle: dict[BrokerAddress, list[BrokerConnection]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    closed: bool = False
    #: per connection: whether its broker offers ``+txpipe`` (asked once per connection)
    pipelines: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)

    def pipelined(self, conn: BrokerConnection) -> bool:
        """Whether ``conn``'s broker takes pipelined local transactions (``+txpipe``)."""
        known = self.pipelines.get(conn)
        if known is None:
            try:
                known = TXPIPE_CAPABILITY in conn.version().split()
            except BrokerError:  # a broker that does not answer ``version`` offers nothing
                known = False
            self.pipelines[conn] = known
        return known

    def close(self) -> None:
        """The producer closes: no connection is kept any more."""
        with self.lock:
            self.closed = True
            for conns in self.idle.values():
                for conn in conns:
                    conn.close()
            self.idle.clear()



class _OnOneBroker:
    """Sends of one transaction to one broker over a connection of its own."""

    def __init__(self, sender: TxSender) -> None:
        self._sender = sender
        self._broker: int | None = None
        self._conn: BrokerConnection | None = None
        self._pending: list[tuple[int, Partition]] = []   # (opaque, partition)
        #: the puts not encoded yet, of one partition, flag and key: ``[topic, partition,
        #: flag, key, payloads]`` (encoded together by :meth:`_flush_run`)
        self._run: list[Any] | None = None
        self._run_size = 0
        self._results: list[SendResult] = []
        self._rr = itertools.count()
        self._lock = threading.Lock()

    def _connect(self, broker_id: int, address: BrokerAddress) -> BrokerConnection:
        if self._conn is None:
            conn = self._pooled(address)
            self._conn = conn or BrokerConnection(*address, timeout=self._sender.send_timeout)
            self._broker = broker_id
        return self._conn

    def _pooled(self, address: BrokerAddress) -> BrokerConnection | None:
        """An idle connection to ``address`` kept by an earlier transaction, skipping
        (and closing) those the broker closed meanwhile (it restarted); None: none."""
        while True:
            with self._sender.lock:
                idle = self._sender.idle.get(address)
                conn = idle.pop() if idle else None
            if conn is None or conn.idle_and_open():
                return conn

    def _partition(self, topic: str, data: bytes, key: Any,
                   partition: str | None) -> tuple[Partition, BrokerAddress]:
        path = self._sender.path
        route = self._sender.router.get(topic) or path.load(topic)
        if partition is not None:
            part = Partition.parse(partition)
            if part not in route.positions:
                raise TransactionError(f"topic {topic!r} has no writable partition "
                                       f"{partition!r}")
            if self._broker is not None and part.broker_id != self._broker:
                raise TransactionError(f"partition {part} is on broker {part.broker_id}; "
                                       f"this transaction's messages go to broker "
                                       f"{self._broker}")
        else:  # kept on this transaction's broker
            part = path.pick(topic, route, data, key)
            if part is None or (self._broker is not None and part.broker_id != self._broker):
                part = self._kept(topic, route, part)
        return part, route.addresses[part.broker_id]

    def _kept(self, topic: str, route: Any, part: Partition | None) -> Partition:
        """The partitioner's ``part`` is None or on another broker than this
        transaction's: one of the topic's partitions on this broker (round-robin)."""
        if part is None:
            raise TransactionError(f"no broker publishes topic {topic!r}")
        mine = [p for p in route.partitions if p.broker_id == self._broker]
        if not mine:
            raise TransactionError(
                f"topic {topic!r} has no partition on broker {self._broker}, where "
                f"this transaction's messages go (a transaction is one broker's)")
        return mine[next(self._rr) % len(mine)]

    def _put(self, tx_key_of: Any, topic: str, body: Any, attribute: str | None, key: Any,
             partition: str | None) -> None:
        """Queue one put; ``tx_key_of``: the transaction key (a str) or what gives it
        once the connection is known (called with it)."""
        enc = self._sender.encoder
        data = body if type(body) is bytes and enc.raw_bytes else enc.encode(body)
        size = len(data)
        if size > enc.max_size:
            raise TransactionError(f"message body of {size} bytes is over "
                                   f"max_message_size={enc.max_size}")
        if attribute is None:
            payload, flag = data, 0
        else:
            payload, flag = enc.with_attribute(data, attribute), FLAG_HAS_ATTRIBUTE
            size = len(payload)
        with self._lock:
            conn = self._conn
            if conn is not None and partition is None:  # _partition's usual case, inline
                s = self._sender
                route = s.router.get(topic) or s.path.load(topic)
                part = s.path.pick(topic, route, data, key)
                if part is None or part.broker_id != self._broker:
                    part = self._kept(topic, route, part)
                route.addresses[part.broker_id]  # noqa: B018 (checked, as _partition does)
            else:
                part, address = self._partition(topic, data, key, partition)
                if conn is None:  # _partition keeps every put on this connection's broker
                    conn = self._connect(part.broker_id, address)
            tx_key = tx_key_of if type(tx_key_of) is str else tx_key_of(conn)
            run = self._run
            if (run is not None and run[1] is part and run[2] == flag and run[3] == tx_key
                    and run[0] == topic):
                run[4].append(payload)
            else:  # a new run: its topic checked now, as encoding it would
                check_topic(topic)
                self._flush_run()
                self._run = [topic, part, flag, tx_key, [payload]]
            self._run_size += size
            if self._run_size >= _RUN_MAX:
                self._flush_run()

    def _flush_run(self) -> None:
        """The puts not encoded yet, encoded together and queued on the connection (sent
        with the next request that is not held)."""
        run, self._run = self._run, None
        self._run_size = 0
        if run is not None:
            topic, part, flag, tx_key, payloads = run
            assert self._conn is not None
            opaques = self._conn.send_tx_puts(
                topic, part.index, payloads, flag,
                list(map(CHECKSUM_MASK.__and__, map(crc32, payloads))), tx_key, hold=True)
            self._pending += zip(opaques, itertools.repeat(part))

    def _collect(self) -> list[BaseException]:
        """Read every pending put's answer; the failures."""
        try:
            self._flush_run()
        except BrokerUnavailableError as e:  # none of the answers can be read
            self._pending = []
            return [e]
        errors: list[BaseException] = []
        pending, self._pending = self._pending, []
        if not pending:
            return errors
        opaques = list(map(_opaque_of, pending))
        part = pending[0][1]
        try:
            results = None
            if list(map(_part_of, pending)).count(part) == len(pending):  # the usual
                # every answer an acknowledgement: the SendResults made in C, in bulk
                results = self._conn.read_tx_acks(opaques, SendResult, part.broker_id,
                                                  part.index, str(part))
            bodies = self._conn.read_results(opaques) if results is None else None
        except BrokerUnavailableError as e:  # the answers cannot be read: none is known
            return [e] * len(pending)
        if results is not None:
            self._results += results
            return errors
        append = self._results.append
        last: Partition | None = None
        names: dict[int, str] = {}
        for (_opaque, part), body in zip(pending, bodies, strict=True):
            try:
                if type(body) is not bytes:
                    raise body
                msg_id, index, offset = body.split()
                if part is not last:  # the name once per run of puts to one partition
                    last, names = part, {part.index: str(part)}
                try:  # the answer's partition is the put's: the SendResult made in C
                    append(ack_result(SendResult, msg_id, index, offset, part.broker_id,
                                      names))
                except KeyError:
                    append(SendResult(int(msg_id), str(part), int(offset), part.broker_id,
                                      part.index))
            except (BrokerError, ValueError) as e:
                errors.append(e)
        return errors

    def _close(self, reuse: bool = False) -> None:
        """Done with the connection: kept for the producer's next transaction to that
        broker when ``reuse`` (every answer read), else closed."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        s = self._sender
        with s.lock:
            idle = s.idle.setdefault(conn.address, [])
            if (reuse and not self._pending and self._run is None and len(idle) < _IDLE_MAX
                    and not s.closed):
                idle.append(conn)
                return
        conn.close()


class LocalTransaction(_OnOneBroker):
    """A local transaction (see the module docstring); use it with ``with``."""

    def __init__(self, sender: TxSender, *, timeout: int = 0) -> None:
        super().__init__(sender)
        if isinstance(timeout, bool) or not isinstance(timeout, int) or timeout < 0:
            raise TransactionError(f"timeout must be an int >= 0 (seconds), got {timeout!r}")
        self.timeout = timeout
        self.session_id = new_session_id()
        self.key = local_key(self.session_id, 1)
        self._state = "new"
        #: pipelined (``+txpipe``): BEGIN's opaque, its answer not read yet; else None
        self._begun: int | None = None
        self._pipelined = False

    def _begin(self, conn: BrokerConnection) -> str:
        if self._state == "new":
            if self._sender.pipelined(conn):  # BEGIN goes with the puts, not waited for
                self._begun = conn.send_transaction(self.key, self.session_id, "BEGIN",
                                                    timeout=self.timeout, hold=True)
                self._pipelined = True
                self._state = "open"
                return self.key
            try:
                conn.transaction(self.key, self.session_id, "BEGIN", timeout=self.timeout)
            except BrokerError as e:
                raise _failure(e, f"begin of {self.key}") from None
            self._state = "open"
        return self.key

    def _collect(self) -> list[BaseException]:
        """Read BEGIN's answer (pipelined) and every pending put's; the failures."""
        errors: list[BaseException] = []
        if self._begun is not None:
            opaque, self._begun = self._begun, None
            assert self._conn is not None
            try:
                self._conn.read_result(opaque)
            except BrokerError as e:
                errors.append(_failure(e, f"begin of {self.key}"))
            except BrokerUnavailableError as e:
                errors.append(e)
        return errors + super()._collect()

    def _commit_pipelined(self, conn: BrokerConnection) -> list[SendResult]:
        """COMMIT written right after the puts (``puts=<n>``: the broker commits only
        what holds every one of them), then every answer read: one round trip."""
        try:
            self._flush_run()
        except BrokerUnavailableError as e:  # the COMMIT was not sent: the broker rolls
            self._state = "failed"            # back a transaction whose connection closes
            raise TransactionError(f"{self.key} was not committed: the connection failed "
                                   f"before its COMMIT was sent ({e})") from e
        n = len(self._pending)
        try:
            opaque = conn.send_transaction(self.key, self.session_id, "COMMIT_ONE_PHASE",
                                           puts=n)
        except BrokerUnavailableError as e:
            # not sent whole, maybe not at all: the broker rolls back a transaction whose
            # connection closes, and a commit cut short is not one (its line is unfinished)
            self._state = "unknown"
            raise TransactionError(f"commit of {self.key}: the connection failed ({e}); "
                                   f"the outcome is unknown") from e
        errors = self._collect()
        try:
            conn.read_result(opaque)
        except BrokerError as e:
            self._state = "failed"
            if errors:
                raise TransactionError(f"{self.key} was rolled back: {len(errors)} of its "
                                       f"requests were refused, first: {errors[0]}"
                                       ) from None
            raise _failure(e, f"commit of {self.key}") from None
        except BrokerUnavailableError as e:
            self._state = "unknown"
            raise TransactionError(f"commit of {self.key}: the connection failed ({e}); "
                                   f"the outcome is unknown") from e
        if errors:  # refused puts, yet committed: never by a +txpipe broker
            self._state = "unknown"
            raise TransactionError(f"commit of {self.key}: the broker committed although "
                                   f"{len(errors)} message(s) were refused ({errors[0]})")
        self._state = "committed"
        return list(self._results)

    def send(self, topic: str, body: Any, attribute: str | None = None, key: Any = None, *,
             partition: str | None = None) -> None:
        """Queue a message in the transaction (not visible until :meth:`commit`)."""
        if self._state not in ("new", "open"):
            raise TransactionError(f"transaction {self.key} is {self._state}")
        self._put(self.key if self._state == "open" else self._begin, topic, body, attribute,
                  key, partition)

    def commit(self) -> list[SendResult]:
        """Make every message visible, together; their SendResults (offset -1: the
        broker places them at the commit).  Raises TransactionError (rolled back)."""
        if self._state == "new":
            self._state = "committed"
            return []
        if self._state != "open":
            raise TransactionError(f"transaction {self.key} is {self._state}")
        conn = self._conn
        assert conn is not None
        try:
            if self._pipelined:
                return self._commit_pipelined(conn)
            errors = self._collect()
            if errors:
                self.rollback()
                raise TransactionError(f"{len(errors)} message(s) of {self.key} were refused "
                                       f"({errors[0]}); the transaction was rolled back")
            try:
                conn.transaction(self.key, self.session_id, "COMMIT_ONE_PHASE")
            except BrokerError as e:
                self._state = "failed"
                raise _failure(e, f"commit of {self.key}") from None
            except BrokerUnavailableError as e:
                self._state = "unknown"
                raise TransactionError(f"commit of {self.key}: the connection failed ({e}); "
                                       f"the outcome is unknown") from e
            self._state = "committed"
            return list(self._results)
        finally:
            if self._state != "open":
                self._close(reuse=self._state == "committed")

    def rollback(self) -> None:
        """Drop every message of the transaction."""
        if self._state == "new":
            self._state = "rolled back"
            return
        if self._state != "open":
            return
        self._state = "rolled back"
        reuse = False
        try:
            if self._conn is not None:
                self._collect()
                self._conn.transaction(self.key, self.session_id, "ROLLBACK")
                reuse = True
        except (BrokerError, BrokerUnavailableError):
            pass  # the broker rolls back a transaction whose connection closes
        finally:
            self._close(reuse=reuse)

    def __enter__(self) -> LocalTransaction:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.rollback()


class XAResource(_OnOneBroker):
    """An XA resource of one broker (see the module docstring)."""

    def __init__(self, sender: TxSender, unique_qualifier: str, *,
                 broker_id: int | None = None, topic: str | None = None) -> None:
        super().__init__(sender)
        if not unique_qualifier or not re.fullmatch(r"[^:\s]+", unique_qualifier):
            raise ProducerError(f"unique_qualifier must be a non-empty name without ':' or "
                                f"spaces, got {unique_qualifier!r}")
        self.unique_qualifier = unique_qualifier
        self.session_id = new_session_id()
        self.timeout = 0
        self._xid: Xid | None = None
        if broker_id is None:
            if topic is None:
                raise ProducerError("xa_resource needs a topic (to pick its broker) or a "
                                    "broker_id")
            route = sender.router.get(topic) or sender.path.load(topic)
            if not route.partitions:
                raise ProducerError(f"no broker publishes topic {topic!r}")
            broker_id = route.partitions[0].broker_id
            address = route.addresses[broker_id]
        else:
            address = sender.router.address(broker_id)
            if address is None:
                raise ProducerError(f"broker {broker_id} is not registered")
        self._connect(broker_id, address)

    def key(self, xid: Xid) -> str:
        return xa_key(xid.format_id, xid.gtrid, xid.bqual, self.unique_qualifier)

    def _request(self, xid: Xid | None, type: str, **kw: Any) -> bytes | None:
        key = "null" if xid is None else self.key(xid)
        try:
            return self._conn.transaction(key, self.session_id, type,
                                          unique_qualifier=self.unique_qualifier, **kw)
        except BrokerError as e:
            raise _failure(e, f"{type} of {key}") from None

    def set_transaction_timeout(self, seconds: int) -> None:
        self.timeout = seconds

    def start(self, xid: Xid) -> None:
        self._request(xid, "BEGIN", timeout=self.timeout)
        self._xid = xid

    def send(self, topic: str, body: Any, attribute: str | None = None, key: Any = None, *,
             partition: str | None = None) -> None:
        """Queue a message in the started branch."""
        if self._xid is None:
            raise TransactionError("send outside a started XA branch (call start(xid))")
        self._put(self.key(self._xid), topic, body, attribute, key, partition)

    def end(self, xid: Xid) -> None:
        errors = self._collect()
        self._request(xid, "END")
        self._xid = None
        if errors:
            raise XAError(f"{len(errors)} message(s) of {self.key(xid)} were refused "
                          f"({errors[0]})", code=100)

    def prepare(self, xid: Xid) -> int:
        """0 (XA_OK) or 3 (XA_RDONLY: nothing to commit, already finished)."""
        return int(self._request(xid, "PREPARE") or b"0")

    def commit(self, xid: Xid, one_phase: bool = False) -> None:
        self._request(xid, "COMMIT_ONE_PHASE" if one_phase else "COMMIT_TWO_PHASE")

    def rollback(self, xid: Xid) -> None:
        self._request(xid, "ROLLBACK")

    def forget(self, xid: Xid) -> None:
        self._request(xid, "FORGET")

    def recover(self) -> list[Xid]:
        """The prepared branches of this unique qualifier on this broker."""
        body = self._request(None, "RECOVER") or b""
        out = []
        for line in body.decode().split("\r\n"):
            if line:
                k = parse_transaction_key(line)
                out.append(Xid(k.format_id, k.gtrid, k.bqual))
        return out

    def close(self) -> None:
        self._close()

    def __enter__(self) -> XAResource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
